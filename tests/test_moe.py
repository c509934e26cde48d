"""Mixture-of-experts experts (fastlm.kernels.moe) against a float64 loop over experts: the
output and every gradient (x, the routing weights, gate_up, down, the biases), on odd sizes,
strided inputs, the layouts (transposed, interleaved), the activations and their options (the
non-gated ReLU² of Nemotron-H's experts included), and the routings that stress the grouping (an
expert with no token, every token on one expert, k = E, one token, tied weights); the routing
metadata against a stable sort; bad input."""

import pytest
import torch
from torch._dynamo.utils import counters

import fastlm
from fastlm import reference as R
from fastlm.kernels.moe.experts import moe_experts_ref
from fastlm.kernels.moe.routing import BLOCK, route, route_ref
from fastlm.testing import assert_close


def _routing(T: int, E: int, k: int, device, dtype=torch.float32):
    """k distinct experts per token, drawn at random, and softmax weights."""
    ids = torch.rand(T, E, device=device).argsort(dim=1)[:, :k]
    weights = torch.randn(T, k, device=device).softmax(dim=1).to(dtype)
    return ids, weights


def _weights(E, D, F, device, dtype, transposed=False, bias=False, scale=1.0, gated=True):
    """gate_up (up alone, F rows, if not `gated`), down (in the layout asked for) and the
    biases (or None): pre-activations of order `scale`."""
    rows = 2 * F if gated else F
    gate_up = scale * torch.randn(E, rows, D, device=device) / D**0.5
    down = torch.randn(E, D, F, device=device) / F**0.5
    if transposed:  # the (E, in, out) layout: the same values, stored transposed
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    b1 = 0.5 * torch.randn(E, rows, device=device) if bias else None
    b2 = 0.5 * torch.randn(E, D, device=device) if bias else None
    return [None if t is None else t.to(dtype).requires_grad_() for t in (gate_up, down, b1, b2)]


def _check(x, ids, weights, gate_up, down, b1=None, b2=None, dtype=None, **options):
    """fastlm.moe_experts's output and every gradient against float64 autograd through
    `moe_experts_ref` (a loop over experts)."""
    dtype = dtype or x.dtype
    inputs = [x, weights, gate_up, down, b1, b2]
    out = fastlm.moe_experts(x, ids, weights, gate_up, down, b1, b2, **options)
    grad_out = torch.randn_like(out)
    leaves = [t for t in inputs if t is not None]
    grads = torch.autograd.grad(out, leaves, grad_out)
    ref_inputs = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    x64, w64, gu64, dn64, b164, b264 = ref_inputs
    expected = moe_experts_ref(x64, ids, w64, gu64, dn64, b164, b264, **options)
    ref_leaves = [t for t in ref_inputs if t is not None]
    ref_grads = torch.autograd.grad(expected, ref_leaves, grad_out.double())
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_close(out, expected, dtype, "out")
    names = [n for n, t in zip(("dx", "d weights", "d gate_up", "d down", "d b1", "d b2"), inputs)
             if t is not None]  # fmt: skip
    for name, got, want, leaf in zip(names, grads, ref_grads, leaves):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape, name
        assert_close(got, want, dtype, name)
    return out, grads


def test_matches_the_seed_swiglu_experts(device):
    """fp32, odd sizes (not block multiples: T k = 74 rows over 5 experts, D 77, F 40), x a
    row-strided slice: output and gradients against reference.MoeExperts in float64 (E seed
    SwiGlu FFNs, a loop over experts), the weight gradients of each expert's w1, w3 and w2."""
    T, D, F, E, k = 37, 77, 40, 5, 2
    ref = R.MoeExperts(E, D, F, device=device, dtype=torch.float64)
    ids, weights = _routing(T, E, k, device, torch.float64)
    x64 = torch.randn(T, D, device=device, dtype=torch.float64)
    wide = torch.randn(T, D + 9, device=device)
    wide[:, 3 : 3 + D] = x64.float()
    x = wide[:, 3 : 3 + D].requires_grad_()  # strided rows, not a copy
    gate_up64, down64 = ref.stacked()
    gate_up = gate_up64.detach().float().requires_grad_()
    down = down64.detach().float().requires_grad_()
    w = weights.float().requires_grad_()
    out = fastlm.moe_experts(x, ids, w, gate_up, down)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    x64.requires_grad_()
    weights.requires_grad_()
    expected = ref(x64, ids, weights)
    expected.backward(grad_out.double())
    assert_close(out, expected, torch.float32, "out")
    assert_close(x.grad, x64.grad, torch.float32, "dx")
    assert_close(w.grad, weights.grad, torch.float32, "d weights")
    for e, ffn in enumerate(ref.experts):
        d_gate, d_up = gate_up.grad[e].split(F)
        assert_close(d_gate, ffn.w1.w.grad, torch.float32, f"d w1 of expert {e}")
        assert_close(d_up, ffn.w3.w.grad, torch.float32, f"d w3 of expert {e}")
        assert_close(down.grad[e], ffn.w2.w.grad, torch.float32, f"d w2 of expert {e}")


