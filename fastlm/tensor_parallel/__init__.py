"""Tensor parallelism (docs/tensor-parallel.md): every public name, importable from here.

The files are being split by concern; for now `vocab_parallel.py` holds all of it.
"""

from fastlm.tensor_parallel.vocab_parallel import (
    ALL_GATHER,
    LAYOUT,
    REDUCE_SCATTER,
    check_plan,
    clip_grad_norm_,
    collective_model,
    full_optimizer_state,
    full_state_dict,
    gather_rows,
    gather_tokens,
    lm_head_cross_entropy,
    memory_model,
    parallelize,
    reduce_gradients,
    scatter_tokens,
    shard_optimizer_state,
    shard_tensor,
    token_shard,
    unshard_tensor,
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
    vocab_range,
)

__all__ = [
    "ALL_GATHER",
    "LAYOUT",
    "REDUCE_SCATTER",
    "check_plan",
    "clip_grad_norm_",
    "collective_model",
    "full_optimizer_state",
    "full_state_dict",
    "gather_rows",
    "gather_tokens",
    "lm_head_cross_entropy",
    "memory_model",
    "parallelize",
    "reduce_gradients",
    "scatter_tokens",
    "shard_optimizer_state",
    "shard_tensor",
    "token_shard",
    "unshard_tensor",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_linear_cross_entropy",
    "vocab_range",
]
