"""Context parallelism (`fastlm.distributed`) on the CPU: gloo groups of 2 and 4 processes spawned
here (one spawn per group size runs every check, since starting processes is what costs), each
rank comparing its shard with single-process results over the whole sequence: attention's output,
log-sum-exp and gradients (PyTorch backend, and the kernels through Triton's interpreter), a
model's loss and gradients, and the exchange's buffers and traffic against `ExchangePlan` (the
memory model of docs/distributed.md). The layout helpers and the errors run in this process."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import test_train
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_train import TOY, run_main, torchrun
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fastlm.cli.trainer as training
import fastlm.kernels._common as kernel_common
from fastlm import Transformer, checkpoint, flash_attention
from fastlm.distributed import (
    ExchangePlan,
    context_parallel_attention,
    context_parallel_mesh,
    gather_sequence,
    sequence_positions,
    shard_sequence,
)
from fastlm.testing import relative_error

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="needs gloo")

# float32 rounding: the sums run in other orders (other key blocks, partial dK/dV added across
# ranks), a few units of 2^-24 over these short rows; measured up to 1.5e-7.
FP32_BOUND = 1e-6


def spawn(world_size: int, tmp_path, worker, *args) -> None:
    """worker(rank, world_size, *args) in `world_size` fresh processes joined in one gloo group;
    an exception in any of them fails the caller with its traceback."""
    store = tmp_path / f"store-{world_size}"
    # Forked: the children start with fastlm imported (seconds each, spawned, on a busy machine).
    args = (world_size, str(store), worker, args)
    mp.start_processes(_entry, args, nprocs=world_size, join=True, start_method="fork")


def _entry(rank, world_size, store, worker, args):
    torch.set_num_threads(1)  # several processes on a shared two-core machine
    kernel_common.POISON_OUTPUTS = True  # as tests/conftest.py sets in the parent
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        worker(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def _check(name: str, out: torch.Tensor, ref: torch.Tensor, bound: float = FP32_BOUND) -> None:
    error = relative_error(out, ref)
    assert error <= bound, f"{name}: relative error {error:.2e} > {bound:.0e}"


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    backend: str  # FASTLM_BACKEND
    B: int = 2
    Hq: int = 2
    Hkv: int = 2
    chunk: int = 5  # tokens per chunk: the sequence is 2 * world_size chunks
    D: int = 16
    Dv: int | None = None  # v's head dim (None: D)
    causal: bool = True
    left: int = -1  # the window's left side
    softcap: float = 0.0


TORCH_CASES = [
    Case("torch"),  # causal MHA
    Case("torch", Hq=4, Hkv=2, chunk=3),  # grouped-query heads
    Case("torch", Hq=3, Hkv=1, left=3),  # a window inside one chunk: neighbours only
    Case("torch", Hq=4, Hkv=2, left=12, softcap=5.0),  # a window over several chunks, capped
    Case("torch", left=0),  # each query sees itself: nothing exchanged
    Case("torch", Hq=4, Hkv=2, causal=False),  # every query sees every key
    Case("torch", Hq=4, Hkv=2, Dv=8),  # v's head dim of its own (MLA)
]
# The kernels through the interpreter: a few seconds each, so one per group size.
KERNEL_CASES = {
    2: Case("triton", B=1, Hq=2, Hkv=1, chunk=6, Dv=8, left=8, softcap=3.0),
    4: Case("triton", B=1, Hq=4, Hkv=2, chunk=7),
}


@contextlib.contextmanager
def _backend(name: str):
    previous = os.environ.get("FASTLM_BACKEND")
    os.environ["FASTLM_BACKEND"] = name
    try:
        yield
    finally:
        if previous is None:
            del os.environ["FASTLM_BACKEND"]
        else:
            os.environ["FASTLM_BACKEND"] = previous


def _attention_problem(case: Case, world_size: int, seed: int):
    """(case, the whole sequence's q, k, v and dO, the options, and single-process attention's
    o, lse, dq, dk, dv), computed once in the parent."""
    generator = torch.Generator().manual_seed(seed)
    N = 2 * world_size * case.chunk
    Dv = case.Dv or case.D
    q, k = (torch.randn(case.B, H, N, case.D, generator=generator) for H in (case.Hq, case.Hkv))
    v, do = (torch.randn(case.B, H, N, Dv, generator=generator) for H in (case.Hkv, case.Hq))
    options = dict(window_size=(case.left, -1 if case.causal else case.left))
    options = dict(options, causal=case.causal, softcap=case.softcap, return_lse=True)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    with _backend(case.backend):
        o, lse = flash_attention(*full, **options)
        expected = [o.detach(), lse, *torch.autograd.grad(o, full, do)]
    return case, (q, k, v, do), options, expected


def _attention_check(rank, world_size, case, inputs, options, expected):
    os.environ["FASTLM_BACKEND"] = case.backend
    q, k, v, do = (shard_sequence(t, rank, world_size, dim=2) for t in inputs)
    local = [t.requires_grad_() for t in (q, k, v)]
    o, lse = context_parallel_attention(*local, **options)
    got = [o, lse, *torch.autograd.grad(o, local, do)]
    for name, out, ref in zip(("o", "lse", "dq", "dk", "dv"), got, expected):
        _check(f"{case}, rank {rank}: {name}", out, shard_sequence(ref, rank, world_size, dim=2))
    gathered = gather_sequence(o.detach(), dim=2)  # every rank's shard in its place
    _check(f"{case}, rank {rank}: gathered o", gathered, expected[0])
    assert torch.equal(shard_sequence(gathered, rank, world_size, 2), o.detach())


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------

MODEL = dict(
    vocab_size=61,
    context_length=24,  # 2 * 4 * 3: 3-token chunks on 4 ranks
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    d_ff=64,
    rope_theta=10000.0,
)


def _model_problem(backend: str, layers: int, batch: int, seed: int):
    """(backend, a model, its inputs and targets, and the single-process loss, every
    parameter's gradient and the logits), with ignored targets spread unevenly over the ranks
    (most in rank 0's first chunk)."""
    torch.manual_seed(seed)
    model = Transformer(**dict(MODEL, num_layers=layers))
    N = MODEL["context_length"]
    tokens = torch.randint(0, MODEL["vocab_size"], (batch, N + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, :5] = targets[-1, 7] = -100
    with _backend(backend):
        loss = model.loss(inputs, targets)
        expected = [loss.detach(), *torch.autograd.grad(loss, list(model.parameters()))]
        with torch.no_grad():
            logits = model(inputs)
    return backend, model, inputs, targets, expected, logits


def _model_check(rank, world_size, backend, model, inputs, targets, expected, logits):
    """Each rank's share of the loss and its gradients, averaged over the ranks (as DDP and
    FSDP do), equal the single-process loss and gradients; the shard's logits are the whole
    sequence's at its positions (also when given them)."""
    os.environ["FASTLM_BACKEND"] = backend
    model.set_context_parallel(dist.group.WORLD)
    local = [shard_sequence(t, rank, world_size) for t in (inputs, targets)]
    loss = model.loss(*local)
    got = [loss.detach(), *torch.autograd.grad(loss, list(model.parameters()))]
    for t in got:
        dist.all_reduce(t)
        t /= world_size
    names = ["loss", *(name for name, _ in model.named_parameters())]
    for name, out, ref in zip(names, got, expected):
        _check(f"{backend}, rank {rank}: {name}", out, ref, 1e-5)  # sums over all tokens
    with torch.no_grad():
        own = model(local[0])
        positions = sequence_positions(inputs.shape[1], rank, world_size)
        given = model(local[0], positions)
    _check(f"rank {rank}: logits", own, shard_sequence(logits, rank, world_size), 1e-5)
    assert torch.equal(given, own)
    cu_seqlens = torch.tensor([0, local[0].numel()], dtype=torch.int32)
    with pytest.raises(ValueError, match="without a KV cache and without packed documents"):
        model.loss(*local, cu_seqlens=cu_seqlens)
    with pytest.raises(ValueError, match="longer than context_length=24"):
        model(torch.cat([local[0], local[0]], 1))


def _errors_check(rank, world_size):
    """What a group of several ranks refuses, naming it."""
    q = torch.randn(1, 2, 3, 8)  # 3 tokens a rank: not 2 chunks
    with pytest.raises(ValueError, match=f"not divisible by 2 \\* {world_size}"):
        context_parallel_attention(q, q, q)
    two, four = q[:, :, :2], torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="q holds 2 tokens and k 4"):
        context_parallel_attention(two, four, four)
    with pytest.raises(ValueError, match="needs causal=True"):
        context_parallel_attention(two, two, two, None, False, window_size=(1, 1))


def _mesh_problem(seed: int):
    """(a model, two data ranks' batches, the mean of their single-process losses and of every
    parameter's gradients): what one step of DDP or FSDP over data x context must give."""
    torch.manual_seed(seed)
    model = Transformer(**MODEL)
    batches, results = [], []
    tokens = torch.randint(0, MODEL["vocab_size"], (2, 2, MODEL["context_length"] + 1))
    with _backend("torch"):
        for inputs, targets in zip(tokens[..., :-1], tokens[..., 1:]):
            loss = model.loss(inputs, targets)
            results.append([loss.detach(), *torch.autograd.grad(loss, list(model.parameters()))])
            batches.append((inputs, targets))
    return model, batches, [sum(pair) / 2 for pair in zip(*results)]


def _mesh_check(rank, world_size, model, batches, expected):
    """On a (data 2 x context 2) DeviceMesh, DDP and FSDP2 as fastlm.cli.train wraps them (over all
    four ranks): the step's loss and gradients are the single-process ones of both batches."""
    os.environ["FASTLM_BACKEND"] = "torch"
    mesh = context_parallel_mesh(2)
    data, context = mesh["data"].get_local_rank(), mesh["context"].get_local_rank()
    inputs, targets = (shard_sequence(t, context, 2) for t in batches[data])
    run = training.Run(rank, world_size, torch.device("cpu"), 2, mesh["context"].get_group())
    for fsdp in (False, True):
        local = copy.deepcopy(model).set_context_parallel(mesh)
        wrapped = training.distribute(training.NextTokenLoss(local), run, fsdp)
        loss = wrapped(inputs, targets)
        loss.backward()
        loss = loss.detach()
        dist.all_reduce(loss)
        got = [loss / world_size]
        for p in local.parameters():  # FSDP's are DTensor shards: gathered whole
            got.append(p.grad.full_tensor() if fsdp else p.grad)
        names = ["loss", *(name for name, _ in local.named_parameters())]
        for name, out, ref in zip(names, got, expected):
            _check(f"fsdp={fsdp}, rank {rank}: {name}", out, ref, 1e-5)


# --------------------------------------------------------------------------------------------
# Memory and traffic
# --------------------------------------------------------------------------------------------


class _ExchangeRecorder(TorchDispatchMode):
    """Bytes of the new tensors shaped like the exchange's buffers, (tokens, B, Hkv, D + Dv).
    tests/test_attention.py's _AllocationRecorder keys storages by address, which the allocator
    reuses once a buffer is freed (the forward's spans before the backward's): here every
    allocation counts."""

    def __init__(self, tail: tuple[int, ...]):
        super().__init__()
        self.tail, self.bytes = tail, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if _is(t)}
        for t in tree_leaves(out):
            if _is(t) and tuple(t.shape[1:]) == self.tail:
                if t.untyped_storage().data_ptr() not in inputs:  # not a view or in-place
                    self.bytes += t.untyped_storage().nbytes()
        return out


def _is(t) -> bool:
    return isinstance(t, torch.Tensor)


def _memory_check(rank, world_size, seed, dtype, left: int, Dv: int):
    """What one layer's attention keeps for the backward is the shard's q, k, v, o and lse, so
    it shrinks as 1 / P; the exchange's buffers and traffic are ExchangePlan.exchange_bytes."""
    os.environ["FASTLM_BACKEND"] = "torch"  # the exchange is the same on both backends
    B, Hq, Hkv, D, N = 2, 4, 2, 8, 48
    torch.manual_seed(seed)
    T = N // world_size
    q = torch.randn(B, Hq, T, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, T, Dv, dtype=dtype, requires_grad=True)
    traffic = Counter()
    send_and_receive = dist.batch_isend_irecv

    def counting(ops):
        for op in ops:
            traffic[op.op.__name__] += op.tensor.nbytes
        return send_and_receive(ops)

    saved = []
    recorder = _ExchangeRecorder((B, Hkv, D + Dv))
    dist.batch_isend_irecv = counting
    try:
        with recorder, saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            o = context_parallel_attention(q, k, v, window_size=(left, 0))
        forward, recorder.bytes = recorder.bytes, 0
        forward_traffic = traffic.copy()
        with recorder:
            o.backward(torch.randn_like(o))
    finally:
        dist.batch_isend_irecv = send_and_receive
    e = dtype.itemsize
    kept = B * T * ((Hq + Hkv) * (D + Dv) * e + Hq * 4)  # q, k, v, o and the fp32 lse
    assert sum(t.nbytes for t in saved) == kept
    plan = ExchangePlan.build(N, world_size, rank, True, left)
    expected = plan.exchange_bytes(B, Hkv, D, e, value_head_dim=Dv)
    measured = dict(
        forward_buffers=forward,
        backward_buffers=recorder.bytes,
        forward_sent=forward_traffic["isend"],
        forward_received=forward_traffic["irecv"],
        backward_sent=traffic["isend"] - forward_traffic["isend"],
        backward_received=traffic["irecv"] - forward_traffic["irecv"],
    )
    assert measured == expected, f"rank {rank} of {world_size}, window {left}, {dtype}"


# --------------------------------------------------------------------------------------------
# The groups
# --------------------------------------------------------------------------------------------


def _worker(rank, world_size, seed, attention, models, mesh):
    for problem in attention:
        _attention_check(rank, world_size, *problem)
    for problem in models:
        _model_check(rank, world_size, *problem)
    if mesh is not None:
        _mesh_check(rank, world_size, *mesh)
    _errors_check(rank, world_size)
    for dtype, left, Dv in (
        (torch.float32, -1, 8),
        (torch.bfloat16, -1, 8),
        (torch.float32, 5, 16),
    ):
        _memory_check(rank, world_size, seed, dtype, left, Dv)


@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_matches_single_process(tmp_path, fresh_seed, world_size):
    """On every rank: attention's output, log-sum-exp and dq, dk, dv (causal and not, windowed,
    capped, MHA and GQA; PyTorch backend and kernels), a model's loss, gradients and logits,
    and (4 ranks) a DDP and an FSDP2 step on a data x context mesh, equal single-process
    results, computed here once; the exchange's buffers and traffic are the memory model's."""
    cases = [*TORCH_CASES, KERNEL_CASES[world_size]]
    attention = [_attention_problem(case, world_size, fresh_seed) for case in cases]
    models = [_model_problem("torch", layers=2, batch=2, seed=fresh_seed)]
    if world_size == 2:
        models.append(_model_problem("triton", layers=1, batch=1, seed=fresh_seed))
    mesh = _mesh_problem(fresh_seed) if world_size == 4 else None
    spawn(world_size, tmp_path, _worker, fresh_seed, attention, models, mesh)


# --------------------------------------------------------------------------------------------
# In this process
# --------------------------------------------------------------------------------------------


def test_shards_balance_causal_work_and_gather_back():
    x = torch.arange(2 * 16).view(2, 16)
    shards = [shard_sequence(x, rank, 4) for rank in range(4)]
    assert shards[1][0].tolist() == [2, 3, 12, 13]  # chunks 1 and 6 of 8
    assert sequence_positions(16, 1, 4).tolist() == [2, 3, 12, 13]
    # Causal work per rank: the keys its queries see, the same on every rank.
    work = [int((shard[0] + 1).sum()) for shard in shards]
    assert len(set(work)) == 1, work
    assert sorted(torch.cat(shards, 1)[0].tolist()) == x[0].tolist()


def test_plan_sends_what_others_receive():
    for world_size, left in ((2, -1), (4, -1), (4, 2), (4, 7), (3, 0)):
        plans = [ExchangePlan.build(48, world_size, r, True, left) for r in range(world_size)]
        sent = {(p.rank, dst, g) for p in plans for g, _, dst in p.sends}
        received = {(src, p.rank, g) for p in plans for g, src in p.receives}
        assert sent == received, (world_size, left)
    # Without a window rank 0 reads every key, the last rank half of them and one chunk.
    assert ExchangePlan.build(48, 4, 0).held_tokens == 48
    assert ExchangePlan.build(48, 4, 3).held_tokens == 30
    # A window of 2 keys with 6-token chunks: each query chunk reads its own and the one before.
    assert ExchangePlan.build(48, 4, 1, True, 2).held_tokens == 4 * 6


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="sequence length 30 must be divisible by 2 \\* 4 = 8"):
        shard_sequence(torch.zeros(2, 30), 1, 4)
    with pytest.raises(ValueError, match="rank must lie in"):
        shard_sequence(torch.zeros(2, 32), 4, 4)
    with pytest.raises(TypeError, match="group must be a ProcessGroup"):
        context_parallel_attention(*(torch.randn(1, 1, 4, 8) for _ in range(3)), group="world")