@pytest.mark.parametrize(
    "dtype, layout, activation, options",
    [
        # gpt-oss: (E, in, out) weights, interleaved gate/up, biases, the clamp reached
        (torch.float16, dict(transposed=True, interleaved=True), "silu",
         dict(alpha=1.702, limit=1.5, up_offset=1.0)),
        (torch.bfloat16, dict(), "gelu_tanh", dict()),
        (torch.float32, dict(interleaved=True), "gelu", dict()),
    ],
)  # fmt: skip
def test_layouts_activations_and_biases(device, dtype, layout, activation, options):
    T, D, F, E, k = 29, 70, 36, 4, 2
    ids, weights = _routing(T, E, k, device, dtype)
    x = torch.randn(T, D, device=device, dtype=dtype, requires_grad=True)
    gate_up, down, b1, b2 = _weights(E, D, F, device, dtype, layout.get("transposed", False), True)
    _check(x, ids, weights.requires_grad_(), gate_up, down, b1, b2, activation=activation,
           **layout, **options)  # fmt: skip


@pytest.mark.parametrize(
    "dtype, transposed, bias", [(torch.float32, True, True), (torch.bfloat16, False, False)]
)
def test_non_gated_relu2(device, dtype, transposed, bias):
    """Non-gated experts (transformers' has_gate=False, Nemotron-H): h = relu(up_e x + b1)^2,
    gate_up holding up alone (E, F, D); odd sizes, x a column slice of a wider tensor (strided
    rows), fp32 with the transposed layout and biases, bf16 without."""
    T, D, F, E, k = 31, 70, 36, 4, 2
    ids, weights = _routing(T, E, k, device, dtype)
    wide = torch.randn(T, D + 6, device=device, dtype=dtype)
    x = wide[:, 2 : 2 + D].requires_grad_()
    gate_up, down, b1, b2 = _weights(E, D, F, device, dtype, transposed, bias, gated=False)
    _check(x, ids, weights.requires_grad_(), gate_up, down, b1, b2, transposed=transposed,
           activation="relu2")  # fmt: skip


@pytest.mark.parametrize("dtype, gpt_oss", [(torch.bfloat16, False), (torch.float32, True)])
def test_block_multiples(device, monkeypatch, dtype, gpt_oss):
    """D and F multiples of the blocks, two column blocks of each: the loops' loads without a
    mask on D (MASK_K off) or on the weight gradients' columns (MASK_I, MASK_J off), each
    expert's rows whole BLOCK_R blocks (unmasked) and a partial one; gpt_oss: its layout
    (interleaved gate/up read as pairs, biases: their terms summed by one block of several)
    and the weight gradients' int64 row offsets, forced (a tensor past 2^31 elements is too big
    for a test)."""
    from fastlm.kernels.moe import experts

    if gpt_oss:
        monkeypatch.setattr(experts, "_past_int32", lambda *tensors: True)
    T, D, F, E, k = 45, 128, 128, 3, 2
    ids, weights = _routing(T, E, k, device, dtype)
    x = torch.randn(T, D, device=device, dtype=dtype, requires_grad=True)
    gate_up, down, b1, b2 = _weights(E, D, F, device, dtype, transposed=gpt_oss, bias=gpt_oss)
    options = dict(transposed=True, interleaved=True, alpha=1.702, limit=1.5, up_offset=1.0)
    _check(x, ids, weights.requires_grad_(), gate_up, down, b1, b2, **(options if gpt_oss else {}))


def _one_expert(T, E, device):
    """Every token on expert E - 1 (k = 1): one expert's rows span several tiles, the others
    have none."""
    return torch.full((T, 1), E - 1, device=device)


ROUTINGS = {
    # expert 0 and 2 get no token
    "empty experts": lambda T, E, device: (
        torch.randint(1, 2, (T, 1), device=device) + torch.tensor([[0, 2]], device=device)
    ),
    "all on one expert": _one_expert,
    "k = E": lambda T, E, device: torch.rand(T, E, device=device).argsort(dim=1),
    "one token": lambda T, E, device: torch.tensor([[3, 0]], device=device),
}


