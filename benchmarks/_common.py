"""What the benchmarks share: their options, timing on `triton.testing`, and their output.

Timing is `triton.testing.do_bench` (median milliseconds; it flushes the L2 cache before every
timed call, so inputs need no rotation) or, for rows too short for the host to keep up,
`triton.testing.do_bench_cudagraph` (replays of a CUDA graph: the GPU's time alone, no flush).
A failed measurement is a table cell, never a crash: `OOM` (the memory is freed), `unsupported` (a
backend that refuses the shape or dtype), `n/a` (not importable), `error` (its message goes to
the notes), `skipped` (the time budget is spent). Rows reach NAME.csv as they are measured, and
Ctrl-C or SIGINT (gpu_check.sh's limit) ends the measuring early but still writes every file.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import gc
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # step_profile.py runs the kernels on the CPU; set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = "cuda" if HAS_CUDA else "cpu"
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's fastlm, wherever (or whether) fastlm is installed
SOURCES = ("fastlm", "benchmarks", "tests", "tools", "pyproject.toml")

OOM, UNSUPPORTED, NOT_AVAILABLE, ERROR, SKIPPED = "OOM", "unsupported", "n/a", "error", "skipped"
MODES = ("fwd", "bwd", "fwd+bwd")


def parser(description: str, quick: str) -> argparse.ArgumentParser:
    """The options every benchmark takes (`quick`: what --quick measures); scripts add theirs."""
    p = argparse.ArgumentParser(description=description)
    add = p.add_argument
    add("--quick", action="store_true", help=quick)
    add("--out", type=Path, metavar="DIR", help="write NAME.csv, .json, _summary.md (.png) here")
    add("--time-limit", type=float, metavar="S", help="start nothing new after S seconds")
    add("--warmup-ms", type=float, default=25.0, help="do_bench's warm-up per measurement")
    add("--rep-ms", type=float, default=100.0, help="do_bench's timed time per measurement")
    add("--graph-rep-ms", type=float, default=20.0, help="do_bench_cudagraph's time per replay")
    part = p.add_mutually_exclusive_group()
    part.add_argument("--headline", action="store_true", help="only gpu_check.sh's first rows")
    part.add_argument("--skip-headline", action="store_true", help="all but the headline rows")
    return p


def no_cuda(script: str) -> bool:
    """True, after saying so, where torch sees no CUDA device (the script then exits 0)."""
    if not HAS_CUDA:
        print(f"{script}: no CUDA device, nothing to measure (correctness: pytest tests/)")
    return not HAS_CUDA


def optional_module(name: str):
    """The module if it imports, else None (Liger-Kernel, flash-attn, matplotlib...)."""
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a broken optional install counts as missing
        return None


def as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def number(value) -> float | None:
    """value if it is a measured number, None for a status word or an empty cell."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def failure(exc: BaseException) -> tuple[str, str]:
    """The status word of a failed measurement and the first line of its message."""
    text = f"{type(exc).__name__}: {exc}"
    low = text.lower()
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in low:
        status = OOM
    elif any(w in low for w in ("no available kernel", "no viable backend", "out of resource")):
        status = UNSUPPORTED
    elif isinstance(exc, (ImportError, NotImplementedError)):
        status = NOT_AVAILABLE
    else:
        status = ERROR
    return status, text.splitlines()[0][:200]


def free_memory() -> None:
    gc.collect()
    if HAS_CUDA:
        torch.cuda.empty_cache()


