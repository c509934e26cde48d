"""flash_attention's window_size, softcap and return_lse, and flash_attention_varlen, against
float64 attention with the mask written out element by element (block-diagonal for packed
sequences, causal and windowed aligned to each sequence's end, capped scores).

Interpreter blocks are 64x32 (forward, dQ) and 32x64 (dK/dV): windows of 3 and 5 fit inside a
block, 40 and 100 span several, and key blocks wholly outside every window are never read (NaN
there would show). Outputs are NaN-poisoned by conftest, so an unwritten element fails.
"""

import math

import pytest
import torch

from fastlm import flash_attention, flash_attention_varlen
from fastlm.kernels._common import tl, triton
from fastlm.kernels.attention import attention_ref, attention_varlen_ref
from fastlm.kernels.attention.blocks import tanh
from fastlm.testing import TOLERANCE, assert_close


def window_mask(Nq: int, Nk: int, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """(Nq, Nk) bool, True where query i sees key j, one element at a time: d = i + Nk - Nq is
    the query's position among the keys."""
    left, right = window
    visible = torch.zeros(Nq, Nk, dtype=torch.bool)
    for i in range(Nq):
        d = i + Nk - Nq
        for j in range(Nk):
            visible[i, j] = (
                not (causal and j > d)
                and not (left >= 0 and j < d - left)
                and not (right >= 0 and j > d + right)
            )
    return visible


def packed_mask(lens_q, lens_k, causal, window) -> torch.Tensor:
    """(total_q, total_k) bool: block-diagonal, each block the sequence's own window_mask."""
    visible = torch.zeros(sum(lens_q), sum(lens_k), dtype=torch.bool)
    q0 = k0 = 0
    for nq, nk in zip(lens_q, lens_k):
        visible[q0 : q0 + nq, k0 : k0 + nk] = window_mask(nq, nk, causal, window)
        q0, k0 = q0 + nq, k0 + nk
    return visible


def reference(q, k, v, visible, scale, softcap):
    """o and lse in float64 of q (..., Hq, Nq, D), k and v (..., Hkv, Nk, D) with grouped heads
    repeated: scores scale * q k^T, capped, then masked by `visible`; a row that sees nothing has
    o = 0 and lse = -inf."""
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = scale * q @ k.transpose(-1, -2)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible.to(q.device), -math.inf)
    lse = torch.logsumexp(scores.detach(), -1)
    row_max = scores.detach().amax(-1, keepdim=True)
    weights = torch.exp(scores - row_max.nan_to_num(neginf=0.0))
    p = weights / weights.sum(-1, keepdim=True).clamp_min(1e-300)
    return p @ v, lse


def gradients(outputs, inputs, do):
    for t in inputs:
        t.grad = None
    outputs.backward(do)
    return [t.grad for t in inputs]


def check(out, lse, grads, ref_out, ref_lse, ref_grads, dtype):
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, ref_out, dtype, "o")
    empty_rows = torch.isinf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty_rows), "lse = -inf exactly on rows with no key"
    assert_close(lse[~empty_rows], ref_lse[~empty_rows], dtype, "lse")
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(grad, ref, dtype, name)


def make(shape_q, shape_kv, dtype, device, std=1.0):
    q = (torch.randn(shape_q, device=device) * std).to(dtype).requires_grad_()
    k = (torch.randn(shape_kv, device=device) * std).to(dtype).requires_grad_()
    v = torch.randn(shape_kv, device=device).to(dtype).requires_grad_()
    return q, k, v


