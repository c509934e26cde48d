"""The backward pass, recomputing P from the saved log-sum-exp: Delta = rowsum(O * dO), then dK
and dV per key block (grouped query heads summed in the program, no atomics), then dQ per query
block; or, with deterministic=False, one pass that also adds dQ with fp32 atomics (FA2's 5-matmul
schedule); then the launcher."""

from __future__ import annotations

import torch

from fastlm.backend import interpreting
from fastlm.kernels._common import capability, empty, tl, triton
from fastlm.kernels.attention.blocks import (
    block_start_and_batch_head,
    capped_scores,
    is_visible,
    key_range,
    load_rows,
    load_tile,
    query_range,
    rows_descriptor,
    sequence_rows,
    slope_unit,
    stats_offset,
    store_tile,
)
from fastlm.kernels.attention.configs import (
    DKDV_CONFIGS,
    DKDV_CUDA_CONFIGS,
    DKDV_DQ_CONFIGS,
    DKDV_DQ_CUDA_CONFIGS,
    DKDV_TUNING_KEY,
    DQ_CONFIGS,
    DQ_CUDA_CONFIGS,
    DQ_TMA_CONFIGS,
    DQ_TMA_CUDA_CONFIGS,
    SPLIT_KV_MIN_BLOCK_D,
    TUNING_KEY,
    atomic_max_block_d,
    prune_to_fitting,
)
from fastlm.kernels.attention.launch import (
    LOG2_E,
    Varlen,
    block_grid,
    empty_heads_like,
    kernel_flags,
    kernel_strides,
    option_args,
    sequence_args,
    tuning_bucket,
    use_tensor_descriptors,
)


