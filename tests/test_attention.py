"""flash_attention against float64 attention (fastlm.reference), forward and every gradient.

Interpreter block sizes (64x32 forward, 32x64 dK/dV, 64x32 dQ) make 77, 130 and 257 partial-block
lengths, and causal runs with Nq < Nk put the diagonal anywhere inside a block. Cases with several
batches, heads and blocks check how each kernel splits its 1-D grid into (block, batch * head).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fastlm.kernels.attention import (
    attention_ref,
    flash_attention,
    rope_attention,
    rope_attention_ref,
    split_heads,
)
from fastlm.kernels.attention.backward import attention_backward
from fastlm.kernels.attention.forward import _use_tensor_descriptors, attention_forward
from fastlm.kernels.attention.launch import empty_heads_like
from fastlm.kernels.rope import apply_rope_, rope_ref, rope_tables
from fastlm.reference import ScaledDotProductAttention
from fastlm.testing import TOLERANCE, assert_close

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def reference_attention(q, k, v, causal: bool, softmax_scale: float | None = None) -> torch.Tensor:
    """fastlm.reference attention in float64, with grouped heads repeated and the end-aligned
    mask."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    D, (Nq, Nk) = q.shape[-1], (q.shape[2], k.shape[2])
    if softmax_scale is not None:  # the reference divides by sqrt(D)
        q = q * (softmax_scale * math.sqrt(D))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = None
    if causal:  # True where masked: query i sees key j <= i + Nk - Nq
        mask = ~torch.ones(Nq, Nk, dtype=torch.bool, device=q.device).tril(Nk - Nq)
    return ScaledDotProductAttention()(q, k, v, mask)


def make_inputs(B, Hq, Hkv, Nq, Nk, D, dtype, device, std=1.0):
    q = (torch.randn(B, Hq, Nq, D, device=device) * std).to(dtype).requires_grad_()
    k = (torch.randn(B, Hkv, Nk, D, device=device) * std).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv, Nk, D, device=device).to(dtype).requires_grad_()
    return q, k, v


def run(q, k, v, causal, softmax_scale=None, deterministic=True):
    """Output and (dq, dk, dv) of flash_attention for a random dO; fp32 asks for full-precision dots
    so that the fp32 bound also holds on a GPU (TF32 is tested on its own)."""
    for t in (q, k, v):
        t.grad = None
    o = flash_attention(
        q, k, v, causal, softmax_scale, allow_tf32=False, deterministic=deterministic
    )
    do = torch.randn_like(o)
    o.backward(do)
    return o, do, (q.grad, k.grad, v.grad)


def reference_run(q, k, v, do, causal, softmax_scale=None):
    q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    o = reference_attention(q64, k64, v64, causal, softmax_scale)
    o.backward(do.to(torch.float64))
    return o, (q64.grad, k64.grad, v64.grad)


def check_against_reference(q, k, v, causal, softmax_scale=None, deterministic=True):
    o, do, grads = run(q, k, v, causal, softmax_scale, deterministic)
    ref_o, ref_grads = reference_run(q, k, v, do, causal, softmax_scale)
    dtype = q.dtype
    assert o.dtype == dtype and o.shape == q.shape
    assert_close(o, ref_o, dtype, "o")
    assert_close(grads[2], ref_grads[2], dtype, "dv")
    if k.shape[2] == 1:
        # One key: P = 1 whatever q and k are, so dQ = dK = 0 exactly; only round-off of
        # dP - Delta (|dO| |v| at most) may remain, scaled by s |k| or s |q|.
        scale = softmax_scale or q.shape[-1] ** -0.5
        bound = TOLERANCE[dtype] * scale * do.double().norm() * v.double().norm()
        assert grads[0].double().norm() <= bound * k.double().norm(), "dq of a single key is not ~0"
        assert grads[1].double().norm() <= bound * q.double().norm(), "dk of a single key is not ~0"
    else:
        assert_close(grads[0], ref_grads[0], dtype, "dq")
        assert_close(grads[1], ref_grads[1], dtype, "dk")
    return o, grads


