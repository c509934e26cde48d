"""Every fastlm Triton kernel as a GPU would compile it, read without a GPU.

Triton compiles for a GPU target on any machine, and its wheel ships `ptxas`. For each kernel
launch of fastlm at the shapes that matter (bf16, fp16, fp32; head dims 64, 128 and the largest
attention takes; hidden 4096; causal and not; attention's window, score cap and packed
sequences) and each config the launcher or autotuner may use, this compiles for sm_90a (H100,
H200), sm_80 (A100) and sm_100a (B200, B300; its own attention configs, `configs.CudaConfigs`)
and reads off: registers per thread, spill stores/loads and the stack
frame (ptxas -v with Triton's flags); shared memory (Triton's metadata) against the arch's
per-block limit; tensor cores (`wgmma.mma_async` on sm_90, `mma.sync` on sm_80, `tcgen05.mma`
on sm_100 with the tensor memory columns it allocates, Triton's `tmem_size`) and TMA
(`cp.async.bulk.tensor`); software pipelining (the `cp.async.ca/cg` copies Triton emits for
loads it prefetches across loop iterations); the widest and narrowest global access on the main
path (the loads, stores and async copies whose address the PTX data flow computes from a pointer
argument of the dtype under test, so that an index or an fp32 table does not count in a bf16
kernel); barriers (`bar.sync` / `barrier.sync`). For the attention kernels that multiply
matrices and the MoE grouped GEMMs (16-bit), the hot loop read from the SASS (`hot_loop.py`: its
instruction mix, the MMA it issues against its tile's FLOPs, the deepest `wgmma.wait_group`,
what runs beside a pending MMA and a clock model), printed as a second table.

A row is flagged when it spills, needs more shared memory than its arch has or issues more MMA
than its tile needs (work repeated across warps; a fallback config, kept only for head blocks no
better one fits, is noted instead), and on sm_100a when a `tl.dot` did not become `tcgen05.mma`
(`mma.sync` in its PTX: a product of fewer than 64 rows) or it allocates more than the 512
tensor memory columns an SM has, and the exit
status is 1 when any row is flagged (or fails to compile). Only shipped configs are compiled:
every config a launcher picks, and every config an attention autotuner tries at the row's head
block and dtype (the configs its pruning keeps; the last is FASTLM_AUTOTUNE=0's, "default").

Each case calls fastlm's own launcher on meta tensors (shapes, strides, dtypes, no memory) with
every kernel's `run` replaced by a recorder, so the arguments are exactly what the launcher
passes on a GPU (once per compute capability: the attention backward and the MoE launchers choose
by it, `launched_on`); they are specialised as a launch does (ints equal to 1 become constants,
ints and 16-byte aligned pointers divisible by 16 get `tt.divisibility`) and compiled with
`triton.compile`. Triton's on-disk cache (TRITON_CACHE_DIR) keeps each compiled kernel, and the
ptxas report beside it, under a key that includes the kernel's source: a rerun with unchanged
kernels takes seconds.

Each row carries `ptx_sha256`, a digest of its PTX without the debug line info: a change meant
to leave the generated code alone proves it with `--same-code-as` an earlier run's JSON, which
lists every row whose code differs and exits 1 if any does.

    python benchmarks/compile_report.py [--arch sm_90a sm_80 sm_100a] [--json rows.json] [--quick]
    python benchmarks/compile_report.py --op attention --same-code-as before.json
    python benchmarks/compile_report.py --baseline        # the whole report, kept in the repo
    python benchmarks/compile_report.py --baseline --arch sm_100a  # one arch's rows again
    python benchmarks/compile_report.py --check-baseline  # is the kept one this code's, clean?

The whole report takes tens of minutes on two cores, too long for every test run; so it is kept
in the repository (`baselines/compile_report.json`, written by `--baseline`; `results/` holds GPU
measurements only) with a fingerprint of
the kernels' code, and `--check-baseline` (run by the tests) exits 1 unless that fingerprint is
this tree's and no kept row is flagged: a kernel change that is not reported again fails CI.

Run it without TRITON_INTERPRET (the interpreter's autotuners hold one config, its launchers
choose interpreter tiles): with TRITON_INTERPRET=1 it refuses to run.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import contextlib
import hashlib
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest.mock
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    print(
        "compile_report.py: unset TRITON_INTERPRET; the report compiles for CUDA targets",
        file=sys.stderr,
    )
    sys.exit(2)

import torch  # noqa: E402
import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.cache import get_cache_manager  # noqa: E402
from triton.runtime.jit import JITFunction, MockTensor  # noqa: E402

# This checkout's kernels, whether or not (and wherever) fastlm is installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import hot_loop  # noqa: E402

# The modules (fastlm.kernels re-exports functions under some of the same names).
cross_entropy, cross_entropy_options, rmsnorm, rope, swiglu = (
    importlib.import_module(f"fastlm.kernels.{name}")
    for name in ("cross_entropy", "cross_entropy_options", "rmsnorm", "rope", "swiglu")
)
moe_experts, moe_routing = (
    importlib.import_module(f"fastlm.kernels.moe.{name}") for name in ("experts", "routing")
)


def _attention_internals() -> SimpleNamespace:
    """What the report calls inside fastlm's attention, in one place: the launchers it runs on
    meta tensors, the layout helpers, and each autotuned kernel with the configs it tries on
    CUDA (and the pruning the autotuner applies to them)."""
    configs, launch, forward, backward = (
        importlib.import_module(f"fastlm.kernels.attention.{name}")
        for name in ("configs", "launch", "forward", "backward")
    )
    return SimpleNamespace(
        forward=forward.attention_forward,
        backward=backward.attention_backward,
        backward_module=backward,  # whose `capability` `launched_on` stands in for
        as_heads=launch.as_heads,
        varlen=launch.Varlen,
        max_head_dim=configs.MAX_HEAD_DIM,
        max_head_dim_fp32=configs.MAX_HEAD_DIM_FP32,
        tma_max_block_d=configs.TMA_MAX_BLOCK_D,
        fitting_configs=configs.fitting_configs,
        for_capability=configs.for_capability,
        has_options=configs.has_options,
        configs={
            forward._attention_fwd_kernel: configs.FWD_CUDA_CONFIGS,
            backward._attention_bwd_dkdv_kernel: configs.DKDV_CUDA_CONFIGS,
            backward._attention_bwd_dq_kernel: configs.DQ_CUDA_CONFIGS,
            forward._attention_fwd_tma_autotuned: configs.FWD_TMA_CUDA_CONFIGS,
            backward._attention_bwd_dkdv_dq_kernel: configs.DKDV_DQ_CUDA_CONFIGS,
            backward._attention_bwd_dq_tma_autotuned: configs.DQ_TMA_CUDA_CONFIGS,
        },
        # Kernels the launcher picks only from a compute capability on (the descriptor forward:
        # sm_90+); on an older arch they never run, so they are not compiled for it.
        min_capability={"_attention_fwd_tma_kernel": 90},
    )


ATTENTION = _attention_internals()

#: Targets: compute capability and the largest shared memory one block may use (opt-in limit:
#: 227 KB on compute capability 9.0 and 10.0, 163 KB on 8.0, the CUDA programming guide's table).
ARCHS = {"sm_90a": (90, 232448), "sm_80": (80, 166912), "sm_100a": (100, 232448)}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOKENS = 16384  # rows of the row-wise kernels: 4 sequences of 4096 tokens
HIDDEN = 4096
D_FF = 11008  # LLaMA-7B's at hidden 4096
VOCAB = 32000
SEQ = 4096


# --------------------------------------------------------------------------------------------
# Recording launches
# --------------------------------------------------------------------------------------------


@dataclass
class Launch:
    """One recorded kernel launch: the kernel object and its arguments by name."""

    kernel: JITFunction | Autotuner
    args: dict
    options: dict  # num_warps, num_stages, ... as passed to the launch


def _kernel_objects() -> list[JITFunction | Autotuner]:
    """Every kernel of fastlm.kernels' modules (helpers imported in several counted once)."""
    modules = [m for name, m in sys.modules.items() if name.startswith("fastlm.kernels")]
    kernels = {
        id(obj): obj
        for module in modules
        for obj in vars(module).values()
        if isinstance(obj, (JITFunction, Autotuner))
    }
    return list(kernels.values())


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """Within the block, fastlm's kernels record their launches instead of running."""
    launches: list[Launch] = []
    kernels = _kernel_objects()

    def recorder(kernel):
        fn = kernel.fn if isinstance(kernel, Autotuner) else kernel

        def run(*args, grid, warmup, **kwargs):
            named = dict(zip(fn.arg_names, args))
            named.update((k, v) for k, v in kwargs.items() if k in fn.arg_names)
            options = {k: v for k, v in kwargs.items() if k not in fn.arg_names}
            launches.append(Launch(kernel, named, options))

        return run

    for kernel in kernels:
        kernel.run = recorder(kernel)  # an instance attribute shadows the class's `run`
    try:
        yield launches
    finally:
        for kernel in kernels:
            del kernel.run


