"""One training step of a GPT-2-small-sized model: tokens per second and peak memory.

Model: vocab 32000, d_model 768, 12 layers, 12 heads, d_ff 2048, RoPE theta 10000, at sequence
1024 and 2048 with a batch of --tokens / seq sequences. A step is: forward and loss under bf16
autocast (fp32 parameters), backward, `torch.optim.AdamW(fused=True)` step (the same optimizer for
every row, so rows differ only in the model), gradients set to None.

The batch is fixed at 16384 tokens per step (--tokens) rather than grown until memory is full,
so every row does the same work: the largest batch that fits differs per row, the eager reference
keeping B x H x N^2 attention scores per layer. 16384 tokens already fill the chip: the narrowest
matmul of a step (16384 x 768, the attention output projection) is 768 tiles of 128 x 128, almost
six per SM of an H100 or H200 (132 SMs), and attention has B x H x N / 128 = 1536 query blocks of
128 rows at either sequence length.

Rows, in the order they are measured (a spent time budget skips the last ones):
`fastlm.Transformer` (its fused `loss()`, loaded from the reference's state_dict) compiled, and
the reference with its attention replaced by F.scaled_dot_product_attention(is_causal=True),
compiled (what users pick today): the headline comparison; then fastlm eager, and the reference
(`fastlm.reference.Transformer`) eager and compiled. The reference's loss is
`reference.CrossEntropyLoss` on its logits cast to float32, as fastlm.train computes it.
Columns: tokens/s and its ratio to the eager reference and to the compiled SDPA reference; peak
memory (torch.cuda.max_memory_allocated over the timed steps: parameters, gradients, optimizer
state and activations) and its ratio to the eager reference; the first step's loss (every row
starts from the same weights and data, so these should agree).

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
# The headline comparison first, so that a spent time budget skips the least needed rows.
KINDS = [FASTLM_COMPILED, SDPA_COMPILED, FASTLM_EAGER, REF_EAGER, REF_COMPILED]
COLUMNS = ["seq", "batch", "layers", "impl", "ms/step", "tokens/s", "vs reference",
           "vs compiled SDPA", "peak GiB", "memory vs reference", "first loss"]


class SdpaAttention(torch.nn.Module):
    """Drop-in for reference.ScaledDotProductAttention calling PyTorch's fused attention. The
    reference model always passes the causal mask, so is_causal=True replaces it."""

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def reference_loss(model: torch.nn.Module, ids: torch.Tensor,
                   targets: torch.Tensor) -> torch.Tensor:
    """The reference model's loss, on float32 logits as in fastlm.train."""
    return reference.CrossEntropyLoss()(model(ids).float(), targets)


def build(kind: str, config: Config, seq: int) -> tuple[torch.nn.Module, Callable]:
    """(model, loss_fn(model, ids, targets)) for a row; every model has the same weights."""
    torch.manual_seed(0)
    ref = reference.Transformer(**config.kwargs(seq), device=common.DEVICE)
    if kind in (REF_EAGER, REF_COMPILED, SDPA_COMPILED):
        if kind == SDPA_COMPILED:
            for block in ref.blocks:
                block.mult_head_atten.attention = SdpaAttention()
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
    for seq in seqs:
        batch = max(1, tokens // seq)
        for kind in KINDS:
            outcome = run.measure(
                lambda: measure(kind, config, seq, batch, run.args.warmup_steps, run.args.steps),
                f"{kind} seq={seq}")
            torch._dynamo.reset()  # drop compiled graphs (and what their guards hold)
            common.free_memory()
            value = outcome.value
            run.add({"seq": seq, "batch": batch, "layers": config.num_layers, "impl": kind,
                     "ms/step": value.ms if value else outcome.status,
                     "tokens/s": batch * seq / (value.ms * 1e-3) if value else None,
                     "peak GiB": value.peak_gib if value else outcome.status,
                     "first loss": value.first_loss if value else None})


def add_comparisons(rows: list[dict]) -> None:
    """Throughput against the eager and the compiled SDPA reference, memory against the eager
    reference, at the same sequence length; each the row's value / the baseline's."""
    for column, baseline, value in (("vs reference", REF_EAGER, "tokens/s"),
                                    ("vs compiled SDPA", SDPA_COMPILED, "tokens/s"),
                                    ("memory vs reference", REF_EAGER, "peak GiB")):
        common.add_ratios(rows, column, baseline, key=("seq",), value=value,
                          higher_is_better=True)


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
        step = make_step(ref, reference_loss, ids, targets, autocast=False)
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
    p.add_argument("--tokens", type=int, default=16384,
                   help="tokens per step, batch x seq (default 16384, the same for every row; "
                        "train.py's docstring says why)")
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
    run = common.Run("train", args, QUICK_TIME_LIMIT_S, COLUMNS)
    run.header()
    with run.interruptible():
        bench(run, config, args.seqs, args.tokens)
    add_comparisons(run.rows)
    return run.finish(summary=summary_lines(run.rows),
                      plot={"x": "impl", "y": "tokens/s", "series": "seq", "panel": ("layers",),
                            "title": f"training step, {run.env['gpu']}"})


if __name__ == "__main__":
    sys.exit(main())
