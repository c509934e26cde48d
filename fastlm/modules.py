"""The nn.Modules fastlm.Transformer is built from, on fastlm's ops: drop-ins for the reference's.

Each has its `fastlm.reference` counterpart's constructor, parameter names and state_dict, and
runs the matching op of `fastlm.kernels` (which picks the Triton kernels or PyTorch by the backend
rule). The ops themselves know nothing of modules or of the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastlm import reference
from fastlm.kernels.cross_entropy import check_ignore_index, cross_entropy
from fastlm.kernels.linear import half_linear
from fastlm.kernels.moe.experts import moe_experts
from fastlm.kernels.rmsnorm import rms_norm
from fastlm.kernels.rope import rope_tables, rotate_in_place
from fastlm.kernels.swiglu import swiglu, swiglu_packed
from fastlm.options import check


class RmsNorm(reference.RmsNorm):
    """`reference.RmsNorm` (same constructor, parameter `g`, state_dict) running `rms_norm`.

    Args:
        d_model: the normalised (last) dim.
        eps: added to the mean square (default 1e-5), a finite number > 0 (`fastlm.options`).
        device, dtype: of the gain `g`, initialised to ones (default: PyTorch's defaults).

    Raises:
        TypeError, ValueError: an eps that `fastlm.options` refuses (at construction, not at the
            first forward).
    """

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__(d_model, check("eps", eps), device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised x, by `fastlm.rms_norm`.

        Args:
            x: (..., d_model) float32, float16 or bfloat16.

        Returns:
            x's shape and dtype.

        Raises:
            TypeError: as `fastlm.rms_norm`.
            ValueError: as `fastlm.rms_norm`.
        """
        return rms_norm(x, self.g, self.eps)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}"


class RoPE(nn.Module):
    """Drop-in for `fastlm.reference.RoPE` that rotates x in its own storage and returns it.

    The tables are non-persistent buffers `cos_cached` and `sin_cached` of shape
    (max_seq_len, d_k // 2) (one column per pair; the reference repeats each column twice), so
    the state_dict is empty, as the reference's.

    Args:
        theta: the base (10000.0 in most models).
        d_k: the head dim, even.
        max_seq_len: the number of positions the tables hold, at least 1.
        device: of the tables (default: PyTorch's default device).
        interleaved: the pair layout (default True: interleaved); False selects the half-split
            (NeoX / Hugging Face) layout.

    Raises:
        ValueError: an odd d_k or a max_seq_len below 1 (`rope_tables`).
    """

    def __init__(
        self, theta: float, d_k: int, max_seq_len: int, device=None, interleaved: bool = True
    ):
        super().__init__()
        self.theta = theta
        self.d_k = d_k
        self.max_seq_len = max_seq_len
        self.interleaved = interleaved
        cos, sin = rope_tables(theta, d_k, max_seq_len, device)
        self.register_buffer("cos_cached", cos, persistent=False)
        self.register_buffer("sin_cached", sin, persistent=False)

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor) -> torch.Tensor:
        """Rotate x in place by the angles of its tokens' positions, and return it.

        Args:
            x: (..., T, d_k) as (T, D), (B, T, D) or (B, H, T, D); float32, float16 or
                bfloat16, not a leaf that requires grad (or a view of one).
            token_positions: (T,) or (B, T) int32 or int64 in [0, max_seq_len).

        Returns:
            x itself, rotated.

        Raises:
            TypeError: as `fastlm.apply_rope_`.
            ValueError: a last dim other than d_k; otherwise as `fastlm.apply_rope_`.
        """
        if x.shape[-1] != self.d_k:
            raise ValueError(f"x must have last dim d_k={self.d_k}, got {tuple(x.shape)}")
        (x,) = rotate_in_place(
            {"x": x}, self.cos_cached, self.sin_cached, token_positions, self.interleaved
        )
        return x

    def extra_repr(self) -> str:
        return (
            f"theta={self.theta}, d_k={self.d_k}, max_seq_len={self.max_seq_len}, "
            f"interleaved={self.interleaved}"
        )