def run_dense(q, k, v, causal, window, softcap, scale=None, deterministic=True, std=1.0):
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
    )
    do = torch.randn_like(o)
    grads = gradients(o, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    visible = window_mask(q.shape[2], k.shape[2], causal, window)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    ref_o, ref_lse = reference(q64, k64, v64, visible, scale, softcap)
    ref_grads = gradients(ref_o, (q64, k64, v64), do.double())
    check(o, lse, grads, ref_o, ref_lse, ref_grads, q.dtype)
    return o, lse, grads


# (B, Hq, Hkv, Nq, Nk, D, causal, window, softcap, dtype)
DENSE_CASES = [
    (1, 2, 1, 70, 70, 16, True, (3, 0), 0.0, torch.float32),  # window inside a block
    (1, 2, 2, 70, 70, 32, True, (40, -1), 0.0, torch.float16),  # spans blocks, right from causal
    (2, 2, 1, 45, 70, 16, True, (5, 0), 5.0, torch.float32),  # Nq < Nk, capped
    (1, 4, 2, 67, 67, 16, False, (5, 17), 0.0, torch.float32),  # both sides, non-causal
    (1, 2, 2, 70, 70, 24, False, (-1, 9), 2.0, torch.bfloat16),  # right only, capped
    (1, 2, 1, 33, 70, 16, False, (100, 0), 0.0, torch.float16),  # window wider than the keys
    (1, 2, 2, 70, 70, 16, False, (0, 2), 0.0, torch.float32),  # itself and the next two
    (1, 3, 1, 70, 70, 16, True, (-1, -1), 1.5, torch.float32),  # cap alone, causal
    (1, 2, 2, 17, 40, 32, False, (-1, -1), 3.0, torch.float16),  # cap alone, full
]


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal,window,softcap,dtype", DENSE_CASES)
def test_window_softcap_lse_match_reference(
    device, deterministic, B, Hq, Hkv, Nq, Nk, D, causal, window, softcap, dtype
):
    q, k, v = make((B, Hq, Nq, D), (B, Hkv, Nk, D), dtype, device)
    run_dense(q, k, v, causal, window, softcap, deterministic=deterministic)


@pytest.mark.parametrize("tma", ["1", "0"], ids=["descriptor", "pointer"])
@pytest.mark.parametrize("case", [DENSE_CASES[i] for i in (0, 2, 3, 4)])
def test_window_softcap_forward_paths(device, monkeypatch, tma, case):
    """The descriptor forward (FASTLM_ATTENTION_TMA=1) takes the same window and cap."""
    monkeypatch.setenv("FASTLM_ATTENTION_TMA", tma)
    B, Hq, Hkv, Nq, Nk, D, causal, window, softcap, dtype = case
    q, k, v = make((B, Hq, Nq, D), (B, Hkv, Nk, D), dtype, device)
    run_dense(q, k, v, causal, window, softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softcap_with_large_scores(device, dtype):
    """Scores of ~1e3 capped at 20: accurate, finite, and tanh saturates without overflow."""
    q, k, v = make((1, 2, 70, 32), (1, 2, 70, 32), dtype, device, std=1000**0.5 / 32**0.25)
    with torch.no_grad():
        scores = (q.double() @ k.double().transpose(-1, -2)) * 32**-0.5
    assert scores.abs().amax() > 500
    o, lse, grads = run_dense(q, k, v, True, (-1, -1), 20.0)
    assert lse.abs().amax() < 20 * math.log2(math.e) + math.log(70) + 1


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("softcap", [1e3, 1e5, 1e6, 1e8, 1e30])
def test_large_caps_are_exact(device, softcap, deterministic):
    """A cap far above the scores leaves them as they are: c * tanh(s / c) must be s to fp32
    rounding for any finite c (a tanh that cancels for small arguments loses digits as c grows).
    """
    q, k, v = make((1, 2, 45, 16), (1, 1, 70, 16), torch.float32, device)
    run_dense(q, k, v, True, (-1, -1), softcap, deterministic=deterministic)


@triton.jit
def _tanh_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tanh(tl.load(X + offs, mask=offs < n)), mask=offs < n)


def test_triton_tanh_is_exact_to_fp32_rounding(device):
    """The kernels' tanh against torch.tanh in float64 over the whole float32 range of
    arguments, tiny ones included: within 3 units in the last place of the float32 result."""
    magnitudes = torch.cat(
        [
            torch.logspace(-38, 1.5, 4000, dtype=torch.float64),
            torch.linspace(0.0, 1.0, 2001, dtype=torch.float64),
        ]
    )
    x = torch.cat([magnitudes, -magnitudes]).to(torch.float32).to(device)
    y = torch.full_like(x, math.nan)
    _tanh_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    ref = torch.tanh(x.double())
    ulp = torch.finfo(torch.float32).eps * ref.abs().clamp_min(torch.finfo(torch.float32).tiny)
    worst = ((y.double() - ref).abs() / ulp).max().item()
    assert worst <= 3.0, f"tanh is {worst:.1f} ulp off"
    assert torch.equal(torch.sign(y), torch.sign(x)), "tanh keeps the sign (and tanh(0) = 0)"


@pytest.mark.parametrize("causal", [True, False])
def test_lse_is_logsumexp_of_the_scores(device, causal):
    """return_lse without window or cap: torch.logsumexp of the scaled, masked scores."""
    q, k, v = make((2, 2, 50, 16), (2, 1, 70, 16), torch.float32, device)
    o, lse = flash_attention(q, k, v, causal, 0.3, return_lse=True, allow_tf32=False)
    assert lse.shape == (2, 2, 50) and lse.dtype == torch.float32 and not lse.requires_grad
    scores = 0.3 * q.detach().double() @ k.detach().double().transpose(-1, -2)
    if causal:
        scores = scores.masked_fill(~torch.ones(50, 70, dtype=torch.bool).tril(20), -math.inf)
    assert_close(lse, torch.logsumexp(scores, -1), torch.float32, "lse")
    assert torch.equal(o, flash_attention(q, k, v, causal, 0.3, allow_tf32=False))


def test_keys_outside_every_window_are_never_read(device):
    """Keys and values below every query's window are NaN: read by any kernel they would reach
    the output (0 * NaN) or the gradients. Their dK and dV are exactly 0."""
    Nq, Nk, left, D = 20, 300, 10, 16  # the first query sees keys from 270; 256 = 2 * 128
    q, k, v = make((1, 2, Nq, D), (1, 1, Nk, D), torch.float32, device)
    with torch.no_grad():
        k[:, :, :256] = math.nan
        v[:, :, :256] = math.nan
    for deterministic in (True, False):
        o, lse = flash_attention(
            q, k, v, window_size=(left, 0), return_lse=True, deterministic=deterministic
        )
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
        for name, t in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk[:, :, 256:])):
            assert torch.isfinite(t).all(), f"{name} read keys outside every window"
        assert torch.equal(dk[:, :, :256], torch.zeros_like(dk[:, :, :256]))
        assert torch.equal(dv[:, :, :256], torch.zeros_like(dv[:, :, :256]))
    k64, v64 = (t.detach().double()[:, :, -40:] for t in (k, v))  # every key a query sees
    visible = window_mask(Nq, 40, True, (left, 0))
    ref_o, ref_lse = reference(q.detach().double(), k64, v64, visible, D**-0.5, 0.0)
    assert_close(o, ref_o, torch.float32, "o")
    assert_close(lse, ref_lse, torch.float32, "lse")


