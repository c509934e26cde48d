"""fastlm: Triton fused kernels for training decoder-only language models faster.

`fastlm.reference` holds the plain PyTorch math every kernel is checked against;
`fastlm.kernels` the kernels; `fastlm.backend` decides which of the two runs.
"""

from fastlm import reference
from fastlm.backend import backend, use_triton
from fastlm.sampling import generate

__version__ = "0.1.0"

__all__ = ["reference", "backend", "use_triton", "generate", "__version__"]
