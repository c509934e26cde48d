"""flash_attention against the float64 reference (`attention_harness`): the output, the
log-sum-exp and every gradient, plain and with a window, a cap or both, on both backward schedules
and both forward paths; strides, determinism, masked rows, extreme scores, memory, bad input.

Packed sequences are in test_attention_varlen.py, rope_attention in test_rope_attention.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_harness import (
    DTYPES,
    NO_WINDOW,
    TMA_PATHS,
    AllocationRecorder,
    CopyRecorder,
    check_cancelling_gradients,
    gradients,
    make_heads,
    make_sinks,
    record_dq_paths,
    reference,
    run_dense,
    takes_descriptors,
    visible,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from fastlm import flash_attention
from fastlm.kernels._common import tl, triton
from fastlm.kernels.attention import flash_attention_ref, forward
from fastlm.kernels.attention.backward import attention_backward
from fastlm.kernels.attention.blocks import capped_scores, exp2_fma, exp2_split, slope_unit, tanh
from fastlm.kernels.attention.configs import (
    DKDV_CUDA_CONFIGS,
    DQ_CUDA_CONFIGS,
    FWD_CUDA_CONFIGS,
    MLA_BLOCKS,
    cuda_config,
    fitting_configs,
)
from fastlm.kernels.attention.forward import attention_forward
from fastlm.kernels.attention.launch import empty_heads_like, use_tensor_descriptors
from fastlm.kernels.attention.qkv import split_heads
from fastlm.reference import ScaledDotProductAttention
from fastlm.testing import TOLERANCE, assert_close, recomputed_softmax_bound, relative_error


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,causal", [(2, 4, 2, 9, 9, True), (1, 2, 1, 5, 12, True)])
def test_harness_reference_is_fastlm_reference(device, B, Hq, Hkv, Nq, Nk, causal):
    """The harness's float64 attention is fastlm.reference's ScaledDotProductAttention (the
    ground truth) on what both compute: grouped heads repeated, the causal mask at the end."""
    q, k, v = make_heads(B, Hq, Hkv, Nq, Nk, 16, torch.float64, device)
    o, _ = reference(q, k, v, visible(Nq, Nk, causal), 16**-0.5)
    group = Hq // Hkv
    mask = ~visible(Nq, Nk, causal).to(device)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    assert_close(o, ScaledDotProductAttention()(q, k, v, mask), torch.float64, "o")


# --------------------------------------------------------------------------------------------
# Shapes: every N, D and dtype, both schedules
# --------------------------------------------------------------------------------------------

# (B, Hq, Hkv, Nq, Nk, D, causal, dtype): every N, D and dtype appears, with and without the causal
# mask, grouped (Hq > Hkv) and multi-query (Hkv = 1) heads, Nq < Nk (decoding, chunked prefill), and
# several batches, heads and blocks at once (the 1-D grids' decomposition).
CASES = [
    (1, 2, 2, 1, 1, 16, True, torch.float32),
    (2, 2, 1, 17, 17, 32, True, torch.float16),
    (1, 4, 2, 64, 64, 64, False, torch.bfloat16),
    (1, 2, 2, 77, 77, 80, True, torch.float32),
    (1, 1, 1, 130, 130, 128, True, torch.bfloat16),
    (1, 2, 1, 257, 257, 16, True, torch.float16),
    (1, 2, 2, 257, 257, 32, False, torch.float32),
    (1, 3, 1, 77, 130, 64, True, torch.float16),
    (1, 2, 2, 1, 257, 128, True, torch.bfloat16),
    (2, 2, 2, 17, 64, 80, False, torch.float32),
    (1, 4, 1, 130, 257, 16, True, torch.float32),
    (1, 2, 2, 64, 77, 128, True, torch.float16),
    (1, 2, 1, 130, 130, 64, False, torch.float16),
    (1, 2, 2, 77, 77, 96, False, torch.bfloat16),
    (1, 2, 2, 64, 64, 8, True, torch.float32),
    (2, 3, 1, 130, 130, 16, True, torch.float16),
]


@pytest.mark.parametrize("deterministic", [True, False], ids=["two-pass", "atomic-dq"])
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal,dtype", CASES)
def test_matches_reference(device, deterministic, B, Hq, Hkv, Nq, Nk, D, causal, dtype):
    """Both backward schedules: the dK/dV and dQ passes, and dQ added with atomics."""
    q, k, v = make_heads(B, Hq, Hkv, Nq, Nk, D, dtype, device)
    run_dense(q, k, v, causal, deterministic=deterministic)


@pytest.mark.parametrize("tma", TMA_PATHS[1:], ids=["other-path"])
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal,dtype", [CASES[i] for i in (1, 2, 3, 7, 8, 11)])
def test_other_data_path_matches_reference(
    device, monkeypatch, tma, B, Hq, Hkv, Nq, Nk, D, causal, dtype
):
    """The data path the default does not take here (FASTLM_ATTENTION_TMA), in the forward and
    in the dQ pass (k and v streamed): every dtype, a padded head dim (80), GQA and MQA, Nq < Nk,
    rows past a block."""
    monkeypatch.setenv("FASTLM_ATTENTION_TMA", tma)
    q, k, v = make_heads(B, Hq, Hkv, Nq, Nk, D, dtype, device)
    assert use_tensor_descriptors(q, k, v, empty_heads_like(q.detach())) == (tma == "1")
    dq_paths = record_dq_paths(monkeypatch)
    run_dense(q, k, v, causal)
    assert dq_paths == [tma == "1"]


def test_a_config_kept_for_large_head_blocks_takes_no_smaller_one():
    """min_block_d: a config shipped only for the head blocks no better one fits (fp32 above 128,
    where 8 warps on 32 rows repeat MMA work) is not tried below them."""
    kept = cuda_config(32, 32, 8, 1, 0, 256, min_block_d=256)
    plain = cuda_config(64, 32, 4, 1, 0, 128)
    assert fitting_configs([plain, kept], 256, 4) == [kept]
    assert fitting_configs([plain, kept], 128, 4) == [plain]
    assert fitting_configs([plain, kept], 256, 2) == []
    for cuda in (FWD_CUDA_CONFIGS, DKDV_CUDA_CONFIGS):
        assert [c.min_block_d for c in fitting_configs(cuda, 256, 4)] == [256]
        assert all(c.min_block_d == 0 for c in fitting_configs(cuda, 128, 4))


def test_split_head_blocks_take_their_own_configs():
    """v's head block other than q's (MLA): configs by the wider block unless split_v is False,
    and the configs kept for the pair alone (split_blocks: 16-bit only, never for equal
    blocks)."""
    plain = cuda_config(64, 32, 4, 2, 128, 128)
    unsplit = cuda_config(128, 64, 8, 3, 128, 0, split_v=False)
    mla = cuda_config(128, 64, 8, 2, 0, 0, split_blocks=(MLA_BLOCKS,))
    wide = cuda_config(32, 32, 4, 1, 256, 128)
    cuda = [plain, unsplit, mla, wide]
    assert fitting_configs(cuda, 128, 2, block_dv=64) == [plain, wide]
    assert fitting_configs(cuda, 128, 2) == [plain, unsplit, wide]
    assert fitting_configs(cuda, 256, 2, block_dv=128) == [mla, wide]
    assert fitting_configs(cuda, 256, 2) == [wide]
    assert fitting_configs(cuda, 256, 4, block_dv=128) == []
    assert fitting_configs(cuda, 64, 2, block_dv=256) == [wide]
    for configs in (FWD_CUDA_CONFIGS, DKDV_CUDA_CONFIGS, DQ_CUDA_CONFIGS):
        assert fitting_configs(configs, MLA_BLOCKS[0], 2, block_dv=MLA_BLOCKS[1])


@pytest.mark.parametrize("shift", [1, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_descriptor_forward_with_exponentials_on_the_fma_units(device, monkeypatch, shift, causal):
    """The descriptor forward with the last 1/2^shift of each block's exponentials computed by
    exp2_fma (EXP2_FMA_SHIFT): masked keys (-inf) and rows past a block included."""
    monkeypatch.setenv("FASTLM_ATTENTION_TMA", "1")
    monkeypatch.setattr(forward, "_exp2_fma_shift", lambda block_d: shift)
    q, k, v = make_heads(1, 2, 1, 77, 130, 64, torch.float16, device)
    run_dense(q, k, v, causal)


def test_descriptor_forward_reads_packed_qkv_in_place(device, monkeypatch):
    """A packed q|k|v (row stride (Hq + 2 Hkv) D) takes the descriptor path and agrees with the
    pointer path; a misaligned view falls back to pointers."""
    B, T, Hq, Hkv, D = 2, 77, 4, 2, 32
    qkv = torch.randn(B, T, (Hq + 2 * Hkv) * D, device=device, dtype=torch.float16)
    q, k, v = split_heads(qkv, Hq, Hkv)
    monkeypatch.setenv("FASTLM_ATTENTION_TMA", "1")
    assert use_tensor_descriptors(q, k, v, empty_heads_like(q))
    o_tma, lse_tma = attention_forward(q, k, v, True, D**-0.5, True)
    monkeypatch.setenv("FASTLM_ATTENTION_TMA", "0")
    o_ptr, lse_ptr = attention_forward(q, k, v, True, D**-0.5, True)
    assert_close(o_tma, o_ptr.double(), torch.float16, "o, descriptor vs pointer path")
    assert_close(lse_tma, lse_ptr.double(), torch.float32, "lse, descriptor vs pointer path")
    monkeypatch.setenv("FASTLM_ATTENTION_TMA", "1")
    shifted = torch.randn(B * T * 8 * D + 1, device=device, dtype=torch.float16)[1:]
    q, k, v = split_heads(shifted.view(B, T, 8 * D), Hq, Hkv)  # base 2 bytes past alignment
    assert not use_tensor_descriptors(q, k, v, empty_heads_like(q))


@pytest.mark.parametrize("tma", TMA_PATHS, ids=["default-path", "other-path"])
@pytest.mark.parametrize(
    "causal,window,softcap",
    [(True, NO_WINDOW, 0.0), (False, NO_WINDOW, 0.0), (True, (20, 0), 2.0), (False, (9, 30), 0.0)],
)
def test_packed_qkv_views_match_reference(device, monkeypatch, tma, causal, window, softcap):
    """q, k, v as head slices of one packed (B, T, (Hq + 2 Hkv) D) projection (row stride
    (Hq + 2 Hkv) D, grouped heads), T = 77 ending inside a block, forward and every gradient
    against float64 on both data paths: the descriptor dQ pass reads k and v in place, with the
    next head's columns past each row's D and the rows past T outside its views."""
    if tma is not None:
        monkeypatch.setenv("FASTLM_ATTENTION_TMA", tma)
    B, T, Hq, Hkv, D = 2, 77, 4, 2, 32
    qkv = torch.randn(B, T, (Hq + 2 * Hkv) * D, device=device, dtype=torch.float16)
    q, k, v = split_heads(qkv.requires_grad_(), Hq, Hkv)
    for t in (q, k, v):
        t.retain_grad()  # views: the checks read their .grad
    dq_paths = record_dq_paths(monkeypatch)
    run_dense(q, k, v, causal, window, softcap)
    assert dq_paths == [takes_descriptors(tma)]


@pytest.mark.parametrize("tma", TMA_PATHS, ids=["default-path", "other-path"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scale", [0.3, -0.3, 0.0])
def test_softmax_scale(device, monkeypatch, causal, tma, scale):
    """A positive scale takes the row max of the unscaled scores; zero and negative ones scale
    first (the max would not commute with them)."""
    if tma is not None:
        monkeypatch.setenv("FASTLM_ATTENTION_TMA", tma)
    q, k, v = make_heads(1, 2, 1, 77, 130, 32, torch.float32, device)
    run_dense(q, k, v, causal, scale=scale)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scale", [0.3, -0.3, 0.0])
def test_torch_backend_softmax_scale(device, monkeypatch, causal, scale):
    """FASTLM_BACKEND=torch takes any scale the option rule does: SDPA scales q and k by
    sqrt(scale) each (NaN below 0, and 0 with the causal mask gave NaN too), so a scale <= 0
    goes through the explicit scores."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    for Nq, Nk in ((77, 77), (77, 130)):  # SDPA's own causal mask, and a mask of ours
        q, k, v = make_heads(1, 2, 1, Nq, Nk, 32, torch.float32, device)
        o = flash_attention(q, k, v, causal, scale)  # no lse asked: the path that may take SDPA
        ref_o, _ = reference(q, k, v, visible(Nq, Nk, causal), scale)
        assert_close(o, ref_o, torch.float32, "o")
        run_dense(q, k, v, causal, scale=scale)  # with lse and gradients: the explicit scores


