"""`python -m fastlm.cli.generate` on a checkpoint written by `fastlm.cli.train`: streaming, seeds,
whole characters from byte tokens, and one-line errors."""

import functools
import os
import subprocess
import sys

import pytest
import torch
from test_train import TOY

import fastlm
import fastlm.cli.generate as generate_cli
import fastlm.cli.train as train_cli
from fastlm.checkpoint import load_config, load_model
from fastlm.cli import THREAD_CROSSOVER_FLOPS, choose_threads
from fastlm.data import DataError
from fastlm.testing import assert_close
from fastlm.tokens import ByteTokenizer, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


# A tiny model that learns a repetitive corpus in 40 steps (the last of a repeated option counts).
TINY = [*TOY, "--num-layers", "1", "--batch-size", "8", "--steps", "40", "--lr", "1e-2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("generate")
    (folder / "corpus.txt").write_text("abcabcabd café " * 200)
    out = folder / "checkpoint"
    status = train_cli.main(["--data", str(folder / "corpus.txt"), *TINY, "--out", str(out)])
    assert status == 0
    return out


def generate(capsys, *argv) -> tuple[int, str, str]:
    status = generate_cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_generates_from_checkpoint(trained, capsys):
    args = [
        "--checkpoint",
        trained,
        "--prompt",
        "abc",
        "--max-new-tokens",
        "24",
        "--model",
        "reference",
    ]
    status, text, err = generate(capsys, *args, "--temperature", "0")
    assert status == 0, err
    assert text.startswith("abc") and text.endswith("\n")
    # 40 steps on a repetitive corpus: greedy decoding continues the pattern.
    assert "abcab" in text[3:]
    sampled = [
        generate(capsys, *args, "--seed", "3", "--top-k", "5", "--top-p", "0.9") for _ in range(2)
    ]
    for status, text, err in sampled:
        assert status == 0 and text.startswith("abc") and len(text) > 4, err
    assert sampled[0][1] == sampled[1][1]


def test_weights_file_path_and_package_function(trained, capsys):
    status, text, err = generate(
        capsys,
        "--checkpoint",
        trained / "model.safetensors",
        "--prompt",
        "é",
        "--max-new-tokens",
        "3",
        "--model",
        "reference",
    )
    assert status == 0 and text.startswith("é"), err
    # The documented Python call (the kernels' model on the CPU by default); importing the CLI
    # module rebinds the package attribute `sample`, and calling it still samples.
    model, tokenizer = load_model(trained)
    assert isinstance(model, fastlm.Transformer) and not model.training
    out = fastlm.sample(model, tokenizer.encode("ab").long(), 4, temperature=0)
    assert out.shape == (6,) and out[:2].tolist() == [97, 98]


def test_default_length_stays_within_the_context(trained, capsys):
    """The tiny model's context is 16: "abc" leaves 13 tokens, and a prompt that fills the
    context needs --max-new-tokens (past it the model attends to a sliding window only)."""
    argv = ["--checkpoint", trained, "--model", "reference", "--prompt"]
    status, text, err = generate(capsys, *argv, "abc")
    assert status == 0 and err.startswith("fastlm-generate: 13 tokens in"), err
    status, text, err = generate(capsys, *argv, "a" * 16)
    assert status == 2 and err.count("\n") == 1, err
    assert "the prompt's 16 tokens fill the model's context of 16" in err
    status, text, err = generate(capsys, *argv, "a" * 16, "--max-new-tokens", "2")
    assert status == 0 and err.startswith("fastlm-generate: 2 tokens in"), err
    # The thread count chosen (here given) is said.
    status, text, err = generate(capsys, *argv, "abc", "--threads", "1")
    assert status == 0 and "s on 1 CPU thread (--threads)" in err, err


def test_stop_at_eos(tmp_path, capsys, trained):
    """A model that has learnt to end "the fox" with <|endoftext|> stops there with
    --stop-at-eos (the token not printed) and goes on without it; a byte-tokenizer model, which
    has no end-of-text token, refuses the flag in one line."""
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["<|endoftext|>", "[UNK]"])
    tokenizer.train_from_iterator(["the fox"], trainer)
    tokenizer.save(str(tmp_path / "tok.json"))
    (tmp_path / "corpus.txt").write_text("the fox <|endoftext|> " * 200)
    out = tmp_path / "run"
    argv = ["--data", tmp_path / "corpus.txt", "--tokenizer", tmp_path / "tok.json", *TINY]
    assert train_cli.main([str(a) for a in [*argv, "--out", out]]) == 0
    capsys.readouterr()
    argv = ["--checkpoint", out, "--prompt", "the fox", "--temperature", "0", "--model"]
    status, text, err = generate(capsys, *argv, "reference", "--stop-at-eos")
    assert status == 0 and text == "the fox\n" and "0 tokens" in err, err
    assert err.rstrip().endswith("stopped at <|endoftext|>")
    status, text, err = generate(capsys, *argv, "reference", "--max-new-tokens", "2")
    # Without the flag it goes on (the tokenizer's decode leaves the special token out).
    assert status == 0 and "2 tokens" in err and text != "the fox\n", err
    argv = ["--checkpoint", trained, "--prompt", "abc", "--stop-at-eos"]
    status, _, err = generate(capsys, *argv)
    assert status == 2 and "--stop-at-eos: the tokenizer has no end-of-text token" in err, err


