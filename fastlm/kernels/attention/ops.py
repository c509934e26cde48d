"""`torch.ops.fastlm.flash_attention`, `flash_attention_varlen` and their backward (fake tensors
and autograd formulas), the argument checks, and the public functions, which apply the backend
rule (`fastlm.backend.use_triton`) once."""

from __future__ import annotations

import math
import numbers

import torch

from fastlm.backend import use_triton
from fastlm.kernels._common import check_float, check_match, refuse_double_backward
from fastlm.kernels.attention.backward import attention_backward
from fastlm.kernels.attention.forward import attention_forward
from fastlm.kernels.attention.launch import (
    LN_2,
    Varlen,
    as_heads,
    as_packed,
    check_kernel_head_dim,
    empty_heads_like,
)
from fastlm.kernels.attention.reference import flash_attention_ref, flash_attention_varlen_ref
from fastlm.options import OPTIONS, check, check_flag


def _check_op_options(
    q, sinks, softmax_scale, window_left, window_right, softcap, max_seqlen_q=0, max_seqlen_k=0
) -> None:
    """The ops' numeric arguments and sinks by the public functions' rule (`fastlm.options`), so
    that a direct `torch.ops.fastlm` call refuses what `flash_attention` refuses (the varlen ops'
    max lengths by their range only: their cu_seqlens are not read on the host here)."""
    check_sinks(sinks, q.shape[1], q.device)  # q's heads: dim 1 of (B, Hq, N, D) and (T, Hq, D)
    check("max_seqlen_q", max_seqlen_q)
    check("max_seqlen_k", max_seqlen_k)
    check("softmax_scale", softmax_scale)
    check("window_size[0]", window_left, spec="window_size")
    check("window_size[1]", window_right, spec="window_size")
    check("softcap", softcap)


@torch.library.custom_op("fastlm::flash_attention", mutates_args=())
def flash_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
    window_left: int, window_right: int, softcap: float, allow_tf32: bool, deterministic: bool,
    sinks: torch.Tensor | None = None, softcap_approx: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse): o (B, Hq, Nq, Dv) in q's memory layout, lse (B, Hq, Nq) fp32 base 2 (the sinks
    in its sums). deterministic picks the backward's schedule (the forward has one)."""
    _check_op_options(q, sinks, softmax_scale, window_left, window_right, softcap)
    return attention_forward(
        q, k, v, causal, softmax_scale, allow_tf32, (window_left, window_right), softcap,
        sinks=sinks, softcap_approx=softcap_approx
    )


@flash_attention_op.register_fake
def _(q, k, v, *rest):
    B, Hq, Nq, _ = q.shape
    o = empty_heads_like(q, head_dim=v.shape[-1])
    return o, q.new_empty((B, Hq, Nq), dtype=torch.float32)


def _with_sink_grad(grads: tuple, sinks: torch.Tensor | None, q: torch.Tensor) -> tuple:
    """The backward ops' outputs: (dq, dk, dv) and the sinks' gradient, which `grads` ends with
    when there are sinks; without them an empty (0,) tensor (an op returns as many tensors each
    call)."""
    return grads if sinks is not None else (*grads, q.new_empty((0, ), dtype=torch.float32))


