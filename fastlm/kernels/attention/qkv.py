"""`rope_attention`: RoPE and flash attention on a packed q|k|v projection, the model's
attention in one call, with one gradient buffer.

A fused projection writes q, k and v side by side: qkv (B, T, (Hq + 2 Hkv) * D). RoPE rotates the
q and k parts in place, attention reads all three through their strides, and the backward writes
dq, dk (rotated back in place) and dv straight into one gradient of qkv's shape. Autograd built
from views would instead zero-fill a buffer per view, copy each gradient in and add them.
"""

from __future__ import annotations

import math

import torch

from fastlm.backend import use_triton
from fastlm.kernels._common import check_float, empty_like
from fastlm.kernels.attention.backward import attention_backward
from fastlm.kernels.attention.launch import (
    Varlen,
    as_heads,
    as_packed,
    check_kernel_head_dim,
    empty_heads_like,
)
from fastlm.kernels.attention.ops import (
    check_cu_seqlens,
    check_inputs,
    flash_attention_op,
    flash_attention_varlen,
    flash_attention_varlen_op,
)
from fastlm.kernels.attention.reference import flash_attention_ref
from fastlm.kernels.rope import check_rope_args, check_rotatable, rope_ref
from fastlm.options import check


@torch.library.custom_op("fastlm::flash_attention_backward_", mutates_args=("dq", "dk", "dv"))
def _flash_attention_backward_into_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor, causal: bool, softmax_scale: float, allow_tf32: bool, deterministic: bool,
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int = 0
) -> None:
    """flash_attention's backward written into dq, dk, dv (views of one buffer, say); with
    cu_seqlens, of packed sequences (self-attention: the same bounds for queries and keys) held
    as the launchers' (1, H, total, D) views, lse (1, H, total)."""
    check("softmax_scale", softmax_scale)  # a direct torch.ops call, by the public rule
    check("max_seqlen", max_seqlen)
    varlen = None if cu_seqlens is None else Varlen(cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    attention_backward(
        do, q, k, v, o, lse, causal, softmax_scale, allow_tf32, deterministic, out=(dq, dk, dv),
        varlen=varlen
    )


@_flash_attention_backward_into_op.register_fake
def _(do, q, k, v, o, lse, causal, softmax_scale, allow_tf32, deterministic, dq, dk, dv, *packed):
    return None


def split_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, packed: bool = False):
    """q (B, Hq, T, D), k and v (B, Hkv, T, D): views of qkv (B, T, (Hq + 2 Hkv) * D); packed:
    of its B * T tokens as one row, (1, H, B * T, D)."""
    if packed:
        qkv = qkv.view(1, -1, qkv.shape[-1])
    B, T, width = qkv.shape
    D = width // (num_heads + 2 * num_kv_heads)
    q_end, k_end = num_heads * D, (num_heads + num_kv_heads) * D
    q = qkv[..., :q_end].view(B, T, num_heads, D).transpose(1, 2)
    k = qkv[..., q_end:k_end].view(B, T, num_kv_heads, D).transpose(1, 2)
    v = qkv[..., k_end:].view(B, T, num_kv_heads, D).transpose(1, 2)
    return q, k, v


