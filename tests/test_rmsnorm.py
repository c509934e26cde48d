"""rms_norm, add_rms_norm and RmsNorm against the same math in float64.

Every comparison uses scale 1, including dweight, a sum over all rows: the inputs are exact in
float64, the kernel accumulates in fp32 (relative error ~ sqrt(rows) * 6e-8, far below every bound
for the row counts here) and rounds once to the output dtype, which the bound already allows for.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastlm import reference
from fastlm.kernels.rmsnorm import add_rms_norm, rms_norm, rms_norm_ref
from fastlm.modules import RmsNorm
from fastlm.testing import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5


def rms_norm64(x, weight, eps=EPS):
    """The op's PyTorch math in float64 (the tests' ground truth beside reference.RmsNorm)."""
    return rms_norm_ref(x.to(torch.float64), weight.to(torch.float64), eps)


def leaf(t):
    return t.detach().requires_grad_(True)


def make_inputs(shape, dtype, device, weight_dtype=None, generator=None):
    x = torch.randn(shape, dtype=dtype, device=device, generator=generator)
    weight = torch.randn(shape[-1], dtype=weight_dtype or dtype, device=device, generator=generator)
    return leaf(x), leaf(weight)


def check_rms_norm(x, weight, dtype):
    """Forward, dx and dweight of rms_norm against float64 autograd of the same math."""
    y = rms_norm(x, weight)
    assert y.shape == x.shape and y.dtype == x.dtype
    dy = torch.randn_like(y)
    y.backward(dy)

    x64, w64 = leaf(x.double()), leaf(weight.double())
    y64 = rms_norm64(x64, w64)
    y64.backward(dy.double())
    assert_close(y, y64, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    # dweight needs no rounding of its inputs, so it is held to the bound of its own dtype.
    assert_close(weight.grad, w64.grad, weight.dtype, "dweight")
    assert x.grad.dtype == x.dtype and weight.grad.dtype == weight.dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(1, 1000), (37, 1000), (37, 4096), (1, 4096), (64, 96), (2, 3, 130), (3, 5, 77)]
)
def test_rms_norm(shape, dtype, device):
    check_rms_norm(*make_inputs(shape, dtype, device), dtype)


@pytest.mark.parametrize("fused", [False, True], ids=["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("eps", [1e-5, 1e-3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_eps_is_exercised(eps, dtype, fused, device):
    """Rows whose mean square is near eps (randn of variance eps / 2, rows of one tenth and ten
    times that too): there eps changes y by 10-40 %, so a kernel that drops or misplaces eps fails
    (randn rows, mean square ~1, would not notice). y, dx, dweight (and dresidual) in float64."""
    shape = (6, 130)
    rms = (eps / 2) ** 0.5 * torch.tensor([0.3, 1.0, 3.0], device=device).repeat(2)[:, None]
    x = leaf((torch.randn(shape, device=device) * rms).to(dtype))
    residual = leaf((torch.randn(shape, device=device) * rms).to(dtype)) if fused else None
    weight = leaf(torch.randn(shape[-1], device=device).to(dtype))
    if fused:
        normed, _ = add_rms_norm(x, residual, weight, eps)
    else:
        normed = rms_norm(x, weight, eps)
    dy = torch.randn_like(normed)
    normed.backward(dy)

    leaves = [leaf(t.double()) for t in (x, weight) + ((residual,) if fused else ())]
    summed64 = leaves[0] + leaves[2] if fused else leaves[0]
    normed64 = rms_norm64(summed64, leaves[1], eps)
    normed64.backward(dy.double())
    without_eps = rms_norm64(summed64.detach(), leaves[1].detach(), 0.0)
    assert (without_eps - normed64).norm() > 0.1 * normed64.norm(), "eps is not exercised"
    assert_close(normed, normed64, dtype, "y")
    assert_close(x.grad, leaves[0].grad, dtype, "dx")
    assert_close(weight.grad, leaves[1].grad, dtype, "dweight")
    if fused:
        assert_close(residual.grad, leaves[2].grad, dtype, "dresidual")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp32_weight_with_half_input(dtype, device):
    check_rms_norm(*make_inputs((37, 1000), dtype, device, weight_dtype=torch.float32), dtype)


# Not hidden 1: there x_hat = +-1 up to eps, and dx = rstd * g * dy * (1 - x_hat^2) is a
# cancellation that no fp32 implementation gets to 1e-4 (PyTorch's neither).
@pytest.mark.parametrize("shape", [(3, 65536), (2, 50000), (7, 2), (300, 3)])
def test_extreme_hidden_sizes(shape, device):
    check_rms_norm(*make_inputs(shape, torch.bfloat16, device), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows(dtype, device):
    """Row slices of wider tensors (the last dim contiguous) and a transposed view."""
    views = [
        torch.randn(37, 1000 + 24, dtype=dtype, device=device)[:, :1000],
        torch.randn(3, 7, 2 * 130, dtype=dtype, device=device)[:, :, 130:],
        torch.randn(77, 5, dtype=dtype, device=device).t(),
    ]
    for view in views:
        x = leaf(view)  # detach keeps the view's strides
        assert not x.is_contiguous()
        check_rms_norm(x, leaf(torch.randn(x.shape[-1], dtype=dtype, device=device)), dtype)


def test_matches_reference_module(device):
    """Same state_dict as reference.RmsNorm; same output as it on the same weights."""
    ours = RmsNorm(1000, eps=1e-6, device=device)
    ref = reference.RmsNorm(1000, eps=1e-6, device=device)
    with torch.no_grad():
        ref.g.normal_()
    ours.load_state_dict(ref.state_dict())
    assert list(ours.state_dict()) == list(ref.state_dict()) == ["g"]
    x = torch.randn(2, 37, 1000, device=device)
    assert_close(ours(x), ref(x), torch.float32, "module y")
    assert_close(
        ours(x), rms_norm64(x, ours.g.detach(), eps=1e-6), torch.float32, "module vs float64"
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1000), (37, 1000), (2, 3, 130), (37, 4096)])
def test_add_rms_norm(shape, dtype, device):
    x, weight = make_inputs(shape, dtype, device)
    residual = leaf(torch.randn(shape, dtype=dtype, device=device))
    normed, summed = add_rms_norm(x, residual, weight)
    assert torch.equal(summed, x + residual), "summed must equal PyTorch's x + residual bitwise"
    d_normed, d_summed = torch.randn_like(normed), torch.randn_like(summed)
    torch.autograd.backward([normed, summed], [d_normed, d_summed])

    x64, r64, w64 = leaf(x.double()), leaf(residual.double()), leaf(weight.double())
    exact = x64 + r64
    # The norm sees the sum rounded to the input dtype; take that value, keep the sum's gradient.
    summed64 = exact + ((x + residual).double() - exact).detach()
    normed64 = rms_norm64(summed64, w64)
    torch.autograd.backward([normed64, summed64], [d_normed.double(), d_summed.double()])
    assert_close(normed, normed64, dtype, "normed")
    assert_close(x.grad, x64.grad, dtype, "dx")
    assert_close(residual.grad, r64.grad, dtype, "dresidual")
    assert_close(weight.grad, w64.grad, dtype, "dweight")


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(37, 1000), (2, 3, 130)])
def test_add_rms_norm_mixed_precision(shape, half, device):
    """The autocast residual stream: a half-precision sub-layer output x, an fp32 residual and
    weight. summed is fp32 (x + residual bitwise, as PyTorch promotes), normed is written in the
    half dtype the next GEMM reads (the fp32 norm rounded once), dx comes back in x's dtype and
    dresidual in fp32, from upstream gradients in those dtypes."""
    x = leaf(torch.randn(shape, device=device).to(half))
    residual = leaf(torch.randn(shape, device=device))
    weight = leaf(torch.randn(shape[-1], device=device))
    normed, summed = add_rms_norm(x, residual, weight, out_dtype=half)
    assert normed.dtype == half and summed.dtype == torch.float32
    assert torch.equal(summed, x + residual)
    d_normed, d_summed = torch.randn_like(normed), torch.randn_like(summed)
    torch.autograd.backward([normed, summed], [d_normed, d_summed])
    assert x.grad.dtype == half and residual.grad.dtype == torch.float32

    x64, r64, w64 = leaf(x.double()), leaf(residual.double()), leaf(weight.double())
    summed64 = x64 + r64
    normed64 = rms_norm64(summed64, w64)
    torch.autograd.backward([normed64, summed64], [d_normed.double(), d_summed.double()])
    assert_close(normed, normed64, half, "normed")
    assert torch.equal(normed, rms_norm(summed, weight).to(half)), "normed: one rounding from fp32"
    assert_close(x.grad, x64.grad, half, "dx")
    assert_close(residual.grad, r64.grad, torch.float32, "dresidual")
    assert_close(weight.grad, w64.grad, torch.float32, "dweight")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_out_dtype(dtype, device):
    """out_dtype: the fp32 result rounded once to it, with gradients as without it."""
    x, weight = make_inputs((5, 130), torch.float32, device)
    y = rms_norm(x, weight, out_dtype=dtype)
    assert y.dtype == dtype
    assert torch.equal(y, rms_norm(x, weight).to(dtype))
    dy = torch.randn_like(y)
    y.backward(dy)
    x64, w64 = leaf(x.double()), leaf(weight.double())
    rms_norm64(x64, w64).backward(dy.double())
    assert x.grad.dtype == torch.float32
    # Computed in fp32 from fp32 x and weight and a dy that fp32 holds exactly: fp32's bound.
    assert_close(x.grad, x64.grad, torch.float32, "dx")
    assert_close(weight.grad, w64.grad, torch.float32, "dweight")


def test_add_rms_norm_one_output_used(device):
    """Only normed used: the gradients of rms_norm(x + residual). Only summed used: passed
    through."""
    x, weight = make_inputs((37, 130), torch.float32, device)
    residual = leaf(torch.randn_like(x))
    normed, _ = add_rms_norm(x, residual, weight)
    d_normed = torch.randn_like(normed)
    normed.backward(d_normed)
    s, w2 = leaf(x + residual), leaf(weight)
    rms_norm(s, w2).backward(d_normed)
    assert torch.equal(x.grad, s.grad) and torch.equal(residual.grad, s.grad)
    assert torch.equal(weight.grad, w2.grad)

    x.grad = residual.grad = weight.grad = None
    _, summed = add_rms_norm(x, residual, weight)
    d_summed = torch.randn_like(summed)
    summed.backward(d_summed)
    assert torch.equal(x.grad, d_summed) and torch.equal(residual.grad, d_summed)
    assert weight.grad is None or not weight.grad.any()


@pytest.mark.parametrize("fused", [False, True])
def test_backward_is_deterministic(fused, device):
    """Many row tiles spread over several programs: two backwards give bitwise-equal gradients.
    Under Triton's interpreter this cannot fail (NumPy runs every launch in one order): it is a
    GPU check, and tools/gpu_check runs the whole suite on CUDA."""
    x, weight = make_inputs((300, 96), torch.bfloat16, device)
    residual = leaf(torch.randn_like(x))
    dy = torch.randn_like(x)
    grads = []
    for _ in range(2):
        x.grad = residual.grad = weight.grad = None
        y = add_rms_norm(x, residual, weight)[0] if fused else rms_norm(x, weight)
        y.backward(dy)
        grads.append((x.grad, weight.grad))
    assert torch.equal(grads[0][0], grads[1][0])
    assert torch.equal(grads[0][1], grads[1][1])


def test_torch_backend_gives_the_same_numbers(monkeypatch, device):
    """fp32, so that both sides' results differ by reduction order only, not by a rounding flip."""
    x, weight = make_inputs((37, 1000), torch.float32, device)
    residual = torch.randn_like(x)
    dy = torch.randn_like(x)

    def run():
        x.grad = weight.grad = None
        normed, summed = add_rms_norm(x, residual, weight)
        y = rms_norm(x, weight)
        y.backward(dy)
        return y, normed, summed, x.grad, weight.grad

    ours = run()
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    theirs = run()
    for name, a, b in zip(["y", "normed", "summed", "dx", "dweight"], ours, theirs):
        assert_close(a, b, torch.float32, name)
    assert torch.equal(ours[2], theirs[2])


