"""fastlm.hf.patch on every causal-LM model type of the installed transformers: each one whose
tiny configuration builds is patched and run against its unpatched copy (eager attention) on a
plain batch, and counted where its attention ran through fastlm's attention with loss, logits
and every gradient within fastlm's fp32 tolerance. Every type that does not is a named,
understood limit (`LIMITS`, checked both ways: a type listed there that passes fails the test,
so the list stays true). Every type with experts modules (`probe.experts_module`: transformers'
experts interface, and stacked experts of other forms, Llama 4's, LongCat-Flash's, JetMoE's) is
counted where its experts ran `fastlm.moe_experts` forward and backward under that parity, or is
a named limit of its math (`EXPERTS_LEFT`, checked both ways); an experts module neither on the
op nor named in `fastlm_patched.left` fails it. The MoE decoders that are no causal-LM type
(`_moe_text_types`: multimodal models' text decoders, Mistral 4) are built as a causal LM around
their decoder and their experts checked the same way.

It runs on the PyTorch backend (FASTLM_BACKEND=torch: fastlm.hf's routing down to
`flash_attention`'s and `flash_attention_varlen`'s reference math, their calls counted) to fit
CI's time; tests/test_hf_families.py runs the families issue 28 names on the kernels. Run
`pytest tests/test_hf_all_models.py -s` to print the table.
"""

import copy
import importlib
import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_families import (  # noqa: E402
    FAMILY_CONFIGS,
    MLA,
    TINY,
    VOCAB,
    has_field,  # noqa: E402
    tiny_config,
    tiny_model,
    worst_gradient_error,
)
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402
from transformers.models.auto.configuration_auto import model_type_to_module_name  # noqa: E402

from fastlm import hf  # noqa: E402
from fastlm.hf import attention as hf_attention  # noqa: E402
from fastlm.hf import experts as hf_experts  # noqa: E402
from fastlm.hf import forwards as hf_forwards  # noqa: E402
from fastlm.hf import probe  # noqa: E402
from fastlm.testing import TOLERANCE, relative_error  # noqa: E402

hf_patch = importlib.import_module("fastlm.hf.patch")  # (fastlm.hf.patch is also the function)

pytestmark = pytest.mark.usefixtures("one_thread")

#: The phrases of the limits below.
OWN_ATTENTION = "no module calls transformers' attention interface"
BIDIRECTIONAL = "{'fastlm': 0, 'sdpa'"
READS_MASK = "its forward fails on fastlm's attention"
SCORE_BIAS = "attention did not run on fastlm's path"

#: model_type -> why it does not run attention on fastlm's kernels with parity (a phrase of
#: the failure it gives here). Types whose tiny config does not build are in NOT_BUILT.
#: - OWN_ATTENTION: the model computes attention in its own code (BLOOM's ALiBi, MPT, XGLM,
#:   Falcon, GPT-Neo, Reformer's LSH, CPM-Ant, the BERT-era decoders) or has none (Mamba,
#:   Mamba-2, RWKV, xLSTM, RecurrentGemma);
#: - BIDIRECTIONAL: an encoder's config (is_decoder False): bidirectional attention, which
#:   fastlm's causal kernels do not run; it goes to SDPA with a warning;
#: - inkling_text: a relative position bias added to the scores (position_bias), which the
#:   kernels do not take: the family's eager attention runs it, with a warning; Inkling 2's
#:   (SCORE_BIAS) goes to SDPA;
#: - READS_MASK: the family's own code reads the mask tensor (Doge's dynamic mask, the sparse
#:   attention indexers of DeepSeek-V3.2, GLM-MoE-DSA, Hunyuan-V4, AXK2, dots.3 and Qwen4-exp,
#:   GIT's additive mask), which fastlm's mask function does not make: patch finds that on its
#:   first forward and leaves attention;
#: - gemma4_unified_assistant: a drafter, whose forward needs the target model's shared keys and
#:   values (shared_kv_states);
#: - xmod: needs set_default_language() (an adapter per language) before any forward.
LIMITS = {
    "axk2": READS_MASK,
    "bert": BIDIRECTIONAL,
    "bert-generation": BIDIRECTIONAL,
    "big_bird": OWN_ATTENTION,
    "bigbird_pegasus": BIDIRECTIONAL,
    "bloom": OWN_ATTENTION,
    "camembert": BIDIRECTIONAL,
    "cpmant": OWN_ATTENTION,
    "data2vec-text": BIDIRECTIONAL,
    "deepseek_v32": READS_MASK,
    "doge": READS_MASK,
    "dots3_note": READS_MASK,
    "dots3_note_text": READS_MASK,
    "electra": BIDIRECTIONAL,
    "ernie": BIDIRECTIONAL,
    "falcon": OWN_ATTENTION,
    "falcon_mamba": OWN_ATTENTION,
    "gemma4_unified_assistant": "shared_kv_states cannot be None",
    "git": READS_MASK,
    "glm_moe_dsa": READS_MASK,
    "gpt_neo": OWN_ATTENTION,
    "gpt_neox_japanese": OWN_ATTENTION,
    "hy_v4": READS_MASK,
    "inkling_text": "{'fastlm': 0, 'sdpa': 0}",
    "inkling2_loop_text": SCORE_BIAS,
    "inkling2_text": SCORE_BIAS,
    "mamba": OWN_ATTENTION,
    "mamba2": OWN_ATTENTION,
    "megatron-bert": OWN_ATTENTION,
    "mpt": OWN_ATTENTION,
    "mvp": OWN_ATTENTION,
    "openai-gpt": OWN_ATTENTION,
    "qwen4_exp": READS_MASK,
    "qwen4_exp_text": READS_MASK,
    "recurrent_gemma": OWN_ATTENTION,
    "reformer": OWN_ATTENTION,
    "rembert": OWN_ATTENTION,
    "roberta": BIDIRECTIONAL,
    "roberta-prelayernorm": BIDIRECTIONAL,
    "roc_bert": BIDIRECTIONAL,
    "roformer": OWN_ATTENTION,
    "rwkv": OWN_ATTENTION,
    "trocr": OWN_ATTENTION,
    "xglm": OWN_ATTENTION,
    "xlm": OWN_ATTENTION,
    "xlm-roberta": BIDIRECTIONAL,
    "xlm-roberta-xl": BIDIRECTIONAL,
    "xlstm": OWN_ATTENTION,
    "xmod": "Input language unknown",
}