# (B, Hq, Hkv, Nq, Nk, D, causal, dtype): every N, D and dtype appears, with and without the causal
# mask, grouped (Hq > Hkv) and multi-query (Hkv = 1) heads, Nq < Nk (decoding, chunked prefill), and
# several batches, heads and blocks at once (the 1-D grids' decomposition).
CASES = [
    (1, 2, 2, 1, 1, 16, True, torch.float32),
    (2, 2, 1, 17, 17, 32, True, torch.float16),
    (1, 4, 2, 64, 64, 64, False, torch.bfloat16),
    (1, 2, 2, 77, 77, 80, True, torch.float32),
    (1, 1, 1, 130, 130, 128, True, torch.bfloat16),
    (1, 2, 1, 257, 257, 16, True, torch.float16),
    (1, 2, 2, 257, 257, 32, False, torch.float32),
    (1, 3, 1, 77, 130, 64, True, torch.float16),
    (1, 2, 2, 1, 257, 128, True, torch.bfloat16),
    (2, 2, 2, 17, 64, 80, False, torch.float32),
    (1, 4, 1, 130, 257, 16, True, torch.float32),
    (1, 2, 2, 64, 77, 128, True, torch.float16),
    (1, 2, 1, 130, 130, 64, False, torch.float16),
    (1, 2, 2, 77, 77, 96, False, torch.bfloat16),
    (1, 2, 2, 64, 64, 8, True, torch.float32),
    (2, 3, 1, 130, 130, 16, True, torch.float16),
]


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal,dtype", CASES)
def test_matches_reference(device, B, Hq, Hkv, Nq, Nk, D, causal, dtype):
    check_against_reference(*make_inputs(B, Hq, Hkv, Nq, Nk, D, dtype, device), causal)


# A subset of CASES through each forward path, forced: every dtype, a padded head dim (80), GQA
# and MQA, Nq < Nk, rows past a block.
PATH_CASES = [CASES[i] for i in (1, 2, 3, 7, 8, 11)]


@pytest.mark.parametrize("tma", ["1", "0"], ids=["descriptor", "pointer"])
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal,dtype", PATH_CASES)
def test_forward_paths_match_reference(
    device, monkeypatch, tma, B, Hq, Hkv, Nq, Nk, D, causal, dtype
):
    """FASTLM_ATTENTION_TMA forces the tensor-descriptor forward (1) or the pointer one (0)."""
    monkeypatch.setenv("FASTLM_ATTENTION_TMA", tma)
    q, k, v = make_inputs(B, Hq, Hkv, Nq, Nk, D, dtype, device)
    o = empty_heads_like(q.detach())
    assert _use_tensor_descriptors(q, k, v, o) == (tma == "1")
    check_against_reference(q, k, v, causal)


