"""Causal attention: fastlm's flash_attention against PyTorch's and the reference's.

Forward, backward and forward+backward, causal, q, k, v (B, H, N, D) with H = 2048 / D, for two
batch shapes: batch 1, and one that fills the GPU (B = 16384 / N sequences, at least 1). Sequence
lengths 128 to 65536, head dims 16 to 128, bf16 and fp32. Side by side: fastlm, the reference
attention (`fastlm.reference.ScaledDotProductAttention`, explicit [N x N] softmax) eager and under
`torch.compile`, PyTorch's F.scaled_dot_product_attention with each backend pinned (flash, cuDNN,
memory-efficient), and the flash-attn package when it is importable.

Columns: milliseconds; TFLOP/s with the FlashAttention papers' causal convention (forward
4 B H N^2 D / 2, backward 2.5x that, forward+backward 3.5x); speed-ups against SDPA's flash
backend and the eager reference; the output's relative error against SDPA with PyTorch's own
backend choice. Out of memory shows as OOM, a backend that does not take the shape or dtype
(flash and cuDNN take no fp32) as `unsupported`.

fp32: fastlm's dots may run as tf32 on the GPU; the reference and SDPA use PyTorch's settings
(full fp32 matmuls by default).

Headline (`--headline`, what gpu_check.sh measures first): bf16, D = 128, the GPU filled at
N = 4096 and 16384, forward and forward+backward, fastlm against SDPA's flash and cuDNN backends.
`--skip-headline` measures the rest of the chosen sweep without those rows; a full sweep runs the
--quick shapes first.

`--varlen`: packed documents instead (bf16, D = 128, H = 16, causal): mixed document lengths
(`document_lengths`: log-uniform 16 to 8192 tokens) totalling 16k, 32k and 64k tokens, timed as
fastlm's flash_attention_varlen, fastlm on the documents padded to the longest (the scatter and
gather included), SDPA with a block-diagonal causal mask, FlexAttention with a document mask and
flash-attn's flash_attn_varlen_func when importable (masks and block masks built once, outside
the timing; errors against attention per document); then a causal window of 4096 keys at N =
32k: fastlm against FlexAttention's sliding-window block mask (and flash-attn's window). TFLOP/s
count only the attended (document-causal or windowed) pairs. Files attention_varlen.*.

Without CUDA: a message, then flash_attention (plain, windowed and capped, and packed) against
the float64 reference through Triton's interpreter at tiny sizes; exit code 1 if the kernel gives
a wrong result or fails to run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import _common as common  # first: turns on Triton's interpreter when there is no CUDA
import torch
import torch.nn.functional as F

from fastlm import reference
from fastlm.kernels.attention import (
    attention_ref,
    attention_varlen_ref,
    flash_attention,
    flash_attention_varlen,
)

HIDDEN = 2048  # heads x head dim
FILL_TOKENS = 16384  # B x N of the configuration that fills the GPU
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
QUICK_TIME_LIMIT_S = 160
EAGER, COMPILED, SDPA_FLASH = "reference", "torch.compile(reference)", "sdpa-flash"
COLUMNS = [
    "dtype",
    "D",
    "B",
    "H",
    "N",
    "mode",
    "impl",
    "ms",
    "TFLOP/s",
    "vs sdpa-flash",
    "vs reference",
    "rel err",
]
SHAPE_AND_MODE = ("dtype", "D", "B", "N", "mode")  # the columns that make rows comparable


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

    def forward_flops(self) -> float:
        return 4 * self.batch * self.heads * self.seq**2 * self.head_dim / 2


FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def full_shapes() -> list[Shape]:
    shapes = []
    for dtype in DTYPES:
        for d in (16, 32, 64, 128):
            for fill in (False, True):
                for n in (2**p for p in range(7, 17)):
                    shapes.append(Shape(dtype, d, max(1, FILL_TOKENS // n) if fill else 1, n))
    return list(dict.fromkeys(shapes))  # the two batch shapes meet at N = 16384


# fastlm's other backward schedule (deterministic=False: dQ by atomics inside the dK/dV pass); its
# forward is fastlm's, so it is timed only where a backward runs.
FASTLM_ATOMIC = "fastlm atomic-dQ"
IMPL_MODES = {FASTLM_ATOMIC: ("bwd", "fwd+bwd")}
HEADLINE_SEQS = (4096, 16384)
HEADLINE_MODES = ("fwd", "fwd+bwd")
# What the headline times of each implementation: both of fastlm's backward schedules, so that
# the first GPU run also says which should be the default.
HEADLINE = {
    "fastlm": HEADLINE_MODES,
    FASTLM_ATOMIC: ("fwd+bwd",),
    SDPA_FLASH: HEADLINE_MODES,
    "sdpa-cudnn": HEADLINE_MODES,
}


def impl_modes(name: str) -> tuple[str, ...]:
    return IMPL_MODES.get(name, common.MODES)


def headline_shapes() -> list[Shape]:
    return [Shape("bf16", 128, FILL_TOKENS // n, n) for n in HEADLINE_SEQS]


def quick_shapes() -> list[Shape]:
    """bf16, D = 128: the filled GPU at 1k, 4k and 16k tokens, then batch 1 at 64k (where the
    explicit [N x N] reference runs out of memory)."""
    return [Shape("bf16", 128, FILL_TOKENS // n, n) for n in (1024, 4096, 16384)] + [
        Shape("bf16", 128, 1, 65536)
    ]


# --------------------------------------------------------------------------------------------
# Implementations: each takes q, k, v (B, H, N, D) and returns o (B, H, N, D)
# --------------------------------------------------------------------------------------------


def _reference_attention(q, k, v, mask):
    return reference.ScaledDotProductAttention()(q, k, v, mask)


def _with_causal_mask(fn: Callable) -> Callable:
    """fn(q, k, v, mask) with the reference's boolean mask, built once per sequence length."""
    masks: dict[int, torch.Tensor] = {}

    def run(q, k, v):
        n = q.shape[-2]
        if n not in masks:
            masks.clear()
            masks[n] = torch.triu(torch.ones(n, n, dtype=torch.bool, device=q.device), 1)
        return fn(q, k, v, masks[n])

    return run