#: The walk's own gap: a size field under a name of the family's own that the tiny config does
#: not set, so it would build big (refused before it is built).
SIZE_FIELD = "a size field the tiny config misses"

#: model_type -> why its tiny config does not build a model here. About the family:
#: - gemma3n: its vision tower is a timm model (MobileNetV5): timm is not installed;
#: - gemma4_assistant: its default config fails its own validation in transformers 5.24;
#: - prophetnet, xlnet: an encoder-decoder and a memory model whose configs refuse the
#:   decoder-only fields (num_hidden_layers, a sequence length).
#: The others are the walk's own gaps (SIZE_FIELD, a field of another name or layout).
NOT_BUILT = {
    "blt": SIZE_FIELD,
    "cohere_compass_text": "KeyError: 'full_attention'",
    "dbrx": "AttributeError: 'DbrxAttentionConfig' object has no attribute 'rope_th",
    "emu3": "has no attribute 'pad_token_id'",
    "gemma3n": "TimmWrapperModel requires the timm library",
    "gemma4_assistant": "hidden_size_per_layer_input must be 0",
    "got_ocr2": SIZE_FIELD,
    "musicgen": "has no attribute 'dropout'",
    "musicgen_melody": "has no attribute 'dropout'",
    "phi4_multimodal": SIZE_FIELD,
    "prophetnet": "NotImplementedError: This model does not support the setting of `num_h",
    "xlnet": "NotImplementedError: The model xlnet is one of the few models that has",
}


def _causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


#: model_type -> why patch leaves its experts on transformers' own code (a phrase of what
#: `fastlm_patched.left` says): the family's math, which `fastlm.moe_experts` does not compute.
#: Every other type with experts modules (`probe.experts_module`) runs them on the op, forward
#: and backward, with the walk's parity on loss, logits and every gradient.
#: - Inkling 2 (text, and looped): a softcapped SwiGLU, softcap(gate) * sigmoid(gate) *
#:   softcap(up) with tanh softcaps, which the op does not compute.
#: - Inkling (text): its routed experts run on the op; its shared experts take every token
#:   through each of n_shared experts, scaled by the router's gammas between the gate and down
#:   (gate, up and down three separate stacks, run by batched matmuls): a form no probe checks
#:   (the op would take gate and up as one stack: a copy of them on every call), so left, named.
#: - Muse Spark (text): an RMSNorm of each expert's output before the weighted sum
#:   (`has_post_expert_norm`): the op sums the experts' outputs as they are.
#: - JetMoE: its MoE MLP runs on the op (`forwards.sorted_experts_forward`); its mixture of
#:   attention heads (MoA: per expert a query projection before attention and an output
#:   projection after it, called through the block's map and reduce, its forward raising) is
#:   no MLP's experts, and stays the family's code, named in `left`.
EXPERTS_LEFT = {
    "muse_spark_text": "a norm of each expert's output (has_post_expert_norm)",
    "inkling2_loop_text": "neither act(gate) * up",
    "inkling2_text": "neither act(gate) * up",
    "inkling_text": "InklingSharedExperts: stacked gate_proj, up_proj, down_proj and a forward(",
    "jetmoe": "not as an MLP's experts, which fastlm.moe_experts computes; the others on",
}
#: Types whose left experts are some of theirs, the others run on the op with parity.
SOME_ON_THE_OP = {"inkling_text", "jetmoe"}

