"""fastlm without Triton (run by `python tests/without_triton.py`, which hides it; skipped where
Triton is importable): it imports, runs every op and the model on PyTorch, and says what to
install when the kernels are asked for."""

import importlib.util

import pytest
import torch
from conftest import TINY_MODEL

import fastlm
from fastlm import reference as R
from fastlm.kernels._common import HAVE_TRITON
from fastlm.testing import assert_close


def _triton_hidden() -> bool:
    try:
        return importlib.util.find_spec("triton") is None
    except ModuleNotFoundError:
        return True


pytestmark = pytest.mark.skipif(
    not _triton_hidden(), reason="Triton is importable: run tests/without_triton.py"
)


def test_fastlm_imports_and_knows_triton_is_missing():
    assert not HAVE_TRITON
    assert not fastlm.use_triton(torch.zeros(1))


def test_asking_for_the_kernels_says_what_to_install(monkeypatch):
    monkeypatch.setenv("FASTLM_BACKEND", "triton")
    with pytest.raises(ModuleNotFoundError, match="pip install triton"):
        fastlm.rms_norm(torch.randn(3, 8), torch.ones(8))


def test_a_kernel_launched_anyway_says_what_to_install():
    from fastlm.kernels.swiglu import _swiglu_fwd_kernel

    with pytest.raises(ModuleNotFoundError, match="pip install triton"):
        _swiglu_fwd_kernel[(1,)]()


def test_every_op_runs_on_pytorch():
    x, residual, g = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)
    assert_close(fastlm.rms_norm(x, g), R.RmsNorm(16)(x) * g, torch.float32, "rms_norm")
    normed, summed = fastlm.add_rms_norm(x, residual, g)
    assert torch.equal(summed, x + residual)
    assert_close(normed, fastlm.rms_norm(x + residual, g), torch.float32, "add_rms_norm")
    gate, up = torch.randn(4, 16), torch.randn(4, 16)
    assert_close(fastlm.swiglu(gate, up), R.SiLu()(gate) * up, torch.float32, "swiglu")
    assert_close(
        fastlm.swiglu_packed(torch.cat([gate, up], -1)),
        fastlm.swiglu(gate, up),
        torch.float32,
        "swiglu_packed",
    )
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    assert_close(
        fastlm.flash_attention(q, k, v),
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
        torch.float32,
        "flash_attention",
    )
    cos, sin = fastlm.kernels.rope_tables(10000.0, 8, 16)
    rotated = R.RoPE(10000.0, 8, 16)(q, torch.arange(9))
    fastlm.apply_rope_(q, k, cos, sin, torch.arange(9))
    assert_close(q, rotated, torch.float32, "apply_rope_")
    logits, targets = torch.randn(5, 30), torch.randint(0, 30, (5,))
    expected = torch.nn.functional.cross_entropy(logits, targets)
    assert_close(fastlm.cross_entropy(logits, targets), expected, torch.float32, "cross_entropy")
    hidden, weight = torch.randn(5, 16), torch.randn(30, 16)
    assert_close(
        fastlm.linear_cross_entropy(hidden, weight, targets),
        torch.nn.functional.cross_entropy(hidden @ weight.T, targets),
        torch.float32,
        "linear_cross_entropy",
    )
    experts = R.MoeExperts(3, 16, 8)
    ids, weights = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]]), torch.rand(5, 2)
    assert_close(
        fastlm.moe_experts(hidden, ids, weights, *experts.stacked()),
        experts(hidden, ids, weights),
        torch.float32,
        "moe_experts",
    )


def test_model_trains_on_pytorch():
    config = TINY_MODEL
    model = fastlm.Transformer(**config)
    ref = R.Transformer(**config, dtype=torch.float64)
    ref.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 31, (2, 12))
    loss = model.loss(tokens, tokens)
    loss.backward()
    expected = R.CrossEntropyLoss()(ref(tokens), tokens)
    assert_close(loss, expected, torch.float32, "loss")
