"""Cross-entropy with its gradient computed in the forward.

For a row of logits x (V entries) and its target t, with m = max_j x_j and
s = sum_j exp(x_j - m) (online over vocabulary blocks, fp32):

    loss = (m - x_t) + log s                          (= log sum_j exp(x_j) - x_t)
    dloss/dx_j = softmax(x)_j - [j == t]  =  exp((x_j - m) - log s) - [j == t]

Never through lse = m + log s itself: where |m| dwarfs log s (every logit at finfo.min or
finfo.max) lse rounds to m, and lse - x_t would give a loss of 0 and exp(x_j - lse) a softmax of 1
instead of log V and 1/V. m and log s are what a row's log-softmax needs, exactly as PyTorch's.

and the mean over the n_valid rows whose target is not `ignore_index` (PyTorch's
F.cross_entropy with reduction='mean'). Where every target is ignored the mean is 0, not
PyTorch's NaN (0/0), so a batch made only of padding adds nothing to a training step.
Logits may be -inf (a masked vocabulary); a counted row whose logits are all -inf has no softmax
and gives NaN, as in PyTorch.

The forward kernel reads a row once, keeping a running max m and a running sum s of exp(x - m)
(rescaled by exp(m_old - m_new) as m grows, so logits of any magnitude stay finite; while m is still
-inf, after leading blocks of -inf logits, the exponents are taken relative to 0 instead, as
exp(-inf - (-inf)) is NaN), and picks x_t; it saves (m, log s) (fp32, a pair per row). The backward
kernel reads the row again and writes (softmax - onehot) * grad_output / n_valid, computed in fp32
and rounded once, into a new tensor. Three passes over (N, V) in all, and a graph that can be
backpropagated through as often as autograd allows.

`inplace_backward=True` trades that for memory: the forward writes the mean loss's gradient,
(softmax - onehot) / n_valid (n_valid counted first, on the device), over the logits themselves, and
the backward scales it in place by the upstream gradient, a pass whose programs return at once when
that is 1 (`loss.backward()`): one read and one write of the logits in all, forward and backward,
and no second (N, V) tensor ever exists; such a graph supports one backward only. A forward that
writes the gradient (this, and fused linear cross-entropy's chunks) loads a row that fits in
registers (up to MAX_ROW_ON_CHIP logits) as one block and keeps it for the gradient: the row is read
from memory once; a longer row streams through blocks twice.

Whether a gradient is needed is decided in the public functions, from grad mode and each input's
requires_grad (inside autograd.Function.forward grad mode is always off, and needs_input_grad
ignores torch.no_grad): under no_grad or inference_mode the loss takes a forward-only path that
writes no gradient, allocates no buffer for one and never overwrites logits.

Fused linear cross-entropy (`fastlm.kernels.linear_cross_entropy`) runs this file's row kernel
on chunks of logits it computes itself. Targets are checked in the public functions; one outside
[0, V) other than ignore_index that reaches a kernel gives a NaN loss there, never a read out of
bounds.
"""

from __future__ import annotations

import torch

from fastlm.backend import interpreting, use_triton
from fastlm.kernels import cross_entropy_options
from fastlm.kernels._common import (
    as_rows,
    check_float,
    check_values,
    empty,
    refuse_double_backward,
    tl,
    triton,
)
from fastlm.kernels._vocab_blocks import (  # noqa: F401 (MAX_BLOCK_V: the tests read it here)
    MAX_BLOCK_V,
    MAX_BLOCK_V_INTERPRETER,
    _block_v,
    _load_block,
    _online_lse_step,
)
from fastlm.options import check

#: Longest row the forward keeps on chip (in registers, 64 fp32 a thread at 32 warps) when it also
#: writes the gradient, so that the row is read from memory once instead of twice. A longer row
#: streams through MAX_BLOCK_V blocks twice. The interpreter's is MAX_BLOCK_V_INTERPRETER, so
#: that the tests' vocabularies take both paths.
MAX_ROW_ON_CHIP = 65536

# --------------------------------------------------------------------------------------------
# Reference math (the PyTorch backend, and what the tests and benchmarks compare with)
# --------------------------------------------------------------------------------------------


