"""The Hugging Face model families `from_hf`/`to_hf` convert and fastlm.hf's tests name, and
how to tell which one a model is. `patch` reads no family table: it finds each part by what a
module computes (`fastlm.hf.probe`)."""

from __future__ import annotations

import sys
import types
from typing import NamedTuple


class Family(NamedTuple):
    """One transformers model family fastlm.hf names (a NamedTuple).

    `FAMILIES` maps the model_types fastlm.hf named before `patch` took any causal LM (its
    tests build them by this table) to their Family.

    Args:
        causal_lm: the ForCausalLM class's name in transformers.
        convertible: whether `from_hf`/`to_hf` convert it to and from `fastlm.Transformer`
            (default False).
    """

    causal_lm: str
    convertible: bool = False


#: model_type -> Family.
FAMILIES = {
    "llama": Family("LlamaForCausalLM", convertible=True),
    "mistral": Family("MistralForCausalLM", convertible=True),
    "qwen2": Family("Qwen2ForCausalLM", convertible=True),
    "qwen3": Family("Qwen3ForCausalLM"),
    "gemma": Family("GemmaForCausalLM"),
    "gemma2": Family("Gemma2ForCausalLM"),
    "gemma3_text": Family("Gemma3ForCausalLM"),
    "phi3": Family("Phi3ForCausalLM"),
    "mixtral": Family("MixtralForCausalLM"),
    "qwen3_moe": Family("Qwen3MoeForCausalLM"),
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


def rope_parameters(config) -> tuple[str, float]:
    """(rope type, theta) from rope_parameters (transformers 5) or rope_scaling/rope_theta (4)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope_type, float(theta)


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
