"""flash_attention_varlen: packed sequences against the block-diagonal float64 reference
(`attention_harness`), each sequence with its own causal mask and window aligned to its end; more
queries than keys, empty sequences, strided cu_seqlens, bad input, compile, memory."""

import math

import pytest
import torch
from attention_harness import (
    NO_WINDOW,
    TMA_PATHS,
    AllocationRecorder,
    cu_seqlens,
    make,
    make_sinks,
    record_dq_paths,
    run_varlen,
    takes_descriptors,
)

from fastlm import flash_attention, flash_attention_varlen
from fastlm.testing import assert_close

# (lens_q, lens_k, Hq, Hkv, D, causal, window, softcap, dtype)
VARLEN_CASES = [
    ([1, 17, 1, 70, 3], None, 2, 2, 16, True, NO_WINDOW, 0.0, torch.float32),
    ([2, 1, 3, 1, 1, 64, 1, 5], None, 4, 2, 16, True, NO_WINDOW, 0.0, torch.float16),
    ([33, 1, 40], None, 3, 1, 32, False, NO_WINDOW, 0.0, torch.bfloat16),
    ([5, 70, 9, 1], None, 2, 1, 16, True, (7, 0), 3.0, torch.float32),
    ([70, 2, 45], None, 2, 2, 16, False, (4, 40), 0.0, torch.float16),
    ([1, 30, 12], [9, 65, 12], 2, 1, 16, True, NO_WINDOW, 0.0, torch.float32),  # Nq < Nk
    ([6, 0, 20, 4], [3, 5, 0, 40], 2, 2, 16, True, NO_WINDOW, 2.0, torch.float32),  # Nq > Nk
]


@pytest.mark.parametrize("deterministic", [True, False], ids=["two-pass", "atomic-dq"])
@pytest.mark.parametrize("lens_q,lens_k,Hq,Hkv,D,causal,window,softcap,dtype", VARLEN_CASES)
def test_varlen_matches_reference(
    device, deterministic, lens_q, lens_k, Hq, Hkv, D, causal, window, softcap, dtype
):
    run_varlen(
        lens_q, lens_k or lens_q, Hq, Hkv, D, causal, window, softcap, dtype, device, deterministic
    )


@pytest.mark.parametrize("tma", TMA_PATHS[1:], ids=["other-path"])
@pytest.mark.parametrize("case", [VARLEN_CASES[i] for i in (1, 2, 3, 4, 6)])
def test_varlen_other_data_path(device, monkeypatch, tma, case):
    """The descriptor forward's and dQ pass's per-sequence views of the strided packed q, k, v:
    the next sequence's rows read as zeros, and a sequence without keys gets a one-row view that
    its loop never reads."""
    monkeypatch.setenv("FASTLM_ATTENTION_TMA", tma)
    dq_paths = record_dq_paths(monkeypatch)
    lens_q, lens_k, *rest = case
    run_varlen(lens_q, lens_k or lens_q, *rest, device)
    assert dq_paths == [takes_descriptors(tma)]


def test_varlen_rows_without_keys(device):
    """A sequence with more queries than keys masks its first queries (causal, aligned to the
    end), and a sequence without keys masks all of them: output 0 and lse -inf, gradients 0."""
    o, lse = run_varlen([6, 4], [2, 0], 2, 1, 16, True, NO_WINDOW, 0.0, torch.float32, device)
    assert torch.equal(o[:4], torch.zeros_like(o[:4]))
    assert torch.equal(o[6:], torch.zeros_like(o[6:]))
    assert torch.isneginf(lse[:, :4]).all() and torch.isneginf(lse[:, 6:]).all()


