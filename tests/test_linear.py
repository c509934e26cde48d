"""fastlm.kernels.linear: weights cast together, and GEMMs whose weight gradients leave in fp32.

Checks taking the `gemms` fixture (conftest.py) run on the CPU as it runs them and with the mixed
GEMMs CUDA has lent to it.
"""

import pytest
import torch
import torch.nn.functional as F

from fastlm.kernels.linear import (
    add_product,
    autocast_dtype,
    cast_weights,
    half_linear,
    has_mixed_gemm,
    product,
)
from fastlm.testing import assert_close


def test_cast_weights_stacks_each_group_in_one_buffer(device):
    w1, w3, w2 = (torch.randn(r, c, device=device) for r, c in ((5, 7), (3, 7), (7, 4)))
    w13, w2_half = cast_weights([[w1, w3], [w2]], torch.bfloat16)
    assert w13.shape == (8, 7) and w2_half.shape == (7, 4)
    assert torch.equal(w13, torch.cat([w1, w3]).to(torch.bfloat16))
    assert torch.equal(w2_half, w2.to(torch.bfloat16))
    assert w13.untyped_storage().data_ptr() == w2_half.untyped_storage().data_ptr()
    assert not w13.requires_grad


def test_cast_weights_rejects_groups_that_do_not_stack(device):
    with pytest.raises(ValueError, match="one column count"):
        cast_weights(
            [[torch.randn(2, 3, device=device), torch.randn(2, 4, device=device)]], torch.bfloat16
        )
    with pytest.raises(ValueError, match="2-D"):
        cast_weights([[torch.randn(6, device=device)]], torch.bfloat16)


def test_autocast_dtype(device):
    w = torch.randn(2, 2, device=device)
    assert autocast_dtype(w) is None
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        assert autocast_dtype(w) == torch.bfloat16
        assert autocast_dtype(w.to(torch.bfloat16)) is None  # already what the GEMM reads


@pytest.mark.parametrize("rows", [(24,), (17, 9)], ids=["one-weight", "stacked"])
def test_half_linear_against_float64(device, gemms, rows):
    """Output and gradients against float64 math on the fp32 weights; weight gradients fp32."""
    C = 13
    weights = [torch.randn(r, C, device=device, requires_grad=True) for r in rows]
    x = torch.randn(3, 11, C + 2, device=device)[..., 1:-1].requires_grad_()  # strided rows
    dy = torch.randn(3, 11, sum(rows), device=device)
    (stacked,) = cast_weights([weights], torch.bfloat16)

    y = half_linear(x, stacked, *weights)
    y.backward(dy)

    x64, w64 = x.detach().double().requires_grad_(), torch.cat(weights).detach().double()
    w64.requires_grad_()
    y64 = x64 @ w64.T
    y64.backward(dy.double())
    assert y.dtype == torch.bfloat16
    assert_close(y, y64, torch.bfloat16, "y")
    assert x.grad.dtype == torch.float32
    assert_close(x.grad, x64.grad, torch.bfloat16, "dx")
    for w, dw64 in zip(weights, w64.grad.split(rows)):
        assert w.grad.dtype == torch.float32
        assert_close(w.grad, dw64, torch.bfloat16, "dW")
    # From the bf16 operands the GEMM reads, the mixed GEMM's fp32 accumulation is fp32-exact, which
    # a bf16 round trip (2^-9) is not; without it (the CPU's own GEMM) the product is rounded.
    dy_half, x_half = (t.to(torch.bfloat16).double() for t in (dy, x))
    read = (dy_half.reshape(-1, sum(rows)).T @ x_half.reshape(-1, C)).split(rows)
    for w, dw_read in zip(weights, read):
        exact_to = torch.float32 if gemms else torch.bfloat16
        assert_close(w.grad, dw_read, exact_to, "dW from the operands the GEMM reads")


def test_half_linear_on_the_cpu_gemm_is_autocast_bit_for_bit(device):
    """Without the mixed GEMM, a weight gradient is the bf16 product cast up: autocast's numbers."""
    if has_mixed_gemm(device):
        pytest.skip("this device accumulates dW in fp32 inside the GEMM (more exact than autocast)")
    w = torch.randn(10, 6, device=device, requires_grad=True)
    x = torch.randn(7, 6, device=device, requires_grad=True)
    dy = torch.randn(7, 10, device=device)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        (w_half,) = cast_weights([[w]], torch.bfloat16)
        y = half_linear(x, w_half, w)
        w_ref, x_ref = w.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
        y_ref = F.linear(x_ref, w_ref)
    (y.float() * dy).sum().backward()
    (y_ref.float() * dy).sum().backward()
    assert torch.equal(y, y_ref)
    assert torch.equal(w.grad, w_ref.grad)
    assert torch.equal(x.grad, x_ref.grad)


def test_half_linear_gradient_only_where_asked(device, gemms):
    w_frozen = torch.randn(4, 5, device=device)
    w = torch.randn(3, 5, device=device, requires_grad=True)
    (stacked,) = cast_weights([[w_frozen, w]], torch.bfloat16)
    x = torch.randn(2, 5, device=device)
    half_linear(x, stacked, w_frozen, w).sum().backward()
    assert w.grad is not None and w_frozen.grad is None and x.grad is None


def test_half_linear_rejects_mismatched_shapes(device):
    w = torch.randn(4, 5, device=device)
    (stacked,) = cast_weights([[w]], torch.bfloat16)
    with pytest.raises(ValueError, match="stacked by rows"):
        half_linear(torch.randn(2, 5, device=device), stacked, w, w)
    with pytest.raises(ValueError, match="x's last dim"):
        half_linear(torch.randn(2, 6, device=device), stacked, w)


def test_product_and_add_product(device, gemms):
    a = torch.randn(9, 5, device=device, dtype=torch.bfloat16)
    b = torch.randn(5, 4, device=device, dtype=torch.bfloat16)
    exact = a.double() @ b.double()
    # The mixed GEMM sums the exact products in fp32: fp32's bound, which a bf16 round trip of
    # the product (2^-9) misses; the CPU's own GEMM rounds the product to bf16.
    exact_to = torch.float32 if gemms else torch.bfloat16
    out = product(a, b, torch.float32)
    assert out.dtype == torch.float32
    assert_close(out, exact, exact_to, "a @ b")
    acc = torch.randn(9, 4, device=device)
    start = acc.double()
    add_product(acc, a, b)
    assert acc.dtype == torch.float32
    assert_close(acc, start + exact, exact_to, "acc + a @ b")
