"""SwiGLU activation: y = silu(gate) * up, with silu(g) = g * sigmoid(g).

Backward, with s = sigmoid(gate):

    d gate = dy * up * s * (1 + gate * (1 - s))
    d up   = dy * gate * s

s is recomputed in the backward instead of stored: one exp per element costs less than writing
and reading back a tensor the size of gate. Math in float32; outputs in the input dtype.

Two forms share the same two kernels (they take row strides, so halves of one buffer are just
pointers with a stride): `swiglu(gate, up)`, and `swiglu_packed(gate_up)` for a fused W1|W3
projection whose output holds gate in its first half and up in its second, and whose gradient is
written as one [..., 2 * d_ff] tensor.

The kernels are those of any gated linear unit act(gate) * up: the ACTIVATION constant picks the
activation (SILU here; GELU_TANH and GELU for `fastlm.kernels.geglu`, whose math is there), and
SILU's code is the same as without the choice.
"""

from __future__ import annotations

import torch

from fastlm.backend import interpreting, use_triton
from fastlm.kernels._common import (
    as_rows,
    check_float,
    check_match,
    empty,
    interpreter_bf16,
    refuse_double_backward,
    round_to,
    tl,
    triton,
)

# --------------------------------------------------------------------------------------------
# Reference math (the PyTorch backend, and what the tests and benchmarks compare with)
# --------------------------------------------------------------------------------------------


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in PyTorch, fp32 inside (fp64 for fp64), the result in gate's dtype."""
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    gate_c = gate.to(compute)
    return (gate_c * torch.sigmoid(gate_c) * up.to(compute)).to(gate.dtype)


