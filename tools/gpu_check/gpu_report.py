"""gpu_check.sh's helper: the packing of what the steps measured, and the test suite.

    python tools/gpu_check/gpu_report.py publish STAGE OUT

writes STAGE/summary.md from what the steps left there so far, then OUT/summary.md and
OUT/results.tar.gz (the staging folder as one folder <date>-<gpu>), each replaced whole, so that
a call cut short at any moment returns every step finished by then. A file comes back from a
device machine only up to 16 MiB: a log over LOG_CAP_BYTES goes in cut to its first and last
lines, another file over it stays out, and while the archive is too large the plots, then the
logs, then the largest files stay out; summary.md says which.

    python tools/gpu_check/gpu_report.py pytest SECONDS [PYTEST ARGS...]

runs pytest, which starts no test after SECONDS (a SIGINT cannot stop the suite: the commands
under test catch Ctrl-C themselves, so one test fails and pytest runs on).

Standard library only (pytest is imported by its subcommand): it runs where torch does not.
"""

from __future__ import annotations

import argparse
import csv
import datetime
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
STEPS_FILE = "steps.tsv"  # name, planned limit, limit, seconds, exit code or '-', note
HEADLINE = {  # step (and file) name -> section title
    "train_headline": "Training step: fastlm compiled vs the reference compiled with SDPA",
    "attention_headline": "Attention, forward and forward+backward: fastlm vs SDPA flash, cuDNN",
    "kernels_headline": "Memory-bound kernels at 16k x 4096 (cross-entropy 16k x 32000)",
    "moe_headline": "MoE experts at Qwen3-30B-A3B's sizes: fastlm vs grouped_mm, Liger, SonicMoE",
}
SWEEPS = ("attention_sweep", "attention_varlen", "kernels_sweep", "train_hf", "train_sweep")
ENV_FIELDS = "gpu driver torch triton cuda cudnn python commit source liger_kernel flash_attn"


# --------------------------------------------------------------------------------------------
# Reading what the steps left
# --------------------------------------------------------------------------------------------


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def read_steps(stage: Path) -> list[dict]:
    """gpu_check.sh's steps.tsv, one dict a step."""
    keys = ("name", "planned", "limit", "seconds", "rc", "note")
    rows = csv.reader(io.StringIO(_read(stage / STEPS_FILE)), delimiter="\t")
    return [dict(zip(keys, [*fields, ""])) for fields in rows if len(fields) >= 5]


HARD_STOPS = {"124": "HIT ITS LIMIT: interrupted (SIGINT)", "137": "HIT ITS LIMIT: killed"}


def soft_stop(step: dict, stage: Path) -> str | None:
    """Why a step stopped itself early to keep its limit (its JSON's `stopped`, or the test
    log's interruption), or None."""
    stopped = _json(stage / f"{step['name']}.json").get("stopped")
    if stopped:
        return f"stopped early ({stopped}): later cases not measured"
    match = re.search(r"Interrupted: (time limit of \d+ s)", _read(stage / f"{step['name']}.log"))
    return f"stopped early ({match.group(1)}): later tests not run" if match else None


def step_status(step: dict, stage: Path) -> str:
    rc = step["rc"]
    if rc == "-":
        return f"not run: {step['note']}" if step["note"] else "not run"
    if step["name"] == "setup" and rc == "3":
        return "no CUDA device: nothing measured (exit 3)"
    status = HARD_STOPS.get(rc, "ok" if rc == "0" else f"exit {rc}")
    soft = soft_stop(step, stage)
    return f"{status}; {soft}" if soft else status


def suite_result(stage: Path) -> list[str]:
    """pytest's last summary line in tests.log, and its FAILED / ERROR lines (20 at most)."""
    log = _read(stage / "tests.log").splitlines()
    if not log:
        return ["no tests.log: the test step did not run"]
    words = r"^=+ .*\b(passed|failed|error|errors|skipped|no tests ran)\b.* =+$"
    summary = [line for line in log if re.match(words, line)]
    lines = [f"`{summary[-1].strip('= ')}`" if summary else "no pytest summary line: see tests.log"]
    failures = [line for line in log if line.startswith(("FAILED ", "ERROR "))]
    lines += [f"- {line[:200]}" for line in failures[:20]]
    return lines + ([f"- ... and {len(failures) - 20} more"] if len(failures) > 20 else [])


