"""fastlm.hf: Hugging Face models of every supported family patched onto fastlm's kernels, in the
batch shapes trainers build (padded, padding-free by position_ids or by cu_seq_lens), and weights
converted to and from fastlm.Transformer. Tiny random configurations built here (no download);
the unpatched model in float64 is the ground truth.

The kernels run through Triton's interpreter, which is slow: each family runs on the kernels
once in fp32 and once under bf16 autocast (a padded batch, with sliding windows and soft caps
where the family has them); the other batch shapes run on the PyTorch backend
(FASTLM_BACKEND=torch), whose attention is the same routing (`fastlm.hf.attention`) down to
`flash_attention_varlen`'s reference math, and again on the kernels for one family with the op
calls counted.
"""

import collections
import copy
import subprocess
import sys
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

import fastlm  # noqa: E402
from fastlm import hf  # noqa: E402
from fastlm.hf import attention as hf_attention  # noqa: E402
from fastlm.testing import LargestTensor, assert_close, relative_error  # noqa: E402

VOCAB = 61
pytestmark = pytest.mark.usefixtures("one_thread")

#: hidden 32, 2 layers, 2 query heads sharing 1 key/value head of 16 dims; each family with its
#: own features switched on (windows of 6 tokens, soft caps, partial rotary, experts).
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)
TWO_LAYER_TYPES = ["sliding_attention", "full_attention"]
FAMILY_CONFIGS = {
    "llama": dict(rope_theta=500.0),
    "mistral": dict(sliding_window=6),
    "qwen2": dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
    "gemma": dict(hidden_act="gelu_pytorch_tanh"),
    "gemma2": dict(
        sliding_window=6,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
        query_pre_attn_scalar=24,
        layer_types=TWO_LAYER_TYPES,
    ),
    "gemma3_text": dict(
        sliding_window=6,
        query_pre_attn_scalar=24,
        layer_types=TWO_LAYER_TYPES,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
    ),
    "phi3": dict(sliding_window=6, partial_rotary_factor=0.5, pad_token_id=0),
    "mixtral": dict(sliding_window=6, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        mlp_only_layers=[1],  # one dense MLP beside the experts
        output_router_logits=True,
    ),
}
FAMILIES = list(FAMILY_CONFIGS)
GELU_FAMILIES = {"gemma", "gemma2", "gemma3_text"}
ALL_PARTS = ("rms_norm", "swiglu", "rope", "attention", "cross_entropy")


def _config(family: str, **changes):
    name = hf.FAMILIES[family].causal_lm.replace("ForCausalLM", "Config")
    config_class = transformers.Gemma3TextConfig if family == "gemma3_text" else None
    fields = {**BASE, **FAMILY_CONFIGS[family], **changes}
    return (config_class or getattr(transformers, name))(**fields)


def _model(family: str, **changes):
    """A random model whose every parameter (norm weights, biases) is perturbed, so that a part
    read wrongly shows."""
    model = getattr(transformers, hf.FAMILIES[family].causal_lm)(_config(family, **changes))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.train()


def _truth(model):
    """The unpatched model in float64 (experts by transformers' eager loop: its grouped GEMM
    takes no float64)."""
    truth = copy.deepcopy(model).double()
    if hasattr(truth, "set_experts_implementation"):
        truth.set_experts_implementation("eager")
    return truth