def test_descriptor_forward_reads_packed_qkv_in_place(device, monkeypatch):
    """A packed q|k|v (row stride (Hq + 2 Hkv) D) takes the descriptor path and agrees with the
    pointer path; a misaligned view falls back to pointers."""
    B, T, Hq, Hkv, D = 2, 77, 4, 2, 32
    qkv = torch.randn(B, T, (Hq + 2 * Hkv) * D, device=device, dtype=torch.float16)
    q, k, v = split_heads(qkv, Hq, Hkv)
    monkeypatch.setenv("FASTLM_ATTENTION_TMA", "1")
    assert _use_tensor_descriptors(q, k, v, empty_heads_like(q))
    o_tma, lse_tma = attention_forward(q, k, v, True, D**-0.5, True)
    monkeypatch.setenv("FASTLM_ATTENTION_TMA", "0")
    o_ptr, lse_ptr = attention_forward(q, k, v, True, D**-0.5, True)
    assert_close(o_tma, o_ptr.double(), torch.float16, "o, descriptor vs pointer path")
    assert_close(lse_tma, lse_ptr.double(), torch.float32, "lse, descriptor vs pointer path")
    monkeypatch.setenv("FASTLM_ATTENTION_TMA", "1")
    shifted = torch.randn(B * T * 8 * D + 1, device=device, dtype=torch.float16)[1:]
    q, k, v = split_heads(shifted.view(B, T, 8 * D), Hq, Hkv)  # base 2 bytes past alignment
    assert not _use_tensor_descriptors(q, k, v, empty_heads_like(q))


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,causal,dtype", CASES)
def test_atomic_dq_schedule_matches_reference(device, B, Hq, Hkv, Nq, Nk, D, causal, dtype):
    """deterministic=False: dQ added with atomics inside the dK/dV pass, on every shape case."""
    check_against_reference(
        *make_inputs(B, Hq, Hkv, Nq, Nk, D, dtype, device), causal, deterministic=False
    )


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tma", ["1", "0"], ids=["descriptor", "pointer"])
@pytest.mark.parametrize("scale", [0.3, -0.3, 0.0])
def test_softmax_scale(device, monkeypatch, causal, tma, scale):
    """A positive scale takes the row max of the unscaled scores; zero and negative ones scale
    first (the max would not commute with them)."""
    monkeypatch.setenv("FASTLM_ATTENTION_TMA", tma)
    check_against_reference(
        *make_inputs(1, 2, 1, 77, 130, 32, torch.float32, device), causal, softmax_scale=scale
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_scores_do_not_overflow(device, dtype):
    """Scores of magnitude ~1e3 (e^1000 overflows every float type): all finite and accurate.

    O and dV are well conditioned and meet the usual bound. At such scores P is almost one-hot and
    dS = P * (dP - Delta) cancels: the error of any floating-point dQ is relative to the terms that
    cancel, s * (P * (|dP| + |Delta|)) |K| (and likewise for dK), not to the tiny result.
    """
    D, scale = 64, 64**-0.5
    q, k, v = make_inputs(1, 2, 2, 77, 77, D, dtype, device, std=1000**0.5)
    o, do, grads = run(q, k, v, causal=True)
    ref_o, ref_grads = reference_run(q, k, v, do, causal=True)
    assert_close(o, ref_o, dtype, "o")
    assert_close(grads[2], ref_grads[2], dtype, "dv")

    q64, k64, v64, do64 = (t.detach().double() for t in (q, k, v, do))
    scores = scale * q64 @ k64.transpose(-1, -2)
    assert scores.abs().amax() > 1000
    p = scores.masked_fill(
        ~torch.ones(77, 77, dtype=torch.bool, device=device).tril(), -math.inf
    ).softmax(-1)
    dp = do64 @ v64.transpose(-1, -2)
    delta = (ref_o * do64).sum(-1, keepdim=True)
    cancelling = scale * p * (dp.abs() + delta.abs())
    for name, grad, ref_grad, magnitude in (
        ("dq", grads[0], ref_grads[0], cancelling @ k64.abs()),
        ("dk", grads[1], ref_grads[1], cancelling.transpose(-1, -2) @ q64.abs()),
    ):
        assert torch.isfinite(grad).all(), f"{name} is not finite"
        err = torch.linalg.vector_norm(grad.double() - ref_grad) / torch.linalg.vector_norm(
            magnitude
        )
        assert err <= TOLERANCE[dtype], (
            f"{name}: error {err:.2e} of the cancelling terms' size ({dtype})"
        )


class _CopyRecorder(TorchDispatchMode):
    """The ops that read `base`'s memory into other memory while active: clone (`.contiguous()`),
    copy_, _to_copy and the like. Not recorded: views of `base` (they return its own memory),
    factories like new_empty (they read only its dtype and device; the interpreter's launch uses
    it),
    and fastlm's own ops, which a dispatch mode sees whole: what runs inside them (the launchers) is
    recorded by calling the launchers directly."""

    def __init__(self, base: torch.Tensor):
        super().__init__()
        self.base_ptr = base.untyped_storage().data_ptr()
        self.copies = []

    def _in_base(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == self.base_ptr

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        reads_base = any(self._in_base(t) for t in tree_leaves((args, kwargs)))
        factory = name.startswith("new_") or name.endswith("_like")
        if (
            reads_base
            and not factory
            and func.namespace != "fastlm"
            and not any(self._in_base(t) for t in tree_leaves(out))
        ):
            self.copies.append(str(func))
        return out


def test_strided_inputs_need_no_copy(device):
    """q, k, v as slices of one fused (B, N, 3, H, D) projection viewed as (B, H, N, D), and head
    dims
    with stride 4, are read in place: no torch op copies their memory, forward or backward (the
    kernels get the strides). The results are bitwise those of contiguous copies."""
    B, N, H, D = 2, 77, 2, 32
    qkv = torch.randn(B, N, 3, H, D, device=device, dtype=torch.float16, requires_grad=True)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, N, D), token-major memory
    do = torch.randn(B, N, H, D, device=device, dtype=torch.float16).transpose(1, 2)
    with _CopyRecorder(qkv) as recorder:
        o = flash_attention(q, k, v, causal=True)
        (dqkv,) = torch.autograd.grad(o, qkv, do)
    assert not recorder.copies, f"q, k, v were copied by {recorder.copies}"
    assert o.transpose(1, 2).is_contiguous(), "o should keep q's [B, N, H, D] memory layout"
    with torch.no_grad(), _CopyRecorder(qkv) as recorder:  # inside the ops: the launchers
        o_launched, lse = attention_forward(q, k, v, True, D**-0.5, True)
        for deterministic in (True, False):
            attention_backward(do, q, k, v, o_launched, lse, True, D**-0.5, True, deterministic)
    assert not recorder.copies, f"the launchers copied q, k, v by {recorder.copies}"

    contiguous = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    o_contiguous = flash_attention(*contiguous, causal=True)
    grads = torch.autograd.grad(o_contiguous, contiguous, do)
    assert torch.equal(o, o_contiguous)
    for i, grad in enumerate(grads):
        assert torch.equal(dqkv[:, :, i].transpose(1, 2), grad)

    wide = torch.randn(1, 2, 130, 4 * D, device=device)
    q, k, v = wide[..., 0::4], wide[..., 1::4], wide[..., 2::4]
    assert q.stride(-1) == 4
    with _CopyRecorder(wide) as recorder:
        o = flash_attention(q, k, v, causal=False, allow_tf32=False)
        attention_forward(q, k, v, False, D**-0.5, False)
    assert not recorder.copies, f"q, k, v with strided head dims were copied by {recorder.copies}"
    assert torch.equal(
        o,
        flash_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), causal=False, allow_tf32=False
        ),
    )


