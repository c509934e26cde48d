"""One mixture-of-experts experts layer: what its backward keeps, and (CUDA) its speed.

Saved-for-backward bytes (`--saved`, runs anywhere): each implementation's forward runs under
`torch.autograd.graph.saved_tensors_hooks` on small CPU tensors, and every tensor autograd keeps
is counted once by its storage (views of one buffer share it; the experts' weights, which live
anyway, are left out). Each implementation's count is a formula in (T, D, F, E, k) and the
element sizes, derived in `saved_formula` from what its code saves; the formula is checked
against the count at two sizes and then evaluated at Qwen3-30B-A3B's (D 2048, F 768, E 128, k 8,
T 16384, bf16). Implementations: fastlm's op, transformers' `grouped_mm` (its default) and
`eager` experts (the Qwen3-MoE module, transformers 5).

Speed (CUDA only; exits cleanly without): forward and forward+backward of fastlm's op against
transformers' `grouped_mm` and `eager` experts at the same sizes, each checked against fp32
math first; milliseconds, TFLOP/s and peak memory; a table, and CSV/JSON with --csv/--json.

    python benchmarks/moe.py --saved [--json saved.json]
    python benchmarks/moe.py [--tokens 16384] [--csv moe.csv] [--json moe.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402 (benchmarks/_common.py)

#: Qwen3-30B-A3B's experts (T: 4 sequences of 4096 tokens).
QWEN3_30B = dict(T=16384, D=2048, F=768, E=128, k=8)
IMPLEMENTATIONS = ("fastlm", "grouped_mm", "eager")


def _round_robin_ids(T: int, E: int, k: int) -> torch.Tensor:
    """Token t picks experts (t k + j) mod E: k distinct experts each, every expert hit when
    T k >= E, so that the per-expert loop of `eager` saves the same at any seed."""
    return (torch.arange(T)[:, None] * k + torch.arange(k)[None, :]) % E


def _experts_module(implementation: str, D: int, F: int, E: int, dtype):
    """transformers' Qwen3-MoE experts module (stacked gate_up (E, 2F, D), down (E, D, F))
    with `implementation` as its experts implementation."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E)
    config._experts_implementation = implementation
    module = Qwen3MoeExperts(config).to(dtype)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=D**-0.5)
    return module


def saved_bytes(implementation: str, T: int, D: int, F: int, E: int, k: int, dtype) -> int:
    """The bytes autograd keeps for the backward of one experts layer (the module docstring),
    counted on CPU tensors; fastlm's op needs Triton's interpreter on the CPU."""
    import fastlm

    module = _experts_module("eager" if implementation == "fastlm" else implementation, D, F, E,
                             dtype)  # fmt: skip
    x = torch.randn(T, D, dtype=dtype, requires_grad=True)
    ids = _round_robin_ids(T, E, k)
    weights = torch.rand(T, k, dtype=dtype, requires_grad=True)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if implementation == "fastlm":
            fastlm.moe_experts(x, ids, weights, module.gate_up_proj, module.down_proj)
        else:
            module(x, ids, weights)
    weights_storage = {p.untyped_storage().data_ptr() for p in module.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in weights_storage)


def saved_formula(implementation: str, T: int, D: int, F: int, E: int, k: int, dtype) -> int:
    """`saved_bytes` from what each implementation's code saves, S = T k routed rows, s the
    element size, 8 bytes per int64 index and 4 per int32:

    - fastlm: x (T D s), the routing weights (S s), the sorted order (4 S) and the expert
      offsets (4 (E + 1)); gate/up, h and the down projection's rows are recomputed.
    - grouped_mm: the permuted copy of x (S D s), the gate/up output (S 2F s), silu(gate)
      (S F s), h (S F s), the down projection's output (S D s, for the routing weights'
      gradient), the permuted routing weights (S s), three index vectors (perm // k, perm and
      its inverse: 3 8 S) and the group offsets (4 E).
    - eager: per expert, x's rows, the gate/up output, silu(gate), h, the down projection's
      output and the gathered routing weights as grouped_mm's, one more (rows, D) buffer
      (counted by the hooks, 3 S D s in all), and the expert's (slot, token) index pairs from
      torch.where (2 8 S).
    """
    s = dtype.itemsize
    S = T * k
    if implementation == "fastlm":
        return T * D * s + S * s + 4 * S + 4 * (E + 1)
    rows = 2 * S * D * s + S * 2 * F * s + 2 * S * F * s + S * s
    if implementation == "grouped_mm":
        return rows + 3 * 8 * S + 4 * E
    if implementation == "eager":
        return rows + S * D * s + 2 * 8 * S
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")


