"""The options of cross_entropy and linear_cross_entropy that trainers pass: a soft cap on the
logits, label smoothing, a z-loss, the reduction, and the token accuracy.

For a row of logits x (V entries) and its target t, with the cap c (Gemma 2's final logits):

    z_j  = c * tanh(x_j / c)                         (z = x without a cap)
    lse  = log sum_j exp(z_j) = m + log s,   m = max_j z_j,   s = sum_j exp(z_j - m)
    loss = (1 - eps) * (lse - z_t) + eps * (lse - mean_j z_j) + w * lse^2

eps is the label smoothing (PyTorch's: the target distribution (1 - eps) onehot + eps / V), w
the z-loss weight (PaLM's auxiliary lse^2 term, which keeps the normaliser near 1). The loss uses
(m - z_t) + log s, never a rounded lse, so logits near finfo's extremes keep their log V. The
gradient, with p = softmax(z):

    dloss/dz_j = (1 + 2 w lse) p_j - (1 - eps) [j == t] - eps / V
    dloss/dx_j = dloss/dz_j * (1 - (z_j / c)^2)

Rows whose target is ignore_index add 0 and get gradient 0. reduction "mean" divides the sum by
the number of counted rows (0 when there is none), "sum" does not, "none" returns each row's
loss (0 for ignored rows). The accuracy is the fraction of counted rows whose largest z (the
first, on ties, as torch.argmax) is the target.

Kernels: the forward reads a row through vocabulary blocks once for (m, s), the target's z, the
sum of z and the argmax, and a second time to write the unscaled gradient when asked; the
backward reads it again and writes the gradient times a per-row scale (the reduction's, from
autograd), so "none" needs nothing special. `linear_cross_entropy` with options runs the tokens in
chunks as the plain one does: for "mean" and "sum" each chunk's dx and dweight are made in the
forward from the unscaled gradient; for "none" (a per-row scale known only in the backward) each
chunk is recomputed in the backward (torch.utils.checkpoint), one chunk of logits alive at a time.
"""

from __future__ import annotations

import torch

from fastlm.backend import use_triton
from fastlm.kernels._common import as_rows, empty, refuse_double_backward, tl, triton
from fastlm.kernels._vocab_blocks import _block_v, _load_block, _online_lse_step
from fastlm.kernels.linear import add_product
from fastlm.options import check

REDUCTIONS = ("mean", "sum", "none")
#: (softcap, reduction, label_smoothing, z_loss, return_accuracy) that take the plain kernels.
NO_OPTIONS = (0.0, "mean", 0.0, 0.0, False)

# --------------------------------------------------------------------------------------------
# Reference math (the PyTorch backend, and what the tests compare with)
# --------------------------------------------------------------------------------------------


