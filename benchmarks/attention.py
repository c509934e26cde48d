"""Causal attention: fastlm's flash_attention against PyTorch's and the reference's.

Forward, backward and forward+backward, causal, q, k, v (B, H, N, D) with H = 2048 / D, at
batch 1 and at a batch that fills the GPU (B = 16384 / N, at least 1); N 128 to 65536, D 16 to
128, bf16 and fp32. Side by side: fastlm (its backward also with `deterministic=False`, dQ by
atomics: `fastlm atomic-dQ`), the reference attention (explicit [N x N] softmax) eager and under
`torch.compile`, F.scaled_dot_product_attention with each backend pinned (flash, cuDNN,
memory-efficient), and flash-attn when it imports. Columns: ms, TFLOP/s (the FlashAttention
papers' causal count: forward 4 B H N^2 D / 2, backward 2.5x that, both 3.5x), speed-ups over
SDPA-flash and the eager reference, and the output's relative error against SDPA's own choice.
fp32: fastlm's dots may run as tf32; the reference and SDPA use PyTorch's settings.

`--headline`: bf16, D = 128, the GPU filled at N = 4096 and 16384, forward and forward+backward,
fastlm (both backward schedules) against SDPA's flash and cuDNN backends.

`--varlen`: packed documents instead (bf16, D = 128, H = 16, causal; log-uniform lengths of 16
to 8192 tokens totalling 16k, 32k and 64k): fastlm's flash_attention_varlen, fastlm on the
documents padded to the longest (the scatter and gather timed too), SDPA with a block-diagonal
causal mask, FlexAttention with a document mask, flash-attn's varlen (masks built once, outside
the timing; errors against attention per document); then a causal window of 4096 keys at N =
32k against FlexAttention's sliding-window mask and flash-attn's window. TFLOP/s count only the
attended pairs. Files attention_varlen.*.

`--families`: the newer families' attention (bf16, causal, the layer at batch 1, N = 4k and 16k):
gpt-oss-20b's (head dim 64, 64 query and 8 KV heads, learned sinks; a sliding window of 128 keys
on alternate layers, full causal on the others) by fastlm (`sinks=`) against transformers'
eager attention (the sinks a column of the B x H x N x N scores) and FlexAttention (its
log-sum-exp corrected for the sink); DeepSeek's MLA (q and k 192, v 128, 16 heads) by fastlm
(v's own head dim) against SDPA with v padded to 192 (what transformers' flash-attention path
does) and SDPA with v as it is; Gemma 4's global layer (head dim 512, 8 query and 4 KV heads:
transformers' Gemma4TextConfig) by fastlm against SDPA (grouped heads; above head dim 256 it
takes its math kernel) and FlexAttention with a causal block mask. Errors against the eager
(gpt-oss), padded (MLA) and SDPA (Gemma 4) rows. TFLOP/s count the attended pairs: 2 (D + Dv)
flops each forward. Files attention_families.*.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from functools import partial

import _common as common  # first: this checkout's fastlm
import torch
import torch.nn.functional as F

from fastlm import reference
from fastlm.kernels.attention import (
    flash_attention,
    flash_attention_varlen,
    flash_attention_varlen_ref,
)

HIDDEN, FILL_TOKENS, BUDGET_S = 2048, 16384, 160  # heads x head dim; B x N of a filled GPU
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
EAGER, COMPILED, SDPA_FLASH = "reference", "torch.compile(reference)", "sdpa-flash"
ATOMIC = "fastlm atomic-dQ"  # its forward is fastlm's: timed where a backward runs
IMPL_MODES = {ATOMIC: ("bwd", "fwd+bwd")}
HEADLINE = {"fastlm": ("fwd", "fwd+bwd"), ATOMIC: ("fwd+bwd",)}
HEADLINE |= {SDPA_FLASH: ("fwd", "fwd+bwd"), "sdpa-cudnn": ("fwd", "fwd+bwd")}
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
KEY = ("dtype", "D", "B", "N", "mode")
COLUMNS = [*KEY[:3], "H", "N", "mode", "impl", "ms", "TFLOP/s", "vs sdpa-flash", "vs reference"]
COLUMNS.append("rel err")


@dataclass(frozen=True)
class Shape:
    dtype: str
    head_dim: int
    batch: int
    seq: int

    @property
    def heads(self) -> int:
        return HIDDEN // self.head_dim

    def __str__(self) -> str:
        return f"{self.dtype} D={self.head_dim} B={self.batch} N={self.seq}"


def filled(n: int, dtype: str = "bf16", d: int = 128) -> Shape:
    return Shape(dtype, d, max(1, FILL_TOKENS // n), n)


def headline_shapes() -> list[Shape]:
    return [filled(n) for n in (4096, 16384)]


def plan(args) -> list[tuple[Shape, dict]]:
    """(shape, {impl: modes}) in the order measured; an impl absent from the dict runs its
    IMPL_MODES (default all). --quick: bf16, D = 128, the GPU filled at 1k, 4k, 16k, and batch
    1 at 64k (where the reference runs out of memory); a full sweep starts with those."""
    if args.headline:
        return [(shape, dict(HEADLINE)) for shape in headline_shapes()]
    shapes = [filled(n) for n in (1024, 4096, 16384)] + [Shape("bf16", 128, 1, 65536)]
    if not args.quick:
        shapes += [
            Shape(t, d, b, 2**p)
            for t in DTYPES
            for d in (16, 32, 64, 128)
            for b in (1, None)
            for p in range(7, 17)
        ]
        shapes = [filled(s.seq, s.dtype, s.head_dim) if s.batch is None else s for s in shapes]
    rest = {
        k: tuple(m for m in IMPL_MODES.get(k, common.MODES) if m not in v)
        for k, v in HEADLINE.items()
    }
    skip = args.skip_headline
    return [
        (s, dict(rest) if skip and s in headline_shapes() else {}) for s in dict.fromkeys(shapes)
    ]


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return run


def _sdpa_default(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _reference(compiled: bool):
    """The reference attention with its causal mask, built once per sequence length."""
    attend = reference.ScaledDotProductAttention()
    attend = torch.compile(attend, dynamic=False) if compiled else attend
    masks = {}

    def run(q, k, v):
        n = q.shape[-2]
        if n not in masks:
            masks.clear()
            masks[n] = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        return attend(q, k, v, masks[n])

    return run


def _flash_attn(**options):
    """flash-attn's flash_attn_func on (B, H, N, D) (it wants (B, N, H, D): views, no copy)."""
    flash_attn = common.optional_module("flash_attn")
    if flash_attn is None:
        return None
    bnhd = lambda *ts: (t.transpose(1, 2) for t in ts)  # noqa: E731
    return lambda q, k, v: flash_attn.flash_attn_func(*bnhd(q, k, v), **options).transpose(1, 2)