@torch.library.custom_op("fastlm::flash_attention_backward", mutates_args=())
def _flash_attention_backward_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor, causal: bool, softmax_scale: float, window_left: int, window_right: int,
    softcap: float, allow_tf32: bool, deterministic: bool, sinks: torch.Tensor | None = None,
    softcap_approx: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks); dsinks is (0,) without sinks."""
    _check_op_options(q, sinks, softmax_scale, window_left, window_right, softcap)
    grads = attention_backward(
        do, q, k, v, o, lse, causal, softmax_scale, allow_tf32, deterministic,
        window=(window_left, window_right), softcap=softcap, sinks=sinks,
        softcap_approx=softcap_approx
    )
    return _with_sink_grad(grads, sinks, q)


@_flash_attention_backward_op.register_fake
def _(
    do, q, k, v, o, lse, causal, scale, left, right, softcap, tf32, deterministic, sinks=None,
    softcap_approx=False
):
    grads = empty_heads_like(q), empty_heads_like(k), empty_heads_like(v)
    return _with_sink_grad(
        (*grads, *([] if sinks is None else [torch.empty_like(sinks)])), sinks, q
    )


def _flash_attention_setup(ctx, inputs, output):
    """Saves q, k, v, o, the sinks and the (B, Hq, Nq) fp32 log-sum-exp: memory linear in the
    sequence."""
    q, k, v, *flags, sinks, softcap_approx = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, sinks)
    ctx.set_materialize_grads(False)  # lse has no gradient: no zero tensor for it
    ctx.mark_non_differentiable(lse)
    ctx.flags = flags
    ctx.softcap_approx = softcap_approx


def _flash_attention_grad(ctx, do, _):
    q, k, v, o, lse, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = _flash_attention_backward_op(
        do, q, k, v, o, lse, *ctx.flags, sinks, ctx.softcap_approx
    )
    dsinks = dsinks if sinks is not None else None
    return dq, dk, dv, *[None] * len(ctx.flags), dsinks, None


torch.library.register_autograd(
    "fastlm::flash_attention", _flash_attention_grad, setup_context=_flash_attention_setup
)
refuse_double_backward("fastlm::flash_attention_backward", "flash_attention")


@torch.library.custom_op("fastlm::flash_attention_varlen", mutates_args=())
def flash_attention_varlen_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
    softmax_scale: float, window_left: int, window_right: int, softcap: float, allow_tf32: bool,
    deterministic: bool, sinks: torch.Tensor | None = None, softcap_approx: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse): o (total_q, Hq, Dv) in q's memory layout, lse (Hq, total_q) fp32 base 2."""
    _check_op_options(
        q, sinks, softmax_scale, window_left, window_right, softcap, max_seqlen_q, max_seqlen_k
    )
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    o, lse = attention_forward(
        as_heads(q), as_heads(k), as_heads(v), causal, softmax_scale, allow_tf32,
        (window_left, window_right), softcap, varlen, sinks, softcap_approx
    )
    return as_packed(o), lse[0]


@flash_attention_varlen_op.register_fake
def _(q, k, v, *rest):
    o = as_packed(empty_heads_like(as_heads(q), head_dim=v.shape[-1]))
    return o, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("fastlm::flash_attention_varlen_backward", mutates_args=())
