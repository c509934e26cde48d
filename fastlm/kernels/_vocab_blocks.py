"""A row of logits streamed through vocabulary blocks: the online log-sum-exp that the plain
cross-entropy (`fastlm.kernels.cross_entropy`) and the one with options
(`fastlm.kernels.cross_entropy_options`) both build on, in a file of its own so that each of them
imports it and neither imports the other's internals.

For a row x, a block at a time: m = max_j x_j and s = sum_j exp(x_j - m), with s rescaled by
exp(m_old - m_new) as m grows (fp32).
"""

from __future__ import annotations

from fastlm.backend import interpreting
from fastlm.kernels._common import tl, triton

#: Largest vocabulary block a program loads at once (a row of more entries loops over blocks).
#: The interpreter's is smaller so that the test suite's vocabularies span several blocks.
MAX_BLOCK_V = 4096
MAX_BLOCK_V_INTERPRETER = 1024


@triton.jit
def _load_block(logits_row, start, n_cols, BLOCK_V: tl.constexpr):
    """(x, cols, mask): logits [start, start + BLOCK_V) in fp32, -inf past the row's end."""
    cols = start + tl.arange(0, BLOCK_V)
    mask = cols < n_cols
    x = tl.load(logits_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
    return x, cols, mask


@triton.jit
def _online_lse_step(x, running_max, running_sum):
    """Fold a block x into (running max m, running sum of exp(x - m))."""
    new_max = tl.maximum(running_max, tl.max(x, axis=0))
    # Every logit so far -inf (masked): new_max is -inf and exp(-inf - (-inf)) would be NaN.
    # Any finite reference works while the sum is 0, so take 0 until a finite logit is seen.
    max_ref = tl.where(new_max == float("-inf"), 0.0, new_max)
    running_sum = running_sum * tl.exp(running_max - max_ref) + tl.sum(tl.exp(x - max_ref), axis=0)
    return new_max, running_sum


def _block_v(n_cols: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for rows of n_cols logits streamed through blocks."""
    max_block = MAX_BLOCK_V_INTERPRETER if interpreting() else MAX_BLOCK_V
    block_v = min(triton.next_power_of_2(n_cols), max_block)
    return block_v, 8 if block_v >= 2048 else 4