def implementations() -> dict:
    """The implementations that run here, in table order."""
    from torch.nn.attention import SDPBackend

    impls = {"fastlm": lambda q, k, v: flash_attention(q, k, v, causal=True)}
    impls[ATOMIC] = lambda q, k, v: flash_attention(q, k, v, causal=True, deterministic=False)
    impls[SDPA_FLASH] = _sdpa(SDPBackend.FLASH_ATTENTION)
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        impls["sdpa-cudnn"] = _sdpa(SDPBackend.CUDNN_ATTENTION)
    impls["sdpa-efficient"] = _sdpa(SDPBackend.EFFICIENT_ATTENTION)
    if _flash_attn() is not None:
        impls["flash-attn"] = _flash_attn(causal=True)
    impls[EAGER], impls[COMPILED] = _reference(False), _reference(True)
    return impls


def random_inputs(*shape, dtype=torch.bfloat16):
    return [torch.randn(shape, device=common.DEVICE, dtype=dtype).requires_grad_() for _ in "qkv"]


def bench(run, cases) -> None:
    """Measure each case (row, build, flops, modes): build() gives (impls, inputs, reference);
    each implementation's output is checked against the reference's once, then it is timed in
    its modes ({impl: modes}, default IMPL_MODES or all): a row per mode. flops: the forward's."""
    with run.measuring():
        for row, build, flops, modes in cases:
            if run.out_of_time():
                break
            built = run.measure(build, f"inputs {row}")
            impls, inputs, reference_fn = ({}, [], None) if isinstance(built, str) else built
            for name, fn in impls.items():
                label = f"{name} " + " ".join(f"{k}={v}" for k, v in row.items())
                check = lambda: common.output_error(fn, reference_fn, inputs)  # noqa: B023, E731
                measured = {**row, "impl": name, "rel err": run.measure(check, f"{label} check")}
                chosen = modes.get(name, IMPL_MODES.get(name, common.MODES))
                for mode, ms in common.time_modes(run, fn, inputs, label, chosen).items():
                    t = common.number(ms)
                    tflops = FLOP_FACTOR[mode] * flops / (t * 1e-3) / 1e12 if t else None
                    run.add({**measured, "mode": mode, "ms": ms, "TFLOP/s": tflops})
            built = impls = inputs = None  # freed before the next case allocates
            common.free_memory()