def test_empty_rows(device):
    x, weight = make_inputs((0, 64), torch.float32, device)
    y = rms_norm(x, weight)
    assert y.shape == (0, 64)
    y.sum().backward()
    assert x.grad.shape == (0, 64) and not weight.grad.any()


@pytest.mark.parametrize(
    "call, error, name",
    [
        (lambda x, w, r: rms_norm(x.int(), w), TypeError, "x"),
        (lambda x, w, r: rms_norm(x.tolist(), w), TypeError, "x"),
        (lambda x, w, r: rms_norm(x, w.double()), TypeError, "weight"),
        (lambda x, w, r: rms_norm(x, w.half()), TypeError, "weight"),
        (lambda x, w, r: rms_norm(x, w[:-1]), ValueError, "weight"),
        (lambda x, w, r: rms_norm(x, w[None]), ValueError, "weight"),
        (lambda x, w, r: rms_norm(x[0, 0], w), ValueError, "x"),
        (lambda x, w, r: rms_norm(x[..., :0], w[:0]), ValueError, "x"),
        (lambda x, w, r: add_rms_norm(x, r[:, :-1], w), ValueError, "residual"),
        (lambda x, w, r: add_rms_norm(x, r.int(), w), TypeError, "residual"),
        (lambda x, w, r: add_rms_norm(x, r, w, out_dtype=torch.int8), TypeError, "out_dtype"),
        (lambda x, w, r: rms_norm(x, w, out_dtype=torch.float64), TypeError, "out_dtype"),
        (lambda x, w, r: add_rms_norm(x, None, w), TypeError, "residual"),
        (lambda x, w, r: add_rms_norm(x, r, w[:3]), ValueError, "weight"),
    ],
)
def test_bad_input(call, error, name, device):
    x = torch.randn(4, 8, dtype=torch.bfloat16, device=device)
    weight = torch.randn(8, dtype=torch.bfloat16, device=device)
    with pytest.raises(error, match=rf"\b{name}\b"):
        call(x, weight, torch.randn_like(x))


