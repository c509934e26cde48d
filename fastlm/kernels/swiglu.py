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

Options (gpt-oss's experts; the defaults alpha = 1, limit = None, up_offset = 0 are SwiGLU), the
kernels' SILU_OPTIONS:

    g = min(gate, limit),  u = clamp(up, -limit, limit) + up_offset,  s = sigmoid(alpha * g)
    y = g * s * u
    d gate = dy * u * s * (1 + alpha * g * (1 - s)) * [gate <= limit]
    d up   = dy * g * s * [-limit <= up <= limit]

The brackets are torch.clamp's gradient (1 inside the bounds, ends included; 0 for a NaN input);
without a limit nothing is clamped. gpt-oss: alpha 1.702, limit 7, up_offset 1, its fused
projection interleaving gate and up columns (`swiglu_packed(..., interleaved=True)`): the kernels
(INTERLEAVED) read each row's pairs in one contiguous load and split them, and write the
gradient's pairs back joined.
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
from fastlm.options import check

# --------------------------------------------------------------------------------------------
# Reference math (the PyTorch backend, and what the tests and benchmarks compare with)
# --------------------------------------------------------------------------------------------


def swiglu_ref(
    gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.0, limit: float | None = None,
    up_offset: float = 0.0
) -> torch.Tensor:
    """silu(gate) * up in PyTorch, fp32 inside (fp64 for fp64), the result in gate's dtype; with
    the options g sigmoid(alpha g) (clamp(up, +-limit) + up_offset), g = min(gate, limit)."""
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    gate_c, up_c = gate.to(compute), up.to(compute)
    if limit is not None:
        gate_c, up_c = gate_c.clamp(max=limit), up_c.clamp(-limit, limit)
    if up_offset != 0.0:
        up_c = up_c + up_offset
    return (gate_c * torch.sigmoid(alpha * gate_c) * up_c).to(gate.dtype)


def split_gate_up(gate_up: torch.Tensor, interleaved: bool = False):
    """(gate, up) views of a fused projection's (..., 2 * d_ff) output: its two halves, or with
    `interleaved` its even and odd columns (gpt-oss)."""
    if interleaved:
        return gate_up[..., 0::2], gate_up[..., 1::2]
    return gate_up.chunk(2, dim=-1)


def swiglu_packed_ref(gate_up: torch.Tensor, interleaved: bool = False, **options) -> torch.Tensor:
    """swiglu_ref of gate_up's gate and up (`split_gate_up`), with `swiglu_ref`'s options."""
    return swiglu_ref(*split_gate_up(gate_up, interleaved), **options)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

#: The ACTIVATION constant of the kernels.
SILU, GELU_TANH, GELU, SILU_OPTIONS = 0, 1, 2, 3


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
def _options_terms(gate, up, alpha, limit, up_offset, CLAMP: tl.constexpr):
    """(g, u, sigmoid(alpha g)) of SILU_OPTIONS: g = min(gate, limit), u = clamp(up, +-limit) +
    up_offset under CLAMP. The comparisons keep a NaN input NaN, as torch.clamp does."""
    if CLAMP:
        gate = tl.where(gate > limit, limit, gate)
        up = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up))
    return gate, up + up_offset, tl.sigmoid(alpha * gate)


@triton.jit
def gated_unit(gate, up, alpha, limit, up_offset, ACTIVATION: tl.constexpr, CLAMP: tl.constexpr):
    """act(gate) * up in fp32 for fp32 tiles gate and up: the ACTIVATION constant's unit (also
    the epilogue of `fastlm.kernels.moe`'s first grouped GEMM)."""
    if ACTIVATION == 0:
        y = gate * tl.sigmoid(gate) * up
    elif ACTIVATION == 3:
        g, u, sig = _options_terms(gate, up, alpha, limit, up_offset, CLAMP)
        y = g * sig * u
    else:
        y = _gelu_and_slope(gate, ACTIVATION == 1)[0] * up
    return y


@triton.jit
def gated_unit_grad(
    dy, gate, up, alpha, limit, up_offset, ACTIVATION: tl.constexpr, CLAMP: tl.constexpr
):
    """(d gate, d up) of `gated_unit` for the fp32 tiles dy, gate and up."""
    if ACTIVATION == 0:
        sig = tl.sigmoid(gate)
        d_gate = dy * up * sig * (1.0 + gate * (1.0 - sig))
        d_up = dy * gate * sig
    elif ACTIVATION == 3:
        g, u, sig = _options_terms(gate, up, alpha, limit, up_offset, CLAMP)
        d_gate = dy * u * sig * (1.0 + alpha * g * (1.0 - sig))
        d_up = dy * g * sig
        if CLAMP:  # torch.clamp's gradient: 1 inside the bounds, ends included; 0 for NaN
            d_gate = tl.where(gate <= limit, d_gate, 0.0)
            d_up = tl.where((up >= -limit) & (up <= limit), d_up, 0.0)
    else:
        gelu, slope = _gelu_and_slope(gate, ACTIVATION == 1)
        d_gate = dy * up * slope
        d_up = dy * gelu
    return d_gate, d_up