def cross_entropy_options_ref(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, *, softcap: float = 0.0,
    label_smoothing: float = 0.0, z_loss: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row losses (N,), correct (N,) bool) of logits (..., V) in PyTorch, fp32 inside (fp64 for
    fp64); an ignored row's logits never enter the math (loss 0, no NaN gradient)."""
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.reshape(-1, logits.shape[-1]).to(compute)
    flat_targets = targets.reshape(-1)
    counted = flat_targets != ignore_index
    x = torch.where(counted[:, None], x, 0.0)
    if softcap:
        x = softcap * torch.tanh(x / softcap)
    log_probs = torch.log_softmax(x, dim=-1)
    safe_targets = torch.where(counted, flat_targets, 0)[:, None]
    nll = -log_probs.gather(-1, safe_targets).squeeze(-1)
    rows = (1 - label_smoothing) * nll
    if label_smoothing:
        rows = rows - label_smoothing * log_probs.mean(-1)
    if z_loss:
        rows = rows + z_loss * torch.logsumexp(x, dim=-1).square()
    correct = counted & (x.argmax(-1) == flat_targets)
    return torch.where(counted, rows, 0.0), correct


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _capped_block(logits_row, start, n_cols, softcap, BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr):
    """(z, cols, mask) of a block: c * tanh(x / c) under SOFTCAP, -inf past the row's end."""
    x, cols, mask = _load_block(logits_row, start, n_cols, BLOCK_V)
    if SOFTCAP:
        # tanh from one exp; |x / c| capped at 20, where tanh is +-1 in fp32 already, so that
        # the exp never overflows (a -inf logit gives -c, as the cap of PyTorch's tanh).
        u = tl.minimum(tl.maximum(x / softcap, -20.0), 20.0)
        x = softcap * (1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
        x = tl.where(mask, x, float("-inf"))
    return x, cols, mask


@triton.jit
def _row_grad(
    z, cols, target, counted, row_max, log_sum, n_cols, softcap, smoothing, z_weight,  #
    SOFTCAP: tl.constexpr
):
    """dloss/dx of a block (fp32, 0 for an ignored row); see the module docstring."""
    p = tl.exp((z - row_max) - log_sum)
    lse = row_max + log_sum
    grad = (1.0 + 2.0 * z_weight * lse) * p - (1.0 - smoothing) * tl.where(cols == target, 1.0, 0.0)
    grad -= smoothing / n_cols
    if SOFTCAP:  # z is -inf only past the row's end (a capped -inf logit is -c)
        capped = tl.where(z > float("-inf"), z / softcap, 1.0)
        grad *= 1.0 - capped * capped
    return tl.where(counted, grad, 0.0)


@triton.jit
def _options_fwd_kernel(
    Logits, Targets, Loss, Stats, Correct, DLogits,  #
    stride_lm, stride_dm,  #
    n_cols, ignore_index, softcap, smoothing, z_weight,  #
    BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr, WRITE_GRAD: tl.constexpr
):
    """One program per row: Loss[row], Stats[row] = (max, log sum) of z, Correct[row] and, under
    WRITE_GRAD, DLogits[row] = the unscaled gradient."""
    row = tl.program_id(0).to(tl.int64)
    logits_row = Logits + row * stride_lm
    target = tl.load(Targets + row).to(tl.int64)
    counted = target != ignore_index
    in_vocab = (target >= 0) & (target < n_cols)
    target_z = tl.load(logits_row + target, mask=in_vocab, other=0.0).to(tl.float32)
    if SOFTCAP:
        u = tl.minimum(tl.maximum(target_z / softcap, -20.0), 20.0)
        target_z = softcap * (1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))

    row_max = tl.full([], float("-inf"), tl.float32)
    row_sum = tl.zeros([], tl.float32)
    z_mean = tl.zeros([], tl.float32)
    best = tl.full([], float("-inf"), tl.float32)
    best_col = tl.zeros([], tl.int64)
    for start in range(0, n_cols, BLOCK_V):
        z, cols, mask = _capped_block(logits_row, start, n_cols, softcap, BLOCK_V, SOFTCAP)
        row_max, row_sum = _online_lse_step(z, row_max, row_sum)
        if smoothing != 0.0:  # each z / V first: a sum of huge logits would overflow
            z_mean += tl.sum(tl.where(mask, z / n_cols, 0.0), axis=0)
        block_best = tl.max(z, axis=0)
        block_col = start + tl.argmax(z, axis=0, tie_break_left=True).to(tl.int64)
        better = block_best > best  # strictly: the first of equal maxima, as torch.argmax
        best_col = tl.where(better, block_col, best_col)
        best = tl.maximum(best, block_best)
    log_sum = tl.log(row_sum)

    loss = (row_max - target_z) + log_sum
    if smoothing != 0.0:
        loss = (1.0 - smoothing) * loss + smoothing * ((row_max - z_mean) + log_sum)
    if z_weight != 0.0:  # lse^2 of huge logits is inf, and 0 * inf NaN
        lse = row_max + log_sum
        loss += z_weight * lse * lse
    loss = tl.where(in_vocab, loss, float("nan"))
    tl.store(Loss + row, tl.where(counted, loss, 0.0))
    tl.store(Stats + 2 * row, row_max)
    tl.store(Stats + 2 * row + 1, log_sum)
    tl.store(Correct + row, tl.where(counted & (best_col == target), 1.0, 0.0))

    if WRITE_GRAD:
        dlogits_row = DLogits + row * stride_dm
        for start in range(0, n_cols, BLOCK_V):
            z, cols, mask = _capped_block(logits_row, start, n_cols, softcap, BLOCK_V, SOFTCAP)
            grad = _row_grad(
                z, cols, target, counted, row_max, log_sum, n_cols, softcap, smoothing, z_weight,
                SOFTCAP
            )
            tl.store(dlogits_row + cols, grad.to(DLogits.dtype.element_ty), mask=mask)


