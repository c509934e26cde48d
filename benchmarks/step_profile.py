"""What one training step moves outside the kernels: Triton launches, GEMMs and glue, per layer.

One step is what `fastlm-train` runs on CUDA: fp32 parameters, the loss
(`fastlm.cli.trainer.NextTokenLoss`) under bf16 autocast, `backward()` outside it. Without CUDA it
runs on the CPU under CPU autocast, the kernels through the interpreter, lent the GEMMs with an fp32
result from bf16 inputs that fastlm's weight gradients use on CUDA
(`fastlm.testing.mixed_gemms_on_cpu`); CPU autocast casts the same GEMMs as CUDA's but runs exp,
log, pow, rsqrt and sum in bf16 (the reference's eager attention and loss would show more casts
on CUDA; fastlm's layers call none of them). With CUDA, one unrecorded warm-up step first.

A `TorchDispatchMode` records every aten op; Triton's launch entry (`JITFunction.run`, or
`InterpretedFunction.run`) counts each outermost launch once under its kernel's name, and the
aten ops inside it (the interpreter's copies) are not recorded. Categories: `triton` launches (no
bytes: a kernel's traffic is its own business); `gemm` (`GEMM_OPS`); `model`, the embedding and
its backward; `glue`, every other op that moves bytes (casts, copies, fills, adds, reductions; for
the reference, all its eager math outside GEMMs); `metadata`, ops that move none (views,
allocations).

Bytes of an op: every tensor it reads plus every tensor it writes, each by the memory its view
spans (a stride-0 dimension counts once). Inputs are read, a functional op's outputs written; an
argument the op mutates is written, and read too unless the op overwrites it without looking
(`copy_`, `fill_`, `zero_`, `out=`), and counts whole even where the op touches part of it; an
output that aliases an input, a view and an allocation add nothing.

Per layer: the step runs at two depths L1 < L2 and two batch sizes B1 < B2 (N = B x T tokens),
and each (category, op) total is fitted exactly through the four runs as
    bytes(L, N) = fixed_step + token_step * N + L * (fixed_layer + token_layer * N).
The depth difference is one middle block (all else is the same at both depths); the rest is the
once-per-step part. Weights are separated from tokens because at these sizes the weight casts
(12 bytes per parameter a step) would swamp a per-token figure they barely touch at training
sizes: `token_layer` is reported in bytes per token x d_model (a bf16 [tokens, d_model] tensor
read once is 2), `fixed_layer` in bytes per parameter of the layer (an fp32 weight cast to bf16
is 6). Counts per layer are taken at B1 (a note if B2 gives others); "large" glue ops move at
least `LARGE` bytes per token x d_model or per parameter (host-side checks stand apart).

    python benchmarks/step_profile.py [--d-model 128] [--json step_profile.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import _common as common  # first: turns on Triton's interpreter when there is no CUDA
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fastlm.testing import call_through, mixed_gemms_on_cpu

GEMM_OPS = frozenset(
    "mm addmm bmm baddbmm addbmm matmul linear dot vdot mv addmv _addmm_activation "
    "_scaled_mm".split()
)
MODEL_OPS = frozenset({"embedding", "embedding_dense_backward", "embedding_backward"})
# Ops that move no data although their schema does not mark them as views.
NO_DATA_OPS = frozenset(
    "_unsafe_view empty empty_strided empty_like new_empty new_empty_strided lift_fresh set_ "
    "resize_ _reshape_alias".split()
)
# In-place ops that write their argument without reading it.
OVERWRITE_OPS = frozenset("copy_ _foreach_copy_ fill_ zero_ normal_ uniform_ random_".split())
CATEGORIES = ("triton", "gemm", "model", "glue", "metadata")
DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
DTYPE_NAMES |= {torch.float64: "f64", torch.int64: "i64", torch.int32: "i32", torch.bool: "bool"}


# --------------------------------------------------------------------------------------------
# Recording one step
# --------------------------------------------------------------------------------------------


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the memory a view spans: its elements, each stride-0 (expanded) dim once."""
    elements = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            elements *= size
    return elements * t.element_size() if t.numel() else 0


def _bytes_of(value) -> int:
    if isinstance(value, torch.Tensor):
        return tensor_bytes(value)
    if isinstance(value, (list, tuple)):
        return sum(_bytes_of(v) for v in value)
    return 0


