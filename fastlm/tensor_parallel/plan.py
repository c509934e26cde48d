"""The tensor-parallel plan for `fastlm.Transformer`: each rank's shard of every weight, and the
model run on those shards.

`LAYOUT` says how each parameter is split over the P ranks of the group (`shard_tensor`, and
`unshard_tensor` its inverse); `check_plan` refuses a model whose heads, KV heads, d_ff or
vocabulary P does not divide. `parallelize` cuts a model holding whole weights to its rank's
shards, in place, and gives its attention, feed-forward, embedding and the model itself the
mixins below: sequence-parallel tokens in and out (`fastlm.tensor_parallel.tokens`), the loss
vocabulary-parallel (`fastlm.tensor_parallel.vocab_parallel`). After the backward,
`reduce_gradients` sums the replicated norms' gradients and `clip_grad_norm_` clips by the
global norm; `full_state_dict`, `full_optimizer_state` and `shard_optimizer_state` turn the
shards into whole tensors and back (checkpoints any mesh, or one process, loads).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastlm.tensor_parallel.tokens import gather_rows, gather_tokens, scatter_tokens, token_shard
from fastlm.tensor_parallel.vocab_parallel import vocab_parallel_linear_cross_entropy

__all__ = [
    "LAYOUT",
    "check_plan",
    "clip_grad_norm_",
    "full_optimizer_state",
    "full_state_dict",
    "parallelize",
    "reduce_gradients",
    "shard_optimizer_state",
    "shard_tensor",
    "unshard_tensor",
]

# How each parameter of a block is sharded (a suffix of its state_dict key): "rows" and "cols"
# split dim 0 and 1 in P equal parts; "qkv" takes each rank's query heads, then its KV heads'
# keys, then values; None: replicated (the norms' gains, and a mixture of experts' router,
# experts and shared experts, which each rank runs on its own tokens: `reduce_gradients` sums
# their gradients over the group; the router's selection bias, a buffer, moves alike on every
# rank).
LAYOUT = {
    "embedding.w": "rows",
    "out_linear.w": "rows",
    "mult_head_atten.qkv_proj.w": "qkv",
    "mult_head_atten.output_proj.w": "cols",
    "ffe.w1.w": "rows",
    "ffe.w3.w": "rows",
    "ffe.w2.w": "cols",
    "rms_norm1.g": None,
    "rms_norm2.g": None,
    "final_norm.g": None,
    "ffe.router.weight": None,
    "ffe.router.selection_bias": None,
    "ffe.experts.gate_up": None,
    "ffe.experts.down": None,
    "ffe.shared.w1.w": None,
    "ffe.shared.w3.w": None,
    "ffe.shared.w2.w": None,
}


def _layout(name: str) -> str | None:
    for suffix, layout in LAYOUT.items():
        if name == suffix or name.endswith("." + suffix):
            return layout
    raise ValueError(f"{name}: a parameter the tensor-parallel plan does not know")


def _qkv_parts(full_rows: int, heads: tuple[int, int]) -> list[int]:
    """Rows of the q, k and v parts of a fused (Hq + 2 Hkv) D projection."""
    num_heads, num_kv_heads = heads
    head_dim = full_rows // (num_heads + 2 * num_kv_heads)
    return [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]


def shard_tensor(name: str, full: torch.Tensor, rank: int, world: int, heads=None):
    """Rank `rank`'s shard of parameter `name` (a full tensor), by `LAYOUT`.

    Args:
        name: the state_dict key.
        full: the whole tensor.
        rank, world: the rank in the tensor-parallel group and its size.
        heads: (Hq, Hkv) of the model, for the fused qkv projection.

    Returns:
        The shard (a view of `full`; the whole tensor for a replicated one).
    """
    layout = _layout(name)
    if layout is None:
        return full
    if layout == "qkv":
        parts = full.split(_qkv_parts(full.shape[0], heads))
        return torch.cat([part.chunk(world)[rank] for part in parts])
    return full.chunk(world, dim=0 if layout == "rows" else 1)[rank]


def unshard_tensor(name: str, shards: list[torch.Tensor], heads=None) -> torch.Tensor:
    """The whole parameter `name` from every rank's shard, in rank order: `shard_tensor`'s
    inverse."""
    layout = _layout(name)
    if layout is None:
        return shards[0]
    if layout == "qkv":
        world = len(shards)
        rows = _qkv_parts(shards[0].shape[0] * world, heads)
        parts = [s.split([r // world for r in rows]) for s in shards]
        return torch.cat([torch.cat([p[i] for p in parts]) for i in range(3)])
    return torch.cat(shards, dim=0 if layout == "rows" else 1)


def check_plan(config: dict, tensor_parallel: int, name=str) -> None:
    """ValueError (one line) unless `tensor_parallel` ranks can split a model of `config`.

    Args:
        config: the model's vocab_size, num_heads, num_kv_heads (None: num_heads), d_ff (None,
            or a mixture of experts without dense layers: no dense feed-forward to split).
        tensor_parallel: T, the tensor-parallel group's size.
        name: spells the fields in the message (default `str`; the commands pass their flags).

    Raises:
        ValueError: T below 1, or query heads, KV heads, d_ff or the vocabulary not divisible by
            T.
    """
    if tensor_parallel < 1:
        raise ValueError(f"the tensor-parallel size must be at least 1, got {tensor_parallel}")
    kv_heads = config.get("num_kv_heads") or config["num_heads"]
    d_ff = config["d_ff"]
    if config.get("num_experts") and not config.get("first_dense_layers"):
        d_ff = None  # every feed-forward is a mixture of experts: replicated, not split
    for what, count in (
        ("num_heads", config["num_heads"]),
        ("num_kv_heads", kv_heads),
        ("d_ff", d_ff),
        ("vocab_size", config["vocab_size"]),
    ):
        if count is not None and count % tensor_parallel:
            raise ValueError(
                f"{name(what)} {count} is not divisible by the tensor-parallel size "
                f"{tensor_parallel}: "
                "each rank holds an equal share (a KV head with its query heads)"
            )


class _VocabParallelEmbedding:
    """Embedding rows of the rank's vocabulary shard; the shards' sums reduce-scattered to the
    ranks' tokens (sequence parallelism)."""

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        start = self.vocab_start
        inside = (token_ids >= start) & (token_ids < start + self.w.shape[0])
        local = torch.where(inside, token_ids - start, 0)
        rows = torch.nn.functional.embedding(local, self.w) * inside[..., None].to(self.w.dtype)
        return scatter_tokens(rows, self.tensor_group)  # (B, T / P, C)