def _sdpa(backend) -> Callable:
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return run


def implementations() -> tuple[dict[str, Callable], list[str]]:
    """The implementations that can run here, in table order, and notes on those that cannot."""
    from torch.nn.attention import SDPBackend

    impls, notes = {}, []
    impls["fastlm"] = lambda q, k, v: flash_attention(q, k, v, causal=True)
    impls[FASTLM_ATOMIC] = lambda q, k, v: flash_attention(
        q, k, v, causal=True, deterministic=False
    )
    impls[SDPA_FLASH] = _sdpa(SDPBackend.FLASH_ATTENTION)
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        impls["sdpa-cudnn"] = _sdpa(SDPBackend.CUDNN_ATTENTION)
    else:
        notes.append("this torch has no cuDNN SDPA backend")
    impls["sdpa-efficient"] = _sdpa(SDPBackend.EFFICIENT_ATTENTION)
    flash_attn = common.optional_module("flash_attn")
    if flash_attn is not None:

        def flash_attn_run(q, k, v):  # flash-attn wants (B, N, H, D): transposed views, no copy
            out = flash_attn.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
            return out.transpose(1, 2)

        impls["flash-attn"] = flash_attn_run
    else:
        notes.append("the flash-attn package is not installed: its rows are left out")
    impls[EAGER] = _with_causal_mask(_reference_attention)
    impls[COMPILED] = _with_causal_mask(torch.compile(_reference_attention, dynamic=False))
    return impls, notes


