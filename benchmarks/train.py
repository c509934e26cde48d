"""One training step: tokens per second and peak memory.

A step is the loss under bf16 autocast (fp32 parameters), backward, a `torch.optim.AdamW(fused=
True)` step and the gradients set to None: the same optimizer for every row, so rows differ
only in the model. Columns: ms/step, tokens/s and its ratio to each row's baseline, peak memory
(torch.cuda.max_memory_allocated over the timed steps: parameters, gradients, optimizer state,
activations), the first step's loss (every row starts from the same weights and data, so these
agree: the rows' check of one another) and seconds (compilation and autotuning included), and
for compiled rows the graph breaks dynamo counted while tracing the first step (their reasons in
the JSON under `graph_breaks`).

GPT-2-small rows (default): vocab 32000, d_model 768, 12 layers, 12 heads, d_ff 2048, at sequence
1024 and 2048 with 16384 tokens a step (--tokens) for every row rather than a batch grown until
memory is full, so every row does the same work (the eager reference keeps B x H x N^2 scores a
layer). 16384 tokens fill the chip: the narrowest matmul (16384 x 768) is 768 tiles of 128 x 128,
almost six per SM of an H100 or H200, and attention has 1536 query blocks of 128 rows. Rows, in
the order measured: `fastlm.Transformer` compiled and the reference with
F.scaled_dot_product_attention(is_causal=True) compiled (the headline: `--headline`, seq 1024, 12
layers); then fastlm eager, the reference (`fastlm.reference.Transformer`, its loss on fp32 logits
as fastlm.cli.train computes it) eager and compiled. `vs reference`: against the eager reference.

Hugging Face rows (`--hf`, files train_hf.*): a `LlamaForCausalLM` with Llama-3-8B's layer sizes
(hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocab 128256, RoPE theta 500000) and a
few layers (--layers, default 4; --quick 2), on Liger-Kernel's published benchmark shape: a batch
of 8 sequences of up to 4096 tokens, here 8 documents of mixed lengths (log-uniform, 256 to 4096
tokens), fed as trainers build batches: padded (right-padded to the longest, `attention_mask`
with zeros, labels -100 at the pads) and padding-free (one row, `position_ids` restarting at each
document, and `cu_seq_lens_q/k`, `max_length_q/k` as DataCollatorWithFlattening(
return_flash_attn_kwargs=True) makes them). Rows: Hugging Face unpatched (SDPA), patched with
`fastlm.hf.patch`, `fastlm.Transformer` of the same weights (`fastlm.hf.from_hf`) on the packed
documents (`cu_seqlens`), and last (it patches transformers' Llama classes for every later
model) Liger-Kernel's `apply_liger_kernel_to_llama`, each batch shape. tokens/s counts the
documents' tokens, not the padding; `vs HF padded`: against unpatched Hugging Face padded.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import _common as common  # first: this checkout's fastlm
import torch
import torch.nn.functional as F

import fastlm
from fastlm import reference

GPT2 = dict(vocab_size=32000, d_model=768, num_layers=12, num_heads=12, d_ff=2048)
BUDGET_S = 85
REF_EAGER, REF_COMPILED = "reference", "torch.compile(reference)"
SDPA_COMPILED, FASTLM_COMPILED = "torch.compile(reference + SDPA)", "torch.compile(fastlm)"
HEADLINE = [FASTLM_COMPILED, SDPA_COMPILED]  # first: a spent budget skips the least needed rows
KINDS = [*HEADLINE, "fastlm", REF_EAGER, REF_COMPILED]
LLAMA3_LAYERS = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336)
LLAMA3_LAYERS |= dict(num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0)
LLAMA3_LAYERS |= dict(rms_norm_eps=1e-5, tie_word_embeddings=False)
LLAMA3_LAYERS["max_position_embeddings"] = 32768  # fastlm's packed row: every document at once
HF_DOCS, HF_SHORTEST, HF_LONGEST = 8, 256, 4096
HF, PATCHED, LIGER, VARLEN = "HF", "HF + fastlm.hf.patch", "HF + Liger", "fastlm.Transformer varlen"
PADDED, PADDING_FREE = "padded", "padding-free"
HF_KINDS = [(HF, PADDED), (HF, PADDING_FREE), (PATCHED, PADDED), (PATCHED, PADDING_FREE)]
HF_KINDS += [(VARLEN, PADDING_FREE), (LIGER, PADDED), (LIGER, PADDING_FREE)]
COLUMNS = ["seq", "batch", "layers", "impl", "ms/step", "tokens/s", "vs reference"]
COLUMNS += ["vs compiled SDPA", "peak GiB", "first loss", "first step s", "graph breaks"]
HF_COLUMNS = ["layers", "impl", "batch", "shape", "tokens", "ms/step", "tokens/s", "vs HF padded"]
HF_COLUMNS += ["peak GiB", "first loss", "first step s"]


@dataclass
class Measured:
    ms: float
    peak_gib: float
    first_loss: float
    first_step_s: float
    compiled: dict | None  # count_graph_breaks' counts for a compiled row


def make_step(model, loss_fn, batch: dict):
    """One training step as a function: loss_fn(model, **batch) under bf16 autocast, backward,
    AdamW step, gradients to None; returns the loss."""
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(model, **batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def count_graph_breaks(call) -> tuple[object, dict]:
    """call()'s result and what dynamo counted while it ran: graph breaks (in all and by reason)
    and the graphs it compiled. A model traced whole gives 0 breaks, 1 graph."""
    from torch._dynamo.utils import counters

    counters.clear()
    result = call()
    reasons = {str(reason): count for reason, count in counters["graph_break"].items()}
    counted = {"graph_breaks": sum(reasons.values()), "graphs": counters["stats"]["unique_graphs"]}
    return result, counted | {"reasons": reasons}


def measure(model, loss_fn, batch: dict, compiled: bool, args) -> Measured:
    """The step's first loss and seconds, then `--steps` timed after `--warmup-steps`."""
    step = make_step(model, torch.compile(loss_fn) if compiled else loss_fn, batch)
    start = time.perf_counter()
    first_loss, counted = count_graph_breaks(lambda: float(step()))  # float() waits for the GPU
    first_step_s = time.perf_counter() - start
    for _ in range(args.warmup_steps - 1):
        step()
    torch.cuda.reset_peak_memory_stats()
    ms = common.time_steps_ms(step, args.steps)
    peak = torch.cuda.max_memory_allocated() / 2**30
    return Measured(ms, peak, first_loss, first_step_s, counted if compiled else None)