def test_backward_is_deterministic(device):
    q, k, v = make_inputs(1, 4, 2, 130, 130, 32, torch.float16, device)
    o = flash_attention(q, k, v, causal=True, deterministic=True)
    do = torch.randn_like(o)
    first = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    second = torch.autograd.grad(o, (q, k, v), do)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("deterministic", [True, False])
def test_fully_masked_rows_give_zeros(device, deterministic):
    """The public function rejects Nq > Nk; the kernels, given it, mask every key for the first
    Nq - Nk queries (they would see keys j <= i - (Nq - Nk) < 0). Those rows must be 0, not NaN."""
    Nq, Nk, D = 77, 40, 16
    q, k, v = make_inputs(1, 2, 1, Nq, Nk, D, torch.float32, device)
    scale = D**-0.5
    o, lse = attention_forward(q.detach(), k.detach(), v.detach(), True, scale, False)
    do = torch.randn_like(o)
    dq, dk, dv = attention_backward(
        do, q.detach(), k.detach(), v.detach(), o, lse, True, scale, False, deterministic
    )
    hidden = Nq - Nk
    assert torch.equal(o[:, :, :hidden], torch.zeros_like(o[:, :, :hidden]))
    assert torch.equal(dq[:, :, :hidden], torch.zeros_like(dq[:, :, :hidden]))
    # The other rows are ordinary attention of the last Nk queries.
    q_seen = q[:, :, hidden:]
    ref_o, (ref_dq, ref_dk, ref_dv) = reference_run(q_seen, k, v, do[:, :, hidden:], causal=True)
    assert_close(o[:, :, hidden:], ref_o, torch.float32, "o")
    assert_close(dq[:, :, hidden:], ref_dq, torch.float32, "dq")
    assert_close(dk, ref_dk, torch.float32, "dk")
    assert_close(dv, ref_dv, torch.float32, "dv")


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_scores_all_far_below_zero(device, causal, deterministic):
    """Every score about -100: the LSE is too, and 2^(0 - LSE) overflows (base 2: 0 + 144). The
    key rows past Nk in the last (partial) key block are zeros with score 0; unmasked, their P =
    inf times k = 0 put a NaN into the atomic dQ. Nk = 77 leaves a partial key block at every
    block size. The offset is the same for every pair (first channel 20 in q, -20 in k), so the
    softmax is as well conditioned as without it."""
    Nq, Nk, D = 40, 77, 16
    q, k, v = make_inputs(1, 2, 1, Nq, Nk, D, torch.float32, device)
    with torch.no_grad():
        q[..., 0] = 20.0
        k[..., 0] = -20.0  # s * -400 = -100
    check_against_reference(q, k, v, causal, deterministic=deterministic)