def _dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def op_name(func, args: Sequence, out) -> str:
    """`sum.dim_IntList`, `add`; casts and copies name their dtypes (`_to_copy f32->bf16`)."""
    name = str(func).removeprefix("aten.").removesuffix(".default")
    packet = func.overloadpacket.__name__
    if packet in ("_to_copy", "copy_") and isinstance(out, torch.Tensor):
        source = args[0] if packet == "_to_copy" else args[1]
        if isinstance(source, torch.Tensor) and source.dtype != out.dtype:
            name += f" {_dtype_name(source.dtype)}->{_dtype_name(out.dtype)}"
    return name


def bytes_moved(func, args: Sequence, kwargs: dict, out) -> int:
    """Bytes read plus bytes written by one aten op, by the rule in the module docstring."""
    packet = func.overloadpacket.__name__
    if func.is_view or packet in NO_DATA_OPS:
        return 0
    schema = func._schema
    by_name = {a.name: a for a in schema.arguments}
    pairs = list(zip(schema.arguments, args)) + [(by_name[k], v) for k, v in kwargs.items()]
    total = 0
    for arg, value in pairs:
        size = _bytes_of(value)
        written = arg.alias_info is not None and arg.alias_info.is_write
        overwritten = written and (packet in OVERWRITE_OPS or arg.kwarg_only)  # `out=`
        total += size * (written + (not overwritten))
    outs = out if isinstance(out, (list, tuple)) else (out,)
    for ret, value in zip(schema.returns, outs):
        if ret.alias_info is None:  # a fresh tensor, not the mutated input or a view of one
            total += _bytes_of(value)
    return total


def category(func, moved: int) -> str:
    packet = func.overloadpacket.__name__
    if packet in GEMM_OPS:
        return "gemm"
    if packet in MODEL_OPS:
        return "model"
    return "glue" if moved else "metadata"


class StepRecorder(TorchDispatchMode):
    """Counts and bytes of every aten op, and Triton launches, keyed by (category, name)."""

    def __init__(self):
        super().__init__()
        self.totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        self.launch_depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "fastlm":  # an op seen whole: count what runs inside it instead
            return call_through(self, func, args, kwargs)
        out = func(*args, **kwargs)
        if self.launch_depth == 0:  # inside a launch: the interpreter's own copies
            moved = bytes_moved(func, args, kwargs, out)
            entry = self.totals[category(func, moved), op_name(func, args, out)]
            entry[0] += 1
            entry[1] += moved
        return out

    @contextlib.contextmanager
    def launches_counted(self) -> Iterator[None]:
        """Wrap Triton's launch entry points so that each outermost launch counts once."""
        from triton.runtime.jit import JITFunction

        classes = [JITFunction]
        try:
            from triton.runtime.interpreter import InterpretedFunction

            classes.append(InterpretedFunction)
        except ImportError:  # an older Triton: the interpreter launches through JITFunction
            pass
        originals = {cls: cls.run for cls in classes}

        def wrap(original):
            def run(kernel, *args, **kwargs):
                if kwargs.get("warmup"):  # compiles, launches nothing
                    return original(kernel, *args, **kwargs)
                if self.launch_depth == 0:
                    name = getattr(kernel, "__name__", None) or kernel.fn.__name__
                    self.totals["triton", name][0] += 1
                self.launch_depth += 1
                try:
                    return original(kernel, *args, **kwargs)
                finally:
                    self.launch_depth -= 1

            return run

        for cls, original in originals.items():
            cls.run = wrap(original)
        try:
            yield
        finally:
            for cls, original in originals.items():
                cls.run = original


def record_step(step: Callable[[], None], warmup_steps: int = 0) -> dict[tuple[str, str], list]:
    """{(category, name): [count, bytes]} of one call of `step`, after `warmup_steps` unrecorded
    calls."""
    for _ in range(warmup_steps):
        step()
    recorder = StepRecorder()
    with recorder.launches_counted(), recorder:
        step()
    return dict(recorder.totals)


# --------------------------------------------------------------------------------------------
# Per layer: four runs, one exact fit
# --------------------------------------------------------------------------------------------