def raise_compile_limits() -> None:
    """One compiled graph per benchmarked shape, not eager after 8 recompilations."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, 1024)


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def bench_ms(fn, args: argparse.Namespace, *, graph: bool = False, grad_to_none=None) -> float:
    """Median milliseconds of fn() by do_bench, or with graph=True by do_bench_cudagraph."""
    from triton.testing import do_bench, do_bench_cudagraph

    if not graph:
        ms = do_bench(fn, args.warmup_ms, args.rep_ms, grad_to_none, return_mode="median")
        return float(ms)
    torch.cuda.synchronize()  # the inputs were written on the default stream
    with torch.cuda.stream(torch.cuda.Stream()):  # older Tritons capture on the caller's stream
        ms = do_bench_cudagraph(fn, args.graph_rep_ms, grad_to_none, return_mode="median")
    return float(ms)


def time_modes(run: Run, fn, inputs, label: str, modes=MODES, *, forward_grad=True, graph=False):
    """{mode: ms or status} of fn(*inputs)'s forward, backward and forward+backward (those in
    `modes`). The forward records the autograd graph, as in training (not if forward_grad is
    False); the backward reuses one graph and one random output gradient; the leaves' gradients
    are reset before each call. graph=True: replayed from CUDA graphs, no backward alone (it would
    run on the stream of a forward made outside the graph)."""
    leaves = [t for t in inputs if t.requires_grad]

    def outputs():
        return as_tuple(fn(*inputs))

    def forward():
        with torch.set_grad_enabled(forward_grad):
            return bench_ms(outputs, run.args, graph=graph)

    def backward():
        outs = outputs()
        grads = [torch.randn_like(o) for o in outs]
        step = lambda: torch.autograd.backward(outs, grads, retain_graph=True)  # noqa: E731
        return bench_ms(step, run.args, grad_to_none=leaves)

    def forward_backward():
        grads = [torch.randn_like(o) for o in outputs()]
        step = lambda: torch.autograd.backward(outputs(), grads)  # noqa: E731
        return bench_ms(step, run.args, graph=graph, grad_to_none=leaves)

    timers = {"fwd": forward, "bwd": backward, "fwd+bwd": forward_backward}
    tag = " (graph)" if graph else ""
    return {
        m: run.measure(timers[m], f"{label} {m}{tag}") for m in modes if m != "bwd" or not graph
    }


def time_steps_ms(step, steps: int) -> float:
    """Mean milliseconds of `steps` back-to-back calls, by CUDA events (whole training steps)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def peak_bytes(fn) -> int:
    """Peak CUDA memory allocated while fn runs, beyond what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def output_error(fn, reference_fn, inputs) -> float:
    """Largest relative error of fn's outputs against reference_fn's, both on copies of `inputs`
    (`fn.error_reference`, when set, replaces reference_fn: another layout's math)."""
    from fastlm.testing import relative_error

    reference_fn = getattr(fn, "error_reference", reference_fn)

    def copies():  # requiring grad as the inputs do, so compiled code reuses its training graph
        return [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]

    outs = [o.detach().clone() for o in as_tuple(fn(*copies()))]
    refs = [r.detach() for r in as_tuple(reference_fn(*copies()))]
    return max(relative_error(o, r) for o, r in zip(outs, refs))


# --------------------------------------------------------------------------------------------
# A run: rows, notes, the time budget, the files
# --------------------------------------------------------------------------------------------


class Run:
    """One benchmark run. Files are NAME.*, NAME_headline.* (--headline) or NAME_sweep.*
    (--skip-headline); the time budget is --time-limit, else `budget_s` for --quick and
    --headline, else none."""

    def __init__(self, name: str, args: argparse.Namespace, columns, budget_s: float):
        self.name = name + ("_headline" if args.headline else "")
        self.name += "_sweep" if args.skip_headline else ""
        self.args, self.columns = args, list(columns)
        self.limit = args.time_limit
        if self.limit is None and (args.quick or args.headline):
            self.limit = budget_s
        self.start = time.monotonic()
        self.rows, self.notes, self.extra, self.failures = [], [], {}, {}
        self.stopped = None  # why the run ended before its last case
        self.env = environment()
        self.csv = args.out / f"{self.name}.csv" if args.out else None
        if self.csv:
            args.out.mkdir(parents=True, exist_ok=True)
            self._csv([], "w")

    def _csv(self, rows, mode: str) -> None:
        with self.csv.open(mode, newline="") as f:
            writer = csv.DictWriter(f, self.columns, extrasaction="ignore")
            if mode == "w":
                writer.writeheader()
            writer.writerows(rows)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def add(self, row: dict) -> None:
        """Keep a measured row and append it to the CSV at once."""
        self.rows.append(row)
        if self.csv:
            self._csv([row], "a")

    def out_of_time(self) -> bool:
        """True once the time budget is spent: loops stop starting new cases."""
        if self.limit is None or self.elapsed() <= self.limit:
            return False
        if not self.stopped:
            self.stopped = "time budget spent"
            self.note(f"{SKIPPED}: the time budget of {self.limit:.0f} s was spent first")
        return True

    def measure(self, fn, label: str):
        """fn()'s value, or the status word of its failure (SKIPPED once out of time)."""
        if self.out_of_time():
            return SKIPPED
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - every failure is a table cell
            status, message = failure(exc)
        if status == OOM:  # outside the except block: the traceback's frames are gone by now
            free_memory()
        else:
            self.failures.setdefault((status, message), []).append(label)
        return status

    @contextlib.contextmanager
    def measuring(self):
        """Measure in the block; Ctrl-C or SIGINT ends it early, keeping the rows so far."""
        env = self.env
        versions = f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}"
        print(f"# {self.name}: {env['gpu']}, {versions}, commit {env['commit']}\n")
        # A process started with SIGINT ignored (a background job) would not see the limit's.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            yield
        except KeyboardInterrupt:
            self.stopped = "interrupted (SIGINT)"
            self.note(f"interrupted (SIGINT) after {self.elapsed():.0f} s: later rows are missing")

    def finish(self, summary=(), group_by=()) -> int:
        """The table and notes on stdout; with --out the CSV (rewritten whole), the JSON and
        NAME_summary.md (`summary`'s lines). Rows with equal `group_by` fields are put together.
        Returns the exit status: 130 if interrupted, else 0."""
        order: dict = {}
        for row in self.rows:
            order.setdefault(tuple(row[k] for k in group_by), len(order))
        self.rows.sort(key=lambda row: order[tuple(row[k] for k in group_by)])
        self.notes += [
            f"{status} in {len(labels)} measurement(s), first {labels[0]}: {message}"
            for (status, message), labels in self.failures.items()
        ]
        summary = list(summary)
        print(markdown_table(self.rows, self.columns), "\n".join(summary), sep="\n\n")
        print(*(f"- {text}" for text in self.notes), f"\n({self.elapsed():.0f} s)", sep="\n")
        out = self.args.out
        if out:
            self._csv(self.rows, "w")
            record = dict(env=self.env, args={k: str(v) for k, v in vars(self.args).items()})
            record.update(elapsed_s=round(self.elapsed(), 1), stopped=self.stopped)
            record.update(rows=self.rows, notes=self.notes, **self.extra)
            (out / f"{self.name}.json").write_text(json.dumps(record, indent=1, default=str))
            (out / f"{self.name}_summary.md").write_text("\n".join(summary) + "\n")
            print(f"wrote {out}/{self.name}.csv, .json and _summary.md")
        return 130 if self.stopped and self.stopped.startswith("interrupted") else 0