class _AllocationRecorder(TorchDispatchMode):
    """Bytes of every distinct storage that a torch op returns while active."""

    def __init__(self):
        super().__init__()
        self.storages = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                self.storages[storage.data_ptr()] = storage.nbytes()
        return out


def _bytes_touched(device, N: int, causal: bool) -> tuple[int, int]:
    q, k, v = make_inputs(1, 2, 1, N, N, 16, torch.float16, device)
    do = torch.randn(1, 2, N, 16, device=device, dtype=torch.float16)

    def forward_backward():
        return torch.autograd.grad(flash_attention(q, k, v, causal), (q, k, v), do)

    # Once outside the recorder: on CUDA the first call autotunes, and the autotuner's timing
    # allocates a 256 MiB buffer (to flush L2) that is not the kernels' memory.
    forward_backward()
    with _AllocationRecorder() as recorder:
        forward_backward()
    return sum(recorder.storages.values()), max(recorder.storages.values())


@pytest.mark.parametrize("causal", [True, False])
def test_memory_is_linear_in_sequence_length(device, causal):
    """Every tensor the forward and backward allocate (outputs, log-sum-exp, Delta, the
    interpreter's
    copies) grows like N: doubling N doubles the bytes. One (N x N) fp32 score matrix for the two
    heads would add 2 * N^2 * 4 bytes, at N = 128 already 2.5x all the linear tensors together (the
    check then fails with a 3.4x growth)."""
    N = 128
    total, largest = _bytes_touched(device, N, causal)
    total_2n, largest_2n = _bytes_touched(device, 2 * N, causal)
    assert total_2n <= 2.05 * total, f"bytes grew {total_2n / total:.2f}x when N doubled"
    assert largest_2n <= 2 * largest
    assert largest_2n < 2 * (2 * N) ** 2  # smaller than one head's score matrix in fp16


@settings(max_examples=8, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 2, 3]),
    n_k=st.integers(1, 140),
    q_fraction=st.floats(0.0, 1.0),
    head_dim=st.sampled_from([8, 16, 24, 32, 48, 64, 80, 96, 112, 128]),
    causal=st.booleans(),
    dtype=st.sampled_from(DTYPES),
)
def test_fuzz_shapes(batch, kv_heads, group, n_k, q_fraction, head_dim, causal, dtype):
    n_q = max(1, round(q_fraction * n_k))
    device = (
        "cuda" if torch.cuda.is_available() else "cpu"
    )  # hypothesis refuses function-scoped fixtures
    inputs = make_inputs(batch, kv_heads * group, kv_heads, n_q, n_k, head_dim, dtype, device)
    check_against_reference(*inputs, causal)


def _heads(B=1, H=2, N=8, D=16, **kwargs):
    return torch.randn(B, H, N, D, **kwargs)