def test_hidden_too_large_for_the_kernels(device):
    x, weight = torch.randn(1, 65537, device=device), torch.randn(65537, device=device)
    with pytest.raises(ValueError, match=r"\bx\b"):
        rms_norm(x, weight)


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.integers(1, 70),
    hidden=st.integers(8, 2100),
    dtype=st.sampled_from(DTYPES),
    fused=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_fuzz(rows, hidden, dtype, fused, seed, device):
    generator = torch.Generator(device).manual_seed(seed)
    x, weight = make_inputs((rows, hidden), dtype, device, generator=generator)
    if not fused:
        torch.manual_seed(seed)
        check_rms_norm(x, weight, dtype)
        return
    residual = torch.randn(rows, hidden, dtype=dtype, device=device, generator=generator)
    normed, summed = add_rms_norm(x, residual, weight)
    assert torch.equal(summed, x + residual)
    assert_close(normed, rms_norm64((x + residual).double(), weight), dtype, "normed")


@pytest.mark.cuda
def test_torch_compile(device):
    x, weight = make_inputs((37, 1000), torch.bfloat16, device)
    residual = torch.randn_like(x)
    compiled = torch.compile(lambda x, r, w: add_rms_norm(x, r, w)[0] + rms_norm(x, w))
    out = compiled(x, residual, weight)
    out.backward(torch.ones_like(out))
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, residual, weight))
    expected = rms_norm64(x64 + r64, w64) + rms_norm64(x64, w64)
    expected.backward(torch.ones_like(expected))
    assert_close(out, expected, torch.bfloat16, "compiled")
    assert_close(x.grad, x64.grad, torch.bfloat16, "compiled dx")
    assert_close(weight.grad, w64.grad, torch.bfloat16, "compiled dweight")


