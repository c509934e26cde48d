"""Tensor parallelism (`fastlm.tensor_parallel`) on the CPU: gloo groups spawned here (one spawn
per group size runs every check). The vocabulary-parallel loss against float64 autograd of the
whole-vocabulary reference (loss, x's and the weight shard's gradients), with ignored targets and
every option it takes, on the kernels (Triton's interpreter) and the PyTorch backend; the
collectives it runs (two all-reduces forward, one backward) and that no tensor as large as the
logits or the whole weight is ever made. Argument errors run in this process."""

from __future__ import annotations

import contextlib
import json
import textwrap
from collections import Counter
from dataclasses import dataclass

import pytest
import test_train
import torch
import torch.distributed as dist
from test_distributed import (
    FASTLM_TOY,
    _backend,
    _train,
    assert_refused_in_one_line,
    assert_resumes_back,
    keep_every_checkpoint,
    spawn,
)
from test_train import TOY, run_main, torchrun_runs

from fastlm import checkpoint
from fastlm.cli.trainer import NextTokenLoss
from fastlm.kernels.cross_entropy_options import cross_entropy_options_ref
from fastlm.tensor_parallel import (
    ALL_GATHER,
    REDUCE_SCATTER,
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
    vocab_range,
)
from fastlm.testing import CollectiveCounter, LargestTensor, assert_close

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="needs gloo")

COLLECTIVES = ("all_reduce", ALL_GATHER, REDUCE_SCATTER)


@dataclass(frozen=True)
class LossCase:
    backend: str = "triton"
    tokens: int = 13
    features: int = 24
    vocab_shard: int = 19  # V = 19 * P: odd shards
    chunk: int = 5
    softcap: float = 0.0
    smoothing: float = 0.0
    z_loss: float = 0.0
    reduction: str = "mean"
    sequence_parallel: bool = False
    logits: bool = False  # vocab_parallel_cross_entropy on a shard's logits


LOSS_CASES = [
    LossCase(),
    LossCase(softcap=3.0, smoothing=0.1, z_loss=1e-3),
    LossCase(reduction="sum", sequence_parallel=True, tokens=7),
    LossCase(reduction="none", smoothing=0.2),
    LossCase(logits=True, softcap=2.0, z_loss=1e-2),
    LossCase(backend="torch", softcap=3.0, smoothing=0.1, z_loss=1e-3),
    LossCase(backend="torch", logits=True, reduction="sum", smoothing=0.1),
]


def _reference(case, x, weight, targets):
    """float64 autograd of the whole-vocabulary loss under a random upstream gradient:
    (loss, dx, dweight, dlogits, upstream)."""
    x64 = x.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    logits = x64 @ w64.T
    logits.retain_grad()
    rows, _ = cross_entropy_options_ref(
        logits,
        targets,
        -100,
        softcap=case.softcap,
        label_smoothing=case.smoothing,
        z_loss=case.z_loss,
    )
    if case.reduction == "none":
        loss = rows.view(targets.shape)
    else:
        loss = rows.sum()
        if case.reduction == "mean":
            loss = loss / (targets != -100).sum().clamp_min(1)
    upstream = torch.randn(loss.shape, dtype=torch.float64)
    (loss * upstream).sum().backward()
    return loss, x64.grad, w64.grad, logits.grad, upstream.float()


