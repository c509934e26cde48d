"""RMSNorm over the last dim, alone or fused with the residual add before it.

Forward, per row x of length N (math in fp32, output in x's dtype, as `reference.RmsNorm`):

    rstd  = 1 / sqrt(mean(x^2) + eps)
    x_hat = x * rstd
    y     = x_hat * (g + offset)

Backward, given dy (per row) and with g_dy = (g + offset) * dy:

    dx = rstd * (g_dy - x_hat * mean(g_dy * x_hat))
    dg = sum over rows of dy * x_hat

`offset` is 0 for LLaMA-style norms and 1 for Gemma's, whose weight is stored as a deviation from
one (`x_hat * (1 + w)`, computed in fp32 and rounded once to x's dtype: Gemma's casting order).
It is a compile-time constant of the kernels, so the plain norm's code does not change.

`add_rms_norm(x, residual, g)` first forms the residual stream s = x + residual (rounded to the
dtype PyTorch's `x + residual` promotes to) and returns (rms_norm(s), s). Its backward takes the
gradients of both outputs: ds = d_summed + dx_of_the_norm(d_normed), and dx = dresidual = ds, each
written in its input's dtype.

Mixed precision: under autocast a sub-layer's output x is bf16 while the residual stream stays
fp32, as in the reference. The kernels take that pair as it is, keep the sum in fp32, and write
the normed output in `out_dtype` (the dtype the next GEMM reads), so no cast runs around them; in
the backward dx leaves in bf16 and dresidual in fp32 from the same registers.

Kernel layout:
- Forward: one program per tile of BLOCK_M rows x BLOCK_N = next_power_of_2(N) columns, so each
  row is read once and written once; small hidden sizes get several rows per tile. rstd (fp32, one
  per row) is saved for the backward.
- Backward: a grid sized to the GPU; each program walks tiles pid, pid + G, pid + 2G, ..., writes
  dx, and accumulates its rows' dg in fp32 registers, stored as one row of a (G, N) fp32 buffer
  that a single `.sum(0)` reduces. No atomics: for a given device and shape the result is bitwise
  reproducible.

Weight dtype: either x's dtype or float32 (fp32 master weights with half-precision activations). The
weight's gradient comes back in the weight's dtype. Hidden sizes up to 65536.
"""

from __future__ import annotations

import torch

from fastlm.backend import interpreting, use_triton
from fastlm.kernels._common import (
    FLOAT_DTYPES,
    as_rows,
    check_float,
    check_match,
    device_sms,
    empty,
    refuse_double_backward,
    round_to,
    tl,
    triton,
)
from fastlm.options import check

#: The largest hidden size the kernels take: a row lives in one block of registers.
MAX_HIDDEN = 65536

