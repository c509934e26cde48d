"""fastlm: Triton fused kernels for training decoder-only language models faster.

- `fastlm.reference`: the plain PyTorch math every kernel is checked against.
- `fastlm.kernels`: the ops (RMSNorm, residual-add + RMSNorm, RoPE, SwiGLU, GeGLU, flash
  attention, cross-entropy, mixture-of-experts experts), Triton kernels with their backward,
  registered as `torch.ops.fastlm.*`.
- `fastlm.modules`: nn.Module drop-ins for the reference's (RmsNorm, RoPE, SwiGlu,
  CrossEntropyLoss).
- `fastlm.Transformer` and its parts: drop-ins for the reference's modules, built on the kernels.
- `fastlm.sample`: sampling (temperature, top-k, top-p) with a KV cache; `fastlm.ModelConfig`,
  `fastlm.build_model`: a model's configuration and the model built from it.
- `fastlm.cli`: the commands, `fastlm-train` and `fastlm-generate` (also `python -m
  fastlm.cli.train`, `python -m fastlm.cli.generate`).
- `fastlm.backend`: which of kernels and PyTorch runs (FASTLM_BACKEND): the module, with
  `selected()` and `use_triton` (also `fastlm.use_triton`).
- `fastlm.distributed`: context parallelism, one sequence over the ranks of a process group.
- `fastlm.hf`: Hugging Face models (Llama, Mistral, Qwen2/3, Gemma 1-3, Phi-3, Mixtral, Qwen3-MoE)
  patched onto the kernels (`patch`), and weights converted to and from `fastlm.Transformer`
  (`from_hf`, `to_hf`); needs transformers (`pip install fastlm[hf]`), imported only when one of
  them is called.
"""

from fastlm import hf, reference
from fastlm.backend import use_triton
from fastlm.config import ModelConfig, build_model
from fastlm.kernels import (
    add_rms_norm,
    apply_rope_,
    cross_entropy,
    flash_attention,
    flash_attention_varlen,
    geglu,
    linear_cross_entropy,
    moe_experts,
    rms_norm,
    rope_attention,
    swiglu,
    swiglu_packed,
)
from fastlm.model import KVCache, MultiHeadAttentionWithRoPE, Transformer, TransformerBlock
from fastlm.modules import CrossEntropyLoss, RmsNorm, RoPE, SwiGlu
from fastlm.sampling import sample

__version__ = "0.1.0"

__all__ = [
    "reference",
    "hf",
    "use_triton",
    "sample",
    "ModelConfig",
    "build_model",
    "__version__",
    "Transformer",
    "TransformerBlock",
    "MultiHeadAttentionWithRoPE",
    "KVCache",
    "RmsNorm",
    "RoPE",
    "SwiGlu",
    "CrossEntropyLoss",
    "rms_norm",
    "add_rms_norm",
    "apply_rope_",
    "swiglu",
    "swiglu_packed",
    "geglu",
    "flash_attention",
    "flash_attention_varlen",
    "rope_attention",
    "cross_entropy",
    "linear_cross_entropy",
    "moe_experts",
]

from fastlm import sharding  # noqa: E402

sharding.register()  # DTensor sharding rules for torch.ops.fastlm.* (where torch.distributed is)