#: MoE configs that are no causal-LM type and that the walk does not build (`_moe_text_types`
#: finds them all; checked both ways), each with why: no decoder-only LM over tokens.
MOE_NOT_WALKED = {
    "qwen3_omni_moe_talker_text": "Qwen3-Omni's talker: a decoder over the thinker's hidden "
    "states, with no token embedding of its own (its thinker's text decoder is walked)",
    "dots3_note_vision_encoder": "a vision encoder's experts (dots.3's text decoder is walked)",
    "nllb-moe": "an encoder-decoder (translation): no decoder-only LM",
    "openai_privacy_filter": "a bidirectional token classifier: no causal LM (gpt-oss's experts)",
    "switch_transformers": "an encoder-decoder (T5's): no decoder-only LM",
}

#: The model's own classes holding a stacked parameter (3 or more dims) that are no experts:
#: per-head gates and projections of recurrent and state-space layers, a learned query.
#: The walk checks both ways that these, and only these, are what `probe.experts_module` does
#: not take for experts, so a new family's stacked experts cannot go unseen.
NOT_EXPERTS = {
    "Inkling2LoopMessageAttentionResidual": "a learned query (heads, 1, head_dim)",
    "KimiLinearForgetGate": "A_log per head",
    "RecurrentGemmaRglru": "block-diagonal gates per head",
    "RwkvFeedForward": "time-mix vectors (1, 1, D)",
    "RwkvSelfAttention": "time-mix vectors (1, 1, D)",
    "SiglipMultiheadAttentionPoolingHead": "a learned probe (1, 1, D)",
    "ZambaMambaMixer": "per-head projections of its Mamba mixer",
}


class _AttentionCalls:
    """Counts the calls of fastlm.hf.attention's kernels' entry points and of PyTorch's SDPA
    outside them (their PyTorch-backend reference may call SDPA itself)."""

    def __init__(self, monkeypatch):
        self.counts = {"fastlm": 0, "sdpa": 0}
        self.inside = 0
        for name in ("flash_attention", "flash_attention_varlen"):
            monkeypatch.setattr(
                hf_attention, name, self._counting("fastlm", getattr(hf_attention, name))
            )
        sdpa = torch.nn.functional.scaled_dot_product_attention
        monkeypatch.setattr(
            torch.nn.functional, "scaled_dot_product_attention", self._counting("sdpa", sdpa)
        )

    def _counting(self, key, function):
        def counted(*args, **kwargs):
            if key == "fastlm" or not self.inside:
                self.counts[key] += 1
            self.inside += key == "fastlm"
            try:
                return function(*args, **kwargs)
            finally:
                self.inside -= key == "fastlm"

        return counted


#: The sizes under the other names configs give them (GPT-2's n_embd, BART's d_model...).
ALIASES = dict(
    n_embd=32, d_model=32, hidden_dim=32, dim=32, n_layer=2, n_layers=2, num_layers=2,
    decoder_layers=2, encoder_layers=2, n_head=2, n_heads=2, num_heads=2,
    decoder_attention_heads=2, encoder_attention_heads=2, decoder_ffn_dim=48,
    encoder_ffn_dim=48, ffn_dim=48, n_inner=48, d_ff=48, d_kv=16, n_positions=64,
    max_seq_len=64,
)  # fmt: skip
#: A tiny config that still builds more parameters than this kept a size field we do not know.
MAX_PARAMETERS = 2_000_000


#: Linear-attention sizes of the hybrids (Qwen3.5's gated delta net).
LINEAR = dict(
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=2,
)  # fmt: skip