def test_byte_stream_never_splits_a_character():
    text = "naïve café — 速い 😀 end"
    decoder = ByteTokenizer().stream_decoder()
    pieces = [decoder.push(b) for b in text.encode()] + [decoder.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    # A lone continuation byte and a cut-off character become replacement characters.
    decoder = ByteTokenizer().stream_decoder()
    pieces = [decoder.push(b) for b in b"a\x80b\xe2\x82"] + [decoder.flush()]
    assert "".join(pieces) == "a\ufffdb\ufffd"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--checkpoint", "{tmp}/nowhere"], "no checkpoint"),
        (["--checkpoint", "{ckpt}", "--prompt", ""], "--prompt must not be empty"),
        (
            ["--checkpoint", "{ckpt}", "--top-p", "1.5"],
            "top_p must be a finite number in (0, 1], got 1.5",
        ),
        (
            ["--checkpoint", "{ckpt}", "--temperature", "-1"],
            "temperature must be a finite number in [0, 3.4e38], got -1.0",
        ),
        (["--checkpoint", "{ckpt}", "--temperature", "nan"], "temperature must be a finite number"),
        (["--checkpoint", "{ckpt}", "--max-new-tokens", "-1"], "--max-new-tokens"),
        (["--checkpoint", "{tmp}/broken"], "cannot read"),
        (["--checkpoint", "{ckpt}", "--device", "foo"], "--device must be cpu, cuda or cuda:N"),
        (["--checkpoint", "{ckpt}", "--device", "meta"], "--device must be cpu, cuda or cuda:N"),
        (["--checkpoint", "{ckpt}", "--device", "cuda:99"], "cuda:99 does not exist"),
        (
            ["--checkpoint", "{ckpt}", "--max-new-tokens", str(2**63)],
            "--max-new-tokens must be at most 2**63 - 1",
        ),
        (
            ["--checkpoint", "{ckpt}", "--prompt", "a\ud800"],
            "--prompt: the text holds U+D800, a lone surrogate",
        ),
    ],
)
def test_bad_input_is_one_line(argv, message, trained, tmp_path, capsys):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"not safetensors")
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{ckpt}", str(trained)) for a in argv]
    if "--prompt" not in argv:
        argv += ["--prompt", "abc"]
    status, text, err = generate(capsys, *argv, "--model", "reference")
    assert status == 2 and text == ""
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_cli_streams_and_errors_without_traceback(trained):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "fastlm.cli.generate",
        "--checkpoint",
        str(trained),
        "--model",
        "reference",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
    ]
    result = subprocess.run(
        [*command, "--prompt", "abc"], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("abc") and len(result.stdout) > 3
    assert "8 tokens" in result.stderr
    result = subprocess.run(
        [*command, "--prompt", "abc", "--top-k", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        == "fastlm-generate: error: top_k must be an int in [1, 2**63 - 1], got 0"
    )
    # A prompt byte that is not UTF-8, as a shell passes it: the byte tokenizer takes the byte.
    raw = [os.fsencode(a) for a in command]
    result = subprocess.run(
        [*raw, b"--prompt", b"ab\xff"], capture_output=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.startswith("ab\ufffd".encode()) and b"8 tokens" in result.stderr


def test_prompt_bytes_that_are_not_utf8(trained, capsys):
    """Python hands a command-line byte that is not UTF-8 over as a lone surrogate (the
    surrogateescape handler): the byte tokenizer encodes it as that byte, the model continues
    from it, and the echo shows it as U+FFFD, as a sampled one would be."""
    assert ByteTokenizer().encode("ab\udcff").tolist() == [97, 98, 255]
    args = ["--checkpoint", trained, "--model", "reference", "--temperature", "0"]
    status, text, err = generate(capsys, *args, "--prompt", "ab\udcff", "--max-new-tokens", "5")
    assert status == 0, err
    assert text.startswith("ab\ufffd") and len(text) > 4
    # A character the prompt leaves unfinished waits for the continuation; with none, U+FFFD.
    status, text, err = generate(capsys, *args, "--prompt", "caf\udcc3", "--max-new-tokens", "0")
    assert status == 0 and text == "caf\ufffd\n", err


def test_tokenizer_file_refuses_prompt_bytes_that_are_not_utf8(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    hf = load_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(DataError, match="byte 0xff, which is not UTF-8: a tokenizer.json"):
        hf.encode("ab\udcff")


def test_any_integer_seed(trained, capsys):
    """torch's generators take a seed modulo 2**64: seeds that differ by 2**64 sample alike."""
    args = ["--checkpoint", trained, "--prompt", "abc", "--model", "reference"]
    texts = []
    for seed in (2**70 + 5, 5, -(2**64) + 5):
        status, text, err = generate(capsys, *args, "--max-new-tokens", "12", "--seed", seed)
        assert status == 0, err
        texts.append(text)
    assert texts[0] == texts[1] == texts[2]


def test_fastlm_model_generates_like_the_reference(trained, capsys):
    args = [
        "--checkpoint",
        trained,
        "--prompt",
        "abca",
        "--max-new-tokens",
        "6",
        "--temperature",
        "0",
    ]
    status, with_fastlm, err = generate(capsys, *args, "--model", "fastlm")
    assert status == 0, err
    status, with_reference, err = generate(capsys, *args, "--model", "reference")
    assert with_fastlm == with_reference


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_cuda_without_cuda_is_one_line(trained, capsys):
    status, text, err = generate(
        capsys, "--checkpoint", trained, "--prompt", "abc", "--device", "cuda"
    )
    assert status == 2 and text == ""
    assert err.strip().splitlines() == [
        "fastlm-generate: error: cuda:0 does not exist (0 GPUs here): pass --device cpu or a GPU "
        "that exists (under torchrun: one process per GPU)"
    ]


def test_tiny_temperatures_sample_the_likeliest_token(trained):
    model, _ = generate_cli.load_model(trained, "reference", "cpu")
    prompt = torch.tensor([97, 98, 99])
    greedy = fastlm.sample(model, prompt, 6, temperature=0)
    for temperature in (1e-45, 1e-300, 5e-324):  # the last: the smallest float above 0
        assert torch.equal(fastlm.sample(model, prompt, 6, temperature=temperature), greedy)
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        fastlm.sample(model, prompt, 6, temperature=float("inf"))


def test_non_finite_logits_are_a_clear_error():
    class Diverged(torch.nn.Module):
        context_length = 8

        def forward(self, token_ids):
            return torch.full((*token_ids.shape, 5), float("nan"))

    with pytest.raises(ValueError, match="logits are not all finite"):
        fastlm.sample(Diverged(), torch.tensor([1, 2]), 3)


def test_reference_generates_through_one_window_shape(trained):
    # The reference's einx expressions are prepared once per input shape: every step feeds the
    # same padded window (it took ~40 s for 200 tokens when each new length was a new shape).
    model, _ = generate_cli.load_model(trained, "reference", "cpu")
    shapes = []
    model.register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape)))
    prompt = torch.tensor([97, 98])
    out = fastlm.sample(model, prompt, 20, temperature=0)  # past the context of 16: slides
    assert set(shapes) == {(1, model.context_length)} and len(shapes) == 20
    assert out.shape == (22,)  # that the padding changes no token: the test below


def test_threads_follow_the_steps_work_and_the_free_cores(trained, capsys, monkeypatch):
    """A thread, and one more for each THREAD_CROSSOVER_FLOPS of a step's work, within the cores
    the load leaves free; --threads and OMP_NUM_THREADS override; fastlm-generate passes its step's
    work (one token's forward: 2 FLOPs a weight) and says why."""
    crossover = THREAD_CROSSOVER_FLOPS
    assert choose_threads(None, 2, 0.0, {}, work=crossover * 0.99) == (
        1,
        f"the load 0.0 leaves 2 of 2 cores free; a step of {crossover * 0.99 / 1e9:.3g} GFLOP "
        "pays for 1",
    )
    assert choose_threads(None, 2, 0.0, {}, work=crossover) == (
        2,
        "the load 0.0 leaves 2 of 2 cores free",
    )
    assert choose_threads(None, 16, 0.0, {}, work=crossover * 3.5)[0] == 4
    assert choose_threads(None, 2, 7.3, {}, work=crossover * 100)[0] == 1  # the load's limit
    assert choose_threads(None, 2, 0.0, {}, work=None)[0] == 2  # work not known: the cores'
    assert choose_threads(None, 2, 0.0, {"OMP_NUM_THREADS": "2"}, work=1.0)[0] == 2
    assert choose_threads(2, 2, 0.0, {"OMP_NUM_THREADS": "1"}, work=1.0) == (2, "--threads")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    weights = sum(p.numel() for p in load_model(trained)[0].parameters())
    status, _, err = generate(
        capsys, "--checkpoint", trained, "--prompt", "ab", "--max-new-tokens", "1"
    )
    assert status == 0, err
    assert err.endswith(
        f"s on 1 CPU thread (the load 0.0 leaves 2 of 2 cores free; a step of "
        f"{2 * weights / 1e6:.3g} MFLOP pays for 1)\n"
    ), err


def test_past_the_context_the_kv_cache_slides(trained, monkeypatch):
    """Past the context (16) the fastlm model's cache slides: each step runs one token through
    the model (it ran the whole window), and the logits are those of a sliding-window attention
    over the whole text: the same weights at a context of the text's length, each token
    attending to itself and the 15 before it, all rotated by their absolute positions."""
    model, _ = load_model(trained)
    width = model.context_length
    fed, logits = [], []
    model.register_forward_pre_hook(lambda module, args: fed.append(args[0].shape[-1]))
    model.register_forward_hook(lambda module, args, out: logits.append(out[0, -1]))
    out = fastlm.sample(model, torch.tensor([97, 98, 99]), width + 3, temperature=0)
    assert fed == [3] + [1] * (width + 2)  # the last 6 steps past the context
    config = fastlm.ModelConfig.from_dict({**load_config(trained), "context_length": out.numel()})
    wide = fastlm.build_model(config, "fastlm", "cpu")
    wide.load_state_dict(model.state_dict())
    window = functools.partial(fastlm.model.flash_attention, window_size=(width - 1, 0))
    monkeypatch.setattr(fastlm.model, "flash_attention", window)  # the cached path's attention
    with torch.no_grad():
        windowed = wide(out[None], kv_cache=wide.make_kv_cache())[0]
    # Both in float32: the sums differ in order only (the ring's slots are not in position order).
    assert_close(torch.stack(logits), windowed[2:-1], torch.float32, "sliding cache's logits")
    cache = model.make_kv_cache()
    model(out[None, :width], kv_cache=cache)
    with pytest.raises(ValueError, match="token_ids: 16 cached .* slides one token at a time"):
        model(out[None, :2], kv_cache=cache)


def test_never_samples_ids_the_tokenizer_cannot_decode(tmp_path, capsys):
    # --vocab-size 300 with byte tokens: the ids 256..299 decode to nothing. At a high
    # temperature sampling is nearly uniform, so without the limit about one id in six of them.
    (tmp_path / "corpus.txt").write_text("abcabd " * 200)
    out = tmp_path / "big-vocab"
    extra = ["--num-layers", "1", "--steps", "2", "--vocab-size", "300", "--out", out]
    status = train_cli.main([str(a) for a in ["--data", tmp_path / "corpus.txt", *TOY, *extra]])
    assert status == 0
    capsys.readouterr()
    model, tokenizer = generate_cli.load_model(out, "reference", "cpu")
    prompt = torch.tensor([97])
    unlimited = fastlm.sample(
        model, prompt, 40, temperature=1000.0, generator=torch.Generator().manual_seed(0)
    )
    assert unlimited.max() >= 256  # the check below would be empty otherwise
    limited = fastlm.sample(
        model,
        prompt,
        40,
        temperature=1000.0,
        vocab_size=256,
        generator=torch.Generator().manual_seed(0),
    )
    assert limited.max() < 256
    status, text, err = generate(
        capsys,
        "--checkpoint",
        out,
        "--prompt",
        "a",
        "--model",
        "reference",
        "--max-new-tokens",
        "40",
        "--temperature",
        "1000",
    )
    assert status == 0 and "40 tokens" in err, err
    assert text.startswith("a") and text.endswith("\n")
