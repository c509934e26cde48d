"""The attention tests' one harness: which keys a query sees, the float64 reference, the inputs,
and the runners that check a kernel's o, lse and every gradient against the reference.

The reference computes scores in float64, caps them (softcap), masks them with a visibility
matrix written from the definition (causal and windows aligned to each sequence's end; packed
sequences block-diagonal), appends the attention sinks as one more column as gpt-oss's eager
attention does, and takes the softmax with a row that sees no key (and no sink) giving o = 0 and
lse = -inf. `test_attention.py` checks once that it equals `fastlm.reference`'s attention.

Interpreter blocks are 64x32 (forward, dQ) and 32x64 (dK/dV): lengths such as 17, 77, 130 and 257
end inside a block, and Nq < Nk puts the causal diagonal anywhere in one.
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fastlm import flash_attention, flash_attention_varlen
from fastlm.kernels.attention import backward, launch
from fastlm.testing import TOLERANCE, assert_close

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NO_WINDOW = (-1, -1)

#: FASTLM_ATTENTION_TMA values that, with the default (None), run both data paths of the forward
#: and of the dQ pass (pointers, tensor descriptors): the interpreter and GPUs before sm_90 default
#: to pointers, so descriptors are forced ("1"; the interpreter runs them); Hopper defaults to
#: descriptors, so pointers are forced ("0").
_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
TMA_PATHS = [None, "0" if _HOPPER else "1"]


def record_dq_paths(monkeypatch) -> list[bool]:
    """The data path the backward's launcher chooses for each dQ pass from now on (True: k and v
    through descriptors)."""
    chosen = []

    def recording(*tensors):
        chosen.append(launch.use_tensor_descriptors(*tensors))
        return chosen[-1]

    monkeypatch.setattr(backward, "use_tensor_descriptors", recording)
    return chosen


def takes_descriptors(tma: str | None) -> bool:
    """Whether a TMA_PATHS value runs the descriptor path (of aligned 16-bit inputs, head dims up
    to 128)."""
    return (tma or ("1" if _HOPPER else "0")) == "1"


# --------------------------------------------------------------------------------------------
# The reference
# --------------------------------------------------------------------------------------------


def visible(Nq: int, Nk: int, causal: bool, window: tuple[int, int] = NO_WINDOW) -> torch.Tensor:
    """(Nq, Nk) bool, True where query i sees key j: with d = i + Nk - Nq the query's position
    among the keys, j <= d when causal, and d - left <= j <= d + right for a window side >= 0."""
    left, right = window
    d = torch.arange(Nq)[:, None] + (Nk - Nq)
    j = torch.arange(Nk)[None, :]
    seen = torch.ones(Nq, Nk, dtype=torch.bool)
    if causal:
        seen &= j <= d
    if left >= 0:
        seen &= j >= d - left
    if right >= 0:
        seen &= j <= d + right
    return seen


def packed_visible(lens_q, lens_k, causal, window=NO_WINDOW) -> torch.Tensor:
    """(total_q, total_k) bool: block-diagonal, each block its sequence's own `visible`."""
    seen = torch.zeros(sum(lens_q), sum(lens_k), dtype=torch.bool)
    q0 = k0 = 0
    for nq, nk in zip(lens_q, lens_k):
        seen[q0 : q0 + nq, k0 : k0 + nk] = visible(nq, nk, causal, window)
        q0, k0 = q0 + nq, k0 + nk
    return seen