def add_ratios(rows, column: str, baseline: str, key, value: str, higher_is_better=False) -> None:
    """Each row's `column`: its `value` against the row of impl `baseline` with the same `key`
    fields, baseline / row (a speed-up when value is a time) or, with higher_is_better (tokens/s),
    row / baseline; None where either is not a number."""
    base = {tuple(r[k] for k in key): number(r.get(value)) for r in rows if r["impl"] == baseline}
    for row in rows:
        a, b = number(row.get(value)), base.get(tuple(row[k] for k in key))
        a, b = (a, b) if higher_is_better else (b, a)
        row[column] = a / b if a is not None and b else None


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


def format_value(value) -> str:
    if value is None:
        return ""
    if not isinstance(value, float) or not math.isfinite(value):
        return str(value)
    size = abs(value)
    if size >= 100 or size == 0:
        return f"{value:.0f}"
    return f"{value:.2f}" if size >= 1 else f"{value:.3f}" if size >= 1e-2 else f"{value:.1e}"


def markdown_table(rows, columns) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(format_value(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def versus(rows, key, shown, value: str = "ms", ours: str = "fastlm") -> list[dict]:
    """One row per `key` group that holds an `ours` row: the key fields, that row's `shown`
    columns and, for each other impl of the group, 'vs NAME' = NAME's `value` / ours (the
    speed-up over NAME when value is a time)."""
    table = []
    for group in dict.fromkeys(tuple(r[k] for k in key) for r in rows):
        same = {r["impl"]: r for r in rows if tuple(r[k] for k in key) == group}
        if ours not in same:
            continue
        line = dict(zip(key, group)) | {c: same[ours].get(c) for c in shown}
        base = number(same[ours].get(value))
        for name, row in same.items():
            theirs = number(row.get(value))
            if name != ours:
                line[f"vs {name}"] = theirs / base if theirs is not None and base else None
        table.append(line)
    return table


def table_lines(title: str, table: list[dict], columns=None) -> list[str]:
    """A summary's lines: the title and the table (`columns`, default every column a row has)."""
    columns = columns or list(dict.fromkeys(c for row in table for c in row))
    return [title, "", markdown_table(table, columns)] if table else [f"{title} no rows"]


# --------------------------------------------------------------------------------------------
# The environment every result records
# --------------------------------------------------------------------------------------------


def source_fingerprint(repo: Path = REPO) -> str:
    """12 hex digits of SHA-256 over the path and bytes of every .py, .sh and .toml file of
    SOURCES (caches and results left out), in sorted order: what ties numbers measured on a
    tree without .git to a commit."""
    digest = hashlib.sha256()
    files = []
    for top in (repo / name for name in SOURCES):
        files += [top] if top.is_file() else top.rglob("*")
    for f in sorted(files, key=lambda f: f.relative_to(repo).as_posix()):
        skip = {"__pycache__", "results"} & set(f.parts)
        if f.is_file() and f.suffix in (".py", ".sh", ".toml") and not skip:
            digest.update(f.relative_to(repo).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def _run(*command: str) -> str:
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def environment() -> dict:
    """What a reader needs to compare numbers: GPU, driver, versions, commit, date. Without .git
    the commit is FASTLM_COMMIT (or "unknown"), and `source` still ties the numbers to one."""
    import triton

    commit = _run("git", "rev-parse", "--short", "HEAD")
    smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    info = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if HAS_CUDA else "none (CPU)",
        "driver": (_run(*smi).split() or [None])[0] if HAS_CUDA and shutil.which(smi[0]) else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if HAS_CUDA else None,
        "python": platform.python_version(),
        "commit": commit or os.environ.get("FASTLM_COMMIT") or "unknown",
        "uncommitted_changes": bool(_run("git", "status", "--porcelain")) if commit else None,
        "source": source_fingerprint(),
    }
    if HAS_CUDA:
        props = torch.cuda.get_device_properties(0)
        info.update(sms=props.multi_processor_count, gpu_memory_gib=props.total_memory / 2**30)
    for module, distribution in (("liger_kernel", "liger-kernel"), ("flash_attn", "flash-attn")):
        try:
            info[module] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            info[module] = None
    return info


def main(argv: list[str] | None = None) -> int:
    """`env --out DIR`: DIR/env.json, with the --require modules that do not import (exit 3
    with --need-cuda where torch sees no CUDA device); `fingerprint`: the source fingerprint."""
    p = argparse.ArgumentParser(description="the environment benchmarks record")
    sub = p.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print the environment and write DIR/env.json")
    env.add_argument("--out", type=Path, required=True, metavar="DIR")
    env.add_argument("--require", nargs="*", default=[], metavar="MODULE")
    env.add_argument("--need-cuda", action="store_true", help="exit 3 without a CUDA device")
    sub.add_parser("fingerprint", help="print this checkout's source fingerprint")
    args = p.parse_args(argv)
    if args.command == "fingerprint":
        print(source_fingerprint())
        return 0
    info = environment()
    missing = [m for m in args.require if importlib.util.find_spec(m) is None]
    info["missing_modules"] = " ".join(missing)
    print(json.dumps(info, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "env.json").write_text(json.dumps(info, indent=1) + "\n")
    if args.need_cuda and not HAS_CUDA:
        print("no CUDA device: torch.cuda.is_available() is False", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