class _PackedRopeAttention(torch.autograd.Function):
    """RoPE in place on qkv's q and k, then flash attention; the backward fills one dqkv.

    qkv is marked dirty (it holds the rotated q and k afterwards) and returned beside o, as
    autograd requires of a Function that writes an input; callers use o.
    """

    @staticmethod
    def forward(
        ctx, qkv, cos, sin, positions, num_heads, num_kv_heads, causal, softmax_scale, allow_tf32,
        deterministic, interleaved, cu_seqlens, max_seqlen
    ):
        packed = cu_seqlens is not None
        q, k, v = split_heads(qkv, num_heads, num_kv_heads, packed)
        torch.ops.fastlm.rope_(q, k, cos, sin, positions, interleaved, False)
        if not packed:
            o, lse = flash_attention_op(
                q, k, v, causal, softmax_scale, -1, -1, 0.0, allow_tf32, deterministic
            )
        else:  # q, k, v are the packed sequences' (1, H, total, D)
            o, lse = flash_attention_varlen_op(
                *(as_packed(t) for t in (q, k, v)), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                causal, softmax_scale, -1, -1, 0.0, allow_tf32, deterministic
            )
            o, lse = as_heads(o), lse[None]  # (1, H, total, D), (1, H, total)
        ctx.mark_dirty(qkv)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(qkv, o, lse, cos, sin, positions, cu_seqlens)
        ctx.max_seqlen = max_seqlen or 0  # the op takes an int
        ctx.args = (
            num_heads, num_kv_heads, causal, softmax_scale, allow_tf32, deterministic, interleaved
        )
        return o, qkv

    @staticmethod
    def backward(ctx, do, d_rotated):
        """do: o's gradient; d_rotated: that of qkv as it is after the call (rotated), when the
        caller read it again. Both are gradients with respect to the rotated q and k, so they are
        summed first and rotated back together."""
        if torch.is_grad_enabled():  # create_graph=True: the kernels' backward has no graph
            raise RuntimeError(
                "fastlm.rope_attention: second derivatives are not supported "
                "(create_graph=True through its backward)"
            )
        qkv, o, lse, cos, sin, positions, cu_seqlens = ctx.saved_tensors
        num_heads, num_kv_heads, causal, softmax_scale, allow_tf32, deterministic, interleaved = (
            ctx.args
        )
        packed = cu_seqlens is not None
        dqkv = empty_like(qkv)  # a DTensor qkv's is one of its placements
        dq, dk, dv = split_heads(dqkv, num_heads, num_kv_heads, packed)
        if do is None:
            dqkv.zero_()
        else:
            q, k, v = split_heads(qkv, num_heads, num_kv_heads, packed)
            _flash_attention_backward_into_op(
                do, q, k, v, o, lse, causal, softmax_scale, allow_tf32, deterministic, dq, dk, dv,
                cu_seqlens, ctx.max_seqlen
            )
        if d_rotated is not None:
            dqkv.add_(d_rotated)
        torch.ops.fastlm.rope_(dq, dk, cos, sin, positions, interleaved, True)
        return dqkv, *[None] * 12


def rope_attention_ref(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
    num_heads: int, num_kv_heads: int | None = None, causal: bool = True,
    softmax_scale: float | None = None, interleaved: bool = True
) -> torch.Tensor:
    """rope_attention's math in PyTorch (rotated copies; qkv is left as it is)."""
    q, k, v = split_heads(qkv, num_heads, num_kv_heads or num_heads)
    q = rope_ref(q, cos, sin, positions, interleaved)
    k = rope_ref(k, cos, sin, positions, interleaved)
    return flash_attention_ref(q, k, v, causal, softmax_scale)


