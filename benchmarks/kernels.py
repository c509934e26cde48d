"""RMSNorm, residual add + RMSNorm, RoPE, SwiGLU, cross-entropy and fused linear cross-entropy:
fastlm's kernels against the alternatives.

For each op, forward, backward and forward+backward in bf16 at LLaMA-like sizes (tokens x hidden;
tokens x vocabulary for cross-entropy), side by side with: the reference in eager mode
(`fastlm.reference`), `torch.compile` of it, PyTorch's built-ins where there is one (F.rms_norm,
F.silu(gate) * up, F.cross_entropy), and Liger-Kernel when it is importable. Columns:
milliseconds, GB/s, percent of a device-to-device copy measured in the same run, speed-ups
against the eager and the compiled reference, and each output's relative error against the eager
reference (a fast wrong kernel shows here; cross-entropy's against the reference in float32).

Bytes are the fewest each op must move (M tokens, N hidden, e = 2 bytes; the weight and the RoPE
tables are under 0.1% and left out):
  rms_norm      fwd read x, write y: 2MNe      bwd read x, dy, write dx: 3MNe
  add_rms_norm  fwd read x, r, write y, h: 4MNe  bwd read h, dy, dh, write dx: 4MNe
  rope (q, k)   fwd read and write q, k: 4MNe  bwd the same on the gradients: 4MNe
  swiglu        fwd read g, u, write y: 3MNe   bwd read g, u, dy, write dg, du: 5MNe
  cross_entropy fwd read logits: MVe          (no backward-alone row)
(M tokens, V vocabulary entries.) fwd+bwd is the sum, except for cross-entropy: its gradient can
be written while the logits are read once, so its fwd+bwd counts 2MVe (read logits, write
dlogits). fastlm's forward does just that: its forward rows move 2MVe against the MVe counted,
and its backward only scales the gradient in place, which cannot be repeated on one retained
graph, so cross-entropy is compared on fwd and fwd+bwd only. RoPE rotates in place, which
autograd allows only on computed tensors, so with autograd on every implementation runs on
clones of q and k: the forward+backward rows time the clone too and count its 4MNe (12MNe in
all), while the backward rows time only `backward()`, where the clone's backward passes the
gradient on without a kernel (4MNe); the forward rows run under no_grad on the tensors directly.
RoPE shapes: q and k (B, H, T, 128) with H = N / 128, T = 2048, B = M / T. Liger's RoPE uses the
half-split layout, so it is also compared with fastlm's half-split mode.

Cross-entropy: logits (M, V) with V = 32000 and random targets, none ignored (the reference has
no ignore_index); in bf16 the reference rounds the loss itself, hence the float32 check. Liger
writes its gradient into the logits, as in training; every check runs before the timings.

Fused linear cross-entropy (`linear_cross_entropy`, the loss of x @ w.T without the logits):
x (M, C) and w (V, C) bf16, M = 16k, C = 768 or 2048 (size MxCxV), forward+backward only,
against the logits materialised (x @ w.T, then F.cross_entropy), torch.compile of that (the
"vs reference" and "vs compiled" columns compare with these two) and Liger's fused linear
cross-entropy. `peak MiB` is torch.cuda.max_memory_allocated during one forward+backward minus
what was allocated before it (the inputs), so it includes the gradients dx and dw themselves;
`peak / logits` divides it by the logits' size MVe, which the fused op is meant to keep to a
fraction. The loss is checked against the materialised one in float32.

CUDA graphs: a memory-bound row shorter than --graph-below-ms (1 ms) is also timed replayed from
a CUDA graph (`triton.testing.do_bench_cudagraph`, column `ms (graph)`): at 16k x 4096 a kernel
takes tens of microseconds, so the host's launch overhead (the eager reference's many launches,
Python around each autograd Function) can decide the `ms` column; the graph column shows the GPU
time alone. Only fwd and fwd+bwd rows: a backward alone runs on the stream of a forward made
outside the graph. No L2 flush between replays; every tensor here is over twice the H200's L2.

Order: the headline cases first (each memory-bound op at its first quick size: 16384 x 4096, and
cross-entropy 16384 x 32000; `--headline` measures only these), then fused linear cross-entropy,
then (without --quick) the other sizes; `--skip-headline` leaves the headline cases out.

Without CUDA: a message, then each kernel against the float64 reference through Triton's
interpreter at tiny sizes; exit code 1 if a kernel gives a wrong result or fails to run.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import _common as common  # first: turns on Triton's interpreter when there is no CUDA
import torch
import torch.nn.functional as F

from fastlm import reference
from fastlm.kernels import (
    add_rms_norm,
    add_rms_norm_ref,
    apply_rope_,
    cross_entropy,
    linear_cross_entropy,
    rms_norm,
    rms_norm_ref,
    rope_ref,
    rope_tables,
    swiglu,
    swiglu_ref,
)

DTYPE = torch.bfloat16
EPS = 1e-5
ROPE_THETA = 10000.0
ROPE_HEAD_DIM = 128
ROPE_SEQ = 2048

FULL_SIZES = tuple((m, n) for m in (4096, 16384, 65536) for n in (2048, 4096, 8192))
QUICK_SIZES = ((16384, 4096),)
VOCAB = 32000
CROSS_ENTROPY_FULL_SIZES = ((4096, VOCAB), (16384, VOCAB))  # (M tokens, V)
CROSS_ENTROPY_QUICK_SIZES = ((16384, VOCAB),)
LINEAR_CE = "linear_cross_entropy"
LINEAR_CE_FULL_SIZES = ((16384, 768), (16384, 2048))  # (M tokens, C features), V = VOCAB
LINEAR_CE_QUICK_SIZES = ((16384, 768),)  # GPT-2 small's width, as in train.py
IGNORE_INDEX = -100
QUICK_TIME_LIMIT_S = 80
MODES = common.MODES
EAGER, COMPILED = "reference", "torch.compile(reference)"
MATERIALISED = "x @ w.T, F.cross_entropy"
MATERIALISED_COMPILED = f"torch.compile({MATERIALISED})"
GRAPH_BELOW_MS = 1.0
COLUMNS = [
    "op",
    "mode",
    "size",
    "impl",
    "ms",
    "ms (graph)",
    "GB/s",
    "% of copy",
    "vs reference",
    "vs compiled",
    "graph vs compiled",
    "rel err",
    "peak MiB",
    "peak / logits",
]


@dataclass
class Op:
    """One op: its inputs, its implementations, the bytes each mode moves (in units of MNe; the
    modes it is timed in) and its sizes (M, N)."""

    name: str
    make_inputs: Callable[[int, int], tuple[torch.Tensor, ...]]
    impls: Callable[[int, int], dict[str, Callable]]
    traffic: dict[str, float]
    forward_grad: bool = True  # False: the forward rows run under no_grad (in-place RoPE)
    full_sizes: tuple[tuple[int, int], ...] = FULL_SIZES
    quick_sizes: tuple[tuple[int, int], ...] = QUICK_SIZES  # the first is the summary's
    error_reference: Callable | None = None  # what outputs are checked against; None: EAGER


def _randn(*shape, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=common.DEVICE, dtype=torch.float32) * scale).to(DTYPE)


def _leaf(*shape) -> torch.Tensor:
    return _randn(*shape).requires_grad_()


def _weight(n: int) -> torch.Tensor:
    return (1 + _randn(n, scale=0.1)).requires_grad_()


def _size(*dims: int) -> str:
    return "x".join(map(str, dims))


def _targets(m: int, v: int) -> torch.Tensor:
    return torch.randint(0, v, (m,), device=common.DEVICE)


def _liger(module: str, name: str):
    """A Liger-Kernel autograd Function, or None when Liger-Kernel is not importable."""
    found = common.optional_module(f"liger_kernel.ops.{module}")
    return getattr(found, name, None) if found else None


def _liger_loss(function, *args) -> torch.Tensor:
    """The loss of a Liger loss Function: newer versions return (loss, z_loss, ...)."""
    out = function.apply(*args)
    return out[0] if isinstance(out, tuple) else out


# --------------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------------


def _rms_norm_math(x, weight):
    """The op's PyTorch math (reference.RmsNorm's) with the weight passed in."""
    return rms_norm_ref(x, weight, EPS)


def rms_norm_impls(m: int, n: int) -> dict[str, Callable]:
    impls = {
        "fastlm": lambda x, w: rms_norm(x, w, EPS),
        EAGER: _rms_norm_math,
        COMPILED: torch.compile(_rms_norm_math, dynamic=False),
        "F.rms_norm": lambda x, w: F.rms_norm(x, (n,), w, EPS),
    }
    liger = _liger("rms_norm", "LigerRMSNormFunction")
    if liger is not None:
        # in_place=False: Liger would otherwise write dx into dy, which the timing loop reuses.
        impls["liger"] = lambda x, w: liger.apply(x, w, EPS, 0.0, "llama", False)
    return impls


def _add_rms_norm_math(x, residual, weight):
    return add_rms_norm_ref(x, residual, weight, EPS)


def add_rms_norm_impls(m: int, n: int) -> dict[str, Callable]:
    def builtin(x, r, w):
        summed = x + r
        return F.rms_norm(summed, (n,), w, EPS), summed

    impls = {
        "fastlm": lambda x, r, w: add_rms_norm(x, r, w, EPS),
        EAGER: _add_rms_norm_math,
        COMPILED: torch.compile(_add_rms_norm_math, dynamic=False),
        "x + r, F.rms_norm": builtin,
    }
    liger = _liger("fused_add_rms_norm", "LigerFusedAddRMSNormFunction")
    if liger is not None:  # returns (normed, summed), as fastlm's
        impls["liger"] = lambda x, r, w: liger.apply(x, r, w, EPS, 0.0, "llama", False)
    return impls


def _rope_shape(m: int, n: int) -> tuple[int, int, int, int]:
    t = min(m, ROPE_SEQ)
    return m // t, n // ROPE_HEAD_DIM, t, ROPE_HEAD_DIM


def _computed(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Clones when autograd is recording (in-place autograd needs computed tensors)."""
    if torch.is_grad_enabled() and tensors[0].requires_grad:
        return tuple(t.clone() for t in tensors)
    return tensors