def _check_loss_case(case: LossCase, rank: int, world: int) -> None:
    vocab = case.vocab_shard * world
    x = torch.randn(case.tokens * (world if case.sequence_parallel else 1), case.features)
    weight = torch.randn(vocab, case.features) / case.features**0.5
    targets = torch.randint(0, vocab, (x.shape[0],))
    targets[::3] = -100  # ignored rows
    targets[1] = vocab - 1  # a target in the last shard
    loss_ref, dx_ref, dw_ref, dlogits_ref, upstream = _reference(case, x, weight, targets)
    start, end = vocab_range(vocab, rank, world)
    mine = slice(rank * case.tokens, (rank + 1) * case.tokens) if case.sequence_parallel else None
    options = dict(
        softcap=case.softcap,
        reduction=case.reduction,
        label_smoothing=case.smoothing,
        z_loss=case.z_loss,
    )
    with (
        _backend(case.backend),
        CollectiveCounter(COLLECTIVES) as counting,
        LargestTensor() as sizes,
    ):
        if case.logits:
            logits = (x @ weight[start:end].T).requires_grad_()
            loss = vocab_parallel_cross_entropy(logits, targets, **options)
            forward = dict(counting.calls)
            (loss * upstream).sum().backward()
            assert_close(logits.grad, dlogits_ref[:, start:end], torch.float32, f"{case} dlogits")
        else:
            x_in = (x[mine] if mine else x).clone().requires_grad_()
            shard = weight[start:end].clone().requires_grad_()
            loss = vocab_parallel_linear_cross_entropy(
                x_in,
                shard,
                targets[mine] if mine else targets,
                chunk_size=case.chunk,
                sequence_parallel=case.sequence_parallel,
                **options,
            )
            forward = dict(counting.calls)
            (loss * upstream).sum().backward()
            assert_close(x_in.grad, dx_ref[mine] if mine else dx_ref, torch.float32, f"{case} dx")
            assert_close(shard.grad, dw_ref[start:end], torch.float32, f"{case} dweight")
            # Never the logits (tokens x V) nor the whole weight: one chunk of the shard's.
            assert sizes.largest < min(x.shape[0] * vocab, vocab * case.features), sizes.largest
    assert_close(loss, loss_ref, torch.float32, f"{case} loss")
    backward = counting.calls - Counter(forward)
    gathered = 2 if case.sequence_parallel else 0  # x and targets
    assert forward == {"all_reduce": 2, **({ALL_GATHER: 2} if gathered else {})}, forward
    expected_backward = (
        {} if case.logits else {REDUCE_SCATTER: 1} if case.sequence_parallel else {"all_reduce": 1}
    )
    assert dict(backward) == expected_backward, (case, backward)


def _loss_worker(rank: int, world: int, seed: int) -> None:
    for index, case in enumerate(LOSS_CASES):
        torch.manual_seed(seed + index)  # the same whole problem on every rank
        _check_loss_case(case, rank, world)


def test_vocab_parallel_loss(tmp_path):
    spawn(2, tmp_path, _loss_worker, int(torch.randint(2**31, ())))


def test_vocab_parallel_errors(tmp_path):
    """Argument errors before any collective: a one-process gloo group."""
    store = tmp_path / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        x, w, t = torch.randn(4, 8), torch.randn(6, 8), torch.randint(0, 6, (4,))
        with pytest.raises(ValueError, match="weight must be this rank's"):
            vocab_parallel_linear_cross_entropy(x, torch.randn(6, 7), t)
        with pytest.raises(ValueError, match=r"targets must lie in \[0, 6\)"):
            vocab_parallel_linear_cross_entropy(x, w, torch.full((4,), 6))
        with pytest.raises(ValueError, match="return_accuracy"):
            vocab_parallel_linear_cross_entropy(x, w, t, return_accuracy=True)
        with pytest.raises(ValueError, match="chunk_size"):
            vocab_parallel_linear_cross_entropy(x, w, t, chunk_size=0)
        with pytest.raises(ValueError, match="reduction"):
            vocab_parallel_cross_entropy(torch.randn(4, 6), t, reduction="avg")
        with pytest.raises(TypeError, match="group must be"):
            vocab_parallel_cross_entropy(torch.randn(4, 6), t, group="tensor")
        with pytest.raises(ValueError, match="divisible by the tensor-parallel size 4"):
            vocab_range(10, 0, 4)
        # One rank: the whole vocabulary, the single-process loss.
        from fastlm.kernels.linear_cross_entropy import linear_cross_entropy_ref

        loss = vocab_parallel_linear_cross_entropy(x, w, t)
        assert_close(loss, linear_cross_entropy_ref(x.double(), w.double(), t), torch.float32)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# fastlm.Transformer under the plan: TP, TP x CP, FSDP x TP against one process
