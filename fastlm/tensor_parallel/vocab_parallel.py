"""Tensor parallelism: the vocabulary-parallel fused linear cross-entropy.

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

#: torch.distributed's names of the collectives into and out of one buffer (torch 2.13 renamed
#: them: the old names warn; older torch has only those).
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)

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


def _all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """(n, ...) on each rank -> (P n, ...), rank r's rows at [r n, (r + 1) n)."""
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    getattr(dist, ALL_GATHER)(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """(P n, ...) partial sums on each rank -> rank r's rows [r n, (r + 1) n) of their sum."""
    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    getattr(dist, REDUCE_SCATTER)(out, x.contiguous(), group=group)
    return out


class _GatherRows(torch.autograd.Function):
    """Every rank's rows gathered (sequence parallelism's entry into a column-parallel layer);
    the backward reduce-scatters the gradient back to each rank's rows."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad, ctx.group), None


class _ScatterTokens(torch.autograd.Function):
    """Partial sums (B, T, ...) reduced and scattered to each rank's tokens (B, T / P, ...) (a
    row-parallel layer's exit into sequence parallelism), returned in a tensor of their own
    (a block's output that is no view: FSDP2 warns of views); the backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        rows = _reduce_scatter_rows(x.transpose(0, 1), group)  # (T / P, B, ...)
        return torch.empty_like(rows.transpose(0, 1), memory_format=torch.contiguous_format).copy_(
            rows.transpose(0, 1)
        )

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_rows(grad.transpose(0, 1), ctx.group).transpose(0, 1), None


def gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's rows of x (dim 0) gathered, in rank order; differentiable (reduce-scatter).

    Args:
        x: (n, ...), the same shape on every rank of `group`.
        group: the ProcessGroup.

    Returns:
        (P n, ...).
    """
    return _GatherRows.apply(x, group)


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


# --------------------------------------------------------------------------------------------
# Sequence parallelism: tokens between the blocks, gathered for the sharded GEMMs
# --------------------------------------------------------------------------------------------


def _check_tokens_divide(x: torch.Tensor, world: int) -> None:
    if x.shape[1] % world:
        raise ValueError(
            f"sequence parallelism over {world} ranks splits the {x.shape[1]} tokens of each row "
            f"into equal shards: the sequence length must be divisible by {world}"
        )


def gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T / P, ...) token shards gathered into (B, T, ...), rank r's tokens at
    [r T / P, (r + 1) T / P); the backward reduce-scatters (each rank's partial gradient)."""
    return gather_rows(x.transpose(0, 1), group).transpose(0, 1)


def scatter_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T, ...) partial sums reduced over the group, rank r keeping tokens
    [r T / P, (r + 1) T / P); the backward all-gathers."""
    _check_tokens_divide(x, dist.get_world_size(group))
    return _ScatterTokens.apply(x, group)


def token_shard(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's tokens of x (B, T, ...): [r T / P, (r + 1) T / P) along dim 1."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    _check_tokens_divide(x, world)
    return x.chunk(world, dim=1)[rank]


# --------------------------------------------------------------------------------------------
# The plan: fastlm.Transformer's modules on their shards
# --------------------------------------------------------------------------------------------

# How each parameter of a block is sharded (a suffix of its state_dict key): "rows" and "cols"
# split dim 0 and 1 in P equal parts; "qkv" takes each rank's query heads, then its KV heads'
# keys, then values; None: replicated (the norms' gains, whose gradients `reduce_gradients`
# sums over the group).
LAYOUT = {
    "embedding.w": "rows",
    "out_linear.w": "rows",
    "mult_head_atten.qkv_proj.w": "qkv",
    "mult_head_atten.output_proj.w": "cols",
    "ffe.w1.w": "rows",
    "ffe.w3.w": "rows",
    "ffe.w2.w": "cols",
    "rms_norm1.g": None,
    "rms_norm2.g": None,
    "final_norm.g": None,
}


def _layout(name: str) -> str | None:
    for suffix, layout in LAYOUT.items():
        if name == suffix or name.endswith("." + suffix):
            return layout
    raise ValueError(f"{name}: a parameter the tensor-parallel plan does not know")


def _qkv_parts(full_rows: int, heads: tuple[int, int]) -> list[int]:
    """Rows of the q, k and v parts of a fused (Hq + 2 Hkv) D projection."""
    num_heads, num_kv_heads = heads
    head_dim = full_rows // (num_heads + 2 * num_kv_heads)
    return [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]


def shard_tensor(name: str, full: torch.Tensor, rank: int, world: int, heads=None):
    """Rank `rank`'s shard of parameter `name` (a full tensor), by `LAYOUT`.

    Args:
        name: the state_dict key.
        full: the whole tensor.
        rank, world: the rank in the tensor-parallel group and its size.
        heads: (Hq, Hkv) of the model, for the fused qkv projection.

    Returns:
        The shard (a view of `full`; the whole tensor for a replicated one).
    """
    layout = _layout(name)
    if layout is None:
        return full
    if layout == "qkv":
        parts = full.split(_qkv_parts(full.shape[0], heads))
        return torch.cat([part.chunk(world)[rank] for part in parts])
    return full.chunk(world, dim=0 if layout == "rows" else 1)[rank]


def unshard_tensor(name: str, shards: list[torch.Tensor], heads=None) -> torch.Tensor:
    """The whole parameter `name` from every rank's shard, in rank order: `shard_tensor`'s
    inverse."""
    layout = _layout(name)
    if layout is None:
        return shards[0]
    if layout == "qkv":
        world = len(shards)
        rows = _qkv_parts(shards[0].shape[0] * world, heads)
        parts = [s.split([r // world for r in rows]) for s in shards]
        return torch.cat([torch.cat([p[i] for p in parts]) for i in range(3)])
    return torch.cat(shards, dim=0 if layout == "rows" else 1)


def check_plan(config: dict, tensor_parallel: int, name=str) -> None:
    """ValueError (one line) unless `tensor_parallel` ranks can split a model of `config`.

    Args:
        config: the model's vocab_size, num_heads, num_kv_heads (None: num_heads), d_ff.
        tensor_parallel: T, the tensor-parallel group's size.
        name: spells the fields in the message (default `str`; the commands pass their flags).

    Raises:
        ValueError: T below 1, or query heads, KV heads, d_ff or the vocabulary not divisible by
            T.
    """
    if tensor_parallel < 1:
        raise ValueError(f"the tensor-parallel size must be at least 1, got {tensor_parallel}")
    kv_heads = config.get("num_kv_heads") or config["num_heads"]
    for what, count in (
        ("num_heads", config["num_heads"]),
        ("num_kv_heads", kv_heads),
        ("d_ff", config["d_ff"]),
        ("vocab_size", config["vocab_size"]),
    ):
        if count % tensor_parallel:
            raise ValueError(
                f"{name(what)} {count} is not divisible by the tensor-parallel size "
                f"{tensor_parallel}: "
                "each rank holds an equal share (a KV head with its query heads)"
            )


class _VocabParallelEmbedding:
    """Embedding rows of the rank's vocabulary shard; the shards' sums reduce-scattered to the
    ranks' tokens (sequence parallelism)."""

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        start = self.vocab_start
        inside = (token_ids >= start) & (token_ids < start + self.w.shape[0])
        local = torch.where(inside, token_ids - start, 0)
        rows = torch.nn.functional.embedding(local, self.w) * inside[..., None].to(self.w.dtype)
        return scatter_tokens(rows, self.tensor_group)  # (B, T / P, C)


class _ColumnRowParallel:
    """A sub-layer whose first GEMM is column-parallel and last row-parallel (the feed-forward:
    d_ff): the tokens gathered in, the partial outputs reduce-scattered out."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out = super().forward(gather_tokens(x, self.tensor_group), *args, **kwargs)
        return scatter_tokens(out, self.tensor_group)


class _HeadParallelAttention(_ColumnRowParallel):
    """Attention on the rank's heads, as `_ColumnRowParallel`; no KV cache."""

    def forward(self, x, token_positions=None, kv_cache=None, *args, **kwargs):
        if kv_cache is not None:
            raise ValueError(
                "tensor parallelism trains (no KV cache): generate with the whole model "
                "(fastlm.tensor_parallel.full_state_dict)"
            )
        return super().forward(x, token_positions, kv_cache, *args, **kwargs)


class _TensorParallelModel:
    """fastlm.Transformer under the plan: `loss` through the vocabulary-parallel loss; `forward`
    gathers the logits (evaluation: not differentiable)."""

    def loss(
        self, token_ids, targets, token_positions=None, ignore_index: int = -100, **packed
    ) -> torch.Tensor:
        if not isinstance(targets, torch.Tensor) or targets.shape != token_ids.shape:
            raise ValueError(
                f"targets must have the shape of token_ids {tuple(token_ids.shape)}, got "
                f"{getattr(targets, 'shape', type(targets))}"
            )
        hidden = self.hidden(token_ids, token_positions, **packed)  # (B, T / P, C)
        group = self.tensor_group
        loss = vocab_parallel_linear_cross_entropy(
            hidden,
            self.out_linear.w,
            token_shard(targets, group),
            group,
            ignore_index,
            sequence_parallel=True,
        )
        context = self.context_parallel_group
        if context is None:
            return loss
        from fastlm.distributed import mean_share

        return mean_share(loss, targets, ignore_index, context)

    def forward(self, token_ids, token_positions=None, kv_cache=None, **packed) -> torch.Tensor:
        hidden = self.hidden(token_ids, token_positions, kv_cache, **packed)
        with torch.no_grad():
            full = gather_tokens(hidden, self.tensor_group)
            logits = torch.nn.functional.linear(full, self.out_linear.w.to(full.dtype))
            return gather_rows(logits.movedim(-1, 0), self.tensor_group).movedim(0, -1)


def _swap_class(module: torch.nn.Module, mixin: type) -> None:
    """Give `module` the mixin's forward (a subclass of its own class, as FSDP2 does), keeping
    its parameters and state_dict keys."""
    module.__class__ = type(f"TensorParallel{type(module).__name__}", (mixin, type(module)), {})


def parallelize(model, group=None):
    """Apply Megatron-style tensor and sequence parallelism to a `fastlm.Transformer`, in place.

    Each rank keeps its shard of every GEMM's weight (`LAYOUT`): the fused q|k|v projection by
    heads (each rank's query heads and the KV heads they read, GQA included), the output
    projection by its input columns, W1 and W3 by rows (so the block's packed W1|W3 GEMM and
    `swiglu_packed` run on the rank's [W1_r; W3_r] unchanged), W2 by columns, and the embedding
    and LM head by vocabulary rows. Between the sub-layers the residual stream, the norms and
    the embedding's output are sequence-parallel: each rank holds T / P tokens of every row; a
    sub-layer all-gathers them, runs its heads or d_ff shard, and reduce-scatters its partial
    output back (one all-gather and one reduce-scatter of (B, T, C) per sub-layer and pass).
    `loss` is the vocabulary-parallel fused linear cross-entropy: no rank ever holds the whole
    LM head or any logits. The norms' gains are replicated: call `reduce_gradients(model)` after
    the backward (their gradients are each rank's tokens' share).

    Composes with context parallelism (`set_context_parallel` with the mesh's "context"
    group: each context shard's tokens are sequence-parallel over the tensor group) and with
    FSDP2 or DDP over the data (and context) ranks: apply this first.

    Args:
        model: a fastlm.Transformer holding whole weights (load a checkpoint first).
        group: the tensor-parallel ProcessGroup, a DeviceMesh (1-D or with a "tensor" dim), or
            None for the default group.

    Returns:
        The model (every rank of the group must call its forward, loss and backward together,
        with the same token_ids and targets; T divisible by the group's size).

    Raises:
        ValueError: heads, KV heads, d_ff or the vocabulary not divisible by the group's size.
    """
    from fastlm.distributed import mesh_group

    group = mesh_group(group, "tensor")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    first = model.blocks[0]
    attention = first.mult_head_atten
    heads = (attention.num_heads, attention.num_kv_heads)
    config = dict(
        vocab_size=model.vocab_size, num_heads=heads[0], num_kv_heads=heads[1], d_ff=first.ffe.d_ff
    )
    check_plan(config, world)
    shared = {}  # a tied weight is sharded once and stays one parameter
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if id(param) not in shared:
            shard = shard_tensor(name, param.detach(), rank, world, heads).clone()
            shared[id(param)] = torch.nn.Parameter(shard, requires_grad=param.requires_grad)
        setattr(owner, attr, shared[id(param)])
    for block in model.blocks:
        attention = block.mult_head_atten
        attention.num_heads, attention.num_kv_heads = heads[0] // world, heads[1] // world
        block.ffe.d_ff //= world
        for module, mixin in ((attention, _HeadParallelAttention), (block.ffe, _ColumnRowParallel)):
            _swap_class(module, mixin)
            module.tensor_group = group
    model.embedding.vocab_start = rank * model.embedding.w.shape[0]
    model.embedding.tensor_group = group
    _swap_class(model.embedding, _VocabParallelEmbedding)
    model.tensor_group, model.tensor_heads = group, heads
    _swap_class(model, _TensorParallelModel)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2's) local shard, or t."""
    return t.to_local() if hasattr(t, "to_local") else t


def reduce_gradients(model) -> None:
    """Sum the replicated parameters' gradients (the norms' gains) over the tensor-parallel
    group, after the backward (and after DDP's or FSDP2's reduction over the data ranks, which
    shards every tensor-parallel rank's alike): one all-reduce of them all. Under sequence
    parallelism each rank's is its tokens' share; the sharded weights' gradients are whole
    already.

    Args:
        model: a model `parallelize` prepared, or a module holding it (DDP, a loss wrapper).
    """
    grads = [
        _local(param.grad)
        for name, param in model.named_parameters()
        if param.grad is not None and _layout(name) is None
    ]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=_tensor_group(model))
    for grad, summed in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(summed.view_as(grad))