@triton.jit
def _load_gate_up(
    G, U, rows, start, M, N, stride_gm, stride_um,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERLEAVED: tl.constexpr
):
    """The fp32 (gate, up) tiles of columns [start, start + BLOCK_N): from G and U, or with
    INTERLEAVED from G alone, an interleaved gate_up (gate of column c at 2c, up at 2c + 1) read
    in one contiguous load, vectorised as a load with a column stride of 2 is not (2 bytes at a
    time), then split; Triton moves the halves to the output's layout through shared memory (the
    compile report: 4 KB and 3 barriers at bf16)."""
    if INTERLEAVED:
        pair_cols = 2 * start + tl.arange(0, 2 * BLOCK_N)
        mask = (rows < M)[:, None] & (pair_cols < 2 * N)[None, :]
        pairs = tl.load(G + rows[:, None] * stride_gm + pair_cols[None, :], mask=mask, other=0.0)
        gate, up = tl.split(tl.reshape(pairs.to(tl.float32), [BLOCK_M, BLOCK_N, 2]))
    else:
        cols = start + tl.arange(0, BLOCK_N)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        gate = tl.load(G + rows[:, None] * stride_gm + cols[None, :], mask=mask, other=0.0)
        up = tl.load(U + rows[:, None] * stride_um + cols[None, :], mask=mask, other=0.0)
        gate, up = gate.to(tl.float32), up.to(tl.float32)
    return gate, up


@triton.jit
def _store_pairs(
    X, gate, up, rows, start, M, N, stride_m,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BF16_BY_HAND: tl.constexpr
):
    """The inverse of `_load_gate_up`'s INTERLEAVED load: the tiles joined and stored
    interleaved at once."""
    pair_cols = 2 * start + tl.arange(0, 2 * BLOCK_N)
    mask = (rows < M)[:, None] & (pair_cols < 2 * N)[None, :]
    pairs = tl.reshape(tl.join(gate, up), [BLOCK_M, 2 * BLOCK_N])
    tl.store(
        X + rows[:, None] * stride_m + pair_cols[None, :],
        round_to(pairs, X.dtype.element_ty, BF16_BY_HAND), mask=mask
    )


@triton.jit
def _swiglu_fwd_kernel(
    G, U, Y,  #
    stride_gm, stride_um, stride_ym,  #
    M, N, alpha, limit, up_offset,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BF16_BY_HAND: tl.constexpr,  #
    ACTIVATION: tl.constexpr = 0, CLAMP: tl.constexpr = False, INTERLEAVED: tl.constexpr = False
):
    """Y = act(gate) * up; INTERLEAVED: G is gate_up with gate and up in alternate columns (U
    unused)."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    start = tl.program_id(1) * BLOCK_N
    cols = start + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    gate, up = _load_gate_up(
        G, U, rows, start, M, N, stride_gm, stride_um, BLOCK_M, BLOCK_N, INTERLEAVED
    )
    y = gated_unit(gate, up, alpha, limit, up_offset, ACTIVATION, CLAMP)
    tl.store(
        Y + rows[:, None] * stride_ym + cols[None, :],
        round_to(y, Y.dtype.element_ty, BF16_BY_HAND), mask=mask
    )


@triton.jit
def _swiglu_bwd_kernel(
    DY, G, U, DG, DU,  #
    stride_dym, stride_gm, stride_um, stride_dgm,  #
    stride_dum,  #
    M, N, alpha, limit, up_offset,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BF16_BY_HAND: tl.constexpr,  #
    ACTIVATION: tl.constexpr = 0, CLAMP: tl.constexpr = False, INTERLEAVED: tl.constexpr = False
):
    """(d gate, d up); INTERLEAVED: G and DG are gate_up and its gradient, gate and up in
    alternate columns (U and DU unused)."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    start = tl.program_id(1) * BLOCK_N
    cols = start + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    dy = tl.load(DY + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0)
    dy = dy.to(tl.float32)
    gate, up = _load_gate_up(
        G, U, rows, start, M, N, stride_gm, stride_um, BLOCK_M, BLOCK_N, INTERLEAVED
    )
    d_gate, d_up = gated_unit_grad(dy, gate, up, alpha, limit, up_offset, ACTIVATION, CLAMP)
    if INTERLEAVED:
        _store_pairs(
            DG, d_gate, d_up, rows, start, M, N, stride_dgm, BLOCK_M, BLOCK_N, BF16_BY_HAND
        )
    else:
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