def causal_main(args, impls) -> int:
    run = common.Run("attention", args, COLUMNS, BUDGET_S)
    if _flash_attn() is None:
        run.note("the flash-attn package is not installed: its rows are left out")
    cases = (
        (
            dict(dtype=s.dtype, D=s.head_dim, B=s.batch, H=s.heads, N=s.seq),
            lambda s=s: (
                impls,
                random_inputs(s.batch, s.heads, s.seq, s.head_dim, dtype=DTYPES[s.dtype]),
                _sdpa_default,
            ),
            2 * s.batch * s.heads * s.seq**2 * s.head_dim,
            modes,
        )
        for s, modes in plan(args)
    )
    bench(run, cases)
    for column, baseline in (("vs sdpa-flash", SDPA_FLASH), ("vs reference", EAGER)):
        common.add_ratios(run.rows, column, baseline, KEY, "ms")
    ours = [r for r in run.rows if r["dtype"] == "bf16" and r["D"] == 128]
    title = "Causal attention, bf16, D = 128, H = 16 (vs X = X's ms / fastlm's):"
    summary = common.table_lines(title, common.versus(ours, ("N", "B", "mode"), ("TFLOP/s", "ms")))
    status = run.finish(summary, KEY)
    if args.out:
        print(plot(run.rows, args.out / f"{run.name}.png", f"causal attention, {run.env['gpu']}"))
    return status


