"""Every `torch.ops.fastlm.*` op (and its backward op) on DTensors (`fastlm.sharding`): gloo groups
of 2 processes spawned here (one spawn runs every case: starting processes is what costs). Each
case runs a public function on whole tensors, then on DTensors distributed with the case's
placements, and compares the outputs and every input's gradient (DTensors read back whole with
`full_tensor`, which reduces a Partial weight gradient: a dropped reduction would fail). The
placements the rules refuse raise a ValueError naming the op, the argument and the placement."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from test_distributed import spawn

import fastlm
from fastlm import sharding
from fastlm.kernels.rope import rope_tables
from fastlm.testing import relative_error

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="needs gloo")

# float32: the same kernels on each rank's rows, so outputs match to the bit but for reductions
# across rows (weight gradients) that add the ranks' partial sums in another order.
FP32_BOUND = 1e-6


@dataclass
class Case:
    """fn(*inputs) on whole tensors vs on DTensors; placements[i] is input i's (a tuple over
    the 1-D mesh) or None (passed as it is); grads: the inputs differentiated."""

    name: str
    fn: Callable
    make: Callable  # () -> inputs, drawn from the seeded generator
    placements: tuple
    grads: tuple = ()
    # {position in grads: fn(inputs, outputs, upstreams) -> the magnitude of the terms that the
    # gradient sums}, for a gradient that is a sum of terms of both signs which the ranks add in
    # another order: its rounding is relative to that magnitude, not to the small sum.
    cancelling: dict | None = None


def _randn(*shape):
    return torch.randn(*shape, dtype=torch.float32)


def _sink_gradient_terms(inputs, outputs, upstreams):
    """dsink_h = -sum over the head's rows of P_sink rowsum(dO * O) (plus P_sink dlse where
    lse gets an upstream gradient), P_sink = exp(sink_h - lse): terms of either sign, so their
    absolute sum per head."""
    (o, lse), sinks = outputs, inputs[3]
    o, lse, sinks, do = (t.detach().double() for t in (o, lse, sinks, upstreams[0]))
    terms = (o * do).sum(-1).abs()
    if len(upstreams) > 1:
        terms = terms + upstreams[1].double().abs()
    return (torch.exp(sinks[None, :, None] - lse) * terms).sum((0, 2))


def attention(q, k, v, causal=True, **kw):
    return fastlm.flash_attention(q, k, v, causal, return_lse=True, **kw)


def varlen(q, k, v, cu, sinks=None):
    return fastlm.flash_attention_varlen(q, k, v, cu, cu, 7, 7, return_lse=True, sinks=sinks)


def _cases() -> list[Case]:
    from torch.distributed.tensor import Replicate, Shard

    R, S = Replicate(), Shard
    cos, sin = rope_tables(10000.0, 16, 32)
    positions = torch.randperm(32)[:10]

    def rope_inplace(q, k, cos, sin, positions):
        q, k = q * 1.0, k * 1.0  # not leaves: rotated in place
        return fastlm.apply_rope_(q, k, cos, sin, positions)

    def rope_functional(x, cos, sin, positions):
        return torch.ops.fastlm.rope(x, cos, sin, positions, True, False)

    def rope_attention(qkv, cos, sin, positions):
        return fastlm.rope_attention(qkv * 1.0, cos, sin, positions, 4, 2)

    def targets(*shape, vocab=37):
        t = torch.randint(0, vocab, shape)
        t[..., 1] = -100  # ignored rows
        return t

    def lce_sum(x, w, t):
        return fastlm.linear_cross_entropy(x, w, t, chunk_size=5, reduction="sum")

    return [
        Case(
            "rms_norm rows",
            lambda x, w: fastlm.rms_norm(x, w),
            lambda: (_randn(6, 5, 40), _randn(40)),
            ((S(0),), (R,)),
            (0, 1),
        ),
        Case(
            "rms_norm tokens",
            lambda x, w: fastlm.rms_norm(x, w),
            lambda: (_randn(2, 9, 40), _randn(40)),
            ((S(1),), (R,)),
            (0, 1),
        ),
        Case(
            "add_rms_norm",
            lambda x, r, w: fastlm.add_rms_norm(x, r, w),
            lambda: (_randn(2, 7, 24), _randn(2, 7, 24), _randn(24)),
            ((S(1),), (S(1),), (R,)),
            (0, 1, 2),
        ),
        Case(
            "swiglu last dim",
            fastlm.swiglu,
            lambda: (_randn(3, 4, 22), _randn(3, 4, 22)),
            ((S(2),), (S(2),)),
            (0, 1),
        ),
        Case(
            "geglu rows",
            fastlm.geglu,
            lambda: (_randn(5, 18), _randn(5, 18)),
            ((S(0),), (S(0),)),
            (0, 1),
        ),
        Case(
            "swiglu_packed tokens",
            fastlm.swiglu_packed,
            lambda: (_randn(2, 7, 30),),
            ((S(1),),),
            (0,),
        ),
        Case(
            "apply_rope_ heads",
            rope_inplace,
            lambda: (_randn(2, 4, 10, 16), _randn(2, 2, 10, 16), cos, sin, positions),
            ((S(1),), (S(1),), (R,), (R,), (R,)),
            (0, 1),
        ),
        Case(
            "apply_rope_ tokens",
            rope_inplace,
            lambda: (_randn(1, 2, 10, 16), _randn(1, 2, 10, 16), cos, sin, positions),
            ((S(2),), (S(2),), (R,), (R,), (S(0),)),
            (0, 1),
        ),
        Case(
            "rope batch, (B, T) positions",
            rope_functional,
            lambda: (_randn(4, 3, 10, 16), cos, sin, torch.randint(0, 32, (4, 10))),
            ((S(0),), (R,), (R,), (S(0),)),
            (0,),
        ),
        Case(
            "flash_attention GQA heads",
            attention,
            lambda: (_randn(2, 4, 9, 16), _randn(2, 2, 11, 16), _randn(2, 2, 11, 16)),
            ((S(1),), (S(1),), (S(1),)),
            (0, 1, 2),
        ),
        Case(
            "flash_attention batch, window, softcap",
            lambda q, k, v: attention(q, k, v, window_size=(3, 0), softcap=4.0),
            lambda: (_randn(4, 2, 9, 16), _randn(4, 1, 9, 16), _randn(4, 1, 9, 16)),
            ((S(0),), (S(0),), (S(0),)),
            (0, 1, 2),
        ),
        Case(
            "flash_attention non-causal queries",
            lambda q, k, v: attention(q, k, v, False),
            lambda: (_randn(1, 2, 12, 16), _randn(1, 2, 13, 16), _randn(1, 2, 13, 16)),
            ((S(2),), (R,), (R,)),
            (0, 1, 2),
        ),
        Case(
            "flash_attention GQA heads, sinks split with them",
            lambda q, k, v, sinks: attention(q, k, v, sinks=sinks),
            lambda: (_randn(2, 4, 9, 16), _randn(2, 2, 11, 16), _randn(2, 2, 11, 16), _randn(4)),
            ((S(1),), (S(1),), (S(1),), (S(0),)),
            (0, 1, 2, 3),
        ),
        Case(
            "flash_attention batch, sinks replicated (their gradient Partial)",
            lambda q, k, v, sinks: attention(q, k, v, window_size=(3, 0), sinks=sinks),
            lambda: (_randn(4, 2, 9, 16), _randn(4, 1, 9, 16), _randn(4, 1, 9, 16), _randn(2)),
            ((S(0),), (S(0),), (S(0),), (R,)),
            (0, 1, 2, 3),
            # The sinks' gradient (2 heads) sums 36 rows' terms of either sign; the two ranks'
            # partial sums, added, fail a bound relative to the sum itself in 2 of 3,000 seeds.
            cancelling={3: _sink_gradient_terms},
        ),
        Case(
            "flash_attention_varlen heads, sinks split with them",
            varlen,
            lambda: (
                _randn(12, 4, 16),
                _randn(12, 2, 16),
                _randn(12, 2, 16),
                torch.tensor([0, 5, 12], dtype=torch.int32),
                _randn(4),
            ),
            ((S(1),), (S(1),), (S(1),), (R,), (S(0),)),
            (0, 1, 2, 4),
        ),
        Case(
            "flash_attention_varlen heads",
            varlen,
            lambda: (
                _randn(12, 4, 16),
                _randn(12, 2, 16),
                _randn(12, 2, 16),
                torch.tensor([0, 5, 12], dtype=torch.int32),
            ),
            ((S(1),), (S(1),), (S(1),), (R,)),
            (0, 1, 2),
        ),
        Case(
            "rope_attention batch",
            rope_attention,
            lambda: (_randn(2, 10, 128), cos, sin, positions),
            ((S(0),), (R,), (R,), (R,)),
            (0,),
        ),
        Case(
            "cross_entropy replicated",
            fastlm.cross_entropy,
            lambda: (_randn(7, 37), targets(7)),
            ((R,), (R,)),
            (0,),
        ),
        Case(
            "cross_entropy sum, rows",
            lambda x, t: fastlm.cross_entropy(x, t, reduction="sum", label_smoothing=0.1),
            lambda: (_randn(8, 37), targets(8)),
            ((S(0),), (S(0),)),
            (0,),
        ),
        Case(
            "cross_entropy none, tokens, softcap",
            lambda x, t: fastlm.cross_entropy(x, t, reduction="none", softcap=3.0),
            lambda: (_randn(2, 5, 37), targets(2, 5)),
            ((S(0),), (S(0),)),
            (0,),
        ),
        Case(
            "linear_cross_entropy replicated",
            lambda x, w, t: fastlm.linear_cross_entropy(x, w, t, chunk_size=4),
            lambda: (_randn(9, 24), _randn(37, 24), targets(9)),
            ((R,), (R,), (R,)),
            (0, 1),
        ),
        Case(
            "linear_cross_entropy sum, rows",
            lce_sum,
            lambda: (_randn(10, 24), _randn(37, 24), targets(10)),
            ((S(0),), (R,), (S(0),)),
            (0, 1),
        ),
    ]


def _distribute(value, placements, mesh):
    from torch.distributed.tensor import distribute_tensor

    if placements is None or not isinstance(value, torch.Tensor):
        return value
    return distribute_tensor(value, mesh, list(placements))


def _run(case: Case, inputs, mesh=None):
    """(outputs, gradients, upstream gradients) of case.fn on inputs, distributed over mesh if
    given (outputs and gradients read back whole)."""
    inputs = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
    if mesh is not None:
        inputs = [_distribute(t, p, mesh) for t, p in zip(inputs, case.placements)]
    for i in case.grads:
        inputs[i].requires_grad_()
    outputs = case.fn(*inputs)
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    generator = torch.Generator().manual_seed(1)  # the same upstream gradients on every rank
    loss, upstreams = 0, []
    for out in outputs:
        if out.is_floating_point() and out.requires_grad:
            upstream = torch.randn(out.shape, generator=generator)
            upstreams.append(upstream)
            if mesh is not None:
                upstream = _distribute(upstream, out.placements, mesh)
            loss = loss + (out * upstream).sum()
    loss.backward()
    whole = [o.full_tensor() if mesh is not None else o for o in outputs]
    grads = [inputs[i].grad for i in case.grads]
    return whole, [g.full_tensor() if mesh is not None else g for g in grads], upstreams


def _whole_runs(cases: list[Case]) -> list:
    """(case, its inputs, its run on whole tensors) for each case, drawn in order from the
    seeded generator: computed once in the test's process, before the ranks fork (each rank
    computing them again cost a third of its time)."""
    return [(case, inputs, _run(case, inputs)) for case in cases for inputs in [case.make()]]


def _check_case(case: Case, mesh, inputs=None, whole=None) -> None:
    """The case on DTensors against its run on whole tensors (`whole`, for `inputs`; both made
    here if not given)."""
    if inputs is None:
        inputs = case.make()
    outputs, grads, upstreams = whole or _run(case, inputs)
    d_outputs, d_grads, _ = _run(case, inputs, mesh)
    magnitudes = {
        len(outputs) + position: terms(inputs, outputs, upstreams)
        for position, terms in (case.cancelling or {}).items()
    }
    for index, (out, ref) in enumerate(zip(d_outputs + d_grads, outputs + grads)):
        what = f"output {index}" if index < len(outputs) else f"grad {index - len(outputs)}"
        assert out.shape == ref.shape and out.dtype == ref.dtype, (case.name, what, out.shape)
        if not out.is_floating_point():
            assert torch.equal(out, ref), (case.name, what)
            continue
        if index in magnitudes:
            error = float(
                torch.linalg.vector_norm(out.double() - ref.double())
                / torch.linalg.vector_norm(magnitudes[index])
            )
        else:
            error = relative_error(out, ref)
        assert error <= FP32_BOUND, f"{case.name}, {what}: relative error {error:.2e}"


def _check_refusals(mesh) -> None:
    """Placements an op cannot run on its local shards: a ValueError naming op, argument and
    placement."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def d(t, *placements):
        return distribute_tensor(t, mesh, list(placements))

    R = Replicate()
    x, w = _randn(4, 40), _randn(40)
    q = _randn(1, 3, 8, 16)  # 3 heads: not divisible by 2 ranks
    logits, t = _randn(6, 38), torch.randint(0, 38, (6,))
    refused = [
        (
            lambda: fastlm.rms_norm(d(x, Shard(1)), d(w, R)),
            r"fastlm::rms_norm: x .* Shard\(dim=1\)",
        ),
        (lambda: fastlm.swiglu_packed(d(x, Shard(1))), r"swiglu_packed: gate_up .*\[gate \| up\]"),
        (
            lambda: fastlm.flash_attention(d(q, Shard(1)), d(q, Shard(1)), d(q, Shard(1))),
            r"flash_attention: q .* 3 query and 3 KV heads",
        ),
        (
            lambda: fastlm.flash_attention(d(q, Shard(2)), d(q, Shard(2)), d(q, Shard(2))),
            r"flash_attention: k .*context_parallel_attention",
        ),
        (
            lambda: fastlm.flash_attention(d(q, Shard(3)), d(q, R), d(q, R)),
            r"flash_attention: q .* Shard\(dim=3\).*head's dims",
        ),
        (
            lambda: fastlm.cross_entropy(d(logits, Shard(1)), d(t, R)),
            r"fastlm::cross_entropy: logits .*vocab_parallel",
        ),
        (
            lambda: fastlm.cross_entropy(d(logits, Shard(0)), d(t, Shard(0))),
            r"fastlm::cross_entropy: logits .*mean over its rows",
        ),
        (
            lambda: fastlm.linear_cross_entropy(d(x, R), d(_randn(38, 40), Shard(0)), d(t[:4], R)),
            r"linear_cross_entropy: weight .*vocab_parallel",
        ),
    ]
    for call, pattern in refused:
        # DTensor re-raises a rule's ValueError as a RuntimeError caused by it, both messages
        # kept: the rule's first.
        with pytest.raises(RuntimeError, match=pattern) as info:
            call()
        assert isinstance(info.value.__cause__, ValueError), info.value


