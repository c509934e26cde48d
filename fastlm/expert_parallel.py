"""Expert parallelism: the routed experts of a mixture-of-experts layer spread over the P ranks of
a `torch.distributed` group, tokens sent to their experts' ranks and back by `all_to_all_single`.

Layout. E experts over P ranks: rank r holds experts [r E / P, (r + 1) E / P) (`expert_range`),
its `gate_up` (E / P, 2F, D) and `down` (E / P, D, F). Every rank keeps its own T tokens and
their router choices, `expert_ids` and `expert_weights` (T, k).

One layer's forward (`expert_parallel_experts`):

1. Counts: each rank counts its (token, choice) rows per expert and sends each rank the E / P
   counts of that rank's experts (one `all_to_all_single` of E integers). Their per-rank sums
   are the split sizes of the exchanges below (host integers: one host sync per layer, which a
   variable-size all-to-all needs anyway).
2. Dispatch: the rows, sorted by expert (stably: token order within an expert), go to their
   experts' ranks, each x row with its choice's weight. The receiver rebuilds each row's local
   expert id from the counts, so ids are never sent.
3. Experts: `fastlm.moe_experts` on the received rows, one choice per row (k = 1):
   y_a = w_a down_e(act(gate_up_e x_a)).
4. Combine: the rows go back by the reverse exchange, return to (token, choice) order, and each
   token's k rows are summed in fp32 in choice order j = 0 .. k - 1 and rounded once to x's
   dtype: the fused op's own combine, in its order.

Backward: each exchange is an autograd.Function whose backward is the reverse exchange (the
dispatch's backward returns each row's dx and d weight and sums a token's k dx rows in fp32 in
choice order; the combine's backward sends each token's output gradient to its k rows' ranks).
The experts' gradients are the fused op's on the received rows. Every step is a gather by
index, a collective or a fixed-order sum: no atomics, deterministic.

Why one choice per row and not a token's choices grouped: the choices of one token that land on
one rank vary from 0 to min(k, E / P), while the fused op takes a fixed k per token; grouping
would pad (compute on zero weights) or need a ragged op. With k = 1 per row the combine runs on
the token's own rank in the single-process order, so the result is the single-process one. The
price: a token with c choices on one rank is sent c times (what DeepSeek-V3's node-limited
routing saves by sending a token once per node); `ExpertParallelPlan` counts it that way.

Why our own autograd.Function and not `torch.distributed._functional_collectives`'
`all_to_all_single_autograd`: that one is differentiable on gloo too (checked on torch 2.13),
but it is private API (an underscore module) and returns tensors that wait lazily; the split
sizes are host integers here either way, and the Function is a few lines whose backward is
exactly the reverse call, on any backend that has `all_to_all_single` (gloo, nccl).

Costs (bytes per rank and step, token imbalance, memory): `ExpertParallelPlan`, and
docs/distributed.md's "Expert parallelism".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastlm.distributed import mesh_group
from fastlm.kernels.moe.experts import _check_ids, moe_experts

__all__ = [
    "ExpertParallelExperts",
    "ExpertParallelPlan",
    "check_expert_parallel",
    "clip_grad_norm_",
    "expert_modules",
    "expert_parallel_experts",
    "expert_parallel_mesh",
    "expert_parameter_names",
    "expert_parameters",
    "expert_range",
    "full_expert_state",
    "reduce_expert_gradients",
    "set_expert_parallel",
    "shard_expert_optimizer_state",
]


# --------------------------------------------------------------------------------------------
# Layout and checks (pure: no process group needed)
# --------------------------------------------------------------------------------------------


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


def check_expert_parallel(
    num_experts: int,
    expert_parallel: int,
    world_size: int | None = None,
    mesh_dims: tuple[str, ...] | None = None,
    name=str,
) -> int:
    """Check an expert-parallel layout before any process group is made; experts per rank.

    Args:
        num_experts: E, the routed experts of each MoE layer.
        expert_parallel: P, the ranks the experts are spread over.
        world_size: the processes of the run (None: not checked); P must divide it.
        mesh_dims: the names of the DeviceMesh's dimensions the experts' group is taken from
            (None: not checked); with P > 1 one must be "expert".
        name: how the messages spell an argument's name (fastlm-train passes its flags').

    Returns:
        E / P.

    Raises:
        TypeError: a count that is not an int.
        ValueError: a count below 1, E not divisible by P, P not dividing the world size, or a
            mesh without an "expert" dimension; one line each.
    """
    E = _positive_int(name("num_experts"), num_experts)
    P = _positive_int(name("expert_parallel"), expert_parallel)
    if E % P:
        raise ValueError(
            f"{name('num_experts')} {E} must be divisible by {name('expert_parallel')} {P}: each "
            "rank holds E / P experts"
        )
    if world_size is not None and _positive_int("world_size", world_size) % P:
        raise ValueError(
            f"{name('expert_parallel')} {P} must divide the number of processes ({world_size})"
        )
    if mesh_dims is not None and P > 1 and "expert" not in mesh_dims:
        raise ValueError(
            f"expert parallelism over {P} ranks needs an 'expert' mesh dimension, got "
            f"dimensions {tuple(mesh_dims)}"
        )
    return E // P


def expert_range(num_experts: int, rank: int, expert_parallel: int) -> tuple[int, int]:
    """The experts [lo, hi) that rank `rank` of an expert-parallel group of P holds.

    Args:
        num_experts: E, divisible by expert_parallel.
        rank: the rank in the expert-parallel group, in [0, P).
        expert_parallel: P.

    Returns:
        (rank E / P, (rank + 1) E / P): slice a layer's full `gate_up` and `down` with it.

    Raises:
        TypeError, ValueError: as `check_expert_parallel`, or a rank outside [0, P).
    """
    local = check_expert_parallel(num_experts, expert_parallel)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < expert_parallel:
        raise ValueError(f"rank must be an int in [0, {expert_parallel}), got {rank!r}")
    return rank * local, (rank + 1) * local


def expert_parallel_mesh(expert_parallel: int, num_experts: int, device_type: str = "cpu"):
    """The (data, expert) DeviceMesh of the default group's ranks (every rank calls it).

    Args:
        expert_parallel: P, the ranks of each expert group; it must divide the world size.
        num_experts: E, divisible by P.
        device_type: "cuda" or "cpu".

    Returns:
        A 2-D DeviceMesh ("data", "expert") of world / P x P: rank = data_rank P + expert_rank,
        so an expert group is neighbouring ranks (one node's GPUs when it fits: the all-to-all
        stays on the fastest links). `mesh["expert"].get_group()` is the group for
        `expert_parallel_experts`.

    Raises:
        ValueError, TypeError: as `check_expert_parallel`, before the mesh's groups are made.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    check_expert_parallel(num_experts, expert_parallel, world, ("data", "expert"))
    return init_device_mesh(
        device_type, (world // expert_parallel, expert_parallel), mesh_dim_names=("data", "expert")
    )


# --------------------------------------------------------------------------------------------
# The exchange
# --------------------------------------------------------------------------------------------


def _all_to_all(rows: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
    """rows (sum(send), ...) cut by `send` to the group's ranks; returns the sum(receive) rows
    the ranks send here, by source rank."""
    out = rows.new_empty((sum(receive), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), receive, send, group=group)
    return out


def _sum_groups(rows: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    """rows (N size, ...) -> (N, ...): each group of `size` consecutive rows summed in fp32 in
    row order, rounded once to `dtype` (the fused op's combine, in its order)."""
    grouped = rows.view(-1, size, *rows.shape[1:])
    acc = grouped[:, 0].float()
    for j in range(1, size):
        acc = acc + grouped[:, j]
    return acc.to(dtype)


@dataclass(frozen=True)
class _Routes:
    """One layer's exchange on this rank: row i of the send buffer is assignment `order[i]`
    (a = t k + j), and assignment a is its row `inverse[a]`."""

    order: torch.Tensor  # (T k,) int64, the assignments sorted by expert
    inverse: torch.Tensor  # (T k,) int64, order's inverse permutation
    send: list[int]  # rows sent to each rank
    receive: list[int]  # rows received from each rank
    group: dist.ProcessGroup

    def save(self, ctx) -> None:
        """Keep the routes for a backward: the permutations saved as tensors (so that saved-tensor
        hooks see them), the rest as Python values."""
        ctx.save_for_backward(self.order, self.inverse)
        ctx.splits = self.send, self.receive, self.group

    @classmethod
    def saved(cls, ctx) -> _Routes:
        return cls(*ctx.saved_tensors, *ctx.splits)


def _send_out(source: torch.Tensor, size: int, routes: _Routes) -> torch.Tensor:
    """Each assignment's row of `source` ((T k / size, ...): row a // size) to its expert's rank:
    the received rows (R, ...)."""
    return _all_to_all(source[routes.order // size], routes.send, routes.receive, routes.group)


def _bring_back(rows: torch.Tensor, size: int, dtype: torch.dtype, routes: _Routes):
    """The reverse: the R rows back to the ranks they came from, in assignment order, each
    group of `size` assignments summed (fp32, in order) -> (T k / size, ...) in `dtype`."""
    back = _all_to_all(rows, routes.receive, routes.send, routes.group)
    return _sum_groups(back[routes.inverse], size, dtype)


class _Dispatch(torch.autograd.Function):
    """source (T k / size, ...) -> the received rows; backward: the rows' gradients brought
    back and summed per source row (a token's k dx rows)."""

    @staticmethod
    def forward(ctx, source, size, routes):
        routes.save(ctx)
        ctx.size, ctx.dtype = size, source.dtype
        return _send_out(source, size, routes)

    @staticmethod
    def backward(ctx, grad):
        return _bring_back(grad, ctx.size, ctx.dtype, _Routes.saved(ctx)), None, None


class _Combine(torch.autograd.Function):
    """The experts' rows (R, D) -> each token's sum of its k rows (T, D); backward: each token's
    gradient sent to its k rows."""

    @staticmethod
    def forward(ctx, rows, size, routes):
        routes.save(ctx)
        ctx.size = size
        return _bring_back(rows, size, rows.dtype, routes)

    @staticmethod
    def backward(ctx, grad):
        return _send_out(grad, ctx.size, _Routes.saved(ctx)), None, None


def _routes(expert_ids: torch.Tensor, num_experts: int, group) -> tuple[_Routes, torch.Tensor]:
    """The exchange's routes and the received rows' local expert ids (R,)."""
    P = dist.get_world_size(group)
    local = num_experts // P
    flat = expert_ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    inverse = torch.empty_like(order).scatter_(
        0, order, torch.arange(order.numel(), device=order.device)
    )
    counts = torch.bincount(flat, minlength=num_experts).to(torch.int64)
    received = torch.empty_like(counts)  # (source rank, local expert)
    dist.all_to_all_single(received, counts, group=group)
    send = counts.view(P, local).sum(1).tolist()
    receive = received.view(P, local).sum(1).tolist()
    local_ids = torch.arange(local, device=flat.device).repeat(P).repeat_interleave(received)
    return _Routes(order, inverse, send, receive, group), local_ids


def _no_rows(rows, weights, gate_up_local, down_local) -> torch.Tensor:
    """The experts' output (0, D) of a rank that receives no row, tied to the rows, their weights
    and the experts: the backward then reaches the dispatches' reverse exchanges on this rank
    too (every rank must make each collective call), and the experts' gradients are zeros."""
    tie = (gate_up_local.sum() + down_local.sum()) * 0 + weights[:, None] * 0
    return rows + tie.to(rows.dtype)  # in the rows' dtype: every rank exchanges the same


@torch.compiler.disable
def expert_parallel_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    gate_up_local: torch.Tensor,
    down_local: torch.Tensor,
    num_experts: int,
    group=None,
    **options,
) -> torch.Tensor:
    """`fastlm.moe_experts` with the experts spread over an expert-parallel group.

    out[t] = sum_j w[t, j] down_e(act(gate_up_e x[t])), e = ids[t, j], wherever expert e lives:
    this rank's rows go to their experts' ranks and back (the module docstring). Every rank of
    the group calls it for the same layer, with its own tokens (T may differ between ranks).
    Gradients flow to x, expert_weights and this rank's experts, equal to one process's on all
    the tokens with all the experts (the same sums in the same order; `expert_ids` has none).

    Args:
        x: (T, D), this rank's tokens.
        expert_ids: (T, k) integer tensor, the router's choices among all E experts.
        expert_weights: (T, k) float, each choice's weight.
        gate_up_local: (E / P, 2F, D), this rank's experts `expert_range(E, rank, P)`.
        down_local: (E / P, D, F).
        num_experts: E, the layer's experts over all ranks.
        group: a ProcessGroup, a DeviceMesh (1-D, or with an "expert" dimension) or None (the
            default group; one process when torch.distributed is not initialised).
        **options: `fastlm.moe_experts`' keyword options (activation, alpha, limit, up_offset,
            transposed, interleaved, the biases of the local experts).

    Returns:
        (T, D) in x's dtype.

    Raises:
        TypeError, ValueError: as `fastlm.moe_experts` for the local experts; E not divisible
            by P, or gate_up_local / down_local not holding E / P experts; a DeviceMesh without
            an "expert" dimension.
    """
    group = mesh_group(group, "expert")
    P = 1 if group is None else dist.get_world_size(group)
    local = check_expert_parallel(num_experts, P)
    for name, weights in (("gate_up_local", gate_up_local), ("down_local", down_local)):
        if not isinstance(weights, torch.Tensor) or weights.dim() != 3 or weights.shape[0] != local:
            shape = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights)
            raise ValueError(
                f"{name} must hold E / P = {num_experts} / {P} = {local} experts (first dim), "
                f"got {shape}"
            )
    if P == 1:
        return moe_experts(x, expert_ids, expert_weights, gate_up_local, down_local, **options)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be (T, D), got {getattr(x, 'shape', type(x))}")
    _check_ids(expert_ids, x, num_experts)
    if not isinstance(expert_weights, torch.Tensor) or expert_weights.shape != expert_ids.shape:
        raise ValueError(
            f"expert_weights must have expert_ids' shape {tuple(expert_ids.shape)}, got "
            f"{getattr(expert_weights, 'shape', type(expert_weights))}"
        )
    k = expert_ids.shape[1]
    routes, local_ids = _routes(expert_ids, num_experts, group)
    rows = _Dispatch.apply(x, k, routes)
    weights = _Dispatch.apply(expert_weights.reshape(-1), 1, routes)
    if rows.shape[0]:
        y = moe_experts(
            rows, local_ids[:, None], weights[:, None], gate_up_local, down_local, **options
        )
    else:
        y = _no_rows(rows, weights, gate_up_local, down_local)
    return _Combine.apply(y, k, routes)


class ExpertParallelExperts(torch.nn.Module):
    """A layer's stacked experts holding this rank's E / P of them and running
    `expert_parallel_experts`: a drop-in for a module with parameters `gate_up` (E, 2F, D) and
    `down` (E, D, F), `num_experts` and forward(x, expert_ids, expert_weights) (fastlm's MoE
    layers' `experts`). Its parameters keep the names, with E / P experts.

    Args:
        gate_up: (E / P, 2F, D), this rank's experts `expert_range(E, rank, P)`.
        down: (E / P, D, F).
        num_experts: E.
        group: the expert-parallel ProcessGroup.
    """

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, num_experts: int, group):
        super().__init__()
        self.gate_up = torch.nn.Parameter(gate_up)
        self.down = torch.nn.Parameter(down)
        self.num_experts = num_experts
        self.group = group

    @classmethod
    def of(cls, experts: torch.nn.Module, group: dist.ProcessGroup) -> ExpertParallelExperts:
        """This rank's share of `experts` (a copy of its slice of `gate_up` and `down`)."""
        P, rank = dist.get_world_size(group), dist.get_rank(group)
        lo, hi = expert_range(experts.num_experts, rank, P)
        take = [w.detach()[lo:hi].clone() for w in (experts.gate_up, experts.down)]
        return cls(*take, experts.num_experts, group)

    def forward(self, x, expert_ids, expert_weights) -> torch.Tensor:
        """As the module it replaces: the weights cast to x's dtype (under autocast), then
        `expert_parallel_experts` over the group."""
        gate_up, down = self.gate_up, self.down
        if gate_up.dtype != x.dtype:
            gate_up, down = gate_up.to(x.dtype), down.to(x.dtype)
        return expert_parallel_experts(
            x, expert_ids, expert_weights, gate_up, down, self.num_experts, self.group
        )


def set_expert_parallel(model: torch.nn.Module, group) -> int:
    """Spread the experts of every MoE layer of `model` over an expert-parallel group: each
    layer's `experts` (a module with `gate_up`, `down` and `num_experts`, under a module with
    `run_experts`) becomes this rank's `ExpertParallelExperts`. Every rank calls it with the same
    model (the same full weights); a group of one rank changes nothing.

    Training: each rank's experts' gradient then sums the P ranks' tokens, so where the other
    parameters' gradients are averaged over all W ranks, the experts' are averaged over the
    ranks that hold the same experts (W / P) and divided by P as well.

    Args:
        model: e.g. a `fastlm.Transformer` with MoE layers.
        group: a ProcessGroup, a DeviceMesh (1-D, or with an "expert" dimension) or None (the
            default group).

    Returns:
        The number of layers changed.

    Raises:
        ValueError: a layer's E not divisible by the group's size; a mesh without an "expert"
            dimension.
    """
    group = mesh_group(group, "expert")
    if group is None or dist.get_world_size(group) == 1:
        return 0
    layers = [m for m in model.modules() if hasattr(m, "run_experts") and hasattr(m, "experts")]
    for layer in layers:
        layer.experts = ExpertParallelExperts.of(layer.experts, group)
    return len(layers)


# --------------------------------------------------------------------------------------------
# Training: gradients, clipping and checkpoints of an expert-parallel model
# --------------------------------------------------------------------------------------------

EXPERT_WEIGHTS = ("gate_up", "down")


def expert_modules(root: torch.nn.Module) -> list[tuple[str, ExpertParallelExperts]]:
    """(name relative to `root`, module) of each `ExpertParallelExperts` under `root`; empty
    for a model `set_expert_parallel` left alone."""
    return [(n, m) for n, m in root.named_modules() if isinstance(m, ExpertParallelExperts)]


def expert_parameter_names(root: torch.nn.Module) -> list[str]:
    """The names (relative to `root`) of this rank's expert parameters: the ones a
    data-parallel wrapper must leave to `reduce_expert_gradients`."""
    return [f"{name}.{w}" for name, _ in expert_modules(root) for w in EXPERT_WEIGHTS]


def expert_parameters(root: torch.nn.Module) -> list[torch.nn.Parameter]:
    """This rank's expert parameters (`expert_parameter_names`' parameters), for FSDP2's
    `ignored_params`."""
    return [getattr(m, w) for _, m in expert_modules(root) for w in EXPERT_WEIGHTS]


@torch.no_grad()
def reduce_expert_gradients(root: torch.nn.Module, replicas, world_size: int) -> None:
    """The experts' part of a data-parallel gradient average, in place.

    Every other parameter's gradient is averaged over the W = `world_size` ranks by DDP:
    (1 / W) sum_r grad L_r. An expert's gradient on its rank already sums the P ranks of its
    expert group (their tokens came to it), so the same average is the sum over the W / P
    ranks that hold the same experts (`replicas`), divided by W.

    Args:
        root: the model (or a module holding it).
        replicas: the ProcessGroup of the ranks holding this rank's experts (None: only this
            one, W = P).
        world_size: W, the ranks DDP averages the other gradients over.
    """
    for _, module in expert_modules(root):
        for w in EXPERT_WEIGHTS:
            grad = getattr(module, w).grad
            if grad is None:
                continue
            if replicas is not None and dist.get_world_size(replicas) > 1:
                dist.all_reduce(grad, group=replicas)
            grad.div_(world_size)


@torch.no_grad()
def clip_grad_norm_(root: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Scale every gradient by max_norm / (norm + 1e-6) where the global norm is above max_norm
    (`fastlm.reference.gradient_clip`'s rule), the norm counting each gradient element once: all
    E experts of each layer (their squares summed over the expert group, once whatever the
    replicas), an FSDP2-sharded gradient's shards (DTensors: their squares summed over their
    mesh) and every other (replicated, as under DDP) gradient as it is. Call after
    `reduce_expert_gradients` (and DDP's average or FSDP2's reduce-scatter).

    Returns:
        The norm before clipping, fp32.
    """
    # The group each gradient's squares are summed over: an expert's its expert group (which
    # holds all E), an FSDP2 DTensor's its mesh's (a 1-D mesh: the data ranks), None for a
    # gradient every rank holds whole (DDP's, or one process's).
    experts = {id(getattr(m, w)): m.group for _, m in expert_modules(root) for w in EXPERT_WEIGHTS}
    grads, squares = [], {}  # id(group) -> [group, sum of squares]
    for param in root.parameters():
        grad, group = param.grad, experts.get(id(param))
        if grad is None:
            continue
        if hasattr(grad, "to_local"):
            group, grad = grad.device_mesh.get_group(), grad.to_local()
        entry = squares.setdefault(id(group), [group, 0.0])
        entry[1] = entry[1] + grad.float().square().sum()
        grads.append(grad)
    if not grads:  # as on every rank of the group: the same model, the same backward
        return torch.zeros(())
    norm = torch.zeros((), device=grads[0].device)
    for group, total in squares.values():  # in first-seen order: the same on every rank
        if group is not None:
            dist.all_reduce(total, group=group)
        norm = norm + total
    norm = norm.sqrt()
    scale = torch.where(norm > max_norm, max_norm / (norm + 1e-6), 1.0)
    for grad in grads:
        grad.mul_(scale.to(grad.dtype))
    return norm


def _gather_experts(local: torch.Tensor, group) -> torch.Tensor:
    """The expert group's shares (E / P, ...) of a tensor, in rank order: (E, ...) on the CPU."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    return torch.cat(parts).cpu()


def full_expert_state(
    root: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: dict, state: dict, prefix=""
) -> None:
    """Put the whole (E, ...) expert weights and their optimizer state into a checkpoint's
    `weights` (keys relative to `root`) and optimizer `state` ({"state": {prefix + key:
    {entry: tensor}}}), in place, so that it holds a one-process model's layout. A collective
    of the expert groups: every rank calls it (a rank whose dicts are empty gets them filled).
    """
    for name, module in expert_modules(root):
        for w in EXPERT_WEIGHTS:
            param, key = getattr(module, w), f"{name}.{w}"
            weights[key] = _gather_experts(param, module.group)
            entries = state.setdefault("state", {}).setdefault(prefix + key, {})
            for entry, value in optimizer.state[param].items():
                if isinstance(value, torch.Tensor) and value.ndim > 0:  # not AdamW's step
                    entries[entry] = _gather_experts(value, module.group)


def shard_expert_optimizer_state(root: torch.nn.Module, state: dict, prefix="") -> dict:
    """A one-process optimizer state dict ({"state": {prefix + key: {entry: tensor}}}) with each
    expert entry cut to this rank's experts (`expert_range`), to load into the optimizer of a
    model `set_expert_parallel` spread; the rest is left as it is."""
    out = {**state, "state": {k: dict(v) for k, v in state["state"].items()}}
    for name, module in expert_modules(root):
        P, rank = dist.get_world_size(module.group), dist.get_rank(module.group)
        lo, hi = expert_range(module.num_experts, rank, P)
        for w in EXPERT_WEIGHTS:
            entries = out["state"].get(f"{prefix}{name}.{w}", {})
            for entry, value in entries.items():
                if isinstance(value, torch.Tensor) and value.ndim > 0:
                    entries[entry] = value[lo:hi].clone()
    return out


# --------------------------------------------------------------------------------------------
# Cost model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertParallelPlan:
    """What one MoE layer costs each rank of an expert-parallel group: docs/distributed.md.

    Args:
        tokens: T, the tokens each rank holds (batch x sequence shard).
        d_model: D.
        d_ff: F, one routed expert's hidden size.
        num_experts: E, the routed experts.
        top_k: k, the choices per token (distinct experts, as a top-k router picks them).
        expert_parallel: P.
        element_size: bytes of an activation element (x, the experts' rows): 2 for bf16.
        weight_size: bytes of a routing weight as exchanged (default None: element_size).
        param_size: bytes of a parameter as kept (4: fp32 weights under bf16 autocast, as
            fastlm-train keeps them); its gradient the same.
        optimizer_size: bytes of optimizer state per parameter (8: Adam's two fp32 moments).
        shared_experts: experts every token runs through on its own rank (no exchange).
        shared_d_ff: their hidden size (default None: d_ff).
        capacity_factor: None (dropless, as `expert_parallel_experts`), or the c of a capacity
            of ceil(c T k P / E) rows per expert, which caps what a rank receives.

    Traffic counts rows that leave the rank (a rank's rows for its own experts are copied, not
    sent) and one send per (token, choice): a token with c choices on one rank is sent c times.
    """

    tokens: int
    d_model: int
    d_ff: int
    num_experts: int
    top_k: int
    expert_parallel: int
    element_size: int = 2
    weight_size: int | None = None
    param_size: int = 4
    optimizer_size: int = 8
    shared_experts: int = 0
    shared_d_ff: int | None = None
    capacity_factor: float | None = None

    def __post_init__(self):
        check_expert_parallel(self.num_experts, self.expert_parallel)
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be at most num_experts {self.num_experts}")

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.expert_parallel

    @property
    def row_bytes(self) -> int:
        """Bytes one (token, choice) row moves in a step: x and its weight out, y back (forward);
        y's gradient out, dx and the weight's gradient back (backward): 4 D e + 2 w."""
        w = self.element_size if self.weight_size is None else self.weight_size
        return 4 * self.d_model * self.element_size + 2 * w

    # Token imbalance: the rows a rank's experts receive (its own included)

    @property
    def expected_rows(self) -> float:
        """Uniform routing: each of the T k P rows lands on a rank with probability 1 / P."""
        return float(self.tokens * self.top_k)

    @property
    def worst_rows(self) -> int:
        """Every token of every rank sends this rank all the choices its E / P experts can
        take: T P min(k, E / P) (T k P when k <= E / P)."""
        return self.tokens * self.expert_parallel * min(self.top_k, self.experts_per_rank)

    @property
    def capacity_rows(self) -> int | None:
        """The cap under capacity_factor c: E / P experts of ceil(c T k P / E) rows each."""
        if self.capacity_factor is None:
            return None
        P, E = self.expert_parallel, self.num_experts
        per_expert = math.ceil(self.capacity_factor * self.tokens * self.top_k * P / E)
        return min(self.worst_rows, self.experts_per_rank * per_expert)

    # Traffic

    def step_bytes(self, rows_out: float, rows_in: float) -> float:
        """Bytes this rank sends in one layer's exchanges of one training step (it receives as
        many), for `rows_out` rows it sends other ranks' experts and `rows_in` rows its experts
        receive from other ranks.

        Forward: x and the weight of each row out, y of each received row back; backward: dy of
        each row out, dx and d weight of each received row back. So (rows_out + rows_in)
        (2 D e + w), plus the counts (E / P int64s to each other rank).
        """
        counts = 8 * self.experts_per_rank * (self.expert_parallel - 1)
        return (rows_out + rows_in) * self.row_bytes / 2 + counts

    @property
    def expected_step_bytes(self) -> float:
        """Bytes each rank sends (and receives) per layer and step under uniform routing:
        T k (P - 1) / P rows each way, T k (P - 1) / P (4 D e + 2 w) + 8 E (P - 1) / P."""
        off_rank = self.expected_rows * (self.expert_parallel - 1) / self.expert_parallel
        return self.step_bytes(off_rank, off_rank)

    # Memory

    @property
    def expert_parameters(self) -> int:
        """Parameters this rank holds for the layer's experts: its E / P routed experts, the
        shared experts and the router (E x D), the last two replicated on every rank."""
        shared_f = self.d_ff if self.shared_d_ff is None else self.shared_d_ff
        routed = self.experts_per_rank * 3 * self.d_model * self.d_ff
        return (
            routed
            + self.shared_experts * 3 * self.d_model * shared_f
            + self.num_experts * self.d_model
        )

    @property
    def state_bytes(self) -> int:
        """The parameters, their gradients and the optimizer's state: (2 p + o) per parameter."""
        return self.expert_parameters * (2 * self.param_size + self.optimizer_size)

    def activation_bytes(self, rows: float) -> float:
        """What the exchange keeps for the backward per layer when this rank receives `rows`
        rows: the received rows and weights and the fused op's sort of them (R (D e + w + 4) +
        4 (E / P + 1), the offsets only when it receives a row), and the routes' two int64
        permutations of the T k assignments."""
        w = self.element_size if self.weight_size is None else self.weight_size
        offsets = 4 * (self.experts_per_rank + 1) if rows else 0  # no rows: the op is not run
        received = rows * (self.d_model * self.element_size + w + 4) + offsets
        return received + 16 * self.tokens * self.top_k
