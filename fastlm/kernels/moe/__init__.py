"""Mixture-of-experts ops: the routing metadata (`routing`) and the fused experts (`experts`),
registered as `torch.ops.fastlm.moe_route`, `.moe_experts` and `.moe_experts_backward`."""

from fastlm.kernels.moe.experts import moe_experts

__all__ = ["moe_experts"]
