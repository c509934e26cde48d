"""The kernels as Triton compiles them for an H100/H200 (sm_90a) and a B200/B300 (sm_100a),
checked without a GPU.

The whole compile report (every op and shipped config on sm_90a, sm_80 and sm_100a) takes tens of
minutes, so it is kept in the repository (`benchmarks/baselines/compile_report.json`) with a
fingerprint of the kernels' code, and `compile_report.py --check-baseline` proves it is this
code's and flags nothing. Most tests here read that kept report: on sm_90a, the CI's selection
(bf16 row-wise kernels, RoPE at head dims 64 and 128, every attention config at head dim 128,
causal, plain and with a window, the cap and packed sequences): no shipped config spills or needs
more shared memory than Hopper has, the memory-bound kernels move 16-byte vectors on their main
path, attention uses Hopper's tensor cores (wgmma) and TMA where it should; on sm_100a, every
row: no spill, shared memory and tensor memory (512 columns) within Blackwell's, and every
kernel with a `tl.dot` on tcgen05.

One small sample is compiled now (`report`: the RMSNorm forwards for sm_90a, seconds, in a
subprocess without TRITON_INTERPRET, which conftest.py sets here): the script runs and prints its
tables, `--same-code-as` finds changed code, and the sample's PTX is the kept rows' PTX, digest
for digest: the kept report is what this Triton makes of this code, not only of code with the
same fingerprint.
"""

import importlib
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

#: The memory-bound ops: each must reach 16-byte loads (and stores, where it stores bf16 data).
MEMORY_BOUND = (
    "RMSNorm fwd",
    "add+RMSNorm fwd",
    "RMSNorm bwd",
    "add+RMSNorm bwd",
    "RoPE interleaved",
    "RoPE half-split",
    "SwiGLU fwd",
    "SwiGLU bwd",
    "cross-entropy fwd+grad",
    "cross-entropy fwd",
)
#: The attention kernels that multiply matrices (the delta kernel is a row sum).
TENSOR_CORE_KERNELS = (
    "_attention_fwd_kernel",
    "_attention_fwd_tma_kernel",
    "_attention_bwd_dkdv_kernel",
    "_attention_bwd_dq_kernel",
)


def _ptxas_missing() -> str | None:
    """Why the report cannot run here, or None."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(90).path
    except Exception as error:  # no NVIDIA backend in this Triton build, or no ptxas in it
        return f"Triton's ptxas for sm_90a is not available: {error}"
    if not os.access(path, os.X_OK):
        return f"Triton's ptxas for sm_90a is not executable at {path}"
    return None


#: The kept whole report (`compile_report.py --baseline`), and the op the sample compiles now.
KEPT_REPORT = REPO / "benchmarks" / "baselines" / "compile_report.json"
SAMPLE_OP = "RMSNorm fwd"
#: The attention rows of the CI's selection (`compile_report.cases(quick=True)`): head dim 128,
#: (causal, option).
QUICK_ATTENTION = {(True, None), (True, "window"), (False, "window"), (True, "softcap")}
QUICK_ATTENTION |= {(True, "varlen")}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """(completed process, rows) of the sample: the RMSNorm forwards, bf16, sm_90a."""
    reason = _ptxas_missing()
    if reason:
        pytest.skip(reason)
    rows_path = tmp_path_factory.mktemp("compile_report") / "rows.json"
    same = ["--same-code-as", str(KEPT_REPORT)] if _kept_by_this_triton() else []
    result = _run_report(
        "--quick", "--arch", "sm_90a", "--op", SAMPLE_OP, "--json", str(rows_path), *same
    )
    assert rows_path.exists(), f"no rows written:\n{result.stdout}\n{result.stderr}"
    return result, json.loads(rows_path.read_text())


def _kept_by_this_triton() -> bool:
    return _kept()["triton"] == importlib.import_module("triton").__version__


def _kept() -> dict:
    return json.loads(KEPT_REPORT.read_text())


@pytest.fixture(scope="module")
def kept_quick() -> list[dict]:
    """The kept report's sm_90a rows of the CI's selection (`QUICK_ATTENTION`, bf16)."""
    rows = [row for row in _kept()["rows"] if row["arch"] == "sm_90a" and row["dtype"] == "bf16"]
    return [
        row
        for row in rows
        if not row["op"].startswith(("attention", "MoE"))
        or (row.get("head_dim") == 128 and "head_dim_v" not in row
            and (row["causal"], row["option"]) in QUICK_ATTENTION)
    ]  # fmt: skip


def _run_report(*args: str) -> subprocess.CompletedProcess:
    """compile_report.py with these arguments, in a subprocess without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "compile_report.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=900,
    )