# --------------------------------------------------------------------------------------------
# Packed sequences
# --------------------------------------------------------------------------------------------


def cu_seqlens(lens, device):
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
):
    """flash_attention_varlen with q, k, v as strided views of one packed projection (total,
    Hq + 2 Hkv, D), against the block-diagonal float64 reference. A nonzero score_offset sets
    the first channel of q to its square root and k's to minus that: every score drops by
    scale * score_offset."""
    total_q, total_k = sum(lens_q), sum(lens_k)
    qkv_q = torch.randn(total_q, Hq + 2 * Hkv, D, device=device).to(dtype)
    qkv_k = torch.randn(total_k, Hq + 2 * Hkv, D, device=device).to(dtype)
    if score_offset:
        qkv_q[:, :Hq, 0] = score_offset**0.5
        qkv_k[:, Hq : Hq + Hkv, 0] = -(score_offset**0.5)
    q = qkv_q[:, :Hq].requires_grad_()
    k = qkv_k[:, Hq : Hq + Hkv].requires_grad_()
    v = qkv_k[:, Hq + Hkv :].requires_grad_()
    assert not q.is_contiguous() and not k.is_contiguous()
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    o, lse = flash_attention_varlen(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(lens_q),
        max(lens_k),
        causal,
        window_size=window,
        softcap=softcap,
        return_lse=True,
        allow_tf32=False,
        deterministic=deterministic,
    )
    assert o.shape == q.shape and lse.shape == (Hq, total_q)
    do = torch.randn_like(o)
    grads = gradients(o, (q, k, v), do)
    heads = [t.detach().double().transpose(0, 1).requires_grad_() for t in (q, k, v)]
    visible = packed_mask(lens_q, lens_k, causal, window)
    ref_o, ref_lse = reference(*heads, visible, D**-0.5, softcap)
    ref_grads = gradients(ref_o, heads, do.double().transpose(0, 1))
    check(
        o, lse, grads, ref_o.transpose(0, 1), ref_lse, [g.transpose(0, 1) for g in ref_grads], dtype
    )
    return o, lse