# --------------------------------------------------------------------------------------------
# Reference math (the PyTorch backend, and what the tests and benchmarks compare with)
# --------------------------------------------------------------------------------------------


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, out_dtype: torch.dtype | None = None,
    offset: float = 0.0
) -> torch.Tensor:
    """RMSNorm in PyTorch: fp32 inside (fp64 for fp64 input), scaled by weight + offset, the
    result in out_dtype (default: x's dtype)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x.to(compute)
    scale = weight.to(compute) + offset if offset else weight
    y = xc * torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + eps) * scale
    return y.to(out_dtype or x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
    out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm_ref(x + residual), x + residual) in PyTorch."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps, out_dtype), summed


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_fwd(
    X, R, S, Y, W, Rstd,  #
    stride_xm, stride_rm, stride_sm, stride_ym,  #
    M, N,  #
    eps,  #
    HAS_RESIDUAL: tl.constexpr, BF16_BY_HAND: tl.constexpr, BLOCK_M: tl.constexpr,  #
    BLOCK_N: tl.constexpr, OFFSET: tl.constexpr = 0.0
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols < N)[None, :]
    row_start = rows.to(tl.int64)[:, None]  # (BLOCK_M, 1), int64: rows * stride may pass 2^31

    x = tl.load(X + row_start * stride_xm + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row_start * stride_rm + cols[None, :], mask=mask, other=0.0)
        # Round the sum to the input dtype before normalising: the stream the model carries on is
        # the rounded one, and the norm must see the same values the next block adds to.
        x = round_to(x.to(tl.float32) + r.to(tl.float32), S.dtype.element_ty, BF16_BY_HAND)
        tl.store(S + row_start * stride_sm + cols[None, :], x, mask=mask)
    x = x.to(tl.float32)

    # Masked columns load as 0, so they add nothing to the sum of squares.
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)  # (BLOCK_M,)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    if OFFSET != 0.0:
        w += OFFSET
    # Same order as the reference: (x * rstd) * g, all in fp32.
    y = (x * rstd[:, None]) * w[None, :]
    y = round_to(y, Y.dtype.element_ty, BF16_BY_HAND)
    tl.store(Y + row_start * stride_ym + cols[None, :], y, mask=mask)
    tl.store(Rstd + rows, rstd, mask=row_mask)


@triton.jit
def _rms_norm_bwd(
    DY, DS, X, W, Rstd, DX, DX2, DW_partial,  #
    stride_dym, stride_dsm, stride_xm, stride_dxm,  #
    stride_dx2m,  #
    M, N,  #
    HAS_DRESIDUAL: tl.constexpr, TWO_OUTPUTS: tl.constexpr, BF16_BY_HAND: tl.constexpr,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, OFFSET: tl.constexpr = 0.0
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    if OFFSET != 0.0:  # masked columns get it too, but their dy and x_hat are 0
        w += OFFSET
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    num_tiles = tl.cdiv(M, BLOCK_M)
    # Three stages: the next two tiles' loads are in flight (cp.async) while this one is reduced
    # (two stages spill 8 bytes on sm_80 with the residual's gradient; three do not).
    for tile in tl.range(pid, num_tiles, num_programs, num_stages=3):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        row_start = rows.to(tl.int64)[:, None]  # (BLOCK_M, 1)

        x = tl.load(X + row_start * stride_xm + cols[None, :], mask=mask, other=0.0)
        dy = tl.load(DY + row_start * stride_dym + cols[None, :], mask=mask, other=0.0)
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)  # (BLOCK_M,)
        x_hat = x.to(tl.float32) * rstd[:, None]
        dy = dy.to(tl.float32)
        g_dy = dy * w[None, :]

        # Masked entries are zero in x_hat and g_dy, so neither the row mean nor dg sees them.
        c = tl.sum(x_hat * g_dy, axis=1) / N
        dx = (g_dy - x_hat * c[:, None]) * rstd[:, None]
        if HAS_DRESIDUAL:
            # The residual stream's own gradient joins here, so dx and dresidual leave in one store.
            ds = tl.load(DS + row_start * stride_dsm + cols[None, :], mask=mask, other=0.0)
            dx += ds.to(tl.float32)
        tl.store(
            DX + row_start * stride_dxm + cols[None, :],
            round_to(dx, DX.dtype.element_ty, BF16_BY_HAND), mask=mask
        )
        if TWO_OUTPUTS:  # the same gradient in a second dtype (a bf16 delta beside an fp32 stream)
            tl.store(
                DX2 + row_start * stride_dx2m + cols[None, :],
                round_to(dx, DX2.dtype.element_ty, BF16_BY_HAND), mask=mask
            )
        dw_acc += dy * x_hat

    tl.store(DW_partial + pid.to(tl.int64) * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _tile(n: int, rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a hidden size `n` and `rows` rows.

    A whole row is one block. Small rows are stacked into tiles of about 4096 elements, so a
    program has enough work to hide memory latency. Warps grow with the tile to keep about 8
    elements per thread (one 16-byte vector of bf16 per tensor), up to 32 warps at 64K: at 16
    elements per thread ptxas fits the bf16 forward into 32 registers for sm_80 by spilling
    (benchmarks/compile_report.py).
    """
    block_n = triton.next_power_of_2(n)
    block_m = min(max(4096 // block_n, 1), 64, triton.next_power_of_2(rows))
    elements = block_m * block_n
    num_warps = 32 if elements >= 32768 else min(max(elements // 256, 4), 16)
    return block_m, block_n, num_warps


def _backward_programs(x: torch.Tensor, num_tiles: int, num_warps: int) -> int:
    """Grid of the backward: enough programs to fill the GPU, each owning one dg partial row.

    On CUDA, up to 16 warps' worth of programs per SM (4 programs of 4 warps, 1 of 16 or more), so
    that all of them can be resident at once and none waits for a second wave (a first guess, to be
    tuned by measurement); in the interpreter one per pretend SM, so that programs loop over several
    tiles in the tests.
    """
    per_sm = 1 if interpreting() else max(1, 16 // num_warps)
    return max(1, min(num_tiles, device_sms(x) * per_sm))


def _rms_norm_forward(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    out_dtype: torch.dtype, shape: tuple[int, ...] | None = None, *, offset: float = 0.0
):
    """Launch the forward on (rows, N) views. Returns (y in out_dtype, summed in the promoted
    dtype of x and residual or None, rstd), allocated in `shape` (rows' by default; rstd in
    shape[:-1]), so that an op returns them as tensors of their own, not views. The weight
    scales by weight + offset."""
    # Every forward launch passes here: the ops called directly obey the public functions' rule.
    check("eps", eps)
    check("offset", offset)
    weight = weight.contiguous()  # the kernels read it with a unit stride
    M, N = x.shape
    shape = shape or (M, N)
    y_out = empty(shape, device=x.device, dtype=out_dtype)
    summed_out = (
        empty(shape, device=x.device, dtype=torch.promote_types(x.dtype, residual.dtype))
        if residual is not None else None
    )
    rstd_out = empty(shape[:-1], device=x.device, dtype=torch.float32)
    y, rstd = y_out.view(M, N), rstd_out.view(M)
    summed = summed_out.view(M, N) if summed_out is not None else None
    if M == 0:
        return y_out, summed_out, rstd_out
    block_m, block_n, num_warps = _tile(N, M)
    # Unused pointer arguments get y, which the kernel never reads through them.
    r = residual if residual is not None else y
    s = summed if summed is not None else y
    _rms_norm_fwd[(triton.cdiv(M, block_m), )](
        x, r, s, y, weight, rstd, x.stride(0), r.stride(0), s.stride(0), y.stride(0), M, N, eps,
        HAS_RESIDUAL=residual is not None, BF16_BY_HAND=interpreting(), BLOCK_M=block_m,
        BLOCK_N=block_n, OFFSET=float(offset), num_warps=num_warps
    )
    return y_out, summed_out, rstd_out


def _rms_norm_backward(
    dy: torch.Tensor, d_summed: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor,
    rstd: torch.Tensor, dx_dtype: torch.dtype, dx2_dtype: torch.dtype | None = None,
    shape: tuple[int, ...] | None = None, *, offset: float = 0.0
):
    """Launch the backward on (rows, N) views. Returns (dx, dx2 or None, dweight): dx (already
    holding d_summed) in dx_dtype and, if dx2_dtype is given, the same gradient in that dtype,
    allocated in `shape` (rows' by default); the forward scaled by weight + offset."""
    check("offset", offset)
    M, N = x.shape
    weight = weight.contiguous()
    shape = shape or (M, N)
    dx_out = empty(shape, device=x.device, dtype=dx_dtype)
    dx2_out = empty(shape, device=x.device, dtype=dx2_dtype) if dx2_dtype is not None else None
    dx = dx_out.view(M, N)
    dx2 = dx2_out.view(M, N) if dx2_out is not None else None
    if M == 0:
        return dx_out, dx2_out, torch.zeros_like(weight)
    block_m, block_n, num_warps = _tile(N, M)
    num_programs = _backward_programs(x, triton.cdiv(M, block_m), num_warps)
    dw_partial = empty((num_programs, N), device=x.device, dtype=torch.float32)
    ds = d_summed if d_summed is not None else dy
    second = dx2 if dx2 is not None else dx  # never written through without TWO_OUTPUTS
    _rms_norm_bwd[(num_programs, )](
        dy, ds, x, weight, rstd, dx, second, dw_partial, dy.stride(0), ds.stride(0), x.stride(0),
        dx.stride(0), second.stride(0), M, N, HAS_DRESIDUAL=d_summed is not None, TWO_OUTPUTS=dx2
        is not None, BF16_BY_HAND=interpreting(), BLOCK_M=block_m, BLOCK_N=block_n,
        OFFSET=float(offset), num_warps=num_warps
    )
    return dx_out, dx2_out, dw_partial.sum(0).to(weight.dtype)


# --------------------------------------------------------------------------------------------
# Registration: torch.ops.fastlm.rms_norm, .add_rms_norm and their backward
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("fastlm::rms_norm", mutates_args=())
def _rms_norm_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): y of x's shape in out_dtype, rstd (x.shape[:-1]) fp32 for the backward."""
    rows = as_rows(x)
    y, _, rstd = _rms_norm_forward(rows, None, weight, eps, out_dtype, x.shape, offset=offset)
    return y, rstd


@_rms_norm_op.register_fake
def _(x, weight, eps, out_dtype, offset=0.0):
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("fastlm::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normed in out_dtype, summed in x's and residual's promoted dtype, rstd)."""
    return _rms_norm_forward(as_rows(x), as_rows(residual), weight, eps, out_dtype, x.shape)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, out_dtype):
    summed_dtype = torch.promote_types(x.dtype, residual.dtype)
    return (
        x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape, dtype=summed_dtype),
        x.new_empty(x.shape[:-1], dtype=torch.float32)
    )


@torch.library.custom_op("fastlm::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(
    dy: torch.Tensor, d_summed: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor,
    rstd: torch.Tensor, dx_dtype: torch.dtype, dx2_dtype: torch.dtype | None, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx in dx_dtype, the same in dx2_dtype or an empty tensor, dweight); dx already holds
    d_summed, the residual stream's own gradient, if given."""
    d_summed_rows = as_rows(d_summed) if d_summed is not None else None
    dx, dx2, dweight = _rms_norm_backward(
        as_rows(dy), d_summed_rows, as_rows(x), weight,
        rstd.reshape(-1).contiguous(),  # the kernel reads one float per row, unit stride
        dx_dtype, dx2_dtype, x.shape, offset=offset
    )
    return dx, dx2 if dx2 is not None else x.new_empty(0), dweight


@_rms_norm_backward_op.register_fake
def _(dy, d_summed, x, weight, rstd, dx_dtype, dx2_dtype, offset=0.0):
    dx2 = x.new_empty(x.shape if dx2_dtype is not None else 0, dtype=dx2_dtype or x.dtype)
    return x.new_empty(x.shape, dtype=dx_dtype), dx2, weight.new_empty(weight.shape)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _, _, offset = inputs
    ctx.offset = offset
    ctx.save_for_backward(x, weight, output[1])
    ctx.set_materialize_grads(False)  # rstd has no gradient: no zero tensor for it
    ctx.mark_non_differentiable(output[1])


def _rms_norm_grad(ctx, dy, _):
    x, weight, rstd = ctx.saved_tensors
    dx, _, dweight = _rms_norm_backward_op(dy, None, x, weight, rstd, x.dtype, None, ctx.offset)
    return dx, dweight, None, None, None


def _add_rms_norm_setup(ctx, inputs, output):
    x, residual, weight, _, _ = inputs
    _, summed, rstd = output
    # A missing output gradient stays None instead of becoming a tensor of zeros to read.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(summed, weight, rstd)
    ctx.mark_non_differentiable(rstd)
    ctx.dtypes = (x.dtype, residual.dtype)


def _add_rms_norm_grad(ctx, d_normed, d_summed, _):
    summed, weight, rstd = ctx.saved_tensors
    x_dtype, residual_dtype = ctx.dtypes
    if d_normed is None:
        ds = d_summed if d_summed is not None else torch.zeros_like(summed)
        return ds.to(x_dtype), ds.to(residual_dtype), torch.zeros_like(weight), None, None
    # x and residual enter only through their sum, so both receive its gradient, each in its
    # own dtype: one tensor when the dtypes agree, two stores of the same registers otherwise.
    second = residual_dtype if residual_dtype != x_dtype else None
    dx, dx2, dweight = _rms_norm_backward_op(
        d_normed, d_summed, summed, weight, rstd, x_dtype, second
    )
    return dx, dx2 if second is not None else dx, dweight, None, None


torch.library.register_autograd("fastlm::rms_norm", _rms_norm_grad, setup_context=_rms_norm_setup)
torch.library.register_autograd(
    "fastlm::add_rms_norm", _add_rms_norm_grad, setup_context=_add_rms_norm_setup
)
refuse_double_backward("fastlm::rms_norm_backward", "rms_norm")

# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def _check_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_float("x", x)
    check_float("weight", weight)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(
            f"x must have a non-empty last dim to normalise, got shape {tuple(x.shape)}"
        )
    if weight.shape != (x.shape[-1], ):
        raise ValueError(
            f"weight must have shape ({x.shape[-1]},) to match x's last dim, "
            f"got {tuple(weight.shape)}"
        )
    if weight.dtype != torch.float32:
        check_match("weight", weight, "x", x)
    elif weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, but x is on {x.device}")


def _check_residual(residual: torch.Tensor, x: torch.Tensor) -> None:
    check_float("residual", residual)
    if residual.shape != x.shape:
        raise ValueError(
            f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
        )
    if residual.device != x.device:
        raise ValueError(f"residual is on {residual.device}, but x is on {x.device}")


def _out_dtype(out_dtype: object, default: torch.dtype) -> torch.dtype:
    if out_dtype is None:
        return default
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be None or one of {FLOAT_DTYPES}, got {out_dtype!r}")
    return out_dtype


def _kernels_take(x: torch.Tensor) -> bool:
    """The backend rule, plus the kernels' one limit: a row fits in one block."""
    if not use_triton(x):
        return False
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(
            f"x has hidden size {x.shape[-1]}; the Triton kernels take at most "
            f"{MAX_HIDDEN} (FASTLM_BACKEND=torch runs any size)"
        )
    return True


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *,
    out_dtype: torch.dtype | None = None, offset: float = 0.0
) -> torch.Tensor:
    """RMSNorm of x over its last dim, scaled by `weight + offset`, as `reference.RmsNorm`.

    Args:
        x: (..., N) float32/float16/bfloat16, any leading shape; rows may be strided (a slice of
            a wider tensor) as long as the last dim is contiguous, otherwise x is copied once.
        weight: (N,), of x's dtype or float32.
        eps: added to the mean square before the reciprocal square root (default 1e-5).
        out_dtype: the result's dtype (default: x's), rounded once from fp32:
            `rms_norm(x, w).to(bf16)` in one pass.
        offset: added to the weight in fp32 inside the kernel (default 0.0): 1.0 is Gemma's
            RMSNorm (`x_hat * (1 + w)` in fp32, then one rounding). The weight's gradient is
            unchanged.

    Returns:
        A tensor of x's shape in out_dtype.

    Raises:
        TypeError: x or weight not a tensor of float32, float16 or bfloat16, a weight whose dtype
            is neither x's nor float32, an out_dtype that is not one of those three, or an eps or
            offset that is not a real number.
        ValueError: an empty last dim, a weight not (N,) or on another device than x; eps
            outside (0, 3.4e38] or offset outside [-1e6, 1e6] (`fastlm.options`); with the Triton
            kernels, N above 65536 (`MAX_HIDDEN`; FASTLM_BACKEND=torch runs any size).
    """
    _check_args(x, weight)
    out_dtype = _out_dtype(out_dtype, x.dtype)
    eps, offset = check("eps", eps), check("offset", offset)
    if not _kernels_take(x):
        return rms_norm_ref(x, weight, eps, out_dtype, offset)
    return _rms_norm_op(x, weight, eps, out_dtype, offset)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *,
    out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual, weight), x + residual) in one pass: a block's residual add fused
    with the next norm.

    The sum is rounded to the dtype PyTorch's `x + residual` gives (the wider of the two: a bf16
    sub-layer output x added to an fp32 residual stream stays fp32), exactly as that expression,
    and the norm sees the rounded sum. Gradients of both outputs flow back, each input's in its own
    dtype: the summed output carries the residual stream on.

    Args:
        x: (..., N) float32/float16/bfloat16, a sub-layer's output; strided rows as in `rms_norm`.
        residual: the residual stream, x's shape and device; float32/float16/bfloat16, its dtype
            may differ from x's.
        weight: (N,), of x's dtype or float32, as in `rms_norm`.
        eps: added to the mean square before the reciprocal square root (default 1e-5).
        out_dtype: normed's dtype (default: the sum's dtype), rounded once from fp32.

    Returns:
        (normed, summed), both of x's shape: normed = rms_norm(summed, weight, eps) in out_dtype,
        summed = x + residual in the promoted dtype.

    Raises:
        TypeError: an input that is not a tensor of float32, float16 or bfloat16, a weight whose
            dtype is neither x's nor float32, or an out_dtype that is not one of those three.
        ValueError: an empty last dim, a weight not (N,), a residual of another shape, an input
            on another device than x, or eps as in `rms_norm`; with the Triton kernels, N above
            65536 (`MAX_HIDDEN`; FASTLM_BACKEND=torch runs any size).
    """
    _check_args(x, weight)
    _check_residual(residual, x)
    out_dtype = _out_dtype(out_dtype, torch.promote_types(x.dtype, residual.dtype))
    eps = check("eps", eps)
    if not _kernels_take(x):
        return add_rms_norm_ref(x, residual, weight, eps, out_dtype)
    normed, summed, _ = _add_rms_norm_op(x, residual, weight, eps, out_dtype)
    return normed, summed