class SwiGlu(nn.Module):
    """w2(silu(w1 x) * w3 x): `fastlm.reference.SwiGlu`'s parameters and state_dict keys (w1.w,
    w2.w, w3.w), with the activation and its backward in one kernel each.

    Given its weights already cast for autocast (`half`: W1|W3 stacked by rows, and W2; the model's
    block casts all its weights at once with `cast_weights`), it runs one GEMM on W1|W3, whose
    input gradient is then one GEMM too, and `swiglu_packed` on its output. Otherwise two GEMMs and
    `swiglu`: stacking fp32 weights would copy them every step just for that.

    Args:
        d_model: the input and output width.
        d_ff: the hidden width (w1, w3: d_model -> d_ff; w2: d_ff -> d_model).
        device, dtype: of the three weights (default: PyTorch's defaults).
    """

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.d_model = d_model
        self.d_ff = d_ff
        self.w1 = reference.Linear(d_model, d_ff, device, dtype)
        self.w2 = reference.Linear(d_ff, d_model, device, dtype)
        self.w3 = reference.Linear(d_model, d_ff, device, dtype)

    def cast_groups(self) -> list[list[torch.Tensor]]:
        """The weight groups `half` holds, for `cast_weights`.

        Returns:
            [[W1, W3], [W2]]: W1 and W3 stacked, then W2.
        """
        return [[self.w1.w, self.w3.w], [self.w2.w]]

    def forward(
        self, x: torch.Tensor, half: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The feed-forward output.

        Args:
            x: (..., d_model).
            half: (W1|W3, W2) cast to the autocast dtype by `cast_weights`, or None (the default).

        Returns:
            (..., d_model); with `half`, in half's dtype.
        """
        if half is None:
            return F.linear(swiglu(F.linear(x, self.w1.w), F.linear(x, self.w3.w)), self.w2.w)
        w13, w2 = half
        gate_up = half_linear(x, w13, self.w1.w, self.w3.w)  # (..., 2 d_ff): gate | up
        return half_linear(swiglu_packed(gate_up), w2, self.w2.w)


class StackedExperts(reference.StackedExperts):
    """`reference.StackedExperts` (parameters `gate_up` (E, 2F, D), `down` (E, D, F), same
    init) running `fastlm.moe_experts`: the routing metadata and the grouped GEMMs in a few
    kernels, forward and backward, instead of a loop over experts."""

    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        """The weighted sum of each token's experts' outputs.

        Args:
            x: (T, D) float32, float16 or bfloat16; under autocast the weights are cast to its
                dtype (one copy each per forward, as autocast casts a Linear's weight).
            expert_ids: (T, k) integer in [0, E).
            expert_weights: (T, k) float (the router's float32 weights: the op takes them so).

        Returns:
            (T, D) in x's dtype.
        """
        gate_up, down = self.gate_up, self.down
        if gate_up.dtype != x.dtype:
            gate_up, down = gate_up.to(x.dtype), down.to(x.dtype)
        return moe_experts(x, expert_ids, expert_weights, gate_up, down)


class MoeLayer(reference.MoeLayer):
    """`reference.MoeLayer` (constructor, parameters, buffers, auxiliary losses) with the experts
    on `fastlm.moe_experts` and the shared experts on fastlm's SwiGLU.

    The router stays in PyTorch: its (T, E) logits are one small GEMM, computed in float32
    outside autocast as the reference's, and softmax/sigmoid and top-k over E columns have no
    fastlm kernel (the experts op routes by the chosen ids itself: `fastlm::moe_route`).
    Expert parallelism replaces `run_experts(x, expert_ids, expert_weights)`.
    """

    experts_class = StackedExperts
    ffn_class = SwiGlu

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The router's (expert_ids, expert_weights, logits) for x (T, D), in float32 under
        autocast too."""
        with torch.autocast(x.device.type, enabled=False):
            return self.router(x)

    def forward(self, x: torch.Tensor, half=None) -> torch.Tensor:
        """The layer's output (x's shape and dtype), its losses left in `losses`; `half` (the
        block's cast weights) is unused: the experts cast their own weights under autocast."""
        return super().forward(x)

    def cast_groups(self) -> list[list[torch.Tensor]]:
        """No weight groups for the block's `cast_weights` (the experts cast their own)."""
        return []


class CrossEntropyLoss(nn.Module):
    """Drop-in for fastlm.reference.CrossEntropyLoss (forward(logits, targets)), on
    `cross_entropy`; no parameters.

    Args:
        ignore_index: the target value whose positions are left out of the mean (default -100).

    Raises:
        TypeError: an ignore_index that is not an int.
    """

    def __init__(self, ignore_index: int = -100):
        super().__init__()
        check_ignore_index(ignore_index)
        self.ignore_index = ignore_index

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy over the targets that are not ignore_index (0 when all are).

        Args:
            logits: (..., V) float32, float16 or bfloat16.
            targets: int64 or int32 of logits' leading shape, in [0, V) or ignore_index.

        Returns:
            An fp32 scalar.

        Raises:
            TypeError: as `fastlm.cross_entropy`.
            ValueError: as `fastlm.cross_entropy`.
        """
        return cross_entropy(logits, targets, self.ignore_index)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}"
