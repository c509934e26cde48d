"""Put together what benchmarks/gpu_check.sh measured: summary.md and one results.tar.gz.

gpu_check.sh writes every step's files (CSV, JSON, PNG, logs) into a staging folder and, after
each step, runs

    python benchmarks/gpu_report.py publish STAGE OUT

which writes STAGE/summary.md from what is there so far, then OUT/summary.md and
OUT/results.tar.gz (the whole staging folder as one folder named <date>-<gpu>, ready to unpack
into benchmarks/results/). OUT's top level holds those two files and nothing else, each replaced
whole (written beside, then renamed), so a call cut short at any moment still returns every step
finished by then. The device machine returns files of at most 16 MiB: a log over LOG_CAP_BYTES
goes in cut to its first and last lines, another file over it stays out, and if the archive is
still too large the largest files stay out; summary.md lists what was cut or left out.

    python benchmarks/gpu_report.py fingerprint [REPO]

prints the source fingerprint that env.json records (a hash of the sources that ran), so that a
run on a machine that got the working tree without .git can be matched to a commit here.

    python benchmarks/gpu_report.py pytest SECONDS [PYTEST ARGS...]

runs pytest, which starts no new test after SECONDS and then reports as usual. A SIGINT is no
way to stop the suite on time: the code under test (python -m fastlm.train, fastlm.generate)
catches Ctrl-C itself, so one test fails with status 130 and pytest runs on.

Standard library only (pytest is imported by its subcommand alone): it runs even where torch
does not import.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import io
import json
import os
import re
import signal
import sys
import tarfile
import time
from pathlib import Path

OUTPUT_FILES = ("summary.md", "results.tar.gz")
LIMIT_BYTES = 16 * 2**20  # what the device machine returns of one file
LOG_CAP_BYTES = 4 * 2**20  # a longer log goes into the archive cut (head and tail)
STEPS_FILE = "steps.tsv"  # one line per step, written by gpu_check.sh (see read_steps)
HEADLINE = {  # step (and file) name -> section title
    "train_headline": "Training step: fastlm compiled vs the reference compiled with SDPA",
    "attention_headline": "Attention, forward and forward+backward: fastlm vs SDPA flash, cuDNN",
    "kernels_headline": "Memory-bound kernels at 16k x 4096 (cross-entropy 16k x 32000)",
}
SWEEPS = ("attention_sweep", "attention_varlen", "kernels_sweep", "train_sweep")
SOURCES = ("fastlm", "benchmarks", "tests", "pyproject.toml")
SOURCE_SUFFIXES = (".py", ".sh", ".toml")


# --------------------------------------------------------------------------------------------
# Source fingerprint
# --------------------------------------------------------------------------------------------


def source_fingerprint(repo: Path) -> str:
    """12 hex digits of SHA-256 over the path and bytes of every source file of fastlm, its
    benchmarks and tests (.py, .sh, .toml; caches and results excluded), in sorted order."""
    digest = hashlib.sha256()
    files = []
    for top in SOURCES:
        path = repo / top
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        files += [
            f
            for f in candidates
            if f.is_file()
            and f.suffix in SOURCE_SUFFIXES
            and "__pycache__" not in f.parts
            and "results" not in f.parts
        ]
    for f in sorted(files, key=lambda f: f.relative_to(repo).as_posix()):
        digest.update(f.relative_to(repo).as_posix().encode() + b"\0")
        digest.update(f.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


# --------------------------------------------------------------------------------------------
# Reading what the steps left
# --------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def read_steps(stage: Path) -> list[dict]:
    """gpu_check.sh's steps.tsv: name, planned limit, limit given, seconds used, exit code ('-'
    for a step not run) and a note, tab-separated, one step a line."""
    steps = []
    for fields in csv.reader(io.StringIO(_read_text(stage / STEPS_FILE)), delimiter="\t"):
        if len(fields) >= 5:
            name, planned, limit, seconds, rc = fields[:5]
            steps.append(
                {
                    "name": name,
                    "planned": planned,
                    "limit": limit,
                    "seconds": seconds,
                    "rc": rc,
                    "note": fields[5] if len(fields) > 5 else "",
                }
            )
    return steps


HARD_STOPS = {"124": "HIT ITS LIMIT: interrupted (SIGINT)", "137": "HIT ITS LIMIT: killed"}


def soft_stop(step: dict, stage: Path) -> str | None:
    """Why a step stopped itself early to keep its limit (a benchmark's JSON says so, or the test
    log shows StopAfter's interruption), or None if it did not."""
    stopped = (_read_json(stage / f"{step['name']}.json") or {}).get("stopped")
    if stopped:
        return f"stopped early ({stopped}): later cases not measured"
    log = _read_text(stage / f"{step['name']}.log")
    match = re.search(r"Interrupted: (time limit of \d+ s)", log)
    return f"stopped early ({match.group(1)}): later tests not run" if match else None


def step_status(step: dict, stage: Path) -> str:
    """In words: ok, hit its limit, failed or not run, and an early stop to keep the limit."""
    rc = step["rc"]
    if rc == "-":
        return f"not run: {step['note']}" if step["note"] else "not run"
    if step["name"] == "setup" and rc == "3":
        return "no CUDA device: nothing measured (exit 3)"
    soft = soft_stop(step, stage)
    status = HARD_STOPS.get(rc, "ok" if rc == "0" else f"exit {rc}")
    return f"{status}; {soft}" if soft else status


def hit_limit(step: dict, stage: Path) -> bool:
    return step["rc"] in HARD_STOPS or (step["rc"] != "-" and soft_stop(step, stage) is not None)


def suite_result(stage: Path) -> list[str]:
    """pytest's last summary line in tests.log, and its FAILED / ERROR lines (20 at most)."""
    log = _read_text(stage / "tests.log").splitlines()
    if not log:
        return ["no tests.log: the test step did not run"]
    summary = [
        line
        for line in log
        if re.match(
            r"^=+ .*\b(passed|failed|error|errors|skipped|"
            r"no tests ran)\b.* =+$",
            line,
        )
    ]
    lines = [
        f"`{summary[-1].strip('= ')}`"
        if summary
        else "no pytest summary line (cut by the limit?): see tests.log"
    ]
    failures = [line for line in log if line.startswith(("FAILED ", "ERROR "))]
    lines += [f"- {line[:200]}" for line in failures[:20]]
    if len(failures) > 20:
        lines.append(f"- ... and {len(failures) - 20} more (tests.log)")
    return lines


# --------------------------------------------------------------------------------------------
# summary.md
# --------------------------------------------------------------------------------------------

ENV_FIELDS = (
    "gpu",
    "driver",
    "torch",
    "triton",
    "cuda",
    "cudnn",
    "python",
    "commit",
    "source",
    "liger_kernel",
    "flash_attn",
)


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join("" if v is None else str(v) for v in row) + " |" for row in rows
    ]


