"""fastlm.hf under the trainers people fine-tune with: TRL's SFTTrainer (padded and padding-free
batches), transformers' Trainer with gradient accumulation, and PEFT LoRA, each on a patched tiny
model against the unpatched one.

These run on the PyTorch backend (FASTLM_BACKEND=torch): the same routing (`fastlm.hf`'s
forwards and attention down to `flash_attention_varlen`) with each op's reference math, fast on
a CPU. tests/test_hf.py runs the same batch shapes through the kernels with the op calls counted.
"""

import copy
import functools
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from test_hf import _model as hf_model  # noqa: E402
from test_hf import _Ops  # noqa: E402

import fastlm.hf  # noqa: E402
from fastlm.hf import attention as hf_attention  # noqa: E402
from fastlm.hf import experts as hf_experts  # noqa: E402
from fastlm.testing import assert_close  # noqa: E402

VOCAB = 61
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def pytorch_backend(monkeypatch):
    monkeypatch.setenv("FASTLM_BACKEND", "torch")


def _tokenizer():
    """A word-level tokenizer built here: "w0" ... "w57", with pad and eos."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def _texts(count=8):
    lengths = torch.randint(3, 14, (count,)).tolist()
    return [" ".join(f"w{i}" for i in torch.randint(0, VOCAB - 3, (n,)).tolist()) for n in lengths]


def _model():
    """Qwen2 with a sliding-window layer and a full one (tests/test_hf.py's tiny configuration),
    and the tokenizer's pad and eos ids."""
    return hf_model("qwen2", sliding_window=5, pad_token_id=0, eos_token_id=1, bos_token_id=None)


class _Calls:
    """Counts calls of fastlm.hf's attention kernels and of PyTorch's SDPA."""

    def __init__(self, monkeypatch):
        self.counts = {"varlen": 0, "sdpa": 0}
        varlen, sdpa = (
            hf_attention.flash_attention_varlen,
            torch.nn.functional.scaled_dot_product_attention,
        )
        monkeypatch.setattr(
            hf_attention, "flash_attention_varlen", self._counting("varlen", varlen)
        )
        monkeypatch.setattr(
            torch.nn.functional, "scaled_dot_product_attention", self._counting("sdpa", sdpa)
        )

    def _counting(self, name, function):
        def counted(*args, **kwargs):
            self.counts[name] += 1
            return function(*args, **kwargs)

        return counted


def _trl_config(config_class, **options):
    """A TRL trainer's config: two steps of 4 rows on the CPU, each logged, nothing saved."""
    return config_class(
        output_dir="unused",
        per_device_train_batch_size=4,
        logging_steps=1,
        learning_rate=1e-3,
        report_to="none",
        bf16=False,
        use_cpu=True,
        save_strategy="no",
        dataloader_num_workers=0,
        seed=0,
        **{"max_steps": 2, **options},
    )


def _sft(model, data, tokenizer, **options):
    config = _trl_config(trl.SFTConfig, **options)
    return trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)


@pytest.mark.parametrize(
    "options",
    [dict(max_length=32), dict(packing=True, max_length=32)],
    ids=["padded", "packing-padding-free"],
)
def test_sft_trainer_logs_what_it_logs_unpatched(options, tmp_path, monkeypatch):
    """SFTTrainer on a patched model (patched before the trainer is built) for two steps, with
    TRL's gradient checkpointing: the same metrics logged (loss, grad norm, entropy, token
    accuracy, token counts) as for the unpatched model, equal within fp32 rounding, and the
    attention ran fastlm's varlen path (padded rows, or TRL's one packed row with cu_seq_lens),
    never SDPA."""
    monkeypatch.chdir(tmp_path)
    tokenizer = _tokenizer()
    data = datasets.Dataset.from_dict({"text": _texts()})
    model = _model()
    unpatched = copy.deepcopy(model)

    def sft(m):
        trainer = _sft(m, data, tokenizer, **options)
        assert trainer.args.gradient_checkpointing
        return trainer

    builds = {"patched": lambda: sft(fastlm.hf.patch(model)), "unpatched": lambda: sft(unpatched)}
    run = _train(builds, monkeypatch)
    _assert_same_logs(run, {"loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens"})


