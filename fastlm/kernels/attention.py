"""Flash attention (FlashAttention-2): exact softmax attention without an [N x N] matrix.

For one (batch, query head) with q (Nq, D), the keys k and values v (Nk, D) of its key/value head
(query head h reads key/value head h // G when Hq = G * Hkv) and the softmax scale s:

    S = s * q k^T,   P = softmax(S) over the keys,   O = P v

Causal attention masks key j for query i unless j <= i + (Nk - Nq): the mask is aligned to the end,
so the last query sees every key (decoding against a KV cache); Nq == Nk is the usual training case.

Forward, one program per (query block, batch * head). Keys are visited block by block with an online
softmax in base 2: t = s * log2(e) * q k^T, a running row max m and row sum l (fp32),

    m' = max(m, rowmax t),   l' = l * 2^(m - m') + rowsum 2^(t - m'),
    acc' = acc * 2^(m - m') + 2^(t - m') v,   O = acc / l,   LSE = m + log2(l)

LSE (base 2, fp32, one value per query row) is all the forward saves besides its inputs and output.
Causal programs visit the key blocks every row of the query block sees without any mask, then the
diagonal blocks with the mask; blocks above the diagonal are never visited.

Backward, with dO, recomputing P = 2^(t - LSE) block by block:

    Delta = rowsum(O * dO),  dV = P^T dO,  dP = dO v^T,  dS = P * (dP - Delta),
    dQ = s * dS k,   dK = s * dS^T q

One program per (key block, batch * key/value head) computes dK and dV, looping over the G query
heads of its group, so grouped heads need no atomics; another kernel, one program per (query block,
batch * query head), computes dQ. Every grid is 1-D, block index fastest
(`_block_start_and_batch_head`).
With deterministic=False the dK/dV pass also computes dQ = s * dS k for its key block and adds it
with fp32 atomics into a zeroed buffer (FA2's 5-matmul schedule): one pass, P computed once.

Options, each a constexpr so that the plain kernels compile as without them:

- window (HAS_WINDOW): query i sees key j only if d - left <= j <= d + right, d = i + Nk - Nq
  (causal: right = 0). Each program's loop covers only the key (or query) blocks some row's
  window reaches, unmasked where every row sees the whole block, so the work is O(N * window).
- softcap (SOFTCAP): t' = c * tanh(t / c) on the base-2 scores (c = softcap * log2(e)), tanh from
  exp2; the backward recomputes it and multiplies dS by 1 - tanh^2.
- packed sequences (VARLEN, `flash_attention_varlen`): q, k, v are (total, H, D) views as (1, H,
  total, D); the grid is cdiv(max_seqlen, BLOCK) * (num_seqs * H), each program reads its
  sequence's bounds from cu_seqlens, offsets its pointers by the first row, and returns at once
  when its block starts past the sequence's end. LSE and Delta are (H, total_q).

Forward data movement: on sm_90+ with a Triton that has `tl.make_tensor_descriptor`, q, k, v, o
move through tensor descriptors (TMA), one 2-D [rows, D] view per (batch, head) built on the device;
otherwise (sm_80, older Triton, unaligned views) through masked pointer loads. The choice is made
on the host per call from cached device facts and cheap stride checks (`_use_tensor_descriptors`).

Determinism (deterministic=True, the default): no atomics, and every sum has an order fixed by the
block sizes, so with the same (BLOCK_M, BLOCK_N) configs the output and gradients are bitwise
reproducible. In one process each kernel's config is chosen once per tuning key (`_TUNING_KEY` and
the dtypes) and kept: repeated calls are bitwise equal. Across processes they need not be: on CUDA
the autotuner picks configs by timing, so another run, GPU or Triton version may pick other block
sizes and round differently (equal to rounding, not bitwise). TRITON_CACHE_AUTOTUNING=1 makes later
processes on the same machine reuse the timings stored on disk. The interpreter has a single config.

Precision: fp16/bf16 dots accumulate in fp32. fp32 inputs use TF32 dots on a GPU by default
(`allow_tf32=False` asks for full fp32 dots); Triton's interpreter computes fp32 dots exactly.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fastlm.backend import interpreting, use_triton
from fastlm.kernels._common import (
    check_float,
    check_match,
    empty,
    interpreter_bf16,
    refuse_double_backward,
    tl,
    triton,
)
from fastlm.kernels.rope import check_rope_args, check_rotatable, rope_ref

LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453

#: Head dims the kernels take: multiples of 8 (padded inside to a power of two of at least 16).
MAX_HEAD_DIM = 256

# --------------------------------------------------------------------------------------------
# Reference math (the PyTorch backend, and what the tests and benchmarks compare with)
# --------------------------------------------------------------------------------------------


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


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    *,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """flash_attention's math in PyTorch (the PyTorch backend): GQA by repeating k and v, the
    causal mask aligned to the end. Plain attention goes through scaled_dot_product_attention;
    a window, a cap or the log-sum-exp through explicit scores (fp32 at least), where a row that
    sees no key gets output 0 and lse -inf."""
    Nq, Nk, D = q.shape[2], k.shape[2], q.shape[-1]
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    visible = _visible_keys(Nq, Nk, causal, window_size, q.device)
    if window_size == (-1, -1) and not softcap and not return_lse and Nk > 0:
        if not causal or Nq == Nk:  # SDPA's own causal mask is aligned to the start
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=softmax_scale)
    scale = softmax_scale if softmax_scale is not None else D**-0.5
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if visible is not None:
        scores = scores.masked_fill(~visible, -math.inf)
    # Rows with no key have max -inf: shift them by 0 instead, so that they sum to 0, not NaN.
    shift = scores.new_zeros((*scores.shape[:-1], 1))
    if Nk:
        row_max = scores.detach().amax(-1, keepdim=True)
        shift = row_max.masked_fill(row_max == -math.inf, 0.0)
    e = torch.exp(scores - shift)
    total = e.sum(-1, keepdim=True)
    o = ((e / total.clamp_min(torch.finfo(dtype).tiny)) @ v.to(dtype)).to(q.dtype)
    if not return_lse:
        return o
    return o, (torch.log(total) + shift).squeeze(-1)


def attention_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    *,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """flash_attention_varlen's math in PyTorch: `attention_ref` of each sequence on its own (the
    sequence bounds are read on the host). o (total_q, Hq, D); lse (Hq, total_q)."""
    outs, lses = [], []
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:]):
        o, lse = attention_ref(
            *(t[None].transpose(1, 2) for t in (q[q0:q1], k[k0:k1], v[k0:k1])),
            causal,
            softmax_scale,
            window_size=window_size,
            softcap=softcap,
            return_lse=True,
        )
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    o = torch.cat(outs)
    return (o, torch.cat(lses, dim=1)) if return_lse else o


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


class CudaConfig(NamedTuple):
    """An autotuning candidate on CUDA and the head blocks it takes.

    max_block_d / max_block_d_fp32: the largest BLOCK_D it takes with fp16/bf16 or fp32 inputs
    without spilling registers or needing more shared memory than an H100 or an A100 has, as
    `benchmarks/compile_report.py` reads them off the compiled kernels (0: never).
    options: whether it also takes the option variants (a window, the cap, packed sequences:
    `has_options`) within those limits; False where one of them spills.
    """

    blocks: dict
    num_warps: int
    num_stages: int
    max_block_d: int
    max_block_d_fp32: int
    options: bool = True


#: The constexprs of the option variants: each adds registers to the plain kernels.
OPTION_FLAGS = ("HAS_WINDOW", "SOFTCAP", "VARLEN")


def has_options(args: dict) -> bool:
    """Whether a launch's arguments (by name) compile in an option variant."""
    return any(args.get(flag) for flag in OPTION_FLAGS)


def fitting_configs(
    cuda: list[CudaConfig], block_d: int, element_size: int, options: bool = False
) -> list[CudaConfig]:
    """The configs of a CUDA list that take head blocks of BLOCK_D at this input element size
    (and with `options`, an option variant)."""
    return [
        config
        for config in cuda
        if block_d <= (config.max_block_d_fp32 if element_size == 4 else config.max_block_d)
        and (config.options or not options)
    ]


def _configs(
    interpreter_blocks: dict,
    cuda: list[CudaConfig],
    covers: tuple[int, int] = (MAX_HEAD_DIM, MAX_HEAD_DIM),
) -> list[triton.Config]:
    """One small config under the interpreter (autotuning there runs every config); the CUDA list
    otherwise, which `_prune_to_fitting` cuts down per launch. `covers`: the largest head blocks
    (16-bit, fp32) some config must take: every head dim unless the caller routes the rest
    elsewhere."""
    for block_d, element_size in ((covers[0], 2), (covers[1], 4)):
        assert fitting_configs(cuda, block_d, element_size), "a head dim no config takes"
    if interpreting():
        return [triton.Config(interpreter_blocks, num_warps=4, num_stages=1)]
    return [triton.Config(c.blocks, num_warps=c.num_warps, num_stages=c.num_stages) for c in cuda]


def _prune_to_fitting(cuda: list[CudaConfig]):
    """An autotuner's early_config_prune: the configs that fit the launch's head block and dtype.

    FASTLM_AUTOTUNE=0 keeps only the last of them, the smallest: for test runs, where tuning each
    new shape would compile every config.
    """

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        if interpreting():
            return configs
        fitting = fitting_configs(
            cuda, kwargs["BLOCK_D"], named_args["Q"].element_size(), has_options(kwargs)
        )
        if os.environ.get("FASTLM_AUTOTUNE", "1") == "0":
            fitting = fitting[-1:]
        chosen = {(tuple(c.blocks.items()), c.num_warps, c.num_stages) for c in fitting}
        return [
            c for c in configs if (tuple(c.kwargs.items()), c.num_warps, c.num_stages) in chosen
        ]

    return {"early_config_prune": prune}