def _patched(model):
    """patch(model), which must patch every part (a part left unpatched warns: an error here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hf.patch(model) is model
    config = model.config
    act = getattr(config, "hidden_activation", None) or config.hidden_act
    gated = "geglu" if "gelu" in act else "swiglu"
    parts = tuple(gated if p == "swiglu" else p for p in ALL_PARTS)
    if hasattr(config, "num_experts_per_tok"):  # the experts on fastlm.moe_experts; dense MLPs
        dense = getattr(config, "mlp_only_layers", None)
        parts = parts[:1] + ("moe_experts",) + parts[1 if dense else 2 :]
    assert model.fastlm_patched == parts
    return model


def _padded_batch(batch=2, seq=13):
    """Right padding in the last row (left padding: test_left_padding_and_generate); labels
    -100 on padding."""
    ids = torch.randint(0, VOCAB, (batch, seq))
    mask = torch.ones_like(ids)
    mask[-1, -4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :3] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)


def _packed_batch():
    """Two rows of several documents each, marked by restarting position_ids; labels -100 at
    each document's first token (the previous document's last token predicts nothing)."""
    positions = torch.tensor(
        [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0]]
    )
    ids = torch.randint(0, VOCAB, positions.shape)
    labels = ids.masked_fill(positions == 0, -100)
    return dict(input_ids=ids, position_ids=positions, labels=labels, use_cache=False)


def _flattened_batch(lengths=(9, 1, 12, 4)):
    """One row of documents as transformers' DataCollatorWithFlattening (and TRL's padding-free
    collator) builds it: position_ids, cu_seq_lens_q/k, max_length_q/k."""
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    docs = [{"input_ids": torch.randint(0, VOCAB, (n,)).tolist()} for n in lengths]
    return dict(collate(docs), use_cache=False)


class _Ops(TorchDispatchMode):
    """The names of the torch.ops.fastlm ops that ran, "sdpa" for a call of PyTorch's
    scaled_dot_product_attention (whatever its backend decomposes it into) and "softmax over
    keys" for a softmax of a 4-D (B, H, Tq, Tk) score matrix (an eager attention); `calls`
    counts each."""

    def __init__(self):
        super().__init__()
        self.names = set()
        self.calls = collections.Counter()
        self._sdpa = torch.nn.functional.scaled_dot_product_attention

    def _seen(self, name: str) -> None:
        self.names.add(name)
        self.calls[name] += 1

    def _counted_sdpa(self, *args, **kwargs):
        self._seen("sdpa")
        return self._sdpa(*args, **kwargs)

    def __enter__(self):
        torch.nn.functional.scaled_dot_product_attention = self._counted_sdpa
        return super().__enter__()

    def __exit__(self, *exc):
        torch.nn.functional.scaled_dot_product_attention = self._sdpa
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[1]
        if func.namespace == "fastlm":
            self._seen(name)
        elif name in ("_softmax", "softmax") and args[0].dim() == 4:
            self._seen("softmax over keys")
        return func(*args, **(kwargs or {}))


def _assert_attention_on_the_kernels(names):
    assert {"flash_attention_varlen", "flash_attention_varlen_backward"} <= names, names
    assert not names & {"sdpa", "softmax over keys"}, names


def _pin_routing(truth, *models):
    """MoE: every model routes each token to the experts the float64 model chose, with its
    weights (a bf16 router can pick another expert on a near-tie, a discontinuity no bound
    covers). The routers are the model's own, untouched by patch; pinning them tests the rest."""
    routers = [m for m in truth.modules() if type(m).__name__.endswith("TopKRouter")]
    if not routers:
        return lambda: None
    recorded = []
    record = lambda module, inputs, out: recorded.append([t.detach() for t in out])  # noqa: E731
    handles = [r.register_forward_hook(record) for r in routers]

    def pin():
        for handle in handles:
            handle.remove()
        for model in models:
            mine = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
            for router, (logits, scores, indices) in zip(mine, recorded):
                routing = (logits.float(), scores.float(), indices)
                router.forward = lambda hidden, routing=routing: routing

    return pin


