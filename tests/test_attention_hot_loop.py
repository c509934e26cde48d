"""benchmarks/hot_loop.py: the hot loop read from SASS, its instruction mix, MMA against the
tile, the waits and what runs beside the tensor cores, and the clock model; then the shipped
descriptor forward compiled for sm_90a, whose softmax must keep running beside a warpgroup MMA,
and the shipped descriptor dQ pass, whose loop must be shorter than the pointer one's.

The parser is checked on a hand-written listing in nvdisasm's format, where every figure is
known; the compile runs `benchmarks/attention_hot_loops.py` in a subprocess without
TRITON_INTERPRET (which conftest.py sets here), as test_compile_report.py does.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastlm.kernels.attention.configs import DQ_TMA_CUDA_CONFIGS, FWD_TMA_CUDA_CONFIGS

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("hot_loop", REPO / "benchmarks" / "hot_loop.py")
hot_loop = sys.modules["hot_loop"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hot_loop)


def _line(address: int, text: str) -> str:
    return f"        /*{address:04x}*/                   {text} ;"


def _listing() -> str:
    """A kernel in nvdisasm -c's format: an outer loop around two loops holding MMA (a masked one
    longer than the hot one), a barrier retry placed after EXIT that branches back into the hot
    loop, and a trailing self-branch."""
    body = []
    address = 0

    def emit(text):
        nonlocal address
        body.append(_line(address, text))
        address += 0x10

    def label(name):
        body.append(f".{name}:")

    emit("MOV R1, c[0x0][0x28]")
    label("L_x_0")  # outer loop
    emit("IADD3 R2, R2, 0x1, RZ")
    label("L_x_1")  # the hot loop: one iteration of a pipelined softmax
    emit("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x20000], R3")
    emit("@!P0 BRA `(.L_x_9)")
    label("L_x_2")
    emit("WARPGROUP.ARRIVE")
    emit("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT")
    emit("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24, gsb0")  # S: one group of 2
    emit("WARPGROUP.DEPBAR.LE gsb0, 0x0")
    emit("FMUL R88, R88, R5")
    emit("WARPGROUP.ARRIVE")
    emit("HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR16].tnspB, R88, gsb0")  # P V in flight
    emit("FMNMX R6, R24, R25, !PT")
    emit("FFMA R7, R24, R9, -R6")
    emit("MUFU.EX2 R8, R7")
    emit("MUFU.EX2 R10, R6")
    emit("FADD R11, R8, R11")
    emit("F2FP.BF16.F32.PACK_AB R152, R8, R8")
    emit("UIADD3 UR4, UR4, 0x1, URZ")
    emit("ISETP.GE.AND P0, PT, R2, R4, PT")
    emit("@!P0 BRA `(.L_x_1)")
    label("L_x_3")  # the masked loop: the same MMA, more instructions
    emit("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT, gsb0")
    emit("WARPGROUP.DEPBAR.LE gsb0, 0x0")
    for _ in range(20):
        emit("FSEL R24, R24, -INF, P1")
    emit("HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR16].tnspB, R88, gsb0")
    emit("@!P1 BRA `(.L_x_3)")
    emit("@P2 BRA `(.L_x_0)")
    emit("EXIT")
    label("L_x_9")  # the retry loop of the barrier wait, out of line
    emit("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x20000], R3")
    emit("@!P0 BRA `(.L_x_9)")
    emit("BRA `(.L_x_2)")
    label("L_x_10")
    emit("BRA `(.L_x_10)")
    return "\n".join(body) + "\n"


def test_hot_loop_is_the_shortest_innermost_loop_with_mma():
    instructions, labels = hot_loop.parse_sass(_listing())
    assert instructions[0].opcode == "MOV" and labels[".L_x_1"] == 0x20
    spans = hot_loop.loops(instructions, labels)
    # outer, hot, masked and the retry's own loop; the retry's branch back into the hot loop is
    # not one, nor is the trailing self-branch (one instruction) anything but a loop of its own.
    starts = sorted(instructions[s].address for s, _ in spans)
    assert starts == [0x10, 0x20, 0x140, 0x2E0, 0x310]
    first, last = hot_loop.hot_loop(instructions, labels)
    assert (instructions[first].address, instructions[last].address) == (0x20, 0x130)


def test_a_fence_is_synchronisation_not_softmax_work():
    """FENCE.VIEW.ASYNC (issued before a warpgroup MMA reads registers or shared memory) orders
    memory: it counts as sync, and issued beside a pending MMA it does not make that MMA overlap
    the softmax (it once counted as floating point for its leading F)."""
    assert hot_loop.classify("FENCE.VIEW.ASYNC.S") == "sync"
    assert hot_loop.classify("FMNMX") == "fp_other"
    listing = "\n".join(
        _line(16 * i, text)
        for i, text in enumerate(
            [
                "WARPGROUP.ARRIVE",
                "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0",
                "FENCE.VIEW.ASYNC.S",
                "WARPGROUP.DEPBAR.LE gsb0, 0x0",
            ]
        )
    )
    body, _ = hot_loop.parse_sass(listing)
    assert hot_loop.in_flight(body, 4) == dict(instructions=1, mufu=0, mma_flops=0)


def test_mix_mma_against_the_tile_waits_and_overlap():
    """Per warp and iteration of the hot loop above, compiled as 8 warps (two warpgroups) of a
    forward whose tile is 128 x 128 x D=16: each HGMMA.64x128x16 is 2 * 64 * 128 * 16 FLOPs per
    warpgroup; the loop's three of them on two warpgroups are 1.5x the tile's two dots."""
    row = hot_loop.analyse(
        _listing(),
        "wgmma.wait_group.sync.aligned 0;\nwgmma.wait_group.sync.aligned 1;",
        "_attention_fwd_tma_kernel",
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_D=16),
        8,
        "sm_90a",
    )
    assert row["mix"] == dict(
        mma=3,
        mufu=2,
        fma=3,
        fp_other=2,
        load=0,
        store=0,
        sync=4,
        shuffle=0,
        branch=2,
        uniform=1,
        other=1,
        total=18,
    )
    flops = 2 * 64 * 128 * 16
    assert row["tile_flops"] == 2 * 2 * 128 * 128 * 16
    assert row["mma_issued_flops"] == 3 * flops * 2
    assert row["mma_ratio"] == 1.5 and row["problems"] == ["duplicated MMA"]
    assert row["loop_waits"] == [0] and row["deepest_wait_group"] == 1
    # Beside an MMA: the S group is waited for at once; the P V stays in flight from its issue
    # to the end of the iteration and through the next one's head (TRYWAIT, BRA, ARRIVE) until
    # the wait: 9 + 3 instructions, both MUFU among them.
    assert row["in_flight"] == dict(instructions=12, mufu=2, mma_flops=2 * flops)
    clocks = row["clocks"]
    assert clocks["mma"] == 3 * flops * 2 / 4096
    assert clocks["mufu"] == 2 * 8 * 32 / 16  # 2 per thread, 256 threads, 16 per clock
    assert clocks["issue"] == (18 - 3) * 8 / 4
    assert row["bound"] == "mufu"
    softmax = clocks["mufu"]
    assert row["mma_busy"] == pytest.approx(clocks["mma"] / (clocks["mma"] + softmax))
    # Every MUFU runs beside the P V, whose clocks exceed the MUFU's: all of them hidden.
    assert row["mma_busy_overlapped"] == 1.0


def test_loop_that_waits_for_every_mma_at_once():
    """Each group waited for right after it: nothing runs beside the tensor cores, and the model
    hides nothing."""
    listing = "\n".join(
        [
            ".L_x_0:",
            _line(0x0, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT, gsb0"),
            _line(0x10, "WARPGROUP.DEPBAR.LE gsb0, 0x0"),
            _line(0x20, "MUFU.EX2 R5, R24"),
            _line(0x30, "@P0 BRA `(.L_x_0)"),
            _line(0x40, "EXIT"),
        ]
    )
    row = hot_loop.analyse(
        listing,
        "",
        "_attention_fwd_tma_kernel",
        dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=16),
        4,
        "sm_90a",
    )
    assert row["in_flight"] == dict(instructions=0, mufu=0, mma_flops=0)
    assert row["mma_busy_overlapped"] == row["mma_busy"]


def test_hmma_loops_and_a_loop_without_mma():
    """mma.sync (sm_80): one warp's m16n8k16 per HMMA, no warpgroup waits; a kernel without a
    loop holding MMA is a flagged row."""
    listing = "\n".join(
        [
            ".L_x_0:",
            _line(0x0, "HMMA.16816.F32.BF16 R4, R8, R12, R4"),
            _line(0x10, "HMMA.1688.F32.TF32 R4, R8, R12, R4"),
            _line(0x20, "MUFU.EX2 R5, R5"),
            _line(0x30, "@P0 BRA `(.L_x_0)"),
            _line(0x40, "EXIT"),
        ]
    )
    row = hot_loop.analyse(
        listing, "", "_attention_bwd_dq_kernel", dict(BLOCK_M=16, BLOCK_N=8, BLOCK_D=16), 4, "sm_80"
    )
    issued = (2 * 16 * 8 * 16 + 2 * 16 * 8 * 8) * 4
    assert row["mma_issued_flops"] == issued and row["in_flight"] is None
    assert row["mma_ratio"] == issued / (3 * 2 * 16 * 8 * 16)
    assert row["clocks"]["mma"] == issued / (2048 * 0.5)  # a TF32 loop at half the rate
    assert row["deepest_wait_group"] is None and row["loop_waits"] == []
    no_loop = hot_loop.analyse(
        _line(0, "EXIT"),
        "",
        "_attention_bwd_dq_kernel",
        dict(BLOCK_M=16, BLOCK_N=8, BLOCK_D=16),
        4,
        "sm_80",
    )
    assert no_loop["problems"] == ["no loop with MMA instructions"]


def _compile_missing() -> str | None:
    try:
        import triton

        path = triton.knobs.nvidia.nvdisasm.path
    except Exception as error:  # no NVIDIA backend in this Triton build
        return f"Triton's nvdisasm is not available: {error}"
    return None if os.access(path, os.X_OK) else f"nvdisasm is not executable at {path}"


def _hot_loops(tmp_path, *args: str) -> list[dict]:
    """The rows of `benchmarks/attention_hot_loops.py --arch sm_90a --dtype bf16 *args`, run in a
    subprocess without TRITON_INTERPRET."""
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "attention_hot_loops.py"),
            "--arch",
            "sm_90a",
            "--dtype",
            "bf16",
            *args,
            "--json",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.skipif(_compile_missing() is not None, reason=str(_compile_missing()))
def test_shipped_descriptor_forward_overlaps_softmax_and_mma(tmp_path):
    """The descriptor forward's largest shipped tile (bf16, causal, head dim 128, M128 N128, 8
    warps) compiled for sm_90a: every exponential of its hot loop is issued while the previous
    block's P V runs on the tensor cores, and the loop issues exactly its tile's MMA."""
    (report_row,) = _hot_loops(
        tmp_path, "--op", "fwd (TMA)", "--head-dim", "128", "--config", "128,128,8,2"
    )
    row = report_row["hot_loop"]
    assert (128, 128, 8, 2) in [
        (c.blocks["BLOCK_M"], c.blocks["BLOCK_N"], c.num_warps, c.num_stages)
        for c in FWD_TMA_CUDA_CONFIGS
        if c.max_block_d >= 128
    ], "the config checked here is shipped"
    assert row["mma_ratio"] == 1.0
    assert row["mix"]["mufu"] >= 64, "a 128 x 128 tile on 256 threads: 64 ex2 per thread"
    assert row["in_flight"]["mufu"] == row["mix"]["mufu"], "an exponential waits for the MMA"
    assert row["mma_busy_overlapped"] > row["mma_busy"]


@pytest.mark.skipif(_compile_missing() is not None, reason=str(_compile_missing()))
def test_shipped_descriptor_dq_loop_is_shorter_than_the_pointer_one(tmp_path):
    """Each shipped config of the descriptor dQ pass (bf16, causal, head dim 128) compiled for
    sm_90a: its hot loop reads k and v without per-thread global loads and issues fewer
    instructions than the pointer dQ pass at the same config (which ships it too), with no MMA
    repeated and no spill. The reason the descriptor path is the default on sm_90."""
    rows = _hot_loops(tmp_path, "--op", "attention bwd", "--head-dim", "128")
    dq = {}
    for row in rows:
        if row["kernel"] == "_attention_bwd_dq_kernel":
            config = (*row["blocks"].values(), row["num_warps"], row["num_stages"])
            dq[row["op"], config] = row
    shipped = [
        (c.blocks["BLOCK_M"], c.blocks["BLOCK_N"], c.num_warps, c.num_stages)
        for c in DQ_TMA_CUDA_CONFIGS
        if c.max_block_d >= 128
    ]
    assert sorted(config for op, config in dq if "TMA" in op) == sorted(shipped)
    for config in shipped:
        row, pointer = dq["attention bwd dQ (TMA)", config], dq["attention bwd", config]
        assert row["tma"] and not pointer["tma"]
        loop, pointer_loop = row["hot_loop"], pointer["hot_loop"]
        assert loop["mix"]["load"] < pointer_loop["mix"]["load"], config
        assert loop["mix"]["total"] < pointer_loop["mix"]["total"], config
        assert loop["mma_ratio"] == 1.0 and row["spill_stores"] == 0, config


#: The whole compile report as kept in the repository (`compile_report.py --baseline`).
KEPT_REPORT = REPO / "benchmarks" / "baselines" / "compile_report.json"
#: The most a soft-capped hot loop may issue against the same kernel and config without the cap
#: ("exact": the default cap; "approx": softcap_approx=True), and the most it may take in the
#: hot-loop table's clock model (the most of its MMA, MUFU and issue clocks) against the plain one.
#:
#: The exact cap's tanh (`blocks._tanh_parts`) costs 13 instructions per score and thread in the
#: forward, two of them MUFU, and 15 in the backward (with its slope, one FFMA, and the product
#: with dS), against the 8 to 11 the plain loop issues per score on sm_90a (MMA, loads,
#: synchronisation): 2.53x at the descriptor forward's M128 N128 tile, 2.59x at the descriptor dQ
#: pass's M128 N64 (14 and 17 before the scale went into the tanh's constants, the slope was
#: halved into one FFMA and qk's sign into the exponent's scale: 2.65x and 2.80x). 1.5x would
#: leave 4.2 instructions per score (forward, M128 N128: 533 for 64 scores a thread) and 4.7
#: (dQ, M128 N64: 299 for 32), 2 of them the backward's slope and its product; no tanh exact to
#: fp32 rounding fits: it takes two forms and a choice, 11 or more (1 - 2 / (1 + 2^v) cancels
#: digits below |x| = 0.6, where the odd polynomial takes over). Its clocks: 1.0x to 1.55x, 1.79x
#: at the descriptor forward's M64 N32, a tile small enough that issuing bounds its plain loop.
#:
#: The approximate cap is tanh.approx.f32 (MUFU.TANH), a multiply and in the backward the slope's
#: FMA and product: 1.24x the forward's M128 N128 loop, 1.43x the descriptor dQ's M128 N64; its
#: clocks within 1.02x (the MUFU's extra tanh fills time the tensor cores leave).
#:
#: sm_100a (B200, B300) has limits of its own, its kept report's largest ratios: the tensor cores
#: multiply twice as fast as Hopper's (8192 16-bit FLOP per clock per SM) while the MUFU (16
#: results per clock) and issue (4 warp-instructions) stay, so the plain loop's bound is the
#: MUFU's one ex2 per score (the descriptor forward's M128 N128 at head dim 128: 1040 MUFU clocks
#: against 1024 of MMA and 864 of issue) and the cap multiplies it: the exact cap's tanh adds an
#: ex2 and a reciprocal (3 MUFU results a score: 3088 clocks, 2.97x), the approximate one a
#: tanh.approx (2: 2064, 1.98x). A loop bound by the MUFU cannot go below those ratios with
#: every exponential on it; moving some to the FMA units (`blocks.exp2_split`) did not pay there
#: (docs/attention.md, "The soft cap on Blackwell").
CAPPED_OPTIONS = ("softcap", "softcap+approx")
CAPPED_LIMITS = {
    "sm_90a": {"softcap": (2.7, 1.9), "softcap+approx": (1.5, 1.2)},
    "sm_80": {"softcap": (2.7, 1.9), "softcap+approx": (1.5, 1.2)},
    "sm_100a": {"softcap": (2.5, 3.0), "softcap+approx": (1.35, 2.0)},
}


def capped_against_plain(rows: list[dict]) -> dict[tuple, tuple[dict, dict]]:
    """{(option, arch, op, kernel, config): (capped, plain)} hot-loop figures (`hot_loop.analyse`)
    of every compile report row with the soft cap (exact or approximate), and of its twin without
    it (same kernel, arch, dtype, head dim, causality, blocks, warps and stages)."""

    def key(row):
        where = [row[k] for k in ("arch", "op", "kernel", "dtype", "head_dim", "causal")]
        blocks = " ".join(f"{k}={v}" for k, v in sorted(row["blocks"].items()))
        return (*where, blocks, row["num_warps"], row["num_stages"])

    with_loop = [
        row
        for row in rows
        if row["kernel"] in hot_loop.KERNEL_DOTS and (row.get("hot_loop") or {}).get("mix")
    ]  # the attention kernels' (the MoE GEMMs have hot loops too, and no head dim)
    plain = {key(row): row for row in with_loop if row.get("option") is None}
    pairs = {}
    for row in with_loop:
        if row.get("option") in CAPPED_OPTIONS:
            twin = plain[key(row)]  # a KeyError here: a capped config compiled without its twin
            pairs[(row["option"], *key(row))] = (row["hot_loop"], twin["hot_loop"])
    return pairs


@pytest.mark.parametrize("option", CAPPED_OPTIONS)
@pytest.mark.parametrize("arch", list(CAPPED_LIMITS))
def test_capped_hot_loops_stay_near_the_plain_ones(arch, option):
    """Every shipped config of every attention kernel that takes the soft cap (forward on both
    paths, dK/dV, dQ on both paths; on sm_90a, sm_80 and sm_100a) in the kept compile report,
    exact and approximate: its hot loop issues at most CAPPED_LIMITS' instruction ratio times the
    plain one's instructions (Gemma 2 trains on it; the tanh it had first, 3.6x), and takes at
    most its clock ratio times the plain one's modelled clocks, the arch's limits."""
    pairs = capped_against_plain(json.loads(KEPT_REPORT.read_text())["rows"])
    pairs = {key[1:]: loops for key, loops in pairs.items() if key[:2] == (option, arch)}
    kernels = {kernel for _, _, kernel, *_ in pairs}
    descriptors = "_attention_fwd_tma_kernel"  # sm_90+
    assert kernels == set(hot_loop.KERNEL_DOTS) - ({descriptors} if arch == "sm_80" else set())
    most_instructions, most_clocks = CAPPED_LIMITS[arch][option]
    over = {}
    for key, (capped, plain) in pairs.items():
        instructions = capped["mix"]["total"] / plain["mix"]["total"]
        clocks = max(capped["clocks"].values()) / max(plain["clocks"].values())
        if instructions > most_instructions or clocks > most_clocks:
            over[key] = f"instructions {instructions:.2f}x, clocks {clocks:.2f}x"
    assert not over, over


def test_head_block_512_has_hot_loops_without_spills():
    """Gemma 4's global layers (16-bit head dim 512) in the kept report: the forward, the split
    dK/dV pass's dV and dK launches and the dQ pass, plain, with the window, cap and sinks, and
    packed, on sm_90a and sm_80, each with a hot loop read and nothing spilled; the split
    launches' MMA counted against their own matmuls (`hot_loop.tile_flops`: 2 and 3 dots), so the
    configs without repeated work issue exactly their tile."""
    rows = json.loads(KEPT_REPORT.read_text())["rows"]
    rows = [row for row in rows if row.get("head_dim") == 512 and row.get("hot_loop")]

    def launch(row):  # the split pass's launches end their case with "(dV)" or "(dK)"
        grads = row["case"].rsplit(" ", 1)[-1]
        return row["kernel"], grads if grads in ("(dV)", "(dK)") else None

    seen = {(row["arch"], *launch(row), row.get("option")) for row in rows}
    launches = [
        ("_attention_fwd_kernel", None),
        ("_attention_bwd_dkdv_kernel", "(dV)"),
        ("_attention_bwd_dkdv_kernel", "(dK)"),
        ("_attention_bwd_dq_kernel", None),
    ]
    expected = {
        (arch, *each, option)
        for arch in ("sm_90a", "sm_80")
        for each in launches
        for option in (None, "window+softcap+sinks", "varlen")
    }
    assert expected <= seen, expected - seen
    assert all(row["spill_stores"] == 0 and not row["problems"] for row in rows)
    whole = [row for row in rows if not row["notes"]]  # no repeated MMA: the dK/dV M64 N16
    assert whole and all(row["hot_loop"]["mma_ratio"] == 1.0 for row in whole)


def _tcgen05_listing() -> str:
    """A Blackwell forward's hot loop in nvdisasm -c's format, as Triton 3.9 compiles a 128 x 64
    tile at head block 128 for sm_100a (cut down): wait for S (committed to UR19), load it from
    tensor memory, try-wait for the previous P V (UR11) with exponentials between the try-wait
    and its retry branch, store P to tensor memory, issue P V (A from tensor memory) and commit
    it to UR11, then the next S = Q K^T (A and B from shared memory) committed to UR19."""
    lines = [
        "UMOV UR35, 0x8210490",  # before the loop: M 128, N 128, bf16 (P V)
        ".L_x_1:",
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR19], R4",
        "@!P2 BRA `(.L_x_9)",
        "LDTM.16dp32bit_t0_t15.x32 R4, tmem[UR12+0x80]",
        "FMNMX R6, R4, R5, !PT",
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR11], R36",
        "MUFU.EX2 R8, R4",
        "MUFU.EX2 R9, R5",
        "@!P2 BRA `(.L_x_9)",
        "STTM.16dp32bit_t0_t15.x16 tmem[UR12+0xc0], R8",
        "FMUL R20, R20, R6",
        "UTCHMMA tmem[UR39], gdesc[UR24], tmem[UR9], tmem[UR34], idesc[UR35], UPT",
        "UTCHMMA tmem[UR6], gdesc[UR28], tmem[UR9], tmem[UR34], idesc[UR35], UPT",
        "UTCBAR [UR11], URZ",
        "UMOV UR43, 0x8100490",  # M 128, N 64, bf16 (S = Q K^T)
        "UTCHMMA gdesc[UR16], gdesc[UR20], tmem[UR10], tmem[UR42], idesc[UR43], !UPT",
        "UTCBAR [UR19], URZ",
        "FADD R11, R8, R11",
        "LDGSTS.E.BYPASS.128 [R15+0xc000], desc[UR26][R4.64], !P2",
        "ISETP.GE.AND P0, PT, R2, R3, PT",
        "@!P0 BRA `(.L_x_1)",
        "EXIT",
        ".L_x_9:",
        "BRA `(.L_x_1)",
    ]
    out, address = [], 0
    for text in lines:
        if text.startswith("."):
            out.append(text)
        else:
            out.append(_line(address, text))
            address += 0x10
    return "\n".join(out)


def test_tcgen05_loop_shapes_groups_and_tensor_memory():
    """sm_100a's reading: each UTCHMMA's shape from the UMOV that set its instruction descriptor
    (before the loop, or in it), issued once per CTA; what runs between a group's issue and the
    try-wait on the barrier it is committed to; the MMAs fed A (P) from tensor memory."""
    constexprs = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_D=128)
    listing = _tcgen05_listing()
    row = hot_loop.analyse(listing, "", "_attention_fwd_kernel", constexprs, 8, "sm_100a")
    assert row["mma_shapes"] == {"UTCHMMA.128x128x16.BF16": 2, "UTCHMMA.128x64x16.BF16": 1}
    issued = 2 * (2 * 128 * 128 * 16) + 2 * 128 * 64 * 16  # not times the 8 warps
    assert row["mma_issued_flops"] == issued
    assert row["mma_ratio"] == issued / (4 * 128 * 64 * 128)
    assert row["mix"]["mma"] == 3 and row["mix"]["sync"] == 4  # two try-waits, two commits
    assert row["tcgen05"] == dict(tmem_a=2, tmem_moves=dict(ld=1, st=1))
    # P V is in flight from its issue to the try-wait on UR11 (the next iteration), S from its
    # issue to the try-wait on UR19: the UMOV beside P V, FADD, LDGSTS, ISETP and the back branch
    # beside both, then the retry branch, LDTM and FMNMX beside P V alone (8); the exponentials
    # follow P V's try-wait, and the FADD and FMNMX put both MMAs beside floating-point work
    assert row["in_flight"] == dict(instructions=8, mufu=0, mma_flops=issued)
    assert row["loop_waits"] == [0, 1] and row["deepest_wait_group"] is None
    assert row["clocks"]["mma"] == issued / 8192
    assert row["problems"] == []
    unread = listing.replace("UMOV UR35, 0x8210490", "MOV R1, R2")
    row = hot_loop.analyse(unread, "", "_attention_fwd_kernel", constexprs, 8, "sm_100a")
    assert row["mma_shapes"]["UTCHMMA.?"] == 2 and "MMA shape unread" in row["problems"]
