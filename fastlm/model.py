"""fastlm.Transformer: a drop-in for `fastlm.reference.Transformer`, built on fastlm's kernels.

Same constructor, same forward, same state_dict keys and shapes as the reference, so checkpoints
load both ways with `strict=True`. What changes is how the math runs:

- attention: one q|k|v projection, and `rope_attention` on its output: RoPE rotates q and k in
  place, flash attention reads the [B, T, H, D] views through their strides (no transposing
  copies, no [T x T] matrix), and the backward writes the projection's gradient as one tensor;
- the residual stream travels as (residual, delta) between sub-layers, so each residual add is fused
  with the RMSNorm that follows it. Under autocast the stream stays fp32 (as the reference's) and
  the deltas bf16: the fused kernel takes them as they are and writes the normed output in bf16
  for the next GEMM, so no cast runs between sub-layers;
- the feed-forward (`fastlm.SwiGlu`) applies silu(gate) * up, and its backward, in one kernel each;
- under autocast with fp32 weights, each block casts its four GEMM weights by one copy
  (`fastlm.kernels.linear.cast_weights`, W1 and W3 stacked so that they are one GEMM and their
  input gradient one more) and its GEMMs return fp32 weight gradients straight from the GEMM
  where the device has it (CUDA): no cast per weight on the way in or out;
- `loss()` runs the final norm's output through fused linear cross-entropy: the [tokens x vocab]
  logits never exist at once;
- generation uses a KV cache (`make_kv_cache`) read by flash attention with fewer queries than keys;
  past the context it slides (`KVCache`);
- `set_context_parallel(group)` spreads each sequence over a process group's ranks
  (`fastlm.distributed`): RoPE and flash attention on each rank's shard, keys and values
  exchanged with the others.

Shapes in comments: B batch, T new tokens, S cached + new tokens, H heads, D head dim, C model dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fastlm import reference
from fastlm.backend import use_triton
from fastlm.distributed import (
    context_group,
    context_parallel_attention,
    mean_share,
    sequence_positions,
)
from fastlm.kernels.attention import MAX_HEAD_DIM, flash_attention, rope_attention, split_heads
from fastlm.kernels.linear import autocast_dtype, cast_weights, half_linear
from fastlm.kernels.linear_cross_entropy import linear_cross_entropy
from fastlm.kernels.rmsnorm import add_rms_norm, rms_norm
from fastlm.kernels.rope import apply_rope_, check_positions, rope_frequencies
from fastlm.modules import MoeLayer, RmsNorm, RoPE, SwiGlu


class Linear(reference.Linear):
    """reference.Linear (same constructor, weight `w`, init) through F.linear, which autocast and
    torch.compile know best; or, given `half` (its weight already cast for autocast, as the block
    casts all of its weights at once), through `half_linear`, whose weight gradient leaves the GEMM
    in fp32.
    """

    def forward(self, x: torch.Tensor, half: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T.

        Args:
            x: (..., in_features).
            half: this layer's weight already cast to the autocast dtype (`cast_weights`), or None
                (the default): F.linear on `w`.

        Returns:
            (..., out_features); with `half`, in half's dtype.
        """
        return F.linear(x, self.w) if half is None else half_linear(x, half, self.w)