class _ColumnRowParallel:
    """A sub-layer whose first GEMM is column-parallel and last row-parallel (the feed-forward:
    d_ff): the tokens gathered in, the partial outputs reduce-scattered out."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out = super().forward(gather_tokens(x, self.tensor_group), *args, **kwargs)
        return scatter_tokens(out, self.tensor_group)


class _SequenceParallelMoe:
    """A mixture of experts on the rank's own tokens (sequence parallelism's T / P of each row),
    its router, experts and shared experts replicated: no collective but one all-reduce of
    2E + 1 floats for the auxiliary losses, which are nonlinear in the whole batch's routing.

    With n the tokens of all ranks, f_e = c_e / (n k) (c_e: the assignments to e over all
    ranks, not differentiable) and S_e, Z the sums over all ranks' tokens of p_e and
    logsumexp(s)^2, balance = E sum_e f_e S_e / n and z = Z / n: linear in each rank's share
    S_e^r, Z^r. Each rank's losses have the whole batch's values and the gradient of its share
    only, so that, as for the norms' gains, `reduce_gradients`' sum over the group is the
    whole gradient (and each token's input gradient is its own rank's, whole)."""

    def auxiliary_losses(self, logits: torch.Tensor, expert_ids: torch.Tensor) -> dict:
        from fastlm.reference import expert_counts

        E = self.router.num_experts
        probs = self.router.probabilities(logits)  # (T / P, E)
        squares = torch.logsumexp(logits, dim=-1).pow(2)  # (T / P,)
        mine = torch.cat([probs.sum(dim=0), squares.sum()[None]])  # S^r, Z^r: (E + 1,)
        counts = expert_counts(expert_ids, E).to(mine.dtype)
        total = torch.cat([counts, mine.detach()])
        dist.all_reduce(total, group=self.tensor_group)
        counts, whole = total.split([E, E + 1])
        n = logits.shape[0] * dist.get_world_size(self.tensor_group)  # equal shares
        share = counts / (n * expert_ids.shape[-1])  # f_e
        losses = {}
        for name, part, full in (
            ("balance", (share * mine[:E]).sum(), (share * whole[:E]).sum()),
            ("z", mine[E], whole[E]),
        ):
            scale = E / n if name == "balance" else 1 / n
            losses[name] = part * scale + (full * scale - part * scale).detach()
        return losses


class _HeadParallelAttention(_ColumnRowParallel):
    """Attention on the rank's heads, as `_ColumnRowParallel`; no KV cache."""

    def forward(self, x, token_positions=None, kv_cache=None, *args, **kwargs):
        if kv_cache is not None:
            raise ValueError(
                "tensor parallelism trains (no KV cache): generate with the whole model "
                "(fastlm.tensor_parallel.full_state_dict)"
            )
        return super().forward(x, token_positions, kv_cache, *args, **kwargs)