@pytest.mark.parametrize("routing", ROUTINGS)
def test_routings(device, routing):
    """Routings that stress the grouping, fp32, with tied weights (each token's k weights
    equal) for 'k = E'."""
    E, D, F = 4, 40, 24
    T = 1 if routing == "one token" else 45
    ids = ROUTINGS[routing](T, E, device)
    k = ids.shape[1]
    if routing == "k = E":
        weights = torch.full((T, k), 1.0 / k, device=device)
    else:
        weights = torch.rand(T, k, device=device) + 0.1
    x = torch.randn(T, D, device=device, requires_grad=True)
    gate_up, down, _, _ = _weights(E, D, F, device, torch.float32)
    _, grads = _check(x, ids, weights.requires_grad_(), gate_up, down)
    if routing == "empty experts":
        for e in (0, 2):  # no token: exactly zero, not poison left unwritten
            assert not grads[2][e].any() and not grads[3][e].any()


def _fp32_leaves(T, D, F, E, k, device):
    """(ids, (x, weights, gate_up, down)): fp32 inputs that require grad."""
    ids, weights = _routing(T, E, k, device)
    x = torch.randn(T, D, device=device, requires_grad=True)
    gate_up, down, _, _ = _weights(E, D, F, device, torch.float32)
    return ids, (x, weights.requires_grad_(), gate_up, down)


def test_route_is_a_stable_sort(device, monkeypatch):
    """The routing metadata against torch's stable sort, over several blocks of the histogram
    (T k > BLOCK) and with int32 ids; at the GPU's BLOCK (several sub-blocks a program) also
    under the interpreter, whose own block (`routing.block`: one sub-block) the other tests
    take."""
    from fastlm.kernels.moe import routing

    monkeypatch.setattr(routing, "block", lambda: BLOCK)
    T, E, k = BLOCK // 2 + 77, 6, 3
    ids = torch.randint(0, E, (T, k), device=device, dtype=torch.int32)
    sorted_assignments, offsets = route(ids, E)
    expected_sorted, expected_offsets = route_ref(ids, E)
    assert torch.equal(offsets, expected_offsets)
    assert torch.equal(sorted_assignments, expected_sorted)


def test_route_places_bad_ids_nowhere(device):
    """An id outside [0, E) that reaches the kernels (the public function refuses it first) is
    counted for no expert and placed nowhere: no read or write out of bounds."""
    E = 4
    ids = torch.tensor([[0, -1], [4, 3], [2, 1000], [3, 0]], device=device)
    sorted_assignments, offsets = route(ids, E)
    assert offsets.tolist() == [0, 2, 2, 3, 5]
    assert sorted_assignments[:5].tolist() == [0, 7, 4, 3, 6]


