"""Test set-up: Triton's interpreter on machines without CUDA, fresh seeds, poisoned outputs,
and a test run that writes nothing into the repository.

TRITON_INTERPRET must be set before triton is first imported, so this runs before fastlm is.
`import torch` does not import triton, which lets us ask torch whether CUDA exists first.

Tests write under their tmp paths only. The tools that would write into the working directory
are pointed elsewhere: Hypothesis keeps its example database and caches in `.hypothesis/`
(here: no database, and a temporary folder for the rest), pytest-benchmark makes `.benchmarks/`
at start-up (here: a temporary folder). A run that leaves new files in the repository anyway
fails, naming them.
"""

import contextlib
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch
from hypothesis import configuration as hypothesis_configuration
from hypothesis import settings

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n N runs N worker processes: one torch thread each, or they oversubscribe the cores.
    torch.set_num_threads(1)

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
#: Written by Python and pytest themselves, not by the tests: never counted.
RUN_CACHES = {"__pycache__", ".pytest_cache"}
#: The repository's own metadata and a developer's tools, which other processes may touch.
NOT_OURS = {".git", ".venv", ".ruff_cache"}
REPOSITORY_FILES = pytest.StashKey[set]()

# This process's scratch folder for the tools' files, removed at the end of the session.
SCRATCH = Path(tempfile.mkdtemp(prefix="fastlm-tests-"))
hypothesis_configuration.set_hypothesis_home_dir(SCRATCH / "hypothesis")
settings.register_profile("fastlm", database=None)
settings.load_profile("fastlm")


def _patch_the_language_once_per_launch() -> None:
    """Triton's interpreter (3.9) re-patches triton.language's builtins, walking every module
    member with `inspect.getmembers`, on every call of a @triton.jit device function inside a
    kernel, although the launch patched them already (and restores them when it ends): kernels
    that call helpers in their loops (the MoE kernels, attention's) spend up to 40% of their
    interpreted time there. Here a device call whose language modules the running launch has
    patched skips it; any other call patches as before. Test time only: what runs is unchanged."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # tests/without_triton.py hides triton
        return

    original, patched = interpreter._patch_lang, set()

    class LaunchScope:
        def __init__(self, scope):
            self.scope = scope

        def restore(self):
            patched.clear()
            self.scope.restore()

    class Nothing:
        def restore(self):
            pass

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if patched and langs <= patched:
            return Nothing()
        scope = original(fn)
        patched.update(langs)
        return LaunchScope(scope)

    interpreter._patch_lang = patch_lang


def _numpy_dtypes_by_name() -> None:
    """Triton's interpreter (3.9) maps a Triton dtype to its NumPy storage dtype through
    `_get_np_dtype`, which builds its table of 18 entries (each key hashed in Python) on every
    call: several times per op of every program of every launch. Here the table is built once,
    keyed by the dtype's name (what Triton's dtypes compare by); a name not in it goes to the
    original function, which raises as before. Test time only: the mapping is unchanged."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # tests/without_triton.py hides triton
        return

    original = interpreter._get_np_dtype
    names = ("int1", "float16", "float32", "float64", "int8", "uint8", "int16", "uint16",
             "int32", "uint32", "int64", "uint64", "bfloat16", "float8e5", "float8e5b16",
             "float8e4nv", "float8e4b8", "float8e4b15")  # fmt: skip
    by_name = {getattr(tl, n).name: original(getattr(tl, n)) for n in names}
    address = original(tl.pointer_type(tl.int8))

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return address
        found = by_name.get(tt_dtype.name)
        return found if found is not None else original(tt_dtype)

    interpreter._get_np_dtype = get_np_dtype


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_per_launch()
    _numpy_dtypes_by_name()

import fastlm.kernels._common as kernel_common  # noqa: E402
from fastlm.kernels.linear import has_mixed_gemm  # noqa: E402
from fastlm.testing import mixed_gemms_on_cpu  # noqa: E402

kernel_common.POISON_OUTPUTS = True

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

#: The tiny model the tests build (`from conftest import TINY_MODEL`): 2 layers, 2 heads of 16,
#: an odd vocabulary.
TINY_MODEL = dict(
    vocab_size=61,
    context_length=24,
    d_model=32,
    num_layers=2,
    num_heads=2,
    d_ff=48,
    rope_theta=10000.0,
)


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


def pytest_addoption(parser):
    parser.addoption(
        "--fresh-seeds",
        type=int,
        default=0,
        metavar="N",
        help="run each selected test N times, each with a fresh seed (tools/rerun_seeds.py)",
    )


def pytest_generate_tests(metafunc):
    """--fresh-seeds N: each test once per run index, so one session draws N seeds for it."""
    runs = metafunc.config.getoption("fresh_seeds")
    if runs > 0:
        if "FASTLM_TEST_SEED" in os.environ:
            raise pytest.UsageError("--fresh-seeds draws its own seeds: unset FASTLM_TEST_SEED")
        metafunc.fixturenames.append("seed_run")
        metafunc.parametrize("seed_run", range(runs), indirect=True, ids=lambda i: f"run{i}")


@pytest.fixture
def seed_run(request):
    """The run index under --fresh-seeds (the seed itself is fresh_seed's)."""
    return request.param


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


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # pytest-benchmark opens its storage (and makes the folder) in its own pytest_configure: a
    # storage left at its default goes to the scratch folder instead of ./.benchmarks.
    if config.getoption("benchmark_storage", None) == "file://./.benchmarks":
        config.option.benchmark_storage = f"file://{SCRATCH / 'benchmarks'}"


def pytest_unconfigure(config):
    shutil.rmtree(SCRATCH, ignore_errors=True)


def repository_files() -> set[str]:
    """Every file and folder in the repository, relative to it, caches and metadata aside."""
    found = set()
    for folder, subfolders, files in os.walk(REPO):
        top = Path(folder) == REPO
        subfolders[:] = [
            name for name in subfolders if name not in RUN_CACHES and not (top and name in NOT_OURS)
        ]
        relative = Path(folder).relative_to(REPO)
        found.update(str(relative / name) for name in (*subfolders, *files))
    return found


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller of a pytest-xdist run
        session.config.stash[REPOSITORY_FILES] = repository_files()


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if it left files in the repository: tests write under their tmp paths."""
    before = session.config.stash.get(REPOSITORY_FILES, None)
    if before is None:
        return
    added = sorted(repository_files() - before)
    if added:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"the test run wrote into the repository {REPO}: {', '.join(added)}"
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