def _assert_grads_match(model, truth, dtype, what):
    truth_params = dict(truth.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{what}: no gradient for {name}"
        assert_close(p.grad, truth_params[name].grad, dtype, f"{what}: grad of {name}")


def _assert_matches_truth(model, truth, batch, what):
    """Loss and every gradient of the patched model (fp32) against the float64 model."""
    loss = model(**batch).loss
    loss.backward()
    expected = truth(**batch).loss
    expected.backward()
    assert_close(loss, expected, torch.float32, f"{what} loss")
    _assert_grads_match(model, truth, torch.float32, what)


# --------------------------------------------------------------------------------------------
# Every family on the kernels
# --------------------------------------------------------------------------------------------


#: The families run on the kernels (the interpreter is slow): each kernel path a family adds
#: once. Mistral and Qwen2 run on them below (left padding and generation, padding-free with the
#: op calls counted); Gemma's kernels are Gemma 2's and 3's, Mixtral's experts Qwen3-MoE's.
ON_THE_KERNELS = ["llama", "qwen3", "gemma2", "gemma3_text", "phi3", "qwen3_moe"]


@pytest.mark.parametrize("family", ON_THE_KERNELS)
def test_family_on_the_kernels(family):
    """A padded batch through every kernel: loss and every gradient against the float64 model;
    the varlen kernel ran, SDPA did not; in training no logits were made."""
    model = _model(family)
    truth = _truth(model)
    _patched(model)
    batch = _padded_batch()
    with _Ops() as ops:
        out = model(**batch)
        out.loss.backward()
    assert out.logits is None
    expected = truth(**batch)
    expected.loss.backward()
    assert_close(out.loss, expected.loss, torch.float32, f"{family} loss")
    _assert_grads_match(model, truth, torch.float32, family)
    gated = "geglu" if family in GELU_FAMILIES else "swiglu"
    if family in ("phi3", "mixtral"):
        gated = "swiglu_packed"  # fused gate_up projections
    head = "linear_cross_entropy_options" if family == "gemma2" else "linear_cross_entropy"
    kernels = {"rms_norm", "rope", "flash_attention_varlen", head, gated}  # gemma2: a soft cap
    if family in ("mixtral", "qwen3_moe"):  # the experts on fastlm.moe_experts (fastlm.hf.experts)
        kernels |= {"moe_route", "moe_experts", "moe_experts_backward"}
    kernels |= {name + "_backward" for name in ("rms_norm", "flash_attention_varlen", gated)}
    assert kernels <= ops.names, kernels - ops.names
    _assert_attention_on_the_kernels(ops.names)


#: Families run under bf16 autocast on the kernels (the others on the PyTorch backend): one with
#: GeGLU, offset norms, soft caps and windows, one with q/k norms, a dense MLP and experts.
BF16_ON_THE_KERNELS = ("gemma2", "qwen3_moe")


def bf16_gradient_bound(their_err: float, truth: torch.Tensor) -> float:
    """The relative error one parameter's gradient may have under bf16 autocast, given Hugging
    Face's own error on it: flash-attention's test rule, twice the other implementation's error
    plus twice the rounding of the true values themselves, with the factor 2 widened by 5/sqrt(n)
    for an n-element gradient. Both errors are one draw of rounding noise; their ratio spreads
    like 1/sqrt(n) (in 300 seeds of every family, 16-element biases and norm weights whose
    gradients nearly cancel reach 3.2x, 1024-element weights 2.3x; the mean ratio is 1.03-1.25).
    The bound, 4.5x at n = 16 and 2.3x at n = 1024, passed all 300 seeds (the lowest margin
    9%) where max(2x, 3e-2) failed 1.8% of them, and it fails an error 3x ours on 93% of the
    parameters of 512 elements or more (that rule: 65%), 5x ours on 85% of the 16-32-element
    ones (92%) and 10x on all but 0.1%."""
    rounding = relative_error(truth.to(torch.bfloat16), truth)
    return 2 * (1 + 5 / truth.numel() ** 0.5) * their_err + 2 * rounding


@pytest.mark.parametrize("family", FAMILIES)
def test_family_under_bf16_autocast(family, monkeypatch):
    """The padded batch under bf16 autocast: all the gradients together within twice the error
    of Hugging Face's own model under the same autocast (flash-attention's rule), and each
    parameter's within `bf16_gradient_bound` of it."""
    if family not in BF16_ON_THE_KERNELS:
        monkeypatch.setenv("FASTLM_BACKEND", "torch")
    model = _model(family)
    truth = _truth(model)
    unpatched = copy.deepcopy(model)
    _patched(model)
    batch = _padded_batch()
    pin = _pin_routing(truth, model, unpatched)
    expected = truth(**batch).loss
    expected.backward()
    pin()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch).loss
        loss.backward()
        unpatched(**batch).loss.backward()
    assert loss.dtype == torch.float32
    assert_close(loss, expected, torch.bfloat16, f"{family} bf16 loss")
    theirs, ours = dict(unpatched.named_parameters()), dict(model.named_parameters())
    grads = {"ours": [], "theirs": [], "truth": []}
    for name, p in truth.named_parameters():
        if name.endswith("mlp.gate.weight") and family in ("mixtral", "qwen3_moe"):
            assert ours[name].grad is theirs[name].grad is None  # the pinned router
            continue
        assert ours[name].grad is not None, name
        for key, grad in (
            ("ours", ours[name].grad),
            ("theirs", theirs[name].grad),
            ("truth", p.grad),
        ):
            grads[key].append(grad.flatten().double())
        err = relative_error(ours[name].grad, p.grad)
        their_err = relative_error(theirs[name].grad, p.grad)
        assert err <= bf16_gradient_bound(their_err, p.grad), (name, err, their_err)
    ours_all, theirs_all, truth_all = (torch.cat(grads[key]) for key in grads)
    err, their_err = relative_error(ours_all, truth_all), relative_error(theirs_all, truth_all)
    assert err <= 2 * their_err, ("all gradients", err, their_err)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_batch_shapes_on_pytorch(family, monkeypatch):
    """Padding-free batches in both forms (position_ids restarting in two rows; one flattened
    row with cu_seq_lens from the collator): each document attends only within itself, with
    its window; loss and every gradient against the float64 model, which splits documents by
    position_ids itself. Then eval mode: the padded batch's logits on real tokens and its loss
    (and an MoE model's auxiliary loss, added as its own forward does)."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    model = _model(family)
    truth = _truth(model)
    _patched(model)
    for batch, what in ((_packed_batch(), "position_ids"), (_flattened_batch(), "cu_seq_lens")):
        for p in (*model.parameters(), *truth.parameters()):
            p.grad = None
        _assert_matches_truth(model, truth, batch, f"{family} {what}")
    model.eval()
    truth.eval()
    batch = _padded_batch()
    with torch.no_grad():
        evaluated = model(**batch)
        expected = truth(**batch)
    real = batch["attention_mask"].bool()
    assert_close(evaluated.logits[real], expected.logits[real], torch.float32, "eval logits")
    assert_close(evaluated.loss, expected.loss, torch.float32, "eval loss")
    if family == "qwen3_moe":
        assert_close(evaluated.aux_loss, expected.aux_loss, torch.float32, "aux loss")


def test_padding_free_on_the_kernels_counts_the_ops():
    """Both padding-free forms on the kernels (a sliding-window and a full layer): the varlen
    kernel ran forward and backward, no SDPA and no attention matrix; loss and gradients
    against the float64 model."""
    model = _model("qwen2")
    truth = _truth(model)
    _patched(model)
    for batch, what in ((_packed_batch(), "position_ids"), (_flattened_batch(), "cu_seq_lens")):
        for p in (*model.parameters(), *truth.parameters()):
            p.grad = None
        with _Ops() as ops:
            loss = model(**batch).loss
            loss.backward()
        _assert_attention_on_the_kernels(ops.names)
        expected = truth(**batch).loss
        expected.backward()
        assert_close(loss, expected, torch.float32, f"{what} loss")
        _assert_grads_match(model, truth, torch.float32, what)


def test_padding_free_memory_is_linear_in_tokens(monkeypatch):
    """The largest tensor any op makes in a padding-free forward grows with the tokens, not
    their square: 4x the tokens (documents of 16) give at most 4x the largest tensor, and no
    T x T mask. The unpatched model's largest is its [1, 1, T, T] mask, which shows the
    measurement would catch one."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    model = _model("llama").eval()
    unpatched = copy.deepcopy(model)
    _patched(model)
    largest = {}
    for tokens in (64, 256):
        batch = _flattened_batch([16] * (tokens // 16))
        batch.pop("labels")
        for name, m in (("patched", model), ("unpatched", unpatched)):
            with torch.no_grad(), LargestTensor() as mode:
                m(**batch)
            largest[name, tokens] = mode.largest
    assert largest["patched", 256] <= 4 * largest["patched", 64], largest
    assert largest["patched", 256] < 256 * 256 // 4, largest
    assert largest["unpatched", 256] >= 256 * 256, largest


# --------------------------------------------------------------------------------------------
# Padding, generation, masks and what falls back
# --------------------------------------------------------------------------------------------


def test_left_padding_and_generate():
    """Left-padded prompts with a sliding window shorter than them: eval logits on real tokens,
    then greedy generation (the KV cache's decode steps through the padded path) giving the
    unpatched model's tokens; the varlen kernel ran."""
    model = _model("mistral").eval()
    truth = _truth(model)
    unpatched = copy.deepcopy(model)
    _patched(model)
    ids = torch.randint(1, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad(), _Ops() as ops:
        logits = model(input_ids=ids, attention_mask=mask).logits
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    expected = truth(input_ids=ids, attention_mask=mask).logits
    assert_close(logits[mask.bool()], expected[mask.bool()], torch.float32, "left-padded logits")
    assert "flash_attention_varlen" in ops.names and "flash_attention" not in ops.names
    with torch.no_grad():
        theirs = unpatched.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(tokens, theirs), (tokens, theirs)
    with torch.no_grad(), _Ops() as ops:  # no padding: the plain kernel with the KV cache
        tokens = model.generate(ids[1:], max_new_tokens=4, do_sample=False)
    assert torch.equal(tokens, unpatched.generate(ids[1:], max_new_tokens=4, do_sample=False))
    assert "flash_attention" in ops.names


def test_mask_function_builds_no_square_mask():
    """What the registered mask function returns for each kind of call."""
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
    args = dict(batch_size=2, q_length=4, kv_length=4)
    assert hf.fastlm_mask(**args) is None
    # Packed documents (rows [2, 2] and [1, 3]): which token attends to the one before it, read
    # from the model's own mask function.
    from transformers.masking_utils import and_masks, packed_sequence_mask_function

    documents = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    function = and_masks(lambda b, h, q, kv: kv <= q, packed_sequence_mask_function(documents))
    packed = hf.fastlm_mask(**args, mask_function=function, allow_is_causal_skip=False)
    assert torch.equal(packed.follows, torch.tensor([[0, 1, 0, 1], [0, 0, 1, 1]]).bool())
    assert torch.equal(hf.fastlm_mask(**args, attention_mask=mask), mask.bool())
    # A sliding-window cache's keys: the last 3 of 6 tokens seen, one of them the query.
    longer = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    sliced = hf.fastlm_mask(2, 1, 3, 5, 3, attention_mask=longer)
    assert torch.equal(sliced, longer[:, 3:].bool())
    with pytest.warns(UserWarning, match="a static cache"):
        static = hf.fastlm_mask(2, 1, 8, torch.tensor(4), 0, attention_mask=mask)
    assert static.shape == (2, 1, 1, 8)  # keys past the written ones masked: SDPA's
    assert not static[..., 5:].any() and static[1, 0, 0, :3].all()


def test_padding_with_holes_is_refused():
    model = _model("llama").eval()
    _patched(model)
    ids = torch.randint(0, VOCAB, (1, 8))
    holed = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1]])
    with pytest.raises(RuntimeError, match="each row's ones contiguous"):
        model(input_ids=ids, attention_mask=holed)


