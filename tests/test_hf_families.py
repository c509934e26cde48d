"""fastlm.hf.patch on the families people fine-tune now, none of them named anywhere in fastlm:
each patched tiny model against its unpatched copy (eager attention) on a plain, a left-padded
and a padding-free batch, with the kernels (Triton's interpreter) and fastlm's attention op
calls counted, and what each patch leaves named with its reason.

Tiny random configurations built here (no download): 2 layers, hidden 32, 2 query heads sharing
1 key/value head; each family with its own features switched on (windows, sinks, chunked
attention, NoPE layers, partial rotary, logit scales, experts, hybrid layers).
"""

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf import BASE, _Ops  # noqa: E402
from test_hf import FAMILY_CONFIGS as TEN  # noqa: E402

from fastlm import hf  # noqa: E402
from fastlm.hf import attention as hf_attention  # noqa: E402
from fastlm.hf import forwards, probe  # noqa: E402
from fastlm.testing import TOLERANCE, LargestTensor, assert_close  # noqa: E402

VOCAB = 61
pytestmark = pytest.mark.usefixtures("one_thread")

#: Every config: tests/test_hf.py's tiny one, with the fields other families name.
TINY = dict(
    BASE,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=24,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    attention_dropout=0.0,
)
TWO_LAYER_TYPES = ["sliding_attention", "full_attention"]
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, rope_theta=1e4)
LLAMA3 = dict(YARN, rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0)
MLA = dict(
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=16, q_lora_rank=24,
    head_dim=8, num_key_value_heads=2,
    n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
)  # fmt: skip

#: model_type -> its features switched on.
FAMILY_CONFIGS = {
    # Today's ten, as tests/test_hf.py runs them in depth (the MoE auxiliary loss off: on a
    # padding-free batch the reference is each document alone, whose routing statistics differ).
    **{name: dict(config, output_router_logits=False) for name, config in TEN.items()},
    # Gemma 3's soft caps (off by default), beside test_hf.py's windows and local RoPE base.
    "gemma3_text": dict(
        TEN["gemma3_text"], attn_logit_softcapping=5.0, final_logit_softcapping=3.0
    ),
    # The families issue 28 names.
    "gpt_oss": dict(sliding_window=6, layer_types=TWO_LAYER_TYPES, rope_parameters=YARN),
    "deepseek_v2": dict(MLA),
    "deepseek_v3": dict(MLA, rope_interleave=True),
    "smollm3": dict(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=6),
    "olmo": dict(clip_qkv=8.0),
    "olmo2": dict(),
    "olmo3": dict(sliding_window=6, layer_types=TWO_LAYER_TYPES),
    "glm": dict(partial_rotary_factor=0.5),
    "glm4": dict(partial_rotary_factor=0.5),
    "glm4_moe": dict(
        partial_rotary_factor=0.5,
        first_k_dense_replace=1,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        use_qk_norm=True,
    ),  # fmt: skip
    "granite": dict(
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=4.0,
    ),  # fmt: skip
    "granitemoe": dict(
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=4.0,
    ),  # fmt: skip
    "cohere": dict(logit_scale=0.5, use_qk_norm=False),
    "cohere2": dict(logit_scale=0.5, sliding_window=6, layer_types=TWO_LAYER_TYPES),
    "exaone4": dict(sliding_window=6, layer_types=TWO_LAYER_TYPES),
    # Every switch of Llama4TextConfig on but two: router jitter (random noise) and
    # attention_bias (the NoPE layer's key bias adds a constant to each query's scores: its
    # gradient is 0, rounding alone compared).
    "llama4_text": dict(
        attention_chunk_size=4,
        no_rope_layers=[1, 0],
        interleave_moe_layer_step=2,
        intermediate_size_mlp=48,
        use_qk_norm=True,
        attn_temperature_tuning=True,  # on the NoPE layer; floor_scale 4: on from token 3
        floor_scale=4,
        attn_scale=0.5,
        rope_parameters=LLAMA3,
    ),  # fmt: skip
    "ernie4_5": dict(),
    "ernie4_5_moe": dict(moe_layer_start_index=1, moe_num_shared_experts=1),
    "apertus": dict(rope_parameters=LLAMA3),
    "arcee": dict(),
    # (residual_dropout, 0.1 by default: its MLP is left, test_the_probe_is_not_fooled_...)
    "seed_oss": dict(residual_dropout=0.0, attention_bias=True, attention_out_bias=True),
    "hunyuan_v1_dense": dict(),
    "hunyuan_v1_moe": dict(),
    "ministral": dict(sliding_window=6, layer_types=TWO_LAYER_TYPES),
    "starcoder2": dict(sliding_window=6, residual_dropout=0.0, embedding_dropout=0.0),
    "stablelm": dict(partial_rotary_factor=0.5, use_qkv_bias=True, qk_layernorm=True),
    "helium": dict(),
    "nemotron": dict(partial_rotary_factor=0.5),
    "phi": dict(partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0),
    "bitnet": dict(),
    "minimax": dict(layer_types=["linear_attention", "full_attention"], block_size=4),
    "dots1": dict(first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1),
    "olmoe": dict(),
    "qwen3_next": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
    ),  # fmt: skip
    "jamba": dict(
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        use_mamba_kernels=False,
        mamba_d_state=8,
        mamba_dt_rank=4,
    ),  # fmt: skip
    "lfm2": dict(layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False),
    # Nemotron-H: a Mamba-2 layer, a MoE layer of non-gated ReLU² experts (has_gate=False) beside
    # a shared ReLU² MLP, an attention layer.
    "nemotron_h": dict(
        layers_block_type=["linear_attention", "moe", "full_attention"],
        mamba_num_heads=4,
        mamba_head_dim=8,
        ssm_state_size=8,
        n_groups=1,
        chunk_size=4,
        head_dim=16,
        intermediate_size=48,
        moe_shared_expert_intermediate_size=24,
    ),  # fmt: skip
    # Gemma 4: sliding and global layers with their own head dims (16 and 32; the real global
    # layers' 512, which the kernels take, is tested in test_attention.py), key/value heads
    # (1 and 2) and RoPE
    # (proportional, a quarter rotary on the global layers), per-layer input embeddings, the
    # last layer reusing the global layer's keys and values (with a double-wide MLP), keys as
    # values on the global layers, the MoE block beside the MLP, a final logit cap.
    "gemma4_text": dict(
        num_hidden_layers=3,
        layer_types=[*TWO_LAYER_TYPES, "full_attention"],
        sliding_window=6,
        global_head_dim=32,
        num_global_key_value_heads=2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=1,
        use_double_wide_mlp=True,
        attention_k_eq_v=True,
        enable_moe_block=True,
        top_k_experts=2,
        final_logit_softcapping=3.0,
    ),  # fmt: skip
}


