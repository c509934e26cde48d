"""Hugging Face Llama-family models on fastlm's kernels, and weights to and from fastlm.Transformer.

Needs `transformers` (`pip install fastlm[hf]`); fastlm itself imports without it, and these
functions say what to install when it is missing. Supported: `LlamaForCausalLM`,
`MistralForCausalLM` and `Qwen2ForCausalLM`.

`patch(model)` rebinds, on that model's own modules only (other models, and the classes, are left
as they are), the forwards that fastlm has kernels for:

- rms_norm: each RMSNorm runs `rms_norm` (fp32 inside, one rounding, output in the dtype Hugging
  Face's norm returns: the promotion of the input's and the weight's);
- rope: each attention module rotates q and k in place with `apply_rope_` in the half-split
  layout, on Hugging Face's own cos/sin (so every rope type its rotary embedding computes, llama3
  and dynamic scaling included, is what the kernel applies), then attends as before;
- swiglu: each MLP runs `swiglu(gate_proj(x), up_proj(x))` (needs hidden_act silu);
- attention: the attention function is fastlm's `flash_attention`, registered as "fastlm" in
  transformers' `AttentionInterface` (with SDPA's mask function) and selected with
  `set_attn_implementation`. Where the kernel's causal mask is not the mask Hugging Face asks for
  (a padding mask, a sliding window shorter than the keys, attention dropout in training) that
  call goes to transformers' SDPA function instead, so the result is never another one;
- cross_entropy: with labels, the loss is fused linear cross-entropy on the final hidden states
  (`linear_cross_entropy`: the [tokens x vocab] logits never exist), with Hugging Face's label
  shift, ignore_index -100, `shift_labels` and `num_items_in_batch` (the sum over the batch divided
  by it, as transformers does for gradient accumulation). In training mode such a call returns
  `logits=None` (that is the memory saved); in eval mode the logits are computed as well.
  One difference: a batch whose labels are all -100 has loss 0, where PyTorch's mean gives NaN.

The weights, their names and the state_dict are untouched. Gradient checkpointing
(`model.gradient_checkpointing_enable()`) composes: it recomputes decoder layers whose modules
run the patched forwards. Under `torch.compile` the kernels are opaque custom ops
(`torch.ops.fastlm.*`): `torch.compile(model, fullgraph=True)` traces the patched model's loss
and backward whole (tested with aot_eager on the CPU). A part that cannot be patched
for this model (another activation, a head dim the attention kernel does not take, a rotary
embedding of another class, an lm_head with a bias) is left as it is, with a warning that says why.

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

import inspect
import types
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from fastlm import reference
from fastlm.kernels.attention import flash_attention
from fastlm.kernels.cross_entropy import linear_cross_entropy
from fastlm.kernels.rmsnorm import rms_norm
from fastlm.kernels.rope import apply_rope_
from fastlm.kernels.swiglu import swiglu
from fastlm.model import Transformer, kernel_takes_head_dim, kernels_run_on

#: model_type -> (the ForCausalLM class, the prefix of its modules' classes) in transformers.
FAMILIES = {
    "llama": ("LlamaForCausalLM", "Llama"),
    "mistral": ("MistralForCausalLM", "Mistral"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2"),
}

#: The name fastlm's attention function is registered under in transformers' AttentionInterface.
ATTENTION = "fastlm"

IGNORE_INDEX = -100  # Hugging Face's label for "no loss here"


def _transformers():
    try:
        import transformers
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "fastlm.hf needs transformers: pip install 'fastlm[hf]' (or transformers)"
        ) from None
    return transformers


def _family(hf_model: object) -> str:
    """The model_type of a supported ForCausalLM; TypeError naming what is supported otherwise."""
    transformers = _transformers()
    for family, (class_name, _) in FAMILIES.items():
        if isinstance(hf_model, getattr(transformers, class_name)):
            return family
    names = ", ".join(class_name for class_name, _ in FAMILIES.values())
    raise TypeError(f"hf_model must be one of {names}, got {type(hf_model).__name__}")


def _modules_of(hf_model: nn.Module, family: str, suffix: str) -> list[nn.Module]:
    """The model's modules whose class is the family's `<Prefix><suffix>` (LlamaRMSNorm, ...)."""
    name = FAMILIES[family][1] + suffix
    return [m for m in hf_model.modules() if type(m).__name__ == name]


def _rope_parameters(config) -> tuple[str, float]:
    """(rope type, theta) from rope_parameters (transformers 5) or rope_scaling/rope_theta (4)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope_type, float(theta)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


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


