"""Test set-up: Triton's interpreter on machines without CUDA, fresh seeds, poisoned outputs.

TRITON_INTERPRET must be set before triton is first imported, so this runs before fastlm is.
`import torch` does not import triton, which lets us ask torch whether CUDA exists first.
"""

import contextlib
import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n N runs N worker processes: one torch thread each, or they oversubscribe the cores.
    torch.set_num_threads(1)

import pytest  # noqa: E402

import fastlm.kernels._common as kernel_common  # noqa: E402
from fastlm.kernels.linear import has_mixed_gemm  # noqa: E402
from fastlm.testing import mixed_gemms_on_cpu  # noqa: E402

kernel_common.POISON_OUTPUTS = True

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE


MIXED_GEMM = [pytest.param(False, id="cpu-gemm"), pytest.param(True, id="mixed-gemm")]


@pytest.fixture(params=MIXED_GEMM)
def gemms(request, device):
    """Which GEMMs the device has for half inputs and an fp32 result (`fastlm.kernels.linear`):
    on the CPU, once as it is (no such GEMM: the bf16 product is cast, autocast's numbers) and
    once with them lent (`mixed_gemms_on_cpu`), the path CUDA takes; on CUDA only the latter."""
    if device == "cpu":
        with mixed_gemms_on_cpu() if request.param else contextlib.nullcontext():
            assert has_mixed_gemm("cpu") == request.param
            yield request.param
    elif not request.param:
        pytest.skip("CUDA has the mixed-precision GEMM: there is no other path to test")
    else:
        assert has_mixed_gemm(device)
        yield True


@pytest.fixture
def one_thread():
    """One torch thread: on a shared two-core machine two threads can be ten times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """A new random seed for each test, reported when the test fails.

    Re-run with that seed by setting FASTLM_TEST_SEED.
    """
    seed = int(os.environ.get("FASTLM_TEST_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    return seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        seeds = [v for k, v in item.user_properties if k == "seed"]
        if seeds:
            report.sections.append(("seed", f"FASTLM_TEST_SEED={seeds[0]} reproduces this draw"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