def plot(rows: list[dict], path, title: str) -> str:
    """TFLOP/s against N, a line per implementation, a panel per dtype, D, batch and mode."""
    os.environ.setdefault("MPLBACKEND", "Agg")  # no display needed
    plt = common.optional_module("matplotlib.pyplot")
    rows = [r for r in rows if common.number(r["TFLOP/s"])]
    if plt is None or not rows:
        return f"no plot: {'no matplotlib' if plt is None else 'nothing measured'}"
    panel = lambda r: (r["dtype"], r["D"], "1" if r["B"] == 1 else "fill", r["mode"])  # noqa: E731
    panels = list(dict.fromkeys(map(panel, rows)))
    cols, lines = min(3, len(panels)), -(-len(panels) // 3)
    fig, axes = plt.subplots(lines, cols, figsize=(5.5 * cols, 4 * lines), squeeze=False)
    for ax, key in zip(axes.flat, panels):
        mine = [r for r in rows if panel(r) == key]
        for name in dict.fromkeys(r["impl"] for r in mine):
            points = sorted((r["N"], r["TFLOP/s"]) for r in mine if r["impl"] == name)
            ax.plot(*zip(*points), marker="o", label=name)
        ax.set(title="dtype={}, D={}, batch={}, {}".format(*key), xlabel="N", ylabel="TFLOP/s")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


# --------------------------------------------------------------------------------------------
# Packed documents (--varlen) and the sliding window
# --------------------------------------------------------------------------------------------

VARLEN_TOTALS, HEADS, HEAD_DIM, WINDOW, WINDOW_SEQ = (16384, 32768, 65536), 16, 128, 4096, 32768
VARLEN_KEY = ("case", "tokens", "mode")
VARLEN_COLUMNS = ["case", "tokens", "docs", "longest", "mode", "impl", "ms", "TFLOP/s"]
VARLEN_COLUMNS += ["vs fastlm", "rel err"]


def document_lengths(total: int, seed: int = 0) -> list[int]:
    """Mixed document lengths summing to `total`: log-uniform from 16 to 8192 tokens (many short
    documents beside a few long ones, as in a packed pre-training batch), the last one cut."""
    generator = torch.Generator().manual_seed(seed + total)
    lengths = []
    while sum(lengths) < total:
        length = int(2 ** (4 + 9 * torch.rand((), generator=generator).item()))
        lengths.append(min(length, total - sum(lengths)))
    return lengths


@dataclass(frozen=True)
class Packed:
    """One packed batch: its document lengths and the tensors every implementation shares."""

    lengths: tuple[int, ...]
    cu_seqlens: torch.Tensor  # int32 (docs + 1,)
    doc_ids: torch.Tensor  # (tokens,) document of each token
    positions: torch.Tensor  # (tokens,) position of each token within its document

    @classmethod
    def of(cls, lengths: list[int]) -> Packed:
        lengths_t = torch.tensor(lengths, device=common.DEVICE)
        cu = torch.nn.functional.pad(lengths_t.cumsum(0), (1, 0)).to(torch.int32)
        doc_ids = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths_t)
        positions = torch.arange(int(cu[-1]), device=cu.device) - cu[doc_ids].long()
        return cls(tuple(lengths), cu, doc_ids, positions)


def _flex_attention():
    """(compiled flex_attention, create_block_mask), or None where this torch has none."""
    module = common.optional_module("torch.nn.attention.flex_attention")
    if module is None:
        return None
    return torch.compile(module.flex_attention, dynamic=False), module.create_block_mask