def test_a_trainer_built_before_patch_keeps_its_loss_head(tmp_path, monkeypatch):
    """SFTTrainer wraps the model's forward with its fused LM head when it is built; patching
    afterwards leaves that wrapper (with a warning saying to patch first) and patches the rest,
    so training still runs and matches."""
    monkeypatch.chdir(tmp_path)
    tokenizer = _tokenizer()
    data = datasets.Dataset.from_dict({"text": _texts(4)})
    trainer = _sft(_model(), data, tokenizer, max_length=32, max_steps=1)
    with pytest.warns(UserWarning, match="forward is already replaced, by trl.*Patch the model"):
        fastlm.hf.patch(trainer.model)
    assert trainer.model.fastlm_patched == ("rms_norm", "swiglu", "rope", "attention")
    trainer.train()
    assert torch.isfinite(torch.tensor(trainer.state.log_history[0]["loss"]))


def _batches(rows, per_batch, tokenizer):
    """Micro-batches of `per_batch` rows as a collator pads them (each to its own longest row),
    labels -100 on padding."""
    collate = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return [collate(rows[i : i + per_batch]) for i in range(0, len(rows), per_batch)]


def test_gradient_accumulation_equals_one_big_batch():
    """Micro-batches padded to different lengths, each loss over num_items_in_batch (all
    micro-batches' counted tokens, as transformers' Trainer passes it): the summed gradients
    are the one big batch's, on the patched model as on the unpatched one."""
    tokenizer = _tokenizer()
    rows = [{"input_ids": torch.randint(3, VOCAB, (n,)).tolist()} for n in (5, 12, 3, 9, 7, 11)]
    micro = _batches(rows, 2, tokenizer)
    (whole,) = _batches(rows, len(rows), tokenizer)
    items = torch.tensor(sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro))
    model = _model()
    unpatched = copy.deepcopy(model)
    fastlm.hf.patch(model)
    grads = {}
    for name, m in (("patched", model), ("unpatched", unpatched)):
        for batch in micro:
            m(**batch, num_items_in_batch=items, use_cache=False).loss.backward()
        accumulated = {n: p.grad.clone() for n, p in m.named_parameters()}
        m.zero_grad()
        m(**whole, use_cache=False).loss.backward()
        for n, p in m.named_parameters():
            assert_close(accumulated[n], p.grad, torch.float32, f"{name}: accumulated grad of {n}")
        grads[name] = accumulated
    for n, grad in grads["unpatched"].items():
        assert_close(grads["patched"][n], grad, torch.float32, f"patched vs unpatched grad of {n}")


def test_trainer_gradient_accumulation_takes_the_same_step(tmp_path):
    """transformers' Trainer on the patched model: two micro-batches of 2 with gradient
    accumulation take the very step one batch of 4 takes (plain SGD, so that a wrongly scaled
    loss would show)."""
    tokenizer = _tokenizer()
    rows = [{"input_ids": ids} for ids in tokenizer(_texts(4))["input_ids"]]
    data = datasets.Dataset.from_list(rows)
    collate = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    start = _model()
    trained = {}
    for accumulate, per_device in ((2, 2), (1, 4)):
        model = fastlm.hf.patch(copy.deepcopy(start))
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path),
            max_steps=1,
            per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accumulate,
            learning_rate=0.5,
            optim="sgd",
            lr_scheduler_type="constant",
            report_to="none",
            use_cpu=True,
            save_strategy="no",
            dataloader_num_workers=0,
            seed=0,
        )
        transformers.Trainer(
            model=model, args=args, train_dataset=data, data_collator=collate
        ).train()
        trained[accumulate] = dict(model.named_parameters())
    moved = 0.0
    for name, p in trained[1].items():
        assert_close(trained[2][name], p, torch.float32, f"{name} after the step")
        moved = max(moved, float((p - dict(start.named_parameters())[name]).abs().max()))
    assert moved > 1e-3  # the step did move the weights


