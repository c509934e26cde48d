"""rope_attention: RoPE and flash attention on a packed q|k|v projection, against float64 RoPE +
attention written from the definitions (`_definition`: not `rope_attention_ref`, which the
PyTorch backend runs, so that backend is not compared with itself); qkv rotated in place on
both backends, its gradient one buffer with no glue ops, packed documents."""

import pytest
import torch
from attention_harness import GlueRecorder, reference, visible
from test_rope import reference_rope_autograd

from fastlm import flash_attention
from fastlm.kernels.attention import rope_attention
from fastlm.kernels.attention.qkv import split_heads
from fastlm.kernels.rope import apply_rope_, rope_tables
from fastlm.testing import assert_close


def _definition(qkv64, positions, Hq, Hkv, interleaved, max_seq_len):
    """o (B, Hq, T, D) in float64 from the definitions, sharing no code with either backend:
    q, k, v cut from qkv's last dim by hand, rotated by `reference.RoPE` (test_rope's), causal
    attention by the harness's scores-and-softmax reference."""
    B, T, width = qkv64.shape
    D = width // (Hq + 2 * Hkv)
    heads = qkv64.reshape(B, T, Hq + 2 * Hkv, D).transpose(1, 2)  # (B, H, T, D)
    q, k, v = heads[:, :Hq], heads[:, Hq : Hq + Hkv], heads[:, Hq + Hkv :]
    q, k = (reference_rope_autograd(t, positions, max_seq_len, interleaved) for t in (q, k))
    return reference(q, k, v, visible(T, T, True), D**-0.5)[0]


def _packed(B, T, Hq, Hkv, D, dtype, device):
    """A projection output qkv (B, T, (Hq + 2 Hkv) D), a non-leaf as a GEMM's output is."""
    weight = torch.randn((Hq + 2 * Hkv) * D, 24, device=device, dtype=torch.float64) / 5
    x = torch.randn(B, T, 24, device=device, dtype=torch.float64)
    return (x @ weight.T).to(dtype).detach().requires_grad_(), weight


@pytest.mark.parametrize(
    "Hq,Hkv,D,T,interleaved,dtype",
    [
        (2, 2, 16, 37, True, torch.float32),
        (4, 2, 32, 77, True, torch.bfloat16),
        (4, 1, 16, 64, False, torch.float16),
        (2, 2, 32, 1, True, torch.float32),
    ],
)
def test_rope_attention_matches_reference(device, Hq, Hkv, D, T, interleaved, dtype):
    """o and the gradient of the projection output against float64 RoPE + attention, with
    positions offset per sequence; dqkv is one poisoned buffer, so an unwritten part shows."""
    B = 2
    leaf, _ = _packed(B, T, Hq, Hkv, D, dtype, device)
    qkv = leaf * 1  # rotated in place: a computed tensor, not the leaf
    cos, sin = rope_tables(10000.0, D, 200, device=device)
    positions = torch.arange(T, device=device) + torch.tensor([[3], [50]], device=device)
    o = rope_attention(qkv, cos, sin, positions, Hq, Hkv, interleaved=interleaved)
    assert o.shape == (B, Hq, T, D) and o.transpose(1, 2).is_contiguous()
    do = torch.randn_like(o)
    o.backward(do)

    leaf64 = leaf.detach().double().requires_grad_()
    o64 = torch.cat(
        [_definition(leaf64[b : b + 1], positions[b], Hq, Hkv, interleaved, 200) for b in range(B)]
    )
    o64.backward(do.double())
    assert_close(o, o64, dtype, "o")
    assert leaf.grad.dtype == dtype
    assert_close(leaf.grad, leaf64.grad, dtype, "dqkv")


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_rope_attention_qkv_read_after_the_call(device, monkeypatch, backend):
    """qkv holds the rotated q and k after the call, on both backends; a caller that reads it
    again gets their gradient too (summed with o's and rotated back), as if it had rotated
    copies itself."""
    monkeypatch.setenv("FASTLM_BACKEND", backend)
    leaf, _ = _packed(2, 21, 2, 2, 16, torch.float32, device)
    cos, sin = rope_tables(10000.0, 16, 64, device=device)
    positions = torch.arange(21, device=device)
    weight = torch.randn(leaf.shape[-1], device=device)
    qkv = leaf * 1
    o = rope_attention(qkv, cos, sin, positions, 2)
    (o.sum() + (qkv * weight).sum()).backward()

    leaf64 = leaf.detach().double().requires_grad_()
    q64, k64, v64 = split_heads(leaf64, 2, 2)  # (B, H, T, D)
    q64, k64 = (reference_rope_autograd(t, positions, 64, True) for t in (q64, k64))
    rotated = [t.transpose(1, 2).reshape(2, 21, -1) for t in (q64, k64)]  # (B, T, H * D)
    qkv64 = torch.cat([*rotated, leaf64[..., 64:]], dim=-1)
    o64 = reference(q64, k64, v64, visible(21, 21, True), 16**-0.5)[0]
    (o64.sum() + (qkv64 * weight.double()).sum()).backward()
    assert_close(qkv, qkv64, torch.float32, "qkv after the call: q and k rotated in place")
    assert_close(leaf.grad, leaf64.grad, torch.float32, "dqkv with qkv read again")


