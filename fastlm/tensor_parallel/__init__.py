"""Tensor parallelism (docs/tensor-parallel.md): Megatron-style tensor and sequence parallelism for
`fastlm.Transformer`, and the vocabulary-parallel fused linear cross-entropy for any LM head.

Every public name is importable from here. The files, in reading order (each imports only those
above it):

- `tokens.py`: sequence parallelism's collectives: `gather_rows`, `gather_tokens`,
  `scatter_tokens`, `token_shard`, and `ALL_GATHER` / `REDUCE_SCATTER`, the torch.distributed
  functions they call;
- `vocab_parallel.py`: the loss over a vocabulary-sharded LM head (the math in its docstring):
  `vocab_parallel_linear_cross_entropy`, `vocab_parallel_cross_entropy`, `lm_head_cross_entropy`,
  `vocab_range`;
- `plan.py`: the plan for `fastlm.Transformer`: `LAYOUT`, `shard_tensor`, `unshard_tensor`,
  `check_plan`, `parallelize`, `reduce_gradients`, `clip_grad_norm_`, and the whole tensors of a
  sharded model's state and optimizer state (`full_state_dict`, `full_optimizer_state`,
  `shard_optimizer_state`);
- `models.py`: what a rank holds and sends, analytically: `memory_model`, `collective_model`.
"""

from fastlm.tensor_parallel.models import collective_model, memory_model
from fastlm.tensor_parallel.plan import (
    LAYOUT,
    check_plan,
    clip_grad_norm_,
    full_optimizer_state,
    full_state_dict,
    parallelize,
    reduce_gradients,
    shard_optimizer_state,
    shard_tensor,
    unshard_tensor,
)
from fastlm.tensor_parallel.tokens import (
    ALL_GATHER,
    REDUCE_SCATTER,
    gather_rows,
    gather_tokens,
    scatter_tokens,
    token_shard,
)
from fastlm.tensor_parallel.vocab_parallel import (
    lm_head_cross_entropy,
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