# (lens_q, lens_k, Hq, Hkv, D, causal, window, softcap, dtype)
VARLEN_CASES = [
    ([1, 17, 1, 70, 3], None, 2, 2, 16, True, (-1, -1), 0.0, torch.float32),
    ([2, 1, 3, 1, 1, 64, 1, 5], None, 4, 2, 16, True, (-1, -1), 0.0, torch.float16),
    ([33, 1, 40], None, 3, 1, 32, False, (-1, -1), 0.0, torch.bfloat16),
    ([5, 70, 9, 1], None, 2, 1, 16, True, (7, 0), 3.0, torch.float32),
    ([70, 2, 45], None, 2, 2, 16, False, (4, 40), 0.0, torch.float16),
    ([1, 30, 12], [9, 65, 12], 2, 1, 16, True, (-1, -1), 0.0, torch.float32),  # Nq < Nk
    ([6, 0, 20, 4], [3, 5, 0, 40], 2, 2, 16, True, (-1, -1), 2.0, torch.float32),  # Nq > Nk, empty
]


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("lens_q,lens_k,Hq,Hkv,D,causal,window,softcap,dtype", VARLEN_CASES)
def test_varlen_matches_reference(
    device, deterministic, lens_q, lens_k, Hq, Hkv, D, causal, window, softcap, dtype
):
    run_varlen(
        lens_q, lens_k or lens_q, Hq, Hkv, D, causal, window, softcap, dtype, device, deterministic
    )


@pytest.mark.parametrize("case", [VARLEN_CASES[i] for i in (1, 3, 6)])
def test_varlen_descriptor_forward(device, monkeypatch, case):
    """The descriptor forward's per-sequence views: the next sequence's rows read as zeros."""
    monkeypatch.setenv("FASTLM_ATTENTION_TMA", "1")
    lens_q, lens_k, *rest = case
    run_varlen(lens_q, lens_k or lens_q, *rest, device)


def test_varlen_rows_without_keys(device):
    """A sequence with more queries than keys masks its first queries (causal, aligned to the
    end), and a sequence without keys masks all of them: output 0 and lse -inf, gradients 0."""
    o, lse = run_varlen([6, 4], [2, 0], 2, 1, 16, True, (-1, -1), 0.0, torch.float32, device)
    assert torch.equal(o[:4], torch.zeros_like(o[:4]))
    assert torch.equal(o[6:], torch.zeros_like(o[6:]))
    assert torch.isneginf(lse[:, :4]).all() and torch.isneginf(lse[:, 6:]).all()


