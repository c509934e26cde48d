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
starts from the same weights and data, so these should agree) and seconds (compilation and
autotuning included); for compiled rows, the graph breaks torch.compile's dynamo counted while
tracing the first step (`torch._dynamo.utils.counters["graph_break"]`; the reasons are in the JSON
under `graph_breaks`).

Hugging Face rows (when transformers is importable; `n/a` otherwise): a `LlamaForCausalLM` holding
the reference model's weights (`fastlm.hf.to_hf`: vocab 32000, hidden 768, 12 layers, 12 heads,
intermediate 2048, max positions = seq, its default SDPA attention), its loss `model(input_ids,
labels=targets).loss` (Hugging Face shifts the labels), eager: unpatched, patched with
`fastlm.hf.patch`, and patched with Liger-Kernel's `apply_liger_kernel_to_llama` when liger_kernel
imports. Liger patches transformers' Llama module for every model built after it, so its rows come
last of all.

`--headline` (what gpu_check.sh measures first): the two headline rows only, fastlm compiled and
the compiled SDPA reference, at seq 1024 with all 12 layers. `--skip-headline`: the other rows.

Without CUDA: a message, then a tiny model's loss and gradients, fastlm against the float64
reference, through Triton's interpreter, and one step of the benchmark's step function; exit
code 1 if fastlm.Transformer disagrees.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import _common as common  # first: turns on Triton's interpreter when there is no CUDA
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
        return dict(
            vocab_size=self.vocab_size,
            context_length=context_length,
            d_model=self.d_model,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            d_ff=self.d_ff,
            rope_theta=self.rope_theta,
        )


QUICK_LAYERS = 4
QUICK_TIME_LIMIT_S = 85
REF_EAGER, REF_COMPILED = "reference", "torch.compile(reference)"
SDPA_COMPILED = "torch.compile(reference + SDPA)"
FASTLM_EAGER, FASTLM_COMPILED = "fastlm", "torch.compile(fastlm)"
HF, HF_FASTLM, HF_LIGER = "HF Llama", "HF Llama + fastlm.hf.patch", "HF Llama + Liger"
# The headline comparison first, so that a spent time budget skips the least needed rows.
HEADLINE_KINDS = [FASTLM_COMPILED, SDPA_COMPILED]
HEADLINE_SEQ = 1024
KINDS = HEADLINE_KINDS + [FASTLM_EAGER, REF_EAGER, REF_COMPILED, HF, HF_FASTLM, HF_LIGER]
HF_KINDS = (HF, HF_FASTLM, HF_LIGER)
COMPILED_KINDS = (FASTLM_COMPILED, SDPA_COMPILED, REF_COMPILED)
COLUMNS = [
    "seq",
    "batch",
    "layers",
    "impl",
    "ms/step",
    "tokens/s",
    "vs reference",
    "vs compiled SDPA",
    "vs HF Llama",
    "peak GiB",
    "memory vs reference",
    "first loss",
    "first step s",
    "graph breaks",
]


class SdpaAttention(torch.nn.Module):
    """Drop-in for reference.ScaledDotProductAttention calling PyTorch's fused attention. The
    reference model always passes the causal mask, so is_causal=True replaces it."""

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def reference_loss(
    model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """The reference model's loss, on float32 logits as in fastlm.train."""
    return reference.CrossEntropyLoss()(model(ids).float(), targets)


def hf_llama(config: Config, seq: int, device=None) -> torch.nn.Module:
    """A Hugging Face LlamaForCausalLM holding the reference model of `config`'s size (the weights
    every row starts from), by `fastlm.hf.to_hf` (ModuleNotFoundError without transformers: the
    row shows n/a)."""
    import fastlm.hf

    model = reference.Transformer(**config.kwargs(seq), device=device or common.DEVICE)
    return fastlm.hf.to_hf(model).train()


def hf_loss(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=targets).loss


def build_hf(kind: str, config: Config, seq: int) -> tuple[torch.nn.Module, Callable]:
    """The Hugging Face rows' model and loss."""
    model = hf_llama(config, seq)
    if kind == HF_FASTLM:
        import fastlm.hf

        fastlm.hf.patch(model)
    elif kind == HF_LIGER:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)
    return model, hf_loss


