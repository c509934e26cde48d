"""fastlm.hf.patch on every causal-LM model type of the installed transformers: each one whose
tiny configuration builds is patched and run against its unpatched copy (eager attention) on a
plain batch, and counted where its attention ran through fastlm's attention with loss, logits
and every gradient within fastlm's fp32 tolerance. Every type that does not is a named,
understood limit (`LIMITS`, checked both ways: a type listed there that passes fails the test,
so the list stays true).

It runs on the PyTorch backend (FASTLM_BACKEND=torch: fastlm.hf's routing down to
`flash_attention`'s and `flash_attention_varlen`'s reference math, their calls counted) to fit
CI's time; tests/test_hf_families.py runs the families issue 28 names on the kernels. Run
`pytest tests/test_hf_all_models.py -s` to print the table.
"""

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_families import FAMILY_CONFIGS, MLA, VOCAB, tiny_model  # noqa: E402

from fastlm import hf  # noqa: E402
from fastlm.hf import attention as hf_attention  # noqa: E402
from fastlm.testing import TOLERANCE, relative_error  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

#: The phrases of the limits below.
OWN_ATTENTION = "no module calls transformers' attention interface"
BIDIRECTIONAL = "{'fastlm': 0, 'sdpa'"

#: model_type -> why it does not run attention on fastlm's kernels with parity (a phrase of
#: the failure it gives here). Types whose tiny config does not build are in NOT_BUILT.
#: - OWN_ATTENTION: the model computes attention in its own code (BLOOM's ALiBi, MPT, XGLM, the
#:   BERT-era decoders), has none (Mamba, RWKV, xLSTM, RecurrentGemma), or is a hybrid whose two
#:   tiny layers are both linear attention (Qwen3.5, Qwen4-exp, LFM3, Bailing);
#: - BIDIRECTIONAL: an encoder's config (is_decoder False): bidirectional attention, which
#:   fastlm's causal kernels do not run; it goes to SDPA with a warning;
#: - inkling_text: a relative position bias added to the scores (position_bias), which the
#:   kernels do not take: the family's eager attention runs it, with a warning;
#: - doge: its attention builds a dynamic mask from the 4-D mask tensor itself, which fastlm's
#:   mask function does not make: patch finds that on its first forward and leaves attention;
#: - xmod: needs set_default_language() (an adapter per language) before any forward.
LIMITS = {
    "bailing_hybrid": OWN_ATTENTION,
    "bert": BIDIRECTIONAL,
    "bert-generation": BIDIRECTIONAL,
    "big_bird": OWN_ATTENTION,
    "bigbird_pegasus": BIDIRECTIONAL,
    "bloom": OWN_ATTENTION,
    "camembert": BIDIRECTIONAL,
    "data2vec-text": BIDIRECTIONAL,
    "doge": "its forward fails on fastlm's attention",
    "electra": BIDIRECTIONAL,
    "ernie": BIDIRECTIONAL,
    "falcon_mamba": OWN_ATTENTION,
    "gpt_neox_japanese": OWN_ATTENTION,
    "inkling_text": "{'fastlm': 0, 'sdpa': 0}",
    "lfm3": OWN_ATTENTION,
    "mamba": OWN_ATTENTION,
    "megatron-bert": OWN_ATTENTION,
    "mpt": OWN_ATTENTION,
    "mvp": OWN_ATTENTION,
    "openai-gpt": OWN_ATTENTION,
    "qwen3_5_moe_text": OWN_ATTENTION,
    "qwen3_5_text": OWN_ATTENTION,
    "qwen4_exp_text": OWN_ATTENTION,
    "recurrent_gemma": OWN_ATTENTION,
    "rembert": OWN_ATTENTION,
    "roberta": BIDIRECTIONAL,
    "roberta-prelayernorm": BIDIRECTIONAL,
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

#: model_type -> why its tiny config (TINY's fields) does not build a model here: composite
#: configs (text and vision sub-configs: their sizes are not top-level fields), per-layer
#: configs, layer patterns validated against more than 2 layers, and size fields of other names.
NOT_BUILT = {
    "axk2": "a size field the tiny config misses",
    "bamba": "Class validation error",
    "blt": "a size field the tiny config misses",
    "cohere_compass_text": "KeyError: 'full_attention'",
    "cpmant": "a size field the tiny config misses",
    "dbrx": "AttributeError: 'DbrxAttentionConfig' object has no attribute 'rope_th",
    "deepseek_v32": "a size field the tiny config misses",
    "diffllama": "ValueError: DiffLlama requires `num_key_value_heads` to be even (and a",
    "dots3_note": "has no attribute 'pad_token_id'",
    "dots3_note_text": "per-layer attribute",
    "emu3": "has no attribute 'pad_token_id'",
    "falcon": "AttributeError: property 'head_dim' of 'FalconConfig' object has no se",
    "fuyu": "a size field the tiny config misses",
    "gemma3": "a size field the tiny config misses",
    "gemma3n": "ImportError: ",
    "gemma3n_text": "ValueError: The set of layer types producing a cache is different than",
    "gemma4": "a size field the tiny config misses",
    "gemma4_assistant": "Class validation error",
    "gemma4_text": "per-layer attribute",
    "gemma4_unified": "a size field the tiny config misses",
    "gemma4_unified_assistant": "a size field the tiny config misses",
    "gemma4_unified_text": "per-layer attribute",
    "git": "a size field the tiny config misses",
    "glm_moe_dsa": "a size field the tiny config misses",
    "got_ocr2": "a size field the tiny config misses",
    "gpt_neo": "Class validation error",
    "granitemoehybrid": "Class validation error",
    "hy_v4": "a size field the tiny config misses",
    "inkling2_loop_text": "a size field the tiny config misses",
    "inkling2_text": "a size field the tiny config misses",
    "kimi_linear": "a size field the tiny config misses",
    "lfm2_moe": "TypeError: 'NoneType' object is not subscriptable",
    "llama4": "has no attribute 'pad_token_id'",
    "longcat_flash": "a size field the tiny config misses",
    "mamba2": "Class validation error",
    "mllama": "a size field the tiny config misses",
    "moss_transcribe_diarize": "a size field the tiny config misses",
    "musicgen": "has no attribute 'dropout'",
    "musicgen_melody": "has no attribute 'dropout'",
    "phi4_multimodal": "a size field the tiny config misses",
    "prophetnet": "NotImplementedError: This model does not support the setting of `num_h",
    "qwen3_5": "has no attribute 'vocab_size'",
    "qwen3_5_moe": "has no attribute 'vocab_size'",
    "qwen4_exp": "has no attribute 'vocab_size'",
    "reformer": "AssertionError: If you want to use `ReformerModelWithLMHead` make sure",
    "roc_bert": "a size field the tiny config misses",
    "xlnet": "NotImplementedError: The model xlnet is one of the few models that has",
    "zamba": "Class validation error",
    "zamba2": "Class validation error",
    "zaya": "Class validation error",
}


def _causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


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


#: Types whose tiny config needs a field of its own (a rotary width, MLA's head dims).
WALK_CONFIGS = {
    "codegen": dict(rotary_dim=8),
    "gptj": dict(rotary_dim=8),
    **{name: dict(MLA) for name in ("axk1", "youtu", "glm4_moe_lite", "minicpm3", "sarvam_mla")},
}


def _build(model_type: str):
    """The type's tiny model, or why it does not build (its parameters counted on the meta
    device first: a config with a size field of another name is refused, not built big)."""
    try:
        config = transformers.CONFIG_MAPPING[model_type]()
        aliases = {name: value for name, value in ALIASES.items() if name in config.__dict__}
        aliases.update(WALK_CONFIGS.get(model_type, {}))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.device("meta"):
                count = sum(p.numel() for p in tiny_model(model_type, **aliases).parameters())
            if count > MAX_PARAMETERS:
                return f"ValueError: {count:,} parameters: a size field the tiny config misses"
            return tiny_model(model_type, **aliases)
    except Exception as error:  # noqa: BLE001 (the reason is what the test records)
        return f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"


def _worst(model, unpatched) -> tuple[float, str]:
    """The largest relative error of a parameter's gradient, its denominator floored at 1e-3 of
    the norm of all gradients: some are zero in exact arithmetic (a key projection's bias:
    softmax is shift-invariant), rounding noise on both sides."""
    theirs = dict(unpatched.named_parameters())
    worst, where = 0.0, ""
    grads = [p.grad.double().norm() for p in unpatched.parameters() if p.grad is not None]
    floor = 1e-3 * float(torch.stack(grads).norm()) if grads else 0.0
    for name, p in model.named_parameters():
        if (p.grad is None) != (theirs[name].grad is None):
            return float("inf"), f"gradient of {name} on one side only"
        if p.grad is not None:
            difference = float((p.grad.double() - theirs[name].grad.double()).norm())
            err = difference / max(float(theirs[name].grad.double().norm()), floor, 1e-30)
            if err > worst:
                worst, where = err, f"grad of {name}"
    return worst, where


def _run(model_type: str, calls: _AttentionCalls) -> str | None:
    """None when the type runs attention on fastlm's path with parity, else why not."""
    model = _build(model_type)
    if isinstance(model, str):
        return f"build: {model}"
    model.eval()  # no dropout: the two models draw no random masks
    unpatched = copy.deepcopy(model)
    ids = torch.randint(3, VOCAB, (2, 9))
    batch = dict(input_ids=ids, labels=ids.clone(), use_cache=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf.patch(model)
    except Exception as error:  # noqa: BLE001
        return f"patch: {type(error).__name__}: {error}"
    parts = model.fastlm_patched
    if "attention" not in parts:
        return f"attention left: {parts.left.get('attention', parts.left)}"
    before = dict(calls.counts)
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
        return f"run: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
    ran = {key: calls.counts[key] - before[key] for key in before}
    if ran["fastlm"] == 0 or ran["sdpa"]:
        return f"attention did not run on fastlm's path: {ran}"
    bound = TOLERANCE[torch.float32]
    for what, ours, theirs in (("loss", loss, expected), ("logits", logits, their_logits)):
        if relative_error(ours, theirs) > bound:
            return f"parity: {what} off by {relative_error(ours, theirs):.1e}"
    worst, where = _worst(model, unpatched)
    if worst > bound:
        return f"parity: {where} off by {worst:.1e}"
    return None


def test_every_causal_lm_type(monkeypatch, capsys):
    """Every causal-LM model type: on fastlm's attention with parity, or a named limit."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    calls = _AttentionCalls(monkeypatch)
    results = {}
    for model_type in _causal_lm_types():
        torch.manual_seed(0)
        results[model_type] = _run(model_type, calls)
    built = {t: r for t, r in results.items() if not (r or "").startswith("build: ")}
    passing = sorted(t for t, r in built.items() if r is None)
    with capsys.disabled():
        print(f"\n{len(passing)} of {len(built)} causal-LM types whose tiny config builds "
              f"({len(results)} in transformers {transformers.__version__}) run attention on "
              "fastlm's kernels with parity")  # fmt: skip
        for model_type, reason in sorted(results.items()):
            print(f"  {model_type}: {reason or 'ok'}")
    problems = []
    for model_type, reason in results.items():
        if reason is None:
            if model_type in LIMITS or model_type in NOT_BUILT:
                problems.append(f"{model_type} passes: remove it from LIMITS / NOT_BUILT")
        elif reason.startswith("build: "):
            if model_type not in NOT_BUILT or NOT_BUILT[model_type] not in reason:
                problems.append(f"{model_type} does not build, not in NOT_BUILT: {reason}")
        elif model_type not in LIMITS or LIMITS[model_type] not in reason:
            problems.append(f"{model_type} is no understood limit: {reason}")
    assert not problems, "\n".join(problems)
    assert set(FAMILY_CONFIGS) <= set(passing) | set(LIMITS)