#: Types whose tiny config needs a field of its own (a rotary width, MLA's head dims), or more
#: layers: the hybrids' default pattern puts a full-attention layer every 4th.
WALK_CONFIGS = {
    "codegen": dict(rotary_dim=8),
    "diffllama": dict(num_key_value_heads=2),  # its differential attention splits KV heads
    "gptj": dict(rotary_dim=8),
    **{name: dict(MLA) for name in ("axk1", "youtu", "glm4_moe_lite", "minicpm3", "sarvam_mla")},
    **{name: dict(LINEAR, num_hidden_layers=4) for name in ("qwen3_5_text", "qwen3_5_moe_text")},
    # The other hybrids: two layers of their two kinds.
    "qwen4_exp_text": dict(
        LINEAR,
        layer_types=["linear_attention", "indexed_attention"],
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=1,
    ),  # fmt: skip
    "lfm3": dict(layer_types=["conv", "full_attention"]),
    # Per-layer configs: dots.3's sliding layer with heads and MLA sizes of its own.
    "dots3_note_text": dict(
        MLA,
        layer_types=["indexed_attention", "sliding_attention"],
        index_topk=4,
        index_head_dim=16,
        index_n_heads=2,
        head_dim=16,  # the sliding layer's: its qk_nope_head_dim 8 + qk_rope_head_dim 8
        per_layer_config={
            1: dict(
                num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=8, qk_nope_head_dim=8
            )
        },
    ),  # fmt: skip
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "zaya": dict(num_experts_per_tok=1),
    **{
        name: dict(
            swa_num_attention_heads=2,
            swa_num_key_value_heads=1,
            swa_head_dim=16,
            sliding_window_size=8,
            rel_extent=8,
            unpadded_vocab_size=VOCAB,
        )
        for name in ("inkling2_text", "inkling2_loop_text")
    },
    "kimi_linear": dict(
        MLA,
        layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"],
        linear_head_dim=8,
        linear_num_heads=2,
        num_key_value_heads=2,
    ),  # fmt: skip
    # MoE families whose default dense first layers would take both of the tiny model's.
    "beam": dict(mlp_layer_types=["dense", "sparse"], n_group=1, topk_group=1),
    "flint": dict(mlp_only_layers=[0]),
    # The Mamba hybrids: a Mamba layer, then an attention layer.
    "bamba": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, attn_layer_indices=[1]),
    "granitemoehybrid": dict(
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        layer_types=["linear_attention", "attention"],
    ),  # fmt: skip
    "mamba2": dict(num_heads=4, head_dim=16, state_size=8),
    # Falcon-H1's Mamba-2 mixer at its default sizes (128 heads, a state of 256, chunks of 256)
    # took most of this test's time; here 4 heads, a state of 8, and chunks of 8 (a row of 9
    # tokens spans two).
    "falcon_h1": dict(
        mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=8
    ),  # fmt: skip
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[16, 16]),
    # DeepSeek-V3.2's sparse attention (MLA with an indexer) and the families that took it.
    **{
        name: dict(MLA, index_n_heads=2, index_head_dim=16, index_topk=4)
        for name in ("deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2")
    },  # fmt: skip
    "hy_v4_vl_text": dict(
        MLA,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 1, 1]),
    ),  # fmt: skip
    # The MoE decoders that are no causal-LM type (`_moe_text_types`), their sizes and layers.
    **{name: dict(MLA) for name in ("mistral4", "mistral_large4_text")},
    "glm4v_moe_text": dict(
        rope_parameters=dict(
            rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5, mrope_section=[2, 1, 1]
        ),
        n_group=1,
        topk_group=1,
    ),  # fmt: skip
    "glm5_next_text": dict(
        MLA,
        num_key_value_heads=2,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=16,
        qk_rope_head_dim=0,
        layer_types=["linear_attention", "indexed_attention"],
        linear_head_dim=8,
        linear_num_heads=2,
        mlp_layer_types=["dense", "sparse"],
    ),  # fmt: skip
    "step3p5": dict(mlp_layer_types=["dense", "sparse"], sliding_window=6),
    "ernie4_5_vl_moe_text": dict(
        moe_intermediate_size=[24, 24],
        moe_num_experts=4,
        moe_k=2,
        moe_num_shared_experts=1,
        rope_parameters=dict(rope_type="default", rope_theta=5e5, mrope_section=[2, 2, 4]),
    ),  # fmt: skip
    "deepseek_ocr2_text": dict(mlp_layer_types=["dense", "sparse"], n_group=1, topk_group=1),
    "muse_spark_text": dict(moe_hidden_size=32),
    # LongCat-Flash: 2 identity "zero experts" beside its 4 experts (its default 256 would take
    # nearly every choice), so that the router picks both kinds.
    "longcat_flash": dict(
        MLA, index_n_heads=2, index_head_dim=16, index_topk=4, zero_expert_num=2
    ),  # fmt: skip
    "cpmant": dict(dim_ff=48),
    "roc_bert": dict(
        shape_vocab_size=16,
        shape_embed_dim=16,
        pronunciation_vocab_size=16,
        pronunciation_embed_dim=16,
    ),  # fmt: skip
    # Zamba ties its hybrid layers' shared block to the first one's: two of them.
    "zamba": dict(
        num_hidden_layers=3,
        layers_block_type=["linear_attention", "hybrid", "hybrid"],
        mamba_d_state=8,
    ),  # fmt: skip
    "zamba2": dict(layers_block_type=["linear_attention", "hybrid"], mamba_d_state=8),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "bailing_hybrid": dict(MLA, layer_group_size=2, linear_head_dim=8, linear_num_heads=2),
    # Gemma 3n: a sliding and a global layer, its per-layer inputs and LAuReL small.
    "gemma3n_text": dict(
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        num_kv_shared_layers=0,
        activation_sparsity_pattern=[0.95, 0.0],
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        laurel_rank=4,
    ),  # fmt: skip
}


def _changes(model_type: str) -> dict:
    """The fields a type's tiny config sets beyond TINY's: its sizes under other names, its
    WALK_CONFIGS, and a composite config's sub-configs made tiny (a multimodal model built
    through its text config: the text one as its own type's tiny config, vision and audio ones
    with the tiny sizes they have)."""
    config = transformers.CONFIG_MAPPING[model_type]()
    changes = {name: value for name, value in ALIASES.items() if name in config.__dict__}
    changes.update(WALK_CONFIGS.get(model_type, {}))
    for name in getattr(config, "sub_configs", {}):
        sub = getattr(config, name, None)
        if sub is None or name in changes:
            continue
        if name == "text_config" and sub.model_type in transformers.CONFIG_MAPPING:
            text = {**FAMILY_CONFIGS.get(sub.model_type, {}), **_changes(sub.model_type)}
            changes[name] = tiny_config(sub.model_type, **text)
        else:
            fields = {**TINY, **ALIASES, **WALK_CONFIGS.get(sub.model_type, {})}
            changes[name] = type(sub)(**{k: v for k, v in fields.items() if has_field(sub, k)})
    return changes