class Embedding(reference.Embedding):
    """reference.Embedding (same constructor, weight `w`, init) through F.embedding, whose backward
    is a dedicated kernel.
    """

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The rows of W at `token_ids`.

        Args:
            token_ids: integer tensor of any shape, values in [0, num_embeddings).

        Returns:
            (*token_ids.shape, embedding_dim) in W's dtype.
        """
        return F.embedding(token_ids, self.w)


class KVCache:
    """Keys and values of every layer for the last `max_seq_len` positions, for generation.

    Each layer's k and v are [B, H, max_seq_len, D], allocated at the first append in the dtype
    the attention computes in (bf16 under autocast). `length` counts the positions written: a
    forward through the model appends each layer's new keys and values at `length`, then advances
    it by the new tokens.

    Once max_seq_len positions are written the cache slides: tokens then come one at a time, each
    written over the oldest's slot (a ring), so the new token attends to itself and the
    max_seq_len - 1 tokens before it, and costs one token's forward. Keys keep the RoPE rotation
    of their absolute position and the new token is rotated by its own (past the RoPE tables:
    `MultiHeadAttentionWithRoPE`), so attention sees the same relative distances as within the
    context: it is a sliding-window attention of width max_seq_len (as transformers' sliding
    window cache). It is not re-encoding the last max_seq_len tokens: the kept keys and values of
    the deeper layers are those computed when their token was new, from the tokens it saw then.

    Args:
        num_layers: the model's blocks.
        max_seq_len: the positions it holds (the model's context_length).
    """

    def __init__(self, num_layers: int, max_seq_len: int):
        self.max_seq_len = max_seq_len
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store this step's k, v after the cached ones and return all of them.

        Writes positions `length` to `length + T - 1` of `layer`'s cache (once full, the one new
        position over the oldest); `length` itself is advanced by the model once every layer has
        appended.

        Args:
            layer: the block's index.
            k, v: (B, H, T, D), this step's keys and values.

        Returns:
            (k, v), each (B, H, S, D) with S = min(length + T, max_seq_len): views of the cache,
            in slot order (once it slides, not in position order: attention sums over them).

        Raises:
            ValueError: as `check_room`.
        """
        B, H, T, D = k.shape
        self.check_room(T)
        if self.k[layer] is None:
            self.k[layer] = k.new_zeros(B, H, self.max_seq_len, D)
            self.v[layer] = v.new_zeros(B, H, self.max_seq_len, D)
        start = self.length % self.max_seq_len  # the oldest's slot once full (check_room: T 1)
        self.k[layer][:, :, start : start + T] = k
        self.v[layer][:, :, start : start + T] = v
        S = min(self.length + T, self.max_seq_len)
        return self.k[layer][:, :, :S], self.v[layer][:, :, :S]

    def check_room(self, new_tokens: int) -> None:
        """ValueError naming token_ids unless `new_tokens` may follow the cached ones: up to
        max_seq_len positions in all, then one token at a time (the cache slides)."""
        if new_tokens > 1 and self.length + new_tokens > self.max_seq_len:
            raise ValueError(
                f"token_ids: {self.length} cached + {new_tokens} new tokens exceed "
                f"context_length={self.max_seq_len}; past it the KV cache slides one token at a "
                "time"
            )


def kernels_run_on(device: torch.device | str | None) -> bool:
    """Whether fastlm's Triton kernels process tensors on `device`.

    FASTLM_BACKEND=triton where they cannot run counts as yes: the first call says why it cannot.

    Args:
        device: a torch.device, a name ("cuda", "cpu") or None (PyTorch's default device).

    Returns:
        True where the kernels run (`fastlm.backend.use_triton`).
    """
    try:
        return use_triton(torch.empty(0, device=device))
    except ValueError:
        return True


def kernel_takes_head_dim(head_dim: int) -> bool:
    """Whether flash attention's Triton kernel takes heads of `head_dim` dims.

    Args:
        head_dim: the head dim (d_model / num_heads).

    Returns:
        True for a multiple of 8 up to `MAX_HEAD_DIM` (512; 256 in fp32, `MAX_HEAD_DIM_FP32`).
    """
    return head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM


def check_heads(
    d_model: int, num_heads: int, kernels: bool = True, name: Callable[[str], str] = str
) -> None:
    """Check that `d_model` splits into `num_heads` heads the model can run, saying what to change.

    The heads must be of an even size (RoPE rotates pairs; the reference needs that too) and,
    where the Triton kernels run (`kernels`), of a size flash attention's kernel takes: a multiple
    of 8 up to 512 (heads above 256 in 16-bit only: the kernel refuses them in fp32, naming the
    tensor). The message then suggests the nearest num_heads that fits.

    Args:
        d_model: the model width.
        num_heads: the query heads.
        kernels: whether the Triton kernels run (default True).
        name: spells the two fields in the message (default `str`; the commands pass their
            flags).

    Raises:
        ValueError: d_model not a multiple of num_heads (or num_heads below 1), an odd head dim,
            or (with kernels) a head dim the kernel does not take.
    """
    d, h = name("d_model"), name("num_heads")
    if num_heads < 1 or d_model % num_heads:
        raise ValueError(f"{d} {d_model} must be a multiple of {h} {num_heads}")
    head_dim = d_model // num_heads
    split = f"{d} {d_model} / {h} {num_heads} gives heads of {head_dim} dims"
    if head_dim % 2:
        raise ValueError(
            f"{split}, but RoPE rotates pairs: choose {d} and {h} whose quotient is even"
        )
    if kernels and not kernel_takes_head_dim(head_dim):
        fits = [
            n
            for n in range(1, d_model + 1)
            if d_model % n == 0 and kernel_takes_head_dim(d_model // n)
        ]
        hint = f" (with {d} {d_model}: {h} {min(fits, key=lambda n: abs(n - num_heads))})"
        raise ValueError(
            f"{split}, but fastlm's attention kernel takes multiples of 8 up to "
            f"{MAX_HEAD_DIM}: change {d} or {h}{hint if fits else ''}, or run "
            "PyTorch's attention with FASTLM_BACKEND=torch"
        )


class MultiHeadAttentionWithRoPE(nn.Module):
    """Causal self-attention with RoPE on the kernels: `rope_attention` on one q|k|v projection.

    The parameters, their names and the constructor are reference.MultiHeadAttentionWithRoPE's
    (num_kv_heads < num_heads: grouped-query attention, flash attention reading the shared
    key/value heads; rope_interleaved=False: half-split pairs).

    Args:
        d_model: the input and output width, a multiple of num_heads.
        num_heads: the query heads; the head dim d_model / num_heads must be even and, where the
            Triton kernels run on `device`, a multiple of 8 up to 512 (256 in fp32).
        max_seq_len: the longest sequence, and the positions RoPE's tables hold.
        theta: RoPE's base.
        device, dtype: of the parameters (default: PyTorch's defaults).
        num_kv_heads: key/value heads, a divisor of num_heads (default None: num_heads).
        rope_interleaved: RoPE's pair layout (default True: interleaved).

    Raises:
        ValueError: heads the model cannot run (`check_heads`), or a bad num_kv_heads.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        max_seq_len: int,
        theta: float,
        device=None,
        dtype=None,
        num_kv_heads: int | None = None,
        rope_interleaved: bool = True,
    ):
        super().__init__()
        check_heads(d_model, num_heads, kernels_run_on(device))
        self.d_model = d_model
        self.num_heads = num_heads
        self.num_kv_heads = reference.check_kv_heads(num_heads, num_kv_heads)
        self.head_dim = d_model // num_heads
        self.max_seq_len = max_seq_len
        qkv_width = (num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(d_model, qkv_width, device, dtype)
        self.output_proj = Linear(d_model, d_model, device, dtype)
        self.rope = RoPE(theta, self.head_dim, max_seq_len, device, rope_interleaved)

    def cast_groups(self) -> list[list[torch.Tensor]]:
        """The weight groups `half` holds, for `cast_weights`.

        Returns:
            [[W_qkv], [W_o]].
        """
        return [[self.qkv_proj.w], [self.output_proj.w]]

    def forward(
        self,
        x: torch.Tensor,
        token_positions: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        layer: int = 0,
        *,
        positions_checked: bool = False,
        half: tuple[torch.Tensor, torch.Tensor] | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        context_parallel=None,
    ) -> torch.Tensor:
        """Attention of x's tokens, q and k rotated by their positions.

        Without a KV cache or a context-parallel group: `rope_attention` on the projection,
        whose gradient is one tensor. With a KV cache: this step's k and v appended, then flash
        attention of the T new queries against all S cached and new keys. With a
        context-parallel group: `fastlm.distributed.context_parallel_attention` on this rank's
        shard.

        Args:
            x: (B, T, d_model).
            token_positions: (T,) or (B, T) integers in [0, max_seq_len) (default: L to L + T - 1,
                L the KV cache's length, 0 without one). With cu_seqlens, each token's position
                in its document; with context_parallel, the global positions of x's tokens.
            kv_cache: the generation cache (default None); this layer's k and v are appended to it.
            layer: this block's index in kv_cache (default 0).
            positions_checked: the caller has checked token_positions' values (the model does, once
                for every layer; default False).
            half: the two projections' weights cast for autocast, (W_qkv, W_o) (default None).
            cu_seqlens, max_seqlen: packed documents, as in `Transformer.hidden`.
            context_parallel: a process group of more than one rank over which x's sequence is
                sharded (`fastlm.distributed`; no KV cache); default None.

        Returns:
            (B, T, d_model).
        """
        B, T, C = x.shape
        half_qkv, half_out = half if half is not None else (None, None)
        H, Hkv = self.num_heads, self.num_kv_heads
        if token_positions is None:
            start = kv_cache.length if kv_cache is not None else 0
            token_positions = torch.arange(start, start + T, device=x.device)
            positions_checked = True
        if kv_cache is None and context_parallel is None:  # the projection's gradient: one tensor
            out = rope_attention(  # (B, H, T, D), or packed (1, H, B * T, D)
                self.qkv_proj(x, half_qkv),
                self.rope.cos_cached,
                self.rope.sin_cached,
                token_positions,
                H,
                Hkv,
                interleaved=self.rope.interleaved,
                check_positions=not positions_checked,
                cu_seqlens=cu_seqlens,
                max_seqlen=max_seqlen,
            )
            # (B, H, T, D) views of (B, T, H, D) memory: the reshape is free
            return self.output_proj(out.transpose(1, 2).reshape(B, T, -1), half_out)
        # q (B, H, T, D), k and v (B, Hkv, T, D): views of the projection; q and k rotated in its
        # storage, in one launch.
        q, k, v = split_heads(self.qkv_proj(x, half_qkv), H, Hkv)
        cos, sin = self.rope.cos_cached, self.rope.sin_cached
        if kv_cache is not None and kv_cache.length + T > cos.shape[0]:  # a sliding cache
            cos, sin, token_positions = _rope_rows(self.rope, token_positions)
        apply_rope_(q, k, cos, sin, token_positions, interleaved=self.rope.interleaved)
        if kv_cache is not None:
            k, v = kv_cache.append(layer, k, v)  # (B, Hkv, S, D)
            out = flash_attention(q, k, v, causal=True)  # (B, H, T, D)
        else:  # (B, H, T, D) in (B, T, H, D) memory, the keys exchanged with the group
            out = context_parallel_attention(q, k, v, context_parallel)
        return self.output_proj(out.transpose(1, 2).reshape(B, T, -1), half_out)


def _rope_rows(rope: RoPE, positions: torch.Tensor):
    """(cos, sin, index): the RoPE rows of `positions`, which may lie past rope's tables (a
    sliding KV cache's), by the tables' own formula (`rope_tables`: the same float32 products, so
    a position inside the tables gets its table row), and each position's row in them."""
    angles = torch.outer(
        positions.reshape(-1).float(), rope_frequencies(rope.theta, rope.d_k, positions.device)
    )
    index = torch.arange(positions.numel(), device=positions.device).reshape(positions.shape)
    return angles.cos(), angles.sin(), index


class TransformerBlock(reference.TransformerBlock):
    """Pre-norm block on the kernels, with the reference's constructor and attribute names.

    rms_norm1, mult_head_atten, rms_norm2 and ffe are built from the kernels' modules, so the
    state_dict keys are the reference's.

    Args:
        d_model, num_heads, d_ff, max_seq_len, theta, device, dtype, num_kv_heads,
            rope_interleaved, norm_eps, moe: as in `fastlm.reference.TransformerBlock` (with
            `moe`, ffe is a `fastlm.modules.MoeLayer`).

    Raises:
        ValueError: as `MultiHeadAttentionWithRoPE`.
    """

    norm_class = RmsNorm
    attention_class = MultiHeadAttentionWithRoPE
    ffn_class = SwiGlu
    moe_class = MoeLayer

    def forward(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor | None],
        token_positions: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        layer: int = 0,
        *,
        positions_checked: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        context_parallel=None,
    ):
        """x + attention + feed-forward, as the reference's block.

        `x` may also be the residual stream held as a pair (residual, delta) whose sum is the
        stream (delta None: zero); the block then returns the stream after it as such a pair, so
        the add of each delta is fused with the RMSNorm that follows it, here or in the next
        block. The model passes pairs, and through this forward, so that hooks on the block
        (FSDP2 gathers its sharded weights in one) run.

        Args:
            x: (B, T, d_model), or a pair (residual, delta) of such tensors (delta may be None).
            token_positions, kv_cache, layer, positions_checked, cu_seqlens, max_seqlen,
                context_parallel: as in `MultiHeadAttentionWithRoPE.forward`.

        Returns:
            (B, T, d_model); for a pair x, the pair (residual, delta) after the block.
        """
        pair = isinstance(x, tuple)
        residual, delta = x if pair else (x, None)
        half_attention, half_ffe = self._cast_weights()
        normed, residual = _add_norm(delta, residual, self.rms_norm1)
        delta = self.mult_head_atten(
            normed,
            token_positions,
            kv_cache,
            layer,
            positions_checked=positions_checked,
            half=half_attention,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            context_parallel=context_parallel,
        )
        normed, residual = _add_norm(delta, residual, self.rms_norm2)
        delta = self.ffe(normed, half_ffe)
        return (residual, delta) if pair else residual + delta

    def _cast_weights(self):
        """Under autocast with fp32 weights: the four GEMMs' weights in the autocast dtype, all
        cast by one copy (W1|W3 stacked for one GEMM), as (attention's, feed-forward's) pairs;
        else (None, None) and each GEMM takes its weight as it is (or autocast casts it)."""
        attention, ffe = self.mult_head_atten.cast_groups(), self.ffe.cast_groups()
        dtype = autocast_dtype(*(w for group in attention + ffe for w in group))
        if dtype is None:
            return None, None
        qkv, out, *half_ffe = cast_weights(attention + ffe, dtype)  # MoE: no ffe groups
        return (qkv, out), (tuple(half_ffe) or None)


def _add_norm(delta: torch.Tensor | None, residual: torch.Tensor, norm: RmsNorm):
    """(norm(residual + delta), residual + delta) in one kernel pass, the normed output in the
    dtype the next GEMM computes in: the autocast dtype under autocast (where the reference's
    RmsNorm returns fp32 that its next Linear casts down: the same numbers), else the stream's.

    Under autocast delta is bf16 while the stream stays fp32; the sum promotes to fp32 as the
    reference's `x + delta` does, inside the kernel."""
    device = residual.device.type
    out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    if delta is None:
        return rms_norm(residual, norm.g, norm.eps, out_dtype=out_dtype), residual
    return add_rms_norm(delta, residual, norm.g, norm.eps, out_dtype=out_dtype)


class Transformer(reference.Transformer):
    """Decoder-only language model on the kernels; a drop-in for `fastlm.reference.Transformer`.

    Its constructor (with the LLaMA-style options num_kv_heads, rope_interleaved, tie_embeddings and
    norm_eps) and its state_dict are the reference's, so checkpoints load both ways with
    `strict=True`; the parts are built from the kernels' modules. Beyond the reference's `forward`
    it has `hidden` (the final norm's output), `loss` (fused linear cross-entropy), `make_kv_cache`
    (generation) and `set_context_parallel`.

    Args:
        vocab_size, context_length, d_model, num_layers, num_heads, d_ff, rope_theta, device,
            dtype, num_kv_heads, rope_interleaved, tie_embeddings, norm_eps: as in
            `fastlm.reference.Transformer`, whose constructor this is.
        num_experts, experts_per_token, moe_d_ff, num_shared_experts, first_dense_layers,
            router, normalize_top_k, aux_loss_coef, z_loss_coef, router_bias_rate: the
            mixture-of-experts options of `fastlm.reference.Transformer`; the MoE layers
            (`fastlm.modules.MoeLayer`) run their experts on `fastlm.moe_experts`, and `loss`
            is the cross-entropy alone: add `auxiliary_loss()` for training (docs/moe-training.md).

    Raises:
        ValueError: as `fastlm.reference.Transformer`; and, where the Triton kernels run on
            `device`, a head dim (d_model / num_heads) that is not a multiple of 8 up to 512
            (the message says what to change; FASTLM_BACKEND=torch runs any even head dim).
    """

    embedding_class = Embedding
    block_class = TransformerBlock
    norm_class = RmsNorm
    linear_class = Linear
    #: The context-parallel group every forward spreads each sequence over (`set_context_parallel`).
    context_parallel_group: dist.ProcessGroup | None = None

    def set_context_parallel(self, group) -> Transformer:
        """Spread each sequence over the ranks of `group` (context parallelism).

        From then on every rank of the group calls `hidden`, `forward` and `loss` together, each
        with its shard of the tokens (and targets): `fastlm.distributed.shard_sequence(token_ids,
        rank, P)`, (B, N / P) of a batch of N-token sequences, N divisible by 2P and at most
        context_length. RoPE rotates each token by its global position (or by `token_positions`,
        the shard's global positions). Outputs are the shard's; each rank's `loss` is its share of
        the mean over the whole sequences (`fastlm.distributed.mean_share`), so averaging losses
        and gradients over the group gives the single-process ones. No KV cache, no packed
        documents (cu_seqlens).

        Args:
            group: a ProcessGroup, a DeviceMesh (1-D, or with a "context" dimension), or None
                to turn it off; a group of one rank is the plain path.

        Returns:
            The model.

        Raises:
            TypeError: a group that is none of those (`fastlm.distributed.context_group`).
            ValueError: a DeviceMesh of more dimensions without a "context" one.
        """
        group = None if group is None else context_group(group)
        single = group is None or dist.get_world_size(group) == 1
        self.context_parallel_group = None if single else group
        return self

    def hidden(
        self,
        token_ids: torch.Tensor,
        token_positions: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        *,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """The final norm's output [B, T, C]: what out_linear turns into logits.

        With a KV cache, token_ids are the tokens after the cached ones, and the cache's length
        advances by T.

        Args:
            token_ids: (B, T) int32 or int64 in [0, vocab_size); with a KV cache, cached + T at
                most context_length, or T 1 past it (the cache slides: `KVCache`).
            token_positions: (T,) or (B, T) integers in [0, context_length), the positions RoPE
                rotates by (default: L to L + T - 1, L the KV cache's length, 0 without one). Their
                values are checked once here, not in every layer.
            kv_cache: the generation cache from `make_kv_cache` (default None).
            cu_seqlens: packed documents. The B * T tokens, flattened row by row, are split into
                documents at cu_seqlens (int32 [num_docs + 1] on the tokens' device, 0 to B * T, as
                in `flash_attention_varlen`); each token attends only within its document and is
                rotated by its position in it, so a row may hold several documents and a document
                may go on in the next row; token_positions, if given, are the positions instead.
                Not with a KV cache.
            max_seqlen: with cu_seqlens, an int at least the longest document, at most
                context_length (default min(B * T, context_length)); it sizes the launch, so
                nothing is read back from the GPU.

        Returns:
            (B, T, d_model): in the autocast dtype under autocast, else the stream's dtype.

        Raises:
            TypeError: token_positions not an int32/int64 tensor, cu_seqlens not a tensor or
                max_seqlen not an int.
            ValueError: token_ids not a 2-D integer tensor, longer than context_length (with the
                cache's tokens), or (CPU tensors) with an id outside the vocabulary; positions of
                another shape or (CPU) out of range; a KV cache with cu_seqlens or context
                parallelism; cu_seqlens with context parallelism, or shards that make sequences
                longer than context_length; max_seqlen above context_length; bad cu_seqlens
                values (CPU tensors). On a GPU, bad ids, positions and cu_seqlens trip
                device-side asserts instead (a RuntimeError at the next synchronisation).
        """
        _check_tokens(token_ids, self.vocab_size, self.context_length, kv_cache)
        B, T = token_ids.shape
        group = self._check_context_parallel(T, kv_cache, cu_seqlens)
        if group is not None and token_positions is None:  # this shard's global positions
            world = dist.get_world_size(group)
            rank = dist.get_rank(group)
            token_positions = sequence_positions(T * world, rank, world, token_ids.device)
        elif cu_seqlens is not None:
            token_positions, max_seqlen = self._packed_positions(
                token_ids, token_positions, kv_cache, cu_seqlens, max_seqlen
            )
        elif token_positions is None:  # built once here rather than in every layer
            start = kv_cache.length if kv_cache is not None else 0
            token_positions = torch.arange(start, start + T, device=token_ids.device)
        else:  # checked once here rather than in every layer
            token_positions = check_positions(
                token_positions, B, T, self.context_length, token_ids.device
            )
        stream = (self.embedding(token_ids), None)  # (residual, delta), each (B, T, C)
        for layer, block in enumerate(self.blocks):
            stream = block(
                stream,
                token_positions,
                kv_cache,
                layer,
                positions_checked=True,
                cu_seqlens=cu_seqlens,
                max_seqlen=max_seqlen,
                context_parallel=group,
            )
        residual, delta = stream
        if kv_cache is not None:
            kv_cache.length += token_ids.shape[-1]
        return _add_norm(delta, residual, self.final_norm)[0]

    def _check_context_parallel(self, T: int, kv_cache, cu_seqlens) -> dist.ProcessGroup | None:
        """The context-parallel group (None: off), with what it cannot run refused."""
        group = self.context_parallel_group
        if group is None:
            return None
        if kv_cache is not None or cu_seqlens is not None:
            raise ValueError(
                "context parallelism (set_context_parallel) runs without a KV cache and without "
                "packed documents (cu_seqlens): the exchange of keys cuts at chunk bounds, not "
                "at documents"
            )
        world = dist.get_world_size(group)
        if T * world > self.context_length:
            raise ValueError(
                f"token_ids: {T} tokens on each of {world} context-parallel ranks make sequences "
                f"of {T * world}, longer than context_length={self.context_length}"
            )
        return group

    def _packed_positions(self, token_ids, token_positions, kv_cache, cu_seqlens, max_seqlen):
        """(each token's position: in its document, computed on the device with no host sync, or
        token_positions' flattened; max_seqlen) for packed documents; cu_seqlens' values are
        checked by flash_attention_varlen."""
        if kv_cache is not None:
            raise ValueError("cu_seqlens: packed documents do not run with a KV cache")
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
        tokens = token_ids.numel()
        if max_seqlen is None:
            max_seqlen = min(tokens, self.context_length)
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
            raise TypeError(f"max_seqlen must be an int, got {type(max_seqlen).__name__}")
        if max_seqlen > self.context_length:
            raise ValueError(
                f"max_seqlen is {max_seqlen}, but no document may be longer than "
                f"context_length={self.context_length} (RoPE's positions)"
            )
        if token_positions is not None:  # the caller's positions, (T,) or (B, T) as without it
            B, T = token_ids.shape
            positions = check_positions(
                token_positions, B, T, self.context_length, token_ids.device
            )
            return positions.expand(B, T).reshape(B * T), max_seqlen
        index = torch.arange(tokens, device=cu_seqlens.device)
        ends = cu_seqlens[1:].contiguous()  # searchsorted copies a strided one with a warning
        document = torch.searchsorted(ends, index.to(cu_seqlens.dtype), right=True)
        last = cu_seqlens.numel() - 1  # tokens past the end (a bad cu_seqlens): any position
        positions = index - cu_seqlens[document.clamp(max=last)]
        return positions.clamp(0, self.context_length - 1), max_seqlen

    def forward(
        self,
        token_ids: torch.Tensor,
        token_positions: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        *,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, vocab] of every position: out_linear of `hidden`.

        Args:
            token_ids: (B, T) token ids; with a KV cache, the tokens after the cached ones.
            token_positions, kv_cache, cu_seqlens, max_seqlen: as in `hidden` (cu_seqlens,
                max_seqlen: packed documents).

        Returns:
            (B, T, vocab_size).

        Raises:
            TypeError: as `hidden`.
            ValueError: as `hidden`.
        """
        return self.out_linear(
            self.hidden(
                token_ids, token_positions, kv_cache, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen
            )
        )

    def loss(
        self,
        token_ids: torch.Tensor,
        targets: torch.Tensor,
        token_positions: torch.Tensor | None = None,
        ignore_index: int = -100,
        *,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """Mean cross-entropy of the logits at each position against `targets`, without
        materialising the logits (fused linear cross-entropy on `hidden`'s output).

        Args:
            token_ids: (B, T) token ids.
            targets: token_ids' shape, int64 or int32, each in [0, vocab_size) or ignore_index; the
                caller shifts them (targets[:, t] is the token after token_ids[:, t]).
            token_positions: as in `hidden`.
            ignore_index: the target value left out of the mean (default -100); the mean is 0 when
                every target is ignored.
            cu_seqlens, max_seqlen: packed documents (`hidden`); the caller sets the target of each
                document's last token (the next document's first) to ignore_index if it should not
                count.

        Returns:
            The loss, an fp32 scalar; under context parallelism this rank's share of the mean over
            the whole sequences (`set_context_parallel`).

        Raises:
            TypeError: targets neither int64 nor int32; otherwise as `hidden`.
            ValueError: targets not a tensor of token_ids' shape, or (CPU targets) a target
                outside [0, vocab_size) other than ignore_index (on a GPU, a device-side
                assert); otherwise as `hidden`.
        """
        if not isinstance(targets, torch.Tensor) or targets.shape != token_ids.shape:
            got = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets)
            raise ValueError(
                f"targets must have the shape of token_ids {tuple(token_ids.shape)}, got {got}"
            )
        hidden = self.hidden(
            token_ids, token_positions, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen
        )
        loss = linear_cross_entropy(hidden, self.out_linear.w, targets, ignore_index=ignore_index)
        group = self.context_parallel_group
        return loss if group is None else mean_share(loss, targets, ignore_index, group)

    def make_kv_cache(self, batch_size: int | None = None) -> KVCache:
        """An empty KV cache for generating: the last context_length positions (`KVCache`).

        Args:
            batch_size: unused: the batch size is taken from the first tokens appended.

        Returns:
            A `KVCache` of len(blocks) layers and context_length positions.
        """
        return KVCache(len(self.blocks), self.context_length)


def _check_tokens(
    token_ids: torch.Tensor, vocab_size: int, context_length: int, kv_cache: KVCache | None
) -> None:
    """The reference's checks, ValueError naming token_ids, without a host sync on the hot path:
    token values are read back only from CPU tensors. On a GPU, and under torch.compile, an id
    outside the vocabulary trips a device-side assert instead (a RuntimeError at the next
    synchronisation; F.embedding would otherwise read out of bounds)."""
    if kv_cache is not None:
        kv_cache.check_room(token_ids.shape[-1])
    on_host = token_ids.device.type == "cpu" and not torch.compiler.is_compiling()
    reference.check_token_input(token_ids, vocab_size, context_length, check_values=on_host)
    if not on_host:
        in_vocab = ((token_ids >= 0) & (token_ids < vocab_size)).all()
        torch._assert_async(in_vocab, f"token_ids must lie in [0, {vocab_size})")