def _one_row(fn):
    """fn on (1, H, tokens, D) as a function of packed (tokens, H, D)."""
    return lambda q, k, v: fn(*(t.transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)


def varlen_implementations(packed: Packed) -> dict:
    """Each takes packed q, k, v (tokens, H, D) and returns o (tokens, H, D); masks, block masks
    and indices are built here, once, outside the timing."""
    cu, ids, rows, longest = (
        packed.cu_seqlens,
        packed.doc_ids,
        packed.positions,
        max(packed.lengths),
    )
    impls = {"fastlm": lambda q, k, v: flash_attention_varlen(q, k, v, cu, cu, longest, longest)}

    def padded(q, k, v):  # document d's token t at [d, t] of (docs, longest, H, D)
        batch = [t.new_zeros(len(packed.lengths), longest, *t.shape[1:]) for t in (q, k, v)]
        for padded_t, t in zip(batch, (q, k, v)):
            padded_t[ids, rows] = t
        o = flash_attention(*(t.transpose(1, 2) for t in batch), causal=True)
        return o.transpose(1, 2)[ids, rows]

    impls["fastlm padded"] = padded
    mask = (ids[:, None] == ids[None, :]).tril()
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
    impls["sdpa block-diagonal mask"] = _one_row(sdpa)
    flex = _flex_attention()
    if flex is not None:
        causal = lambda b, h, i, j: (ids[i] == ids[j]) & (i >= j)  # noqa: E731
        block_mask = flex[1](causal, None, None, len(ids), len(ids))
        impls["flex document mask"] = _one_row(partial(flex[0], block_mask=block_mask))
    flash_attn = common.optional_module("flash_attn")
    if flash_attn is not None:
        varlen = partial(flash_attn.flash_attn_varlen_func, causal=True)
        impls["flash-attn varlen"] = lambda q, k, v: varlen(q, k, v, cu, cu, longest, longest)
    return impls


def varlen_reference(packed: Packed):
    """Attention of each document on its own (`flash_attention_varlen_ref`)."""
    return lambda q, k, v: flash_attention_varlen_ref(q, k, v, packed.cu_seqlens, packed.cu_seqlens)


def window_implementations() -> dict:
    """Causal attention over WINDOW keys, q, k, v (1, H, WINDOW_SEQ, D)."""
    impls = {"fastlm": lambda q, k, v: flash_attention(q, k, v, window_size=(WINDOW, 0))}
    flex = _flex_attention()
    if flex is not None:
        sliding = lambda b, h, i, j: (i >= j) & (i - j <= WINDOW)  # noqa: E731
        block_mask = flex[1](sliding, None, None, WINDOW_SEQ, WINDOW_SEQ)
        impls["flex sliding window"] = partial(flex[0], block_mask=block_mask)
    if _flash_attn() is not None:
        impls["flash-attn window"] = _flash_attn(causal=True, window_size=(WINDOW, 0))
    return impls


def varlen_cases(totals):
    """The packed batches, then the window (checked against the first implementation other than
    fastlm's: an explicit mask over 32k keys would not fit)."""
    for total in totals:
        lengths = document_lengths(total)
        row = dict(case="varlen causal", tokens=total, docs=len(lengths), longest=max(lengths))

        def build(lengths=lengths, total=total):
            packed = Packed.of(lengths)
            inputs = random_inputs(total, HEADS, HEAD_DIM)
            return varlen_implementations(packed), inputs, varlen_reference(packed)

        yield row, build, sum(2 * HEADS * n * n * HEAD_DIM for n in lengths), {}
    row = dict(case=f"causal window {WINDOW}", tokens=WINDOW_SEQ, docs=1, longest=WINDOW_SEQ)

    def build_window():
        impls = window_implementations()
        others = [fn for name, fn in impls.items() if name != "fastlm"] or [impls["fastlm"]]
        return impls, random_inputs(1, HEADS, WINDOW_SEQ, HEAD_DIM), others[0]

    pairs = sum(min(i + 1, WINDOW + 1) for i in range(WINDOW_SEQ))  # keys each query sees
    yield row, build_window, 2 * HEADS * pairs * HEAD_DIM, {}


def varlen_main(args) -> int:
    run = common.Run("attention_varlen", args, VARLEN_COLUMNS, BUDGET_S)
    bench(run, varlen_cases(VARLEN_TOTALS[:2] if args.quick else VARLEN_TOTALS))
    common.add_ratios(run.rows, "vs fastlm", "fastlm", VARLEN_KEY, "ms", higher_is_better=True)
    title = "Packed documents and a sliding window, bf16, D = 128, H = 16 (vs X: X's ms / fastlm's)"
    table = common.versus(run.rows, VARLEN_KEY, ("ms", "TFLOP/s"))
    return run.finish(common.table_lines(title, table), group_by=VARLEN_KEY)


# --------------------------------------------------------------------------------------------
# The newer families (--families): gpt-oss's sinks and windows, MLA's value head dim
# --------------------------------------------------------------------------------------------

GPT_OSS = dict(heads=64, kv_heads=8, head_dim=64, window=128)
MLA = dict(heads=16, head_dim=192, head_dim_v=128)
GEMMA4_GLOBAL = dict(heads=8, kv_heads=4, head_dim=512)
FAMILY_SEQS = (4096, 16384)
FAMILY_KEY = ("case", "N", "mode")
FAMILY_COLUMNS = ["case", "N", "mode", "impl", "ms", "TFLOP/s", "vs fastlm", "rel err"]


def gpt_oss_eager(window: int | None):
    """transformers' eager attention of gpt-oss: k and v repeated over the groups, the scores
    with the causal (and sliding-window) mask, the sinks a last column, softmax, the column
    dropped."""
    masks = {}

    def run(q, k, v, sinks):
        n, group = q.shape[-2], q.shape[1] // k.shape[1]
        if n not in masks:
            i = torch.arange(n, device=q.device)
            visible = i[None, :] <= i[:, None]
            if window is not None:
                visible &= i[:, None] - i[None, :] < window
            masks.clear()
            masks[n] = torch.zeros(n, n, device=q.device).masked_fill(~visible, -math.inf)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + masks[n]
        column = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        logits = torch.cat([scores, column.to(scores.dtype)], -1)
        logits = logits - logits.max(-1, keepdim=True).values
        probs = logits.softmax(-1, dtype=logits.dtype)[..., :-1]
        return probs @ v

    return run


def gpt_oss_flex(window: int | None):
    """FlexAttention with grouped heads and a causal (sliding) block mask; the sink enters
    through the log-sum-exp: o * exp(lse) / (exp(lse) + exp(sink)) = o * sigmoid(lse - sink)."""
    flex = _flex_attention()
    if flex is None:
        return None
    masks = {}

    def run(q, k, v, sinks):
        n = q.shape[-2]
        if n not in masks:
            if window is None:
                mask = lambda b, h, i, j: i >= j  # noqa: E731
            else:
                mask = lambda b, h, i, j: (i >= j) & (i - j < window)  # noqa: E731
            masks.clear()
            masks[n] = flex[1](mask, None, None, n, n)
        o, lse = flex[0](q, k, v, block_mask=masks[n], enable_gqa=True, return_lse=True)
        factor = torch.sigmoid(lse - sinks.float()[:, None])
        return (o * factor[..., None]).to(q.dtype)

    return run


def gpt_oss_implementations(window: int | None) -> dict:
    left = -1 if window is None else window - 1  # transformers' sliding_window: i - j < window
    impls = {
        "fastlm": lambda q, k, v, sinks: flash_attention(
            q, k, v, window_size=(left, 0), sinks=sinks
        ),
        "eager": gpt_oss_eager(window),
    }
    flex = gpt_oss_flex(window)
    if flex is not None:
        impls["flex (lse-corrected sinks)"] = flex
    return impls


def mla_implementations() -> dict:
    d = MLA["head_dim"]

    def sdpa_padded(q, k, v):  # transformers' flash-attention path: v padded to q's head dim
        o = F.scaled_dot_product_attention(q, k, F.pad(v, (0, d - v.shape[-1])), is_causal=True)
        return o[..., : v.shape[-1]]

    return {
        "fastlm": lambda q, k, v: flash_attention(q, k, v),
        "sdpa v padded": sdpa_padded,
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }


def gemma4_global_implementations() -> dict:
    impls = {
        "fastlm": lambda q, k, v: flash_attention(q, k, v),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        ),
    }
    flex = _flex_attention()
    if flex is not None:
        masks = {}

        def flex_causal(q, k, v):
            n = q.shape[-2]
            if n not in masks:
                masks.clear()
                masks[n] = flex[1](lambda b, h, i, j: i >= j, None, None, n, n)
            return flex[0](q, k, v, block_mask=masks[n], enable_gqa=True)

        impls["flex causal"] = flex_causal
    return impls


