"""RMSNorm, residual add + RMSNorm, RoPE, SwiGLU (and gpt-oss's clamped form), cross-entropy and
fused linear cross-entropy: fastlm's kernels against the eager reference, `torch.compile` of it,
PyTorch's built-ins and Liger-Kernel (when it imports), in bf16 at LLaMA-like sizes (M tokens x N
hidden; V = 32000).

Bytes are the fewest each op must move (e = 2 bytes; the weight and the RoPE tables left out):
  rms_norm      fwd read x, write y: 2MNe        bwd read x, dy, write dx: 3MNe
  add_rms_norm  fwd read x, r, write y, h: 4MNe  bwd read h, dy, dh, write dx: 4MNe
  rope (q, k)   fwd read and write q, k: 4MNe    bwd the same on the gradients: 4MNe
  swiglu        fwd read g, u, write y: 3MNe     bwd read g, u, dy, write dg, du: 5MNe
  swiglu_gpt_oss  the same, gate and up interleaved in one (M, 2N) projection, clamped (its
                reference: transformers' GptOssExperts._apply_gate, op by op in bf16)
  cross_entropy fwd read logits: MVe             fwd+bwd also write the gradient: 2MVe
fwd+bwd is the sum. Cross-entropy has no backward-alone row (fastlm writes the gradient in the
forward and scales it in place once, which a retained graph cannot repeat). RoPE rotates in
place, which autograd allows only on computed tensors: with autograd on every implementation
rotates clones, so fwd+bwd times and counts the clone too (12MNe); the forward runs under no_grad.
Liger's RoPE is half-split, so it is also compared with fastlm's half-split mode. Liger writes
its cross-entropy gradient into the logits, so every output check runs before any timing.

Fused linear cross-entropy (x (M, C) @ w.T (V, C) without the logits), forward+backward only,
against the logits materialised (x @ w.T, F.cross_entropy), torch.compile of that and Liger's:
ms and the memory allocated beyond the inputs (`peak MiB`, dx and dw included), also as a
multiple of the logits' size MVe (`peak / logits`). Rows under --graph-below-ms are also timed
from CUDA graphs (`ms (graph)`): at 16k x 4096 a kernel takes tens of microseconds, and launch
overhead can decide `ms`.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import _common as common  # first: this checkout's fastlm
import torch
import torch.nn.functional as F

from fastlm import kernels as fk
from fastlm import reference
from fastlm.kernels.rmsnorm import add_rms_norm_ref, rms_norm_ref
from fastlm.kernels.rope import rope_ref
from fastlm.kernels.swiglu import swiglu_packed_ref, swiglu_ref

DTYPE, EPS, THETA, VOCAB, BUDGET_S, COPY_BYTES = torch.bfloat16, 1e-5, 1e4, 32000, 80, 2**30
EAGER, COMPILED = "reference", "torch.compile(reference)"
MATERIALISED = "x @ w.T, F.cross_entropy"
LCE = "linear_cross_entropy"
GRID = tuple((m, n) for m in (4096, 16384, 65536) for n in (2048, 4096, 8192))
KEY = ("op", "size", "mode")
COLUMNS = [*KEY, "impl", "ms", "ms (graph)", "GB/s", "% of copy", "vs reference", "vs compiled"]
COLUMNS += ["graph vs compiled", "rel err", "peak MiB", "peak / logits"]
FUSED_COLUMNS = ["size", "impl", "ms", "vs reference", "vs compiled", "peak MiB", "peak / logits"]


@dataclass(eq=False)  # compared and hashed by identity
class Op:
    """An op: its inputs and implementations at a size (M, N), the bytes each timed mode moves
    (in units of MNe; None: not counted), its sizes (the first: --quick's and the headline's)."""

    name: str
    inputs: Callable[[int, int], tuple]
    impls: Callable[[int, int], dict]
    traffic: dict
    sizes: tuple = ((16384, 4096), *GRID)
    forward_grad: bool = True  # False: the forward rows run under no_grad (in-place RoPE)
    check: Callable | None = None  # what outputs are checked against; None: the eager baseline
    baselines: tuple = (EAGER, COMPILED)
    fused: bool = False  # fused linear cross-entropy: peak memory, no CUDA graphs, no headline


def _randn(*shape, scale=1.0, shift=0.0) -> torch.Tensor:
    """A random bf16 leaf that requires grad."""
    return (torch.randn(*shape, device=common.DEVICE) * scale + shift).to(DTYPE).requires_grad_()


def _targets(m: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (m,), device=common.DEVICE)


def _with_liger(impls: dict, module: str, function: str, call, name="liger") -> dict:
    """impls plus call(Liger's autograd Function) under `name`, where Liger-Kernel imports."""
    found = common.optional_module(f"liger_kernel.ops.{module}")
    if found is not None and hasattr(found, function):
        impls[name] = call(getattr(found, function))
    return impls


def _loss(function, *args) -> torch.Tensor:
    """A Liger loss Function's loss (newer versions return (loss, z_loss, ...))."""
    return common.as_tuple(function.apply(*args))[0]


def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def _liger_norm(f):
    # in_place=False: Liger would otherwise write dx into dy, which the timing reuses.
    return lambda *args: f.apply(*args, EPS, 0.0, "llama", False)


def rms_norm_impls(m: int, n: int) -> dict:
    math_ = lambda x, w: rms_norm_ref(x, w, EPS)  # noqa: E731
    impls = {
        "fastlm": lambda x, w: fk.rms_norm(x, w, EPS),
        EAGER: math_,
        COMPILED: _compiled(math_),
    }
    impls["F.rms_norm"] = lambda x, w: F.rms_norm(x, (n,), w, EPS)
    return _with_liger(impls, "rms_norm", "LigerRMSNormFunction", _liger_norm)


def add_rms_norm_impls(m: int, n: int) -> dict:
    def builtin(x, r, w):
        summed = x + r
        return F.rms_norm(summed, (n,), w, EPS), summed

    math_ = lambda x, r, w: add_rms_norm_ref(x, r, w, EPS)  # noqa: E731
    impls = {"fastlm": lambda x, r, w: fk.add_rms_norm(x, r, w, EPS), EAGER: math_}
    impls |= {COMPILED: _compiled(math_), "x + r, F.rms_norm": builtin}
    return _with_liger(impls, "fused_add_rms_norm", "LigerFusedAddRMSNormFunction", _liger_norm)


def _rope_shape(m: int, n: int) -> tuple[int, int, int, int]:
    return m // min(m, 2048), n // 128, min(m, 2048), 128


def _computed(*tensors):
    """Clones while autograd records (in-place autograd needs computed tensors)."""
    grad = torch.is_grad_enabled() and tensors[0].requires_grad
    return tuple(t.clone() for t in tensors) if grad else tensors


def rope_impls(m: int, n: int) -> dict:
    _, _, t, d = _rope_shape(m, n)
    positions = torch.arange(t, device=common.DEVICE)
    cos, sin = fk.rope_tables(THETA, d, t, device=common.DEVICE)
    rope = reference.RoPE(THETA, d, t, device=common.DEVICE)

    def reference_rope(q, k):
        q, k = _computed(q, k)
        return rope(q, positions), rope(k, positions)

    def fastlm_rope(interleaved: bool):
        return lambda q, k: fk.apply_rope_(
            *_computed(q, k), cos, sin, positions, interleaved=interleaved
        )

    def half_split_math(q, k):
        return tuple(rope_ref(x, cos, sin, positions, interleaved=False) for x in (q, k))

    impls = {"fastlm": fastlm_rope(True), "fastlm half-split": fastlm_rope(False)}
    impls |= {EAGER: reference_rope, COMPILED: _compiled(reference_rope)}
    hf_cos, hf_sin = (torch.cat((c, c), dim=-1)[None] for c in (cos, sin))  # Liger's tables
    liger = lambda f: lambda q, k: f.apply(*_computed(q, k), hf_cos, hf_sin)  # noqa: E731
    _with_liger(impls, "rope", "LigerRopeFunction", liger, "liger (half-split)")
    for name in ("fastlm half-split", "liger (half-split)"):
        if name in impls:
            impls[name].error_reference = half_split_math
    return impls


def swiglu_impls(m: int, n: int) -> dict:
    impls = {"fastlm": fk.swiglu, EAGER: swiglu_ref, COMPILED: _compiled(swiglu_ref)}
    impls["F.silu(g) * u"] = lambda gate, up: F.silu(gate) * up
    return _with_liger(impls, "swiglu", "LigerSiLUMulFunction", lambda f: f.apply)


#: gpt-oss's experts' gate: swiglu_packed's options.
GPT_OSS = dict(alpha=1.702, limit=7.0, up_offset=1.0)


def gpt_oss_gate(gate_up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's experts' gate as transformers writes it (`GptOssExperts._apply_gate`)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=GPT_OSS["limit"])
    up = up.clamp(min=-GPT_OSS["limit"], max=GPT_OSS["limit"])
    return (up + 1) * (gate * torch.sigmoid(gate * GPT_OSS["alpha"]))


def swiglu_gpt_oss_impls(m: int, n: int) -> dict:
    fastlm_gate = lambda gate_up: fk.swiglu_packed(gate_up, interleaved=True, **GPT_OSS)  # noqa: E731
    return {"fastlm": fastlm_gate, EAGER: gpt_oss_gate, COMPILED: _compiled(gpt_oss_gate)}


def _cross_entropy_math(logits, targets):
    return reference.CrossEntropyLoss()(logits, targets)


def cross_entropy_impls(m: int, v: int) -> dict:
    impls = {"fastlm": fk.cross_entropy, EAGER: _cross_entropy_math}
    impls |= {COMPILED: _compiled(_cross_entropy_math), "F.cross_entropy": F.cross_entropy}

    def liger(f):  # newer versions take a class weight (no default) after the targets
        weight = (None,) if "weight" in inspect.signature(f.forward).parameters else ()
        return lambda logits, targets: _loss(f, logits, targets, *weight)

    return _with_liger(impls, "cross_entropy", "LigerCrossEntropyFunction", liger)


def _materialised(x, w, targets):
    return F.cross_entropy(x @ w.T, targets)


def linear_cross_entropy_impls(m: int, c: int) -> dict:
    impls = {"fastlm": fk.linear_cross_entropy, MATERIALISED: _materialised}
    impls[f"torch.compile({MATERIALISED})"] = _compiled(_materialised)
    liger = lambda f: lambda x, w, targets: _loss(f, x, w, targets)  # noqa: E731
    function = "LigerFusedLinearCrossEntropyFunction"
    return _with_liger(impls, "fused_linear_cross_entropy", function, liger)


def _rows(count: int, weight: bool = False):
    """Inputs of a row-wise op: `count` (M, N) tensors, then a weight (N,) near 1."""

    def make(m: int, n: int) -> tuple:
        rows = tuple(_randn(m, n) for _ in range(count))
        return (*rows, _randn(n, scale=0.1, shift=1.0)) if weight else rows

    return make


def _rope_inputs(m: int, n: int):
    return _randn(*_rope_shape(m, n)), _randn(*_rope_shape(m, n))


def _fused_inputs(m: int, c: int):
    # w scaled so that the logits have unit variance, as in a trained model's output layer.
    return _randn(m, c), _randn(VOCAB, c, scale=c**-0.5), _targets(m)


OPS = [
    Op("rms_norm", _rows(1, weight=True), rms_norm_impls, {"fwd": 2, "bwd": 3, "fwd+bwd": 5}),
    Op("add_rms_norm", _rows(2, True), add_rms_norm_impls, {"fwd": 4, "bwd": 4, "fwd+bwd": 8}),
    Op("rope", _rope_inputs, rope_impls, {"fwd": 4, "bwd": 4, "fwd+bwd": 12}, forward_grad=False),
    Op("swiglu", _rows(2), swiglu_impls, {"fwd": 3, "bwd": 5, "fwd+bwd": 8}),
    Op(
        "swiglu_gpt_oss",
        # Scale 4 against the limit of 7: about 8 % of the gates and up values clamped.
        lambda m, n: (_randn(m, 2 * n, scale=4.0),),
        swiglu_gpt_oss_impls,
        {"fwd": 3, "bwd": 5, "fwd+bwd": 8},
        ((16384, 2880),),  # gpt-oss-20b's expert width
        check=lambda gate_up: swiglu_packed_ref(gate_up.float(), True, **GPT_OSS),
    ),
    Op(
        "cross_entropy",
        lambda m, v: (_randn(m, v), _targets(m)),
        cross_entropy_impls,
        {"fwd": 1, "fwd+bwd": 2},
        ((16384, VOCAB), (4096, VOCAB)),
        check=lambda logits, targets: _cross_entropy_math(logits.float(), targets),
    ),
    Op(
        LCE,
        _fused_inputs,
        linear_cross_entropy_impls,
        {"fwd+bwd": None},
        ((16384, 768), (16384, 2048)),
        check=lambda x, w, targets: _materialised(x.float(), w.float(), targets),
        baselines=(MATERIALISED, f"torch.compile({MATERIALISED})"),
        fused=True,
    ),
]


def bench_case(run: common.Run, op: Op, m: int, n: int, copy_gbs: float) -> None:
    size = f"{m}x{n}x{VOCAB}" if op.fused else f"{m}x{n}"
    impls, inputs = op.impls(m, n), op.inputs(m, n)
    check = op.check or impls[op.baselines[0]]
    errors = {  # every check before any timing: Liger's cross-entropy overwrites its logits
        name: run.measure(lambda fn=fn: common.output_error(fn, check, inputs), f"{name} {size}")
        for name, fn in impls.items()
    }
    for name, fn in impls.items():
        row = {"op": op.name, "size": size, "impl": name, "rel err": errors[name]}
        for mode, (ms, graph, peak) in time_impl(run, op, fn, inputs, row).items():
            t, moved = common.number(ms), op.traffic[mode]
            gbs = moved * m * n * DTYPE.itemsize / 1e9 / (t * 1e-3) if t and moved else None
            pct = 100 * gbs / copy_gbs if gbs else None
            measured = {"mode": mode, "ms": ms, "ms (graph)": graph, "GB/s": gbs, "% of copy": pct}
            if op.fused:
                peak_b = common.number(peak)
                measured["peak MiB"] = peak if peak_b is None else peak_b / 2**20
                logits = m * VOCAB * DTYPE.itemsize
                measured["peak / logits"] = None if peak_b is None else peak_b / logits
            run.add(row | measured)


def time_impl(run: common.Run, op: Op, fn, inputs, row: dict) -> dict:
    """{mode: (ms, ms from CUDA graphs or None, peak bytes or None)} of one implementation."""
    grad, label = op.forward_grad, f"{op.name} {row['impl']} {row['size']}"
    times = common.time_modes(run, fn, inputs, label, op.traffic, forward_grad=grad)
    below = [
        k for k, ms in times.items() if (common.number(ms) or math.inf) < run.args.graph_below_ms
    ]
    graphs = (
        {}
        if op.fused
        else common.time_modes(run, fn, inputs, label, below, forward_grad=grad, graph=True)
    )
    peak = None
    if op.fused:  # one forward+backward, its gradients counted (not those of the timing)
        for t in inputs:
            t.grad = None
        peak = run.measure(
            lambda: common.peak_bytes(lambda: fn(*inputs).backward()), f"{label} peak"
        )
    return {mode: (ms, graphs.get(mode), peak) for mode, ms in times.items()}


def copy_bandwidth(run: common.Run) -> float:
    """GB/s of a device-to-device copy of COPY_BYTES, bytes read plus written (nan if failed)."""
    src = torch.randn(COPY_BYTES // 4, device=common.DEVICE)
    dst = torch.empty_like(src)
    copy = lambda: common.bench_ms(lambda: dst.copy_(src), run.args)  # noqa: E731
    ms = common.number(run.measure(copy, "copy"))
    run.env["copy_GB/s"] = 2 * src.nbytes / 1e9 / (ms * 1e-3) if ms else math.nan
    print(f"device-to-device copy: {run.env['copy_GB/s']:.0f} GB/s (bytes read + written)\n")
    return run.env["copy_GB/s"]


def cases(args) -> list[tuple[Op, int, int]]:
    """(op, M, N or C) in the order measured, for the ops of --ops."""
    headline = [(op, *op.sizes[0]) for op in OPS if not op.fused]
    wanted = headline + [(op, *op.sizes[0]) for op in OPS if op.fused and not args.headline]
    if not args.quick and not args.headline:
        wanted += [(op, *size) for op in OPS for size in op.sizes]
    if args.skip_headline:
        wanted = [case for case in wanted if case not in headline]
    return [case for case in dict.fromkeys(wanted) if case[0].name in args.ops]


def parser():
    p = common.parser(__doc__.split("\n\n")[0], "each op at its first size")
    names = [op.name for op in OPS]
    p.add_argument("--ops", nargs="+", choices=names, default=names, help="which ops to measure")
    below = "also time rows shorter than this from a CUDA graph (0: never)"
    p.add_argument("--graph-below-ms", type=float, default=1.0, help=below)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if common.no_cuda("benchmarks/kernels.py"):
        return 0
    common.raise_compile_limits()
    run = common.Run("kernels", args, COLUMNS, BUDGET_S)
    if common.optional_module("liger_kernel") is None:
        run.note("Liger-Kernel is not installed: its rows are left out")
    with run.measuring():
        copy_gbs = copy_bandwidth(run)
        for op, m, n in cases(args):
            if run.out_of_time():
                break
            bench_case(run, op, m, n, copy_gbs)
            common.free_memory()
    for op in OPS:
        rows = [r for r in run.rows if r["op"] == op.name]
        for column, baseline in zip(("vs reference", "vs compiled"), op.baselines):
            common.add_ratios(rows, column, baseline, KEY, "ms")
        common.add_ratios(rows, "graph vs compiled", op.baselines[1], KEY, "ms (graph)")
    bound = [r for r in run.rows if r["op"] != LCE]
    shown = ("ms", "ms (graph)", "GB/s", "% of copy", "graph vs compiled")
    title = "Memory-bound kernels, bf16 (vs X = X's ms / fastlm's; graph: both from CUDA graphs):"
    summary = common.table_lines(title, common.versus(bound, KEY, shown))
    fused = [r for r in run.rows if r["op"] == LCE]
    title = f"{LCE}, bf16, forward+backward (peak: memory beyond the inputs):"
    summary += ["", *common.table_lines(title, fused, FUSED_COLUMNS)]
    return run.finish(summary, group_by=KEY)


if __name__ == "__main__":
    sys.exit(main())