def test_what_the_kernels_do_not_run_goes_to_sdpa_with_a_warning():
    """Attention dropout in training and a caller's 4-D mask run transformers' SDPA, each with a
    warning naming why; a 4-D mask gives the unpatched model's result."""
    hf.attention._warned.clear()
    model = _model("llama", attention_dropout=0.5)
    truth = _truth(model).eval()
    _patched(model)
    ids = torch.randint(0, VOCAB, (1, 9))
    with pytest.warns(UserWarning, match="attention with attention dropout in training runs"):
        with _Ops() as ops:
            assert torch.isfinite(model(input_ids=ids, use_cache=False).logits).all()
    assert "sdpa" in ops.names
    model.eval()
    square = torch.ones(1, 1, 9, 9, dtype=torch.bool).tril()
    square[..., 4:, :2] = False  # not a mask the mask function would make
    with torch.no_grad(), pytest.warns(UserWarning, match="a 4-D attention mask"):
        logits = model(input_ids=ids, attention_mask=square).logits
    expected = truth(input_ids=ids, attention_mask=square).logits
    assert_close(logits, expected, torch.float32, "logits with a 4-D mask")
    # Bidirectional attention (config.is_causal False): SDPA over every unpadded key.
    bidirectional = _model("llama", is_causal=False).eval()
    truth = _truth(bidirectional)
    _patched(bidirectional)
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    with torch.no_grad(), pytest.warns(UserWarning, match="bidirectional attention"):
        logits = bidirectional(input_ids=ids, attention_mask=mask).logits
    expected = truth(input_ids=ids, attention_mask=mask).logits
    assert_close(logits[mask.bool()], expected[mask.bool()], torch.float32, "bidirectional")