def reference(q, k, v, seen, scale, softcap=0.0, sinks=None):
    """o and lse in float64 of q (..., Hq, Nq, D), k (..., Hkv, Nk, D) and v (..., Hkv, Nk, Dv),
    grouped heads repeated: scores scale * q k^T, capped, masked by `seen`; sinks (Hq,) appended
    to every row as a column of its head's logit (not scaled, not capped), whose weight is dropped
    after the softmax (gpt-oss's eager attention); a row that sees nothing has o = 0 and lse =
    -inf. Differentiable in q, k, v and sinks."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = scale * q @ k.transpose(-1, -2)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~seen.to(q.device), -math.inf)
    if sinks is not None:  # heads are axis -3 of the scores, dense (B, H, Nq, Nk) or packed
        column = sinks.to(torch.float64)[:, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], -1)
    lse = torch.logsumexp(scores.detach(), -1)
    row_max = scores.detach().amax(-1, keepdim=True)
    weights = torch.exp(scores - row_max.nan_to_num(neginf=0.0))
    p = weights / weights.sum(-1, keepdim=True).clamp_min(1e-300)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v, lse


# --------------------------------------------------------------------------------------------
# Inputs, runners and the checker
# --------------------------------------------------------------------------------------------


def make(shape_q, shape_kv, dtype, device, std=1.0, head_dim_v=None):
    """q, k, v leaves that require grad: q and k with standard deviation `std`, v with 1; v's
    last dim head_dim_v (default: k's)."""
    q = (torch.randn(shape_q, device=device) * std).to(dtype).requires_grad_()
    k = (torch.randn(shape_kv, device=device) * std).to(dtype).requires_grad_()
    shape_v = (*shape_kv[:-1], head_dim_v or shape_kv[-1])
    v = torch.randn(shape_v, device=device).to(dtype).requires_grad_()
    return q, k, v


def make_heads(B, Hq, Hkv, Nq, Nk, D, dtype, device, std=1.0, Dv=None):
    """q (B, Hq, Nq, D), k (B, Hkv, Nk, D) and v (B, Hkv, Nk, Dv), Dv = D by default."""
    return make((B, Hq, Nq, D), (B, Hkv, Nk, D), dtype, device, std, Dv)


def make_sinks(H, device, dtype=torch.float32):
    """(H,) sink logits that require grad, about as large as the scores (gpt-oss's are O(1))."""
    return (torch.randn(H, device=device) * 2).to(dtype).requires_grad_()


def gradients(outputs, inputs, do):
    for t in inputs:
        t.grad = None
    outputs.backward(do)
    return [t.grad for t in inputs]


def sink_terms(sinks, ref_o, ref_lse, do) -> torch.Tensor:
    """(H,): the size of the terms dsinks sums, sum over each head's rows of |P_sink * Delta|,
    P_sink = exp(sink - lse) and Delta = rowsum(dO * O) (float64 reference; heads at axis -3 of o
    and dO, -2 of lse)."""
    delta = (do.double() * ref_o.detach()).sum(-1)
    terms = (torch.exp(sinks.detach().double()[:, None] - ref_lse) * delta).abs()
    return terms.movedim(-2, 0).reshape(len(sinks), -1).sum(1)


def check(out, lse, grads, ref_out, ref_lse, ref_grads, dtype, single_key=None, sink_size=None):
    """o, lse and (dq, dk, dv[, dsinks]) against the reference by `assert_close`'s per-dtype
    bound; lse is -inf exactly on the rows that see no key (and no sink).

    dsinks = -sum over a head's rows of P_sink * Delta, terms of both signs (Delta = rowsum(dO *
    O) with a random dO) that cancel: each carries the rounding of o to the dtype, so the error
    is bounded relative to the terms' size (`sink_terms`, given as sink_size), not to the sum;
    by the dtype's bound, or the sinks' own when coarser (their gradient is rounded to it).

    single_key: (do, q, k, v, scale) when every query sees one key at most. Then P = 1 whatever q
    and k are, so dq and dk are 0 but for the round-off of dP - Delta (|dO| |v| at most), scaled
    by s |k| or s |q|: they are bounded by that instead of compared relatively with zero."""
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, ref_out, dtype, "o")
    empty_rows = torch.isinf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty_rows), "lse = -inf exactly on rows with no key"
    assert_close(lse[~empty_rows], ref_lse[~empty_rows], dtype, "lse")
    assert_close(grads[2], ref_grads[2], dtype, "dv")
    if len(grads) > 3:
        bound = TOLERANCE[max(dtype, grads[3].dtype, key=TOLERANCE.get)]
        err = torch.linalg.vector_norm(grads[3].double() - ref_grads[3]) / sink_size.norm()
        assert err <= bound, f"dsinks: error {err:.2e} of the summed terms' size > {bound:.0e}"
    if single_key is None:
        assert_close(grads[0], ref_grads[0], dtype, "dq")
        assert_close(grads[1], ref_grads[1], dtype, "dk")
        return
    do, q, k, v, scale = (t.double() if isinstance(t, torch.Tensor) else t for t in single_key)
    bound = TOLERANCE[dtype] * abs(scale) * do.norm() * v.norm()
    assert grads[0].double().norm() <= bound * k.norm(), "dq of a single key is not ~0"
    assert grads[1].double().norm() <= bound * q.norm(), "dk of a single key is not ~0"


def run_dense(
    q,
    k,
    v,
    causal,
    window=NO_WINDOW,
    softcap=0.0,
    scale=None,
    deterministic=True,
    seen=None,
    sinks=None,
):
    """flash_attention of (B, H, N, D) leaves with lse (and sinks, a leaf or None), its
    gradients for a random dO, all checked against the float64 reference (fp32 asks for
    full-precision dots, so the fp32 bound holds on a GPU too). `seen` replaces the visibility
    the arguments imply. Returns o, lse, grads (dq, dk, dv[, dsinks])."""
    o, lse = flash_attention(
        q,
        k,
        v,
        causal,
        scale,
        window_size=window,
        softcap=softcap,
        return_lse=True,
        allow_tf32=False,
        deterministic=deterministic,
        sinks=sinks,
    )
    assert o.shape == (*q.shape[:-1], v.shape[-1])
    do = torch.randn_like(o)
    leaves = (q, k, v) if sinks is None else (q, k, v, sinks)
    grads = gradients(o, leaves, do)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    seen = visible(q.shape[2], k.shape[2], causal, window) if seen is None else seen
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    ref_o, ref_lse = reference(*leaves64[:3], seen, scale, softcap, *leaves64[3:])
    ref_grads = gradients(ref_o, leaves64, do.double())
    # With a sink a row's one key no longer has P = 1: dq and dk are compared as usual.
    one_key = seen.sum(-1).max() <= 1 and sinks is None
    single_key = (do, q, k, v, scale) if one_key else None
    size = None if sinks is None else sink_terms(sinks, ref_o, ref_lse, do)
    check(o, lse, grads, ref_o, ref_lse, ref_grads, q.dtype, single_key, size)
    return o, lse, grads