def tiny_config(model_type: str, **changes):
    """The model type's config with TINY's fields (those it has) and `changes`."""
    config_class = transformers.CONFIG_MAPPING[model_type]
    default = config_class()
    fields = {name: value for name, value in TINY.items() if has_field(default, name)}
    return config_class(**{**fields, **changes})


def has_field(config, name: str) -> bool:
    """Whether the config has the field, model-wide or per layer (per-layer fields, Gemma 4's
    head_dim, raise when read from the model's config), and it can be set (Falcon's head_dim is
    a property computed from the others)."""
    computed = getattr(type(config), name, None)
    if isinstance(computed, property) and computed.fset is None:
        return False
    return name in (getattr(config, "per_layer_attributes", None) or ()) or hasattr(config, name)


def tiny_model(model_type: str, model_class=None, **changes):
    """A random causal LM of the type (its causal-LM class, or `model_class`), every parameter
    perturbed (norm weights, biases), in training mode, with eager attention."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    changes = {**FAMILY_CONFIGS.get(model_type, {}), **changes}
    if model_class is None:
        model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    model = model_class(tiny_config(model_type, **changes))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.set_attn_implementation("eager")
    return model.train()


#: What patch leaves as it is in each family, and why (its warning and `fastlm_patched.left`
#: say so): the understood limits. Every other part runs on the kernels.
LEFT = {
    "olmo": {"OlmoLayerNorm": "no weight"},
    "cohere": {"CohereLayerNorm": "not RMSNorm's math"},
    "cohere2": {"Cohere2LayerNorm": "not RMSNorm's math"},
    "apertus": {"ApertusMLP": "XIELUActivation"},
    "arcee": {"ArceeMLP": "ReLUSquaredActivation"},
    "starcoder2": {"LayerNorm": "bias, weight", "Starcoder2MLP": "not down"},
    "stablelm": {"LayerNorm": "not RMSNorm's math"},
    "nemotron": {"NemotronLayerNorm1P": "bias, weight", "NemotronMLP": "ReLUSquared"},
    "phi": {"LayerNorm": "bias, weight", "PhiMLP": "not down"},
    "bitnet": {"BitNetMLP": "ReLUSquaredActivation"},
    "minimax": {"MiniMaxLightningAttention": "does not call transformers' attention"},
    "qwen3_next": {
        "Qwen3NextRMSNormGated": "a gated norm",
        "Qwen3NextGatedDeltaNet": "does not call transformers' attention",
    },
    "jamba": {"JambaMambaMixer": "does not call transformers' attention"},
    "nemotron_h": {
        "NemotronHRMSNormGated": "a gated norm",
        "NemotronHMLP": "ReLUSquaredActivation",
        "NemotronHMamba2Mixer": "does not call transformers' attention",
        "cross_entropy": "not lm_head(hidden) times a number",
    },
}

#: Batches a family's own (unpatched) code cannot run on the CPU, and why.
NO_BATCH = {
    "qwen3_next": {
        name: "its gated delta rule keeps packed documents apart only with "
        "flash-linear-attention (a CUDA package)"
        for name in ("padding-free", "position_ids")
    }
}


def _batches():
    """A plain batch, a left-padded one (labels -100 on the padding and on each row's first
    real token, which a padding position would predict), a padding-free one as
    DataCollatorWithFlattening builds it (cu_seq_lens_q/k, position_ids) and the same by its
    restarting position_ids alone (transformers finds the documents; some families' layers do
    not pass position_ids on to the attention: Llama 4's)."""
    ids = torch.randint(3, VOCAB, (2, 11))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 3] = -100
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    docs = [{"input_ids": torch.randint(3, VOCAB, (n,)).tolist()} for n in (9, 1, 12, 4)]
    flattened = collate(docs)
    positions = {k: flattened[k] for k in ("input_ids", "labels", "position_ids")}
    return {
        "plain": dict(input_ids=ids, labels=ids.clone(), use_cache=False),
        "left-padded": dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False),
        "padding-free": dict(flattened, use_cache=False),
        "position_ids": dict(positions, use_cache=False),
    }