def _option_args(activation: int, alpha: float, limit: float | None, up_offset: float) -> dict:
    """The kernels' option arguments: CLAMP when a limit is set (SILU_OPTIONS only)."""
    clamp = activation == SILU_OPTIONS and limit is not None
    return dict(
        alpha=float(alpha), limit=float(limit) if clamp else 0.0, up_offset=float(up_offset),
        ACTIVATION=activation, CLAMP=clamp
    )


def _forward_rows(
    gate: torch.Tensor, up: torch.Tensor | None, y: torch.Tensor, activation: int = SILU,
    alpha: float = 1.0, limit: float | None = None, up_offset: float = 0.0
) -> None:
    """y = act(gate) * up on (M, N) rows; up None: gate is an interleaved (M, 2 N) gate_up."""
    M, N = y.shape
    if y.numel() == 0:
        return
    grid, config = _launch_config(M, N)
    interleaved = up is None
    up = gate if interleaved else up
    _swiglu_fwd_kernel[grid](
        gate, up, y, gate.stride(0), up.stride(0), y.stride(0), M, N,
        BF16_BY_HAND=interpreter_bf16(y.dtype), INTERLEAVED=interleaved,
        **_option_args(activation, alpha, limit, up_offset), **config
    )


def _backward_rows(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor | None, d_gate: torch.Tensor,
    d_up: torch.Tensor | None, activation: int = SILU, alpha: float = 1.0,
    limit: float | None = None, up_offset: float = 0.0
) -> None:
    """(d gate, d up) on (M, N) rows; up and d_up None: gate and d_gate are interleaved (M, 2 N)
    gate_up and its gradient."""
    M, N = dy.shape
    if dy.numel() == 0:
        return
    grid, config = _launch_config(M, N)
    interleaved = up is None
    up, d_up = (gate, d_gate) if interleaved else (up, d_up)
    _swiglu_bwd_kernel[grid](
        dy, gate, up, d_gate, d_up, dy.stride(0), gate.stride(0), up.stride(0), d_gate.stride(0),
        d_up.stride(0), M, N, BF16_BY_HAND=interpreter_bf16(d_gate.dtype), INTERLEAVED=interleaved,
        **_option_args(activation, alpha, limit, up_offset), **config
    )


# --------------------------------------------------------------------------------------------
# Registration: torch.ops.fastlm.swiglu, .swiglu_packed and their backward
# --------------------------------------------------------------------------------------------


def gated_forward(
    gate: torch.Tensor, up: torch.Tensor, activation: int = SILU, **options
) -> torch.Tensor:  # fmt: skip
    """act(gate) * up into a new tensor of gate's shape (the ops' body; `options`: alpha,
    limit, up_offset of SILU_OPTIONS)."""
    y = empty(gate.shape, device=gate.device, dtype=gate.dtype)
    _forward_rows(as_rows(gate), as_rows(up), y.view(-1, y.shape[-1]), activation, **options)
    return y


