"""The vocabulary-parallel fused linear cross-entropy: the LM head sharded by vocabulary rows.

Each rank of a tensor-parallel group of P ranks holds a shard of the vocabulary: rows
[r V_r, (r + 1) V_r) of the LM head's weight (V_r = V / P), and never the whole weight or the
(tokens, V) logits. For each token row and its target t, with z the (capped) logits, Megatron's
vocabulary-parallel cross-entropy combines per-shard statistics:

    m    = max_r m_r                                   all-reduce MAX    (m_r: the shard's max)
    s    = sum_r s_r exp(m_r - m)                      all-reduce SUM    (s_r = sum exp(z - m_r))
    z_t  = sum_r [t in shard r] z_t                    all-reduce SUM
    lse  = m + log s
    loss = (1 - eps) (lse - z_t) + eps (lse - sum_j z_j / V) + w lse^2

(eps: label smoothing, its sum of z one more entry of the SUM; w: the z-loss weight). The two
all-reduces carry 1 and 2 (3 with label smoothing) fp32 numbers per row, for every chunk at once.
The gradient with respect to a shard's logits needs only the combined statistics and that
shard's logits, so the backward is local:

    dz_j = (1 + 2 w lse) p_j - (1 - eps) [j == t] - eps / V,   p_j = exp(z_j - lse)
    dx_j = dz_j (1 - (z_j / c)^2)                              (under a soft cap c)

dx = sum_r dlogits_r W_r is the column-parallel head's input gradient: all-reduced over the
group (x replicated), or reduce-scattered back to each rank's tokens (sequence parallelism, x
gathered in the forward). dW_r = dlogits_r^T x is exact on each rank.

Chunks: the forward runs the tokens through in chunks (one chunk's (tokens, V_r) logits alive at
a time), the kernels of `fastlm.kernels.cross_entropy_options` writing each row's max and log sum
of exps; the backward recomputes each chunk's logits (the statistics are global only after the
forward's all-reduces) and the options' backward kernel turns them into dlogits with the global
statistics, then two GEMMs give dx and dW. Memory: x, the weight shard, O(tokens) statistics and
one chunk's logits; GEMMs: one in the forward, three in the backward (as the single-GPU op's
forward with its gradient written, plus the recomputed logits).

Here: `vocab_range`, one shard's statistics and gradient, their combination over the group, the
autograd Functions over a shard of the head (`vocab_parallel_linear_cross_entropy`, sequence
parallelism's tokens gathered by `fastlm.tensor_parallel.tokens.gather_rows`) or of its logits
(`vocab_parallel_cross_entropy`), and `lm_head_cross_entropy`, the loss of an LM head that may
be a DTensor (Hugging Face's tensor parallelism).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from fastlm.backend import use_triton
from fastlm.distributed import mesh_group
from fastlm.kernels._common import check_float
from fastlm.kernels.cross_entropy import _check_target_values, _check_targets, check_ignore_index
from fastlm.kernels.cross_entropy_options import _rows_backward, _rows_forward, check_options
from fastlm.kernels.linear import add_product
from fastlm.kernels.linear_cross_entropy import default_chunk_size, linear_cross_entropy
from fastlm.tensor_parallel.tokens import gather_rows

__all__ = [
    "lm_head_cross_entropy",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_linear_cross_entropy",
    "vocab_range",
]


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of the vocabulary rank `rank` of `world_size` holds.

    Args:
        vocab_size: V, divisible by world_size.
        rank, world_size: the rank in the tensor-parallel group and its size.

    Returns:
        (rank * V / P, (rank + 1) * V / P).

    Raises:
        ValueError: V not divisible by world_size.
    """
    if vocab_size % world_size:
        raise ValueError(
            f"the vocabulary ({vocab_size}) must be divisible by the tensor-parallel size "
            f"{world_size}: each rank holds an equal shard"
        )
    shard = vocab_size // world_size
    return rank * shard, (rank + 1) * shard


# --------------------------------------------------------------------------------------------
# One shard's rows: the statistics, and the gradient from the combined ones
# --------------------------------------------------------------------------------------------