def test_rope_attention_gradient_is_one_buffer(device):
    """From the projection output to its gradient: no zero-filled buffers, no copies, no adds."""
    leaf, weight = _packed(2, 37, 2, 2, 16, torch.float32, device)
    cos, sin = rope_tables(10000.0, 16, 64, device=device)
    with GlueRecorder() as recorder:
        qkv = leaf * 1
        o = rope_attention(qkv, cos, sin, torch.arange(37, device=device), 2, check_positions=False)
        o.backward(torch.randn_like(o))
    glue = [op for op in recorder.glue if not op.startswith("aten.mul")]
    assert not glue, glue
    # ...and the same run through views of the projection and apply_rope_ does need them:
    with GlueRecorder() as recorder:
        q, k, v = split_heads(leaf * 1, 2, 2)
        apply_rope_(q, k, cos, sin, torch.arange(37, device=device))
        flash_attention(q, k, v).backward(torch.randn(2, 2, 37, 16, device=device))
    assert any("select" in op or "slice" in op or "zero" in op for op in recorder.glue)


def test_rope_attention_is_deterministic_and_matches_the_torch_backend(device, monkeypatch):
    """Two backwards give bitwise-equal gradients. Under Triton's interpreter this cannot fail
    (NumPy runs every launch, atomics included, in one order): it is a GPU check, and
    tools/gpu_check runs the whole suite on CUDA."""
    leaf, _ = _packed(1, 50, 4, 2, 16, torch.float16, device)
    cos, sin = rope_tables(10000.0, 16, 64, device=device)
    positions = torch.arange(50, device=device)
    do = torch.randn(1, 4, 50, 16, device=device, dtype=torch.float16)
    runs = []
    for backend in ["auto", "auto", "torch"]:
        monkeypatch.setenv("FASTLM_BACKEND", backend)
        leaf.grad = None
        rope_attention(leaf * 1, cos, sin, positions, 4, 2).backward(do)
        runs.append(leaf.grad.clone())
    assert torch.equal(runs[0], runs[1])
    assert_close(runs[0], runs[2].double(), torch.float16, "kernels vs torch backend")
    monkeypatch.setenv("FASTLM_BACKEND", "auto")
    leaf.grad = None
    rope_attention(leaf * 1, cos, sin, positions, 4, 2, deterministic=False).backward(do)
    assert_close(leaf.grad, runs[2].double(), torch.float16, "atomic-dQ schedule vs torch backend")


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda qkv, c, s, p: rope_attention(qkv[..., :-1], c, s, p, 2), ValueError, "qkv must be"),
        (lambda qkv, c, s, p: rope_attention(qkv, c, s, p, 0), ValueError, "num_heads"),
        (lambda qkv, c, s, p: rope_attention(qkv, c, s, p, 4, 2), ValueError, "head dim 12"),
        (
            lambda qkv, c, s, p: rope_attention(qkv, c, s, p, 2, 5),
            ValueError,
            "must be a multiple of num_kv_heads",
        ),
        (
            lambda qkv, c, s, p: rope_attention(qkv.detach().requires_grad_(), c, s, p, 2),
            ValueError,
            "leaf",
        ),
        (lambda qkv, c, s, p: rope_attention(qkv, c[:, :4], s, p, 2), ValueError, "cos and sin"),
        (lambda qkv, c, s, p: rope_attention(qkv, c, s, p[:-1], 2), ValueError, "token_positions"),
        (lambda qkv, c, s, p: rope_attention(qkv, c, s, p + 60, 2), ValueError, "token_positions"),
        (lambda qkv, c, s, p: rope_attention(qkv.int(), c, s, p, 2), TypeError, "qkv"),
    ],
)
def test_rope_attention_bad_input(device, call, error, message):
    qkv = torch.randn(1, 9, 6 * 16, device=device, requires_grad=True) * 1
    cos, sin = rope_tables(10000.0, 16, 64, device=device)
    with pytest.raises(error, match=message):
        call(qkv, cos, sin, torch.arange(9, device=device))


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_rope_attention_packed_rows_apart_in_memory(device, monkeypatch, backend):
    """With cu_seqlens the B * T tokens are one sequence: a qkv whose rows are not one after
    another (a transposed view) is refused by name, not failed inside a view."""
    monkeypatch.setenv("FASTLM_BACKEND", backend)
    qkv = torch.randn(9, 2, 6 * 16, device=device).transpose(0, 1)
    cos, sin = rope_tables(10000.0, 16, 64, device=device)
    cu = torch.tensor([0, 5, 18], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="qkv has strides .* row b \\+ 1 must follow row b"):
        rope_attention(qkv, cos, sin, torch.arange(18, device=device), 2, cu_seqlens=cu)
    o = rope_attention(qkv[:, :5], cos, sin, torch.arange(5, device=device), 2)  # not packed: fine
    assert o.shape == (2, 2, 5, 16)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("Hq, Hkv, interleaved", [(2, 2, True), (4, 2, False)])
