"""Helpers for checking kernels against a float64 reference (used by tests/ and benchmarks/).

- `TOLERANCE[dtype]`: the largest relative error ||out - ref|| / ||ref|| accepted for a kernel
  computing in that dtype (fp32: IEEE fp32 dots; attention's TF32 dots: `attention_dtype`).
- `attention_dtype(dtype, device, allow_tf32)`: the bound's dtype for attention on a device (TF32
  is the float32 contract of the attention kernels on a GPU).
- `assert_close(out, ref, dtype, name)`: relative error against a float64 reference.
- `recomputed_softmax_bound(q, k, scale, dtype)`: the bound for what a backward builds from P
  recomputed out of the saved log-sum-exp, which grows with the scores' magnitude.
- `call_through(mode, func, args, kwargs)`: a dispatch mode's view inside a fastlm op.
- `mixed_gemms_on_cpu()`: the CPU lent CUDA's GEMMs with an fp32 result from half inputs.
- `LargestTensor`: a dispatch mode recording the largest tensor any aten op returns.
- `CollectiveCounter`: counts torch.distributed collectives and their buffers' bytes.

Kernel outputs are poisoned (NaN-filled) by `fastlm.kernels._common.empty` when the test suite sets
`POISON_OUTPUTS`, so an element a kernel never wrote fails these comparisons.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def attention_dtype(dtype: torch.dtype, device, allow_tf32: bool = True) -> torch.dtype:
    """The dtype whose `TOLERANCE` bounds fastlm's attention (and so the model) on `device`.

    TF32 is the float32 contract of the attention kernels on a GPU: with `allow_tf32=True` (the
    default) their float32 dots run in TF32, whose 10-bit mantissa is float16's, so float16's
    bound (about 1e-3 measured, more than float32's 1e-4). `allow_tf32=False` asks for IEEE fp32
    dots. The interpreter's dots are exact fp32 either way, and PyTorch's own float32 matmuls do
    not use TF32 unless `torch.get_float32_matmul_precision()` says so.

    Args:
        dtype: the inputs' dtype.
        device: where the attention runs ("cuda", "cpu" or a torch.device).
        allow_tf32: the `allow_tf32` the call passes (default True, as `flash_attention`'s).

    Returns:
        torch.float16 for float32 with TF32 on CUDA, else dtype.
    """
    tf32 = allow_tf32 and torch.device(device).type == "cuda" and dtype == torch.float32
    return torch.float16 if tf32 else dtype


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / max(||ref||, tiny), computed in float64; NaN anywhere gives inf.

    Args:
        out: the result checked, any dtype.
        ref: the reference, out's shape (usually float64).

    Returns:
        The relative error (Frobenius norms), inf where out is not all finite.

    Raises:
        ValueError: out and ref of two shapes.
    """
    out64, ref64 = out.detach().to(torch.float64), ref.detach().to(torch.float64)
    if out64.shape != ref64.shape:
        raise ValueError(f"shape mismatch: out {tuple(out64.shape)} vs ref {tuple(ref64.shape)}")
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = max(torch.linalg.vector_norm(ref64).item(), 1e-30)
    return torch.linalg.vector_norm(out64 - ref64).item() / denom


def assert_close(
    out: torch.Tensor,
    ref: torch.Tensor,
    dtype: torch.dtype,
    name: str = "output",
    scale: float = 1.0,
) -> None:
    """Assert relative_error(out, ref) <= scale * TOLERANCE[dtype].

    Args:
        out: the kernel's result.
        ref: the float64 (or float32) reference, out's shape.
        dtype: the dtype the kernel computed in: picks the bound in `TOLERANCE`.
        name: what out is, for the message (default "output").
        scale: multiplies the bound (default 1.0), for quantities whose error grows with a
            reduction's length (say, a weight gradient summed over many rows); the caller says
            why when it is not 1.

    Raises:
        AssertionError: naming `name`, the error, the bound and the dtype, when the error exceeds
            the bound.
        ValueError: out and ref of two shapes.
    """
    err = relative_error(out, ref)
    bound = scale * TOLERANCE[dtype]
    assert err <= bound, f"{name}: relative error {err:.3e} > {bound:.1e} ({dtype})"


def recomputed_softmax_bound(q: torch.Tensor, k: torch.Tensor, scale: float, dtype) -> float:
    """The relative-error bound for what a backward builds from P recomputed out of the saved
    log-sum-exp (dV = P^T dO): `TOLERANCE[dtype] + 2 u kappa`.

    P = exp(s - lse) with s = scale * q k^T computed twice, by the forward (inside lse) and again
    by the backward, each time by an fp32 dot whose rounding error is about u * kappa with
    kappa = max_ij scale * sum_d |q_id k_jd| (u = 2^-24, fp32's unit roundoff). The two dots need
    not round alike (their operands come transposed; BLAS and MMA pick their summation order by
    shape), so the exponent is off by up to 2 u kappa and P, the dominant P ~ 1 included, by that
    relative amount. kappa grows with the scores: at |s| ~ 1e3, 2 u kappa ~ 1e-3, above fp32's
    usual 1e-4. An explicit softmax computes s once and subtracts its own row max, so its
    dominant P is exactly 1; any flash-style backward carries this term.

    Args:
        q: (..., Nq, D) queries, k: (..., Nk, D) keys (grouped heads already repeated).
        scale: the softmax scale.
        dtype: the dtype the kernel computed in (picks `TOLERANCE[dtype]`).

    Returns:
        The bound, a float.
    """
    q64, k64 = q.detach().to(torch.float64).abs(), k.detach().to(torch.float64).abs()
    kappa = abs(scale) * (q64 @ k64.transpose(-1, -2)).amax().item()
    return TOLERANCE[dtype] + 2 * (torch.finfo(torch.float32).eps / 2) * kappa


def call_through(mode, func, args=(), kwargs=None):
    """`func(*args, **kwargs)` for a TorchDispatchMode's `__torch_dispatch__` that must see inside
    fastlm's ops.

    A dispatch mode sees a registered op whole (`fastlm.rms_norm.default`), not the aten ops its
    implementation runs. For an op of the `fastlm` namespace this runs the op's Python
    implementation with `mode` active again, so the allocations, matmuls and copies inside it
    reach the mode as they would from plain code.

    Args:
        mode: the dispatch mode (the caller's `self`).
        func: the OpOverload `__torch_dispatch__` received.
        args, kwargs: its arguments (default: none).

    Returns:
        What func returns.
    """
    kwargs = kwargs or {}
    if func.namespace != "fastlm":
        return func(*args, **kwargs)
    from torch._library.custom_ops import OPDEFS  # the implementations torch.library holds

    with mode:
        return OPDEFS[func._schema.name]._init_fn(*args, **kwargs)


@contextlib.contextmanager
def mixed_gemms_on_cpu() -> Iterator[None]:
    """Lend the CPU, while the block runs, the GEMMs with an fp32 result from half inputs that CUDA
    builds have and CPU builds lack.

    Those are `torch.mm(..., out_dtype=)` and `torch.addmm(..., out_dtype=, out=)`; with them a CPU
    run takes the path fastlm takes on CUDA (`fastlm.kernels.linear.has_mixed_gemm`). Like CUDA's,
    they accumulate the half inputs' products (exact in fp32) in out_dtype, so a test can tell
    their result from a half round trip. A context manager; the CPU kernels are removed when the
    block ends.

    Returns:
        A context manager that yields None.
    """

    def mm(a, b, out_dtype):
        return torch.mm(a.to(out_dtype), b.to(out_dtype))

    def addmm_out(acc, a, b, out_dtype, *, beta=1, alpha=1, out):
        return out.copy_(beta * acc + alpha * torch.mm(a.to(out_dtype), b.to(out_dtype)))

    library = torch.library.Library("aten", "IMPL")
    try:
        library.impl("mm.dtype", mm, "CPU")
        library.impl("addmm.dtype_out", addmm_out, "CPU")
        yield
    finally:
        library._destroy()


class LargestTensor(TorchDispatchMode):
    """A dispatch mode that records, in `largest`, the most elements of any tensor an aten op
    returns while it is active: evidence that an op never makes a tensor of some size (the
    logits, say). Use as `with LargestTensor() as mode: ...; mode.largest`."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


class CollectiveCounter:
    """Counts the calls of torch.distributed's collectives `names` (its module functions, wrapped
    while the context lasts, so only callers that look them up at call time are seen) in `calls`,
    and their first argument's bytes (the output buffer of the single-buffer collectives, the
    tensor of all_reduce) in `bytes`."""

    def __init__(self, names):
        from collections import Counter

        self.names = tuple(names)
        self.calls, self.bytes = Counter(), Counter()
        self._saved = {}

    def __enter__(self):
        import torch.distributed as dist

        for name in self.names:
            original = self._saved[name] = getattr(dist, name)

            def wrapped(*args, _name=name, _original=original, **kwargs):
                self.calls[_name] += 1
                # FSDP2 passes its buffers by keyword: the first tensor given, either way.
                given = [*args, *kwargs.values()]
                buffer = next(t for t in given if isinstance(t, torch.Tensor))
                self.bytes[_name] += buffer.numel() * buffer.element_size()
                return _original(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, original in self._saved.items():
            setattr(dist, name, original)
