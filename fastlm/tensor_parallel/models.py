"""What one rank of the tensor-parallel plan holds and sends: the memory and traffic models
(docs/tensor-parallel.md).

`memory_model` counts the bytes of a rank's parameters, gradients, AdamW moments and one block's
saved activations under `parallelize` (and FSDP2 over the data ranks); `collective_model` counts
the collectives of one training step and their output buffers' bytes. Both are arithmetic on the
model's config, no tensors and no process group: benchmarks/tensor_parallel.py measures against
them (tests/test_tensor_parallel.py runs its --simulate, which exits 0 only if they match).
They count dense models: a mixture of experts' layers, replicated over the tensor group
(`plan._SequenceParallelMoe`), are not in them.
"""

from fastlm.tensor_parallel.tokens import ALL_GATHER, REDUCE_SCATTER

__all__ = ["collective_model", "memory_model"]


def _sizes(config: dict) -> tuple[int, ...]:
    C, H = config["d_model"], config["num_heads"]
    Hkv = config.get("num_kv_heads") or H
    return C, H, Hkv, C // H, config["d_ff"], config["vocab_size"], config["num_layers"]


def memory_model(config: dict, tensor: int, tokens: int, *, data: int = 1) -> dict:
    """Bytes one rank holds training a fastlm.Transformer under `parallelize` (fp32 weights,
    AdamW, no autocast; FSDP2 over `data` ranks shards every parameter `data` ways).

    Args:
        config: the model's constructor arguments (d_model, num_heads, num_kv_heads, d_ff,
            vocab_size, num_layers, tie_embeddings).
        tensor: T, the tensor-parallel group's size.
        tokens: N, the tokens of the rows the tensor group computes together (B x the sequence,
            or x its context shard).
        data: the FSDP2 ranks each parameter is sharded over (1: none, or DDP).

    Returns:
        parameters, gradients, optimizer (AdamW's two moments), and activations_per_layer: what
        one block saves for the backward (fp32): per sub-layer the sequence-parallel norm's input
        and rstd (N / T tokens), the gathered normed input of its first GEMM (N tokens), and the
        rank's share of q|k|v (rotated), the attention output and its log-sum-exp, or of gate,
        up and silu(gate) * up.
    """
    C, H, Hkv, D, F, V, L = _sizes(config)
    T = tensor
    layer = ((H + 2 * Hkv) * D * C + H * D * C + 3 * F * C) // T + 2 * C
    heads = 1 if config.get("tie_embeddings") else 2
    parameters = 4 * (L * layer + heads * V * C // T + C) // data
    local = tokens // T
    activations = 4 * (
        2 * (local * C + local)  # each norm's input and rstd
        + 2 * tokens * C  # the gathered normed inputs of qkv and W1|W3
        + tokens * ((H + 2 * Hkv) * D + H * D + 3 * F) // T  # qkv, o; gate, up, h
        + tokens * H // T  # the log-sum-exp
    )
    return dict(
        parameters=parameters,
        gradients=parameters,
        optimizer=2 * parameters,
        activations_per_layer=activations,
    )


def collective_model(config: dict, tensor: int, tokens: int) -> dict:
    """The collectives of one training step (loss, backward, `reduce_gradients`) on one rank of
    the tensor group, and their output buffers' bytes (fp32 activations).

    Per block: an all-gather of the N tokens into attention and into the feed-forward, and a
    reduce-scatter of their outputs (N / T tokens out), each transposed in the backward. Once per
    step: the embedding's reduce-scatter (and its all-gather back), the loss's all-gathers of the
    hidden states and targets, its two all-reduces (MAX of the row maxima; SUM of the sums of
    exps and target logits) and the reduce-scatter of its input gradient, and one all-reduce of
    the norms' gradients.

    Returns:
        calls: (all-gathers, reduce-scatters, all-reduces); bytes: {kind: bytes}.
    """
    C, H, Hkv, D, F, V, L = _sizes(config)
    tokens_bytes, shard_bytes = 4 * tokens * C, 4 * tokens * C // tensor
    return dict(
        calls=(4 * L + 3, 4 * L + 2, 3),
        bytes=dict(
            **{ALL_GATHER: (4 * L + 2) * tokens_bytes + 8 * tokens},
            **{REDUCE_SCATTER: (4 * L + 2) * shard_bytes},
            all_reduce=4 * tokens + 4 * 3 * tokens + 4 * (2 * L + 1) * C,
        ),
    )