def rope_impls(m: int, n: int) -> dict[str, Callable]:
    b, h, t, d = _rope_shape(m, n)
    positions = torch.arange(t, device=common.DEVICE)
    cos, sin = rope_tables(ROPE_THETA, d, t, device=common.DEVICE)
    rope = reference.RoPE(ROPE_THETA, d, t, device=common.DEVICE)

    def reference_rope(q, k):
        q, k = _computed(q, k)
        return rope(q, positions), rope(k, positions)

    def fastlm_rope(interleaved):
        def run(q, k):
            q, k = _computed(q, k)
            return apply_rope_(q, k, cos, sin, positions, interleaved=interleaved)

        return run

    # Hugging Face tables (Liger's): (1, T, D), each frequency repeated over the two halves.
    hf_cos, hf_sin = (torch.cat((c, c), dim=-1)[None] for c in (cos, sin))

    def half_split_math(q, k):
        """The half-split layout's rotation: the op's PyTorch math."""
        return (
            rope_ref(q, cos, sin, positions, interleaved=False),
            rope_ref(k, cos, sin, positions, interleaved=False),
        )

    half_split = fastlm_rope(False)
    half_split.error_reference = half_split_math
    impls = {
        "fastlm": fastlm_rope(True),
        "fastlm half-split": half_split,
        EAGER: reference_rope,
        COMPILED: torch.compile(reference_rope, dynamic=False),
    }
    liger = _liger("rope", "LigerRopeFunction")
    if liger is not None:

        def liger_rope(q, k):
            q, k = _computed(q, k)
            return liger.apply(q, k, hf_cos, hf_sin)

        liger_rope.error_reference = half_split_math
        impls["liger (half-split)"] = liger_rope
    return impls