@pytest.mark.parametrize("tma", TMA_PATHS, ids=["default-path", "other-path"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["two-pass", "atomic-dq"])
@pytest.mark.parametrize(
    "lens_q,lens_k,causal,window",
    [
        ([50, 200], [50, 10], True, (5, 0)),  # 190 queries before the first key
        ([3, 150, 40], [9, 0, 40], True, (7, 0)),  # a sequence without keys
        ([120, 70], [5, 70], False, (3, 2)),  # both sides, keys far behind the queries
    ],
)
def test_varlen_window_with_more_queries_than_keys(
    device, monkeypatch, tma, deterministic, lens_q, lens_k, causal, window
):
    """A window whose queries lie a block or more past the sequence's keys: no key range may
    go below the sequence's first key (another sequence's rows, or memory before the tensor)."""
    if tma is not None:
        monkeypatch.setenv("FASTLM_ATTENTION_TMA", tma)
    o, lse = run_varlen(
        lens_q, lens_k, 2, 1, 16, causal, window, 0.0, torch.float32, device, deterministic
    )
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("deterministic", [True, False], ids=["two-pass", "atomic-dq"])
def test_scores_all_far_below_zero(device, deterministic):
    """Every score about -100 (test_attention.py says why): packed sequences ending inside a key
    block must mask the next sequence's rows, or the atomic dQ is NaN."""
    run_varlen(
        [20, 77, 9],
        [20, 77, 9],
        2,
        1,
        16,
        False,
        NO_WINDOW,
        0.0,
        torch.float32,
        device,
        deterministic,
        score_offset=400.0,
    )


@pytest.mark.parametrize("tma", TMA_PATHS, ids=["default-path", "other-path"])
def test_varlen_reads_cu_seqlens_through_its_strides(device, monkeypatch, tma):
    """cu_seqlens as a column of a table (stride 2) gives what its contiguous copy gives."""
    if tma is not None:
        monkeypatch.setenv("FASTLM_ATTENTION_TMA", tma)
    lens = [5, 70, 1, 30]
    contiguous = cu_seqlens(lens, device)
    strided = torch.stack([contiguous, torch.full_like(contiguous, 10**6)], 1)[:, 0]
    assert strided.stride() == (2,) and torch.equal(strided, contiguous)
    q, k, v = make((106, 2, 16), (106, 1, 16), torch.float32, device)
    results = []
    for cu in (strided, contiguous):
        o, lse = flash_attention_varlen(
            q, k, v, cu, cu, 70, 70, window_size=(9, 0), return_lse=True
        )
        results.append((o, lse, *torch.autograd.grad(o, (q, k, v), torch.ones_like(o))))
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), f"{name} differs with a strided cu_seqlens"


@pytest.mark.parametrize("approx", [False, True], ids=["exact-cap", "approx-cap"])
def test_varlen_equals_flash_attention_per_sequence(device, approx):
    """One sequence packed alone is flash_attention of it: the same kernels, bitwise, output and
    gradients, with the exact or the approximate cap (which the varlen path passes on)."""
    q, k, v = make((1, 2, 70, 16), (1, 1, 70, 16), torch.float16, device)
    packed = [t.detach()[0].transpose(0, 1).requires_grad_() for t in (q, k, v)]
    cu = cu_seqlens([70], device)
    options = dict(window_size=(9, 0), softcap=4.0, softcap_approx=approx)
    o = flash_attention_varlen(*packed, cu, cu, 70, 70, **options)
    dense = flash_attention(q, k, v, **options)
    assert torch.equal(o, dense[0].transpose(0, 1))
    do = torch.randn_like(dense)
    dense.backward(do)
    o.backward(do[0].transpose(0, 1))
    for t, p in zip((q, k, v), packed):
        assert torch.equal(p.grad, t.grad[0].transpose(0, 1))
    exact = flash_attention(q, k, v, window_size=(9, 0), softcap=4.0)
    assert torch.equal(dense, exact) != approx, "softcap_approx changes the result"


# --------------------------------------------------------------------------------------------
# Bad input; the PyTorch backend
# --------------------------------------------------------------------------------------------


def _packed(total=8):
    return torch.randn(total, 2, 16)


