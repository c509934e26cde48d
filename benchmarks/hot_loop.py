"""The hot loop of each attention kernel and MoE grouped GEMM, read from the SASS of a compile for
sm_90a, sm_80 or sm_100a.

`compile_report.py` calls `analyse` on every attention kernel that multiplies matrices and on
the 16-bit launches of the mixture-of-experts GEMMs (`reads`; their fp32 launches multiply in
IEEE fp32 on the FMA units, with no tensor-core loop to read): it
disassembles the cubin with the wheel's `nvdisasm` and reads the hot loop, the innermost loop (a
backward branch) that holds tensor-core instructions (HGMMA on sm_90a, HMMA on sm_80, UTCHMMA on
sm_100a), the
cheapest of them when there are several (a kernel's unmasked phase). From it:

- the instruction mix per warp and iteration: MMA, MUFU (ex2 and the rest), FFMA/FMUL/FADD,
  other floating point, loads, stores, barriers and synchronisation, the rest, total;
- the MMA the loop issues against the tile's FLOPs: each HGMMA is one warpgroup's m x n x k
  product, run once per warpgroup (num_warps / 4), each HMMA one warp's, run once per warp; the
  tile's FLOPs are 2 * rows * cols * BLOCK_D per dot of the loop over q's head dim and
  2 * rows * cols * BLOCK_DV per dot over v's (the forward 1 + 1 dots, dQ 2 + 1, dK/dV 2 + 2,
  3 + 2 with the atomic dQ); a MoE GEMM's 2 * rows * cols * BLOCK_K per dot of its loop over K
  (GEMM_DOTS). A ratio above 1 is work duplicated across warps;
- the deepest `wgmma.wait_group N` in the PTX, and the `WARPGROUP.DEPBAR.LE gsb0, N` waits inside
  the loop: a wait of N >= 1 leaves N warpgroup MMA groups in flight across the code after it, 0
  waits for every one;
- what the loop issues while a warpgroup MMA is in flight (`in_flight`: non-MMA instructions,
  MUFU among them, and the FLOPs of the MMAs they run beside): a wait 0 per iteration still
  leaves the MMA issued after it running beside whatever follows it (a softmax placed after the
  P V of the previous block, say) until the next iteration's wait;
- a per-iteration clock model per SM (a ranking model, not a speed): MMA clocks = issued FLOPs /
  the tensor cores' dense rate (sm_90a: 4096 bf16/fp16 FLOP per clock per SM, H100; sm_80: 2048,
  A100; TF32 half of that), MUFU clocks = MUFU results / 16 per clock, issue clocks = the loop's
  non-MMA warp-instructions / 4 per clock (four schedulers), and the tensor cores' share if
  nothing overlaps: MMA / (MMA + max(MUFU, issue)); and with the overlap the loop has, the
  share of the bound resource's work (MUFU or issue) issued beside an MMA hidden behind it, up
  to that MMA's clocks: MMA / (MMA + softmax - hidden).

On sm_100a (B200, B300) `tl.dot` becomes `tcgen05.mma` (SASS `UTCHMMA`; `UTCQMMA` for 8-bit
inputs): an asynchronous MMA that one thread issues for the whole CTA, accumulating in tensor
memory (TMEM), whose completion `tcgen05.commit` (`UTCBAR [barrier]`) signals on an mbarrier that
the consumers wait for (`SYNCS.PHASECHK.TRANS64.TRYWAIT P, [barrier]`). Its shape is not in the
opcode but in the instruction descriptor (`idesc[URn]`, set by a `UMOV URn, imm`: M at bits
24-28 as M >> 4, N at 17-22 as N >> 3, the input type at 7-9; K is 32 bytes of input: 16 for
16-bit, 8 for TF32), so `tcgen05_flops` decodes it there, once per CTA (not per warp); a shape it
cannot read is a problem of the row. `tcgen05_in_flight` follows each group of MMAs from its
issue through its commit to the first wait on that barrier (the try-wait itself: ptxas may place
independent work between a try-wait and the branch that retries it, but the try-wait may already
suspend the warp; the barriers matched by their operand text), which gives `in_flight` and
`loop_waits` (groups still pending after each wait) as for warpgroup MMA; `tmem_a` counts the
MMAs whose A operand is read from TMEM (the P of P V, stored there with `STTM`, instead of
through shared memory), `tmem_moves` the loop's TMEM loads and stores (`LDTM`, `STTM`). The clock
model is the same with B200's dense rate (8192 16-bit FLOP per clock per SM, twice H100's; MUFU
and issue rates as Hopper's); like the rest, a ranking, which a GPU must confirm.

The compile report keeps these figures in its rows (`hot_loop`) and prints them as a second
table (`table`). `attention_hot_loops.py` prints that table alone for causal attention, also for
configs not shipped yet. This module imports neither of them: they build on it.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

#: Dense tensor-core FLOP per clock per SM for 16-bit inputs (H100 SXM; A100; B200: 2.25 dense
#: PFLOP/s over 148 SMs at about 1.86 GHz), and for TF32.
MMA_RATE = {"sm_90a": 4096, "sm_80": 2048, "sm_100a": 8192}
TF32_FACTOR = 0.5
#: MUFU results per clock per SM (16 per SM on both), warp-instructions issued per clock per SM.
MUFU_RATE = 16
ISSUE_RATE = 4
#: tl.dot calls per iteration of each kernel's key (or query) loop: (dots, tile rows, tile cols)
#: with the tile's sides named by their BLOCK_ constexprs.
KERNEL_DOTS = {  # (dots over q's head dim, dots over v's, the score block's rows and cols)
    "_attention_fwd_kernel": (1, 1, "BLOCK_M", "BLOCK_N"),
    "_attention_fwd_tma_kernel": (1, 1, "BLOCK_M", "BLOCK_N"),
    "_attention_bwd_dq_kernel": (2, 1, "BLOCK_M", "BLOCK_N"),
    "_attention_bwd_dkdv_kernel": (2, 2, "BLOCK_N", "BLOCK_M"),  # + 1 over q's with ATOMIC_DQ
}
#: The grouped GEMMs of `fastlm.kernels.moe.kernels`: (dots per iteration of the loop over the
#: reduction, and with GATED one more; the output tile's rows and cols, the reduction block).
GEMM_DOTS = {
    # gate (and up with GATED; PAIRED: both as one dot of 2 BLOCK_N columns, the same FLOPs)
    "_grouped_gemm_kernel": (1, "BLOCK_M", "BLOCK_N", "BLOCK_K"),
    "_hidden_backward_kernel": (2, "BLOCK_M", "BLOCK_N", "BLOCK_K"),  # gate, dh (and up, PAIRED)
    "_expert_grad_kernel": (1, "BLOCK_I", "BLOCK_J", "BLOCK_R"),  # a ragged-K weight gradient
}


def reads(kernel: str, dtype: str | None) -> bool:
    """Whether the compile report reads this kernel's hot loop: every attention kernel, and
    the MoE GEMMs in 16-bit dtypes (fp32 ones take IEEE fp32 dots, with no MMA to count)."""
    return kernel in KERNEL_DOTS or (kernel in GEMM_DOTS and dtype != "fp32")


_LINE = re.compile(
    r"^\s*/\*([0-9a-f]+)\*/\s+(?:\{\s*)?(@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)"
    r"\s*([^;]*);"
)
_LABEL = re.compile(r"^(\.L\w+):")
_TARGET = re.compile(r"`\((\.L\w+)\)")
_HGMMA = re.compile(r"HGMMA\.(\d+)x(\d+)x(\d+)\.")
_HMMA = re.compile(r"HMMA\.(\d{2})(\d)(\d+)\.")
_WAIT_GROUP = re.compile(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)")
_DEPBAR = re.compile(r"gsb0\s*,\s*(0x[0-9a-f]+|\d+)")

#: tcgen05.mma's SASS opcodes (sm_100a): 16-bit and TF32 inputs, 8-bit floats, integers, fp4.
TCGEN05_MMA = ("UTCHMMA", "UTCQMMA", "UTCIMMA", "UTCOMMA")

#: Instruction classes of the mix, the first matching prefix wins (opcode without modifiers).
CLASSES = (
    ("mma", ("HGMMA", "HMMA", "IMMA", *TCGEN05_MMA)),
    ("mufu", ("MUFU",)),
    # before the floating point's "F": FENCE.VIEW.ASYNC orders memory, it computes nothing;
    # UTCBAR (tcgen05.commit) before the uniform "U": it arrives on an MMA's barrier
    (
        "sync",
        ("BAR", "SYNCS", "WARPGROUP", "DEPBAR", "MEMBAR", "WARPSYNC", "ARRIVES", "FENCE", "UTCBAR"),
    ),
    ("fma", ("FFMA", "FMUL", "FADD")),
    ("fp_other", ("F", "H")),
    ("load", ("LD", "UTMALDG", "UBLKCP")),
    ("store", ("ST", "UTMASTG", "RED", "ATOM")),
    ("shuffle", ("SHFL",)),
    ("branch", ("BRA", "EXIT", "BSSY", "BSYNC", "CALL", "RET", "JMP")),
    ("uniform", ("U", "R2UR", "S2UR", "VOTEU", "ELECT")),
)


@dataclass(frozen=True)
class Instruction:
    address: int
    predicate: str
    opcode: str  # with its modifiers: HGMMA.64x128x16.F32.BF16
    operands: str

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]


def parse_sass(text: str) -> tuple[list[Instruction], dict[str, int]]:
    """The instructions of nvdisasm output (one kernel) in order, and each label's address."""
    instructions, labels, pending = [], {}, []
    for line in text.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        match = _LINE.match(line)
        if match:
            address = int(match.group(1), 16)
            for name in pending:
                labels[name] = address
            pending = []
            predicate, opcode, operands = match.group(2) or "", match.group(3), match.group(4)
            instructions.append(Instruction(address, predicate.strip(), opcode, operands.strip()))
    return instructions, labels