# --------------------------------------------------------------------------------------------
# patch: what it picks, and what it cannot
# --------------------------------------------------------------------------------------------


def test_patch_names_what_it_supports_and_leaves_what_it_cannot(monkeypatch):
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    with pytest.raises(TypeError, match="model must be a transformers PreTrainedModel with a c"):
        hf.patch(torch.nn.Linear(2, 2))
    relu = _model("llama", hidden_act="relu")
    truth = _truth(relu)
    with pytest.warns(UserWarning, match=r"left unpatched: LlamaMLP \(ReLU activation\)"):
        hf.patch(relu)
    assert relu.fastlm_patched == ("rms_norm", "rope", "attention", "cross_entropy")
    assert relu.fastlm_patched.left == {"LlamaMLP": "ReLU activation"}
    _assert_matches_truth(relu, truth, _padded_batch(), "relu")
    exact = _patched(_model("llama", hidden_act="gelu"))  # the exact GELU: geglu
    assert exact.fastlm_patched[1] == "geglu"


def test_patch_composes_with_peft_and_a_trainer_built_first():
    """patch finds the transformers model inside a PEFT model; a forward already replaced (TRL
    wraps it with its fused LM head when the trainer is built) is left in place, with a warning
    that says to patch first."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    assert hf.patch(model) is model
    assert model.get_base_model().fastlm_patched == ("rms_norm", "swiglu", "rope", "attention",
                                                     "cross_entropy")  # fmt: skip
    wrapped = _model("llama")
    wrapped.forward = lambda *args, **kwargs: None
    with pytest.warns(UserWarning, match="forward is already replaced.*before building the trai"):
        hf.patch(wrapped)
    assert "cross_entropy" not in wrapped.fastlm_patched


def _lora(model, seed: int = 1):
    """PEFT LoRA on q_proj and lm_head, its B matrices random (not PEFT's zeros, which would
    make the adapter a no-op)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"], lora_dropout=0.0)
    model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    return model