def meta(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, device="meta", dtype=dtype)


@contextlib.contextmanager
def triton_backend(*modules):
    """Make `use_triton` say yes for meta tensors in the given launcher modules."""
    saved = [module.use_triton for module in modules]
    for module in modules:
        module.use_triton = lambda x: True
    try:
        yield
    finally:
        for module, use in zip(modules, saved):
            module.use_triton = use


# --------------------------------------------------------------------------------------------
# The cases: each calls a launcher on meta tensors
# --------------------------------------------------------------------------------------------


@dataclass
class Case:
    op: str  # what the launch computes, e.g. "RMSNorm fwd"
    label: str  # the specialisation, e.g. "bf16 N=4096"
    launch: Callable[[], None]
    fields: dict = field(default_factory=dict)  # the specialisation as data, for --json
    only: str = ""  # the one kernel (by name) whose launches the case adds, if not every one


def rmsnorm_cases(dtypes) -> Iterator[Case]:
    for name in dtypes:
        dtype = DTYPES[name]
        x, r, w = (
            meta((TOKENS, HIDDEN), dtype),
            meta((TOKENS, HIDDEN), dtype),
            meta((HIDDEN,), dtype),
        )
        rstd = meta((TOKENS,), torch.float32)
        fields, label = dict(dtype=name, hidden=HIDDEN), f"{name} N={HIDDEN}"
        forward, backward = rmsnorm._rms_norm_forward, rmsnorm._rms_norm_backward
        yield Case("RMSNorm fwd", label, partial(forward, x, None, w, 1e-5, dtype), fields)
        yield Case("add+RMSNorm fwd", label, partial(forward, x, r, w, 1e-5, dtype), fields)
        yield Case("RMSNorm bwd", label, partial(backward, x, None, x, w, rstd, dtype), fields)
        yield Case("add+RMSNorm bwd", label, partial(backward, x, r, x, w, rstd, dtype), fields)
        if dtype != torch.float32:  # the autocast stream: a half delta, fp32 residual and weight
            r32, w32 = meta((TOKENS, HIDDEN), torch.float32), meta((HIDDEN,), torch.float32)
            mixed = f"{name}+fp32 N={HIDDEN}"
            yield Case("add+RMSNorm fwd", mixed, partial(forward, x, r32, w32, 1e-5, dtype), fields)
            mixed_backward = partial(backward, x, r32, r32, w32, rstd, dtype, torch.float32)
            yield Case("add+RMSNorm bwd", mixed, mixed_backward, fields)