def _describe(row: dict) -> str:
    return (
        f"{row['op']} {row['kernel']} {row['case']} {row['blocks']} "
        f"w{row.get('num_warps')} s{row.get('num_stages')}"
    )


def test_report_runs_and_prints_its_table(report):
    result, rows = report
    assert result.returncode == 0, (
        f"exit status {result.returncode}:\n{result.stdout}\n{result.stderr}"
    )
    assert result.stdout.startswith("| op | kernel |")
    assert len(result.stdout.splitlines()) >= len(rows) + 2  # header, rule, one line per row
    assert {row["op"] for row in rows} == {"RMSNorm fwd", "add+RMSNorm fwd"}


def test_sample_compiles_to_the_kept_code(report):
    """The rows compiled now have the PTX (debug info aside) of the same rows kept, as
    `--same-code-as` the kept report says: the kept report is what this Triton makes of this
    code."""
    result, rows = report
    if not _kept_by_this_triton():
        pytest.skip(f"the kept report was compiled by Triton {_kept()['triton']}")
    digests = {_row_key(row): row["ptx_sha256"] for row in _kept()["rows"]}
    assert rows and all(digests[_row_key(row)] == row["ptx_sha256"] for row in rows)
    assert f"same code as before: {len(rows)} of {len(rows)} rows" in result.stdout


def _row_key(row: dict) -> tuple:
    config = json.dumps(row["blocks"], sort_keys=True), row.get("num_warps"), row.get("num_stages")
    return row["op"], row["kernel"], row["case"], *config, row["arch"]


def test_the_ci_selection_is_in_the_kept_report(kept_quick):
    ops = {row["op"] for row in kept_quick}
    assert set(MEMORY_BOUND) | {"attention fwd", "attention bwd"} <= ops
    kernels = {row["kernel"] for row in kept_quick}
    assert set(TENSOR_CORE_KERNELS) | {"_attention_bwd_delta_kernel"} <= kernels


def test_no_shipped_config_spills_or_overflows_shared_memory(kept_quick):
    rows = kept_quick
    assert all(row["arch"] == "sm_90a" for row in rows)
    flagged = [f"{_describe(row)}: {', '.join(row['problems'])}" for row in rows if row["problems"]]
    assert not flagged, "\n".join(flagged)
    for row in rows:  # the flags above come from these numbers
        assert row["spill_stores"] == row["spill_loads"] == 0, _describe(row)
        assert 0 <= row["shared"] <= row["shared_limit"] == 232448, _describe(row)
        assert 0 < row["registers"] <= 255, _describe(row)


def test_the_kept_whole_report_is_this_codes_and_flags_nothing():
    """The whole report (every op and shipped config, sm_90a, sm_80 and sm_100a) takes tens of
    minutes, so it is kept in the repository with a fingerprint of the kernels' code: it must be
    this code's (a kernel change is reported again before it lands) and flag no row."""
    result = _run_report("--check-baseline")
    assert result.returncode == 0, result.stdout + result.stderr


def test_memory_bound_kernels_move_16_byte_vectors(kept_quick):
    rows = kept_quick
    checked = set()
    for row in rows:
        if row["op"] not in MEMORY_BOUND:
            continue
        assert row["dtype"] == "bf16"
        accesses = row["accesses"]
        widest_load = max(map(int, accesses["ld_main"]), default=0)
        assert widest_load == 16, f"{_describe(row)}: main-path loads {accesses['ld_main']}"
        if row["op"] != "cross-entropy fwd":  # the loss alone is fp32: no bf16 store there
            widest_store = max(map(int, accesses["st_main"]), default=0)
            assert widest_store == 16, f"{_describe(row)}: main-path stores {accesses['st_main']}"
        checked.add(row["op"])
    assert checked == set(MEMORY_BOUND)


def test_rms_norm_backward_keeps_loads_in_flight(kept_quick):
    """The RMSNorm backward loops over rows (one program per SM, partial weight gradients in
    registers); its loop is software-pipelined: the next rows' loads are async copies (cp.async)
    issued while this row is reduced."""
    rows = kept_quick
    backward = [row for row in rows if row["kernel"] == "_rms_norm_bwd"]
    assert backward
    serial = [_describe(row) for row in backward if not row["async_copies"]]
    assert not serial, "no cp.async in:\n" + "\n".join(serial)