def bench(run: common.Run, cases) -> None:
    """Measure each case (row, tokens a step, make): make() gives (model, loss_fn, batch,
    compiled?); a row of `row`'s fields and the measurement's cells."""
    with run.measuring():
        for row, tokens, make in cases:
            if run.out_of_time():
                break
            label = " ".join(f"{k}={v}" for k, v in row.items())
            outcome = run.measure(lambda: measure(*make(), run.args), label)  # noqa: B023
            torch._dynamo.reset()  # drop compiled graphs (and what their guards hold)
            common.free_memory()
            if not isinstance(outcome, Measured):
                run.add(row | {"ms/step": outcome, "peak GiB": outcome})
                continue
            if outcome.compiled:
                run.extra.setdefault("graph_breaks", {})[label] = outcome.compiled
            m, breaks = outcome, (outcome.compiled or {}).get("graph_breaks")
            cells = {"ms/step": m.ms, "tokens/s": tokens / (m.ms * 1e-3), "peak GiB": m.peak_gib}
            cells |= {"first loss": m.first_loss, "first step s": m.first_step_s}
            run.add(row | cells | {"graph breaks": breaks})


# --------------------------------------------------------------------------------------------
# GPT-2-small: fastlm against the reference
# --------------------------------------------------------------------------------------------


class SdpaAttention(torch.nn.Module):
    """reference.ScaledDotProductAttention by PyTorch's fused attention (the reference model
    always passes the causal mask, so is_causal=True replaces it)."""

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def reference_loss(model, ids, targets):
    """The reference model's loss, on float32 logits as in fastlm.cli.train."""
    return reference.CrossEntropyLoss()(model(ids).float(), targets)