@pytest.mark.parametrize("deterministic", [True, False])
def test_scores_all_far_below_zero(device, deterministic):
    """Every score about -100 (2^(0 - LSE) overflows; test_attention.py says why): key rows past
    a sequence's end in a partial key block, read as zeros, must be masked for every query, or
    the atomic dQ is NaN. A window reaching past the keys and packed sequences ending inside a
    key block."""
    q, k, v = make((1, 2, 40, 16), (1, 1, 77, 16), torch.float32, device)
    with torch.no_grad():
        q[..., 0] = 20.0
        k[..., 0] = -20.0
    run_dense(q, k, v, False, (5, 100), 0.0, deterministic=deterministic)
    run_varlen(
        [20, 77, 9],
        [20, 77, 9],
        2,
        1,
        16,
        False,
        (-1, -1),
        0.0,
        torch.float32,
        device,
        deterministic,
        score_offset=400.0,
    )


@pytest.mark.parametrize("tma", ["0", "1"], ids=["pointer", "descriptor"])
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize(
    "lens_q,lens_k,causal,window",
    [
        ([50, 200], [50, 10], True, (5, 0)),  # 190 queries before the first key
        ([3, 150, 40], [9, 0, 40], True, (7, 0)),  # a sequence without keys
        ([120, 70], [5, 70], False, (3, 2)),  # both sides, keys far behind the queries
    ],
)
def test_varlen_window_with_more_queries_than_keys(
    device, monkeypatch, tma, deterministic, lens_q, lens_k, causal, window
):
    """A window whose queries lie a block or more past the sequence's keys: no key range may
    go below the sequence's first key (another sequence's rows, or memory before the tensor)."""
    monkeypatch.setenv("FASTLM_ATTENTION_TMA", tma)
    o, lse = run_varlen(
        lens_q, lens_k, 2, 1, 16, causal, window, 0.0, torch.float32, device, deterministic
    )
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("tma", ["0", "1"], ids=["pointer", "descriptor"])
def test_varlen_reads_cu_seqlens_through_its_strides(device, monkeypatch, tma):
    """cu_seqlens as a column of a table (stride 2) gives what its contiguous copy gives."""
    monkeypatch.setenv("FASTLM_ATTENTION_TMA", tma)
    lens = [5, 70, 1, 30]
    contiguous = cu_seqlens(lens, device)
    strided = torch.stack([contiguous, torch.full_like(contiguous, 10**6)], 1)[:, 0]
    assert strided.stride() == (2,) and torch.equal(strided, contiguous)
    q, k, v = make((106, 2, 16), (106, 1, 16), torch.float32, device)
    results = []
    for cu in (strided, contiguous):
        o, lse = flash_attention_varlen(
            q, k, v, cu, cu, 70, 70, window_size=(9, 0), return_lse=True
        )
        results.append((o, lse, *torch.autograd.grad(o, (q, k, v), torch.ones_like(o))))
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), f"{name} differs with a strided cu_seqlens"


def test_varlen_equals_flash_attention_per_sequence(device):
    """One sequence packed alone is flash_attention of it: the same kernels, bitwise."""
    q, k, v = make((1, 2, 70, 16), (1, 1, 70, 16), torch.float16, device)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]
    cu = cu_seqlens([70], device)
    o = flash_attention_varlen(*packed, cu, cu, 70, 70, window_size=(9, 0), softcap=4.0)
    assert torch.equal(
        o, flash_attention(q, k, v, window_size=(9, 0), softcap=4.0)[0].transpose(0, 1)
    )


# --------------------------------------------------------------------------------------------
# Bad values; the PyTorch backend
# --------------------------------------------------------------------------------------------


def _heads(N=8):
    return torch.randn(1, 2, N, 16)