def _config(
    block_m: int,
    block_n: int,
    warps: int,
    stages: int,
    max_block_d: int,
    max_block_d_fp32: int,
    options: bool = True,
) -> CudaConfig:
    return CudaConfig(
        {"BLOCK_M": block_m, "BLOCK_N": block_n},
        warps,
        stages,
        max_block_d,
        max_block_d_fp32,
        options,
    )


# Largest first. Hopper-first: 128-row query blocks for head dims up to 128, 64-row blocks (still
# Hopper's wgmma) up to 256; the last config of each dtype is the smallest (FASTLM_AUTOTUNE=0).
# Every config that spilled or overflowed shared memory on sm_90a or sm_80 at a head dim is
# limited below it (compile_report.py's rows); head dim 256 and fp32 leave few configs.
FWD_CUDA_CONFIGS = [
    _config(128, 128, 8, 3, 64, 0),
    _config(128, 64, 4, 3, 64, 0),
    _config(128, 64, 8, 3, 128, 64),
    _config(128, 64, 8, 4, 128, 64),
    _config(64, 64, 4, 3, 128, 0),
    _config(64, 32, 8, 1, 256, 128),
    _config(32, 32, 4, 1, 256, 0),
    _config(32, 32, 8, 1, 0, 256),
]
# dK/dV keep a key block's k, v, dk, dv on chip and stream query blocks past it: its fp32 dk and
# dv accumulators take twice the registers of the forward's one, hence the small key blocks.
DKDV_CUDA_CONFIGS = [
    _config(32, 128, 8, 2, 64, 64),
    _config(32, 64, 4, 3, 128, 0, options=False),  # with the cap: 28 B spilled on sm_80
    _config(16, 64, 4, 2, 128, 64),
    _config(32, 32, 8, 1, 256, 256),
]
# dQ keeps a query block's q, dO, dq on chip and streams key blocks past it.
DQ_CUDA_CONFIGS = [
    _config(128, 64, 8, 3, 128, 0),
    _config(64, 32, 8, 2, 256, 128),
    _config(64, 32, 4, 2, 128, 128),
    _config(32, 32, 4, 1, 256, 128),
    _config(16, 32, 8, 1, 0, 256),
]
_FWD_CONFIGS = _configs({"BLOCK_M": 64, "BLOCK_N": 32}, FWD_CUDA_CONFIGS)
_DKDV_CONFIGS = _configs({"BLOCK_M": 32, "BLOCK_N": 64}, DKDV_CUDA_CONFIGS)
_DQ_CONFIGS = _configs({"BLOCK_M": 64, "BLOCK_N": 32}, DQ_CUDA_CONFIGS)
# Tuned per power-of-two bucket of the sequence lengths, so a growing KV cache does not retune;
# a window, the cap or packed sequences change the work per block, so they are tuned apart.
_TUNING_KEY = [
    "q_bucket",
    "k_bucket",
    "BLOCK_D",
    "CAUSAL",
    "HAS_WINDOW",
    "SOFTCAP",
    "VARLEN",
    "DOT_PRECISION",
]


@triton.jit
def _load_tile(
    ptrs,
    rows,
    n_rows,
    cols,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
    TO_FP32: tl.constexpr,
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
def _store_tile(ptrs, tile, rows, n_rows, cols, HEAD_DIM: tl.constexpr):
    tl.store(
        ptrs,
        tile.to(ptrs.dtype.element_ty),
        mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM),
    )


@triton.jit
def _block_start_and_batch_head(n_rows, BLOCK: tl.constexpr, LAST_BLOCK_FIRST: tl.constexpr):
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