def _capped(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    """z = c tanh(x / c) in fp32 (x itself, fp32, without a cap)."""
    z = logits.float()
    return softcap * torch.tanh(z / softcap) if softcap else z


def _local_targets(targets, start: int, end: int, ignore_index: int) -> torch.Tensor:
    """Each target as a column of this shard; a target on another shard becomes a column no
    shard has (never ignore_index: the row still counts, its softmax still gets a gradient)."""
    absent = -1 if ignore_index != -1 else -2
    inside = (targets >= start) & (targets < end)
    local = torch.where(inside, targets - start, absent)
    return torch.where(targets == ignore_index, ignore_index, local)


def _shard_stats(logits, local, ignore_index, softcap, smoothing):
    """(n, 4) fp32 of this shard's rows: max and log sum of exps of z (the kernels'), the
    target's z where this shard holds it (0 elsewhere), and the sum of z (with smoothing)."""
    n = logits.shape[0]
    stats = torch.zeros((n, 4), device=logits.device, dtype=torch.float32)
    if use_triton(logits):  # every row as ignored: the kernel's statistics only, no loss
        ignored = torch.full_like(local, ignore_index)
        _, max_log_sum, _ = _rows_forward(logits, ignored, ignore_index, (softcap, 0.0, 0.0))
        stats[:, :2] = max_log_sum
    else:
        z = _capped(logits, softcap)
        stats[:, 0] = z.max(-1).values
        stats[:, 1] = torch.logsumexp(z - stats[:, :1], -1)
    held = (local >= 0) & (local < logits.shape[1])
    target_logit = logits.gather(1, torch.where(held, local, 0)[:, None])[:, 0]
    stats[:, 2] = torch.where(held, _capped(target_logit, softcap), 0.0)
    if smoothing:
        stats[:, 3] = _capped(logits, softcap).sum(-1)
    return stats


def _combine(stats: torch.Tensor, group) -> torch.Tensor:
    """The shards' (n, 4) statistics combined over the group: (n, 4) global max, log sum, target
    z, sum of z. Two all-reduces: MAX of the maxima, SUM of the rest."""
    row_max = stats[:, 0].clone()
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    # A row whose shard is all -inf (a masked vocabulary) has s_r = 0: exp(-inf) is 0, not NaN.
    shifted = torch.where(
        stats[:, 0] > float("-inf"), torch.exp(stats[:, 1] + stats[:, 0] - row_max), 0.0
    )
    sums = torch.stack((shifted, stats[:, 2], stats[:, 3]))  # (3, n)
    dist.all_reduce(sums, group=group)
    return torch.stack((row_max, torch.log(sums[0]), sums[1], sums[2]), dim=1)


def _row_losses(combined, targets, ignore_index, vocab_size, smoothing, z_loss):
    """(n,) fp32 losses from the combined statistics; 0 for ignored rows."""
    row_max, log_sum, target_z, sum_z = combined.unbind(1)
    lse = row_max + log_sum
    loss = (row_max - target_z) + log_sum  # never through a rounded lse
    if smoothing:
        loss = (1 - smoothing) * loss + smoothing * ((row_max - sum_z / vocab_size) + log_sum)
    if z_loss:
        loss = loss + z_loss * lse * lse
    return torch.where(targets != ignore_index, loss, 0.0)


def _shard_grad(logits, local, ignore_index, combined, scale, options, vocab_size):
    """dlogits (n, V_r) in logits' dtype of this shard's rows, from the combined statistics and
    each row's scale (n,) fp32: the options' backward kernel with the global max and log sum
    (smoothing's -eps [j == t] - eps / V term added here, as the kernel's would take V_r)."""
    softcap, smoothing, z_loss = options
    counted = local != ignore_index
    if use_triton(logits):
        stats = combined[:, :2].contiguous()
        dlogits = _rows_backward(logits, local, ignore_index, stats, scale, (softcap, 0.0, z_loss))
    else:
        z = _capped(logits, softcap)
        lse = (combined[:, 0] + combined[:, 1])[:, None]
        onehot = (
            torch.zeros_like(z).scatter_(
                1, torch.where((local >= 0) & counted, local, 0)[:, None], 1.0
            )
            * ((local >= 0) & counted)[:, None]
        )
        dz = (1 + 2 * z_loss * lse) * torch.exp(z - lse) - onehot
        if softcap:
            dz = dz * (1 - (z / softcap) ** 2)
        dlogits = torch.where(counted[:, None], dz * scale[:, None], 0.0).to(logits.dtype)
    if smoothing:
        held = (local >= 0) & (local < logits.shape[1])
        onehot = torch.zeros(logits.shape, device=logits.device, dtype=torch.float32)
        onehot.scatter_(1, torch.where(held, local, 0)[:, None], held[:, None].float())
        term = smoothing * (onehot - 1.0 / vocab_size)
        if softcap:
            term = term * (1 - (_capped(logits, softcap) / softcap) ** 2)
        term = torch.where(counted[:, None], term * scale[:, None], 0.0)
        dlogits = (dlogits.float() + term).to(logits.dtype)
    return dlogits


# --------------------------------------------------------------------------------------------
# Autograd: row losses of a vocabulary shard's logits, or of x @ W_r^T in chunks
# --------------------------------------------------------------------------------------------


class _VocabParallelLinear(torch.autograd.Function):
    """Row losses (N,) of x (N, C) @ weight (V_r, C)^T, the vocabulary sharded over `group`."""

    @staticmethod
    def forward(ctx, x, weight, targets, group, span, ignore_index, chunk_size, options, reduce):
        start, end, vocab_size = span
        local = _local_targets(targets, start, end, ignore_index)
        weight_x = weight.to(x.dtype)
        stats = []
        for first in range(0, x.shape[0], chunk_size):
            rows = slice(first, first + chunk_size)
            logits = x[rows] @ weight_x.T  # (chunk, V_r), the only logits alive
            stats.append(_shard_stats(logits, local[rows], ignore_index, options[0], options[1]))
        stats = torch.cat(stats) if stats else x.new_zeros((0, 4), dtype=torch.float32)
        combined = _combine(stats, group)
        ctx.save_for_backward(x, weight, local, combined)
        ctx.args = (group, ignore_index, chunk_size, options, vocab_size, reduce)
        return _row_losses(combined, targets, ignore_index, vocab_size, *options[1:])

    @staticmethod
    def backward(ctx, grad_rows):
        x, weight, local, combined = ctx.saved_tensors
        group, ignore_index, chunk_size, options, vocab_size, reduce = ctx.args
        weight_x = weight.to(x.dtype)
        scale = grad_rows.float().contiguous()
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        need_dweight = ctx.needs_input_grad[1]
        dweight = torch.zeros(weight.shape, device=x.device, dtype=torch.float32)
        for first in range(0, x.shape[0], chunk_size):
            rows = slice(first, first + chunk_size)
            logits = x[rows] @ weight_x.T  # recomputed: the statistics are global only now
            dlogits = _shard_grad(
                logits, local[rows], ignore_index, combined[rows], scale[rows], options, vocab_size
            )
            if dx is not None:
                torch.mm(dlogits, weight_x, out=dx[rows])
            if need_dweight:
                add_product(dweight, dlogits.T, x[rows])
        if dx is not None and reduce:  # x replicated over the group: its gradient sums them
            dist.all_reduce(dx, group=group)
        grad_weight = dweight.to(weight.dtype) if need_dweight else None
        return dx, grad_weight, *(None,) * 7


class _VocabParallelLogits(torch.autograd.Function):
    """Row losses (N,) of logits (N, V_r), the vocabulary sharded over `group`."""

    @staticmethod
    def forward(ctx, logits, targets, group, span, ignore_index, options):
        start, end, vocab_size = span
        local = _local_targets(targets, start, end, ignore_index)
        combined = _combine(_shard_stats(logits, local, ignore_index, *options[:2]), group)
        ctx.save_for_backward(logits, local, combined)
        ctx.args = (ignore_index, options, vocab_size)
        return _row_losses(combined, targets, ignore_index, vocab_size, *options[1:])

    @staticmethod
    def backward(ctx, grad_rows):
        logits, local, combined = ctx.saved_tensors
        ignore_index, options, vocab_size = ctx.args
        scale = grad_rows.float().contiguous()
        dlogits = _shard_grad(logits, local, ignore_index, combined, scale, options, vocab_size)
        return dlogits, *(None,) * 5


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def _check_common(targets, of: str, tensor, ignore_index, group, options) -> tuple:
    """The checks both losses share; (the ProcessGroup, the (softcap, smoothing, z-loss) floats
    the autograd Functions take)."""
    softcap, reduction, smoothing, z_loss, return_accuracy = options
    _check_targets(targets, tensor.shape[:-1], tensor.device, of)
    check_ignore_index(ignore_index)
    check_options(softcap, reduction, smoothing, z_loss, return_accuracy)
    if return_accuracy:
        raise ValueError(
            "return_accuracy: the argmax over a sharded vocabulary is not computed by the "
            "vocabulary-parallel loss; compute accuracy from gathered predictions"
        )
    return mesh_group(group, "tensor"), (float(softcap), float(smoothing), float(z_loss))


def _reduce(rows, targets, ignore_index, reduction):
    if reduction == "none":
        return rows.view(targets.shape)
    total = rows.sum()
    if reduction == "sum":
        return total
    return total / (targets != ignore_index).sum().clamp_min(1)


def _span(vocab_shard: int, group) -> tuple[int, int, int]:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return rank * vocab_shard, (rank + 1) * vocab_shard, world * vocab_shard


def vocab_parallel_linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    group=None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    *,
    sequence_parallel: bool = False,
    softcap: float = 0.0,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    return_accuracy: bool = False,
) -> torch.Tensor:
    """`linear_cross_entropy(x, W, targets)` with W's vocabulary rows sharded over `group`.

    Every rank of the group calls it with its shard of the LM head, rows [r V / P, (r + 1) V / P)
    of W (`vocab_range`), and the whole vocabulary's targets. No rank holds the whole weight or
    any (tokens, V) logits: each projects its shard chunk by chunk, and the row statistics are
    combined by two all-reduces (see the module docstring). Every rank returns the same loss.

    Args:
        x: (..., C) float32/float16/bfloat16, the final norm's output: the same tokens on every
            rank, or with sequence_parallel each rank's own tokens (then gathered here, and their
            gradient reduce-scattered back).
        weight: (V / P, C), this rank's shard, x's dtype or fp32 (master weights).
        targets: int64/int32 of x's leading shape, in [0, V) (the whole vocabulary) or
            ignore_index; with sequence_parallel, this rank's tokens' targets.
        group: the tensor-parallel ProcessGroup, a DeviceMesh (1-D or with a "tensor" dim), or
            None for the default group.
        ignore_index: the target value whose rows add nothing (default -100).
        chunk_size: token rows per chunk (default: `default_chunk_size` for the shard's width).
        sequence_parallel: x and targets are this rank's tokens (default False: the same on every
            rank).
        softcap, reduction, label_smoothing, z_loss: as in `fastlm.linear_cross_entropy`
            (reduction "none" returns every gathered token's loss under sequence_parallel).

    Returns:
        The loss, fp32, the same on every rank: a scalar, or the (gathered) targets' shape with
        reduction="none". x's gradient is whole (all-reduced, or reduce-scattered to each rank's
        tokens); the weight's is this shard's.

    Raises:
        TypeError: x or weight not a float tensor; targets or options as in
            `fastlm.linear_cross_entropy`; a group of another type.
        ValueError: a weight not (V / P, C); targets of another shape; a bad option; a
            chunk_size that is not a positive int; return_accuracy (not computed sharded).
    """
    check_float("x", x)
    check_float("weight", weight)
    options = (softcap, reduction, label_smoothing, z_loss, return_accuracy)
    group, options = _check_common(targets, "x", x, ignore_index, group, options)
    if weight.ndim != 2 or weight.shape[1] != x.shape[-1] or weight.shape[0] == 0:
        raise ValueError(
            f"weight must be this rank's (vocab_size / P, {x.shape[-1]}) shard for x of shape "
            f"{tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    if chunk_size is not None and (
        not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    rows = x.reshape(-1, x.shape[-1])
    flat_targets = targets.reshape(-1)
    if sequence_parallel:
        rows = gather_rows(rows, group)
        flat_targets = gather_rows(flat_targets, group)
        targets = flat_targets
    span = _span(weight.shape[0], group)
    _check_target_values(flat_targets, span[2], ignore_index)
    if chunk_size is None:
        chunk_size = default_chunk_size(rows.shape[0], weight.shape[0], x.dtype)
    losses = _VocabParallelLinear.apply(
        rows,
        weight,
        flat_targets,
        group,
        span,
        ignore_index,
        chunk_size,
        options,
        not sequence_parallel,
    )
    return _reduce(losses, targets, ignore_index, reduction)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group=None,
    ignore_index: int = -100,
    *,
    softcap: float = 0.0,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    return_accuracy: bool = False,
) -> torch.Tensor:
    """`cross_entropy(logits, targets)` of logits whose vocabulary is sharded over `group`
    (a column-parallel LM head's output; PyTorch's `loss_parallel` for fastlm's options).

    Args:
        logits: (..., V / P) float32/float16/bfloat16, this rank's columns [r V / P,
            (r + 1) V / P) of every row.
        targets: int64/int32 of logits' leading shape, in [0, V) or ignore_index, the same on
            every rank.
        group, ignore_index, softcap, reduction, label_smoothing, z_loss: as in
            `vocab_parallel_linear_cross_entropy`.

    Returns:
        The loss, fp32, the same on every rank; logits' gradient is this rank's columns' (no
        communication in the backward).

    Raises:
        TypeError, ValueError: as `vocab_parallel_linear_cross_entropy`.
    """
    check_float("logits", logits)
    options = (softcap, reduction, label_smoothing, z_loss, return_accuracy)
    group, options = _check_common(targets, "logits", logits, ignore_index, group, options)
    if logits.ndim == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be (..., V / P) with V / P >= 1, got {tuple(logits.shape)}")
    rows = logits.reshape(-1, logits.shape[-1])
    if use_triton(rows) and rows.stride(-1) != 1:
        rows = rows.contiguous()  # the kernels read rows with a unit column stride
    span = _span(logits.shape[-1], group)
    _check_target_values(targets, span[2], ignore_index)
    losses = _VocabParallelLogits.apply(
        rows, targets.reshape(-1), group, span, ignore_index, options
    )
    return _reduce(losses, targets, ignore_index, reduction)