def _swiglu_math(gate, up):
    return swiglu_ref(gate, up)


def swiglu_impls(m: int, n: int) -> dict[str, Callable]:
    impls = {
        "fastlm": swiglu,
        EAGER: _swiglu_math,
        COMPILED: torch.compile(_swiglu_math, dynamic=False),
        "F.silu(g) * u": lambda gate, up: F.silu(gate) * up,
    }
    liger = _liger("swiglu", "LigerSiLUMulFunction")
    if liger is not None:
        impls["liger"] = liger.apply
    return impls


def _cross_entropy_math(logits, targets):
    return reference.CrossEntropyLoss()(logits, targets)


def _cross_entropy_fp32(logits, targets):
    return _cross_entropy_math(logits.float(), targets)


def cross_entropy_impls(m: int, v: int) -> dict[str, Callable]:
    impls = {
        "fastlm": cross_entropy,
        EAGER: _cross_entropy_math,
        COMPILED: torch.compile(_cross_entropy_math, dynamic=False),
        "F.cross_entropy": F.cross_entropy,
    }
    liger = _liger("cross_entropy", "LigerCrossEntropyFunction")
    if liger is not None:
        # Newer versions take a class weight (no default) after the targets.
        weight = (None,) if "weight" in inspect.signature(liger.forward).parameters else ()
        impls["liger"] = lambda logits, targets: _liger_loss(liger, logits, targets, *weight)
    return impls


