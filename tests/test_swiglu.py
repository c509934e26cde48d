"""SwiGLU (fastlm.kernels.swiglu) against the float64 reference: silu(gate) * up and its grads,
and with gpt-oss's options (alpha, limit, up_offset; interleaved gate/up) against the gate as
transformers writes it, torch.clamp's gradient included."""

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


# --------------------------------------------------------------------------------------------
# Options: gpt-oss's clamped SwiGLU
# --------------------------------------------------------------------------------------------

GPT_OSS = dict(alpha=1.702, limit=7.0, up_offset=1.0)
OPTIONS = [
    GPT_OSS,
    dict(alpha=1.0, limit=7.0, up_offset=0.0),  # DeepSeek-V4's, GLM-5's: SiLU, clamped
    dict(alpha=0.5, limit=None, up_offset=-2.0),  # no clamp
]


def options_reference_grads(gate, up, grad_out, alpha=1.0, limit=None, up_offset=0.0):
    """Output and (d gate, d up) of the gate as gpt-oss's transformers code writes it (torch.clamp,
    sigmoid, the offset added to up), all in float64."""
    gate64 = gate.detach().to(torch.float64).requires_grad_()
    up64 = up.detach().to(torch.float64).requires_grad_()
    g, u = gate64, up64
    if limit is not None:
        g, u = g.clamp(min=None, max=limit), u.clamp(min=-limit, max=limit)
    out = (u + up_offset) * (g * torch.sigmoid(g * alpha))
    out.backward(grad_out.to(torch.float64))
    return out.detach(), gate64.grad, up64.grad


def across_the_clamp(shape, dtype, device, limit=7.0):
    """Values from about -3 to 3 limits (scale 6 against 7 puts a quarter beyond the clamp), the
    first ones exactly at -limit and limit, where torch.clamp still passes the gradient."""
    x = 6 * torch.randn(shape, device=device)
    x.view(-1)[:4] = torch.tensor([limit, -limit, limit, -limit], device=device)[: x.numel()]
    return x.to(dtype)


@pytest.mark.parametrize("options", OPTIONS, ids=["gpt_oss", "silu_clamped", "alpha_offset"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1000), (37, 130), (2, 3, 257)])
def test_options_match_reference(options, dtype, shape, device):
    gate = across_the_clamp(shape, dtype, device).requires_grad_()
    up = across_the_clamp(shape, dtype, device).flip(-1).requires_grad_()  # the ends at the end
    grad_out = torch.randn(shape, device=device, dtype=dtype)
    out = swiglu(gate, up, **options)
    out.backward(grad_out)
    expected, d_gate, d_up = options_reference_grads(gate, up, grad_out, **options)
    assert out.dtype == dtype and out.shape == gate.shape
    assert_close(out, expected, dtype, "out")
    assert_close(gate.grad, d_gate, dtype, "d gate")
    assert_close(up.grad, d_up, dtype, "d up")


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_options_match_reference(interleaved, dtype, device):
    """gpt-oss's experts: gate_up interleaved (or in halves, as MiniMax-M3's), a slice of a wider
    buffer (strided rows); the gradient comes back in gate_up's own layout."""
    M, d_ff = 37, 130
    wide = across_the_clamp((M, 2 * d_ff + 9), dtype, device).requires_grad_()
    gate_up = wide[:, 9:]
    grad_out = torch.randn(M, d_ff, device=device, dtype=dtype)
    out = swiglu_packed(gate_up, interleaved=interleaved, **GPT_OSS)
    out.backward(grad_out)
    gate, up = (gate_up[:, 0::2], gate_up[:, 1::2]) if interleaved else gate_up.chunk(2, -1)
    expected, d_gate, d_up = options_reference_grads(gate, up, grad_out, **GPT_OSS)
    assert_close(out, expected, dtype, "out")
    d_gate_up = (
        torch.stack((d_gate, d_up), dim=-1).flatten(-2)
        if interleaved
        else torch.cat((d_gate, d_up), dim=-1)
    )
    assert_close(wide.grad[:, 9:], d_gate_up, dtype, "d gate_up")
    assert torch.all(wide.grad[:, :9] == 0)


def test_clamp_gradient_is_torch_clamps(device):
    """At the clamp's ends the gradient passes (torch.clamp's, ends included), beyond them it is
    exactly 0, and a NaN stays NaN in the output and gives torch's gradients (0 through a
    clamped NaN gate, NaN elsewhere)."""
    limit = GPT_OSS["limit"]
    ends = [limit, -limit, limit + 2**-20, -limit - 2**-20, 1e30, -1e30, float("nan"), 0.5]
    gate = torch.tensor(ends, device=device, dtype=torch.float64).float().requires_grad_()
    up = torch.tensor(ends[::-1], device=device).float().requires_grad_()
    grad_out = torch.ones(len(ends), device=device)
    out = swiglu(gate, up, **GPT_OSS)
    out.backward(grad_out)
    expected, d_gate, d_up = options_reference_grads(gate, up, grad_out, **GPT_OSS)
    for name, ours, theirs in (("out", out, expected), ("d gate", gate.grad, d_gate),
                               ("d up", up.grad, d_up)):  # fmt: skip
        nan = torch.isnan(theirs)
        assert torch.equal(torch.isnan(ours), nan), f"{name}: NaN at other places"
        assert torch.equal(ours[~nan] == 0, theirs[~nan] == 0), f"{name}: zeros at other places"
        assert_close(ours[~nan], theirs[~nan], torch.float32, name)


def test_options_torch_backend_gives_same_numbers(monkeypatch, device):
    gate_up = across_the_clamp((2, 9, 2 * 300), torch.bfloat16, device)
    grad_out = torch.randn(2, 9, 300, device=device, dtype=torch.bfloat16)
    results = []
    for backend in ("auto", "torch"):
        monkeypatch.setenv("FASTLM_BACKEND", backend)
        leaf = gate_up.clone().requires_grad_()
        out = swiglu_packed(leaf, interleaved=True, **GPT_OSS)
        out.backward(grad_out)
        results.append((out.detach(), leaf.grad))
    for kernel, torch_path in zip(*results):
        torch.testing.assert_close(kernel, torch_path)


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
    with pytest.raises(TypeError, match="interleaved must be a bool"):
        swiglu_packed(torch.randn(4, 8, device=device), interleaved=1)
    with pytest.raises(ValueError, match=r"gate_up must have an even.*\(gate, up, gate, up"):
        swiglu_packed(torch.randn(4, 7, device=device), interleaved=True)
    with pytest.raises(ValueError, match=r"limit must be a finite number in \(0, 1e6\]"):
        swiglu(gate, gate, limit=0.0)


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