def _cu(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


# (lens_q, lens_k, Hq, Hkv, D, Dv, causal, window, softcap, dtype): packed sequences with sinks
# (an empty sequence, more queries than keys: rows that see only the sink) and with v's own
# head dim (MLA's 192 / 128 among them), together or apart.
VARLEN_SINK_CASES = [
    ([6, 0, 20, 4], [3, 5, 0, 40], 4, 2, 16, 16, True, NO_WINDOW, 0.0, torch.float32),
    ([5, 70, 9, 1], None, 2, 1, 16, 16, True, (7, 0), 3.0, torch.float16),
    ([33, 1, 40], None, 2, 1, 192, 128, True, NO_WINDOW, 0.0, torch.bfloat16),
    ([70, 2, 45], None, 2, 2, 32, 16, False, (4, 40), 0.0, torch.float32),
]


@pytest.mark.parametrize("with_sinks", [True, False], ids=["sinks", "no-sinks"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["two-pass", "atomic-dq"])
@pytest.mark.parametrize("lens_q,lens_k,Hq,Hkv,D,Dv,causal,window,softcap,dtype", VARLEN_SINK_CASES)
def test_varlen_sinks_and_value_head_dim(
    device,
    with_sinks,
    deterministic,
    lens_q,
    lens_k,
    Hq,
    Hkv,
    D,
    Dv,
    causal,
    window,
    softcap,
    dtype,
):
    sinks = make_sinks(Hq, device) if with_sinks else None
    run_varlen(
        lens_q,
        lens_k or lens_q,
        Hq,
        Hkv,
        D,
        causal,
        window,
        softcap,
        dtype,
        device,
        deterministic,
        sinks=sinks,
        Dv=Dv,
    )


def test_varlen_head_dim_512(device):
    """Packed sequences at a head block of 512 (the split dK/dV pass), grouped heads, the cap."""
    run_varlen([3, 6], [5, 6], 2, 1, 512, True, NO_WINDOW, 1.5, torch.bfloat16, device)


@pytest.mark.parametrize("tma", TMA_PATHS[1:], ids=["other-path"])
@pytest.mark.parametrize("case", [VARLEN_SINK_CASES[i] for i in (0, 1, 3)])
def test_varlen_sinks_and_value_head_dim_other_data_path(device, monkeypatch, tma, case):
    monkeypatch.setenv("FASTLM_ATTENTION_TMA", tma)
    lens_q, lens_k, Hq, Hkv, D, Dv, *rest = case
    run_varlen(
        lens_q, lens_k or lens_q, Hq, Hkv, D, *rest, device, sinks=make_sinks(Hq, device), Dv=Dv
    )


def test_varlen_rows_that_see_only_the_sink(device):
    """A sequence with more queries than keys and one without keys: their rows see the sink
    alone, so o = 0 and lse = the head's sink (not -inf), and dq = 0 there."""
    sinks = torch.tensor([0.25, -2.0], device=device, requires_grad=True)
    o, lse = run_varlen(
        [6, 4], [2, 0], 2, 1, 16, True, NO_WINDOW, 0.0, torch.float32, device, sinks=sinks
    )
    unseen = [0, 1, 2, 3, 6, 7, 8, 9]  # the first 4 queries of sequence 0, all of sequence 1
    assert torch.equal(o[unseen], torch.zeros_like(o[unseen]))
    assert_close(
        lse[:, unseen], sinks.detach()[:, None].double().expand(2, 8), torch.float32, "lse"
    )


# Each replaces some of q, k, v = (8, 2, 16), cu_seqlens = [0, 3, 8], max_seqlen = 5.
BAD_VARLEN = [
    (dict(cu_seqlens_q=_cu(0, 3, 8, dtype=torch.int64)), ValueError, "cu_seqlens_q must be int32"),
    (dict(cu_seqlens_k=_cu(0, 5, 3, 8)), ValueError, "cu_seqlens_k must start at 0.*not decrease"),
    (dict(cu_seqlens_q=_cu(0, 3, 7)), ValueError, "end at the packed length 8"),
    (dict(cu_seqlens_q=_cu(1, 3, 8)), ValueError, "cu_seqlens_q must start at 0"),
    (dict(max_seqlen_q=4), ValueError, "no sequence longer than max_seqlen_q = 4"),
    (dict(max_seqlen_k=-1), ValueError, r"max_seqlen_k must be an int in \[0, 2\*\*31 - 1\]"),
    (dict(max_seqlen_k=5.0), TypeError, "max_seqlen_k must be an int"),
    (dict(cu_seqlens_q=[0, 3, 8]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    (dict(cu_seqlens_q=_cu(0, 3, 8)[None]), ValueError, "cu_seqlens_q must be 1-D"),
    (dict(cu_seqlens_q=_cu(8)), ValueError, "cu_seqlens_q must be 1-D with num_seqs \\+ 1 >= 2"),
    (
        dict(cu_seqlens_q=_cu(0, 8), max_seqlen_q=8),
        ValueError,
        "cu_seqlens_k has 3 entries, but cu_seqlens_q has 2",
    ),
    (dict(q=torch.randn(1, 8, 2, 16)), ValueError, "q must have 3 dims"),
    (dict(q=torch.randn(8, 3, 16)), ValueError, "not a multiple of k's 2 heads"),
    (dict(v=torch.randn(8, 1, 16)), ValueError, "v has shape"),
    (dict(v=torch.randn(8, 2, 12)), ValueError, "v has head dim 12"),
    (dict(sinks=torch.zeros(8)), ValueError, "sinks must have shape \\(Hq,\\) = \\(2,\\)"),
    (dict(sinks=torch.tensor([0.0, math.nan])), ValueError, "each element of sinks, as float32"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(window_size=(4, 2)), ValueError, "window_size\\[1\\] is 2, but with causal=True"),
    (dict(softcap=-1.0), ValueError, r"softcap must be a finite number in \[0, 1e6\]"),
    (dict(return_lse=1), TypeError, "return_lse must be a bool"),
    (dict(softcap=2.0, softcap_approx=1), TypeError, "softcap_approx must be a bool"),
]


@pytest.mark.parametrize("overrides,error,message", BAD_VARLEN)
def test_bad_varlen_input_is_named(overrides, error, message):
    args = dict(
        q=_packed(),
        k=_packed(),
        v=_packed(),
        cu_seqlens_q=_cu(0, 3, 8),
        cu_seqlens_k=_cu(0, 3, 8),
        max_seqlen_q=5,
        max_seqlen_k=5,
    )
    with pytest.raises(error, match=message):
        flash_attention_varlen(**(args | overrides))


@pytest.mark.parametrize(
    "causal,window,softcap", [(True, (5, 0), 0.0), (False, (3, 7), 2.0), (True, NO_WINDOW, 3.0)]
)
def test_torch_backend_matches_reference(device, monkeypatch, causal, window, softcap):
    """FASTLM_BACKEND=torch: flash_attention_varlen_ref, one sequence at a time."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    run_varlen(
        [1, 30, 9, 0], [5, 30, 9, 3], 4, 2, 12, causal, window, softcap, torch.float32, device
    )


# --------------------------------------------------------------------------------------------
# Compile, memory
# --------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_varlen_torch_compile_and_no_host_sync(device):
    """Compiled with fullgraph (no graph break, so no host read of cu_seqlens) and equal to
    eager."""
    lens = [100, 1, 700, 37]
    cu = cu_seqlens(lens, device)
    q, k, v = make((sum(lens), 8, 128), (sum(lens), 2, 128), torch.bfloat16, device)

    def attend(q, k, v):
        o = flash_attention_varlen(q, k, v, cu, cu, 700, 700, window_size=(64, 0), softcap=30.0)
        return o.float().square().sum()

    eager = torch.autograd.grad(attend(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(attend, fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(eager, compiled):
        assert_close(b, a, torch.bfloat16)


def test_varlen_compiles_whole_without_host_reads(device):
    """torch.compile(fullgraph=True) traces flash_attention_varlen and its backward as ops: a
    host read of cu_seqlens (a sync on a GPU) would break the graph and fail here. Under
    compilation the values are checked by a device-side assertion, and the results are
    eager's."""
    import torch._dynamo

    torch._dynamo.reset()
    lens = [5, 1, 17]
    cu = cu_seqlens(lens, device)
    q, k, v = make((23, 4, 16), (23, 2, 16), torch.float32, device)

    def attend(q, k, v):
        o, lse = flash_attention_varlen(
            q, k, v, cu, cu, 17, 17, window_size=(4, 0), softcap=2.0, return_lse=True
        )
        return o.square().sum() + lse.sum()

    eager = torch.autograd.grad(attend(q, k, v), (q, k, v))
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    for a, b in zip(eager, torch.autograd.grad(compiled(q, k, v), (q, k, v))):
        assert torch.equal(a, b)


def test_varlen_memory_is_linear_in_tokens(device):
    """Every tensor the varlen forward and backward allocate grows like the token count:
    doubling the tokens (twice the documents, the longest 128) doubles the bytes."""

    def bytes_touched(copies):
        lens = [128, 7, 64, 1] * copies
        cu = cu_seqlens(lens, device)
        q, k, v = make((sum(lens), 2, 16), (sum(lens), 1, 16), torch.float16, device)
        with AllocationRecorder() as recorder:
            o = flash_attention_varlen(q, k, v, cu, cu, 128, 128)
            torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
        return sum(recorder.storages.values())

    once, twice = bytes_touched(1), bytes_touched(2)
    assert twice <= 2.05 * once, f"bytes grew {twice / once:.2f}x when the tokens doubled"