def swiglu_packed_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """swiglu_ref of the two halves of gate_up (..., 2 * d_ff)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return swiglu_ref(gate, up)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

#: The ACTIVATION constant of the kernels.
SILU, GELU_TANH, GELU = 0, 1, 2


@triton.jit
def _gelu_and_slope(g, TANH: tl.constexpr):
    """(gelu(g), gelu'(g)) in fp32 (see `fastlm.kernels.geglu`). Constants: 2 sqrt(2 / pi),
    sqrt(2 / pi), 1 / sqrt(2), 1 / sqrt(2 pi)."""
    if TANH:
        # 0.5 * (1 + tanh(u)) = sigmoid(2u), and 1 - tanh(u)^2 = 4 sigmoid(2u) sigmoid(-2u): no
        # 1 + t cancelling where tanh(u) is near -1. 2u is kept within +-80, where sigmoid is 0
        # or 1 to fp32 already, so that its exp never overflows.
        two_u = 1.5957691216057308 * (g + 0.044715 * g * g * g)
        s = tl.sigmoid(tl.minimum(tl.maximum(two_u, -80.0), 80.0))
        gelu = g * s
        slope = s + 2.0 * g * s * (1.0 - s) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        gelu = g * cdf
        slope = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    return gelu, slope


@triton.jit
def _swiglu_fwd_kernel(
    G, U, Y,  #
    stride_gm, stride_um, stride_ym,  #
    M, N,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BF16_BY_HAND: tl.constexpr,  #
    ACTIVATION: tl.constexpr = 0
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    gate = tl.load(G + rows[:, None] * stride_gm + cols[None, :], mask=mask, other=0.0)
    up = tl.load(U + rows[:, None] * stride_um + cols[None, :], mask=mask, other=0.0)
    gate, up = gate.to(tl.float32), up.to(tl.float32)
    if ACTIVATION == 0:
        y = gate * tl.sigmoid(gate) * up
    else:
        y = _gelu_and_slope(gate, ACTIVATION == 1)[0] * up
    tl.store(
        Y + rows[:, None] * stride_ym + cols[None, :],
        round_to(y, Y.dtype.element_ty, BF16_BY_HAND), mask=mask
    )


@triton.jit
def _swiglu_bwd_kernel(
    DY, G, U, DG, DU,  #
    stride_dym, stride_gm, stride_um, stride_dgm,  #
    stride_dum,  #
    M, N,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BF16_BY_HAND: tl.constexpr,  #
    ACTIVATION: tl.constexpr = 0
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    dy = tl.load(DY + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0)
    gate = tl.load(G + rows[:, None] * stride_gm + cols[None, :], mask=mask, other=0.0)
    up = tl.load(U + rows[:, None] * stride_um + cols[None, :], mask=mask, other=0.0)
    dy, gate, up = dy.to(tl.float32), gate.to(tl.float32), up.to(tl.float32)
    if ACTIVATION == 0:
        sig = tl.sigmoid(gate)
        d_gate = dy * up * sig * (1.0 + gate * (1.0 - sig))
        d_up = dy * gate * sig
    else:
        gelu, slope = _gelu_and_slope(gate, ACTIVATION == 1)
        d_gate = dy * up * slope
        d_up = dy * gelu
    tl.store(
        DG + rows[:, None] * stride_dgm + cols[None, :],
        round_to(d_gate, DG.dtype.element_ty, BF16_BY_HAND), mask=mask
    )
    tl.store(
        DU + rows[:, None] * stride_dum + cols[None, :],
        round_to(d_up, DU.dtype.element_ty, BF16_BY_HAND), mask=mask
    )


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
# Every tensor is (M, N) rows with a unit column stride; rows may be strided.


def _launch_config(M: int, N: int) -> tuple[tuple[int, int], dict]:
    """Grid and tile: a (BLOCK_M x BLOCK_N) tile, several rows per program when N is small."""
    # The interpreter pays per program, so it gets big tiles; a GPU gets 4096-element tiles, 32
    # elements (16-byte vectors) per thread at 4 warps.
    tile = 16384 if interpreting() else 4096
    block_n = min(triton.next_power_of_2(N), tile)
    block_m = max(1, tile // block_n)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    return grid, {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 1 if interpreting() else 4}


def _forward_rows(
    gate: torch.Tensor, up: torch.Tensor, y: torch.Tensor, activation: int = SILU
) -> None:
    M, N = gate.shape
    if gate.numel() == 0:
        return
    grid, config = _launch_config(M, N)
    _swiglu_fwd_kernel[grid](
        gate, up, y, gate.stride(0), up.stride(0), y.stride(0), M, N,
        BF16_BY_HAND=interpreter_bf16(y.dtype), ACTIVATION=activation, **config
    )


def _backward_rows(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, d_gate: torch.Tensor,
    d_up: torch.Tensor, activation: int = SILU
) -> None:
    M, N = gate.shape
    if gate.numel() == 0:
        return
    grid, config = _launch_config(M, N)
    _swiglu_bwd_kernel[grid](
        dy, gate, up, d_gate, d_up, dy.stride(0), gate.stride(0), up.stride(0), d_gate.stride(0),
        d_up.stride(0), M, N, BF16_BY_HAND=interpreter_bf16(d_gate.dtype), ACTIVATION=activation,
        **config
    )


# --------------------------------------------------------------------------------------------
# Registration: torch.ops.fastlm.swiglu, .swiglu_packed and their backward
# --------------------------------------------------------------------------------------------


def gated_forward(gate: torch.Tensor, up: torch.Tensor, activation: int = SILU) -> torch.Tensor:
    """act(gate) * up into a new tensor of gate's shape (the ops' body)."""
    y = empty(gate.shape, device=gate.device, dtype=gate.dtype)
    _forward_rows(as_rows(gate), as_rows(up), y.view(-1, y.shape[-1]), activation)
    return y


def gated_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                   activation: int = SILU) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) into new tensors of the inputs' shapes (the backward ops' body)."""
    d_gate = empty(gate.shape, device=gate.device, dtype=gate.dtype)
    d_up = empty(up.shape, device=up.device, dtype=up.dtype)
    _backward_rows(
        as_rows(dy), as_rows(gate), as_rows(up), d_gate.view(-1, d_gate.shape[-1]),
        d_up.view(-1, d_up.shape[-1]), activation
    )
    return d_gate, d_up


@torch.library.custom_op("fastlm::swiglu", mutates_args=())
def _swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return gated_forward(gate, up)