@dataclass
class Fit:
    """One (category, name)'s share of a step; see the module docstring for the model."""

    category: str
    name: str
    count_layer: float
    count_step: float
    token_bytes_layer: float  # bytes per token, per layer
    fixed_bytes_layer: float  # bytes per step, per layer
    token_bytes_step: float
    fixed_bytes_step: float
    count_layer_larger_batch: float  # count_layer measured at the larger batch


def fit_runs(
    runs: dict[tuple[int, int], dict], layers: tuple[int, int], tokens: tuple[int, int]
) -> list[Fit]:
    """Exact fit of every key's count and bytes through runs[(L, N)] for L in layers and N in
    tokens (a key missing from a run counts zero there)."""
    (l1, l2), (n1, n2) = layers, tokens
    keys = sorted({key for totals in runs.values() for key in totals})
    fits = []
    for key in keys:
        count = {ln: runs[ln].get(key, (0, 0))[0] for ln in runs}
        size = {ln: runs[ln].get(key, (0, 0))[1] for ln in runs}
        count_layer = (count[l2, n1] - count[l1, n1]) / (l2 - l1)
        token_layer = ((size[l2, n2] - size[l2, n1]) - (size[l1, n2] - size[l1, n1])) / (
            (l2 - l1) * (n2 - n1)
        )
        fixed_layer = (size[l2, n1] - size[l1, n1]) / (l2 - l1) - token_layer * n1
        token_step = (size[l1, n2] - size[l1, n1]) / (n2 - n1) - token_layer * l1
        fixed_step = size[l1, n1] - l1 * (fixed_layer + token_layer * n1) - token_step * n1
        fits.append(
            Fit(
                *key,
                count_layer=count_layer,
                count_step=count[l1, n1] - l1 * count_layer,
                token_bytes_layer=token_layer,
                fixed_bytes_layer=fixed_layer,
                token_bytes_step=token_step,
                fixed_bytes_step=fixed_step,
                count_layer_larger_batch=(count[l2, n2] - count[l1, n2]) / (l2 - l1),
            )
        )
    return fits


def profile(
    make_step: Callable[[int, int], Callable[[], None]],
    layers: tuple[int, int],
    batch_sizes: tuple[int, int],
    seq_len: int,
    warmup_steps: int = 0,
) -> list[Fit]:
    """Record make_step(num_layers, batch_size)() at the four (depth, batch) pairs and fit."""
    runs = {
        (num_layers, batch * seq_len): record_step(make_step(num_layers, batch), warmup_steps)
        for num_layers in layers
        for batch in batch_sizes
    }
    return fit_runs(runs, layers, tuple(b * seq_len for b in batch_sizes))


# --------------------------------------------------------------------------------------------
# The two models
# --------------------------------------------------------------------------------------------


MODELS = ("fastlm", "reference")


def build_model(kind: str, config: dict, device: str) -> nn.Module:
    import fastlm
    from fastlm import reference

    cls = {"fastlm": fastlm.Transformer, "reference": reference.Transformer}[kind]
    return cls(**config, device=device)


def model_step(
    kind: str, config: dict, batch_size: int, device: str, seed: int = 0
) -> Callable[[], None]:
    """One loss + backward of a fresh fp32 model as fastlm.cli.train runs it on CUDA: the loss under
    bf16 autocast (fastlm: fused linear cross-entropy; reference: float32 logits through the
    reference cross-entropy), backward outside it, gradients None before each call."""
    from fastlm.cli.trainer import NextTokenLoss

    torch.manual_seed(seed)
    loss_fn = NextTokenLoss(build_model(kind, config, device))
    tokens = torch.randint(
        0, config["vocab_size"], (batch_size, config["context_length"] + 1), device=device
    )

    def step():
        loss_fn.zero_grad(set_to_none=True)  # a warm-up's gradients would turn casts into adds
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            loss = loss_fn(tokens[:, :-1], tokens[:, 1:])
        loss.backward()

    return step


def parameter_counts(kind: str, config: dict) -> tuple[int, int]:
    """(parameters of one block, parameters outside the blocks)."""
    model = build_model(kind, dict(config, num_layers=1), "meta")
    block = sum(p.numel() for p in model.blocks[0].parameters())
    return block, sum(p.numel() for p in model.parameters()) - block


