"""The forward pass: one program per (query block, batch * head) runs the online softmax over the
key blocks its rows see (`key_range`'s three phases). Two kernels of one algorithm: q, k, v, o
moved by masked pointer loads (every GPU, the interpreter), or by tensor descriptors (TMA on
sm_90+), chosen per call by `launch.use_tensor_descriptors`; then the launcher."""

from __future__ import annotations

import torch

from fastlm.kernels._common import empty, tl, triton
from fastlm.kernels.attention.blocks import (
    block_start_and_batch_head,
    capped_scores,
    exp2_split,
    is_visible,
    key_range,
    load_tile,
    rows_descriptor,
    sequence_rows,
    stats_offset,
    store_tile,
)
from fastlm.kernels.attention.configs import (
    FWD_CONFIGS,
    FWD_CUDA_CONFIGS,
    FWD_TMA_CONFIGS,
    FWD_TMA_CUDA_CONFIGS,
    TUNING_KEY,
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
    sink_args,
    tuning_bucket,
    use_tensor_descriptors,
)


@triton.jit
def _softmax_block(
    qk, m_i, l_i, offs_m, offs_n, n_k, causal_shift, qk_scale, window_left, window_right,  #
    softcap,  #
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,  #
    SOFTCAP: tl.constexpr, SCALE_POSITIVE: tl.constexpr, EXP2_FMA_SHIFT: tl.constexpr
):
    """(p, alpha, m_i, l_i) of one key block's raw scores qk = q k^T (rows offs_m, keys offs_n):
    p = 2^(t - m_new) with m_new the running max in scaled (base-2) units, alpha = 2^(m_i - m_new)
    the factor that rescales what was summed before, l_i the updated row sum.

    With a positive scale the row max is taken on the unscaled scores (the max commutes with the
    scaling) and each score is scaled and shifted by one FMA, qk * qk_scale - m. A zero or
    negative scale (allowed, never hot) and SOFTCAP scale first. MASKED blocks may hold keys >= n_k
    or (CAUSAL, HAS_WINDOW) keys some rows must not see. EXP2_FMA_SHIFT: the last 1 / 2^shift of
    p's columns computed on the FMA units (`exp2_split`).
    """
    if SOFTCAP:
        qk, fma_scale, _ = capped_scores(qk, qk_scale, softcap, SOFTCAP)
    elif SCALE_POSITIVE:
        fma_scale = qk_scale
    else:
        qk = qk * qk_scale
        fma_scale = 1.0
    if MASKED:
        visible = is_visible(
            offs_m[:, None], offs_n[None, :], n_k, causal_shift, window_left, window_right, True,
            CAUSAL, HAS_WINDOW
        )
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * fma_scale)
    # A row that has seen no key yet keeps m = -inf; subtract 0 so that 2^(-inf - -inf) is not NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = exp2_split(qk * fma_scale - m_ref[:, None], EXP2_FMA_SHIFT)
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _online_softmax_step(
    acc, m_i, l_i, q, k, v, offs_m, offs_n, n_k, causal_shift, qk_scale, window_left,  #
    window_right, softcap,  #
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,  #
    SOFTCAP: tl.constexpr, SCALE_POSITIVE: tl.constexpr, DOT_PRECISION: tl.constexpr
):
    """(acc, m_i, l_i) after one key block k, v (rows offs_n); m_i is in scaled (base-2) units
    (`_softmax_block`)."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
    p, alpha, m_i, l_i = _softmax_block(
        qk, m_i, l_i, offs_m, offs_n, n_k, causal_shift, qk_scale, window_left, window_right,
        softcap, MASKED, CAUSAL, HAS_WINDOW, SOFTCAP, SCALE_POSITIVE, 0
    )
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _fwd_key_blocks(
    acc, m_i, l_i, q,  #
    K_head, V_head,  #
    stride_kn, stride_kd, stride_vn, stride_vd,  #
    offs_m, offs_d, offs_dv, lo, hi, n_k, causal_shift, qk_scale, window_left, window_right,  #
    softcap,  #
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,  #
    BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,  #
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, TO_FP32: tl.constexpr,  #
    SCALE_POSITIVE: tl.constexpr, DOT_PRECISION: tl.constexpr
):
    """Online-softmax update of (acc, m_i, l_i) with the key blocks starting in [lo, hi),
    loaded through pointers.

    Not software pipelined as `_fwd_key_blocks_tma` is: carrying a block's p into the next
    iteration costs registers this path does not have where it runs. Pipelined (the compile
    report's rows), bf16 head dim 128 spilled 832 B on sm_80 (M64 N64, 4 warps), head dim 256
    512 B (sm_80) and 1,096 B (sm_90a), fp32 head dim 128 3,100 B (sm_80); on sm_90a it kept
    the softmax beside the P V (bf16 head dim 128, M128 N64, 8 warps: the clock model's MMA
    share 67 % -> 83 %, no spill), but on Hopper this path serves only what the descriptor
    forward does not take: fp32, head dims above 128 and strides TMA cannot read."""
    offs_n = lo + tl.arange(0, BLOCK_N)
    k_ptrs = K_head + offs_n.to(tl.int64)[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V_head + offs_n.to(tl.int64)[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    for _ in range(lo, hi, BLOCK_N):
        k = load_tile(k_ptrs, offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, MASKED, TO_FP32)
        v = load_tile(v_ptrs, offs_n, n_k, offs_dv, HEAD_DIM_V, BLOCK_DV, MASKED, TO_FP32)
        acc, m_i, l_i = _online_softmax_step(
            acc, m_i, l_i, q, k, v, offs_m, offs_n, n_k, causal_shift, qk_scale, window_left,
            window_right, softcap, MASKED, CAUSAL, HAS_WINDOW, SOFTCAP, SCALE_POSITIVE,
            DOT_PRECISION
        )
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
        offs_n += BLOCK_N
    return acc, m_i, l_i


@triton.autotune(
    configs=FWD_CONFIGS, key=TUNING_KEY, prune_configs_by=prune_to_fitting(FWD_CUDA_CONFIGS)
)
@triton.jit
def _attention_fwd_kernel(
    Q, K, V, O, LSE, SINKS, CU_SEQLENS_Q, CU_SEQLENS_K,  #
    stride_qb, stride_qh, stride_qm, stride_qd,  #
    stride_kb, stride_kh, stride_kn, stride_kd,  #
    stride_vb, stride_vh, stride_vn, stride_vd,  #
    stride_ob, stride_oh, stride_om, stride_od,  #
    num_heads, group, n_q, n_k, qk_scale, total_q, window_left, window_right, softcap,  #
    q_bucket, k_bucket,  #
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,  #
    BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,  #
    SOFTCAP: tl.constexpr, VARLEN: tl.constexpr, HAS_SINKS: tl.constexpr,  #
    TO_FP32: tl.constexpr, SCALE_POSITIVE: tl.constexpr, DOT_PRECISION: tl.constexpr,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """With VARLEN the batch index walks the sequences of cu_seqlens (the launcher passes batch
    strides of 0), n_q and n_k are the longest sequences' lengths, and a block past its
    sequence's end returns at once."""
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

    q_ptrs = (
        Q + batch * stride_qb + head * stride_qh + q_start * stride_qm +
        offs_m.to(tl.int64)[:, None] * stride_qm + offs_d[None, :] * stride_qd
    )
    q = load_tile(
        q_ptrs, offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True, TO_FP32
    )  # (BLOCK_M, BLOCK_D)
    K_head = K + batch * stride_kb + kv_head * stride_kh + k_start * stride_kn
    V_head = V + batch * stride_vb + kv_head * stride_vh + k_start * stride_vn

    acc, m_i, l_i, causal_shift, lo, full_lo, full_hi, hi = _fwd_start(
        SINKS, head, start_m, n_q, n_k, window_left, window_right, CAUSAL, HAS_WINDOW, HAS_SINKS,
        BLOCK_M, BLOCK_N, BLOCK_DV
    )
    # The key range in three phases (`key_range`): the window's far edge (masked; without a
    # window lo = full_lo = 0), the blocks every row sees whole, then the diagonal and the end.
    bounds = (lo, full_lo, full_hi, hi)
    for phase in tl.static_range(0 if HAS_WINDOW else 1, 3):
        acc, m_i, l_i = _fwd_key_blocks(
            acc, m_i, l_i, q, K_head, V_head, stride_kn, stride_kd, stride_vn, stride_vd, offs_m,
            offs_d, offs_dv, bounds[phase], bounds[phase + 1], n_k, causal_shift, qk_scale,
            window_left, window_right, softcap, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N,
            phase != 1, CAUSAL, HAS_WINDOW, SOFTCAP, TO_FP32, SCALE_POSITIVE, DOT_PRECISION
        )

    o, lse = _fwd_finish(acc, m_i, l_i)
    o_ptrs = (
        O + batch * stride_ob + head * stride_oh + q_start * stride_om +
        offs_m.to(tl.int64)[:, None] * stride_om + offs_dv[None, :] * stride_od
    )
    store_tile(o_ptrs, o, offs_m, n_q, offs_dv, HEAD_DIM_V)
    stats = stats_offset(batch_head, head, n_q, q_start, total_q, VARLEN)
    tl.store(LSE + stats + offs_m, lse, mask=offs_m < n_q)


@triton.jit
def _fwd_start(
    SINKS, head, start_m, n_q, n_k, window_left, window_right,  #
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr
):
    """The online softmax's initial state (acc, m_i, l_i), the causal shift Nk - Nq, and the query
    block's key range (lo, full_lo, full_hi, hi) (`key_range`).

    Without a sink the state is empty (m = -inf, l = 0). A sink (HAS_SINKS: the head's logit
    sink, base 2) is a key with no value that every row sees: the state starts as having seen it,
    m = sink, l = 2^(sink - m) = 1, acc = 0, and the loop's rescaling carries it into l. A sink of
    -inf starts empty, as without one (so it gives the same result, bit for bit)."""
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:
        sink = tl.load(SINKS + head)
        m_i = tl.maximum(m_i, sink)
        l_i = tl.where(m_i > float("-inf"), 1.0, l_i)
    causal_shift = n_k - n_q
    lo, full_lo, full_hi, hi = key_range(
        start_m, n_k, causal_shift, window_left, window_right, CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N
    )
    return acc, m_i, l_i, causal_shift, lo, full_lo, full_hi, hi


@triton.jit
def _fwd_finish(acc, m_i, l_i):
    """O and the base-2 LSE of each row. A row that saw no key (l = 0) gets O = 0 and LSE = +inf,
    so the backward's P = 2^(t - LSE) is 0; with a sink it has l = 1: O = 0 and LSE = sink."""
    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("inf"))
    return o, lse