def cu_seqlens(lens, device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).to(device)


def run_varlen(
    lens_q,
    lens_k,
    Hq,
    Hkv,
    D,
    causal,
    window,
    softcap,
    dtype,
    device,
    deterministic=True,
    score_offset=0.0,
    sinks=None,
    Dv=None,
):
    """flash_attention_varlen with q, k, v as strided views of one packed projection (total,
    Hq + 2 Hkv, D), against the block-diagonal float64 reference. A nonzero score_offset sets
    the first channel of q to its square root and k's to minus that: every score drops by
    scale * score_offset. sinks: an (Hq,) leaf or None. Dv: v's head dim, then the first Dv
    channels of its heads in the projection (strided rows and heads). Returns o, lse."""
    total_q, total_k = sum(lens_q), sum(lens_k)
    qkv_q = torch.randn(total_q, Hq + 2 * Hkv, D, device=device).to(dtype)
    qkv_k = torch.randn(total_k, Hq + 2 * Hkv, max(D, Dv or D), device=device).to(dtype)
    if score_offset:
        qkv_q[:, :Hq, 0] = score_offset**0.5
        qkv_k[:, Hq : Hq + Hkv, 0] = -(score_offset**0.5)
    q = qkv_q[:, :Hq].requires_grad_()
    k = qkv_k[:, Hq : Hq + Hkv, :D].requires_grad_()
    v = qkv_k[:, Hq + Hkv :, : Dv or D].requires_grad_()
    assert not q.is_contiguous() and not k.is_contiguous()
    o, lse = flash_attention_varlen(
        q,
        k,
        v,
        cu_seqlens(lens_q, device),
        cu_seqlens(lens_k, device),
        max(lens_q),
        max(lens_k),
        causal,
        window_size=window,
        softcap=softcap,
        return_lse=True,
        allow_tf32=False,
        deterministic=deterministic,
        sinks=sinks,
    )
    assert o.shape == (*q.shape[:-1], v.shape[-1]) and lse.shape == (Hq, total_q)
    do = torch.randn_like(o)
    grads = gradients(o, (q, k, v) if sinks is None else (q, k, v, sinks), do)
    heads = [t.detach().double().transpose(0, 1).requires_grad_() for t in (q, k, v)]
    sinks64 = [] if sinks is None else [sinks.detach().double().requires_grad_()]
    seen = packed_visible(lens_q, lens_k, causal, window)
    ref_o, ref_lse = reference(*heads, seen, D**-0.5, softcap, *sinks64)
    ref_grads = gradients(ref_o, heads + sinks64, do.double().transpose(0, 1))
    ref_grads = [g.transpose(0, 1) for g in ref_grads[:3]] + ref_grads[3:]
    size = None if sinks is None else sink_terms(sinks, ref_o, ref_lse, do.transpose(0, 1))
    check(o, lse, grads, ref_o.transpose(0, 1), ref_lse, ref_grads, dtype, sink_size=size)
    return o, lse


# --------------------------------------------------------------------------------------------
# What the ops do to memory, seen from a dispatch mode
# --------------------------------------------------------------------------------------------


class AllocationRecorder(TorchDispatchMode):
    """Bytes of every distinct storage that a torch op returns while active."""

    def __init__(self):
        super().__init__()
        self.storages = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                self.storages[storage.data_ptr()] = storage.nbytes()
        return out


class CopyRecorder(TorchDispatchMode):
    """The ops that read `base`'s memory into other memory while active: clone (`.contiguous()`),
    copy_, _to_copy and the like. Not recorded: views of `base` (they return its own memory),
    factories like new_empty (they read only its dtype and device), and fastlm's own ops, which a
    dispatch mode sees whole: what runs inside them (the launchers) is recorded by calling the
    launchers directly."""

    def __init__(self, base: torch.Tensor):
        super().__init__()
        self.base_ptr = base.untyped_storage().data_ptr()
        self.copies = []

    def _in_base(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == self.base_ptr

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        reads_base = any(self._in_base(t) for t in tree_leaves((args, kwargs)))
        factory = name.startswith("new_") or name.endswith("_like")
        if (
            reads_base
            and not factory
            and func.namespace != "fastlm"
            and not any(self._in_base(t) for t in tree_leaves(out))
        ):
            self.copies.append(str(func))
        return out


class GlueRecorder(TorchDispatchMode):
    """The aten ops outside fastlm's own that move data: what autograd adds around views."""

    GLUE = {
        "zeros",
        "zero_",
        "fill_",
        "copy_",
        "add",
        "add_",
        "select_backward",
        "slice_backward",
        "clone",
        "_to_copy",
        "cat",
        "stack",
        "new_zeros",
        "index_put_",
    }

    def __init__(self):
        super().__init__()
        self.glue = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.GLUE:
            self.glue.append(str(func))
        return func(*args, **(kwargs or {}))