# --------------------------------------------------------------------------------------------
# A window, a cap, the log-sum-exp
# --------------------------------------------------------------------------------------------

# (B, Hq, Hkv, Nq, Nk, D, causal, window, softcap, dtype): windows of 3 and 5 fit inside a block,
# 40 and 100 span several, and key blocks wholly outside every window are never read.
WINDOW_CASES = [
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


@pytest.mark.parametrize("deterministic", [True, False], ids=["two-pass", "atomic-dq"])
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal,window,softcap,dtype", WINDOW_CASES)
def test_window_softcap_lse_match_reference(
    device, deterministic, B, Hq, Hkv, Nq, Nk, D, causal, window, softcap, dtype
):
    q, k, v = make_heads(B, Hq, Hkv, Nq, Nk, D, dtype, device)
    run_dense(q, k, v, causal, window, softcap, deterministic=deterministic)


@pytest.mark.parametrize("tma", TMA_PATHS[1:], ids=["other-path"])
@pytest.mark.parametrize("case", [WINDOW_CASES[i] for i in (0, 2, 3, 4)])
def test_window_softcap_other_data_path(device, monkeypatch, tma, case):
    monkeypatch.setenv("FASTLM_ATTENTION_TMA", tma)
    B, Hq, Hkv, Nq, Nk, D, causal, window, softcap, dtype = case
    dq_paths = record_dq_paths(monkeypatch)
    run_dense(*make_heads(B, Hq, Hkv, Nq, Nk, D, dtype, device), causal, window, softcap)
    assert dq_paths == [tma == "1"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softcap_with_large_scores(device, dtype):
    """Scores of ~1e3 capped at 20: accurate, finite, and tanh saturates without overflow.

    o, lse and dv meet the usual bounds. dq and dk go through the cap's slope 1 - tanh^2(s / 20),
    tiny for all but the few scores near 0, and P * (dP - Delta) cancels there: they are checked
    relative to the terms that cancel (`check_cancelling_gradients`), not to their small norm (a
    bare bound on that failed 2 of 150 fp16 seeds at 5.7e-3 and 7.4e-3)."""
    D, scale = 32, 32**-0.5
    q, k, v = make_heads(1, 2, 2, 70, 70, D, dtype, device, std=1000**0.5 / D**0.25)
    with torch.no_grad():
        assert (scale * q.double() @ k.double().transpose(-1, -2)).abs().amax() > 500
    o, lse = flash_attention(
        q, k, v, True, return_lse=True, softcap=20.0, allow_tf32=False, deterministic=True
    )
    do = torch.randn_like(o)
    grads = gradients(o, (q, k, v), do)
    seen = visible(70, 70, True)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_o, ref_lse = reference(*leaves, seen, scale, 20.0)
    ref_grads = gradients(ref_o, leaves, do.double())
    assert_close(o, ref_o, dtype, "o")
    assert_close(lse, ref_lse, torch.float32, "lse")
    assert lse.abs().amax() < 20 * math.log2(math.e) + math.log(70) + 1
    assert_close(grads[2], ref_grads[2], dtype, "dv")
    bound = TOLERANCE[dtype]
    check_cancelling_gradients(grads, ref_grads, q, k, v, do, ref_o, seen, scale, 20.0, bound)


@pytest.mark.parametrize(
    "backend,deterministic", [("triton", True), ("triton", False), ("torch", True)]
)
def test_cap_far_below_the_scores_keeps_gradients_relative(
    device, monkeypatch, backend, deterministic
):
    """A cap of 1e-3 under scores of 6.4e-3 to 1.44e-2 (positive q and k of 16 dims drawn in
    [1, 1.5), scale 4e-4): every x = s / cap lies in [6.4, 14.4], where the cap's slope 1 /
    cosh^2(x) runs from 1.1e-5 down to 1.3e-12, so every term of dq and dk is a slope of the
    tail. dq and dk within fp32's bound of the float64 reference (whose own slope, 1 - tanh^2 in
    float64, is off by 1e-16 absolute: under 1e-4 of the smallest slope here, and the sums are
    led by the largest), on both backends. Computed from tanh (1 - th^2), the slopes were off by
    about 6e-8 absolute; the kernels' dq and dk came out ~1e-2 off, the PyTorch backend's 2e-2."""
    monkeypatch.setenv("FASTLM_BACKEND", backend)
    cap, scale, D = 1e-3, 4e-4, 16

    def draw(heads, n):
        return (1 + 0.5 * torch.rand(1, heads, n, D, device=device)).requires_grad_()

    q, k, v = draw(2, 20), draw(1, 37), draw(1, 37)
    with torch.no_grad():
        x = scale * q.double() @ k.double().transpose(-1, -2) / cap
        assert 6.0 < x.amin() and x.amax() < 15.0
    run_dense(q, k, v, True, NO_WINDOW, cap, scale=scale, deterministic=deterministic)


def approx_cap_bounds(q, k, v, do, scale, softcap):
    """Elementwise bounds on how far the approximate cap (tanh off by at most e = 2^-11 of
    itself) may move o, dq, dk and dv from the exact ones, from the float64 exact quantities of
    one causal head each (q, k, v, do (B, H, N, D), no grouping):

    - each capped score c th moves by at most d = c e, so each weight P by a factor within
      exp(+-2 d): |dP| <= r P, r = exp(2 d) - 1; o by r (P |V|), dv by r (P^T |dO|);
    - Delta = rowsum(dO o) by r E, E = rowsum(|dO| (P |V|)); the slope 1 - th^2 by t th^2, t =
      2 e (1 + e / 2) (|th^2 - th'^2| <= |th - th'| (|th| + |th'|));
    - dS = P (dP - Delta) slope moves by B = P ((r (|g| + r E) + r E)(slope + t th^2) + |g| t
      th^2), g = dP - Delta (each factor at its worst); dq by scale B |K|, dk by scale B^T |Q|.
    """
    q, k, v, do = (x.detach().double() for x in (q, k, v, do))
    n_q, n_k = q.shape[-2], k.shape[-2]
    th = torch.tanh(scale * q @ k.transpose(-1, -2) / softcap)
    seen = visible(n_q, n_k, True).to(q.device)
    p = (softcap * th).masked_fill(~seen, -math.inf).softmax(-1)
    e = 2.0**-11
    r, t = math.expm1(2 * softcap * e), 2 * e * (1 + e / 2)
    pv = p @ v.abs()
    big_e = (do.abs() * pv).sum(-1, keepdim=True)
    g = (do @ v.transpose(-1, -2) - (do * (p @ v)).sum(-1, keepdim=True)).abs()
    slope, moved = 1 - th**2, t * th**2
    b = p * ((r * (g + r * big_e) + r * big_e) * (slope + moved) + g * moved)
    return dict(
        o=r * pv,
        dq=scale * b @ k.abs(),
        dk=scale * b.transpose(-1, -2) @ q.abs(),
        dv=r * p.transpose(-1, -2) @ do.abs(),
    )


@pytest.mark.parametrize(
    "backend,deterministic", [("triton", True), ("triton", False), ("torch", True)]
)
def test_approximate_cap_within_its_bound(device, monkeypatch, backend, deterministic):
    """softcap_approx=True (tanh.approx.f32 on a GPU; here its model, tanh rounded toward zero to
    11 bits, on both backends): o, dq, dk, dv against the float64 exact cap within the bound
    that 2^-11 in tanh implies (`approx_cap_bounds`) plus fp32's own allowance, at a cap of 4
    under scores of about +-10 (every part of tanh: the line, the bend, the tails). And the
    approximation is in use: o is 100 fp32 epsilons or more from the exact cap (measured about
    1.7e3: 2e-4 relative, where the exact cap's o is about 1 epsilon off)."""
    monkeypatch.setenv("FASTLM_BACKEND", backend)
    cap, D = 4.0, 16
    q, k, v = make_heads(1, 2, 2, 45, 45, D, torch.float32, device, std=10**0.5 / D**0.25)
    o = flash_attention(
        q, k, v, True, softcap=cap, softcap_approx=True, allow_tf32=False,
        deterministic=deterministic,
    )  # fmt: skip
    do = torch.randn_like(o)
    grads = dict(zip(("dq", "dk", "dv"), gradients(o, (q, k, v), do)))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_o, _ = reference(*leaves, visible(45, 45, True), D**-0.5, cap)
    refs = dict(zip(("dq", "dk", "dv"), gradients(ref_o, leaves, do.double())), o=ref_o)
    bounds = approx_cap_bounds(q, k, v, do, D**-0.5, cap)
    tolerance = TOLERANCE[torch.float32]
    for name, out in dict(grads, o=o).items():
        err = (out.double() - refs[name]).norm()
        bound = bounds[name].norm() + tolerance * refs[name].norm()
        assert err <= bound, f"{name}: {err:.3e} > {bound:.3e} (approximate cap)"
    eps = torch.finfo(torch.float32).eps  # the exact cap's o: about eps off here
    assert relative_error(o, ref_o) > 100 * eps, "the approximate cap was not taken"


@pytest.mark.parametrize("deterministic", [True, False], ids=["two-pass", "atomic-dq"])
# 1e3 (the cap's own effect the bound's second term) and the largest, 1e6: every score here is
# under 0.6 c, so each cap takes `_scaled_tanh_parts`' polynomial form, whose leading term is t,
# and a cap between them checks that form again.
@pytest.mark.parametrize("softcap", [1e3, 1e6])
def test_large_caps_are_exact(device, softcap, deterministic):
    """A cap far above the scores leaves them as they are: c * tanh(s / c) = s (1 - (s / c)^2 / 3)
    must be s to fp32 rounding for any cap up to the largest the option rule takes, 1e6
    (`fastlm/options.py`; a tanh that cancels for small arguments loses digits as c grows).
    Checked against the reference, and against the same call without a cap: every output within
    4 u max|s| of it (u = 2^-24; measured up to 0.93 u max|s| for c >= 1e5 over 8 seeds) plus the
    cap's own effect, max|s|^3 / c^2 (measured 1.2e-5 at c = 1e3).
    """
    q, k, v = make_heads(1, 2, 1, 45, 70, 16, torch.float32, device)
    run_dense(q, k, v, True, NO_WINDOW, softcap, deterministic=deterministic)
    do = torch.randn(1, 2, 45, 16, device=device)

    def outputs(cap):
        o, lse = flash_attention(
            q,
            k,
            v,
            True,
            softcap=cap,
            return_lse=True,
            allow_tf32=False,
            deterministic=deterministic,
        )
        return (o, lse, *gradients(o, (q, k, v), do))

    with torch.no_grad():
        largest = (q.double() @ k.double().transpose(-1, -2)).abs().amax().item() * 16**-0.5
    bound = 4 * 2**-24 * largest + largest**3 / softcap**2
    names = ("o", "lse", "dq", "dk", "dv")
    for name, with_cap, plain in zip(names, outputs(softcap), outputs(0.0)):
        err = relative_error(with_cap, plain)
        assert err <= bound, f"{name}: capped at {softcap:g} differs by {err:.2e} > {bound:.1e}"


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


@triton.jit
def _capped_scores_kernel(
    QK, Y, Y_SCALE, D, n, qk_scale, softcap, SIGNED: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y, y_scale, slope = capped_scores(
        tl.load(QK + offs, mask=offs < n), qk_scale, softcap, 1, SIGNED
    )
    tl.store(Y + offs, y, mask=offs < n)
    tl.store(Y_SCALE + offs, y_scale + tl.zeros_like(y), mask=offs < n)
    tl.store(D + offs, slope * slope_unit(1), mask=offs < n)


LOG2E = math.log2(math.e)


@pytest.mark.parametrize(
    "signed,qk_scale,softcap",
    [(True, 1.0, cap) for cap in (1e-2, 1.0, 20 * LOG2E, 50 * LOG2E, 1e8, 1e30)]
    + [(True, 0.125 * LOG2E, 50 * LOG2E), (False, -0.3, 1e-2)],
    ids=[f"scaled-scores-cap{i}" for i in range(6)] + ["forward", "backward-negative-scale"],
)
def test_capped_scores_are_exact_to_fp32_rounding(device, signed, qk_scale, softcap):
    """What the kernels run on raw scores qk (`capped_scores`): the scale folded into the tanh's
    constants, the sign of qk on y (the forward's, SIGNED) or on y's scale (the backward's), a
    positive or negative scale, caps far below and far above the scores; x = qk * s / c from
    1e-30 to 44 (where the slope leaves fp32's normal range) and densely across 0..2, where the
    tanh's two forms meet (0.6).

    y * y_scale, formed in float64 here as the kernels' exponent forms it in one FMA (y * c - m:
    no rounding of the product of its own), within 3 ulp of c * tanh(x) and with its sign. The
    slope 1 - tanh^2 = 1 / cosh^2(x) to a relative error, in the tails too, where it is tiny:
    within 3 eps (1 + 2 |x|), 2 |x| the slope's condition number in x (d log(1 / cosh^2) / dx =
    -2 tanh x), whose fp32 rounding the kernel cannot avoid. Taken from tanh (1 - th^2) it was
    off by an ulp of th, about 6e-8 absolute: 2.4e-3 relative at |x| = 6, all of it past 9."""
    ratios = torch.cat(
        [
            torch.logspace(-30, 1.5, 3000, dtype=torch.float64),
            torch.linspace(0.0, 2.0, 20001, dtype=torch.float64),
            torch.linspace(2.0, 44.0, 4001, dtype=torch.float64),
        ]
    )
    qk = (torch.cat([ratios, -ratios]) * softcap / abs(qk_scale)).to(torch.float32).to(device)
    y, y_scale, dcap = (torch.full_like(qk, math.nan) for _ in range(3))
    grid = (triton.cdiv(qk.numel(), 1024),)
    _capped_scores_kernel[grid](
        qk, y, y_scale, dcap, qk.numel(), qk_scale, softcap, signed, BLOCK=1024
    )
    f32 = lambda value: torch.tensor(value, dtype=torch.float32).double()  # noqa: E731
    x = qk.double() * f32(qk_scale) / f32(softcap)  # the kernel's scalars: fp32
    ref = f32(softcap) * torch.tanh(x)
    eps = torch.finfo(torch.float32).eps
    ulp = eps * ref.abs().clamp_min(torch.finfo(torch.float32).tiny)
    capped = y.double() * y_scale.double()
    worst = ((capped - ref).abs() / ulp).max().item()
    assert worst <= 3.0, f"c * tanh(x) is {worst:.1f} ulp off (s = {qk_scale:g}, c = {softcap:g})"
    assert torch.equal(torch.sign(capped), torch.sign(ref)), "the cap keeps the sign of s qk"
    slope = 1.0 / torch.cosh(x) ** 2
    normal = slope >= torch.finfo(torch.float32).tiny
    error = (dcap.double() - slope).abs() / (slope * eps * (1 + 2 * x.abs()))
    worst_dcap = error[normal].max().item()
    assert worst_dcap <= 3.0, f"1 - tanh^2: {worst_dcap:.1f} eps (1 + 2|x|) off"


def test_negative_scale_with_a_cap(device):
    """A negative softmax scale under the cap (allowed, never hot): the forward takes the sign of
    the scale into its tanh, the backward into the exponent's scale (`capped_scores`); o, lse
    and the gradients against the float64 reference on both passes' paths."""
    q, k, v = make_heads(1, 2, 1, 45, 70, 16, torch.float32, device, std=2.0)
    run_dense(q, k, v, True, NO_WINDOW, 3.0, scale=-0.3)


@triton.jit
def _exp2_fma_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, exp2_fma(tl.load(X + offs, mask=offs < n)), mask=offs < n)


def _softmax_exponents(device) -> torch.Tensor:
    """float32 exponents over the softmax's whole range, x <= 0 (and a few ulp above, where a
    fused scale-and-shift rounds past the row max): dense near 0, every binade down to 2^-126
    and through the denormals to where 2^x rounds to 0, -inf (a masked score) and both zeros."""
    tiny = torch.logspace(-30, 0, 3000, dtype=torch.float64)
    x = torch.cat(
        [
            torch.linspace(-160.0, 0.0, 40001, dtype=torch.float64),
            -tiny,
            tiny * 1e-6,
            -torch.rand(5000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
            * 160.0,
            torch.tensor([0.0, -0.0, -math.inf, -126.0, -149.0, -149.5, -150.0, -200.0]),
        ]
    )
    return x.to(torch.float32).to(device)


def test_exp2_on_the_fma_units_is_exact_to_fp32_rounding(device):
    """exp2_fma against torch.exp2 in float64 over the softmax's range: within an fp32 ulp of the
    exact value where 2^x is normal (1.5 where the interpreter rounds a * b + c twice), within
    one ulp of the smallest denormal (2^-149) below, and exactly 0 where exp2 gives 0."""
    x = _softmax_exponents(device)
    y = torch.full_like(x, math.nan)
    _exp2_fma_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    exact = torch.exp2(x.double())
    normal = exact >= torch.finfo(torch.float32).tiny
    # An fp32 ulp at the exact value: 2^(e - 24) for exact = m * 2^e, m in [0.5, 1); 2^-149
    # (the smallest denormal) below 2^-126.
    ulp = torch.where(
        normal, torch.ldexp(torch.ones_like(exact), torch.frexp(exact)[1] - 24), 2.0**-149
    )
    error = (y.double() - exact).abs() / ulp
    assert error[normal].max().item() <= 1.5, f"{error[normal].max().item():.2f} ulp off"
    assert error[~normal].max().item() <= 1.0, "denormal results off by more than one"
    zero = torch.exp2(x) == 0
    assert zero.any() and torch.equal(y[zero], torch.zeros_like(y[zero])), "exp2 rounds to 0 there"
    assert torch.equal(y[x == 0], torch.ones_like(y[x == 0])), "2^0 = 1 exactly"


@triton.jit
def _exp2_split_kernel(X, Y, FMA_SHIFT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    tl.store(Y + offs, exp2_split(tl.load(X + offs), FMA_SHIFT))


@pytest.mark.parametrize("shift", [1, 2, 3])
def test_exp2_split_puts_each_column_back(device, shift):
    """A tile's 2^x with the last 1/2^shift of its columns on the FMA units: every element where
    it was, equal to torch.exp2 within the MUFU's and exp2_fma's rounding; the columns exp2_fma
    computed are exactly its own values."""
    rows, cols = 16, 64
    x = -torch.rand(rows, cols, device=device) * 40.0
    y = torch.full_like(x, math.nan)
    _exp2_split_kernel[(1,)](x, y, shift, rows, cols)
    assert_close(y, torch.exp2(x.double()), torch.float32, "exp2_split")
    fma = torch.full_like(x, math.nan)
    _exp2_fma_kernel[(1,)](x, fma, x.numel(), BLOCK=rows * cols)
    first = cols - (cols >> shift)
    assert torch.equal(y[:, first:], fma[:, first:]), "the last columns come from exp2_fma"


@pytest.mark.parametrize("causal", [True, False])
def test_lse_is_logsumexp_of_the_scores(device, causal):
    """return_lse without window or cap: torch.logsumexp of the scaled, masked scores."""
    q, k, v = make_heads(2, 2, 1, 50, 70, 16, torch.float32, device)
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
    q, k, v = make_heads(1, 2, 1, Nq, Nk, D, torch.float32, device)
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
    ref_o, ref_lse = reference(q.detach(), k64, v64, visible(Nq, 40, True, (left, 0)), D**-0.5)
    assert_close(o, ref_o, torch.float32, "o")
    assert_close(lse, ref_lse, torch.float32, "lse")


# --------------------------------------------------------------------------------------------
# Extreme scores, masked rows
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_scores_do_not_overflow(device, dtype):
    """Scores of magnitude ~1e3 (e^1000 overflows every float type): all finite and accurate.

    O meets the usual bound. dV = P^T dO is built from P recomputed out of the saved lse, whose
    exponent carries the rounding of two fp32 dots of size ~ kappa = max scale |q| |k|: it is
    bounded by `recomputed_softmax_bound` (2 u kappa ~ 1e-3 here; measured 2e-6..2e-5 on one
    x86 machine, 1.2e-4..2e-4 on another). At such scores P is almost one-hot and
    dS = P * (dP - Delta) cancels: the error of any floating-point dQ is relative to the terms that
    cancel, s * (P * (|dP| + |Delta|)) |K| (and likewise for dK), not to the tiny result.
    """
    D, scale = 64, 64**-0.5
    q, k, v = make_heads(1, 2, 2, 77, 77, D, dtype, device, std=1000**0.5)
    o = flash_attention(q, k, v, causal=True, allow_tf32=False)  # TF32 would move s by ~1
    do = torch.randn_like(o)
    grads = gradients(o, (q, k, v), do)
    q64, k64, v64, do64 = (t.detach().double() for t in (q, k, v, do))
    leaves = [t.clone().requires_grad_() for t in (q64, k64, v64)]
    ref_o, _ = reference(*leaves, visible(77, 77, True), scale)
    ref_grads = gradients(ref_o, leaves, do64)
    assert_close(o, ref_o, dtype, "o")
    dv_err, dv_bound = (
        relative_error(grads[2], ref_grads[2]),
        recomputed_softmax_bound(q, k, scale, dtype),
    )
    assert dv_err <= dv_bound, f"dv: relative error {dv_err:.3e} > {dv_bound:.1e} ({dtype})"

    assert (scale * q64 @ k64.transpose(-1, -2)).abs().amax() > 1000
    # dq and dk: the same recomputed P, relative to the terms that cancel.
    seen = visible(77, 77, True)
    check_cancelling_gradients(grads, ref_grads, q, k, v, do, ref_o, seen, scale, 0.0, dv_bound)


@pytest.mark.parametrize("deterministic", [True, False], ids=["two-pass", "atomic-dq"])
def test_fully_masked_rows_give_zeros(device, deterministic):
    """The public function rejects Nq > Nk; the kernels, given it, mask every key for the first
    Nq - Nk queries (they would see keys j <= i - (Nq - Nk) < 0). Those rows must be 0, not NaN,
    and the others ordinary attention of the last Nk queries."""
    Nq, Nk, D = 77, 40, 16
    q, k, v = (t.detach() for t in make_heads(1, 2, 1, Nq, Nk, D, torch.float32, device))
    o, lse = attention_forward(q, k, v, True, D**-0.5, False)
    do = torch.randn_like(o)
    dq, dk, dv = attention_backward(do, q, k, v, o, lse, True, D**-0.5, False, deterministic)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_o, _ = reference(*leaves, visible(Nq, Nk, True), D**-0.5)
    assert ref_o[:, :, : Nq - Nk].abs().max() == 0
    ref_grads = gradients(ref_o, leaves, do.double())
    for name, out, ref in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), (ref_o, *ref_grads)):
        assert_close(out, ref, torch.float32, name)
    assert torch.equal(o[:, :, : Nq - Nk], torch.zeros_like(o[:, :, : Nq - Nk]))
    assert torch.equal(dq[:, :, : Nq - Nk], torch.zeros_like(dq[:, :, : Nq - Nk]))


@pytest.mark.parametrize("deterministic", [True, False], ids=["two-pass", "atomic-dq"])
@pytest.mark.parametrize(
    "causal,window", [(False, NO_WINDOW), (True, NO_WINDOW), (False, (5, 100))], ids=str
)
def test_scores_all_far_below_zero(device, causal, window, deterministic):
    """Every score about -100: the LSE is too, and 2^(0 - LSE) overflows (base 2: 0 + 144). The
    key rows past Nk in the last (partial) key block are zeros with score 0; unmasked, their P =
    inf times k = 0 put a NaN into the atomic dQ. Nk = 77 leaves a partial key block at every
    block size; a window reaching past the keys too. The offset is the same for every pair
    (first channel 20 in q, -20 in k), so the softmax is as well conditioned as without it."""
    q, k, v = make_heads(1, 2, 1, 40, 77, 16, torch.float32, device)
    with torch.no_grad():
        q[..., 0] = 20.0
        k[..., 0] = -20.0  # s * -400 = -100
    run_dense(q, k, v, causal, window, deterministic=deterministic)


# --------------------------------------------------------------------------------------------
# Attention sinks (gpt-oss); a value head dim of its own (MLA)
# --------------------------------------------------------------------------------------------

# (B, Hq, Hkv, Nq, Nk, D, causal, window, softcap, dtype): sinks with GQA and MQA, causal and
# full, gpt-oss's sliding window, a cap (the sink is not capped), Nq < Nk, every dtype.
SINK_CASES = [
    (2, 4, 2, 77, 77, 32, True, NO_WINDOW, 0.0, torch.float32),
    (1, 4, 1, 45, 70, 16, True, (9, 0), 0.0, torch.float16),  # sliding window, MQA, Nq < Nk
    (1, 2, 2, 70, 70, 16, False, (5, 17), 2.0, torch.float32),  # both sides, capped
    (1, 2, 1, 64, 64, 64, False, NO_WINDOW, 0.0, torch.bfloat16),
    (1, 3, 1, 33, 33, 16, True, NO_WINDOW, 1.5, torch.float16),  # capped, causal
]


@pytest.mark.parametrize("deterministic", [True, False], ids=["two-pass", "atomic-dq"])
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal,window,softcap,dtype", SINK_CASES)
def test_sinks_match_reference(
    device, deterministic, B, Hq, Hkv, Nq, Nk, D, causal, window, softcap, dtype
):
    """o, lse (the sink in its sum) and dq, dk, dv, dsinks against float64 autograd of the
    eager formula (a column of sink logits, softmax, the column dropped)."""
    q, k, v = make_heads(B, Hq, Hkv, Nq, Nk, D, dtype, device)
    run_dense(
        q, k, v, causal, window, softcap, deterministic=deterministic, sinks=make_sinks(Hq, device)
    )


@pytest.mark.parametrize("tma", TMA_PATHS[1:], ids=["other-path"])
@pytest.mark.parametrize("case", [SINK_CASES[i] for i in (1, 2, 3)])
def test_sinks_other_data_path(device, monkeypatch, tma, case):
    monkeypatch.setenv("FASTLM_ATTENTION_TMA", tma)
    B, Hq, Hkv, Nq, Nk, D, causal, window, softcap, dtype = case
    q, k, v = make_heads(B, Hq, Hkv, Nq, Nk, D, dtype, device)
    run_dense(q, k, v, causal, window, softcap, sinks=make_sinks(Hq, device))


@pytest.mark.parametrize("sink_dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_sinks_of_any_float_dtype(device, sink_dtype):
    """Sinks of another dtype than q: fp32 math, and their gradient in their own dtype."""
    q, k, v = make_heads(1, 2, 1, 40, 40, 16, torch.float32, device)
    sinks = make_sinks(2, device, sink_dtype)
    _, _, grads = run_dense(q, k, v, True, sinks=sinks)
    assert grads[3].dtype == sink_dtype


@pytest.mark.parametrize("tma", TMA_PATHS, ids=["default-path", "other-path"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["two-pass", "atomic-dq"])
def test_minus_inf_sink_is_no_sink(device, monkeypatch, tma, deterministic):
    """A sink of -inf is no sink: o, lse, dq, dk, dv bitwise those of a call without sinks, on
    its head, with a finite sink on the other; its gradient is 0."""
    if tma is not None:
        monkeypatch.setenv("FASTLM_ATTENTION_TMA", tma)
    q, k, v = make_heads(1, 2, 1, 45, 70, 16, torch.float16, device)
    sinks = torch.tensor([-math.inf, 0.5], device=device, requires_grad=True)
    do = torch.randn(1, 2, 45, 16, device=device, dtype=torch.float16)
    results = []
    for s in (sinks, None):
        o, lse = flash_attention(
            q, k, v, window_size=(20, 0), return_lse=True, sinks=s, deterministic=deterministic
        )
        results.append((o, lse, *gradients(o, (q, k, v) if s is None else (q, k, v, s), do)))
    with_sinks, without = results
    for name, a, b in zip(("o", "lse"), with_sinks, without):
        assert torch.equal(a[:, 0], b[:, 0]), f"{name} of the -inf sink's head"
        assert not torch.equal(a[:, 1], b[:, 1]), f"{name} of the finite sink's head"
    assert torch.equal(with_sinks[2][:, 0], without[2][:, 0]), "dq of the -inf sink's head"
    assert with_sinks[5][0] == 0 and with_sinks[5][1] != 0
    all_minus_inf = torch.full((2,), -math.inf, device=device)
    o, lse = flash_attention(q, k, v, return_lse=True, sinks=all_minus_inf)
    o_plain, lse_plain = flash_attention(q, k, v, return_lse=True)
    assert torch.equal(o, o_plain) and torch.equal(lse, lse_plain)


@pytest.mark.parametrize("deterministic", [True, False], ids=["two-pass", "atomic-dq"])
def test_sinks_on_rows_without_keys(device, deterministic):
    """Rows that see no key (here the first Nq - Nk of a causal launch, which the public function
    refuses but packed sequences have): the sink is all they see, so o = 0 and lse = the sink
    (base 2 in the kernels), and their dq is 0."""
    Nq, Nk, D = 77, 40, 16
    q, k, v = (t.detach() for t in make_heads(1, 2, 1, Nq, Nk, D, torch.float32, device))
    sinks = torch.tensor([0.7, -1.3], device=device)
    o, lse = attention_forward(q, k, v, True, D**-0.5, False, sinks=sinks)
    do = torch.randn_like(o)
    dq, dk, dv, dsinks = attention_backward(
        do, q, k, v, o, lse, True, D**-0.5, False, deterministic, sinks=sinks
    )
    leaves = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    ref_o, ref_lse = reference(*leaves[:3], visible(Nq, Nk, True), D**-0.5, 0.0, leaves[3])
    ref_grads = gradients(ref_o, leaves, do.double())
    for name, out, ref in zip(
        ("o", "dq", "dk", "dv", "dsinks"), (o, dq, dk, dv, dsinks), (ref_o, *ref_grads)
    ):
        assert_close(out, ref, torch.float32, name)
    empty = slice(0, Nq - Nk)
    assert torch.equal(o[:, :, empty], torch.zeros_like(o[:, :, empty]))
    assert torch.equal(dq[:, :, empty], torch.zeros_like(dq[:, :, empty]))
    assert_close(
        lse[0, :, empty] * math.log(2),
        sinks[:, None].double().expand(2, Nq - Nk),
        torch.float32,
        "lse",
    )


def test_sink_gradient_is_deterministic(device):
    """Two backward passes give bitwise-equal dsinks (a fixed-order reduction, no atomics)."""
    q, k, v = make_heads(1, 4, 2, 77, 77, 16, torch.float16, device)
    sinks = make_sinks(4, device)
    o = flash_attention(q, k, v, sinks=sinks)
    do = torch.randn_like(o)
    first = gradients(o, (q, k, v, sinks), do)
    o = flash_attention(q, k, v, sinks=sinks)
    second = gradients(o, (q, k, v, sinks), do)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# (B, Hq, Hkv, Nq, Nk, D, Dv, causal, dtype): q and k's head dim and v's differ: MLA's 192 / 128
# (padded to head blocks 256 / 128), 96 / 64, v wider than q, GQA, Nq < Nk.
VALUE_DIM_CASES = [
    (1, 2, 1, 40, 40, 192, 128, True, torch.bfloat16),
    (1, 2, 2, 45, 70, 96, 64, True, torch.float16),
    (2, 4, 2, 33, 33, 32, 16, False, torch.float32),
    (1, 2, 1, 70, 70, 16, 48, True, torch.float32),
]


@pytest.mark.parametrize("deterministic", [True, False], ids=["two-pass", "atomic-dq"])
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,Dv,causal,dtype", VALUE_DIM_CASES)
def test_value_head_dim_of_its_own(device, deterministic, B, Hq, Hkv, Nq, Nk, D, Dv, causal, dtype):
    """o and dv take v's head dim; every output and gradient against float64."""
    q, k, v = make_heads(B, Hq, Hkv, Nq, Nk, D, dtype, device, Dv=Dv)
    o, _, grads = run_dense(q, k, v, causal, deterministic=deterministic)
    assert o.shape == (B, Hq, Nq, Dv) and grads[2].shape == v.shape


# Head blocks of 512 (Gemma 4's global layers), where the dK/dV pass runs as a dV and a dK
# launch (`split_kv_grads`), 16-bit only: every option at once on grouped heads, then a head dim
# padded to 512 for q and k with a narrower v (full), and the reverse.
WIDE_HEAD_CASES = [
    (1, 2, 1, 7, 9, 512, 512, True, (4, 0), 2.0, True, torch.bfloat16),
    (1, 2, 2, 6, 6, 264, 128, False, NO_WINDOW, 0.0, False, torch.bfloat16),
    (1, 2, 1, 5, 5, 64, 512, True, NO_WINDOW, 0.0, False, torch.float16),
]


@pytest.mark.parametrize(
    "B,Hq,Hkv,Nq,Nk,D,Dv,causal,window,softcap,with_sinks,dtype", WIDE_HEAD_CASES
)
def test_head_dim_512(
    device, B, Hq, Hkv, Nq, Nk, D, Dv, causal, window, softcap, with_sinks, dtype
):
    """o, lse and every gradient against float64 at head blocks of 512."""
    q, k, v = make_heads(B, Hq, Hkv, Nq, Nk, D, dtype, device, Dv=Dv)
    sinks = make_sinks(Hq, device) if with_sinks else None
    run_dense(q, k, v, causal, window, softcap, sinks=sinks)


@pytest.mark.parametrize("tma", TMA_PATHS[1:], ids=["other-path"])
@pytest.mark.parametrize("case", [VALUE_DIM_CASES[i] for i in (1, 3)])
def test_value_head_dim_other_data_path(device, monkeypatch, tma, case):
    monkeypatch.setenv("FASTLM_ATTENTION_TMA", tma)
    B, Hq, Hkv, Nq, Nk, D, Dv, causal, dtype = case
    dq_paths = record_dq_paths(monkeypatch)
    run_dense(*make_heads(B, Hq, Hkv, Nq, Nk, D, dtype, device, Dv=Dv), causal)
    assert dq_paths == [tma == "1"]


@pytest.mark.parametrize("tma", TMA_PATHS, ids=["default-path", "other-path"])
def test_value_head_dim_strided_with_sinks_and_window(device, monkeypatch, tma):
    """MLA-shaped q|k and v as views of token-major projections (v the first 64 channels of
    wider heads), a window and sinks at once."""
    if tma is not None:
        monkeypatch.setenv("FASTLM_ATTENTION_TMA", tma)
    B, T, Hq, Hkv, D, Dv = 1, 77, 4, 2, 96, 64
    qk = torch.randn(B, T, Hq + Hkv, D, device=device, dtype=torch.float16)
    q = qk[:, :, :Hq].transpose(1, 2).requires_grad_()
    k = qk[:, :, Hq:].transpose(1, 2).requires_grad_()
    v = torch.randn(B, T, Hkv, D, device=device, dtype=torch.float16)[..., :Dv]
    v = v.transpose(1, 2).requires_grad_()
    assert v.stride(-2) == Hkv * D
    run_dense(q, k, v, True, (30, 0), sinks=make_sinks(Hq, device))


@pytest.mark.parametrize("Dv", [16, 40])
def test_torch_backend_sinks_and_value_head_dim(device, monkeypatch, Dv):
    """FASTLM_BACKEND=torch: flash_attention_ref with sinks and v's own head dim."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    q, k, v = make_heads(2, 4, 2, 30, 41, 12, torch.float32, device, Dv=Dv)
    run_dense(q, k, v, True, (5, 0), scale=0.2, sinks=make_sinks(4, device))
    q, k, v = make_heads(2, 4, 2, 30, 41, 12, torch.float64, device, Dv=Dv)
    o_explicit, _ = flash_attention_ref(q, k, v, False, return_lse=True)
    assert_close(flash_attention_ref(q, k, v, False), o_explicit, torch.float64, "o (SDPA)")


# --------------------------------------------------------------------------------------------
# Strides, determinism, memory
# --------------------------------------------------------------------------------------------


def test_strided_inputs_need_no_copy(device):
    """q, k, v as slices of one fused (B, N, 3, H, D) projection viewed as (B, H, N, D), and head
    dims with stride 4, are read in place: no torch op copies their memory, forward or backward
    (the kernels get the strides). The results are bitwise those of contiguous copies."""
    B, N, H, D = 2, 77, 2, 32
    qkv = torch.randn(B, N, 3, H, D, device=device, dtype=torch.float16, requires_grad=True)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, N, D), token-major memory
    do = torch.randn(B, N, H, D, device=device, dtype=torch.float16).transpose(1, 2)
    with CopyRecorder(qkv) as recorder:
        o = flash_attention(q, k, v, causal=True)
        (dqkv,) = torch.autograd.grad(o, qkv, do)
    assert not recorder.copies, f"q, k, v were copied by {recorder.copies}"
    assert o.transpose(1, 2).is_contiguous(), "o should keep q's [B, N, H, D] memory layout"
    with torch.no_grad(), CopyRecorder(qkv) as recorder:  # inside the ops: the launchers
        o_launched, lse = attention_forward(q, k, v, True, D**-0.5, True)
        for deterministic in (True, False):
            attention_backward(do, q, k, v, o_launched, lse, True, D**-0.5, True, deterministic)
    assert not recorder.copies, f"the launchers copied q, k, v by {recorder.copies}"

    contiguous = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    o_contiguous = flash_attention(*contiguous, causal=True)
    grads = torch.autograd.grad(o_contiguous, contiguous, do)
    assert torch.equal(o, o_contiguous)
    for i, grad in enumerate(grads):
        assert torch.equal(dqkv[:, :, i].transpose(1, 2), grad)

    wide = torch.randn(1, 2, 130, 4 * D, device=device)
    q, k, v = wide[..., 0::4], wide[..., 1::4], wide[..., 2::4]
    assert q.stride(-1) == 4
    with CopyRecorder(wide) as recorder:
        o = flash_attention(q, k, v, causal=False, allow_tf32=False)
        attention_forward(q, k, v, False, D**-0.5, False)
    assert not recorder.copies, f"q, k, v with strided head dims were copied by {recorder.copies}"
    contiguous = (t.contiguous() for t in (q, k, v))
    assert torch.equal(o, flash_attention(*contiguous, causal=False, allow_tf32=False))


def test_backward_is_deterministic(device):
    """Two backwards give bitwise-equal gradients. Under Triton's interpreter this cannot fail
    (NumPy runs every launch, atomics included, in one order): it is a GPU check, and
    tools/gpu_check runs the whole suite on CUDA."""
    q, k, v = make_heads(1, 4, 2, 130, 130, 32, torch.float16, device)
    o = flash_attention(q, k, v, causal=True, deterministic=True)
    do = torch.randn_like(o)
    first = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    second = torch.autograd.grad(o, (q, k, v), do)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def _bytes_touched(device, N: int, causal: bool) -> tuple[int, int]:
    q, k, v = make_heads(1, 2, 1, N, N, 16, torch.float16, device)
    do = torch.randn(1, 2, N, 16, device=device, dtype=torch.float16)

    def forward_backward():
        return torch.autograd.grad(flash_attention(q, k, v, causal), (q, k, v), do)

    # Once outside the recorder: on CUDA the first call autotunes, and the autotuner's timing
    # allocates a 256 MiB buffer (to flush L2) that is not the kernels' memory.
    forward_backward()
    with AllocationRecorder() as recorder:
        forward_backward()
    return sum(recorder.storages.values()), max(recorder.storages.values())


@pytest.mark.parametrize("causal", [True, False])
def test_memory_is_linear_in_sequence_length(device, causal):
    """Every tensor the forward and backward allocate (outputs, log-sum-exp, Delta, the
    interpreter's copies) grows like N: doubling N doubles the bytes. One (N x N) fp32 score
    matrix for the two heads would add 2 * N^2 * 4 bytes, at N = 128 already 2.5x all the linear
    tensors together (the check then fails with a 3.4x growth)."""
    N = 128
    total, largest = _bytes_touched(device, N, causal)
    total_2n, largest_2n = _bytes_touched(device, 2 * N, causal)
    assert total_2n <= 2.05 * total, f"bytes grew {total_2n / total:.2f}x when N doubled"
    assert largest_2n <= 2 * largest
    assert largest_2n < 2 * (2 * N) ** 2  # smaller than one head's score matrix in fp16


@settings(max_examples=8, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 2, 3]),
    n_k=st.integers(1, 140),
    q_fraction=st.floats(0.0, 1.0),
    head_dim=st.sampled_from([8, 16, 24, 32, 48, 64, 80, 96, 112, 128]),
    causal=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_fuzz_shapes(batch, kv_heads, group, n_k, q_fraction, head_dim, causal, dtype, seed):
    torch.manual_seed(seed)  # drawn by Hypothesis, so a failing example replays and shrinks
    n_q = max(1, round(q_fraction * n_k))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # hypothesis refuses fixtures
    q, k, v = make_heads(batch, kv_heads * group, kv_heads, n_q, n_k, head_dim, dtype, device)
    run_dense(q, k, v, causal)


# --------------------------------------------------------------------------------------------
# Bad input; the PyTorch backend
# --------------------------------------------------------------------------------------------


def _heads(B=1, H=2, N=8, D=16, **kwargs):
    return torch.randn(B, H, N, D, **kwargs)


# Each case replaces some of q, k, v = (1, 2, 8, 16) fp32, causal=True, softmax_scale=None.
BAD_INPUTS = [
    (dict(q=torch.randn(2, 8, 16)), ValueError, "q must have 4 dims"),
    (dict(k=torch.randn(1, 2, 8, 16, 1)), ValueError, "k must have 4 dims"),
    (dict(k=_heads(N=9)), ValueError, "v has shape"),
    (dict(v=_heads(D=0)), ValueError, "v has head dim 0"),
    (dict(v=_heads(D=12)), ValueError, "v has head dim 12"),
    (dict(sinks=[0.0, 1.0]), TypeError, "sinks must be a torch.Tensor or None"),
    (dict(sinks=torch.zeros(2, dtype=torch.int64)), TypeError, "sinks must be a floating"),
    (dict(sinks=torch.zeros(3)), ValueError, "sinks must have shape \\(Hq,\\) = \\(2,\\)"),
    (dict(sinks=torch.zeros(1, 2)), ValueError, "sinks must have shape"),
    (dict(sinks=torch.zeros(2, device="meta")), ValueError, "sinks is on meta"),
    (dict(sinks=torch.tensor([0.0, math.nan])), ValueError, "each element of sinks, as float32"),
    (dict(sinks=torch.tensor([math.inf, 0.0])), ValueError, "each element of sinks, as float32"),
    (dict(k=_heads(D=32), v=_heads(D=32)), ValueError, "k has head dim 32"),
    (dict(k=_heads(dtype=torch.float16)), TypeError, "k has dtype"),
    (dict(v=_heads(device="meta")), ValueError, "v is on meta"),
    (dict(v=_heads(dtype=torch.float64)), TypeError, "v must be float32"),
    (dict(q=torch.randint(0, 3, (1, 2, 8, 16))), TypeError, "q must be float32"),
    (dict(q=[[1.0]]), TypeError, "q must be a torch.Tensor"),
    (dict(q=_heads(H=3)), ValueError, "not a multiple of k's 2 heads"),
    (dict(q=_heads(N=9)), ValueError, "q has sequence length 9 > k's 8"),
    (dict(q=_heads(N=0), k=_heads(N=0), v=_heads(N=0)), ValueError, "k has sequence length 0"),
    (dict(k=_heads(B=2), v=_heads(B=2)), ValueError, "k has batch size 2"),
    (dict(q=_heads(D=12), k=_heads(D=12), v=_heads(D=12)), ValueError, "head dim 12"),
    (dict(q=_heads(D=520), k=_heads(D=520), v=_heads(D=520)), ValueError, "head dim 520"),
    (dict(q=_heads(D=264), k=_heads(D=264), v=_heads(D=264)), ValueError, "256 in fp32"),
    (dict(causal="yes"), TypeError, "causal must be a bool"),
    (dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a real number"),
    (dict(window_size=(-2, -1)), ValueError, r"window_size\[0\] must be an int in \[-1, 2\*\*30\]"),
    (dict(window_size=(4, -3)), ValueError, r"window_size\[1\] must be an int in \[-1, 2\*\*30\]"),
    (dict(window_size=(4, 2)), ValueError, "window_size\\[1\\] is 2, but with causal=True"),
    (dict(window_size=4), TypeError, "window_size must be a pair of ints"),
    (dict(window_size=(1.5, 0)), TypeError, "window_size must be a pair of ints"),
    (dict(softcap=-1.0), ValueError, r"softcap must be a finite number in \[0, 1e6\]"),
    (dict(softcap=math.inf), ValueError, r"softcap must be a finite number in \[0, 1e6\]"),
    (dict(softcap="1"), TypeError, "softcap must be a real number"),
    (dict(softcap_approx="yes"), TypeError, "softcap_approx must be a bool"),
    (dict(return_lse=1), TypeError, "return_lse must be a bool"),
]


@pytest.mark.parametrize("overrides,error,message", BAD_INPUTS)
def test_bad_input_is_named(overrides, error, message):
    args = dict(q=_heads(), k=_heads(), v=_heads(), causal=True, softmax_scale=None) | overrides
    with pytest.raises(error, match=message):
        flash_attention(**args)


@pytest.mark.parametrize(
    "Nq,Nk,causal,window,softcap",
    [
        (77, 130, True, NO_WINDOW, 0.0),
        (77, 77, True, NO_WINDOW, 0.0),
        (33, 64, False, NO_WINDOW, 0.0),
        (30, 41, True, (5, 0), 0.0),
        (30, 41, False, (3, 7), 2.0),
        (30, 41, True, NO_WINDOW, 3.0),
    ],
)
def test_torch_backend_same_math(device, monkeypatch, Nq, Nk, causal, window, softcap):
    """FASTLM_BACKEND=torch: flash_attention_ref, through SDPA for plain attention and explicit
    scores for a window, a cap or the log-sum-exp."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    q, k, v = make_heads(2, 4, 2, Nq, Nk, 12, torch.float32, device)
    run_dense(q, k, v, causal, window, softcap, scale=0.2)


def test_torch_backend_sdpa_path_equals_explicit_scores(device):
    """flash_attention_ref's SDPA path (plain attention) equals its explicit one (taken for lse)."""
    q, k, v = (torch.randn(1, 2, 20, 8, device=device, dtype=torch.float64) for _ in range(3))
    o, lse = flash_attention_ref(q, k, v, True, return_lse=True)
    assert_close(o, flash_attention_ref(q, k, v, True), torch.float64, "o")
    ref_o, ref_lse = reference(q, k, v, visible(20, 20, True), 8**-0.5)
    assert_close(lse, ref_lse, torch.float64, "lse")


# --------------------------------------------------------------------------------------------
# CUDA only
# --------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_fp32_tf32_and_full_precision(device):
    """fp32 dots run as TF32 by default (10-bit mantissa like fp16, so fp16's bound);
    allow_tf32=False gives full fp32 accuracy."""
    q, k, v = make_heads(2, 4, 2, 257, 257, 64, torch.float32, device)
    ref, _ = reference(q.detach(), k.detach(), v.detach(), visible(257, 257, True), 64**-0.5)
    assert_close(flash_attention(q, k, v), ref, torch.float16, "o (tf32)")
    assert_close(flash_attention(q, k, v, allow_tf32=False), ref, torch.float32, "o (ieee)")


@pytest.mark.cuda
def test_more_batch_heads_than_cuda_grid_axes_1_and_2_hold(device):
    """B * H = 65600 batch-heads, more than CUDA's 65535 cap on grid axes 1 and 2: the kernels
    launch because their grids are 1-D. The batches past the cap are also checked on their own,
    so an error there cannot hide in the norm of the whole tensor."""
    B, H, N, D = 4100, 16, 16, 16
    q, k, v = make_heads(B, H, H, N, N, D, torch.float16, device)  # Hkv = H: dK/dV's grid too
    o = flash_attention(q, k, v, causal=True)
    do = torch.randn_like(o)
    grads = gradients(o, (q, k, v), do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_o, _ = reference(*leaves, visible(N, N, True), D**-0.5)
    ref_grads = gradients(ref_o, leaves, do.double())
    past_cap = slice(65535 // H, None)
    for name, out, ref in zip(("o", "dq", "dk", "dv"), (o, *grads), (ref_o, *ref_grads)):
        assert_close(out, ref, torch.float16, name)
        assert_close(
            out[past_cap], ref[past_cap], torch.float16, f"{name} of batch-heads past 65535"
        )


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_compile(device, dtype):
    q, k, v = make_heads(2, 8, 2, 1000, 1000, 128, dtype, device)

    def attend(q, k, v):
        return flash_attention(q, k, v, causal=True).float().square().sum()

    eager_grads = torch.autograd.grad(attend(q, k, v), (q, k, v))
    compiled_grads = torch.autograd.grad(torch.compile(attend, fullgraph=True)(q, k, v), (q, k, v))
    for eager, compiled in zip(eager_grads, compiled_grads):
        assert_close(compiled, eager, dtype)