def _linear_cross_entropy_math(x, weight, targets):
    return F.cross_entropy(x @ weight.T, targets)


def _linear_cross_entropy_fp32(x, weight, targets):
    return _linear_cross_entropy_math(x.float(), weight.float(), targets)


def linear_cross_entropy_impls() -> dict[str, Callable]:
    impls = {
        "fastlm": linear_cross_entropy,
        MATERIALISED: _linear_cross_entropy_math,
        MATERIALISED_COMPILED: torch.compile(_linear_cross_entropy_math, dynamic=False),
    }
    liger = _liger("fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyFunction")
    if liger is not None:
        impls["liger"] = lambda x, weight, targets: _liger_loss(liger, x, weight, targets)
    return impls


OPS = [
    Op(
        "rms_norm",
        lambda m, n: (_leaf(m, n), _weight(n)),
        rms_norm_impls,
        {"fwd": 2, "bwd": 3, "fwd+bwd": 5},
    ),
    Op(
        "add_rms_norm",
        lambda m, n: (_leaf(m, n), _leaf(m, n), _weight(n)),
        add_rms_norm_impls,
        {"fwd": 4, "bwd": 4, "fwd+bwd": 8},
    ),
    Op(
        "rope",
        lambda m, n: (_leaf(*_rope_shape(m, n)), _leaf(*_rope_shape(m, n))),
        rope_impls,
        {"fwd": 4, "bwd": 4, "fwd+bwd": 4 + 4 + 4},  # fwd+bwd: clone, rotation, backward
        forward_grad=False,
    ),
    Op(
        "swiglu",
        lambda m, n: (_leaf(m, n), _leaf(m, n)),
        swiglu_impls,
        {"fwd": 3, "bwd": 5, "fwd+bwd": 8},
    ),
    Op(
        "cross_entropy",
        lambda m, v: (_leaf(m, v), _targets(m, v)),
        cross_entropy_impls,
        # No backward-alone row: fastlm's gradient is written in the forward, its backward is
        # one in-place scale and refuses a second pass over a retained graph.
        {"fwd": 1, "fwd+bwd": 2},
        full_sizes=CROSS_ENTROPY_FULL_SIZES,
        quick_sizes=CROSS_ENTROPY_QUICK_SIZES,
        error_reference=_cross_entropy_fp32,
    ),
]


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


def bench_size(run: common.Run, op: Op, m: int, n: int, copy_gbs: float) -> None:
    size = _size(m, n)
    impls = op.impls(m, n)
    inputs = op.make_inputs(m, n)
    reference_fn = op.error_reference or impls[EAGER]
    # Every check before any timing: Liger's cross-entropy overwrites the logits it is timed on.
    errors = {
        name: run.measure(
            lambda fn=fn, inputs=inputs: common.output_error(fn, reference_fn, inputs),
            f"{op.name} {name} {size} check",
        )
        for name, fn in impls.items()
    }
    for name, fn in impls.items():
        label = f"{op.name} {name} {size}"
        times = common.time_modes(
            run, fn, inputs, label, forward_grad=op.forward_grad, modes=tuple(op.traffic)
        )
        short = [mode for mode, ms in times.items() if ms.ok and ms.value < run.args.graph_below_ms]
        graph_times = common.time_modes_graph(
            run, fn, inputs, label, forward_grad=op.forward_grad, modes=short
        )
        for mode, ms in times.items():
            gigabytes = op.traffic[mode] * m * n * DTYPE.itemsize / 1e9
            gbs = gigabytes / (ms.value * 1e-3) if ms.ok else None
            graph = graph_times.get(mode)
            run.add(
                {
                    "op": op.name,
                    "mode": mode,
                    "size": size,
                    "impl": name,
                    "ms": ms.cell(),
                    "ms (graph)": graph.cell() if graph else None,
                    "GB/s": gbs,
                    "% of copy": 100 * gbs / copy_gbs if gbs else None,
                    "rel err": errors[name].cell(),
                }
            )
    del inputs
    common.free_memory()


