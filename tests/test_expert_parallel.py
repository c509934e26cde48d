"""Expert parallelism (`fastlm.expert_parallel`): a gloo group of 2 processes spawned once
(starting processes is what costs) runs every exchange check, each rank comparing its share with
the single-process `fastlm.moe_experts` on all the tokens and all the experts, which each rank
computes itself (same threads, same inputs). The layout checks and the cost model's arithmetic run
in this process.

Why exact: expert e receives the same rows in the same order as on one process (the ranks' tokens
in rank order, each rank's in token order), so every expert's GEMMs, and so the weights' and the
routing weights' gradients, are the same sums in the same order. The kernels (Triton's
interpreter) also round each row to x's dtype and sum each token's k rows in fp32 in choice
order, as the exchange does: output and dx are bitwise equal, in fp32 and bf16. The PyTorch
backend's `moe_experts_ref` adds a token's k rows in expert order (an index_add per expert)
while the exchange adds them in choice order, so there (fp32) output and dx are the same k terms
summed in another order: each element within 2 gamma_{k-1} sum_j |term_j| (each order's error
is at most gamma_{k-1} = (k-1) u / (1 - (k-1) u) times the sum of the terms' magnitudes,
u = 2^-24), with the terms computed per choice.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import pytest
import test_train
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import TINY_MODEL
from test_distributed import FASTLM_TOY, _backend, spawn
from torch.autograd.graph import saved_tensors_hooks

from fastlm import Transformer, checkpoint
from fastlm.expert_parallel import (
    ExpertParallelPlan,
    check_expert_parallel,
    expert_parallel_experts,
    expert_parallel_mesh,
    expert_range,
    set_expert_parallel,
)
from fastlm.kernels.moe import moe_experts
from fastlm.testing import relative_error

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="needs gloo")

P, E, K, D, F = 2, 6, 3, 12, 10
TOKENS = (5, 4)  # per rank: ranks may hold different numbers of tokens
U = 2.0**-24


def _problem(seed: int, case: str, dtype: torch.dtype = torch.float32) -> dict:
    """Inputs for all ranks. "spread": distinct random experts per token, none picking expert 1
    (an expert with no token). "one rank": every token picks experts 0, 1, 2 in a random order,
    all on rank 0, so rank 1 receives no row (and rank 0 the worst case, T P min(k, E / P))."""
    g = torch.Generator().manual_seed(seed)
    T = sum(TOKENS)
    if case == "spread":
        allowed = torch.tensor([0, 2, 3, 4, 5])
        ids = torch.stack([allowed[torch.randperm(5, generator=g)[:K]] for _ in range(T)])
    else:
        ids = torch.stack([torch.randperm(K, generator=g) for _ in range(T)])
    return dict(
        x=torch.randn(T, D, generator=g).to(dtype),
        ids=ids,
        weights=torch.rand(T, K, generator=g),  # float32, as fastlm's router gives them
        gate_up=(torch.randn(E, 2 * F, D, generator=g) / D**0.5).to(dtype),
        down=(torch.randn(E, D, F, generator=g) / F**0.5).to(dtype),
        dout=torch.randn(T, D, generator=g).to(dtype),
    )


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _single_process(p: dict, terms: bool) -> dict:
    """Output and gradients; with `terms`, also sum_j |term_j| of out and of dx."""
    x, w, gate_up, down = _leaves(p["x"], p["weights"], p["gate_up"], p["down"])
    out = moe_experts(x, p["ids"], w, gate_up, down)
    out.backward(p["dout"])
    grads = dict(out=out.detach(), x=x.grad, weights=w.grad, gate_up=gate_up.grad, down=down.grad)
    if not terms:
        return grads
    terms, dx_terms = [], []
    for j in range(K):
        xj, wj = _leaves(p["x"], p["weights"][:, j : j + 1])
        yj = moe_experts(xj, p["ids"][:, j : j + 1], wj, p["gate_up"], p["down"])
        (dxj,) = torch.autograd.grad(yj, xj, p["dout"])
        terms.append(yj.detach().abs())
        dx_terms.append(dxj.abs())
    return dict(grads, out_terms=sum(terms), x_terms=sum(dx_terms))


def _check(name, got, want, terms=None):
    if terms is None:
        assert torch.equal(got, want), f"{name}: max difference {(got - want).abs().max():.2e}"
        return
    gamma = (K - 1) * U / (1 - (K - 1) * U)
    excess = (got - want).abs() - 2 * gamma * terms
    assert excess.max() <= 0, f"{name}: {excess.max():.2e} beyond the reordering bound"


class _Traffic:
    """Bytes that all_to_all_single moves to other ranks, and the rows of (T, D) or wider."""

    def __init__(self, rank: int):
        self.rank, self.bytes, self.rows_out, self.rows_in = rank, 0, 0, 0
        self.call = dist.all_to_all_single

    def __enter__(self):
        def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
            row = input[0].nbytes if input.dim() > 0 and input.shape[0] else 0
            splits = input_split_sizes or [input.shape[0] // P] * P
            self.bytes += sum(n for r, n in enumerate(splits) if r != self.rank) * row
            return self.call(output, input, output_split_sizes, input_split_sizes, group=group)

        dist.all_to_all_single = counting
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self.call


def _exchange_check(rank, p: dict, backend: str, group):
    with _backend(backend):
        exact = backend == "triton"
        ref = _single_process(p, terms=not exact)
        lo_t = sum(TOKENS[:rank])
        tokens = slice(lo_t, lo_t + TOKENS[rank])
        lo, hi = expert_range(E, rank, P)
        x, w = _leaves(p["x"][tokens], p["weights"][tokens])
        gate_up, down = _leaves(p["gate_up"][lo:hi], p["down"][lo:hi])
        saved = []
        params = {gate_up.untyped_storage().data_ptr(), down.untyped_storage().data_ptr()}
        with _Traffic(rank) as traffic:
            with saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                out = expert_parallel_experts(x, p["ids"][tokens], w, gate_up, down, E, group)
            out.backward(p["dout"][tokens])
    _check("out", out, ref["out"][tokens], None if exact else ref["out_terms"][tokens])
    _check("dx", x.grad, ref["x"][tokens], None if exact else ref["x_terms"][tokens])
    _check("d expert_weights", w.grad, ref["weights"][tokens])
    _check("d gate_up", gate_up.grad, ref["gate_up"][lo:hi])
    _check("d down", down.grad, ref["down"][lo:hi])

    # The cost model: traffic and what the kernels' path keeps for the backward.
    mine = (p["ids"] // (E // P)) == rank  # rows this rank's experts take
    rows_in = int(mine.sum()) - int(mine[tokens].sum())
    rows_out = int((~mine[tokens]).sum())
    plan = ExpertParallelPlan(TOKENS[rank], D, F, E, K, P, x.element_size(), weight_size=4)
    assert traffic.bytes == plan.step_bytes(rows_out, rows_in), (backend, rank)
    if exact:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
        kept = sum(n for ptr, n in storages.items() if ptr not in params)
        assert kept == plan.activation_bytes(int(mine.sum())), rank


# A fastlm.Transformer whose second layer is a mixture of 4 experts (k 2, a shared expert).
MOE_MODEL = dict(
    TINY_MODEL, num_experts=4, experts_per_token=2, moe_d_ff=24, num_shared_experts=1,
    first_dense_layers=1
)  # fmt: skip
EXPERTS = ("experts.gate_up", "experts.down")


def _model_problem(seed: int):
    """The model, a batch of 2 sequences (one per rank) and the single-process loss and
    gradients (PyTorch backend: the whole model through the interpreter would take minutes)."""
    torch.manual_seed(seed)
    model = Transformer(**MOE_MODEL)
    tokens = torch.randint(0, MOE_MODEL["vocab_size"], (P, MOE_MODEL["context_length"] + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with _backend("torch"):
        loss = model.loss(inputs, targets)
        grads = torch.autograd.grad(loss, list(model.parameters()))
    names = [name for name, _ in model.named_parameters()]
    return model, inputs, targets, dict(loss=loss.detach(), **dict(zip(names, grads)))


def _model_check(rank, model, inputs, targets, expected):
    """Each rank trains on its sequence with its half of the experts: the loss and the other
    parameters' gradients averaged over the ranks (as DDP does), and each expert's gradient
    divided by P (it already sums both ranks' tokens: `set_expert_parallel`), equal one
    process's within 1e-5 (fp32 sums over all tokens in other orders, as tests/test_distributed.py's
    model check)."""
    with _backend("torch"):
        assert set_expert_parallel(model, dist.group.WORLD) == 1
        loss = model.loss(inputs[rank : rank + 1], targets[rank : rank + 1])
        names, params = zip(*model.named_parameters())
        got = dict(loss=loss.detach(), **dict(zip(names, torch.autograd.grad(loss, params))))
    lo, hi = expert_range(MOE_MODEL["num_experts"], rank, P)
    assert set(got) == set(expected)
    for name, value in got.items():
        ref = expected[name]
        if name.endswith(EXPERTS):
            assert value.shape[0] == hi - lo
            ref = ref[lo:hi]
        else:
            dist.all_reduce(value)
        error = relative_error(value / P, ref)
        assert error <= 1e-5, f"rank {rank}: {name}: relative error {error:.2e}"


def _worker(rank, world_size, problems, model_problem):
    mesh = expert_parallel_mesh(P, E)
    for n, (backend, problem) in enumerate(problems):
        _exchange_check(rank, problem, backend, mesh if n % 2 else None)
    _model_check(rank, *model_problem)


def test_matches_single_process(tmp_path, fresh_seed):
    """On each of 2 ranks (3 and 6 experts, k = 3, 5 and 4 tokens; fp32, and bf16 on the
    kernels): output and the gradients of
    x, the routing weights and the rank's experts equal one process's (exact, or the PyTorch
    backend's reordering bound for out and dx), with an expert that gets no token and a rank
    that receives no row; bytes sent and saved are the cost model's; and a fastlm.Transformer
    with a mixture-of-experts layer, its experts spread over the ranks, trains as one process."""
    problems = [
        (backend, _problem(fresh_seed + n, case))
        for n, case in enumerate(("spread", "one rank"))
        for backend in ("torch", "triton")
    ]
    # bf16 tokens and experts, float32 routing weights: the rank without rows exchanges bf16 too.
    problems.append(("triton", _problem(fresh_seed + 2, "one rank", torch.bfloat16)))
    spawn(P, tmp_path, _worker, problems, _model_problem(fresh_seed))


# --------------------------------------------------------------------------------------------
# In this process
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        ((6, 4, 8), "num_experts 6 must be divisible by expert_parallel 4"),
        ((8, 4, 6), "expert_parallel 4 must divide the number of processes \\(6\\)"),
        ((8, 4, 8, ("data", "context")), "needs an 'expert' mesh dimension"),
        ((8, 0, 8), "expert_parallel must be at least 1"),
    ],
)
def test_bad_layout_is_one_value_error(args, message):
    with pytest.raises(ValueError, match=message):
        check_expert_parallel(*args)


def test_layout_and_one_process():
    assert check_expert_parallel(8, 4, 8, ("data", "expert")) == 2
    assert [expert_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="gate_up_local must hold E / P = 8 / 1 = 8 experts"):
        expert_parallel_experts(
            *(torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.long)),
            torch.ones(2, 1),
            torch.zeros(4, 6, 4),
            torch.zeros(4, 4, 3),
            8,
        )
    # Without torch.distributed: the single-process op itself.
    x, ids, w = torch.randn(3, 4), torch.tensor([[1, 0], [2, 1], [0, 2]]), torch.rand(3, 2)
    gate_up, down = torch.randn(3, 6, 4), torch.randn(3, 4, 3)
    out = expert_parallel_experts(x, ids, w, gate_up, down, 3)
    assert torch.equal(out, moe_experts(x, ids, w, gate_up, down))


def test_plan_arithmetic_by_hand():
    """T 4, D 3, F 5, E 4, k 2, P 2, bf16 rows and fp32 routing weights."""
    plan = ExpertParallelPlan(4, 3, 5, 4, 2, 2, element_size=2, weight_size=4, capacity_factor=1.5)
    assert plan.experts_per_rank == 2
    assert plan.row_bytes == 4 * 3 * 2 + 2 * 4 == 32  # x, y, dy, dx of 3 bf16 + w, dw
    # 3 rows out, 1 in: 4 x (2 D e + w) = 4 x 16, and 2 counts of 8 bytes to the other rank.
    assert plan.step_bytes(3, 1) == 64 + 16
    # Uniform: T k (P - 1) / P = 4 rows each way: 8 x 16 + 16.
    assert plan.expected_step_bytes == 144
    assert plan.expected_rows == 8  # T k
    assert plan.worst_rows == 4 * 2 * 2  # T P min(k, E / P)
    assert ExpertParallelPlan(4, 3, 5, 8, 2, 8).worst_rows == 4 * 8 * 1  # E / P = 1 < k
    # Capacity ceil(1.5 x 4 x 2 x 2 / 4) = 6 rows per expert, 2 experts: 12 of the 16 possible.
    assert plan.capacity_rows == 12
    # 2 experts of 3 D F = 45, the router 4 x 3 = 12: 102 parameters of 4 + 4 + 8 bytes.
    assert plan.expert_parameters == 102 and plan.state_bytes == 102 * 16
    shared = ExpertParallelPlan(4, 3, 5, 4, 2, 2, shared_experts=1, shared_d_ff=7)
    assert shared.expert_parameters == 102 + 63
    # 8 received rows: 8 x (3 x 2 + 4 + 4) + 4 x 3 for the op's sort, 2 x 8 x 8 for the routes.
    assert plan.activation_bytes(8) == 112 + 12 + 128
    with pytest.raises(ValueError, match="num_experts 4 must be divisible by expert_parallel 3"):
        ExpertParallelPlan(4, 3, 5, 4, 2, 3)


# --------------------------------------------------------------------------------------------
# fastlm-train --expert-parallel
# --------------------------------------------------------------------------------------------

MOE_TOY = [
    *FASTLM_TOY,
    *("--num-experts", "4", "--experts-per-token", "2", "--moe-d-ff", "32"),
    # The balancing bias (updated from the counts of all ranks) moves each step.
    *("--router", "sigmoid", "--router-bias-rate", "0.01"),
    *("--steps", "6", "--save-every", "2", "--grad-accum", "2"),  # DDP's no_sync: experts too
]
corpus = test_train.corpus  # the fixture

# fp32 rounding over a few steps: each expert's gradient sums the ranks' tokens in another order
# (a few units of 2^-24), AdamW's update then carries such differences on.
TRAIN_BOUND = 1e-5


def _train_runs(world_size: int) -> tuple:
    """The runs on the same `world_size` processes, one after the other: (--out, P, the saves
    rank 0 copies: {step: --out folders of later runs}); an --out starting "fsdp" runs --fsdp.
    A DDP run (P = 1) and then, on 4 processes: its step-2 checkpoint resumed at P = 2, that
    one's step-4 checkpoint at P = 4; on 2 processes: its step-2 checkpoint resumed with --fsdp
    --expert-parallel 2, that one's step-4 checkpoint with DDP at P = 2 and with --fsdp alone
    (P = 1). A "-4" folder is a step-4 checkpoint kept to compare."""
    if world_size == 4:
        return (
            ("ddp", 1, {2: ("p2",), 4: ("ddp-4",)}),
            ("p2", 2, {4: ("p4", "p2-4")}),
            ("p4", 4, {}),
        )
    return (
        ("ddp", 1, {2: ("fsdp-p2",), 4: ("ddp-4",)}),
        ("fsdp-p2", 2, {4: ("p2", "fsdp", "fsdp-p2-4")}),
        ("p2", 2, {}),
        ("fsdp", 1, {}),
    )


def _train_entry(rank, world_size, ports, folder, corpus):
    """Each of `_train_runs` through fastlm-train's main, as torchrun would start it, in a forked
    process (fastlm imported already: what a torchrun per run would spend seconds on)."""
    import shutil

    import fastlm.cli.train as train_cli
    import fastlm.cli.trainer as training
    from fastlm.expert_parallel import expert_modules

    torch.set_num_threads(1)
    save = training.Trainer.save
    folder = Path(folder)
    for (name, P, copies), port in zip(_train_runs(world_size), ports):

        def save_and_copy(trainer, copies=copies):
            note = save(trainer)
            for to in copies.get(trainer.step, ()) if rank == 0 else ():
                shutil.copytree(trainer.out, folder / to)  # before this run's final barrier
            layers = trainer.model.moe_layers()
            gate_up = layers[0].experts.gate_up
            held = gate_up.shape[0]  # (FSDP2's DTensor: the whole shape)
            spread = len(expert_modules(trainer.model))
            # FSDP2 shards the experts (DTensors), or leaves expert parallelism's alone
            sharded = f"{type(trainer.wrapped).__name__}/{type(gate_up).__name__}"
            biases = torch.cat([layer.router.selection_bias for layer in layers])
            bias = hashlib.sha256(biases.numpy().tobytes()).hexdigest()  # the same on every rank
            text = f"{held} {spread} {sharded} {bias}"
            (folder / f"held-{trainer.out.name}-{rank}").write_text(text)
            return note

        training.Trainer.save = save_and_copy
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        flags = ["--expert-parallel", str(P)] + (["--resume"] if name != "ddp" else [])
        flags += ["--fsdp"] if name.startswith("fsdp") else []
        argv = ["--data", corpus, *MOE_TOY, *flags, "--out", str(folder / name)]
        status = train_cli.main(argv)
        assert status == 0, f"rank {rank}, run {name}: exit status {status}"


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.mark.parametrize("world_size", [2, 4])
def test_train_expert_parallel_matches_ddp_and_resumes_across_p(
    tmp_path, corpus, monkeypatch, capsys, world_size
):
    """fastlm-train on `world_size` gloo ranks (`_train_runs`): a DDP run (P = 1); on 4 ranks
    its step-2 checkpoint resumed with --expert-parallel 2 (1 -> 2: each rank slices its 2 of
    the 4 experts and their AdamW moments; two ranks hold each expert, their gradients averaged
    by `reduce_expert_gradients`) and that one's step-4 checkpoint at P = 4; on 2 ranks its
    step-2 checkpoint resumed under FSDP2 with --expert-parallel 2 (the experts outside FSDP2)
    and that one's step-4 checkpoint under DDP at P = 2 and under FSDP2 alone (the experts
    sharded with the rest). The losses are the DDP run's to fp32 rounding (each expert's
    gradient summed in another order), the P = 2 step-4 checkpoint holds the whole (E, ...)
    tensors (the DDP run's keys, shapes and values), and so does each later run's; the sigmoid
    routers' balancing bias is the same on every rank. One process training this model has
    gradient norms of 1.3 to 1.7, above --grad-clip 1: every step clips, by the norm over all
    experts. On 2 ranks the FSDP2 + EP step-4 checkpoint and the DDP one also resume in one
    process (another data split: another curve) to the same step-5 loss."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")  # the interpreted kernels: the tests above
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    runs = _train_runs(world_size)
    args = (world_size, _free_ports(len(runs)), str(tmp_path), str(corpus))
    mp.start_processes(_train_entry, args, nprocs=world_size, join=True, start_method="fork")

    def expected(name: str, P: int) -> str:
        """E / P experts in each of the 2 layers (P = 1 leaves the layers alone); the wrapper,
        and the experts' class: FSDP2's DTensor shards without EP only."""
        fsdp = name.startswith("fsdp")
        wrapper = "FSDPNextTokenLoss" if fsdp else "DistributedDataParallel"
        experts = "DTensor" if fsdp and P == 1 else "Parameter"
        return f"{4 // P} {2 if P > 1 else 0} {wrapper}/{experts}"

    held = {p.name: p.read_text().rsplit(" ", 1) for p in tmp_path.glob("held-*")}
    assert {name: counts for name, (counts, _) in held.items()} == {
        f"held-{name}-{r}": expected(name, P) for name, P, _ in runs for r in range(world_size)
    }
    for name, _, _ in runs:  # the balancing bias: each rank's the same
        assert len({held[f"held-{name}-{r}"][1] for r in range(world_size)}) == 1, name
    names = [name for name, _, _ in runs]
    losses = {name: checkpoint.load_state(tmp_path / name)["train_losses"] for name in names}
    ddp = losses["ddp"]
    assert len(ddp) == 6
    for name, _, copies in runs:  # the histories resumed
        for later in (n for n in copies.get(4, ()) if n in losses):
            assert losses[later][:4] == losses[name][:4], (name, later)
    for name in names[1:]:
        assert losses[name][:2] == ddp[:2], name
        assert losses[name] == pytest.approx(ddp, rel=TRAIN_BOUND, abs=0), name
    checked = [(f"{names[1]}-4", "ddp-4"), *((name, "ddp") for name in names[1:])]
    for got, want in checked:
        for part in ("weights", "state"):
            a, b = (_checkpoint_tensors(tmp_path / n, part) for n in (got, want))
            assert a.keys() == b.keys() and a, (got, part)
            errors = {}
            for key in a:
                assert a[key].shape == b[key].shape, (got, key)
                errors[key] = relative_error(a[key], b[key])
            worst = max(errors, key=errors.get)
            assert errors[worst] <= TRAIN_BOUND, f"{got} {worst}: {errors[worst]:.2e}"
    biases = [v for k, v in checkpoint.load_weights(tmp_path / "ddp").items() if "bias" in k]
    assert len(biases) == 2 and all(b.abs().sum() > 0 for b in biases)  # it moved
    if world_size == 2:
        next_step = {}
        for name in ("fsdp-p2-4", "ddp-4"):
            argv = ["--data", corpus, *MOE_TOY, "--steps", "5", "--out", tmp_path / name]
            status, _, err = test_train.run_main([*argv, "--resume"], capsys)
            assert status == 0, err
            next_step[name] = checkpoint.load_state(tmp_path / name)["train_losses"]
        assert len(next_step["ddp-4"]) == 5
        assert next_step["fsdp-p2-4"] == pytest.approx(next_step["ddp-4"], rel=TRAIN_BOUND)


def _checkpoint_tensors(folder: Path, part: str) -> dict[str, torch.Tensor]:
    """A checkpoint's weights, or its AdamW moments keyed "parameter/entry"."""
    if part == "weights":
        return checkpoint.load_weights(folder)
    state = checkpoint.load_state(folder)["optimizer"]["state"]
    return {f"{k}/{e}": v for k, entries in state.items() for e, v in entries.items() if v.ndim}