def test_lora_on_the_lm_head_in_either_order(monkeypatch):
    """LoRA on lm_head (continued pretraining), patched before get_peft_model and after it:
    the loss runs the adapter (the head's own forward, its logits into fastlm's cross-entropy,
    not the fused loss on the base weight alone), every other part is patched, and loss and
    every trainable weight's gradient (the LoRA matrices) are the unpatched model's."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    base = _model("llama")
    unpatched = _lora(copy.deepcopy(base))
    before = _lora(_patched(copy.deepcopy(base)))
    after = _lora(copy.deepcopy(base))
    hf.patch(after)
    assert after.get_base_model().fastlm_patched == ("rms_norm", "swiglu", "rope", "attention",
                                                     "cross_entropy")  # fmt: skip
    batch = _padded_batch()
    expected = unpatched(**batch).loss
    expected.backward()
    theirs = dict(unpatched.named_parameters())
    for what, model in (("patched before PEFT", before), ("patched after PEFT", after)):
        loss = model(**batch).loss
        loss.backward()
        assert_close(loss, expected, torch.float32, f"{what}: loss")
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        assert any("lm_head.lora_A" in n for n, _ in trainable)
        for name, p in trainable:
            assert_close(p.grad, theirs[name].grad, torch.float32, f"{what}: grad of {name}")


# --------------------------------------------------------------------------------------------
# The loss, gradient checkpointing, compile, other options
# --------------------------------------------------------------------------------------------


def test_patch_on_the_meta_device_then_loaded(monkeypatch):
    """A model built on the meta device (how large models are built before their weights are
    loaded) patches every part (each check runs on random parameters on the CPU), then, once
    materialised and loaded, gives the unpatched model's loss and gradients."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    reference = _model("gemma2")
    with torch.device("meta"):
        model = transformers.Gemma2ForCausalLM(reference.config)
    _patched(model)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the tied head a tensor of its own, as it does unpatched
    model.load_state_dict(reference.state_dict())
    with torch.no_grad():  # the rotary tables: buffers no state_dict holds
        for name, buffer in reference.named_buffers():
            model.get_buffer(name).copy_(buffer)
    _assert_matches_truth(model.train(), _truth(reference), _padded_batch(), "patched on meta")


def test_patching_twice_finds_what_patching_once_does(monkeypatch):
    """patch on a patched model finds each part again from the module's own code: the same
    parts, nothing reported left, the same loss."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    model = _model("qwen3_moe")
    truth = _truth(model)
    _patched(_patched(model))
    assert model.fastlm_patched.left == {}
    _assert_matches_truth(model, truth, _padded_batch(), "patched twice")


def test_num_items_in_batch_and_shift_labels_as_transformers(monkeypatch):
    """Gradient accumulation: the loss is the sum over the micro-batch over num_items_in_batch;
    shift_labels, when given, replace the shift of labels."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    model = _model("llama")
    truth = _truth(model)
    _patched(model)
    batch = _padded_batch()
    items = torch.tensor(57)
    loss = model(**batch, num_items_in_batch=items).loss
    expected = truth(**batch, num_items_in_batch=items).loss
    assert_close(loss, expected, torch.float32, "loss over num_items_in_batch")
    shifted = torch.nn.functional.pad(batch.pop("labels"), (0, 1), value=-100)[..., 1:]
    assert_close(
        model(**batch, shift_labels=shifted).loss, loss * 57 / (shifted != -100).sum(),
        torch.float32, "shift_labels",
    )  # fmt: skip
    assert model(**batch, labels=shifted, return_dict=False)[0].shape == ()