class _TensorParallelModel:
    """fastlm.Transformer under the plan: `loss` through the vocabulary-parallel loss; `forward`
    gathers the logits (evaluation: not differentiable)."""

    def loss(
        self, token_ids, targets, token_positions=None, ignore_index: int = -100, **packed
    ) -> torch.Tensor:
        if not isinstance(targets, torch.Tensor) or targets.shape != token_ids.shape:
            raise ValueError(
                f"targets must have the shape of token_ids {tuple(token_ids.shape)}, got "
                f"{getattr(targets, 'shape', type(targets))}"
            )
        hidden = self.hidden(token_ids, token_positions, **packed)  # (B, T / P, C)
        group = self.tensor_group
        loss = vocab_parallel_linear_cross_entropy(
            hidden,
            self.out_linear.w,
            token_shard(targets, group),
            group,
            ignore_index,
            sequence_parallel=True,
        )
        context = self.context_parallel_group
        if context is None:
            return loss
        from fastlm.distributed import mean_share

        return mean_share(loss, targets, ignore_index, context)

    def forward(self, token_ids, token_positions=None, kv_cache=None, **packed) -> torch.Tensor:
        hidden = self.hidden(token_ids, token_positions, kv_cache, **packed)
        with torch.no_grad():
            full = gather_tokens(hidden, self.tensor_group)
            logits = torch.nn.functional.linear(full, self.out_linear.w.to(full.dtype))
            return gather_rows(logits.movedim(-1, 0), self.tensor_group).movedim(0, -1)


def _swap_class(module: torch.nn.Module, mixin: type) -> None:
    """Give `module` the mixin's forward (a subclass of its own class, as FSDP2 does), keeping
    its parameters and state_dict keys."""
    module.__class__ = type(f"TensorParallel{type(module).__name__}", (mixin, type(module)), {})


