"""Context parallelism: one sequence spread over the P ranks of a `torch.distributed` group.

Layout. A sequence of N tokens is cut into 2P chunks of c = N / (2P) tokens; rank r holds chunks r
and 2P - 1 - r, in that order (its shard: 2c = N / P tokens, `shard_sequence`). Under a causal
mask chunk j attends to j + 1 chunks of keys, so each rank's two chunks attend to 2P + 1 chunks
together, whatever r: the attention work is balanced.

Attention. Query chunk j attends to the key chunks [lo, j], lo = 0 without a window and
max(0, j - ceil(left / c)) with a left window. Each rank receives the K/V chunks its two query
chunks reach (and only those) from their owners, by point-to-point sends, straight into buffers
that hold the chunks in sequence order. Then each query chunk is one call of the single-GPU
kernel on its contiguous key range, whose causal mask and window are aligned to the end of the
keys: exactly a chunk attending to every key up to its own end. Nothing is merged: each query
row meets all of its keys in one call, so the output and log-sum-exp are the single-process ones
(to rounding). The backward receives the K/V chunks again (the forward keeps only its own shard:
activation memory stays O(N / P)), runs the kernels' backward with the saved final output and
log-sum-exp, and sends each received chunk's partial dK/dV (fp32) back to its owner, which adds
them to its own.

Why this exchange and not a ring: the traffic is the same as an all-gather's for the busiest rank
(rank 0's last chunk reaches every key) and less for the others, a window reaches only the chunks
it covers (O(window) instead of O(N) per rank), and every kernel call is a whole key range ending
at its queries, so windows, the softcap and GQA work unchanged. A ring holds only O(N / P) K/V at a
time but splits each row's keys over P calls merged by log-sum-exp, and cannot express a window
across chunk boundaries with the end-aligned kernel. The price is the K/V of up to N tokens for
the layer being computed (GQA keeps it small): see `ExchangePlan` and docs/distributed.md's
memory model.

Training: `fastlm.Transformer.set_context_parallel(group)`; then `model.loss(shard(tokens),
shard(targets))` on every rank of the group (RoPE rotates each token by its global position, and
each rank's loss is its share of the sequence's mean). `fastlm-train --context-parallel P`
builds a (data x context) `DeviceMesh` with `context_parallel_mesh`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastlm.backend import use_triton
from fastlm.kernels._common import empty, empty_like
from fastlm.kernels.attention import flash_attention, flash_attention_ref
from fastlm.kernels.attention.ops import (
    check_inputs,
    check_kernel_head_dims,
    check_options,
    flash_attention_op,
    natural_lse,
)

__all__ = [
    "ExchangePlan",
    "context_group",
    "context_parallel_attention",
    "context_parallel_mesh",
    "gather_sequence",
    "mean_share",
    "mesh_group",
    "sequence_positions",
    "shard_sequence",
]


# --------------------------------------------------------------------------------------------
# Layout: the 2P chunks
# --------------------------------------------------------------------------------------------


def _check_world(rank: int, world_size: int) -> None:
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, world_size={world_size}), got {rank}")


def _chunk_length(seq_len: int, world_size: int) -> int:
    """c = seq_len / (2 * world_size); ValueError unless it divides."""
    if seq_len % (2 * world_size):
        raise ValueError(
            f"the sequence length {seq_len} must be divisible by 2 * {world_size} = "
            f"{2 * world_size}: context parallelism over {world_size} ranks cuts it into "
            f"{2 * world_size} chunks (rank r holds chunks r and {2 * world_size - 1} - r)"
        )
    return seq_len // (2 * world_size)


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s shard of `x` along `dim`: chunks rank and 2 * world_size - 1 - rank of the
    2 * world_size equal chunks, in that order (a new tensor).

    Args:
        x: a batch's tokens, targets or positions, say (B, N), sequence along `dim`.
        rank, world_size: the rank in the context-parallel group and the group's size.
        dim: the sequence dimension.

    Returns:
        x's shard, with N / world_size entries along `dim`.

    Raises:
        TypeError: rank or world_size not an int.
        ValueError: rank outside [0, world_size), world_size below 1, or N not divisible by
            2 * world_size.
    """
    _check_world(rank, world_size)
    c = _chunk_length(x.shape[dim], world_size)
    first, second = rank, 2 * world_size - 1 - rank
    return torch.cat((x.narrow(dim, first * c, c), x.narrow(dim, second * c, c)), dim)