def build(kind: str, config: dict):
    """(model, loss_fn(model, ids, targets)) of a row; every row has the same weights."""
    torch.manual_seed(0)
    ref = reference.Transformer(**config, rope_theta=10000.0, device=common.DEVICE)
    if kind == SDPA_COMPILED:
        for block in ref.blocks:
            block.mult_head_atten.attention = SdpaAttention()
    if kind in (REF_EAGER, REF_COMPILED, SDPA_COMPILED):
        return ref, reference_loss
    model = fastlm.Transformer(**config, rope_theta=10000.0, device=common.DEVICE)
    model.load_state_dict(ref.state_dict())
    return model, lambda model, ids, targets: model.loss(ids, targets)


def gpt2_cases(args, todo, layers: int):
    for seq, kind in todo:
        batch = max(1, args.tokens // seq)

        def make(kind=kind, seq=seq, batch=batch):
            model, loss_fn = build(kind, GPT2 | dict(num_layers=layers, context_length=seq))
            generator = torch.Generator(common.DEVICE).manual_seed(1)
            size = (2, batch, seq)
            vocab = GPT2["vocab_size"]
            ids, targets = torch.randint(vocab, size, device=common.DEVICE, generator=generator)
            return model, loss_fn, dict(ids=ids, targets=targets), kind.startswith("torch.compile")

        yield dict(seq=seq, batch=batch, layers=layers, impl=kind), batch * seq, make


def gpt2_main(args) -> int:
    quick = args.quick and not args.headline  # the headline is the whole 12-layer model
    seqs = args.seqs or ([1024] if quick else [1024, 2048])
    args.steps = args.steps or (3 if quick else 10)
    layers = args.layers or (4 if quick else GPT2["num_layers"])
    todo = [(1024, kind) for kind in HEADLINE] if args.headline else []
    todo = todo or [(seq, kind) for seq in seqs for kind in KINDS]
    if args.skip_headline:
        todo = [(seq, kind) for seq, kind in todo if seq != 1024 or kind not in HEADLINE]
    run = common.Run("train", args, COLUMNS, BUDGET_S)
    bench(run, gpt2_cases(args, todo, layers))
    for column, baseline in (("vs reference", REF_EAGER), ("vs compiled SDPA", SDPA_COMPILED)):
        common.add_ratios(run.rows, column, baseline, ("seq",), "tokens/s", higher_is_better=True)
    columns = [c for c in COLUMNS if any(row.get(c) is not None for row in run.rows)]
    title = "Training step, bf16 autocast, AdamW (vs X: tokens/s over X's):"
    summary = common.table_lines(title, run.rows, columns)
    for label, counted in run.extra.get("graph_breaks", {}).items():
        reasons = [f"{n}x {r.splitlines()[0][:160]}" for r, n in counted["reasons"].items()]
        breaks = f"{counted['graph_breaks']} graph break(s), {counted['graphs']} graph(s)"
        summary.append(f"- {label}: {breaks}" + "".join(f"; {r}" for r in reasons))
    return run.finish(summary)


# --------------------------------------------------------------------------------------------
# Hugging Face Llama: padded and padding-free batches
# --------------------------------------------------------------------------------------------


def document_lengths(count: int = HF_DOCS, seed: int = 0) -> list[int]:
    """`count` lengths, log-uniform from HF_SHORTEST to HF_LONGEST tokens, the same every run."""
    generator = torch.Generator().manual_seed(seed)
    ratio = torch.log2(torch.tensor(HF_LONGEST / HF_SHORTEST))
    exponents = torch.rand(count, generator=generator) * ratio
    return [int(HF_SHORTEST * 2**e) for e in exponents.tolist()]


def hf_batches(lengths: list[int], vocab_size: int, device) -> dict[str, dict]:
    """The same documents as trainers batch them: {"padded": model kwargs, "padding-free":
    model kwargs, "packed": fastlm.Transformer.loss kwargs}. Every form counts the same
    predictions: each document's next tokens, nothing across documents or from padding."""
    from transformers import DataCollatorWithFlattening

    generator = torch.Generator().manual_seed(1)
    docs = [torch.randint(vocab_size, (n,), generator=generator) for n in lengths]
    longest = max(lengths)
    ids = torch.zeros(len(docs), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, doc in enumerate(docs):
        ids[row, : len(doc)], mask[row, : len(doc)] = doc, 1
    labels = ids.masked_fill(mask == 0, -100)
    padded = dict(input_ids=ids, attention_mask=mask, labels=labels)
    flat = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    padding_free = flat([{"input_ids": doc.tolist()} for doc in docs])
    # fastlm's loss takes unshifted targets: each token's next one, -100 at a document's end
    # (the flattened labels hold -100 at each document's start).
    targets = torch.cat((padding_free["labels"][:, 1:], torch.full((1, 1), -100)), dim=1)
    cu = padding_free["cu_seq_lens_q"]
    packed = dict(ids=padding_free["input_ids"], targets=targets, cu_seqlens=cu, max_seqlen=longest)
    batches = {PADDED: padded, PADDING_FREE: padding_free, "packed": packed}
    move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    return {name: {k: move(v) for k, v in batch.items()} for name, batch in batches.items()}


def hf_loss(model, **batch):
    return model(**batch, use_cache=False).loss


def packed_loss(model, ids, targets, cu_seqlens, max_seqlen):
    return model.loss(ids, targets, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)


def hf_model(kind: str, config: dict, device=common.DEVICE):
    """(model, loss_fn) of a Hugging Face row: the same weights for every row (one seed)."""
    import transformers

    import fastlm.hf

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).train()
    if kind == PATCHED:
        fastlm.hf.patch(model)
    elif kind == LIGER:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)
    elif kind == VARLEN:
        return fastlm.hf.from_hf(model).train(), packed_loss
    return model, hf_loss