# --------------------------------------------------------------------------------------------

MODEL = dict(
    vocab_size=62,
    context_length=24,
    d_model=64,
    num_layers=2,
    num_heads=4,
    d_ff=48,
    rope_theta=10000.0,
)


# The second layer a mixture of experts, whose balance and z-losses count in the gradients.
MOE = dict(
    num_experts=4,
    experts_per_token=2,
    moe_d_ff=24,
    num_shared_experts=1,
    first_dense_layers=1,
    router="sigmoid",
    aux_loss_coef=0.5,
    z_loss_coef=0.1,
)


@dataclass(frozen=True)
class ModelCase:
    tensor: int = 2
    context: int = 1
    fsdp: bool = False
    num_kv_heads: int | None = None
    tie_embeddings: bool = False
    count: bool = False  # check the collectives of one step
    packed: bool = False  # documents packed in the rows (cu_seqlens over the B x T tokens)
    # A dense layer, then a mixture of experts (sigmoid router, shared expert), on fastlm's
    # PyTorch backend: the plan is what is tested here, the interpreted experts op (12 s more)
    # is test_moe_model's.
    moe: bool = False


MODEL_CASES = {
    2: [
        ModelCase(count=True),  # MHA
        ModelCase(num_kv_heads=2, tie_embeddings=True, packed=True),  # GQA, tied, packed
        ModelCase(moe=True),  # experts replicated on each rank's tokens, auxiliary losses
    ],
    4: [
        ModelCase(context=2, num_kv_heads=2),  # TP=2 x CP=2
        ModelCase(fsdp=True),  # FSDP=2 x TP=2
    ],
}


def _model(case: ModelCase, seed: int):
    from fastlm import Transformer

    torch.manual_seed(seed)
    moe = MOE if case.moe else {}
    return Transformer(
        **MODEL, num_kv_heads=case.num_kv_heads, tie_embeddings=case.tie_embeddings, **moe
    )


def _model_problem(case: ModelCase, world: int, seed: int):
    """A case's whole batch and its one-process truth, the same for every rank: (tokens,
    targets, packed, the loss, the reference's parameters with their gradients). Computed once
    in the test's process, before the ranks are forked (each rank computing it again cost as
    much as its own parallel step)."""
    data = world // (case.tensor * case.context)
    torch.manual_seed(seed + 1)
    B, T = 2 * data, 16
    tokens = torch.randint(0, MODEL["vocab_size"], (B, T))
    targets = torch.randint(0, MODEL["vocab_size"], (B, T))
    if not case.fsdp:  # FSDP averages the data ranks' means: the same count on each
        targets[:, ::5] = -100

    packed = {}
    if case.packed:  # documents crossing the rows, cut anywhere (not at shard bounds)
        packed = dict(cu_seqlens=torch.tensor([0, 5, 21, 27, B * T], dtype=torch.int32))
    reference = _model(case, seed)
    loss = NextTokenLoss(reference)(tokens, targets, **packed)  # with an MoE's auxiliary loss
    loss.backward()
    return (
        tokens,
        targets,
        packed,
        loss.detach(),
        dict(reference.named_parameters(remove_duplicate=False)),
    )


