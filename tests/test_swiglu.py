"""SwiGLU (fastlm.kernels.swiglu) against the float64 reference: silu(gate) * up and its grads."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastlm import reference
from fastlm.kernels.swiglu import swiglu, swiglu_packed
from fastlm.modules import SwiGlu
from fastlm.testing import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 1000), (37, 1000), (2, 3, 130), (5, 4096), (7,)]


def reference_grads(gate, up, grad_out):
    """Output and (d gate, d up) of reference.SiLu()(gate) * up, all in float64."""
    gate64 = gate.detach().to(torch.float64).requires_grad_()
    up64 = up.detach().to(torch.float64).requires_grad_()
    out = reference.SiLu()(gate64) * up64
    out.backward(grad_out.to(torch.float64))
    return out.detach(), gate64.grad, up64.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu_matches_reference(dtype, shape, device):
    # Scale 3 reaches the saturated parts of the sigmoid as well as its middle.
    gate = (3 * torch.randn(shape, device=device)).to(dtype).requires_grad_()
    up = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(shape, device=device, dtype=dtype)
    out = swiglu(gate, up)
    out.backward(grad_out)
    expected, d_gate, d_up = reference_grads(gate, up, grad_out)
    assert out.dtype == dtype and out.shape == gate.shape
    assert_close(out, expected, dtype, "out")
    assert_close(gate.grad, d_gate, dtype, "d gate")
    assert_close(up.grad, d_up, dtype, "d up")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1000), (37, 1000), (2, 3, 130)])
def test_packed_matches_reference(dtype, shape, device):
    d_ff = shape[-1]
    gate_up = torch.randn(*shape[:-1], 2 * d_ff, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(shape, device=device, dtype=dtype)
    out = swiglu_packed(gate_up)
    out.backward(grad_out)
    expected, d_gate, d_up = reference_grads(gate_up[..., :d_ff], gate_up[..., d_ff:], grad_out)
    assert out.shape == shape
    assert_close(out, expected, dtype, "out")
    assert_close(gate_up.grad, torch.cat((d_gate, d_up), dim=-1), dtype, "d gate_up")


def test_strided_inputs(device):
    """Row-strided slices (no copy), a transposed input (copied to rows) and a strided grad."""
    M, N = 37, 130
    wide = torch.randn(M, N + 11, device=device, requires_grad=True)
    gate = wide[:, 5 : 5 + N]  # rows with a leading stride of N + 11
    up_t = torch.randn(N, M, device=device, requires_grad=True)
    up = up_t.t()  # column-major
    grad_out = torch.randn(N, M, device=device).t()
    out = swiglu(gate, up)
    out.backward(grad_out)
    expected, d_gate, d_up = reference_grads(gate, up, grad_out)
    assert_close(out, expected, torch.float32, "out")
    assert_close(wide.grad[:, 5 : 5 + N], d_gate, torch.float32, "d gate")
    assert torch.all(wide.grad[:, :5] == 0) and torch.all(wide.grad[:, 5 + N :] == 0)
    assert_close(up_t.grad.t(), d_up, torch.float32, "d up")


def test_packed_strided_input(device):
    """gate_up as a slice of a wider fused projection output, with non-collapsible rows."""
    B, T, d_ff = 3, 5, 100
    fused = torch.randn(2 * B, T, 2 * d_ff + 7, device=device, requires_grad=True)
    gate_up = fused[::2, :, 7:]
    grad_out = torch.randn(B, T, d_ff, device=device)
    out = swiglu_packed(gate_up)
    out.backward(grad_out)
    expected, d_gate, d_up = reference_grads(gate_up[..., :d_ff], gate_up[..., d_ff:], grad_out)
    assert_close(out, expected, torch.float32, "out")
    assert_close(fused.grad[::2, :, 7:], torch.cat((d_gate, d_up), -1), torch.float32, "d gate_up")
    assert torch.all(fused.grad[1::2] == 0)


@pytest.mark.parametrize("packed", [False, True])
def test_backward_is_deterministic(packed, device):
    """Two backwards give bitwise-equal gradients. Under Triton's interpreter this cannot fail
    (NumPy runs every launch, atomics included, in one order): it is a GPU check, and
    tools/gpu_check runs the whole suite on CUDA."""
    gate_up = torch.randn(37, 2 * 1000, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(37, 1000, device=device, dtype=torch.bfloat16)
    grads = []
    for _ in range(2):
        gate_up.grad = None
        out = swiglu_packed(gate_up) if packed else swiglu(gate_up[:, :1000], gate_up[:, 1000:])
        out.backward(grad_out)
        grads.append(gate_up.grad.clone())
    assert torch.equal(grads[0], grads[1])


def test_torch_backend_gives_same_numbers(monkeypatch, device):
    gate_up = torch.randn(2, 9, 2 * 300, device=device, dtype=torch.float16)
    grad_out = torch.randn(2, 9, 300, device=device, dtype=torch.float16)
    results = []
    for backend in ("auto", "torch"):
        monkeypatch.setenv("FASTLM_BACKEND", backend)
        leaf = gate_up.clone().requires_grad_()
        out = swiglu_packed(leaf)
        out.backward(grad_out)
        a = leaf.detach()[..., :300].clone().requires_grad_()
        b = leaf.detach()[..., 300:].clone().requires_grad_()
        swiglu(a, b).backward(grad_out)
        results.append((out.detach(), leaf.grad, a.grad, b.grad))
    for kernel, torch_path in zip(*results):
        torch.testing.assert_close(kernel, torch_path)


def test_module_matches_reference(device):
    d_model, d_ff = 48, 130
    ref = reference.SwiGlu(d_model, d_ff, device=device, dtype=torch.float64)
    module = SwiGlu(d_model, d_ff, device=device)
    assert set(module.state_dict()) == set(ref.state_dict()) == {"w1.w", "w2.w", "w3.w"}
    module.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    x = torch.randn(3, 11, d_model, device=device)
    grad_out = torch.randn(3, 11, d_model, device=device)
    out = module(x)
    out.backward(grad_out)
    expected = ref(x.double())
    expected.backward(grad_out.double())
    assert_close(out, expected, torch.float32, "out")
    for name, parameter in module.named_parameters():
        assert_close(parameter.grad, ref.get_parameter(name).grad, torch.float32, f"d {name}")


def test_bad_arguments_raise(device):
    gate = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="gate .* and up"):
        swiglu(gate, torch.randn(4, 9, device=device))
    with pytest.raises(TypeError, match="up has dtype"):
        swiglu(gate, gate.half())
    with pytest.raises(TypeError, match="gate must be"):
        swiglu(gate.double(), gate.double())
    with pytest.raises(TypeError, match="up must be a torch.Tensor"):
        swiglu(gate, 1.0)
    with pytest.raises(ValueError, match="gate_up must have an even, non-empty last dim"):
        swiglu_packed(torch.randn(4, 7, device=device))
    with pytest.raises(ValueError, match="gate_up must have an even, non-empty last dim"):
        swiglu_packed(torch.randn(4, 0, device=device))
    with pytest.raises(ValueError, match="gate must have a non-empty last dim"):
        swiglu(torch.randn(4, 0, device=device), torch.randn(4, 0, device=device))


@settings(max_examples=10, deadline=None)
@given(
    rows=st.lists(st.integers(1, 5), min_size=0, max_size=2),
    d_ff=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
    packed=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_fuzz_shapes(rows, d_ff, dtype, packed, seed):
    torch.manual_seed(seed)  # drawn by Hypothesis, so a failing example replays and shrinks
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gate_up = torch.randn(*rows, 2 * d_ff, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(*rows, d_ff, device=device, dtype=dtype)
    if packed:
        out = swiglu_packed(gate_up)
    else:
        out = swiglu(gate_up[..., :d_ff], gate_up[..., d_ff:])
    out.backward(grad_out)
    expected, d_gate, d_up = reference_grads(gate_up[..., :d_ff], gate_up[..., d_ff:], grad_out)
    assert_close(out, expected, dtype, "out")
    assert_close(gate_up.grad, torch.cat((d_gate, d_up), dim=-1), dtype, "d gate_up")


@pytest.mark.parametrize("packed", [False, True])
def test_second_derivatives_raise(packed, device):
    """The backward kernel has no graph: a backward through the gradient raises instead of
    silently dropping the second-order terms."""
    gate_up = torch.randn(4, 64, device=device, requires_grad=True)
    y = swiglu_packed(gate_up) if packed else swiglu(gate_up[:, :32], gate_up[:, 32:])
    (grad,) = torch.autograd.grad(y.pow(2).sum(), gate_up, create_graph=True)
    with pytest.raises(RuntimeError, match="second derivatives"):
        grad.sum().backward()
