"""`patch`: one call that puts a Hugging Face model of a supported family on fastlm's kernels."""

from __future__ import annotations

import warnings

from torch import nn

from fastlm.hf import attention as attention_module
from fastlm.hf.families import FAMILIES, family_of, head_dim, modules_of, transformers_module
from fastlm.hf.forwards import (
    PatchedParts,
    activation_of,
    bind,
    is_patched_forward,
    rope_attention_forward,
)
from fastlm.model import kernel_takes_head_dim, kernels_run_on


def _hugging_face_model(model: object) -> nn.Module:
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    transformers = transformers_module()
    if not isinstance(model, transformers.PreTrainedModel) and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def _patch_norms(model, family, patched, skipped) -> None:
    norms = modules_of(model, family, "RMSNorm")
    if not norms:
        skipped.append(f"rms_norm (no {FAMILIES[family].prefix}RMSNorm modules)")
        return
    bind(norms, "offset_rms_norm" if FAMILIES[family].norm_offset else "rms_norm")
    patched.append("rms_norm")


def _patch_mlps(model, family, patched, skipped) -> None:
    """Dense MLPs (split or fused gate/up projections) and MoE experts: each by the activation
    its own act_fn computes."""
    ran, refused = set(), set()
    for module in modules_of(model, family, "MLP") + modules_of(model, family, "Experts"):
        if "Experts" in type(module).__name__:
            kind = "experts"  # 3-D gate_up_proj
        else:
            kind = "mlp" if hasattr(module, "gate_proj") else "packed_mlp"  # Phi-3's gate_up_proj
        act = getattr(module, "act_fn", None) or getattr(module, "activation_fn", None)
        activation = activation_of(act)
        if activation is None or (kind != "mlp" and activation != "silu"):
            refused.add(f"{type(module).__name__} ({type(act).__name__} activation)")
            continue
        if kind == "experts":
            if not getattr(module, "is_concatenated", True) or getattr(module, "has_bias", False):
                refused.add(f"{type(module).__name__} (interleaved gate/up or biases)")
                continue
            bind([module], "experts_gate", "_apply_gate")
        bind([module], kind)
        ran.add("swiglu" if activation == "silu" else "geglu")
    patched.extend(sorted(ran))
    if refused:
        skipped.append(
            f"mlp of {', '.join(sorted(refused))}: fastlm has SwiGLU and GeGLU (tanh or exact "
            "GELU), and SwiGLU alone on fused gate/up projections"
        )


def _patch_rope(model, family, patched, skipped) -> None:
    modules = modules_of(model, family, "Attention")
    if not modules or rope_attention_forward(type(modules[0])) is None:
        skipped.append("rope (the attention forward does not call apply_rotary_pos_emb)")
        return
    bind(modules, "attention")
    patched.append("rope")


def _patch_attention(model, family, patched, skipped) -> None:
    size = head_dim(model.config)
    device = model.get_input_embeddings().weight.device
    if kernels_run_on(device) and not kernel_takes_head_dim(size):
        skipped.append(
            f"attention (head_dim {size}: fastlm's kernel takes multiples of 8 up to 256)"
        )
        return
    attention_module.register()
    model.set_attn_implementation(attention_module.ATTENTION)
    patched.append("attention")


def _patch_loss(model, family, patched, skipped) -> None:
    config = model.config
    loss_type = getattr(config, "loss_type", None)
    forward = model.__dict__.get("forward")
    if model.lm_head.bias is not None:
        skipped.append("cross_entropy (lm_head has a bias)")
    elif loss_type not in (None, "ForCausalLM"):
        skipped.append(f"cross_entropy (loss_type is {loss_type!r}, not ForCausalLM)")
    elif forward is not None and not is_patched_forward(forward):
        # TRL's SFTTrainer wraps the forward with its own fused LM head when it is built.
        # Named by its code, not by __qualname__, which functools.wraps copies from the model's.
        owner = getattr(forward, "__func__", forward)
        code = getattr(owner, "__code__", None)
        name = repr(owner)
        if code is not None:
            name = f"{owner.__globals__.get('__name__', '?')}.{code.co_qualname}"
        skipped.append(
            f"cross_entropy (the model's forward is already replaced, by {name}: a trainer "
            "built before patch? Patch the model before building the trainer; its own loss "
            "head stays in use)"
        )
    else:
        bind([model], "causal_lm")
        patched.append("cross_entropy")


def patch(
    model: nn.Module,
    *,
    rms_norm: bool = True,
    rope: bool = True,
    swiglu: bool = True,
    attention: bool = True,
    cross_entropy: bool = True,
) -> nn.Module:
    """Run a Hugging Face causal LM of a supported family on fastlm's kernels, in place.

    Args:
        model: a ForCausalLM of one of `fastlm.hf.FAMILIES` (Llama, Mistral, Qwen2, Qwen3,
            Gemma, Gemma 2, Gemma 3 text, Phi-3, Mixtral, Qwen3-MoE), or a PEFT model around
            one. Patch before building a trainer (TRL's SFTTrainer wraps the forward then).
        rms_norm: every RMSNorm (q/k norms included) by `rms_norm` (Gemma's with offset 1).
        rope: RoPE by `apply_rope_` on the rotary embedding's own cos/sin, inside the family's
            own attention forward.
        swiglu: the MLPs' gated unit by `swiglu`, `swiglu_packed` (fused gate/up, MoE experts)
            or `geglu` (GELU activations).
        attention: attention by fastlm's flash attention in every batch shape (see
            `fastlm.hf.attention`), registered as "fastlm" with transformers.
        cross_entropy: with labels, the loss by fused linear cross-entropy.

    Returns:
        The model, with `fastlm_patched` (on the transformers model) listing the parts patched.
        A part this model cannot run on the kernels is left as it is, with a warning that says
        why.

    Raises:
        ModuleNotFoundError: transformers is not installed (saying what to install).
        TypeError: naming the supported classes, for a model of another family.
    """
    target = _hugging_face_model(model)
    family = family_of(target)
    patched, skipped = [], []
    steps = (
        (rms_norm, _patch_norms),
        (swiglu, _patch_mlps),
        (rope, _patch_rope),
        (attention, _patch_attention),
        (cross_entropy, _patch_loss),
    )
    for wanted, step in steps:
        if wanted:
            step(target, family, patched, skipped)
    for part in skipped:
        warnings.warn(f"fastlm.hf.patch: left unpatched: {part}", stacklevel=2)
    target.fastlm_patched = PatchedParts(patched)
    return model