def _log_tail(stage: Path, name: str, lines: int = 5) -> list[str]:
    tail = _read_text(stage / f"{name}.log").rstrip().splitlines()[-lines:]
    return ["```", *(line[:200] for line in tail), "```"] if tail else []


def _benchmark_section(stage: Path, name: str, title: str, steps: dict[str, dict]) -> list[str]:
    """A benchmark step's summary table and its files, or why there is none."""
    files = [
        f"`{f}`"
        for f in (name + ext for ext in (".csv", ".json", ".png", ".log"))
        if (stage / f).exists()
    ]
    lines = [f"### {title}", ""] + (["Files: " + ", ".join(files) + ".", ""] if files else [])
    summary = _read_text(stage / f"{name}_summary.md").strip()
    if summary:
        return lines + summary.splitlines() + [""]
    why = step_status(steps[name], stage) if name in steps else "not run (yet)"
    tail = _log_tail(stage, name)
    return lines + [
        f"No table (step: {why})." + (f" The end of `{name}.log`:" if tail else ""),
        *tail,
        "",
    ]


def _graph_breaks(stage: Path) -> list[str]:
    lines = []
    for name in ("train_headline", "train_sweep"):
        counted = (_read_json(stage / f"{name}.json") or {}).get("graph_breaks", {})
        for label, c in counted.items():
            reasons = "; ".join(
                f"{n}x {reason.splitlines()[0][:160]}" for reason, n in c.get("reasons", {}).items()
            )
            lines.append(
                f"- {label}: {c.get('graph_breaks')} graph break(s), {c.get('graphs')} "
                f"graph(s) (`{name}.json`){': ' + reasons if reasons else ''}"
            )
    return lines or ["- not measured (no compiled row in train_headline.json)"]