def sequence_positions(
    seq_len: int, rank: int, world_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """The global positions of the tokens in rank `rank`'s shard of a sequence: what RoPE rotates
    them by.

    Args:
        seq_len: the whole sequence's tokens N, divisible by 2 * world_size.
        rank: the rank in the context-parallel group, in [0, world_size).
        world_size: the group's size.
        device: where to make them (default None: PyTorch's default device).

    Returns:
        (seq_len / world_size,) int64 on `device`: chunks rank and 2 * world_size - 1 - rank of
        arange(seq_len), as `shard_sequence` cuts them.

    Raises:
        TypeError: rank or world_size not an int.
        ValueError: as `shard_sequence`.
    """
    return shard_sequence(torch.arange(seq_len, device=device), rank, world_size, dim=0)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 1):
    """The whole sequence from every rank's shard (`shard_sequence`'s inverse), on every rank.

    Args:
        x: this rank's shard (same shape on every rank), sequence along `dim`.
        group: the context-parallel group (default: the world).
        dim: the sequence dimension.

    Returns:
        The full tensor, world_size times longer along `dim`. Not differentiable: for outputs
        and metrics.

    Raises:
        ValueError: an odd length along `dim` (a shard holds 2 chunks).
    """
    world = dist.get_world_size(group)
    if x.shape[dim] % 2:
        raise ValueError(f"x has {x.shape[dim]} entries along dim {dim}: a shard holds 2 chunks")
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    chunks = [None] * (2 * world)
    for rank, part in enumerate(parts):
        chunks[rank], chunks[2 * world - 1 - rank] = part.chunk(2, dim)
    return torch.cat(chunks, dim)


# --------------------------------------------------------------------------------------------
# Which chunks each rank needs: the exchange plan
# --------------------------------------------------------------------------------------------


def _owner(chunk: int, world_size: int) -> tuple[int, int]:
    """(rank, half) holding `chunk`: g < P is rank g's first half, else rank 2P-1-g's second."""
    if chunk < world_size:
        return chunk, 0
    return 2 * world_size - 1 - chunk, 1


