"""The Triton helpers every pass shares: tile loads and stores, the 1-D grid's decomposition,
packed-sequence bounds, which keys a query sees, and the ranges of key (or query) blocks a block
of queries (or keys) visits, split into masked and unmasked phases."""

from __future__ import annotations

import inspect

from fastlm.backend import interpreting
from fastlm.kernels._common import tl, triton


@triton.jit
def load_tile(
    ptrs, rows, n_rows, cols,  #
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr,  #
    TO_FP32: tl.constexpr
):
    """A (rows, BLOCK_D) tile; rows >= n_rows and the head-dim padding read as zero.

    Without CHECK_ROWS the caller has proven every row in range, and the load is unmasked unless
    the head dim is padded (the hot loop of the causal forward runs this way).
    """
    if CHECK_ROWS:
        tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM), other=0.0)
    elif HEAD_DIM < BLOCK_D:
        tile = tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)
    else:
        tile = tl.load(ptrs)
    if TO_FP32:  # bf16 tl.dot is wrong in the interpreter: feed it fp32 (exact) operands
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def rows_descriptor(
    Head, n_rows, stride_row,  #
    HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):
    """A tensor descriptor of one head's (n_rows, HEAD_DIM) rows, read in (BLOCK_ROWS, BLOCK_D)
    blocks: rows past n_rows (with packed sequences, the next sequence's) and the head-dim
    padding read as zeros, so the loop that streams them computes no addresses and no masks. A
    head without rows still gets one (a descriptor needs a row; the loop reads none)."""
    return tl.make_tensor_descriptor(
        Head, [tl.maximum(n_rows, 1), HEAD_DIM], [stride_row, 1], [BLOCK_ROWS, BLOCK_D]
    )


@triton.jit
def load_rows(desc, start, TO_FP32: tl.constexpr):
    """The block of a tensor descriptor's rows from `start` (out-of-bounds rows and columns read
    as zero: the descriptor's shape bounds them, not a mask)."""
    tile = desc.load([start, 0])
    if TO_FP32:  # as in load_tile
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def store_tile(ptrs, tile, rows, n_rows, cols, HEAD_DIM: tl.constexpr):
    tl.store(
        ptrs, tile.to(ptrs.dtype.element_ty),
        mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM)
    )


@triton.jit
def block_start_and_batch_head(n_rows, BLOCK: tl.constexpr, LAST_BLOCK_FIRST: tl.constexpr):
    """First row of this program's block and its batch * head, in a 1-D grid of
    cdiv(n_rows, BLOCK) * (B * H) programs.

    One grid axis because CUDA caps the second and third at 65535, and B * H can exceed that
    (e.g. batch 2048 x 32 heads at a short context). The block varies fastest, so the programs
    running together read one head's K and V, which stay in L2. LAST_BLOCK_FIRST reverses the
    blocks of each head: causal query blocks' work grows with their index, and launching the
    longest ones first leaves the short ones to fill the last wave.
    """
    num_blocks = tl.cdiv(n_rows, BLOCK)
    pid = tl.program_id(0)
    block = pid % num_blocks
    if LAST_BLOCK_FIRST:
        block = num_blocks - 1 - block
    return block * BLOCK, pid // num_blocks


def _fdiv_takes_approx() -> bool:
    """Whether this Triton's fdiv takes approx=True (div.approx.f32; Triton 3.9 has it)."""
    try:
        return "approx" in inspect.signature(tl.math.fdiv).parameters
    except (AttributeError, TypeError, ValueError):  # no Triton (`_no_triton`'s stand-ins)
        return False


@triton.jit
def _reciprocal_approx(d):
    """1 / d by div.approx.f32: MUFU.RCP alone, within 2 ulp; 0 for d = inf."""
    return tl.math.fdiv(1.0, d, approx=True)


@triton.jit
def _reciprocal_full_range(d):
    """1 / d by div.full.f32, for a Triton without approx division: a range check (|d| above
    2^126) and two multiplies more per element."""
    return 1.0 / d


_reciprocal = _reciprocal_approx if _fdiv_takes_approx() else _reciprocal_full_range


@triton.jit
def _xor_sign_bits(a, x):
    """a with its sign flipped where x's sign bit is set."""
    a = a.to(tl.uint32, bitcast=True) ^ (x.to(tl.uint32, bitcast=True) & 0x80000000)
    return a.to(tl.float32, bitcast=True)


