"""The kernels' autotuning configs, importable without compiling anything (the compile report
reads them): per kernel a list of `CudaConfig`s, each with the largest head block it compiles for
without spilling, and the one small config the interpreter runs."""

from __future__ import annotations

import os
from typing import NamedTuple

from fastlm.backend import interpreting
from fastlm.kernels._common import capability, triton

#: Head dims the kernels take: multiples of 8 (padded inside to a power of two of at least 16),
#: fp32 ones to MAX_HEAD_DIM_FP32: at a head block of 512 every fp32 config spilled on sm_90a and
#: sm_80 (the forward's M32 N32 on 8 warps 688 B, the dK/dV and dQ passes also overflowed shared
#: memory), as the fp32 tiles are twice the 16-bit ones.
MAX_HEAD_DIM = 512
MAX_HEAD_DIM_FP32 = 256


class CudaConfig(NamedTuple):
    """An autotuning candidate on CUDA and the head blocks it takes.

    max_block_d / max_block_d_fp32: the largest BLOCK_D it takes with fp16/bf16 or fp32 inputs
    without spilling registers or needing more shared memory than an H100 or an A100 has, as
    `benchmarks/compile_report.py` reads them off the compiled kernels (0: never).
    options: whether it also takes the option variants (a window, the cap, packed sequences:
    `has_options`) within those limits; False where one of them spills.
    min_block_d: the smallest BLOCK_D it takes: a config kept only for the head blocks no better
    one fits.
    split_v: whether it also takes a v head block other than q's (MLA) within those limits (the
    wider of the two); False where that spilled.
    split_blocks: (BLOCK_D, BLOCK_DV) pairs of 16-bit inputs it is kept for beside those limits:
    MLA's 192 / 128 is (256, 128), where a 256-wide v would not fit.
    mma_sync: in a Blackwell list (`CudaConfigs.sm100`), a config whose `tl.dot`s do not all
    become `tcgen05.mma` (a product of fewer than 64 rows runs on `mma.sync`), kept only for the
    head blocks where no tcgen05 config compiled without spilling: why (the compile report notes
    it in the row instead of flagging it); empty otherwise.
    options_only: taken only by the option variants (a plain launch has a better config that
    spills with an option).
    """

    blocks: dict
    num_warps: int
    num_stages: int
    max_block_d: int
    max_block_d_fp32: int
    options: bool = True
    min_block_d: int = 0
    split_v: bool = True
    split_blocks: tuple = ()
    mma_sync: str = ""
    options_only: bool = False


class CudaConfigs(list):
    """A kernel's CUDA configs (the list itself: sm_80, sm_90 and every arch without its own) and
    Blackwell's (`sm100`: compute capability 10.x, B200 and B300), chosen per launch from the
    GPU's compute capability (`for_capability`). Blackwell multiplies with `tcgen05.mma`, whose
    accumulators live in tensor memory instead of registers, on tiles of 64 or 128 rows per
    CTA: a product of fewer rows falls back to the warp-level `mma.sync`, so its configs differ."""

    def __init__(self, configs: list[CudaConfig], sm100: list[CudaConfig]):
        super().__init__(configs)
        self.sm100 = list(sm100)


def for_capability(cuda: list[CudaConfig], major: int) -> list[CudaConfig]:
    """The configs of a kernel's CUDA list for a GPU of this compute capability (major)."""
    return cuda.sm100 if major == 10 and isinstance(cuda, CudaConfigs) else list(cuda)


#: The constexprs of the option variants: each adds registers to the plain kernels.
OPTION_FLAGS = ("HAS_WINDOW", "SOFTCAP", "VARLEN")


def has_options(args: dict) -> bool:
    """Whether a launch's arguments (by name) compile in an option variant."""
    return any(args.get(flag) for flag in OPTION_FLAGS)


def fitting_configs(
    cuda: list[CudaConfig], block_d: int, element_size: int, options: bool = False,
    block_dv: int | None = None
) -> list[CudaConfig]:
    """The configs of a CUDA list that take head blocks of BLOCK_D (q, k) and BLOCK_DV (v; default
    BLOCK_D) at this input element size (and with `options`, an option variant): by the wider
    head block, or (split head blocks) by `split_blocks`."""
    block_dv = block_d if block_dv is None else block_dv
    split = block_dv != block_d
    wider = max(block_d, block_dv)

    def takes(config: CudaConfig) -> bool:
        if not (config.options or not options) or (config.options_only and not options):
            return False
        if split and element_size == 2 and (block_d, block_dv) in config.split_blocks:
            return True
        limit = config.max_block_d_fp32 if element_size == 4 else config.max_block_d
        return config.min_block_d <= wider <= limit and (config.split_v or not split)

    return [config for config in cuda if takes(config)]


