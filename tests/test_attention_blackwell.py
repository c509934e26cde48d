"""What Blackwell (compute capability 10.x) runs apart from the other archs, checked where it can
be without a B200: the launcher's routing of the fp32 atomic-dQ schedule at head dim 128 to the
deterministic passes (`configs.atomic_max_block_d`), against the float64 reference (`run_dense`:
strided inputs, poisoned outputs, sizes off the blocks)."""

from __future__ import annotations

import pytest
import torch
from attention_harness import make_heads, run_dense

from fastlm.kernels.attention import backward


@pytest.mark.parametrize("major,atomic_launches", [(9, 1), (10, 0)], ids=["sm90", "sm100"])
def test_fp32_atomic_dq_at_128_runs_the_deterministic_passes_on_blackwell(
    device, monkeypatch, major, atomic_launches
):
    """deterministic=False with fp32 at head dim 128: the one atomic pass on Hopper, the dK/dV
    and dQ passes on Blackwell (its atomic pass's one tcgen05 shape spilled); both correct."""
    launches = []
    atomic = backward._attention_bwd_dkdv_dq_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return atomic[grid]

    monkeypatch.setattr(backward, "capability", lambda tensor: major)
    monkeypatch.setattr(backward, "_attention_bwd_dkdv_dq_kernel", Spy())
    q, k, v = make_heads(1, 2, 1, 37, 45, 128, torch.float32, device)
    run_dense(q, k, v, True, deterministic=False)
    assert len(launches) == atomic_launches
