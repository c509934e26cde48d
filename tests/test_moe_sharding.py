"""The experts op sharded (`fastlm.sharding`'s MoE rules): over E (expert parallelism: each rank
holds E / P experts and runs their rows of the whole routing, `expert_index` telling it which)
and over F (tensor parallelism of each expert's MLP, interleaved gate/up only). On a gloo mesh
of 2 processes, `fastlm.moe_experts` on DTensors against the whole tensors: the output and every
gradient (read back whole with `full_tensor`, which reduces the `Partial` ones), the placements
the rules give, and the layout they must not shard (halves); and the PyTorch backend, which
runs DTensors whole. In this process: the op on slices
of the experts with `expert_index`, and its validation."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from test_distributed import spawn
from test_tensor_parallel_ops import FP32_BOUND, Case, _check_case

import fastlm
from fastlm.backend import use_triton
from fastlm.kernels.moe.experts import _experts_op, _route_op, moe_experts_ref
from fastlm.testing import relative_error

T, D, F, E, K = 7, 20, 6, 4, 2  # F: 3 hidden columns a rank, not a multiple of any block
GPT_OSS = dict(transposed=True, interleaved=True, alpha=1.702, limit=7.0, up_offset=1.0)


def _inputs(transposed=False):
    """x, expert_ids (k distinct experts a token), expert_weights, gate_up, down, the biases."""
    ids = torch.rand(T, E).argsort(dim=1)[:, :K]
    weights = torch.randn(T, K).softmax(dim=1)
    gate_up = torch.randn(E, 2 * F, D) / D**0.5
    down = torch.randn(E, D, F) / F**0.5
    if transposed:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    return torch.randn(T, D), ids, weights, gate_up, down, torch.randn(E, 2 * F), torch.randn(E, D)


def _moe(placement, **layout):
    """fastlm.moe_experts, asserting on DTensors the output's placement (the strategy used; the
    PyTorch backend runs DTensors whole, replicated)."""

    def fn(x, ids, weights, gate_up, down, b1=None, b2=None):
        from torch.distributed.tensor import Replicate

        out = fastlm.moe_experts(x, ids, weights, gate_up, down, b1, b2, **layout)
        want = placement if use_triton(x) else Replicate()
        placements = getattr(out, "placements", (want,))
        assert placements == (want,), (layout, placements)
        return out

    return fn


def _cases() -> list[Case]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    R, S = Replicate(), Shard
    return [
        Case(
            # gpt-oss's form: (E, D, 2F) and (E, F, D), interleaved, biases, the clamp. The
            # replicated down_bias is made Partial (divided among the ranks): added once.
            "F sharded, transposed, interleaved, biases",
            _moe(Partial(), **GPT_OSS),
            lambda: _inputs(transposed=True),
            ((R,), (R,), (R,), (S(2),), (S(1),), (S(1),), (R,)),
            (0, 2, 3, 4, 5, 6),
        ),
        Case(
            "E sharded, biases",
            _moe(Partial()),
            _inputs,
            ((R,), (R,), (R,), (S(0),), (S(0),), (S(0),), (S(0),)),
            (0, 2, 3, 4, 5, 6),
        ),
        Case(
            # Halves (gate the first F rows): a Shard of the 2F rows would give rank 0 gate rows
            # only; the rule offers no such strategy, DTensor gathers and runs replicated.
            "F sharded, halves: run replicated",
            _moe(Replicate()),
            lambda: _inputs()[:5],
            ((R,), (R,), (R,), (S(1),), (S(2),)),
            (0, 2, 3, 4),
        ),
    ]


def _check_refusals(mesh) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    x, ids, weights, gate_up, down, _, _ = _inputs()
    R = [Replicate()]
    ids, weights = distribute_tensor(ids, mesh, R), distribute_tensor(weights, mesh, R)
    refused = [
        ((Shard(0), R[0], R[0]), r"fastlm::moe_experts: x .*Shard\(dim=0\).*replicated tokens"),
        ((R[0], Shard(2), R[0]), r"fastlm::moe_experts: gate_up .*its D dim is reduced over"),
        ((R[0], R[0], Shard(1)), r"fastlm::moe_experts: down .*its D dim is the output's"),
    ]
    for (on_x, on_gate_up, on_down), pattern in refused:
        args = [distribute_tensor(t, mesh, [p]) for t, p in
                ((x, on_x), (gate_up, on_gate_up), (down, on_down))]  # fmt: skip
        with pytest.raises(RuntimeError, match=pattern) as info:
            fastlm.moe_experts(args[0], ids, weights, args[1], args[2])
        assert isinstance(info.value.__cause__, ValueError), info.value


def _check_strategy_cache(mesh) -> None:
    """DTensor caches the strategy chosen for a call, keyed on the arguments `fastlm.sharding`
    names (every non-tensor one): a call that differs from a cached one in a bool alone gets its
    own strategy. interleaved=True then False on the same F-sharded weights: the second is the
    halves layout (gathered, Replicate), not the first's F shard (which gave wrong numbers);
    likewise attention's non-causal queries sharded by sequence, then causal ones (refused)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    x, ids, weights, gate_up, down, _, _ = _inputs()
    R = [Replicate()]
    args = [distribute_tensor(t, mesh, R) for t in (x, ids, weights)]
    args += [
        distribute_tensor(gate_up, mesh, [Shard(1)]),
        distribute_tensor(down, mesh, [Shard(2)]),
    ]
    for interleaved, placement in ((True, "Partial"), (False, "Replicate")):
        out = fastlm.moe_experts(*args, interleaved=interleaved)
        assert type(out.placements[0]).__name__ == placement, (interleaved, out.placements)
        ref = moe_experts_ref(x, ids, weights, gate_up, down, interleaved=interleaved)
        assert relative_error(out.full_tensor(), ref) <= FP32_BOUND, interleaved
    q = distribute_tensor(torch.randn(1, 1, 6, 16), mesh, [Shard(2)])
    kv = distribute_tensor(torch.randn(1, 1, 6, 16), mesh, R)
    fastlm.flash_attention(q, kv, kv, False)
    with pytest.raises(RuntimeError, match="causal or windowed queries"):
        fastlm.flash_attention(q, kv, kv, True)


