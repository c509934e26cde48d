"""tools/gpu_check/gpu_check.sh without a GPU: its syntax, its plan, its packing and its flow.

The flow test runs the real script with PYTHON pointing at a stand-in for the GPU programs (each
benchmark writes a small table, one sleeps past its limit), with every limit scaled down, and
checks what a device machine would send back: OUT/summary.md and OUT/results.tar.gz alone.
"""

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tools" / "gpu_check" / "gpu_check.sh"
BUDGET_S = 540  # 9 minutes: the device call's limit is 10, and timeout_s 570 leaves the rest

sys.path.insert(0, str(REPO / "tools" / "gpu_check"))
import gpu_report  # noqa: E402


def run_script(*args, env=None, timeout=120):
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


def plan_rows(text: str) -> dict[str, int]:
    """The dry run's plan table: step name -> limit in seconds."""
    return {
        m.group(1): int(m.group(2))
        for m in re.finditer(r"^\| (\w+) \| (\d+) \| (fixed|elastic) \|", text, re.M)
    }


def test_bash_syntax():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_dry_run_plan_fits_the_budget():
    result = run_script("--dry-run")
    assert result.returncode == 0, result.stderr
    limits = plan_rows(result.stdout)
    assert list(limits)[:4] == [
        "setup",
        "train_headline",
        "attention_headline",
        "kernels_headline",
    ], "the headline measurements come first"
    assert list(limits).index("tests") < list(limits).index("attention_sweep")
    total = sum(limits.values())
    assert total <= BUDGET_S
    assert f"total of limits: {total} s" in result.stdout
    assert "OUT/summary.md and OUT/results.tar.gz, nothing else" in result.stdout
    assert "device machine: bash tools/gpu_check/gpu_check.sh $OUT, timeout_s 570" in result.stdout


def test_limits_over_the_budget_are_refused():
    result = run_script("--dry-run", env={"LIMIT_tests": "1000"})
    assert result.returncode == 2
    assert "over the budget" in result.stderr


def test_bad_arguments():
    assert run_script().returncode == 2
    assert run_script("--bogus").returncode == 2


