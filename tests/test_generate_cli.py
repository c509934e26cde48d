"""`python -m fastlm.generate` on a checkpoint written by `fastlm.train`: streaming, seeds,
whole characters from byte tokens, and one-line errors."""

import os
import subprocess
import sys

import pytest
import torch

import fastlm
import fastlm.generate as generate_cli
import fastlm.train as train_cli
from fastlm.data import ByteTokenizer


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("generate")
    (folder / "corpus.txt").write_text("abcabcabd café " * 200)
    out = folder / "checkpoint"
    status = train_cli.main(["--data", str(folder / "corpus.txt"), "--model", "reference",
                             "--d-model", "32", "--num-layers", "1", "--num-heads", "2",
                             "--d-ff", "64", "--context-length", "16", "--batch-size", "8",
                             "--steps", "40", "--lr", "1e-2", "--no-progress", "--device", "cpu",
                             "--out", str(out)])
    assert status == 0
    return out


def generate(capsys, *argv) -> tuple[int, str, str]:
    status = generate_cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_generates_from_checkpoint(trained, capsys):
    args = ["--checkpoint", trained, "--prompt", "abc", "--max-new-tokens", "24", "--model",
            "reference"]
    status, text, err = generate(capsys, *args, "--temperature", "0")
    assert status == 0, err
    assert text.startswith("abc") and text.endswith("\n")
    # 40 steps on a repetitive corpus: greedy decoding continues the pattern.
    assert "abcab" in text[3:]
    sampled = [generate(capsys, *args, "--seed", "3", "--top-k", "5", "--top-p", "0.9")
               for _ in range(2)]
    for status, text, err in sampled:
        assert status == 0 and text.startswith("abc") and len(text) > 4, err
    assert sampled[0][1] == sampled[1][1]


def test_weights_file_path_and_package_function(trained, capsys):
    status, text, err = generate(capsys, "--checkpoint", trained / "model.safetensors",
                                 "--prompt", "é", "--max-new-tokens", "3", "--model", "reference")
    assert status == 0 and text.startswith("é"), err
    # Importing the CLI module rebinds the package attribute; calling it still samples.
    model, _ = generate_cli.load_model(trained, "reference", "cpu")
    out = fastlm.generate(model, torch.tensor([97, 98]), 4, temperature=0)
    assert out.shape == (6,) and out[:2].tolist() == [97, 98]


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


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint", "{tmp}/nowhere"], "no checkpoint"),
    (["--checkpoint", "{ckpt}", "--prompt", ""], "--prompt must not be empty"),
    (["--checkpoint", "{ckpt}", "--top-p", "1.5"], "top_p must lie in (0, 1], got 1.5"),
    (["--checkpoint", "{ckpt}", "--temperature", "-1"], "temperature must be >= 0"),
    (["--checkpoint", "{ckpt}", "--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--checkpoint", "{tmp}/broken"], "cannot read"),
])
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
    command = [sys.executable, "-m", "fastlm.generate", "--checkpoint", str(trained),
               "--model", "reference", "--max-new-tokens", "8", "--temperature", "0"]
    result = subprocess.run([*command, "--prompt", "abc"], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("abc") and len(result.stdout) > 3
    assert "8 tokens" in result.stderr
    result = subprocess.run([*command, "--prompt", "abc", "--top-k", "0"], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == "fastlm.generate: error: top_k must be >= 1, got 0"


def test_fastlm_model_generates_like_the_reference(trained, capsys):
    args = ["--checkpoint", trained, "--prompt", "abca", "--max-new-tokens", "6",
            "--temperature", "0"]
    status, with_fastlm, err = generate(capsys, *args, "--model", "fastlm")
    assert status == 0, err
    status, with_reference, err = generate(capsys, *args, "--model", "reference")
    assert with_fastlm == with_reference
