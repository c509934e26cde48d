"""Linear layers with fp32 master weights and half-precision GEMMs, without the casts around them.

With W fp32 (what the optimizer updates) and W_h = half(W) (what the GEMMs read):

    y  = x_h W_h^T                        x_h = half(x)
    dx = dy W_h                           (half GEMM, fp32 accumulation inside, rounded once)
    dW = dy^T x_h, accumulated in fp32 and returned fp32

which is autocast's math. Autocast runs it with one cast kernel per weight on the way in and
one per weight gradient on the way out (the GEMM writes dW in bf16, a cast brings it to the fp32
parameter). Here:

- `cast_weights` casts the weights a layer uses together, by one multi-tensor copy
  (`torch._foreach_copy_`, one kernel on CUDA) into one buffer, group by group: the weights of a
  group are stacked by rows, so two GEMMs that read the same input (W1 and W3) become one GEMM on
  the stacked matrix, and that GEMM's input gradient is their sum without an add;
- `half_linear`'s backward writes each weight gradient in fp32 straight out of the GEMM, where
  the device has a GEMM with an fp32 result from half inputs (`torch.mm(..., out_dtype=)`, CUDA);
  elsewhere the product is rounded to the half dtype and cast, as autocast does.

`add_product` (acc += a @ b into an fp32 accumulator) is the same rule for
`linear_cross_entropy`'s chunked weight gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

# --------------------------------------------------------------------------------------------
# Mixed-precision products
# --------------------------------------------------------------------------------------------


@torch.compiler.assume_constant_result
def has_mixed_gemm(device_type: str) -> bool:
    """Whether this torch has, for `device_type`, the GEMMs with an fp32 result from half inputs
    (`mm` and `addmm` with `out_dtype=`; CUDA builds have them, CPU has not)."""
    key = device_type.upper()
    return all(
        torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", key)
        for op in ("mm.dtype", "addmm.dtype_out")
    )


def product(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b in out_dtype, accumulated inside the GEMM in out_dtype's precision where the device
    has that GEMM, else rounded to a's dtype first (autocast's result)."""
    if a.dtype == out_dtype:
        return a @ b
    if has_mixed_gemm(a.device.type):
        return torch.mm(a, b, out_dtype=out_dtype)
    return (a @ b).to(out_dtype)


def add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc fp32 and a, b perhaps of a half dtype: accumulated in fp32 inside the
    GEMM where the device has that GEMM, else through a rounded partial product."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif has_mixed_gemm(acc.device.type):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += a @ b


# --------------------------------------------------------------------------------------------
# Casting a layer's weights
# --------------------------------------------------------------------------------------------


def autocast_dtype(*weights: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would cast these weights to for a GEMM, or None where it would not
    (autocast off on their device, or the weights not fp32)."""
    device = weights[0].device.type
    if not torch.is_autocast_enabled(device):
        return None
    if any(w.dtype != torch.float32 for w in weights):
        return None
    return torch.get_autocast_dtype(device)


def cast_weights(groups: Sequence[Sequence[torch.Tensor]],
                 dtype: torch.dtype) -> list[torch.Tensor]:
    """Each group's weights (2-D, one column count per group) in `dtype`, stacked by rows: one
    (sum of rows, cols) tensor per group, all in one buffer filled by one multi-tensor copy.

    The copies carry no autograd history: `half_linear` takes the fp32 weights alongside and
    returns their gradients itself."""
    for group in groups:
        if any(w.dim() != 2 or w.shape[1] != group[0].shape[1] for w in group):
            shapes = [tuple(w.shape) for w in group]
            raise ValueError(f"a group's weights must be 2-D with one column count, got {shapes}")
    sizes = [sum(w.numel() for w in group) for group in groups]
    buffer = torch.empty(sum(sizes), dtype=dtype, device=groups[0][0].device)
    stacked, pieces = [], []
    for group, part in zip(groups, buffer.split(sizes)):
        matrix = part.view(-1, group[0].shape[1])
        stacked.append(matrix)
        pieces.extend(matrix.split([w.shape[0] for w in group]))
    with torch.no_grad():
        torch._foreach_copy_(pieces, [w for group in groups for w in group])
    return stacked


# --------------------------------------------------------------------------------------------
# Autograd function
# --------------------------------------------------------------------------------------------


class _HalfLinear(torch.autograd.Function):
    """y = x @ stacked^T, with `stacked` the half copy of `weights` stacked by rows; gradients for
    x (in x's dtype) and for each fp32 weight (fp32), none for the copy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, stacked: torch.Tensor, *weights: torch.Tensor):
        x_half = x.to(stacked.dtype)
        ctx.save_for_backward(x_half, stacked)
        ctx.x_dtype = x.dtype
        ctx.rows = [w.shape[0] for w in weights]
        ctx.weight_dtypes = [w.dtype for w in weights]
        return F.linear(x_half, stacked)  # (..., sum of rows)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_half, stacked = ctx.saved_tensors
        dy = dy.to(stacked.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (dy @ stacked).to(ctx.x_dtype)  # one GEMM: the groups' input gradients summed
        dy_rows = dy.reshape(-1, dy.shape[-1])  # (N, sum of rows)
        x_rows = x_half.reshape(-1, x_half.shape[-1])  # (N, C)
        dweights = [
            product(dy_piece.T, x_rows, dtype) if needed else None for dy_piece, dtype, needed in
            zip(dy_rows.split(ctx.rows, dim=1), ctx.weight_dtypes, ctx.needs_input_grad[2:])
        ]
        return dx, None, *dweights


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------


def half_linear(x: torch.Tensor, stacked: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
    """x @ stacked^T where `stacked` is `weights` (fp32, each (rows_i, C)) cast by
    `cast_weights` as one group: (..., C) -> (..., sum of rows_i), in stacked's dtype.

    The gradient of each weight comes back fp32 from the GEMM (see the module docstring); x's
    in x's dtype."""
    rows = sum(w.shape[0] for w in weights)
    if stacked.dim() != 2 or stacked.shape[0] != rows:
        raise ValueError(
            f"stacked {tuple(stacked.shape)} must be the weights "
            f"{[tuple(w.shape) for w in weights]} stacked by rows"
        )
    if any(w.shape[1] != stacked.shape[1] for w in weights):
        raise ValueError("every weight must have stacked's column count")
    if x.shape[-1] != stacked.shape[1]:
        raise ValueError(f"x's last dim {x.shape[-1]} must be the weights' {stacked.shape[1]}")
    return _HalfLinear.apply(x, stacked, *weights)