# Each case replaces some of q, k, v = (1, 2, 8, 16) fp32, causal=True, softmax_scale=None.
BAD_INPUTS = [
    (dict(q=torch.randn(2, 8, 16)), ValueError, "q must have 4 dims"),
    (dict(k=torch.randn(1, 2, 8, 16, 1)), ValueError, "k must have 4 dims"),
    (dict(k=_heads(D=32)), ValueError, "v has shape"),
    (dict(k=_heads(D=32), v=_heads(D=32)), ValueError, "k has head dim 32"),
    (dict(k=_heads(dtype=torch.float16)), TypeError, "k has dtype"),
    (dict(v=_heads(device="meta")), ValueError, "v is on meta"),
    (dict(v=_heads(dtype=torch.float64)), TypeError, "v must be float32"),
    (dict(q=torch.randint(0, 3, (1, 2, 8, 16))), TypeError, "q must be float32"),
    (dict(q=[[1.0]]), TypeError, "q must be a torch.Tensor"),
    (dict(q=_heads(H=3)), ValueError, "not a multiple of k's 2 heads"),
    (dict(q=_heads(N=9)), ValueError, "q has sequence length 9 > k's 8"),
    (dict(q=_heads(N=0), k=_heads(N=0), v=_heads(N=0)), ValueError, "k has sequence length 0"),
    (dict(k=_heads(B=2), v=_heads(B=2)), ValueError, "k has batch size 2"),
    (dict(q=_heads(D=12), k=_heads(D=12), v=_heads(D=12)), ValueError, "head dim 12"),
    (dict(q=_heads(D=264), k=_heads(D=264), v=_heads(D=264)), ValueError, "head dim 264"),
    (dict(causal="yes"), TypeError, "causal must be a bool"),
    (dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a real number"),
]


@pytest.mark.parametrize("overrides,error,message", BAD_INPUTS)
def test_bad_input_is_named(overrides, error, message):
    args = dict(q=_heads(), k=_heads(), v=_heads(), causal=True, softmax_scale=None) | overrides
    with pytest.raises(error, match=message):
        flash_attention(**args)


@pytest.mark.parametrize("Nq,Nk,causal", [(77, 130, True), (77, 77, True), (33, 64, False)])
def test_torch_backend_same_math(device, monkeypatch, Nq, Nk, causal):
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    q, k, v = make_inputs(2, 4, 2, Nq, Nk, 32, torch.float32, device)
    o = flash_attention(q, k, v, causal, softmax_scale=0.2)
    do = torch.randn_like(o)
    o.backward(do)
    ref_o, ref_grads = reference_run(q, k, v, do, causal, softmax_scale=0.2)
    assert_close(o, ref_o, torch.float32, "o")
    for name, grad, ref_grad in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref_grads):
        assert_close(grad, ref_grad, torch.float32, name)


@pytest.mark.cuda
def test_fp32_tf32_and_full_precision(device):
    """fp32 dots run as TF32 by default (10-bit mantissa like fp16, so fp16's bound);
    allow_tf32=False
    gives full fp32 accuracy."""
    q, k, v = make_inputs(2, 4, 2, 257, 257, 64, torch.float32, device)
    ref = reference_attention(q, k, v, True)
    assert_close(flash_attention(q, k, v), ref, torch.float16, "o (tf32)")
    assert_close(flash_attention(q, k, v, allow_tf32=False), ref, torch.float32, "o (ieee)")