def _tensor_group(model):
    for module in model.modules():
        if hasattr(module, "tensor_heads"):
            return module.tensor_group
    raise ValueError("the model is not tensor-parallel (fastlm.tensor_parallel.parallelize)")


def full_state_dict(state: dict, model) -> dict:
    """The whole tensors of a tensor-parallel model's state_dict, on every rank of its group:
    what a single-process model (or any other mesh) loads.

    Args:
        state: {key: this rank's shard} (model.state_dict(), or FSDP2's full state of the
            rank's shards), keys as `LAYOUT` knows them.
        model: the model `parallelize` prepared (its group and head counts).

    Returns:
        {key: the whole tensor}, on the shards' devices.
    """
    group = _tensor_group(model)
    world = dist.get_world_size(group)
    heads = model.tensor_heads
    full = {}
    for key, shard in state.items():
        shard = _local(shard)
        if _layout(key) is None:
            full[key] = shard
            continue
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard.contiguous(), group=group)
        full[key] = unshard_tensor(key, parts, heads)
    return full


def _state_tensors(state: dict):
    """(parameter key, entry name, tensor) of each per-parameter tensor of an optimizer's full
    state dict ({"state": {key: {name: tensor}}, "param_groups": ...}) shaped like its
    parameter (a scalar `step` is left alone)."""
    for key, entries in state["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                yield key, name, value


def full_optimizer_state(state: dict, model, device=None) -> dict:
    """`full_state_dict` for an optimizer's full state dict (AdamW's moments are shaped like
    their parameters): every rank of the group gets the whole tensors (moved to `device` when
    given)."""
    out = {**state, "state": {k: dict(v) for k, v in state["state"].items()}}
    for key, name, value in _state_tensors(state):
        out["state"][key][name] = full_state_dict({key: value}, model)[key].to(device)
    return out


def shard_optimizer_state(state: dict, model) -> dict:
    """An optimizer's full state dict cut to this rank's shards (`shard_tensor`), to load into
    the optimizer of a model `parallelize` prepared."""
    group = _tensor_group(model)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out = {**state, "state": {k: dict(v) for k, v in state["state"].items()}}
    for key, name, value in _state_tensors(state):
        out["state"][key][name] = shard_tensor(key, value, rank, world, model.tensor_heads).clone()
    return out


def clip_grad_norm_(model, max_norm: float, data_group=None) -> torch.Tensor:
    """Scale every gradient by max_norm / (norm + 1e-6) where the global norm is above max_norm
    (`fastlm.reference.gradient_clip`'s rule), the norm counting each
    sharded weight's shards and each replicated gain once. Call after `reduce_gradients`.

    Args:
        model: a model `parallelize` prepared, or a module holding it.
        max_norm: the largest norm kept.
        data_group: with FSDP2 (each rank a disjoint shard of the data ranks' gradients), the
            group of the data (x context) ranks; None when they hold whole copies (DDP).

    Returns:
        The norm before clipping, fp32.
    """
    group = _tensor_group(model)
    world = dist.get_world_size(group)
    grads = [(name, _local(p.grad)) for name, p in model.named_parameters() if p.grad is not None]
    squares = [g.float().square().sum() / (1 if _layout(n) else world) for n, g in grads]
    total = torch.stack(squares).sum()
    dist.all_reduce(total, group=group)
    if data_group is not None:
        dist.all_reduce(total, group=data_group)
    norm = total.sqrt()
    scale = torch.where(norm > max_norm, max_norm / (norm + 1e-6), 1.0)
    for _, grad in grads:
        grad.mul_(scale.to(grad.dtype))
    return norm


# --------------------------------------------------------------------------------------------
# What a rank holds and sends: the memory and traffic models (docs/tensor-parallel.md)
# --------------------------------------------------------------------------------------------


def _sizes(config: dict) -> tuple[int, ...]:
    C, H = config["d_model"], config["num_heads"]
    Hkv = config.get("num_kv_heads") or H
    return C, H, Hkv, C // H, config["d_ff"], config["vocab_size"], config["num_layers"]


def memory_model(config: dict, tensor: int, tokens: int, *, data: int = 1) -> dict:
    """Bytes one rank holds training a fastlm.Transformer under `parallelize` (fp32 weights,
    AdamW, no autocast; FSDP2 over `data` ranks shards every parameter `data` ways).

    Args:
        config: the model's constructor arguments (d_model, num_heads, num_kv_heads, d_ff,
            vocab_size, num_layers, tie_embeddings).
        tensor: T, the tensor-parallel group's size.
        tokens: N, the tokens of the rows the tensor group computes together (B x the sequence,
            or x its context shard).
        data: the FSDP2 ranks each parameter is sharded over (1: none, or DDP).

    Returns:
        parameters, gradients, optimizer (AdamW's two moments), and activations_per_layer: what
        one block saves for the backward (fp32): per sub-layer the sequence-parallel norm's input
        and rstd (N / T tokens), the gathered normed input of its first GEMM (N tokens), and the
        rank's share of q|k|v (rotated), the attention output and its log-sum-exp, or of gate,
        up and silu(gate) * up.
    """
    C, H, Hkv, D, F, V, L = _sizes(config)
    T = tensor
    layer = ((H + 2 * Hkv) * D * C + H * D * C + 3 * F * C) // T + 2 * C
    heads = 1 if config.get("tie_embeddings") else 2
    parameters = 4 * (L * layer + heads * V * C // T + C) // data
    local = tokens // T
    activations = 4 * (
        2 * (local * C + local)  # each norm's input and rstd
        + 2 * tokens * C  # the gathered normed inputs of qkv and W1|W3
        + tokens * ((H + 2 * Hkv) * D + H * D + 3 * F) // T  # qkv, o; gate, up, h
        + tokens * H // T  # the log-sum-exp
    )
    return dict(
        parameters=parameters,
        gradients=parameters,
        optimizer=2 * parameters,
        activations_per_layer=activations,
    )


def collective_model(config: dict, tensor: int, tokens: int) -> dict:
    """The collectives of one training step (loss, backward, `reduce_gradients`) on one rank of
    the tensor group, and their output buffers' bytes (fp32 activations).

    Per block: an all-gather of the N tokens into attention and into the feed-forward, and a
    reduce-scatter of their outputs (N / T tokens out), each transposed in the backward. Once per
    step: the embedding's reduce-scatter (and its all-gather back), the loss's all-gathers of the
    hidden states and targets, its two all-reduces (MAX of the row maxima; SUM of the sums of
    exps and target logits) and the reduce-scatter of its input gradient, and one all-reduce of
    the norms' gradients.

    Returns:
        calls: (all-gathers, reduce-scatters, all-reduces); bytes: {kind: bytes}.
    """
    C, H, Hkv, D, F, V, L = _sizes(config)
    tokens_bytes, shard_bytes = 4 * tokens * C, 4 * tokens * C // tensor
    return dict(
        calls=(4 * L + 3, 4 * L + 2, 3),
        bytes=dict(
            **{ALL_GATHER: (4 * L + 2) * tokens_bytes + 8 * tokens},
            **{REDUCE_SCATTER: (4 * L + 2) * shard_bytes},
            all_reduce=4 * tokens + 4 * 3 * tokens + 4 * (2 * L + 1) * C,
        ),
    )