def peak_extra_bytes(fn: Callable, inputs: tuple[torch.Tensor, ...]) -> float:
    """Peak memory allocated during one forward+backward of fn(*inputs) beyond what was allocated
    before it (the inputs); the leaves' gradients are counted, and set to None afterwards."""
    leaves = [t for t in inputs if t.requires_grad]
    for t in leaves:
        t.grad = None
    common.free_memory()
    before = torch.cuda.memory_allocated()
    peak = common.peak_memory_gib(lambda: fn(*inputs).backward()) * 2**30
    for t in leaves:
        t.grad = None
    return peak - before


def bench_linear_cross_entropy(run: common.Run, m: int, c: int) -> None:
    """Forward+backward milliseconds and peak memory of the loss of x (m, c) @ w.T (VOCAB, c)."""
    size = _size(m, c, VOCAB)
    impls = linear_cross_entropy_impls()
    # w scaled so that the logits have unit variance, as in a trained model's output layer.
    inputs = (_leaf(m, c), _randn(VOCAB, c, scale=c**-0.5).requires_grad_(), _targets(m, VOCAB))
    logits_bytes = m * VOCAB * DTYPE.itemsize
    for name, fn in impls.items():
        label = f"{LINEAR_CE} {name} {size}"
        ms = common.time_modes(run, fn, inputs, label, modes=("fwd+bwd",))["fwd+bwd"]
        error = run.measure(
            lambda fn=fn, inputs=inputs: common.output_error(
                fn, _linear_cross_entropy_fp32, inputs
            ),
            f"{label} check",
        )
        peak = run.measure(
            lambda fn=fn, inputs=inputs: peak_extra_bytes(fn, inputs), f"{label} peak memory"
        )
        run.add(
            {
                "op": LINEAR_CE,
                "mode": "fwd+bwd",
                "size": size,
                "impl": name,
                "ms": ms.cell(),
                "rel err": error.cell(),
                "peak MiB": peak.value / 2**20 if peak.ok else peak.status,
                "peak / logits": common.ratio(peak, logits_bytes),
            }
        )
    del inputs
    common.free_memory()


def add_speedups(rows: list[dict]) -> None:
    """'vs reference' and 'vs compiled': the baseline's ms / the row's at the same op, mode and
    size; the baselines of linear_cross_entropy are the materialised logits, eager and compiled.
    'graph vs compiled': the same with both replayed from CUDA graphs."""
    fused = [r for r in rows if r["op"] == LINEAR_CE]
    others = [r for r in rows if r["op"] != LINEAR_CE]
    key = ("op", "mode", "size")
    for subset, eager, compiled in (
        (others, EAGER, COMPILED),
        (fused, MATERIALISED, MATERIALISED_COMPILED),
    ):
        for column, baseline in (("vs reference", eager), ("vs compiled", compiled)):
            common.add_ratios(subset, column, baseline, key=key, value="ms")
    common.add_ratios(others, "graph vs compiled", COMPILED, key=key, value="ms (graph)")


def cases(args) -> list[tuple[str, int, int]]:
    """(op name, M, N or C) in the order measured (module docstring), those of --ops only."""
    headline = [(op.name, *op.quick_sizes[0]) for op in OPS]
    wanted = headline + [(LINEAR_CE, *size) for size in LINEAR_CE_QUICK_SIZES]
    if args.headline:
        wanted = headline
    elif not args.quick:
        wanted += [(op.name, *size) for op in OPS for size in op.full_sizes]
        wanted += [(LINEAR_CE, *size) for size in LINEAR_CE_FULL_SIZES]
    if args.skip_headline:
        wanted = [case for case in wanted if case not in headline]
    return [case for case in dict.fromkeys(wanted) if case[0] in args.ops]