def triton_configs(
    interpreter_blocks: dict, cuda: list[CudaConfig],
    covers: tuple[int, int] = (MAX_HEAD_DIM, MAX_HEAD_DIM_FP32),
    covers_sm100: tuple[int, int] | None = None
) -> list[triton.Config]:
    """One small config under the interpreter (autotuning there runs every config); the CUDA list
    otherwise, which `prune_to_fitting` cuts down per launch. `covers`: the largest head blocks
    (16-bit, fp32) some config must take: every head dim unless the caller routes the rest
    elsewhere; `covers_sm100`: the Blackwell list's, where the launcher routes more (default
    `covers`)."""
    lists = [(list(cuda), covers)]
    if isinstance(cuda, CudaConfigs):
        lists.append((cuda.sm100, covers_sm100 or covers))
    for configs, (largest, largest_fp32) in lists:
        for block_d, element_size in ((largest, 2), (largest_fp32, 4)):
            assert fitting_configs(configs, block_d, element_size), "a head dim no config takes"
    lists = [configs for configs, _ in lists]
    if interpreting():
        return [triton.Config(interpreter_blocks, num_warps=4, num_stages=1)]
    return cuda_triton_configs([config for configs in lists for config in configs])


def cuda_triton_configs(cuda: list[CudaConfig]) -> list[triton.Config]:
    """The CUDA list as Triton configs, each shape once: a shape may be listed twice, kept for
    different head blocks (or archs), and pruning (`prune_to_fitting`) matches configs by
    shape."""
    shapes = dict.fromkeys((tuple(c.blocks.items()), c.num_warps, c.num_stages) for c in cuda)
    return [
        triton.Config(dict(blocks), num_warps=warps, num_stages=stages)
        for blocks, warps, stages in shapes
    ]


def prune_to_fitting(cuda: list[CudaConfig]):
    """An autotuner's early_config_prune: the configs of the GPU's arch (`for_capability`) that
    fit the launch's head block and dtype.

    FASTLM_AUTOTUNE=0 keeps only the last of them, the smallest: for test runs, where tuning each
    new shape would compile every config.
    """

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        if interpreting():
            return configs
        q = named_args["Q"]
        fitting = fitting_configs(
            for_capability(cuda, capability(q)), kwargs["BLOCK_D"], q.element_size(),
            has_options(kwargs), kwargs.get("BLOCK_DV")
        )
        if os.environ.get("FASTLM_AUTOTUNE", "1") == "0":
            fitting = fitting[-1:]
        chosen = {(tuple(c.blocks.items()), c.num_warps, c.num_stages) for c in fitting}
        return [
            c for c in configs if (tuple(c.kwargs.items()), c.num_warps, c.num_stages) in chosen
        ]

    return {"early_config_prune": prune}


def cuda_config(
    block_m: int, block_n: int, warps: int, stages: int, max_block_d: int, max_block_d_fp32: int,
    options: bool = True, min_block_d: int = 0, split_v: bool = True, split_blocks: tuple = (),
    mma_sync: str = "", options_only: bool = False
) -> CudaConfig:
    return CudaConfig(
        {"BLOCK_M": block_m, "BLOCK_N": block_n}, warps, stages, max_block_d, max_block_d_fp32,
        options, min_block_d, split_v, split_blocks, mma_sync, options_only
    )


#: MLA as DeepSeek-V2/V3 train it: q and k 192 wide (a head block of 256), v 128.
MLA_BLOCKS = (256, 128)