def _check_model_case(case: ModelCase, rank: int, world: int, seed: int, problem) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from fastlm.distributed import shard_sequence
    from fastlm.tensor_parallel import parallelize, reduce_gradients, shard_tensor

    data = world // (case.tensor * case.context)
    mesh = init_device_mesh(
        "cpu", (data, case.context, case.tensor), mesh_dim_names=("data", "context", "tensor")
    )
    tokens, targets, packed, expected, truth = problem
    B = tokens.shape[0]
    model = parallelize(_model(case, seed), mesh["tensor"])
    heads = model.tensor_heads
    d_rank, c_rank = mesh["data"].get_local_rank(), mesh["context"].get_local_rank()
    t_rank = mesh["tensor"].get_local_rank()
    rows = slice(d_rank * B // data, (d_rank + 1) * B // data)
    my_tokens, my_targets = tokens[rows], targets[rows]
    if case.context > 1:
        model.set_context_parallel(mesh["context"])
        my_tokens = shard_sequence(my_tokens, c_rank, case.context)
        my_targets = shard_sequence(my_targets, c_rank, case.context)
    step = NextTokenLoss(model)  # the trainer's: FSDP2 gathers the weights in its forward
    if case.fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh["data"])
        step = fully_shard(step, mesh=mesh["data"])
    with CollectiveCounter(COLLECTIVES) as counting:
        loss = step(my_tokens, my_targets, **packed)
        loss.backward()
        reduce_gradients(model)
    if case.count:
        layers = MODEL["num_layers"]
        # Per layer and step: an all-gather in and a reduce-scatter out of attention and of the
        # feed-forward, each transposed in the backward; the embedding's reduce-scatter; the
        # loss: tokens and targets gathered, 2 all-reduces, dx reduce-scattered; one all-reduce
        # of the norms' gradients.
        assert dict(counting.calls) == {
            ALL_GATHER: 4 * layers + 3,
            REDUCE_SCATTER: 4 * layers + 2,
            "all_reduce": 3,
        }, counting.calls
    # The mean over the data x context ranks of their losses (and gradients), as DDP or FSDP.
    data_context = [mesh["data"], mesh["context"]]
    total = loss.detach().clone()
    for dim in data_context:
        dist.all_reduce(total, group=dim.get_group())
    assert_close(total / (data * case.context), expected, torch.float32, f"{case} loss")
    for name, param in model.named_parameters(remove_duplicate=False):
        grad = param.grad.full_tensor() if case.fsdp else param.grad.clone()
        if not case.fsdp:  # FSDP averaged over the data ranks already
            for dim in data_context:
                dist.all_reduce(grad, group=dim.get_group())
            grad /= data * case.context
        want = shard_tensor(name, truth[name].grad, t_rank, case.tensor, heads)
        assert_close(grad, want, torch.float32, f"{case} grad {name}")


@contextlib.contextmanager
def _case_backend(case: ModelCase):
    """FASTLM_BACKEND=torch for an MoE case (`ModelCase.moe`), else the kernels as set."""
    if not case.moe:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FASTLM_BACKEND", "torch")
        yield


def _model_worker(rank: int, world: int, seed: int, problems: list) -> None:
    for case, problem in zip(MODEL_CASES[world], problems, strict=True):
        with _case_backend(case):
            _check_model_case(case, rank, world, seed, problem)


def _spawn_model_cases(world: int, tmp_path) -> None:
    seed = int(torch.randint(2**31, ()))
    problems = []
    for case in MODEL_CASES[world]:
        with _case_backend(case):
            problems.append(_model_problem(case, world, seed))
    spawn(world, tmp_path, _model_worker, seed, problems)


def test_model_tensor_parallel(tmp_path):
    _spawn_model_cases(2, tmp_path)


@pytest.mark.slow
def test_model_tensor_parallel_4(tmp_path):
    _spawn_model_cases(4, tmp_path)


# --------------------------------------------------------------------------------------------
# fastlm-train --tensor-parallel
# --------------------------------------------------------------------------------------------

corpus = test_train.corpus  # the fixture
TP_ARGS = ["--num-kv-heads", "2"]  # every head count divisible by 2 (the byte vocabulary: 256)


