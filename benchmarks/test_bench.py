"""The headline cases of kernels.py and attention.py through pytest-benchmark (CUDA only).

    pytest benchmarks/ --benchmark-only

Each timed call ends with torch.cuda.synchronize(), so pytest-benchmark's wall clock measures
the GPU's work; compiling and autotuning happen in an untimed call first.
"""

from __future__ import annotations

import _common as common  # first: this checkout's fastlm
import pytest
import torch

pytestmark = pytest.mark.skipif(not common.HAS_CUDA, reason="benchmarks need a CUDA device")
KERNEL_IMPLS = ["fastlm", "reference", "torch.compile(reference)", "liger"]
KERNEL_IMPLS += ["F.rms_norm", "x + r, F.rms_norm", "F.silu(g) * u", "F.cross_entropy"]
ATTENTION_IMPLS = ["fastlm", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flash-attn"]
ATTENTION_IMPLS.append("torch.compile(reference)")


def timed(benchmark, fn, inputs, mode: str) -> None:
    """Benchmark fn(*inputs) (mode "fwd") or its forward and backward."""
    leaves = [t for t in inputs if t.requires_grad]
    grads = [torch.randn_like(o) for o in common.as_tuple(fn(*inputs))]

    def call():
        if mode == "fwd":
            fn(*inputs)
        else:
            for t in leaves:
                t.grad = None
            torch.autograd.backward(common.as_tuple(fn(*inputs)), grads)
        torch.cuda.synchronize()

    call()
    benchmark.pedantic(call, rounds=20, warmup_rounds=3)


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "rope", "swiglu", "cross_entropy"])
def test_kernel(benchmark, op, impl, mode):
    import kernels

    common.raise_compile_limits()
    op = next(o for o in kernels.OPS if o.name == op)
    (m, n), impls = op.sizes[0], op.impls(*op.sizes[0])
    if impl not in impls:
        pytest.skip(f"{impl} is not an implementation of {op.name} here")
    benchmark.group = f"{op.name} {mode} {m}x{n}"
    with torch.set_grad_enabled(op.forward_grad or mode != "fwd"):
        timed(benchmark, impls[impl], op.inputs(m, n), mode)


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("impl", ATTENTION_IMPLS)
@pytest.mark.parametrize("seq", [4096, 16384])
def test_attention(benchmark, seq, impl, mode):
    import attention

    impls, shape = attention.implementations(), attention.filled(seq)
    if impl not in impls:
        pytest.skip(f"{impl} is not available here")
    benchmark.group = f"attention {mode} {shape}"
    inputs = attention.random_inputs(shape.batch, shape.heads, seq, shape.head_dim)
    timed(benchmark, impls[impl], inputs, mode)