def _check_dtype_cache(mesh) -> None:
    """An out_dtype changes the output's dtype: a strategy cached for another call (torch 2.13
    keys its cache on the non-tensor arguments too) must not be reused."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    x = distribute_tensor(_randn(4, 8), mesh, [Shard(0)])
    w = distribute_tensor(_randn(8), mesh, [Replicate()])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = fastlm.rms_norm(x, w, out_dtype=dtype)
        assert out.dtype == dtype and out.to_local().dtype == dtype, (dtype, out.dtype)


def _worker(rank: int, world_size: int, seed: int, runs: list) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    for case, inputs, whole in runs:  # the same whole inputs on every rank
        _check_case(case, mesh, inputs, whole)
    torch.manual_seed(seed)  # every rank draws the same tensors below
    _check_refusals(mesh)
    _check_dtype_cache(mesh)


def test_ops_on_dtensors(tmp_path):
    seed = int(torch.randint(2**31, ()))  # from the test's seed
    torch.manual_seed(seed)
    spawn(2, tmp_path, _worker, seed, _whole_runs(_cases()))


def _mesh_2d_cases() -> list[Case]:
    """On a (data 2 x tensor 2) mesh: heads split over one mesh dim need only divide its ranks
    (not the mesh's 4), and a dim split over both must divide all 4."""
    from torch.distributed.tensor import Replicate, Shard

    R, S = Replicate(), Shard

    def row_losses(x, t):
        loss = fastlm.cross_entropy(x, t, reduction="none")
        # On DTensors the row rule's strategy: the rows stay where they are (not replicated).
        assert tuple(getattr(loss, "placements", (S(0), R))) == (S(0), R), loss.placements
        return loss

    return [
        Case(
            "flash_attention batch on data, heads on tensor, sinks with them",
            lambda q, k, v, sinks: attention(q, k, v, sinks=sinks),
            lambda: (_randn(2, 2, 9, 16), _randn(2, 2, 11, 16), _randn(2, 2, 11, 16), _randn(2)),
            ((S(0), S(1)), (S(0), S(1)), (S(0), S(1)), (R, S(0))),
            (0, 1, 2, 3),
            # Replicated over the data ranks: each head's sink gradient is their Partial sum.
            cancelling={3: _sink_gradient_terms},
        ),
        Case(
            "flash_attention_varlen heads on tensor",
            varlen,
            lambda: (
                _randn(12, 2, 16),
                _randn(12, 2, 16),
                _randn(12, 2, 16),
                torch.tensor([0, 5, 12], dtype=torch.int32),
                _randn(2),
            ),
            ((R, S(1)), (R, S(1)), (R, S(1)), (R, R), (R, S(0))),
            (0, 1, 2, 4),
        ),
        Case(
            # Either dim's 2 ranks split 12 and 6 heads evenly, both dims' 4 do not split 6.
            "flash_attention q's 12 heads on data, k's and v's 6 on tensor",
            attention,
            lambda: (_randn(1, 12, 5, 16), _randn(1, 6, 5, 16), _randn(1, 6, 5, 16)),
            ((S(1), R), (R, S(1)), (R, S(1))),
            (0, 1, 2),
        ),
        Case(
            "cross_entropy none, rows on data",
            row_losses,
            lambda: (_randn(2, 5, 37), torch.randint(0, 37, (2, 5))),
            ((S(0), R), (S(0), R)),
            (0,),
        ),
    ]


def _worker_2d(rank: int, world_size: int, seed: int, runs: list) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
    for case, inputs, whole in runs:
        _check_case(case, mesh, inputs, whole)
    torch.manual_seed(seed)
    # 3 heads do not divide the tensor dim's 2 ranks: refused, naming that count.
    q = distribute_tensor(_randn(2, 3, 8, 16), mesh, [Shard(0), Shard(1)])
    with pytest.raises(RuntimeError, match="3 query and 3 KV heads do not both divide the 2 "):
        fastlm.flash_attention(q, q, q)
    k = distribute_tensor(_randn(2, 3, 8, 16), mesh, [Shard(0), Replicate()])
    with pytest.raises(RuntimeError, match="3 query and 3 KV heads do not both divide the 2 "):
        fastlm.flash_attention(q, k, k)


def test_ops_on_a_2d_mesh(tmp_path):
    seed = int(torch.randint(2**31, ()))
    torch.manual_seed(seed)
    spawn(4, tmp_path, _worker_2d, seed, _whole_runs(_mesh_2d_cases()))


def test_every_op_has_a_rule():
    """Every registered torch.ops.fastlm op has a sharding rule (none added without one)."""
    import fastlm.kernels.attention.qkv  # noqa: F401
    import fastlm.kernels.cross_entropy_options  # noqa: F401

    registered = {
        name
        for name in dir(torch.ops.fastlm)
        if not name.startswith("_")
        and isinstance(getattr(torch.ops.fastlm, name), torch._ops.OpOverloadPacket)
    }
    assert registered == set(sharding.rules())
    assert sharding.register()
