"""Sequence parallelism's collectives: token rows gathered over the tensor group, and scattered
back.

Under `parallelize` each rank of a tensor-parallel group of P ranks holds T / P tokens of every
row between the sub-layers (the residual stream, the norms, the embedding's output). A sub-layer
whose GEMMs are sharded by heads or d_ff needs every token: `gather_tokens` all-gathers them (its
backward reduce-scatters each rank's partial gradient back to the rank's tokens), and
`scatter_tokens` sums the sub-layer's partial outputs and scatters each rank its tokens (its
backward all-gathers). `gather_rows` is the same all-gather along dim 0: the vocabulary-parallel
loss gathers the hidden states and targets with it. The plan and the loss both import these, so
they live here, below both; `ALL_GATHER` and `REDUCE_SCATTER` name the torch.distributed
functions they call (what the collective model and the tests count).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

#: torch.distributed's names of the collectives into and out of one buffer (torch 2.13 renamed
#: them: the old names warn; older torch has only those).
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)

__all__ = [
    "ALL_GATHER",
    "REDUCE_SCATTER",
    "gather_rows",
    "gather_tokens",
    "scatter_tokens",
    "token_shard",
]


# --------------------------------------------------------------------------------------------
# Rows of every rank: gathered in, partial sums reduce-scattered out
# --------------------------------------------------------------------------------------------


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
