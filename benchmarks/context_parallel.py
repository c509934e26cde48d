"""Context-parallel attention on several GPUs: tokens per second and peak memory per rank against
the sequence length (`fastlm.distributed.context_parallel_attention`, forward + backward).

    torchrun --nproc_per_node=8 benchmarks/context_parallel.py --seq-lens 32768 65536 131072
    python benchmarks/context_parallel.py --simulate 8      # one GPU: each rank's kernel work

Under torchrun every rank holds N / P tokens of one sequence (bf16, Llama-3-8B's attention by
default: 32 query heads, 8 key/value heads, head dim 128); rank 0 prints one row per length:
milliseconds per forward + backward (the slowest rank's median), tokens per second of the group,
the largest peak of allocated memory over the ranks, and docs/distributed.md's memory model for
the busiest rank (the attention's saved activations and the exchange's buffers, per layer).

What one GPU can check meanwhile (`--simulate P`, no torchrun): the kernel calls each of the P
ranks makes (its two query chunks against their key ranges, forward + backward), timed one rank
after another, against single-GPU attention over the whole sequence: how even the causal work
is over the ranks and what cutting it into chunks costs, without the exchange.

Without CUDA it says so and exits 0. Results go to stdout as a markdown table (and --json).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a bare checkout

import torch.distributed as dist  # noqa: E402


def time_ms(fn, warmup: int = 3, repeats: int = 10) -> float:
    """Median milliseconds of fn() on the current CUDA stream."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def inputs(N: int, args) -> list[torch.Tensor]:
    """q, k, v (requiring grad) and dO of one sequence of N tokens (B = 1), bf16, on the GPU."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    heads = (args.heads, args.kv_heads, args.kv_heads, args.heads)
    shapes = [(1, h, N, args.head_dim) for h in heads]
    return [
        torch.randn(shape, generator=generator, device="cuda", dtype=torch.bfloat16)
        for shape in shapes
    ]


def forward_backward(attention, q, k, v, do, **options) -> None:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    torch.autograd.grad(attention(q, k, v, **options), (q, k, v), do)


def model_bytes(N: int, P: int, args, window: int) -> tuple[int, int]:
    """(saved activations, forward + backward exchange buffers) of the busiest rank, per layer."""
    from fastlm.distributed import ExchangePlan

    T, e = N // P, 2
    saved = T * (args.heads + 2 * args.kv_heads) * args.head_dim * e
    saved += T * args.heads * (args.head_dim * e + 4)
    plans = [ExchangePlan.build(N, P, r, True, window) for r in range(P)] if P > 1 else []
    costs = [p.exchange_bytes(1, args.kv_heads, args.head_dim, e) for p in plans]
    exchange = max((c["forward_buffers"] + c["backward_buffers"] for c in costs), default=0)
    return saved, exchange


def distributed(args) -> list[dict]:
    from fastlm.distributed import context_parallel_attention, shard_sequence

    rank, P = dist.get_rank(), dist.get_world_size()
    rows = []
    for N in args.seq_lens:
        local = [shard_sequence(t, rank, P, dim=2) for t in inputs(N, args)]
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        step = functools.partial(
            forward_backward, context_parallel_attention, *local, window_size=(args.window, 0)
        )
        ms = torch.tensor(time_ms(step), device="cuda")
        peak = torch.tensor(float(torch.cuda.max_memory_allocated()), device="cuda")
        for value in (ms, peak):
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        saved, exchange = model_bytes(N, P, args, args.window)
        rows.append(
            dict(
                ranks=P,
                seq_len=N,
                ms=round(ms.item(), 3),
                tokens_per_s=round(N / ms.item() * 1e3),
                peak_gib=round(peak.item() / 2**30, 3),
                model_saved_gib=round(saved / 2**30, 3),
                model_exchange_gib=round(exchange / 2**30, 3),
            )
        )
        del local, step
    return rows


def simulate(args) -> list[dict]:
    """Each rank's kernel calls, one rank after another on this GPU, against the whole."""
    from fastlm import flash_attention
    from fastlm.distributed import ExchangePlan

    P, rows = args.simulate, []
    window = dict(window_size=(args.window, 0))
    for N in args.seq_lens:
        q, k, v, do = inputs(N, args)
        whole = time_ms(functools.partial(forward_backward, flash_attention, q, k, v, do, **window))
        per_rank = []
        for rank in range(P):
            plan = ExchangePlan.build(N, P, rank, True, args.window)
            calls = []
            for chunk, (lo, hi) in zip((rank, 2 * P - 1 - rank), plan.ranges):
                queries = slice(chunk * plan.chunk, (chunk + 1) * plan.chunk)
                keys = slice(lo * plan.chunk, (hi + 1) * plan.chunk)
                tensors = (q[:, :, queries], k[:, :, keys], v[:, :, keys], do[:, :, queries])
                call = functools.partial(forward_backward, flash_attention, *tensors, **window)
                calls.append(call)
            per_rank.append(time_ms(lambda calls=calls: [call() for call in calls]))
        rows.append(
            dict(
                ranks=P,
                seq_len=N,
                whole_ms=round(whole, 3),
                slowest_rank_ms=round(max(per_rank), 3),
                fastest_rank_ms=round(min(per_rank), 3),
                ideal_ms=round(whole / P, 3),
            )
        )
    return rows


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    lines += ["| " + " | ".join(str(row[key]) for key in keys) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=-1, help="left window (-1: none)")
    parser.add_argument("--simulate", type=int, metavar="P", help="one GPU: P ranks' kernel work")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("context_parallel.py: no CUDA device here; it measures GPUs (see --help)")
        return 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.simulate is None and world > 1:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
        try:
            rows = distributed(args)
        finally:
            main_rank = dist.get_rank() == 0
            dist.destroy_process_group()
        if not main_rank:
            return 0
    else:
        args.simulate = args.simulate or 2
        rows = simulate(args)
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