# Largest first. Hopper-first: 128-row query blocks for head dims up to 128, 64-row blocks (still
# Hopper's wgmma) up to 256; the last config of each dtype is the smallest (FASTLM_AUTOTUNE=0).
# Every config that spilled or overflowed shared memory on sm_90a or sm_80 at a head dim is
# limited below it (compile_report.py's rows); head dim 256 and fp32 leave few configs.
# No config repeats MMA work across warps (benchmarks/hot_loop.py's MMA issued against the tile's
# FLOPs): Triton lays a dot whose result feeds another (the scores) with all warps along its rows,
# so 8 warps on 64 rows computed each row twice, 1.5 to 2 times the tile's MMA on both archs.
# The one exception is 32 rows on 8 warps (1.5 times) for fp32 head dims above 128, where nothing
# else fits: 4 warps spill, and 128 rows spill or overflow sm_80's shared memory.
FWD_CUDA_CONFIGS = [
    cuda_config(128, 128, 8, 3, 64, 0),
    cuda_config(128, 64, 4, 3, 64, 0),
    cuda_config(128, 64, 8, 3, 128, 64),
    cuda_config(128, 64, 8, 4, 128, 64),
    cuda_config(64, 64, 4, 3, 128, 0),
    cuda_config(64, 32, 4, 1, 0, 128),
    # MLA's 192 / 128 alone (bf16, causal: plain, packed, and with a window and the cap at once
    # no spill on sm_90a or sm_80, at most 254 registers; M64 N64 spilled 40 B on sm_80): the
    # hot loop's MMA share by the clock model of benchmarks/hot_loop.py (sm_90a, no overlap)
    # 65 % and 53 %, against 39 % for M32 N32, the one config that takes a head block of 256.
    cuda_config(128, 64, 8, 2, 0, 0, split_blocks=(MLA_BLOCKS, )),
    cuda_config(64, 32, 4, 2, 0, 0, split_blocks=(MLA_BLOCKS, )),
    cuda_config(32, 32, 8, 1, 0, 256, min_block_d=256),  # the exception (above)
    cuda_config(32, 32, 4, 1, 256, 128),
    # Head block 512 (Gemma 4's global layers; 16-bit only): 32 rows on 8 warps again, the one
    # shape that compiled without spills on both archs, with every option (at most 252 registers,
    # 66 KiB of shared memory); 64 rows spilled 620 B (sm_90a), 16 rows on 4 warps 184 B.
    cuda_config(32, 32, 8, 1, 512, 0, min_block_d=512),
]
# dK/dV keep a key block's k, v, dk, dv on chip and stream query blocks past it: its fp32 dk and
# dv accumulators take twice the registers of the forward's one, hence the small key blocks. The
# query block is the scores' columns here, and warps split them 8 at a time: 32 on 8 warps
# repeated work (1.5 times the tile's MMA), as did 16 on 4 warps at head dim 128 on sm_80; 64 on
# 8 warps do not. A 4-warp M32 N128 block spills at head dim 64 (84 B on sm_90a, 4 B on sm_80).
DKDV_CUDA_CONFIGS = [
    cuda_config(32, 128, 8, 2, 64, 64),
    cuda_config(32, 64, 4, 3, 128, 0, options=False),  # with the cap: 28 B spilled on sm_80
    cuda_config(16, 64, 4, 2, 64, 64),
    cuda_config(64, 32, 8, 1, 256, 128),
    # Head block 512, 16-bit: no config held dk and dv at once without spilling (M16 N16 on 4
    # warps: 392 B on sm_90a), so the pass runs as a dV and a dK launch (`split_kv_grads`). 64
    # query columns on 8 warps repeat no MMA work (at most 255 registers, dK's 160 KiB of shared
    # memory within sm_80's 163), but spill with an option on sm_90a (8 B with the window, cap and
    # sinks, 80 B packed); 32 on 8 warps (the last below: 1.5 and 1.67 times the dV and the dK
    # launch's MMA) take every option.
    # (Before the M32 N32 of head block 256: the autotuner's list holds each shape once, where
    # it first appears, and pruning keeps that order.)
    cuda_config(64, 16, 8, 1, 512, 0, options=False, min_block_d=512),
    cuda_config(32, 32, 8, 1, 0, 256, min_block_d=256),  # 1.5 times its MMA: as the forward's
    cuda_config(32, 32, 8, 1, 512, 0, min_block_d=512),
]
#: Head blocks from which the dK/dV pass runs as two launches, dV and dK (`split_kv_grads`).
SPLIT_KV_MIN_BLOCK_D = 512
# dQ keeps a query block's q, dO, dq on chip and streams key blocks past it.
DQ_CUDA_CONFIGS = [
    cuda_config(128, 64, 8, 3, 128, 0, split_v=False),  # 96 / 64: 44 B spilled on sm_80
    cuda_config(64, 32, 4, 2, 128, 128),
    cuda_config(32, 32, 4, 1, 256, 128),
    cuda_config(16, 64, 8, 1, 0, 256),
    # Head block 512, 16-bit: as the forward's (1.67 times its MMA); M16 N32 on 4 warps spilled.
    cuda_config(32, 32, 8, 1, 512, 0, min_block_d=512),
]