@triton.jit
def _attention_bwd_delta_kernel(
    O, DO, DELTA,  #
    stride_ob, stride_oh, stride_om, stride_od,  #
    stride_dob, stride_doh, stride_dom, stride_dod,  #
    num_heads, n_q,  #
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr
):
    """Delta = rowsum(O * dO) in fp32, one value per query row."""
    start_m, batch_head = block_start_and_batch_head(n_q, BLOCK_M, False)
    batch = (batch_head // num_heads).to(tl.int64)
    head = (batch_head % num_heads).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_m.to(tl.int64)[:, None]
    o = load_tile(
        O + batch * stride_ob + head * stride_oh + rows * stride_om + offs_d[None, :] * stride_od,
        offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True, True
    )
    do = load_tile(
        DO + batch * stride_dob + head * stride_doh + rows * stride_dom +
        offs_d[None, :] * stride_dod, offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True, True
    )
    tl.store(DELTA + batch_head.to(tl.int64) * n_q + offs_m, tl.sum(o * do, 1), mask=offs_m < n_q)


@triton.jit
def _dkdv_query_blocks(
    dk, dv, k, v,  #
    Q_head, DO_head, LSE_head, DELTA_head, DQ_head,  #
    stride_qm, stride_qd, stride_dom, stride_dod,  #
    stride_dqm, stride_dqd,  #
    offs_n, offs_d, offs_dv, lo, hi, n_q, n_k, causal_shift, softmax_scale, qk_scale,  #
    window_left, window_right, softcap,  #
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,  #
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, CHECK_ROWS: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,  #
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, TO_FP32: tl.constexpr,  #
    DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, WITH_DK: tl.constexpr,  #
    WITH_DV: tl.constexpr
):
    """Add to (dk, dv) of one key block the query blocks starting in [lo, hi) of one query head;
    with ATOMIC_DQ also add this key block's share of dq, s * dS k, to the fp32 DQ_head. MASKED:
    some of these queries must not see some of the keys (CAUSAL, HAS_WINDOW, or keys past n_k in
    a partial key block: `query_range`). WITH_DK, WITH_DV: which of the two it adds to (the other
    is returned as it came; `split_kv_grads`)."""
    offs_m = lo + tl.arange(0, BLOCK_M)
    dq_ptrs = DQ_head + offs_m.to(tl.int64)[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
    q_ptrs = Q_head + offs_m.to(tl.int64)[:, None] * stride_qm + offs_d[None, :] * stride_qd
    do_ptrs = DO_head + offs_m.to(tl.int64)[:, None] * stride_dom + offs_dv[None, :] * stride_dod
    for _ in range(lo, hi, BLOCK_M):
        q = load_tile(q_ptrs, offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, CHECK_ROWS, TO_FP32)
        do = load_tile(do_ptrs, offs_m, n_q, offs_dv, HEAD_DIM_V, BLOCK_DV, CHECK_ROWS, TO_FP32)
        if CHECK_ROWS:  # rows past n_q: q = dO = 0 and LSE = inf give P = dS = 0
            lse = tl.load(LSE_head + offs_m, mask=offs_m < n_q, other=float("inf"))
            delta = tl.load(DELTA_head + offs_m, mask=offs_m < n_q, other=0.0)
        else:
            lse = tl.load(LSE_head + offs_m)
            delta = tl.load(DELTA_head + offs_m)
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        if SOFTCAP:
            scores, cap_scale, dcap = capped_scores(qk_t, qk_scale, softcap, SOFTCAP, False)
            exponent = scores * cap_scale - lse[None, :]
        else:
            exponent = qk_t * qk_scale - lse[None, :]
        if MASKED:  # mask the exponent: 2^(t - LSE) of a key a query must not see may overflow
            visible = is_visible(
                offs_m[None, :], offs_n[:, None], n_k, causal_shift, window_left, window_right,
                HAS_WINDOW or not CAUSAL, CAUSAL, HAS_WINDOW
            )
            exponent = tl.where(visible, exponent, float("-inf"))
        p_t = tl.math.exp2(exponent)
        if WITH_DV:
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        if WITH_DK:
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            if SOFTCAP:  # through the cap: d(cap tanh(s / cap)) / ds = 1 - tanh^2, in its unit
                ds_t = ds_t * dcap  # (`capped_scores`; the store's scale takes the unit)
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
        if ATOMIC_DQ:  # the fifth matmul: other key blocks add to the same rows, in any order
            dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=DOT_PRECISION)
            tl.atomic_add(
                dq_ptrs, dq * (softmax_scale * slope_unit(SOFTCAP)), sem="relaxed",
                mask=(offs_m[:, None] < n_q) & (offs_d[None, :] < HEAD_DIM)
            )
            dq_ptrs += BLOCK_M * stride_dqm
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
        offs_m += BLOCK_M
    return dk, dv


@triton.autotune(
    configs=DKDV_CONFIGS, key=DKDV_TUNING_KEY, prune_configs_by=prune_to_fitting(DKDV_CUDA_CONFIGS)
)
@triton.jit
def _attention_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, DQ, LSE, DELTA, CU_SEQLENS_Q, CU_SEQLENS_K,  #
    stride_qb, stride_qh, stride_qm, stride_qd,  #
    stride_kb, stride_kh, stride_kn, stride_kd,  #
    stride_vb, stride_vh, stride_vn, stride_vd,  #
    stride_dob, stride_doh, stride_dom, stride_dod,  #
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,  #
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,  #
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,  #
    num_kv_heads, group, n_q, n_k, softmax_scale, qk_scale, total_q, window_left,  #
    window_right, softcap, q_bucket, k_bucket,  #
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,  #
    BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,  #
    SOFTCAP: tl.constexpr, VARLEN: tl.constexpr, TO_FP32: tl.constexpr,  #
    DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, WITH_DK: tl.constexpr,  #
    WITH_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """dK and dV of one key block; with ATOMIC_DQ also dQ, added with fp32 atomics into a zeroed
    DQ (FA2's 5-matmul schedule: one pass, no dQ kernel, sums in no fixed order). Without it
    DQ is unused. VARLEN as in the forward. WITH_DK, WITH_DV: which of dK and dV it computes and
    stores (both, or one for `split_kv_grads`)."""
    # In order: the first key blocks, seen by the most causal queries, are already the longest.
    start_n, batch_kv_head = block_start_and_batch_head(n_k, BLOCK_N, False)
    batch = (batch_kv_head // num_kv_heads).to(tl.int64)
    kv_head = (batch_kv_head % num_kv_heads).to(tl.int64)
    q_start, n_q = sequence_rows(CU_SEQLENS_Q, batch, n_q, VARLEN)
    k_start, n_k = sequence_rows(CU_SEQLENS_K, batch, n_k, VARLEN)
    if VARLEN and start_n >= n_k:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = offs_n.to(tl.int64)[:, None]
    k = load_tile(
        K + batch * stride_kb + kv_head * stride_kh + k_start * stride_kn + rows * stride_kn +
        offs_d[None, :] * stride_kd, offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, True, TO_FP32
    )  # (BLOCK_N, BLOCK_D)
    v = k  # dV alone needs no v
    if WITH_DK:
        v = load_tile(
            V + batch * stride_vb + kv_head * stride_vh + k_start * stride_vn + rows * stride_vn +
            offs_dv[None, :] * stride_vd, offs_n, n_k, offs_dv, HEAD_DIM_V, BLOCK_DV, True, TO_FP32
        )  # (BLOCK_N, BLOCK_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    causal_shift = n_k - n_q
    lo, full_lo, full_hi, hi = query_range(
        start_n, n_q, n_k, causal_shift, window_left, window_right, CAUSAL, HAS_WINDOW, BLOCK_M,
        BLOCK_N
    )
    # Three phases (`query_range`): queries that see part of the block, whole blocks of queries
    # that see all of it, then rows past n_q and queries that see part of it.
    starts = (lo, full_lo, full_hi)
    ends = (tl.minimum(full_lo, hi), full_hi, hi)
    masked = (CAUSAL or HAS_WINDOW, False, HAS_WINDOW or not CAUSAL)
    # Grouped heads: sum over the group's query heads here, in a fixed order, instead of atomics.
    for g in range(group):
        head = kv_head * group + g
        Q_head = Q + batch * stride_qb + head * stride_qh + q_start * stride_qm
        DO_head = DO + batch * stride_dob + head * stride_doh + q_start * stride_dom
        stats = stats_offset(
            batch * num_kv_heads * group + head, head, n_q, q_start, total_q, VARLEN
        )
        LSE_head = LSE + stats
        DELTA_head = DELTA + stats
        DQ_head = DQ + batch * stride_dqb + head * stride_dqh + q_start * stride_dqm
        for phase in tl.static_range(3):
            dk, dv = _dkdv_query_blocks(
                dk, dv, k, v, Q_head, DO_head, LSE_head, DELTA_head, DQ_head, stride_qm, stride_qd,
                stride_dom, stride_dod, stride_dqm, stride_dqd, offs_n, offs_d, offs_dv,
                starts[phase], ends[phase], n_q, n_k, causal_shift, softmax_scale, qk_scale,
                window_left, window_right, softcap, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV,
                BLOCK_M, phase != 1, masked[phase], CAUSAL, HAS_WINDOW, SOFTCAP, TO_FP32,
                DOT_PRECISION, ATOMIC_DQ, WITH_DK, WITH_DV
            )

    dk_ptrs = (
        DK + batch * stride_dkb + kv_head * stride_dkh + k_start * stride_dkn + rows * stride_dkn +
        offs_d[None, :] * stride_dkd
    )
    dv_ptrs = (
        DV + batch * stride_dvb + kv_head * stride_dvh + k_start * stride_dvn + rows * stride_dvn +
        offs_dv[None, :] * stride_dvd
    )
    if WITH_DK:  # dS carried the cap's slope in its unit (`capped_scores`)
        store_tile(
            dk_ptrs, dk * (softmax_scale * slope_unit(SOFTCAP)), offs_n, n_k, offs_d, HEAD_DIM
        )
    if WITH_DV:
        store_tile(dv_ptrs, dv, offs_n, n_k, offs_dv, HEAD_DIM_V)


_attention_bwd_dkdv_dq_kernel = triton.autotune(
    configs=DKDV_DQ_CONFIGS, key=TUNING_KEY, reset_to_zero=["DQ"],
    prune_configs_by=prune_to_fitting(DKDV_DQ_CUDA_CONFIGS)
)(_attention_bwd_dkdv_kernel.fn)


@triton.jit
def _dq_key_blocks(
    dq, q, do, lse, delta,  #
    K_head, V_head,  #
    stride_kn, stride_kd, stride_vn, stride_vd,  #
    offs_m, offs_d, offs_dv, lo, hi, n_k, causal_shift, qk_scale, window_left, window_right,  #
    softcap,  #
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,  #
    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,  #
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, TO_FP32: tl.constexpr,  #
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr
):
    """Add to dq of one query block the key blocks starting in [lo, hi) (MASKED as in the
    forward). With TMA, K_head and V_head are tensor descriptors of the head's key rows
    (`rows_descriptor`), otherwise pointers to its first row."""
    offs_n = lo + tl.arange(0, BLOCK_N)
    if not TMA:
        k_ptrs = K_head + offs_n.to(tl.int64)[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = V_head + offs_n.to(tl.int64)[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    for start_n in range(lo, hi, BLOCK_N):
        if TMA:
            k = load_rows(K_head, start_n, TO_FP32)
            v = load_rows(V_head, start_n, TO_FP32)
        else:
            k = load_tile(k_ptrs, offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, MASKED, TO_FP32)
            v = load_tile(v_ptrs, offs_n, n_k, offs_dv, HEAD_DIM_V, BLOCK_DV, MASKED, TO_FP32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        if SOFTCAP:
            scores, cap_scale, dcap = capped_scores(qk, qk_scale, softcap, SOFTCAP, False)
            exponent = scores * cap_scale - lse[:, None]
        else:
            exponent = qk * qk_scale - lse[:, None]
        if MASKED:  # mask the exponent: 2^(t - LSE) of a hidden or padded key may overflow
            visible = is_visible(
                offs_m[:, None], offs_n[None, :], n_k, causal_shift, window_left, window_right,
                True, CAUSAL, HAS_WINDOW
            )
            exponent = tl.where(visible, exponent, float("-inf"))
        p = tl.math.exp2(exponent)
        if SOFTCAP:  # P times the cap's slope at once: one tile, not three, lives across the dot
            p = p * dcap  # in the slope's unit (`capped_scores`), which the store's scale takes
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        if not TMA:
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn
        offs_n += BLOCK_N
    return dq


@triton.autotune(
    configs=DQ_CONFIGS, key=TUNING_KEY, prune_configs_by=prune_to_fitting(DQ_CUDA_CONFIGS)
)
@triton.jit
def _attention_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, CU_SEQLENS_Q, CU_SEQLENS_K,  #
    stride_qb, stride_qh, stride_qm, stride_qd,  #
    stride_kb, stride_kh, stride_kn, stride_kd,  #
    stride_vb, stride_vh, stride_vn, stride_vd,  #
    stride_dob, stride_doh, stride_dom, stride_dod,  #
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,  #
    num_heads, group, n_q, n_k, softmax_scale, qk_scale, total_q, window_left, window_right,  #
    softcap, q_bucket, k_bucket,  #
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,  #
    BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,  #
    SOFTCAP: tl.constexpr, VARLEN: tl.constexpr, TO_FP32: tl.constexpr,  #
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,  #
    BLOCK_N: tl.constexpr
):
    """dQ of one query block. TMA: the key blocks the loop streams, k and v, come through tensor
    descriptors (K and V need a unit last stride and 16-byte aligned rows); the query block's q,
    dO and dq move through pointers either way (once per program)."""
    start_m, batch_head = block_start_and_batch_head(n_q, BLOCK_M, CAUSAL)
    batch = (batch_head // num_heads).to(tl.int64)
    head = (batch_head % num_heads).to(tl.int64)
    kv_head = head // group
    q_start, n_q = sequence_rows(CU_SEQLENS_Q, batch, n_q, VARLEN)
    k_start, n_k = sequence_rows(CU_SEQLENS_K, batch, n_k, VARLEN)
    if VARLEN and start_m >= n_q:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = offs_m.to(tl.int64)[:, None]
    q = load_tile(
        Q + batch * stride_qb + head * stride_qh + q_start * stride_qm + rows * stride_qm +
        offs_d[None, :] * stride_qd, offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True, TO_FP32
    )  # (BLOCK_M, BLOCK_D)
    do = load_tile(
        DO + batch * stride_dob + head * stride_doh + q_start * stride_dom + rows * stride_dom +
        offs_dv[None, :] * stride_dod, offs_m, n_q, offs_dv, HEAD_DIM_V, BLOCK_DV, True, TO_FP32
    )  # (BLOCK_M, BLOCK_DV)
    row_stats = stats_offset(batch_head, head, n_q, q_start, total_q, VARLEN) + offs_m
    lse = tl.load(LSE + row_stats, mask=offs_m < n_q, other=float("inf"))
    delta = tl.load(DELTA + row_stats, mask=offs_m < n_q, other=0.0)
    K_head = K + batch * stride_kb + kv_head * stride_kh + k_start * stride_kn
    V_head = V + batch * stride_vb + kv_head * stride_vh + k_start * stride_vn
    if TMA:
        K_head = rows_descriptor(K_head, n_k, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D)
        V_head = rows_descriptor(V_head, n_k, stride_vn, HEAD_DIM_V, BLOCK_N, BLOCK_DV)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    causal_shift = n_k - n_q
    lo, full_lo, full_hi, hi = key_range(
        start_m, n_k, causal_shift, window_left, window_right, CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N
    )
    # The forward's three phases.
    bounds = (lo, full_lo, full_hi, hi)
    for phase in tl.static_range(0 if HAS_WINDOW else 1, 3):
        dq = _dq_key_blocks(
            dq, q, do, lse, delta, K_head, V_head, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_d, offs_dv, bounds[phase], bounds[phase + 1], n_k, causal_shift, qk_scale,
            window_left, window_right, softcap, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N,
            phase != 1, CAUSAL, HAS_WINDOW, SOFTCAP, TO_FP32, DOT_PRECISION, TMA
        )
    dq_ptrs = (
        DQ + batch * stride_dqb + head * stride_dqh + q_start * stride_dqm + rows * stride_dqm +
        offs_d[None, :] * stride_dqd
    )
    # dS carried the cap's slope in its unit (`capped_scores`)
    store_tile(dq_ptrs, dq * (softmax_scale * slope_unit(SOFTCAP)), offs_m, n_q, offs_d, HEAD_DIM)


_attention_bwd_dq_tma_autotuned = triton.autotune(
    configs=DQ_TMA_CONFIGS, key=TUNING_KEY, prune_configs_by=prune_to_fitting(DQ_TMA_CUDA_CONFIGS)
)(_attention_bwd_dq_kernel.fn)


def sink_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The sinks' gradient in their dtype: dsink_h = -sum over head h's rows of P_sink * Delta,
    P_sink = 2^(sink - LSE) (base 2; lse and delta (B, H, N) fp32). A row that saw neither a key
    nor a sink (LSE = +inf) adds 0, and so does every row of a -inf sink. A fixed-order torch
    reduction: deterministic, and as cheap as reading LSE and Delta once."""
    p_sink = torch.exp2(sinks.float()[:, None] * LOG2_E - lse)  # (B, H, N)
    return (-(p_sink * delta).sum((0, 2))).to(sinks.dtype)


def split_kv_grads(block_d: int, block_dv: int) -> list[dict]:
    """The dK/dV pass's launches: one that computes both, or above SPLIT_KV_MIN_BLOCK_D one for
    dV and one for dK, so that each holds one fp32 accumulator of the key block.

    Both recompute P (q k^T); the dK launch also computes dP = dO v^T, the dV launch does not
    load v. The pass's matmuls go from q k^T, P^T dO, dO v^T, dS^T q (2 D + 2 Dv per score) to
    3 D + 2 Dv: 5/4 of them at D = Dv, and the whole backward's (with the dQ pass's 2 D + Dv) from
    4 D + 3 Dv to 5 D + 3 Dv, 8/7."""
    if max(block_d, block_dv) < SPLIT_KV_MIN_BLOCK_D:
        return [dict(WITH_DK=True, WITH_DV=True)]
    return [dict(WITH_DK=False, WITH_DV=True), dict(WITH_DK=True, WITH_DV=False)]


def attention_backward(
    do, q, k, v, o, lse, causal: bool, softmax_scale: float, allow_tf32: bool, deterministic: bool,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    window: tuple[int, int] = (-1, -1), softcap: float = 0.0, varlen: Varlen | None = None,
    sinks: torch.Tensor | None = None, softcap_approx: bool = False
):
    """dq, dk, dv from the saved forward inputs, output and log-sum-exp; written into `out`
    (any strides: views of one packed gradient, say) when given. softcap_approx: the forward's
    (the slope comes from the same approximate tanh).

    deterministic: a dK/dV pass and a dQ pass, no atomics (bitwise reproducible); otherwise one
    pass that adds dQ with fp32 atomics into a zeroed fp32 buffer, then casts it into dq. Head
    blocks above ATOMIC_MAX_BLOCK_D take the deterministic schedule either way: the one pass holds
    one more tile, and no config of it compiles there without spilling (on Blackwell, fp32
    above head block 64 too: `atomic_max_block_d`).

    sinks (Hq,): the forward's attention sinks. The kernels need nothing of them (lse holds them,
    and P of the keys is 2^(t - LSE) as without); their gradient `sink_grad` is returned fourth,
    (dq, dk, dv, dsinks); without sinks (dq, dk, dv)."""
    B, Hq, Nq, _ = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    lse = lse.contiguous()  # the kernels index the row statistics densely; the forward's are
    cu_q, cu_k, sequences, n_q, n_k = sequence_args(q, k, varlen)
    flags = kernel_flags(q, v, causal, allow_tf32)
    delta = empty((B, Hq, Nq), device=q.device, dtype=torch.float32)
    delta_block = 32 if interpreting() else 64
    # Row by row: packed sequences need no bounds here (Delta's rows are o's and dO's).
    _attention_bwd_delta_kernel[block_grid(Nq, "BLOCK_M", B * Hq)](
        o, do, delta, *o.stride(), *do.stride(), Hq, Nq, HEAD_DIM=v.shape[-1],
        BLOCK_D=flags["BLOCK_DV"], BLOCK_M=delta_block,
        num_warps=8,  # at 4, fp32 O and dO tiles of head dim 64 spill on sm_90a (compile_report.py)
    )

    # The sinks' gradient needs only the row statistics.
    dsinks = () if sinks is None else (sink_grad(sinks, lse, delta), )
    dq, dk, dv = out or (empty_heads_like(q), empty_heads_like(k), empty_heads_like(v))
    mask_args, mask_flags = option_args(causal, window, softcap, n_q, n_k, softcap_approx)
    args = (n_q, n_k, softmax_scale, softmax_scale * LOG2_E, Nq, *mask_args)
    args = (*args, tuning_bucket(n_q), tuning_bucket(n_k))
    flags = dict(flags, **mask_flags, VARLEN=varlen is not None)
    atomic_limit = atomic_max_block_d(q.element_size(), capability(q))
    if not deterministic and max(flags["BLOCK_D"], flags["BLOCK_DV"]) <= atomic_limit:
        dq_acc = empty_heads_like(q, torch.float32).zero_()
        _attention_bwd_dkdv_dq_kernel[block_grid(n_k, "BLOCK_N", sequences * Hkv)](
            q, k, v, do, dk, dv, dq_acc, lse, delta, cu_q, cu_k,
            *(s for t in (q, k, v, do, dk, dv, dq_acc) for s in kernel_strides(t, varlen)), Hkv,
            group, *args, ATOMIC_DQ=True, WITH_DK=True, WITH_DV=True, **flags
        )
        return dq.copy_(dq_acc), dk, dv, *dsinks
    for grads in split_kv_grads(flags["BLOCK_D"], flags["BLOCK_DV"]):
        _attention_bwd_dkdv_kernel[block_grid(n_k, "BLOCK_N", sequences * Hkv)](
            q, k, v, do, dk, dv, dk,  # stands in for the unused DQ
            lse, delta, cu_q, cu_k,
            *(s for t in (q, k, v, do, dk, dv, dk) for s in kernel_strides(t, varlen)), Hkv, group,
            *args, ATOMIC_DQ=False, **grads, **flags
        )
    # The dQ pass streams k and v: through tensor descriptors where the forward would use them.
    tma = use_tensor_descriptors(k, v)
    dq_kernel = _attention_bwd_dq_tma_autotuned if tma else _attention_bwd_dq_kernel
    dq_kernel[block_grid(n_q, "BLOCK_M", sequences * Hq)](
        q, k, v, do, dq, lse, delta, cu_q, cu_k,
        *(s for t in (q, k, v, do, dq) for s in kernel_strides(t, varlen)), Hq, group, *args,
        TMA=tma, **flags
    )
    return dq, dk, dv, *dsinks