def build(kind: str, config: Config, seq: int) -> tuple[torch.nn.Module, Callable]:
    """(model, loss_fn(model, ids, targets)) for a row; every model has the same weights (the
    Hugging Face rows too: `hf_llama` converts the reference model)."""
    torch.manual_seed(0)
    if kind in HF_KINDS:
        return build_hf(kind, config, seq)
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


def make_step(
    model: torch.nn.Module,
    loss_fn: Callable,
    ids: torch.Tensor,
    targets: torch.Tensor,
    autocast: bool,
) -> Callable[[], torch.Tensor]:
    """One training step as a function: loss, backward, optimizer step, gradients to None."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=ids.is_cuda)
    precision = (
        torch.autocast(ids.device.type, dtype=torch.bfloat16)
        if autocast
        else contextlib.nullcontext()
    )

    def step():
        with precision:
            loss = loss_fn(model, ids, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def count_graph_breaks(call: Callable[[], object]) -> tuple[object, dict]:
    """call()'s result, and what torch.compile's dynamo counted while it ran: graph breaks (in all
    and by reason) and the graphs it compiled. A model traced whole gives 0 breaks, 1 graph."""
    from torch._dynamo.utils import counters

    counters.clear()
    result = call()
    reasons = {str(reason): count for reason, count in counters["graph_break"].items()}
    return result, {
        "graph_breaks": sum(reasons.values()),
        "graphs": counters["stats"]["unique_graphs"],
        "reasons": reasons,
    }


@dataclass
class Measured:
    ms: float
    peak_gib: float
    first_loss: float
    first_step_s: float
    compiled: dict | None  # count_graph_breaks' counts for a compiled row


def measure(kind: str, config: Config, seq: int, batch: int, warmup: int, steps: int) -> Measured:
    model, loss_fn = build(kind, config, seq)
    if kind in COMPILED_KINDS:
        loss_fn = torch.compile(loss_fn)
    generator = torch.Generator(device=common.DEVICE).manual_seed(1)
    ids, targets = (
        torch.randint(config.vocab_size, (batch, seq), device=common.DEVICE, generator=generator)
        for _ in range(2)
    )
    step = make_step(model, loss_fn, ids, targets, autocast=True)
    start = time.perf_counter()
    first_loss, compiled = count_graph_breaks(lambda: float(step()))  # float() waits for the GPU
    first_step_s = time.perf_counter() - start
    for _ in range(warmup - 1):
        step()
    times = []
    peak = common.peak_memory_gib(lambda: times.append(common.time_loop_ms(step, 0, steps)))
    return Measured(
        times[0], peak, first_loss, first_step_s, compiled if kind in COMPILED_KINDS else None
    )


def cases(args) -> list[tuple[int, str]]:
    """(seq, kind) in the order measured: --headline's two rows, or all but them, or all."""
    if args.headline:
        return [(HEADLINE_SEQ, kind) for kind in HEADLINE_KINDS]
    wanted = [(seq, kind) for seq in args.seqs for kind in KINDS if kind != HF_LIGER]
    wanted += [(seq, HF_LIGER) for seq in args.seqs]  # last: it patches transformers' module
    if args.skip_headline:
        wanted = [
            (seq, kind)
            for seq, kind in wanted
            if not (seq == HEADLINE_SEQ and kind in HEADLINE_KINDS)
        ]
    return wanted