@triton.jit
def _xor_sign_lop3(a, x):
    """`_xor_sign_bits` as one lop3.b32, which ptxas keeps whole: from and.b32 and xor.b32, LLVM
    hoists the and to where x comes out of the MMA, and ptxas issues both (a LOP3 more a score:
    32 in the descriptor dQ pass's M128 N64 loop, Triton 3.9 for sm_90a). Not for the
    interpreter, which runs no PTX."""
    return tl.inline_asm_elementwise(
        "lop3.b32 $0, $1, $2, 0x80000000, 0x78;", "=r,r,r",
        [a.to(tl.uint32, bitcast=True),
         x.to(tl.uint32, bitcast=True)], dtype=tl.uint32, is_pure=True, pack=1
    ).to(tl.float32, bitcast=True)


_xor_sign = _xor_sign_bits if interpreting() else _xor_sign_lop3


@triton.jit
def _tanh_parts(qk, x_scale, SIGNED: tl.constexpr):
    """(y, r) for x = qk * x_scale, a scalar x_scale: y = tanh(x) with SIGNED, otherwise |tanh(x)|
    with x_scale's sign (qk's sign is then the caller's: `capped_scores`), to fp32 rounding at
    every x (the interpreter has no tanh, and the GPU's tanh.approx is 2^-11 off), and r = 1 /
    (1 + 2^v), 1 - |tanh(x)| = 2 r, from which `capped_scores` takes the slope.

    With v = 2 log2(e) |x| (one multiply: the scales folded into one scalar), two forms, both
    computed and one selected:

    - |x| >= 0.6: 1 - 2 r, r <= 0.23, so 1 - 2 r >= 0.53 cancels nothing and r's rounding weighs
      a quarter of an ulp at most; 2^v = inf past |x| = 44 gives r = 0, |tanh| = 1. One ex2 and
      one reciprocal (MUFU: 1 / (1 + 2^v) is MUFU.RCP alone, where ptxas cannot rule out a
      denormal divisor in 2 / (1 + 2^v) or 1 / (1/2 + 2^v / 2) and adds div.approx's range
      check), an FADD and an FFMA; with SIGNED qk's sign by one LOP3 (`_xor_sign`).
    - |x| < 0.6, where 1 + 2^v rounds away the digits of tanh: |x| + |x|^3 q(x^2), q the degree-3
      minimax polynomial of (tanh(x) - x) / x^3 on [0, 0.6] (relative error 8.3e-8 of tanh),
      evaluated in v^2 = x^2 (2 log2(e))^2 (its coefficients scaled to match) as |qk| (x_scale
      + v^2 x_scale q'(v^2)): the coefficients times x_scale are scalars, so x itself is never
      formed (four FFMAs and a multiply). v = |qk * s|, not |qk| * s: LLVM would share the one
      |qk| between v and this form, and ptxas computes a shared |qk| by a LOP3.

    Worst error, ulp of |tanh(x)|: 2.6 measured in the interpreter (correctly rounded exp2 and
    division; tests/test_attention.py holds it at 3), x_scale's own rounding included (the form
    with the scaled score t = qk * s as its leading term measured 1.7, from t, but took a multiply
    a score more).
    """
    v = tl.abs(qk * (x_scale * 2.8853900817779268))  # 2 log2(e) |x|
    # x^3 q(x^2) = x v^2 q'(v^2), q' with q's k-th coefficient times (ln(2) / 2)^(2 k + 2)
    v2 = v * v
    q = v2 * (x_scale * 3.2496573112439364e-06) + x_scale * -9.04776097740978e-05
    q = v2 * q + x_scale * 0.0019207090372219682
    q = v2 * q + x_scale * -0.040036868304014206
    r = _reciprocal(1.0 + tl.math.exp2(v))
    one = tl.where(x_scale < 0, -1.0, 1.0)
    far = one - (2.0 * one) * r
    if SIGNED:
        near = qk * (v2 * q + x_scale)
        far = _xor_sign(far, qk)
    else:
        near = tl.abs(qk) * (v2 * q + x_scale)
    return tl.where(v < 1.731234073638916, near, far), r  # |x| < 0.6


@triton.jit
def tanh(x):
    """tanh to fp32 rounding at every x (`_tanh_parts`)."""
    th, _ = _tanh_parts(x, 1.0, True)
    return th


