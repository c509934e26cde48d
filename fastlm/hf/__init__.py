"""Hugging Face causal LMs on fastlm's kernels, for inference and fine-tuning, and weights to and
from fastlm.Transformer.

Needs `transformers` (`pip install fastlm[hf]`); fastlm itself imports without it, and these
functions say what to install when it is missing.

`patch(model)` takes any transformers causal LM (a PEFT model around one too) and gives its own
modules (other models, and transformers' classes, are left as they are) forwards on the kernels
(`fastlm.hf.forwards`), each part found by what a module computes, checked by running it on
random parameters in training and eval mode (`fastlm.hf.probe`), never by the family's name;
what cannot run exactly stays, named with its reason in `model.fastlm_patched.left` and in one
warning (docs/huggingface-families.md):

- rms_norm: every module computing RMSNorm's math, q/k norms included, by `rms_norm` (fp32
  inside, one rounding; the output dtype the module's own: LLaMA's promotion of the input's and
  the weight's, Gemma's `x * (1 + w)` in fp32 cast to x's dtype, by the kernel's offset);
- rope: the family's own attention forward, run with its `apply_rotary*` function bound to one
  that rotates q and k by fastlm's RoPE op on the rotary embedding's own cos/sin, in the layout
  the family's function computes (found per shape against it), so every rope type (llama3,
  yarn, linear, dynamic, Gemma 3's local base, partial rotary) and every position (padded,
  packed) is applied as Hugging Face would, and the rest of the forward (q/k norms, fused qkv,
  soft caps, caches) is the family's code;
- swiglu: gated MLPs by `swiglu`, by `swiglu_packed` on a fused gate/up projection and the
  experts' gate (whose router and auxiliary loss are untouched; gpt-oss's clamped SwiGLU on
  interleaved gate/up by `swiglu_packed`'s options), or by `geglu` for GELU activations;
- attention: `fastlm.hf.attention`'s attention and mask functions, registered as "fastlm" with
  transformers and selected with `set_attn_implementation`: padded batches, padding-free batches
  (position_ids, or cu_seq_lens_q/k from the collator), sliding windows, soft caps, attention
  sinks, a value head dim of its own and Llama 4's chunks on the kernels, no [B, 1, T, T] mask
  built; what the kernels cannot run goes to SDPA with a warning;
- cross_entropy: with labels, the loss by fused linear cross-entropy on the final hidden states
  (`linear_cross_entropy`: the [tokens x vocab] logits never exist), with Hugging Face's label
  shift, ignore_index -100, `shift_labels` and `num_items_in_batch` (the sum over the batch
  divided by it, as transformers does for gradient accumulation), the family's logit scale
  (Granite's divisor, Cohere's multiplier) and final soft cap, each read on every call where
  the family reads it (a head that is no plain nn.Linear, PEFT's LoRA on lm_head: its own
  logits into fastlm's cross-entropy); MoE families add the router's
  auxiliary loss as their own forward does. In training mode such a call returns `logits=None`
  (that is the memory saved); in eval mode the logits are computed as well. A batch whose labels
  are all -100 has loss 0, where PyTorch's mean gives NaN.

The weights, their names and the state_dict are untouched. A patched model pickles
(`torch.save`/`torch.load`, `pickle`, `copy.deepcopy`, also loaded in a fresh process, which
registers the attention again); `save_pretrained` stores the weights and config, and a model
loaded back with `from_pretrained` is a plain transformers model: call `patch` on it again.
Gradient checkpointing composes (the decoder layers recompute through the patched forwards).
Under `torch.compile` the kernels are opaque custom ops (`torch.ops.fastlm.*`).

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
