"""Host-side pieces both launchers share: output allocation in the caller's memory layout, the
1-D grid, tuning buckets, compile-time flags, packed-sequence arguments, the option arguments
(window, cap) as the kernels take them, and the choice of tensor descriptors."""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from fastlm.backend import interpreting
from fastlm.kernels._common import empty, interpreter_bf16, tl, triton
from fastlm.kernels.attention.blocks import (
    SOFTCAP_APPROX,
    SOFTCAP_APPROX_MODEL,
    SOFTCAP_EXACT,
    SOFTCAP_OFF,
)
from fastlm.kernels.attention.configs import MAX_HEAD_DIM, MAX_HEAD_DIM_FP32, TMA_MAX_BLOCK_D

LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453


def empty_heads_like(t: torch.Tensor, dtype=None, head_dim: int | None = None) -> torch.Tensor:
    """An output shaped like `t` (B, H, N, D), in t's token-major [B, N, H, D] memory layout when t
    is a transposed view of one, so that the caller's `transpose(1, 2).reshape(B, N, H * D)` is
    free. head_dim: another last dim (o and dO take v's head dim, which may differ from q's)."""
    B, H, N, D = t.shape
    D = head_dim or D
    dtype = dtype or t.dtype
    if t.stride(1) < t.stride(2):
        return empty((B, N, H, D), device=t.device, dtype=dtype).transpose(1, 2)
    return empty((B, H, N, D), device=t.device, dtype=dtype)


def block_grid(n_rows: int, block: str, batch_heads: int):
    """The 1-D grid `block_start_and_batch_head` decomposes: cdiv(n_rows, BLOCK) * (B * H)
    programs,
    BLOCK the launch's (possibly autotuned) block size named `block`."""
    return lambda meta: (triton.cdiv(n_rows, meta[block]) * batch_heads, )


def tuning_bucket(n: int) -> int:
    return triton.next_power_of_2(n)


def head_block(head_dim: int) -> int:
    """The power-of-two tile width (at least 16, tl.dot's minimum) that holds a head dim."""
    return max(16, triton.next_power_of_2(head_dim))


def kernel_flags(q: torch.Tensor, v: torch.Tensor, causal: bool, allow_tf32: bool) -> dict:
    """Compile-time arguments shared by the forward and backward kernels: HEAD_DIM is q's and
    k's, HEAD_DIM_V v's (and o's, dO's, dv's), equal but for MLA-style attention."""
    full_fp32 = q.dtype == torch.float32 and not allow_tf32
    return dict(
        HEAD_DIM=q.shape[-1], BLOCK_D=head_block(q.shape[-1]), HEAD_DIM_V=v.shape[-1],
        BLOCK_DV=head_block(v.shape[-1]), CAUSAL=causal, TO_FP32=interpreter_bf16(q.dtype),
        DOT_PRECISION="ieee" if full_fp32 else "tf32"
    )


class Varlen(NamedTuple):
    """Packed sequences for the launchers: q, k, v are (1, H, total, D) views of the packed
    (total, H, D) tensors, and sequence i holds rows cu_seqlens_*[i] to cu_seqlens_*[i + 1]
    (int32 on the device), none longer than max_seqlen_*."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def sequence_args(q, k, varlen: Varlen | None) -> tuple:
    """(cu_seqlens_q, cu_seqlens_k, sequences, n_q, n_k): what the kernels index by batch. n_q,
    n_k: the (longest) sequence lengths, which size the grids and the tuning buckets. The kernels
    read cu_seqlens as contiguous: a strided view (a column of a table) is copied first."""
    if varlen is None:
        return None, None, q.shape[0], q.shape[2], k.shape[2]
    return (
        varlen.cu_seqlens_q.contiguous(), varlen.cu_seqlens_k.contiguous(),
        varlen.cu_seqlens_q.numel() - 1, varlen.max_seqlen_q, varlen.max_seqlen_k
    )


def kernel_strides(t: torch.Tensor, varlen: Varlen | None) -> tuple:
    """t's strides for a kernel; packed sequences start at their rows, not at a batch stride."""
    return (0, *t.stride()[1:]) if varlen is not None else t.stride()