def profile_model(kind: str, config: dict, layers, batch_sizes, device: str, warmup_steps=0):
    """profile() of `kind`'s training step (model_step) at depths `layers` and `batch_sizes`."""

    def make_step(num_layers: int, batch_size: int):
        return model_step(kind, dict(config, num_layers=num_layers), batch_size, device)

    # On the CPU, the GEMMs CUDA has for fp32 weight gradients from bf16 inputs, so the step
    # recorded is the one a CUDA step runs.
    with mixed_gemms_on_cpu() if device == "cpu" else contextlib.nullcontext():
        return profile(make_step, layers, batch_sizes, config["context_length"], warmup_steps)


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


def _number(x: float) -> float | int:
    """Counts that are whole print as integers; bytes keep two decimals."""
    return int(round(x)) if abs(x - round(x)) < 1e-9 else round(x, 2)


LARGE = 0.5  # bytes per token x d_model, or per parameter: below this an op is small glue
COUNT_COLUMNS = ["Triton launches", "GEMMs", "other model ops", "glue ops", "zero-byte ops"]
GLUE_COLUMNS = ["large glue ops", "glue B/token/d_model", "glue fixed B/param"]
SUMMARY_COLUMNS = ["model", "part", *COUNT_COLUMNS[:4], *GLUE_COLUMNS, COUNT_COLUMNS[4]]
OP_COLUMNS = ["category", "op", "per layer", "B/token/d_model per layer"]
OP_COLUMNS += ["fixed B/param per layer", "once per step", "B/token/d_model once"]
OP_COLUMNS += ["fixed B/param once"]


def summary_rows(kind: str, fits: Sequence[Fit], d_model: int, params: tuple) -> list[dict]:
    """One row per part (a layer, the rest of the step) with counts per category and the glue's
    bytes per token x d_model and fixed bytes per parameter of that part."""
    rows = []
    for part, suffix, n_params in (
        ("per layer", "layer", params[0]),
        ("once per step", "step", params[1]),
    ):
        count, token, fixed = f"count_{suffix}", f"token_bytes_{suffix}", f"fixed_bytes_{suffix}"
        total = lambda fits, field: sum(getattr(f, field) for f in fits)  # noqa: E731
        glue = [f for f in fits if f.category == "glue"]
        large = [
            f
            for f in glue
            if getattr(f, token) / d_model >= LARGE or getattr(f, fixed) / n_params >= LARGE
        ]
        row = {"model": kind, "part": part}
        for cat, column in zip(CATEGORIES, COUNT_COLUMNS):
            row[column] = _number(total([f for f in fits if f.category == cat], count))
        row["large glue ops"] = _number(total(large, count))
        row["glue B/token/d_model"] = _number(total(glue, token) / d_model)
        row["glue fixed B/param"] = _number(total(glue, fixed) / n_params)
        rows.append(row)
    return rows


def op_rows(kind: str, fits: Sequence[Fit], d_model: int, params: tuple) -> list[dict]:
    """Every (category, op) with its share of a layer and of the rest of the step."""
    return [
        {
            "model": kind,
            "category": f.category,
            "op": f.name,
            "per layer": _number(f.count_layer),
            "B/token/d_model per layer": _number(f.token_bytes_layer / d_model),
            "fixed B/param per layer": _number(f.fixed_bytes_layer / params[0]),
            "once per step": _number(f.count_step),
            "B/token/d_model once": _number(f.token_bytes_step / d_model),
            "fixed B/param once": _number(f.fixed_bytes_step / params[1]),
            "per layer at the larger batch": _number(f.count_layer_larger_batch),
        }
        for f in fits
    ]