@pytest.mark.parametrize(
    "options", [dict(alpha=1.702, limit=1.0), dict(activation="relu2")], ids=["silu", "relu2"]
)
def test_pytorch_backend(device, monkeypatch, options):
    """FASTLM_BACKEND=torch: the same math (moe_experts_ref) with its own autograd, gated
    (gpt-oss's clamp) and not."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    T, D, F, E, k = 21, 30, 16, 3, 2
    ids, weights = _routing(T, E, k, device)
    x = torch.randn(T, D, device=device, requires_grad=True)
    gated = options.get("activation") != "relu2"
    gate_up, down, b1, b2 = _weights(E, D, F, device, torch.float32, bias=True, gated=gated)
    _check(x, ids, weights.requires_grad_(), gate_up, down, b1, b2, **options)


def test_compiles_whole(device):
    """torch.compile(fullgraph=True) of the forward and backward (aot_eager: the ops run the
    kernels at run time), the ids checked by a device-side assert there; the loss and gradients
    bitwise those of an eager run (and so deterministic: no atomics, forward or backward)."""
    ids, leaves = _fp32_leaves(19, 40, 24, 3, 2, device)
    x, weights, gate_up, down = leaves

    def step(x, ids, weights, gate_up, down):
        return fastlm.moe_experts(x, ids, weights, gate_up, down).square().sum()

    counters.clear()
    loss = torch.compile(step, backend="aot_eager", fullgraph=True)(x, ids, weights, gate_up, down)
    grads = torch.autograd.grad(loss, leaves)
    assert not counters["graph_break"], dict(counters["graph_break"])
    expected = step(x, ids, weights, gate_up, down)
    for got, want in zip((loss, *grads), (expected, *torch.autograd.grad(expected, leaves))):
        assert torch.equal(got, want)


def test_ids_past_the_held_experts(device):
    """num_experts N > E (LongCat-Flash's zero experts): a choice of an id in [E, N) runs no
    expert and adds nothing, its weight's gradient 0; the rest against the float64 loop, every
    gradient; fp32, odd sizes, k = N (every token chooses every id, held or not)."""
    T, D, F, E, N = 11, 26, 18, 3, 5
    ids = torch.rand(T, N, device=device).argsort(dim=1)
    weights = torch.rand(T, N, device=device).requires_grad_()
    x = torch.randn(T, D, device=device, requires_grad=True)
    gate_up, down, _, _ = _weights(E, D, F, device, torch.float32)
    _, grads = _check(x, ids, weights, gate_up, down, num_experts=N)
    assert torch.all(grads[1][ids >= E] == 0) and torch.all(grads[1][ids < E] != 0)


def _bad_inputs(device):
    """(what to change, the error, what its message names)."""
    T, D, F, E, k = 4, 8, 4, 3, 2
    x = torch.randn(T, D, device=device)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]], device=device)
    weights = torch.rand(T, k, device=device)
    gate_up, down = torch.randn(E, 2 * F, D, device=device), torch.randn(E, D, F, device=device)
    base = dict(x=x, expert_ids=ids, expert_weights=weights, gate_up=gate_up, down=down)
    return base, [
        (dict(expert_ids=ids.float()), TypeError, "expert_ids"),
        (dict(expert_ids=ids.bool()), TypeError, "expert_ids"),
        (dict(expert_ids=ids.clone().fill_(E)), ValueError, r"expert_ids must lie in \[0, 3\)"),
        (dict(expert_ids=ids - 1), ValueError, "expert_ids must lie"),
        (dict(expert_ids=ids[:3]), ValueError, "expert_ids"),
        (dict(expert_ids=torch.zeros(T, E + 1, dtype=torch.long, device=device),
              expert_weights=torch.rand(T, E + 1, device=device)), ValueError, "k = 4"),
        (dict(expert_weights=weights[:, :1]), ValueError, "expert_weights"),
        (dict(expert_weights=weights.long()), TypeError, "expert_weights"),
        (dict(x=x[0]), ValueError, "x must be"),
        (dict(gate_up=gate_up[:, :-1]), ValueError, "gate_up"),
        (dict(gate_up=gate_up[..., :-1]), ValueError, "gate_up"),
        (dict(down=down[:2]), ValueError, "down"),  # E of down against gate_up's
        (dict(down=down[..., :-1]), ValueError, "down"),
        (dict(down=down.half()), TypeError, "down"),
        (dict(gate_up_bias=torch.randn(E, F, device=device)), ValueError, "gate_up_bias"),
        (dict(down_bias=torch.randn(E, D + 1, device=device)), ValueError, "down_bias"),
        (dict(transposed=1), TypeError, "transposed"),
        (dict(num_experts=E - 1), ValueError, "num_experts"),
        (dict(num_experts=float(E + 1)), TypeError, "num_experts"),
        (dict(num_experts=True), TypeError, "num_experts"),
        (dict(expert_ids=ids.clone().fill_(E + 2), num_experts=E + 2), ValueError,
         r"expert_ids must lie in \[0, 5\)"),
        (dict(transposed=True), ValueError, "gate_up"),  # (E, 2F, D) read as (E, D, 2F)
        (dict(activation="relu"), ValueError, "activation"),
        (dict(activation="gelu", alpha=1.702), ValueError, "alpha"),
        (dict(limit=-1.0), ValueError, "limit"),
        # non-gated: gate_up is up alone (E, F, D), no gate to interleave, no SwiGLU options
        (dict(activation="relu2"), ValueError, "down"),  # F = 2F of gate_up against down's
        (dict(activation="relu2", gate_up=gate_up[:, :F], interleaved=True), ValueError,
         "interleaved"),
        (dict(activation="relu2", gate_up=gate_up[:, :F], limit=7.0), ValueError, "limit"),
        (dict(activation="relu2", gate_up=gate_up[:, :F],
              gate_up_bias=torch.randn(E, 2 * F, device=device)), ValueError, "gate_up_bias"),
    ]  # fmt: skip


def test_bad_input(device):
    base, cases = _bad_inputs(device)
    for change, error, named in cases:
        with pytest.raises(error, match=named):
            fastlm.moe_experts(**{**base, **change})


def test_saved_bytes_formula():
    """benchmarks/moe.py's formula of the bytes each implementation saves for the backward
    equals the count of the saved-tensor hooks at two sizes (fastlm's op, transformers'
    grouped_mm and eager experts), and at Qwen3-30B-A3B's sizes fastlm's is at most half of
    grouped_mm's (the docs' table)."""
    pytest.importorskip("transformers")
    moe = _benchmark_module("moe")
    for sizes, dtype in ((dict(T=16, D=64, F=32, E=8, k=2), torch.bfloat16),
                         (dict(T=21, D=48, F=40, E=6, k=3), torch.float32)):  # fmt: skip
        for name in moe.IMPLEMENTATIONS:
            counted = moe.saved_bytes(name, **sizes, dtype=dtype)
            assert counted == moe.saved_formula(name, **sizes, dtype=dtype), (name, sizes)
    table = {row["implementation"]: row["bytes"] for row in moe.saved_table()}
    assert table["fastlm"] <= table["grouped_mm"] / 2


def _benchmark_module(name: str):
    import importlib
    import sys
    from pathlib import Path

    sys.path.append(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    return importlib.import_module(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the speed rows run on CUDA")
def test_benchmark_exits_cleanly_without_cuda(capsys):
    assert _benchmark_module("moe").main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


#: MMA-busy floors (`hot_loop.py`'s clock model of the hot loop read from the SASS, no overlap
#: counted) of the MoE kernels at Qwen3-30B-A3B's sizes (D 2048, F 768), bf16 SwiGLU, sm_90a, in
#: the kept compile report: {(op, kernel): floors of its launches' figures, lowest first}. Measured
#: 74% and 81% (the forward's two grouped GEMMs), 74% (the backward's recompute kernel), 79% and
#: 80% (the weight gradients d gate_up and d down), 80% (dx): all above the 70% goal.
MMA_BUSY_FLOORS = {
    ("MoE fwd", "_grouped_gemm_kernel"): (0.73, 0.80),
    ("MoE bwd", "_hidden_backward_kernel"): (0.73,),
    ("MoE bwd", "_expert_grad_kernel"): (0.78, 0.79),
    ("MoE bwd", "_grouped_gemm_kernel"): (0.79,),
}


def test_kept_report_has_the_moe_hot_loops():
    """The MoE GEMMs' rows in the kept compile report (`compile_report.py --baseline`): each
    16-bit launch on the three archs has its hot loop read (tensor cores issuing exactly the
    tile's FLOPs, no spill; tcgen05 on sm_100a, wgmma on sm_90a, mma.sync on sm_80) and is a
    line of the hot-loop table, and the bf16 SwiGLU launches on sm_90a are at least
    MMA_BUSY_FLOORS."""
    import json
    from pathlib import Path

    hot_loop = _benchmark_module("hot_loop")
    kept = Path(__file__).resolve().parent.parent / "benchmarks/baselines/compile_report.json"
    rows = [r for r in json.loads(kept.read_text())["rows"] if r["kernel"] in hot_loop.GEMM_DOTS]
    read = [r for r in rows if r["dtype"] != "fp32"]
    assert {(r["arch"], r["form"]) for r in read} == {
        (arch, form)
        for arch in ("sm_100a", "sm_90a", "sm_80")
        for form in ("SwiGLU", "gpt-oss", "ReLU2")
    }
    lines = hot_loop.table(read).splitlines()[2:]
    for row, line in zip(read, lines, strict=True):
        loop = row["hot_loop"]
        assert loop["mma_ratio"] == 1.0 and not row["problems"] and row["spill_stores"] == 0
        tensor_cores = {"sm_100a": "tcgen05", "sm_90a": "wgmma", "sm_80": "mma"}[row["arch"]]
        assert row[tensor_cores] > 0, (row["kernel"], row["arch"])
        assert f"`{row['kernel']}`" in line and f"{loop['mma_busy']:.0%}" in line
    busy = {}
    for row in read:
        if (row["arch"], row["dtype"], row["form"]) == ("sm_90a", "bf16", "SwiGLU"):
            busy.setdefault((row["op"], row["kernel"]), []).append(row["hot_loop"]["mma_busy"])
    assert set(busy) == set(MMA_BUSY_FLOORS)
    for key, floors in MMA_BUSY_FLOORS.items():
        figures = sorted(busy[key])
        assert len(figures) == len(floors), (key, figures)
        assert all(f >= floor for f, floor in zip(figures, floors)), (key, figures, floors)