def loops(instructions: list[Instruction], labels: dict[str, int]) -> list[tuple[int, int]]:
    """(first, last) instruction indices of each loop: a branch back to an earlier label, the
    body the instructions from the label to the branch. Code placed after the kernel's last
    EXIT (a barrier's retry loop, which branches back into the loop it came from) forms no loop
    with the code before it, and its own instructions are not counted in the body."""
    index = {inst.address: i for i, inst in enumerate(instructions)}
    last_exit = max((i for i, inst in enumerate(instructions) if inst.base == "EXIT"), default=-1)
    found = []
    for i, inst in enumerate(instructions):
        if inst.base != "BRA":
            continue
        target = _TARGET.search(inst.operands)
        if not target or labels.get(target.group(1), inst.address + 1) > inst.address:
            continue
        start = index[labels[target.group(1)]]
        if (start > last_exit) == (i > last_exit):
            found.append((start, i))
    return found


def classify(opcode: str) -> str:
    """The mix class of an opcode (CLASSES), "other" when none matches."""
    base = opcode.split(".")[0]
    for name, prefixes in CLASSES:
        if base.startswith(prefixes):
            return name
    return "other"


def mma_flops(body: list[Instruction], num_warps: int) -> tuple[int, Counter]:
    """FLOPs one iteration of the body issues per program (CTA), and the MMA shapes it holds."""
    flops, shapes = 0, Counter()
    for inst in body:
        hgmma = _HGMMA.match(inst.opcode)
        hmma = _HMMA.match(inst.opcode)
        if hgmma:  # one warpgroup's product: each of its 4 warps issues the same instruction
            m, n, k = map(int, hgmma.groups())
            flops += 2 * m * n * k * (num_warps // 4)
        elif hmma:
            m, n, k = map(int, hmma.groups())
            flops += 2 * m * n * k * num_warps
        else:
            continue
        shapes[inst.opcode] += 1
    return flops, shapes


def hot_loop(instructions: list[Instruction], labels: dict[str, int]) -> tuple[int, int] | None:
    """The innermost loop holding MMA instructions, the shortest when there are several (the
    unmasked phase of a kernel whose phases are separate loops); None without one."""

    def has_mma(span):
        return any(classify(inst.opcode) == "mma" for inst in instructions[span[0] : span[1] + 1])

    with_mma = [span for span in loops(instructions, labels) if has_mma(span)]
    innermost = [
        span
        for span in with_mma
        if not any(o != span and span[0] <= o[0] and o[1] <= span[1] for o in with_mma)
    ]
    return min(innermost, key=lambda s: s[1] - s[0], default=None)


def in_flight(body: list[Instruction], num_warps: int) -> dict | None:
    """What one iteration does while a warpgroup MMA is in flight (after an HGMMA, before the
    wait that retires it), in the loop's steady state (the body walked twice, the second walk
    counted): the non-MMA instructions and the MUFU ones issued then, and the FLOPs of the
    HGMMAs some floating-point or MUFU instruction runs beside (the address arithmetic between
    the HGMMAs of one group does not make them overlap the softmax). None without warpgroup
    MMA. An HGMMA marked `gsb0` closes a group, `WARPGROUP.DEPBAR.LE gsb0, N` leaves at most N
    groups pending."""
    if not any(inst.base == "HGMMA" for inst in body):
        return None
    groups: list[list[int]] = [[]]  # indices of the HGMMAs of each pending group, the last open
    counts, beside = Counter(instructions=0, mufu=0), set()
    for walk in range(2):
        for i, inst in enumerate(body):
            if inst.base == "HGMMA":
                groups[-1].append(i)
                if "gsb0" in inst.operands:
                    groups.append([])
            elif inst.opcode.startswith("WARPGROUP.DEPBAR"):
                wait = _DEPBAR.search(inst.operands)
                keep = int(wait.group(1), 0) if wait else 0
                groups = (groups[:-1][-keep:] if keep else []) + [groups[-1]]
            elif walk and any(groups) and classify(inst.opcode) != "mma":
                counts["instructions"] += 1
                counts["mufu"] += inst.base == "MUFU"
                if classify(inst.opcode) in ("mufu", "fma", "fp_other"):  # the softmax's work
                    beside.update(i for group in groups for i in group)
    flops, _ = mma_flops([body[i] for i in sorted(beside)], num_warps)
    return dict(counts, mma_flops=flops)


# --------------------------------------------------------------------------------------------
# tcgen05 (sm_100a): shapes from the instruction descriptors, groups from commit to wait
# --------------------------------------------------------------------------------------------

_IDESC = re.compile(r"idesc\[(UR\d+)\]")
_UMOV_IMMEDIATE = re.compile(r"^(UR\d+)\s*,\s*(0x[0-9a-f]+|\d+)$")
_BRACKETS = re.compile(r"\[([^\]]+)\]")
#: The input types of kind::f16 / kind::tf32 instruction descriptors (bits 7-9).
_TCGEN05_TYPES = {0: "F16", 1: "BF16", 2: "TF32"}


def is_tcgen05(inst: Instruction) -> bool:
    return inst.base in TCGEN05_MMA


def tcgen05_shape(inst: Instruction, body: list[Instruction], before: list[Instruction]):
    """(M, N, K, input type) of a tcgen05 MMA of the loop body, from the `UMOV URn, imm` that
    last set its instruction descriptor register (earlier in the body, else later in it: set in
    the previous iteration, else before the loop); None where that is not a constant or the
    opcode's kind is not 16-bit or TF32 (UTCHMMA)."""
    idesc = _IDESC.search(inst.operands)
    if not idesc or inst.base != "UTCHMMA":
        return None
    register, at = idesc.group(1), body.index(inst)
    for candidate in [*body[:at][::-1], *body[at + 1 :][::-1], *before[::-1]]:
        if not candidate.operands.startswith(register + ","):  # not a write of the register
            continue
        value = _UMOV_IMMEDIATE.match(candidate.operands) if candidate.base == "UMOV" else None
        if value is None:
            return None
        bits = int(value.group(2), 0)
        kind = _TCGEN05_TYPES.get((bits >> 7) & 7)
        if kind is None:
            return None
        m, n = ((bits >> 24) & 0x1F) << 4, ((bits >> 17) & 0x3F) << 3
        return m, n, 8 if kind == "TF32" else 16, kind
    return None


def tcgen05_flops(
    body: list[Instruction], before: list[Instruction], num_warps: int
) -> tuple[list[int], Counter]:
    """FLOPs of each instruction of the body (0 but for MMAs: a tcgen05 MMA's 2 M N K, issued
    once per CTA; a warp-level HMMA beside them, as `mma_flops` counts it), and the MMA shapes it
    holds (`UTCHMMA.128x64x16.BF16`; `UTCHMMA.?` when unread)."""
    flops, shapes = [], Counter()
    for inst in body:
        if not is_tcgen05(inst):
            warp_level, shape = mma_flops([inst], num_warps)
            flops.append(warp_level)
            shapes.update(shape)
            continue
        shape = tcgen05_shape(inst, body, before)
        if shape is None:
            flops.append(0)
            shapes[f"{inst.base}.?"] += 1
        else:
            m, n, k, kind = shape
            flops.append(2 * m * n * k)
            shapes[f"{inst.base}.{m}x{n}x{k}.{kind}"] += 1
    return flops, shapes


def _barrier(inst: Instruction) -> str | None:
    found = _BRACKETS.search(inst.operands)
    return found.group(1) if found else None


def tcgen05_in_flight(body: list[Instruction], flops: list[int]) -> tuple[dict, list[int]]:
    """What one iteration does while a tcgen05 MMA is in flight, as `in_flight` for warpgroup
    MMA (steady state: the body walked twice, the second walk counted), and the MMA groups still
    pending after each wait on an MMA barrier (`loop_waits`). An MMA is in flight from its issue
    to the first wait (`SYNCS.PHASECHK`) on the barrier its group is committed to (`UTCBAR`)."""
    issued: list[int] = []  # MMAs not committed yet
    pending: dict[str, list[int]] = {}  # committed groups by barrier
    counts, beside, waits = Counter(instructions=0, mufu=0), set(), set()
    for walk in range(2):
        for i, inst in enumerate(body):
            barrier = _barrier(inst)
            if is_tcgen05(inst):
                issued.append(i)
            elif inst.base == "UTCBAR" and barrier:
                pending.setdefault(barrier, []).extend(issued)
                issued = []
            elif inst.opcode.startswith("SYNCS.PHASECHK") and pending.get(barrier):
                del pending[barrier]
                if walk:
                    waits.add(sum(map(bool, pending.values())))
            elif walk and (issued or any(pending.values())) and classify(inst.opcode) != "mma":
                counts["instructions"] += 1
                counts["mufu"] += inst.base == "MUFU"
                if classify(inst.opcode) in ("mufu", "fma", "fp_other"):  # the softmax's work
                    beside.update(issued, *pending.values())
    return dict(counts, mma_flops=sum(flops[i] for i in beside)), sorted(waits)


def tcgen05_figures(
    instructions: list[Instruction], span: tuple[int, int], num_warps: int
) -> dict | None:
    """The tcgen05 reading of a hot loop (module docstring), None without tcgen05 MMA in it:
    FLOPs and shapes, `in_flight`, `loop_waits`, the MMAs fed A (P) from tensor memory and the
    loop's TMEM loads and stores."""
    body, before = instructions[span[0] : span[1] + 1], instructions[: span[0]]
    mmas = [inst for inst in body if is_tcgen05(inst)]
    if not mmas:
        return None
    flops, shapes = tcgen05_flops(body, before, num_warps)
    overlap, waits = tcgen05_in_flight(body, flops)
    return dict(
        issued=sum(flops),
        shapes=shapes,
        in_flight=overlap,
        loop_waits=waits,
        tmem_a=sum(inst.operands.startswith("tmem[") for inst in mmas),
        tmem_moves=dict(
            ld=sum(inst.base == "LDTM" for inst in body),
            st=sum(inst.base == "STTM" for inst in body),
        ),
    )


def tile_flops(kernel: str, constexprs: dict) -> tuple[int, str]:
    """The FLOPs of one iteration's dots and the tile (rows x cols of its score block; a GEMM's
    rows x cols x reduction block)."""
    if kernel in GEMM_DOTS:
        dots, rows, cols, depth = GEMM_DOTS[kernel]
        dots += bool(constexprs.get("GATED"))
        r, c, k = constexprs[rows], constexprs[cols], constexprs[depth]
        return 2 * r * c * k * dots, f"{r}x{c}x{k}"
    qk_dots, v_dots, rows, cols = KERNEL_DOTS[kernel]
    qk_dots += bool(constexprs.get("ATOMIC_DQ"))
    if not constexprs.get("WITH_DK", True):  # the split dK/dV pass's dV launch: no dP, no dK
        qk_dots, v_dots = qk_dots - 1, v_dots - 1
    if not constexprs.get("WITH_DV", True):  # its dK launch: no dV
        v_dots -= 1
    r, c, d = constexprs[rows], constexprs[cols], constexprs["BLOCK_D"]
    d_v = constexprs.get("BLOCK_DV", d)  # v's head block (MLA: narrower than q's)
    return 2 * r * c * (qk_dots * d + v_dots * d_v), f"{r}x{c}"


def analyse(sass: str, ptx: str, kernel: str, constexprs: dict, num_warps: int, arch: str) -> dict:
    """The hot loop's figures for one compiled kernel (module docstring): a JSON-able dict."""
    instructions, labels = parse_sass(sass)
    waits = [int(n) for n in _WAIT_GROUP.findall(ptx)]
    flops, tile = tile_flops(kernel, constexprs)
    result = dict(
        tile=tile,
        tile_flops=flops,
        num_warps=num_warps,
        deepest_wait_group=max(waits) if waits else None,
    )
    span = hot_loop(instructions, labels)
    if span is None:
        return dict(result, problems=["no loop with MMA instructions"])
    body = instructions[span[0] : span[1] + 1]
    mix = Counter(classify(inst.opcode) for inst in body)
    mix["total"] = len(body)
    mufu = Counter(inst.opcode for inst in body if inst.base == "MUFU")
    tcgen05 = tcgen05_figures(instructions, span, num_warps)
    if tcgen05:
        issued, shapes = tcgen05.pop("issued"), tcgen05.pop("shapes")
        loop_waits, overlap = tcgen05.pop("loop_waits"), tcgen05.pop("in_flight")
    else:
        issued, shapes = mma_flops(body, num_warps)
        loop_waits = sorted(
            {
                int(m.group(1), 0)
                for inst in body
                if inst.opcode.startswith("WARPGROUP.DEPBAR")
                and (m := _DEPBAR.search(inst.operands))
            }
        )
        overlap = in_flight(body, num_warps)
    rate = MMA_RATE[arch] * (TF32_FACTOR if any(".TF32" in s for s in shapes) else 1)
    mma_clocks = issued / rate
    mufu_clocks = mix["mufu"] * num_warps * 32 / MUFU_RATE
    issue_clocks = (mix["total"] - mix["mma"]) * num_warps / ISSUE_RATE
    softmax = max(mufu_clocks, issue_clocks)
    hidden = 0.0
    if overlap:  # the share of the bound resource's work issued beside an MMA, up to that MMA
        if mufu_clocks >= issue_clocks:
            share = overlap["mufu"] / max(mix["mufu"], 1)
        else:
            share = overlap["instructions"] / max(mix["total"] - mix["mma"], 1)
        hidden = min(share * softmax, overlap["mma_flops"] / rate)
    return dict(
        result,
        loop=[body[0].address, body[-1].address],
        mix={k: mix.get(k, 0) for k in [c for c, _ in CLASSES] + ["other", "total"]},
        mufu=dict(mufu),
        mma_shapes=dict(shapes),
        mma_issued_flops=issued,
        mma_ratio=issued / flops,
        loop_waits=loop_waits,
        in_flight=overlap,
        clocks=dict(mma=mma_clocks, mufu=mufu_clocks, issue=issue_clocks),
        bound="mufu" if mufu_clocks >= issue_clocks else "issue",
        mma_busy=mma_clocks / (mma_clocks + softmax) if mma_clocks + softmax else 0.0,
        mma_busy_overlapped=mma_clocks / (mma_clocks + softmax - hidden)
        if mma_clocks + softmax
        else 0.0,
        problems=(["duplicated MMA"] if issued > flops else [])
        + (["MMA shape unread"] if any(s.endswith(".?") for s in shapes) else []),
        **({"tcgen05": tcgen05} if tcgen05 else {}),
    )


def disassemble(cubin: bytes) -> str:
    """SASS of a cubin, with the nvdisasm Triton's wheel ships (or TRITON_NVDISASM_PATH)."""
    import triton

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "kernel.cubin")
        path.write_bytes(cubin)
        return subprocess.run(
            [triton.knobs.nvidia.nvdisasm.path, "-c", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout


# --------------------------------------------------------------------------------------------
# The table (compile_report.py prints it after its own; attention_hot_loops.py alone)
# --------------------------------------------------------------------------------------------


def config_label(row: dict) -> str:
    """A compile report row's config: its blocks, warps and stages ("M128 N64 w4 s3")."""
    blocks = " ".join(f"{k.removeprefix('BLOCK_')}{v}" for k, v in row["blocks"].items())
    text = f"{blocks} w{row.get('num_warps', '?')} s{row.get('num_stages', '?')}"
    return text + " (default)" if row["default"] else text


def _mix(row: dict) -> str:
    mix = row["mix"]
    return f"{mix['total']} ({mix['mma']}/{mix['mufu']}/{mix['fma']}/{mix['load']}/{mix['sync']})"


def _clocks(row: dict) -> str:
    return " : ".join(f"{row['clocks'][k]:.0f}" for k in ("mma", "mufu", "issue"))


def _beside(row: dict) -> str:
    overlap = row["in_flight"]
    return f"{overlap['instructions']} ({overlap['mufu']})" if overlap else "-"


#: The table's columns after (op, kernel, case, config, arch): heading and cell, from `analyse`.
FIGURES = {
    "tile": lambda row: row["tile"],
    "loop instr (MMA/MUFU/FMA/ld/sync)": _mix,
    "MMA issued / tile": lambda row: f"{row['mma_ratio']:.2f}",
    "MMA : MUFU : issue clocks": _clocks,
    "MMA busy (no overlap / overlap)": lambda row: (
        f"{row['mma_busy']:.0%} / {row['mma_busy_overlapped']:.0%}"
    ),
    "wait in loop (PTX max)": lambda row: (
        f"{','.join(map(str, row['loop_waits'])) or '-'} ({row['deepest_wait_group']})"
    ),
    "instr (MUFU) beside MMA": _beside,
    "MMA fed A from TMEM": lambda row: (
        f"{row['tcgen05']['tmem_a']} of {row['mix']['mma']}" if "tcgen05" in row else "-"
    ),
}


def table(rows: list[dict]) -> str:
    """Markdown table of compile report rows with their hot loop's figures (`analyse`, kept as
    the row's `hot_loop`); a row that did not compile or has no MMA loop: dashes."""
    heading = ["op", "kernel", "case", "config", "arch", *FIGURES, "flags"]
    lines = [f"| {' | '.join(heading)} |", "|" + "---|" * len(heading)]
    for row in rows:
        figures = row.get("hot_loop") or {}
        cells = [cell(figures) if "mix" in figures else "-" for cell in FIGURES.values()]
        flags = "; ".join(row["problems"] + row.get("notes", [])) or "ok"
        where = [row["op"], f"`{row['kernel']}`", row["case"], config_label(row), row["arch"]]
        lines.append(f"| {' | '.join([*where, *cells, flags])} |")
    return "\n".join(lines)