def print_report(config: dict, args, summaries: list[dict], ops: list[dict]) -> None:
    shape = ", ".join(f"{k}={v}" for k, v in config.items() if k != "num_layers")
    print(
        f"One training step (loss + backward, fp32 parameters, bf16 autocast) on {common.DEVICE}"
        f"; {shape}; layers {args.layers[0]} and {args.layers[1]}, batch sizes "
        f"{args.batch_sizes[0]} and {args.batch_sizes[1]} fitted (see the docstring).\n"
    )
    print(common.markdown_table(summaries, SUMMARY_COLUMNS))
    print(
        f"\nlarge glue ops: those moving at least {LARGE} B/token/d_model or {LARGE} fixed "
        "B/param; fixed B/param: bytes that do not grow with the batch (weight casts), per "
        "parameter of the part"
    )
    for kind in args.models:
        mine = [r for r in ops if r["model"] == kind]
        launches = [
            f"{r['op']} {r['per layer']}"
            for r in mine
            if r["category"] == "triton" and r["per layer"]
        ]
        if launches:
            print(f"\n{kind}: Triton launches per layer: " + ", ".join(launches))
        moving = ("glue", "model", "gemm")
        shown = [
            r for r in mine if r["category"] in moving and (r["per layer"] or r["once per step"])
        ]
        weight = lambda r: (  # noqa: E731
            -abs(r["B/token/d_model per layer"]),
            -abs(r["per layer"]),
            -abs(r["B/token/d_model once"]),
            r["op"],
        )
        print(f"\n{kind}: aten ops that move data (counts per layer and once per step)\n")
        print(common.markdown_table(sorted(shown, key=weight), OP_COLUMNS))
    uneven = [
        f"{r['model']} {r['op']}"
        for r in ops
        if r["per layer"] != r["per layer at the larger batch"]
    ]
    if uneven:
        print("\nnote: per-layer counts differ at the larger batch for " + ", ".join(uneven))


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--models", nargs="+", choices=MODELS, default=list(MODELS))
    add("--d-model", type=int, default=128)
    add("--num-heads", type=int, default=2)
    add("--d-ff", type=int, default=352, help="default 2.75 x d_model")
    add("--vocab-size", type=int, default=256)
    add("--seq-len", type=int, default=64, help="tokens per sequence (T)")
    depths, batches = ("L1", "L2"), ("B1", "B2")
    add("--layers", type=int, nargs=2, default=(1, 2), metavar=depths, help="two depths")
    add("--batch-sizes", type=int, nargs=2, default=(2, 4), metavar=batches, help="two batches")
    add("--warmup-steps", type=int, help="unrecorded steps first (default: 1 on CUDA, 0 on CPU)")
    add("--json", type=Path, metavar="PATH", help="write config, environment and rows here")
    args = p.parse_args(argv)
    for name in ("d_model", "num_heads", "d_ff", "vocab_size", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(
                f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}"
            )
    if args.d_model % args.num_heads or (args.d_model // args.num_heads) % 2:
        raise ValueError(
            f"--d-model ({args.d_model}) must be a multiple of --num-heads "
            f"({args.num_heads}) with an even head size"
        )
    if not 1 <= args.layers[0] < args.layers[1]:
        raise ValueError(f"--layers must be two depths 1 <= L1 < L2, got {list(args.layers)}")
    if not 1 <= args.batch_sizes[0] < args.batch_sizes[1]:
        raise ValueError(f"--batch-sizes must be 1 <= B1 < B2, got {list(args.batch_sizes)}")
    if args.warmup_steps is None:
        args.warmup_steps = 1 if common.HAS_CUDA else 0
    elif args.warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    args.models = list(dict.fromkeys(args.models))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ValueError as error:
        print(f"step_profile.py: error: {error}", file=sys.stderr)
        return 2
    config = dict(vocab_size=args.vocab_size, context_length=args.seq_len, d_model=args.d_model)
    config |= dict(num_layers=args.layers[0], num_heads=args.num_heads, d_ff=args.d_ff)
    config["rope_theta"] = 10000.0
    summaries, ops = [], []
    for kind in args.models:
        layers, batches = tuple(args.layers), tuple(args.batch_sizes)
        fits = profile_model(kind, config, layers, batches, common.DEVICE, args.warmup_steps)
        params = parameter_counts(kind, config)
        summaries += summary_rows(kind, fits, args.d_model, params)
        ops += op_rows(kind, fits, args.d_model, params)
    print_report(config, args, summaries, ops)
    if args.json is not None:
        record = {"config": {k: v for k, v in config.items() if k != "num_layers"}}
        record |= {"layers": list(args.layers), "batch_sizes": list(args.batch_sizes)}
        record |= {"warmup_steps": args.warmup_steps, "device": common.DEVICE}
        record |= {"environment": common.environment(), "summary": summaries, "ops": ops}
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