@triton.jit
def _tanh(x):
    """tanh through exp2 (the interpreter has no tanh): e = e^(-2|x|) lies in (0, 1], so no
    overflow at any |x|."""
    e = tl.math.exp2(-2.8853900817779268 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _capped(t, softcap):
    """softcap * tanh(t / softcap) of base-2 scores t (softcap in base-2 units too: the cap of the
    natural scores times log2(e)) and its derivative 1 - tanh^2, which the backward needs."""
    th = _tanh(t * (1.0 / softcap))
    return softcap * th, 1.0 - th * th


@triton.jit
def _sequence(CU_SEQLENS, index, n_rows, VARLEN: tl.constexpr):
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
def _stats_offset(batch_head, head, n_q, q_start, total_q, VARLEN: tl.constexpr):
    """Where a (sequence, head)'s first row lies in the fp32 row statistics (LSE, Delta): (B, H,
    Nq) contiguous, or with VARLEN (H, total_q) with the sequences packed along the rows."""
    offset = batch_head.to(tl.int64) * n_q
    if VARLEN:
        offset = head * total_q + q_start
    return offset


@triton.jit
def _visible(
    rows,
    cols,
    n_k,
    causal_shift,
    window_left,
    window_right,
    CHECK_COLS: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
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
def _key_range(
    start_m,
    n_k,
    causal_shift,
    window_left,
    window_right,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """(lo, full_lo, full_hi, hi) for the query block [start_m, start_m + BLOCK_M): every row sees
    the whole of the key blocks starting in [full_lo, full_hi), no row sees a key outside [lo, hi),
    and the blocks starting in [lo, full_lo) and [full_hi, hi) need the mask. lo, full_lo and
    full_hi are multiples of BLOCK_N; keys outside [lo, hi) are never visited (a window's work is
    O(window), not O(n_k)). Bounds are clamped at 0 before a division: Triton's rounds to zero."""
    lo = 0
    full_lo = 0
    if HAS_WINDOW:
        first = start_m + causal_shift  # the diagonal of the block's first row
        last = first + BLOCK_M - 1
        lo = tl.maximum(first - window_left, 0) // BLOCK_N * BLOCK_N
        hi = tl.minimum(last + window_right + 1, n_k)
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
def _query_range(
    start_n,
    n_q,
    n_k,
    causal_shift,
    window_left,
    window_right,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
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


@triton.jit
def _online_softmax_step(
    acc,
    m_i,
    l_i,
    q,
    k,
    v,
    offs_m,
    offs_n,
    n_k,
    causal_shift,
    qk_scale,
    window_left,
    window_right,
    softcap,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SCALE_POSITIVE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """(acc, m_i, l_i) after one key block k, v (rows offs_n); m_i is in scaled (base-2) units.

    With a positive scale the row max is taken on the unscaled scores (the max commutes with the
    scaling) and each score is scaled and shifted by one FMA, qk * qk_scale - m. A zero or
    negative scale (allowed, never hot) and SOFTCAP scale first. MASKED blocks may hold keys >= n_k
    or (CAUSAL, HAS_WINDOW) keys some rows must not see.
    """
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
    if SOFTCAP:
        qk, _ = _capped(qk * qk_scale, softcap)
        fma_scale = 1.0
    elif SCALE_POSITIVE:
        fma_scale = qk_scale
    else:
        qk = qk * qk_scale
        fma_scale = 1.0
    if MASKED:
        visible = _visible(
            offs_m[:, None],
            offs_n[None, :],
            n_k,
            causal_shift,
            window_left,
            window_right,
            True,
            CAUSAL,
            HAS_WINDOW,
        )
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * fma_scale)
    # A row that has seen no key yet keeps m = -inf; subtract 0 so that 2^(-inf - -inf) is not NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk * fma_scale - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _fwd_key_blocks(
    acc,
    m_i,
    l_i,
    q,
    K_head,
    V_head,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    offs_m,
    offs_d,
    lo,
    hi,
    n_k,
    causal_shift,
    qk_scale,
    window_left,
    window_right,
    softcap,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    TO_FP32: tl.constexpr,
    SCALE_POSITIVE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update of (acc, m_i, l_i) with the key blocks starting in [lo, hi),
    loaded through pointers."""
    offs_n = lo + tl.arange(0, BLOCK_N)
    k_ptrs = K_head + offs_n.to(tl.int64)[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V_head + offs_n.to(tl.int64)[:, None] * stride_vn + offs_d[None, :] * stride_vd
    for _ in range(lo, hi, BLOCK_N):
        k = _load_tile(k_ptrs, offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, MASKED, TO_FP32)
        v = _load_tile(v_ptrs, offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, MASKED, TO_FP32)
        acc, m_i, l_i = _online_softmax_step(
            acc,
            m_i,
            l_i,
            q,
            k,
            v,
            offs_m,
            offs_n,
            n_k,
            causal_shift,
            qk_scale,
            window_left,
            window_right,
            softcap,
            MASKED,
            CAUSAL,
            HAS_WINDOW,
            SOFTCAP,
            SCALE_POSITIVE,
            DOT_PRECISION,
        )
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
        offs_n += BLOCK_N
    return acc, m_i, l_i


@triton.autotune(
    configs=_FWD_CONFIGS, key=_TUNING_KEY, prune_configs_by=_prune_to_fitting(FWD_CUDA_CONFIGS)
)
@triton.jit
def _attention_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    CU_SEQLENS_Q,
    CU_SEQLENS_K,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    num_heads,
    group,
    n_q,
    n_k,
    qk_scale,
    total_q,
    window_left,
    window_right,
    softcap,
    q_bucket,
    k_bucket,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr,
    TO_FP32: tl.constexpr,
    SCALE_POSITIVE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """With VARLEN the batch index walks the sequences of cu_seqlens (the launcher passes batch
    strides of 0), n_q and n_k are the longest sequences' lengths, and a block past its
    sequence's end returns at once."""
    start_m, batch_head = _block_start_and_batch_head(n_q, BLOCK_M, CAUSAL)
    batch = (batch_head // num_heads).to(tl.int64)
    head = (batch_head % num_heads).to(tl.int64)
    kv_head = head // group
    q_start, n_q = _sequence(CU_SEQLENS_Q, batch, n_q, VARLEN)
    k_start, n_k = _sequence(CU_SEQLENS_K, batch, n_k, VARLEN)
    if VARLEN and start_m >= n_q:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    q_ptrs = (
        Q
        + batch * stride_qb
        + head * stride_qh
        + q_start * stride_qm
        + offs_m.to(tl.int64)[:, None] * stride_qm
        + offs_d[None, :] * stride_qd
    )
    q = _load_tile(
        q_ptrs, offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True, TO_FP32
    )  # (BLOCK_M, BLOCK_D)
    K_head = K + batch * stride_kb + kv_head * stride_kh + k_start * stride_kn
    V_head = V + batch * stride_vb + kv_head * stride_vh + k_start * stride_vn

    acc, m_i, l_i, causal_shift, lo, full_lo, full_hi, hi = _fwd_start(
        start_m, n_q, n_k, window_left, window_right, CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N, BLOCK_D
    )
    # The key range in three phases (`_key_range`): the window's far edge (masked; without a
    # window lo = full_lo = 0), the blocks every row sees whole, then the diagonal and the end.
    bounds = (lo, full_lo, full_hi, hi)
    for phase in tl.static_range(0 if HAS_WINDOW else 1, 3):
        acc, m_i, l_i = _fwd_key_blocks(
            acc,
            m_i,
            l_i,
            q,
            K_head,
            V_head,
            stride_kn,
            stride_kd,
            stride_vn,
            stride_vd,
            offs_m,
            offs_d,
            bounds[phase],
            bounds[phase + 1],
            n_k,
            causal_shift,
            qk_scale,
            window_left,
            window_right,
            softcap,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_N,
            phase != 1,
            CAUSAL,
            HAS_WINDOW,
            SOFTCAP,
            TO_FP32,
            SCALE_POSITIVE,
            DOT_PRECISION,
        )

    o, lse = _fwd_finish(acc, m_i, l_i)
    o_ptrs = (
        O
        + batch * stride_ob
        + head * stride_oh
        + q_start * stride_om
        + offs_m.to(tl.int64)[:, None] * stride_om
        + offs_d[None, :] * stride_od
    )
    _store_tile(o_ptrs, o, offs_m, n_q, offs_d, HEAD_DIM)
    stats = _stats_offset(batch_head, head, n_q, q_start, total_q, VARLEN)
    tl.store(LSE + stats + offs_m, lse, mask=offs_m < n_q)


@triton.jit
def _fwd_start(
    start_m,
    n_q,
    n_k,
    window_left,
    window_right,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The online softmax's empty state (acc, m_i, l_i), the causal shift Nk - Nq, and the query
    block's key range (lo, full_lo, full_hi, hi) (`_key_range`)."""
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    causal_shift = n_k - n_q
    lo, full_lo, full_hi, hi = _key_range(
        start_m, n_k, causal_shift, window_left, window_right, CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N
    )
    return acc, m_i, l_i, causal_shift, lo, full_lo, full_hi, hi


@triton.jit
def _fwd_finish(acc, m_i, l_i):
    """O and the base-2 LSE of each row. A row that saw no key (l = 0) gets O = 0 and LSE = +inf,
    so the backward's P = 2^(t - LSE) is 0."""
    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("inf"))
    return o, lse


@triton.jit
def _fwd_key_blocks_tma(
    acc,
    m_i,
    l_i,
    q,
    k_desc,
    v_desc,
    offs_m,
    lo,
    hi,
    n_k,
    causal_shift,
    qk_scale,
    window_left,
    window_right,
    softcap,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    TO_FP32: tl.constexpr,
    SCALE_POSITIVE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """_fwd_key_blocks with k and v read through tensor descriptors (TMA on sm_90+): rows past
    the head's n_k and the head-dim padding come back as zeros, with no masks to compute."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = k_desc.load([start_n, 0])
        v = v_desc.load([start_n, 0])
        if TO_FP32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = _online_softmax_step(
            acc,
            m_i,
            l_i,
            q,
            k,
            v,
            offs_m,
            offs_n,
            n_k,
            causal_shift,
            qk_scale,
            window_left,
            window_right,
            softcap,
            MASKED,
            CAUSAL,
            HAS_WINDOW,
            SOFTCAP,
            SCALE_POSITIVE,
            DOT_PRECISION,
        )
    return acc, m_i, l_i


@triton.jit
def _attention_fwd_tma_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    CU_SEQLENS_Q,
    CU_SEQLENS_K,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_om,
    num_heads,
    group,
    n_q,
    n_k,
    qk_scale,
    total_q,
    window_left,
    window_right,
    softcap,
    q_bucket,
    k_bucket,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr,
    TO_FP32: tl.constexpr,
    SCALE_POSITIVE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The forward with q, k, v, o moved by tensor descriptors, one 2-D [rows, HEAD_DIM] view per
    (batch, head) with unit last stride: any row stride, so a packed q|k|v (row stride 3C) is read
    in place. Out-of-bounds rows and columns load as zeros; their stores are dropped. With VARLEN
    each view is one sequence's rows, so the next sequence's rows read as zeros too."""
    start_m, batch_head = _block_start_and_batch_head(n_q, BLOCK_M, CAUSAL)
    batch = (batch_head // num_heads).to(tl.int64)
    head = (batch_head % num_heads).to(tl.int64)
    kv_head = head // group
    q_start, n_q = _sequence(CU_SEQLENS_Q, batch, n_q, VARLEN)
    k_start, n_k = _sequence(CU_SEQLENS_K, batch, n_k, VARLEN)
    if VARLEN and start_m >= n_q:
        return
    q_desc = tl.make_tensor_descriptor(
        Q + batch * stride_qb + head * stride_qh + q_start * stride_qm,
        [n_q, HEAD_DIM],
        [stride_qm, 1],
        [BLOCK_M, BLOCK_D],
    )
    k_rows = n_k
    if VARLEN:  # a sequence without keys: a descriptor needs a row (its loop reads none)
        k_rows = tl.maximum(n_k, 1)
    k_desc = tl.make_tensor_descriptor(
        K + batch * stride_kb + kv_head * stride_kh + k_start * stride_kn,
        [k_rows, HEAD_DIM],
        [stride_kn, 1],
        [BLOCK_N, BLOCK_D],
    )
    v_desc = tl.make_tensor_descriptor(
        V + batch * stride_vb + kv_head * stride_vh + k_start * stride_vn,
        [k_rows, HEAD_DIM],
        [stride_vn, 1],
        [BLOCK_N, BLOCK_D],
    )
    o_desc = tl.make_tensor_descriptor(
        O + batch * stride_ob + head * stride_oh + q_start * stride_om,
        [n_q, HEAD_DIM],
        [stride_om, 1],
        [BLOCK_M, BLOCK_D],
    )
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = q_desc.load([start_m, 0])
    if TO_FP32:
        q = q.to(tl.float32)

    acc, m_i, l_i, causal_shift, lo, full_lo, full_hi, hi = _fwd_start(
        start_m, n_q, n_k, window_left, window_right, CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N, BLOCK_D
    )
    # The three phases of the pointer kernel; only the unmasked one may be warp-specialised.
    bounds = (lo, full_lo, full_hi, hi)
    for phase in tl.static_range(0 if HAS_WINDOW else 1, 3):
        acc, m_i, l_i = _fwd_key_blocks_tma(
            acc,
            m_i,
            l_i,
            q,
            k_desc,
            v_desc,
            offs_m,
            bounds[phase],
            bounds[phase + 1],
            n_k,
            causal_shift,
            qk_scale,
            window_left,
            window_right,
            softcap,
            BLOCK_N,
            phase != 1,
            CAUSAL,
            HAS_WINDOW,
            SOFTCAP,
            TO_FP32,
            SCALE_POSITIVE,
            DOT_PRECISION,
            WARP_SPECIALIZE and phase == 1,
        )

    o, lse = _fwd_finish(acc, m_i, l_i)
    o_desc.store([start_m, 0], o.to(o_desc.dtype))
    stats = _stats_offset(batch_head, head, n_q, q_start, total_q, VARLEN)
    tl.store(LSE + stats + offs_m, lse, mask=offs_m < n_q)


# The descriptor forward's own list (the pointer list's shapes: TMA moves the same tiles). Each
# compiled for sm_90a without spills at bf16 head dims 64 and 128 (ptxas -v, Triton 3.9); fp32 and
# head dims above 128 were not checked, so `_use_tensor_descriptors` sends them to the pointer path.
TMA_MAX_BLOCK_D = 128
FWD_TMA_CUDA_CONFIGS = [
    _config(128, 64, 4, 2, 128, 0, options=False),  # a window, the cap or varlen spill (sm_90a)
    _config(128, 64, 4, 3, 128, 0, options=False),
    _config(128, 64, 8, 2, 128, 0),
    _config(128, 64, 8, 3, 128, 0),
    _config(128, 128, 8, 2, 128, 0),
    _config(64, 64, 4, 3, 128, 0),
    _config(64, 32, 4, 2, 128, 0),
]
_FWD_TMA_CONFIGS = _configs(
    {"BLOCK_M": 64, "BLOCK_N": 32}, FWD_TMA_CUDA_CONFIGS, covers=(TMA_MAX_BLOCK_D, 0)
)
_attention_fwd_tma_autotuned = triton.autotune(
    configs=_FWD_TMA_CONFIGS,
    key=_TUNING_KEY,
    prune_configs_by=_prune_to_fitting(FWD_TMA_CUDA_CONFIGS),
)(_attention_fwd_tma_kernel)


@triton.jit
def _attention_bwd_delta_kernel(
    O,
    DO,
    DELTA,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    num_heads,
    n_q,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Delta = rowsum(O * dO) in fp32, one value per query row."""
    start_m, batch_head = _block_start_and_batch_head(n_q, BLOCK_M, False)
    batch = (batch_head // num_heads).to(tl.int64)
    head = (batch_head % num_heads).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_m.to(tl.int64)[:, None]
    o = _load_tile(
        O + batch * stride_ob + head * stride_oh + rows * stride_om + offs_d[None, :] * stride_od,
        offs_m,
        n_q,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
        True,
        True,
    )
    do = _load_tile(
        DO
        + batch * stride_dob
        + head * stride_doh
        + rows * stride_dom
        + offs_d[None, :] * stride_dod,
        offs_m,
        n_q,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
        True,
        True,
    )
    tl.store(DELTA + batch_head.to(tl.int64) * n_q + offs_m, tl.sum(o * do, 1), mask=offs_m < n_q)


@triton.jit
def _dkdv_query_blocks(
    dk,
    dv,
    k,
    v,
    Q_head,
    DO_head,
    LSE_head,
    DELTA_head,
    DQ_head,
    stride_qm,
    stride_qd,
    stride_dom,
    stride_dod,
    stride_dqm,
    stride_dqd,
    offs_n,
    offs_d,
    lo,
    hi,
    n_q,
    n_k,
    causal_shift,
    softmax_scale,
    qk_scale,
    window_left,
    window_right,
    softcap,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    TO_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
):
    """Add to (dk, dv) of one key block the query blocks starting in [lo, hi) of one query head;
    with ATOMIC_DQ also add this key block's share of dq, s * dS k, to the fp32 DQ_head. MASKED:
    some of these queries must not see some of the keys (CAUSAL, HAS_WINDOW, or keys past n_k in
    a partial key block: `_query_range`)."""
    offs_m = lo + tl.arange(0, BLOCK_M)
    dq_ptrs = DQ_head + offs_m.to(tl.int64)[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
    q_ptrs = Q_head + offs_m.to(tl.int64)[:, None] * stride_qm + offs_d[None, :] * stride_qd
    do_ptrs = DO_head + offs_m.to(tl.int64)[:, None] * stride_dom + offs_d[None, :] * stride_dod
    for _ in range(lo, hi, BLOCK_M):
        q = _load_tile(q_ptrs, offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, CHECK_ROWS, TO_FP32)
        do = _load_tile(do_ptrs, offs_m, n_q, offs_d, HEAD_DIM, BLOCK_D, CHECK_ROWS, TO_FP32)
        if CHECK_ROWS:  # rows past n_q: q = dO = 0 and LSE = inf give P = dS = 0
            lse = tl.load(LSE_head + offs_m, mask=offs_m < n_q, other=float("inf"))
            delta = tl.load(DELTA_head + offs_m, mask=offs_m < n_q, other=0.0)
        else:
            lse = tl.load(LSE_head + offs_m)
            delta = tl.load(DELTA_head + offs_m)
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        scores = qk_t * qk_scale
        if SOFTCAP:
            scores, dcap = _capped(scores, softcap)
        exponent = scores - lse[None, :]
        if MASKED:  # mask the exponent: 2^(t - LSE) of a key a query must not see may overflow
            visible = _visible(
                offs_m[None, :],
                offs_n[:, None],
                n_k,
                causal_shift,
                window_left,
                window_right,
                HAS_WINDOW or not CAUSAL,
                CAUSAL,
                HAS_WINDOW,
            )
            exponent = tl.where(visible, exponent, float("-inf"))
        p_t = tl.math.exp2(exponent)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:  # through the cap: d(cap tanh(s / cap)) / ds = 1 - tanh^2
            ds_t = ds_t * dcap
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
        if ATOMIC_DQ:  # the fifth matmul: other key blocks add to the same rows, in any order
            dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=DOT_PRECISION)
            tl.atomic_add(
                dq_ptrs,
                dq * softmax_scale,
                sem="relaxed",
                mask=(offs_m[:, None] < n_q) & (offs_d[None, :] < HEAD_DIM),
            )
            dq_ptrs += BLOCK_M * stride_dqm
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
        offs_m += BLOCK_M
    return dk, dv


@triton.autotune(
    configs=_DKDV_CONFIGS, key=_TUNING_KEY, prune_configs_by=_prune_to_fitting(DKDV_CUDA_CONFIGS)
)
@triton.jit
def _attention_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    DK,
    DV,
    DQ,
    LSE,
    DELTA,
    CU_SEQLENS_Q,
    CU_SEQLENS_K,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dkd,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_dvd,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_dqd,
    num_kv_heads,
    group,
    n_q,
    n_k,
    softmax_scale,
    qk_scale,
    total_q,
    window_left,
    window_right,
    softcap,
    q_bucket,
    k_bucket,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr,
    TO_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dK and dV of one key block; with ATOMIC_DQ also dQ, added with fp32 atomics into a zeroed
    DQ (FA2's 5-matmul schedule: one pass, no dQ kernel, sums in no fixed order). Without it
    DQ is unused. VARLEN as in the forward."""
    # In order: the first key blocks, seen by the most causal queries, are already the longest.
    start_n, batch_kv_head = _block_start_and_batch_head(n_k, BLOCK_N, False)
    batch = (batch_kv_head // num_kv_heads).to(tl.int64)
    kv_head = (batch_kv_head % num_kv_heads).to(tl.int64)
    q_start, n_q = _sequence(CU_SEQLENS_Q, batch, n_q, VARLEN)
    k_start, n_k = _sequence(CU_SEQLENS_K, batch, n_k, VARLEN)
    if VARLEN and start_n >= n_k:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_n.to(tl.int64)[:, None]
    k = _load_tile(
        K
        + batch * stride_kb
        + kv_head * stride_kh
        + k_start * stride_kn
        + rows * stride_kn
        + offs_d[None, :] * stride_kd,
        offs_n,
        n_k,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
        True,
        TO_FP32,
    )  # (BLOCK_N, BLOCK_D)
    v = _load_tile(
        V
        + batch * stride_vb
        + kv_head * stride_vh
        + k_start * stride_vn
        + rows * stride_vn
        + offs_d[None, :] * stride_vd,
        offs_n,
        n_k,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
        True,
        TO_FP32,
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    causal_shift = n_k - n_q
    lo, full_lo, full_hi, hi = _query_range(
        start_n,
        n_q,
        n_k,
        causal_shift,
        window_left,
        window_right,
        CAUSAL,
        HAS_WINDOW,
        BLOCK_M,
        BLOCK_N,
    )
    # Three phases (`_query_range`): queries that see part of the block, whole blocks of queries
    # that see all of it, then rows past n_q and queries that see part of it.
    starts = (lo, full_lo, full_hi)
    ends = (tl.minimum(full_lo, hi), full_hi, hi)
    masked = (CAUSAL or HAS_WINDOW, False, HAS_WINDOW or not CAUSAL)
    # Grouped heads: sum over the group's query heads here, in a fixed order, instead of atomics.
    for g in range(group):
        head = kv_head * group + g
        Q_head = Q + batch * stride_qb + head * stride_qh + q_start * stride_qm
        DO_head = DO + batch * stride_dob + head * stride_doh + q_start * stride_dom
        stats = _stats_offset(
            batch * num_kv_heads * group + head, head, n_q, q_start, total_q, VARLEN
        )
        LSE_head = LSE + stats
        DELTA_head = DELTA + stats
        DQ_head = DQ + batch * stride_dqb + head * stride_dqh + q_start * stride_dqm
        for phase in tl.static_range(3):
            dk, dv = _dkdv_query_blocks(
                dk,
                dv,
                k,
                v,
                Q_head,
                DO_head,
                LSE_head,
                DELTA_head,
                DQ_head,
                stride_qm,
                stride_qd,
                stride_dom,
                stride_dod,
                stride_dqm,
                stride_dqd,
                offs_n,
                offs_d,
                starts[phase],
                ends[phase],
                n_q,
                n_k,
                causal_shift,
                softmax_scale,
                qk_scale,
                window_left,
                window_right,
                softcap,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_M,
                phase != 1,
                masked[phase],
                CAUSAL,
                HAS_WINDOW,
                SOFTCAP,
                TO_FP32,
                DOT_PRECISION,
                ATOMIC_DQ,
            )

    dk_ptrs = (
        DK
        + batch * stride_dkb
        + kv_head * stride_dkh
        + k_start * stride_dkn
        + rows * stride_dkn
        + offs_d[None, :] * stride_dkd
    )
    dv_ptrs = (
        DV
        + batch * stride_dvb
        + kv_head * stride_dvh
        + k_start * stride_dvn
        + rows * stride_dvn
        + offs_d[None, :] * stride_dvd
    )
    _store_tile(dk_ptrs, dk * softmax_scale, offs_n, n_k, offs_d, HEAD_DIM)
    _store_tile(dv_ptrs, dv, offs_n, n_k, offs_d, HEAD_DIM)


# The atomic schedule's one backward pass holds a dq tile besides dk, dv, k and v, so it fits
# narrower query blocks than the deterministic pass. Each config takes the head blocks it compiles
# for without spills (compile_report.py, sm_90a). At head block 256 even the smallest spills (44 B
# bf16, 916 B fp32), so larger head dims take the deterministic schedule (`_attention_backward`).
ATOMIC_MAX_BLOCK_D = 128
DKDV_DQ_CUDA_CONFIGS = [
    _config(32, 128, 8, 2, 64, 0),
    _config(16, 64, 4, 2, 64, 0),
    _config(16, 64, 8, 2, 128, 0),
    _config(16, 32, 4, 1, ATOMIC_MAX_BLOCK_D, ATOMIC_MAX_BLOCK_D),
]
_DKDV_DQ_CONFIGS = _configs(
    {"BLOCK_M": 32, "BLOCK_N": 64},
    DKDV_DQ_CUDA_CONFIGS,
    covers=(ATOMIC_MAX_BLOCK_D, ATOMIC_MAX_BLOCK_D),
)
_attention_bwd_dkdv_dq_kernel = triton.autotune(
    configs=_DKDV_DQ_CONFIGS,
    key=_TUNING_KEY,
    reset_to_zero=["DQ"],
    prune_configs_by=_prune_to_fitting(DKDV_DQ_CUDA_CONFIGS),
)(_attention_bwd_dkdv_kernel.fn)


@triton.jit
def _dq_key_blocks(
    dq,
    q,
    do,
    lse,
    delta,
    K_head,
    V_head,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    offs_m,
    offs_d,
    lo,
    hi,
    n_k,
    causal_shift,
    qk_scale,
    window_left,
    window_right,
    softcap,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    TO_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Add to dq of one query block the key blocks starting in [lo, hi) (MASKED as in the
    forward)."""
    offs_n = lo + tl.arange(0, BLOCK_N)
    k_ptrs = K_head + offs_n.to(tl.int64)[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V_head + offs_n.to(tl.int64)[:, None] * stride_vn + offs_d[None, :] * stride_vd
    for _ in range(lo, hi, BLOCK_N):
        k = _load_tile(k_ptrs, offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, MASKED, TO_FP32)
        v = _load_tile(v_ptrs, offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, MASKED, TO_FP32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        scores = qk * qk_scale
        if SOFTCAP:
            scores, dcap = _capped(scores, softcap)
        exponent = scores - lse[:, None]
        if MASKED:  # mask the exponent: 2^(t - LSE) of a hidden or padded key may overflow
            visible = _visible(
                offs_m[:, None],
                offs_n[None, :],
                n_k,
                causal_shift,
                window_left,
                window_right,
                True,
                CAUSAL,
                HAS_WINDOW,
            )
            exponent = tl.where(visible, exponent, float("-inf"))
        p = tl.math.exp2(exponent)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * dcap
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
        offs_n += BLOCK_N
    return dq


@triton.autotune(
    configs=_DQ_CONFIGS, key=_TUNING_KEY, prune_configs_by=_prune_to_fitting(DQ_CUDA_CONFIGS)
)
@triton.jit
def _attention_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    DQ,
    LSE,
    DELTA,
    CU_SEQLENS_Q,
    CU_SEQLENS_K,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_dqd,
    num_heads,
    group,
    n_q,
    n_k,
    softmax_scale,
    qk_scale,
    total_q,
    window_left,
    window_right,
    softcap,
    q_bucket,
    k_bucket,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr,
    TO_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    start_m, batch_head = _block_start_and_batch_head(n_q, BLOCK_M, CAUSAL)
    batch = (batch_head // num_heads).to(tl.int64)
    head = (batch_head % num_heads).to(tl.int64)
    kv_head = head // group
    q_start, n_q = _sequence(CU_SEQLENS_Q, batch, n_q, VARLEN)
    k_start, n_k = _sequence(CU_SEQLENS_K, batch, n_k, VARLEN)
    if VARLEN and start_m >= n_q:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_m.to(tl.int64)[:, None]
    q = _load_tile(
        Q
        + batch * stride_qb
        + head * stride_qh
        + q_start * stride_qm
        + rows * stride_qm
        + offs_d[None, :] * stride_qd,
        offs_m,
        n_q,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
        True,
        TO_FP32,
    )  # (BLOCK_M, BLOCK_D)
    do = _load_tile(
        DO
        + batch * stride_dob
        + head * stride_doh
        + q_start * stride_dom
        + rows * stride_dom
        + offs_d[None, :] * stride_dod,
        offs_m,
        n_q,
        offs_d,
        HEAD_DIM,
        BLOCK_D,
        True,
        TO_FP32,
    )
    row_stats = _stats_offset(batch_head, head, n_q, q_start, total_q, VARLEN) + offs_m
    lse = tl.load(LSE + row_stats, mask=offs_m < n_q, other=float("inf"))
    delta = tl.load(DELTA + row_stats, mask=offs_m < n_q, other=0.0)
    K_head = K + batch * stride_kb + kv_head * stride_kh + k_start * stride_kn
    V_head = V + batch * stride_vb + kv_head * stride_vh + k_start * stride_vn

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    causal_shift = n_k - n_q
    lo, full_lo, full_hi, hi = _key_range(
        start_m, n_k, causal_shift, window_left, window_right, CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N
    )
    # The forward's three phases.
    bounds = (lo, full_lo, full_hi, hi)
    for phase in tl.static_range(0 if HAS_WINDOW else 1, 3):
        dq = _dq_key_blocks(
            dq,
            q,
            do,
            lse,
            delta,
            K_head,
            V_head,
            stride_kn,
            stride_kd,
            stride_vn,
            stride_vd,
            offs_m,
            offs_d,
            bounds[phase],
            bounds[phase + 1],
            n_k,
            causal_shift,
            qk_scale,
            window_left,
            window_right,
            softcap,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_N,
            phase != 1,
            CAUSAL,
            HAS_WINDOW,
            SOFTCAP,
            TO_FP32,
            DOT_PRECISION,
        )
    dq_ptrs = (
        DQ
        + batch * stride_dqb
        + head * stride_dqh
        + q_start * stride_dqm
        + rows * stride_dqm
        + offs_d[None, :] * stride_dqd
    )
    _store_tile(dq_ptrs, dq * softmax_scale, offs_m, n_q, offs_d, HEAD_DIM)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _empty_heads_like(t: torch.Tensor, dtype=None) -> torch.Tensor:
    """An output shaped like `t` (B, H, N, D), in t's token-major [B, N, H, D] memory layout when t
    is a transposed view of one, so that the caller's `transpose(1, 2).reshape(B, N, H * D)` is
    free."""
    B, H, N, D = t.shape
    dtype = dtype or t.dtype
    if t.stride(1) < t.stride(2):
        return empty((B, N, H, D), device=t.device, dtype=dtype).transpose(1, 2)
    return empty((B, H, N, D), device=t.device, dtype=dtype)


def _grid(n_rows: int, block: str, batch_heads: int):
    """The 1-D grid `_block_start_and_batch_head` decomposes: cdiv(n_rows, BLOCK) * (B * H)
    programs,
    BLOCK the launch's (possibly autotuned) block size named `block`."""
    return lambda meta: (triton.cdiv(n_rows, meta[block]) * batch_heads,)


def _bucket(n: int) -> int:
    return triton.next_power_of_2(n)


def _kernel_flags(q: torch.Tensor, causal: bool, allow_tf32: bool) -> dict:
    """Compile-time arguments shared by the forward and backward kernels."""
    head_dim = q.shape[-1]
    full_fp32 = q.dtype == torch.float32 and not allow_tf32
    return dict(
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        CAUSAL=causal,
        TO_FP32=interpreter_bf16(q.dtype),
        DOT_PRECISION="ieee" if full_fp32 else "tf32",
    )


# Tensor descriptors (TMA on sm_90+) for the forward: FASTLM_ATTENTION_TMA=1 forces them wherever
# this Triton has them (the interpreter too, which is how the tests run both paths), 0 forbids
# them; unset, they are used on CUDA devices of capability 9 or more. Read at each call.
_HAS_TENSOR_DESCRIPTORS = hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")
# Warp specialisation of the descriptor forward's unmasked key loop (`tl.range(...,
# warp_specialize=True)`) is off: with Triton 3.9 for sm_90a it aborts in the
# NVGPUWarpSpecialization pass at 4 warps, and at 8 warps compiles to the same kernel as without
# it (no setmaxnreg, equal registers): no producer/consumer split on Hopper yet.
_WARP_SPECIALIZE = False


@functools.cache
def _device_has_tma(device: torch.device) -> bool:
    """Once per device: a CUDA GPU of compute capability 9.0 or more."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _descriptor_allocator(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for descriptors built on the device (Triton asks through set_allocator)."""
    return torch.empty(size, dtype=torch.uint8, device=_descriptor_allocator.device)


def _use_tensor_descriptors(*tensors: torch.Tensor) -> bool:
    """Whether the forward takes the descriptor path for these (q, k, v, o): the device and this
    Triton can, and every tensor has a unit last stride and 16-byte aligned base and strides
    (what a TMA descriptor requires); otherwise the pointer path."""
    mode = os.environ.get("FASTLM_ATTENTION_TMA", "")
    if mode == "0" or not _HAS_TENSOR_DESCRIPTORS:
        return False
    q = tensors[0]
    # The descriptor configs were checked spill-free for 16-bit head dims up to 128 only (the
    # interpreter, where tests force the path, has no registers to spill).
    if not interpreting() and (q.element_size() != 2 or q.shape[-1] > TMA_MAX_BLOCK_D):
        return False
    if mode != "1" and (interpreting() or not _device_has_tma(tensors[0].device)):
        return False
    for t in tensors:
        size = t.element_size()
        if (
            t.stride(-1) != 1
            or t.data_ptr() % 16
            or any(stride * size % 16 for stride in t.stride()[:-1])
        ):
            return False
    if getattr(_descriptor_allocator, "device", None) != tensors[0].device:
        _descriptor_allocator.device = tensors[0].device
        triton.set_allocator(_descriptor_allocator)
    return True


class Varlen(NamedTuple):
    """Packed sequences for the launchers: q, k, v are (1, H, total, D) views of the packed
    (total, H, D) tensors, and sequence i holds rows cu_seqlens_*[i] to cu_seqlens_*[i + 1]
    (int32 on the device), none longer than max_seqlen_*."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def _sequence_args(q, k, varlen: Varlen | None) -> tuple:
    """(cu_seqlens_q, cu_seqlens_k, sequences, n_q, n_k): what the kernels index by batch. n_q,
    n_k: the (longest) sequence lengths, which size the grids and the tuning buckets."""
    if varlen is None:
        return None, None, q.shape[0], q.shape[2], k.shape[2]
    return (
        varlen.cu_seqlens_q,
        varlen.cu_seqlens_k,
        varlen.cu_seqlens_q.numel() - 1,
        varlen.max_seqlen_q,
        varlen.max_seqlen_k,
    )


def _strides(t: torch.Tensor, varlen: Varlen | None) -> tuple:
    """t's strides for a kernel; packed sequences start at their rows, not at a batch stride."""
    return (0, *t.stride()[1:]) if varlen is not None else t.stride()


def _mask_args(causal: bool, window: tuple[int, int], softcap: float, n_q: int, n_k: int):
    """(window_left, window_right, softcap) as the kernels take them, and their flags.

    A window side of -1 (unbounded) becomes one that reaches every key (n_k to the left, n_q to
    the right: every diagonal lies in [n_k - n_q, n_k)); causal makes the right side 0. The cap
    goes into base-2 units. HAS_WINDOW only when a side bounds more than the causal mask does, so
    the plain causal and full kernels stay as they are.
    """
    left, right = window
    has_window = left >= 0 or (right >= 0 and not causal)
    if causal:
        right = 0
    args = (left if left >= 0 else n_k, right if right >= 0 else n_q, softcap * LOG2_E)
    return args, dict(HAS_WINDOW=has_window, SOFTCAP=softcap > 0)


def _attention_forward(
    q,
    k,
    v,
    causal: bool,
    softmax_scale: float,
    allow_tf32: bool,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    varlen: Varlen | None = None,
):
    """o (B, Hq, Nq, D) and the base-2 log-sum-exp (B, Hq, Nq) fp32 of checked inputs (a row
    that sees no key: o = 0, lse = +inf)."""
    B, Hq, Nq, _ = q.shape
    Hkv = k.shape[1]
    cu_q, cu_k, sequences, n_q, n_k = _sequence_args(q, k, varlen)
    o = _empty_heads_like(q)
    lse = empty((B, Hq, Nq), device=q.device, dtype=torch.float32)
    mask_args, mask_flags = _mask_args(causal, window, softcap, n_q, n_k)
    args = (Hq, Hq // Hkv, n_q, n_k, softmax_scale * LOG2_E, Nq, *mask_args)
    args = (*args, _bucket(n_q), _bucket(n_k))
    flags = dict(
        _kernel_flags(q, causal, allow_tf32),
        **mask_flags,
        VARLEN=varlen is not None,
        SCALE_POSITIVE=softmax_scale > 0,
    )
    grid = _grid(n_q, "BLOCK_M", sequences * Hq)
    strides = [_strides(t, varlen) for t in (q, k, v, o)]
    if _use_tensor_descriptors(q, k, v, o):
        _attention_fwd_tma_autotuned[grid](
            q,
            k,
            v,
            o,
            lse,
            cu_q,
            cu_k,
            *(s for t in strides for s in t[:3]),
            *args,
            WARP_SPECIALIZE=_WARP_SPECIALIZE,
            **flags,
        )
    else:
        _attention_fwd_kernel[grid](
            q, k, v, o, lse, cu_q, cu_k, *(s for t in strides for s in t), *args, **flags
        )
    return o, lse


def _attention_backward(
    do,
    q,
    k,
    v,
    o,
    lse,
    causal: bool,
    softmax_scale: float,
    allow_tf32: bool,
    deterministic: bool,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    varlen: Varlen | None = None,
):
    """dq, dk, dv from the saved forward inputs, output and log-sum-exp; written into `out`
    (any strides: views of one packed gradient, say) when given.

    deterministic: a dK/dV pass and a dQ pass, no atomics (bitwise reproducible); otherwise one
    pass that adds dQ with fp32 atomics into a zeroed fp32 buffer, then casts it into dq. Head
    blocks above ATOMIC_MAX_BLOCK_D take the deterministic schedule either way: the one pass holds
    one more tile, and no config of it compiles there without spilling."""
    B, Hq, Nq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    cu_q, cu_k, sequences, n_q, n_k = _sequence_args(q, k, varlen)
    flags = _kernel_flags(q, causal, allow_tf32)
    delta = empty((B, Hq, Nq), device=q.device, dtype=torch.float32)
    delta_block = 32 if interpreting() else 64
    # Row by row: packed sequences need no bounds here (Delta's rows are o's and dO's).
    _attention_bwd_delta_kernel[_grid(Nq, "BLOCK_M", B * Hq)](
        o,
        do,
        delta,
        *o.stride(),
        *do.stride(),
        Hq,
        Nq,
        HEAD_DIM=D,
        BLOCK_D=flags["BLOCK_D"],
        BLOCK_M=delta_block,
        num_warps=8,  # at 4, fp32 O and dO tiles of head dim 64 spill on sm_90a (compile_report.py)
    )

    dq, dk, dv = out or (_empty_heads_like(q), _empty_heads_like(k), _empty_heads_like(v))
    mask_args, mask_flags = _mask_args(causal, window, softcap, n_q, n_k)
    args = (n_q, n_k, softmax_scale, softmax_scale * LOG2_E, Nq, *mask_args)
    args = (*args, _bucket(n_q), _bucket(n_k))
    flags = dict(flags, **mask_flags, VARLEN=varlen is not None)
    if not deterministic and flags["BLOCK_D"] <= ATOMIC_MAX_BLOCK_D:
        dq_acc = _empty_heads_like(q, torch.float32).zero_()
        _attention_bwd_dkdv_dq_kernel[_grid(n_k, "BLOCK_N", sequences * Hkv)](
            q,
            k,
            v,
            do,
            dk,
            dv,
            dq_acc,
            lse,
            delta,
            cu_q,
            cu_k,
            *(s for t in (q, k, v, do, dk, dv, dq_acc) for s in _strides(t, varlen)),
            Hkv,
            group,
            *args,
            ATOMIC_DQ=True,
            **flags,
        )
        return dq.copy_(dq_acc), dk, dv
    _attention_bwd_dkdv_kernel[_grid(n_k, "BLOCK_N", sequences * Hkv)](
        q,
        k,
        v,
        do,
        dk,
        dv,
        dk,  # stands in for the unused DQ
        lse,
        delta,
        cu_q,
        cu_k,
        *(s for t in (q, k, v, do, dk, dv, dk) for s in _strides(t, varlen)),
        Hkv,
        group,
        *args,
        ATOMIC_DQ=False,
        **flags,
    )
    _attention_bwd_dq_kernel[_grid(n_q, "BLOCK_M", sequences * Hq)](
        q,
        k,
        v,
        do,
        dq,
        lse,
        delta,
        cu_q,
        cu_k,
        *(s for t in (q, k, v, do, dq) for s in _strides(t, varlen)),
        Hq,
        group,
        *args,
        **flags,
    )
    return dq, dk, dv


def _check_kernel_head_dim(D: int) -> None:
    """PyTorch's attention takes any head dim; the kernels only these."""
    if D % 8 or not 8 <= D <= MAX_HEAD_DIM:
        raise ValueError(
            f"q has head dim {D}; the Triton kernel takes multiples of 8 from 8 to "
            f"{MAX_HEAD_DIM} (FASTLM_BACKEND=torch runs any)"
        )


# --------------------------------------------------------------------------------------------
# Registration: torch.ops.fastlm.flash_attention, flash_attention_varlen and their backward
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("fastlm::flash_attention", mutates_args=())
def _flash_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    allow_tf32: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse): o (B, Hq, Nq, D) in q's memory layout, lse (B, Hq, Nq) fp32 base 2.
    deterministic picks the backward's schedule (the forward has one)."""
    return _attention_forward(
        q, k, v, causal, softmax_scale, allow_tf32, (window_left, window_right), softcap
    )


@_flash_attention_op.register_fake
def _(q, k, v, causal, softmax_scale, window_left, window_right, softcap, *flags):
    B, Hq, Nq, _ = q.shape
    return _empty_heads_like(q), q.new_empty((B, Hq, Nq), dtype=torch.float32)


@torch.library.custom_op("fastlm::flash_attention_backward", mutates_args=())
def _flash_attention_backward_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    allow_tf32: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _attention_backward(
        do,
        q,
        k,
        v,
        o,
        lse,
        causal,
        softmax_scale,
        allow_tf32,
        deterministic,
        window=(window_left, window_right),
        softcap=softcap,
    )


@_flash_attention_backward_op.register_fake
def _(do, q, k, v, *rest):
    return _empty_heads_like(q), _empty_heads_like(k), _empty_heads_like(v)


def _flash_attention_setup(ctx, inputs, output):
    """Saves q, k, v, o and the (B, Hq, Nq) fp32 log-sum-exp: memory linear in the sequence."""
    q, k, v, *flags = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.set_materialize_grads(False)  # lse has no gradient: no zero tensor for it
    ctx.mark_non_differentiable(lse)
    ctx.flags = flags


def _flash_attention_grad(ctx, do, _):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _flash_attention_backward_op(do, q, k, v, o, lse, *ctx.flags)
    return dq, dk, dv, *[None] * len(ctx.flags)


torch.library.register_autograd(
    "fastlm::flash_attention", _flash_attention_grad, setup_context=_flash_attention_setup
)
refuse_double_backward("fastlm::flash_attention_backward", "flash_attention")


def _as_heads(t: torch.Tensor) -> torch.Tensor:
    """A packed (total, H, D) tensor as the launchers' (1, H, total, D) view."""
    return t.unsqueeze(0).transpose(1, 2)


def _as_packed(t: torch.Tensor) -> torch.Tensor:
    """The launchers' (1, H, total, D) output as (total, H, D)."""
    return t[0].transpose(0, 1)


@torch.library.custom_op("fastlm::flash_attention_varlen", mutates_args=())
def _flash_attention_varlen_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    allow_tf32: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse): o (total_q, Hq, D) in q's memory layout, lse (Hq, total_q) fp32 base 2."""
    varlen = Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    o, lse = _attention_forward(
        _as_heads(q),
        _as_heads(k),
        _as_heads(v),
        causal,
        softmax_scale,
        allow_tf32,
        (window_left, window_right),
        softcap,
        varlen,
    )
    return _as_packed(o), lse[0]


@_flash_attention_varlen_op.register_fake
def _(q, k, v, *rest):
    return _as_packed(_empty_heads_like(_as_heads(q))), q.new_empty(
        (q.shape[1], q.shape[0]), dtype=torch.float32
    )


@torch.library.custom_op("fastlm::flash_attention_varlen_backward", mutates_args=())
def _flash_attention_varlen_backward_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    allow_tf32: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = _attention_backward(
        *(_as_heads(t) for t in (do, q, k, v, o)),
        lse[None],
        causal,
        softmax_scale,
        allow_tf32,
        deterministic,
        window=(window_left, window_right),
        softcap=softcap,
        varlen=Varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
    )
    return tuple(_as_packed(g) for g in grads)


@_flash_attention_varlen_backward_op.register_fake
def _(do, q, k, v, *rest):
    return tuple(_as_packed(_empty_heads_like(_as_heads(t))) for t in (q, k, v))


def _flash_attention_varlen_setup(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *flags = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse)
    ctx.flags = flags


def _flash_attention_varlen_grad(ctx, do, _):
    q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = _flash_attention_varlen_backward_op(
        do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *ctx.flags
    )
    return dq, dk, dv, None, None, *[None] * len(ctx.flags)


torch.library.register_autograd(
    "fastlm::flash_attention_varlen",
    _flash_attention_varlen_grad,
    setup_context=_flash_attention_varlen_setup,
)
refuse_double_backward("fastlm::flash_attention_varlen_backward", "flash_attention_varlen")


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def _check_heads(names: tuple[str, str, str], q, k, v, dims: int, layout: str) -> None:
    """q, k, v: kernel dtypes, one device, `dims` dims, k and v alike, grouped heads and equal
    head dims (the head axis is -2 in both layouts)."""
    for name, t in zip(names, (q, k, v)):
        check_float(name, t)
        if t.dim() != dims:
            raise ValueError(f"{name} must have {dims} dims ({layout}), got shape {tuple(t.shape)}")
    check_match("k", k, "q", q)
    check_match("v", v, "q", q)
    if k.shape != v.shape:
        raise ValueError(
            f"v has shape {tuple(v.shape)}, but k has {tuple(k.shape)}; they must match"
        )
    D, Dk = q.shape[-1], k.shape[-1]
    if Dk != D:
        raise ValueError(f"k has head dim {Dk}, but q has {D}")
    if D < 1:
        raise ValueError("q has head dim 0; it must be at least 1")
    Hq, Hkv = q.shape[-2] if dims == 3 else q.shape[1], k.shape[-2] if dims == 3 else k.shape[1]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q has {Hq} heads, which is not a multiple of k's {Hkv} heads")


def _check_causal_and_scale(causal, softmax_scale) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)
    ):
        raise TypeError(
            f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}"
        )


def _check_inputs(q, k, v, causal, softmax_scale) -> None:
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


def _check_options(causal: bool, window_size, softcap, return_lse) -> tuple[tuple[int, int], float]:
    """window_size as two ints and softcap as a float, checked."""
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size)
    ):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(
            f"window_size sides must be -1 (unbounded) or at least 0, got {(left, right)}"
        )
    if causal and right > 0:
        raise ValueError(
            f"window_size[1] is {right}, but with causal=True no query sees a later key: "
            "use -1 or 0 (or causal=False)"
        )
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number, got {type(softcap).__name__}")
    if not 0.0 <= softcap < math.inf:
        raise ValueError(f"softcap must be 0 (off) or a positive finite number, got {softcap}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    return (left, right), float(softcap)


def _check_cu_seqlens(name: str, cu: object, total: int, max_seqlen: object, device) -> None:
    """cu_seqlens: int32, 1-D, on q's device, 0 first, the packed total last, non-decreasing, no
    step above max_seqlen. The values are checked on the host for a CPU tensor; on a GPU (or when
    compiling) with `torch._assert_async`, which reports a bad value as a device-side assertion
    without a host sync."""
    max_name = name.replace("cu_seqlens", "max_seqlen")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral):
        raise TypeError(f"{max_name} must be an int, got {type(max_seqlen).__name__}")
    if max_seqlen < 0:
        raise ValueError(f"{max_name} must be at least 0, got {max_seqlen}")
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


def _natural_lse(lse: torch.Tensor) -> torch.Tensor:
    """The kernels' base-2 log-sum-exp in natural log, with a row that saw no key at -inf (the
    kernels keep +inf there, which zeroes the backward's P)."""
    return torch.where(torch.isposinf(lse), -math.inf, lse * LN_2)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    *,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    allow_tf32: bool = True,
    deterministic: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(softmax_scale * q k^T [+ causal mask]) v without materialising the scores.

    q: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D) with Hq a multiple of Hkv (grouped-query / multi-query
    attention: query head h reads key/value head h // (Hq // Hkv)) and 1 <= Nq <= Nk. Any strides
    (e.g. `x.view(B, N, H, D).transpose(1, 2)` or slices of a fused qkv tensor) are read in place.
    causal: query i sees key j iff j <= i + Nk - Nq (aligned to the end, as in KV-cache decoding).
    softmax_scale: defaults to 1 / sqrt(D). D: a multiple of 8 up to 256 for the Triton kernel
    (the PyTorch backend takes any).
    window_size: (left, right): query i sees key j only if d - left <= j <= d + right, d = i + Nk
    - Nq its aligned diagonal; -1 leaves that side unbounded; with causal=True right is 0 (it may
    be given as -1 or 0). Key blocks outside every row's window are never visited: the work is
    O(N * window).
    softcap: if > 0, each scaled score s becomes softcap * tanh(s / softcap) before the mask and
    the softmax (gradients through the cap).
    return_lse: also return lse (B, Hq, Nq) fp32, the natural log-sum-exp of each row's capped,
    masked scores (-inf for a row that sees no key, whose output is 0). lse carries no gradient.
    dtypes: float16, bfloat16, float32 (all three the same); softmax statistics in fp32.
    allow_tf32: for float32 inputs on a GPU, False makes the dots full fp32 instead of TF32.
    deterministic: the backward's schedule. True (the default): a dK/dV pass and a dQ pass with
    no atomics, bitwise reproducible for a given config. False: FA2's 5-matmul schedule, one pass
    that also adds dQ with fp32 atomics (less recomputation; gradients equal to rounding only).
    Returns o (B, Hq, Nq, D) in q's dtype, differentiable in q, k and v; (o, lse) with return_lse.
    """
    _check_inputs(q, k, v, causal, softmax_scale)
    window, softcap = _check_options(causal, window_size, softcap, return_lse)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if not use_triton(q) or q.numel() == 0:
        return attention_ref(
            q, k, v, causal, scale, window_size=window, softcap=softcap, return_lse=return_lse
        )
    _check_kernel_head_dim(q.shape[-1])
    o, lse = _flash_attention_op(
        q, k, v, causal, scale, *window, softcap, bool(allow_tf32), bool(deterministic)
    )
    return (o, _natural_lse(lse)) if return_lse else o


def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = True,
    softmax_scale: float | None = None,
    *,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    allow_tf32: bool = True,
    deterministic: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """flash_attention of packed sequences (documents): sequence i's queries, rows
    cu_seqlens_q[i] to cu_seqlens_q[i + 1] of q, attend only to its keys, rows cu_seqlens_k[i]
    to cu_seqlens_k[i + 1] of k and v, with the causal mask and window aligned to the end of each
    sequence as in `flash_attention`.

    q: (total_q, Hq, D); k, v: (total_k, Hkv, D), any strides. cu_seqlens_q, cu_seqlens_k: int32
    (num_seqs + 1,) on q's device, from 0 to the totals, non-decreasing (a sequence may be
    empty; one with more queries than keys masks its first queries, which get output 0).
    max_seqlen_q, max_seqlen_k: ints at least the longest sequence's lengths; they size the
    launch, so nothing is read back from the device. On a CPU tensor the cu_seqlens values are
    checked at once; on a GPU by a device-side assertion (`torch._assert_async`, no host sync).
    causal, softmax_scale, window_size, softcap, allow_tf32, deterministic: as in
    `flash_attention`. return_lse: also return lse (Hq, total_q) fp32.
    Returns o (total_q, Hq, D) in q's dtype; (o, lse) with return_lse.
    """
    _check_heads(("q", "k", "v"), q, k, v, 3, "tokens, heads, head_dim")
    _check_causal_and_scale(causal, softmax_scale)
    window, softcap = _check_options(causal, window_size, softcap, return_lse)
    for name, cu, total, longest in (
        ("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
        ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k),
    ):
        _check_cu_seqlens(name, cu, total, longest, q.device)
    if cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise ValueError(
            f"cu_seqlens_k has {cu_seqlens_k.numel()} entries, but cu_seqlens_q has "
            f"{cu_seqlens_q.numel()}: one sequence of keys per sequence of queries"
        )
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if not use_triton(q) or q.numel() == 0 or k.shape[0] == 0:
        return attention_varlen_ref(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            causal,
            scale,
            window_size=window,
            softcap=softcap,
            return_lse=return_lse,
        )
    _check_kernel_head_dim(q.shape[-1])
    o, lse = _flash_attention_varlen_op(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        int(max_seqlen_q),
        int(max_seqlen_k),
        causal,
        scale,
        *window,
        softcap,
        bool(allow_tf32),
        bool(deterministic),
    )
    return (o, _natural_lse(lse)) if return_lse else o


# --------------------------------------------------------------------------------------------
# Packed q|k|v with RoPE: the model's attention, with one gradient buffer
# --------------------------------------------------------------------------------------------
# A fused projection writes q, k and v side by side: qkv (B, T, (Hq + 2 Hkv) * D). RoPE rotates
# the q and k parts in place, attention reads all three through their strides, and the backward
# writes dq, dk (rotated back in place) and dv straight into one gradient of qkv's shape. Autograd
# built from views would instead zero-fill a buffer per view, copy each gradient in and add them.


@torch.library.custom_op("fastlm::flash_attention_backward_", mutates_args=("dq", "dk", "dv"))
def _flash_attention_backward_into_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    allow_tf32: bool,
    deterministic: bool,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int = 0,
) -> None:
    """flash_attention's backward written into dq, dk, dv (views of one buffer, say); with
    cu_seqlens, of packed sequences (self-attention: the same bounds for queries and keys) held
    as the launchers' (1, H, total, D) views, lse (1, H, total)."""
    varlen = None if cu_seqlens is None else Varlen(cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    _attention_backward(
        do,
        q,
        k,
        v,
        o,
        lse,
        causal,
        softmax_scale,
        allow_tf32,
        deterministic,
        out=(dq, dk, dv),
        varlen=varlen,
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
        ctx,
        qkv,
        cos,
        sin,
        positions,
        num_heads,
        num_kv_heads,
        causal,
        softmax_scale,
        allow_tf32,
        deterministic,
        interleaved,
        cu_seqlens,
        max_seqlen,
    ):
        packed = cu_seqlens is not None
        q, k, v = split_heads(qkv, num_heads, num_kv_heads, packed)
        torch.ops.fastlm.rope_(q, k, cos, sin, positions, interleaved, False)
        if not packed:
            o, lse = _flash_attention_op(
                q, k, v, causal, softmax_scale, -1, -1, 0.0, allow_tf32, deterministic
            )
        else:  # q, k, v are the packed sequences' (1, H, total, D)
            o, lse = _flash_attention_varlen_op(
                *(_as_packed(t) for t in (q, k, v)),
                cu_seqlens,
                cu_seqlens,
                max_seqlen,
                max_seqlen,
                causal,
                softmax_scale,
                -1,
                -1,
                0.0,
                allow_tf32,
                deterministic,
            )
            o, lse = _as_heads(o), lse[None]  # (1, H, total, D), (1, H, total)
        ctx.mark_dirty(qkv)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(qkv, o, lse, cos, sin, positions, cu_seqlens)
        ctx.max_seqlen = max_seqlen or 0  # the op takes an int
        ctx.args = (
            num_heads,
            num_kv_heads,
            causal,
            softmax_scale,
            allow_tf32,
            deterministic,
            interleaved,
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
        dqkv = empty(qkv.shape, device=qkv.device, dtype=qkv.dtype)
        dq, dk, dv = split_heads(dqkv, num_heads, num_kv_heads, packed)
        if do is None:
            dqkv.zero_()
        else:
            q, k, v = split_heads(qkv, num_heads, num_kv_heads, packed)
            _flash_attention_backward_into_op(
                do,
                q,
                k,
                v,
                o,
                lse,
                causal,
                softmax_scale,
                allow_tf32,
                deterministic,
                dq,
                dk,
                dv,
                cu_seqlens,
                ctx.max_seqlen,
            )
        if d_rotated is not None:
            dqkv.add_(d_rotated)
        torch.ops.fastlm.rope_(dq, dk, cos, sin, positions, interleaved, True)
        return dqkv, *[None] * 12


def rope_attention_ref(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    num_heads: int,
    num_kv_heads: int | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    interleaved: bool = True,
) -> torch.Tensor:
    """rope_attention's math in PyTorch (rotated copies; qkv is left as it is)."""
    q, k, v = split_heads(qkv, num_heads, num_kv_heads or num_heads)
    q = rope_ref(q, cos, sin, positions, interleaved)
    k = rope_ref(k, cos, sin, positions, interleaved)
    return attention_ref(q, k, v, causal, softmax_scale)


def rope_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    token_positions: torch.Tensor,
    num_heads: int,
    num_kv_heads: int | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    *,
    interleaved: bool = True,
    allow_tf32: bool = True,
    deterministic: bool = True,
    check_positions: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Attention of a fused q|k|v projection with RoPE: the model's attention in one call.

    qkv: (B, T, (Hq + 2 Hkv) * D), the projection's output (q's heads, then k's, then v's);
    Hkv = num_kv_heads (default num_heads) divides Hq. cos, sin, token_positions, interleaved as in
    `apply_rope_` (check_positions=False skips the range check of the positions, for a caller
    that checked them once for all layers); causal, softmax_scale, allow_tf32, deterministic as in
    `flash_attention`. Returns o (B, Hq, T, D) in (B, T, Hq, D) memory, so that
    `o.transpose(1, 2).reshape(B, T, Hq * D)` is free.

    With the kernels qkv is rotated in place (it must not be a leaf that requires grad, and must
    not be read afterwards for its unrotated values), and its gradient is written as one tensor:
    dq and dk rotated back, and dv, side by side, with no buffers to zero or gradients to add.
    The PyTorch backend rotates copies and leaves qkv unchanged.

    cu_seqlens, max_seqlen: packed documents, as in `flash_attention_varlen` (self-attention):
    the B * T tokens, flattened row by row, are split at cu_seqlens; token_positions are then the
    B * T tokens' positions, (B * T,). Returns o (1, Hq, B * T, D) in (B * T, Hq, D) memory.
    """
    check_float("qkv", qkv)
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if qkv.dim() != 3 or qkv.shape[-1] % (num_heads + 2 * num_kv_heads):
        raise ValueError(
            f"qkv must be (B, T, (num_heads + 2 * num_kv_heads) * head_dim) = "
            f"(B, T, {num_heads + 2 * num_kv_heads} * D), got {tuple(qkv.shape)}"
        )
    packed = cu_seqlens is not None
    q, k, v = split_heads(qkv, num_heads, num_kv_heads, packed)
    _check_inputs(q, k, v, causal, softmax_scale)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if packed:
        max_seqlen = _check_packed_self_attention(cu_seqlens, max_seqlen, q.shape[2], q.device)
    if not use_triton(qkv):
        positions = (
            check_rope_args(q, cos, sin, token_positions) if check_positions else token_positions
        )
        if packed:
            q, k = (rope_ref(t, cos, sin, positions, interleaved) for t in (q, k))
            o = flash_attention_varlen(
                *(_as_packed(t) for t in (q, k, v)),
                cu_seqlens,
                cu_seqlens,
                max_seqlen,
                max_seqlen,
                causal,
                scale,
            )
            return _as_heads(o)
        return rope_attention_ref(
            qkv, cos, sin, positions, num_heads, num_kv_heads, causal, scale, interleaved
        )
    _check_kernel_head_dim(q.shape[-1])
    check_rotatable("qkv", qkv)
    positions = check_rope_args(q, cos, sin, token_positions, check_values=check_positions)
    if qkv.numel() == 0:
        return _empty_heads_like(q)
    return _PackedRopeAttention.apply(
        qkv,
        cos.contiguous(),
        sin.contiguous(),
        positions,
        num_heads,
        num_kv_heads,
        causal,
        scale,
        bool(allow_tf32),
        bool(deterministic),
        interleaved,
        cu_seqlens,
        max_seqlen,
    )[0]


def _check_packed_self_attention(cu_seqlens, max_seqlen, total: int, device) -> int:
    """rope_attention's packed sequences checked as flash_attention_varlen's; max_seqlen as an
    int (default: the total)."""
    max_seqlen = total if max_seqlen is None else max_seqlen
    _check_cu_seqlens("cu_seqlens", cu_seqlens, total, max_seqlen, device)
    return int(max_seqlen)
