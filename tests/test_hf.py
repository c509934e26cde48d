"""fastlm.hf: Hugging Face Llama, Mistral and Qwen2 models patched onto fastlm's kernels, and
weights converted to and from fastlm.Transformer. Tiny random configurations built here (no
download); the unpatched model in float64 is the ground truth."""

import copy
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

import fastlm  # noqa: E402
from fastlm import hf  # noqa: E402
from fastlm.testing import assert_close, relative_error  # noqa: E402

VOCAB = 61
FAMILIES = ["llama", "mistral", "qwen2"]

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(family: str, **changes):
    """hidden 64, 2 layers, 4 query heads sharing 2 key/value heads of 16 dims."""
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=500.0,
    )
    if family != "llama":
        fields["sliding_window"] = None
    fields.update(changes)
    name = hf.FAMILIES[family][0].replace("ForCausalLM", "Config")
    return getattr(transformers, name)(**fields)


def _model(family: str, **changes):
    """A random model whose every parameter (norm weights and Qwen2's q/k/v biases too) is
    perturbed, so that a part read wrongly shows."""
    model = getattr(transformers, hf.FAMILIES[family][0])(_config(family, **changes))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.train()


def _tokens(batch=2, seq=21):
    return torch.randint(0, VOCAB, (batch, seq))


def _labels(ids):
    labels = ids.clone()
    labels[0, :4] = -100
    labels[1, -3:] = -100
    return labels