def _unconvertible(hf_model: nn.Module, family: str) -> list[str]:
    """What of this model fastlm.Transformer cannot hold, one phrase each."""
    config = hf_model.config
    problems = []
    if config.hidden_act not in ("silu", "swish"):
        problems.append(f"hidden_act {config.hidden_act!r} (fastlm's feed-forward is SwiGLU: silu)")
    if _head_dim(config) * config.num_attention_heads != config.hidden_size:
        problems.append(
            f"head_dim {_head_dim(config)} x {config.num_attention_heads} heads != hidden_size "
            f"{config.hidden_size} (fastlm's heads split d_model)"
        )
    rope_type, _ = _rope_parameters(config)
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
    """A `fastlm.Transformer` (model="reference": `fastlm.reference.Transformer`) holding the
    weights of a Llama, Mistral or Qwen2 ForCausalLM, on its device and in its dtype, giving the
    same logits.

    q, k and v projections are concatenated into qkv_proj, gate/up/down become ffe.w1/w3/w2, the
    norms' weights the g's; tie_word_embeddings becomes tie_embeddings. RoPE stays in Hugging
    Face's half-split layout (rope_interleaved=False), or, with rope_interleaved=True, q's and k's
    rows are reordered within each head to the interleaved layout (the same function).
    ValueError listing what fastlm.Transformer cannot represent (see the module docstring).
    """
    family = _family(hf_model)
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
        rope_theta=_rope_parameters(config)[1],
        device=embedding.device,
        dtype=embedding.dtype,
        num_kv_heads=None if kv_heads in (None, heads) else kv_heads,
        rope_interleaved=rope_interleaved,
        tie_embeddings=bool(config.tie_word_embeddings),
        norm_eps=float(config.rms_norm_eps),
    )
    order = torch.argsort(_half_split_order(_head_dim(config))) if rope_interleaved else None
    state = {"embedding.w": embedding, "final_norm.g": hf_model.model.norm.weight}
    state["out_linear.w"] = hf_model.get_output_embeddings().weight
    for i, layer in enumerate(hf_model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, k = attn.q_proj.weight, attn.k_proj.weight
        if order is not None:
            q, k = (_reorder_heads(w, _head_dim(config), order) for w in (q, k))
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
    """A new Hugging Face ForCausalLM of `family` ("llama", "mistral" or "qwen2") holding the
    weights of a `fastlm.Transformer` or `fastlm.reference.Transformer`, on its device and in its
    dtype, giving the same logits: config from the model's options (max_position_embeddings is
    its context_length, no sliding window, Qwen2's q/k/v biases zero). An interleaved-RoPE model's
    q and k rows are reordered within each head to Hugging Face's half-split layout."""
    transformers = _transformers()
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    if not isinstance(model, (Transformer, reference.Transformer)):
        raise TypeError(
            f"model must be a fastlm.Transformer or fastlm.reference.Transformer, "
            f"got {type(model).__name__}"
        )
    attention = model.blocks[0].mult_head_atten
    head_dim, rope = attention.head_dim, attention.rope
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
    config_class = getattr(transformers, FAMILIES[family][0].replace("ForCausalLM", "Config"))
    hf_model = getattr(transformers, FAMILIES[family][0])(config_class(**fields))
    hf_model.to(device=embedding.device, dtype=embedding.dtype)
    order = _half_split_order(head_dim) if rope.interleaved else None
    kv_width = attention.num_kv_heads * head_dim
    state = {"model.embed_tokens.weight": embedding, "model.norm.weight": model.final_norm.g}
    state["lm_head.weight"] = model.out_linear.w
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


# --------------------------------------------------------------------------------------------
# Patched forwards (bound to each module of one model by `patch`)
# --------------------------------------------------------------------------------------------


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Hugging Face's RMSNorm: weight * normed.to(input dtype), so the output has the promoted
    dtype; fastlm's kernel computes it in fp32 and rounds once."""
    weight = self.weight
    out_dtype = torch.promote_types(hidden_states.dtype, weight.dtype)
    if weight.dtype not in (hidden_states.dtype, torch.float32):
        weight = weight.to(hidden_states.dtype)
    return rms_norm(hidden_states, weight, self.variance_epsilon, out_dtype=out_dtype)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Hugging Face's apply_rotary_pos_emb on q, k (B, H, T, D) in place, by fastlm's kernel.

    cos and sin are the rotary embedding's (B or 1, T, D), each angle twice (cat(freqs, freqs));
    their first halves, one row per (sequence, position), serve as the kernel's tables, read at
    positions 0, 1, ... So whatever the rope type computed is what is applied."""
    half = q.shape[-1] // 2
    rows = cos.shape[0] * cos.shape[1]
    cos_table = cos[..., :half].reshape(rows, half)
    sin_table = sin[..., :half].reshape(rows, half)
    positions = torch.arange(rows, device=q.device).view(cos.shape[0], cos.shape[1])
    return apply_rope_(q, k, cos_table, sin_table, positions, interleaved=False)


def _attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    cache=None,
    **kwargs,
):
    """The family's attention forward (transformers 5), with RoPE by fastlm's kernel."""
    if cache is None:  # the name before transformers 5.2x
        cache = kwargs.pop("past_key_values", None)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    _rotate(q, k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, ALL_ATTENTION_FUNCTIONS["sdpa"]
    )
    # Qwen2 keeps its window per layer (None on full-attention layers), Mistral in its config.
    sliding_window = getattr(self, "sliding_window", getattr(self.config, "sliding_window", None))
    out, weights = attention_interface(
        self,
        q,
        k,
        v,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        sliding_window=sliding_window,
        **kwargs,
    )
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def fastlm_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
):
    """transformers' attention-function interface on `flash_attention`: query (B, Hq, Tq, D),
    key and value (B, Hkv, Tk, D) (grouped-query heads read as they are); returns the output
    (B, Tq, Hq, D) and no weights.

    The mask function registered with it is SDPA's, which gives no mask (None) exactly when the
    attention is plain causal: Tq == Tk, one query token that sees every key, or a prefill of an
    empty static cache (Tq < Tk, aligned to the start: only the first Tq keys can be seen). Any
    mask (padding, a sliding window shorter than the keys), dropout or soft-capping is handed to
    transformers' SDPA function, so the result is the one Hugging Face defines."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    Tq, Tk = query.shape[2], key.shape[2]
    plain = (
        attention_mask is None
        and not dropout
        and not kwargs.get("softcap")
        and getattr(module, "is_causal", True)
        and kwargs.get("is_causal", True) is not False
        and Tq <= Tk
    )
    if not plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if Tq > 1:  # Tq == Tk, or a static cache's prefill: the keys past Tq are never seen
        key, value = key[:, :, :Tq], value[:, :, :Tq]
    out = flash_attention(query, key, value, causal=True, softmax_scale=scaling)
    return out.transpose(1, 2), None


def _causal_lm_forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    cache=None,
    inputs_embeds=None,
    labels=None,
    use_cache=None,
    logits_to_keep=0,
    **kwargs,
):
    """The ForCausalLM forward with the loss by fused linear cross-entropy (see patch)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.modeling_utils import slice_logits_to_keep

    return_dict = kwargs.pop("return_dict", None)
    if cache is not None:
        kwargs["cache"] = cache
    outputs = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
    )
    hidden = outputs[0]  # the final norm's output (B, T, C)
    shift_labels = kwargs.get("shift_labels")
    loss = logits = None
    if labels is not None or shift_labels is not None:
        if shift_labels is None:  # position t predicts label t + 1; the last predicts nothing
            shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        shift_labels = shift_labels.to(hidden.device)
        loss = linear_cross_entropy(hidden, self.lm_head.weight, shift_labels, IGNORE_INDEX)
        num_items_in_batch = kwargs.get("num_items_in_batch")
        if num_items_in_batch is not None:  # transformers' sum / num_items_in_batch
            counted = (shift_labels != IGNORE_INDEX).sum().clamp_min(1)
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss * counted / num_items_in_batch
    if loss is None or not self.training:
        logits = self.lm_head(slice_logits_to_keep(hidden, logits_to_keep))
    rest = {name: value for name, value in outputs.items() if name != "last_hidden_state"}
    result = CausalLMOutputWithPast(loss=loss, logits=logits, **rest)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    return result if return_dict else result.to_tuple()


# --------------------------------------------------------------------------------------------
# patch
# --------------------------------------------------------------------------------------------


def _register_attention() -> None:
    """fastlm_attention as "fastlm" in transformers' attention interface, with SDPA's mask
    function (which gives None for plain causal attention)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, fastlm_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def _bind(modules: list[nn.Module], forward) -> None:
    for module in modules:
        module.forward = types.MethodType(forward, module)


