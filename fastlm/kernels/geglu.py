"""GeGLU activation: y = gelu(gate) * up, with the exact GELU or its tanh approximation.

Exact ("none"), with Phi the standard normal CDF:

    gelu(g)  = g * Phi(g) = 0.5 * g * (1 + erf(g / sqrt(2)))
    gelu'(g) = Phi(g) + g * exp(-g^2 / 2) / sqrt(2 pi)

tanh approximation ("tanh", Gemma's `gelu_pytorch_tanh`), with u = sqrt(2 / pi) * (g + 0.044715 g^3)
and t = tanh(u):

    gelu(g)  = 0.5 * g * (1 + t)
    gelu'(g) = 0.5 * (1 + t) + 0.5 * g * (1 - t^2) * sqrt(2 / pi) * (1 + 3 * 0.044715 g^2)

Backward: d gate = dy * up * gelu'(gate), d up = dy * gelu(gate). The kernels are `swiglu`'s (the
gated-unit kernels, with GELU as their activation): the activation is recomputed in the backward
instead of stored, the math is float32 and the outputs are in the input dtype; they take row
strides, so gate and up may be halves of one fused buffer.
"""

from __future__ import annotations

import torch

from fastlm.backend import use_triton
from fastlm.kernels._common import check_float, check_match, refuse_double_backward
from fastlm.kernels.swiglu import GELU, GELU_TANH, gated_backward, gated_forward

#: The GELU forms (PyTorch's `approximate` argument of `torch.nn.functional.gelu`) and the
#: activation constant of the gated-unit kernels for each.
_ACTIVATION = {"none": GELU, "tanh": GELU_TANH}
APPROXIMATIONS = tuple(_ACTIVATION)

# --------------------------------------------------------------------------------------------
# Reference math (the PyTorch backend, and what the tests and benchmarks compare with)
# --------------------------------------------------------------------------------------------


def geglu_ref(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate, approximate) * up in PyTorch, fp32 inside (fp64 for fp64), in gate's dtype."""
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    activated = torch.nn.functional.gelu(gate.to(compute), approximate=approximate)
    return (activated * up.to(compute)).to(gate.dtype)


# --------------------------------------------------------------------------------------------
# Registration: torch.ops.fastlm.geglu and its backward
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("fastlm::geglu", mutates_args=())
def _geglu_op(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> torch.Tensor:
    return gated_forward(gate, up, _ACTIVATION[approximate])


@_geglu_op.register_fake
def _(gate, up, approximate):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("fastlm::geglu_backward", mutates_args=())
def _geglu_backward_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                       approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    return gated_backward(dy, gate, up, _ACTIVATION[approximate])


@_geglu_backward_op.register_fake
def _(dy, gate, up, approximate):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _geglu_setup(ctx, inputs, output):
    gate, up, approximate = inputs
    ctx.approximate = approximate
    ctx.save_for_backward(gate, up)


def _geglu_grad(ctx, dy):
    d_gate, d_up = _geglu_backward_op(dy, *ctx.saved_tensors, ctx.approximate)
    return d_gate, d_up, None


torch.library.register_autograd("fastlm::geglu", _geglu_grad, setup_context=_geglu_setup)
refuse_double_backward("fastlm::geglu_backward", "geglu")

# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate) * up for tensors of one shape (any leading dims, any row strides).

    Args:
        gate: the gate projection's output, fp32, fp16 or bf16.
        up: the up projection's output, gate's shape, dtype and device.
        approximate: "tanh" (the default: Gemma's `gelu_pytorch_tanh`, PyTorch's
            `gelu(approximate="tanh")`) or "none" (the exact, erf GELU).

    Returns:
        gelu(gate) * up in the inputs' dtype, computed in float32; the backward recomputes the
        activation.

    Raises:
        TypeError: gate or up not a tensor of float32, float16 or bfloat16, or of two dtypes.
        ValueError: an approximate other than "tanh" and "none", gate and up of two shapes or on
            two devices, or an empty last dim.
    """
    check_float("gate", gate)
    check_float("up", up)
    check_match("up", up, "gate", gate)
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    if gate.dim() == 0 or gate.shape[-1] == 0:
        raise ValueError(f"gate must have a non-empty last dim, got {tuple(gate.shape)}")
    if not use_triton(gate):
        return geglu_ref(gate, up, approximate)
    return _geglu_op(gate, up, approximate)