def hf_main(args) -> int:
    args.steps = args.steps or (3 if args.quick else 10)
    layers = args.layers or (2 if args.quick else 4)
    config, lengths = LLAMA3_LAYERS | dict(num_hidden_layers=layers), document_lengths()
    run = common.Run("train_hf", args, HF_COLUMNS, BUDGET_S)
    if common.optional_module("liger_kernel.transformers") is None:
        run.note("Liger-Kernel is not installed: its rows are n/a")
    shapes = {PADDED: f"{len(lengths)}x{max(lengths)}", PADDING_FREE: f"1x{sum(lengths)}"}

    def cases():
        for kind, shape in HF_KINDS:
            batch = "packed" if kind == VARLEN else shape

            def make(kind=kind, batch=batch):
                batches = hf_batches(lengths, config["vocab_size"], common.DEVICE)
                return (*hf_model(kind, config), batches[batch], False)

            row = dict(layers=layers, impl=kind, batch=shapes[shape], shape=shape)
            yield row | dict(tokens=sum(lengths)), sum(lengths), make

    bench(run, cases())
    base = [r["tokens/s"] for r in run.rows if r["impl"] == HF and r["shape"] == PADDED]
    for row in run.rows:  # tokens/s over unpatched Hugging Face's on the padded batch
        ours, theirs = common.number(row.get("tokens/s")), common.number(base[0] if base else None)
        row["vs HF padded"] = ours / theirs if ours and theirs else None
    title = (
        f"Hugging Face Llama, Llama-3-8B layer sizes, {layers} layers, {HF_DOCS} documents of "
        f"{min(lengths)} to {max(lengths)} tokens (vs HF padded: tokens/s over unpatched HF's):"
    )
    return run.finish(common.table_lines(title, run.rows, HF_COLUMNS))


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.split("\n\n")[0], "fewer layers, seq 1024 only, 3 timed steps")
    p.add_argument("--hf", action="store_true", help="the Hugging Face Llama rows instead")
    p.add_argument("--seqs", type=int, nargs="+", help="sequence lengths (default 1024 2048)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens a step, batch x seq")
    p.add_argument("--layers", type=int, help="blocks (default 12, --hf 4; --quick 4, --hf 2)")
    p.add_argument("--steps", type=int, help="timed steps (default 10; --quick 3)")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps, compiling first")
    args = p.parse_args(argv)
    if common.no_cuda("benchmarks/train.py"):
        return 0
    common.raise_compile_limits()
    return hf_main(args) if args.hf else gpt2_main(args)


if __name__ == "__main__":
    sys.exit(main())