#: fastlm's attention ops: one call per attention layer forward, one backward.
ATTENTION_OPS = ("flash_attention", "flash_attention_varlen")
#: Families whose experts run on fastlm.moe_experts, forward and backward: those of transformers'
#: experts interface (gpt-oss's with its clamped, interleaved, biased gate; Nemotron-H's
#: non-gated ReLU²) and Llama 4's block, which scales each token's input by its router score.
EXPERTS_ON_THE_OP = {
    "mixtral", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3", "glm4_moe", "granitemoe",
    "llama4_text", "ernie4_5_moe", "hunyuan_v1_moe", "minimax", "dots1", "olmoe", "qwen3_next",
    "jamba", "gemma4_text", "nemotron_h",
}  # fmt: skip


def patched_copy(model):
    """(patch(model), the warnings it gave), the model's unpatched copy kept first."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf.patch(model)
    return [str(w.message) for w in caught if "fastlm.hf.patch" in str(w.message)]


def assert_left_as_understood(model, family, messages):
    """What patch left is exactly the family's LEFT entries, each with its reason, and one
    warning for each."""
    left = model.fastlm_patched.left
    expected = LEFT.get(family, {})
    assert set(left) == set(expected), left
    for what, why in expected.items():
        assert why in left[what], (what, left[what])
    assert len(messages) == len(left), messages
    for what in left:
        assert any(f"left unpatched: {what} (" in m for m in messages), (what, messages)


def _documents(batch):
    """The documents of a padding-free batch, each as the batch of one row it stands for."""
    bounds = batch["cu_seq_lens_q"].tolist()
    for start, end in zip(bounds, bounds[1:]):
        row = {k: batch[k][:, start:end] for k in ("input_ids", "labels") if k in batch}
        yield dict(row, use_cache=False)


#: Families whose unpatched eager attention attends across the documents of a padding-free row
#: (cu_seq_lens): their reference is each document alone. (Hybrids must not: their recurrent and
#: convolution layers, untouched by patch, run across the row in both models.)
PER_DOCUMENT = {"gpt_oss": "its eager attention reads no cu_seq_lens and no packed position_ids"}


def _per_document(unpatched, batch) -> bool:
    return "cu_seq_lens_q" in batch and unpatched.config.model_type in PER_DOCUMENT


def _unpatched_loss(unpatched, batch):
    """The unpatched model's loss; on a padding-free batch of a PER_DOCUMENT family, the mean
    over all counted tokens of its loss on each document alone (what padding-free training
    means)."""
    if not _per_document(unpatched, batch):
        return unpatched(**batch).loss
    total, count = 0.0, 0
    for document in _documents(batch):
        counted = int((document["labels"][:, 1:] != -100).sum())
        if counted:
            total = total + unpatched(**document).loss * counted
            count += counted
    return total / count


def _unpatched_logits(unpatched, inputs):
    if not _per_document(unpatched, inputs):
        return unpatched(**inputs).logits
    return torch.cat([unpatched(**d).logits for d in _documents(inputs)], dim=1)


def worst_gradient_error(model, unpatched) -> tuple[float, str]:
    """The largest relative error of a parameter's gradient (and which), its denominator floored
    at 1e-3 of the norm of all gradients: some are zero in exact arithmetic (a key projection's
    bias: softmax is shift-invariant) or nearly so by cancellation (Qwen3-Next's dt_bias, 1e-5
    of the norm of all), and their rounding error is of the scale of the terms that cancel, not
    of their own: rounding noise on both sides. inf for a gradient on one side only or not
    finite."""
    theirs = dict(unpatched.named_parameters())
    worst, where = 0.0, ""
    grads = [p.grad.double().norm() for p in unpatched.parameters() if p.grad is not None]
    floor = 1e-3 * float(torch.stack(grads).norm()) if grads else 0.0
    for name, p in model.named_parameters():
        if (p.grad is None) != (theirs[name].grad is None):
            return float("inf"), f"gradient of {name} on one side only"
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            return float("inf"), f"grad of {name} not finite"
        if p.grad is not None:
            difference = float((p.grad.double() - theirs[name].grad.double()).norm())
            err = difference / max(float(theirs[name].grad.double().norm()), floor, 1e-30)
            if err > worst:
                worst, where = err, f"grad of {name}"
    return worst, where


def assert_matches(model, unpatched, batch, what):
    """Loss, logits (real tokens) and every gradient of the patched model against its
    unpatched copy, within fastlm's fp32 tolerance (the gradients by `worst_gradient_error`);
    returns the op calls of the patched model's training step."""
    for m in (model, unpatched):
        m.zero_grad(set_to_none=True)
    with _Ops() as calls:
        loss = model(**batch).loss
        loss.backward()
    expected = _unpatched_loss(unpatched, batch)
    expected.backward()
    assert_close(loss, expected, torch.float32, f"{what}: loss")
    worst, where = worst_gradient_error(model, unpatched)
    assert worst <= TOLERANCE[torch.float32], f"{what}: {where}: relative error {worst:.3e}"
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        logits, their_logits = model(**inputs).logits, _unpatched_logits(unpatched, inputs)
    real = inputs.get("attention_mask", torch.ones(logits.shape[:2])).bool()
    assert_close(logits[real], their_logits[real], torch.float32, f"{what}: logits")
    return calls


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_family_patched_matches_unpatched(family):
    """The family on the kernels, on a plain, a left-padded and a padding-free batch: loss,
    logits and every gradient as its unpatched copy's (eager attention; gpt-oss's padding-free
    batch each document alone through it); each attention layer
    ran fastlm's attention op once forward and its backward once, no SDPA, no eager softmax
    over keys; a patched RoPE ran fastlm's op (DeepSeek-V2's and Llama 4's complex freqs_cis
    too); what was left is the family's named limit."""
    model = tiny_model(family)
    unpatched = copy.deepcopy(model)
    messages = patched_copy(model)
    assert_left_as_understood(model, family, messages)
    layers = model.fastlm_patched.modules.get("attention", 0)
    assert layers > 0 and "attention" in model.fastlm_patched
    for name, batch in _batches().items():
        if name in NO_BATCH.get(family, {}):
            continue
        calls = assert_matches(model, unpatched, batch, f"{family}, {name} batch")
        assert sum(calls.calls[op] for op in ATTENTION_OPS) == layers, calls.calls
        assert sum(calls.calls[f"{op}_backward"] for op in ATTENTION_OPS) == layers, calls.calls
        assert not {"sdpa", "softmax over keys"} & calls.names, calls.calls
        if "rope" in model.fastlm_patched:  # found a layout: no family code rotates instead
            assert calls.calls["rope"] > 0, calls.calls
        if family in EXPERTS_ON_THE_OP:
            assert "moe_experts" in model.fastlm_patched
            assert calls.calls["moe_experts"] > 0, calls.calls
            assert calls.calls["moe_experts_backward"] > 0, calls.calls