def family_cases(seqs):
    """gpt-oss's two kinds of layer, MLA, then Gemma 4's global layer, at each N (batch 1)."""
    for n in seqs:
        for window in (GPT_OSS["window"], None):
            name = f"gpt-oss-20b {'window 128' if window else 'full'} + sinks"

            def build(n=n, window=window):
                h, h_kv, d = GPT_OSS["heads"], GPT_OSS["kv_heads"], GPT_OSS["head_dim"]
                q, _, _ = random_inputs(1, h, n, d)
                _, k, v = random_inputs(1, h_kv, n, d)
                sinks = torch.randn(h, device=common.DEVICE, requires_grad=True)
                impls = gpt_oss_implementations(window)
                return impls, [q, k, v, sinks], impls["eager"]

            pairs = sum(min(i + 1, window or n) for i in range(n))
            flops = 2 * GPT_OSS["heads"] * pairs * 2 * GPT_OSS["head_dim"]
            yield dict(case=name, N=n), build, flops, {}

        def build_mla(n=n):
            h, d, d_v = MLA["heads"], MLA["head_dim"], MLA["head_dim_v"]
            q, k, _ = random_inputs(1, h, n, d)
            v = random_inputs(1, h, n, d_v)[0]
            impls = mla_implementations()
            return impls, [q, k, v], impls["sdpa v padded"]

        flops = 2 * MLA["heads"] * n * (n + 1) // 2 * (MLA["head_dim"] + MLA["head_dim_v"])
        yield dict(case="MLA 192/128", N=n), build_mla, flops, {}

        def build_gemma4(n=n):
            h, h_kv, d = (
                GEMMA4_GLOBAL["heads"],
                GEMMA4_GLOBAL["kv_heads"],
                GEMMA4_GLOBAL["head_dim"],
            )
            q, _, _ = random_inputs(1, h, n, d)
            _, k, v = random_inputs(1, h_kv, n, d)
            impls = gemma4_global_implementations()
            return impls, [q, k, v], impls["sdpa"]

        flops = 2 * GEMMA4_GLOBAL["heads"] * n * (n + 1) // 2 * 2 * GEMMA4_GLOBAL["head_dim"]
        yield dict(case="Gemma 4 global (head dim 512)", N=n), build_gemma4, flops, {}