#: LoRA targets: the MLP and attention projections of the dense model; on a tiny Qwen3-MoE (one
#: MoE layer) and gpt-oss (two), the attention projections, and the experts' stacked weights
#: (PEFT's `target_parameters`: its ParamWrapper adds B A to the weight while the experts run),
#: adapted after patching or before it. Each with its count of LoRA tensors (A and B each).
MLP_AND_ATTENTION = dict(target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
ATTENTION = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
EXPERTS = dict(target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"])
PEFT_CASES = {
    "qwen2-mlp-attention": ("qwen2", MLP_AND_ATTENTION, 2 * 2 * 4),
    "qwen3_moe-attention": ("qwen3_moe", ATTENTION, 2 * 2 * 4),
    "qwen3_moe-experts": ("qwen3_moe", EXPERTS, 1 * 2 * 2),
    "gpt_oss-experts-adapted-first": ("gpt_oss", EXPERTS, 2 * 2 * 2),
}  # fmt: skip


def _experts_on_the_kernels(monkeypatch) -> None:
    """transformers' experts modules that patch gave fastlm's implementation run
    `fastlm.moe_experts` on the kernels (Triton's interpreter here), every other op on this
    module's PyTorch backend: the experts' op shows in `_Ops`, forward and backward, at a CPU
    test's speed."""
    op = hf_experts.moe_experts

    def on_the_kernels(*args, **kwargs):
        with monkeypatch.context() as scoped:
            scoped.setenv("FASTLM_BACKEND", "auto")
            return op(*args, **kwargs)

    monkeypatch.setattr(hf_experts, "moe_experts", on_the_kernels)


def _assert_experts_on_the_op(model, calls) -> None:
    """The patched model's experts ran fastlm's op forward and backward, and patch left
    nothing."""
    assert "moe_experts" in model.fastlm_patched and not model.fastlm_patched.left, (
        model.fastlm_patched
    )
    assert calls["moe_experts"] > 0 and calls["moe_experts_backward"] > 0, calls


def _lora_gradients(family: str, targets: dict, adapted_first: bool, monkeypatch):
    """(the patched PEFT model's base model, the fastlm ops its backward step ran): one loss
    and backward on a patched PEFT model (patched before get_peft_model, or after with
    `adapted_first`) and on the unpatched one with the same nonzero adapters, whose gradients
    must be equal and reach only the adapters."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, **targets)
    if family == "qwen2":
        base = _model()
    else:
        from test_hf_families import tiny_model

        base = tiny_model(family, pad_token_id=0, eos_token_id=1, bos_token_id=None)
        _experts_on_the_kernels(monkeypatch)
    models = {}
    for name in ("patched", "unpatched"):
        model = copy.deepcopy(base)
        if name == "patched" and not adapted_first:
            fastlm.hf.patch(model)
        model = peft.get_peft_model(model, lora)
        if name == "patched" and adapted_first:
            fastlm.hf.patch(model)
        models[name] = model
    torch.manual_seed(3)
    with torch.no_grad():  # nonzero adapters (B starts at zero), the same in both
        for p in models["unpatched"].parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
    models["patched"].load_state_dict(models["unpatched"].state_dict())
    patched = models["patched"].get_base_model()
    assert patched.fastlm_patched[-1] == "cross_entropy"
    ids = torch.randint(0, VOCAB, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    with _Ops() as calls:
        models["patched"](
            input_ids=ids, attention_mask=mask, labels=labels, use_cache=False
        ).loss.backward()
    models["unpatched"](
        input_ids=ids, attention_mask=mask, labels=labels, use_cache=False
    ).loss.backward()
    theirs = dict(models["unpatched"].named_parameters())
    trained = 0
    for name, p in models["patched"].named_parameters():
        assert (p.grad is not None) == ("lora_" in name) == p.requires_grad, name
        if p.grad is not None:
            trained += 1
            assert_close(p.grad, theirs[name].grad, torch.float32, f"grad of {name}")
    return patched, calls.calls, trained


@pytest.mark.parametrize("case", list(PEFT_CASES))
def test_peft_lora_on_a_patched_model(case, monkeypatch):
    """LoRA adapters on a patched model (or, "adapted-first", a PEFT model patched): gradients
    reach only the adapters, equal to the unpatched model's with the same adapters. On the MoE
    models the experts ran fastlm.moe_experts forward and backward, LoRA on their weights too:
    transformers' experts read `gate_up_proj` and `down_proj` while PEFT's wrapper has them
    parametrized (W + B A), and so does fastlm's experts forward."""
    family, targets, adapters = PEFT_CASES[case]
    patched, calls, trained = _lora_gradients(
        family, targets, case.endswith("adapted-first"), monkeypatch
    )
    if family != "qwen2":
        _assert_experts_on_the_op(patched, calls)
    assert trained == adapters


@pytest.mark.parametrize("adapted_first", [False, True], ids=["patched-first", "adapted-first"])
def test_peft_lora_on_llama4_experts_runs_the_blocks_own_forward(adapted_first, monkeypatch):
    """Llama 4's MoE block reads its experts' stacked weights itself (fastlm's block forward
    too), so PEFT's LoRA on them (`target_parameters`), which exists only inside the experts
    wrapper's forward, would be skipped or crash there: patched first, the block runs its own
    forward once PEFT has wrapped its experts; adapted first, patch leaves the block, named.
    Either way the adapters' gradients are the unpatched PEFT model's."""
    patched, calls, trained = _lora_gradients("llama4_text", EXPERTS, adapted_first, monkeypatch)
    assert trained > 0 and calls["moe_experts"] == 0, calls
    if adapted_first:
        assert "Llama4TextMoe" in patched.fastlm_patched.left, patched.fastlm_patched.left


def test_the_readme_example_runs(tmp_path, monkeypatch):
    """README's "Fine-tuning with Hugging Face and TRL" example as written, with a tiny Qwen3
    and a local tokenizer where it downloads them, and use_cpu (its bf16 is a GPU's): the model
    is patched and trained on."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Fine-tuning with Hugging Face and TRL\n", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    tiny = hf_model("qwen3", pad_token_id=0, eos_token_id=1, bos_token_id=None)
    models, tokenizers = transformers.AutoModelForCausalLM, transformers.AutoTokenizer
    monkeypatch.setattr(models, "from_pretrained", lambda *args, **kwargs: tiny)
    monkeypatch.setattr(tokenizers, "from_pretrained", lambda *args, **kwargs: _tokenizer())
    monkeypatch.setattr(trl, "SFTConfig", functools.partial(trl.SFTConfig, use_cpu=True))
    monkeypatch.chdir(tmp_path)
    names = {}
    exec(code, names)
    assert names["model"] is tiny and "attention" in tiny.fastlm_patched
    assert names["trainer"].state.global_step > 0


# --------------------------------------------------------------------------------------------
# Preference trainers (TRL's own fused LM head over the patched layers), gpt-oss padding-free
# --------------------------------------------------------------------------------------------


class _LogitScale:
    """What bounds an fp32 difference in anything computed from a run's logits.

    Each logit is a dot product h_t . W_v, so its rounding, and any fp32 difference in h_t between
    two computations of the same layers, is relative to ||h_t|| ||W_v||, not to the logit itself
    (which cancels to near zero). A per-token log-prob (logit_y - logsumexp, each 1-Lipschitz in
    the logits) is then off by at most twice that, and a sequence's log-prob by twice the sum over
    its tokens. `value` is the largest such per-sequence sum, sum_t ||h_t|| * max_v ||W_v||, over
    every forward of the backbones given (a policy and its reference model)."""

    def __init__(self, models):
        self.value = 0.0
        for model in models:
            head = model.get_output_embeddings()
            model.base_model.register_forward_hook(functools.partial(self._record, head))

    def _record(self, head, module, args, output):
        hidden = output.last_hidden_state.detach().float()
        widest_row = torch.linalg.vector_norm(head.weight.detach().float(), dim=-1).max()
        per_sequence = torch.linalg.vector_norm(hidden, dim=-1).sum(-1).max() * widest_row
        self.value = max(self.value, float(per_sequence))


class _Run(NamedTuple):
    logs: dict  # {"patched": logged rows, "unpatched": logged rows}
    logit_scale: float  # the larger of the two runs' _LogitScale
    beta: float | None  # a preference trainer's beta (its rewards and loss scale by it)


def _train(builds: dict, monkeypatch) -> _Run:
    """Each trainer of {"patched": build, "unpatched": build} built (after fastlm's attention
    calls are counted) and trained, in that order; the patched run's attention ran fastlm's
    varlen path, never SDPA."""
    calls = _Calls(monkeypatch)
    logs, ran, scale = {}, {}, 0.0
    for name, build in builds.items():
        trainer = build()
        models = [m for m in (trainer.model, getattr(trainer, "ref_model", None)) if m is not None]
        logit_scale = _LogitScale(models)
        before = dict(calls.counts)
        trainer.train()
        logs[name] = [row for row in trainer.state.log_history if "loss" in row]
        ran[name] = {key: calls.counts[key] - before[key] for key in before}
        scale = max(scale, logit_scale.value)
    assert ran["patched"]["varlen"] > 0 and ran["patched"]["sdpa"] == 0, ran
    return _Run(logs, scale, getattr(trainer.args, "beta", None))


def _train_both(trainer_class, config_class, data, tokenizer, monkeypatch) -> _Run:
    """A preference trainer for two steps on the patched model and on the unpatched one (each
    with a reference copy of itself at the start)."""
    model = _model()
    unpatched = copy.deepcopy(model)

    def preference(m):
        return trainer_class(
            model=m, ref_model=copy.deepcopy(m), args=_trl_config(config_class, max_length=32),
            train_dataset=data, processing_class=tokenizer,
        )  # fmt: skip

    builds = {"patched": lambda: preference(fastlm.hf.patch(model)),
              "unpatched": lambda: preference(unpatched)}  # fmt: skip
    return _train(builds, monkeypatch)


# The relative fp32 difference between the patched and the unpatched backbones' hidden states
# that the metric bounds allow, in units of fp32's unit roundoff u: each of the tiny model's two
# layers rounds its norms, attention and MLP differently on the two paths (a few u each, summed
# over the layers' residual stream). Over 35 runs of these tests the worst metric came to 1.34 u
# of `_LogitScale` for a sequence's log-prob, i.e. c >= 0.67: 16 leaves a margin of 12.
HIDDEN_STATE_ROUNDING = 16


def _from_logprobs(beta: float) -> dict:
    """The preference trainers' metrics computed from sequence log-probs (each off by at most
    2 c u S between the runs, S the `_LogitScale`), with each one's bound in units of c u S:
    a log-prob 2; KL, the mean of a policy's minus the reference's log-probs, 4; a reward, beta
    times a log-ratio, 4 beta; the margin, a difference of two rewards, 8 beta; the loss, a
    sigmoid of beta times at most a margin and a KL (slope at most 1) 8 beta; a mean logit
    (a mean of the logits themselves) 1. These differences cancel: they may be far smaller than
    the log-probs they come from, so a bound relative to the metric itself cannot hold."""
    return {
        "logps/chosen": 2, "logps/rejected": 2, "kl": 4,
        "rewards/chosen": 4 * beta, "rewards/rejected": 4 * beta, "rewards/margins": 8 * beta,
        "loss": 8 * beta, "logits/chosen": 1, "logits/rejected": 1,
    }  # fmt: skip


def _assert_same_logs(run: _Run, keys):
    """Both runs logged the same metrics, `keys` among them, two rows each, equal within what
    fp32 rounding leaves: a metric computed from cancelling log-probs within its bound in
    `_from_logprobs`; every other one (sums of terms of one sign: the SFT loss, entropy,
    gradient norm, aux loss; and counts) relative to itself."""
    logs = run.logs
    unit = torch.finfo(torch.float32).eps / 2
    cancelling = _from_logprobs(run.beta) if run.beta is not None else {}
    assert len(logs["patched"]) == len(logs["unpatched"]) == 2
    for ours, theirs in zip(logs["patched"], logs["unpatched"]):
        assert ours.keys() == theirs.keys()
        assert keys <= ours.keys(), ours.keys()
        for key, value in theirs.items():
            if key in cancelling:
                bound = cancelling[key] * HIDDEN_STATE_ROUNDING * unit * run.logit_scale
                assert abs(ours[key] - value) <= bound, (key, ours[key], value, bound)
            else:
                assert ours[key] == pytest.approx(value, rel=1e-4, abs=0), (key, ours, theirs)


def test_dpo_trainer_logs_what_it_logs_unpatched(tmp_path, monkeypatch):
    """DPOTrainer (TRL 1.16: its fused LM head over the patched model's layers, gradient
    checkpointing on) for two steps: the same metrics (loss, rewards, log-probs, margins,
    grad norm) as on the unpatched model, and the attention ran fastlm's varlen path."""
    monkeypatch.chdir(tmp_path)
    tokenizer = _tokenizer()
    texts = _texts(24)
    data = datasets.Dataset.from_dict(
        {"prompt": texts[:8], "chosen": texts[8:16], "rejected": texts[16:]}
    )
    run = _train_both(trl.DPOTrainer, trl.DPOConfig, data, tokenizer, monkeypatch)
    keys = {"loss", "grad_norm", "rewards/chosen", "rewards/margins", "logps/chosen"}
    _assert_same_logs(run, keys)


def test_kto_trainer_logs_what_it_logs_unpatched(tmp_path, monkeypatch):
    """KTOTrainer for two steps: the same metrics (loss, KL, rewards, log-probs) as on the
    unpatched model, and the attention ran fastlm's varlen path."""
    monkeypatch.chdir(tmp_path)
    tokenizer = _tokenizer()
    texts = _texts(16)
    data = datasets.Dataset.from_dict(
        {"prompt": texts[:8], "completion": texts[8:], "label": [True, False] * 4}
    )
    run = _train_both(trl.KTOTrainer, trl.KTOConfig, data, tokenizer, monkeypatch)
    _assert_same_logs(run, {"loss", "grad_norm", "kl"})


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_moe_trains_padding_free_under_sft(family, tmp_path, monkeypatch):
    """A tiny MoE model patched, under SFTTrainer with padding_free (TRL's one packed row with
    cu_seq_lens): its attention on fastlm's varlen path, no SDPA, its experts on
    fastlm.moe_experts forward and backward (the op on the kernels, `_experts_on_the_kernels`),
    and the metrics of the unpatched model trained on the same rows padded. gpt-oss: attention
    sinks, a sliding window on alternate layers, YaRN's half-width RoPE tables, clamped,
    interleaved, biased experts (its eager attention would attend across the packed documents:
    padding is its padding-free truth); Qwen3-MoE: a dense layer and an MoE one, SwiGLU
    experts."""
    from test_hf_families import tiny_model

    monkeypatch.chdir(tmp_path)
    _experts_on_the_kernels(monkeypatch)
    tokenizer = _tokenizer()
    data = datasets.Dataset.from_dict({"text": _texts()})
    model = tiny_model(family, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    unpatched = copy.deepcopy(model)
    builds = {
        "patched": lambda: _sft(
            fastlm.hf.patch(model), data, tokenizer, max_length=None, padding_free=True
        ),
        "unpatched": lambda: _sft(unpatched, data, tokenizer, max_length=None, padding_free=False),
    }
    # _Ops swaps PyTorch's SDPA for its counter, and _train's _Calls wraps that: monkeypatch
    # (last in, first out) puts the original back after both.
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    with _Ops() as calls:  # the unpatched model calls no fastlm op: these are the patched run's
        run = _train(builds, monkeypatch)
    _assert_experts_on_the_op(model, calls.calls)
    _assert_same_logs(run, {"loss", "grad_norm", "entropy", "mean_token_accuracy"})