BAD_OPTIONS = [
    (dict(window_size=(-2, -1)), ValueError, "-1 \\(unbounded\\) or at least 0"),
    (dict(window_size=(4, -3)), ValueError, "-1 \\(unbounded\\) or at least 0"),
    (dict(window_size=(4, 2)), ValueError, "window_size\\[1\\] is 2, but with causal=True"),
    (dict(window_size=4), TypeError, "window_size must be a pair of ints"),
    (dict(window_size=(1.5, 0)), TypeError, "window_size must be a pair of ints"),
    (dict(softcap=-1.0), ValueError, "softcap must be 0 \\(off\\) or a positive finite"),
    (dict(softcap=math.inf), ValueError, "softcap must be 0 \\(off\\) or a positive finite"),
    (dict(softcap="1"), TypeError, "softcap must be a real number"),
    (dict(return_lse=1), TypeError, "return_lse must be a bool"),
]


@pytest.mark.parametrize("overrides,error,message", BAD_OPTIONS)
def test_bad_options_are_named(overrides, error, message):
    with pytest.raises(error, match=message):
        flash_attention(_heads(), _heads(), _heads(), **overrides)
    with pytest.raises(error, match=message):
        cu = torch.tensor([0, 8], dtype=torch.int32)
        flash_attention_varlen(
            *(torch.randn(8, 2, 16) for _ in range(3)), cu, cu, 8, 8, **overrides
        )


def _packed(total=8):
    return torch.randn(total, 2, 16)