def test_attention_uses_hopper_tensor_cores(kept_quick):
    """Every config the autotuners try at head dim 128 bf16 uses wgmma, except the smallest one
    that FASTLM_AUTOTUNE=0 keeps for test runs (32-row blocks: below a warpgroup's 64 rows)."""
    rows = kept_quick
    tuned = [row for row in rows if row["kernel"] in TENSOR_CORE_KERNELS and not row["default"]]
    assert {row["kernel"] for row in tuned} == set(TENSOR_CORE_KERNELS)
    without = [_describe(row) for row in tuned if not row["wgmma"]]
    assert not without, "no wgmma in:\n" + "\n".join(without)
    for row in tuned:  # and Hopper's tensor cores only: no Ampere-style mma.sync left over,
        # except in the atomic-dQ pass, whose 16-row query blocks (all that fit beside its extra
        # dq tile without spilling) are below a warpgroup's 64 rows for the dq product
        if "atomic" not in row["op"]:
            assert row["mma"] == 0, _describe(row)


def test_tensor_core_loops_issue_their_tiles_mma_once(kept_quick):
    """Every attention kernel that multiplies matrices carries its hot loop's figures (the
    report's second table), and no config repeats MMA work across warps (a fallback config,
    kept only for head blocks no better one fits, may: it is noted, not flagged)."""
    rows = kept_quick
    analysed = [row for row in rows if row["kernel"] in TENSOR_CORE_KERNELS]
    assert analysed and all("mix" in row["hot_loop"] for row in analysed)
    for row in analysed:
        figures = row["hot_loop"]
        assert figures["mix"]["mma"] > 0 and figures["mma_issued_flops"] > 0, _describe(row)
        if not any("fallback" in note for note in row["notes"]):
            assert figures["mma_ratio"] <= 1, f"{_describe(row)}: {figures['mma_ratio']}"


def test_descriptor_paths_move_tiles_by_tma(kept_quick):
    """The sm_90 forward path loads Q, K, V and stores O through tensor descriptors, the dQ pass
    loads K and V so: every config of them (plain and with each option) compiles to bulk tensor
    copies (cp.async.bulk.tensor); the pointer dQ pass to none."""
    rows = kept_quick
    for is_descriptor_path in (
        lambda row: row["kernel"] == "_attention_fwd_tma_kernel",
        lambda row: row["op"] == "attention bwd dQ (TMA)",
    ):
        descriptor_rows = [row for row in rows if is_descriptor_path(row)]
        assert {row["option"] for row in descriptor_rows} == {None, "window", "softcap", "varlen"}
        without = [_describe(row) for row in descriptor_rows if not row["tma"]]
        assert not without, "no TMA in:\n" + "\n".join(without)
    pointer_dq = [row for row in rows if row["kernel"] == "_attention_bwd_dq_kernel"]
    pointer_dq = [row for row in pointer_dq if "TMA" not in row["op"]]
    assert pointer_dq and not any(row["tma"] for row in pointer_dq)


def _attention_internals() -> SimpleNamespace:
    """What these tests reach inside fastlm's attention, in one place: the module whose
    `interpreting` the autotuners' pruning asks, the config helpers, and each autotuner with its
    CUDA configs and the largest 16-bit and fp32 head blocks it serves (the launchers route
    larger ones, and fp32 descriptors, to the pointer kernels / the deterministic backward; the
    atomic pass's depend on the compute capability)."""
    configs, forward, backward = (
        importlib.import_module(f"fastlm.kernels.attention.{name}")
        for name in ("configs", "forward", "backward")
    )
    every = (configs.MAX_HEAD_DIM, configs.MAX_HEAD_DIM_FP32)
    tma = (configs.TMA_MAX_BLOCK_D, 0)

    def atomic(major):  # Blackwell routes fp32 above head block 64 to the deterministic passes
        return tuple(configs.atomic_max_block_d(size, major) for size in (2, 4))

    return SimpleNamespace(
        prune_module=configs,
        fitting_configs=configs.fitting_configs,
        option_flags=configs.OPTION_FLAGS,
        autotuned=[
            (forward._attention_fwd_kernel, configs.FWD_CUDA_CONFIGS, every),
            (backward._attention_bwd_dkdv_kernel, configs.DKDV_CUDA_CONFIGS, every),
            (backward._attention_bwd_dq_kernel, configs.DQ_CUDA_CONFIGS, every),
            (forward._attention_fwd_tma_autotuned, configs.FWD_TMA_CUDA_CONFIGS, tma),
            (backward._attention_bwd_dkdv_dq_kernel, configs.DKDV_DQ_CUDA_CONFIGS, atomic),
            (backward._attention_bwd_dq_tma_autotuned, configs.DQ_TMA_CUDA_CONFIGS, tma),
        ],
    )