def cross_entropy_ref(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """The mean cross-entropy in PyTorch, fp32 inside (fp64 for fp64), with the kernel's rules:
    0 when every target is ignored, and an ignored row adds nothing, not even a NaN gradient
    (its logits never enter the math)."""
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.reshape(-1, logits.shape[-1]).to(compute)  # (N, V)
    flat_targets = targets.reshape(-1)
    counted = flat_targets != ignore_index
    x = torch.where(counted[:, None], x, 0.0)
    # log_softmax is (x - max) - log sum exp(x - max): logsumexp(x) - x_t would round the
    # log-sum to nothing where every logit is near finfo.min or finfo.max.
    log_probs = torch.log_softmax(x, dim=-1)
    target_log_prob = log_probs.gather(-1, torch.where(counted, flat_targets, 0)[:, None])
    row_loss = torch.where(counted, -target_log_prob.squeeze(-1), 0.0)
    return row_loss.sum() / counted.sum().clamp_min(1)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _softmax(x, row_max, log_sum):
    """exp(x - lse) without forming lse = row_max + log_sum, which rounds to row_max where the
    logits are huge. In base 2, so that the scale and the shift are one FMA an element (with
    tl.exp's own multiply by log2(e) after the two subtractions, the forward that keeps a row in
    registers spills on sm_80)."""
    log2_e = 1.4426950408889634
    return tl.exp2((x - row_max) * log2_e - log_sum * log2_e)


@triton.jit
def _store_grad(dlogits_row, x, cols, mask, row_max, log_sum, target, counted, scale):
    """(softmax - onehot) * scale of a block (0 for an ignored row), in DLogits' dtype."""
    grad = (_softmax(x, row_max, log_sum) - tl.where(cols == target, 1.0, 0.0)) * scale
    grad = tl.where(counted, grad, 0.0)
    tl.store(dlogits_row + cols, grad.to(dlogits_row.dtype.element_ty), mask=mask)


@triton.jit
def _cross_entropy_fwd_kernel(
    Logits, Targets, Loss, Stats, DLogits, GradScale,  #
    stride_lm, stride_dm,  #
    n_cols, ignore_index,  #
    BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr, ROW_ON_CHIP: tl.constexpr,  #
    SCALE_GRAD: tl.constexpr
):
    """One program per row: Loss[row] and Stats[row] = (max, log sum) (fp32) and, under
    WRITE_GRAD, DLogits[row] = softmax - onehot, times GradScale (one fp32 on the device) under
    SCALE_GRAD. ROW_ON_CHIP: one block holds the whole row, loaded once and kept in registers
    for the gradient; else the row streams through blocks, a second time for the gradient."""
    row = tl.program_id(0).to(tl.int64)
    logits_row = Logits + row * stride_lm
    dlogits_row = DLogits + row * stride_dm
    target = tl.load(Targets + row).to(tl.int64)
    counted = target != ignore_index
    in_vocab = (target >= 0) & (target < n_cols)

    # Ignored and out-of-vocabulary targets (-100, say) are masked off, so never read out of bounds.
    target_logit = tl.load(logits_row + target, mask=in_vocab, other=0.0).to(tl.float32)
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.zeros([], tl.float32)
    if ROW_ON_CHIP:
        x_row, cols_row, mask_row = _load_block(logits_row, 0, n_cols, BLOCK_V)
        running_max, running_sum = _online_lse_step(x_row, running_max, running_sum)
    else:
        for start in range(0, n_cols, BLOCK_V):
            x, _, _ = _load_block(logits_row, start, n_cols, BLOCK_V)
            running_max, running_sum = _online_lse_step(x, running_max, running_sum)
    log_sum = tl.log(running_sum)

    loss = tl.where(in_vocab, (running_max - target_logit) + log_sum, float("nan"))
    tl.store(Loss + row, tl.where(counted, loss, 0.0))
    tl.store(Stats + 2 * row, running_max)
    tl.store(Stats + 2 * row + 1, log_sum)

    if WRITE_GRAD:
        scale = 1.0
        if SCALE_GRAD:
            scale = tl.load(GradScale)
        if ROW_ON_CHIP:
            _store_grad(
                dlogits_row, x_row, cols_row, mask_row, running_max, log_sum, target, counted, scale
            )
        else:
            for start in range(0, n_cols, BLOCK_V):
                x, cols, mask = _load_block(logits_row, start, n_cols, BLOCK_V)
                _store_grad(
                    dlogits_row, x, cols, mask, running_max, log_sum, target, counted, scale
                )


@triton.jit
def _cross_entropy_bwd_kernel(
    Logits, Targets, Stats, Scale, DLogits,  #
    stride_lm, stride_dm,  #
    n_cols, ignore_index,  #
    BLOCK_V: tl.constexpr
):
    """One program per (row, block of BLOCK_V columns): DLogits = (softmax - onehot) * Scale,
    Scale = grad_output / n_valid (one fp32 on the device); 0 for an ignored row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < n_cols
    target = tl.load(Targets + row).to(tl.int64)
    row_max, log_sum = tl.load(Stats + 2 * row), tl.load(Stats + 2 * row + 1)
    x = tl.load(Logits + row * stride_lm + cols, mask=mask, other=float("-inf")).to(tl.float32)
    grad = (_softmax(x, row_max, log_sum) - tl.where(cols == target, 1.0, 0.0)) * tl.load(Scale)
    # An ignored row may have no softmax at all (all logits -inf): select 0, never multiply NaN.
    grad = tl.where(target != ignore_index, grad, 0.0)
    tl.store(DLogits + row * stride_dm + cols, grad.to(DLogits.dtype.element_ty), mask=mask)


@triton.jit
def _scale_rows_kernel(DLogits, Scale,  #
                       stride_dm, n_cols,  #
                       BLOCK_V: tl.constexpr):
    """DLogits *= Scale (one fp32 on the device), one program per (row, block of columns); when
    Scale is 1 (loss.backward() with nothing in between) every program returns before touching
    the rows, so that pass costs the logits no memory traffic."""
    scale = tl.load(Scale)
    if scale == 1.0:
        return
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < n_cols
    ptrs = DLogits + row * stride_dm + cols
    grad = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * scale
    tl.store(ptrs, grad.to(DLogits.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _row_on_chip(n_cols: int) -> tuple[int, int] | None:
    """(BLOCK_V, num_warps) holding a whole row of n_cols logits in registers, at most 64 fp32 a
    thread, or None where the row is longer than MAX_ROW_ON_CHIP."""
    max_row = MAX_BLOCK_V_INTERPRETER if interpreting() else MAX_ROW_ON_CHIP
    block_v = triton.next_power_of_2(n_cols)
    if block_v > max_row:
        return None
    return block_v, min(32, max(4, block_v // (32 * 16)))


def _cross_entropy_rows(
    rows: torch.Tensor, targets: torch.Tensor, ignore_index: int, row_loss: torch.Tensor,
    stats: torch.Tensor, dlogits: torch.Tensor | None, grad_scale: torch.Tensor | None = None
) -> None:
    """Per-row losses of rows (N, V) (unit column stride) into row_loss (N,) fp32 and their
    (max, log sum of exp(x - max)) into stats (N, 2) fp32 (contiguous), and softmax - onehot
    (times grad_scale, one fp32 on the device, when given) into dlogits (N, V) unless it is None;
    dlogits may be rows."""
    n_rows, n_cols = rows.shape
    if n_rows == 0:
        return
    write_grad = dlogits is not None
    # Only a forward that also writes the gradient reads the row twice, so only it keeps the row.
    on_chip = _row_on_chip(n_cols) if write_grad else None
    block_v, num_warps = on_chip or _block_v(n_cols)
    grad_out = dlogits if write_grad else rows  # never written when WRITE_GRAD is off
    _cross_entropy_fwd_kernel[(n_rows, )](
        rows, targets, row_loss, stats, grad_out, stats if grad_scale is None else grad_scale,
        rows.stride(0), grad_out.stride(0), n_cols, ignore_index, BLOCK_V=block_v,
        WRITE_GRAD=write_grad, ROW_ON_CHIP=on_chip is not None, SCALE_GRAD=grad_scale is not None,
        num_warps=num_warps
    )


def _cross_entropy_grad_rows(
    rows: torch.Tensor, targets: torch.Tensor, ignore_index: int, stats: torch.Tensor,
    scale: torch.Tensor
) -> torch.Tensor:
    """(softmax - onehot) * scale of rows (N, V) as a new tensor of rows' dtype, from the
    forward's stats (N, 2) (contiguous)."""
    dlogits = empty(rows.shape, device=rows.device, dtype=rows.dtype)
    n_rows, n_cols = rows.shape
    if n_rows == 0:
        return dlogits
    block_v, num_warps = _block_v(n_cols)
    _cross_entropy_bwd_kernel[(n_rows, triton.cdiv(n_cols, block_v))](
        rows, targets, stats, scale, dlogits, rows.stride(0), dlogits.stride(0), n_cols,
        ignore_index, BLOCK_V=block_v, num_warps=num_warps
    )
    return dlogits


def _scale_rows(dlogits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """dlogits *= scale (one fp32 on the device), in place; free when scale is 1."""
    rows = _unit_stride_rows(dlogits)
    if rows is None:  # another layout: a plain multiply (the in-place path's rare fallback)
        return dlogits.mul_(scale)
    n_rows, n_cols = rows.shape
    if n_rows:
        block_v, num_warps = _block_v(n_cols)
        _scale_rows_kernel[(n_rows, triton.cdiv(n_cols, block_v))](
            rows, scale, rows.stride(0), n_cols, BLOCK_V=block_v, num_warps=num_warps
        )
    return dlogits


def _count_valid(targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """n_valid as a device tensor (no host sync), at least 1 so that all-ignored gives 0, not
    NaN."""
    return (targets != ignore_index).sum().clamp_min(1)


def _mean_loss(
    rows: torch.Tensor, flat_targets: torch.Tensor, ignore_index: int, dlogits: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mean loss of rows (N, V), n_valid and the rows' stats (N, 2) (see
    _cross_entropy_rows); the mean loss's gradient, (softmax - onehot) / n_valid, into dlogits
    unless it is None (n_valid counted first, on the device)."""
    row_loss = empty((rows.shape[0], ), device=rows.device, dtype=torch.float32)
    stats = empty((rows.shape[0], 2), device=rows.device, dtype=torch.float32)
    n_valid = _count_valid(flat_targets, ignore_index)
    grad_scale = None if dlogits is None else 1.0 / n_valid.float()
    _cross_entropy_rows(rows, flat_targets, ignore_index, row_loss, stats, dlogits, grad_scale)
    return row_loss.sum() / n_valid, n_valid, stats


# --------------------------------------------------------------------------------------------
# Registration: torch.ops.fastlm.cross_entropy, .cross_entropy_backward, .cross_entropy_
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("fastlm::cross_entropy", mutates_args=())
def _cross_entropy_op(logits: torch.Tensor, targets: torch.Tensor,
                      ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss, n_valid, stats (N, 2) fp32: each row's max and log sum of exp(x - max))."""
    return _mean_loss(as_rows(logits), targets.reshape(-1).contiguous(), ignore_index, None)


@_cross_entropy_op.register_fake
def _(logits, targets, ignore_index):
    rows = logits.shape[:-1].numel()
    return (
        logits.new_empty((), dtype=torch.float32), targets.new_empty((), dtype=torch.int64),
        logits.new_empty((rows, 2), dtype=torch.float32)
    )


@torch.library.custom_op("fastlm::cross_entropy_backward", mutates_args=())
def _cross_entropy_backward_op(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, stats: torch.Tensor,
    scale: torch.Tensor
) -> torch.Tensor:
    """dlogits = (softmax - onehot) * scale for counted rows, 0 for ignored ones; logits' shape.
    stats: the forward's (N, 2)."""
    flat_targets, stats = targets.reshape(-1).contiguous(), stats.contiguous()
    dlogits = _cross_entropy_grad_rows(as_rows(logits), flat_targets, ignore_index, stats, scale)
    return dlogits.view(logits.shape)


@_cross_entropy_backward_op.register_fake
def _(logits, targets, ignore_index, stats, scale):
    return logits.new_empty(logits.shape)


def _unit_stride_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """logits as (rows, V) in their own memory with a unit last-dim stride, or None where their
    layout has no such view."""
    if logits.stride(-1) != 1:
        return None
    try:
        return logits.view(-1, logits.shape[-1])
    except RuntimeError:  # rows not one stride apart
        return None


@torch.library.custom_op("fastlm::cross_entropy_", mutates_args=("logits", ))
def _cross_entropy_inplace_op(logits: torch.Tensor, targets: torch.Tensor,
                              ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, n_valid), with the mean loss's gradient (softmax - onehot) / n_valid written over
    logits. The kernel writes rows with a unit last-dim stride one stride apart; logits in another
    layout get the gradient through a contiguous copy."""
    rows = _unit_stride_rows(logits)
    work = rows if rows is not None else logits.contiguous().view(-1, logits.shape[-1])
    loss, n_valid, _ = _mean_loss(work, targets.reshape(-1).contiguous(), ignore_index, work)
    if rows is None:
        logits.copy_(work.view(logits.shape))
    return loss, n_valid


@_cross_entropy_inplace_op.register_fake
def _(logits, targets, ignore_index):
    return logits.new_empty((), dtype=torch.float32), targets.new_empty((), dtype=torch.int64)


def _grad_scale(grad_output: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
    return grad_output.float() / n_valid


def _cross_entropy_setup(ctx, inputs, output):
    logits, targets, ignore_index = inputs
    _, n_valid, stats = output
    ctx.set_materialize_grads(False)  # no zero tensors for the outputs without a gradient
    ctx.mark_non_differentiable(n_valid, stats)
    ctx.save_for_backward(logits, targets, stats, n_valid)
    ctx.ignore_index = ignore_index


def _cross_entropy_grad(ctx, grad_loss, *_):
    logits, targets, stats, n_valid = ctx.saved_tensors
    scale = _grad_scale(grad_loss, n_valid)
    return (_cross_entropy_backward_op(logits, targets, ctx.ignore_index, stats, scale), None, None)


torch.library.register_autograd(
    "fastlm::cross_entropy", _cross_entropy_grad, setup_context=_cross_entropy_setup
)
refuse_double_backward("fastlm::cross_entropy_backward", "cross_entropy")


class _CrossEntropyInPlace(torch.autograd.Function):
    """cross_entropy(..., inplace_backward=True): the mean loss's gradient is written over logits
    by the mutating op (PyTorch registers no autograd formula for one, hence this Function), and
    the backward scales it there by the upstream gradient (`_scale_rows`: no memory traffic when
    that is 1, as after loss.backward()), so it runs once only."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index):
        loss, n_valid = _cross_entropy_inplace_op(logits, targets, ignore_index)
        # logits now hold the gradient: any other node that saved them must fail loudly.
        ctx.mark_dirty(logits)
        ctx.set_materialize_grads(False)  # the returned logits get no gradient: no zero tensor
        ctx.save_for_backward(logits, n_valid)
        ctx.scaled = False
        return loss, logits

    @staticmethod
    def backward(ctx, grad_loss, _):
        if torch.is_grad_enabled():  # create_graph=True: the gradient was computed without a graph
            raise RuntimeError(
                "fastlm.cross_entropy: second derivatives are not supported "
                "(create_graph=True through its backward)"
            )
        if ctx.scaled:
            raise RuntimeError(
                "cross_entropy(inplace_backward=True): a second backward through the same graph "
                "(retain_graph=True). The first scaled the gradient in place (over the logits), "
                "so it cannot be used again: compute the loss again, or use the default "
                "inplace_backward=False."
            )
        ctx.scaled = True
        dlogits, _ = ctx.saved_tensors
        return _scale_rows(dlogits, grad_loss.float()), None, None


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def _check_targets(
    targets: object, leading_shape: torch.Size, device: torch.device, of: str
) -> None:
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be int64 or int32, got {targets.dtype}")
    if targets.shape != leading_shape:
        raise ValueError(
            f"targets must have the leading shape of {of}, {tuple(leading_shape)}, "
            f"got {tuple(targets.shape)}"
        )
    if targets.device != device:
        raise ValueError(f"targets is on {targets.device}, but {of} is on {device}")


def check_ignore_index(ignore_index: object) -> None:
    check("ignore_index", ignore_index)


def _check_target_values(targets: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Targets in [0, vocab_size) or ignore_index: ValueError for CPU targets, checked on the
    host; on a GPU and under torch.compile a device-side assert (no host sync per step)."""
    valid = ((targets >= 0) & (targets < vocab_size)) | (targets == ignore_index)
    check_values(
        targets, valid,
        f"targets must lie in [0, {vocab_size}) or equal ignore_index={ignore_index}"
    )


def _overwritable(logits: torch.Tensor) -> None:
    """ValueError unless writing the gradient over logits is safe."""
    if logits.is_leaf or (
        logits._base is not None and logits._base.requires_grad and logits._base.is_leaf
    ):
        raise ValueError(
            "inplace_backward=True would overwrite logits, a leaf tensor that requires "
            "grad (or a view of one)"
        )
    if torch._debug_has_internal_overlap(logits) == 1:  # 1: yes (0: no, 2: too hard to tell)
        raise ValueError(
            "inplace_backward=True needs logits whose elements do not share memory "
            "(an expanded tensor, say): pass logits.contiguous()"
        )


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, *,
    inplace_backward: bool = False, softcap: float = 0.0, reduction: str = "mean",
    label_smoothing: float = 0.0, z_loss: float = 0.0, return_accuracy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of logits (..., V) against targets (...), skipping ignore_index.

    F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index) except
    that the result is 0 (not NaN) when every target is ignored. The forward saves each row's max
    and log-sum-exp relative to it; the backward computes the gradient from the logits and those
    into a new tensor. Without a gradient (torch.no_grad, inference_mode, or logits that do not
    require grad) logits are never written. Second derivatives are not supported (an error, not a
    silent zero).

    The options (`fastlm.kernels.cross_entropy_options`) run on their own kernels;
    inplace_backward does not apply to them.

    Args:
        logits: (..., V) float32, float16 or bfloat16, any strides; V at least 1.
        targets: int64 (or int32) with logits' leading shape (...), on logits' device, each in
            [0, V) or equal to ignore_index. CPU targets are checked on the host (ValueError); on a
            GPU a bad target trips a device-side assert (checking on the host would need a sync).
        ignore_index: the target value whose rows add nothing (default -100).
        inplace_backward: default False. True: the forward writes the gradient into `logits`
            itself, and the backward scales it there, saving that tensor: when a gradient is needed
            and logits' rows are one stride apart with a unit last-dim stride, logits are
            overwritten and must not be used afterwards, and the graph supports one backward (a
            second, after retain_graph=True, raises RuntimeError); otherwise it is the default path.
            The PyTorch backend ignores it. A leaf that requires grad (or a view of one) and logits
            whose elements overlap are refused; any other autograd node that saved `logits` raises
            at its backward, as after any in-place op.
        softcap: c > 0 caps the logits at c * tanh(x / c) first (Gemma 2's final logits); 0 (the
            default) is off.
        reduction: "mean" (the default), "sum", or "none" (each row's loss, logits' leading shape,
            0 where ignored).
        label_smoothing: eps in [0, 1], PyTorch's (default 0).
        z_loss: w >= 0 adds w * lse^2 per counted row (default 0).
        return_accuracy: True also returns the accuracy, the fraction of counted rows whose
            largest logit is the target (default False).

    Returns:
        The loss, fp32 (a scalar, or logits' leading shape with reduction="none"); with
        return_accuracy, (loss, accuracy).

    Raises:
        TypeError: logits not a tensor of float32, float16 or bfloat16; targets not an int64/int32
            tensor; ignore_index not an int; an option of the wrong type.
        ValueError: an empty vocabulary dim; targets of another leading shape or device; (CPU
            targets) a target outside [0, V) other than ignore_index; an option out of range;
            with inplace_backward, logits that are a leaf requiring grad (or a view of one) or
            whose elements share memory.
    """
    check_float("logits", logits)
    if logits.ndim == 0 or logits.shape[-1] == 0:
        raise ValueError(
            f"logits must have a non-empty last (vocabulary) dim, got shape {tuple(logits.shape)}"
        )
    _check_targets(targets, logits.shape[:-1], logits.device, "logits")
    check_ignore_index(ignore_index)
    options = cross_entropy_options.check_options(
        softcap, reduction, label_smoothing, z_loss, return_accuracy
    )
    _check_target_values(targets, logits.shape[-1], ignore_index)
    if options != cross_entropy_options.NO_OPTIONS:
        return cross_entropy_options.cross_entropy_with_options(
            logits, targets, ignore_index, *options
        )
    if not use_triton(logits):
        return cross_entropy_ref(logits, targets, ignore_index)
    # Decided here: inside the ops grad mode is always off.
    need_grad = logits.requires_grad and torch.is_grad_enabled()
    if need_grad and inplace_backward:
        _overwritable(logits)
        # Written in place only where each element is plainly its own and the kernel can write
        # the rows where they are; otherwise the default path (its gradient a new tensor).
        if torch._debug_has_internal_overlap(logits) == 0 and _unit_stride_rows(logits) is not None:
            return _CrossEntropyInPlace.apply(logits, targets, ignore_index)[0]
    return _cross_entropy_op(logits, targets, ignore_index)[0]


def _option_names(options: tuple) -> dict:
    names = ("softcap", "reduction", "label_smoothing", "z_loss", "return_accuracy")
    return dict(zip(names, options))