def _text_type(model_type: str) -> str | None:
    """The text config's model type of a composite type whose causal LM is built from its text
    config alone (Qwen3.5's: `Qwen3_5ForCausalLM` takes a `Qwen3_5TextConfig`), else None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        text = getattr(transformers.CONFIG_MAPPING[model_type](), "text_config", None)
    except Exception:  # noqa: BLE001 (a config that does not build: _build says why)
        return None
    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    registered = text is not None and text.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if registered and model_class.config_class is type(text):
        return text.model_type
    return None


#: Fields that count a text config's experts (a mixture's: more than one).
EXPERTS_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _moe_text_types(walked: set) -> dict:
    """{model type: types holding it} of every config in transformers' CONFIG_MAPPING (or the
    text config of one) that counts more than one expert and that no type in `walked` is:
    the MoE decoders that are no causal-LM type (a multimodal model's text decoder, Mistral 4's
    decoder, encoder-decoders), which the walk builds through `_text_causal_lm`."""
    found: dict[str, list] = {}
    for model_type in sorted(transformers.CONFIG_MAPPING.keys()):
        if model_type in walked:
            continue
        try:
            config = transformers.CONFIG_MAPPING[model_type]()
        except Exception:  # noqa: BLE001 (a config that needs arguments: no default to read)
            continue
        for text in (config, getattr(config, "text_config", None)):
            if text is None or text.model_type in walked:
                continue
            per_layer = getattr(text, "per_layer_attributes", None) or ()
            counts = [getattr(text, f, None) for f in EXPERTS_FIELDS if f not in per_layer]
            if any(f in per_layer for f in EXPERTS_FIELDS) or any(
                isinstance(n, int) and n > 1 for n in counts
            ):  # a count per layer: a mixture whose layers differ
                found.setdefault(text.model_type, []).append(model_type)
    return found


def _text_causal_lm(model_type: str):
    """A causal LM around the type's decoder, for a type with no causal LM of its own: the
    decoder class of its modeling module that takes this config (`...TextModel`, `...Model`),
    an lm_head, and transformers' causal-LM loss, on the family's PreTrainedModel (its
    attention and initialisation flags)."""
    folder = model_type_to_module_name(model_type)
    module = importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")
    config_class = transformers.CONFIG_MAPPING[model_type]
    decoder = next(
        c
        for name, c in vars(module).items()
        if isinstance(c, type)
        and issubclass(c, transformers.PreTrainedModel)
        and c.config_class is config_class
        and name.endswith("Model")
        and "PreTrained" not in name
    )
    base = next(c for c in decoder.__mro__[1:] if c.__name__.endswith("PreTrainedModel"))

    class TextCausalLM(base):
        def __init__(self, config):
            super().__init__(config)
            self.model = decoder(config)
            self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

        def get_output_embeddings(self):
            return self.lm_head

        def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            logits = self.lm_head(hidden.last_hidden_state)
            loss = None
            if labels is not None:
                loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size)
            return CausalLMOutputWithPast(loss=loss, logits=logits)

    TextCausalLM.__name__ = f"{decoder.__name__}ForCausalLM"
    return TextCausalLM


def _build(model_type: str):
    """The type's tiny model (a type with no causal LM of its own: `_text_causal_lm`), or why
    it does not build (its parameters counted on the meta device first: a config with a size
    field of another name is refused, not built big)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        aliases = _changes(model_type)
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            aliases["model_class"] = _text_causal_lm(model_type)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.device("meta"):
                count = sum(p.numel() for p in tiny_model(model_type, **aliases).parameters())
            if count > MAX_PARAMETERS:
                return f"ValueError: {count:,} parameters: {SIZE_FIELD}"
            return tiny_model(model_type, **aliases)
    except Exception as error:  # noqa: BLE001 (the reason is what the test records)
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        return f"{type(error).__name__}: {' '.join(lines[:2])[:200]}"  # (validators: 2 lines)


#: The experts status of a type whose experts run on fastlm's op with parity.
ON_THE_OP = "on fastlm's op"


class _ExpertsCalls:
    """Counts the calls of fastlm.moe_experts by fastlm.hf (`fastlm.hf.experts`' implementation
    and `fastlm.hf.forwards`' blocks, LongCat-Flash's zero experts among them: the probe's runs
    call the reference instead), and
    their backward (a gradient hook on each output); `missed` names the experts modules whose
    forward ran without calling it."""

    def __init__(self, monkeypatch):
        self.forward = self.backward = 0
        self.missed = set()
        self.stacked = set()  # `_stacked_classes` of every model run
        for module, name in ((hf_experts, "moe_experts"), (hf_forwards, "moe_experts")):
            monkeypatch.setattr(module, name, self._counting(getattr(module, name)))

    def _counting(self, op):
        def counted(*args, **kwargs):
            self.forward += 1
            out = op(*args, **kwargs)
            if out.requires_grad:
                out.register_hook(self._backward)
            return out

        return counted

    def _backward(self, grad):
        self.backward += 1

    def watch(self, modules: dict) -> list:
        """Hooks on `modules` ({path: module}; remove them after) that add to `missed` the path
        of each one whose forward did not call the op."""

        def before(module, args):
            module._fastlm_calls_before = self.forward

        def after(path):
            def hook(module, args, output):
                if self.forward == module._fastlm_calls_before:
                    self.missed.add(path)

            return hook

        hooks = [(m.register_forward_pre_hook(before), m.register_forward_hook(after(path)))
                 for path, m in modules.items()]  # fmt: skip
        return [h for pair in hooks for h in pair]


