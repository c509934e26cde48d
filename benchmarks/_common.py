"""What every fastlm benchmark shares: set-up, timing, failure handling, tables, files, plots.

Import this module before torch-using code imports triton or fastlm: without CUDA it turns on
Triton's interpreter (TRITON_INTERPRET must be set before triton is first imported), so each
script's small correctness check runs on the CPU.

Timing is `triton.testing.do_bench`, median of the timed runs, in milliseconds. do_bench writes a
large buffer before every timed call, so inputs never sit in the L2 cache (60 MB on an H200)
between runs and need no rotation. A failing measurement never stops a run: out of memory shows
as `OOM` (and the memory is freed), a shape a kernel does not support as `unsupported`, a piece
that is not importable as `n/a`, anything else as `error` with its message in the notes, and rows
past the time budget as `skipped`. Rows go to the CSV as they are measured, and Ctrl-C or SIGINT
(gpu_check.sh's time limit) ends the measuring early but still writes the tables.

Every script takes --headline (only the rows gpu_check.sh measures first; files NAME_headline.*)
and --skip-headline (everything else of the chosen sweep, most important first; files
NAME_sweep.*), so that gpu_check.sh measures what matters most before the rest.

`python benchmarks/_common.py --out DIR` writes the environment (GPU, driver, versions, commit) to
DIR/env.json and prints it.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import gc
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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_CUDA else "cpu"

REPO = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("fastlm") is None:  # a bare checkout: use it without installing
    sys.path.insert(0, str(REPO))

# Status words shown in a table cell instead of a number.
OOM, UNSUPPORTED, NOT_AVAILABLE, ERROR, SKIPPED = "OOM", "unsupported", "n/a", "error", "skipped"


# --------------------------------------------------------------------------------------------
# Command line and environment
# --------------------------------------------------------------------------------------------


def parser(description: str, *, quick_help: str) -> argparse.ArgumentParser:
    """The arguments every benchmark takes; scripts add their own."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="write CSV, JSON, PNG and a summary here (created if missing)",
    )
    p.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up per measurement")
    p.add_argument(
        "--rep-ms", type=float, default=100.0, help="do_bench timed time per measurement"
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop starting measurements after this long (default: none, or the "
        "script's --quick budget)",
    )
    part = p.add_mutually_exclusive_group()
    part.add_argument(
        "--headline",
        action="store_true",
        help="only the headline rows (what gpu_check.sh measures first); files NAME_headline.*",
    )
    part.add_argument(
        "--skip-headline",
        action="store_true",
        help="leave out the rows --headline measures; files NAME_sweep.*",
    )
    return p


def run_name(base: str, args: argparse.Namespace) -> str:
    """The files' name: NAME, NAME_headline or NAME_sweep, so that gpu_check.sh's steps do not
    overwrite each other's tables."""
    if getattr(args, "headline", False):
        return f"{base}_headline"
    if getattr(args, "skip_headline", False):
        return f"{base}_sweep"
    return base


def optional_module(name: str):
    """The module if it imports, else None (Liger-Kernel, flash-attn, matplotlib...)."""
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a broken optional install counts as missing
        return None


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _driver_version() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None


def environment() -> dict:
    """What a reader needs to compare numbers: GPU, driver, versions, commit, date.

    A device machine may get the working tree without its .git folder: then the commit is
    FASTLM_COMMIT if set, else "unknown", and `source` (a hash of the tracked sources, see
    gpu_report.py) still ties the numbers to a commit."""
    import triton
    from gpu_report import source_fingerprint

    commit = _git("rev-parse", "--short", "HEAD")
    info = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if HAS_CUDA else "none (CPU, Triton interpreter)",
        "driver": _driver_version() if HAS_CUDA else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if HAS_CUDA else None,
        "python": platform.python_version(),
        "commit": commit or os.environ.get("FASTLM_COMMIT") or "unknown",
        "uncommitted_changes": bool(_git("status", "--porcelain")) if commit else None,
        "source": source_fingerprint(REPO),
    }
    if HAS_CUDA:
        props = torch.cuda.get_device_properties(0)
        info["sms"] = props.multi_processor_count
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    for package, distribution in (("liger_kernel", "liger-kernel"), ("flash_attn", "flash-attn")):
        info[package] = None
        if optional_module(package) is not None:
            try:
                info[package] = importlib.metadata.version(distribution)
            except importlib.metadata.PackageNotFoundError:
                info[package] = "installed"
    return info


