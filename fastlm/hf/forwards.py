"""The forwards `patch` puts on a model's modules, and how they are attached so that a patched
model pickles.

Each module gets a `PatchedForward` as its instance `forward`: a callable holding the module and
the name of one of the `PARTS` functions. It pickles as that pair (a bound method would pickle as
`getattr(module, "<function name>")`, which a module does not have), so `torch.save` /
`torch.load`, `pickle` and `copy.deepcopy` of a patched model work, also in a fresh process.
"""

from __future__ import annotations

import inspect
import types

import torch
import torch.nn.functional as F
from torch import nn

from fastlm.hf.families import IGNORE_INDEX, modeling_module
from fastlm.kernels import apply_rope_, geglu, linear_cross_entropy, rms_norm, swiglu_packed
from fastlm.kernels import swiglu as swiglu_op

# --------------------------------------------------------------------------------------------
# Norms and MLPs
# --------------------------------------------------------------------------------------------


def rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """LLaMA's RMSNorm: weight * normed.to(input dtype), so the output has the promoted dtype;
    fastlm's kernel computes it in fp32 and rounds once."""
    weight = self.weight
    out_dtype = torch.promote_types(hidden_states.dtype, weight.dtype)
    if weight.dtype not in (hidden_states.dtype, torch.float32):
        weight = weight.to(hidden_states.dtype)
    return rms_norm(hidden_states, weight, self.variance_epsilon, out_dtype=out_dtype)


def offset_rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm: normed * (1 + weight) in fp32, then x's dtype, exactly its order."""
    weight = self.weight
    if weight.dtype not in (x.dtype, torch.float32):
        weight = weight.float()  # Gemma adds 1 to the fp32 weight: exact
    return rms_norm(x, weight, self.eps, offset=1.0, out_dtype=x.dtype)


def activation_of(act: object) -> str | None:
    """ "silu", "tanh" (a tanh GELU), "none" (the exact GELU) or None for another activation."""
    if isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation":
        return "silu"
    if isinstance(act, nn.GELU):
        return act.approximate
    name = type(act).__name__
    if name in ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation"):
        return "tanh"  # each computes 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
    if name == "GELUActivation":
        return "none"
    return None


def _gated(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    return swiglu_op(gate, up) if activation == "silu" else geglu(gate, up, activation)


def mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """gate_proj / up_proj / down_proj with SwiGLU or GeGLU in one kernel."""
    return self.down_proj(_gated(self.gate_proj(x), self.up_proj(x), activation_of(self.act_fn)))


def packed_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Phi-3's fused gate_up_proj (gate first, up second) through `swiglu_packed`."""
    return self.down_proj(swiglu_packed(self.gate_up_proj(x)))


def experts_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
    """The experts' gate on (S, 2 * I) projections (gate first, up second) by `swiglu_packed`:
    what transformers' grouped_mm and batched_mm experts call between their two GEMMs."""
    return swiglu_packed(gate_up)


def experts_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Mixtral's and Qwen3-MoE's experts (3-D gate_up_proj and down_proj). The model's experts
    implementation runs as it is (grouped_mm, batched_mm: their gate is `experts_gate`), except
    "eager", whose loop over the experts hit is transformers' own with each expert's SwiGLU by
    `swiglu_packed`. The router, its weights and the auxiliary loss are the model's, untouched."""
    if getattr(self.config, "_experts_implementation", "eager") != "eager":
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for hit in expert_hit:
        expert = hit[0]
        if expert == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert])
        gate_up = F.linear(hidden_states[token_idx], self.gate_up_proj[expert])
        out = F.linear(swiglu_packed(gate_up), self.down_proj[expert])
        out = out * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final


