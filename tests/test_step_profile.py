"""benchmarks/step_profile.py counts what it claims: bytes by its rule, planted casts to the byte,
layers and tokens separated exactly, interpreter copies left out, GEMMs per layer as the model's
structure says."""

import sys
from pathlib import Path

import pytest
import torch

# Appended, not prepended: benchmarks/ holds kernels.py, attention.py and train.py, which must not
# shadow anything another test imports.
sys.path.append(str(Path(__file__).resolve().parent.parent / "benchmarks"))

import step_profile  # noqa: E402
from conftest import TINY_MODEL

import fastlm  # noqa: E402
import fastlm.kernels._common as kernel_common  # noqa: E402
from fastlm import reference  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32


def glue(totals: dict) -> dict:
    return {name: tuple(v) for (cat, name), v in totals.items() if cat == "glue"}


def test_planted_cast_is_glue_of_its_exact_size():
    n, d = torch.randint(3, 50, (2,)).tolist()
    x, w = torch.randn(n, d), torch.randn(d, d)
    plain = step_profile.record_step(lambda: (x @ w).sum())
    planted = step_profile.record_step(lambda: (x.to(BF16).to(F32) @ w).sum())
    extra = {k: v for k, v in glue(planted).items() if glue(plain).get(k) != v}
    # Each cast reads one dtype and writes the other: (4 + 2) bytes per element.
    assert extra == {"_to_copy f32->bf16": (1, 6 * n * d), "_to_copy bf16->f32": (1, 6 * n * d)}
    assert {k: v for k, v in plain.items() if k[0] != "glue"} == {
        k: v for k, v in planted.items() if k[0] != "glue"
    }


@pytest.mark.parametrize(
    "op, expected",
    [
        # copy_ into a column slice: reads the source, writes the slice, never the rest of dst.
        (lambda a, b, dst: dst[:, :3].copy_(b[:, :3]), lambda n, m: 2 * n * 3 * 4),
        # in-place add: reads both operands, writes one.
        (lambda a, b, dst: a.add_(b), lambda n, m: 3 * n * m * 4),
        # a zero-fill writes its output; zero_ in place writes without reading.
        (lambda a, b, dst: torch.zeros(a.shape), lambda n, m: n * m * 4),
        (lambda a, b, dst: dst.zero_(), lambda n, m: n * m * 4),
        # an expanded (stride 0) operand is read once per distinct element.
        (lambda a, b, dst: a * b[:1].expand_as(a), lambda n, m: (n * m + m + n * m) * 4),
    ],
)
def test_bytes_follow_the_rule(op, expected):
    n, m = torch.randint(4, 40, (2,)).tolist()
    a, b, dst = torch.randn(n, m), torch.randn(n, m), torch.randn(n, m)
    totals = step_profile.record_step(lambda: op(a, b, dst))
    assert sum(size for _, size in glue(totals).values()) == expected(n, m)
    assert sum(count for count, _ in glue(totals).values()) == 1


def test_fit_separates_layers_tokens_and_weights():
    """A toy model whose every byte is known: per layer, a bf16 GEMM with its three casts."""
    d, seq = 24, 5

    def make_step(num_layers: int, batch: int):
        weights = [torch.randn(d, d) for _ in range(num_layers)]
        x = torch.randn(batch * seq, d)

        def step():
            h = x
            for w in weights:
                h = (h.to(BF16) @ w.to(BF16)).to(F32)
            h.sum()

        return step

    fits = {
        (f.category, f.name): f
        for f in step_profile.profile(make_step, layers=(2, 5), batch_sizes=(3, 7), seq_len=seq)
    }
    down, up, mm = (
        fits["glue", "_to_copy f32->bf16"],
        fits["glue", "_to_copy bf16->f32"],
        fits["gemm", "mm"],
    )
    # Per layer: h and w cast down (6 bytes per element each), the product cast up, the GEMM
    # reading h and w and writing its product in bf16.
    assert (down.count_layer, up.count_layer, mm.count_layer) == (2, 1, 1)
    assert (down.token_bytes_layer, down.fixed_bytes_layer) == pytest.approx((6 * d, 6 * d * d))
    assert (up.token_bytes_layer, up.fixed_bytes_layer) == pytest.approx((6 * d, 0), abs=1e-9)
    assert (mm.token_bytes_layer, mm.fixed_bytes_layer) == pytest.approx((4 * d, 2 * d * d))
    assert (down.count_step, down.token_bytes_step, down.fixed_bytes_step) == pytest.approx(
        (0, 0, 0), abs=1e-9
    )
    # Once per step: the sum reads h (fp32) and writes one fp32 scalar.
    total = fits["glue", "sum"]
    assert (total.count_layer, total.count_step) == pytest.approx((0, 1), abs=1e-9)
    assert (total.token_bytes_step, total.fixed_bytes_step) == pytest.approx((4 * d, 4))


def test_interpreter_copies_are_left_out_and_launches_counted(monkeypatch):
    monkeypatch.setattr(kernel_common, "POISON_OUTPUTS", False)  # NaN fills would be glue
    x, g = torch.randn(7, 40), torch.randn(40)
    with torch.no_grad():
        totals = step_profile.record_step(lambda: fastlm.rms_norm(x, g))
        assert totals.get(("triton", "_rms_norm_fwd")) == [1, 0]
        assert glue(totals) == {}  # the kernel's work is the launch; nothing else moves data
        if step_profile.common.HAS_CUDA:
            return
        # The control: without the launch wrapper the interpreter's copies would be counted.
        recorder = step_profile.StepRecorder()
        with recorder:
            fastlm.rms_norm(x, g)
    assert recorder.totals["glue", "copy_"][0] > 0


@pytest.mark.parametrize("kind", step_profile.MODELS)
def test_gemms_per_layer_match_the_block(kind, monkeypatch):
    # The suite's NaN-poisoning of kernel outputs (conftest.py) is test-only glue: off here.
    monkeypatch.setattr(kernel_common, "POISON_OUTPUTS", False)
    config = {**TINY_MODEL, "num_layers": 1}
    fits = step_profile.profile_model(
        kind, config, layers=(1, 2), batch_sizes=(2, 3), device="cpu", warmup_steps=0
    )
    per_layer = {(f.category, f.name): f.count_layer for f in fits if f.count_layer}
    block = step_profile.build_model(kind, config, "meta").blocks[0]
    linears = sum(isinstance(m, reference.Linear) for m in block.modules())
    # Each linear: a forward product and the two of its backward (input and weight gradients);
    # the reference's attention adds q k^T and P v, each with two backward products; fastlm runs
    # W1 and W3 (autocast: stacked) as one GEMM forward and one for their input gradient.
    expected = 3 * linears + (2 * 3 if kind == "reference" else -2)
    assert sum(n for (cat, _), n in per_layer.items() if cat == "gemm") == expected
    assert sum(n for (cat, _), n in per_layer.items() if cat == "model") == 0  # embedding: once
    launches = sum(n for (cat, _), n in per_layer.items() if cat == "triton")
    assert (launches > 0) == (kind == "fastlm")
    assert all(f.count_layer == f.count_layer_larger_batch for f in fits)
    if kind == "fastlm":  # a fused step's bounds for a layer's forward + backward
        glue = [f for f in fits if f.category == "glue"]
        assert launches <= 12
        assert sum(f.count_layer for f in glue) <= 4
        assert sum(f.token_bytes_layer for f in glue) <= 24 * config["d_model"]


def test_command_line_rejects_bad_input_in_one_line(capsys):
    assert step_profile.main(["--layers", "2", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--layers" in err
