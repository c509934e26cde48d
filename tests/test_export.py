"""`fastlm-export --to-hf`: transformers' `from_pretrained` on the folder gives the logits of
fastlm-generate's model (interleaved RoPE included, by its exact q/k row permutation), with the
tokenizer's files when the run had one; fastlm-generate reads such a folder back."""

import contextlib
import json
import logging
import warnings

import pytest
import torch
from test_train import TOY, run_main

from fastlm.cli import export as export_cli
from fastlm.cli import generate as generate_cli
from fastlm.testing import assert_close
from fastlm.tokens import load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
transformers = pytest.importorskip("transformers")


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 80)
    return path


@pytest.fixture
def hf_tokenizer(tmp_path, corpus):
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.train([str(corpus)], tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path / "tok.json"
    tokenizer.save(str(path))
    return path


@contextlib.contextmanager
def transformers_warnings():
    """Every warning transformers gives inside the block, as a list of messages: its logger's
    records at WARNING and above (transformers' own handler writes to the stderr it found at
    import, which capsys does not see) and Python warnings."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)  # whatever TRANSFORMERS_VERBOSITY says
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield records
        records.extend(str(warning.message) for warning in caught)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def train(tmp_path, corpus, capsys, name, *options):
    out = tmp_path / name
    args = ["--data", corpus, *TOY, "--model", "fastlm", "--steps", "3", "--out", out, *options]
    status, _, err = run_main(args, capsys)
    assert status == 0, err
    return out


def export(argv, capsys):
    status = export_cli.main([str(a) for a in argv])
    return status, capsys.readouterr().err


LLAMA = ["--no-rope-interleaved", "--num-kv-heads", "1", "--tie-embeddings"]
CASES = {  # (training options, family)
    "interleaved": ([], "llama"),
    "llama": (LLAMA, "llama"),
    "qwen2": (LLAMA, "qwen2"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_export_then_from_pretrained_gives_the_same_logits(
    tmp_path, corpus, capsys, monkeypatch, case
):
    monkeypatch.setenv("FASTLM_BACKEND", "torch")  # the interpreted kernels are test_model's
    options, family = CASES[case]
    run = train(tmp_path, corpus, capsys, "run", "--rope-theta", "5000", *options)
    out = tmp_path / "hf"
    status, err = export(["--checkpoint", run, "--to-hf", out, "--family", family], capsys)
    assert status == 0, err
    assert {"config.json", "model.safetensors", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(hf_model).__name__ == {"llama": "Llama", "qwen2": "Qwen2"}[family] + "ForCausalLM"
    config = json.loads((out / "config.json").read_text())
    assert config["fastlm_tokenizer"] == "bytes" and config["max_position_embeddings"] == 16
    model, _ = generate_cli.load_model(run, "fastlm", "cpu")
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        expected = model(ids).double()
        got = hf_model(ids).logits.double()
    assert_close(got, expected, torch.float32, "transformers' logits")
    # fastlm-generate reads the folder back: the same model.
    again, tokenizer = generate_cli.load_model(out, "fastlm", "cpu")
    assert tokenizer.name == "bytes"
    with torch.no_grad():
        assert_close(again(ids).double(), expected, torch.float32, "re-imported logits")


def test_export_with_a_tokenizer_and_generate_from_the_folder(
    tmp_path, corpus, capsys, monkeypatch, hf_tokenizer
):
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    run = train(tmp_path, corpus, capsys, "run", "--tokenizer", hf_tokenizer)
    out = tmp_path / "hf"
    status, err = export(["--checkpoint", run, "--to-hf", out], capsys)
    assert status == 0, err
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    hf_tokenizer_loaded = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tokenizer_loaded("the quick fox")["input_ids"] == (
        load_tokenizer(hf_tokenizer).encode("the quick fox").tolist()
    )
    argv = ["--checkpoint", str(out), "--prompt", "the quick", "--temperature", "0"]
    status = generate_cli.main([*argv, "--max-new-tokens", "4"])
    captured = capsys.readouterr()
    assert status == 0 and captured.out.startswith("the quick"), captured.err
    status = generate_cli.main(["--checkpoint", str(run), *argv[2:], "--max-new-tokens", "4"])
    assert status == 0 and capsys.readouterr().out == captured.out  # the same greedy text


def test_export_carries_the_tokenizers_special_tokens(tmp_path, corpus, capsys, monkeypatch):
    """A BPE with <|endoftext|>: config.json, generation_config.json and tokenizer_config.json
    name its ids and tokens (not Llama's 1 and 2), model_max_length is the context, and
    transformers' generate stops at it, with max_new_tokens and no warning (a max_length in
    generation_config.json made each such call warn that both were set); --family qwen2, whose
    folder transformers would load as a Qwen2Tokenizer giving other ids, is refused in one
    line."""
    tokenizers = pytest.importorskip("tokenizers")
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train([str(corpus)], trainer)
    bpe.save(str(tmp_path / "bpe.json"))
    end = bpe.token_to_id("<|endoftext|>")
    run = train(tmp_path, corpus, capsys, "run", "--tokenizer", tmp_path / "bpe.json", *LLAMA)
    out = tmp_path / "hf"
    status, err = export(["--checkpoint", run, "--to-hf", out], capsys)
    assert status == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == end and config["bos_token_id"] is None
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == end and "max_length" not in generation
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|endoftext|>" and "bos_token" not in tokenizer_config
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    assert loaded.eos_token_id == end and loaded.model_max_length == 16
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():  # every logit 0: greedy picks id 0, <|endoftext|>
        hf_model.lm_head.weight.zero_()
    assert end == 0
    prompt = loaded("the quick", return_tensors="pt")["input_ids"]
    with transformers_warnings() as said:
        new = hf_model.generate(prompt, max_new_tokens=5, do_sample=False)[0, prompt.shape[1] :]
    assert new.tolist() == [end]  # stopped there, not after 5 tokens
    assert not said, said

    status, err = export(
        ["--checkpoint", run, "--to-hf", tmp_path / "q", "--family", "qwen2"], capsys
    )
    assert status == 2 and "as Qwen2Tokenizer" in err and "--family llama" in err, err
    assert not (tmp_path / "q").exists() and not (tmp_path / "q.tmp").exists()


def test_export_refusals(tmp_path, corpus, capsys, monkeypatch):
    monkeypatch.setenv("FASTLM_BACKEND", "torch")  # a checkpoint is all it needs: no kernels
    run = train(tmp_path, corpus, capsys, "run")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    status, err = export(["--checkpoint", run, "--to-hf", tmp_path / "taken"], capsys)
    assert status == 2 and "already exists" in err and (tmp_path / "taken" / "x").is_file()
    files = sorted(p.name for p in run.iterdir())
    for onto, relation in ((run, "is"), (tmp_path, "holds")):  # itself, its parent
        argv = ["--checkpoint", run, "--to-hf", onto, "--overwrite"]
        status, err = export(argv, capsys)
        assert status == 2 and f"--to-hf {onto} {relation} --checkpoint {run}" in err, err
    assert sorted(p.name for p in run.iterdir()) == files  # --resume still has it all
    status, err = export(["--checkpoint", tmp_path / "nothing", "--to-hf", tmp_path / "o"], capsys)
    assert status == 2 and "no checkpoint at" in err and not (tmp_path / "o").exists()
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text("{}")
    argv = ["--checkpoint", str(tmp_path / "bare"), "--prompt", "x"]
    assert generate_cli.main(argv) == 2
    assert "cannot load the Hugging Face model" in capsys.readouterr().err


MOE = ["--num-experts", "4", "--experts-per-token", "2", "--moe-d-ff", "24"]
MOE_CASES = {  # (training options, the family written, its class)
    # softmax router, no renormalisation, a dense first layer, shared experts (gated by 1/2)
    "softmax": (["--no-normalize-top-k", "--first-dense-layers", "1", "--num-shared-experts", "1"],
                "qwen2_moe", "Qwen2MoeForCausalLM"),
    # sigmoid router with its bias moved by training (a rate large enough to matter in 3 steps)
    "sigmoid": (["--router", "sigmoid", "--router-bias-rate", "0.05", "--num-shared-experts", "1"],
                "glm4_moe", "Glm4MoeForCausalLM"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_export_then_from_pretrained_gives_the_same_logits(
    tmp_path, corpus, capsys, monkeypatch, case
):
    """A mixture-of-experts checkpoint is written as its router's family by default;
    from_pretrained gives fastlm's logits; Qwen3-MoE (q/k norms) and a family of the other
    router are refused in one line."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")  # the interpreted kernels are test_moe_model's
    options, family, cls = MOE_CASES[case]
    run = train(tmp_path, corpus, capsys, "run", *MOE, *options)
    out = tmp_path / "hf"
    status, err = export(["--checkpoint", run, "--to-hf", out], capsys)
    assert status == 0, err
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(hf_model).__name__ == cls
    model, _ = generate_cli.load_model(run, "fastlm", "cpu")
    if case == "sigmoid":
        bias = model.moe_layers()[0].router.selection_bias
        assert bias.abs().sum() > 0  # the test exercises the bias
        assert torch.equal(hf_model.model.layers[0].mlp.gate.e_score_correction_bias, bias)
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert_close(hf_model(ids).logits.double(), model(ids).double(), torch.float32, "logits")
    capsys.readouterr()  # transformers' loading bars
    other = "glm4_moe" if family == "qwen2_moe" else "qwen2_moe"
    for wrong, message in (("qwen3_moe", "q_norm, k_norm"), (other, f"--family {family}")):
        status, err = export(["--checkpoint", run, "--to-hf", tmp_path / wrong, "--family", wrong],
                             capsys)  # fmt: skip
        assert status == 2 and err.count("\n") == 1 and message in err, err