def test_group_of_one_is_plain_attention(tmp_path):
    """A one-rank group is flash_attention itself, and a model with it the plain model."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 's'}", rank=0, world_size=1)
    try:
        q, k, v = (torch.randn(2, 2, 9, 16) for _ in range(3))
        assert torch.equal(context_parallel_attention(q, k, v), flash_attention(q, k, v))
        model = Transformer(**MODEL)
        assert model.set_context_parallel(dist.group.WORLD).context_parallel_group is None
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# python -m fastlm.cli.train --context-parallel
# --------------------------------------------------------------------------------------------

corpus = test_train.corpus  # the fixture
FASTLM_TOY = [*TOY, "--model", "fastlm", "--num-kv-heads", "1"]  # grouped-query heads too


SHARDED_LOSS = """
import fastlm.model
whole_loss = fastlm.model.Transformer.loss
def sharded_loss(model, token_ids, *args, **kwargs):
    assert model.context_parallel_group is not None and token_ids.shape[1] == 8, token_ids.shape
    return whole_loss(model, token_ids, *args, **kwargs)
fastlm.model.Transformer.loss = sharded_loss
"""


def _train(tmp_path, corpus, capsys, name: str, *extra) -> list[float]:
    """An in-process run's training losses (its checkpoint's history)."""
    argv = [*FASTLM_TOY, "--data", corpus, "--steps", 6, "--out", tmp_path / name, *extra]
    status, _, err = run_main(argv, capsys)
    assert status == 0, err
    return checkpoint.load_state(tmp_path / name)["train_losses"]


def assert_resumes_back(tmp_path, corpus, capsys, saved, parallel, uninterrupted, *extra):
    """A parallel run's step-4 checkpoint `saved` resumed in one process: its losses, the
    parallel run's and the uninterrupted one-process run's ("single") are equal for the first
    two steps and to rounding after, and its final weights match that run's."""
    shutil.copytree(saved, tmp_path / "back")
    back = _train(tmp_path, corpus, capsys, "back", *extra, "--resume")
    assert parallel[:2] == back[:2] == uninterrupted[:2]
    assert parallel == pytest.approx(uninterrupted, rel=1e-5)
    assert back == pytest.approx(uninterrupted, rel=1e-5)
    weights = checkpoint.load_weights(tmp_path / "back")
    for key, value in checkpoint.load_weights(tmp_path / "single").items():
        assert torch.allclose(weights[key], value, rtol=1e-4, atol=1e-6), key


