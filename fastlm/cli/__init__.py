"""fastlm's commands: `fastlm-train` (`python -m fastlm.cli.train`) trains a model and writes
checkpoints, `fastlm-generate` (`python -m fastlm.cli.generate`) samples from one. From Python,
sampling is `fastlm.sample`; the commands build on `fastlm.config`, `fastlm.data` and
`fastlm.checkpoint`. Here: the CPU thread count the commands choose."""

import os


def cpu_threads(requested: int | None) -> tuple[int, str]:
    """(CPU threads, why) for a command on this machine: `choose_threads` with its cores and
    1-minute load average."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return choose_threads(requested, cores or 1, load)


def choose_threads(
    requested: int | None, cores: int, load: float, environ: dict | None = None
) -> tuple[int, str]:
    """(CPU threads, why): --threads, else OMP_NUM_THREADS, else the cores the load (the
    1-minute load average: runnable processes) leaves free, at least 1. On a machine other work
    keeps busy, more threads than free cores wait on each other: the tiny preset trained at 450
    tokens/s on 2 threads of a 2-core machine at load 8, 3,600 on 1."""
    environ = os.environ if environ is None else environ
    if requested is not None:
        return requested, "--threads"
    if environ.get("OMP_NUM_THREADS", "").isdigit() and int(environ["OMP_NUM_THREADS"]) > 0:
        return int(environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    free = max(1, min(cores, int(cores - load)))
    return free, f"the load {load:.1f} leaves {free} of {cores} cores free"
