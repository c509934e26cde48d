"""The Hugging Face model families fastlm.hf knows, and how to tell which one a model is."""

from __future__ import annotations

import sys
import types
from typing import NamedTuple

from torch import nn


class Family(NamedTuple):
    """What fastlm.hf needs to know of one transformers model family (a NamedTuple).

    `FAMILIES` maps each model_type `patch` runs on the kernels to its Family.

    Args:
        causal_lm: the ForCausalLM class's name in transformers.
        prefix: the prefix of the family's module classes (`<prefix>RMSNorm`,
            `<prefix>Attention`...).
        norm_offset: 1.0 where the RMSNorm scales by `1 + weight` in fp32 (Gemma's), 0.0 (the
            default) where it scales by `weight` after rounding to the input dtype (LLaMA's).
        convertible: whether `from_hf`/`to_hf` convert it to and from `fastlm.Transformer`
            (default False).
    """

    causal_lm: str
    prefix: str
    norm_offset: float = 0.0
    convertible: bool = False


#: model_type -> Family, for every family `patch` runs on the kernels.
FAMILIES = {
    "llama": Family("LlamaForCausalLM", "Llama", convertible=True),
    "mistral": Family("MistralForCausalLM", "Mistral", convertible=True),
    "qwen2": Family("Qwen2ForCausalLM", "Qwen2", convertible=True),
    "qwen3": Family("Qwen3ForCausalLM", "Qwen3"),
    "gemma": Family("GemmaForCausalLM", "Gemma", norm_offset=1.0),
    "gemma2": Family("Gemma2ForCausalLM", "Gemma2", norm_offset=1.0),
    "gemma3_text": Family("Gemma3ForCausalLM", "Gemma3", norm_offset=1.0),
    "phi3": Family("Phi3ForCausalLM", "Phi3"),
    "mixtral": Family("MixtralForCausalLM", "Mixtral"),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", "Qwen3Moe"),
}

#: The families `from_hf` and `to_hf` convert.
CONVERTIBLE = tuple(name for name, family in FAMILIES.items() if family.convertible)

IGNORE_INDEX = -100  # Hugging Face's label for "no loss here"


def transformers_module() -> types.ModuleType:
    """`transformers`, or ModuleNotFoundError saying what to install."""
    try:
        import transformers
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "fastlm.hf needs transformers: pip install 'fastlm[hf]' (or transformers)"
        ) from None
    return transformers


def family_of(hf_model: object, names=tuple(FAMILIES)) -> str:
    """The model_type of a ForCausalLM among `names`; TypeError listing them otherwise."""
    transformers = transformers_module()
    for name in names:
        if isinstance(hf_model, getattr(transformers, FAMILIES[name].causal_lm)):
            return name
    supported = ", ".join(FAMILIES[name].causal_lm for name in names)
    raise TypeError(f"hf_model must be one of {supported}, got {type(hf_model).__name__}")


def modeling_module(obj: object) -> types.ModuleType:
    """The `modeling_<family>.py` module an object's class is defined in."""
    return sys.modules[type(obj).__module__]


def modules_of(hf_model: nn.Module, family: str, suffix: str) -> list[nn.Module]:
    """The model's modules whose class is the family's `<prefix><suffix>` (LlamaRMSNorm, ...)."""
    name = FAMILIES[family].prefix + suffix
    return [m for m in hf_model.modules() if type(m).__name__ == name]


def rope_parameters(config) -> tuple[str, float]:
    """(rope type, theta) from rope_parameters (transformers 5) or rope_scaling/rope_theta (4)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope_type, float(theta)


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
