"""One training step of a GPT-2-small-sized model: tokens per second and peak memory.

Model: vocab 32000, d_model 768, 12 layers, 12 heads, d_ff 2048, RoPE theta 10000, at sequence
1024 and 2048 with a batch of --tokens / seq sequences. A step is: forward and loss under bf16
autocast (fp32 parameters), backward, `torch.optim.AdamW(fused=True)` step (the same optimizer for
every row, so rows differ only in the model), gradients set to None.

Rows: the reference (`fastlm.reference.Transformer`, loss by `reference.CrossEntropyLoss` on its
logits) in eager mode and under `torch.compile`; the reference with its attention replaced by
F.scaled_dot_product_attention(is_causal=True), compiled (what users pick today); and
`fastlm.Transformer` (its fused `loss()`), eager and compiled, loaded from the reference's
state_dict. Columns: tokens/s and its ratio to the eager reference and to the compiled SDPA
reference; peak memory (torch.cuda.max_memory_allocated over the timed steps: parameters,
gradients, optimizer state and activations) and its ratio to the eager reference; the first
step's loss (every row starts from the same weights and data, so these should agree).

Without CUDA: a message, then a tiny model's loss and gradients, fastlm against the float64
reference, through Triton's interpreter, and one step of the benchmark's step function; exit
code 1 if fastlm.Transformer disagrees.
"""

from __future__ import annotations

import _common as common  # first: turns on Triton's interpreter when there is no CUDA

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import fastlm
from fastlm import reference


@dataclass(frozen=True)
class Config:
    vocab_size: int = 32000
    d_model: int = 768
    num_layers: int = 12
    num_heads: int = 12
    d_ff: int = 2048
    rope_theta: float = 10000.0

    def kwargs(self, context_length: int) -> dict:
        return dict(vocab_size=self.vocab_size, context_length=context_length,
                    d_model=self.d_model, num_layers=self.num_layers, num_heads=self.num_heads,
                    d_ff=self.d_ff, rope_theta=self.rope_theta)


QUICK_LAYERS = 4
QUICK_TIME_LIMIT_S = 85
REF_EAGER, REF_COMPILED = "reference", "torch.compile(reference)"
SDPA_COMPILED = "torch.compile(reference + SDPA)"
FASTLM_EAGER, FASTLM_COMPILED = "fastlm", "torch.compile(fastlm)"


class SdpaAttention(torch.nn.Module):
    """Drop-in for reference.ScaledDotProductAttention calling PyTorch's fused attention. The
    reference model always passes the causal mask, so is_causal=True replaces it."""

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def build(kind: str, config: Config, seq: int) -> tuple[torch.nn.Module, Callable]:
    """(model, loss_fn(model, ids, targets)) for a row; every model has the same weights."""
    torch.manual_seed(0)
    ref = reference.Transformer(**config.kwargs(seq), device=common.DEVICE)
    if kind in (REF_EAGER, REF_COMPILED, SDPA_COMPILED):
        if kind == SDPA_COMPILED:
            for block in ref.blocks:
                block.mult_head_atten.attention = SdpaAttention()

        def reference_loss(model, ids, targets):
            return reference.CrossEntropyLoss()(model(ids), targets)
        return ref, reference_loss
    model = fastlm.Transformer(**config.kwargs(seq), device=common.DEVICE)
    model.load_state_dict(ref.state_dict())
    del ref
    return model, lambda model, ids, targets: model.loss(ids, targets)