@triton.jit
def exp2_fma(x):
    """2^x on the FMA units (no MUFU), within an fp32 ulp of exact for x < 63.5, so at every
    softmax exponent (x <= 0): results below 2^-126 are the correctly rounded denormals, 0 from
    about -149.5 down, -inf included.

    Cody-Waite: x = j + f with j = rint(x) (the 1.5 * 2^23 trick: its low mantissa bits are j)
    and |f| <= 1/2; 2^f by a degree-6 minimax polynomial (relative error 1.9e-9, under an fp32
    ulp with Horner's FMAs); 2^j added to the exponent bits with a bias of 2^64, so the sum stays
    a normal number down to x = -150, and taken off by one multiplication, which rounds the
    denormals once.
    """
    x = tl.maximum(x, -150.0)
    t = x + 12582912.0
    f = x - (t - 12582912.0)
    p = f * 1.534579175960525e-4 + 1.3399929366022805e-3
    p = f * p + 9.618489006952545e-3
    p = f * p + 5.550328781768263e-2
    p = f * p + 0.24022646890427754
    p = f * p + 0.6931472057349264
    p = f * p + 1.0
    scaled = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23) + (64 << 23)
    return scaled.to(tl.float32, bitcast=True) * 5.421010862427522e-20  # 2^-64