def test_layers_of_a_head_dim_the_kernel_does_not_take(monkeypatch):
    """Gemma 4's global layers with a head dim of their own that fastlm's kernel does not take
    (20, not a multiple of 8; the real model's 512 the kernels take), its
    sliding layers at 16: patch reads each layer's head dim from the layer (never the config's
    ambiguous global one), runs the sliding layer on the kernel and names the global layers it
    leaves, which run SDPA; loss and every gradient as the unpatched copy's."""
    model = tiny_model(
        "gemma4_text",
        num_hidden_layers=2,
        layer_types=TWO_LAYER_TYPES,
        global_head_dim=20,
        num_kv_shared_layers=0,
        enable_moe_block=False,
        hidden_size_per_layer_input=0,
    )  # fmt: skip
    unpatched = copy.deepcopy(model)
    monkeypatch.setattr(hf_attention, "_warned", set())  # its fallback warns once per process
    messages = patched_copy(model)
    left = model.fastlm_patched.left
    assert list(left) == ["attention of layers 1"], left
    assert "head_dim 20" in left["attention of layers 1"]
    assert len(messages) == 1 and model.fastlm_patched.modules["attention"] == 1
    with pytest.warns(UserWarning, match="head dim 20"):
        calls = assert_matches(model, unpatched, _batches()["plain"], "head dim 20")
    assert calls.calls["flash_attention"] == 1 and calls.calls["sdpa"] == 1, calls.calls


