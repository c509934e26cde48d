"""fastlm's ops: Triton kernels with their backward, registered as `torch.ops.fastlm.*`.

One file per op, each read top to bottom in the same order: the math (docstring), the reference
math in PyTorch, the kernels, their launchers, the torch.library registration (fake tensors and
autograd), and the public functions, which apply the backend rule (`fastlm.backend.use_triton`)
once. The reference math of `torch.ops.fastlm.<op>` and of the public function of the same name is
`<op>_ref` in the op's module (`fastlm.kernels.rmsnorm.rms_norm_ref`,
`fastlm.kernels.attention.flash_attention_ref`): the PyTorch backend, and what the tests and
benchmarks compare with; it is not exported here, beside the ops.
"""

from fastlm.kernels import cross_entropy_options  # noqa: F401 (registers its ops)
from fastlm.kernels.attention import flash_attention, flash_attention_varlen, rope_attention
from fastlm.kernels.cross_entropy import cross_entropy
from fastlm.kernels.geglu import geglu
from fastlm.kernels.linear_cross_entropy import linear_cross_entropy
from fastlm.kernels.moe import moe_experts
from fastlm.kernels.rmsnorm import add_rms_norm, rms_norm
from fastlm.kernels.rope import apply_rope_, rope_tables
from fastlm.kernels.swiglu import swiglu, swiglu_packed

__all__ = [
    "add_rms_norm", "apply_rope_", "cross_entropy", "flash_attention", "flash_attention_varlen",
    "geglu", "linear_cross_entropy", "moe_experts", "rms_norm", "rope_attention", "rope_tables",
    "swiglu", "swiglu_packed"
]