def test_autotuners_try_the_configs_the_report_compiles(monkeypatch):
    """The report compiles `fitting_configs` of each arch's list (`for_capability`); on CUDA the
    autotuners prune to the same configs (to the last of them under FASTLM_AUTOTUNE=0) on a
    Hopper and on a Blackwell GPU, for every head block and element size, plain and with each
    option variant compiled in (which some configs do not take)."""
    attention = _attention_internals()
    configs = attention.prune_module
    monkeypatch.setattr(configs, "interpreting", lambda: False)  # as on CUDA
    for (kernel, cuda, served), major in itertools.product(attention.autotuned, (9, 10)):
        # a GPU of this compute capability: Blackwell (10) has its own configs
        monkeypatch.setattr(configs, "capability", lambda tensor, major=major: major)
        every = configs.cuda_triton_configs([*cuda, *getattr(cuda, "sm100", [])])
        cuda = configs.for_capability(cuda, major)
        served = served(major) if callable(served) else served
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            q = torch.empty(0, dtype=dtype)
            largest = served[1] if dtype == torch.float32 else served[0]
            for block_d, flag in (
                (d, flag)
                for d in (16, 32, 64, 128, 256, 512)
                if d <= largest
                for flag in (None, *attention.option_flags)
            ):
                options = {flag: True} if flag else {}
                expected = [
                    (c.blocks, c.num_warps, c.num_stages)
                    for c in attention.fitting_configs(
                        cuda, block_d, q.element_size(), options=bool(flag)
                    )
                ]
                for autotune, keep in (("1", expected), ("0", expected[-1:])):
                    monkeypatch.setenv("FASTLM_AUTOTUNE", autotune)
                    kept = kernel.early_config_prune(every, {"Q": q}, BLOCK_D=block_d, **options)
                    assert [(c.kwargs, c.num_warps, c.num_stages) for c in kept] == keep
                    assert kept, f"no config for BLOCK_D={block_d} {dtype} {flag or ''}"


def test_same_code_as_finds_changed_code(report, tmp_path):
    """`--same-code-as`: rows with the digest of an earlier run pass (the sample against the
    kept report, above); a row whose code differs (here: its earlier digest altered) or that the
    earlier run lacks is listed, exit status 1."""
    _, rows = report
    assert all(len(row["ptx_sha256"]) == 64 for row in rows)
    norms = [dict(row) for row in rows if "RMSNorm fwd" in row["op"]]  # what --op runs
    before = tmp_path / "before.json"
    norms[0]["ptx_sha256"] = "0" * 64  # a row whose code differs, and one the earlier run lacks
    before.write_text(json.dumps([norms[0], *norms[2:]]))
    changed = _run_report(
        "--quick", "--arch", "sm_90a", "--op", "RMSNorm fwd", "--same-code-as", str(before)
    )
    assert changed.returncode == 1
    assert f"same code as before: {len(norms) - 2} of {len(norms)} rows" in changed.stdout
    assert changed.stdout.count("  changed: ") == 1
    assert changed.stdout.count("  not in the earlier run: ") == 1


#: The sm_100a row's arch: what Blackwell's rows must show.
BLACKWELL = "sm_100a"