def _describe(name: str) -> str:
    stem, suffix = os.path.splitext(name)
    if name == "env.json":
        return "environment: GPU, driver, versions, commit, source fingerprint, missing packages"
    if name == "nvidia-smi.log":
        return "nvidia-smi's report at the start"
    if name == "compile_report.json":
        return "compile_report.py's report for sm_90a"
    if name == STEPS_FILE:
        return "each step: planned limit, limit given, seconds used, exit code"
    if name == "summary.md":
        return "this summary"
    if stem.endswith("_summary"):
        return f"the summary table of {stem[:-8]}"
    return {
        ".csv": f"every row of {stem} (also written row by row while measuring)",
        ".json": f"rows, notes and environment of {stem}",
        ".png": f"plot of {stem}",
        ".log": f"output of the {stem} step",
        ".xml": f"JUnit XML of the {stem} step",
    }.get(suffix, "")


def summarize(stage: Path, archive: str, left_out: list[str]) -> str:
    """summary.md for what the staging folder holds now."""
    env = _read_json(stage / "env.json") or {}
    steps = read_steps(stage)
    by_name = {step["name"]: step for step in steps}
    ran = [s for s in steps if s["rc"] != "-"]
    used = sum(float(s["seconds"]) for s in ran if s["seconds"].replace(".", "").isdigit())
    hit = [s["name"] for s in steps if hit_limit(s, stage)]
    lines = [
        f"# fastlm GPU check: {env.get('gpu', 'unknown GPU')}, {env.get('date', 'no date')}",
        "",
        f"Steps run: {len(ran)} of {len(steps)}, {used:.0f} s in all. "
        + (f"Steps that hit their limits: {', '.join(hit)}." if hit else "No step hit its limit."),
        f"Everything below is in `results.tar.gz` (folder `{archive}/`).",
        "",
        "## Environment",
        "",
    ]
    if env:
        lines += _table(list(ENV_FIELDS), [[env.get(k) for k in ENV_FIELDS]])
    else:
        lines += ["No env.json: the setup step did not finish (see `setup.log`)."]
    if env.get("missing_modules"):
        lines += ["", f"Missing Python modules: {env['missing_modules']}"]
    lines += ["", "## Headline", ""]
    for name, title in HEADLINE.items():
        lines += _benchmark_section(stage, name, title, by_name)
    lines += [
        "## Graph breaks (torch.compile's dynamo counters)",
        "",
        *_graph_breaks(stage),
        "",
        "## Test suite on CUDA (`tests.log`)",
        "",
        *suite_result(stage),
        "",
        "## Steps",
        "",
    ]
    lines += _table(
        ["step", "limit s (planned)", "used s", "status", "log"],
        [
            [
                s["name"],
                f"{s['limit']} ({s['planned']})",
                s["seconds"],
                step_status(s, stage),
                f"`{s['name']}.log`" if s["rc"] != "-" else "",
            ]
            for s in steps
        ],
    )
    lines += ["", "## Wider sweeps", ""]
    for name in SWEEPS:
        lines += _benchmark_section(stage, name, name, by_name)
    files = sorted({p.name for p in stage.iterdir() if p.is_file()} | {"summary.md"})
    lines += ["## Files in results.tar.gz", ""]
    lines += _table(["file", "what"], [[f"`{f}`", _describe(f)] for f in files])
    if left_out:
        lines += ["", "Cut or left out for the 16 MiB limit:", *(f"- {n}" for n in left_out)]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------


def archive_name(stage: Path) -> str:
    """<date>-<gpu>, e.g. 2026-12-01-nvidia-h200: the folder under benchmarks/results/."""
    env = _read_json(stage / "env.json") or {}
    date = env.get("date", datetime.date.today().isoformat())[:10]
    gpu = re.sub(r"[^a-z0-9]+", "-", env.get("gpu", "unknown gpu").lower()).strip("-")
    return f"{date}-{gpu}"


