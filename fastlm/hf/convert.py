"""Weights between Hugging Face Llama, Mistral and Qwen2 models and `fastlm.Transformer`.

`from_hf(hf_model)` and `to_hf(model)` convert weights between such a model and
`fastlm.Transformer` (or `fastlm.reference.Transformer`) with the LLaMA-style options
(num_kv_heads, rope_interleaved, tie_embeddings, norm_eps); Hugging Face -> fastlm -> Hugging Face
gives back the very same tensors. fastlm's model has no biases and only RoPE's default frequencies,
so from_hf raises ValueError for nonzero attention or MLP biases (Qwen2's q/k/v biases must be all
zero), for a rope scaling type, and for what else it cannot represent. A sliding window shorter
than max_position_embeddings (Mistral's) caps the converted model's context_length at the window,
within which the two agree, with a warning.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from fastlm import reference
from fastlm.hf.families import (
    CONVERTIBLE,
    FAMILIES,
    family_of,
    rope_parameters,
    transformers_module,
)
from fastlm.hf.families import head_dim as config_head_dim
from fastlm.model import Transformer

# --------------------------------------------------------------------------------------------
# Weights: from_hf, to_hf
# --------------------------------------------------------------------------------------------


def _half_split_order(head_dim: int) -> torch.Tensor:
    """Index i of a half-split head vector holds interleaved element order[i]: pair j is
    (x[2j], x[2j+1]) interleaved and (x[j], x[j + D/2]) half-split."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