@pytest.mark.parametrize("fused", [False, True])
def test_second_derivatives_raise(fused, device):
    """The backward kernel has no graph: a backward through the gradient raises instead of
    silently dropping the second-order terms."""
    x, weight = make_inputs((5, 64), torch.float32, device)
    residual = leaf(torch.randn_like(x))
    y = add_rms_norm(x, residual, weight)[0] if fused else rms_norm(x, weight)
    (dx,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="second derivatives"):
        dx.sum().backward()


def gemma_norm64(x, weight, eps):
    """Gemma's RMSNorm in float64: x_hat * (1 + w), the weight stored as a deviation from one."""
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.double())


@pytest.mark.parametrize(
    "dtype, weight_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
    ],
)
@pytest.mark.parametrize("shape", [(37, 130), (2, 3, 77), (1, 1000)])
def test_offset_is_gemmas_norm(shape, dtype, weight_dtype, device):
    """offset=1: x_hat * (1 + w) in fp32, rounded once to x's dtype; dweight unchanged in form.
    Weights near zero, as Gemma's are stored, so that a dropped offset cannot pass."""
    x = leaf(torch.randn(shape, dtype=dtype, device=device))
    weight = leaf((0.1 * torch.randn(shape[-1], device=device)).to(weight_dtype))
    y = rms_norm(x, weight, 1e-6, offset=1.0)
    assert y.dtype == dtype and y.shape == x.shape
    dy = torch.randn_like(y)
    y.backward(dy)
    x64, w64 = leaf(x.detach().double()), leaf(weight.detach().double())
    y64 = gemma_norm64(x64, w64, 1e-6)
    y64.backward(dy.double())
    assert_close(y, y64, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    assert_close(weight.grad, w64.grad, weight_dtype, "dweight")
    assert_close(rms_norm_ref(x, weight, 1e-6, offset=1.0), y64, dtype, "rms_norm_ref")


def test_offset_on_strided_rows(device):
    wide = leaf(torch.randn(9, 5, 140, device=device))
    x = wide[:, :, 3:133]  # rows with a leading stride of 140
    weight = leaf(0.1 * torch.randn(130, device=device))
    y = rms_norm(x, weight, 1e-5, offset=1.0, out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    x64, w64 = leaf(x.detach().double()), leaf(weight.detach().double())
    gemma_norm64(x64, w64, 1e-5).sum().backward()
    assert_close(wide.grad[:, :, 3:133], x64.grad, torch.bfloat16, "dx")
    assert torch.all(wide.grad[:, :, :3] == 0)
    with pytest.raises(TypeError, match="offset must be a real number"):
        rms_norm(x, weight, offset="1")