def rope_attention(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, token_positions: torch.Tensor,
    num_heads: int, num_kv_heads: int | None = None, causal: bool = True,
    softmax_scale: float | None = None, *, interleaved: bool = True, allow_tf32: bool = True,
    deterministic: bool = True, check_positions: bool = True,
    cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None
) -> torch.Tensor:
    """Attention of a fused q|k|v projection with RoPE: the model's attention in one call.

    qkv's q and k are rotated in place, on both backends (so qkv must not be a leaf that requires
    grad, and must not be read afterwards for its unrotated values), then attended by
    `flash_attention` through their strides. With the kernels qkv's gradient is written as one
    tensor: dq and dk rotated back, and dv, side by side, with no buffers to zero or gradients to
    add.

    Args:
        qkv: (B, T, (Hq + 2 Hkv) * D) float16, bfloat16 or float32, the projection's output (q's
            heads, then k's, then v's).
        cos, sin: RoPE's tables, as in `apply_rope_`.
        token_positions: as in `apply_rope_`: (T,) or (B, T); with cu_seqlens, the B * T tokens'
            positions, (B * T,).
        num_heads: Hq, a positive int.
        num_kv_heads: Hkv, a positive int dividing Hq (default: num_heads).
        causal, softmax_scale, allow_tf32, deterministic: as in `flash_attention`.
        interleaved: RoPE's pair layout, as in `apply_rope_` (default True).
        check_positions: False skips the range check of the positions, for a caller that checked
            them once for all layers (default True).
        cu_seqlens, max_seqlen: packed documents, as in `flash_attention_varlen` (self-attention:
            one cu_seqlens for queries and keys; max_seqlen default: B * T): the B * T tokens,
            flattened row by row, are split at cu_seqlens. Row b + 1 of qkv must then follow row b
            in memory.

    Returns:
        o (B, Hq, T, D) in (B, T, Hq, D) memory, so that `o.transpose(1, 2).reshape(B, T, Hq * D)`
        is free; with cu_seqlens, o (1, Hq, B * T, D) in (B * T, Hq, D) memory.

    Raises:
        TypeError: qkv not a tensor of float16, bfloat16 or float32; cos, sin, token_positions,
            causal or softmax_scale as in `apply_rope_` and `flash_attention`.
        ValueError: num_heads or num_kv_heads not a positive int; qkv not 3-D with a last dim
            that splits into Hq + 2 Hkv heads; a leaf qkv that requires grad; Hq not a multiple of
            Hkv; with cu_seqlens, rows of qkv that do not follow each other in memory, or bad
            cu_seqlens, as in `flash_attention_varlen`; the tables, positions and head dim as in
            `apply_rope_` and `flash_attention`.
    """
    check_float("qkv", qkv)
    num_heads = check("num_heads", num_heads, spec="num_kv_heads")  # the same range
    num_kv_heads = check("num_kv_heads", num_kv_heads, none_ok=True) or num_heads
    check("max_seqlen", max_seqlen, none_ok=True)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if qkv.dim() != 3 or qkv.shape[-1] % (num_heads + 2 * num_kv_heads):
        raise ValueError(
            f"qkv must be (B, T, (num_heads + 2 * num_kv_heads) * head_dim) = "
            f"(B, T, {num_heads + 2 * num_kv_heads} * D), got {tuple(qkv.shape)}"
        )
    packed = cu_seqlens is not None
    B, T = qkv.shape[:2]
    if packed and B > 1 and T > 1 and qkv.stride(0) != T * qkv.stride(1):
        raise ValueError(
            f"qkv has strides {qkv.stride()}: with cu_seqlens its B * T tokens are one packed "
            "sequence, so row b + 1 must follow row b in memory (stride(0) == T * stride(1))"
        )
    q, k, v = split_heads(qkv, num_heads, num_kv_heads, packed)
    check_inputs(q, k, v, causal, softmax_scale)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if packed:
        max_seqlen = _check_packed_self_attention(cu_seqlens, max_seqlen, q.shape[2], q.device)
    check_rotatable("qkv", qkv)
    if not use_triton(qkv):
        positions = (
            check_rope_args(q, cos, sin, token_positions) if check_positions else token_positions
        )
        # Rotated in place as the kernels do (autograd tracks the writes into qkv's views).
        for t in (q, k):
            t.copy_(rope_ref(t, cos, sin, positions, interleaved))
        if packed:
            o = flash_attention_varlen(
                *(as_packed(t) for t in (q, k, v)), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                causal, scale
            )
            return as_heads(o)
        return flash_attention_ref(q, k, v, causal, scale)
    check_kernel_head_dim(q.shape[-1], dtype=q.dtype)
    positions = check_rope_args(q, cos, sin, token_positions, check_values=check_positions)
    if qkv.numel() == 0:
        return empty_heads_like(q)
    return _PackedRopeAttention.apply(
        qkv, cos.contiguous(), sin.contiguous(), positions, num_heads, num_kv_heads, causal, scale,
        bool(allow_tf32), bool(deterministic), interleaved, cu_seqlens, max_seqlen
    )[0]


def _check_packed_self_attention(cu_seqlens, max_seqlen, total: int, device) -> int:
    """rope_attention's packed sequences checked as flash_attention_varlen's; max_seqlen as an
    int (default: the total)."""
    max_seqlen = total if max_seqlen is None else max_seqlen
    check_cu_seqlens("cu_seqlens", cu_seqlens, total, max_seqlen, device)
    return int(max_seqlen)