def _sdpa_default(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


def plan(args) -> list[tuple[Shape, dict[str, tuple[str, ...]]]]:
    """(shape, {impl name: modes}) in the order measured; impls absent from the dict are measured
    in their `impl_modes`. --headline keeps only the headline's implementations and modes;
    --skip-headline removes them from the headline shapes."""
    headline = headline_shapes()
    if args.headline:
        return [(shape, dict(HEADLINE)) for shape in headline]
    shapes = quick_shapes()
    if not args.quick:  # the quick shapes first: a time-limited full sweep still has them
        shapes += full_shapes()
    rest_of_headline = {
        name: tuple(m for m in impl_modes(name) if m not in modes)
        for name, modes in HEADLINE.items()
    }
    return [
        (shape, dict(rest_of_headline) if args.skip_headline and shape in headline else {})
        for shape in dict.fromkeys(shapes)
    ]


def bench_shape(
    run: common.Run, impls: dict[str, Callable], shape: Shape, modes: dict[str, tuple[str, ...]]
) -> None:
    dtype = DTYPES[shape.dtype]

    def make():
        return tuple(
            torch.randn(
                shape.batch,
                shape.heads,
                shape.seq,
                shape.head_dim,
                device=common.DEVICE,
                dtype=dtype,
            ).requires_grad_()
            for _ in range(3)
        )

    made = run.measure(make, f"inputs {shape}")
    if not made.ok:
        return
    inputs = made.value
    for name, fn in impls.items():
        label = f"{name} {shape}"
        times = common.time_modes(run, fn, inputs, label, modes=modes.get(name, impl_modes(name)))
        if not times:
            continue
        error = run.measure(
            lambda fn=fn, inputs=inputs: common.output_error(fn, _sdpa_default, inputs),
            f"{label} check",
        )
        for mode, ms in times.items():
            flops = FLOP_FACTOR[mode] * shape.forward_flops()
            run.add(
                {
                    "dtype": shape.dtype,
                    "D": shape.head_dim,
                    "B": shape.batch,
                    "H": shape.heads,
                    "N": shape.seq,
                    "batch": "1" if shape.batch == 1 else "fill",
                    "mode": mode,
                    "impl": name,
                    "ms": ms.cell(),
                    "TFLOP/s": flops / (ms.value * 1e-3) / 1e12 if ms.ok else None,
                    "rel err": error.cell(),
                }
            )
    del inputs, made
    common.free_memory()


def add_speedups(rows: list[dict]) -> None:
    """'vs sdpa-flash' and 'vs reference': the baseline's ms / the row's for the same shape."""
    for column, baseline in (("vs sdpa-flash", SDPA_FLASH), ("vs reference", EAGER)):
        common.add_ratios(rows, column, baseline, key=SHAPE_AND_MODE, value="ms")


def summary_lines(rows: list[dict]) -> list[str]:
    """A markdown table at bf16, D = 128: TFLOP/s of every implementation for each measured N, B
    and mode, and fastlm's speed-up over each (their ms / fastlm's)."""
    rows = [r for r in rows if r["dtype"] == "bf16" and r["D"] == 128]
    others = [name for name in dict.fromkeys(r["impl"] for r in rows) if name != "fastlm"]
    if not any(r["impl"] == "fastlm" for r in rows):
        return ["attention: no fastlm rows at bf16, D = 128 (see the notes)"]
    fmt = common.format_value
    lines = [
        f"Causal attention, bf16, D = 128, H = {HIDDEN // 128} (TFLOP/s; vs X = X's ms / "
        "fastlm's):",
        "",
        "| N | B | mode | fastlm | "
        + " | ".join(others)
        + " | "
        + " | ".join(f"vs {name}" for name in others)
        + " |",
        "|---|---|---|---|" + "---|" * (2 * len(others)),
    ]
    for key in dict.fromkeys((r["N"], r["B"], r["mode"]) for r in rows):
        same = {r["impl"]: r for r in rows if (r["N"], r["B"], r["mode"]) == key}
        ours = same.get("fastlm")
        if ours is None:
            continue

        def cell(name, same=same):
            row = same.get(name)
            return "" if row is None else fmt(row["TFLOP/s"] or row["ms"])

        def ms(row):
            return row["ms"] if row and isinstance(row["ms"], float) else None

        speedups = [common.ratio(ms(same.get(name)), ms(ours)) for name in others]
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {cell('fastlm')} | "
            + " | ".join(cell(name) for name in others)
            + " | "
            + " | ".join(fmt(v) for v in speedups)
            + " |"
        )
    return lines