@triton.jit
def _halves(x):
    """The first and the second half of x's columns: register permutations in the tensor-core
    layouts, where one thread holds columns c and c + N / 2 alike."""
    rows: tl.constexpr = x.shape[0]
    cols: tl.constexpr = x.shape[1]
    return tl.split(tl.permute(tl.reshape(x, [rows, 2, cols // 2]), [0, 2, 1]))


@triton.jit
def _unhalves(a, b):
    rows: tl.constexpr = a.shape[0]
    cols: tl.constexpr = a.shape[1]
    return tl.reshape(tl.permute(tl.join(a, b), [0, 2, 1]), [rows, 2 * cols])


@triton.jit
def exp2_split(x, FMA_SHIFT: tl.constexpr):
    """2^x of a (rows, cols) tile, the last cols >> FMA_SHIFT columns on the FMA units
    (`exp2_fma`), the others on the MUFU: FMA_SHIFT 0 takes the MUFU alone, 1 to 3 move a half
    to an eighth of the exponentials off it, where the MUFU bounds a loop."""
    if FMA_SHIFT == 0:
        y = tl.math.exp2(x)
    elif FMA_SHIFT == 1:
        a, b = _halves(x)
        y = _unhalves(tl.math.exp2(a), exp2_fma(b))
    elif FMA_SHIFT == 2:
        a, b = _halves(x)
        b0, b1 = _halves(b)
        y = _unhalves(tl.math.exp2(a), _unhalves(tl.math.exp2(b0), exp2_fma(b1)))
    else:
        tl.static_assert(FMA_SHIFT == 3, "FMA_SHIFT: 0 to 3")
        a, b = _halves(x)
        b0, b1 = _halves(b)
        c0, c1 = _halves(b1)
        y = _unhalves(
            tl.math.exp2(a), _unhalves(tl.math.exp2(b0), _unhalves(tl.math.exp2(c0), exp2_fma(c1)))
        )
    return y


@triton.jit
def _half_slope(th, r):
    """(1 - tanh^2) / 2 = (1 + |th|)(1 - |th|) / 2 with (1 - |th|) / 2 = r from `_tanh_parts`
    (1 / (1 + 2^v)), not from th: a product of relatively accurate factors, so it keeps fp32's
    relative accuracy where it is tiny, in one FFMA (the half: `slope_unit`). 1 - th * th is off
    by an ulp of th, about 6e-8, once |x| passes 6 (a slope below 2.5e-5): with a cap far below
    the scores every slope is there, and dq and dk came out wrong in their first digit."""
    return tl.abs(th) * r + r


#: The SOFTCAP constexpr of the kernels (`capped_scores`): no cap, the exact one, or the
#: approximate one, computed by tanh.approx.f32 on a GPU and by its error model where inline PTX
#: cannot run (the interpreter).
SOFTCAP_OFF, SOFTCAP_EXACT, SOFTCAP_APPROX, SOFTCAP_APPROX_MODEL = 0, 1, 2, 3
#: tanh.approx.f32's relative error (the PTX ISA's figure; flash-attention's cutlass::fast_tanh).
TANH_APPROX_ERROR = 2.0**-11


@triton.jit
def _tanh_approx(x, SOFTCAP: tl.constexpr):
    """tanh.approx.f32 (MUFU.TANH, one instruction, 2^-11 relative) with SOFTCAP_APPROX; with
    SOFTCAP_APPROX_MODEL its error model: fp32's tanh (`tanh`) rounded toward zero to 11
    fraction bits, an error below 2^-11 relative, all of it toward zero (tanh.approx's own values
    are not reproduced: its errors may have either sign)."""
    if SOFTCAP == 2:
        th = tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        tl.static_assert(SOFTCAP == 3, "SOFTCAP: 2 (tanh.approx) or 3 (its model)")
        th = (tanh(x).to(tl.uint32, bitcast=True) & 0xFFFFF000).to(tl.float32, bitcast=True)
    return th


@triton.jit
def capped_scores(qk, qk_scale, softcap, SOFTCAP: tl.constexpr, SIGNED: tl.constexpr = True):
    """(y, y_scale, slope) of raw scores qk = q k^T: the capped base-2 scores are y * y_scale,
    and the cap's derivative is slope * slope_unit(SOFTCAP).

    y = tanh(x), x = qk * qk_scale / softcap, y_scale = softcap, which the caller's exponent
    takes in its FMA (y * c - m). SOFTCAP_EXACT: tanh to fp32 rounding (`_tanh_parts`, its
    scales folded into scalars) and half the slope in one FFMA (`_half_slope`); without SIGNED,
    y = |tanh(x)| with the scale's sign and y_scale = softcap with qk's, one LOP3 either way (the
    backward's choice, which takes no row max: the same loop as SIGNED in the descriptor dQ
    pass's M128 N64, 2 registers fewer, 252). The approximate cap
    (SOFTCAP_APPROX, _MODEL): tanh by `_tanh_approx`, x in one multiply, the slope 1 - y^2: a
    multiply, a MUFU and an FFMA a score beyond the plain loop's. SIGNED with a positive scale
    makes y_scale > 0, so that a row max of y times y_scale is theirs."""
    x_scale = qk_scale / softcap
    y_scale = softcap
    if SOFTCAP == 1:
        y, r = _tanh_parts(qk, x_scale, SIGNED)
        slope = _half_slope(y, r)
        if not SIGNED:
            y_scale = _xor_sign(softcap + tl.zeros_like(qk), qk)
    else:
        y = _tanh_approx(qk * x_scale, SOFTCAP)
        slope = 1.0 - y * y
    return y, y_scale, slope


@triton.jit
def slope_unit(SOFTCAP: tl.constexpr):
    """What `capped_scores`' slope counts in: 2 for the exact cap (half the slope saves its
    doubling in the hot loop; the kernels take the 2 in their final scale), 1 otherwise."""
    unit = 1.0
    if SOFTCAP == 1:
        unit = 2.0
    return unit


@triton.jit
def sequence_rows(CU_SEQLENS, index, n_rows, VARLEN: tl.constexpr):
    """(first row, rows) of sequence `index`: with VARLEN rows cu_seqlens[index] to
    cu_seqlens[index + 1] of the packed tokens (the first row as int64: it scales a row stride);
    otherwise rows 0 to n_rows of batch `index`."""
    start = 0
    n = n_rows
    if VARLEN:
        first = tl.load(CU_SEQLENS + index)
        n = tl.load(CU_SEQLENS + index + 1) - first
        start = first.to(tl.int64)
    return start, n


@triton.jit
def stats_offset(batch_head, head, n_q, q_start, total_q, VARLEN: tl.constexpr):
    """Where a (sequence, head)'s first row lies in the fp32 row statistics (LSE, Delta): (B, H,
    Nq) contiguous, or with VARLEN (H, total_q) with the sequences packed along the rows."""
    offset = batch_head.to(tl.int64) * n_q
    if VARLEN:
        offset = head * total_q + q_start
    return offset


@triton.jit
def is_visible(
    rows, cols, n_k, causal_shift, window_left, window_right,  #
    CHECK_COLS: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr
):
    """Whether query `rows` sees key `cols` (index tensors that broadcast): the key lies within
    the window [d - window_left, d + window_right] or (CAUSAL, no window) at most d, d = rows +
    causal_shift the query's aligned diagonal; with CHECK_COLS also below n_k."""
    if CHECK_COLS:
        in_range = cols < n_k
    if HAS_WINDOW:
        diagonal = rows + causal_shift
        visible = (cols >= diagonal - window_left) & (cols <= diagonal + window_right)
        if CHECK_COLS:
            visible = in_range & visible
    elif CAUSAL:
        visible = cols <= rows + causal_shift
        if CHECK_COLS:
            visible = in_range & visible
    else:
        visible = in_range
    return visible


@triton.jit
def key_range(
    start_m, n_k, causal_shift, window_left, window_right,  #
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,  #
    BLOCK_N: tl.constexpr
):
    """(lo, full_lo, full_hi, hi) for the query block [start_m, start_m + BLOCK_M): every row sees
    the whole of the key blocks starting in [full_lo, full_hi), no row sees a key outside [lo, hi),
    and the blocks starting in [lo, full_lo) and [full_hi, hi) need the mask. lo, full_lo and
    full_hi are multiples of BLOCK_N; keys outside [lo, hi) are never visited (a window's work is
    O(window), not O(n_k)). Bounds are clamped at 0 before a division (Triton's rounds to zero),
    and a window's hi at 0 too: a block of queries a window or more past a packed sequence's keys
    (more queries than keys) sees none, and no range may reach below the sequence's first key.
    Causal without a window, the ranges are empty there already (full_hi >= 0 > hi)."""
    lo = 0
    full_lo = 0
    if HAS_WINDOW:
        first = start_m + causal_shift  # the diagonal of the block's first row
        last = first + BLOCK_M - 1
        lo = tl.maximum(first - window_left, 0) // BLOCK_N * BLOCK_N
        hi = tl.maximum(tl.minimum(last + window_right + 1, n_k), 0)
        full_lo = tl.minimum(tl.cdiv(tl.maximum(last - window_left, 0), BLOCK_N) * BLOCK_N, hi)
        full_hi = tl.maximum(first + window_right + 1, 0)
        full_hi = tl.maximum(tl.minimum(full_hi, n_k) // BLOCK_N * BLOCK_N, full_lo)
    elif CAUSAL:
        # Keys [0, full_hi) are seen by every row of the block (the first row sees j <= start_m +
        # shift); the last row sees j <= start_m + BLOCK_M - 1 + shift.
        full_hi = tl.maximum(start_m + causal_shift + 1, 0) // BLOCK_N * BLOCK_N
        hi = tl.minimum(start_m + BLOCK_M + causal_shift, n_k)
    else:
        full_hi = n_k // BLOCK_N * BLOCK_N
        hi = n_k
    return lo, full_lo, full_hi, hi


@triton.jit
def query_range(
    start_n, n_q, n_k, causal_shift, window_left, window_right,  #
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,  #
    BLOCK_N: tl.constexpr
):
    """(lo, full_lo, full_hi, hi) for the key block [start_n, start_n + BLOCK_N): the query blocks
    starting in [lo, min(full_lo, hi)) see part of it (mask), those in [full_lo, full_hi) are whole
    blocks of rows below n_q that see all of it, and those in [full_hi, hi) hold rows past n_q or
    see part of it (mask unless causal); queries outside [lo, hi) see none of it.

    Not causal, a key block holding rows past n_k has no whole blocks: those rows are read as
    zeros, and a zero key's score 0 against an LSE below about -126 (base 2: every score the
    query sees below about -88) would overflow 2^(0 - LSE), make dS inf and the atomic dQ NaN.
    Causally no row below n_q sees past n_k, so the mask of [lo, full_lo) holds them already."""
    lo = 0
    full_lo = 0
    hi = n_q
    if HAS_WINDOW:
        first = start_n - causal_shift  # the query whose diagonal is the block's first key
        last = first + BLOCK_N - 1
        lo = tl.maximum(first - window_right, 0) // BLOCK_M * BLOCK_M
        hi = tl.minimum(last + window_left + 1, n_q)
        full_lo = tl.cdiv(tl.maximum(last - window_right, 0), BLOCK_M) * BLOCK_M
        full_hi = tl.minimum(tl.maximum(first + window_left + 1, 0), n_q) // BLOCK_M * BLOCK_M
        full_hi = tl.maximum(full_hi, full_lo)
    else:
        if CAUSAL:
            lo = tl.maximum(start_n - causal_shift, 0) // BLOCK_M * BLOCK_M
            full_lo = (
                tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - causal_shift, 0), BLOCK_M) * BLOCK_M
            )
        full_hi = tl.maximum(n_q // BLOCK_M * BLOCK_M, full_lo)
    if HAS_WINDOW or not CAUSAL:
        full_hi = tl.where(start_n + BLOCK_N > n_k, full_lo, full_hi)
    return lo, full_lo, full_hi, hi