class _Memory(LargestTensor):
    """Allocation accounting of one training step: the bytes autograd saves for the backward
    (each storage once) and, as LargestTensor, the largest tensor any op makes, forward and
    backward."""

    def __init__(self):
        super().__init__()
        self.saved: dict[int, int] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        self.saved[storage.data_ptr()] = storage.nbytes()
        return t

    def step(self, model, tokens: int) -> "_Memory":
        ids = torch.randint(3, VOCAB, (1, tokens))
        with self, torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        return self


def test_fp32_heads_past_the_kernels_fp32_limit_run_sdpa(monkeypatch):
    """fp32 heads of 264 dims (the kernels take 16-bit heads to 512 but fp32 ones to 256: a
    Gemma 4 global layer run in fp32): the layer runs SDPA, saying why, and gives causal
    grouped-query attention's output (float64 math)."""
    monkeypatch.setattr(hf_attention, "_warned", set())
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    q, k, v = (torch.randn(1, h, 5, 264) for h in (2, 1, 1))
    with pytest.warns(UserWarning, match="fp32 head dim 264 .* runs transformers' SDPA"):
        out, _ = hf_attention.fastlm_attention(module, q, k, v, None, scaling=0.1)
    scores = 0.1 * q.double() @ k.double().transpose(-1, -2)  # (1, 2, 5, 5)
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    expected = (scores.softmax(-1) @ v.double()).transpose(1, 2)  # (1, 5, 2, 264)
    assert_close(out, expected, torch.float32, "fp32 head dim 264 on SDPA")


def test_gpt_oss_layer_memory_is_linear_in_tokens():
    """A gpt-oss layer (4 query heads, sinks, full attention) training on T and 4T tokens: the
    patched model's saved bytes and largest tensor grow at most 4x (linear), and no tensor
    holds T x T scores; its unpatched eager copy saves one (B, Hq, T, T + 1) fp32 softmax per
    layer: 4 Hq T (T + 1) bytes, the quadratic term docs/huggingface-families.md prices at
    gpt-oss-20b's sizes."""
    model = tiny_model(
        "gpt_oss", num_hidden_layers=1, layer_types=["full_attention"], num_attention_heads=4
    )
    unpatched = copy.deepcopy(model)
    patched_copy(model)
    ours = {t: _Memory().step(model, t) for t in (64, 256)}
    assert sum(ours[256].saved.values()) <= 4 * sum(ours[64].saved.values()), ours
    assert ours[256].largest <= 4 * ours[64].largest
    assert ours[256].largest < 4 * 256 * 256  # no (Hq, T, T) scores
    theirs = {t: sum(_Memory().step(unpatched, t).saved.values()) for t in (64, 128, 256)}
    # saved = a + b T + c T^2: the quadratic coefficient from three sizes is 4 bytes x 4 heads.
    c = ((theirs[256] - theirs[128]) / 128 - (theirs[128] - theirs[64]) / 64) / (256 - 64)
    assert c == pytest.approx(4 * 4, rel=1e-6), theirs