def rope_cases(dtypes, head_dims) -> Iterator[Case]:
    """q and k rotated in place as views of a fused QKV projection output, as in the model."""
    for name in dtypes:
        for d in head_dims:
            heads = HIDDEN // d
            qkv = meta((TOKENS // SEQ, SEQ, 3, heads, d), DTYPES[name])
            q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
            cos, sin = meta((SEQ, d // 2), torch.float32), meta((SEQ, d // 2), torch.float32)
            positions = meta((SEQ,), torch.int64)
            for interleaved in (True, False):
                layout = "interleaved" if interleaved else "half-split"
                launch = partial(rope._launch, (q, k), (q, k), cos, sin, positions, interleaved)
                fields = dict(dtype=name, head_dim=d, layout=layout)
                yield Case(f"RoPE {layout}", f"{name} D={d}", partial(launch, False), fields)


def swiglu_cases(dtypes) -> Iterator[Case]:
    """The gated units' kernels: SwiGLU, GeGLU (tanh and exact GELU) as their ACTIVATION, and
    SwiGLU with gpt-oss's options on an interleaved gate/up."""
    units = {"SwiGLU": swiglu.SILU, "GeGLU tanh": swiglu.GELU_TANH, "GeGLU": swiglu.GELU}
    for name in dtypes:
        gate, up = meta((TOKENS, D_FF), DTYPES[name]), meta((TOKENS, D_FF), DTYPES[name])
        fields, label = dict(dtype=name, d_ff=D_FF), f"{name} N={D_FF}"
        for unit, activation in units.items():
            forward = partial(swiglu._forward_rows, gate, up, gate, activation)
            yield Case(f"{unit} fwd", label, forward, fields)
            backward = partial(swiglu._backward_rows, gate, gate, up, gate, up, activation)
            yield Case(f"{unit} bwd", label, backward, fields)
        # gpt-oss's experts: the clamped SwiGLU on interleaved gate/up (INTERLEAVED: up None).
        gate_up = meta((TOKENS, 2 * D_FF), DTYPES[name])
        options = dict(activation=swiglu.SILU_OPTIONS, alpha=1.702, limit=7.0, up_offset=1.0)
        forward = partial(swiglu._forward_rows, gate_up, None, gate, **options)
        yield Case("SwiGLU clamped interleaved fwd", label, forward, fields)
        backward = partial(swiglu._backward_rows, gate, gate_up, None, gate_up, None, **options)
        yield Case("SwiGLU clamped interleaved bwd", label, backward, fields)


#: Qwen3-30B-A3B's experts: hidden 2048, expert width 768, 128 experts, 8 per token.
MOE = dict(D=2048, F=768, E=128, k=8)


def moe_cases(dtypes) -> Iterator[Case]:
    """The mixture-of-experts kernels at Qwen3-30B-A3B's sizes (TOKENS tokens): the routing
    metadata once (it reads only ids), the forward's and the backward's launches per dtype, and
    in bf16 gpt-oss's form (transposed weights, interleaved gate/up, biases, the clamp) and
    Nemotron-H's (non-gated ReLU² experts: up (E, F, D) alone)."""
    D, F, E, k = MOE["D"], MOE["F"], MOE["E"], MOE["k"]
    ids = meta((TOKENS, k), torch.int64)
    routing = f"T={TOKENS} E={E} k={k}"
    fields = dict(dtype="i64", E=E, k=k)  # the ids: the one tensor the routing kernels read
    yield Case("MoE routing", routing, partial(moe_routing.route, ids, E), fields)
    sorted_assignments = meta((TOKENS * k,), torch.int32)
    offsets = meta((E + 1,), torch.int32)
    plain = dict(alpha=1.0, limit=None, up_offset=0.0)
    gpt_oss = dict(alpha=1.702, limit=7.0, up_offset=1.0)
    for name in dtypes:
        dtype = DTYPES[name]
        x, weights, dout = (
            meta((TOKENS, D), dtype),
            meta((TOKENS, k), dtype),
            meta((TOKENS, D), dtype),
        )
        forms = [("SwiGLU", False, plain, "silu")]
        if name == "bf16":
            forms += [("gpt-oss", True, gpt_oss, "silu"), ("ReLU2", False, plain, "relu2")]
        for form, transposed, options, activation in forms:
            if activation == "relu2":
                gate_up, down, biases = meta((E, F, D), dtype), meta((E, D, F), dtype), (None, None)
            elif transposed:
                gate_up, down = meta((E, D, 2 * F), dtype), meta((E, F, D), dtype)
                biases = meta((E, 2 * F), dtype), meta((E, D), dtype)
            else:
                gate_up, down, biases = (
                    meta((E, 2 * F, D), dtype),
                    meta((E, D, F), dtype),
                    (None, None),
                )
            args = (x, weights, gate_up, down, *biases, sorted_assignments, offsets, transposed,
                    transposed, activation, options)  # fmt: skip
            fields = dict(dtype=name, form=form, **MOE)
            label = f"{name} {form} D={D} F={F} E={E} k={k}"
            yield Case("MoE fwd", label, partial(moe_experts.experts_forward, *args), fields)
            backward = partial(moe_experts.experts_backward, dout, *args)
            yield Case("MoE bwd", label, backward, fields)


def cross_entropy_cases(dtypes) -> Iterator[Case]:
    for name in dtypes:
        logits = meta((TOKENS // 2, VOCAB), DTYPES[name])
        targets = meta((TOKENS // 2,), torch.int64)
        loss, stats = meta((TOKENS // 2,), torch.float32), meta((TOKENS // 2, 2), torch.float32)
        scale = meta((), torch.float32)
        fields, label = dict(dtype=name, vocab=VOCAB), f"{name} V={VOCAB}"
        forward = partial(cross_entropy._cross_entropy_rows, logits, targets, -100, loss, stats)
        yield Case("cross-entropy fwd+grad", label, partial(forward, logits), fields)
        # inplace_backward's forward: the mean loss's gradient, scaled by 1 / n_valid on the way.
        in_place = partial(forward, logits, meta((), torch.float32))
        yield Case("cross-entropy fwd+grad (in place)", label, in_place, fields)
        yield Case("cross-entropy fwd", label, partial(forward, None), fields)
        scaling = partial(cross_entropy._scale_rows, logits, meta((), torch.float32))
        yield Case("cross-entropy in-place bwd", label, scaling, fields)
        backward = partial(cross_entropy._cross_entropy_grad_rows, logits, targets, -100, stats)
        yield Case("cross-entropy bwd", label, partial(backward, scale), fields)
        # The options' kernels (cap, label smoothing, z-loss), as Gemma 2's fine-tuning runs them.
        options = (30.0, 0.1, 1e-4)
        rows = partial(cross_entropy_options._rows_forward, logits, targets, -100, options)
        yield Case("cross-entropy options fwd+grad", label, partial(rows, logits), fields)
        yield Case("cross-entropy options fwd", label, rows, fields)
        scales = meta((TOKENS // 2,), torch.float32)
        backward = partial(
            cross_entropy_options._rows_backward, logits, targets, -100, stats, scales, options
        )
        yield Case("cross-entropy options bwd", label, backward, fields)


#: The attention options' rows: a window of a quarter of the sequence, Gemma 2's score cap.
WINDOW = SEQ // 4
SOFTCAP = 50.0


#: gpt-oss's attention: head dim 64, a window of 128 on alternate layers, sinks.
GPT_OSS_WINDOW = 128


def _qkv_views(d: int, d_v: int, heads: int, dtype, packed: bool):
    """q, k (head dim d), v (d_v), o (d_v) as the launchers' (B, H, N, D) views of token-major
    memory: one fused q|k|v projection when d == d_v, else (MLA) a fused q|k and its own v."""
    rows = (TOKENS,) if packed else (TOKENS // SEQ, SEQ)
    if d == d_v:
        qkv = meta((*rows, 3, heads, d), dtype)
        q, k, v = (qkv[..., i, :, :] for i in range(3))
    else:
        qk = meta((*rows, 2, heads, d), dtype)
        q, k, v = qk[..., 0, :, :], qk[..., 1, :, :], meta((*rows, heads, d_v), dtype)
    o = meta((*rows, heads, d_v), dtype)
    heads_view = ATTENTION.as_heads if packed else (lambda t: t.transpose(1, 2))
    return tuple(heads_view(t) for t in (q, k, v, o))


def attention_cases(specs) -> Iterator[Case]:
    """q, k, v as views of a fused QKV output, outputs and gradients token-major, as in the
    model. `d` is the head dim, or (q and k's, v's) for MLA. `option` (None, or "+"-joined
    "window", "softcap", "approx", "varlen", "sinks", "gpt-oss") adds those constexpr variants: a
    window of WINDOW keys (both sides when not causal), the cap (with "approx" its approximate
    tanh), the batch packed as sequences of SEQ
    tokens (`Varlen`, cu_seqlens on the device), attention sinks, or gpt-oss's window of
    GPT_OSS_WINDOW with sinks."""
    for name, dims, causal, option in specs:
        d, d_v = dims if isinstance(dims, tuple) else (dims, dims)
        heads, dtype = HIDDEN // d_v, DTYPES[name]
        parts = option.split("+") if option else []
        options = {}
        if "window" in parts:
            options["window"] = (WINDOW, 0 if causal else WINDOW)
        if "softcap" in parts:
            options["softcap"] = SOFTCAP
        if "approx" in parts:
            options["softcap_approx"] = True
        if "gpt-oss" in parts:
            options["window"] = (GPT_OSS_WINDOW, 0 if causal else GPT_OSS_WINDOW)
        if "sinks" in parts or "gpt-oss" in parts:
            options["sinks"] = meta((heads,), torch.float32)
        packed = "varlen" in parts
        q, k, v, o = _qkv_views(d, d_v, heads, dtype, packed)
        if packed:
            lse = meta((1, heads, TOKENS), torch.float32)
            cu = meta((TOKENS // SEQ + 1,), torch.int32)
            options["varlen"] = ATTENTION.varlen(cu, cu, SEQ, SEQ)
        else:
            lse = meta((TOKENS // SEQ, heads, SEQ), torch.float32)
        fields = dict(dtype=name, head_dim=d, causal=causal, option=option)
        if d_v != d:
            fields["head_dim_v"] = d_v
        label = f"{name} D={d}{f'/{d_v}' if d_v != d else ''} {'causal' if causal else 'full'}"
        label += "".join(
            {
                "window": f" window={WINDOW}",
                "softcap": f" softcap={SOFTCAP:g}",
                "approx": " approx",
                "varlen": " varlen",
                "sinks": " sinks",
                "gpt-oss": f" window={GPT_OSS_WINDOW} sinks",
            }[part]
            for part in parts
        )
        scale = d**-0.5
        forward = partial(ATTENTION.forward, q, k, v, causal, scale, True, **options)
        yield Case("attention fwd", label, forward, fields)
        descriptors = dtype != torch.float32 and max(d, d_v) <= ATTENTION.tma_max_block_d
        if descriptors:
            tma = partial(_with_tensor_descriptors, forward)
            yield Case("attention fwd (TMA)", label, tma, fields)
        backward = partial(ATTENTION.backward, o, q, k, v, o, lse, causal, scale, True)
        yield Case("attention bwd", label, partial(backward, True, **options), fields)
        atomic = partial(backward, False, **options)
        yield Case("attention bwd (atomic dQ)", label, atomic, fields)
        if descriptors:
            dq_tma = partial(_with_tensor_descriptors, partial(backward, True, **options))
            yield Case("attention bwd dQ (TMA)", label, dq_tma, fields, "_attention_bwd_dq_kernel")


def _with_tensor_descriptors(launcher):
    """Run the launcher with the descriptor paths forced (meta tensors have no device to ask)."""
    with unittest.mock.patch.dict(os.environ, FASTLM_ATTENTION_TMA="1"):
        return launcher()


def cases(quick: bool) -> list[Case]:
    """Everything; `quick`: bf16 only, attention at head dim 128 causal, plain and with each
    option, no MoE rows (the CI test's rows)."""
    # Each option's variant of the kernels at the most common head dim, causal (and the window
    # both sides, full).
    options = [("bf16", 128, True, "window"), ("bf16", 128, False, "window")]
    options += [("bf16", 128, True, "softcap"), ("bf16", 128, True, "varlen")]
    if quick:
        dtypes, head_dims = ["bf16"], [64, 128]
        attention_specs = [("bf16", 128, True, None), *options]
    else:
        dtypes, head_dims = list(DTYPES), [64, 128]
        # Every head block class for both element sizes (the configs' limits), non-causal and
        # fp16 where they could differ from bf16 causal: at the most common head dim.
        attention_specs = [
            (name, d, True, None)
            for name in ("bf16", "fp32")
            for d in (64, 128, 256, ATTENTION.max_head_dim)
            if name != "fp32" or d <= ATTENTION.max_head_dim_fp32
        ] + [("bf16", 128, False, None), ("fp16", 128, True, None), *options]
        # The newer families' shapes: gpt-oss (head dim 64, a window of 128 with sinks, or
        # sinks alone), DeepSeek's MLA (q and k 192, v 128; dense and packed) and 96 / 64.
        attention_specs += [("bf16", 64, True, "gpt-oss"), ("bf16", 64, True, "sinks")]
        attention_specs += [("bf16", (192, 128), True, None), ("bf16", (192, 128), True, "varlen")]
        attention_specs += [("bf16", (96, 64), True, None)]
        # The approximate cap (softcap_approx): the hot-loop test reads its rows in the kept report.
        attention_specs += [("bf16", 128, True, "softcap+approx")]
        # Gemma 4's global layers (head dim 512): with every option at once, and packed.
        attention_specs += [
            ("bf16", 512, True, "window+softcap+sinks"),
            ("bf16", 512, True, "varlen"),
        ]
    return [
        *rmsnorm_cases(dtypes),
        *rope_cases(dtypes, head_dims),
        *swiglu_cases(dtypes),
        *cross_entropy_cases(dtypes),
        *(moe_cases(dtypes) if not quick else ()),  # the CI's quick run: not its compile time
        *attention_cases(attention_specs),
    ]


# --------------------------------------------------------------------------------------------
# From launches to compile tasks
# --------------------------------------------------------------------------------------------


class _Pointer(MockTensor):
    """A tensor argument as Triton's launch specialisation sees it: a dtype and an address, here
    the byte offset into a 16-byte aligned allocation (what PyTorch's allocators return)."""

    def __init__(self, t: torch.Tensor):
        super().__init__(t.dtype)
        self.offset = t.storage_offset() * t.element_size()

    def data_ptr(self):
        return self.offset


def specialise(fn: JITFunction, args: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for ASTSource, as a launch with these arguments makes them."""
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(fn.params):
        value = args.get(param.name, param.default)
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
            continue
        if isinstance(value, torch.Tensor):
            value = _Pointer(value)
        specialize = not param.do_not_specialize, not param.do_not_specialize_on_alignment
        kind, key = native_specialize_impl(BaseBackend, value, param.is_const, *specialize)
        signature[param.name] = kind
        if kind == "constexpr":  # an int equal to 1
            constexprs[param.name] = value
        elif key:
            attrs[(index,)] = BaseBackend.parse_attr(key)
    return signature, constexprs, attrs


@dataclass
class Task:
    """One compile: picklable, for the worker processes."""

    op: str
    label: str
    fields: dict
    module: str
    kernel: str
    blocks: dict
    default: bool  # the FASTLM_AUTOTUNE=0 config of an autotuned kernel
    arch: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    fallback: bool = False  # a config kept only for the head blocks no better one fits
    mma_sync: str = ""  # on sm_100: why it is kept on mma.sync (no tcgen05 config fits)


def _blocks(args: dict) -> dict:
    return {
        k: v for k, v in args.items() if k.startswith("BLOCK_") and k not in ("BLOCK_D", "BLOCK_DV")
    }


def shipped_configs(launch: Launch, arch: str) -> list:
    """The configs an attention autotuner tries for this launch (its head block and dtype) on a
    GPU of this arch (Blackwell has its own); the last is the one FASTLM_AUTOTUNE=0 keeps."""
    return ATTENTION.fitting_configs(
        ATTENTION.for_capability(ATTENTION.configs[launch.kernel], ARCHS[arch][0] // 10),
        launch.args["BLOCK_D"],
        launch.args["Q"].element_size(),
        ATTENTION.has_options(launch.args),
        launch.args["BLOCK_DV"],
    )


def tasks(all_cases: list[Case], archs: list[str]) -> list[Task]:
    """Each case's launches as its launchers make them on a GPU of each arch (Blackwell routes
    some apart: `launched_on`), every shipped config of each, launch by launch."""
    out = []
    for case in all_cases:
        by_arch = {}
        for major in dict.fromkeys(ARCHS[arch][0] // 10 for arch in archs):
            with recording() as launches, triton_backend(swiglu, cross_entropy):
                with launched_on(major):
                    case.launch()
            by_arch.update((arch, launches) for arch in archs if ARCHS[arch][0] // 10 == major)
        for arch, launch in (
            (arch, by_arch[arch][index])
            for index in range(max(map(len, by_arch.values())))
            for arch in archs
            if index < len(by_arch[arch])
        ):
            fn = launch.kernel.fn if isinstance(launch.kernel, Autotuner) else launch.kernel
            if case.only and fn.fn.__name__ != case.only:
                continue
            minimum = ATTENTION.min_capability.get(fn.fn.__name__, 0)
            if "TMA" in case.op:  # a pointer kernel's descriptor variant: where TMA is
                minimum = max(minimum, ATTENTION.min_capability["_attention_fwd_tma_kernel"])
            label = case.label  # the split dK/dV pass launches its kernel once per gradient
            if launch.args.get("WITH_DK") is False:
                label += " (dV)"
            elif launch.args.get("WITH_DV") is False:
                label += " (dK)"
            where = (case.op, label, case.fields, fn.fn.__module__, fn.fn.__name__)
            if ARCHS[arch][0] < minimum:
                continue
            for args, options, default, fallback, mma_sync in _variants(launch, arch):
                compiled = (*specialise(fn, args), options)
                task = Task(*where, _blocks(args), default, arch, *compiled, fallback, mma_sync)
                out.append(task)
    return out


@contextlib.contextmanager
def launched_on(major: int) -> Iterator[None]:
    """Within the block, the launchers take the report's meta tensors (which have no device to
    ask) for tensors on a GPU of this compute capability (major): the attention backward routes
    by it, the MoE launchers choose their tiles by it (`moe_experts._configs`)."""
    with (
        unittest.mock.patch.object(ATTENTION.backward_module, "capability", lambda t: major),
        unittest.mock.patch.object(moe_experts, "capability", lambda t: major),
    ):
        yield


def _variants(launch: Launch, arch: str) -> list[tuple[dict, dict, bool, bool, str]]:
    """(arguments, launch options, FASTLM_AUTOTUNE=0's config, fallback config, why it is kept
    on mma.sync or "") of each config a launch compiles on this arch: an autotuned kernel's shipped
    configs, else the launch's."""
    if not isinstance(launch.kernel, Autotuner):
        return [(launch.args, launch.options, False, False, "")]
    configs = shipped_configs(launch, arch)
    return [
        (
            {**launch.args, **c.blocks},
            dict(num_warps=c.num_warps, num_stages=c.num_stages),
            i == len(configs) - 1,
            c.min_block_d > 0,
            c.mma_sync,
        )
        for i, c in enumerate(configs)
    ]


# --------------------------------------------------------------------------------------------
# Compiling and reading the result (runs in worker processes)
# --------------------------------------------------------------------------------------------

# fastlm.backend (imported with the kernels) sets TRITON_DEFAULT_FP_FUSION=1, as for a launch
# on a GPU; the kept report records it (`fp_fusion`).
# ptxas's report of each fresh compile is printed (and captured below) instead of discarded.
triton.knobs.nvidia.dump_ptxas_log = True

PTXAS_LOG = "ptxas_v.log"


def _gpu_name(capability: int) -> str:
    return f"sm_{capability}{'a' if capability >= 90 else ''}"


def _run_ptxas(ptx: str, capability: int) -> str:
    """ptxas -v on the PTX with the flags Triton uses for its cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "kernel.ptx")
        source.write_text(ptx)
        flags = ["-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={_gpu_name(capability)}"]
        command = [get_ptxas(capability).path, *flags, str(source), "-o", str(Path(tmp, "k.cubin"))]
        result = subprocess.run(command, capture_output=True, text=True, check=True)
    return result.stderr


def _ptxas_log(compiled, printed: str, capability: int) -> tuple[str, bool]:
    """The ptxas -v report of a compiled kernel, kept in Triton's cache beside it; and whether it
    came from there."""
    cache = get_cache_manager(compiled.hash)
    filename = f"{compiled.name}.{PTXAS_LOG}"
    if "registers" in printed:  # a fresh compile: Triton's own ptxas run printed it
        cache.put(printed, filename, binary=False)
        return printed, False
    path = cache.get_file(filename)
    if path is not None:
        return Path(path).read_text(), True
    log = _run_ptxas(compiled.asm["ptx"], capability)
    cache.put(log, filename, binary=False)
    return log, False


def _number(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    return int(match.group(1)) if match else 0


_PTX_ACCESS = re.compile(
    r"^\s*(?:@!?%\w+\s+)?((?:ld|st)\.global[\w.:]*|cp\.async\.c[ag]\.shared"
    r"\.global)\s+(.*)$"
)
_PTX_DEF = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)\s+(%rd\d+)\s*,(.*)$")
_PTX_BITS = re.compile(r"^[bsuf](8|16|32|64)$|^bf16$")


def _access_bytes(opcode: str, operands: str) -> int:
    if opcode.startswith("cp.async"):  # cp.async.cg.shared.global [dst], [src], bytes
        return int(operands.split(",")[2].strip().rstrip(";"), 0)
    vector, bits = 1, 0
    for part in opcode.split("."):
        if re.fullmatch(r"v\d+", part):
            vector = int(part[1:])
        elif _PTX_BITS.match(part):
            bits = 16 if part == "bf16" else int(part[1:])
    return vector * bits // 8


def _pointer_params(ptx: str) -> Callable[[str], set[int]]:
    """For a 64-bit register, the kernel parameters (by index) its value is computed from: the
    PTX data flow, followed back through every definition (loop-carried ones included)."""
    sources: dict[str, set[str]] = {}
    for line in ptx.splitlines():
        match = _PTX_DEF.match(line)
        if match and not match.group(1).startswith(("st.", "cp.")):
            operands = match.group(3)
            sources.setdefault(match.group(2), set()).update(
                re.findall(r"%rd\d+|_param_\d+", operands)
            )
    resolved: dict[str, set[int]] = {}

    def params(register: str) -> set[int]:
        if register not in resolved:
            resolved[register] = set()  # a cycle through a loop adds nothing new
            found = set()
            for source in sources.get(register, ()):
                if source.startswith("_param_"):
                    found.add(int(source.removeprefix("_param_")))
                else:
                    found |= params(source)
            resolved[register] = found
        return resolved[register]

    return params


def global_accesses(ptx: str, main_params: set[int]) -> dict[str, Counter]:
    """Bytes per global access instruction (static counts), loads and stores: all of them, and
    those of the main path (addresses computed from a parameter in `main_params`)."""
    params = _pointer_params(ptx)
    counts = {key: Counter() for key in ("ld", "st", "ld_main", "st_main")}
    for line in ptx.splitlines():
        match = _PTX_ACCESS.match(line)
        if not match:
            continue
        opcode, operands = match.groups()
        kind = "st" if opcode.startswith("st") else "ld"
        size = _access_bytes(opcode, operands)
        counts[kind][size] += 1
        addresses = re.findall(r"\[\s*(%rd\d+)", operands)  # cp.async: [shared], [global]
        address = addresses[-1] if opcode.startswith("cp.async") else addresses[0]
        if params(address) & main_params:
            counts[f"{kind}_main"][size] += 1
    return counts


def main_params(signature: dict, dtype: str) -> set[int]:
    """PTX parameter indices of the pointers to `dtype` (constexprs are not parameters)."""
    runtime = [kind for kind in signature.values() if kind != "constexpr"]
    return {i for i, kind in enumerate(runtime) if kind == f"*{dtype}"}


_PTX_DEBUG = re.compile(r"\s*(?:\.loc|\.file|//|\$L__tmp\d+:)")


def ptx_digest(ptx: str) -> str:
    """sha256 of the PTX without its debug line info (`.loc`, `.file`, the `$L__tmp` labels and
    the debug sections), which moves with every edit of the source: two versions of a kernel
    with equal digests generate the same code (how a refactor proves it changed nothing)."""
    debug = ptx.find(".section\t.debug")
    code = ptx if debug < 0 else ptx[:debug]
    lines = (line for line in code.splitlines() if not _PTX_DEBUG.match(line))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


#: Tensor memory (sm_100): 512 columns of 128 lanes x 32 bits per SM, allocated per CTA in
#: powers of two from 32 columns.
TMEM_COLUMNS = 512


def tcgen05_resources(ptx: str, meta_data) -> dict:
    """Blackwell's tensor cores in a compiled kernel: the `tcgen05.mma` instructions of its PTX,
    and the tensor memory columns it allocates (Triton's `tmem_size`, else the largest
    `tcgen05.alloc` of the PTX; 0 on older archs)."""
    allocs = [int(n) for n in re.findall(r"tcgen05\.alloc\.[\w:.]+\s+\[[^\]]*\],\s*(\d+)", ptx)]
    return dict(
        tcgen05=len(re.findall(r"\btcgen05\.mma\b", ptx)),
        tmem_columns=getattr(meta_data, "tmem_size", 0) or max(allocs, default=0),
    )


def tcgen05_problems(row: dict, mma_sync: str) -> list[str]:
    """What an sm_100 row must not do: multiply on the warp-level `mma.sync` (a `tl.dot` that
    did not become `tcgen05.mma`: Hopper's wgmma does not exist there), unless its config is
    kept for that (`mma_sync`, the reason: noted instead), or allocate more tensor memory than an
    SM has."""
    problems = []
    if row["mma"] and mma_sync:
        row["notes"].append(f"tl.dot on mma.sync (kept: no tcgen05 config fits; {mma_sync})")
    elif row["mma"]:
        problems.append("tl.dot off tcgen05 (mma.sync)")
    if row["tmem_columns"] > TMEM_COLUMNS:
        problems.append("tensor memory")
    return problems


def compile_task(task: Task) -> dict:
    """Compile one task and read its resources; a compile error is a flagged row."""
    capability, shared_limit = ARCHS[task.arch]
    row = dict(
        op=task.op,
        kernel=task.kernel,
        case=task.label,
        **task.fields,
        blocks=task.blocks,
        default=task.default,
        arch=task.arch,
        shared_limit=shared_limit,
        problems=[],
        notes=[],
    )
    start = time.perf_counter()
    try:
        kernel = getattr(importlib.import_module(task.module), task.kernel)
        fn = kernel.fn if isinstance(kernel, Autotuner) else kernel
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            compiled = triton.compile(
                ASTSource(fn, task.signature, task.constexprs, task.attrs),
                target=GPUTarget("cuda", capability, 32),
                options=task.options,
            )
        log, cached = _ptxas_log(compiled, printed.getvalue(), capability)
    except Exception as error:  # a compile failure is reported as a flagged row
        message = " ".join(str(error).split())[:300]
        row.update(
            problems=[f"compile error: {type(error).__name__}: {message}"],
            seconds=time.perf_counter() - start,
        )
        return row
    ptx, meta_data = compiled.asm["ptx"], compiled.metadata
    accesses = global_accesses(ptx, main_params(task.signature, task.fields["dtype"]))
    row.update(
        num_warps=meta_data.num_warps,
        num_stages=meta_data.num_stages,
        registers=_number(r"Used (\d+) registers", log),
        spill_stores=_number(r"(\d+) bytes spill stores", log),
        spill_loads=_number(r"(\d+) bytes spill loads", log),
        stack=_number(r"(\d+) bytes stack frame", log),
        ptxas_barriers=_number(r"used (\d+) barriers", log),
        shared=meta_data.shared,
        wgmma=ptx.count("wgmma.mma_async"),
        mma=ptx.count("mma.sync"),
        **tcgen05_resources(ptx, meta_data),
        tma=ptx.count("cp.async.bulk.tensor"),
        async_copies=len(re.findall(r"\bcp\.async\.c[ag]\.shared", ptx)),
        barriers=len(re.findall(r"\b(?:bar|barrier)\.sync\b", ptx)),
        accesses={k: dict(sorted(v.items())) for k, v in accesses.items()},
        ptx_sha256=ptx_digest(ptx),
        seconds=time.perf_counter() - start,
        cached=cached,
    )
    if row["spill_stores"] or row["spill_loads"]:
        row["problems"].append("spills")
    if row["shared"] > shared_limit:
        row["problems"].append("shared memory")
    if capability >= 100:
        row["problems"] += tcgen05_problems(row, task.mma_sync)
    if hot_loop.reads(task.kernel, task.fields.get("dtype")):
        sass = hot_loop.disassemble(compiled.asm["cubin"])
        figures = hot_loop.analyse(
            sass, ptx, task.kernel, task.constexprs, row["num_warps"], task.arch
        )
        for problem in figures.pop("problems"):
            if problem == "duplicated MMA" and task.fallback:
                row["notes"].append("duplicated MMA (a fallback config)")
            else:
                row["problems"].append(problem)
        row["hot_loop"] = figures
    return row


# --------------------------------------------------------------------------------------------
# Table and command line
# --------------------------------------------------------------------------------------------


def _widths(sizes: dict) -> str:
    if not sizes:
        return "-"
    low, high = min(sizes), max(sizes)
    return str(high) if low == high else f"{low}-{high}"


def _tensor_cores(row: dict) -> str:
    """The tensor-core instructions of a row: wgmma, mma (mma.sync), tcgen05 with its tensor
    memory columns."""
    kinds = [kind for kind in ("wgmma", "mma") if row[kind]]
    if row.get("tcgen05"):
        kinds.append(f"tcgen05 ({row['tmem_columns']} TMEM cols)")
    return " + ".join(kinds)


def table(rows: list[dict]) -> str:
    columns = ["op", "kernel", "case", "config", "arch", "regs", "spill st/ld B"]
    columns += ["smem KB / limit", "tensor cores", "TMA", "cp.async", "main ld B", "main st B"]
    columns += ["bar.sync", "flags"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        if "registers" not in row:
            config = hot_loop.config_label(row)
            cells = [row["op"], f"`{row['kernel']}`", row["case"], config, row["arch"]]
            cells += ["-"] * 9 + ["; ".join(row["problems"])]
        else:
            accesses = row["accesses"]
            tensor_cores = _tensor_cores(row)
            cells = [
                row["op"],
                f"`{row['kernel']}`",
                row["case"],
                hot_loop.config_label(row),
                row["arch"],
                str(row["registers"]),
                f"{row['spill_stores']}/{row['spill_loads']}",
                f"{row['shared'] / 1024:.0f} / {row['shared_limit'] / 1024:.0f}",
                tensor_cores or "-",
                "yes" if row["tma"] else "-",
                str(row["async_copies"]) if row["async_copies"] else "-",
                _widths(accesses["ld_main"]),
                _widths(accesses["st_main"]),
                str(row["barriers"]),
                ", ".join(row["problems"] + row.get("notes", [])) or "ok",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(task_list: list[Task], jobs: int) -> list[dict]:
    """Compile every task (the slow ones first, so that the pool drains evenly); rows in order."""
    order = sorted(
        range(len(task_list)),
        key=lambda i: (not task_list[i].op.startswith("attention"), -len(task_list[i].blocks)),
    )
    rows: list[dict | None] = [None] * len(task_list)
    if jobs == 1:
        for i in order:
            rows[i] = compile_task(task_list[i])
        return rows
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(compile_task, task_list[i]): i for i in order}
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            rows[futures[future]] = future.result()
            if done % 50 == 0:
                print(f"compile_report: {done}/{len(task_list)} compiled", file=sys.stderr)
    return rows


def _row_keys(rows: list[dict]) -> list[tuple]:
    """Each row's key: op, kernel, case, config, arch, and its place among the rows of that key
    (two launches of one kernel with one config, as the MoE forward's two grouped GEMMs can
    be, are told apart by their order, which `tasks` keeps)."""
    seen = Counter()
    keys = []
    for row in rows:
        blocks = json.dumps(row["blocks"], sort_keys=True)
        key = (row["op"], row["kernel"], row["case"], blocks, row.get("num_warps"),
               row.get("num_stages"), row["arch"])  # fmt: skip
        keys.append((*key, seen[key]))
        seen[key] += 1
    return keys


def code_changes(before: list[dict], after: list[dict]) -> tuple[list[str], list[str]]:
    """The rows of `after` whose PTX digest differs from the same row of `before`, and those
    `before` lacks."""
    digests = {key: row.get("ptx_sha256") for key, row in zip(_row_keys(before), before)}

    def describe(row):
        return f"{row['op']} {row['case']} {hot_loop.config_label(row)} {row['arch']}"

    changed = [
        describe(row)
        for key, row in zip(_row_keys(after), after)
        if key in digests and digests[key] != row.get("ptx_sha256")
    ]
    new = [describe(row) for key, row in zip(_row_keys(after), after) if key not in digests]
    return changed, new


def report_code_changes(before: list[dict], after: list[dict]) -> bool:
    """Print how many rows kept their code; True if any row's code changed or is new."""
    changed, new = code_changes(before, after)
    same = len(after) - len(changed) - len(new)
    print(f"same code as before: {same} of {len(after)} rows")
    for line in changed:
        print(f"  changed: {line}")
    for line in new:
        print(f"  not in the earlier run: {line}")
    return bool(changed or new)


def merged(kept: list[dict], fresh: list[dict]) -> list[dict]:
    """The kept rows with each (op, case, arch) that `fresh` has replaced by fresh's rows of it,
    in the kept order (so that the file's diff shows what changed); fresh (op, case, arch)s the
    kept report lacks at the end."""
    groups: dict[tuple, list[dict]] = {}
    for row in fresh:
        groups.setdefault((row["op"], row["case"], row["arch"]), []).append(row)
    out = []
    for row in kept:
        group = (row["op"], row["case"], row["arch"])
        if group not in groups:
            out.append(row)
        elif groups[group] is not None:
            out.extend(groups[group])
            groups[group] = None
    return out + [row for rows in groups.values() if rows is not None for row in rows]


#: The whole report, kept in the repository (`--baseline` writes it, `--check-baseline` reads it).
BASELINE = Path(__file__).resolve().parent / "baselines" / "compile_report.json"


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def kernel_code_fingerprint() -> str:
    """SHA-256 of the code of every file under fastlm/kernels: their syntax trees without
    docstrings, so formatting, comments and docs do not count, and any change to what compiles
    (or to the launchers that choose configs) does."""
    kernels = Path(__file__).resolve().parent.parent / "fastlm" / "kernels"
    digest = hashlib.sha256()
    for path in sorted(kernels.rglob("*.py")):
        code = ast.dump(_without_docstrings(ast.parse(path.read_text())))
        digest.update(path.relative_to(kernels).as_posix().encode() + b"\0" + code.encode())
    return digest.hexdigest()


def check_baseline() -> int:
    """0 when the kept report is this code's and clean; 1 (saying what to do) otherwise."""
    rerun = "run `python benchmarks/compile_report.py --baseline` and commit what it writes"
    if not BASELINE.is_file():
        print(f"no kept report at {BASELINE}: {rerun}", file=sys.stderr)
        return 1
    kept = json.loads(BASELINE.read_text())
    if kept["fingerprint"] != kernel_code_fingerprint():
        print(f"fastlm/kernels changed since the kept report was made: {rerun}", file=sys.stderr)
        return 1
    if kept.get("fp_fusion") is not True:
        print(f"the kept report was not compiled with FMA contraction (fp_fusion): {rerun}")
        return 1
    unread = [
        r
        for r in kept["rows"]
        if hot_loop.reads(r["kernel"], r.get("dtype")) and "hot_loop" not in r
    ]
    if unread:
        print(
            f"the kept report has no hot loop figures ({len(unread)} rows): {rerun}",
            file=sys.stderr,
        )
        return 1
    flagged = [row for row in kept["rows"] if row["problems"]]
    for row in flagged:
        print(f"flagged: {row['op']} {row['case']} {row['arch']}: {row['problems']}")
    archs = sorted({row["arch"] for row in kept["rows"]})
    print(f"kept report: {len(kept['rows'])} rows on {', '.join(archs)}, {len(flagged)} flagged")
    return 1 if flagged or archs != sorted(ARCHS) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add(
        "--arch", nargs="+", choices=list(ARCHS), default=list(ARCHS), help="targets (default: all)"
    )
    add("--json", type=Path, metavar="PATH", help="write the rows as JSON here")
    quick = "bf16 only; attention at head dim 128, causal, plain and with each option (the CI's)"
    add("--quick", action="store_true", help=quick)
    add("--op", action="append", metavar="TEXT", help="only ops whose name contains TEXT")
    add("--case", action="append", metavar="TEXT", help="only cases whose label contains TEXT")
    same = "an earlier run's --json (or the kept report): list the rows whose code differs; exit 1 "
    same += "if any does"
    add("--same-code-as", type=Path, metavar="JSON", help=same)
    jobs = "compiler processes (default: one per CPU)"
    add("--jobs", type=int, default=os.cpu_count() or 1, help=jobs)
    baseline = (
        f"the whole report, kept at {BASELINE}; with --op, --case or --arch, only the chosen "
        "rows compiled again and the kept report's other rows kept as they are: for a change "
        "that leaves the other rows' code alone (the fingerprint covers every kernel, so it "
        "cannot tell; --same-code-as shows it for a sample)"
    )
    add("--baseline", action="store_true", help=baseline)
    check = "exit 0 when the kept report is this code's and has no flagged row"
    add("--check-baseline", action="store_true", help=check)
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.check_baseline:
        return check_baseline()
    if args.baseline and args.quick:
        parser.error("--baseline keeps the whole report: no --quick")

    start = time.perf_counter()
    selected = [
        case
        for case in cases(args.quick)
        if (not args.op or any(text in case.op for text in args.op))
        and (not args.case or any(text in case.label for text in args.case))
    ]
    if not selected:
        parser.error(f"no case matches --op {args.op} --case {args.case}")
    rows = run(tasks(selected, args.arch), args.jobs)
    print(table(rows))
    analysed = [row for row in rows if "hot_loop" in row]
    if analysed:
        print("\nHot loops of the attention kernels and MoE GEMMs (hot_loop.py):\n")
        print(hot_loop.table(analysed))
    flagged = [row for row in rows if row["problems"]]
    cached = sum(bool(row.get("cached")) for row in rows)
    print(
        f"\n{len(rows)} rows ({cached} from the cache), {len(flagged)} flagged, "
        f"{time.perf_counter() - start:.0f} s; triton {triton.__version__}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if args.baseline:
        if args.op or args.case or sorted(args.arch) != sorted(ARCHS):
            kept_rows = json.loads(BASELINE.read_text())["rows"]
            if not (args.op or args.case):  # every row of the chosen archs is compiled again
                kept_rows = [row for row in kept_rows if row["arch"] not in args.arch]
            rows = merged(kept_rows, rows)  # the other rows as kept (`--baseline`'s help)
        kept = dict(
            fingerprint=kernel_code_fingerprint(),
            triton=triton.__version__,
            fp_fusion=triton.knobs.language.default_fp_fusion,
            rows=rows,
        )
        BASELINE.parent.mkdir(parents=True, exist_ok=True)
        BASELINE.write_text(json.dumps(kept, indent=1) + "\n")
    changed = False
    if args.same_code_as:
        before = json.loads(args.same_code_as.read_text())
        before = before["rows"] if isinstance(before, dict) else before  # the kept report too
        changed = report_code_changes(before, rows)
    return 1 if flagged or changed else 0


if __name__ == "__main__":
    sys.exit(main())