def _flash_attention_varlen_backward_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
    max_seqlen_k: int, causal: bool, softmax_scale: float, window_left: int, window_right: int,
    softcap: float, allow_tf32: bool, deterministic: bool, sinks: torch.Tensor | None = None,
    softcap_approx: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks); dsinks is (0,) without sinks."""
    _check_op_options(
        q, sinks, softmax_scale, window_left, window_right, softcap, max_seqlen_q, max_seqlen_k
    )
    dq, dk, dv, *dsinks = attention_backward(
        *(as_heads(t) for t in (do, q, k, v, o)), lse[None], causal, softmax_scale, allow_tf32,
        deterministic, window=(window_left, window_right), softcap=softcap,
        varlen=Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                      max_seqlen_k), sinks=sinks, softcap_approx=softcap_approx
    )
    return _with_sink_grad((*(as_packed(g) for g in (dq, dk, dv)), *dsinks), sinks, q)


@_flash_attention_varlen_backward_op.register_fake
def _(
    do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap, tf32,
    deterministic, sinks=None, softcap_approx=False
):
    grads = tuple(as_packed(empty_heads_like(as_heads(t))) for t in (q, k, v))
    return _with_sink_grad(
        (*grads, *([] if sinks is None else [torch.empty_like(sinks)])), sinks, q
    )


def _flash_attention_varlen_setup(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *flags, sinks, softcap_approx = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, sinks)
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse)
    ctx.flags = flags
    ctx.softcap_approx = softcap_approx


def _flash_attention_varlen_grad(ctx, do, _):
    q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = _flash_attention_varlen_backward_op(
        do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *ctx.flags, sinks, ctx.softcap_approx
    )
    dsinks = dsinks if sinks is not None else None
    return dq, dk, dv, None, None, *[None] * len(ctx.flags), dsinks, None


torch.library.register_autograd(
    "fastlm::flash_attention_varlen", _flash_attention_varlen_grad,
    setup_context=_flash_attention_varlen_setup
)
refuse_double_backward("fastlm::flash_attention_varlen_backward", "flash_attention_varlen")


def _check_heads(names: tuple[str, str, str], q, k, v, dims: int, layout: str) -> None:
    """q, k, v: kernel dtypes, one device, `dims` dims, k and v alike but for the head dim (v's
    may differ: MLA), grouped heads and equal q and k head dims (the head axis is -2 in both
    layouts)."""
    for name, t in zip(names, (q, k, v)):
        check_float(name, t)
        if t.dim() != dims:
            raise ValueError(f"{name} must have {dims} dims ({layout}), got shape {tuple(t.shape)}")
    check_match("k", k, "q", q)
    check_match("v", v, "q", q)
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"v has shape {tuple(v.shape)}, but k has {tuple(k.shape)}; they must match but for "
            "the head dim"
        )
    D, Dk = q.shape[-1], k.shape[-1]
    if Dk != D:
        raise ValueError(f"k has head dim {Dk}, but q has {D}")
    if D < 1:
        raise ValueError("q has head dim 0; it must be at least 1")
    if v.shape[-1] < 1:
        raise ValueError("v has head dim 0; it must be at least 1")
    Hq, Hkv = q.shape[-2] if dims == 3 else q.shape[1], k.shape[-2] if dims == 3 else k.shape[1]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q has {Hq} heads, which is not a multiple of k's {Hkv} heads")


def _check_causal_and_scale(causal, softmax_scale) -> None:
    check_flag("causal", causal)
    check("softmax_scale", softmax_scale, none_ok=True)


def check_inputs(q, k, v, causal, softmax_scale) -> None:
    _check_heads(("q", "k", "v"), q, k, v, 4, "batch, heads, seq, head_dim")
    (B, _, Nq, _), (Bk, _, Nk, _) = q.shape, k.shape
    if Bk != B:
        raise ValueError(f"k has batch size {Bk}, but q has {B}")
    if Nk == 0:
        raise ValueError("k has sequence length 0: every query needs at least one key")
    if Nq > Nk:
        raise ValueError(
            f"q has sequence length {Nq} > k's {Nk}; queries must be the last Nq of the keys' "
            "positions"
        )
    _check_causal_and_scale(causal, softmax_scale)


def check_options(causal: bool, window_size, softcap, return_lse) -> tuple[tuple[int, int], float]:
    """window_size as two ints and softcap as a float, checked."""
    if (
        not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or
        not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size)
    ):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = (
        check(f"window_size[{side}]", w, spec="window_size") for side, w in enumerate(window_size)
    )
    if causal and right > 0:
        raise ValueError(
            f"window_size[1] is {right}, but with causal=True no query sees a later key: "
            "use -1 or 0 (or causal=False)"
        )
    softcap = check("softcap", softcap)
    check_flag("return_lse", return_lse)
    return (left, right), softcap


def check_cu_seqlens(name: str, cu: object, total: int, max_seqlen: object, device) -> None:
    """cu_seqlens: int32, 1-D, on q's device, 0 first, the packed total last, non-decreasing, no
    step above max_seqlen. The values are checked on the host for a CPU tensor; on a GPU (or when
    compiling) with `torch._assert_async`, which reports a bad value as a device-side assertion
    without a host sync."""
    max_name = name.replace("cu_seqlens", "max_seqlen")
    check(max_name, max_seqlen, spec="max_seqlen")
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(
            f"{name} must be 1-D with num_seqs + 1 >= 2 entries, got shape {tuple(cu.shape)}"
        )
    if cu.device != torch.device(device):
        raise ValueError(f"{name} is on {cu.device}, but q is on {device}")
    message = (
        f"{name} must start at 0, end at the packed length {total} and not decrease, with no "
        f"sequence longer than {max_name} = {max_seqlen}"
    )
    steps = cu[1:] - cu[:-1]
    if cu.device.type == "cpu" and not torch.compiler.is_compiling():
        if cu[0] != 0 or cu[-1] != total or steps.min() < 0 or steps.max() > max_seqlen:
            raise ValueError(f"{message}, got {cu.tolist()}")
    else:
        valid = (cu[0] == 0) & (cu[-1] == total) & (steps >= 0).all() & (steps <= max_seqlen).all()
        torch._assert_async(valid, message)


def check_kernel_head_dims(q: torch.Tensor, v: torch.Tensor) -> None:
    """q's (and k's) head dim and v's, as the Triton kernels take them."""
    check_kernel_head_dim(q.shape[-1], dtype=q.dtype)
    check_kernel_head_dim(v.shape[-1], "v", v.dtype)


