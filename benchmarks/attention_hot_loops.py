"""The hot loops of the attention kernels that multiply matrices, alone: the compile report's
second table (`hot_loop.py` reads the SASS) for causal attention, and configs that are not shipped
(`--config`) compiled to try one before shipping it:

    python benchmarks/attention_hot_loops.py [--op TEXT] [--arch sm_90a sm_80 sm_100a]
        [--dtype bf16 fp16 fp32] [--head-dim 64 128] [--config M,N,WARPS,STAGES ...] [--json PATH]

Like the compile report it compiles for CUDA targets and refuses to run with TRITON_INTERPRET=1.
Triton's on-disk cache makes a rerun with unchanged kernels fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compile_report as cr  # noqa: E402
from hot_loop import KERNEL_DOTS, MMA_RATE, table  # noqa: E402


def attention_tasks(
    ops: list[str], archs: list[str], dtypes: list[str], head_dims: list[int], configs: list[tuple]
):
    """compile_report's tasks of the attention kernels that multiply matrices (causal), the
    shipped configs, or `configs` (M, N, warps, stages) in their place."""
    specs = [(dtype, d, True, None) for dtype in dtypes for d in head_dims]
    cases = [case for case in cr.attention_cases(specs) if any(text in case.op for text in ops)]
    tasks = [t for t in cr.tasks(cases, archs) if t.kernel in KERNEL_DOTS]
    if not configs:
        return tasks
    chosen, seen = [], set()
    for task in tasks:
        key = (task.op, task.label, task.kernel, task.arch)
        if key in seen:
            continue
        seen.add(key)
        for m, n, warps, stages in configs:
            blocks = {"BLOCK_M": m, "BLOCK_N": n}
            chosen.append(
                cr.Task(
                    **{
                        **task.__dict__,
                        "blocks": blocks,
                        "default": False,
                        "fallback": False,
                        "constexprs": {**task.constexprs, **blocks},
                        "options": dict(num_warps=warps, num_stages=stages),
                    }
                )
            )
    return chosen


def _parse_config(text: str) -> tuple[int, int, int, int]:
    try:
        m, n, warps, stages = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--config wants M,N,WARPS,STAGES, got {text!r}") from None
    return m, n, warps, stages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", choices=list(MMA_RATE), default=list(MMA_RATE))
    parser.add_argument(
        "--op",
        action="append",
        metavar="TEXT",
        help="only attention ops whose name contains TEXT (repeatable; default: all)",
    )
    parser.add_argument("--dtype", nargs="+", choices=["bf16", "fp16", "fp32"], default=["bf16"])
    parser.add_argument("--head-dim", nargs="+", type=int, default=[64, 128])
    parser.add_argument(
        "--config",
        nargs="+",
        type=_parse_config,
        default=[],
        metavar="M,N,WARPS,STAGES",
        help="compile these configs instead of the shipped ones",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("unset TRITON_INTERPRET; this compiles for CUDA targets")
    tasks = attention_tasks(
        args.op or ["attention"], args.arch, args.dtype, args.head_dim, args.config
    )
    if not tasks:
        parser.error(f"no attention op matches {args.op}")
    rows = [cr.compile_task(task) for task in tasks]
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if any(row["problems"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