def keep_every_checkpoint(monkeypatch, folder) -> None:
    """Make each save of fastlm-train's Trainer also copy the checkpoint to
    folder/<out name>-<step>, so a test can resume from any step it saved."""
    save = training.Trainer.save

    def save_and_keep(trainer):
        note = save(trainer)
        shutil.copytree(trainer.out, folder / f"{trainer.out.name}-{trainer.step}")
        return note

    monkeypatch.setattr(training.Trainer, "save", save_and_keep)


def test_train_resumes_into_and_out_of_context_parallelism(tmp_path, corpus, capsys, monkeypatch):
    """The step-2 checkpoint of a one-process run resumes under torchrun with --context-parallel
    2 (each sequence over both ranks, DDP averaging their gradients), and that run's step-4
    checkpoint (full tensors) back in one process: every loss is the uninterrupted
    single-process run's, to rounding, and nothing notes a change of settings."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")  # as torchrun's ranks run
    keep_every_checkpoint(monkeypatch, tmp_path)
    # Each rank's model must see its shard with the group set, not the whole sequence.
    script = test_train.RANK_SCRIPT.replace("status = ", SHARDED_LOSS + "status = ")
    monkeypatch.setattr(test_train, "RANK_SCRIPT", script)
    uninterrupted = _train(tmp_path, corpus, capsys, "single", "--save-every", "2")
    shutil.copytree(tmp_path / "single-2", tmp_path / "cp")
    extra = ["--steps", "6", "--save-every", "2", "--context-parallel", "2", "--resume"]
    result, records = torchrun(tmp_path, corpus, "cp", *FASTLM_TOY[len(TOY) :], *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "context parallel 2" in result.stderr and "note:" not in result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 6 and summary["world_size"] == 2
    parallel = checkpoint.load_state(tmp_path / "cp")["train_losses"]
    assert_resumes_back(tmp_path, corpus, capsys, records / "checkpoint-4", parallel, uninterrupted)


def test_benchmark_without_cuda_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("measures on a GPU: benchmarks/context_parallel.py")
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "context_parallel.py"
    spec = importlib.util.spec_from_file_location("context_parallel_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def assert_refused_in_one_line(tmp_path, corpus, capsys, extra, message) -> None:
    """fastlm-train with `extra` flags exits 2 before anything runs, with one line on stderr
    that holds `message`, and leaves no --out folder."""
    argv = [*FASTLM_TOY, "--data", corpus, "--out", tmp_path / "out", *extra]
    status, summary, err = run_main(argv, capsys)
    assert status == 2 and summary is None
    assert err.count("\n") == 1 and err.startswith("fastlm-train: error: "), err
    assert message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--context-parallel", "0"], "--context-parallel must be at least 1, got 0"),
        (
            ["--context-parallel", "3"],
            "--context-length 16 must be divisible by 2 * --context-parallel = 6",
        ),
        (["--context-parallel", "2", "--model", "reference"], "runs fastlm's model"),
        (["--context-parallel", "2", "--pack-documents"], "does not take --pack-documents"),
        (["--context-parallel", "2", "--compile"], "does not run under --compile"),
        (["--context-parallel", "2"], "must divide the number of processes (1)"),
    ],
)
def test_train_bad_context_parallel_is_one_line(tmp_path, corpus, capsys, extra, message):
    assert_refused_in_one_line(tmp_path, corpus, capsys, extra, message)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--expert-parallel", "2"], "the model is dense (--num-experts 0)"),
        (
            ["--expert-parallel", "2", "--num-experts", "3"],
            "--num-experts 3 must be divisible by --expert-parallel 2",
        ),
        (
            ["--expert-parallel", "2", "--num-experts", "4"],
            "--expert-parallel 2 must divide the number of processes (1)",
        ),
        (
            ["--expert-parallel", "2", "--num-experts", "4", "--tensor-parallel", "2"],
            "--expert-parallel does not combine with --tensor-parallel yet",
        ),
    ],
)
def test_train_bad_expert_parallel_is_one_line(tmp_path, corpus, capsys, extra, message):
    """Checked with the arguments, before any process group (tests/test_expert_parallel.py
    trains with it)."""
    assert_refused_in_one_line(tmp_path, corpus, capsys, extra, message)
