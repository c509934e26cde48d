"""Hugging Face causal LMs on fastlm's kernels, for inference and fine-tuning, and weights to and
from fastlm.Transformer.

Needs `transformers` (`pip install fastlm[hf]`); fastlm itself imports without it, and these
functions say what to install when it is missing.

`patch(model)` picks the family from the model (`FAMILIES`: Llama, Mistral, Qwen2, Qwen3, Gemma,
Gemma 2, Gemma 3 text, Phi-3, Mixtral, Qwen3-MoE; a PEFT model around one too) and gives that
model's own modules (other models, and transformers' classes, are left as they are) forwards on
the kernels (`fastlm.hf.forwards`):

- rms_norm: every RMSNorm, q/k norms included, by `rms_norm` (fp32 inside, one rounding; LLaMA's
  output dtype is the promotion of the input's and the weight's, Gemma's is `x * (1 + w)` in fp32
  cast to x's dtype, exactly its order, by the kernel's offset);
- rope: the family's own attention forward, run with `apply_rotary_pos_emb` bound to fastlm's:
  q and k rotated in place by `apply_rope_` (half-split) on the rotary embedding's own cos/sin,
  so every rope type (llama3, linear, dynamic, Gemma 3's local base, Phi-3's partial rotary) and
  every position (padded, packed) is applied as Hugging Face would, and the rest of the forward
  (q/k norms, fused qkv, soft caps, caches) is the family's code;
- swiglu: the MLP's gated unit by `swiglu`, by `swiglu_packed` on a fused gate_up projection
  (Phi-3, the experts of Mixtral and Qwen3-MoE, whose router and auxiliary loss are untouched),
  or by `geglu` for GELU activations (Gemma's tanh GELU);
- attention: `fastlm.hf.attention`'s attention and mask functions, registered as "fastlm" with
  transformers and selected with `set_attn_implementation`: padded batches, padding-free batches
  (position_ids, or cu_seq_lens_q/k from the collator), sliding windows and soft caps on the
  kernels, no [B, 1, T, T] mask built; what the kernels cannot run goes to SDPA with a warning;
- cross_entropy: with labels, the loss by fused linear cross-entropy on the final hidden states
  (`linear_cross_entropy`: the [tokens x vocab] logits never exist), with Hugging Face's label
  shift, ignore_index -100, `shift_labels` and `num_items_in_batch` (the sum over the batch
  divided by it, as transformers does for gradient accumulation), Gemma 2's and Gemma 3's final
  logit soft cap (`softcap`); MoE families add the router's auxiliary loss as their own forward
  does. In training mode such a call returns `logits=None`
  (that is the memory saved); in eval mode the logits are computed as well. A batch whose labels
  are all -100 has loss 0, where PyTorch's mean gives NaN.

The weights, their names and the state_dict are untouched. A patched model pickles
(`torch.save`/`torch.load`, `pickle`, `copy.deepcopy`, also loaded in a fresh process, which
registers the attention again); `save_pretrained` stores the weights and config, and a model
loaded back with `from_pretrained` is a plain transformers model: call `patch` on it again.
Gradient checkpointing composes (the decoder layers recompute through the patched forwards).
Under `torch.compile` the kernels are opaque custom ops (`torch.ops.fastlm.*`). A part that cannot
be patched for this model (another activation, a head dim the attention kernel does not take, an
lm_head with a bias) is left as it is, with a warning that says why.

`from_hf` and `to_hf` (`fastlm.hf.convert`) convert weights between Llama, Mistral and Qwen2 models
and `fastlm.Transformer`.
"""

from fastlm.hf.attention import ATTENTION, fastlm_attention, fastlm_mask, register
from fastlm.hf.convert import from_hf, to_hf
from fastlm.hf.families import CONVERTIBLE, FAMILIES, Family
from fastlm.hf.patch import patch

__all__ = [
    "ATTENTION",
    "CONVERTIBLE",
    "FAMILIES",
    "Family",
    "fastlm_attention",
    "fastlm_mask",
    "from_hf",
    "patch",
    "register",
    "to_hf",
]