# --------------------------------------------------------------------------------------------
# summary.md
# --------------------------------------------------------------------------------------------


def _table(header, rows) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join("" if v is None else str(v) for v in r) + " |" for r in rows]


def _section(stage: Path, name: str, title: str, steps: dict) -> list[str]:
    """A benchmark step's summary table and files, or why there is none (and its log's end)."""
    files = [f"`{name}{ext}`" for ext in (".csv", ".json", ".png", ".log")]
    files = [f for f in files if (stage / f.strip("`")).exists()]
    lines = [f"### {title}", ""] + (["Files: " + ", ".join(files) + ".", ""] if files else [])
    summary = _read(stage / f"{name}_summary.md").strip()
    if summary:
        return lines + [summary, ""]
    why = step_status(steps[name], stage) if name in steps else "not run (yet)"
    tail = _read(stage / f"{name}.log").rstrip().splitlines()[-5:]
    tail = ["```", *(line[:200] for line in tail), "```"] if tail else []
    return lines + [f"No table (step: {why}).", *tail, ""]


def summarize(stage: Path, archive: str, left_out: list[str]) -> str:
    """summary.md for what the staging folder holds now."""
    env, steps = _json(stage / "env.json"), read_steps(stage)
    by_name = {step["name"]: step for step in steps}
    ran = [s for s in steps if s["rc"] != "-"]
    used = sum(float(s["seconds"]) for s in ran if s["seconds"].replace(".", "").isdigit())
    hit = [s["name"] for s in ran if s["rc"] in HARD_STOPS or soft_stop(s, stage)]
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
    fields = ENV_FIELDS.split()
    lines += _table(fields, [[env.get(k) for k in fields]]) if env else ["No env.json."]
    if env.get("missing_modules"):
        lines += ["", f"Missing Python modules: {env['missing_modules']}"]
    lines += ["", "## Headline", ""]
    for name, title in HEADLINE.items():
        lines += _section(stage, name, title, by_name)
    lines += ["## Test suite on CUDA (`tests.log`)", "", *suite_result(stage), "", "## Steps", ""]
    lines += _table(
        ["step", "limit s (planned)", "used s", "status"],
        [
            [s["name"], f"{s['limit']} ({s['planned']})", s["seconds"], step_status(s, stage)]
            for s in steps
        ],
    )
    lines += ["", "## Wider sweeps", ""]
    for name in SWEEPS:
        lines += _section(stage, name, name, by_name)
    files = sorted({p.name for p in stage.iterdir() if p.is_file()} | {"summary.md"})
    lines += ["## Files in results.tar.gz", "", ", ".join(f"`{f}`" for f in files)]
    if left_out:
        lines += ["", "Cut or left out for the 16 MiB limit:", *(f"- {n}" for n in left_out)]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------


def archive_name(stage: Path) -> str:
    """<date>-<gpu>, e.g. 2026-12-01-nvidia-h200: the folder under benchmarks/results/."""
    env = _json(stage / "env.json")
    date = env.get("date", datetime.date.today().isoformat())[:10]
    return f"{date}-" + re.sub(r"[^a-z0-9]+", "-", env.get("gpu", "unknown gpu").lower()).strip("-")


def _members(stage: Path, skip: set[str]) -> tuple[list[tuple[Path, bool]], list[str]]:
    """(path, cut?) of each file for the archive, and notes on what is cut or left out: logs
    over LOG_CAP_BYTES cut, other files over it and those in `skip` left out."""
    members, notes = [], []
    for path in sorted(p for p in stage.iterdir() if p.is_file()):
        size = path.stat().st_size
        if path.name in skip:
            notes.append(f"`{path.name}` ({size} bytes) left out: the archive was over 16 MiB")
        elif size <= LOG_CAP_BYTES or path.suffix == ".log":
            members.append((path, size > LOG_CAP_BYTES))
            if size > LOG_CAP_BYTES:
                notes.append(f"`{path.name}` cut from {size} bytes to its first and last lines")
        else:
            notes.append(f"`{path.name}` ({size} bytes) left out: over {LOG_CAP_BYTES} bytes")
    return members, notes