# --------------------------------------------------------------------------------------------
# Packed documents (--varlen) and the sliding window
# --------------------------------------------------------------------------------------------

VARLEN_TOTALS = (16384, 32768, 65536)
VARLEN_QUICK_TOTALS = (16384, 32768)
VARLEN_HEAD_DIM = 128
WINDOW, WINDOW_SEQ = 4096, 32768
VARLEN_COLUMNS = [
    "case",
    "tokens",
    "docs",
    "longest",
    "mode",
    "impl",
    "ms",
    "TFLOP/s",
    "vs fastlm",
    "rel err",
]
VARLEN_KEY = ("case", "tokens", "mode")


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
    cu_seqlens: torch.Tensor  # int32 (docs + 1,) on the GPU
    doc_ids: torch.Tensor  # (tokens,) document of each token
    positions: torch.Tensor  # (tokens,) position of each token within its document

    @classmethod
    def of(cls, lengths: list[int]) -> Packed:
        device = common.DEVICE
        lengths_t = torch.tensor(lengths, device=device)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
        cu[1:] = lengths_t.cumsum(0)
        doc_ids = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths_t)
        positions = torch.arange(int(cu[-1]), device=device) - cu[doc_ids].long()
        return cls(tuple(lengths), cu, doc_ids, positions)

    @property
    def longest(self) -> int:
        return max(self.lengths)

    def causal_flops(self) -> float:
        heads = HIDDEN // VARLEN_HEAD_DIM
        return sum(4 * heads * n * n * VARLEN_HEAD_DIM / 2 for n in self.lengths)


def varlen_implementations(packed: Packed) -> tuple[dict[str, Callable], list[str]]:
    """Each takes packed q, k, v (tokens, H, D) and returns o (tokens, H, D). Masks, block masks
    and index tensors are built here, once, outside the timing."""
    impls, notes = {}, []
    cu, longest = packed.cu_seqlens, packed.longest
    impls["fastlm"] = lambda q, k, v: flash_attention_varlen(q, k, v, cu, cu, longest, longest)

    rows = packed.positions  # the padded layout: document d's token t at [d, t]

    def padded(q, k, v):  # scatter into (docs, longest, H, D), attend, gather back
        batch = []
        for t in (q, k, v):
            out = t.new_zeros(len(packed.lengths), longest, *t.shape[1:])
            out[packed.doc_ids, rows] = t
            batch.append(out.transpose(1, 2))
        o = flash_attention(*batch, causal=True)
        return o.transpose(1, 2)[packed.doc_ids, rows]

    impls["fastlm padded"] = padded

    same_doc = packed.doc_ids[:, None] == packed.doc_ids[None, :]
    block_diagonal = same_doc & torch.ones_like(same_doc).tril()

    def sdpa_masked(q, k, v):
        o = F.scaled_dot_product_attention(
            *(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=block_diagonal
        )
        return o[0].transpose(0, 1)

    impls["sdpa block-diagonal mask"] = sdpa_masked
    flex = _flex_attention()
    if flex is not None:
        flex_attention, create_block_mask = flex
        doc_ids = packed.doc_ids

        def document_causal(b, h, q_idx, kv_idx):
            return (doc_ids[q_idx] == doc_ids[kv_idx]) & (q_idx >= kv_idx)

        tokens = len(doc_ids)
        block_mask = create_block_mask(document_causal, None, None, tokens, tokens)

        def flex_run(q, k, v):
            o = flex_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), block_mask=block_mask)
            return o[0].transpose(0, 1)

        impls["flex document mask"] = flex_run
    else:
        notes.append("this torch has no FlexAttention: its rows are left out")
    flash_attn = common.optional_module("flash_attn")
    if flash_attn is not None:
        impls["flash-attn varlen"] = lambda q, k, v: flash_attn.flash_attn_varlen_func(
            q, k, v, cu, cu, longest, longest, causal=True
        )
    else:
        notes.append("the flash-attn package is not installed: its rows are left out")
    return impls, notes