def test_train_under_tensor_parallelism(tmp_path, corpus, capsys, monkeypatch):
    """fastlm-train --tensor-parallel 2 under torchrun against one process, three runs in one
    launch (`torchrun_runs`: a launch costs more than these runs):

    - resume: the step-2 checkpoint of a one-process run resumes under --tensor-parallel 2
      (each layer over both ranks), and that run's step-4 checkpoint (whole tensors: weights
      and AdamW's moments gathered) back in one process: every loss is the uninterrupted
      single-process run's, to rounding, and the final weights match;
    - packed: --pack-documents, both tensor ranks reading the same rows and their documents'
      bounds (cu_seqlens over the whole B x T tokens, which attention sees gathered): every loss
      the single-process run's, to rounding (a document ends at each ". ", so that many windows
      hold several);
    - compiled: --compile (torch.compile of the DDP-wrapped model and loss, the plan's
      collectives traced inside its autograd Functions; aot_eager here, inductor's C++ build
      being minutes on this CPU): every loss the single-process eager run's;
    - moe: a mixture of experts (sigmoid router, so its selection bias moves each step; a shared
      expert) at the step-2 checkpoint of a one-process run resumes under --tensor-parallel 2
      (the experts replicated on each rank's tokens) for two steps: its losses, held-out loss
      and final checkpoint (whole tensors, biases included) are the one-process run's, to
      rounding."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")  # as torchrun's ranks run
    keep_every_checkpoint(monkeypatch, tmp_path)
    aot_eager = textwrap.dedent("""
        import sys, torch
        compile_ = torch.compile
        def aot_eager(model, **options):
            print("compiling with aot_eager", file=sys.stderr)
            return compile_(model, backend="aot_eager", **options)
        torch.compile = aot_eager
    """)
    monkeypatch.setattr(test_train, "RANK_SCRIPT", aot_eager + test_train.RANK_SCRIPT)
    fastlm_args = [*FASTLM_TOY[len(TOY) :], *TP_ARGS, "--tensor-parallel", "2"]
    packed = ["--pack-documents", "--document-separator", ". "]

    uninterrupted = _train(tmp_path, corpus, capsys, "single", *TP_ARGS, "--save-every", "2")
    singles = {}
    for name, extra in (("packed", packed), ("compiled", [])):
        argv = [*FASTLM_TOY, "--data", corpus, "--steps", 4, "--out", tmp_path / name, *TP_ARGS]
        status, singles[name], err = run_main([*argv, *extra], capsys)
        assert status == 0, err
    assert 0 < singles["packed"]["targets_ignored"] < singles["packed"]["targets"]  # mid-window
    moe = ["--preset", "tiny-moe", "--num-experts", "4", "--moe-d-ff", "24", "--router",
           "sigmoid", "--router-bias-rate", "0.01", "--num-shared-experts", "1"]  # fmt: skip
    argv = [*FASTLM_TOY, "--data", corpus, "--steps", 4, "--out", tmp_path / "moe", *TP_ARGS]
    status, singles["moe"], err = run_main([*argv, *moe, "--save-every", "2"], capsys)
    assert status == 0, err
    resume = ["--steps", "6", "--save-every", "2", "--resume"]
    runs = {
        "tp-packed": ([*fastlm_args, *packed], None),
        "tp-resume": ([*fastlm_args, *resume], (tmp_path / "single-2", tmp_path / "tp-resume")),
        "tp-compiled": ([*fastlm_args, "--compile"], None),
        "tp-moe": ([*fastlm_args, *moe, "--resume"], (tmp_path / "moe-2", tmp_path / "tp-moe")),
    }
    result, outputs = torchrun_runs(tmp_path, corpus, runs)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = {}
    for name, output in outputs.items():
        assert "tensor parallel 2" in output["stderr"], (name, output["stderr"][-3000:])
        summaries[name] = json.loads(output["stdout"].strip().splitlines()[-1])
        assert summaries[name]["world_size"] == 2, name
    assert "note:" not in outputs["tp-resume"]["stderr"]
    assert outputs["tp-compiled"]["stderr"].count("compiling with aot_eager") == 2  # each rank's

    # resume
    assert summaries["tp-resume"]["steps"] == 6
    parallel = checkpoint.load_state(tmp_path / "tp-resume")["train_losses"]
    saved = outputs["tp-resume"]["records"] / "checkpoint-4"
    assert_resumes_back(tmp_path, corpus, capsys, saved, parallel, uninterrupted, *TP_ARGS)

    # packed, compiled, moe
    summary = summaries["tp-packed"]
    assert summary["targets_ignored"] == singles["packed"]["targets_ignored"]
    for name in ("packed", "compiled", "moe"):
        parallel = checkpoint.load_state(tmp_path / f"tp-{name}")["train_losses"]
        expected = checkpoint.load_state(tmp_path / name)["train_losses"]
        assert len(parallel) == len(expected) == 4, name
        assert parallel == pytest.approx(expected, rel=1e-5), name
        val_loss = summaries[f"tp-{name}"]["val_loss"]
        assert val_loss == pytest.approx(singles[name]["val_loss"], rel=1e-5), name
    weights, expected = (checkpoint.load_weights(tmp_path / name) for name in ("tp-moe", "moe"))
    assert weights.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.allclose(weights[key], value, rtol=1e-4, atol=1e-6), key
    biases = [key for key in expected if key.endswith("router.selection_bias")]
    assert len(biases) == 2 and all(expected[key].abs().sum() > 0 for key in biases)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tensor-parallel", "0"], "--tensor-parallel must be at least 1, got 0"),
        (["--tensor-parallel", "3"], "16 tokens must be divisible by --tensor-parallel 3"),
        (["--tensor-parallel", "2", "--model", "reference"], "runs fastlm's model"),
        (
            ["--tensor-parallel", "2", *TP_ARGS],
            "--tensor-parallel 2 x --context-parallel 1 must divide the number of processes (1)",
        ),
    ],
)
def test_train_bad_tensor_parallel_is_one_line(tmp_path, corpus, capsys, extra, message):
    assert_refused_in_one_line(tmp_path, corpus, capsys, extra, message)


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(num_heads=6), "num_heads 6 is not divisible by the tensor-parallel size 4"),
        (dict(num_kv_heads=2), "num_kv_heads 2 is not divisible"),
        (dict(d_ff=42), "d_ff 42 is not divisible"),
        (dict(vocab_size=258), "vocab_size 258 is not divisible"),
    ],
)
def test_plan_refuses_what_does_not_divide(config, message):
    """The model's sizes each rank must hold an equal share of (fastlm-train checks them with
    the model's configuration, naming the flags)."""
    from fastlm.tensor_parallel import check_plan

    fits = dict(vocab_size=256, num_heads=8, num_kv_heads=None, d_ff=64)
    check_plan(fits, 4)
    with pytest.raises(ValueError, match=message):
        check_plan({**fits, **config}, 4)
    if "d_ff" in config:  # no dense layer: no d_ff to split (the experts are replicated)
        moe = {**fits, **config, "num_experts": 4}
        check_plan(moe, 4)
        with pytest.raises(ValueError, match=message):
            check_plan({**moe, "first_dense_layers": 1}, 4)


def _benchmark():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "tensor_parallel.py"
    spec = importlib.util.spec_from_file_location("tensor_parallel_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_simulates_the_models(capsys):
    """One process as rank 0 of a fake group: one step's collectives and their bytes, the
    parameters' bytes and one layer's saved activations equal `collective_model` and
    `memory_model` (exit status 0 only if every row does)."""
    argv = ["--simulate", "--tensor", "2", "--models", "llama3-8b", "--seq-len", "16"]
    assert _benchmark().main(argv) == 0
    assert "| llama3-8b | 2 | 11 | 10 | 3 |" in capsys.readouterr().out


def test_benchmark_without_cuda_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("measures on GPUs: benchmarks/tensor_parallel.py")
    assert _benchmark().main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out