# --------------------------------------------------------------------------------------------
# RoPE: the family's own attention forward, with apply_rotary_pos_emb by fastlm's kernel
# --------------------------------------------------------------------------------------------


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Hugging Face's apply_rotary_pos_emb on q, k (B, H, T, D), in place, by fastlm's kernel.

    cos and sin are the rotary embedding's (B or 1, T, R), each angle twice (cat(freqs, freqs));
    their first halves, one row per (sequence, position), serve as the kernel's tables, read at
    positions 0, 1, ... So whatever the rope type computed (llama3, linear, dynamic, Gemma 3's
    local base, ...) is what is applied, at whatever positions (padded, packed) were given.
    R < D (Phi-3's partial rotary factor) rotates the first R dims of each head, as Hugging Face.
    """
    if unsqueeze_dim != 1:
        raise ValueError(f"unsqueeze_dim must be 1 ((B, H, T, D) heads), got {unsqueeze_dim}")
    rotary = cos.shape[-1]
    half = rotary // 2
    rows = cos.shape[0] * cos.shape[1]
    cos_table = cos[..., :half].reshape(rows, half)
    sin_table = sin[..., :half].reshape(rows, half)
    positions = torch.arange(rows, device=q.device).view(cos.shape[0], cos.shape[1])
    q_rot, k_rot = (q, k) if rotary == q.shape[-1] else (q[..., :rotary], k[..., :rotary])
    apply_rope_(q_rot, k_rot, cos_table, sin_table, positions, interleaved=False)
    return q, k


class _Forwards(dict):
    """attention class -> its forward with fastlm's RoPE, filled when a model is patched, so
    that a compiled forward only looks it up; a class missing (a model unpickled in a fresh
    process) is built on first use."""

    def __missing__(self, cls: type) -> types.FunctionType:
        return rope_attention_forward(cls)


_ROPE_FORWARDS = _Forwards()


def rope_attention_forward(cls: type) -> types.FunctionType | None:
    """cls.forward (transformers' own attention forward of the family) with the name
    `apply_rotary_pos_emb` bound to fastlm's, or None when that forward does not call it.

    The function is rebuilt from the same code with a copy of its module's globals, so the
    family's attention runs exactly as written (q/k norms, fused projections, soft-capping,
    caches) and no other model or class is touched."""
    if cls in _ROPE_FORWARDS:
        return _ROPE_FORWARDS[cls]
    forward = inspect.unwrap(cls.forward)  # under deprecate_kwarg's wrapper
    if "apply_rotary_pos_emb" not in forward.__code__.co_names:
        return None
    names = dict(forward.__globals__, apply_rotary_pos_emb=apply_rotary_pos_emb)
    rebuilt = types.FunctionType(
        forward.__code__, names, forward.__name__, forward.__defaults__, forward.__closure__
    )
    rebuilt.__kwdefaults__ = forward.__kwdefaults__
    _ROPE_FORWARDS[cls] = rebuilt
    return rebuilt


def attention_forward(self, *args, **kwargs):
    if "past_key_values" in kwargs and "cache" not in kwargs:  # the name before transformers 5.2x
        kwargs["cache"] = kwargs.pop("past_key_values")
    return _ROPE_FORWARDS[type(self)](self, *args, **kwargs)


# --------------------------------------------------------------------------------------------
# The loss: fused linear cross-entropy on the final hidden states
# --------------------------------------------------------------------------------------------


def _softcapped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if not cap else cap * torch.tanh(logits / cap)


def causal_lm_forward(
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
    """The ForCausalLM forward with the loss by fused linear cross-entropy (see `patch`); MoE
    families add the router's auxiliary loss as their own forward does."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
    from transformers.modeling_utils import slice_logits_to_keep

    return_dict = kwargs.pop("return_dict", None)
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    if cache is not None:
        kwargs["cache"] = cache
    moe = hasattr(self.config, "router_aux_loss_coef")
    if moe:
        if kwargs.get("output_router_logits") is None:
            kwargs["output_router_logits"] = self.config.output_router_logits
    outputs = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
    )
    hidden = outputs[0]  # the final norm's output (B, T, C)
    cap = getattr(self.config, "final_logit_softcapping", None)
    shift_labels = kwargs.get("shift_labels")
    loss = logits = None
    if labels is not None or shift_labels is not None:
        if shift_labels is None:  # position t predicts label t + 1; the last predicts nothing
            shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        shift_labels = shift_labels.to(hidden.device)
        loss = linear_cross_entropy(
            hidden, self.lm_head.weight, shift_labels, IGNORE_INDEX, softcap=cap or 0.0
        )
        num_items_in_batch = kwargs.get("num_items_in_batch")
        if num_items_in_batch is not None:  # transformers' sum / num_items_in_batch
            counted = (shift_labels != IGNORE_INDEX).sum().clamp_min(1)
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss * counted / num_items_in_batch
    if loss is None or not self.training:
        logits = _softcapped(self.lm_head(slice_logits_to_keep(hidden, logits_to_keep)), cap)
    rest = {name: value for name, value in outputs.items() if name != "last_hidden_state"}
    if moe:
        aux_loss = None
        if kwargs["output_router_logits"]:
            aux_loss = modeling_module(self).load_balancing_loss_func(
                outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask
            )
            if loss is not None:
                loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        result = MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits, **rest)
    else:
        result = CausalLMOutputWithPast(loss=loss, logits=logits, **rest)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    return result if return_dict else result.to_tuple()


# --------------------------------------------------------------------------------------------
# Attaching them
# --------------------------------------------------------------------------------------------

#: The forwards a module can be given, by name (what a pickled PatchedForward stores).
PARTS = {
    "rms_norm": rms_norm_forward,
    "offset_rms_norm": offset_rms_norm_forward,
    "mlp": mlp_forward,
    "packed_mlp": packed_mlp_forward,
    "experts": experts_forward,
    "experts_gate": experts_gate,
    "attention": attention_forward,
    "causal_lm": causal_lm_forward,
}


def _restore_registration() -> None:
    """Loading a patched model in a fresh process: fastlm's attention must be registered with
    transformers again, since the model's config names it."""
    from fastlm.hf.attention import register

    register()


class PatchedForward:
    """A module's forward replaced by `PARTS[part]`; pickles as (module, part)."""

    __slots__ = ("module", "part")

    def __init__(self, module: nn.Module, part: str):
        self.module, self.part = module, part

    def __call__(self, *args, **kwargs):
        return PARTS[self.part](self.module, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        # The module's own forward's: trainers read it (which dataset columns to keep, whether
        # the model takes num_items_in_batch).
        return inspect.signature(type(self.module).forward.__get__(self.module))

    def __reduce__(self):
        return (_load_forward, (self.module, self.part))

    def __repr__(self) -> str:
        return f"fastlm.hf {self.part} forward of {type(self.module).__name__}"


def _load_forward(module: nn.Module, part: str) -> PatchedForward:
    _restore_registration()
    return PatchedForward(module, part)


def bind(modules, part: str, method: str = "forward") -> None:
    """Give each module PARTS[part] as its `method` (its forward by default)."""
    for module in modules:
        setattr(module, method, PatchedForward(module, part))


def is_patched_forward(forward: object) -> bool:
    return isinstance(forward, PatchedForward)


class PatchedParts(tuple):
    """`model.fastlm_patched`: the parts patched. Unpickling it registers fastlm's attention
    with transformers (a model patched for attention alone has no other fastlm object)."""

    def __reduce__(self):
        return (_load_parts, (tuple(self),))


def _load_parts(parts: tuple) -> PatchedParts:
    _restore_registration()
    return PatchedParts(parts)