def _ms(row: dict | None, column: str = "ms") -> float | None:
    value = row.get(column) if row else None
    return value if isinstance(value, float) else None


def summary_lines(rows: list[dict]) -> list[str]:
    """fastlm's row of each measured op, size and mode against the alternatives (speed-up =
    their ms / fastlm's; 'graph': both replayed from CUDA graphs), as markdown tables."""
    table, fused = [], []
    for op_name, size, mode in dict.fromkeys((r["op"], r["size"], r["mode"]) for r in rows):
        at = {
            r["impl"]: r for r in rows if (r["op"], r["size"], r["mode"]) == (op_name, size, mode)
        }
        ours = at.get("fastlm")
        if ours is None:
            continue
        liger = next((r for name, r in at.items() if name.startswith("liger")), {})
        if op_name == LINEAR_CE:
            fused.append(
                {
                    "size": size,
                    "fastlm ms": ours["ms"],
                    "vs materialised": ours["vs reference"],
                    "vs compiled": ours["vs compiled"],
                    "peak / logits": ours["peak / logits"],
                    "materialised peak / logits": at.get(MATERIALISED, {}).get("peak / logits"),
                    "liger ms": liger.get("ms"),
                    "liger peak / logits": liger.get("peak / logits"),
                }
            )
            continue
        table.append(
            {
                "op": op_name,
                "size": size,
                "mode": mode,
                "fastlm ms": ours["ms"],
                "ms (graph)": ours["ms (graph)"],
                "GB/s": ours["GB/s"],
                "% of copy": ours["% of copy"],
                "vs compiled": ours["vs compiled"],
                "vs eager": ours["vs reference"],
                "vs liger": common.ratio(_ms(liger), _ms(ours)),
                "graph vs compiled": ours["graph vs compiled"],
                "graph vs liger": common.ratio(_ms(liger, "ms (graph)"), _ms(ours, "ms (graph)")),
            }
        )
    lines = []
    if table:
        lines += [
            "Memory-bound kernels, bf16 (speed-up = other's ms / fastlm's; graph: both "
            "replayed from CUDA graphs):",
            "",
            common.markdown_table(table, list(table[0])),
        ]
    if fused:
        lines += [
            "",
            f"{LINEAR_CE}, bf16, forward+backward (peak memory beyond the inputs, as a "
            "multiple of the logits' size):",
            "",
            common.markdown_table(fused, list(fused[0])),
        ]
    return lines or ["kernels: no fastlm rows (see the notes)"]


# --------------------------------------------------------------------------------------------
# Without CUDA: the interpreter check
# --------------------------------------------------------------------------------------------


