"""fastlm's commands: `fastlm-train` (`python -m fastlm.cli.train`) trains a model and writes
checkpoints, `fastlm-generate` (`python -m fastlm.cli.generate`) samples from one. From Python,
sampling is `fastlm.sample`; the commands build on `fastlm.config`, `fastlm.data` and
`fastlm.checkpoint`. Here: the CPU thread count the commands choose."""

import os

#: The FLOPs of a step (one call of the model the command repeats: a training micro-batch's
#: forward and backward, 6 per weight and token; a decoding step's forward of one token, 2 per
#: weight) from which a second CPU thread pays; each further thread wants as much again. Measured
#: on a 2-core machine with the benchmark's process group at nice -20 (the machine's other jobs
#: yielding), best of 3 one-second runs of 1 and of 2 threads, fastlm.Transformer with AdamW:
#: 2 threads against 1 gave 0.74-0.97x at 1.8 MFLOP to 1.41 GFLOP a step (decoding the tiny
#: preset and models to 85M weights; training the tiny preset at batch 1 and 2 x 128 tokens),
#: 1.16-1.31x at 2.7-2.8 GFLOP (tiny at batch 4, a 3.5M-weight model at batch 1) and 1.61x at
#: 11.3 GFLOP (tiny at its batch of 16): the crossover lies between 1.41 and 2.7 GFLOP.
THREAD_CROSSOVER_FLOPS = 2e9


def cpu_threads(requested: int | None, work: float | None = None) -> tuple[int, str]:
    """(CPU threads, why) for a command on this machine: `choose_threads` with its cores, its
    1-minute load average and `work`, the FLOPs of the step the command repeats."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return choose_threads(requested, cores or 1, load, work=work)


def choose_threads(
    requested: int | None,
    cores: int,
    load: float,
    environ: dict | None = None,
    *,
    work: float | None = None,
) -> tuple[int, str]:
    """(CPU threads, why): --threads, else OMP_NUM_THREADS, else the cores the load (the
    1-minute load average: runnable processes) leaves free, at least 1, and no more than the
    step's `work` (FLOPs; None: not known) pays for: 1, and one more for each
    THREAD_CROSSOVER_FLOPS. On a machine other work keeps busy, more threads than free cores wait
    on each other: the tiny preset trained at 450 tokens/s on 2 threads of a 2-core machine at
    load 8, 3,600 on 1. On free cores a small step (any decoding step of a small model) loses to
    its threads' hand-offs more than it gains from splitting the work."""
    environ = os.environ if environ is None else environ
    if requested is not None:
        return requested, "--threads"
    if environ.get("OMP_NUM_THREADS", "").isdigit() and int(environ["OMP_NUM_THREADS"]) > 0:
        return int(environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    free = max(1, min(cores, int(cores - load)))
    why = f"the load {load:.1f} leaves {free} of {cores} cores free"
    if work is None:
        return free, why
    pays = 1 + int(work // THREAD_CROSSOVER_FLOPS)
    if pays >= free:
        return free, why
    size = f"{work / 1e9:.3g} GFLOP" if work >= 1e9 else f"{work / 1e6:.3g} MFLOP"
    return pays, f"{why}; a step of {size} pays for {pays}"