def test_rope_attention_packed_documents(device, monkeypatch, backend, Hq, Hkv, interleaved):
    """cu_seqlens: the B * T tokens as packed documents (one running from row 0 into row 1),
    each rotated by its own positions and attending only to itself: o and dqkv against float64
    RoPE + attention run on each document alone; under the kernels dqkv is still one buffer."""
    monkeypatch.setenv("FASTLM_BACKEND", backend)
    B, T, D, docs = 2, 19, 16, [5, 1, 20, 12]
    leaf, _ = _packed(B, T, Hq, Hkv, D, torch.float32, device)
    cos, sin = rope_tables(10000.0, D, 64, device=device)
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], device=device).int()
    positions = torch.cat([torch.arange(n, device=device) for n in docs])  # (B * T,)
    with GlueRecorder() as recorder:
        qkv = leaf * 1
        o = rope_attention(
            qkv, cos, sin, positions, Hq, Hkv, interleaved=interleaved, cu_seqlens=cu, max_seqlen=20
        )
        do = torch.randn_like(o)
        o.backward(do)
    assert o.shape == (1, Hq, B * T, D)
    if backend == "auto":
        assert not [op for op in recorder.glue if not op.startswith("aten.mul")], recorder.glue

    rows64 = leaf.detach().double().reshape(1, B * T, -1).requires_grad_()
    outs, start = [], 0
    for n in docs:
        doc = rows64[:, start : start + n]
        outs.append(_definition(doc, torch.arange(n, device=device), Hq, Hkv, interleaved, 64))
        start += n
    o64 = torch.cat(outs, dim=2)  # (1, Hq, B * T, D)
    o64.backward(do.double())
    assert_close(o, o64, torch.float32, "o")
    assert_close(leaf.grad.reshape(1, B * T, -1), rows64.grad, torch.float32, "dqkv")