def _experts_modules(model) -> dict:
    """{path: module} of every experts module, whatever its form (`probe.experts_module`:
    transformers' experts interface, and stacked experts of the model's own classes: Llama 4's,
    LongCat-Flash's, JetMoE's parallel experts; lists of expert modules)."""
    return {path: m for path, m in model.named_modules() if probe.experts_module(m)}


def _stacked_classes(model) -> set:
    """The model's own classes holding a parameter of 3 or more dims that
    `probe.experts_module` does not take for experts (checked against NOT_EXPERTS)."""
    return {
        type(m).__name__
        for m in model.modules()
        if not type(m).__module__.startswith("torch.")
        and any(p.dim() >= 3 for p in m.parameters(recurse=False))
        and not probe.experts_module(m)
    }


def _experts_status(model, missed: set, backward: int) -> str:
    """ON_THE_OP when no experts module ran without fastlm's op (`missed`: their paths) and the
    op's backward ran; "left: ..." with patch's reasons where `fastlm_patched.left` names each
    one that did (its class, or the class of a module holding it: JetMoE's MoA); else why not."""
    left = model.fastlm_patched.left
    unsaid, said = set(), {}
    for path in sorted(missed):
        steps = path.split(".")
        holders = [".".join(steps[:i]) for i in range(len(steps), -1, -1)]
        names = [type(model.get_submodule(h)).__name__ for h in holders]
        what = next((w for w in left if w.split(" ")[0] in names), None)
        if what is None:
            unsaid.add(names[0])
        else:
            said[what] = left[what]
    if unsaid:
        return f"experts ran without the op, nothing said: {', '.join(sorted(unsaid))}"
    if said:
        others = "; the others on fastlm's op" if backward else ""
        return "left: " + "; ".join(f"{what}: {why}" for what, why in said.items()) + others
    if not backward:
        return "the op's backward did not run"
    return ON_THE_OP


def _parity(model, unpatched, outputs) -> str | None:
    """None when loss, logits and every gradient are within fastlm's fp32 tolerance."""
    bound = TOLERANCE[torch.float32]
    for what, ours, theirs in outputs:
        if relative_error(ours, theirs) > bound:
            return f"parity: {what} off by {relative_error(ours, theirs):.1e}"
    worst, where = worst_gradient_error(model, unpatched)
    if worst > bound:
        return f"parity: {where} off by {worst:.1e}"
    return None