def test_llama_with_biases_patches_and_does_not_convert(monkeypatch):
    """attention_bias and mlp_bias: the patched forwards call the projections (biases
    included); fastlm.Transformer has no biases, so from_hf names them."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    model = _model("llama", attention_bias=True, mlp_bias=True)
    truth = _truth(model)
    _patched(model)
    _assert_matches_truth(model, truth, _padded_batch(), "biases")
    with pytest.raises(ValueError, match=r"nonzero biases \(.*and \d+ more; fastlm"):
        hf.from_hf(model)


def test_rope_scaling_runs_on_hugging_faces_tables():
    """The kernel rotates by the rotary embedding's own cos/sin: linear scaling (and any other
    rope type of the family) gives the unpatched logits; from_hf refuses it."""
    scaled = dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0})
    model = _model("llama", **scaled).eval()
    truth = _truth(model)
    _patched(model)
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        assert_close(
            model(input_ids=ids).logits, truth(input_ids=ids).logits, torch.float32, "logits"
        )
    with pytest.raises(ValueError, match="rope type 'linear'"):
        hf.from_hf(model)


def test_gradient_checkpointing_composes():
    model = _model("qwen2")
    truth = _truth(model)
    _patched(model)
    enable = getattr(model, "activation_checkpointing_enable", None)  # the newer name
    (enable or model.gradient_checkpointing_enable)()
    _assert_matches_truth(model, truth, _packed_batch(), "gradient checkpointing")


def test_patched_model_compiles_whole():
    """torch.compile(fullgraph=True) of the patched model's loss and backward: the kernels are
    ops in the graph (aot_eager here; the ops run through the interpreter), same result."""
    model = _model("llama")
    truth = _truth(model)
    _patched(model)
    packed = _packed_batch()  # the same shapes, and position_ids: no recompilation below
    batch = dict(packed, position_ids=torch.arange(13).expand(2, 13))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = compiled(**batch).loss
    loss.backward()
    expected = truth(**batch).loss
    expected.backward()
    assert_close(loss, expected, torch.float32, "compiled loss")
    _assert_grads_match(model, truth, torch.float32, "compiled")
    # Compiling, position_ids cannot be read: packed documents need cu_seq_lens, and position_ids
    # that restart without them fail rather than attend across documents.
    with pytest.raises(RuntimeError, match="under torch.compile, packed documents need cu_seq"):
        compiled(**packed)


# --------------------------------------------------------------------------------------------
# Saving and loading a patched model
# --------------------------------------------------------------------------------------------

_LOAD_IN_A_FRESH_PROCESS = """
import sys, torch
model, ids, expected = torch.load(sys.argv[1], weights_only=False)
assert model.fastlm_patched == ("rms_norm", "swiglu", "rope", "attention", "cross_entropy")
with torch.no_grad():
    logits = model(input_ids=ids).logits