def test_a_biased_head_with_a_logit_scale(monkeypatch):
    """The fused loss of a head with a bias (Phi's) under a logit divisor (Granite's): the bias
    is one more weight column against a column of ones, scaled as the logits are; loss and
    every gradient as the unpatched model's."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    model = tiny_model("granite", tie_word_embeddings=False)
    head = model.lm_head
    model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        model.lm_head.weight.copy_(head.weight)
        model.lm_head.bias.normal_()
    unpatched = copy.deepcopy(model)
    assert patched_copy(model) == [] and "cross_entropy" in model.fastlm_patched
    assert_matches(model, unpatched, _batches()["left-padded"], "biased head")


class _ClampedMLP(torch.nn.Module):
    """DeepSeek-V4's dense MLP: SiLU of the gate clamped above, up clamped on both sides, the
    limit kept under `limit_name`."""

    def __init__(self, limit: float, limit_name: str = "swiglu_limit"):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16)
        self.down_proj = torch.nn.Linear(16, 8)
        self.act_fn = torch.nn.SiLU()
        self.limit_name = limit_name
        setattr(self, limit_name, limit)

    def forward(self, x):
        limit = getattr(self, self.limit_name)
        gate = self.gate_proj(x).clamp(max=limit)
        up = self.up_proj(x).clamp(min=-limit, max=limit)
        return self.down_proj(self.act_fn(gate) * up)


class _ClampedExperts(torch.nn.Module):
    """An experts' gate clamped at a bound the probe has no name for."""

    act_fn = torch.nn.SiLU()
    bound = 7.0

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=self.bound)) * up.clamp(-self.bound, self.bound)


def test_non_gated_experts_of_another_activation_are_left():
    """Nemotron-H's non-gated experts run on the op only with ReLU² (the probe runs their act_fn
    against it): with SiLU (a config's `mlp_hidden_act`) they are left, with the reason."""
    model = tiny_model("nemotron_h", mlp_hidden_act="silu")
    patched_copy(model)
    assert "moe_experts" not in model.fastlm_patched
    assert "without a gate (ReLU²)" in model.fastlm_patched.left["NemotronHExperts"]


def test_an_experts_block_runs_on_the_op_only_if_it_scales_the_input():
    """Llama 4's block (the token scaled by its router score before its experts) is found by
    what it computes; the same block weighting its experts' outputs instead, a formula the
    input-scaled forward does not compute, is left with the reason."""
    model = tiny_model("llama4_text")
    block = next(m for m in model.modules() if type(m).__name__ == "Llama4TextMoe")
    options = probe.input_scaled_experts_options(block)
    assert options == dict(transposed=True, activation="silu", shared="shared_expert")

    class OutputWeighted(type(block)):
        def forward(self, hidden_states):
            x = hidden_states.reshape(-1, self.hidden_dim)
            scores, logits = self.router(x)  # (T, E), 0 outside the top k
            routed = self.experts(x.repeat(self.num_experts, 1)).view(self.num_experts, *x.shape)
            return self.shared_expert(x) + (routed * scores.T[..., None]).sum(0), logits

    block.__class__ = OutputWeighted
    assert probe.input_scaled_experts_candidate(block)
    assert "not sum_j down_e" in probe.input_scaled_experts_options(block)