def _cut(data: bytes, cap: int) -> bytes:
    """The first quarter and the last three quarters of `cap` bytes, whole lines, a marker."""
    head = data[: cap // 4].rsplit(b"\n", 1)[0]
    tail = data[-(cap - cap // 4) :].split(b"\n", 1)[-1]
    marker = f"\n[... {len(data) - len(head) - len(tail)} bytes cut by gpu_report.py ...]\n"
    return head + marker.encode() + tail


def _write_archive(dest: Path, archive: str, members: list[tuple[Path, bool]]) -> None:
    with tarfile.open(dest, "w:gz") as tar:
        for path, cut in members:
            data = _cut(path.read_bytes(), LOG_CAP_BYTES) if cut else path.read_bytes()
            info = tarfile.TarInfo(f"{archive}/{path.name}")
            info.size, info.mtime, info.mode = len(data), int(path.stat().st_mtime), 0o644
            tar.addfile(info, io.BytesIO(data))


def publish(stage: Path, out: Path) -> list[str]:
    """STAGE/summary.md, OUT/summary.md and OUT/results.tar.gz from the staging folder (any other
    entry at OUT's top level is a ValueError). Returns the notes on files cut or left out."""
    stage, out = Path(stage), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.partial"):  # from a publish killed mid-write
        stale.unlink()
    unexpected = sorted(p.name for p in out.iterdir() if p.name not in OUTPUT_FILES)
    if unexpected:
        raise ValueError(f"OUT {out} holds {unexpected}: it may hold only {OUTPUT_FILES}")
    archive, partial = archive_name(stage), out / "results.tar.gz.partial"
    skip: set[str] = set()
    while True:
        summary = summarize(stage, archive, _members(stage, skip)[1])
        (stage / "summary.md").write_text(summary)
        members, notes = _members(stage, skip)
        _write_archive(partial, archive, members)
        others = [path for path, _ in members if path.name != "summary.md"]
        if partial.stat().st_size <= LIMIT_BYTES or not others:
            break
        # Plots go first (the CSVs redraw them), then logs, then the rest; the largest first.
        rank = {".png": 0, ".log": 1, ".xml": 1}
        skip.add(min(others, key=lambda p: (rank.get(p.suffix, 2), -p.stat().st_size)).name)
    os.replace(partial, out / "results.tar.gz")
    (out / "summary.md.partial").write_text(summary)
    os.replace(out / "summary.md.partial", out / "summary.md")
    return notes


# --------------------------------------------------------------------------------------------
# The test suite under a deadline
# --------------------------------------------------------------------------------------------


class StopAfter:
    """A pytest plugin: once `seconds` have passed, the test that just ended is the last one."""

    def __init__(self, seconds: float):
        self.seconds, self.end, self.session = seconds, time.monotonic() + seconds, None

    def pytest_sessionstart(self, session):
        self.session = session

    def pytest_runtest_logfinish(self, nodeid, location):
        if time.monotonic() > self.end and self.session is not None:
            self.session.shouldstop = (
                f"time limit of {self.seconds:.0f} s: the tests after {nodeid} did not run"
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pub = sub.add_parser("publish", help="write OUT/summary.md and OUT/results.tar.gz from STAGE")
    pub.add_argument("stage", type=Path)
    pub.add_argument("out", type=Path)
    tests = sub.add_parser("pytest", help="pytest that starts no test after SECONDS")
    tests.add_argument("seconds", type=float)
    tests.add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.command == "pytest":
        import pytest

        # A process started with SIGINT ignored would not see gpu_check.sh's hard limit otherwise.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return int(pytest.main(args.pytest_args, plugins=[StopAfter(args.seconds)]))
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