def _worker(rank: int, world_size: int, seed: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(seed)  # every rank draws the same whole inputs
    for case in _cases():
        _check_case(case, mesh)
    # The PyTorch backend gathers DTensors whole and runs the reference on them, whatever
    # their placements: one case shows it.
    os.environ["FASTLM_BACKEND"] = "torch"
    _check_case(_cases()[0], mesh)
    del os.environ["FASTLM_BACKEND"]
    # The F case's check can tell a down_bias added on each rank (twice) from one added once.
    x, ids, weights, gate_up, down, b1, b2 = _inputs(transposed=True)
    once = moe_experts_ref(x, ids, weights, gate_up, down, b1, b2, **GPT_OSS)
    twice = moe_experts_ref(x, ids, weights, gate_up, down, b1, 2 * b2, **GPT_OSS)
    assert relative_error(twice, once) > 1e4 * FP32_BOUND
    _check_refusals(mesh)
    _check_strategy_cache(mesh)


def test_moe_experts_on_dtensors(tmp_path):
    if not dist.is_gloo_available():
        pytest.skip("needs gloo")
    spawn(2, tmp_path, _worker, int(torch.randint(2**31, ())))


# --------------------------------------------------------------------------------------------
# The op's expert_index, in this process
# --------------------------------------------------------------------------------------------


def _op_args(x, weights, gate_up, down, b1, b2, routing):
    return (x, weights, gate_up, down, b1, b2, *routing, False, False, "silu", 1.0, None, 0.0)


def test_expert_index_slices_add_up():
    """The op on an uneven split of the experts (3 + 1), each slice with the global ids of its
    experts: each equals the reference restricted to those experts, and the slices' outputs add
    up to the whole op's (the backward's: the E case on DTensors above)."""
    x, ids, weights, gate_up, down, b1, b2 = _inputs()
    routing = _route_op(ids, E)
    whole = _experts_op(*_op_args(x, weights, gate_up, down, b1, b2, routing))
    outs = []
    for held in (slice(0, 3), slice(3, 4)):
        index = torch.arange(E)[held]
        local = _op_args(x, weights, gate_up[held], down[held], b1[held], b2[held], routing)
        out = _experts_op(*local, index)
        ref = moe_experts_ref(
            x, ids, weights, gate_up[held], down[held], b1[held], b2[held], expert_index=index
        )
        assert relative_error(out, ref) <= FP32_BOUND
        outs.append(out)
    assert relative_error(outs[0] + outs[1], whole) <= FP32_BOUND


@pytest.mark.parametrize(
    "index, message",
    [
        (torch.arange(2.0), "1-D int32 or int64"),
        (torch.arange(3), "of gate_up's 2 experts"),
        (torch.tensor([0, 2]), "consecutive ids"),
        (torch.tensor([3, 4]), r"within \[0, 4\)"),
    ],
)
def test_expert_index_refused(index, message):
    x, ids, weights, gate_up, down, _, _ = _inputs()
    args = _op_args(x, weights, gate_up[:2], down[:2], None, None, _route_op(ids, E))
    with pytest.raises(ValueError, match=f"expert_index must be .*{message}"):
        _experts_op(*args, index)