class _FastlmOps(TorchDispatchMode):
    """The names of the torch.ops.fastlm ops that ran."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fastlm":
            self.names.add(func._schema.name.split("::")[1])
        return func(*args, **(kwargs or {}))


def _assert_grads_match(model, truth, dtype, what):
    truth_params = dict(truth.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{what}: no gradient for {name}"
        assert_close(p.grad, truth_params[name].grad, dtype, f"{what}: grad of {name}")


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_matches_unpatched(family, autocast):
    """Loss, every parameter's gradient and the logits of the patched model against the
    unpatched one in float64; every kernel ran."""
    model = _model(family)
    truth = copy.deepcopy(model).double()
    unpatched = copy.deepcopy(model)
    assert hf.patch(model) is model
    assert model.fastlm_patched == ("rms_norm", "swiglu", "rope", "attention", "cross_entropy")
    ids = _tokens()
    labels = _labels(ids)
    dtype = torch.bfloat16 if autocast else torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), _FastlmOps() as ops:
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
    assert out.logits is None  # training with labels: no logits were made
    expected = truth(input_ids=ids, labels=labels)
    expected.loss.backward()
    assert out.loss.dtype == torch.float32
    assert_close(out.loss, expected.loss, dtype, f"{family} loss")
    if not autocast:
        _assert_grads_match(model, truth, dtype, family)
    else:
        # Flash-attention's rule: within twice the error of Hugging Face's own model under the
        # same autocast. A fixed bf16 bound does not fit every gradient: k_proj.bias's nearly
        # cancels (a bias on every key barely moves the softmax), and Hugging Face's own bf16
        # gradient of it can be 5% off.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            unpatched(input_ids=ids, labels=labels).loss.backward()
        theirs, ours = dict(unpatched.named_parameters()), dict(model.named_parameters())
        for name, p in truth.named_parameters():
            assert ours[name].grad is not None, name
            err = relative_error(ours[name].grad, p.grad)
            their_err = relative_error(theirs[name].grad, p.grad)
            assert err <= max(2 * their_err, 1e-4), (name, err, their_err)
    assert {"rms_norm", "rope_", "flash_attention", "swiglu", "linear_cross_entropy"} <= ops.names
    model.eval()
    truth.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits
        evaluated = model(input_ids=ids, labels=labels)  # eval mode: logits and loss
    assert_close(logits, truth(input_ids=ids).logits, dtype, f"{family} logits")
    assert_close(evaluated.logits, logits, dtype, f"{family} eval logits")
    assert_close(evaluated.loss, expected.loss, dtype, f"{family} eval loss")


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_gives_the_same_tokens(family):
    model = _model(family).eval()
    unpatched = copy.deepcopy(model)
    hf.patch(model)
    prompt = _tokens(batch=1, seq=7)
    with torch.no_grad(), _FastlmOps() as ops:
        tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)
    expected = unpatched.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(tokens, expected), (tokens, expected)
    assert tokens.shape == (1, 15) and "flash_attention" in ops.names


def test_num_items_in_batch_and_shift_labels_as_transformers():
    """Gradient accumulation: the loss is the sum over the micro-batch over num_items_in_batch;
    shift_labels, when given, replace the shift of labels."""
    model = _model("llama")
    truth = copy.deepcopy(model).double()
    hf.patch(model)
    ids = _tokens()
    labels = _labels(ids)
    items = torch.tensor(57)
    loss = model(input_ids=ids, labels=labels, num_items_in_batch=items).loss
    expected = truth(input_ids=ids, labels=labels, num_items_in_batch=items).loss
    assert_close(loss, expected, torch.float32, "loss over num_items_in_batch")
    loss.backward()
    expected.backward()
    _assert_grads_match(model, truth, torch.float32, "num_items_in_batch")
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    assert_close(
        model(input_ids=ids, shift_labels=shifted).loss, loss * 57 / (shifted != -100).sum(),
        torch.float32, "shift_labels",
    )  # fmt: skip
    assert model(input_ids=ids, labels=labels, return_dict=False)[0].shape == ()


def test_masks_flash_attention_does_not_take_fall_back_to_sdpa():
    """A padded batch, and a sliding window shorter than the sequence: the patched model gives
    the unpatched model's logits (those calls run PyTorch's SDPA)."""
    model = _model("llama").eval()
    truth = copy.deepcopy(model).double()
    hf.patch(model)
    ids = _tokens()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        expected = truth(input_ids=ids, attention_mask=mask).logits
    assert_close(logits[mask.bool()], expected[mask.bool()], torch.float32, "padded logits")
    windowed = _model("mistral", sliding_window=8).eval()
    truth = copy.deepcopy(windowed).double()
    hf.patch(windowed)
    with torch.no_grad():
        logits = windowed(input_ids=ids).logits
    assert_close(logits, truth(input_ids=ids).logits, torch.float32, "sliding-window logits")


def test_llama_with_biases_patches_and_does_not_convert():
    """attention_bias and mlp_bias: the patched forwards call the projections (biases
    included); fastlm.Transformer has no biases, so from_hf names them."""
    model = _model("llama", attention_bias=True, mlp_bias=True)
    truth = copy.deepcopy(model).double()
    hf.patch(model)
    ids = _tokens()
    loss = model(input_ids=ids, labels=_labels(ids)).loss
    expected = truth(input_ids=ids, labels=_labels(ids)).loss
    assert_close(loss, expected, torch.float32, "loss with biases")
    loss.backward()
    expected.backward()
    _assert_grads_match(model, truth, torch.float32, "biases")
    with pytest.raises(ValueError, match=r"nonzero biases \(.*and \d+ more; fastlm"):
        hf.from_hf(model)


def test_rope_scaling_runs_on_hugging_faces_tables():
    """The kernel rotates by the rotary embedding's own cos/sin: linear scaling (and any other
    rope type of the family) gives the unpatched logits; from_hf refuses it."""
    scaled = dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0})
    model = _model("llama", **scaled).eval()
    truth = copy.deepcopy(model).double()
    hf.patch(model)
    ids = _tokens()
    with torch.no_grad():
        assert_close(
            model(input_ids=ids).logits, truth(input_ids=ids).logits, torch.float32, "logits"
        )
    with pytest.raises(ValueError, match="rope type 'linear'"):
        hf.from_hf(model)


def test_gradient_checkpointing_composes():
    model = _model("qwen2")
    truth = copy.deepcopy(model).double()
    hf.patch(model)
    enable = getattr(model, "activation_checkpointing_enable", None)  # the newer name
    (enable or model.gradient_checkpointing_enable)()
    ids = _tokens()
    loss = model(input_ids=ids, labels=_labels(ids)).loss
    loss.backward()
    truth(input_ids=ids, labels=_labels(ids)).loss.backward()
    _assert_grads_match(model, truth, torch.float32, "gradient checkpointing")


@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_gives_the_same_logits_and_round_trips_exactly(family):
    """Weights into fastlm.Transformer (the float64 reference, and fastlm's kernels in float32)
    and back to the very same tensors. Hugging Face's RMSNorm computes in float32 even for
    float64 inputs, so its float64 model is float32-accurate: a float32 bound for both."""
    changes = dict(tie_word_embeddings=True) if family == "qwen2" else {}
    model = _model(family, **changes).eval()
    if family == "qwen2":  # fastlm has no biases: all zero converts
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.zero_()
    truth = copy.deepcopy(model).double()
    ids = _tokens()
    with torch.no_grad():
        expected = truth(input_ids=ids).logits
        reference = hf.from_hf(truth, model="reference")
        assert_close(reference(ids), expected, torch.float32, f"{family} reference logits")
        converted = hf.from_hf(model)
        assert isinstance(converted, fastlm.Transformer)
        assert_close(converted(ids), expected, torch.float32, f"{family} fastlm logits")
    attention = converted.blocks[0].mult_head_atten
    assert (attention.num_heads, attention.num_kv_heads) == (4, 2)
    assert not attention.rope.interleaved
    assert (converted.out_linear.w is converted.embedding.w) == (family == "qwen2")
    back = hf.to_hf(converted, family)
    assert type(back) is type(model)
    original = model.state_dict()
    assert back.state_dict().keys() == original.keys()
    for name, value in back.state_dict().items():
        assert value.dtype == original[name].dtype and torch.equal(value, original[name]), name


def test_to_hf_of_an_interleaved_model():
    """A fastlm model in the seed's interleaved layout: to_hf reorders q's and k's rows within
    each head to Hugging Face's half-split layout (same logits); from_hf(rope_interleaved=True)
    reorders them back to the very same weights."""
    model = fastlm.reference.Transformer(
        vocab_size=VOCAB,
        context_length=32,
        d_model=64,
        num_layers=2,
        num_heads=4,
        d_ff=96,
        rope_theta=10000.0,
        dtype=torch.float64,
        num_kv_heads=1,
        norm_eps=1e-6,
    )
    converted = hf.to_hf(model)
    ids = _tokens()
    with torch.no_grad():
        assert_close(converted(input_ids=ids).logits, model(ids), torch.float32, "logits")
    back = hf.from_hf(converted, model="reference", rope_interleaved=True)
    for name, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name


def test_what_cannot_be_converted_or_patched_is_named():
    qwen = _model("qwen2")  # random q/k/v biases
    with pytest.raises(ValueError, match=r"nonzero biases \(model.layers.0.self_attn.q_proj.bias"):
        hf.from_hf(qwen)
    gelu = _model("llama", hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        hf.from_hf(gelu)
    truth = copy.deepcopy(gelu).double()
    with pytest.warns(UserWarning, match=r"left unpatched: swiglu \(hidden_act is 'gelu'"):
        hf.patch(gelu)
    assert "swiglu" not in gelu.fastlm_patched and "rms_norm" in gelu.fastlm_patched
    ids = _tokens()
    loss = gelu(input_ids=ids, labels=_labels(ids)).loss
    assert_close(loss, truth(input_ids=ids, labels=_labels(ids)).loss, torch.float32, "gelu loss")
    with pytest.raises(ValueError, match="head_dim 8 x 4 heads != hidden_size 64"):
        hf.from_hf(_model("llama", head_dim=8))
    with pytest.raises(TypeError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        hf.patch(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="family must be one of llama, mistral, qwen2"):
        hf.to_hf(fastlm.reference.Transformer(VOCAB, 8, 32, 1, 2, 48, 1e4), "gpt2")
    with pytest.warns(UserWarning, match="sliding window of 8 tokens"):
        windowed = hf.from_hf(_model("mistral", sliding_window=8))
    assert windowed.context_length == 8


def test_fastlm_imports_without_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import fastlm, fastlm.hf\n"
        "try:\n"
        "    fastlm.hf.patch(None)\n"
        "except ModuleNotFoundError as error:\n"
        "    print(error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'fastlm[hf]'" in result.stdout


def test_patched_model_compiles_whole():
    """torch.compile(fullgraph=True) of the patched model's loss and backward: the kernels are
    ops in the graph (aot_eager here; the ops run through the interpreter), same result."""
    model = _model("llama")
    truth = copy.deepcopy(model).double()
    hf.patch(model)
    ids = _tokens()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = compiled(input_ids=ids, labels=_labels(ids)).loss
    loss.backward()
    expected = truth(input_ids=ids, labels=_labels(ids)).loss
    expected.backward()
    assert_close(loss, expected, torch.float32, "compiled loss")
    _assert_grads_match(model, truth, torch.float32, "compiled")
