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


def layer_config(config, index: int | None):
    """The config layer `index` is built from: its per-layer config where the model has one
    (transformers 5.24's `per_layer_config`: Gemma 4's global layers take their own head dim and
    key/value heads), else the model's config."""
    if index is None or not getattr(config, "is_heterogeneous", False):
        return config
    return config.per_layer_config[index]


def config_value(config, name: str, default=None):
    """A model-wide config field, or `default` where the config lacks it or holds it per layer
    (reading such a field from the model's config raises AmbiguousGlobalPerLayerAttributeError:
    it has no one value)."""
    if name in (getattr(config, "per_layer_attributes", None) or ()):
        return default
    return getattr(config, name, default)


def head_dim(config) -> int:
    """The head dim of a layer's config (or of a config whose layers are alike)."""
    return config_value(config, "head_dim") or config.hidden_size // config.num_attention_heads


def module_head_dim(module, config) -> int | None:
    """An attention module's head dim, read from the layer: its own `head_dim`, else its layer's
    config's (`layer_config` by its `layer_idx`); None where neither says."""
    size = getattr(module, "head_dim", None)
    if isinstance(size, int):
        return size
    index = getattr(module, "layer_idx", None)
    if index is None and getattr(config, "is_heterogeneous", False):
        return None  # sizes vary by layer, and this module does not say which it is
    try:
        return head_dim(layer_config(config, index))
    except (AttributeError, TypeError, ZeroDivisionError):
        return None
