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
transformers' `grouped_mm` and `eager` experts, Liger-Kernel's fused MoE and SonicMoE ("not
installed" where they are not) at the same sizes, each checked against fp32 math first (an
output off by more than fastlm.testing.TOLERANCE is "wrong" and not timed); milliseconds,
TFLOP/s and peak memory; a table, CSV/JSON with --csv/--json, and the benchmarks' files with
--out (moe_headline.* with --headline: the GPU check's step).

    python benchmarks/moe.py --saved [--json saved.json]
    python benchmarks/moe.py [--tokens 16384] [--csv moe.csv] [--json moe.json]
    python benchmarks/moe.py --headline --out DIR [--time-limit S]
"""

from __future__ import annotations

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


#: The speed rows' implementations: IMPLEMENTATIONS and, where installed, Liger-Kernel's fused
#: MoE (`liger_kernel.ops.LigerFusedMoEFunction`) and SonicMoE (`sonicmoe.functional`).
SPEED_IMPLEMENTATIONS = ("fastlm", "grouped_mm", "liger", "sonicmoe", "eager")
NOT_INSTALLED = "not installed"
#: The cells `_measured` fills.
MEASURED = ("rel_error", "fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops", "peak_gib")


def _liger_forward(x, ids, weights, gate_up, down):
    """Liger-Kernel's fused MoE on transformers' layouts (gate_up (E, 2F, D) gate rows first,
    down (E, D, F)) with int32 expert ids, or None where it is not installed (or predates it)."""
    function = getattr(_common.optional_module("liger_kernel.ops"), "LigerFusedMoEFunction", None)
    if function is None:
        return None
    ids = ids.to(torch.int32)
    return lambda: function.apply(x, gate_up, down, ids, weights)


def _sonicmoe_forward(x, ids, weights, gate_up, down):
    """SonicMoE's `moe_general_routing_inputs` on one flat list of (token, expert, score)
    assignments sorted by token, or None where it is not installed. Its layouts: w1 (2F, D, E)
    with each expert's gate and up rows interleaved and w2 (D, F, E), both E-outermost in memory
    (stride order (2, 0, 1)): the weights are copied into them once here, outside the timing
    (the copies count in its peak memory), and the gradients go to the copies."""
    functional = _common.optional_module("sonicmoe.functional")
    enums = _common.optional_module("sonicmoe.enums")
    route = getattr(functional, "moe_general_routing_inputs", None)
    if route is None or not hasattr(enums, "ActivationType"):
        return None
    (T, k), (E, F2, D) = ids.shape, gate_up.shape
    interleaved = gate_up.detach().view(E, 2, F2 // 2, D).transpose(1, 2).reshape(E, F2, D)
    w1 = interleaved.requires_grad_().permute(1, 2, 0)
    w2 = down.detach().clone().requires_grad_().permute(1, 2, 0)
    tokens = torch.arange(T, device=x.device, dtype=torch.int32).repeat_interleave(k)
    experts, scores = ids.reshape(-1).to(torch.int32), weights.reshape(-1)
    swiglu, stream = enums.ActivationType.SWIGLU, torch.cuda.current_stream().cuda_stream
    return lambda: route(x, scores, tokens, experts, w1, None, w2, None, E, stream, swiglu)[0]


def _measured(forward, expected, grad, flops: int, tolerance: float) -> dict:
    """One implementation's cells: its forward's relative error against fp32 math first ("wrong"
    in every cell, and no timing, over `tolerance`), then forward and forward+backward times,
    TFLOP/s and peak memory."""
    from fastlm.testing import relative_error

    error = relative_error(forward(), expected)
    if error > tolerance:
        return dict.fromkeys(MEASURED, f"wrong (rel error {error:.3g})")
    torch.cuda.reset_peak_memory_stats()
    fwd = _time_ms(lambda: forward().detach())
    both = _time_ms(lambda: forward().backward(grad))
    return dict(rel_error=error, fwd_ms=fwd, fwd_bwd_ms=both, fwd_tflops=flops / fwd / 1e9,
                fwd_bwd_tflops=3 * flops / both / 1e9,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30)  # fmt: skip


def speed_rows(T: int, D: int, F: int, E: int, k: int, dtype=torch.bfloat16,
               out_of_time=lambda: False):  # fmt: skip
    """Forward and forward+backward of each of SPEED_IMPLEMENTATIONS on one routing (softmax
    top-k of random logits), each checked first against fp32 math within
    `fastlm.testing.TOLERANCE[dtype]` (`_measured`); yields a row each as it is measured. One
    not installed, failing, or not started once `out_of_time()` has a status word in every
    cell."""
    import fastlm
    from fastlm.kernels.moe.experts import moe_experts_ref
    from fastlm.testing import TOLERANCE

    device = _common.DEVICE  # CUDA (the CPU only where tests stand in for torch.cuda)
    torch.manual_seed(0)
    module = _experts_module("grouped_mm", D, F, E, dtype).to(device)
    x = torch.randn(T, D, device=device, dtype=dtype, requires_grad=True)
    weights, ids = torch.randn(T, E, device=device).softmax(-1).topk(k, dim=-1)
    weights = weights.to(dtype).requires_grad_()
    gate_up, down = module.gate_up_proj, module.down_proj
    expected = moe_experts_ref(x.float(), ids, weights.float(), gate_up.float(), down.float())
    flops = 2 * T * k * (2 * F * D + D * F)  # two GEMMs forward; the backward does 2x more
    eager = _experts_module("eager", D, F, E, dtype).to(device)
    eager.load_state_dict(module.state_dict())
    forwards = {  # each builds its forward, or gives None where its package is not installed
        "fastlm": lambda: lambda: fastlm.moe_experts(x, ids, weights, gate_up, down),
        "grouped_mm": lambda: lambda: module(x, ids, weights),
        "liger": lambda: _liger_forward(x, ids, weights, gate_up, down),
        "sonicmoe": lambda: _sonicmoe_forward(x, ids, weights, gate_up, down),
        "eager": lambda: lambda: eager(x, ids, weights),
    }
    grad = torch.randn(T, D, device=device, dtype=dtype)
    for name in SPEED_IMPLEMENTATIONS:
        if out_of_time():
            cells = dict.fromkeys(MEASURED, _common.SKIPPED)
        else:
            try:
                forward = forwards[name]()
                if forward is None:
                    cells = dict.fromkeys(MEASURED, NOT_INSTALLED)
                else:
                    cells = _measured(forward, expected, grad, flops, TOLERANCE[dtype])
            except Exception as exc:  # noqa: BLE001 - a failing implementation is a row
                status, message = _common.failure(exc)
                print(f"benchmarks/moe.py: {name}: {message}")
                cells = dict.fromkeys(MEASURED, status)
            _common.free_memory()
        yield dict(implementation=name, T=T, D=D, F=F, E=E, k=k, **cells)


def _speed(args) -> int:
    """The speed rows as a `_common.Run` (NAME moe, or moe_headline with --headline: the GPU
    check's step), stopping at its time budget; also --csv and --json."""
    if not _common.HAS_CUDA:
        print("benchmarks/moe.py: no CUDA device; the speed rows need one (--saved runs here)")
        return 0
    columns = ["implementation", "T", "D", "F", "E", "k", *MEASURED]
    run = _common.Run("moe", args, columns, budget_s=60)
    sizes = {**QWEN3_30B, "T": args.tokens}
    with run.measuring():
        for row in speed_rows(**sizes, out_of_time=run.out_of_time):
            run.add(row)
    title = f"One experts layer, {sizes}, bf16 (fwd+bwd TFLOP/s: 3 times the forward's FLOPs):"
    status = run.finish(_common.table_lines(title, run.rows, columns))
    _write(run.rows, args)
    return status


def _write(rows: list[dict], args) -> None:
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if args.csv:
        keys = list(rows[0])
        lines = [",".join(keys)] + [",".join(str(row[key]) for key in keys) for row in rows]
        args.csv.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = _common.parser(__doc__.split("\n\n")[0], quick="the same rows (one size only)")
    parser.add_argument("--saved", action="store_true", help="the saved-for-backward bytes table")
    parser.add_argument("--tokens", type=int, default=QWEN3_30B["T"], help="T (speed)")
    parser.add_argument("--csv", type=Path, help="write the rows as CSV here")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if not args.saved:
        return _speed(args)
    rows = saved_table()
    _print_saved(rows)
    _write(rows, args)
    return 0


if __name__ == "__main__":
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # fastlm's op on the CPU (saved bytes)
    sys.exit(main())