@triton.jit
def _options_bwd_kernel(
    Logits, Targets, Stats, Scale, DLogits,  #
    stride_lm, stride_dm,  #
    n_cols, ignore_index, softcap, smoothing, z_weight,  #
    BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr
):
    """One program per (row, block of columns): DLogits = the gradient times Scale[row]."""
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK_V
    target = tl.load(Targets + row).to(tl.int64)
    row_max, log_sum = tl.load(Stats + 2 * row), tl.load(Stats + 2 * row + 1)
    z, cols, mask = _capped_block(
        Logits + row * stride_lm, start, n_cols, softcap, BLOCK_V, SOFTCAP
    )
    grad = _row_grad(
        z, cols, target, target != ignore_index, row_max, log_sum, n_cols, softcap, smoothing,
        z_weight, SOFTCAP
    )
    grad *= tl.load(Scale + row)
    tl.store(DLogits + row * stride_dm + cols, grad.to(DLogits.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _option_args(softcap: float, label_smoothing: float, z_loss: float) -> tuple:
    # Every launch passes here: the ops called directly (torch.ops.fastlm) obey the same rule.
    check_op_options(softcap, label_smoothing, z_loss)
    # A cap of 0 is no cap; the kernels divide by it only under SOFTCAP.
    return float(softcap) or 1.0, float(label_smoothing), float(z_loss)


def _rows_forward(rows, targets, ignore_index, options, dlogits=None):
    """(row losses, stats (N, 2), correct (N,) fp32 1 or 0) of rows (N, V); the unscaled gradient
    into dlogits (N, V) (may be rows) unless it is None."""
    n_rows, n_cols = rows.shape
    loss = empty((n_rows, ), device=rows.device, dtype=torch.float32)
    stats = empty((n_rows, 2), device=rows.device, dtype=torch.float32)
    correct = empty((n_rows, ), device=rows.device, dtype=torch.float32)
    if n_rows:
        block_v, num_warps = _block_v(n_cols)
        grad_out = dlogits if dlogits is not None else rows  # never written without WRITE_GRAD
        _options_fwd_kernel[(n_rows, )](
            rows, targets, loss, stats, correct, grad_out, rows.stride(0), grad_out.stride(0),
            n_cols, ignore_index, *_option_args(*options), BLOCK_V=block_v,
            SOFTCAP=bool(options[0]), WRITE_GRAD=dlogits is not None, num_warps=num_warps
        )
    return loss, stats, correct


def _rows_backward(rows, targets, ignore_index, stats, scale, options):
    """dlogits (N, V) of rows (N, V): each row's gradient times scale[row]."""
    dlogits = empty(rows.shape, device=rows.device, dtype=rows.dtype)
    n_rows, n_cols = rows.shape
    if n_rows:
        block_v, num_warps = _block_v(n_cols)
        _options_bwd_kernel[(n_rows, triton.cdiv(n_cols, block_v))](
            rows, targets.reshape(-1).contiguous(), stats.contiguous(), scale.contiguous(), dlogits,
            rows.stride(0), dlogits.stride(0), n_cols, ignore_index, *_option_args(*options),
            BLOCK_V=block_v, SOFTCAP=bool(options[0]), num_warps=num_warps
        )
    return dlogits


# --------------------------------------------------------------------------------------------
# Registration: torch.ops.fastlm.cross_entropy_options, .linear_cross_entropy_options
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("fastlm::cross_entropy_options", mutates_args=())
def _cross_entropy_options_op(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, softcap: float,
    label_smoothing: float, z_loss: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row losses (N,) fp32, stats (N, 2) fp32, correct (N,) fp32 1 or 0)."""
    options = (softcap, label_smoothing, z_loss)
    return _rows_forward(as_rows(logits), targets.reshape(-1).contiguous(), ignore_index, options)


@_cross_entropy_options_op.register_fake
def _(logits, targets, ignore_index, softcap, label_smoothing, z_loss):
    rows = logits.shape[:-1].numel()
    return (
        logits.new_empty(rows,
                         dtype=torch.float32), logits.new_empty((rows, 2), dtype=torch.float32),
        logits.new_empty(rows, dtype=torch.float32)
    )


@torch.library.custom_op("fastlm::cross_entropy_options_backward", mutates_args=())
def _cross_entropy_options_backward_op(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, stats: torch.Tensor,
    scale: torch.Tensor, softcap: float, label_smoothing: float, z_loss: float
) -> torch.Tensor:
    """dlogits of logits' shape: each row's gradient times scale[row]."""
    rows = as_rows(logits)
    options = (softcap, label_smoothing, z_loss)
    dlogits = _rows_backward(rows, targets, ignore_index, stats, scale, options)
    return dlogits.view(logits.shape)


@_cross_entropy_options_backward_op.register_fake
def _(logits, targets, ignore_index, stats, scale, softcap, label_smoothing, z_loss):
    return logits.new_empty(logits.shape)


def _cross_entropy_options_setup(ctx, inputs, output):
    logits, targets, ignore_index, *options = inputs
    _, stats, correct = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(stats, correct)
    ctx.save_for_backward(logits, targets, stats)
    ctx.ignore_index, ctx.options = ignore_index, options


def _cross_entropy_options_grad(ctx, grad_rows, *_):
    logits, targets, stats = ctx.saved_tensors
    dlogits = _cross_entropy_options_backward_op(
        logits, targets, ctx.ignore_index, stats, grad_rows.float(), *ctx.options
    )
    return dlogits, None, None, None, None, None


torch.library.register_autograd(
    "fastlm::cross_entropy_options", _cross_entropy_options_grad,
    setup_context=_cross_entropy_options_setup
)
refuse_double_backward("fastlm::cross_entropy_options_backward", "cross_entropy")


@torch.library.custom_op("fastlm::linear_cross_entropy_options", mutates_args=())
def _linear_cross_entropy_options_op(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
    chunk_size: int, softcap: float, label_smoothing: float, z_loss: float, need_dx: bool,
    need_dweight: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed loss, correct (N,) fp32 1 or 0, unscaled dx or empty, unscaled fp32 dweight or
    empty): x (..., C) @ weight^T chunk by chunk, as linear_cross_entropy's plain op."""
    check("chunk_size", chunk_size)  # a direct torch.ops call, by the public function's rule
    options = (softcap, label_smoothing, z_loss)
    rows = x.reshape(-1, x.shape[-1])
    flat_targets = targets.reshape(-1).contiguous()
    weight_x = weight.to(x.dtype)
    write_grad = need_dx or need_dweight
    losses, corrects = [], []
    dx = empty(rows.shape, device=x.device, dtype=x.dtype) if need_dx else x.new_empty(0)
    dweight = torch.zeros(weight.shape, device=x.device, dtype=torch.float32)
    for start in range(0, rows.shape[0], chunk_size):
        chunk = rows[start:start + chunk_size]
        logits = chunk @ weight_x.T  # (chunk, V), the only logits alive
        loss, _, correct = _rows_forward(
            logits, flat_targets[start:start + chunk_size], ignore_index, options,
            logits if write_grad else None
        )
        losses.append(loss)
        corrects.append(correct)
        if need_dx:
            torch.mm(logits, weight_x, out=dx[start:start + chunk_size])
        if need_dweight:
            add_product(dweight, logits.T, chunk)
    loss = torch.cat(losses).sum() if losses else rows.new_zeros((), dtype=torch.float32)
    correct = torch.cat(corrects) if corrects else rows.new_zeros(0, dtype=torch.float32)
    dweight = dweight if need_dweight else weight.new_empty(0, dtype=torch.float32)
    return loss, correct, dx.view(x.shape) if need_dx else dx, dweight


@_linear_cross_entropy_options_op.register_fake
def _(
    x, weight, targets, ignore_index, chunk_size, softcap, label_smoothing, z_loss, need_dx,
    need_dweight
):
    return (
        x.new_empty((), dtype=torch.float32), x.new_empty(targets.numel(), dtype=torch.float32),
        x.new_empty(x.shape if need_dx else 0),
        weight.new_empty(weight.shape if need_dweight else 0, dtype=torch.float32)
    )


def _linear_options_setup(ctx, inputs, output):
    _, weight, *_ = inputs
    _, correct, dx, dweight = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(correct, dx, dweight)
    ctx.save_for_backward(dx, dweight)
    ctx.need = inputs[8:10]
    ctx.weight_dtype = weight.dtype


def _linear_options_grad(ctx, grad_loss, *_):
    if torch.is_grad_enabled():
        raise RuntimeError(
            "fastlm.linear_cross_entropy: second derivatives are not supported "
            "(create_graph=True through its backward)"
        )
    dx, dweight = ctx.saved_tensors
    need_dx, need_dweight = ctx.need
    scale = grad_loss.float()
    grad_x = dx * scale if need_dx else None
    grad_weight = (dweight * scale).to(ctx.weight_dtype) if need_dweight else None
    return grad_x, grad_weight, *(None, ) * 8


torch.library.register_autograd(
    "fastlm::linear_cross_entropy_options", _linear_options_grad,
    setup_context=_linear_options_setup
)

# --------------------------------------------------------------------------------------------
# The functions cross_entropy and linear_cross_entropy hand their options to
# --------------------------------------------------------------------------------------------


def check_options(softcap, reduction, label_smoothing, z_loss, return_accuracy) -> tuple:
    """The options checked (`fastlm.options`: ValueError/TypeError naming the one out of range),
    the numbers as floats, in the order given."""
    softcap, label_smoothing, z_loss = (
        check(name, value) for name, value in
        (("softcap", softcap), ("label_smoothing", label_smoothing), ("z_loss", z_loss))
    )
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not isinstance(return_accuracy, bool):
        raise TypeError(f"return_accuracy must be a bool, got {type(return_accuracy).__name__}")
    return softcap, reduction, label_smoothing, z_loss, return_accuracy


def check_op_options(softcap: float, label_smoothing: float, z_loss: float) -> None:
    """The ops' float arguments, by the public functions' rule (a direct `torch.ops.fastlm` call
    with softcap=inf is refused as `cross_entropy` refuses it)."""
    check_options(softcap, "mean", label_smoothing, z_loss, False)


def _finish(rows_or_sum, correct, targets, ignore_index, reduction, return_accuracy):
    """The reduction of the row losses (or of their sum) and, on request, the accuracy."""
    n_valid = (targets != ignore_index).sum().clamp_min(1)
    if reduction == "none":
        loss = rows_or_sum.view(targets.shape)
    else:
        total = rows_or_sum if rows_or_sum.dim() == 0 else rows_or_sum.sum()
        loss = total / n_valid if reduction == "mean" else total
    if not return_accuracy:
        return loss
    return loss, correct.float().sum() / n_valid  # an unwritten (poisoned) row: NaN


def cross_entropy_with_options(
    logits, targets, ignore_index, softcap, reduction, label_smoothing, z_loss, return_accuracy
):
    """cross_entropy with its options (arguments checked by cross_entropy)."""
    options = dict(softcap=softcap, label_smoothing=label_smoothing, z_loss=z_loss)
    if not use_triton(logits):
        rows, correct = cross_entropy_options_ref(logits, targets, ignore_index, **options)
    else:
        values = (float(v) for v in options.values())
        rows, _, correct = _cross_entropy_options_op(logits, targets, ignore_index, *values)
    return _finish(rows, correct, targets, ignore_index, reduction, return_accuracy)


def linear_cross_entropy_with_options(
    x, weight, targets, ignore_index, chunk_size, softcap, reduction, label_smoothing, z_loss,
    return_accuracy
):
    """linear_cross_entropy with its options (arguments checked by linear_cross_entropy; the
    weight in x's dtype or fp32, autocast already applied)."""
    options = (float(softcap), float(label_smoothing), float(z_loss))
    if not use_triton(x):
        logits = x @ weight.to(x.dtype).T
        rows, correct = cross_entropy_options_ref(
            logits, targets, ignore_index, softcap=softcap, label_smoothing=label_smoothing,
            z_loss=z_loss
        )
        return _finish(rows, correct, targets, ignore_index, reduction, return_accuracy)
    if reduction == "none":
        rows, correct = _checkpointed_rows(x, weight, targets, ignore_index, chunk_size, options)
        return _finish(rows, correct, targets, ignore_index, reduction, return_accuracy)
    grad_enabled = torch.is_grad_enabled()
    need_dx, need_dweight = x.requires_grad and grad_enabled, weight.requires_grad and grad_enabled
    total, correct, _, _ = _linear_cross_entropy_options_op(
        x, weight, targets, ignore_index, chunk_size, *options, need_dx, need_dweight
    )
    return _finish(total, correct, targets, ignore_index, reduction, return_accuracy)


def _chunk_rows(x_chunk, weight, targets_chunk, ignore_index, options):
    logits = x_chunk @ weight.to(x_chunk.dtype).T
    rows, _, correct = _cross_entropy_options_op(logits, targets_chunk, ignore_index, *options)
    return rows, correct


def _checkpointed_rows(x, weight, targets, ignore_index, chunk_size, options):
    """Row losses of x @ weight^T chunk by chunk, each chunk's logits recomputed in the backward
    (a per-row gradient scale is known only there), so that one chunk's logits are alive."""
    from torch.utils.checkpoint import checkpoint

    rows = x.reshape(-1, x.shape[-1])
    flat_targets = targets.reshape(-1)
    losses = [rows.new_zeros(0, dtype=torch.float32)]  # torch.cat of no chunks: none
    corrects = [rows.new_zeros(0, dtype=torch.float32)]
    for start in range(0, rows.shape[0], chunk_size):
        end = start + chunk_size
        loss, correct = checkpoint(
            _chunk_rows, rows[start:end], weight, flat_targets[start:end], ignore_index, options,
            use_reentrant=False
        )
        losses.append(loss)
        corrects.append(correct)
    return torch.cat(losses), torch.cat(corrects)