def saved_table(sizes: dict = QWEN3_30B, dtype=torch.bfloat16) -> list[dict]:
    """Each implementation's saved bytes at `sizes` by its formula, beside grouped_mm's."""
    rows = [dict(implementation=name, bytes=saved_formula(name, **sizes, dtype=dtype))
            for name in IMPLEMENTATIONS]  # fmt: skip
    reference = rows[1]["bytes"]
    for row in rows:
        row["MiB"] = row["bytes"] / 2**20
        row["of grouped_mm"] = row["bytes"] / reference
    return rows


def _print_saved(rows: list[dict]) -> None:
    print(f"saved for backward, one experts layer at {QWEN3_30B}, bf16:")
    print(f"{'implementation':<16}{'MiB':>12}{'of grouped_mm':>16}")
    for row in rows:
        print(f"{row['implementation']:<16}{row['MiB']:>12.1f}{row['of grouped_mm']:>16.3f}")


# --------------------------------------------------------------------------------------------
# Speed (CUDA)
# --------------------------------------------------------------------------------------------


def _time_ms(fn, warmup: int = 3, repeat: int = 10) -> float:
    for _ in range(warmup):
        fn()
    return _common.time_steps_ms(fn, repeat)


def speed_rows(T: int, D: int, F: int, E: int, k: int, dtype=torch.bfloat16) -> list[dict]:
    """Forward and forward+backward of each implementation on one routing (softmax top-k of
    random logits), each checked against fp32 math first (relative error in the rows)."""
    import fastlm
    from fastlm.kernels.moe.experts import moe_experts_ref
    from fastlm.testing import relative_error

    device = "cuda"
    torch.manual_seed(0)
    module = _experts_module("grouped_mm", D, F, E, dtype).to(device)
    x = torch.randn(T, D, device=device, dtype=dtype, requires_grad=True)
    weights, ids = torch.randn(T, E, device=device).softmax(-1).topk(k, dim=-1)
    weights = weights.to(dtype).requires_grad_()
    gate_up, down = module.gate_up_proj, module.down_proj
    expected = moe_experts_ref(x.float(), ids, weights.float(), gate_up.float(), down.float())
    flops = 2 * T * k * (2 * F * D + D * F)  # two GEMMs forward; the backward does 2x more
    runs = {
        "fastlm": lambda: fastlm.moe_experts(x, ids, weights, gate_up, down),
        "grouped_mm": lambda: module(x, ids, weights),
    }
    eager = _experts_module("eager", D, F, E, dtype).to(device)
    eager.load_state_dict(module.state_dict())
    runs["eager"] = lambda: eager(x, ids, weights)
    rows = []
    grad = torch.randn(T, D, device=device, dtype=dtype)
    for name, forward in runs.items():
        error = relative_error(forward(), expected)
        torch.cuda.reset_peak_memory_stats()
        fwd = _time_ms(lambda f=forward: f().detach())
        both = _time_ms(lambda f=forward: f().backward(grad))
        rows.append(dict(implementation=name, T=T, D=D, F=F, E=E, k=k, rel_error=error,
                         fwd_ms=fwd, fwd_bwd_ms=both, fwd_tflops=flops / fwd / 1e9,
                         fwd_bwd_tflops=3 * flops / both / 1e9,
                         peak_gib=torch.cuda.max_memory_allocated() / 2**30))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saved", action="store_true", help="the saved-for-backward bytes table")
    parser.add_argument("--tokens", type=int, default=QWEN3_30B["T"], help="T (speed)")
    parser.add_argument("--csv", type=Path, help="write the rows as CSV here")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.saved:
        rows = saved_table()
        _print_saved(rows)
    else:
        if not torch.cuda.is_available():
            print("benchmarks/moe.py: no CUDA device; the speed rows need one (--saved runs here)")
            return 0
        rows = speed_rows(**{**QWEN3_30B, "T": args.tokens})
        keys = list(rows[0])
        print("  ".join(f"{key:>14}" for key in keys))
        for row in rows:
            cells = (f"{v:>14.4g}" if isinstance(v, float) else f"{v!s:>14}" for v in row.values())
            print("  ".join(cells))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if args.csv:
        keys = list(rows[0])
        lines = [",".join(keys)] + [",".join(str(row[key]) for key in keys) for row in rows]
        args.csv.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # fastlm's op on the CPU (saved bytes)
    sys.exit(main())