def _reorder_heads(weight: torch.Tensor, head_dim: int, order: torch.Tensor) -> torch.Tensor:
    """The rows of a q or k projection weight [heads * D, C] reordered within each head. Applied
    to both q and k alike it leaves every q . k unchanged while it moves RoPE's pairs from one
    layout to the other."""
    rows, columns = weight.shape
    heads = weight.view(rows // head_dim, head_dim, columns)
    return heads[:, order.to(weight.device)].reshape(rows, columns)


def attention_state(model: nn.Module) -> dict:
    """{transformers' Llama-layout name: tensor} for everything of a fastlm model but its
    feed-forward layers: the embedding, the final norm, the head, and each block's norms and
    q/k/v/o projections (q and k reordered to half-split pairs when RoPE is interleaved). The
    callers add their MLPs or experts under `model.layers.{i}.mlp.`."""
    attention = model.blocks[0].mult_head_atten
    head_dim, d_model = attention.head_dim, model.embedding.w.shape[1]
    kv_width = attention.num_kv_heads * head_dim
    order = _half_split_order(head_dim) if attention.rope.interleaved else None
    state = {
        "model.embed_tokens.weight": model.embedding.w,
        "model.norm.weight": model.final_norm.g,
        "lm_head.weight": model.out_linear.w,
    }
    for i, block in enumerate(model.blocks):
        q, k, v = block.mult_head_atten.qkv_proj.w.split((d_model, kv_width, kv_width))
        if order is not None:
            q, k = (_reorder_heads(w, head_dim, order) for w in (q, k))
        prefix = f"model.layers.{i}."
        state[prefix + "input_layernorm.weight"] = block.rms_norm1.g
        state[prefix + "post_attention_layernorm.weight"] = block.rms_norm2.g
        for name, w in (("q", q), ("k", k), ("v", v)):
            state[prefix + f"self_attn.{name}_proj.weight"] = w
        state[prefix + "self_attn.o_proj.weight"] = block.mult_head_atten.output_proj.w
    return state


def _unconvertible(hf_model: nn.Module, family: str) -> list[str]:
    """What of this model fastlm.Transformer cannot hold, one phrase each."""
    config = hf_model.config
    problems = []
    if config.hidden_act not in ("silu", "swish"):
        problems.append(f"hidden_act {config.hidden_act!r} (fastlm's feed-forward is SwiGLU: silu)")
    if config_head_dim(config) * config.num_attention_heads != config.hidden_size:
        problems.append(
            f"head_dim {config_head_dim(config)} x {config.num_attention_heads} heads != "
            f"hidden_size {config.hidden_size} (fastlm's heads split d_model)"
        )
    rope_type, _ = rope_parameters(config)
    if rope_type != "default":
        problems.append(f"rope type {rope_type!r} (fastlm.Transformer's RoPE has only theta)")
    biases = [
        name
        for name, p in hf_model.named_parameters()
        if name.endswith(".bias") and bool(torch.any(p != 0))
    ]
    if biases:
        shown = ", ".join(biases[:3]) + (f" and {len(biases) - 3} more" if len(biases) > 3 else "")
        problems.append(f"nonzero biases ({shown}; fastlm.Transformer has none)")
    return problems


def from_hf(
    hf_model: nn.Module, *, model: str = "fastlm", rope_interleaved: bool = False
) -> nn.Module:
    """A `fastlm.Transformer` (or `fastlm.reference.Transformer`) holding the weights of a Llama,
    Mistral or Qwen2 ForCausalLM, on its device and in its dtype, giving the same logits.

    q, k and v projections are concatenated into qkv_proj, gate/up/down become ffe.w1/w3/w2, the
    norms' weights the g's; tie_word_embeddings becomes tie_embeddings. A sliding window shorter
    than max_position_embeddings (Mistral's) caps the model's context_length at the window, within
    which the two agree, with a warning.

    Args:
        hf_model: a LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM (`CONVERTIBLE`).
        model: "fastlm" (the default): a `fastlm.Transformer`; "reference": a
            `fastlm.reference.Transformer`.
        rope_interleaved: False (the default): RoPE stays in Hugging Face's half-split layout;
            True: q's and k's rows are reordered within each head to the interleaved layout (the
            same function).

    Returns:
        The model, its weights copied from hf_model's.

    Raises:
        ModuleNotFoundError: transformers is not installed (saying what to install).
        TypeError: hf_model of another family.
        ValueError: a model other than "fastlm" or "reference", or an hf_model fastlm.Transformer
            cannot represent, listing why: an activation other than silu, heads that do not split
            hidden_size, a rope scaling type, nonzero attention or MLP biases (Qwen2's q/k/v
            biases must be all zero).
    """
    family = family_of(hf_model, CONVERTIBLE)
    if model not in ("fastlm", "reference"):
        raise ValueError(f"model must be 'fastlm' or 'reference', got {model!r}")
    problems = _unconvertible(hf_model, family)
    if problems:
        raise ValueError(
            f"from_hf: this {type(hf_model).__name__} cannot be converted: " + "; ".join(problems)
        )
    config = hf_model.config
    context = config.max_position_embeddings
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    if family == "qwen2" and "sliding_attention" not in layer_types:
        window = None  # Qwen2 keeps the field but attends in full unless layers say otherwise
    if window is not None and window < context:
        warnings.warn(
            f"from_hf: the model attends within a sliding window of {window} tokens, which "
            f"fastlm.Transformer does not implement: context_length is {window} (not "
            f"max_position_embeddings {context}), within which the two models agree",
            stacklevel=2,
        )
        context = window
    embedding = hf_model.get_input_embeddings().weight
    cls = Transformer if model == "fastlm" else reference.Transformer
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    out = cls(
        vocab_size=config.vocab_size,
        context_length=context,
        d_model=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        d_ff=config.intermediate_size,
        rope_theta=rope_parameters(config)[1],
        device=embedding.device,
        dtype=embedding.dtype,
        num_kv_heads=None if kv_heads in (None, heads) else kv_heads,
        rope_interleaved=rope_interleaved,
        tie_embeddings=bool(config.tie_word_embeddings),
        norm_eps=float(config.rms_norm_eps),
    )
    order = torch.argsort(_half_split_order(config_head_dim(config))) if rope_interleaved else None
    state = {"embedding.w": embedding, "final_norm.g": hf_model.model.norm.weight}
    state["out_linear.w"] = hf_model.get_output_embeddings().weight
    for i, layer in enumerate(hf_model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, k = attn.q_proj.weight, attn.k_proj.weight
        if order is not None:
            q, k = (_reorder_heads(w, config_head_dim(config), order) for w in (q, k))
        prefix = f"blocks.{i}."
        state[prefix + "rms_norm1.g"] = layer.input_layernorm.weight
        state[prefix + "rms_norm2.g"] = layer.post_attention_layernorm.weight
        state[prefix + "mult_head_atten.qkv_proj.w"] = torch.cat((q, k, attn.v_proj.weight))
        state[prefix + "mult_head_atten.output_proj.w"] = attn.o_proj.weight
        state[prefix + "ffe.w1.w"] = mlp.gate_proj.weight
        state[prefix + "ffe.w2.w"] = mlp.down_proj.weight
        state[prefix + "ffe.w3.w"] = mlp.up_proj.weight
    with torch.no_grad():
        out.load_state_dict(state, strict=True)
    return out


def to_hf(model: nn.Module, family: str = "llama") -> nn.Module:
    """A new Hugging Face ForCausalLM holding the weights of a `fastlm.Transformer` or
    `fastlm.reference.Transformer`, on its device and in its dtype, giving the same logits.

    The config comes from the model's options (max_position_embeddings is its context_length, no
    sliding window, Qwen2's q/k/v biases zero). An interleaved-RoPE model's q and k rows are
    reordered within each head to Hugging Face's half-split layout.

    Args:
        model: a `fastlm.Transformer` or `fastlm.reference.Transformer`.
        family: "llama" (the default), "mistral" or "qwen2".

    Returns:
        The ForCausalLM of `family`.

    Raises:
        ModuleNotFoundError: transformers is not installed (saying what to install).
        ValueError: another family.
        TypeError: a model of another class.
        RuntimeError: a transformers whose parameter names differ, so that some were not filled.
    """
    transformers = transformers_module()
    if family not in CONVERTIBLE:
        raise ValueError(f"family must be one of {', '.join(CONVERTIBLE)}, got {family!r}")
    if not isinstance(model, (Transformer, reference.Transformer)):
        raise TypeError(
            f"model must be a fastlm.Transformer or fastlm.reference.Transformer, "
            f"got {type(model).__name__}"
        )
    attention = model.blocks[0].mult_head_atten
    rope = attention.rope
    embedding = model.embedding.w
    d_model = embedding.shape[1]
    fields = dict(
        vocab_size=model.vocab_size,
        hidden_size=d_model,
        intermediate_size=model.blocks[0].ffe.w1.w.shape[0],
        num_hidden_layers=len(model.blocks),
        num_attention_heads=attention.num_heads,
        num_key_value_heads=attention.num_kv_heads,
        max_position_embeddings=model.context_length,
        rms_norm_eps=model.final_norm.eps,
        rope_theta=float(rope.theta),
        tie_word_embeddings=model.out_linear.w is embedding,
        hidden_act="silu",
    )
    if family != "llama":
        fields["sliding_window"] = None
    causal_lm = FAMILIES[family].causal_lm
    config_class = getattr(transformers, causal_lm.replace("ForCausalLM", "Config"))
    hf_model = getattr(transformers, causal_lm)(config_class(**fields))
    hf_model.to(device=embedding.device, dtype=embedding.dtype)
    state = attention_state(model)
    for i, block in enumerate(model.blocks):
        prefix = f"model.layers.{i}."
        state[prefix + "mlp.gate_proj.weight"] = block.ffe.w1.w
        state[prefix + "mlp.down_proj.weight"] = block.ffe.w2.w
        state[prefix + "mlp.up_proj.weight"] = block.ffe.w3.w
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith(".bias"):  # Qwen2's q/k/v biases: fastlm has none
                p.zero_()
        missing, unexpected = hf_model.load_state_dict(state, strict=False)
    missing = [name for name in missing if not name.endswith(".bias")]
    if fields["tie_word_embeddings"]:
        missing = [name for name in missing if name != "lm_head.weight"]
    if missing or unexpected:  # a transformers whose parameter names differ
        raise RuntimeError(f"to_hf: parameters not filled {missing}, unexpected {unexpected}")
    return hf_model
