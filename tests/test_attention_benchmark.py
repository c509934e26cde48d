"""benchmarks/attention.py's packed-documents sweep without a GPU: the document lengths it draws,
and each implementation it times (fastlm varlen, padding to the longest, SDPA with a
block-diagonal mask) computing the same attention as the per-document reference at tiny sizes.
FlexAttention and flash-attn need CUDA; on a GPU the sweep checks them against the same
reference (its rel err column)."""

import importlib
import sys
from pathlib import Path

import pytest
import torch

from fastlm.testing import assert_close

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
bench = importlib.import_module("attention")  # benchmarks/attention.py


@pytest.mark.parametrize("total", [16384, 65536])
def test_document_lengths_are_mixed_and_fill_the_batch(total):
    lengths = bench.document_lengths(total)
    assert sum(lengths) == total and min(lengths) >= 1
    assert min(lengths) < 64 and max(lengths) > 2048, "short documents beside long ones"
    assert lengths == bench.document_lengths(total), "the same batch on every run"


def test_varlen_implementations_compute_the_same_attention(device, monkeypatch):
    monkeypatch.setattr(bench, "_flex_attention", lambda: None)
    monkeypatch.setattr(bench.common, "DEVICE", device)
    packed = bench.Packed.of([5, 1, 17, 2])
    assert packed.cu_seqlens.tolist() == [0, 5, 6, 23, 25]
    assert packed.positions.tolist()[4:8] == [4, 0, 0, 1]
    impls, notes = bench.varlen_implementations(packed)
    assert {"fastlm", "fastlm padded", "sdpa block-diagonal mask"} <= set(impls)
    q, k, v = (torch.randn(25, 2, 16, device=device) for _ in range(3))
    ref = bench._varlen_reference(packed)(*(t.double() for t in (q, k, v)))
    for name, fn in impls.items():
        if name.startswith("flash-attn"):
            continue
        assert_close(fn(q, k, v), ref, torch.float32, name)


def test_headline_times_both_backward_schedules():
    """The first GPU run must say which backward schedule should be the default: the headline
    times fastlm's forward+backward with each, and --skip-headline times the rest."""
    parse = bench.parser().parse_args
    headline = bench.plan(parse(["--headline"]))
    assert [shape for shape, _ in headline] == bench.headline_shapes()
    for _, modes in headline:
        assert "fwd+bwd" in modes["fastlm"] and "fwd+bwd" in modes[bench.FASTLM_ATOMIC]
        assert "fwd" not in modes[bench.FASTLM_ATOMIC], "its forward is fastlm's"
    rest = dict(bench.plan(parse(["--quick", "--skip-headline"])))
    for shape in bench.headline_shapes():
        assert rest[shape][bench.FASTLM_ATOMIC] == ("bwd",)
        assert rest[shape]["fastlm"] == ("bwd",)
    impls, _ = bench.implementations()
    assert bench.FASTLM_ATOMIC in impls
