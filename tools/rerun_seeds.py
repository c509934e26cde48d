"""Rerun chosen tests N times, each run with a fresh random seed, and count the failures.

For whoever changes a kernel or a tolerance: a bound must hold for any seed, not for the one
drawn today. Runs pytest once (in this process, one worker) with `--fresh-seeds N`
(tests/conftest.py), then prints, per test, the runs, the failures and the seeds that failed
(replay one with FASTLM_TEST_SEED=<seed>).

    python tools/rerun_seeds.py -n 100 tests/test_attention.py::test_large_scores_do_not_overflow

Exit status: 0 when every run passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class _Tally:
    """A pytest plugin that counts the call-phase outcomes per test, run index removed."""

    def __init__(self):
        self.runs = defaultdict(int)
        self.failed = defaultdict(list)
        self.xfailed = defaultdict(int)  # expected failures (pytest.mark.xfail): not counted failed

    def pytest_runtest_logreport(self, report):
        # One count per run: its call, or the set-up or tear-down that failed instead.
        if report.when != "call" and not report.failed:
            return
        test = re.sub(r"run\d+-?|-run\d+", "", report.nodeid).replace("[]", "")
        self.runs[test] += report.when in ("call", "setup")  # a failed set-up never calls
        self.xfailed[test] += hasattr(report, "wasxfail") and report.skipped
        if report.failed:
            self.failed[test].append(dict(report.user_properties).get("seed"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--runs", type=int, default=100, help="runs per test (100)")
    parser.add_argument("tests", nargs="+", help="pytest node ids or files")
    parser.add_argument("--pytest", nargs=argparse.REMAINDER, default=[], help="extra pytest args")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("-n must be at least 1")
    sys.path.insert(0, str(REPO))
    import pytest  # after argparse: --help needs neither torch nor triton

    tally = _Tally()
    pytest.main(
        [*args.tests, f"--fresh-seeds={args.runs}", "-q", "-p", "no:cacheprovider", *args.pytest],
        plugins=[tally],
    )
    print(f"\n{'test':<90} {'runs':>5} {'failed':>6} {'xfail':>5}  failing seeds")
    for test in sorted(tally.runs):
        seeds = ", ".join(str(s) for s in tally.failed[test][:10])
        counts = f"{tally.runs[test]:>5} {len(tally.failed[test]):>6} {tally.xfailed[test]:>5}"
        print(f"{test:<90} {counts}  {seeds}")
    total, failures = sum(tally.runs.values()), sum(map(len, tally.failed.values()))
    print(f"total: {total} runs, {failures} failed")
    return int(failures > 0 or total == 0)


if __name__ == "__main__":
    sys.exit(main())