def check_sinks(sinks: object, num_heads: int, device) -> None:
    """sinks: None, or a floating-point (Hq,) tensor on q's device whose elements, as float32
    holds them (what both backends compute with), lie in `OPTIONS["sinks"]` or are -inf (no
    sink): no NaN, no +inf, and nothing that is inf in float32 or in the kernels' base 2 (a
    float64 1e300, an fp32 2.5e38). The values are checked on the host for a CPU tensor, on a
    GPU (or when compiling) with `torch._assert_async`, as `check_cu_seqlens` does."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
    if sinks.shape != (num_heads, ):
        raise ValueError(
            f"sinks must have shape (Hq,) = ({num_heads},), one logit per query head, got "
            f"{tuple(sinks.shape)}"
        )
    if sinks.device != torch.device(device):
        raise ValueError(f"sinks is on {sinks.device}, but q is on {device}")
    allowed = OPTIONS["sinks"]
    message = (
        f"each element of sinks, as float32, must be {allowed.describe()} or -inf (no sink for "
        "that head): the kernels compute with sinks * log2(e) in float32"
    )
    as_used = sinks.float().double()
    valid = (as_used == -math.inf) | ((allowed.low <= as_used) & (as_used <= allowed.high))
    if sinks.device.type == "cpu" and not torch.compiler.is_compiling():
        if not valid.all():
            raise ValueError(f"{message}, got {sinks.tolist()}")
    else:
        torch._assert_async(valid.all(), message)


def natural_lse(lse: torch.Tensor) -> torch.Tensor:
    """The kernels' base-2 log-sum-exp in natural log, with a row that saw no key at -inf (the
    kernels keep +inf there, which zeroes the backward's P)."""
    return torch.where(torch.isposinf(lse), -math.inf, lse * LN_2)


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
    softmax_scale: float | None = None, *, window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0, return_lse: bool = False, allow_tf32: bool = True,
    deterministic: bool = True, sinks: torch.Tensor | None = None, softcap_approx: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(softmax_scale * q k^T [+ causal mask]) v without materialising the scores.

    Grouped-query / multi-query attention: query head h reads key/value head h // (Hq // Hkv). The
    queries are the last Nq of the keys' positions: query i sits on the diagonal d = i + Nk - Nq
    (aligned to the end, as in KV-cache decoding). Key blocks outside every row's window are never
    visited: the work is O(N * window). Softmax statistics are fp32.

    Args:
        q: (B, Hq, Nq, D) float16, bfloat16 or float32, 1 <= Nq <= Nk. Any strides (e.g.
            `x.view(B, N, H, D).transpose(1, 2)` or slices of a fused qkv tensor) are read in
            place. D: a multiple of 8 up to 256 for the Triton kernel (the PyTorch backend takes
            any).
        k: (B, Hkv, Nk, D), q's dtype and device, Hq a multiple of Hkv, Nk >= 1.
        v: (B, Hkv, Nk, Dv), k's but for its head dim Dv, which may differ from D (MLA: D = 192,
            Dv = 128), with D's limits for the Triton kernel.
        causal: query i sees key j iff j <= i + Nk - Nq (default True).
        softmax_scale: the scale of the scores (default 1 / sqrt(D)).
        window_size: (left, right): query i sees key j only if d - left <= j <= d + right; -1
            (the default, both sides) leaves that side unbounded; with causal=True right is 0 (it
            may be given as -1 or 0).
        softcap: if > 0, each scaled score s becomes softcap * tanh(s / softcap) before the mask
            and the softmax (gradients through the cap); 0 (the default) is off.
        softcap_approx: with a cap, compute its tanh approximately, as flash-attention does
            (tanh.approx.f32 on a GPU, one instruction, 2^-11 relative): each capped score is
            then off by at most softcap * 2^-11, so each weight by a factor within
            exp(+-2 softcap 2^-11) (docs/attention.md states the bounds on o and the
            gradients). Where that instruction cannot run (the interpreter, the PyTorch
            backend) a model of it: tanh rounded toward zero to 11 bits. Default False: the
            exact cap.
        return_lse: also return lse (B, Hq, Nq) fp32, the natural log-sum-exp of each row's capped,
            masked scores and its head's sink (-inf for a row that sees no key and no sink, whose
            output is 0). lse carries no gradient. Default False.
        allow_tf32: for float32 inputs on a GPU, False makes the dots full fp32 instead of TF32
            (default True).
        deterministic: the backward's schedule. True (the default): a dK/dV pass and a dQ pass
            with no atomics, bitwise reproducible for a given config. False: FA2's 5-matmul
            schedule, one pass that also adds dQ with fp32 atomics (less recomputation; gradients
            equal to rounding only).
        sinks: None (the default) or (Hq,) attention sinks (gpt-oss), any floating dtype, on q's
            device: one logit per query head that joins every row's softmax denominator and
            takes no value, neither scaled nor capped: row i's weights are exp(s_ij) /
            (sum_j exp(s_ij) + exp(sinks[h])). Math in fp32; differentiable, its gradient in
            sinks' dtype. A row that sees no key then has output 0 and lse = sinks[h]. -inf is
            no sink for that head (the same result as without); NaN, +inf and values beyond
            `fastlm.options.SINK_MAX` (3.4e38 * ln 2) in magnitude as float32 are refused.

    Returns:
        o (B, Hq, Nq, Dv) in q's dtype, differentiable in q, k, v (and sinks); (o, lse) with
        return_lse.

    Raises:
        TypeError: q, k or v not a tensor of float16, bfloat16 or float32, or of two dtypes;
            causal, return_lse, softcap_approx not a bool; softmax_scale not a real number or
            None; window_size not a pair of ints; softcap not a real number; sinks not a
            floating-point tensor.
        ValueError: q, k, v not 4-D, on two devices, k and v of two shapes (but for the head
            dim), q and k head dims that differ, a head dim of 0, Hq not a multiple of Hkv, batch
            sizes that differ, Nk = 0 or Nq > Nk; a window side outside [-1, 2**30], or
            window_size[1] > 0 with causal=True; softmax_scale outside [-1e6, 1e6], softcap
            outside [0, 1e6] (nan, inf: the rule of every option, `fastlm.options`); sinks not of
            shape (Hq,), on another device, or holding NaN, +inf or (as float32) a value beyond
            3.4e38 * ln 2 in magnitude (`fastlm.options.SINK_MAX`); with the Triton kernel, a
            head dim it does not take.
    """
    check_inputs(q, k, v, causal, softmax_scale)
    window, softcap = check_options(causal, window_size, softcap, return_lse)
    check_flag("softcap_approx", softcap_approx)
    check_sinks(sinks, q.shape[1], q.device)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if not use_triton(q) or q.numel() == 0:
        return flash_attention_ref(
            q, k, v, causal, scale, window_size=window, softcap=softcap, return_lse=return_lse,
            sinks=sinks, softcap_approx=softcap_approx
        )
    check_kernel_head_dims(q, v)
    o, lse = flash_attention_op(
        q, k, v, causal, scale, *window, softcap, bool(allow_tf32), bool(deterministic), sinks,
        softcap_approx
    )
    return (o, natural_lse(lse)) if return_lse else o


def flash_attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool = True,
    softmax_scale: float | None = None, *, window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0, return_lse: bool = False, allow_tf32: bool = True,
    deterministic: bool = True, sinks: torch.Tensor | None = None, softcap_approx: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """flash_attention of packed sequences (documents), each attending only within itself.

    Sequence i's queries, rows cu_seqlens_q[i] to cu_seqlens_q[i + 1] of q, attend only to its
    keys, rows cu_seqlens_k[i] to cu_seqlens_k[i + 1] of k and v, with the causal mask and window
    aligned to the end of each sequence as in `flash_attention`. A sequence may be empty; one with
    more queries than keys masks its first queries, which get output 0.

    Args:
        q: (total_q, Hq, D) float16, bfloat16 or float32, any strides; D as in `flash_attention`.
        k: (total_k, Hkv, D), q's dtype and device, Hq a multiple of Hkv, any strides.
        v: (total_k, Hkv, Dv), k's but for its head dim, as in `flash_attention`.
        cu_seqlens_q, cu_seqlens_k: int32 (num_seqs + 1,) on q's device, each from 0 to its total,
            non-decreasing; one sequence of keys per sequence of queries. On a CPU tensor the values
            are checked at once; on a GPU by a device-side assertion (`torch._assert_async`, no host
            sync).
        max_seqlen_q, max_seqlen_k: ints at least the longest sequence's lengths; they size the
            launch, so nothing is read back from the device.
        causal, softmax_scale, window_size, softcap, allow_tf32, deterministic, sinks,
            softcap_approx: as in `flash_attention` (a sink joins every row of every sequence of
            its head).
        return_lse: also return lse (Hq, total_q) fp32 (default False).

    Returns:
        o (total_q, Hq, Dv) in q's dtype; (o, lse) with return_lse.

    Raises:
        TypeError: q, k, v, the options or max_seqlen_* of a wrong type, as in `flash_attention`;
            cu_seqlens_* not a tensor.
        ValueError: q, k, v not 3-D or otherwise as in `flash_attention`; cu_seqlens_* not int32,
            not 1-D with at least 2 entries, on another device than q, of different lengths, or
            (on the CPU) not rising from 0 to the total with no step above max_seqlen_*; a negative
            max_seqlen_*.
    """
    _check_heads(("q", "k", "v"), q, k, v, 3, "tokens, heads, head_dim")
    _check_causal_and_scale(causal, softmax_scale)
    window, softcap = check_options(causal, window_size, softcap, return_lse)
    for name, cu, total, longest in (
        ("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
        ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
    ):
        check_cu_seqlens(name, cu, total, longest, q.device)
    if cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise ValueError(
            f"cu_seqlens_k has {cu_seqlens_k.numel()} entries, but cu_seqlens_q has "
            f"{cu_seqlens_q.numel()}: one sequence of keys per sequence of queries"
        )
    check_flag("softcap_approx", softcap_approx)
    check_sinks(sinks, q.shape[1], q.device)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if not use_triton(q) or q.numel() == 0 or k.shape[0] == 0:
        return flash_attention_varlen_ref(
            q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window_size=window, softcap=softcap,
            return_lse=return_lse, sinks=sinks, softcap_approx=softcap_approx
        )
    check_kernel_head_dims(q, v)
    o, lse = flash_attention_varlen_op(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), causal, scale,
        *window, softcap, bool(allow_tf32), bool(deterministic), sinks, softcap_approx
    )
    return (o, natural_lse(lse)) if return_lse else o