def test_blackwell_rows_fit_and_multiply_on_tcgen05():
    """Every kept sm_100a row (B200, B300: every shipped config, Blackwell's attention configs
    among them) compiled without spills, within 227 KB of shared memory and the 512 columns of
    tensor memory; every kernel that multiplies matrices (wgmma or mma.sync on sm_90a or sm_80,
    at that dtype) does so
    on sm_100a with tcgen05.mma only, its accumulators in tensor memory, and its hot loop (an
    attention kernel's) issues exactly its tile's MMA: all but the configs Blackwell keeps on
    mma.sync where no tcgen05 config fits (`CudaConfig.mma_sync`, noted in the row), which are
    at most a tenth of the attention rows and never FASTLM_AUTOTUNE=0's at 16-bit head dim 128
    (`test_blackwell_rows_on_mma_sync_are_the_documented_groups` says which they are)."""
    rows = _kept()["rows"]
    multiplying = {  # (kernel, dtype): fp32 MoE GEMMs multiply on the FMA units everywhere
        (row["kernel"], row["dtype"]) for row in rows if row.get("wgmma") or row.get("mma")
    }
    blackwell = [row for row in rows if row["arch"] == BLACKWELL]
    assert {row["kernel"] for row in blackwell} >= set(TENSOR_CORE_KERNELS)
    kept_on_mma_sync = []
    for row in blackwell:
        assert not row["problems"] and row["spill_stores"] == row["spill_loads"] == 0, row
        assert row["shared"] <= row["shared_limit"] == 232448, _describe(row)
        assert row["tmem_columns"] <= 512, _describe(row)
        assert row["wgmma"] == 0, _describe(row)
        if any("kept: no tcgen05 config fits" in note for note in row["notes"]):
            assert row["mma"] > 0, _describe(row)
            kept_on_mma_sync.append(row)
        elif (row["kernel"], row["dtype"]) in multiplying:
            assert row["tcgen05"] > 0 and row["mma"] == 0, _describe(row)
            assert row["tmem_columns"] > 0, _describe(row)
            if row["kernel"] in TENSOR_CORE_KERNELS:
                loop = row["hot_loop"]
                assert loop["mma_ratio"] == 1.0 and "tcgen05" in loop, _describe(row)
                assert all(shape.startswith("UTCHMMA.") for shape in loop["mma_shapes"]), loop
        else:
            assert row["tcgen05"] == row["tmem_columns"] == 0, _describe(row)
    attention = [row for row in blackwell if row["kernel"] in TENSOR_CORE_KERNELS]
    assert 10 * len([row for row in kept_on_mma_sync if row in attention]) <= len(attention)
    defaults = [row for row in attention if row["default"] and row.get("head_dim") == 128]
    assert defaults and not any(row in kept_on_mma_sync for row in defaults)


#: The sm_100a attention rows Blackwell keeps on mma.sync, by (op, kernel, dtype, head dim, with an
#: option): the groups where every tcgen05 config tried spilled (docs/benchmarks.md gives the
#: configs and bytes). fp32 head block 256's dK/dV pass (the atomic schedule runs it too above
#: head dim 128) and head block 512's forward with an option (plain, it is on tcgen05).
BLACKWELL_ON_MMA_SYNC = {
    ("attention bwd", "_attention_bwd_dkdv_kernel", "fp32", 256, False),
    ("attention bwd (atomic dQ)", "_attention_bwd_dkdv_kernel", "fp32", 256, False),
    ("attention bwd", "_attention_bwd_dq_kernel", "fp32", 256, False),
    ("attention bwd (atomic dQ)", "_attention_bwd_dq_kernel", "fp32", 256, False),
    ("attention fwd", "_attention_fwd_kernel", "bf16", 512, True),
}


def test_blackwell_rows_on_mma_sync_are_the_documented_groups():
    """Exactly the groups of BLACKWELL_ON_MMA_SYNC keep a tl.dot on mma.sync on sm_100a, each
    through a config kept for it (`CudaConfig.mma_sync`): a config change that moves a row off
    tcgen05, or onto it, fails here until the docs and this set say so."""
    rows = [row for row in _kept()["rows"] if row["arch"] == BLACKWELL]
    on_mma_sync = {
        (row["op"], row["kernel"], row["dtype"], row["head_dim"], row["option"] is not None)
        for row in rows
        if row.get("mma")
    }
    assert on_mma_sync == BLACKWELL_ON_MMA_SYNC
    noted = [row for row in rows if any("kept: no tcgen05" in note for note in row["notes"])]
    assert noted == [row for row in rows if row.get("mma")]


def test_blackwell_fp32_atomic_dq_at_128_runs_the_deterministic_passes():
    """The atomic-dQ pass's one tcgen05 shape (M64 N64) spilled with fp32 at head block 128, so
    there Blackwell's launcher runs the dK/dV and dQ passes (`configs.atomic_max_block_d`), on
    tcgen05; Hopper and Ampere keep the one pass. The report records each arch's launches."""
    rows = [
        row
        for row in _kept()["rows"]
        if row["op"] == "attention bwd (atomic dQ)" and row["case"] == "fp32 D=128 causal"
    ]
    kernels = {row["arch"]: set() for row in rows}
    for row in rows:
        kernels[row["arch"]].add(row["kernel"])
    assert "_attention_bwd_dq_kernel" in kernels[BLACKWELL] and len(kernels) == 3, kernels
    for arch in set(kernels) - {BLACKWELL}:
        assert "_attention_bwd_dq_kernel" not in kernels[arch], kernels
        assert "_attention_bwd_dkdv_kernel" in kernels[arch], kernels
    blackwell = [row for row in rows if row["arch"] == BLACKWELL and row.get("tcgen05")]
    assert blackwell and not any(row.get("mma") for row in rows if row["arch"] == BLACKWELL)
