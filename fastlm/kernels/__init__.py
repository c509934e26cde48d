"""fastlm's ops: Triton kernels with their backward, registered as `torch.ops.fastlm.*`.

One file per op, each read top to bottom in the same order: the math (docstring), the reference
math in PyTorch (`<op>_ref`: the PyTorch backend, and what tests and benchmarks compare with),
the kernels, their launchers, the torch.library registration (fake tensors and autograd), and
the public functions, which apply the backend rule (`fastlm.backend.use_triton`) once.
"""

from fastlm.kernels.attention import (
    attention_ref,
    attention_varlen_ref,
    flash_attention,
    flash_attention_varlen,
    rope_attention,
    rope_attention_ref,
)
from fastlm.kernels.cross_entropy import (
    cross_entropy,
    cross_entropy_ref,
    linear_cross_entropy,
    linear_cross_entropy_ref,
)
from fastlm.kernels.cross_entropy_options import cross_entropy_options_ref
from fastlm.kernels.geglu import geglu, geglu_ref
from fastlm.kernels.rmsnorm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref
from fastlm.kernels.rope import apply_rope_, rope_ref, rope_tables
from fastlm.kernels.swiglu import swiglu, swiglu_packed, swiglu_packed_ref, swiglu_ref

__all__ = [
    "add_rms_norm", "apply_rope_", "cross_entropy", "flash_attention", "flash_attention_varlen",
    "geglu", "linear_cross_entropy", "rms_norm", "rope_attention", "rope_tables", "swiglu",
    "swiglu_packed", "add_rms_norm_ref", "attention_ref", "attention_varlen_ref",
    "rope_attention_ref", "cross_entropy_ref", "cross_entropy_options_ref", "geglu_ref",
    "linear_cross_entropy_ref", "rms_norm_ref", "rope_ref", "swiglu_packed_ref", "swiglu_ref"
]
