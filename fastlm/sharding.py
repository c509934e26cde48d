"""DTensor sharding rules for every `torch.ops.fastlm.*` op and its backward op.

A DTensor reaching a custom op runs the op's fake implementation for shapes, then asks for a
sharding strategy: the placements of the inputs under which running the op on each rank's local
shards gives the local shards of the outputs, and the outputs' placements. Each rule below lists
them for one mesh dimension (`register_sharding`; DTensor expands them over every dimension of the
mesh) as `(output placements, input placements)`, None for non-tensor arguments:

- rows / tokens: every dim but the one an op reduces over may be `Shard`ed (RMSNorm's rows,
  RoPE's batch, heads and tokens with the positions sharded alike, attention's batch and heads);
  elementwise ops (SwiGLU, GeGLU) on any dim, the last included;
- heads: attention and RoPE shard q by query heads and k, v by KV heads (GQA: every query head
  finds its KV head on its own rank when both counts divide the ranks of the mesh dims they are
  split over: on a (data x tensor) mesh, the tensor dim's), rejected otherwise;
- experts: the mixture-of-experts ops' weights over E or F (each rank's experts or hidden
  columns add a `Partial` share of the output; `_moe_rules`), tokens replicated;
- weights: a `Replicate` weight (RMSNorm's gain, the LM head in fused linear cross-entropy) whose
  inputs are sharded by rows gets a `Partial` gradient: the sum of the ranks' partial sums, which
  DTensor reduces when it is read (`full_tensor`, `redistribute`, the optimizer), never dropped;
  likewise a summed loss;
- a placement the op cannot run on its local shards is either one DTensor redistributes to a
  listed one (a `Partial` input is reduced first, the ops being non-linear; token-sharded logits
  become row-sharded ones) or one that would silently cost a gather of what the op is meant to
  keep sharded, or be wrong: the dim an op reduces over (a norm's features, a head's dims, a
  vocabulary, packed [gate | up] halves), keys sharded by sequence, causal queries sharded by
  sequence, heads that do not divide the mesh dims they are split over. Those raise ValueError
  naming the op, the argument and the placement, and what to use instead. (One exception:
  the experts' F dim in the halves layout is gathered, `_moe_rules` says why.)

Mean losses (`fastlm::cross_entropy`, `fastlm::cross_entropy_`, `fastlm::linear_cross_entropy`)
run replicated only: a rank's mean over its rows is not a share of the global mean. Their
`reduction="sum"` / `"none"` forms (the options ops, whose sums are `Partial` and rows `Shard`)
and their backward ops take sharded rows; a vocabulary-sharded LM head goes through
`fastlm.tensor_parallel.vocab_parallel_linear_cross_entropy`.

Registered when fastlm is imported, where torch.distributed exists (`register`).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist


def _placements():
    from torch.distributed.tensor import Partial, Replicate, Shard

    return Partial, Replicate, Shard


# --------------------------------------------------------------------------------------------
# Helpers: what an input spec shards, refusals, the strategy lists
# --------------------------------------------------------------------------------------------


def _sharded_dims(spec) -> list[tuple[int, object]]:
    """(tensor dim, placement) for each mesh dim on which `spec` is a Shard."""
    if spec is None:
        return []
    return [(p.dim % spec.ndim, p) for p in spec.placements if p.is_shard()]


def _refuse(op: str, name: str, spec, dims, why: str) -> None:
    """ValueError if `spec` (argument `name` of `op`) is sharded on one of `dims` (negative
    dims count from the end)."""
    if spec is None:
        return
    wanted = {d % spec.ndim for d in dims}
    for dim, placement in _sharded_dims(spec):
        if dim in wanted:
            raise ValueError(
                f"fastlm::{op}: {name} {tuple(spec.shape)} is {placement!r} on its dim {dim}: {why}"
            )


def _splits_evenly(spec, *counts: int) -> bool:
    """Whether a dim of `counts[i]` entries (for each i) splits evenly over every set of `spec`'s
    mesh dims DTensor may shard it over. A rule lists strategies for one mesh dim and DTensor
    combines them over all of them, so a dim may be sharded over any set of mesh dims; DTensor
    itself drops only the sets with more ranks than entries (uneven splits it takes). On a
    (data 2 x tensor 2) mesh, 2 heads split over either dim alone, never over both."""
    sizes = spec.mesh.shape
    for n in range(1, len(sizes) + 1):
        for dims in itertools.combinations(sizes, n):
            ranks = math.prod(dims)
            if ranks <= min(counts) and any(count % ranks for count in counts):
                return False
    return True


def _shard_ranks(spec, dim: int) -> int:
    """Into how many pieces `spec` is sharded along its dim `dim` (1: not sharded there)."""
    sizes = spec.mesh.shape
    on_dim = [sizes[i] for i, p in enumerate(spec.placements) if p.is_shard(dim % spec.ndim)]
    return math.prod(on_dim)


def _replicated(n_out: int, inputs) -> tuple[list, list]:
    """Every output and tensor input Replicate; None where `inputs` marks a non-tensor."""
    _, Replicate, _ = _placements()
    R = Replicate()
    return [R] * n_out, [None if x is None else R for x in inputs]


# --------------------------------------------------------------------------------------------
# The rules
# --------------------------------------------------------------------------------------------


def _norm_rules():
    Partial, Replicate, Shard = _placements()
    R = Replicate()
    why = (
        "RMSNorm reduces over the last dim, which no rank holds whole: shard x by rows "
        "(Shard of a leading dim) or replicate it"
    )

    def rms_norm(x, weight, eps, out_dtype, offset=0.0):
        _refuse("rms_norm", "x", x, [-1], why)
        rules = [([Shard(d), Shard(d)], [Shard(d), R, None, None, None]) for d in range(x.ndim - 1)]
        return rules + [_replicated(2, [x, weight, None, None, None])]

    def add_rms_norm(x, residual, weight, eps, out_dtype):
        for name, spec in (("x", x), ("residual", residual)):
            _refuse("add_rms_norm", name, spec, [-1], why)
        rules = [([Shard(d)] * 3, [Shard(d), Shard(d), R, None, None]) for d in range(x.ndim - 1)]
        return rules + [_replicated(3, [x, residual, weight, None, None])]

    def rms_norm_backward(dy, d_summed, x, weight, rstd, dx_dtype, dx2_dtype, offset=0.0):
        for name, spec in (("dy", dy), ("d_summed", d_summed), ("x", x)):
            _refuse("rms_norm_backward", name, spec, [-1], why)
        summed = None if d_summed is None else True

        def rows(d):
            dx2 = Shard(d) if dx2_dtype is not None else R  # else an empty placeholder
            d_summed_placement = None if d_summed is None else Shard(d)
            inputs = [Shard(d), d_summed_placement, Shard(d), R, Shard(d), None, None, None]
            # Each rank's dweight sums its own rows only: a Partial sum over the ranks.
            return [Shard(d), dx2, Partial()], inputs

        replicated = _replicated(3, [dy, summed, x, weight, rstd, None, None, None])
        return [rows(d) for d in range(x.ndim - 1)] + [replicated]

    return dict(rms_norm=rms_norm, add_rms_norm=add_rms_norm, rms_norm_backward=rms_norm_backward)


def _glu_rules():
    _, Replicate, Shard = _placements()
    why = (
        "gate_up packs gate and up along its last dim ([gate | up], or interleaved pairs), so a "
        "Shard of it splits them apart: shard gate and up apart (fastlm.swiglu), or keep each "
        "rank's [gate_r | up_r] local (fastlm.tensor_parallel)"
    )

    def elementwise(n_out, n_in, extra=0):
        def rule(first, *rest):
            dims = range(first.ndim)
            rules = [([Shard(d)] * n_out, [Shard(d)] * n_in + [None] * extra) for d in dims]
            return rules + [_replicated(n_out, [first] * n_in + [None] * extra)]

        return rule

    def packed(op, n_in, extra=0):
        def rule(*args):
            tensors = args[:n_in]
            for name, spec in zip(("dy", "gate_up")[2 - n_in :], tensors):
                _refuse(op, name, spec, [-1], why)
            dims = range(tensors[-1].ndim - 1)
            rules = [([Shard(d)], [Shard(d)] * n_in + [None] * extra) for d in dims]
            return rules + [_replicated(1, [*tensors] + [None] * extra)]

        return rule

    return dict(
        swiglu=elementwise(1, 2),
        swiglu_backward=elementwise(2, 3),
        swiglu_options=elementwise(1, 2, extra=3),
        swiglu_options_backward=elementwise(2, 3, extra=3),
        geglu=elementwise(1, 2, extra=1),
        geglu_backward=elementwise(2, 3, extra=1),
        swiglu_packed=packed("swiglu_packed", 1),
        swiglu_packed_backward=packed("swiglu_packed_backward", 2),
        swiglu_packed_options=packed("swiglu_packed_options", 1, extra=4),
        swiglu_packed_options_backward=packed("swiglu_packed_options_backward", 2, extra=4),
    )


def _rope_rules():
    _, Replicate, Shard = _placements()
    R = Replicate()
    why = "RoPE rotates pairs along the last dim (head dim): shard another dim"

    def layouts(x, positions):
        """(dim of x, placement of the positions) for each dim of x (..., T, D) RoPE can shard:
        the leading dims (batch, heads; a (B, T) positions table sharded with the batch) and
        the tokens (the positions sharded alike)."""
        token_dim = x.ndim - 2
        out = [(token_dim, Shard(positions.ndim - 1))]
        for d in range(token_dim):
            by_batch = positions.ndim == 2 and d == 0
            out.append((d, Shard(0) if by_batch else R))
        return out

    def rope(x, cos, sin, positions, interleaved, inverse):
        _refuse("rope", "x", x, [-1], why)
        rules = [([Shard(d)], [Shard(d), R, R, p, None, None]) for d, p in layouts(x, positions)]
        return rules + [_replicated(1, [x, cos, sin, positions, None, None])]

    def rope_(q, k, cos, sin, positions, interleaved, inverse):
        for name, spec in (("q", q), ("k", k)):
            _refuse("rope_", name, spec, [-1], why)
        on_k = None if k is None else True
        rules = [
            ([], [Shard(d), None if k is None else Shard(d), R, R, p, None, None])
            for d, p in layouts(q, positions)
        ]
        return rules + [_replicated(0, [q, on_k, cos, sin, positions, None, None])]

    return dict(rope=rope, rope_=rope_)


def _check_heads(op: str, q, k, head_dim: int) -> bool:
    """Whether q and k can be sharded by heads: both head counts split evenly over every set of
    mesh dims DTensor may shard them over (`_splits_evenly`; then each rank's query heads share
    the KV heads it holds). On a (data x tensor) mesh that is the tensor dim's ranks (and the
    data dim's), not the whole mesh's. ValueError if q or k already is sharded by heads into a
    number of pieces that does not divide both counts."""
    heads = q.shape[head_dim], k.shape[head_dim]
    for name, spec in (("q", q), ("k", k)):
        ranks = _shard_ranks(spec, head_dim)
        if any(count % ranks for count in heads):
            _refuse(
                op,
                name,
                spec,
                [head_dim],
                f"{heads[0]} query and {heads[1]} KV heads do not both divide the {ranks} ranks "
                f"{name} splits them over, so a rank's query heads would miss their KV heads",
            )
    return _splits_evenly(q, *heads)


def _attention_rules():
    Partial, Replicate, Shard = _placements()
    R = Replicate()
    head_why = "a head's dims are reduced over (q . k): shard batch or heads instead"
    sequence_why = (
        "attention over a sequence sharded by tokens needs every key: use "
        "fastlm.distributed.context_parallel_attention (context parallelism)"
    )

    def dense_refusals(op, q, k, v, causal, window):
        for name, spec in (("q", q), ("k", k), ("v", v)):
            _refuse(op, name, spec, [3], head_why)
        for name, spec in (("k", k), ("v", v)):
            _refuse(op, name, spec, [2], sequence_why)
        if causal or window != (-1, -1):
            _refuse(op, "q", q, [2], f"causal or windowed queries: {sequence_why}")

    def dense(q, k, causal, window):
        """(placement of q-like tensors, of k and v, of lse, of dk and dv) per strategy."""
        rules = [(Shard(0), Shard(0), Shard(0), Shard(0))]
        if _check_heads("flash_attention", q, k, 1):
            rules.append((Shard(1), Shard(1), Shard(1), Shard(1)))
        if not causal and window == (-1, -1):  # queries alone: every rank's keys are all keys
            rules.append((Shard(2), R, Shard(2), Partial()))
        return rules + [(R, R, R, R)]

    def sink_placements(sinks, sq):
        """(placement of the sinks (Hq,), of their gradient) beside q's: split with q's heads,
        else whole on every rank, with a gradient summed over the rows each rank holds (Partial;
        Replicate when there are none: it is then an empty (0,) tensor on every rank)."""
        if sinks is None:
            return None, R
        if sq == Shard(1):
            return Shard(0), Shard(0)
        return R, (R if sq == R else Partial())

    def flash_attention(
        q, k, v, causal, scale, left, right, softcap, allow_tf32, deterministic, sinks=None,
        softcap_approx=False,
    ):  # fmt: skip
        dense_refusals("flash_attention", q, k, v, causal, (left, right))
        return [
            ([sq, sl], [sq, skv, skv] + [None] * 7 + [sink_placements(sinks, sq)[0], None])
            for sq, skv, sl, _ in dense(q, k, causal, (left, right))
        ]

    def flash_attention_backward(
        do, q, k, v, o, lse, causal, scale, left, right, softcap, allow_tf32, deterministic,
        sinks=None, softcap_approx=False,
    ):  # fmt: skip
        dense_refusals("flash_attention_backward", q, k, v, causal, (left, right))
        rules = []
        for sq, skv, sl, dkv in dense(q, k, causal, (left, right)):
            on_sinks, dsinks = sink_placements(sinks, sq)
            rules.append(
                ([sq, dkv, dkv, dsinks], [sq, sq, skv, skv, sq, sl] + [None] * 7 + [on_sinks, None])
            )
        return rules

    def flash_attention_backward_(
        do,
        q,
        k,
        v,
        o,
        lse,
        causal,
        scale,
        allow_tf32,
        deterministic,
        dq,
        dk,
        dv,
        cu_seqlens=None,
        max_seqlen=0,
    ):
        op = "flash_attention_backward_"
        dense_refusals(op, q, k, v, True, (-1, -1))
        # Written in place into dq, dk, dv: they keep q's and k's placements (no Partial).
        layouts = [(Shard(1), Shard(1))] if _check_heads(op, q, k, 1) else []
        if cu_seqlens is None:  # packed documents are one (1, H, total, D) row
            layouts.append((Shard(0), Shard(0)))
        layouts.append((R, R))
        packed = None if cu_seqlens is None else R
        return [
            ([], [sq, sq, skv, skv, sq, sq, None, None, None, None, sq, skv, skv, packed, None])
            for sq, skv in layouts
        ]

    def varlen_refusals(op, q, k, v):
        for name, spec in (("q", q), ("k", k), ("v", v)):
            _refuse(op, name, spec, [0], "packed documents cut across a token shard: shard heads")
            _refuse(op, name, spec, [2], head_why)

    def flash_attention_varlen(q, k, v, cu_q, cu_k, *rest):
        varlen_refusals("flash_attention_varlen", q, k, v)
        sinks = rest[9] if len(rest) > 9 else None
        rules = [_replicated(2, [q, k, v, cu_q, cu_k] + [None] * 9 + [sinks, None])]
        if _check_heads("flash_attention_varlen", q, k, 1):  # lse is (Hq, total)
            on_sinks, _ = sink_placements(sinks, Shard(1))
            inputs = [Shard(1)] * 3 + [R, R] + [None] * 9 + [on_sinks, None]
            rules.append(([Shard(1), Shard(0)], inputs))
        return rules

    def flash_attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, *rest):
        varlen_refusals("flash_attention_varlen_backward", q, k, v)
        sinks = rest[9] if len(rest) > 9 else None
        rules = [_replicated(4, [do, q, k, v, o, lse, cu_q, cu_k] + [None] * 9 + [sinks, None])]
        if _check_heads("flash_attention_varlen_backward", q, k, 1):
            on_sinks, dsinks = sink_placements(sinks, Shard(1))
            inputs = [Shard(1)] * 5 + [Shard(0), R, R] + [None] * 9 + [on_sinks, None]
            rules.append(([Shard(1)] * 3 + [dsinks], inputs))
        return rules

    return dict(
        flash_attention=flash_attention,
        flash_attention_backward=flash_attention_backward,
        flash_attention_backward_=flash_attention_backward_,
        flash_attention_varlen=flash_attention_varlen,
        flash_attention_varlen_backward=flash_attention_varlen_backward,
    )


def _row_dims(x) -> bool:
    """Whether x (..., C)'s rows may be sharded: the ops flatten the leading dims to rows, so a
    Shard(0) of x is a Shard(0) of its rows only when dim 0 splits evenly over the mesh dims it is
    sharded over (`_splits_evenly`), or x is 2-D."""
    return x.ndim == 2 or _splits_evenly(x, x.shape[0])


def _loss_rules():
    Partial, Replicate, Shard = _placements()
    R = Replicate()
    vocab_why = (
        "a vocabulary-sharded row needs the max, the sum of exps and the target logit "
        "combined across ranks: use fastlm.tensor_parallel.vocab_parallel_cross_entropy "
        "(or vocab_parallel_linear_cross_entropy)"
    )
    mean_why = (
        "the op returns the mean over its rows, which rank-local means cannot give: pass "
        "reduction='sum' (a Partial sum) or 'none' and divide by the count, or replicate"
    )

    def loss_refusals(op, logits, targets, mean: bool):
        _refuse(op, "logits", logits, [-1], vocab_why)
        if mean:
            _refuse(op, "logits", logits, range(logits.ndim - 1), mean_why)
            _refuse(op, "targets", targets, range(targets.ndim), mean_why)

    def cross_entropy(logits, targets, ignore_index):
        loss_refusals("cross_entropy", logits, targets, True)
        return [_replicated(3, [logits, targets, None])]

    def cross_entropy_(logits, targets, ignore_index):
        loss_refusals("cross_entropy_", logits, targets, True)
        return [_replicated(2, [logits, targets, None])]

    def cross_entropy_backward(logits, targets, ignore_index, stats, scale):
        loss_refusals("cross_entropy_backward", logits, targets, False)
        rules = [_replicated(1, [logits, targets, None, stats, scale])]
        if _row_dims(logits):  # scale: the mean's 1 / n_valid scalar
            rules.append(([Shard(0)], [Shard(0), Shard(0), None, Shard(0), R]))
        return rules

    def cross_entropy_options(logits, targets, ignore_index, softcap, label_smoothing, z_loss):
        loss_refusals("cross_entropy_options", logits, targets, False)
        rules = [_replicated(3, [logits, targets] + [None] * 4)]
        if _row_dims(logits):  # row losses, stats, correct: by rows
            rules.append(([Shard(0)] * 3, [Shard(0), Shard(0)] + [None] * 4))
        return rules

    def cross_entropy_options_backward(logits, targets, ignore_index, stats, scale, *options):
        loss_refusals("cross_entropy_options_backward", logits, targets, False)
        rules = [_replicated(1, [logits, targets, None, stats, scale] + [None] * 3)]
        if _row_dims(logits):  # scale: per row
            rules.append(([Shard(0)], [Shard(0), Shard(0), None, Shard(0), Shard(0)] + [None] * 3))
        return rules

    def weight_refusals(op, x, weight):
        _refuse(op, "weight", weight, [0], vocab_why)
        _refuse(op, "x", x, [-1], "x's features are reduced over (x @ weight.T): shard rows")
        _refuse(op, "weight", weight, [1], "the features are reduced over: replicate weight")

    def linear_cross_entropy(x, weight, targets, ignore_index, chunk_size, need_dx, need_dweight):
        op = "linear_cross_entropy"
        weight_refusals(op, x, weight)
        loss_refusals(op, x, targets, True)
        return [_replicated(4, [x, weight, targets] + [None] * 4)]

    def linear_cross_entropy_options(
        x,
        weight,
        targets,
        ignore_index,
        chunk_size,
        softcap,
        label_smoothing,
        z_loss,
        need_dx,
        need_dweight,
    ):
        op = "linear_cross_entropy_options"
        weight_refusals(op, x, weight)
        loss_refusals(op, x, targets, False)
        rules = [_replicated(4, [x, weight, targets] + [None] * 7)]
        if _row_dims(x):
            # The summed loss and dweight add every rank's rows: Partial sums. An empty
            # placeholder (a gradient not asked for) is Replicate.
            dx = Shard(0) if need_dx else R
            dweight = Partial() if need_dweight else R
            outputs = [Partial(), Shard(0), dx, dweight]
            rules.append((outputs, [Shard(0), R, Shard(0)] + [None] * 7))
        return rules

    return dict(
        cross_entropy=cross_entropy,
        cross_entropy_=cross_entropy_,
        cross_entropy_backward=cross_entropy_backward,
        cross_entropy_options=cross_entropy_options,
        cross_entropy_options_backward=cross_entropy_options_backward,
        linear_cross_entropy=linear_cross_entropy,
        linear_cross_entropy_options=linear_cross_entropy_options,
    )


def _moe_rules():
    """The experts' weights sharded over E (expert parallelism) or F (tensor parallelism of each
    expert's MLP); tokens, the routing and the experts' D replicated. Either way every rank adds
    its share of each token's output: out, dx and d expert_weights are `Partial` sums.

    - E: gate_up, down and the biases `Shard(0)`, with `expert_index` (arange(E), `Shard(0)`
      alike: the public function passes it for a DTensor gate_up sharded over E) telling each
      rank's op the global ids of the experts it holds; the routing is the whole one, each rank
      runs its experts' rows and leaves the other assignments' rows zero. Weight and bias
      gradients `Shard(0)`.
    - F, only with `interleaved=True` (gate and up in alternate rows of gate_up): a `Shard` of
      gate_up's 2F dim then holds whole (gate, up) pairs, those of hidden columns the rank's
      `Shard` of down's F dim holds, when F splits evenly over the ranks. gate_up_bias shards
      with F; down_bias is `Partial` (a replicated one is divided among the ranks), so that the
      sum over ranks adds it once and d expert_weights' <dout, down_bias> term is counted
      once; its gradient, the same on every rank, `Replicate`. The halves layout (gate the first
      F rows) has no F strategy: a `Shard` of its 2F rows gives a rank gate rows only, so DTensor
      gathers the weights and runs replicated (right, and as costly as it sounds).
    """
    Partial, Replicate, Shard = _placements()
    R = Replicate()
    rows_why = (
        "the experts op runs every token's k choices on replicated tokens (and reduces over D): "
        "replicate it, and shard the experts' weights over E (expert parallelism) or F (tensor "
        "parallelism, interleaved gate/up)"
    )
    routing_why = "the routing metadata is the whole batch's: replicate it"

    def on(spec, placement):
        return None if spec is None else placement

    def dims(transposed):
        """(gate_up's 2F dim, its D dim, down's F dim, its D dim)."""
        return (2, 1, 1, 2) if transposed else (1, 2, 2, 1)

    def refusals(op, x, expert_weights, gate_up, down, down_bias, sorted_, offsets, transposed):
        for name, spec in (("x", x), ("expert_weights", expert_weights)):
            _refuse(op, name, spec, range(spec.ndim), rows_why)
        _, gu_d, _, down_d = dims(transposed)
        _refuse(op, "gate_up", gate_up, [gu_d], "its D dim is reduced over: " + rows_why)
        _refuse(op, "down", down, [down_d], "its D dim is the output's: " + rows_why)
        _refuse(op, "down_bias", down_bias, [1], "its D dim is the output's: " + rows_why)
        for name, spec in (("sorted_assignments", sorted_), ("expert_offsets", offsets)):
            _refuse(op, name, spec, [0], routing_why)

    def layouts(gate_up, gate_up_bias, down_bias, transposed, interleaved, expert_index):
        """(placement of gate_up, down, gate_up_bias, down_bias, expert_index; of the weight
        gradients d gate_up, d down, d b1, d b2) per strategy, replicated first."""
        gu_f, _, down_f, _ = dims(transposed)
        F = gate_up.shape[gu_f] // 2
        out = [(R, R, R, R, R, R, R, R, R)]
        if interleaved and _splits_evenly(gate_up, F):
            out.append((Shard(gu_f), Shard(down_f), Shard(1), Partial(), R,
                        Shard(gu_f), Shard(down_f), Shard(1), R))  # fmt: skip
        if expert_index is not None:
            out.append((Shard(0),) * 9)
        return [
            (gu, dn, on(gate_up_bias, b1), on(down_bias, b2), on(expert_index, ix), dgu, ddn,
             db1 if gate_up_bias is not None else R, db2 if down_bias is not None else R)
            for gu, dn, b1, b2, ix, dgu, ddn, db1, db2 in out
        ]  # fmt: skip

    def moe_route(expert_ids, num_experts):
        _refuse("moe_route", "expert_ids", expert_ids, range(expert_ids.ndim), rows_why)
        return [([R, R], [R, None])]

    def strategies(op, backward, args, kwargs):
        """Both ops' strategies from their arguments (the backward's: dout first)."""
        args = args[1:] if backward else args  # dout: replicated, as x
        x, expert_weights, gate_up, down, gate_up_bias, down_bias, sorted_, offsets = args[:8]
        transposed, interleaved = args[8:10]
        expert_index = kwargs.get("expert_index", args[14] if len(args) > 14 else None)
        refusals(op, x, expert_weights, gate_up, down, down_bias, sorted_, offsets, transposed)
        rules = []
        for i, (gu, dn, b1, b2, ix, dgu, ddn, db1, db2) in enumerate(
            layouts(gate_up, gate_up_bias, down_bias, transposed, interleaved, expert_index)
        ):
            # Sharded: each rank adds its experts' or hidden columns' share to out, dx and
            # d expert_weights.
            share = R if i == 0 else Partial()
            inputs = [R, R, gu, dn, b1, b2, R, R] + [None] * 6 + [ix]
            if backward:
                rules.append(([share, share, dgu, ddn, db1, db2], [R] + inputs))
            else:
                rules.append(([share], inputs))
        return rules

    return dict(
        moe_route=moe_route,
        moe_experts=lambda *args, **kwargs: strategies("moe_experts", False, args, kwargs),
        moe_experts_backward=lambda *args, **kwargs: strategies(
            "moe_experts_backward", True, args, kwargs
        ),
    )


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------


def rules() -> dict:
    """{name in torch.ops.fastlm: its sharding rule}, for every fastlm op."""
    table = {
        **_norm_rules(),
        **_glu_rules(),
        **_rope_rules(),
        **_attention_rules(),
        **_loss_rules(),
        **_moe_rules(),
    }
    return table


_registered = False


def register() -> bool:
    """Register the rules with DTensor (once; fastlm's import does it).

    Returns:
        True where they are registered, False where torch.distributed is not available.
    """
    global _registered
    if _registered:
        return True
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import register_sharding

    import fastlm.kernels.attention.qkv  # noqa: F401  (registers flash_attention_backward_)
    import fastlm.kernels.cross_entropy_options  # noqa: F401  (registers the options ops)

    propagator = DTensor._op_dispatcher.sharding_propagator
    for name, rule in rules().items():
        op = getattr(torch.ops.fastlm, name).default
        register_sharding(op)(rule)
        propagator.op_to_schema_info[op] = _cache_key_info(op)
    _registered = True
    return True


def _cache_key_info(op):
    """Which arguments key DTensor's cache of chosen strategies: every non-tensor one.
    `register_sharding` keys only those from the first int argument on, so a strategy chosen
    for one call would be reused for a call that differs in a bool, a float or a string before
    it: the experts' F shard of `interleaved=True` for the halves layout (wrong results),
    attention's for another `causal`."""
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    def is_tensor(argument) -> bool:
        kind = argument.type
        if isinstance(kind, torch.OptionalType):
            kind = kind.getElementType()
        if isinstance(kind, torch.ListType):
            kind = kind.getElementType()
        return isinstance(kind, torch.TensorType)

    arguments = op._schema.arguments
    positional = [i for i, a in enumerate(arguments) if not a.kwarg_only and not is_tensor(a)]
    keywords = [a.name for a in arguments if a.kwarg_only and not is_tensor(a)]
    first = positional[0] if positional else len(arguments)
    return RuntimeSchemaInfo(first, keywords or None, needs_pytree=True)