@triton.jit
def _fwd_key_blocks_tma(
    acc, m_i, l_i, q, k_desc, v_desc, offs_m, lo, hi, n_k, causal_shift, qk_scale,  #
    window_left, window_right, softcap,  #
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,  #
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, TO_FP32: tl.constexpr,  #
    SCALE_POSITIVE: tl.constexpr, DOT_PRECISION: tl.constexpr, EXP2_FMA_SHIFT: tl.constexpr
):
    """_fwd_key_blocks with k and v read through tensor descriptors (TMA on sm_90+; rows past the
    head's n_k and the head-dim padding come back as zeros, with no masks to compute), software
    pipelined so that each block's softmax runs beside the tensor cores: an iteration issues the
    QK^T of block j + 1, then the P V of block j, then computes block j + 1's softmax while that
    P V runs.

    What the compiler needs for that (Triton 3.9 on Hopper): its pipeliner leaves a warpgroup dot
    in flight only if no op of the loop but another dot's accumulator reads its result before a
    `wait 0` of the same iteration. The scores are read at once, so their dot is waited for where
    it is issued (which retires the previous P V too: waits go in issue order); the P V after
    it is read by nothing but the next iteration's dots, so it stays in flight across the
    softmax; hence the accumulator is rescaled before the P V, not after. Its A operand must be
    in registers: Triton puts an operand that comes from a load or a loop-carried value (through
    layout conversions) in shared memory, stored and waited for each iteration, so p is carried
    as its bits and bitcast back in the loop. EXP2_FMA_SHIFT moves part of the exponentials off
    the MUFU (`exp2_split`)."""
    if lo < hi:
        k = k_desc.load([lo, 0])
        if TO_FP32:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p, alpha, m_i, l_i = _softmax_block(
            qk, m_i, l_i, offs_m, lo + tl.arange(0, BLOCK_N), n_k, causal_shift, qk_scale,
            window_left, window_right, softcap, MASKED, CAUSAL, HAS_WINDOW, SOFTCAP, SCALE_POSITIVE,
            EXP2_FMA_SHIFT
        )
        bits: tl.constexpr = tl.int32 if q.dtype == tl.float32 else tl.int16
        p = p.to(q.dtype).to(bits, bitcast=True)
        for start_n in tl.range(lo + BLOCK_N, hi, BLOCK_N):
            k = k_desc.load([start_n, 0])
            v = v_desc.load([start_n - BLOCK_N, 0])
            if TO_FP32:
                k, v = k.to(tl.float32), v.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            acc = tl.dot(
                p.to(q.dtype, bitcast=True), v, acc * alpha[:, None], input_precision=DOT_PRECISION
            )
            p, alpha, m_i, l_i = _softmax_block(
                qk, m_i, l_i, offs_m, start_n + tl.arange(0, BLOCK_N), n_k, causal_shift, qk_scale,
                window_left, window_right, softcap, MASKED, CAUSAL, HAS_WINDOW, SOFTCAP,
                SCALE_POSITIVE, EXP2_FMA_SHIFT
            )
            p = p.to(q.dtype).to(bits, bitcast=True)
        v = v_desc.load([lo + (hi - lo - 1) // BLOCK_N * BLOCK_N, 0])
        if TO_FP32:
            v = v.to(tl.float32)
        acc = tl.dot(
            p.to(q.dtype, bitcast=True), v, acc * alpha[:, None], input_precision=DOT_PRECISION
        )
    return acc, m_i, l_i


@triton.jit
def _attention_fwd_tma_kernel(
    Q, K, V, O, LSE, SINKS, CU_SEQLENS_Q, CU_SEQLENS_K,  #
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,  #
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,  #
    num_heads, group, n_q, n_k, qk_scale, total_q, window_left, window_right, softcap,  #
    q_bucket, k_bucket,  #
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,  #
    BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,  #
    SOFTCAP: tl.constexpr, VARLEN: tl.constexpr, HAS_SINKS: tl.constexpr,  #
    TO_FP32: tl.constexpr, SCALE_POSITIVE: tl.constexpr, DOT_PRECISION: tl.constexpr,  #
    EXP2_FMA_SHIFT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """The forward with q, k, v, o moved by tensor descriptors, one 2-D [rows, HEAD_DIM] view per
    (batch, head) with unit last stride: any row stride, so a packed q|k|v (row stride 3C) is read
    in place. Out-of-bounds rows and columns load as zeros; their stores are dropped. With VARLEN
    each view is one sequence's rows, so the next sequence's rows read as zeros too."""
    start_m, batch_head = block_start_and_batch_head(n_q, BLOCK_M, CAUSAL)
    batch = (batch_head // num_heads).to(tl.int64)
    head = (batch_head % num_heads).to(tl.int64)
    kv_head = head // group
    q_start, n_q = sequence_rows(CU_SEQLENS_Q, batch, n_q, VARLEN)
    k_start, n_k = sequence_rows(CU_SEQLENS_K, batch, n_k, VARLEN)
    if VARLEN and start_m >= n_q:
        return
    q_desc = rows_descriptor(
        Q + batch * stride_qb + head * stride_qh + q_start * stride_qm, n_q, stride_qm, HEAD_DIM,
        BLOCK_M, BLOCK_D
    )
    k_desc = rows_descriptor(
        K + batch * stride_kb + kv_head * stride_kh + k_start * stride_kn, n_k, stride_kn, HEAD_DIM,
        BLOCK_N, BLOCK_D
    )
    v_desc = rows_descriptor(
        V + batch * stride_vb + kv_head * stride_vh + k_start * stride_vn, n_k, stride_vn,
        HEAD_DIM_V, BLOCK_N, BLOCK_DV
    )
    o_desc = rows_descriptor(
        O + batch * stride_ob + head * stride_oh + q_start * stride_om, n_q, stride_om, HEAD_DIM_V,
        BLOCK_M, BLOCK_DV
    )
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = q_desc.load([start_m, 0])
    if TO_FP32:
        q = q.to(tl.float32)

    acc, m_i, l_i, causal_shift, lo, full_lo, full_hi, hi = _fwd_start(
        SINKS, head, start_m, n_q, n_k, window_left, window_right, CAUSAL, HAS_WINDOW, HAS_SINKS,
        BLOCK_M, BLOCK_N, BLOCK_DV
    )
    # The three phases of the pointer kernel.
    bounds = (lo, full_lo, full_hi, hi)
    for phase in tl.static_range(0 if HAS_WINDOW else 1, 3):
        acc, m_i, l_i = _fwd_key_blocks_tma(
            acc, m_i, l_i, q, k_desc, v_desc, offs_m, bounds[phase], bounds[phase + 1], n_k,
            causal_shift, qk_scale, window_left, window_right, softcap, BLOCK_N, phase != 1, CAUSAL,
            HAS_WINDOW, SOFTCAP, TO_FP32, SCALE_POSITIVE, DOT_PRECISION, EXP2_FMA_SHIFT
        )

    o, lse = _fwd_finish(acc, m_i, l_i)
    o_desc.store([start_m, 0], o.to(o_desc.dtype))
    stats = stats_offset(batch_head, head, n_q, q_start, total_q, VARLEN)
    tl.store(LSE + stats + offs_m, lse, mask=offs_m < n_q)


_attention_fwd_tma_autotuned = triton.autotune(
    configs=FWD_TMA_CONFIGS, key=TUNING_KEY,
    prune_configs_by=prune_to_fitting(FWD_TMA_CUDA_CONFIGS)
)(_attention_fwd_tma_kernel)

# Warp specialisation of the descriptor forward's key loop (`tl.range(..., warp_specialize=True)`)
# is not used: with Triton 3.9 for sm_90a it aborted in the NVGPUWarpSpecialization pass at 4 warps
# and compiled to the same kernel as without it at 8 (no setmaxnreg, equal registers).


def _exp2_fma_shift(block_d: int) -> int:
    """The descriptor forward's EXP2_FMA_SHIFT for a head block: 0 (the MUFU alone) at every one.

    At head dim 64 the MUFU bounds the hot loop by the clock model of `benchmarks/hot_loop.py`, but
    barely (M128 N128, 8 warps, sm_90a: 1056 MUFU clocks a tile against 954 of issue), and each
    exponential moved to the FMA units issues about 12 more instructions than it saves: moving
    an eighth of them (shift 3) takes the MUFU to 928 clocks and the issue to 1148."""
    return 0


def attention_forward(
    q, k, v, causal: bool, softmax_scale: float, allow_tf32: bool,
    window: tuple[int, int] = (-1, -1), softcap: float = 0.0, varlen: Varlen | None = None,
    sinks: torch.Tensor | None = None, softcap_approx: bool = False
):
    """o (B, Hq, Nq, Dv) and the base-2 log-sum-exp (B, Hq, Nq) fp32 of checked inputs (a row
    that sees no key: o = 0, lse = +inf, or with a sink lse = the sink); sinks (Hq,) or None."""
    B, Hq, Nq, _ = q.shape
    Hkv = k.shape[1]
    cu_q, cu_k, sequences, n_q, n_k = sequence_args(q, k, varlen)
    o = empty_heads_like(q, head_dim=v.shape[-1])
    lse = empty((B, Hq, Nq), device=q.device, dtype=torch.float32)
    mask_args, mask_flags = option_args(causal, window, softcap, n_q, n_k, softcap_approx)
    args = (Hq, Hq // Hkv, n_q, n_k, softmax_scale * LOG2_E, Nq, *mask_args)
    args = (*args, tuning_bucket(n_q), tuning_bucket(n_k))
    sinks, sink_flags = sink_args(sinks)
    flags = dict(
        kernel_flags(q, v, causal, allow_tf32), **mask_flags, **sink_flags, VARLEN=varlen
        is not None, SCALE_POSITIVE=softmax_scale > 0
    )
    grid = block_grid(n_q, "BLOCK_M", sequences * Hq)
    strides = [kernel_strides(t, varlen) for t in (q, k, v, o)]
    if use_tensor_descriptors(q, k, v, o):
        _attention_fwd_tma_autotuned[grid](
            q, k, v, o, lse, sinks, cu_q, cu_k, *(s for t in strides for s in t[:3]), *args,
            EXP2_FMA_SHIFT=_exp2_fma_shift(flags["BLOCK_D"]), **flags
        )
    else:
        _attention_fwd_kernel[grid](
            q, k, v, o, lse, sinks, cu_q, cu_k, *(s for t in strides for s in t), *args, **flags
        )
    return o, lse