# Blackwell (compute capability 10.x: B200, B300), read off compiles for sm_100a (Triton 3.9,
# benchmarks/compile_report.py). tcgen05.mma takes 64 or 128 rows per CTA and accumulates in
# tensor memory (TMEM, 512 columns per SM): the forward's and dQ's BLOCK_M and the dK/dV pass's
# BLOCK_N must be 64 or more, or a tl.dot falls back to mma.sync (the 32-row configs above
# do). The accumulators are read into registers for each rescale, so registers still bound the
# head block: the forward's M64 N64 on 4 warps spilled with the window at head dim 128 (255
# registers, 92 B), its M128 N64 on 4 warps at 64 (236 B), M64 N32 at 512 (4 warps 1460 B, 8
# warps 212 B) and fp32 256 on 4 warps (196 B); dQ's M64 N32 at 512 (8 warps: 1188 B); dK/dV's
# M16 N64 at fp32 128 on 4 warps in 2 stages (28 B), its M32 N64 at 256 (12 B); the atomic
# pass's M64 N64 on 4 warps at 128 (248 B). At 256, 8 warps on 64-row blocks fit (forward 153
# registers, dQ 219); at 512, 2 stages on 8 warps did where 1 spilled. Where no tcgen05 config
# fits, or only one the clock model ranks slower (fp32 head block 256's dK/dV and dQ passes,
# head block 512's forward with an option), the Hopper list's small
# configs stay, on mma.sync (`mma_sync`, with why; docs/benchmarks.md lists what was tried);
# the atomic pass's fp32 at 128 takes the deterministic passes instead (`atomic_max_block_d`).
# What a GPU must confirm: docs/attention.md.
FWD_CUDA_CONFIGS = CudaConfigs(
    FWD_CUDA_CONFIGS, [
        cuda_config(128, 64, 8, 3, 128, 0),
        cuda_config(128, 64, 8, 4, 128, 0),
        cuda_config(64, 64, 4, 3, 128, 0, options=False),  # with the window: 92 B spilled
        cuda_config(128, 64, 8, 2, 0, 0, split_blocks=(MLA_BLOCKS, )),
        cuda_config(64, 32, 4, 2, 0, 0, split_blocks=(MLA_BLOCKS, )),
        cuda_config(64, 32, 4, 1, 0, 128),
        # 16-bit 153 registers, fp32 (TF32) 225 (M64 N16: 213; 4 warps spilled 196 B).
        cuda_config(64, 32, 8, 1, 256, 256, min_block_d=256, split_v=False),
        # Head block 512: M64 N16 in 2 stages, 254 registers (1 stage: 124 B spilled; M64 N32
        # 76 B, M128 N16 576 TMEM columns); with an option it spilled (window, cap and sinks
        # 48 B, packed 24 B), so the option variants keep 32 rows on mma.sync.
        cuda_config(64, 16, 8, 2, 512, 0, options=False, min_block_d=512),
        cuda_config(
            32, 32, 8, 1, 512, 0, min_block_d=512, options_only=True,
            mma_sync="head block 512 with an option: M64 N16 spilled 24-48 B"
        ),
    ]
)
DKDV_CUDA_CONFIGS = CudaConfigs(
    DKDV_CUDA_CONFIGS, [
        cuda_config(32, 128, 8, 2, 64, 64),
        cuda_config(32, 64, 4, 3, 128, 0),  # with every option at 128, unlike on sm_80
        cuda_config(16, 64, 4, 2, 256, 64),
        cuda_config(32, 64, 8, 1, 0, 128, min_block_d=128),  # fp32: 207 registers
        # The dV and the dK launch of head block 512 with every option: at most 226 registers
        # and 208 KiB of shared memory (1 stage: the dK launch spilled 1204 B).
        cuda_config(16, 64, 8, 2, 512, 0, min_block_d=512),
        # fp32 head block 256 (docs/benchmarks.md): M8 N64 on 8 warps spilled 32 B, M16 N64
        # 140 B; split as at 512, the dV launch fits (M16 N64: 231 registers) but the dK launch
        # spilled (M8 N64 20 B, M16 N64 116 B), so the pass stays whole, on mma.sync.
        cuda_config(
            32, 32, 8, 1, 0, 256, min_block_d=256,
            mma_sync="fp32 head block 256: every N64 tile spilled, 32 B or more"
        ),
    ]
)
DQ_CUDA_CONFIGS = CudaConfigs(
    DQ_CUDA_CONFIGS, [
        cuda_config(128, 64, 8, 3, 128, 0, split_v=False),
        cuda_config(64, 32, 4, 2, 128, 128),
        cuda_config(64, 32, 8, 1, 256, 0, min_block_d=256),  # 219 registers (4 warps: 56 B)
        # fp32 head block 256: the one 64-row tile that did not spill, M64 N8 (247 registers),
        # issues 1.55 clocks a score in the clock model against this config's 0.70, so the
        # faster stays (docs/benchmarks.md).
        cuda_config(
            16, 64, 8, 1, 0, 256, min_block_d=256,
            mma_sync="fp32 head block 256: M64 N16 spilled 44 B, M64 N8 models 2.2x the clocks"
        ),
        # Head block 512 with every option: at most 211 registers, 208 KiB of shared memory (1
        # stage spilled 856 B, 3 stages overflow shared memory).
        cuda_config(64, 16, 8, 2, 512, 0, min_block_d=512),
    ]
)
FWD_CONFIGS = triton_configs({"BLOCK_M": 64, "BLOCK_N": 32}, FWD_CUDA_CONFIGS)
DKDV_CONFIGS = triton_configs({"BLOCK_M": 32, "BLOCK_N": 64}, DKDV_CUDA_CONFIGS)
DQ_CONFIGS = triton_configs({"BLOCK_M": 64, "BLOCK_N": 32}, DQ_CUDA_CONFIGS)
# Tuned per power-of-two bucket of the sequence lengths, so a growing KV cache does not retune;
# a window, the cap or packed sequences change the work per block, so they are tuned apart.
TUNING_KEY = [
    "q_bucket", "k_bucket", "BLOCK_D", "BLOCK_DV", "CAUSAL", "HAS_WINDOW", "SOFTCAP", "VARLEN",
    "DOT_PRECISION"
]
#: The dK/dV pass's: its split launches (`SPLIT_KV_MIN_BLOCK_D`) are tuned apart.
DKDV_TUNING_KEY = [*TUNING_KEY, "WITH_DK", "WITH_DV"]