def _key_range(chunk: int, c: int, world_size: int, causal: bool, left: int) -> tuple[int, int]:
    """The key chunks [lo, hi] query chunk `chunk` reaches."""
    if not causal:
        return 0, 2 * world_size - 1
    if left < 0:
        return 0, chunk
    return max(0, chunk - -(-left // c)), chunk


def _merge(ranges) -> tuple[tuple[int, int], ...]:
    spans: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if spans and lo <= spans[-1][1] + 1:
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([lo, hi])
    return tuple((lo, hi) for lo, hi in spans)


@dataclass(frozen=True)
class ExchangePlan:
    """Which K/V chunks rank `rank` of `world_size` reads, receives and sends in one layer.

    Built by `ExchangePlan.build`; `context_parallel_attention` follows it, and `exchange_bytes`
    prices it (docs/distributed.md's memory model).

    Args:
        world_size: P, the ranks of the context-parallel group.
        rank: this rank, in [0, P).
        chunk: c, the tokens of one of the 2P chunks.
        ranges: the key chunks [lo, hi] of each of its two query chunks (rank, 2P - 1 - rank).
        spans: those ranges merged; each is one buffer holding its chunks in sequence order.
        receives: (chunk, source rank) for each chunk of the spans another rank owns, ascending.
        sends: (chunk, half, destination rank) for each own chunk another rank reads, by
            destination, then chunk (the order both sides post their messages in).
    """

    world_size: int
    rank: int
    chunk: int
    ranges: tuple[tuple[int, int], tuple[int, int]]
    spans: tuple[tuple[int, int], ...]
    receives: tuple[tuple[int, int], ...]
    sends: tuple[tuple[int, int, int], ...]

    @classmethod
    def build(
        cls, seq_len: int, world_size: int, rank: int, causal: bool = True, window_left: int = -1
    ) -> ExchangePlan:
        """The plan of rank `rank` for one sequence.

        Args:
            seq_len: the sequence's tokens N, divisible by 2 * world_size.
            world_size: P, the ranks of the group.
            rank: this rank, in [0, P).
            causal: whether attention is causal (default True); False: every rank reads every
                chunk.
            window_left: a left window of that many keys (default -1: none), with causal=True.

        Returns:
            The ExchangePlan.

        Raises:
            TypeError: rank or world_size not an int.
            ValueError: rank outside [0, world_size), world_size below 1, or seq_len not
                divisible by 2 * world_size.
        """
        _check_world(rank, world_size)
        c = _chunk_length(seq_len, world_size)
        P = world_size

        def ranges_of(r: int):
            return tuple(_key_range(j, c, P, causal, window_left) for j in (r, 2 * P - 1 - r))

        def needed(r: int) -> list[int]:
            return [g for lo, hi in _merge(ranges_of(r)) for g in range(lo, hi + 1)]

        ranges = ranges_of(rank)
        receives = tuple((g, _owner(g, P)[0]) for g in needed(rank) if _owner(g, P)[0] != rank)
        own = (rank, 2 * P - 1 - rank)
        sends = tuple(
            (g, half, dst)
            for dst in range(P)
            if dst != rank
            for half, g in sorted(enumerate(own), key=lambda pair: pair[1])
            if g in needed(dst)
        )
        return cls(P, rank, c, ranges, _merge(ranges), receives, sends)

    def slot(self, chunk: int) -> tuple[int, int]:
        """Where `chunk` lies in the span buffers.

        Args:
            chunk: a chunk index in [0, 2P) that one of the spans holds.

        Returns:
            (span index, first row).

        Raises:
            ValueError: a chunk that no span of this rank holds.
        """
        for index, (lo, hi) in enumerate(self.spans):
            if lo <= chunk <= hi:
                return index, (chunk - lo) * self.chunk
        raise ValueError(f"chunk {chunk} is in no span of rank {self.rank}")

    @property
    def held_tokens(self) -> int:
        """Tokens whose K/V the span buffers hold (own chunks included)."""
        return sum(hi - lo + 1 for lo, hi in self.spans) * self.chunk

    @property
    def received_tokens(self) -> int:
        """Tokens whose K/V this rank receives (and whose partial dK/dV it sends back)."""
        return len(self.receives) * self.chunk

    @property
    def sent_tokens(self) -> int:
        """Tokens whose K/V this rank sends (and whose partial dK/dV it receives back)."""
        return len(self.sends) * self.chunk

    def exchange_bytes(
        self,
        batch: int,
        kv_heads: int,
        head_dim: int,
        element_size: int,
        value_head_dim: int | None = None,
    ) -> dict[str, int]:
        """What one layer's exchange costs this rank, in bytes: docs/distributed.md's memory model.

        Args:
            batch, kv_heads, head_dim: of k and v; element_size: their dtype's bytes.
            value_head_dim: v's head dim when it differs from k's (default None: head_dim).

        Returns:
            forward_buffers: the K/V span buffers (freed when the forward returns);
            backward_buffers: the K/V spans again, their fp32 dK/dV, the fp32 partial
            gradients received for own chunks and the own chunks' fp32 dK/dV (plus its cast to
            the input dtype when that is not fp32), all freed when the backward returns;
            forward_sent, forward_received, backward_sent, backward_received: the traffic (the
            backward sends K/V again and returns each received chunk's fp32 gradient).
        """
        value_head_dim = head_dim if value_head_dim is None else value_head_dim
        token = batch * kv_heads * (head_dim + value_head_dim)  # K and V elements of one token
        own = 2 * self.chunk
        cast = own * element_size if element_size != 4 else 0
        return dict(
            forward_buffers=self.held_tokens * token * element_size,
            backward_buffers=token
            * (self.held_tokens * (element_size + 4) + (self.sent_tokens + own) * 4 + cast),
            forward_sent=self.sent_tokens * token * element_size,
            forward_received=self.received_tokens * token * element_size,
            backward_sent=token * (self.sent_tokens * element_size + self.received_tokens * 4),
            backward_received=token * (self.received_tokens * element_size + self.sent_tokens * 4),
        )


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


def _run_p2p(sends, receives, group) -> None:
    """Post every send and receive ((tensor, group rank) pairs) as one batch and wait for them.
    A batch with no message on any rank (a window inside one chunk) posts nothing."""
    ops = [dist.P2POp(dist.irecv, t, group=group, group_peer=peer) for t, peer in receives]
    ops += [dist.P2POp(dist.isend, t, group=group, group_peer=peer) for t, peer in sends]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _rows(k: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) as (T, B, H, D): the span buffers' token-major order."""
    return k.permute(2, 0, 1, 3)


def _exchange_kv(k, v, plan: ExchangePlan, group) -> list[torch.Tensor]:
    """The span buffers (tokens, B, Hkv, D + Dv) of K and V side by side along the last dim (k's
    head dim D, then v's Dv, which may differ: `_split`), own chunks copied in and the others'
    received from their owners; a chunk's rows are contiguous, so each travels as one message."""
    B, Hkv, _, D = k.shape
    c = plan.chunk
    shapes = [((hi - lo + 1) * c, B, Hkv, D + v.shape[-1]) for lo, hi in plan.spans]
    spans = [empty(shape, device=k.device, dtype=k.dtype) for shape in shapes]

    def slot(chunk: int) -> torch.Tensor:
        index, row = plan.slot(chunk)
        return spans[index][row : row + c]

    own = (plan.rank, 2 * plan.world_size - 1 - plan.rank)
    for half, chunk in enumerate(own):
        rows = slot(chunk)
        rows[..., :D].copy_(_rows(k[:, :, half * c : (half + 1) * c]))
        rows[..., D:].copy_(_rows(v[:, :, half * c : (half + 1) * c]))
    _run_p2p(
        [(slot(chunk), dst) for chunk, _, dst in plan.sends],
        [(slot(chunk), src) for chunk, src in plan.receives],
        group,
    )
    return spans


def _split(rows: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k (B, Hkv, tokens, D) and v (B, Hkv, tokens, Dv) views of span rows (tokens, B, Hkv,
    D + Dv), D = head_dim: K/V or their gradients."""
    return rows[..., :head_dim].permute(1, 2, 0, 3), rows[..., head_dim:].permute(1, 2, 0, 3)


def _key_views(spans, plan: ExchangePlan, half: int, head_dim: int):
    """k, v views (`_split`) of the span rows query chunk `half` reads."""
    lo, hi = plan.ranges[half]
    index, row = plan.slot(lo)
    return _split(spans[index][row : row + (hi - lo + 1) * plan.chunk], head_dim)


class _Kernels:
    """One query chunk's attention through fastlm's Triton ops; its statistic is the kernels'
    base-2 log-sum-exp, which their backward takes with the final output."""

    def __init__(self, options):
        self.options = options  # causal, scale, left, right, softcap, allow_tf32, deterministic

    def forward(self, q, k, v):
        return flash_attention_op(q, k, v, *self.options)

    def backward(self, do, q, k, v, o, lse):
        dq, dk, dv, _ = torch.ops.fastlm.flash_attention_backward(
            do, q, k, v, o, lse, *self.options
        )  # the fourth, the sinks' gradient, is empty without sinks
        return dq, dk, dv

    @staticmethod
    def natural(lse):
        return natural_lse(lse)


class _Torch:
    """The same through `flash_attention_ref` (FASTLM_BACKEND=torch, or no kernels here); the
    backward recomputes the chunk's attention and differentiates it."""

    def __init__(self, options):
        causal, scale, left, right, softcap, *_ = options
        self.causal, self.scale = causal, scale
        self.kwargs = dict(window_size=(left, right), softcap=softcap)

    def _attend(self, q, k, v):
        return flash_attention_ref(q, k, v, self.causal, self.scale, **self.kwargs, return_lse=True)

    def forward(self, q, k, v):
        return self._attend(q, k, v)

    def backward(self, do, q, k, v, o, lse):
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            out, _ = self._attend(*inputs)
        return torch.autograd.grad(out, inputs, do)

    @staticmethod
    def natural(lse):
        return lse


class _ContextParallelAttention(torch.autograd.Function):
    """Forward: exchange K/V, one call per query chunk. Backward: exchange K/V again, the
    backward per query chunk, partial dK/dV back to their owners."""

    @staticmethod
    def forward(ctx, q, k, v, plan, group, attend):
        B, Hq, T, D = q.shape
        c = plan.chunk
        spans = _exchange_kv(k, v, plan, group)
        # (B, T, H, Dv) memory, as the model reads it; v's head dim
        o = empty((B, T, Hq, v.shape[-1]), device=q.device, dtype=q.dtype).transpose(1, 2)
        stats = []
        for half in range(2):
            rows = slice(half * c, (half + 1) * c)
            o_half, stat = attend.forward(q[:, :, rows], *_key_views(spans, plan, half, D))
            o[:, :, rows] = o_half
            stats.append(stat.contiguous())
        del spans  # the exchanged K/V live for this call only
        ctx.save_for_backward(q, k, v, o, *stats)
        ctx.plan, ctx.group, ctx.attend = plan, group, attend
        ctx.set_materialize_grads(False)
        lse = torch.cat([attend.natural(stat) for stat in stats], dim=-1)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "fastlm.context_parallel_attention: second derivatives are not supported "
                "(create_graph=True through its backward)"
            )
        q, k, v, o, *stats = ctx.saved_tensors
        if do is None:  # o unused here: every rank still takes part in the exchanges
            do = torch.zeros_like(o)
        plan, group, c = ctx.plan, ctx.group, ctx.plan.chunk
        dq, grads = _local_backward(ctx.attend, do, q, k, v, o, stats, plan, group)

        def slot(chunk: int) -> torch.Tensor:
            index, row = plan.slot(chunk)
            return grads[index][row : row + c]

        # Each received chunk's partial gradient goes back to its owner, which adds them up.
        returned = [(empty_like(slot(chunk)), chunk, dst) for chunk, _, dst in plan.sends]
        _run_p2p(
            [(slot(chunk), src) for chunk, src in plan.receives],
            [(buffer, dst) for buffer, _, dst in returned],
            group,
        )
        for buffer, chunk, _ in returned:
            slot(chunk).add_(buffer)
        own = (plan.rank, 2 * plan.world_size - 1 - plan.rank)
        dk, dv = _split(torch.cat([slot(chunk) for chunk in own]).to(k.dtype), k.shape[-1])
        return dq, dk, dv, None, None, None


def _local_backward(attend, do, q, k, v, o, stats, plan: ExchangePlan, group):
    """dq, and the fp32 dK/dV span buffers of every key this rank's queries reach (the K/V
    spans, received again, are freed on return)."""
    c = plan.chunk
    spans = _exchange_kv(k, v, plan, group)
    grads = [torch.zeros(span.shape, dtype=torch.float32, device=q.device) for span in spans]
    dq = empty_like(q)
    for half in range(2):
        rows = slice(half * c, (half + 1) * c)
        dq_half, dk, dv = attend.backward(
            do[:, :, rows],
            q[:, :, rows],
            *_key_views(spans, plan, half, k.shape[-1]),
            o[:, :, rows],
            stats[half],
        )
        dq[:, :, rows] = dq_half
        lo, hi = plan.ranges[half]
        index, row = plan.slot(lo)
        target_k, target_v = _split(grads[index][row : row + (hi - lo + 1) * c], k.shape[-1])
        target_k += dk
        target_v += dv
    return dq, grads


def mesh_group(group, dim: str) -> dist.ProcessGroup | None:
    """The process group `group` names for one kind of parallelism.

    Args:
        group: a ProcessGroup; a DeviceMesh, 1-D or with a dimension named `dim`; or None, the
            default group.
        dim: the mesh dimension's name ("context", "tensor").

    Returns:
        The ProcessGroup, or None when `group` is None and torch.distributed is not initialised
        (one process).

    Raises:
        ValueError: a DeviceMesh of more than one dimension without a `dim` one.
        TypeError: anything other than a ProcessGroup, a DeviceMesh or None.
    """
    if group is None:
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch.distributed without device meshes
        DeviceMesh = ()
    if isinstance(group, DeviceMesh):
        names = group.mesh_dim_names or ()
        if group.ndim == 1:
            return group.get_group()
        if dim in names:
            return group[dim].get_group()
        raise ValueError(
            f"a {group.ndim}-D DeviceMesh needs a '{dim}' dimension, got dimensions {names}"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a ProcessGroup, a DeviceMesh or None, got {type(group).__name__}"
        )
    return group


def context_group(group) -> dist.ProcessGroup | None:
    """The context-parallel process group `group` names: `mesh_group(group, "context")`.

    Args:
        group: a ProcessGroup; a DeviceMesh, 1-D or with a "context" dimension; or None, the
            default group.

    Returns:
        The ProcessGroup, or None when `group` is None and torch.distributed is not initialised
        (one process).

    Raises:
        ValueError: a DeviceMesh of more than one dimension without a "context" one.
        TypeError: anything other than a ProcessGroup, a DeviceMesh or None.
    """
    return mesh_group(group, "context")


@torch.compiler.disable
def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group=None,
    causal: bool = True,
    softmax_scale: float | None = None,
    *,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    allow_tf32: bool = True,
    deterministic: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`flash_attention` of a sequence whose tokens are spread over the ranks of `group`.

    Every rank of the group calls it with its shard (`shard_sequence`: chunks r and 2P - 1 - r
    of the 2P chunks) of q, k and v; each gets the attention output of its own queries, as
    single-process attention over the whole sequence would give them.

    Args:
        q: (B, Hq, T, D), this rank's T = N / P queries; k: (B, Hkv, T, D) and v: (B, Hkv, T,
            Dv), its keys and values (Hq a multiple of Hkv; grouped heads are exchanged as they
            are; v's head dim Dv may differ from D, as in `flash_attention`). Any strides. Every
            rank passes the same shapes.
        group: the context-parallel ProcessGroup, a DeviceMesh (1-D or with a "context"
            dimension), or None for the default group. A group of one rank is plain
            `flash_attention`.
        causal: with the causal mask over the whole sequence; False: every query sees every key
            (no window then).
        softmax_scale, softcap, allow_tf32, deterministic: as in `flash_attention`.
        window_size: (left, -1 or 0) with causal=True: query i sees keys i - left to i over the
            whole sequence, and a rank receives only the chunks its windows reach.
        return_lse: also return the natural log-sum-exp (B, Hq, T) fp32 of each query.

    Returns:
        o (B, Hq, T, Dv) in q's dtype and in (B, T, Hq, Dv) memory, differentiable in q, k and v
        (the backward exchanges with the group too, so every rank must run it); with return_lse
        (o, lse). Packed documents (cu_seqlens) are not supported.

    Raises:
        TypeError: as `flash_attention`, or a group that is not a ProcessGroup, a DeviceMesh or
            None.
        ValueError: as `flash_attention`; with more than one rank, k holding another number of
            tokens than q, an odd T, or a window with causal=False.
    """
    check_inputs(q, k, v, causal, softmax_scale)
    window, softcap = check_options(causal, window_size, softcap, return_lse)
    process_group = context_group(group)
    world = 1 if process_group is None else dist.get_world_size(process_group)
    if world == 1:
        return flash_attention(
            q,
            k,
            v,
            causal,
            softmax_scale,
            window_size=window,
            softcap=softcap,
            return_lse=return_lse,
            allow_tf32=allow_tf32,
            deterministic=deterministic,
        )
    T = q.shape[2]
    if k.shape[2] != T:
        raise ValueError(
            f"q holds {T} tokens and k {k.shape[2]}: context-parallel attention is "
            "self-attention over one sequence, each rank passing its own shard of both"
        )
    if T % 2:
        raise ValueError(
            f"q holds {T} tokens per rank, so the sequence has {T * world}, which is not "
            f"divisible by 2 * {world} = {2 * world} (each rank holds 2 of {2 * world} chunks)"
        )
    if not causal and window != (-1, -1):
        raise ValueError(
            f"window_size {window} needs causal=True under context parallelism (a key range "
            "beyond the queries' own chunk cannot be aligned)"
        )
    rank = dist.get_rank(process_group)
    plan = ExchangePlan.build(T * world, world, rank, causal, window[0])
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    options = (causal, scale, *window, softcap, bool(allow_tf32), bool(deterministic))
    if use_triton(q):
        check_kernel_head_dims(q, v)
        attend = _Kernels(options)
    else:
        attend = _Torch(options)
    o, lse = _ContextParallelAttention.apply(q, k, v, plan, process_group, attend)
    return (o, lse) if return_lse else o


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def mean_share(loss: torch.Tensor, targets: torch.Tensor, ignore_index: int, group) -> torch.Tensor:
    """This rank's share of the mean loss over whole sequences: local sum * P / global count.

    The shares' mean over the group is the sequences' mean, so averaging losses and gradients
    over the group's ranks (as DDP and FSDP do over data x context) gives the mean and its
    gradient; with ranks holding different counts of ignored targets a plain mean of the
    ranks' means would weigh their tokens unequally. One all-reduce of a count, no host sync;
    every rank of the group calls it.

    Args:
        loss: this rank's mean loss over its targets (0 when all are ignored, as fastlm's
            cross-entropy gives).
        targets: this rank's targets; ignore_index: the target value left out.
        group: the context-parallel ProcessGroup.

    Returns:
        The share, differentiable as `loss` is (the counts are constants).
    """
    count = (targets != ignore_index).sum()
    total = count.clone()
    dist.all_reduce(total, group=group)
    world = dist.get_world_size(group)
    return loss * (count.clamp_min(1) * world / total.clamp_min(1)).to(loss.dtype)


def context_parallel_mesh(context_parallel: int, device_type: str = "cpu"):
    """The (data, context) DeviceMesh of the default group's ranks (every rank calls it).

    Args:
        context_parallel: the ranks sharing each sequence; it must divide the world size.
        device_type: "cuda" or "cpu".

    Returns:
        A 2-D DeviceMesh with dimensions ("data", "context") of world / context_parallel x
        context_parallel: rank = data_rank * context_parallel + context_rank, so a context group
        is neighbouring ranks (one node's GPUs when it fits). `mesh["context"].get_group()` is
        the group for `context_parallel_attention`.

    Raises:
        ValueError: a context_parallel below 1 or that does not divide the world size.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if context_parallel < 1 or world % context_parallel:
        raise ValueError(
            f"context_parallel {context_parallel} must divide the number of processes ({world})"
        )
    return init_device_mesh(
        device_type,
        (world // context_parallel, context_parallel),
        mesh_dim_names=("data", "context"),
    )