def _cu(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


# Each replaces some of q, k, v = (8, 2, 16), cu_seqlens = [0, 3, 8], max_seqlen = 5.
BAD_VARLEN = [
    (dict(cu_seqlens_q=_cu(0, 3, 8, dtype=torch.int64)), ValueError, "cu_seqlens_q must be int32"),
    (dict(cu_seqlens_k=_cu(0, 5, 3, 8)), ValueError, "cu_seqlens_k must start at 0.*not decrease"),
    (dict(cu_seqlens_q=_cu(0, 3, 7)), ValueError, "end at the packed length 8"),
    (dict(cu_seqlens_q=_cu(1, 3, 8)), ValueError, "cu_seqlens_q must start at 0"),
    (dict(max_seqlen_q=4), ValueError, "no sequence longer than max_seqlen_q = 4"),
    (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be at least 0"),
    (dict(max_seqlen_k=5.0), TypeError, "max_seqlen_k must be an int"),
    (dict(cu_seqlens_q=[0, 3, 8]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    (dict(cu_seqlens_q=_cu(0, 3, 8)[None]), ValueError, "cu_seqlens_q must be 1-D"),
    (dict(cu_seqlens_q=_cu(8)), ValueError, "cu_seqlens_q must be 1-D with num_seqs \\+ 1 >= 2"),
    (
        dict(cu_seqlens_q=_cu(0, 8), max_seqlen_q=8),
        ValueError,
        "cu_seqlens_k has 3 entries, but cu_seqlens_q has 2",
    ),
    (dict(q=torch.randn(1, 8, 2, 16)), ValueError, "q must have 3 dims"),
    (dict(q=torch.randn(8, 3, 16)), ValueError, "not a multiple of k's 2 heads"),
    (dict(v=torch.randn(8, 2, 8)), ValueError, "v has shape"),
    (dict(causal=1), TypeError, "causal must be a bool"),
]


@pytest.mark.parametrize("overrides,error,message", BAD_VARLEN)
def test_bad_varlen_input_is_named(overrides, error, message):
    args = dict(
        q=_packed(),
        k=_packed(),
        v=_packed(),
        cu_seqlens_q=_cu(0, 3, 8),
        cu_seqlens_k=_cu(0, 3, 8),
        max_seqlen_q=5,
        max_seqlen_k=5,
    )
    with pytest.raises(error, match=message):
        flash_attention_varlen(**(args | overrides))


@pytest.mark.parametrize(
    "causal,window,softcap", [(True, (5, 0), 0.0), (False, (3, 7), 2.0), (True, (-1, -1), 3.0)]
)
def test_torch_backend_options_match_reference(device, monkeypatch, causal, window, softcap):
    """FASTLM_BACKEND=torch: window, cap and lse through `attention_ref`'s explicit scores, for
    flash_attention and flash_attention_varlen."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    q, k, v = make((2, 4, 30, 12), (2, 2, 41, 12), torch.float32, device)
    run_dense(q, k, v, causal, window, softcap, scale=0.2)
    run_varlen(
        [1, 30, 9, 0], [5, 30, 9, 3], 4, 2, 12, causal, window, softcap, torch.float32, device
    )


def test_torch_backend_refs_agree_with_sdpa(device):
    """attention_ref's explicit path (taken for return_lse) equals its SDPA path; the varlen
    reference of one sequence equals attention_ref."""
    q, k, v = (torch.randn(1, 2, 20, 8, device=device, dtype=torch.float64) for _ in range(3))
    o, lse = attention_ref(q, k, v, True, return_lse=True)
    assert_close(o, attention_ref(q, k, v, True), torch.float64, "o")
    cu = cu_seqlens([20], device)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]
    o_varlen, lse_varlen = attention_varlen_ref(*packed, cu, cu, True, return_lse=True)
    assert_close(o_varlen, o[0].transpose(0, 1), torch.float64, "o varlen")
    assert_close(lse_varlen, lse[0], torch.float64, "lse varlen")
    assert TOLERANCE[torch.float64] < 1e-9


@pytest.mark.cuda
def test_varlen_torch_compile_and_no_host_sync(device):
    """Compiled with fullgraph (no graph break, so no host read of cu_seqlens) and equal to
    eager."""
    lens = [100, 1, 700, 37]
    cu = cu_seqlens(lens, device)
    q, k, v = make((sum(lens), 8, 128), (sum(lens), 2, 128), torch.bfloat16, device)

    def attend(q, k, v):
        o = flash_attention_varlen(q, k, v, cu, cu, 700, 700, window_size=(64, 0), softcap=30.0)
        return o.float().square().sum()

    eager = torch.autograd.grad(attend(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(attend, fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(eager, compiled):
        assert_close(b, a, torch.bfloat16)


def test_varlen_compiles_whole_without_host_reads(device):
    """torch.compile(fullgraph=True) traces flash_attention_varlen and its backward as ops: a
    host read of cu_seqlens (a sync on a GPU) would break the graph and fail here. Under
    compilation the values are checked by a device-side assertion, and the results are
    eager's."""
    import torch._dynamo

    torch._dynamo.reset()
    lens = [5, 1, 17]
    cu = cu_seqlens(lens, device)
    q, k, v = make((23, 4, 16), (23, 2, 16), torch.float32, device)

    def attend(q, k, v):
        o, lse = flash_attention_varlen(
            q, k, v, cu, cu, 17, 17, window_size=(4, 0), softcap=2.0, return_lse=True
        )
        return o.square().sum() + lse.sum()

    eager = torch.autograd.grad(attend(q, k, v), (q, k, v))
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    for a, b in zip(eager, torch.autograd.grad(compiled(q, k, v), (q, k, v))):
        assert torch.equal(a, b)


def test_varlen_memory_is_linear_in_tokens(device):
    """Every tensor the varlen forward and backward allocate grows like the token count:
    doubling the tokens (twice the documents, the longest 128) doubles the bytes."""
    from test_attention import _AllocationRecorder

    def bytes_touched(copies):
        lens = [128, 7, 64, 1] * copies
        cu = cu_seqlens(lens, device)
        q, k, v = make((sum(lens), 2, 16), (sum(lens), 1, 16), torch.float16, device)
        with _AllocationRecorder() as recorder:
            o = flash_attention_varlen(q, k, v, cu, cu, 128, 128)
            torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
        return sum(recorder.storages.values())

    once, twice = bytes_touched(1), bytes_touched(2)
    assert twice <= 2.05 * once, f"bytes grew {twice / once:.2f}x when the tokens doubled"
