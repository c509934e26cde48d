"""Which implementation runs: the Triton kernels or PyTorch code of the same math.

`FASTLM_BACKEND` (read at each call, so tests and scripts may change it):
- `auto` (default): Triton for CUDA tensors, and for CPU tensors when Triton's interpreter is on
  (`TRITON_INTERPRET=1` set before triton was imported); PyTorch otherwise, so fastlm runs anywhere,
  also where Triton is not installed (it has wheels for Linux only).
- `triton`: always the kernels; a tensor they cannot run on, or a missing Triton, raises an error
  that says what to do.
- `torch`: never the kernels.

Each op's public function asks `use_triton` once and nothing else; `selected()` says what
FASTLM_BACKEND asks for. (`fastlm.backend` is this module: no function of the package has its name.)

This module imports nothing of fastlm: `fastlm.kernels` builds on it (`HAVE_TRITON`,
`interpreting`), never the other way round.
"""

from __future__ import annotations

import os

import torch

# Triton 3.9 contracts a * b + c into one FMA unless TRITON_DEFAULT_FP_FUSION says otherwise, and
# warns that 3.10 turns that default off: every kernel's rounding and instruction count would
# change with the Triton version. fastlm's kernels are written, tested and measured with it on
# (the compile report records the setting); set here, before any kernel compiles, unless the
# environment chose already.
FP_FUSION = os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

try:
    import triton  # noqa: F401 (only whether it imports: fastlm.kernels._common takes it from here)

    HAVE_TRITON = True
except ImportError:  # Linux is the only platform with Triton wheels
    HAVE_TRITON = False

CHOICES = ("auto", "triton", "torch")

MISSING_MESSAGE = (
    "fastlm's Triton kernels need the `triton` package, which is not installed "
    "(pip install triton; it has wheels for Linux). Use FASTLM_BACKEND=torch (or "
    "auto, the default) to run every op on PyTorch instead."
)


def selected() -> str:
    """The backend FASTLM_BACKEND asks for, read at each call (case and surrounding spaces ignored).

    Returns:
        `auto` (the default, also for an empty value), `triton` or `torch`.

    Raises:
        ValueError: any other value.
    """
    choice = os.environ.get("FASTLM_BACKEND", "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"FASTLM_BACKEND must be one of {CHOICES}, got {choice!r}")
    return choice


def interpreting() -> bool:
    """Whether Triton kernels run on the CPU through Triton's interpreter.

    Returns:
        True when TRITON_INTERPRET is "1" (it must be set before triton is imported).
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernels should process tensor `x` (and the tensors that go with it).

    The backend rule (see the module docstring): `torch` never; `auto` for CUDA tensors, and for
    CPU tensors under Triton's interpreter, when Triton is installed; `triton` where the kernels can
    run, and an error elsewhere.

    Args:
        x: the op's main input; only its device is read.

    Returns:
        True to run the kernels, False to run the PyTorch code of the same math.

    Raises:
        ModuleNotFoundError: FASTLM_BACKEND=triton where Triton is not installed.
        ValueError: FASTLM_BACKEND=triton for a tensor the kernels cannot run on (the message says
            or a FASTLM_BACKEND that is not one of `CHOICES`.
    """
    choice = selected()
    if choice == "torch":
        return False
    if not HAVE_TRITON:
        if choice == "triton":
            raise ModuleNotFoundError(f"FASTLM_BACKEND=triton: {MISSING_MESSAGE}")
        return False
    if x.is_cuda or (x.device.type == "cpu" and interpreting()):
        return True
    if choice == "triton":
        raise ValueError(
            f"FASTLM_BACKEND=triton, but a tensor on {x.device} cannot run the Triton kernels: "
            "use a CUDA tensor, or set TRITON_INTERPRET=1 before importing triton for CPU tensors"
        )
    return False