def test_out_must_hold_nothing_else(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    result = run_script(str(tmp_path))
    assert result.returncode == 2
    assert "notes.txt" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# --------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------


def stage_folder(path: Path) -> Path:
    path.mkdir()
    (path / "env.json").write_text(
        json.dumps(
            {
                "gpu": "NVIDIA H200",
                "date": "2026-12-01T10:00:00",
                "torch": "2.11.0",
                "commit": "abc1234",
            }
        )
    )
    (path / "steps.tsv").write_text(
        "train_headline\t140\t140\t33\t0\t\n"
        "tests\t110\t110\t110\t124\t\n"
        "compile_report\t20\t0\t0\t-\tnot in this tree\n"
    )
    (path / "train_headline.csv").write_text("seq,impl,tokens/s\n1024,fastlm,123\n")
    (path / "train_headline.json").write_text(json.dumps({"stopped": None}))
    (path / "train_headline_summary.md").write_text("| a | b |\n|---|---|\n| 1 | 2 |\n")
    (path / "train_headline.png").write_bytes(os.urandom(1000))
    (path / "tests.log").write_text(
        "tests/test_x.py::test_a FAILED\nFAILED tests/test_x.py::"
        "test_a - boom\n===== 1 failed, 5 passed in 9.0s =====\n"
    )
    return path


def members(tarball: Path) -> list[str]:
    with tarfile.open(tarball) as tar:
        return sorted(tar.getnames())


def test_publish_writes_exactly_two_files(tmp_path):
    stage = stage_folder(tmp_path / "stage")
    out = tmp_path / "out"
    gpu_report.publish(stage, out)
    assert sorted(p.name for p in out.iterdir()) == ["results.tar.gz", "summary.md"]
    names = members(out / "results.tar.gz")
    folder = "2026-12-01-nvidia-h200"
    assert names == sorted(f"{folder}/{p.name}" for p in stage.iterdir())
    assert f"{folder}/summary.md" in names and f"{folder}/train_headline.png" in names
    with tarfile.open(out / "results.tar.gz") as tar:
        packed = tar.extractfile(f"{folder}/train_headline.csv").read().decode()
    assert packed == (stage / "train_headline.csv").read_text()

    summary = (out / "summary.md").read_text()
    assert summary == (stage / "summary.md").read_text()
    assert "NVIDIA H200" in summary and "abc1234" in summary
    assert "| 1 | 2 |" in summary  # the headline table
    assert "`1 failed, 5 passed in 9.0s`" in summary and "- FAILED tests/test_x.py" in summary
    assert "Steps that hit their limits: tests." in summary
    assert "not run: not in this tree" in summary
    assert "`train_headline.csv`" in summary  # each file is listed

    # Published again after more steps: still two files, the archive replaced whole.
    (stage / "kernels_headline.csv").write_text("op\nrms_norm\n")
    gpu_report.publish(stage, out)
    assert sorted(p.name for p in out.iterdir()) == ["results.tar.gz", "summary.md"]
    assert f"{folder}/kernels_headline.csv" in members(out / "results.tar.gz")


def test_publish_keeps_the_device_limit(tmp_path, monkeypatch):
    """A long log goes in cut, a large other file stays out, and the archive fits the limit."""
    monkeypatch.setattr(gpu_report, "LOG_CAP_BYTES", 4000)
    monkeypatch.setattr(gpu_report, "LIMIT_BYTES", 60_000)
    stage = stage_folder(tmp_path / "stage")
    lines = "".join(f"line {i} {os.urandom(8).hex()}\n" for i in range(2000))
    (stage / "kernels_headline.log").write_text(lines)
    (stage / "big.png").write_bytes(os.urandom(5000))
    for i in range(20):  # incompressible files under the cap that together pass the limit
        (stage / f"plot{i:02}.png").write_bytes(os.urandom(3000 + 40 * i))
    out = tmp_path / "out"
    notes = gpu_report.publish(stage, out)
    assert (out / "results.tar.gz").stat().st_size <= 60_000
    names = members(out / "results.tar.gz")
    folder = "2026-12-01-nvidia-h200"
    assert f"{folder}/big.png" not in names
    with tarfile.open(out / "results.tar.gz") as tar:
        log = tar.extractfile(f"{folder}/kernels_headline.log").read().decode()
    assert log.startswith("line 0 ") and log.endswith(lines.splitlines()[-1] + "\n")
    assert "bytes cut by gpu_report.py" in log and len(log) < 4200
    summary = (out / "summary.md").read_text()
    assert "`big.png` (5000 bytes) left out" in summary
    assert "`kernels_headline.log` cut" in summary
    left_out = [n for n in notes if "archive was over 16 MiB" in n]
    assert left_out and all(f"{folder}/{n.split('`')[1]}" not in names for n in left_out)
    assert f"{folder}/summary.md" in names


def test_publish_refuses_other_files_in_out(tmp_path):
    stage = stage_folder(tmp_path / "stage")
    out = tmp_path / "out"
    out.mkdir()
    (out / "other.txt").write_text("x")
    with pytest.raises(ValueError, match="other.txt"):
        gpu_report.publish(stage, out)


# --------------------------------------------------------------------------------------------
# The whole flow, with a stand-in for the GPU programs
# --------------------------------------------------------------------------------------------

STAND_IN = r"""#!/usr/bin/env bash
# Stands in for python3 on a GPU machine: the benchmarks write small tables, kernels --headline
# sleeps past its limit, pytest reports; gpu_report.py's packing is the real one.
real=__PYTHON__
case "$1 ${2:-}" in
"tools/gpu_check/gpu_report.py publish"*) exec "$real" "$@" ;;
"tools/gpu_check/gpu_report.py pytest") echo "===== 7 passed in 0.50s ====="; exit 0 ;;
"benchmarks/compile_report.py"*) exit 0 ;;
"benchmarks/_common.py env")
    printf '{"gpu": "Fake GPU 9000", "date": "2026-01-02T03:04:05", "commit": "f00d"}' \
        >"$STAGE/env.json"; exit 0 ;;
esac
script=$(basename "$1" .py)
out=$(echo "$@" | sed -E 's/.*--out ([^ ]+).*/\1/')
case "$*" in
*--headline*) name=${script}_headline ;;
*--varlen*) name=${script}_varlen ;;
*--hf*) name=${script}_hf ;;
*) name=${script}_sweep ;;
esac
[ "$name" = kernels_headline ] && { echo "measuring..."; exec sleep 60; }
echo "impl,ms" >"$out/$name.csv"
echo "{\"stopped\": null}" >"$out/$name.json"
printf '| fake %s table |\n' "$name" >"$out/${name}_summary.md"
echo "$name measured"
"""


def test_flow_returns_two_files_and_reports_the_limit(tmp_path):
    python = tmp_path / "python"
    python.write_text(STAND_IN.replace("__PYTHON__", sys.executable))
    python.chmod(0o755)
    steps = plan_rows(run_script("--dry-run").stdout)
    # Only the sleeping step is cut short; every other step has far more time than it needs even
    # on a loaded machine (with small limits for all, a slow start could cut or skip another step).
    limits = {f"LIMIT_{name}": "3" if name == "kernels_headline" else "60" for name in steps}
    out = tmp_path / "out"
    (tmp_path / "wheels").mkdir()
    env = {
        "PYTHON": str(python),
        "WHEELS": str(tmp_path / "wheels"),
        "KILL_AFTER": "1",
        "MARGIN": "0",
        "MIN_STEP": "1",
        "BUDGET": str(sum(int(limit) for limit in limits.values())),
        **limits,
    }
    result = run_script(str(out), env=env)
    assert result.returncode == 1, result.stdout + result.stderr  # a step hit its limit
    assert sorted(p.name for p in out.iterdir()) == ["results.tar.gz", "summary.md"]

    folder = "2026-01-02-fake-gpu-9000"
    names = members(out / "results.tar.gz")
    for name in (
        "train_headline",
        "attention_headline",
        "moe_headline",
        "attention_sweep",
        "attention_varlen",
        "kernels_sweep",
        "train_hf",
        "train_sweep",
    ):
        assert f"{folder}/{name}.csv" in names and f"{folder}/{name}.log" in names
    assert f"{folder}/kernels_headline.log" in names and f"{folder}/steps.tsv" in names
    summary = (out / "summary.md").read_text()
    assert "Fake GPU 9000" in summary and "f00d" in summary
    assert "| fake train_headline table |" in summary
    assert "| fake moe_headline table |" in summary.split("## Test suite")[0]  # in the headline
    assert "Steps that hit their limits: kernels_headline." in summary
    # SIGINT ends the sleeping stand-in, unless this test runs with SIGINT ignored: then SIGKILL.
    assert re.search(
        r"\| kernels_headline \| 3 \(3\) \| \d+ \| HIT ITS LIMIT: "
        r"(interrupted \(SIGINT\)|killed) \|",
        summary,
    )
    assert "measuring..." in summary  # the end of the cut step's log
    assert "`7 passed in 0.50s`" in summary
    with tarfile.open(out / "results.tar.gz") as tar:
        steps_tsv = tar.extractfile(f"{folder}/steps.tsv").read().decode()
    assert [line.split("\t")[0] for line in steps_tsv.splitlines()] == [
        name for name in steps if name != "pack"
    ]  # every step, in the plan's order
