"""What every op file shares: the Triton import, argument checks, output allocation, launch helpers.

This is the one module the op files take Triton from (`fastlm.backend.HAVE_TRITON` says whether it
imports). Where Triton is not installed, `triton` and `tl` are `fastlm.kernels._no_triton`'s
stand-ins, which let the op files define their kernels and refuse to launch them;
`fastlm.backend` then runs every op on PyTorch.
"""

from __future__ import annotations

import functools

import torch

from fastlm.backend import HAVE_TRITON, interpreting

if HAVE_TRITON:  # fastlm.backend tried the import
    import triton
    import triton.language as tl
else:
    from fastlm.kernels import _no_triton as triton

    tl = triton.language

#: Kernel dtypes. Anything else is a TypeError naming the argument.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: When True (the test suite sets it), kernel outputs are allocated filled with NaN, so that an
#: element a kernel forgot to write fails the comparison with the reference.
POISON_OUTPUTS = False


def empty(shape, *, device, dtype) -> torch.Tensor:
    """torch.empty, or a NaN-filled tensor under POISON_OUTPUTS."""
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), device=device, dtype=dtype)
    return torch.empty(shape, device=device, dtype=dtype)


def empty_like(t: torch.Tensor, dtype=None) -> torch.Tensor:
    """A contiguous output like `t` (poisoned under POISON_OUTPUTS); a DTensor's is a DTensor
    of the same placements (torch's *_like functions keep them)."""
    dtype = dtype or t.dtype
    fmt = torch.contiguous_format
    if POISON_OUTPUTS:
        return torch.full_like(t, float("nan"), dtype=dtype, memory_format=fmt)
    return torch.empty_like(t, dtype=dtype, memory_format=fmt)


def check_float(name: str, t: object) -> None:
    """TypeError unless `t` is a tensor of a kernel dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_match(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """ValueError/TypeError unless `t` has the dtype and device of `ref`."""
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype}, but {ref_name} has {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device}, but {ref_name} is on {ref.device}")


def check_values(values: torch.Tensor, valid: torch.Tensor, message: str) -> None:
    """ValueError(message) unless `valid` (a bool tensor of `values`' shape) holds everywhere:
    checked on the host for CPU tensors; on a GPU and under torch.compile a device-side assert
    (no host sync per step). For index arguments (targets, expert ids)."""
    if values.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool(valid.all()):
            bad = values[~valid]
            raise ValueError(f"{message}; got {bad.numel()} outside, e.g. {int(bad[0])}")
    else:
        torch._assert_async(valid.all(), message)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x viewed as (rows, last dim) with a unit stride on the last dim, copying only if needed."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:  # leading dims not collapsible into one stride
        return x.reshape(-1, x.shape[-1])


def interpreter_bf16(dtype: torch.dtype) -> bool:
    """Whether a kernel must work around Triton's interpreter for bf16, which gets two things
    wrong: `tl.dot` multiplies the uint16 bit patterns (triton-lang/triton#11584), so dot operands
    are upcast to fp32; and fp32 -> bf16 casts truncate instead of rounding to nearest even, so
    stores round by hand (`round_to`) to give the numbers a GPU and PyTorch give."""
    return interpreting() and dtype == torch.bfloat16


@triton.jit
def round_to(x, dtype: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """x (fp32) rounded to `dtype`, to nearest even.

    Under BF16_BY_HAND (set from `interpreter_bf16`, or `interpreting()` by a kernel whose stores
    have several dtypes) a bf16 result is rounded on the bits: add half an ulp of bf16 (ties to
    even) and keep the high 16 bits; every other cast rounds by itself.
    """
    if BF16_BY_HAND and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        rounded = x.to(dtype)
    return rounded


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (a fixed small grid under the interpreter)."""
    if not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(t: torch.Tensor) -> int:
    return num_sms(t.device.index if t.is_cuda else -1)


def capability(tensor: torch.Tensor) -> int:
    """The compute capability (major) of a tensor's CUDA device; 0 off CUDA: what the launchers
    that choose their tiles or their schedule per GPU generation read."""
    return torch.cuda.get_device_capability(tensor.device)[0] if tensor.is_cuda else 0


def refuse_double_backward(backward_op, op_name: str) -> None:
    """Make a second derivative through `op_name` an error that says so.

    fastlm's backward kernels are not differentiable themselves. Their ops get an autograd formula
    that raises, so `torch.autograd.grad(..., create_graph=True)` followed by a backward through
    the first gradient fails loudly instead of silently dropping the second-order terms.
    """

    def backward(ctx, *grads):
        raise RuntimeError(
            f"fastlm.{op_name}: second derivatives are not supported (a backward "
            "through its gradient, e.g. after create_graph=True)"
        )

    def setup_context(ctx, inputs, output):
        pass

    torch.library.register_autograd(backward_op, backward, setup_context=setup_context)