# The descriptor forward's own list (the pointer list's shapes: TMA moves the same tiles). Each
# compiled for sm_90a without spills at bf16 head dims 64 and 128 (ptxas -v, Triton 3.9); fp32 and
# head dims above 128 were not checked, so `launch.use_tensor_descriptors` sends them to the
# pointer path (the dQ pass's too).
# Its software-pipelined loop holds a block's scores and the previous block's p at once: 128 rows
# on 4 warps spill at head dim 128 (about 800 B); with an option they spilled unpipelined too.
TMA_MAX_BLOCK_D = 128
FWD_TMA_CUDA_CONFIGS = [
    cuda_config(128, 64, 4, 2, 64, 0, options=False),
    cuda_config(128, 64, 4, 3, 64, 0, options=False),
    cuda_config(128, 64, 8, 2, 128, 0),
    cuda_config(128, 64, 8, 3, 128, 0),
    cuda_config(128, 128, 8, 2, 128, 0),
    cuda_config(64, 64, 4, 3, 128, 0),
    cuda_config(64, 32, 4, 2, 128, 0)
]
FWD_TMA_CONFIGS = triton_configs(
    {"BLOCK_M": 64, "BLOCK_N": 32}, FWD_TMA_CUDA_CONFIGS, covers=(TMA_MAX_BLOCK_D, 0)
)