@pytest.mark.cuda
def test_more_batch_heads_than_cuda_grid_axes_1_and_2_hold(device):
    """B * H = 65600 batch-heads, more than CUDA's 65535 cap on grid axes 1 and 2: the kernels
    launch
    because their grids are 1-D. The batches past the cap are also checked on their own, so an error
    there cannot hide in the norm of the whole tensor."""
    B, H, N, D = 4100, 16, 16, 16
    q, k, v = make_inputs(
        B, H, H, N, N, D, torch.float16, device
    )  # Hkv = H: dK/dV's grid is as large
    o, do, grads = run(q, k, v, causal=True)
    ref_o, ref_grads = reference_run(q, k, v, do, causal=True)
    past_cap = slice(65535 // H, None)
    for name, out, ref in zip(("o", "dq", "dk", "dv"), (o, *grads), (ref_o, *ref_grads)):
        assert_close(out, ref, torch.float16, name)
        assert_close(
            out[past_cap], ref[past_cap], torch.float16, f"{name} of batch-heads past 65535"
        )


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_compile(device, dtype):
    q, k, v = make_inputs(2, 8, 2, 1000, 1000, 128, dtype, device)

    def attend(q, k, v):
        return flash_attention(q, k, v, causal=True).float().square().sum()

    eager_grads = torch.autograd.grad(attend(q, k, v), (q, k, v))
    compiled_grads = torch.autograd.grad(torch.compile(attend, fullgraph=True)(q, k, v), (q, k, v))
    for eager, compiled in zip(eager_grads, compiled_grads):
        assert_close(compiled, eager, dtype)


# --------------------------------------------------------------------------------------------
# rope_attention: the packed q|k|v projection with RoPE, one gradient buffer
# --------------------------------------------------------------------------------------------


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
    o64 = rope_attention_ref(
        leaf64, cos.double(), sin.double(), positions, Hq, Hkv, interleaved=interleaved
    )
    o64.backward(do.double())
    assert_close(o, o64, dtype, "o")
    assert leaf.grad.dtype == dtype
    assert_close(leaf.grad, leaf64.grad, dtype, "dqkv")


class _GlueRecorder(TorchDispatchMode):
    """The aten ops outside fastlm's own that move data: what autograd adds around views."""

    GLUE = {
        "zeros",
        "zero_",
        "fill_",
        "copy_",
        "add",
        "add_",
        "select_backward",
        "slice_backward",
        "clone",
        "_to_copy",
        "cat",
        "stack",
        "new_zeros",
        "index_put_",
    }

    def __init__(self):
        super().__init__()
        self.glue = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.GLUE:
            self.glue.append(str(func))
        return func(*args, **(kwargs or {}))


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
    q64, k64 = (rope_ref(t, cos.double(), sin.double(), positions) for t in (q64, k64))
    rotated = [t.transpose(1, 2).reshape(2, 21, -1) for t in (q64, k64)]  # (B, T, H * D)
    qkv64 = torch.cat([*rotated, leaf64[..., 64:]], dim=-1)
    (attention_ref(q64, k64, v64).sum() + (qkv64 * weight.double()).sum()).backward()
    assert_close(qkv, qkv64, torch.float32, "qkv after the call: q and k rotated in place")
    assert_close(leaf.grad, leaf64.grad, torch.float32, "dqkv with qkv read again")


def test_rope_attention_gradient_is_one_buffer(device):
    """From the projection output to its gradient: no zero-filled buffers, no copies, no adds."""
    leaf, weight = _packed(2, 37, 2, 2, 16, torch.float32, device)
    cos, sin = rope_tables(10000.0, 16, 64, device=device)
    with _GlueRecorder() as recorder:
        qkv = leaf * 1
        o = rope_attention(qkv, cos, sin, torch.arange(37, device=device), 2, check_positions=False)
        o.backward(torch.randn_like(o))
    glue = [op for op in recorder.glue if not op.startswith("aten.mul")]
    assert not glue, glue
    # ...and the same run through views of the projection and apply_rope_ does need them:
    with _GlueRecorder() as recorder:
        q, k, v = split_heads(leaf * 1, 2, 2)
        apply_rope_(q, k, cos, sin, torch.arange(37, device=device))
        flash_attention(q, k, v).backward(torch.randn(2, 2, 37, 16, device=device))
    assert any("select" in op or "slice" in op or "zero" in op for op in recorder.glue)


def test_rope_attention_is_deterministic_and_matches_the_torch_backend(device, monkeypatch):
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
        (lambda qkv, c, s, p: rope_attention(qkv, c, s, p, 2, 5), ValueError, "not a multiple"),
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
    with _GlueRecorder() as recorder:
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
        outs.append(
            rope_attention_ref(
                doc,
                cos.double(),
                sin.double(),
                torch.arange(n, device=device),
                Hq,
                Hkv,
                interleaved=interleaved,
            )
        )
        start += n
    o64 = torch.cat(outs, dim=2)  # (1, Hq, B * T, D)
    o64.backward(do.double())
    assert_close(o, o64, torch.float32, "o")
    assert_close(leaf.grad.reshape(1, B * T, -1), rows64.grad, torch.float32, "dqkv")
