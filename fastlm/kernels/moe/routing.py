"""Routing metadata of a mixture of experts: the router's (T, k) choices grouped by expert.

For expert_ids (T, k) (flattened: assignment a = t * k + j goes to expert ids[a]), three small
kernels compute, without a host sync and without atomics (so the order is deterministic):

    counts[e]             assignments to expert e                      (histogram, per block)
    expert_offsets[e]     sum of counts[e'] for e' < e, (E + 1,) int32   (exclusive prefix sum)
    sorted_assignments[p] the assignment at position p of the expert-major order, (T k,) int32;
                          within an expert, assignments in increasing a (a stable sort)

The grouped GEMMs read rows expert_offsets[e] .. expert_offsets[e + 1] of that order for expert
e, and the token of position p is sorted_assignments[p] // k.

An id outside [0, E) is counted for no expert and placed nowhere: no kernel ever reads or
writes out of bounds with it. The public function (`fastlm.moe_experts`) refuses such ids
before: on the host for CPU tensors, by a device-side assert on a GPU and under torch.compile
(no host sync per step), as `fastlm.cross_entropy` checks its targets.
"""

from __future__ import annotations

import torch

from fastlm.kernels import _common
from fastlm.kernels._common import tl, triton

#: Assignments a histogram or scatter program handles (in sub-blocks of SUB_BLOCK), so that the
#: one sequential kernel (the prefix sum over blocks) has few blocks to walk.
BLOCK, SUB_BLOCK = 1024, 128


def block() -> int:
    """The assignments of a program: BLOCK on a GPU; one sub-block under Triton's interpreter,
    which pays per sub-block whether it holds assignments or not (the tests' tens of
    assignments made 8 passes, 7 of them empty: 63 -> 11 ms a call). The same kernels either
    way (BLOCK is a constexpr of theirs); only the number of programs changes."""
    return SUB_BLOCK if _common.interpreting() else BLOCK


@triton.jit
def _histogram_kernel(
    IDS, COUNTS,  #
    n, E,  #
    BLOCK: tl.constexpr, SUB_BLOCK: tl.constexpr, E_PAD: tl.constexpr
):
    """COUNTS[b, e]: the assignments of block b that go to expert e."""
    b = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, BLOCK, SUB_BLOCK):
        a = b * BLOCK + start + tl.arange(0, SUB_BLOCK)
        e = tl.load(IDS + a, mask=a < n, other=-1).to(tl.int32)
        onehot = (e[:, None] == experts[None, :]) & (experts[None, :] < E)
        counts += tl.sum(onehot.to(tl.int32), axis=0)
    tl.store(COUNTS + b * E_PAD + experts, counts)


@triton.jit
def _offsets_kernel(COUNTS, STARTS, EXPERT_OFFSETS,  #
                    n_blocks, E,  #
                    E_PAD: tl.constexpr):
    """EXPERT_OFFSETS (E + 1,): the exclusive prefix sum of the experts' counts; STARTS[b,
    e]: where block b's first assignment to expert e goes (one program: n_blocks is small)."""
    experts = tl.arange(0, E_PAD)
    totals = tl.zeros([E_PAD], dtype=tl.int32)
    for b in range(0, n_blocks):
        totals += tl.load(COUNTS + b * E_PAD + experts)
    ends = tl.cumsum(totals, axis=0)
    tl.store(EXPERT_OFFSETS + 1 + experts, ends, mask=experts < E)
    tl.store(EXPERT_OFFSETS + experts, tl.zeros([E_PAD], dtype=tl.int32), mask=experts == 0)
    running = ends - totals
    for b in range(0, n_blocks):
        tl.store(STARTS + b * E_PAD + experts, running)
        running += tl.load(COUNTS + b * E_PAD + experts)


@triton.jit
def _scatter_kernel(
    IDS, STARTS, SORTED,  #
    n, E,  #
    BLOCK: tl.constexpr, SUB_BLOCK: tl.constexpr, E_PAD: tl.constexpr
):
    """SORTED[p] = a for each assignment a of block b, at p = its expert's STARTS entry
    plus its rank among the block's earlier assignments to the same expert (a cumulative sum of
    one-hot rows: stable, no atomics)."""
    b = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    next_slot = tl.load(STARTS + b * E_PAD + experts)  # per expert, the next free position
    for start in range(0, BLOCK, SUB_BLOCK):
        a = b * BLOCK + start + tl.arange(0, SUB_BLOCK)
        e = tl.load(IDS + a, mask=a < n, other=-1).to(tl.int32)
        onehot = ((e[:, None] == experts[None, :]) & (experts[None, :] < E)).to(tl.int32)
        # rank (from 1) of each assignment among the sub-block's ones to its expert
        rank = tl.cumsum(onehot, axis=0)
        slot = tl.sum(onehot * (next_slot[None, :] + rank - 1), axis=1)
        valid = tl.sum(onehot, axis=1) > 0
        tl.store(SORTED + slot, a.to(tl.int32), mask=valid)
        next_slot += tl.sum(onehot, axis=0)


def _int32_output(n: int, device) -> torch.Tensor:
    """An int32 output, filled with -1 (no valid position or count) under POISON_OUTPUTS."""
    if _common.POISON_OUTPUTS:
        return torch.full((n, ), -1, device=device, dtype=torch.int32)
    return torch.empty((n, ), device=device, dtype=torch.int32)


def route(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_assignments (T k,) int32, expert_offsets (E + 1,) int32) of expert_ids (T, k)
    (any integer dtype and strides; ids outside [0, E) are placed nowhere, see the module
    docstring)."""
    ids = expert_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    n = ids.numel()
    e_pad = max(16, triton.next_power_of_2(num_experts))
    program_block = block()
    n_blocks = max(1, triton.cdiv(n, program_block))
    device = expert_ids.device
    block_counts = torch.empty((n_blocks, e_pad), device=device, dtype=torch.int32)
    block_offsets = torch.empty((n_blocks, e_pad), device=device, dtype=torch.int32)
    sorted_assignments = _int32_output(n, device)
    expert_offsets = _int32_output(num_experts + 1, device)
    sizes = dict(BLOCK=program_block, SUB_BLOCK=SUB_BLOCK, E_PAD=e_pad)
    _histogram_kernel[(n_blocks, )](ids, block_counts, n, num_experts, **sizes)
    _offsets_kernel[
        (1, )](block_counts, block_offsets, expert_offsets, n_blocks, num_experts, E_PAD=e_pad)
    _scatter_kernel[(n_blocks, )](ids, block_offsets, sorted_assignments, n, num_experts, **sizes)
    return sorted_assignments, expert_offsets


def route_ref(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` in PyTorch (a stable sort by expert)."""
    ids = expert_ids.reshape(-1).to(torch.int64)
    counts = torch.bincount(ids, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    offsets[1:] = counts.cumsum(0)
    order = torch.sort(ids, stable=True).indices.to(torch.int32)
    return order, offsets