def no_cuda_notice(script: str) -> None:
    print(
        f"{script}: no CUDA device, so no timings. Running a small correctness check through "
        "Triton's interpreter instead (TRITON_INTERPRET=1)."
    )


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What a measurement returned (milliseconds, or a record), or why there is none: then
    `value` is None and `status` one of the status words."""

    value: object = None
    status: str = "ok"
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.value is not None

    def cell(self):
        return self.value if self.ok else self.status


def free_memory() -> None:
    gc.collect()
    if HAS_CUDA:
        torch.cuda.empty_cache()


def _classify(exc: BaseException) -> tuple[str, str]:
    text = f"{type(exc).__name__}: {exc}".strip()
    first_line = text.splitlines()[0][:200] if text else type(exc).__name__
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in text.lower():
        return OOM, first_line
    if any(
        words in text.lower()
        for words in (
            "no available kernel",
            "no viable backend",
            "outofresources",
            "out of resource",
        )
    ):
        return UNSUPPORTED, first_line
    if isinstance(exc, (ImportError, NotImplementedError)):
        return NOT_AVAILABLE, first_line
    return ERROR, first_line


def guarded(fn: Callable[[], object]) -> Outcome:
    """Run fn; any failure becomes an Outcome with its status, and memory is freed afterwards."""
    try:
        outcome = Outcome(fn())
    except Exception as exc:  # noqa: BLE001 - every failure becomes a table cell
        outcome = Outcome(None, *_classify(exc))
    # Outside the except block: the traceback (and the tensors its frames hold) is gone by now.
    if not outcome.ok:
        free_memory()
    return outcome


def sync() -> None:
    if HAS_CUDA:
        torch.cuda.synchronize()


def do_bench_ms(
    fn: Callable[[], object],
    warmup_ms: float,
    rep_ms: float,
    grad_to_none: Sequence[torch.Tensor] | None = None,
) -> float:
    """Median milliseconds of fn over do_bench's timed runs (L2 flushed before each)."""
    from triton.testing import do_bench

    return float(
        do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, return_mode="median")
    )


def do_bench_graph_ms(
    fn: Callable[[], object], rep_ms: float, grad_to_none: Sequence[torch.Tensor] | None = None
) -> float:
    """Median milliseconds of fn replayed from a CUDA graph (`triton.testing.do_bench_cudagraph`):
    the GPU's time without the host's launch overhead. No L2 flush between calls, so use it on
    data several times the L2's size.

    The graph is captured on a side stream (older Triton versions require the caller to do that);
    fn's autograd work must start inside fn, since a backward runs on its forward's stream."""
    from triton.testing import do_bench_cudagraph

    sync()  # the inputs were written on the default stream
    with torch.cuda.stream(torch.cuda.Stream()):
        return float(
            do_bench_cudagraph(fn, rep=rep_ms, grad_to_none=grad_to_none, return_mode="median")
        )