# The dQ pass with k and v streamed through descriptors: the pointer list's software-pipelined
# configs. Pipelined, TMA removes the loads' addresses and masks from the hot loop
# (benchmarks/hot_loop.py, sm_90a, bf16, causal: M128 N64 275 -> 264 instructions at head dim 64,
# 345 -> 299 at 128; M64 N32 182 -> 178 and 244 -> 213); without a pipeline (1 stage) it sets up,
# waits for and invalidates a barrier per block, which costs more than the loads it replaces (M32
# N32: 124 -> 166, 181 -> 223). The dK/dV pass keeps pointers for its streamed q and dO: their
# blocks are short (16 to 64 rows) beside LSE and Delta, which stay pointer loads (a 1-D descriptor
# needs 16-byte aligned offsets), and descriptors there saved instructions on two of its six bf16
# configs at head dims 64 and 128 (M32 N64: 220 -> 217, 280 -> 260), added some on four (M16 N64:
# 145 -> 158; 1 stage: 174 -> 196), and spilled in the atomic-dQ pass at 128.
DQ_TMA_CUDA_CONFIGS = [
    cuda_config(128, 64, 8, 3, 128, 0),
    cuda_config(64, 32, 4, 2, 128, 0),
]
# Blackwell: M128 N64 spilled 8 B at head dim 128 (plain; not with an option) on sm_100a.
DQ_TMA_CUDA_CONFIGS = CudaConfigs(DQ_TMA_CUDA_CONFIGS, DQ_TMA_CUDA_CONFIGS[1:])
DQ_TMA_CONFIGS = triton_configs(
    {"BLOCK_M": 64, "BLOCK_N": 32}, DQ_TMA_CUDA_CONFIGS, covers=(TMA_MAX_BLOCK_D, 0)
)

# The atomic schedule's one backward pass holds a dq tile besides dk, dv, k and v, so it fits
# narrower query blocks than the deterministic pass. Each config takes the head blocks it compiles
# for without spills on sm_90a and sm_80 and without repeating MMA work across warps (as dK/dV:
# 64 query columns on 8 warps). At head block 256 even the smallest spills (44 B bf16, 916 B
# fp32), so larger head dims take the deterministic schedule (`attention_backward`).
ATOMIC_MAX_BLOCK_D = 128
DKDV_DQ_CUDA_CONFIGS = [
    cuda_config(32, 128, 8, 2, 64, 0),
    cuda_config(16, 64, 4, 2, 64, 0),
    cuda_config(64, 32, 8, 2, 128, 64, options=False),  # packed: 16 B spilled on sm_90a at 128
    cuda_config(64, 16, 8, 1, ATOMIC_MAX_BLOCK_D, ATOMIC_MAX_BLOCK_D)
]
# On Blackwell the atomic pass's five products are all on tcgen05 when both blocks have 64 rows
# or more (dq's rows are BLOCK_M, dk's and dv's BLOCK_N): M64 N64 on 8 warps in 2 stages at head
# dims up to 128 with every option (at most 238 registers; 4 warps spilled 248 B at 128, 1 stage
# 64 B with the cap), M64 N128 at 64 (248). fp32 at 128 spilled at M64 N64 (1 stage 300 B, 2
# stages 620 B and over shared memory, 3 stages 1852 B), the one tcgen05 shape, so Blackwell's
# fp32 atomic pass stops at head block 64 and 128 takes the deterministic passes
# (`atomic_max_block_d`), both on tcgen05 there.
ATOMIC_MAX_BLOCK_D_FP32_SM100 = 64
DKDV_DQ_CUDA_CONFIGS = CudaConfigs(
    DKDV_DQ_CUDA_CONFIGS, [
        cuda_config(64, 128, 8, 2, 64, 0),
        cuda_config(64, 64, 8, 2, ATOMIC_MAX_BLOCK_D, ATOMIC_MAX_BLOCK_D_FP32_SM100),
    ]
)
DKDV_DQ_CONFIGS = triton_configs(
    {"BLOCK_M": 32, "BLOCK_N": 64}, DKDV_DQ_CUDA_CONFIGS,
    covers=(ATOMIC_MAX_BLOCK_D, ATOMIC_MAX_BLOCK_D),
    covers_sm100=(ATOMIC_MAX_BLOCK_D, ATOMIC_MAX_BLOCK_D_FP32_SM100)
)


def atomic_max_block_d(element_size: int, major: int) -> int:
    """The largest head block the atomic-dQ pass takes for inputs of this element size on a GPU
    of this compute capability (major; 0 off CUDA); larger ones take the deterministic passes."""
    if major == 10 and element_size == 4:
        return ATOMIC_MAX_BLOCK_D_FP32_SM100
    return ATOMIC_MAX_BLOCK_D
