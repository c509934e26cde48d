"""The benchmarks' headline cases through pytest-benchmark (CUDA only; skipped elsewhere).

    pytest benchmarks/ --benchmark-only

Each timed call ends with torch.cuda.synchronize() (and one starts synchronised), so
pytest-benchmark's wall clock measures the GPU work; compilation and autotuning happen in an
untimed call first. The cases and implementations are those of kernels.py and attention.py.
"""

from __future__ import annotations

import _common as common  # first: turns on Triton's interpreter when there is no CUDA
import pytest
import torch

pytestmark = pytest.mark.skipif(not common.HAS_CUDA, reason="benchmarks need a CUDA device")

KERNEL_IMPLS = [
    "fastlm",
    "reference",
    "torch.compile(reference)",
    "F.rms_norm",
    "x + r, F.rms_norm",
    "F.silu(g) * u",
    "F.cross_entropy",
    "liger",
]
ATTENTION_SEQS = [4096, 16384]
ATTENTION_IMPLS = [
    "fastlm",
    "sdpa-flash",
    "sdpa-cudnn",
    "sdpa-efficient",
    "flash-attn",
    "torch.compile(reference)",
]


def _run_synchronised(benchmark, fn, forward_only: bool, inputs) -> None:
    """Benchmark fn(*inputs) (forward) or its forward+backward, synchronising around each call."""
    if forward_only:

        def call():
            fn(*inputs)
    else:
        grads = [torch.randn_like(o) for o in common.as_tuple(fn(*inputs))]
        leaves = [t for t in inputs if t.requires_grad]

        def call():
            for t in leaves:
                t.grad = None
            torch.autograd.backward(common.as_tuple(fn(*inputs)), grads)

    def timed():
        call()
        torch.cuda.synchronize()

    timed()  # compile and autotune outside the timing
    benchmark.pedantic(timed, rounds=20, warmup_rounds=3)


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("op_name", ["rms_norm", "add_rms_norm", "rope", "swiglu", "cross_entropy"])
def test_kernel(benchmark, op_name, impl, mode):
    import kernels

    common.raise_compile_limits()
    op = next(op for op in kernels.OPS if op.name == op_name)
    m, n = op.quick_sizes[0]  # kernels.py --quick's size
    impls = op.impls(m, n)
    if impl not in impls:
        pytest.skip(f"{impl} is not an implementation of {op_name} here")
    benchmark.group = f"{op_name} {mode} {m}x{n}"
    inputs = op.make_inputs(m, n)
    with torch.set_grad_enabled(op.forward_grad or mode != "fwd"):
        _run_synchronised(benchmark, impls[impl], mode == "fwd", inputs)


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("impl", ATTENTION_IMPLS)
@pytest.mark.parametrize("seq", ATTENTION_SEQS)
def test_attention(benchmark, seq, impl, mode):
    import attention

    common.raise_compile_limits()
    impls, _ = attention.implementations()
    if impl not in impls:
        pytest.skip(f"{impl} is not available here")
    shape = attention.Shape("bf16", 128, max(1, attention.FILL_TOKENS // seq), seq)
    benchmark.group = f"attention {mode} {shape}"
    inputs = [
        torch.randn(
            shape.batch, shape.heads, shape.seq, shape.head_dim, device="cuda", dtype=torch.bfloat16
        ).requires_grad_()
        for _ in range(3)
    ]
    _run_synchronised(benchmark, impls[impl], mode == "fwd", inputs)