def time_loop_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Mean milliseconds per call over `iters` back-to-back calls after `warmup` calls, timed
    with CUDA events (for whole training steps, where do_bench's cache flush is noise)."""
    for _ in range(warmup):
        fn()
    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    sync()
    return start.elapsed_time(end) / iters


def copy_bandwidth_gbs(warmup_ms: float, rep_ms: float, gib: float = 1.0) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.randn(int(gib * 2**30) // 4, device=DEVICE)
    dst = torch.empty_like(src)
    ms = do_bench_ms(lambda: dst.copy_(src), warmup_ms, rep_ms)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def peak_memory_gib(fn: Callable[[], object]) -> float:
    """Peak CUDA memory allocated (GiB) while fn runs, including what was allocated before."""
    sync()
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync()
    return torch.cuda.max_memory_allocated() / 2**30


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (inf if out holds NaN or inf)."""
    from fastlm.testing import relative_error as rel

    return rel(out, ref)


def raise_compile_limits() -> None:
    """Let torch.compile keep one graph per benchmarked shape instead of falling back to eager
    after 8 recompilations."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, 1024)


MODES = ("fwd", "bwd", "fwd+bwd")


def as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _grads_for(outputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [torch.randn_like(o) for o in outputs]


def time_modes(
    run: Run,
    fn: Callable,
    inputs: Sequence[torch.Tensor],
    label: str,
    *,
    forward_grad: bool = True,
    modes: Sequence[str] = MODES,
) -> dict[str, Outcome]:
    """Milliseconds of fn(*inputs)'s forward, backward and both, keyed by mode (those of MODES
    in `modes`).

    The forward records the autograd graph, as in training (under no_grad if not forward_grad);
    the backward reuses one graph (retain_graph) and one random output gradient; gradients of
    the leaves are reset to None before each timed call.
    """
    leaves = [t for t in inputs if t.requires_grad]

    def forward():
        with torch.set_grad_enabled(forward_grad):
            return do_bench_ms(lambda: fn(*inputs), run.args.warmup_ms, run.args.rep_ms)

    def backward():
        outputs = as_tuple(fn(*inputs))
        grads = _grads_for(outputs)
        return do_bench_ms(
            lambda: torch.autograd.backward(outputs, grads, retain_graph=True),
            run.args.warmup_ms,
            run.args.rep_ms,
            grad_to_none=leaves,
        )

    def forward_backward():
        grads = _grads_for(as_tuple(fn(*inputs)))
        return do_bench_ms(
            lambda: torch.autograd.backward(as_tuple(fn(*inputs)), grads),
            run.args.warmup_ms,
            run.args.rep_ms,
            grad_to_none=leaves,
        )

    return {
        mode: run.measure(timer, f"{label} {mode}")
        for mode, timer in zip(MODES, (forward, backward, forward_backward))
        if mode in modes
    }


GRAPH_MODES = ("fwd", "fwd+bwd")  # a backward alone would run on its forward's stream, uncaptured


def time_modes_graph(
    run: Run,
    fn: Callable,
    inputs: Sequence[torch.Tensor],
    label: str,
    *,
    forward_grad: bool = True,
    modes: Sequence[str] = GRAPH_MODES,
) -> dict[str, Outcome]:
    """As time_modes, replayed from CUDA graphs (do_bench_graph_ms), for the modes of GRAPH_MODES
    in `modes`: the forward and forward+backward without launch overhead."""
    leaves = [t for t in inputs if t.requires_grad]

    def forward():
        with torch.set_grad_enabled(forward_grad):
            return do_bench_graph_ms(lambda: fn(*inputs), run.args.graph_rep_ms)

    def forward_backward():
        grads = _grads_for(as_tuple(fn(*inputs)))
        return do_bench_graph_ms(
            lambda: torch.autograd.backward(as_tuple(fn(*inputs)), grads),
            run.args.graph_rep_ms,
            grad_to_none=leaves,
        )

    timers = {"fwd": forward, "fwd+bwd": forward_backward}
    return {
        mode: run.measure(timers[mode], f"{label} {mode} (graph)")
        for mode in GRAPH_MODES
        if mode in modes
    }


def output_error(fn: Callable, reference_fn: Callable, inputs: Sequence[torch.Tensor]) -> float:
    """Largest relative error of fn's outputs against reference_fn's, on copies of the inputs
    (fn.error_reference replaces reference_fn for another layout)."""
    reference_fn = getattr(fn, "error_reference", reference_fn)

    def copies():  # requiring grad as the inputs do, so compiled code reuses its training graph
        return [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]

    outs = [o.detach().clone() for o in as_tuple(fn(*copies()))]
    refs = [r.detach() for r in as_tuple(reference_fn(*copies()))]
    return max(relative_error(o, r) for o, r in zip(outs, refs))


class Deadline:
    """A time budget: `expired()` once `seconds` have passed since creation (never if None)."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.start = time.monotonic()

    def expired(self) -> bool:
        return self.seconds is not None and time.monotonic() - self.start > self.seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start


class Run:
    """One benchmark run: its arguments, time budget, rows and notes, and where they go.

    Rows are added as they are measured and, with --out, appended to NAME.csv at once, so a run
    that is killed still leaves what it measured there. Derived columns (speed-ups: `add_ratios`)
    are filled in once the measuring is over; `finish()` then rewrites the CSV complete.
    """

    def __init__(
        self, name: str, args: argparse.Namespace, quick_time_limit: float, columns: Sequence[str]
    ):
        self.name = run_name(name, args)
        self.args = args
        self.columns = list(columns)
        limit = (
            args.time_limit
            if args.time_limit is not None
            else (quick_time_limit if args.quick or args.headline else None)
        )
        self.deadline = Deadline(limit)
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.failures: dict[tuple[str, str], list[str]] = {}  # (status, message) -> labels
        self.interrupted = False
        self.budget_spent = False
        self.extra: dict = {}  # more results for the JSON (train.py: graph breaks)
        self.env = environment()
        self.csv_path = None
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            self.csv_path = args.out / f"{self.name}.csv"
            write_csv(self.csv_path, [], self.columns)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def add(self, row: dict) -> None:
        """Keep a measured row, and append it to the CSV at once."""
        self.rows.append(row)
        if self.csv_path is not None:
            write_csv(self.csv_path, [row], self.columns, append=True)

    def measure(self, fn: Callable[[], object], label: str) -> Outcome:
        """fn's value unless the budget is spent; failures become status cells and notes."""
        if self.out_of_time():
            return Outcome(None, SKIPPED)
        outcome = guarded(fn)
        if outcome.status in (ERROR, UNSUPPORTED, NOT_AVAILABLE):
            self.failures.setdefault((outcome.status, outcome.message), []).append(label)
        return outcome

    def out_of_time(self) -> bool:
        """True once the time budget is spent (noted once): loops stop starting new cases."""
        if not self.deadline.expired():
            return False
        self.budget_spent = True
        self.note(
            f"{SKIPPED}: time budget of {self.deadline.seconds:.0f} s spent; "
            "the cases after the last row were not measured"
        )
        return True

    @contextlib.contextmanager
    def interruptible(self):
        """Measure in the with-block; Ctrl-C or SIGINT (gpu_check.sh's time limit sends it) ends
        the block early and leaves the rows measured so far for `finish()`."""
        # A process started with SIGINT ignored (a background job) would not see the limit's
        # SIGINT; Python keeps an inherited SIG_IGN, so ask for the KeyboardInterrupt explicitly.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            yield
        except KeyboardInterrupt:
            self.interrupted = True
            self.note(
                f"interrupted (SIGINT) after {self.deadline.elapsed():.0f} s: "
                "the measurements after the last row are missing"
            )

    def stopped(self) -> str | None:
        """Why the run ended before its last case, or None if it measured everything."""
        if self.interrupted:
            return "interrupted (SIGINT)"
        return "time budget spent" if self.budget_spent else None

    def failure_notes(self) -> list[str]:
        """One note per distinct failure message, naming the first case and the count."""
        return [
            f"{status} in {len(labels)} measurement(s), first {labels[0]}: {message}"
            for (status, message), labels in self.failures.items()
        ]

    def header(self) -> None:
        env = self.env
        print(
            f"# {self.name}: {env['gpu']}, torch {env['torch']}, triton {env['triton']}, "
            f"CUDA {env['cuda']}, commit {env['commit']}"
            + (" (+ uncommitted changes)" if env["uncommitted_changes"] else "")
        )
        print()

    def finish(
        self, *, group_by: Sequence[str] = (), plot: dict | None = None, summary: Iterable[str] = ()
    ) -> int:
        """Markdown table and notes on stdout; CSV, JSON, PNG and summary lines to --out.

        Rows with equal `group_by` fields are put together (groups in the order they were first
        measured). Returns the exit code: 130 if the run was interrupted, else 0.
        """
        if group_by:
            self.rows = grouped(self.rows, group_by)
        print(markdown_table(self.rows, self.columns))
        summary = list(summary)
        if summary:
            print("\n" + "\n".join(summary))
        self.notes += self.failure_notes()
        for text in self.notes:
            print(f"- {text}")
        print(f"\n({self.deadline.elapsed():.0f} s)")
        out = self.args.out
        if out is not None:
            write_csv(self.csv_path, self.rows, self.columns)
            (out / f"{self.name}.json").write_text(
                json.dumps(
                    {
                        "env": self.env,
                        "args": {k: str(v) for k, v in vars(self.args).items()},
                        "elapsed_s": round(self.deadline.elapsed(), 1),
                        "stopped": self.stopped(),
                        "rows": self.rows,
                        "notes": self.notes,
                        **self.extra,
                    },
                    indent=1,
                    default=str,
                )
            )
            (out / f"{self.name}_summary.md").write_text("\n".join(summary) + "\n")
            if plot is not None:
                message = plot_lines(out / f"{self.name}.png", self.rows, **plot)
                if message:
                    print(message)
            print(f"wrote {out}/{self.name}.{{csv,json,png}} and {self.name}_summary.md")
        return 130 if self.interrupted else 0


def ratio(numerator: Outcome | float | None, denominator: Outcome | float | None) -> float | None:
    """numerator / denominator when both are numbers (Outcomes unwrapped), else None."""
    a = numerator.value if isinstance(numerator, Outcome) else numerator
    b = denominator.value if isinstance(denominator, Outcome) else denominator
    return a / b if a is not None and b else None


def add_ratios(
    rows: Sequence[dict],
    column: str,
    baseline: str,
    *,
    key: Sequence[str],
    value: str,
    higher_is_better: bool = False,
) -> None:
    """Set each row's `column` to its `value` compared with the row of impl `baseline` with
    the same `key` fields: baseline / row (a speed-up when value is a time), or row / baseline
    with higher_is_better (tokens/s). None where either is not a number."""

    def number(row):
        return row.get(value) if isinstance(row.get(value), (int, float)) else None

    baselines = {tuple(r[k] for k in key): number(r) for r in rows if r["impl"] == baseline}
    for row in rows:
        base = baselines.get(tuple(row[k] for k in key))
        row[column] = ratio(number(row), base) if higher_is_better else ratio(base, number(row))


def grouped(rows: Sequence[dict], key: Sequence[str]) -> list[dict]:
    """rows with equal `key` fields together, groups in order of first appearance (stable)."""
    order: dict[tuple, int] = {}
    for row in rows:
        order.setdefault(tuple(row[k] for k in key), len(order))
    return sorted(rows, key=lambda row: order[tuple(row[k] for k in key)])


# --------------------------------------------------------------------------------------------
# Tables, files, plots
# --------------------------------------------------------------------------------------------


def format_value(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value == 0:
            return "0"
        magnitude = abs(value)
        if magnitude >= 100:
            return f"{value:.0f}"
        if magnitude >= 1:
            return f"{value:.2f}"
        if magnitude >= 1e-2:
            return f"{value:.3f}"
        return f"{value:.1e}"
    return str(value)


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(format_value(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def write_csv(
    path: Path, rows: Sequence[dict], columns: Sequence[str], *, append: bool = False
) -> None:
    """rows as CSV with a header line, or appended to the file without one."""
    with path.open("a" if append else "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        if not append:
            writer.writeheader()
        writer.writerows(rows)


def plot_lines(
    path: Path,
    rows: Sequence[dict],
    *,
    x: str,
    y: str,
    series: str,
    panel: Sequence[str],
    title: str,
    logx: bool = False,
    logy: bool = False,
) -> str:
    """One subplot per distinct `panel` value tuple, one line per `series` value, y against x.

    Rows whose y is not a number are left out. Returns a note when nothing was drawn.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed: no plot written to {path}"
    numeric = [r for r in rows if isinstance(r.get(y), (int, float))]
    if not numeric:
        return f"no measured values: no plot written to {path}"
    panels = list(dict.fromkeys(tuple(r[k] for k in panel) for r in numeric))
    cols = min(3, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, panels):
        in_panel = [r for r in numeric if tuple(r[k] for k in panel) == key]
        for name in dict.fromkeys(r[series] for r in in_panel):
            points = [(r[x], r[y]) for r in in_panel if r[series] == name]
            if logx:  # numeric x: a sweep measured most important first is drawn in order
                points.sort()
            ax.plot(
                [str(p[0]) if not logx else p[0] for p in points],
                [p[1] for p in points],
                marker="o",
                label=str(name),
            )
        ax.set_title(", ".join(f"{k}={v}" for k, v in zip(panel, key)), fontsize=9)
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ""


# --------------------------------------------------------------------------------------------
# Interpreter checks (no CUDA)
# --------------------------------------------------------------------------------------------


def report_checks(results: Sequence[tuple[str, str, float | None, float | None]]) -> int:
    """Print (name, status, error, bound) rows of a correctness check; return the exit code.

    status is 'ok' or 'FAIL...'; a FAIL makes the exit code 1.
    """
    rows = [
        {"check": name, "status": status, "relative error": err, "bound": bound}
        for name, status, err, bound in results
    ]
    print(markdown_table(rows, ["check", "status", "relative error", "bound"]))
    failed = [r["check"] for r in rows if r["status"].startswith("FAIL")]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    print("interpreter check passed")
    return 0


def compare_with_reference(
    name: str, fn: Callable, ref_fn: Callable, inputs: Sequence[torch.Tensor]
) -> list[tuple[str, str, float, float]]:
    """fn on float32 `inputs` against ref_fn on float64 copies: every output and every input's
    gradient (for random output gradients), with fastlm.testing's float32 bound.

    `inputs` are leaf tensors; those that require grad get their gradients compared. Returns
    rows for `report_checks`.
    """
    from fastlm.testing import TOLERANCE

    ref_inputs = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    outs, refs = as_tuple(fn(*inputs)), as_tuple(ref_fn(*ref_inputs))
    grads = [torch.randn_like(r) for r in refs]
    torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(grads, outs)])
    torch.autograd.backward(refs, grads)
    pairs = [(f"out{i}", o, r) for i, (o, r) in enumerate(zip(outs, refs))]
    pairs += [
        (f"grad{i}", t.grad, r.grad)
        for i, (t, r) in enumerate(zip(inputs, ref_inputs))
        if t.requires_grad
    ]
    bound = TOLERANCE[torch.float32]
    rows = []
    for label, out, ref in pairs:
        err = relative_error(out, ref)
        rows.append((f"{name} {label}", "ok" if err <= bound else "FAIL", err, bound))
    return rows


def try_check(name: str, check: Callable[[], list]) -> list[tuple]:
    """check()'s rows, or one FAIL row when it raises (an import error included)."""
    try:
        return check()
    except Exception as exc:  # noqa: BLE001 - a crash is a failed check, reported with the rest
        return [(name, f"FAIL ({type(exc).__name__}: {str(exc)[:160]})", None, None)]


def main() -> int:
    p = argparse.ArgumentParser(
        description="Print the benchmark environment (GPU, driver, "
        "versions, commit); with --out DIR also write "
        "DIR/env.json."
    )
    p.add_argument("--out", type=Path, default=None, metavar="DIR")
    p.add_argument(
        "--require",
        nargs="*",
        default=[],
        metavar="MODULE",
        help="record which of these modules cannot be imported (missing_modules)",
    )
    p.add_argument(
        "--need-cuda",
        action="store_true",
        help="exit 3 (after writing env.json) when torch sees no CUDA device",
    )
    args = p.parse_args()
    info = environment()
    info["missing_modules"] = " ".join(
        name for name in args.require if importlib.util.find_spec(name) is None
    )
    print(json.dumps(info, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "env.json").write_text(json.dumps(info, indent=1) + "\n")
    if args.need_cuda and not HAS_CUDA:
        print("no CUDA device: torch.cuda.is_available() is False", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