def _flex_attention():
    """(compiled flex_attention, create_block_mask), or None where this torch has none."""
    module = common.optional_module("torch.nn.attention.flex_attention")
    if module is None:
        return None
    return torch.compile(module.flex_attention, dynamic=False), module.create_block_mask


def window_implementations() -> tuple[dict[str, Callable], list[str]]:
    """Causal attention over WINDOW keys, q, k, v (1, H, WINDOW_SEQ, D)."""
    impls, notes = {}, []
    impls["fastlm"] = lambda q, k, v: flash_attention(q, k, v, window_size=(WINDOW, 0))
    flex = _flex_attention()
    if flex is not None:
        flex_attention, create_block_mask = flex

        def sliding_window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)

        block_mask = create_block_mask(sliding_window, None, None, WINDOW_SEQ, WINDOW_SEQ)
        impls["flex sliding window"] = lambda q, k, v: flex_attention(
            q, k, v, block_mask=block_mask
        )
    else:
        notes.append("this torch has no FlexAttention: its rows are left out")
    flash_attn = common.optional_module("flash_attn")
    if flash_attn is not None:

        def flash_attn_window(q, k, v):
            out = flash_attn.flash_attn_func(
                *(t.transpose(1, 2) for t in (q, k, v)), causal=True, window_size=(WINDOW, 0)
            )
            return out.transpose(1, 2)

        impls["flash-attn window"] = flash_attn_window
    return impls, notes


def _varlen_reference(packed: Packed) -> Callable:
    """Attention of each document on its own (`attention_varlen_ref`: SDPA per document)."""
    return lambda q, k, v: attention_varlen_ref(q, k, v, packed.cu_seqlens, packed.cu_seqlens)


def _bench_rows(run, impls, inputs, reference_fn, row) -> None:
    """Time every implementation on `inputs` and add a row per mode (`row`'s fields, plus the
    measurement's)."""
    for name, fn in impls.items():
        label = f"{name} {row['case']} {row['tokens']}"
        times = common.time_modes(run, fn, inputs, label)
        if not times:
            continue
        error = run.measure(
            lambda fn=fn: common.output_error(fn, reference_fn, inputs), f"{label} check"
        )
        for mode, ms in times.items():
            flops = FLOP_FACTOR[mode] * row["flops"]
            run.add(
                {
                    **{k: v for k, v in row.items() if k != "flops"},
                    "mode": mode,
                    "impl": name,
                    "ms": ms.cell(),
                    "TFLOP/s": flops / (ms.value * 1e-3) / 1e12 if ms.ok else None,
                    "rel err": error.cell(),
                }
            )