def option_args(
    causal: bool, window: tuple[int, int], softcap: float, n_q: int, n_k: int,
    softcap_approx: bool = False
):
    """(window_left, window_right, softcap) as the kernels take them, and their flags.

    A window side of -1 (unbounded) becomes one that reaches every key (n_k to the left, n_q to
    the right: every diagonal lies in [n_k - n_q, n_k)); causal makes the right side 0. The cap
    goes into base-2 units, and SOFTCAP says which (`blocks.SOFTCAP_*`): the approximate one is
    tanh.approx.f32 on a GPU, its error model in the interpreter (which cannot run inline PTX).
    HAS_WINDOW only when a side bounds more than the causal mask does, so the plain causal and
    full kernels stay as they are.
    """
    left, right = window
    has_window = left >= 0 or (right >= 0 and not causal)
    if causal:
        right = 0
    args = (left if left >= 0 else n_k, right if right >= 0 else n_q, softcap * LOG2_E)
    mode = SOFTCAP_OFF
    if softcap > 0:
        mode = SOFTCAP_EXACT
        if softcap_approx:
            mode = SOFTCAP_APPROX_MODEL if interpreting() else SOFTCAP_APPROX
    return args, dict(HAS_WINDOW=has_window, SOFTCAP=mode)


def check_kernel_head_dim(D: int, name: str = "q", dtype: torch.dtype | None = None) -> None:
    """PyTorch's attention takes any head dim; the kernels only these (q's and k's, and v's),
    fewer in fp32."""
    limit = MAX_HEAD_DIM_FP32 if dtype == torch.float32 else MAX_HEAD_DIM
    if D % 8 or not 8 <= D <= limit:
        raise ValueError(
            f"{name} has head dim {D}; the Triton kernel takes multiples of 8 from 8 to "
            f"{MAX_HEAD_DIM} ({MAX_HEAD_DIM_FP32} in fp32; FASTLM_BACKEND=torch runs any)"
        )


def as_heads(t: torch.Tensor) -> torch.Tensor:
    """A packed (total, H, D) tensor as the launchers' (1, H, total, D) view."""
    return t.unsqueeze(0).transpose(1, 2)


def as_packed(t: torch.Tensor) -> torch.Tensor:
    """The launchers' (1, H, total, D) output as (total, H, D)."""
    return t[0].transpose(0, 1)


# Tensor descriptors (TMA on sm_90+) for the forward's q, k, v, o and the dQ pass's streamed k and
# v: FASTLM_ATTENTION_TMA=1 forces them wherever this Triton has them (the interpreter too, which
# is how the tests run both paths), 0 forbids them; unset, they are used on CUDA devices of
# capability 9 or more. Read at each call.
_HAS_TENSOR_DESCRIPTORS = hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")


@functools.cache
def _device_has_tma(device: torch.device) -> bool:
    """Once per device: a CUDA GPU of compute capability 9.0 or more."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _descriptor_allocator(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for descriptors built on the device (Triton asks through set_allocator)."""
    return torch.empty(size, dtype=torch.uint8, device=_descriptor_allocator.device)


def use_tensor_descriptors(*tensors: torch.Tensor) -> bool:
    """Whether a pass takes its descriptor path for these tensors (the forward's q, k, v, o; the
    dQ pass's k, v): the device and this Triton can, and every tensor has a unit last stride and
    16-byte aligned base and strides (what a TMA descriptor requires); otherwise the pointer
    path."""
    mode = os.environ.get("FASTLM_ATTENTION_TMA", "")
    if mode == "0" or not _HAS_TENSOR_DESCRIPTORS:
        return False
    first = tensors[0]
    # The descriptor configs were checked spill-free for 16-bit head dims up to 128 only (the
    # interpreter, where tests force the path, has no registers to spill).
    if not interpreting(
    ) and (first.element_size() != 2 or max(t.shape[-1] for t in tensors) > TMA_MAX_BLOCK_D):
        return False
    if mode != "1" and (interpreting() or not _device_has_tma(first.device)):
        return False
    for t in tensors:
        size = t.element_size()
        if (
            t.stride(-1) != 1 or t.data_ptr() % 16
            or any(stride * size % 16 for stride in t.stride()[:-1])
        ):
            return False
    if getattr(_descriptor_allocator, "device", None) != first.device:
        _descriptor_allocator.device = first.device
        triton.set_allocator(_descriptor_allocator)
    return True


def sink_args(sinks: torch.Tensor | None) -> tuple[torch.Tensor | None, dict]:
    """Attention sinks as the forward kernels take them: fp32 in base-2 units (the scores'), and
    their flag; None and HAS_SINKS=False without them, so the plain kernels stay as they are."""
    if sinks is None:
        return None, dict(HAS_SINKS=False)
    return sinks.float() * LOG2_E, dict(HAS_SINKS=True)
