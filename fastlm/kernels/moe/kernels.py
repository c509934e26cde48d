"""The Triton kernels of the fused mixture-of-experts experts (`fastlm.kernels.moe.experts`: the
math, what each launch computes and what the backward saves are in its docstring; the
launchers, the ops and the public function are there too).

- `_grouped_gemm_kernel`: BLOCK_M sorted rows of one expert times its weight rows, A's rows
  gathered by token index, the activation (or the routing weight) in the epilogue: grouped
  GEMM 1 and 2 of the forward, and dx;
- `_hidden_backward_kernel`: the backward's recompute of gate and up beside down_e^T g, writing
  w h, (d gate | d up) and each column block's share of d w;
- `_expert_grad_kernel`: the weight gradients, per expert a GEMM ragged in its reduction;
- `_combine_kernel`: out[t] = sum_j y[t k + j] in a fixed order (no atomics).
"""

from __future__ import annotations

from fastlm.kernels._common import round_to, tl, triton
from fastlm.kernels.swiglu import gated_unit, gated_unit_grad


@triton.jit
def _dot(a, b, acc, FP32_DOT: tl.constexpr):
    """acc + a @ b; FP32_DOT: fp32 operands in IEEE fp32 (fp32 inputs; bf16 ones under the
    interpreter, whose bf16 dot is wrong)."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _load_k(ptrs, ks, K, MASK_K: tl.constexpr):
    """A tile of a loop over K whose rows and columns are in bounds by construction: masked on
    K alone (zeros past it) with MASK_K, else not at all (BLOCK_K divides K)."""
    if MASK_K:
        return tl.load(ptrs, mask=ks < K, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _relu2(u):
    """(relu(u)^2, its slope 2 relu(u)) in fp32 (RELU2: non-gated experts)."""
    r = tl.maximum(u, 0.0)
    return r * r, 2.0 * r


@triton.jit
def _expert_tile(EXPERT_OFFSETS, E, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    """(expert, first row, end of the expert's rows) of program_id(0)'s tile: each expert's rows
    of the sorted order split into BLOCK_M tiles, the tiles numbered expert after expert; a
    program past the last tile gets expert >= E. Recomputed by each program from the (E + 1)
    offsets: no host sync, and each kernel picks its own BLOCK_M."""
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    starts = tl.load(EXPERT_OFFSETS + experts, mask=experts < E, other=0)
    ends = tl.load(EXPERT_OFFSETS + 1 + experts, mask=experts < E, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, axis=0)
    expert = tl.sum((tile_ends <= pid).to(tl.int32), axis=0)
    this = experts == expert
    tile_start = tl.sum(tl.where(this, tile_ends - tiles, 0), axis=0)
    first = tl.sum(tl.where(this, starts, 0), axis=0) + (pid - tile_start) * BLOCK_M
    return expert, first, tl.sum(tl.where(this, ends, 0), axis=0)


@triton.jit
def _grouped_gemm_kernel(
    A, W, BIAS, SCALE, SORTED, EXPERT_OFFSETS, OUT,  #
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_om,  #
    N, K, E, TOP_K, up_row, gate_step, alpha, limit, up_offset,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, E_PAD: tl.constexpr,  #
    GATHER_A: tl.constexpr, SCATTER_OUT: tl.constexpr, GATED: tl.constexpr,  #
    PAIRED: tl.constexpr, ACTIVATION: tl.constexpr, CLAMP: tl.constexpr, HAS_BIAS: tl.constexpr,  #
    HAS_SCALE: tl.constexpr, MASK_K: tl.constexpr, FP32_DOT: tl.constexpr,
    BF16_BY_HAND: tl.constexpr
):
    """OUT[row] = (A[row] @ W_e[n, :]^T + BIAS_e) for BLOCK_M sorted rows of expert e.

    A row is the sorted position p, or with GATHER_A the token SORTED[p] // TOP_K; OUT's row is p,
    or with SCATTER_OUT the assignment SORTED[p]. W_e[n, k] = W[e, n, k] through its strides.
    GATED: output column n takes W's rows gate_step n (gate) and up_row + gate_step n (up) and
    is act(gate, up); PAIRED (gate and up interleaved, rows 2 n and 2 n + 1): the program's
    2 BLOCK_N rows of W read as one tile, one dot, gate and up split in registers after the loop
    (two stride-2 tiles otherwise); else ACTIVATION RELU2 (4) is relu(.)^2 of the column
    (non-gated experts), NO_ACTIVATION none. HAS_SCALE: the result times SCALE[assignment] (the
    routing weight). MASK_K: BLOCK_K does not divide K (the loop masks its last block).
    """
    expert, first, end = _expert_tile(EXPERT_OFFSETS, E, BLOCK_M, E_PAD)
    if expert >= E:
        return
    rows = first + tl.arange(0, BLOCK_M)
    valid = rows < end
    assignment = tl.load(SORTED + rows, mask=valid, other=0)  # int32: an int64 // is a call
    # A's rows take no mask in the loop: past the tile, token 0 or the tile's last row (in
    # bounds, never stored)
    a_rows = (assignment // TOP_K) if GATHER_A else tl.minimum(rows, end - 1)
    a_rows = a_rows.to(tl.int64)
    assignment = assignment.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    W_N: tl.constexpr = 2 * BLOCK_N if PAIRED else BLOCK_N  # W's rows a program reads per dot
    w_rows = tl.program_id(1) * W_N + tl.arange(0, W_N)
    w_valid = w_rows < (2 * N if PAIRED else N)
    if not PAIRED:
        w_rows = w_rows.to(tl.int64) * gate_step
    W_e = W + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, W_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = _load_k(
            A + a_rows[:, None] * stride_am + ks[None, :] * stride_ak, ks[None, :], K, MASK_K
        )
        w_mask = w_valid[None, :] & (ks[:, None] < K if MASK_K else True)
        w = tl.load(
            W_e + w_rows[None, :] * stride_wn + ks[:, None] * stride_wk, mask=w_mask, other=0.0
        )
        acc = _dot(a, w, acc, FP32_DOT)
        if GATED and not PAIRED:
            w_up = tl.load(
                W_e + (up_row + w_rows)[None, :] * stride_wn + ks[:, None] * stride_wk, mask=w_mask,
                other=0.0
            )
            acc_up = _dot(a, w_up, acc_up, FP32_DOT)
    if HAS_BIAS:
        bias = BIAS + expert.to(tl.int64) * stride_be
        acc += tl.load(bias + w_rows * stride_bn, mask=w_valid, other=0.0).to(tl.float32)[None, :]
        if GATED and not PAIRED:
            b_up = tl.load(bias + (up_row + w_rows) * stride_bn, mask=w_valid, other=0.0)
            acc_up += b_up.to(tl.float32)[None, :]
    if PAIRED:
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        acc = gated_unit(gate, up, alpha, limit, up_offset, ACTIVATION, CLAMP)
    elif GATED:
        acc = gated_unit(acc, acc_up, alpha, limit, up_offset, ACTIVATION, CLAMP)
    elif ACTIVATION == 4:  # RELU2
        acc = _relu2(acc)[0]
    if HAS_SCALE:
        acc *= tl.load(SCALE + assignment, mask=valid, other=0.0).to(tl.float32)[:, None]
    out_rows = assignment if SCATTER_OUT else rows.to(tl.int64)
    tl.store(
        OUT + out_rows[:, None] * stride_om + cols[None, :],
        round_to(acc, OUT.dtype.element_ty, BF16_BY_HAND), mask=valid[:, None] & (cols < N)[None, :]
    )


@triton.jit
def _hidden_backward_kernel(
    X, DOUT, W1, W2, B1, B2, SCALE, SORTED, EXPERT_OFFSETS, DGU, H, DW,  #
    stride_xm, stride_xk, stride_dom, stride_dok,  #
    stride_w1e, stride_w1n, stride_w1k, stride_w2e, stride_w2k, stride_w2n,  #
    stride_b1e, stride_b1n, stride_b2e, stride_b2k, stride_gm, stride_hm, stride_dwb,  #
    F, D, E, TOP_K, up_row, gate_step, alpha, limit, up_offset,  #
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, E_PAD: tl.constexpr,  #
    ACTIVATION: tl.constexpr, CLAMP: tl.constexpr, HAS_B1: tl.constexpr, HAS_B2: tl.constexpr,  #
    GATED: tl.constexpr, PAIRED: tl.constexpr, MASK_K: tl.constexpr, FP32_DOT: tl.constexpr,
    BF16_BY_HAND: tl.constexpr
):
    """For BLOCK_M sorted rows of expert e and BLOCK_N hidden columns: gate and up recomputed,
    dh = down_e^T dout[token] in the same loop over D; writes h, (d gate | d up) in gate_up's row
    order (DGU) and this column block's share of d w (DW[block, assignment]). Without GATED
    (non-gated experts, ReLU²) W1's rows are up's alone: acc_gate holds up, and DGU d up.
    PAIRED (gate and up interleaved): W1's 2 BLOCK_N rows as one tile and one dot, split after
    the loop, and (d gate | d up) joined into one contiguous store, as `_grouped_gemm_kernel`.
    H holds w h, rounded (d down's rows, scaled here rather than in its loop). d w's down-bias
    term <dout[token], b2_e> is summed by column block 0 alone, in a loop after the main one."""
    expert, first, end = _expert_tile(EXPERT_OFFSETS, E, BLOCK_M, E_PAD)
    if expert >= E:
        return
    rows = first + tl.arange(0, BLOCK_M)
    valid = rows < end
    assignment = tl.load(SORTED + rows, mask=valid, other=0)  # int32: an int64 // is a call
    tokens = (assignment // TOP_K).to(tl.int64)
    assignment = assignment.to(tl.int64)
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    W_N: tl.constexpr = 2 * BLOCK_N if PAIRED else BLOCK_N  # W1's rows a program reads per dot
    w_rows = pid_n * W_N + tl.arange(0, W_N)
    w_valid = w_rows < (2 * F if PAIRED else F)
    if not PAIRED:
        w_rows = w_rows.to(tl.int64) * gate_step
    e64 = expert.to(tl.int64)
    W1_e, W2_e = W1 + e64 * stride_w1e, W2 + e64 * stride_w2e
    acc_gate = tl.zeros([BLOCK_M, W_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_dh = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # x's and dout's rows take no mask: a row past the tile reads token 0 (its assignment
    # loaded as 0), in bounds and never stored; the weights' columns past F stay masked (a
    # clamped index would hide their contiguity from the compiler); D's last block is masked
    # only when BLOCK_K does not divide D (MASK_K).
    col_mask = cols < F
    for k0 in range(0, D, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = _load_k(
            X + tokens[:, None] * stride_xm + ks[None, :] * stride_xk, ks[None, :], D, MASK_K
        )
        dout = _load_k(
            DOUT + tokens[:, None] * stride_dom + ks[None, :] * stride_dok, ks[None, :], D, MASK_K
        )
        k_mask = ks[:, None] < D if MASK_K else True
        w_gate = tl.load(
            W1_e + w_rows[None, :] * stride_w1n + ks[:, None] * stride_w1k,
            mask=w_valid[None, :] & k_mask, other=0.0
        )
        w_mask = col_mask[None, :] & k_mask
        w_down = tl.load(
            W2_e + ks[:, None] * stride_w2k + cols[None, :] * stride_w2n, mask=w_mask, other=0.0
        )
        acc_gate = _dot(x, w_gate, acc_gate, FP32_DOT)
        if GATED and not PAIRED:
            w_up = tl.load(
                W1_e + (up_row + w_rows)[None, :] * stride_w1n + ks[:, None] * stride_w1k,
                mask=w_mask, other=0.0
            )
            acc_up = _dot(x, w_up, acc_up, FP32_DOT)
        acc_dh = _dot(dout, w_down, acc_dh, FP32_DOT)
    if HAS_B1:
        b1 = B1 + e64 * stride_b1e
        acc_gate += tl.load(b1 + w_rows * stride_b1n, mask=w_valid,
                            other=0.0).to(tl.float32)[None, :]
        if GATED and not PAIRED:
            b_up = tl.load(b1 + (up_row + w_rows) * stride_b1n, mask=cols < F, other=0.0)
            acc_up += b_up.to(tl.float32)[None, :]
    if PAIRED:
        acc_gate, acc_up = tl.split(tl.reshape(acc_gate, [BLOCK_M, BLOCK_N, 2]))
    if GATED:
        h = gated_unit(acc_gate, acc_up, alpha, limit, up_offset, ACTIVATION, CLAMP)
    else:
        h, slope = _relu2(acc_gate)
    h = round_to(h, H.dtype.element_ty, BF16_BY_HAND)  # h as the forward's second GEMM read it
    mask = valid[:, None] & (cols < F)[None, :]
    scale = tl.load(SCALE + assignment, mask=valid, other=0.0).to(tl.float32)
    # w h for d down (so that its GEMM's operands go to shared memory untouched)
    h_out = round_to(h.to(tl.float32) * scale[:, None], H.dtype.element_ty, BF16_BY_HAND)
    tl.store(H + rows.to(tl.int64)[:, None] * stride_hm + cols[None, :], h_out, mask=mask)
    dw = tl.sum(acc_dh * h.to(tl.float32), axis=1)
    if HAS_B2:
        if pid_n == 0:  # <dout[token], b2_e>, once per row
            for k0 in range(0, D, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                dout = tl.load(
                    DOUT + tokens[:, None] * stride_dom + ks[None, :] * stride_dok,
                    mask=(ks < D)[None, :], other=0.0
                )
                b2 = tl.load(B2 + e64 * stride_b2e + ks * stride_b2k, mask=ks < D, other=0.0)
                dw += tl.sum(dout.to(tl.float32) * b2.to(tl.float32)[None, :], axis=1)
    tl.store(DW + pid_n * stride_dwb + assignment, dw, mask=valid)
    dgu = DGU + rows.to(tl.int64)[:, None] * stride_gm
    if PAIRED:
        d_gate, d_up = gated_unit_grad(
            acc_dh * scale[:, None], acc_gate, acc_up, alpha, limit, up_offset, ACTIVATION, CLAMP
        )
        d_gate_up = tl.reshape(tl.join(d_gate, d_up), [BLOCK_M, W_N])
        tl.store(
            dgu + w_rows[None, :], round_to(d_gate_up, DGU.dtype.element_ty, BF16_BY_HAND),
            mask=valid[:, None] & w_valid[None, :]
        )
    else:
        if GATED:
            d_gate, d_up = gated_unit_grad(
                acc_dh * scale[:, None], acc_gate, acc_up, alpha, limit, up_offset, ACTIVATION,
                CLAMP
            )
            tl.store(
                dgu + (up_row + w_rows)[None, :],
                round_to(d_up, DGU.dtype.element_ty, BF16_BY_HAND), mask=mask
            )
        else:  # d up of h = relu(up)^2, written where d gate goes in the gated form
            d_gate = acc_dh * scale[:, None] * slope
        tl.store(
            dgu + w_rows[None, :], round_to(d_gate, DGU.dtype.element_ty, BF16_BY_HAND), mask=mask
        )


@triton.jit
def _sorted_rows(
    SORTED, r0, end, TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, GATHER: tl.constexpr,
    MASK_R: tl.constexpr, INT64: tl.constexpr
):
    """(rows, valid, assignment, the operand's rows) of the BLOCK_R sorted rows from r0: the
    operand's rows the tokens (GATHER) or the sorted rows, int64 with INT64 (else int32: one
    multiply per row address); MASK_R: the rows past `end` masked (assignment 0), else all rows
    are the expert's."""
    rows = r0 + tl.arange(0, BLOCK_R)
    valid = rows < end
    if MASK_R:
        assignment = tl.load(SORTED + rows, mask=valid, other=0)
    else:
        assignment = tl.load(SORTED + rows)
    # the token: a shift or a multiply by the constant k, unsigned (no sign fix-up)
    token = (assignment.to(tl.uint32) // TOP_K).to(tl.int32)
    operand_rows = token if GATHER else rows
    if INT64:
        operand_rows = operand_rows.to(tl.int64)
    return rows, valid, assignment, operand_rows


@triton.jit
def _grad_block(
    A, B, SORTED, r0, end, ii, jj, I, J, acc,  #
    stride_am, stride_ai, stride_bm, stride_bj,  #
    TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, GATHER_A: tl.constexpr, GATHER_B: tl.constexpr,
    MASK_R: tl.constexpr, MASK_I: tl.constexpr, MASK_J: tl.constexpr, INT64: tl.constexpr,
    FP32_DOT: tl.constexpr
):
    """acc + A[rows]^T B[rows] over the BLOCK_R sorted rows from r0 (`_expert_grad_kernel`);
    MASK_R: the rows past `end` masked (zeros); MASK_I, MASK_J: the columns past I, J masked
    (BLOCK_I, BLOCK_J do not divide them)."""
    rows, valid, assignment, a_rows = _sorted_rows(
        SORTED, r0, end, TOP_K, BLOCK_R, GATHER_A, MASK_R, INT64
    )
    b_rows = a_rows if GATHER_A == GATHER_B else _sorted_rows(
        SORTED, r0, end, TOP_K, BLOCK_R, GATHER_B, MASK_R, INT64
    )[3]
    a_mask = (valid[:, None] if MASK_R else True) & ((ii < I)[None, :] if MASK_I else True)
    b_mask = (valid[:, None] if MASK_R else True) & ((jj < J)[None, :] if MASK_J else True)
    a = tl.load(A + a_rows[:, None] * stride_am + ii[None, :] * stride_ai, mask=a_mask, other=0.0)
    b = tl.load(B + b_rows[:, None] * stride_bm + jj[None, :] * stride_bj, mask=b_mask, other=0.0)
    return _dot(tl.trans(a), b, acc, FP32_DOT)


@triton.jit
def _expert_grad_kernel(
    A, B, SCALE, SORTED, EXPERT_OFFSETS, OUT, BIAS_OUT,  #
    stride_am, stride_ai, stride_bm, stride_bj,  #
    stride_oe, stride_oi, stride_oj, stride_ge, stride_gi,  #
    I, J, TOP_K: tl.constexpr,  #
    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr,  #
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, HAS_BIAS: tl.constexpr,  #
    BIAS_SCALE: tl.constexpr, MASK_I: tl.constexpr, MASK_J: tl.constexpr, INT64: tl.constexpr,  #
    FP32_DOT: tl.constexpr, BF16_BY_HAND: tl.constexpr
):
    """OUT[e, i, j] = sum over expert e's sorted rows p of A[p, i] B[p, j] (a GEMM ragged in its
    reduction), A's row the token SORTED[p] // TOP_K under GATHER_A (B's likewise);
    BIAS_OUT[e, i] = sum_p s_p A[p, i] (s_p = SCALE[assignment] with BIAS_SCALE, else 1). One
    program sums all of an expert's rows: no atomics; an expert without rows gets zeros.

    The loop is the GEMM alone: the whole BLOCK_R blocks without a mask, the last partial block
    after it; the bias, which only block j = 0 stores, in a loop of that block's own."""
    expert = tl.program_id(0)
    start = tl.load(EXPERT_OFFSETS + expert)
    end = tl.load(EXPERT_OFFSETS + expert + 1)
    ii = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    jj = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
    acc = tl.zeros([BLOCK_I, BLOCK_J], dtype=tl.float32)
    whole_end = start + (end - start) // BLOCK_R * BLOCK_R
    for r0 in range(start, whole_end, BLOCK_R):
        acc = _grad_block(
            A, B, SORTED, r0, end, ii, jj, I, J, acc, stride_am, stride_ai, stride_bm, stride_bj,
            TOP_K, BLOCK_R, GATHER_A, GATHER_B, False, MASK_I, MASK_J, INT64, FP32_DOT
        )
    if whole_end < end:
        acc = _grad_block(
            A, B, SORTED, whole_end, end, ii, jj, I, J, acc, stride_am, stride_ai, stride_bm,
            stride_bj, TOP_K, BLOCK_R, GATHER_A, GATHER_B, True, MASK_I, MASK_J, INT64, FP32_DOT
        )
    e64 = expert.to(tl.int64)
    tl.store(
        OUT + e64 * stride_oe + ii.to(tl.int64)[:, None] * stride_oi + jj[None, :] * stride_oj,
        round_to(acc, OUT.dtype.element_ty, BF16_BY_HAND),
        mask=(ii < I)[:, None] & (jj < J)[None, :]
    )
    if HAS_BIAS:
        if tl.program_id(2) == 0:
            acc_bias = tl.zeros([BLOCK_I], dtype=tl.float32)
            for r0 in range(start, end, BLOCK_R):
                _, valid, assignment, a_rows = _sorted_rows(
                    SORTED, r0, end, TOP_K, BLOCK_R, GATHER_A, True, INT64
                )
                a = tl.load(
                    A + a_rows[:, None] * stride_am + ii[None, :] * stride_ai,
                    mask=valid[:, None] & (ii < I)[None, :], other=0.0
                ).to(tl.float32)
                if BIAS_SCALE:
                    a *= tl.load(SCALE + assignment, mask=valid, other=0.0).to(tl.float32)[:, None]
                acc_bias += tl.sum(a, axis=0)
            tl.store(
                BIAS_OUT + e64 * stride_ge + ii * stride_gi,
                round_to(acc_bias, BIAS_OUT.dtype.element_ty, BF16_BY_HAND), mask=ii < I
            )


@triton.jit
def _combine_kernel(
    Y, OUT,  #
    stride_ym, stride_om,  #
    T, D, TOP_K,  #
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BF16_BY_HAND: tl.constexpr
):
    """OUT[t] = sum_j Y[t TOP_K + j], j in order (deterministic), in fp32."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (t < T)[:, None] & (d < D)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in range(0, TOP_K):
        y = tl.load(Y + (t * TOP_K + j)[:, None] * stride_ym + d[None, :], mask=mask, other=0.0)
        acc += y.to(tl.float32)
    tl.store(
        OUT + t[:, None] * stride_om + d[None, :],
        round_to(acc, OUT.dtype.element_ty, BF16_BY_HAND), mask=mask
    )