def patch(
    model: nn.Module,
    *,
    rms_norm: bool = True,
    rope: bool = True,
    swiglu: bool = True,
    attention: bool = True,
    cross_entropy: bool = True,
) -> nn.Module:
    """Run a LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM on fastlm's kernels, in
    place, and return it (see the module docstring for what each part does). Each flag patches
    one part; a part this model cannot run on the kernels is left unpatched with a warning saying
    why. `model.fastlm_patched` lists the parts patched. TypeError for another model."""
    family = _family(model)
    config = model.config
    patched, skipped = [], []
    if rms_norm:
        _bind(_modules_of(model, family, "RMSNorm"), _rms_norm_forward)
        patched.append("rms_norm")
    if swiglu:
        if config.hidden_act in ("silu", "swish"):
            _bind(_modules_of(model, family, "MLP"), _mlp_forward)
            patched.append("swiglu")
        else:
            skipped.append(f"swiglu (hidden_act is {config.hidden_act!r}, not silu)")
    device = model.get_input_embeddings().weight.device
    attention_modules = _modules_of(model, family, "Attention")
    if rope:
        rotary = _modules_of(model, family, "RotaryEmbedding")
        expected = {"hidden_states", "position_embeddings", "attention_mask"}
        takes = set(inspect.signature(type(attention_modules[0]).forward).parameters)
        if len(rotary) != 1 or rotary[0] is not getattr(model.model, "rotary_emb", None):
            skipped.append("rope (the rotary embedding is not the family's own)")
        elif not expected <= takes or not takes & {"cache", "past_key_values"}:
            # _attention_forward re-implements transformers 5's attention forward.
            skipped.append(f"rope (this transformers' attention forward takes {sorted(takes)})")
        else:
            _bind(attention_modules, _attention_forward)
            patched.append("rope")
    if attention:
        head_dim = _head_dim(config)
        if kernels_run_on(device) and not kernel_takes_head_dim(head_dim):
            skipped.append(
                f"attention (head_dim {head_dim}: fastlm's kernel takes multiples of 8 up to 256)"
            )
        else:
            _register_attention()
            model.set_attn_implementation(ATTENTION)
            patched.append("attention")
    if cross_entropy:
        loss_type = getattr(config, "loss_type", None)
        if model.lm_head.bias is not None:
            skipped.append("cross_entropy (lm_head has a bias)")
        elif loss_type not in (None, "ForCausalLM"):
            skipped.append(f"cross_entropy (loss_type is {loss_type!r}, not ForCausalLM)")
        else:
            model.forward = types.MethodType(_causal_lm_forward, model)
            patched.append("cross_entropy")
    for part in skipped:
        warnings.warn(f"fastlm.hf.patch: left unpatched: {part}", stacklevel=2)
    model.fastlm_patched = tuple(patched)
    return model
