"""fastlm's Triton kernels, each with its backward, wrapped as autograd functions.

Every public function follows the backend rule (`fastlm.backend.use_triton`): the kernels for CUDA
tensors (and CPU tensors under Triton's interpreter), PyTorch code of the same math otherwise.
"""

from fastlm.kernels.attention import flash_attention
from fastlm.kernels.cross_entropy import CrossEntropyLoss, cross_entropy, linear_cross_entropy
from fastlm.kernels.rmsnorm import RmsNorm, add_rms_norm, rms_norm
from fastlm.kernels.rope import RoPE, apply_rope_, rope_tables
from fastlm.kernels.swiglu import SwiGlu, swiglu, swiglu_packed

__all__ = [
    "CrossEntropyLoss", "RmsNorm", "RoPE", "SwiGlu",
    "add_rms_norm", "apply_rope_", "cross_entropy", "flash_attention", "linear_cross_entropy",
    "rms_norm", "rope_tables", "swiglu", "swiglu_packed",
]