def parallelize(model, group=None):
    """Apply Megatron-style tensor and sequence parallelism to a `fastlm.Transformer`, in place.

    Each rank keeps its shard of every GEMM's weight (`LAYOUT`): the fused q|k|v projection by
    heads (each rank's query heads and the KV heads they read, GQA included), the output
    projection by its input columns, W1 and W3 by rows (so the block's packed W1|W3 GEMM and
    `swiglu_packed` run on the rank's [W1_r; W3_r] unchanged), W2 by columns, and the embedding
    and LM head by vocabulary rows. Between the sub-layers the residual stream, the norms and
    the embedding's output are sequence-parallel: each rank holds T / P tokens of every row; a
    sub-layer all-gathers them, runs its heads or d_ff shard, and reduce-scatters its partial
    output back (one all-gather and one reduce-scatter of (B, T, C) per sub-layer and pass).
    `loss` is the vocabulary-parallel fused linear cross-entropy: no rank ever holds the whole
    LM head or any logits. A mixture-of-experts layer (router, experts, shared experts) is
    replicated and runs on the rank's own tokens, no gather (`_SequenceParallelMoe`: one small
    all-reduce makes its auxiliary losses the whole batch's). The norms' gains and the MoE
    layers' parameters are replicated: call `reduce_gradients(model)` after the backward (their
    gradients are each rank's tokens' share).

    Composes with context parallelism (`set_context_parallel` with the mesh's "context"
    group: each context shard's tokens are sequence-parallel over the tensor group) and with
    FSDP2 or DDP over the data (and context) ranks: apply this first.

    Args:
        model: a fastlm.Transformer holding whole weights (load a checkpoint first).
        group: the tensor-parallel ProcessGroup, a DeviceMesh (1-D or with a "tensor" dim), or
            None for the default group.

    Returns:
        The model (every rank of the group must call its forward, loss and backward together,
        with the same token_ids and targets; T divisible by the group's size).

    Raises:
        ValueError: heads, KV heads, d_ff or the vocabulary not divisible by the group's size.
    """
    from fastlm.distributed import mesh_group

    group = mesh_group(group, "tensor")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    first = model.blocks[0]
    attention = first.mult_head_atten
    heads = (attention.num_heads, attention.num_kv_heads)
    moe = set(map(id, model.moe_layers()))
    dense = [block.ffe for block in model.blocks if id(block.ffe) not in moe]
    d_ff = dense[0].d_ff if dense else None  # the dense feed-forwards' (each model has one)
    config = dict(vocab_size=model.vocab_size, num_heads=heads[0], num_kv_heads=heads[1], d_ff=d_ff)
    check_plan(config, world)
    shared = {}  # a tied weight is sharded once and stays one parameter
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if id(param) not in shared:
            shard = shard_tensor(name, param.detach(), rank, world, heads).clone()
            shared[id(param)] = torch.nn.Parameter(shard, requires_grad=param.requires_grad)
        setattr(owner, attr, shared[id(param)])
    for block in model.blocks:
        attention = block.mult_head_atten
        attention.num_heads, attention.num_kv_heads = heads[0] // world, heads[1] // world
        ffe_mixin = _SequenceParallelMoe if id(block.ffe) in moe else _ColumnRowParallel
        if ffe_mixin is _ColumnRowParallel:
            block.ffe.d_ff //= world
        for module, mixin in ((attention, _HeadParallelAttention), (block.ffe, ffe_mixin)):
            _swap_class(module, mixin)
            module.tensor_group = group
    model.embedding.vocab_start = rank * model.embedding.w.shape[0]
    model.embedding.tensor_group = group
    _swap_class(model.embedding, _VocabParallelEmbedding)
    model.tensor_group, model.tensor_heads = group, heads
    _swap_class(model, _TensorParallelModel)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2's) local shard, or t."""
    return t.to_local() if hasattr(t, "to_local") else t


def reduce_gradients(model) -> None:
    """Sum the replicated parameters' gradients (the norms' gains, the MoE layers') over the
    tensor-parallel group, after the backward (and after DDP's or FSDP2's reduction over the
    data ranks, which shards every tensor-parallel rank's alike): one all-reduce of them all.
    Under sequence parallelism each rank's is its tokens' share; the sharded weights' gradients
    are whole already.

    Args:
        model: a model `parallelize` prepared, or a module holding it (DDP, a loss wrapper).
    """
    grads = [
        _local(param.grad)
        for name, param in model.named_parameters()
        if param.grad is not None and _layout(name) is None
    ]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=_tensor_group(model))
    for grad, summed in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(summed.view_as(grad))