print(float((logits - expected).abs().max()))
"""


def test_patched_model_saves_and_loads(tmp_path, monkeypatch):
    """torch.save / torch.load, pickle and deepcopy of a patched model, also loaded in a fresh
    process (which registers fastlm's attention again); save_pretrained stores the weights and
    config, and the model from_pretrained loads is unpatched until patched again."""
    import pickle

    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    model = _patched(_model("mistral").eval())
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    path = tmp_path / "patched.pt"
    torch.save((model, ids, expected), path)
    for loaded in (torch.load(path, weights_only=False)[0], pickle.loads(pickle.dumps(model)),
                   copy.deepcopy(model)):  # fmt: skip
        assert loaded.fastlm_patched == model.fastlm_patched
        with torch.no_grad():
            assert_close(loaded(input_ids=ids).logits, expected, torch.float32, "loaded logits")
        assert "fastlm" == loaded.config._attn_implementation
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_IN_A_FRESH_PROCESS, str(path)],
        capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "FASTLM_BACKEND": "torch"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.split()[-1]) < 1e-5, result.stdout
    model.save_pretrained(tmp_path / "pretrained")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pretrained").eval()
    assert not hasattr(reloaded, "fastlm_patched")
    _patched(reloaded)
    with torch.no_grad():
        assert_close(reloaded(input_ids=ids).logits, expected, torch.float32, "reloaded")


# --------------------------------------------------------------------------------------------
# Weights to and from fastlm.Transformer
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", hf.CONVERTIBLE)
def test_from_hf_gives_the_same_logits_and_round_trips_exactly(family):
    """Weights into fastlm.Transformer (the float64 reference, and fastlm's kernels in float32)
    and back to the very same tensors. Hugging Face's RMSNorm computes in float32 even for
    float64 inputs, so its float64 model is float32-accurate: a float32 bound for both."""
    changes = dict(sliding_window=None, use_sliding_window=False) if family != "llama" else {}
    if family == "qwen2":
        changes["tie_word_embeddings"] = True
    model = _model(family, **changes).eval()
    if family == "qwen2":  # fastlm has no biases: all zero converts
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.zero_()
    truth = _truth(model)
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        expected = truth(input_ids=ids).logits
        reference = hf.from_hf(truth, model="reference")
        assert_close(reference(ids), expected, torch.float32, f"{family} reference logits")
        converted = hf.from_hf(model)
        assert isinstance(converted, fastlm.Transformer)
        assert_close(converted(ids), expected, torch.float32, f"{family} fastlm logits")
    attention = converted.blocks[0].mult_head_atten
    assert (attention.num_heads, attention.num_kv_heads) == (2, 1)
    assert not attention.rope.interleaved
    assert (converted.out_linear.w is converted.embedding.w) == (family == "qwen2")
    back = hf.to_hf(converted, family)
    assert type(back) is type(model)
    original = model.state_dict()
    assert back.state_dict().keys() == original.keys()
    for name, value in back.state_dict().items():
        assert value.dtype == original[name].dtype and torch.equal(value, original[name]), name


def test_to_hf_of_an_interleaved_model():
    """A fastlm model in the interleaved RoPE layout: to_hf reorders q's and k's rows within
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
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        assert_close(converted(input_ids=ids).logits, model(ids), torch.float32, "logits")
    back = hf.from_hf(converted, model="reference", rope_interleaved=True)
    for name, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name


def test_what_cannot_be_converted_is_named():
    qwen = _model("qwen2")  # random q/k/v biases
    with pytest.raises(ValueError, match=r"nonzero biases \(model.layers.0.self_attn.q_proj.bias"):
        hf.from_hf(qwen)
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        hf.from_hf(_model("llama", hidden_act="gelu"))
    with pytest.raises(ValueError, match="head_dim 8 x 2 heads != hidden_size 32"):
        hf.from_hf(_model("llama", head_dim=8))
    with pytest.raises(TypeError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        hf.from_hf(_model("gemma"))
    with pytest.raises(ValueError, match="family must be one of llama, mistral, qwen2"):
        hf.to_hf(fastlm.reference.Transformer(VOCAB, 8, 32, 1, 2, 48, 1e4), "gemma")
    with pytest.warns(UserWarning, match="sliding window of 6 tokens"):
        windowed = hf.from_hf(_model("mistral"))
    assert windowed.context_length == 6


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


def test_approximate_soft_cap_is_opted_into_on_the_config(monkeypatch):
    """Gemma 2 patched: its capped attention calls the kernels with softcap_approx=False, and
    with True once `config.fastlm_softcap_approx` is set (a non-bool is refused, naming it);
    the approximate cap's logits then differ from the exact ones' (by its bound in
    test_attention.py, not rounding)."""
    calls = []
    real = hf_attention.flash_attention_varlen

    def recording(*args, **kwargs):
        calls.append(kwargs.get("softcap_approx"))
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_attention, "flash_attention_varlen", recording)
    model = _patched(_model("gemma2")).eval()
    batch = _padded_batch()
    batch.pop("labels")
    with torch.no_grad():
        exact = model(**batch).logits
        model.config.fastlm_softcap_approx = True
        approx = model(**batch).logits
        model.config.fastlm_softcap_approx = 1
        with pytest.raises(TypeError, match="config.fastlm_softcap_approx must be a bool"):
            model(**batch)
    assert calls[:4] == [False, False, True, True], calls
    assert not torch.equal(exact, approx)