def test_a_clamp_runs_on_the_kernel_or_is_left_never_dropped():
    """A clamped MLP whose limit the probe reads (DeepSeek-V4's `swiglu_limit`: the first
    probe scale's projections never reach it) runs with swiglu's clamp, equal to its own forward
    where the clamp acts, also after its limit is changed (read on every call); one that keeps
    its limit under another name, and experts clamping at a bound of their own, are left as
    they are: never patched as a plain SwiGLU."""
    module = _ClampedMLP(7.0)
    kind, options = probe.mlp_options(module)
    assert kind == "mlp" and options["activation"] == "silu"
    assert (options["limit_name"], options["alpha_name"], options["up_offset"]) == (
        "swiglu_limit", None, 0.0
    )  # fmt: skip
    x = 20 * torch.randn(3, 5, 8)  # projections well past the limit
    for limit in (7.0, 3.0):  # the limit read on every call, as the module's forward reads it
        module.swiglu_limit = limit
        ours = forwards.mlp_forward(module, x, **options)
        with torch.no_grad():
            truth = copy.deepcopy(module).double()(x.double())
        assert_close(ours, truth, torch.float32, f"clamped MLP, limit {limit}")
    assert isinstance(probe.mlp_options(_ClampedMLP(7.0, limit_name="bound")), str)
    assert isinstance(probe.experts_gate_options(_ClampedExperts()), str)


class _ScaledMLP(torch.nn.Module):
    """A gated SiLU MLP with a trainable output scale, initialised to 1."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16)
        self.down_proj = torch.nn.Linear(16, 8)
        self.act_fn = torch.nn.SiLU()
        self.scale = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * self.scale


class _GeluMLP(torch.nn.Module):
    """A GELU MLP calling F.gelu itself, its down projection initialised to zero."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16)
        self.down_proj = torch.nn.Linear(16, 8)
        torch.nn.init.zeros_(self.down_proj.weight)
        torch.nn.init.zeros_(self.down_proj.bias)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.gelu(self.gate_proj(x)) * self.up_proj(x))


class _ScaledExperts(torch.nn.Module):
    """Experts whose gate reads a trainable scale of the gate, initialised to 1."""

    act_fn = torch.nn.SiLU()

    def __init__(self):
        super().__init__()
        self.gate_scale = torch.nn.Parameter(torch.ones(()))

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate * self.gate_scale) * up


def test_the_probe_is_not_fooled_by_values_special_at_patch_time():
    """Modules built to fool a probe that runs them as they are at patch time, in eval mode: an
    output scale at 1 and experts' gate scale at 1 (parameters fastlm's forward would not read:
    left), a GELU MLP whose down projection is 0 (every formula gives 0: found as GELU on
    random parameters, not as the first candidate, SiLU), and Seed-OSS's MLP with its residual
    dropout, patched in eval mode (dropout is what it computes in training: left). Each check
    leaves the module's mode and the global random state as they were."""
    assert "scale besides its linear layers" in probe.mlp_options(_ScaledMLP())
    assert "given none of their weights" in probe.experts_gate_options(_ScaledExperts())
    assert probe.mlp_options(_GeluMLP()) == (
        "mlp", dict(gate="gate_proj", up="up_proj", down="down_proj", activation="none")
    )  # fmt: skip
    from transformers.models.seed_oss.modeling_seed_oss import SeedOssMLP

    config = tiny_config("seed_oss", residual_dropout=0.1)
    mlp = SeedOssMLP(config).eval()
    rng = torch.get_rng_state()
    assert "not down(act(gate(x)) * up(x))" in probe.mlp_options(mlp)
    assert not mlp.training and torch.equal(torch.get_rng_state(), rng)
    assert probe.mlp_options(SeedOssMLP(tiny_config("seed_oss", residual_dropout=0.0)))[0] == "mlp"


def test_logit_numbers_changed_after_patch_are_read_as_the_family_reads_them(monkeypatch):
    """Gemma 2's final soft cap changed (and switched off) on the config after patch, and
    Cohere's logit scale, which its model copies from the config, changed on the model: the
    patched forward reads each number where and when the family's own does, so loss, logits and
    every gradient stay the unpatched model's."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    batch = _batches()["plain"]
    for family, holder, name, values in (
        ("gemma2", "config", "final_logit_softcapping", (1.0, None)),
        ("cohere", "model", "logit_scale", (2.5,)),
    ):
        model = tiny_model(family)
        unpatched = copy.deepcopy(model)
        patched_copy(model)
        for value in values:
            for m in (model, unpatched):
                setattr(m.config if holder == "config" else m, name, value)
            assert_matches(model, unpatched, batch, f"{family}, {name} {value} after patch")
