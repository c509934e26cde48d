"""Fused linear cross-entropy: the output projection and the cross-entropy loss in one op, so that
the (N, V) logits never exist at once.

For x (N, C), weight (V, C) and logits = x @ weight^T, tokens go through in chunks of rows; for
each chunk the logits (chunk, V) are computed with a torch matmul in x's dtype, the row kernel of
`fastlm.kernels.cross_entropy` overwrites them with dlogits = softmax - onehot (its math is
there), and at once

    dx[chunk]  = dlogits @ weight                     (N, C), x's dtype
    dweight   += dlogits^T @ x[chunk]                 (V, C), fp32 across chunks

dx and dweight are kept for the backward, which scales them by grad_output / n_valid (new
tensors: dx's and the weight gradient's sizes). Targets are checked in the public function; one
outside [0, V) other than ignore_index that reaches a kernel gives a NaN loss there, never a read
out of bounds.
"""

from __future__ import annotations

import math

import torch

from fastlm.backend import use_triton
from fastlm.kernels import cross_entropy_options
from fastlm.kernels._common import check_float, check_match, empty
from fastlm.kernels.cross_entropy import (
    _check_target_values,
    _check_targets,
    _count_valid,
    _cross_entropy_rows,
    _grad_scale,
    _option_names,
    check_ignore_index,
    cross_entropy_ref,
)
from fastlm.kernels.linear import add_product, half_linear
from fastlm.options import check

#: Logits bytes one chunk of linear_cross_entropy may hold (the default chunk_size): 128 MiB is
#: 2048 tokens at vocab 32000 in bf16, an eighth of the logits of 16k tokens, while the chunk's
#: matmuls (2048 x 768 x 32000) stay large enough to run near a GPU's peak.
CHUNK_LOGITS_BYTES = 128 * 2**20

# --------------------------------------------------------------------------------------------
# Reference math
# --------------------------------------------------------------------------------------------