def bench_varlen(run: common.Run, totals) -> None:
    heads, dtype = HIDDEN // VARLEN_HEAD_DIM, torch.bfloat16
    for total in totals:
        if run.out_of_time():
            return
        packed = Packed.of(document_lengths(total))
        made = run.measure(
            lambda total=total: tuple(
                torch.randn(
                    total, heads, VARLEN_HEAD_DIM, device=common.DEVICE, dtype=dtype
                ).requires_grad_()
                for _ in range(3)
            ),
            f"inputs varlen {total}",
        )
        built = run.measure(lambda packed=packed: varlen_implementations(packed), "varlen impls")
        if not (made.ok and built.ok):
            continue
        impls, notes = built.value
        for text in notes:
            run.note(text)
        row = dict(
            case="varlen causal",
            tokens=total,
            docs=len(packed.lengths),
            longest=packed.longest,
            flops=packed.causal_flops(),
        )
        _bench_rows(run, impls, made.value, _varlen_reference(packed), row)
        del made, built, impls
        common.free_memory()
    if run.out_of_time():
        return
    heads = HIDDEN // VARLEN_HEAD_DIM
    made = run.measure(
        lambda: tuple(
            torch.randn(
                1, heads, WINDOW_SEQ, VARLEN_HEAD_DIM, device=common.DEVICE, dtype=dtype
            ).requires_grad_()
            for _ in range(3)
        ),
        "inputs window",
    )
    built = run.measure(window_implementations, "window impls")
    if not (made.ok and built.ok):
        return
    impls, notes = built.value
    for text in notes:
        run.note(text)
    # Keys each query sees: min(i + 1, WINDOW + 1), summed.
    pairs = sum(min(i + 1, WINDOW + 1) for i in range(WINDOW_SEQ))
    row = dict(
        case=f"causal window {WINDOW}",
        tokens=WINDOW_SEQ,
        docs=1,
        longest=WINDOW_SEQ,
        flops=4 * heads * pairs * VARLEN_HEAD_DIM,
    )
    # The error reference: the first implementation that is not fastlm's (the window's mask
    # over 32k keys is too large for an explicit one).
    others = [fn for name, fn in impls.items() if name != "fastlm"]
    _bench_rows(run, impls, made.value, others[0] if others else impls["fastlm"], row)


def varlen_summary(rows: list[dict]) -> list[str]:
    lines = [
        "Packed documents and a sliding window, bf16, D = 128, H = 16 (ms; vs fastlm = the "
        "row's ms / fastlm's):",
        "",
        "| case | tokens | docs | mode | impl | ms | vs fastlm |",
        "|---|---|---|---|---|---|---|",
    ]
    fmt = common.format_value
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['tokens']} | {r['docs']} | {r['mode']} | {r['impl']} | "
            f"{fmt(r['ms'])} | {fmt(r['vs fastlm'])} |"
        )
    return lines


def varlen_main(args) -> int:
    run = common.Run("attention_varlen", args, QUICK_TIME_LIMIT_S, VARLEN_COLUMNS)
    run.header()
    with run.interruptible():
        bench_varlen(run, VARLEN_QUICK_TOTALS if args.quick else VARLEN_TOTALS)
    # fastlm's speed-up over the row's implementation: its ms / fastlm's.
    common.add_ratios(
        run.rows, "vs fastlm", "fastlm", key=VARLEN_KEY, value="ms", higher_is_better=True
    )
    return run.finish(group_by=VARLEN_KEY, summary=varlen_summary(run.rows))


# --------------------------------------------------------------------------------------------
# Without CUDA: the interpreter check
# --------------------------------------------------------------------------------------------