def families_main(args) -> int:
    run = common.Run("attention_families", args, FAMILY_COLUMNS, BUDGET_S)
    if _flex_attention() is None:
        run.note("this torch has no FlexAttention: its rows are left out")
    bench(run, family_cases(FAMILY_SEQS[:1] if args.quick else FAMILY_SEQS))
    common.add_ratios(run.rows, "vs fastlm", "fastlm", FAMILY_KEY, "ms", higher_is_better=True)
    title = "gpt-oss-20b, MLA and Gemma 4 global attention, bf16, causal, batch 1"
    title += " (vs X: X's ms / fastlm's)"
    table = common.versus(run.rows, FAMILY_KEY, ("ms", "TFLOP/s"))
    return run.finish(common.table_lines(title, table), group_by=FAMILY_KEY)


def parser():
    p = common.parser(
        __doc__.split("\n\n")[0], "bf16, D=128, N 1k/4k/16k filling the GPU, 64k at batch 1"
    )
    p.add_argument("--impls", nargs="+", metavar="NAME", help="only these implementations")
    p.add_argument("--varlen", action="store_true", help="packed documents and a window instead")
    families = "gpt-oss-20b's attention (sinks, window), MLA's (v head dim 128) and Gemma 4's"
    families += " global layer (head dim 512) instead"
    p.add_argument("--families", action="store_true", help=families)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if common.no_cuda("benchmarks/attention.py"):
        return 0
    common.raise_compile_limits()
    if args.varlen:
        return varlen_main(args)
    if args.families:
        return families_main(args)
    impls = implementations()
    if set(args.impls or ()) - set(impls):
        p.error(f"unknown --impls {sorted(set(args.impls) - set(impls))}; have {list(impls)}")
    keep = set(args.impls or impls) | {EAGER}  # the reference: the speed-up baseline
    keep &= set(HEADLINE) if args.headline else keep
    return causal_main(args, {name: fn for name, fn in impls.items() if name in keep})


if __name__ == "__main__":
    sys.exit(main())