def _run(model_type: str, calls: _AttentionCalls, experts: _ExpertsCalls):
    """(attention, experts): attention None when the type runs attention on fastlm's path with
    parity, else why not; experts None when it has no experts modules, ON_THE_OP when every
    one ran fastlm.moe_experts forward and backward with that parity, else why not. A type
    whose attention patch left runs the step only for its experts."""
    model = _build(model_type)
    if isinstance(model, str):
        return f"build: {model}", None
    model.eval()  # no dropout: the two models draw no random masks
    unpatched = copy.deepcopy(model)
    ids = torch.randint(3, VOCAB, (2, 9))
    batch = dict(input_ids=ids, labels=ids.clone(), use_cache=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf.patch(model)
    except Exception as error:  # noqa: BLE001
        return f"patch: {type(error).__name__}: {error}", None
    parts = model.fastlm_patched
    modules = _experts_modules(model)
    experts.stacked |= _stacked_classes(model)
    attention = None
    if "attention" not in parts:
        attention = f"attention left: {parts.left.get('attention', parts.left)}"
        if not modules:
            return attention, None
    before = dict(calls.counts)
    experts.forward = experts.backward = 0
    experts.missed.clear()
    hooks = experts.watch(modules)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = model(**batch).loss
            loss.backward()
            expected = unpatched(**batch).loss
            expected.backward()
            with torch.no_grad():
                logits = model(input_ids=ids, use_cache=False).logits
                their_logits = unpatched(input_ids=ids, use_cache=False).logits
    except Exception as error:  # noqa: BLE001
        failure = f"run: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
        return attention or failure, failure if modules else None
    finally:
        for hook in hooks:
            hook.remove()
    ran = {key: calls.counts[key] - before[key] for key in before}
    if attention is None and (ran["fastlm"] == 0 or ran["sdpa"]):
        attention = f"attention did not run on fastlm's path: {ran}"
    outputs = (("loss", loss, expected), ("logits", logits, their_logits))
    parity = _parity(model, unpatched, outputs) if attention is None or modules else None
    if not modules:
        return attention or parity, None
    status = _experts_status(model, experts.missed, experts.backward)
    return attention or parity, parity if status == ON_THE_OP and parity else status


def test_every_causal_lm_type(monkeypatch, capsys):
    """Every causal-LM model type: on fastlm's attention with parity, or a named limit; every
    one with experts modules: its experts on fastlm.moe_experts, or a named limit."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    calls, experts = _AttentionCalls(monkeypatch), _ExpertsCalls(monkeypatch)
    results, moe = {}, {}
    for model_type in _causal_lm_types():
        # A composite type whose causal LM takes its text config alone is its text type.
        text = _text_type(model_type)
        for name in (text, model_type) if text else (model_type,):
            if name not in results:
                torch.manual_seed(0)
                results[name], moe[name] = _run(name, calls, experts)
        results[model_type], moe[model_type] = results[text or model_type], moe[text or model_type]
    # The MoE decoders that are no causal-LM type (multimodal models' text decoders, Mistral 4):
    # a causal LM around each (`_text_causal_lm`), its experts checked as the others'.
    beyond = _moe_text_types(set(results))
    problems = [f"{t} in MOE_NOT_WALKED: no MoE config" for t in set(MOE_NOT_WALKED) - {*beyond}]
    for model_type in sorted(set(beyond) - set(MOE_NOT_WALKED)):
        torch.manual_seed(0)
        attention, moe[model_type] = _run(model_type, calls, experts)
        if moe[model_type] is None:
            moe[model_type] = f"no experts run: {attention}"
    moe = {t: status for t, status in moe.items() if status is not None}
    built = {t: r for t, r in results.items() if not (r or "").startswith("build: ")}
    passing = sorted(t for t, r in built.items() if r is None)
    on_the_op = sorted(t for t, status in moe.items() if status == ON_THE_OP)
    some = {t for t, status in moe.items() if status.endswith("; the others on fastlm's op")}
    with capsys.disabled():
        print(f"\n{len(passing)} of {len(built)} causal-LM types whose tiny config builds "
              f"({len(results)} in transformers {transformers.__version__}) run attention on "
              f"fastlm's kernels with parity; {len(on_the_op)} of {len(moe)} MoE types run "
              f"all their experts on fastlm's op, {len(some)} some of them")  # fmt: skip
        for model_type, reason in sorted(results.items()):
            experts_status = f"; experts {moe[model_type]}" if model_type in moe else ""
            print(f"  {model_type}: {reason or 'ok'}{experts_status}")
        print(f"MoE decoders of no causal-LM type ({len(beyond)}), their experts:")
        for model_type in sorted(beyond):
            print(f"  {model_type}: {moe.get(model_type) or MOE_NOT_WALKED[model_type]}")
    for model_type, reason in results.items():
        if reason is None:
            if model_type in LIMITS or model_type in NOT_BUILT:
                problems.append(f"{model_type} passes: remove it from LIMITS / NOT_BUILT")
        elif reason.startswith("build: "):
            if model_type not in NOT_BUILT or NOT_BUILT[model_type] not in reason:
                problems.append(f"{model_type} does not build, not in NOT_BUILT: {reason}")
        elif model_type not in LIMITS or LIMITS[model_type] not in reason:
            problems.append(f"{model_type} is no understood limit: {reason}")
    for model_type, status in moe.items():
        if status == ON_THE_OP:
            if model_type in EXPERTS_LEFT:
                problems.append(f"{model_type}'s experts run on the op: not EXPERTS_LEFT")
        elif model_type not in EXPERTS_LEFT or EXPERTS_LEFT[model_type] not in status:
            problems.append(f"{model_type}'s experts are no understood limit: {status}")
    problems += [f"{t} in EXPERTS_LEFT has no experts here" for t in set(EXPERTS_LEFT) - set(moe)]
    if some != SOME_ON_THE_OP:
        problems.append(f"types with some experts on the op: {sorted(some)}, not SOME_ON_THE_OP")
    if experts.stacked != set(NOT_EXPERTS):
        problems.append(
            f"stacked parameters probe.experts_module does not take for experts: "
            f"{sorted(experts.stacked)}, not NOT_EXPERTS' {sorted(NOT_EXPERTS)}"
        )
    assert not problems, "\n".join(problems)
    assert set(FAMILY_CONFIGS) <= set(passing) | set(LIMITS)


def test_the_walk_tells_experts_off_the_op(monkeypatch):
    """Experts patch did not put on the op are named in `left` (Mixtral's with `use_op` refusing
    them: they keep transformers' grouped_mm), and the walk tells them apart from experts on it."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    calls, experts = _AttentionCalls(monkeypatch), _ExpertsCalls(monkeypatch)
    monkeypatch.setattr(hf_experts, "use_op", lambda module, options: False)
    torch.manual_seed(0)
    attention, status = _run("mixtral", calls, experts)
    assert attention is None
    assert status.startswith("left: MixtralExperts: their gate on fastlm's kernel"), status
    assert experts.forward == 0 and {p.split(".")[-1] for p in experts.missed} == {"experts"}


@pytest.mark.parametrize(
    "model_type, probe_name, experts_class",
    [
        ("mixtral", None, "MixtralExperts"),
        ("longcat_flash", "zero_experts_candidate", "LongcatFlashExperts"),
        ("jetmoe", "sorted_experts_candidate", "JetMoeParallelExperts"),
    ],
)
def test_the_walk_fails_experts_left_silently(model_type, probe_name, experts_class, monkeypatch):
    """Experts that patch neither runs on the op nor names in `left` fail the walk, whatever
    their form: transformers' experts interface (Mixtral's), LongCat-Flash's beside zero experts,
    JetMoE's parallel experts (their probes switched off, and patch's naming of what it left)."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    calls, experts = _AttentionCalls(monkeypatch), _ExpertsCalls(monkeypatch)
    monkeypatch.setattr(hf_experts, "use_op", lambda module, options: False)
    if probe_name is not None:
        monkeypatch.setattr(probe, probe_name, lambda module: False)
    monkeypatch.setattr(hf_patch, "_name_experts_left", lambda model, report: None)
    torch.manual_seed(0)
    _, status = _run(model_type, calls, experts)
    assert status == f"experts ran without the op, nothing said: {experts_class}", status


def test_zero_experts_on_the_kernels():
    """LongCat-Flash's experts beside identity zero experts, patched, on fastlm's kernels (the
    op's routing over all ids, the zero experts' choices running no expert): output and the
    gradients of x, of every choice's weight (experts' and zero experts') and of the stacked
    weights match the family's own forward within fp32's tolerance."""
    config = tiny_config("longcat_flash", **WALK_CONFIGS["longcat_flash"], num_experts_per_tok=3)
    module = transformers.models.longcat_flash.modeling_longcat_flash.LongcatFlashExperts(config)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    unpatched = copy.deepcopy(module)
    found = probe.zero_experts_options(module)
    assert found == dict(transposed=False, activation="silu", interleaved=False), found
    hf_forwards.bind([module], "zero_experts", **found)
    tokens, total, routed = 11, module.gate_up_proj.shape[0], module.down_proj.shape[0]
    ids = torch.stack([torch.randperm(total)[:3] for _ in range(tokens)])
    ids[0] = torch.tensor([0, routed, 1])  # both kinds in one row, whatever the draw
    x = torch.randn(tokens, config.hidden_size)
    d_weights = _against_the_family(module, unpatched, x, ids, torch.rand(tokens, 3), True)
    assert ids.ge(routed).any() and d_weights[ids >= routed].abs().min() > 0


def _against_the_family(module, unpatched, x, ids, weights, on_op: bool) -> torch.Tensor:
    """The patched stacked experts `module` against the family's own copy, one forward and
    backward each: output and the gradients of x, the weights and both stacks within fp32's
    tolerance, `fastlm::moe_experts` run by the patched one iff `on_op`; its d weights."""
    grads = []
    for m in (module, unpatched):
        inputs = [t.clone().requires_grad_() for t in (x, weights)]
        with torch.autograd.profiler.profile() as profile:
            out = m(inputs[0], ids, inputs[1])
            out.backward(torch.randn_like(out, generator=torch.Generator().manual_seed(1)))
        grads.append([out, *(t.grad for t in inputs), m.gate_up_proj.grad, m.down_proj.grad])
        ran = {e.name for e in profile.function_events}
        assert ("fastlm::moe_experts" in ran) == (m is module and on_op), sorted(ran)
    for what, ours, theirs in zip(("out", "dx", "d weights", "d gate_up", "d down"), *grads):
        assert relative_error(ours, theirs) <= TOLERANCE[torch.float32], what
    return grads[0][2]


@pytest.mark.parametrize("limit", [math.inf, 3.0], ids=["unclamped", "clamped"])
def test_unclamped_experts_on_the_kernels(limit):
    """Step 3.7's experts, whose gate clamps after the activation, min(silu(gate), L) *
    clamp(up, -L, L), with L infinite on the layers a checkpoint does not clamp: patched, they
    run on fastlm's kernels while L is infinite (an id of E choosing no expert) and their own
    forward with a finite L (named in `left`); output and the gradients of x, the weights and
    the stacked projections match the family's forward within fp32's tolerance either way."""
    config = tiny_config("step3p5", **WALK_CONFIGS["step3p5"])
    module = transformers.models.step3p7.modeling_step3p7.Step3p7Experts(config, limit)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    unpatched = copy.deepcopy(module)
    report = hf_patch._Report()
    hf_patch._unclamped_experts(report, module, "their gate")
    assert ("Step3p7Experts" in report.left) == math.isfinite(limit), report.left
    experts, tokens = module.down_proj.shape[0], 11
    ids = torch.stack([torch.randperm(experts + 1)[:2] for _ in range(tokens)])
    ids[0] = torch.tensor([experts, 0])  # a dropped choice, whatever the draw
    x, weights = torch.randn(tokens, config.hidden_size), torch.rand(tokens, 2)
    _against_the_family(module, unpatched, x, ids, weights, math.isinf(limit))