def interpreter_check() -> int:
    torch.manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape).requires_grad_()

    def weight(n):
        return (1 + 0.1 * torch.randn(n)).requires_grad_()

    def rms_norm_check():
        return common.compare_with_reference(
            "rms_norm", lambda x, w: rms_norm(x, w, EPS), _rms_norm_math, [leaf(5, 37), weight(37)]
        )

    def add_rms_norm_check():
        return common.compare_with_reference(
            "add_rms_norm",
            lambda x, r, w: add_rms_norm(x, r, w, EPS),
            _add_rms_norm_math,
            [leaf(5, 37), leaf(5, 37), weight(37)],
        )

    def rope_check():
        d, t, offset = 16, 7, 3
        positions = torch.arange(offset, offset + t)
        cos, sin = rope_tables(ROPE_THETA, d, offset + t)
        rope = reference.RoPE(ROPE_THETA, d, offset + t)
        rope64 = rope.double()
        rope64.cos_cached, rope64.sin_cached = rope.cos_cached.double(), rope.sin_cached.double()

        def fastlm_rope(q, k):
            return apply_rope_(q.clone(), k.clone(), cos, sin, positions)

        def reference_rope(q, k):
            return rope64(q, positions), rope64(k, positions)

        return common.compare_with_reference(
            "rope", fastlm_rope, reference_rope, [leaf(2, 3, t, d), leaf(2, 1, t, d)]
        )

    def swiglu_check():
        return common.compare_with_reference(
            "swiglu", swiglu, _swiglu_math, [leaf(5, 33), leaf(5, 33)]
        )

    # Two of the interpreter's vocabulary blocks (1024), the second partial; one ignored target.
    vocab, tokens = 1500, 7
    targets = torch.randint(0, vocab, (tokens,))
    targets[2] = IGNORE_INDEX
    counted = targets != IGNORE_INDEX

    def reference_loss(logits):
        return _cross_entropy_math(logits[counted], targets[counted])

    def cross_entropy_check():
        return common.compare_with_reference(
            "cross_entropy",
            lambda logits: cross_entropy(logits, targets, IGNORE_INDEX),
            reference_loss,
            [leaf(tokens, vocab)],
        )

    def linear_cross_entropy_check():
        def fused(x, w):  # chunks of 3 tokens: 3, 3 and a partial 1
            return linear_cross_entropy(x, w, targets, IGNORE_INDEX, chunk_size=3)

        return common.compare_with_reference(
            LINEAR_CE,
            fused,
            lambda x, w: reference_loss(x @ w.T),
            [leaf(tokens, 24), leaf(vocab, 24)],
        )

    rows = []
    for name, check in (
        ("rms_norm", rms_norm_check),
        ("add_rms_norm", add_rms_norm_check),
        ("rope", rope_check),
        ("swiglu", swiglu_check),
        ("cross_entropy", cross_entropy_check),
        (LINEAR_CE, linear_cross_entropy_check),
    ):
        rows += common.try_check(name, check)
    return common.report_checks(rows)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    op_names = [op.name for op in OPS] + [LINEAR_CE]
    p = common.parser(
        __doc__.split("\n\n")[0],
        quick_help=(
            f"one size per op ({QUICK_SIZES[0]}; cross-entropy {CROSS_ENTROPY_QUICK_SIZES[0]}, "
            f"{LINEAR_CE} {LINEAR_CE_QUICK_SIZES[0]}), within a {QUICK_TIME_LIMIT_S} s time budget"
        ),
    )
    p.add_argument(
        "--ops", nargs="+", choices=op_names, default=op_names, help="which ops to measure"
    )
    p.add_argument(
        "--graph-below-ms",
        type=float,
        default=GRAPH_BELOW_MS,
        help="also time fwd and fwd+bwd rows shorter than this from a CUDA graph "
        f"(default {GRAPH_BELOW_MS}; 0: never)",
    )
    p.add_argument(
        "--graph-rep-ms",
        type=float,
        default=20.0,
        help="do_bench_cudagraph's timed time per replay (it replays 10 times)",
    )
    args = p.parse_args(argv)
    if not common.HAS_CUDA:
        common.no_cuda_notice("benchmarks/kernels.py")
        return interpreter_check()

    common.raise_compile_limits()
    run = common.Run("kernels", args, QUICK_TIME_LIMIT_S, COLUMNS)
    run.header()
    if common.optional_module("liger_kernel") is None:
        run.note("Liger-Kernel is not installed: its rows are left out")
    with run.interruptible():
        copy = run.measure(lambda: common.copy_bandwidth_gbs(args.warmup_ms, args.rep_ms), "copy")
        copy_gbs = copy.value or math.nan
        print(f"device-to-device copy: {copy_gbs:.0f} GB/s (bytes read + written)\n")
        run.env["copy_GB/s"] = copy_gbs
        ops = {op.name: op for op in OPS}
        for name, m, n in cases(args):
            if run.out_of_time():
                break
            if name == LINEAR_CE:
                bench_linear_cross_entropy(run, m, n)
            else:
                bench_size(run, ops[name], m, n, copy_gbs)
    add_speedups(run.rows)
    return run.finish(
        group_by=("op", "size", "mode"),
        summary=summary_lines(run.rows),
        plot={
            "x": "size",
            "y": "GB/s",
            "series": "impl",
            "panel": ("op", "mode"),
            "title": f"fastlm kernels, bf16, {run.env['gpu']}",
        },
    )


if __name__ == "__main__":
    sys.exit(main())