def linear_cross_entropy_ref(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """cross_entropy_ref(x @ weight.T, ...) with the weight in x's dtype: the logits
    materialised, as an unfused model has them. An fp32 weight with half-precision x gets its
    gradient out of the GEMM in fp32 (`half_linear`), as the fused path accumulates it, not a
    half-precision product cast up."""
    if weight.dtype == torch.float32 and x.dtype != torch.float32:
        weight_x = weight.detach().to(x.dtype)  # what the GEMM reads; the gradient goes to weight
        return cross_entropy_ref(half_linear(x, weight_x, weight), targets, ignore_index)
    return cross_entropy_ref(x @ weight.to(x.dtype).T, targets, ignore_index)


# --------------------------------------------------------------------------------------------
# Launcher: the chunks through the cross-entropy row kernel
# --------------------------------------------------------------------------------------------


def _linear_cross_entropy_chunks(
    x, weight, targets, ignore_index, chunk_size, need_dx, need_dweight
):
    """The mean loss of x (..., C) @ weight^T and n_valid, chunk by chunk, with the unscaled
    dx (N, C) and fp32 dweight (V, C) (sums of softmax - onehot terms) where asked for, else None.
    The logits are computed in x's dtype: an fp32 weight with half-precision x is cast once."""
    n_features = x.shape[-1]
    rows = x.reshape(-1, n_features)  # (N, C)
    flat_targets = targets.reshape(-1).contiguous()
    n_rows = rows.shape[0]
    write_grad = need_dx or need_dweight
    weight_x = weight.to(x.dtype)  # the weight as the GEMMs read it (no copy when it is already)

    row_loss = empty((n_rows, ), device=x.device, dtype=torch.float32)
    stats = empty((n_rows, 2), device=x.device, dtype=torch.float32)
    dx = empty((n_rows, n_features), device=x.device, dtype=x.dtype) if need_dx else None
    # fp32 across chunks, so that a half-precision chunk's share is never rounded on its own.
    dweight = (
        torch.zeros(weight.shape, device=x.device, dtype=torch.float32) if need_dweight else None
    )
    for start in range(0, n_rows, chunk_size):
        end = min(start + chunk_size, n_rows)
        x_chunk = rows[start:end]
        logits = x_chunk @ weight_x.T  # (chunk, V), the only logits alive
        _cross_entropy_rows(
            logits, flat_targets[start:end], ignore_index, row_loss[start:end], stats[start:end],
            logits if write_grad else None
        )
        if need_dx:
            torch.mm(logits, weight_x, out=dx[start:end])
        if need_dweight:
            add_product(dweight, logits.T, x_chunk)
        del logits

    n_valid = _count_valid(flat_targets, ignore_index)
    return row_loss.sum() / n_valid, n_valid, dx, dweight


# --------------------------------------------------------------------------------------------
# Registration: torch.ops.fastlm.linear_cross_entropy
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("fastlm::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
    chunk_size: int, need_dx: bool, need_dweight: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, n_valid, unscaled dx of x's shape or empty, unscaled fp32 dweight or empty): a
    gradient not asked for is an empty tensor (custom ops return tensors, not None)."""
    check("chunk_size", chunk_size)  # a direct torch.ops call, by the public function's rule
    loss, n_valid, dx, dweight = _linear_cross_entropy_chunks(
        x, weight, targets, ignore_index, chunk_size, need_dx, need_dweight
    )
    dx = dx.view(x.shape) if need_dx else x.new_empty(0)
    dweight = dweight if need_dweight else weight.new_empty(0, dtype=torch.float32)
    return loss, n_valid, dx, dweight


@_linear_cross_entropy_op.register_fake
def _(x, weight, targets, ignore_index, chunk_size, need_dx, need_dweight):
    dx = x.new_empty(x.shape if need_dx else 0)
    dweight = weight.new_empty(weight.shape if need_dweight else 0, dtype=torch.float32)
    return (
        x.new_empty((), dtype=torch.float32), targets.new_empty((), dtype=torch.int64), dx, dweight
    )


def _linear_cross_entropy_setup(ctx, inputs, output):
    _, weight, *_ = inputs
    _, n_valid, dx, dweight = output
    ctx.set_materialize_grads(False)  # no zero tensors for the outputs without a gradient
    ctx.mark_non_differentiable(n_valid, dx, dweight)
    ctx.save_for_backward(dx, dweight, n_valid)
    ctx.need = inputs[5:7]
    ctx.weight_dtype = weight.dtype


def _linear_cross_entropy_grad(ctx, grad_loss, *_):
    if torch.is_grad_enabled():  # create_graph=True: dx, dweight were computed without a graph
        raise RuntimeError(
            "fastlm.linear_cross_entropy: second derivatives are not supported "
            "(create_graph=True through its backward)"
        )
    dx, dweight, n_valid = ctx.saved_tensors
    need_dx, need_dweight = ctx.need
    scale = _grad_scale(grad_loss, n_valid)
    grad_x = dx * scale if need_dx else None
    # Scaled in fp32, rounded once to the weight's dtype.
    grad_weight = (dweight * scale).to(ctx.weight_dtype) if need_dweight else None
    return grad_x, grad_weight, None, None, None, None, None


torch.library.register_autograd(
    "fastlm::linear_cross_entropy", _linear_cross_entropy_grad,
    setup_context=_linear_cross_entropy_setup
)

# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------


def default_chunk_size(n_tokens: int, vocab_size: int, dtype: torch.dtype) -> int:
    """Rows per chunk such that a chunk's logits take at most CHUNK_LOGITS_BYTES, balanced so
    that the chunks have near-equal sizes (no small last chunk)."""
    max_rows = max(1, CHUNK_LOGITS_BYTES // (vocab_size * dtype.itemsize))
    n_chunks = max(1, math.ceil(n_tokens / max_rows))
    return max(1, math.ceil(n_tokens / n_chunks))


def linear_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
    chunk_size: int | None = None, *, softcap: float = 0.0, reduction: str = "mean",
    label_smoothing: float = 0.0, z_loss: float = 0.0, return_accuracy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """cross_entropy(x @ weight.T, targets, ignore_index) without the (tokens, V) logits.

    Tokens run in chunks of `chunk_size` rows; each chunk's logits are computed in x's dtype and
    turned into its dx and its share of dweight in the forward, so the peak extra memory is one
    chunk's logits plus dx (x's size), an fp32 dweight (V, C), a copy of the weight in x's dtype if
    it has another, and, where the device lacks a GEMM with an fp32 result from half inputs (CPU),
    one (V, C) partial product. Only the gradients needed are computed (those of the inputs that
    require grad, none under torch.no_grad or inference_mode); the backward scales them by
    grad_output / n_valid into new tensors. Second derivatives raise. The mean, ignore_index,
    all-ignored and target rules are cross_entropy's. The PyTorch backend materialises the logits.

    Under autocast x is cast to the autocast dtype (no copy when the final norm wrote it so) and
    weight is taken as it is, as a linear layer under autocast would.

    Args:
        x: (..., C) float32, float16 or bfloat16, the final norm's output.
        weight: (V, C), nn.Linear's / out_linear.w's [out, in] layout, on x's device; x's dtype,
            or fp32 with half-precision x (master weights): the logits are then computed in x's
            dtype and the weight's gradient is accumulated and returned in fp32, never rounded to
            x's dtype and cast back.
        targets: int64 (or int32) of x's leading shape (...), as in `cross_entropy`.
        ignore_index: the target value whose rows add nothing (default -100).
        chunk_size: rows per chunk, a positive int (default: `default_chunk_size`, at most 128 MiB
            of logits per chunk).
        softcap, reduction, label_smoothing, z_loss, return_accuracy: as in `cross_entropy`, on
            the logits x @ weight.T. "mean" and "sum" make each chunk's gradients in the forward as
            above; "none" recomputes each chunk's logits in the backward (one chunk's alive at a
            time).

    Returns:
        The loss, fp32 (a scalar, or x's leading shape with reduction="none"); with
        return_accuracy, (loss, accuracy). The gradients have x's and weight's dtypes.

    Raises:
        TypeError: x or weight not a tensor of float32, float16 or bfloat16, a weight whose dtype
            is neither x's nor float32; targets, ignore_index or an option as in `cross_entropy`.
        ValueError: a 0-d x, a weight not (V, C) with V >= 1 or on another device, a chunk_size
            that is not a positive int or None; targets and options as in `cross_entropy`.
    """
    check_float("x", x)
    check_float("weight", weight)
    options = (softcap, reduction, label_smoothing, z_loss, return_accuracy)
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        with torch.autocast(x.device.type, enabled=False):
            return linear_cross_entropy(
                x.to(dtype), weight, targets, ignore_index, chunk_size, **_option_names(options)
            )
    if weight.dtype != torch.float32:
        check_match("weight", weight, "x", x)
    elif weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, but x is on {x.device}")
    if x.ndim == 0:
        raise ValueError("x must have a feature dim, got a 0-d tensor")
    if weight.ndim != 2 or weight.shape[1] != x.shape[-1] or weight.shape[0] == 0:
        raise ValueError(
            f"weight must be (vocab_size, {x.shape[-1]}) for x of shape {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    _check_targets(targets, x.shape[:-1], x.device, "x")
    check_ignore_index(ignore_index)
    chunk_size = check("chunk_size", chunk_size, none_ok=True)
    options = cross_entropy_options.check_options(*options)
    _check_target_values(targets, weight.shape[0], ignore_index)
    if chunk_size is None:
        chunk_size = default_chunk_size(targets.numel(), weight.shape[0], x.dtype)
    if options != cross_entropy_options.NO_OPTIONS:
        return cross_entropy_options.linear_cross_entropy_with_options(
            x, weight, targets, ignore_index, chunk_size, *options
        )
    if not use_triton(x):
        return linear_cross_entropy_ref(x, weight, targets, ignore_index)
    grad_enabled = torch.is_grad_enabled()
    need_dx, need_dweight = x.requires_grad and grad_enabled, weight.requires_grad and grad_enabled
    return _linear_cross_entropy_op(
        x, weight, targets, ignore_index, chunk_size, need_dx, need_dweight
    )[0]