@_swiglu_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("fastlm::swiglu_backward", mutates_args=())
def _swiglu_backward_op(dy: torch.Tensor, gate: torch.Tensor,
                        up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return gated_backward(dy, gate, up)


@_swiglu_backward_op.register_fake
def _(dy, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


@torch.library.custom_op("fastlm::swiglu_packed", mutates_args=())
def _swiglu_packed_op(gate_up: torch.Tensor) -> torch.Tensor:
    d_ff = gate_up.shape[-1] // 2
    rows = as_rows(gate_up)  # (M, 2 d_ff)
    y = empty((*gate_up.shape[:-1], d_ff), device=gate_up.device, dtype=gate_up.dtype)
    _forward_rows(rows[:, :d_ff], rows[:, d_ff:], y.view(-1, d_ff))
    return y


@_swiglu_packed_op.register_fake
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("fastlm::swiglu_packed_backward", mutates_args=())
def _swiglu_packed_backward_op(dy: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """d(gate | up) as one (..., 2 * d_ff) tensor: the fused projection's output gradient."""
    d_ff = gate_up.shape[-1] // 2
    rows = as_rows(gate_up)
    d_gate_up = empty(gate_up.shape, device=gate_up.device, dtype=gate_up.dtype)
    d_rows = d_gate_up.view(-1, 2 * d_ff)
    _backward_rows(as_rows(dy), rows[:, :d_ff], rows[:, d_ff:], d_rows[:, :d_ff], d_rows[:, d_ff:])
    return d_gate_up


@_swiglu_packed_backward_op.register_fake
def _(dy, gate_up):
    return gate_up.new_empty(gate_up.shape)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_grad(ctx, dy):
    return _swiglu_backward_op(dy, *ctx.saved_tensors)


def _swiglu_packed_grad(ctx, dy):
    return _swiglu_packed_backward_op(dy, *ctx.saved_tensors)


torch.library.register_autograd("fastlm::swiglu", _swiglu_grad, setup_context=_save_inputs)
torch.library.register_autograd(
    "fastlm::swiglu_packed", _swiglu_packed_grad, setup_context=_save_inputs
)
refuse_double_backward("fastlm::swiglu_backward", "swiglu")
refuse_double_backward("fastlm::swiglu_packed_backward", "swiglu_packed")

# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for tensors of one shape (any leading dims, any row strides).

    silu(g) = g * sigmoid(g). The math is float32; the backward recomputes sigmoid(gate) rather than
    storing it.

    Args:
        gate: (..., d_ff) float32, float16 or bfloat16, the gate projection's output (W1 x); the
            last dim non-empty.
        up: the up projection's output (W3 x), gate's shape, dtype and device.

    Returns:
        silu(gate) * up, gate's shape, in the inputs' dtype.

    Raises:
        TypeError: gate or up not a tensor of float32, float16 or bfloat16, or of two dtypes.
        ValueError: gate and up of two shapes or on two devices, or an empty last dim.
    """
    check_float("gate", gate)
    check_float("up", up)
    check_match("up", up, "gate", gate)
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    if gate.dim() == 0 or gate.shape[-1] == 0:
        raise ValueError(f"gate must have a non-empty last dim, got {tuple(gate.shape)}")
    if not use_triton(gate):
        return swiglu_ref(gate, up)
    return _swiglu_op(gate, up)


def swiglu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up where gate_up holds gate in its first half and up in its second.

    For a fused W1|W3 projection: its output goes in whole, and its gradient comes back as one
    (..., 2 * d_ff) tensor. Math and backward as `swiglu`'s.

    Args:
        gate_up: (..., 2 * d_ff) float32, float16 or bfloat16: gate = gate_up[..., :d_ff],
            up = gate_up[..., d_ff:]; any row strides.

    Returns:
        (..., d_ff) in gate_up's dtype.

    Raises:
        TypeError: gate_up not a tensor of float32, float16 or bfloat16.
        ValueError: a last dim that is empty or odd.
    """
    check_float("gate_up", gate_up)
    if gate_up.dim() == 0 or gate_up.shape[-1] == 0 or gate_up.shape[-1] % 2:
        raise ValueError(
            f"gate_up must have an even, non-empty last dim (gate | up), got {tuple(gate_up.shape)}"
        )
    if not use_triton(gate_up):
        return swiglu_packed_ref(gate_up)
    return _swiglu_packed_op(gate_up)
