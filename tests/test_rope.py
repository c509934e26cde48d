"""In-place RoPE (fastlm.kernels.rope) against fastlm.reference.RoPE in float64.

The kernel writes into its input, so NaN-poisoned outputs do not apply; instead every test
compares every element of the rotated storage with the reference, and checks that the caller's
storage (not a copy) holds the result.
"""

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastlm import reference
from fastlm.kernels.rope import apply_rope_, rope_ref, rope_tables
from fastlm.modules import RoPE
from fastlm.testing import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
THETA = 10000.0


def reference_rope(
    x: torch.Tensor, positions: torch.Tensor, max_seq_len: int, interleaved: bool = True
) -> torch.Tensor:
    """reference.RoPE on float64; the half-split layout goes through it by permuting the last dim
    into interleaved order (x[i], x[i + d/2]) -> (x'[2i], x'[2i + 1]) and back."""
    d = x.shape[-1]
    rope = reference.RoPE(THETA, d, max_seq_len, device=x.device)
    x64, positions = x.detach().to(torch.float64), positions.to(x.device)
    if interleaved:
        return rope(x64, positions)
    order = torch.stack((torch.arange(d // 2), torch.arange(d // 2) + d // 2), dim=-1).flatten()
    order = order.to(x.device)
    return rope(x64[..., order], positions)[..., torch.argsort(order)]


def random_positions(batch: int | None, seq: int, max_seq_len: int, device) -> torch.Tensor:
    """(seq,) or (batch, seq) positions anywhere in [0, max_seq_len), not sorted."""
    shape = (seq,) if batch is None else (batch, seq)
    return torch.randint(0, max_seq_len, shape, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape", [(2, 3, 37, 16), (1, 1, 1, 128), (3, 2, 5, 80), (1, 4, 9, 64)])
@pytest.mark.parametrize("batched_positions", [False, True])
def test_module_matches_reference(dtype, interleaved, shape, batched_positions, device):
    B, H, T, D = shape
    max_seq_len = 64
    rope = RoPE(THETA, D, max_seq_len, device=device, interleaved=interleaved)
    x = torch.randn(shape, device=device, dtype=dtype)
    positions = random_positions(B if batched_positions else None, T, max_seq_len, device)
    expected = reference_rope(x, positions, max_seq_len, interleaved)
    pointer = x.data_ptr()
    out = rope(x, positions)
    assert out is x and x.data_ptr() == pointer  # rotated in the caller's storage
    assert_close(x, expected, dtype, "x")


@pytest.mark.parametrize("x_shape", [(4, 37, 32), (37, 32)])
@pytest.mark.parametrize("batched_positions", [False, True])
def test_module_three_and_two_dims(x_shape, batched_positions, device):
    """(B, T, D) and (T, D), as reference.RoPE takes them; (B, T) positions need a batch dim."""
    if len(x_shape) == 2 and batched_positions:
        pytest.skip("(B, T) positions broadcast a (T, D) tensor to (B, T, D): not in place")
    max_seq_len = 200
    x = torch.randn(x_shape, device=device)
    # Offset positions, as in sliding-window inference.
    positions = torch.arange(150, 150 + x_shape[-2], device=device)
    if batched_positions:
        positions = torch.stack([positions - 30 * b for b in range(x_shape[0])])
    expected = reference_rope(x, positions, max_seq_len)
    RoPE(THETA, 32, max_seq_len, device=device)(x, positions)
    assert_close(x, expected, torch.float32, "x")


def qkv_views(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int):
    """q, k, v as (B, H, T, D) views of one fused projection output (B, T, (H + 2 Hk) D)."""
    B, T, _ = qkv.shape
    C, Ck = n_heads * head_dim, n_kv_heads * head_dim
    q = qkv[..., :C].view(B, T, n_heads, head_dim).transpose(1, 2)
    k = qkv[..., C : C + Ck].view(B, T, n_kv_heads, head_dim).transpose(1, 2)
    v = qkv[..., C + Ck :].view(B, T, n_kv_heads, head_dim).transpose(1, 2)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
def test_qkv_views_rotated_in_place(dtype, interleaved, heads, device):
    """q and k as strided views of one QKV buffer: rotated there, v untouched, one call."""
    B, T, D, max_seq_len = 2, 37, 32, 128
    H, Hk = heads
    qkv = torch.randn(B, T, (H + 2 * Hk) * D, device=device, dtype=dtype)
    original = qkv.clone()
    q, k, v = qkv_views(qkv, H, Hk, D)
    q0, k0, _ = qkv_views(original, H, Hk, D)
    cos, sin = rope_tables(THETA, D, max_seq_len, device=device)
    positions = random_positions(B, T, max_seq_len, device)
    pointer = qkv.data_ptr()

    q_out, k_out = apply_rope_(q, k, cos, sin, positions, interleaved=interleaved)

    assert q_out is q and k_out is k and qkv.data_ptr() == pointer
    assert_close(q, reference_rope(q0, positions, max_seq_len, interleaved), dtype, "q")
    assert_close(k, reference_rope(k0, positions, max_seq_len, interleaved), dtype, "k")
    assert torch.equal(v, qkv_views(original, H, Hk, D)[2]), "v must not change"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
def test_autograd_through_fused_qkv(dtype, interleaved, device):
    """Gradient of the projection weight upstream of qkv, with q and k rotated in place."""
    B, T, C_in, H, Hk, D, max_seq_len = 2, 13, 24, 3, 1, 16, 64
    weight64 = torch.randn((H + 2 * Hk) * D, C_in, device=device, dtype=torch.float64)
    x64 = torch.randn(B, T, C_in, device=device, dtype=torch.float64)
    positions = torch.arange(T, device=device) + 40
    upstream = [torch.randn(B, h, T, D, device=device, dtype=torch.float64) for h in (H, Hk, Hk)]
    cos, sin = rope_tables(THETA, D, max_seq_len, device=device)

    def loss_of(q, k, v):
        return sum((t * g.to(t.dtype)).sum() for t, g in zip((q, k, v), upstream))

    weight = weight64.to(dtype).requires_grad_()
    qkv = x64.to(dtype) @ weight.T
    q, k, v = qkv_views(qkv, H, Hk, D)
    apply_rope_(q, k, cos, sin, positions, interleaved=interleaved)
    loss_of(q, k, v).float().backward()

    weight_ref = weight.detach().to(torch.float64).requires_grad_()
    q, k, v = qkv_views(x64.to(dtype).to(torch.float64) @ weight_ref.T, H, Hk, D)
    q = reference_rope_autograd(q, positions, max_seq_len, interleaved)
    k = reference_rope_autograd(k, positions, max_seq_len, interleaved)
    loss_of(q, k, v).backward()

    # The projection's own rounding (in dtype) is in both; the rope part must add little.
    assert_close(weight.grad, weight_ref.grad, dtype, "d weight")


@pytest.mark.parametrize("interleaved", [True, False])
def test_strided_head_dim(interleaved, device):
    """A head dim without a unit stride (q transposed in memory) goes through a contiguous copy:
    rotated in the caller's storage all the same, next to a k with a unit stride, and its gradient
    (a strided region of the incoming one) is rotated back as well."""
    B, H, T, D, max_seq_len = 2, 3, 11, 24, 32
    weight = torch.randn(D, device=device, requires_grad=True)
    base = torch.randn(B, H, D, T, device=device)
    storage = base * weight[:, None]
    q = storage.transpose(-1, -2)  # (B, H, T, D), stride T along D
    k = torch.randn(B, 1, T, D, device=device) * weight
    q0, k0 = q.detach().clone(), k.detach().clone()
    positions = random_positions(None, T, max_seq_len, device)
    cos, sin = rope_tables(THETA, D, max_seq_len, device=device)
    pointer = storage.data_ptr()

    apply_rope_(q, k, cos, sin, positions, interleaved=interleaved)
    assert q.stride(-1) == T and storage.data_ptr() == pointer
    assert_close(q, reference_rope(q0, positions, max_seq_len, interleaved), torch.float32, "q")
    assert_close(k, reference_rope(k0, positions, max_seq_len, interleaved), torch.float32, "k")

    upstream = torch.randn(B, H, T, D, device=device)
    (q * upstream).sum().backward()
    weight64 = weight.detach().double().requires_grad_()
    q64 = (base.double() * weight64[:, None]).transpose(-1, -2)
    rotated = reference_rope_autograd(q64, positions, max_seq_len, interleaved)
    (rotated * upstream.double()).sum().backward()
    assert_close(weight.grad, weight64.grad, torch.float32, "d weight")


def reference_rope_autograd(x64, positions, max_seq_len, interleaved):
    """reference_rope, differentiable (the permutation is an index, autograd goes through it)."""
    d = x64.shape[-1]
    rope = reference.RoPE(THETA, d, max_seq_len, device=x64.device)
    if interleaved:
        return rope(x64, positions)
    order = torch.stack((torch.arange(d // 2), torch.arange(d // 2) + d // 2), dim=-1).flatten()
    order = order.to(x64.device)
    return rope(x64[..., order], positions)[..., torch.argsort(order)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_input_gradient_and_determinism(dtype, device):
    """d x0 for x = x0 * s rotated in place, twice bitwise equal, against the reference. Under
    Triton's interpreter the bitwise check cannot fail (NumPy runs every launch in one order): it
    is a GPU check, and tools/gpu_check runs the whole suite on CUDA."""
    B, H, T, D, max_seq_len = 2, 3, 37, 48, 64
    x0 = torch.randn(B, H, T, D, device=device, dtype=dtype, requires_grad=True)
    scale = torch.rand(D, device=device, dtype=dtype) + 0.5
    grad_out = torch.randn(B, H, T, D, device=device, dtype=dtype)
    positions = random_positions(B, T, max_seq_len, device)
    rope = RoPE(THETA, D, max_seq_len, device=device)

    grads = []
    for _ in range(2):
        x0.grad = None
        rope(x0 * scale, positions).backward(grad_out)
        grads.append(x0.grad.clone())
    assert torch.equal(grads[0], grads[1])

    x64 = x0.detach().to(torch.float64).requires_grad_()
    reference_rope_autograd(x64 * scale.double(), positions, max_seq_len, True).backward(
        grad_out.double()
    )
    assert_close(grads[0], x64.grad, dtype, "d x0")


def test_shared_incoming_gradient_is_not_overwritten(device):
    """Autograd hands AddBackward's one gradient to both of its inputs: the rotation must not
    write into it, or the other branch's gradient changes."""
    T, D = 5, 8
    a = torch.randn(T, D, device=device, requires_grad=True)
    b = torch.randn(T, D, device=device, requires_grad=True)
    positions = torch.arange(T, device=device) + 3
    y = RoPE(THETA, D, 16, device=device)(a * 1.0, positions)
    (y + b).sum().backward()
    assert torch.equal(b.grad, torch.ones_like(b))
    expected = reference_rope_autograd(
        torch.ones(T, D, dtype=torch.float64, device=device), positions, 16, True
    )
    # The gradient of sum(rope(a)) w.r.t. a is the all-ones tensor rotated by -angle.
    cos, sin = rope_tables(THETA, D, 16, device=device)
    c, s = cos[positions].double(), sin[positions].double()
    ones = torch.ones(T, D // 2, dtype=torch.float64, device=device)
    inverse = torch.stack((ones * c + ones * s, ones * c - ones * s), dim=-1).flatten(-2)
    assert_close(a.grad, inverse, torch.float32, "d a")
    assert not torch.allclose(expected, inverse)  # the backward is not the forward rotation


def test_torch_backend_gives_same_numbers(monkeypatch, device):
    B, H, T, D, max_seq_len = 2, 2, 9, 32, 32
    cos, sin = rope_tables(THETA, D, max_seq_len, device=device)
    positions = random_positions(B, T, max_seq_len, device)
    qkv0 = torch.randn(B, T, 3 * H * D, device=device, dtype=torch.bfloat16)
    results = []
    for backend in ("auto", "torch"):
        monkeypatch.setenv("FASTLM_BACKEND", backend)
        qkv = qkv0.clone().requires_grad_()
        buffer = qkv * 1
        q, k, _ = qkv_views(buffer, H, H, D)
        apply_rope_(q, k, cos, sin, positions, interleaved=False)
        buffer.backward(qkv0)
        results.append((buffer.detach(), qkv.grad))
    for (out_a, grad_a), (out_b, grad_b) in zip(results[:1], results[1:]):
        torch.testing.assert_close(out_a, out_b)
        torch.testing.assert_close(grad_a, grad_b)


@pytest.mark.parametrize("bad", [-1, 32, 100])
def test_out_of_range_positions_raise(bad, device):
    rope = RoPE(THETA, 16, 32, device=device)
    positions = torch.arange(4)  # on the CPU: checked on the host, whatever x's device
    positions[2] = bad
    x = torch.randn(1, 2, 4, 16, device=device)
    before = x.clone()
    with pytest.raises(ValueError, match="token_positions"):
        rope(x, positions)
    assert torch.equal(x, before)


def test_bad_arguments_raise(device):
    cos, sin = rope_tables(THETA, 16, 32, device=device)
    positions = torch.arange(4, device=device)
    q = torch.randn(1, 2, 4, 16, device=device)
    k = torch.randn(1, 1, 4, 16, device=device)
    with pytest.raises(ValueError, match="d_k"):
        RoPE(THETA, 15, 32)
    with pytest.raises(ValueError, match="d_k"):
        rope_tables(THETA, 7, 32)
    with pytest.raises(ValueError, match="q is a leaf"):
        apply_rope_(q.clone().requires_grad_(), k, cos, sin, positions)
    with pytest.raises(ValueError, match="k is a leaf"):
        apply_rope_(q, k.requires_grad_()[:, :, :], cos, sin, positions)  # a view of a leaf
    k.requires_grad_(False)
    with pytest.raises(ValueError, match="k .* must agree"):
        apply_rope_(q, torch.randn(2, 1, 4, 16, device=device), cos, sin, positions)
    with pytest.raises(ValueError, match="head dim"):
        apply_rope_(q[..., :15], k[..., :15], cos, sin, positions)
    with pytest.raises(ValueError, match="cos and sin"):
        apply_rope_(q, k, cos[:, :4], sin[:, :4], positions)
    with pytest.raises(TypeError, match="k has dtype"):
        apply_rope_(q, k.half(), cos, sin, positions)
    with pytest.raises(TypeError, match="token_positions"):
        apply_rope_(q, k, cos, sin, positions.float())
    with pytest.raises(ValueError, match="token_positions must have shape"):
        apply_rope_(q, k, cos, sin, positions[:3])
    with pytest.raises(ValueError, match="q has elements sharing memory"):
        apply_rope_(q[:, :1].expand(1, 2, 4, 16), k, cos, sin, positions)
    with pytest.raises(ValueError, match="x must have last dim"):
        RoPE(THETA, 32, 32, device=device)(q, positions)
    # Without autograd recording, a leaf that requires grad may be rotated in place.
    leaf = q.clone().requires_grad_()
    with torch.no_grad():
        apply_rope_(leaf, k, cos, sin, positions)


def test_module_state_and_buffers(device):
    rope = RoPE(THETA, 64, 128, device=device)
    assert rope.state_dict() == {} == reference.RoPE(THETA, 64, 128).state_dict()
    ref = reference.RoPE(THETA, 64, 128, device=device)
    # One column per pair: the reference's table with each column repeated twice.
    assert torch.equal(rope.cos_cached.repeat_interleave(2, dim=-1), ref.cos_cached)
    assert torch.equal(rope.sin_cached.repeat_interleave(2, dim=-1), ref.sin_cached)


@settings(max_examples=10, deadline=None)
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 4),
    kv_heads=st.integers(1, 3),
    seq=st.integers(1, 20),
    half_dim=st.integers(1, 40),
    offset=st.integers(0, 50),
    interleaved=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_fuzz_shapes(batch, heads, kv_heads, seq, half_dim, offset, interleaved, dtype, seed):
    torch.manual_seed(seed)  # drawn by Hypothesis, so a failing example replays and shrinks
    device = "cuda" if torch.cuda.is_available() else "cpu"
    D, max_seq_len = 2 * half_dim, offset + seq
    qkv = torch.randn(batch, seq, (heads + 2 * kv_heads) * D, device=device, dtype=dtype)
    q, k, _ = qkv_views(qkv, heads, kv_heads, D)
    q0, k0 = q.clone(), k.clone()
    positions = torch.arange(offset, offset + seq, device=device)
    cos, sin = rope_tables(THETA, D, max_seq_len, device=device)
    apply_rope_(q, k, cos, sin, positions, interleaved=interleaved)
    assert_close(q, reference_rope(q0, positions, max_seq_len, interleaved), dtype, "q")
    assert_close(k, reference_rope(k0, positions, max_seq_len, interleaved), dtype, "k")


@pytest.mark.cuda
def test_cuda_positions_checked_on_device():
    """In-range CUDA positions run without a host sync; an out-of-range one trips the device-side
    assert (which ends the CUDA context, so it runs in a subprocess)."""
    script = (
        "import torch\n"
        "from fastlm.modules import RoPE\n"
        "x = torch.randn(1, 2, 4, 16, device='cuda')\n"
        "positions = torch.arange(4, device='cuda')\n"
        "RoPE(10000.0, 16, 8, device='cuda')(x, positions + {offset})\n"
        "torch.cuda.synchronize()\n"
    )
    ok = subprocess.run([sys.executable, "-c", script.format(offset=4)], capture_output=True)
    assert ok.returncode == 0, ok.stderr.decode()
    bad = subprocess.run([sys.executable, "-c", script.format(offset=5)], capture_output=True)
    assert bad.returncode != 0 and b"assert" in bad.stderr.lower(), bad.stderr.decode()


def test_second_derivatives_raise_in_place_and_are_exact_functionally(device):
    """apply_rope_'s in-place backward has no graph: a second derivative raises instead of coming
    out wrong. The functional op (what compiled code calls) has itself as its backward, so its
    second derivatives are exact."""
    cos, sin = rope_tables(THETA, 16, 32, device=device)
    positions = torch.arange(9, device=device)
    base = torch.randn(2, 2, 9, 16, device=device, requires_grad=True)
    qk = base * 1.0
    q, k = qk[0:1], qk[1:2]
    apply_rope_(q, k, cos, sin, positions)
    (grad,) = torch.autograd.grad((q * k).sum(), base, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad.pow(2).sum().backward()

    x64 = torch.randn(1, 2, 9, 16, device=device, dtype=torch.float64, requires_grad=True)
    x = x64.detach().float().requires_grad_()
    y = torch.ops.fastlm.rope(x, cos, sin, positions, True, False)
    (g,) = torch.autograd.grad(y.pow(3).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    y64 = rope_ref(x64, cos.double(), sin.double(), positions)
    (g64,) = torch.autograd.grad(y64.pow(3).sum(), x64, create_graph=True)
    (gg64,) = torch.autograd.grad(g64.sum(), x64)
    assert_close(gg, gg64, torch.float32, "second derivative through torch.ops.fastlm.rope")


@pytest.mark.parametrize("compiled", [False, True])
def test_strided_tables(device, compiled):
    """Tables that are column slices of wider ones (fastlm.hf reads Hugging Face's (T, D) cos as
    (T, D/2)): eager and compiled code (aot_eager: the functional op) both read them right."""
    D = 16
    cos, sin = rope_tables(THETA, D, 32, device)
    wide_cos, wide_sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    positions = torch.randint(0, 32, (2, 11), device=device)
    q, k = torch.randn(2, 3, 11, D, device=device), torch.randn(2, 1, 11, D, device=device)
    expected = [reference_rope(t, positions, 32, interleaved=False) for t in (q, k)]

    def rotate(q, k, cos, sin, positions):
        return apply_rope_(q, k, cos[:, : D // 2], sin[:, : D // 2], positions, interleaved=False)

    if compiled:
        rotate = torch.compile(rotate, backend="aot_eager", fullgraph=True)
    rotated = rotate(q.clone(), k.clone(), wide_cos, wide_sin, positions)
    for out, ref, name in zip(rotated, expected, "qk"):
        assert_close(out, ref, torch.float32, f"{name} with strided tables")


@pytest.mark.parametrize("in_place", [False, True])
def test_ops_read_tables_through_their_strides(device, in_place):
    """torch.ops.fastlm.rope and .rope_ called directly with Hugging Face's tables: cos and sin
    are (T, D), the two halves equal, and `cos[:, :D/2]` (row stride D) is a valid table."""
    D, max_seq_len = 16, 32
    cos, sin = rope_tables(THETA, D, max_seq_len, device)
    hf_cos, hf_sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    cos_view, sin_view = hf_cos[:, : D // 2], hf_sin[:, : D // 2]
    assert cos_view.stride() == (D, 1)
    positions = torch.randint(0, max_seq_len, (2, 11), device=device)
    q, k = torch.randn(2, 3, 11, D, device=device), torch.randn(2, 1, 11, D, device=device)
    expected = [reference_rope(t, positions, max_seq_len, interleaved=False) for t in (q, k)]
    if in_place:
        torch.ops.fastlm.rope_(q, k, cos_view, sin_view, positions, False, False)
        rotated = (q, k)
    else:
        rotated = [
            torch.ops.fastlm.rope(t, cos_view, sin_view, positions, False, False) for t in (q, k)
        ]
    for out, ref, name in zip(rotated, expected, "qk"):
        assert_close(out, ref, torch.float32, f"{name} rotated by torch.ops.fastlm.rope")