def _reference_gqa(q, k, v, causal: bool):
    """The reference attention with grouped heads repeated and the mask aligned to the end."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    nq, nk = q.shape[-2], k.shape[-2]
    mask = None
    if causal:
        mask = torch.ones(nq, nk, dtype=torch.bool).triu(nk - nq + 1)
    return reference.ScaledDotProductAttention()(q, k, v, mask)


def interpreter_check() -> int:
    torch.manual_seed(0)

    def leaves(*shapes):
        return [torch.randn(*s).requires_grad_() for s in shapes]

    def check(name, causal, q_shape, kv_shape, deterministic=True):
        def run():
            return common.compare_with_reference(
                f"flash_attention {name}",
                lambda q, k, v: flash_attention(q, k, v, causal, deterministic=deterministic),
                lambda q, k, v: _reference_gqa(q, k, v, causal),
                leaves(q_shape, kv_shape, kv_shape),
            )

        return common.try_check(f"flash_attention {name}", run)

    rows = check("causal N=33 D=16", True, (1, 2, 33, 16), (1, 2, 33, 16))
    rows += check("GQA 4/2 heads, Nq=9 < Nk=20, D=32", True, (1, 4, 9, 32), (1, 2, 20, 32))
    rows += check("not causal N=17 D=16", False, (2, 1, 17, 16), (2, 1, 17, 16))
    rows += check("causal N=33 D=16, atomic dQ", True, (1, 2, 33, 16), (1, 2, 33, 16), False)

    def check_against(name, fn, ref_fn, shapes):
        return common.try_check(
            name, lambda: common.compare_with_reference(name, fn, ref_fn, leaves(*shapes))
        )

    options = dict(window_size=(5, 0), softcap=3.0)
    rows += check_against(
        "flash_attention window (5, 0) softcap 3, N=33",
        lambda q, k, v: flash_attention(q, k, v, **options),
        lambda q, k, v: attention_ref(q, k, v, **options),
        ((1, 2, 33, 16), (1, 1, 33, 16), (1, 1, 33, 16)),
    )
    cu = torch.tensor([0, 5, 6, 23], dtype=torch.int32)
    rows += check_against(
        "flash_attention_varlen documents 5, 1, 17",
        lambda q, k, v: flash_attention_varlen(q, k, v, cu, cu, 17, 17),
        lambda q, k, v: attention_varlen_ref(q, k, v, cu, cu),
        ((23, 4, 16), (23, 2, 16), (23, 2, 16)),
    )
    return common.report_checks(rows)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = common.parser(
        __doc__.split("\n\n")[0],
        quick_help=(
            "bf16, D=128, N in 1k/4k/16k filling the GPU and 64k at batch 1, "
            f"within a {QUICK_TIME_LIMIT_S} s time budget"
        ),
    )
    p.add_argument(
        "--impls",
        nargs="+",
        default=None,
        metavar="NAME",
        help="measure only these implementations (default: all available)",
    )
    p.add_argument(
        "--varlen",
        action="store_true",
        help=f"instead of the causal sweep: packed documents of mixed lengths totalling "
        f"{', '.join(str(t // 1024) + 'k' for t in VARLEN_TOTALS)} tokens (--quick: "
        f"{', '.join(str(t // 1024) + 'k' for t in VARLEN_QUICK_TOTALS)}) and a causal window "
        f"of {WINDOW} at N = {WINDOW_SEQ // 1024}k; files attention_varlen.*",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not common.HAS_CUDA:
        common.no_cuda_notice("benchmarks/attention.py")
        return interpreter_check()
    if args.varlen:
        common.raise_compile_limits()
        return varlen_main(args)

    common.raise_compile_limits()
    run = common.Run("attention", args, QUICK_TIME_LIMIT_S, COLUMNS)
    run.header()
    impls, notes = implementations()
    for text in notes:
        run.note(text)
    if args.impls:
        unknown = set(args.impls) - set(impls)
        if unknown:
            p.error(f"unknown --impls {sorted(unknown)}; available: {list(impls)}")
        keep = set(args.impls) | {EAGER}  # the reference column is the speed-up baseline
        impls = {name: fn for name, fn in impls.items() if name in keep}
    if args.headline:
        impls = {name: fn for name, fn in impls.items() if name in HEADLINE}
    with run.interruptible():
        for shape, modes in plan(args):
            if run.out_of_time():
                break
            bench_shape(run, impls, shape, modes)
    add_speedups(run.rows)
    return run.finish(
        group_by=SHAPE_AND_MODE,
        summary=summary_lines(run.rows),
        plot={
            "x": "N",
            "y": "TFLOP/s",
            "series": "impl",
            "logx": True,
            "panel": ("dtype", "D", "batch", "mode"),
            "title": f"causal attention, {run.env['gpu']}",
        },
    )


if __name__ == "__main__":
    sys.exit(main())