def lm_head_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    **options,
) -> torch.Tensor:
    """`fastlm.linear_cross_entropy(x, weight, targets)` for an LM head that may be a DTensor.

    Hugging Face's tensor parallelism (`from_pretrained(..., tp_plan="auto")`) keeps the LM head
    `colwise_gather_output`: its weight a DTensor sharded by vocabulary rows (Shard(0)) over the
    tensor mesh, while the final norm's output reaches the loss as a plain tensor, the same on
    every rank. Such a weight goes through `vocab_parallel_linear_cross_entropy` on its local
    shard (no logits, no gathered weight; x's gradient all-reduced, the shard's gradient flowing
    back into the DTensor's); a replicated DTensor through its local tensor; a plain tensor
    straight to `fastlm.linear_cross_entropy`.

    Args:
        x: (..., C) float tensor, plain or a DTensor replicated on every mesh dim.
        weight: (V, C), a plain tensor or a DTensor over a 1-D mesh, Shard(0) with V divisible
            by the mesh's size, or Replicate.
        targets, ignore_index, chunk_size, options: as `fastlm.linear_cross_entropy`
            (return_accuracy refused with a sharded weight).

    Returns:
        The loss, fp32, the same on every rank of the weight's mesh.

    Raises:
        ValueError: a weight sharded otherwise (another dim, a mesh of more dims, a vocabulary
            that does not divide the mesh), or a sharded x; the rest as the losses called.
    """
    if isinstance(x, DTensor):
        if any(p != Replicate() for p in x.placements):
            raise ValueError(
                f"x must be a plain tensor or a replicated DTensor, got placements {x.placements}"
            )
        x = x.to_local()
    if not isinstance(weight, DTensor):
        return linear_cross_entropy(x, weight, targets, ignore_index, chunk_size, **options)
    placements = tuple(weight.placements)
    if all(p == Replicate() for p in placements):
        local = weight.to_local(grad_placements=[Replicate()] * len(placements))
        return linear_cross_entropy(x, local, targets, ignore_index, chunk_size, **options)
    world = weight.device_mesh.size()
    if placements != (Shard(0),) or weight.shape[0] % world:
        raise ValueError(
            f"weight: an LM head DTensor must be Shard(0) (vocabulary rows) over a 1-D mesh with "
            f"the vocabulary divisible by its size, or replicated; got {placements} of shape "
            f"{tuple(weight.shape)} over a mesh of shape {tuple(weight.device_mesh.shape)}"
        )
    return vocab_parallel_linear_cross_entropy(
        x,
        weight.to_local(),
        targets,
        weight.device_mesh.get_group(),
        ignore_index,
        chunk_size,
        **options,
    )
