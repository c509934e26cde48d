"""Attention's math in PyTorch: the PyTorch backend of `flash_attention` and
`flash_attention_varlen`, and what the tests and benchmarks compare the kernels with."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _visible_keys(
    Nq: int, Nk: int, causal: bool, window_size: tuple[int, int], device
) -> torch.Tensor | None:
    """(Nq, Nk) bool: query i sees key j iff d - left <= j <= d + right, d = i + Nk - Nq (right
    = 0 when causal, -1 unbounded); None when every query sees every key."""
    left, right = window_size
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None
    diagonal = torch.arange(Nq, device=device)[:, None] + (Nk - Nq)
    keys = torch.arange(Nk, device=device)
    visible = torch.ones(Nq, Nk, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= keys <= diagonal + right
    if left >= 0:
        visible &= keys >= diagonal - left
    return visible


def _tanh_approx_model(x: torch.Tensor) -> torch.Tensor:
    """The kernels' model of tanh.approx.f32 (`blocks._tanh_approx`): fp32 tanh rounded toward
    zero to 11 fraction bits, an error below 2^-11 relative; in x's dtype."""
    bits = torch.tanh(x.float()).view(torch.int32) & -4096  # 0xFFFFF000
    return bits.view(torch.float32).to(x.dtype)


def soft_cap(scores: torch.Tensor, softcap: float, approx: bool = False) -> torch.Tensor:
    """softcap * tanh(scores / softcap), differentiable with a slope that keeps its relative
    accuracy in the tails; with `approx`, the kernels' approximate cap as their model computes
    it: c th with th = `_tanh_approx_model`, and the slope 1 - th^2 from it.

    Autograd takes tanh's slope as 1 - tanh^2 from tanh's output, which is off by an ulp of tanh
    once tanh rounds near +-1: in fp32 a relative error of 1e-2 in dq and dk at |x| = 6 (x =
    scores / softcap) and all of them further out, every slope once the cap is far below the
    scores. Past |x| = 0.6 tanh is computed as sign(x) (1 - 2 sigmoid(-2 |x|)) instead (1 - 2
    sigmoid >= 0.53 there: no cancellation), whose slope autograd forms as 4 sigmoid(-2 |x|)
    (1 - sigmoid(-2 |x|)), relatively accurate factors; below 0.6, tanh itself (its slope is above
    0.7 there)."""
    x = scores / softcap
    if approx:
        th = _tanh_approx_model(x.detach())
        # value c th; gradient (scores - scores.detach() is 0) the slope 1 - th^2
        return softcap * th + (scores - scores.detach()) * (1 - th * th)
    far = torch.sign(x) * (1 - 2 * torch.sigmoid(-2 * x.abs()))
    return softcap * torch.where(x.abs() < 0.6, torch.tanh(x), far)


def flash_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
    softmax_scale: float | None = None, *, window_size: tuple[int,
                                                              int] = (-1, -1), softcap: float = 0.0,
    return_lse: bool = False, sinks: torch.Tensor | None = None, softcap_approx: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """flash_attention's math in PyTorch (the PyTorch backend): GQA by repeating k and v, the
    causal mask aligned to the end, v's head dim its own. Plain attention goes through
    scaled_dot_product_attention; a window, a cap, sinks or the log-sum-exp through explicit
    scores (fp32 at least), where a row that sees no key (and no sink) gets output 0 and lse
    -inf. sinks (Hq,): one logit per head in each row's denominator, as gpt-oss's eager
    attention has it (a column of the scores, neither scaled nor capped, dropped after the
    softmax)."""
    Nq, Nk, D = q.shape[2], k.shape[2], q.shape[-1]
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    visible = _visible_keys(Nq, Nk, causal, window_size, q.device)
    # SDPA scales q and k by sqrt(scale) each: a scale <= 0 (equal or reversed weights) takes
    # the explicit scores below.
    plain_scale = softmax_scale is None or softmax_scale > 0
    plain = window_size == (-1, -1) and not softcap and not return_lse and sinks is None
    if plain and plain_scale and Nk > 0:
        if not causal or Nq == Nk:  # SDPA's own causal mask is aligned to the start
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=softmax_scale)
    scale = softmax_scale if softmax_scale is not None else D**-0.5
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale
    if softcap:
        scores = soft_cap(scores, softcap, softcap_approx)
    if visible is not None:
        scores = scores.masked_fill(~visible, -math.inf)
    # The sinks as one more column of the scores, (B, Hq, Nq, 1), that every row sees.
    sink = None if sinks is None else sinks.to(dtype)[:, None, None].expand(*scores.shape[:-1], 1)
    # Rows with no key have max -inf: shift them by 0 instead, so that they sum to 0, not NaN.
    shift = scores.new_zeros((*scores.shape[:-1], 1))
    if Nk or sink is not None:
        row_max = torch.cat([scores, sink], -1) if sink is not None else scores
        row_max = row_max.detach().amax(-1, keepdim=True)
        shift = row_max.masked_fill(row_max == -math.inf, 0.0)
    e = torch.exp(scores - shift)
    total = e.sum(-1, keepdim=True)
    if sink is not None:
        total = total + torch.exp(sink - shift)
    o = ((e / total.clamp_min(torch.finfo(dtype).tiny)) @ v.to(dtype)).to(q.dtype)
    if not return_lse:
        return o
    return o, (torch.log(total) + shift).squeeze(-1)


def flash_attention_varlen_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, causal: bool = True, softmax_scale: float | None = None, *,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, return_lse: bool = False,
    sinks: torch.Tensor | None = None, softcap_approx: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """flash_attention_varlen's math in PyTorch: `flash_attention_ref` of each sequence on its
    own (the sequence bounds are read on the host). o (total_q, Hq, Dv); lse (Hq, total_q)."""
    outs, lses = [], []
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:]):
        o, lse = flash_attention_ref(
            *(t[None].transpose(1, 2) for t in (q[q0:q1], k[k0:k1], v[k0:k1])), causal,
            softmax_scale, window_size=window_size, softcap=softcap, return_lse=True, sinks=sinks,
            softcap_approx=softcap_approx
        )
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    o = torch.cat(outs)
    return (o, torch.cat(lses, dim=1)) if return_lse else o