def _cut(data: bytes, cap: int) -> bytes:
    """The first quarter and the last three quarters of `cap` bytes, whole lines, with a marker."""
    head = data[: cap // 4].rsplit(b"\n", 1)[0]
    tail = data[-(cap - cap // 4) :].split(b"\n", 1)[-1]
    marker = f"\n[... {len(data) - len(head) - len(tail)} bytes cut by gpu_report.py ...]\n"
    return head + marker.encode() + tail


def _members(stage: Path, skip: set[str]) -> tuple[list[tuple[Path, bool]], list[str]]:
    """The staging folder's files as (path, cut?) for the archive, and notes on what is cut or
    left out: logs over LOG_CAP_BYTES are cut, other files over it and those in `skip` left out."""
    members, notes = [], []
    for path in sorted(p for p in stage.iterdir() if p.is_file()):
        size = path.stat().st_size
        if path.name in skip:
            notes.append(f"`{path.name}` ({size} bytes) left out: the archive was over 16 MiB")
        elif size <= LOG_CAP_BYTES:
            members.append((path, False))
        elif path.suffix == ".log":
            members.append((path, True))
            notes.append(f"`{path.name}` cut from {size} bytes to its first and last lines")
        else:
            notes.append(f"`{path.name}` ({size} bytes) left out: over {LOG_CAP_BYTES} bytes")
    return members, notes


def _expendable(path: Path) -> tuple[int, int]:
    """Sorts first what an archive over the limit should lose first: plots (the CSVs redraw
    them), then logs, then the rest; the largest first within each."""
    rank = {".png": 0, ".log": 1, ".xml": 1}.get(path.suffix, 2)
    return rank, -min(path.stat().st_size, LOG_CAP_BYTES)


def _write_archive(dest: Path, archive: str, members: list[tuple[Path, bool]]) -> None:
    with tarfile.open(dest, "w:gz") as tar:
        for path, cut in members:
            data = path.read_bytes()
            if cut:
                data = _cut(data, LOG_CAP_BYTES)
            info = tarfile.TarInfo(f"{archive}/{path.name}")
            info.size, info.mtime, info.mode = len(data), int(path.stat().st_mtime), 0o644
            tar.addfile(info, io.BytesIO(data))


def _replace(path: Path, write) -> None:
    """write(partial) then rename it over path: path is always whole."""
    partial = path.with_name(path.name + ".partial")
    write(partial)
    os.replace(partial, path)


def publish(stage: Path, out: Path) -> list[str]:
    """STAGE/summary.md, OUT/summary.md and OUT/results.tar.gz from the staging folder; any
    other entry at OUT's top level is an error (gpu_check.sh checks OUT before it starts).
    Returns the notes on files cut or left out."""
    stage, out = Path(stage), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.partial"):  # from a publish killed mid-write
        stale.unlink()
    unexpected = sorted(p.name for p in out.iterdir() if p.name not in OUTPUT_FILES)
    if unexpected:
        raise ValueError(f"OUT {out} holds {unexpected}: it may hold only {OUTPUT_FILES}")
    archive = archive_name(stage)
    tarball = out / "results.tar.gz"
    partial = tarball.with_name(tarball.name + ".partial")
    skip: set[str] = set()
    while True:
        summary = summarize(stage, archive, _members(stage, skip)[1])
        (stage / "summary.md").write_text(summary)
        members, notes = _members(stage, skip)
        _write_archive(partial, archive, members)
        others = [path for path, _ in members if path.name != "summary.md"]
        if partial.stat().st_size <= LIMIT_BYTES or not others:
            break
        skip.add(min(others, key=_expendable).name)  # then try again
    os.replace(partial, tarball)
    _replace(out / "summary.md", lambda path: path.write_text(summary))
    return notes


# --------------------------------------------------------------------------------------------
# The test suite under a deadline
# --------------------------------------------------------------------------------------------


class StopAfter:
    """A pytest plugin: once `seconds` have passed, the test that just ended is the last one."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds
        self.session = None

    def pytest_sessionstart(self, session):
        self.session = session

    def pytest_runtest_logfinish(self, nodeid, location):
        if time.monotonic() > self.end and self.session is not None:
            self.session.shouldstop = (
                f"time limit of {self.seconds:.0f} s: the tests after {nodeid} did not run"
            )


def run_pytest(seconds: float, args: list[str]) -> int:
    import pytest

    # A process started with SIGINT ignored would not see gpu_check.sh's hard limit otherwise.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return int(pytest.main(args, plugins=[StopAfter(seconds)]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pub = sub.add_parser("publish", help="write OUT/summary.md and OUT/results.tar.gz from STAGE")
    pub.add_argument("stage", type=Path)
    pub.add_argument("out", type=Path)
    fp = sub.add_parser("fingerprint", help="print the source fingerprint of a checkout")
    fp.add_argument("repo", type=Path, nargs="?", default=Path(__file__).resolve().parent.parent)
    tests = sub.add_parser("pytest", help="pytest that starts no test after SECONDS")
    tests.add_argument("seconds", type=float)
    tests.add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.command == "pytest":
        return run_pytest(args.seconds, args.pytest_args)
    if args.command == "fingerprint":
        print(source_fingerprint(args.repo))
        return 0
    if not args.stage.is_dir():
        print(f"gpu_report.py: STAGE {args.stage} is not a folder", file=sys.stderr)
        return 2
    try:
        notes = publish(args.stage, args.out)
    except ValueError as exc:
        print(f"gpu_report.py: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"gpu_report.py: {note}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
