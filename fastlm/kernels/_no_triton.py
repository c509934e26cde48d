"""What `fastlm.kernels._common` offers in place of `triton` where Triton is not installed.

Triton has wheels for Linux only. Elsewhere (macOS, Windows) fastlm still imports and runs every
op on PyTorch (the backend rule in `fastlm.backend` never picks the kernels then), so the op files
must still be importable: their decorators (`triton.jit`, `triton.autotune`) and config lists
(`triton.Config`) need names to call. This module gives them those names; a kernel defined through
it cannot be launched, and says so.
"""

from __future__ import annotations

import types

from fastlm.backend import MISSING_MESSAGE


class _UnlaunchableKernel:
    """A `@triton.jit` function without Triton: keeps the Python function, refuses to launch."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")

    def __getitem__(self, grid):
        raise ModuleNotFoundError(MISSING_MESSAGE)

    def __call__(self, *args, **kwargs):
        raise ModuleNotFoundError(MISSING_MESSAGE)


def jit(fn=None, **options):
    if fn is None:
        return _UnlaunchableKernel
    return _UnlaunchableKernel(fn)


def autotune(configs, key, **options):
    return lambda kernel: kernel


class Config:

    def __init__(self, kwargs, num_warps=4, num_stages=3, **options):
        self.kwargs, self.num_warps, self.num_stages = kwargs, num_warps, num_stages


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


#: `tl` appears only in kernel bodies and (string) annotations, neither of which runs here.
language = types.SimpleNamespace()