def _tensor_group(model):
    for module in model.modules():
        if hasattr(module, "tensor_heads"):
            return module.tensor_group
    raise ValueError("the model is not tensor-parallel (fastlm.tensor_parallel.parallelize)")


def full_state_dict(state: dict, model) -> dict:
    """The whole tensors of a tensor-parallel model's state_dict, on every rank of its group:
    what a single-process model (or any other mesh) loads.

    Args:
        state: {key: this rank's shard} (model.state_dict(), or FSDP2's full state of the
            rank's shards), keys as `LAYOUT` knows them.
        model: the model `parallelize` prepared (its group and head counts).

    Returns:
        {key: the whole tensor}, on the shards' devices.
    """
    group = _tensor_group(model)
    world = dist.get_world_size(group)
    heads = model.tensor_heads
    full = {}
    for key, shard in state.items():
        shard = _local(shard)
        if _layout(key) is None:
            full[key] = shard
            continue
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard.contiguous(), group=group)
        full[key] = unshard_tensor(key, parts, heads)
    return full


def _state_tensors(state: dict):
    """(parameter key, entry name, tensor) of each per-parameter tensor of an optimizer's full
    state dict ({"state": {key: {name: tensor}}, "param_groups": ...}) shaped like its
    parameter (a scalar `step` is left alone)."""
    for key, entries in state["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                yield key, name, value


def full_optimizer_state(state: dict, model, device=None) -> dict:
    """`full_state_dict` for an optimizer's full state dict (AdamW's moments are shaped like
    their parameters): every rank of the group gets the whole tensors (moved to `device` when
    given)."""
    out = {**state, "state": {k: dict(v) for k, v in state["state"].items()}}
    for key, name, value in _state_tensors(state):
        out["state"][key][name] = full_state_dict({key: value}, model)[key].to(device)
    return out


def shard_optimizer_state(state: dict, model) -> dict:
    """An optimizer's full state dict cut to this rank's shards (`shard_tensor`), to load into
    the optimizer of a model `parallelize` prepared."""
    group = _tensor_group(model)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out = {**state, "state": {k: dict(v) for k, v in state["state"].items()}}
    for key, name, value in _state_tensors(state):
        out["state"][key][name] = shard_tensor(key, value, rank, world, model.tensor_heads).clone()
    return out


def clip_grad_norm_(model, max_norm: float, data_group=None) -> torch.Tensor:
    """Scale every gradient by max_norm / (norm + 1e-6) where the global norm is above max_norm
    (`fastlm.reference.gradient_clip`'s rule), the norm counting each
    sharded weight's shards and each replicated gain once. Call after `reduce_gradients`.

    Args:
        model: a model `parallelize` prepared, or a module holding it.
        max_norm: the largest norm kept.
        data_group: with FSDP2 (each rank a disjoint shard of the data ranks' gradients), the
            group of the data (x context) ranks; None when they hold whole copies (DDP).

    Returns:
        The norm before clipping, fp32.
    """
    group = _tensor_group(model)
    world = dist.get_world_size(group)
    grads = [(name, _local(p.grad)) for name, p in model.named_parameters() if p.grad is not None]
    squares = [g.float().square().sum() / (1 if _layout(n) else world) for n, g in grads]
    total = torch.stack(squares).sum()
    dist.all_reduce(total, group=group)
    if data_group is not None:
        dist.all_reduce(total, group=data_group)
    norm = total.sqrt()
    scale = torch.where(norm > max_norm, max_norm / (norm + 1e-6), 1.0)
    for _, grad in grads:
        grad.mul_(scale.to(grad.dtype))
    return norm