def bench(run: common.Run, config: Config, todo: list[tuple[int, str]], tokens: int) -> None:
    for seq, kind in todo:
        if run.out_of_time():
            break
        batch = max(1, tokens // seq)
        outcome = run.measure(
            lambda kind=kind, seq=seq, batch=batch: measure(
                kind, config, seq, batch, run.args.warmup_steps, run.args.steps
            ),
            f"{kind} seq={seq}",
        )
        torch._dynamo.reset()  # drop compiled graphs (and what their guards hold)
        common.free_memory()
        value = outcome.value
        if value is not None and value.compiled is not None:
            run.extra.setdefault("graph_breaks", {})[f"{kind} seq={seq}"] = value.compiled
        run.add(
            {
                "seq": seq,
                "batch": batch,
                "layers": config.num_layers,
                "impl": kind,
                "ms/step": value.ms if value else outcome.status,
                "tokens/s": batch * seq / (value.ms * 1e-3) if value else None,
                "peak GiB": value.peak_gib if value else outcome.status,
                "first loss": value.first_loss if value else None,
                "first step s": value.first_step_s if value else None,
                "graph breaks": value.compiled["graph_breaks"]
                if value and value.compiled
                else None,
            }
        )


def add_comparisons(rows: list[dict]) -> None:
    """Throughput against the eager and the compiled SDPA reference, memory against the eager
    reference, at the same sequence length; each the row's value / the baseline's."""
    for column, baseline, value in (
        ("vs reference", REF_EAGER, "tokens/s"),
        ("vs compiled SDPA", SDPA_COMPILED, "tokens/s"),
        ("vs HF Llama", HF, "tokens/s"),
        ("memory vs reference", REF_EAGER, "peak GiB"),
    ):
        common.add_ratios(rows, column, baseline, key=("seq",), value=value, higher_is_better=True)


SUMMARY_COLUMNS = [
    "seq",
    "batch",
    "layers",
    "impl",
    "tokens/s",
    "ms/step",
    "vs compiled SDPA",
    "vs reference",
    "vs HF Llama",
    "peak GiB",
    "first step s",
    "graph breaks",
]


def summary_lines(rows: list[dict]) -> list[str]:
    """Every row as a markdown table (there are few), without columns that are empty."""
    if not rows:
        return ["training step: no rows (see the notes)"]
    columns = [c for c in SUMMARY_COLUMNS if any(row.get(c) is not None for row in rows)]
    return [
        "Training step, bf16 autocast, AdamW (tokens/s; vs X = tokens/s over X's):",
        "",
        common.markdown_table(rows, columns),
    ]


def graph_break_notes(graph_breaks: dict[str, dict]) -> list[str]:
    """One note per compiled row: its graph breaks and their reasons (first line of each)."""
    notes = []
    for label, counted in graph_breaks.items():
        reasons = "; ".join(
            f"{count}x {reason.splitlines()[0][:160]}"
            for reason, count in counted["reasons"].items()
        )
        notes.append(
            f"graph breaks of {label}: {counted['graph_breaks']} "
            f"({counted['graphs']} graph(s) compiled){': ' + reasons if reasons else ''}"
        )
    return notes


# --------------------------------------------------------------------------------------------
# Without CUDA: the interpreter check
# --------------------------------------------------------------------------------------------


TINY = Config(vocab_size=97, d_model=32, num_layers=2, num_heads=2, d_ff=64)
TINY_SEQ = 12


def interpreter_check() -> int:
    from fastlm.testing import TOLERANCE

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
        model = fastlm.Transformer(**TINY.kwargs(TINY_SEQ))
        model.load_state_dict(ref.state_dict())
        ref64 = reference.Transformer(**TINY.kwargs(TINY_SEQ), dtype=torch.float64)
        ref64.load_state_dict({k: v.double() for k, v in ref.state_dict().items()})
        loss = model.loss(ids, targets)
        loss64 = reference.CrossEntropyLoss()(ref64(ids), targets)
        loss.backward()
        loss64.backward()
        grads64 = dict(ref64.named_parameters())
        worst = max(
            (
                (common.relative_error(p.grad, grads64[name].grad), name)
                for name, p in model.named_parameters()
            ),
            key=lambda pair: pair[0],
        )
        bound = TOLERANCE[torch.float32]
        pairs = [
            ("fastlm.Transformer loss", common.relative_error(loss, loss64)),
            (f"fastlm.Transformer grads (worst: {worst[1]})", worst[0]),
        ]
        rows = [(name, "ok" if err <= bound else "FAIL", err, bound) for name, err in pairs]
        step = make_step(model, lambda m, i, t: m.loss(i, t), ids, targets, autocast=False)
        finite = bool(torch.isfinite(step()))
        rows.append(
            ("fastlm training step", "ok" if finite else "FAIL (loss not finite)", None, None)
        )
        return rows

    def graph_breaks():
        """The GPU rows' graph-break count, here with PyTorch inside the kernels' ops (fake
        tensors cannot enter the interpreter) and aot_eager: the model should trace whole."""
        model = fastlm.Transformer(**TINY.kwargs(TINY_SEQ))
        compiled = torch.compile(lambda i, t: model.loss(i, t), backend="aot_eager")
        with _environ(FASTLM_BACKEND="torch"):
            _, counted = count_graph_breaks(lambda: compiled(ids, targets).backward())
        reasons = "; ".join(counted["reasons"])[:160]
        status = (
            "ok"
            if counted["graph_breaks"] == 0
            else (f"FAIL ({counted['graph_breaks']} graph breaks: {reasons})")
        )
        return [
            (
                f"torch.compile(fastlm) graph breaks: {counted['graph_breaks']}, "
                f"graphs: {counted['graphs']}",
                status,
                None,
                None,
            )
        ]

    def hf_patched_against_unpatched():
        """The Hugging Face rows' step function on a tiny Llama: patched as unpatched (two
        steps, so that the gradients are compared too)."""
        import copy

        import fastlm.hf

        tiny = hf_llama(TINY, TINY_SEQ, device="cpu")
        with torch.no_grad():  # off Hugging Face's small init, so that the logits differ a lot
            for p in tiny.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        patched = fastlm.hf.patch(copy.deepcopy(tiny))
        losses = []
        for m in (tiny, patched):  # the second step's loss: the gradients of the first count too
            step = make_step(m, hf_loss, ids, targets, autocast=False)
            step()
            losses.append(float(step()))
        err = abs(losses[1] - losses[0]) / abs(losses[0])
        bound = TOLERANCE[torch.float32]
        name = "HF Llama + fastlm.hf.patch: loss after a step"
        return [(name, "ok" if err <= bound else "FAIL", err, bound)]

    # Gradients first (the reference step below changes the weights).
    rows += common.try_check("fastlm.Transformer", fastlm_against_reference)
    if common.optional_module("transformers") is not None:
        rows += common.try_check("HF Llama + fastlm.hf.patch", hf_patched_against_unpatched)
    rows += common.try_check("reference step", reference_step)
    rows += common.try_check("torch.compile(fastlm) graph breaks", graph_breaks)
    return common.report_checks(rows)


@contextlib.contextmanager
def _environ(**values: str):
    """Environment variables set inside the with-block, restored after it."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = common.parser(
        __doc__.split("\n\n")[0],
        quick_help=(
            f"{QUICK_LAYERS} layers, seq 1024 only, 3 timed steps, within a {QUICK_TIME_LIMIT_S} s "
            "time budget"
        ),
    )
    p.add_argument(
        "--seqs",
        type=int,
        nargs="+",
        default=None,
        help="sequence lengths (default 1024 2048; --quick: 1024)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=16384,
        help="tokens per step, batch x seq (default 16384, the same for every row; "
        "train.py's docstring says why)",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help=f"transformer blocks (default 12; --quick: {QUICK_LAYERS})",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --quick: 3)")
    p.add_argument(
        "--warmup-steps", type=int, default=3, help="untimed steps first (the first one compiles)"
    )
    args = p.parse_args(argv)
    if not common.HAS_CUDA:
        common.no_cuda_notice("benchmarks/train.py")
        return interpreter_check()

    quick = args.quick and not args.headline  # the headline is the full 12-layer model
    args.seqs = args.seqs or ([1024] if quick else [1024, 2048])
    args.steps = args.steps or (3 if quick else 10)
    layers = args.layers or (QUICK_LAYERS if quick else Config.num_layers)
    config = Config(num_layers=layers)
    common.raise_compile_limits()
    run = common.Run("train", args, QUICK_TIME_LIMIT_S, COLUMNS)
    run.header()
    with run.interruptible():
        bench(run, config, cases(args), args.tokens)
    add_comparisons(run.rows)
    for text in graph_break_notes(run.extra.get("graph_breaks", {})):
        run.note(text)
    return run.finish(
        summary=summary_lines(run.rows),
        plot={
            "x": "impl",
            "y": "tokens/s",
            "series": "seq",
            "panel": ("layers",),
            "title": f"training step, {run.env['gpu']}",
        },
    )


if __name__ == "__main__":
    sys.exit(main())
