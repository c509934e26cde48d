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
(`blocks.block_start_and_batch_head`).
With deterministic=False the dK/dV pass also computes dQ = s * dS k for its key block and adds it
with fp32 atomics into a zeroed buffer (FA2's 5-matmul schedule): one pass, P computed once.
Head dims run to 512 (16-bit; fp32 to 256). At head block 512 no program holds both fp32 dK and dV
accumulators without spilling, so the dK/dV pass runs as two launches, one per gradient, each
recomputing P (`backward.split_kv_grads`: 5/4 of that pass's matmuls, 8/7 of the backward's).

Options, each a constexpr so that the plain kernels compile as without them:

- window (HAS_WINDOW): query i sees key j only if d - left <= j <= d + right, d = i + Nk - Nq
  (causal: right = 0). Each program's loop covers only the key (or query) blocks some row's
  window reaches, unmasked where every row sees the whole block, so the work is O(N * window).
- softcap (SOFTCAP): t' = c * tanh(t / c) on the base-2 scores (c = softcap * log2(e)), tanh from
  exp2; the backward recomputes it and multiplies dS by 1 - tanh^2, taken from 1 / (1 + 2^v) so
  that it stays relatively accurate in the tails. With softcap_approx the tanh is tanh.approx.f32
  instead (SOFTCAP = `blocks.SOFTCAP_APPROX`; in the interpreter its error model), and the slope
  1 - th^2 comes from it (`blocks.capped_scores`).
- attention sinks (HAS_SINKS, gpt-oss): one logit per query head in every row's denominator,
  with no value (neither scaled nor capped). The forward starts each row's online softmax as
  having seen it (m = sink, l = 1; -inf starts empty, as without one), so LSE holds it and the
  backward's kernels are unchanged; dsink = -sum_rows 2^(sink - LSE) * Delta is one torch
  reduction (`backward.sink_grad`).
- a value head dim of its own (MLA: q, k 192, v 128): HEAD_DIM / BLOCK_D are q's and k's,
  HEAD_DIM_V / BLOCK_DV v's, o's, dO's and dv's; configs fit the wider head block, or list the
  pair (`configs.CudaConfig.split_blocks`).
- packed sequences (VARLEN, `flash_attention_varlen`): q, k, v are (total, H, D) views as (1, H,
  total, D); the grid is cdiv(max_seqlen, BLOCK) * (num_seqs * H), each program reads its
  sequence's bounds from cu_seqlens, offsets its pointers by the first row, and returns at once
  when its block starts past the sequence's end. LSE and Delta are (H, total_q).

Data movement: on sm_90+ with a Triton that has `tl.make_tensor_descriptor`, the forward's q, k,
v, o and the key blocks the dQ pass streams (k, v) move through tensor descriptors (TMA), one 2-D
[rows, D] view per (batch, head) built on the device; otherwise (sm_80, older Triton, unaligned
views) through masked pointer loads. The choice is made on the host per call from cached device
facts and cheap stride checks (`launch.use_tensor_descriptors`). The dK/dV pass streams q and dO
through pointers: descriptors there saved no instructions in its loop (`configs.DQ_TMA_CUDA_CONFIGS`
says why).

Determinism (deterministic=True, the default): no atomics, and every sum has an order fixed by the
block sizes, so with the same (BLOCK_M, BLOCK_N) configs the output and gradients are bitwise
reproducible. In one process each kernel's config is chosen once per tuning key
(`configs.TUNING_KEY` and the dtypes) and kept: repeated calls are bitwise equal. Across processes
they need not be: on CUDA the autotuner picks configs by timing, so another run, GPU or Triton
version may pick other block sizes and round differently (equal to rounding, not bitwise).
TRITON_CACHE_AUTOTUNING=1 makes later processes on the same machine reuse the timings stored on
disk. The interpreter has a single config.

Precision: fp16/bf16 dots accumulate in fp32. fp32 inputs use TF32 dots on a GPU by default
(`allow_tf32=False` asks for full fp32 dots); Triton's interpreter computes fp32 dots exactly.

The files, in reading order:

- `reference.py`: the math in PyTorch (`flash_attention_ref`, `flash_attention_varlen_ref`):
  the PyTorch backend and what the tests compare with;
- `configs.py`: the autotuning configs of each kernel, importable without compiling anything;
- `blocks.py`: the Triton helpers every pass shares (tiles, grid, sequence bounds, visibility,
  the key and query ranges with their masked and unmasked phases);
- `launch.py`: host-side pieces both launchers share (outputs, grid, flags, packed sequences);
- `forward.py`: the forward kernels (pointer and tensor-descriptor) and their launcher;
- `backward.py`: Delta, dK/dV, dQ and the atomic one-pass schedule, and their launcher;
- `ops.py`: the custom ops (`torch.ops.fastlm.flash_attention*`), argument checks and the public
  `flash_attention` and `flash_attention_varlen`;
- `qkv.py`: `rope_attention`, RoPE and attention on a packed q|k|v projection.
"""

from fastlm.kernels.attention.configs import MAX_HEAD_DIM, MAX_HEAD_DIM_FP32
from fastlm.kernels.attention.ops import flash_attention, flash_attention_varlen
from fastlm.kernels.attention.qkv import rope_attention, rope_attention_ref, split_heads
from fastlm.kernels.attention.reference import flash_attention_ref, flash_attention_varlen_ref

__all__ = [
    "MAX_HEAD_DIM", "MAX_HEAD_DIM_FP32", "flash_attention_ref", "flash_attention_varlen_ref",
    "flash_attention", "flash_attention_varlen", "rope_attention", "rope_attention_ref",
    "split_heads"
]