def make_step(model: torch.nn.Module, loss_fn: Callable, ids: torch.Tensor,
              targets: torch.Tensor, autocast: bool) -> Callable[[], torch.Tensor]:
    """One training step as a function: loss, backward, optimizer step, gradients to None."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=ids.is_cuda)
    precision = (torch.autocast(ids.device.type, dtype=torch.bfloat16) if autocast
                 else contextlib.nullcontext())

    def step():
        with precision:
            loss = loss_fn(model, ids, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return step


@dataclass
class Measured:
    ms: float
    peak_gib: float
    first_loss: float


def measure(kind: str, config: Config, seq: int, batch: int, warmup: int,
            steps: int) -> Measured:
    model, loss_fn = build(kind, config, seq)
    if kind in (REF_COMPILED, SDPA_COMPILED, FASTLM_COMPILED):
        loss_fn = torch.compile(loss_fn)
    generator = torch.Generator(device=common.DEVICE).manual_seed(1)
    ids, targets = (torch.randint(config.vocab_size, (batch, seq), device=common.DEVICE,
                                  generator=generator) for _ in range(2))
    step = make_step(model, loss_fn, ids, targets, autocast=True)
    first_loss = float(step())  # also the first compilation
    for _ in range(warmup - 1):
        step()
    times = []
    peak = common.peak_memory_gib(lambda: times.append(common.time_loop_ms(step, 0, steps)))
    return Measured(times[0], peak, first_loss)


def bench(run: common.Run, config: Config, seqs: list[int], tokens: int) -> None:
    kinds = [REF_EAGER, REF_COMPILED, SDPA_COMPILED, FASTLM_EAGER, FASTLM_COMPILED]
    # Measured in the order of the design targets' comparisons, so that a spent time budget
    # skips the least needed rows; shown in table order.
    priority = [FASTLM_EAGER, REF_EAGER, SDPA_COMPILED, FASTLM_COMPILED, REF_COMPILED]
    for seq in seqs:
        batch = max(1, tokens // seq)
        results = {}
        for kind in priority:
            results[kind] = run.measure(
                lambda: measure(kind, config, seq, batch, run.args.warmup_steps, run.args.steps),
                f"{kind} seq={seq}")
            torch._dynamo.reset()  # drop compiled graphs (and what their guards hold)
            common.free_memory()

        def tokens_per_s(kind):
            outcome = results[kind]
            return batch * seq / (outcome.value.ms * 1e-3) if outcome.ok else None

        for kind in kinds:
            outcome = results[kind]
            value = outcome.value
            run.rows.append({
                "seq": seq, "batch": batch, "layers": config.num_layers, "impl": kind,
                "ms/step": value.ms if value else outcome.status,
                "tokens/s": tokens_per_s(kind),
                "vs reference": common.ratio(tokens_per_s(kind), tokens_per_s(REF_EAGER)),
                "vs compiled SDPA": common.ratio(tokens_per_s(kind), tokens_per_s(SDPA_COMPILED)),
                "peak GiB": value.peak_gib if value else outcome.status,
                "memory vs reference": common.ratio(
                    value.peak_gib if value else None,
                    results[REF_EAGER].value.peak_gib if results[REF_EAGER].ok else None),
                "first loss": value.first_loss if value else None,
            })


def summary_lines(rows: list[dict]) -> list[str]:
    lines = ["training step (bf16 autocast):"]
    for row in rows:
        if row["impl"] not in (FASTLM_EAGER, FASTLM_COMPILED):
            continue
        if row["tokens/s"] is None:
            lines.append(f"- seq {row['seq']} {row['impl']}: {row['ms/step']}")
            continue
        parts = [f"- seq {row['seq']} {row['impl']}: {row['tokens/s']:.0f} tokens/s"]
        for key in ("vs reference", "vs compiled SDPA"):
            if row[key] is not None:
                parts.append(f"{row[key]:.2f}x {key[3:]}")
        if row["memory vs reference"] is not None:
            parts.append(f"peak memory {row['memory vs reference']:.2f}x reference")
        lines.append(", ".join(parts))
    if len(lines) == 1:
        lines.append("- no fastlm rows (they failed: see notes)")
    return lines


# --------------------------------------------------------------------------------------------
# Without CUDA: the interpreter check
# --------------------------------------------------------------------------------------------


TINY = Config(vocab_size=97, d_model=32, num_layers=2, num_heads=2, d_ff=64)
TINY_SEQ = 12


def interpreter_check() -> int:
    torch.manual_seed(0)
    ids, targets = (torch.randint(TINY.vocab_size, (2, TINY_SEQ)) for _ in range(2))
    ref = reference.Transformer(**TINY.kwargs(TINY_SEQ))
    rows = []

    def reference_step():
        step = make_step(ref, lambda m, i, t: reference.CrossEntropyLoss()(m(i), t), ids, targets,
                         autocast=False)
        loss = float(step())
        status = "ok" if torch.isfinite(torch.tensor(loss)) else "FAIL (loss not finite)"
        return [("reference training step (benchmark's step function)", status, None, None)]

    def fastlm_against_reference():
        from fastlm.testing import TOLERANCE

        model = fastlm.Transformer(**TINY.kwargs(TINY_SEQ))
        model.load_state_dict(ref.state_dict())
        ref64 = reference.Transformer(**TINY.kwargs(TINY_SEQ), dtype=torch.float64)
        ref64.load_state_dict({k: v.double() for k, v in ref.state_dict().items()})
        loss = model.loss(ids, targets)
        loss64 = reference.CrossEntropyLoss()(ref64(ids), targets)
        loss.backward()
        loss64.backward()
        grads64 = dict(ref64.named_parameters())
        worst = max(((common.relative_error(p.grad, grads64[name].grad), name)
                     for name, p in model.named_parameters()), key=lambda pair: pair[0])
        bound = TOLERANCE[torch.float32]
        pairs = [("fastlm.Transformer loss", common.relative_error(loss, loss64)),
                 (f"fastlm.Transformer grads (worst: {worst[1]})", worst[0])]
        rows = [(name, "ok" if err <= bound else "FAIL", err, bound) for name, err in pairs]
        step = make_step(model, lambda m, i, t: m.loss(i, t), ids, targets, autocast=False)
        finite = bool(torch.isfinite(step()))
        rows.append(("fastlm training step", "ok" if finite else "FAIL (loss not finite)",
                     None, None))
        return rows

    # Gradients first (the reference step below changes the weights).
    rows += common.try_check("fastlm.Transformer", fastlm_against_reference)
    rows += common.try_check("reference step", reference_step)
    return common.report_checks(rows)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.split("\n\n")[0], quick_help=(
        f"{QUICK_LAYERS} layers, seq 1024 only, 3 timed steps, within a {QUICK_TIME_LIMIT_S} s "
        "time budget"))
    p.add_argument("--seqs", type=int, nargs="+", default=None,
                   help="sequence lengths (default 1024 2048; --quick: 1024)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step (batch x seq)")
    p.add_argument("--layers", type=int, default=None,
                   help=f"transformer blocks (default 12; --quick: {QUICK_LAYERS})")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --quick: 3)")
    p.add_argument("--warmup-steps", type=int, default=3,
                   help="untimed steps first (the first one compiles)")
    args = p.parse_args(argv)
    if not common.HAS_CUDA:
        common.no_cuda_notice("benchmarks/train.py")
        return interpreter_check()

    args.seqs = args.seqs or ([1024] if args.quick else [1024, 2048])
    args.steps = args.steps or (3 if args.quick else 10)
    layers = args.layers or (QUICK_LAYERS if args.quick else Config.num_layers)
    config = Config(num_layers=layers)
    common.raise_compile_limits()
    run = common.Run("train", args, QUICK_TIME_LIMIT_S)
    run.header()
    bench(run, config, args.seqs, args.tokens)
    columns = ["seq", "batch", "layers", "impl", "ms/step", "tokens/s", "vs reference",
               "vs compiled SDPA", "peak GiB", "memory vs reference", "first loss"]
    run.finish(columns, summary=summary_lines(run.rows),
               plot={"x": "impl", "y": "tokens/s", "series": "seq", "panel": ("layers",),
                     "title": f"training step, {run.env['gpu']}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
