"""GeGLU (fastlm.kernels.geglu) against PyTorch's GELU in float64: gelu(gate) * up and its grads,
for the exact GELU and its tanh approximation (Gemma's gelu_pytorch_tanh)."""

import pytest
import torch

from fastlm.kernels.geglu import geglu
from fastlm.testing import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def reference_grads(gate, up, grad_out, approximate):
    gate64 = gate.detach().to(torch.float64).requires_grad_()
    up64 = up.detach().to(torch.float64).requires_grad_()
    out = torch.nn.functional.gelu(gate64, approximate=approximate) * up64
    out.backward(grad_out.to(torch.float64))
    return out.detach(), gate64.grad, up64.grad


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 1000), (2, 3, 130), (7,)])
def test_geglu_matches_reference(shape, dtype, approximate, device):
    # Scale 4 reaches both tails (GELU ~ 0 and ~ identity) as well as the curved middle.
    gate = (4 * torch.randn(shape, device=device)).to(dtype).requires_grad_()
    up = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(shape, device=device, dtype=dtype)
    out = geglu(gate, up, approximate)
    out.backward(grad_out)
    expected, d_gate, d_up = reference_grads(gate, up, grad_out, approximate)
    assert out.dtype == dtype and out.shape == gate.shape
    assert_close(out, expected, dtype, "out")
    assert_close(gate.grad, d_gate, dtype, "d gate")
    assert_close(up.grad, d_up, dtype, "d up")


def test_the_two_forms_differ_and_each_matches_its_own():
    """The tanh form is not the exact one (about 1e-4 apart): each kernel matches its own math
    far more closely than the two forms match each other."""
    gate = torch.linspace(-5, 5, 2001, dtype=torch.float64).float().view(1, -1)
    up = torch.ones_like(gate)
    exact = torch.nn.functional.gelu(gate.double())
    tanh = torch.nn.functional.gelu(gate.double(), approximate="tanh")
    gap = (exact - tanh).abs().max().item()
    assert gap > 1e-4
    assert (geglu(gate, up, "none").double() - exact).abs().max().item() < gap / 100
    assert (geglu(gate, up, "tanh").double() - tanh).abs().max().item() < gap / 100


def test_strided_halves_of_a_fused_projection(device):
    """gate and up as the two halves of one wider buffer (row-strided views, no copy)."""
    M, N = 37, 130
    fused = torch.randn(M, 2 * N + 9, device=device, requires_grad=True)
    gate, up = fused[:, :N], fused[:, N + 9 :]
    grad_out = torch.randn(N, M, device=device).t()  # a column-major gradient
    out = geglu(gate, up)
    out.backward(grad_out)
    expected, d_gate, d_up = reference_grads(gate, up, grad_out, "tanh")
    assert_close(out, expected, torch.float32, "out")
    assert_close(fused.grad[:, :N], d_gate, torch.float32, "d gate")
    assert_close(fused.grad[:, N + 9 :], d_up, torch.float32, "d up")
    assert torch.all(fused.grad[:, N : N + 9] == 0)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_torch_backend_gives_same_numbers(monkeypatch, device, approximate):
    """Both backends, output and gradients, against float64 GELU (`reference_grads`, not
    `geglu_ref`, which the PyTorch backend runs: that backend is not compared with itself)."""
    gate = (4 * torch.randn(2, 9, 300, device=device)).to(torch.float16)
    up = torch.randn(2, 9, 300, device=device, dtype=torch.float16)
    grad_out = torch.randn(2, 9, 300, device=device, dtype=torch.float16)
    expected = reference_grads(gate, up, grad_out, approximate)
    for backend in ("auto", "torch"):
        monkeypatch.setenv("FASTLM_BACKEND", backend)
        a, b = gate.clone().requires_grad_(), up.clone().requires_grad_()
        out = geglu(a, b, approximate)
        out.backward(grad_out)
        for name, got, ref in zip(("out", "d gate", "d up"), (out, a.grad, b.grad), expected):
            assert_close(got, ref, torch.float16, f"{name} ({backend})")


def test_bad_input(device):
    x = torch.randn(3, 4, device=device)
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh'"):
        geglu(x, x, "erf")
    with pytest.raises(ValueError, match="must have one shape"):
        geglu(x, x[:, :2])
    with pytest.raises(TypeError, match="up has dtype"):
        geglu(x, x.half())
    with pytest.raises(TypeError, match="gate must be float32"):
        geglu(x.long(), x)


def test_second_derivatives_raise(device):
    gate = torch.randn(3, 8, device=device, requires_grad=True)
    (d_gate,) = torch.autograd.grad(geglu(gate, gate.detach()).sum(), gate, create_graph=True)
    with pytest.raises(RuntimeError, match="second derivatives are not supported"):
        d_gate.sum().backward()