def gated_backward(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: int = SILU, **options
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) into new tensors of the inputs' shapes (the backward ops' body)."""
    d_gate = empty(gate.shape, device=gate.device, dtype=gate.dtype)
    d_up = empty(up.shape, device=up.device, dtype=up.dtype)
    _backward_rows(
        as_rows(dy), as_rows(gate), as_rows(up), d_gate.view(-1, d_gate.shape[-1]),
        d_up.view(-1, d_up.shape[-1]), activation, **options
    )
    return d_gate, d_up


def packed_forward(
    gate_up: torch.Tensor, interleaved: bool = False, activation: int = SILU, **options
) -> torch.Tensor:  # fmt: skip
    """act(gate) * up of a fused (..., 2 * d_ff) projection (`split_gate_up`'s layouts) into a
    new (..., d_ff) tensor."""
    d_ff = gate_up.shape[-1] // 2
    y = empty((*gate_up.shape[:-1], d_ff), device=gate_up.device, dtype=gate_up.dtype)
    rows = as_rows(gate_up)  # (M, 2 d_ff)
    gate, up = (rows, None) if interleaved else split_gate_up(rows)
    _forward_rows(gate, up, y.view(-1, d_ff), activation, **options)
    return y


def packed_backward(
    dy: torch.Tensor, gate_up: torch.Tensor, interleaved: bool = False, activation: int = SILU,
    **options
) -> torch.Tensor:  # fmt: skip
    """d(gate_up) as one (..., 2 * d_ff) tensor in gate_up's layout: the fused projection's
    output gradient."""
    d_gate_up = empty(gate_up.shape, device=gate_up.device, dtype=gate_up.dtype)
    rows, d_rows = as_rows(gate_up), d_gate_up.view(-1, gate_up.shape[-1])
    if interleaved:
        gate, up, d_gate, d_up = rows, None, d_rows, None
    else:
        (gate, up), (d_gate, d_up) = split_gate_up(rows), split_gate_up(d_rows)
    _backward_rows(as_rows(dy), gate, up, d_gate, d_up, activation, **options)
    return d_gate_up


def _checked_options(alpha: float, limit: float | None, up_offset: float) -> dict:
    """The options' values by `fastlm.options.check` (the public functions and the ops)."""
    return dict(
        alpha=check("alpha", alpha), limit=check("limit", limit, none_ok=True),
        up_offset=check("up_offset", up_offset)
    )


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
    return packed_forward(gate_up)


@_swiglu_packed_op.register_fake
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("fastlm::swiglu_packed_backward", mutates_args=())
def _swiglu_packed_backward_op(dy: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    return packed_backward(dy, gate_up)


@_swiglu_packed_backward_op.register_fake
def _(dy, gate_up):
    return gate_up.new_empty(gate_up.shape)


@torch.library.custom_op("fastlm::swiglu_options", mutates_args=())
def _swiglu_options_op(
    gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float | None, up_offset: float
) -> torch.Tensor:  # fmt: skip
    return gated_forward(gate, up, SILU_OPTIONS, **_checked_options(alpha, limit, up_offset))


@_swiglu_options_op.register_fake
def _(gate, up, alpha, limit, up_offset):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("fastlm::swiglu_options_backward", mutates_args=())
def _swiglu_options_backward_op(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float | None,
    up_offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    options = _checked_options(alpha, limit, up_offset)
    return gated_backward(dy, gate, up, SILU_OPTIONS, **options)


@_swiglu_options_backward_op.register_fake
def _(dy, gate, up, alpha, limit, up_offset):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


@torch.library.custom_op("fastlm::swiglu_packed_options", mutates_args=())
def _swiglu_packed_options_op(
    gate_up: torch.Tensor, interleaved: bool, alpha: float, limit: float | None, up_offset: float
) -> torch.Tensor:  # fmt: skip
    options = _checked_options(alpha, limit, up_offset)
    return packed_forward(gate_up, interleaved, SILU_OPTIONS, **options)


@_swiglu_packed_options_op.register_fake
def _(gate_up, interleaved, alpha, limit, up_offset):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("fastlm::swiglu_packed_options_backward", mutates_args=())
def _swiglu_packed_options_backward_op(
    dy: torch.Tensor, gate_up: torch.Tensor, interleaved: bool, alpha: float, limit: float | None,
    up_offset: float
) -> torch.Tensor:
    options = _checked_options(alpha, limit, up_offset)
    return packed_backward(dy, gate_up, interleaved, SILU_OPTIONS, **options)


@_swiglu_packed_options_backward_op.register_fake
def _(dy, gate_up, interleaved, alpha, limit, up_offset):
    return gate_up.new_empty(gate_up.shape)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_grad(ctx, dy):
    return _swiglu_backward_op(dy, *ctx.saved_tensors)


def _swiglu_packed_grad(ctx, dy):
    return _swiglu_packed_backward_op(dy, *ctx.saved_tensors)


def _save_tensors_and_options(ctx, inputs, output):
    """The tensors saved for the backward; the other arguments (layout, options) kept as is."""
    ctx.save_for_backward(*(x for x in inputs if isinstance(x, torch.Tensor)))
    ctx.rest = tuple(x for x in inputs if not isinstance(x, torch.Tensor))


def _swiglu_options_grad(ctx, dy):
    return *_swiglu_options_backward_op(dy, *ctx.saved_tensors, *ctx.rest), None, None, None


def _swiglu_packed_options_grad(ctx, dy):
    d_gate_up = _swiglu_packed_options_backward_op(dy, *ctx.saved_tensors, *ctx.rest)
    return d_gate_up, None, None, None, None


torch.library.register_autograd("fastlm::swiglu", _swiglu_grad, setup_context=_save_inputs)
torch.library.register_autograd(
    "fastlm::swiglu_packed", _swiglu_packed_grad, setup_context=_save_inputs
)
torch.library.register_autograd(
    "fastlm::swiglu_options", _swiglu_options_grad, setup_context=_save_tensors_and_options
)
torch.library.register_autograd(
    "fastlm::swiglu_packed_options", _swiglu_packed_options_grad,
    setup_context=_save_tensors_and_options
)
for _op_name in ("swiglu", "swiglu_packed", "swiglu_options", "swiglu_packed_options"):
    refuse_double_backward(f"fastlm::{_op_name}_backward", _op_name)

# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def _is_plain(options: dict) -> bool:
    """Whether checked options are SwiGLU's own (the plain ops, whose kernels are unchanged)."""
    return options == dict(alpha=1.0, limit=None, up_offset=0.0)


def swiglu(
    gate: torch.Tensor, up: torch.Tensor, *, alpha: float = 1.0, limit: float | None = None,
    up_offset: float = 0.0
) -> torch.Tensor:
    """silu(gate) * up for tensors of one shape (any leading dims, any row strides).

    silu(g) = g * sigmoid(g). The math is float32; the backward recomputes sigmoid(gate) rather than
    storing it. The options give gpt-oss's clamped SwiGLU (alpha=1.702, limit=7.0, up_offset=1.0):
    g * sigmoid(alpha * g) * (clamp(up, -limit, limit) + up_offset) with g = min(gate, limit),
    and torch.clamp's gradient (module docstring).

    Args:
        gate: (..., d_ff) float32, float16 or bfloat16, the gate projection's output (W1 x); the
            last dim non-empty.
        up: the up projection's output (W3 x), gate's shape, dtype and device.
        alpha: the sigmoid's slope; 1 is SiLU.
        limit: None (no clamp), or gate clamped above and up on both sides at it.
        up_offset: added to the (clamped) up.

    Returns:
        The gated unit, gate's shape, in the inputs' dtype.

    Raises:
        TypeError: gate or up not a tensor of float32, float16 or bfloat16, or of two dtypes; an
            option that is not a real number (`fastlm.options`).
        ValueError: gate and up of two shapes or on two devices, an empty last dim, or an option
            outside its range (docs/options.md).
    """
    options = _checked_options(alpha, limit, up_offset)
    check_float("gate", gate)
    check_float("up", up)
    check_match("up", up, "gate", gate)
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    if gate.dim() == 0 or gate.shape[-1] == 0:
        raise ValueError(f"gate must have a non-empty last dim, got {tuple(gate.shape)}")
    if not use_triton(gate):
        return swiglu_ref(gate, up, **options)
    if _is_plain(options):
        return _swiglu_op(gate, up)
    return _swiglu_options_op(gate, up, **options)


def swiglu_packed(
    gate_up: torch.Tensor, *, interleaved: bool = False, alpha: float = 1.0,
    limit: float | None = None, up_offset: float = 0.0
) -> torch.Tensor:
    """silu(gate) * up where gate_up holds gate in its first half and up in its second, or with
    `interleaved` gate in its even columns and up in its odd ones (gpt-oss's experts).

    For a fused W1|W3 projection: its output goes in whole, and its gradient comes back as one
    (..., 2 * d_ff) tensor in the same layout. Math, options and backward as `swiglu`'s.

    Args:
        gate_up: (..., 2 * d_ff) float32, float16 or bfloat16; any row strides.
        interleaved: gate = gate_up[..., 0::2], up = gate_up[..., 1::2] (else the two halves).
        alpha, limit, up_offset: as `swiglu`'s.

    Returns:
        (..., d_ff) in gate_up's dtype.

    Raises:
        TypeError: gate_up not a tensor of float32, float16 or bfloat16; interleaved not a bool;
            an option that is not a real number.
        ValueError: a last dim that is empty or odd, or an option outside its range.
    """
    options = _checked_options(alpha, limit, up_offset)
    check_float("gate_up", gate_up)
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")
    if gate_up.dim() == 0 or gate_up.shape[-1] == 0 or gate_up.shape[-1] % 2:
        layout = "gate, up, gate, up, ..." if interleaved else "gate | up"
        raise ValueError(
            f"gate_up must have an even, non-empty last dim ({layout}), got {tuple(gate_up.shape)}"
        )
    if not use_triton(gate_up):
        return swiglu_packed_ref(gate_up, interleaved, **options)
    if _is_plain(options) and not interleaved:
        return _swiglu_packed_op(gate_up)
    return _swiglu_packed_options_op(gate_up, interleaved, **options)
