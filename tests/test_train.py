"""`python -m fastlm.train` end to end at toy sizes: training, exact resume after Ctrl-C,
torchrun with DDP and FSDP2 on gloo, and the one-line errors for bad input."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fastlm.train as train_cli
from fastlm import checkpoint

TOY = ["--model", "reference", "--d-model", "32", "--num-layers", "2", "--num-heads", "2",
       "--d-ff", "64", "--context-length", "16", "--batch-size", "4", "--eval-every", "4",
       "--eval-batches", "2", "--no-progress"]

# Two threads on a shared two-core machine can be ten times slower than one.
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def corpus(tmp_path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    # Two files and a hidden one that must be skipped; text with multibyte characters.
    (folder / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 60)
    (folder / "b.txt").write_text("Größe, naïve café — 速い茶色の狐. " * 40)
    (folder / ".hidden").write_bytes(b"\0binary")
    return folder


def run_main(argv, capsys) -> tuple[int, dict | None, str]:
    """Exit status, the JSON summary (stdout's last line) and stderr of `main(argv)`."""
    status = train_cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    return status, json.loads(lines[-1]) if lines else None, captured.err


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_trains_end_to_end(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    status, summary, err = run_main(["--data", corpus, *TOY, "--steps", "12", "--lr", "1e-2",
                                     "--grad-accum", "2", "--out", out], capsys)
    assert status == 0, err
    for key in ("initial_loss", "final_loss", "val_loss", "tokens_per_second",
                "peak_memory_bytes", "checkpoint"):
        assert summary[key] is not None, key
    assert summary["final_loss"] < summary["initial_loss"] - 0.5
    assert summary["steps"] == 12 and summary["checkpoint"] == str(out)
    assert {"model.safetensors", "state.pt", "loss.png"} <= set(os.listdir(out))
    config = checkpoint.load_config(out)
    assert (config["d_model"], config["vocab_size"], config["tokenizer"]) == (32, 256, "bytes")
    assert len(checkpoint.load_state(out)["train_losses"]) == 12


def test_resume_after_ctrl_c_matches_uninterrupted_run(corpus, tmp_path, capsys, monkeypatch):
    args = ["--data", corpus, *TOY, "--steps", "8", "--save-every", "3"]
    status, full, err = run_main([*args, "--out", tmp_path / "full"], capsys)
    assert status == 0, err

    # A real SIGINT in the middle of step 5 (during its gradient clip): the loop finishes the
    # step, checkpoints it, and exits with 130.
    clip, calls = train_cli.reference.gradient_clip, []

    def clip_then_interrupt(parameters, max_norm):
        calls.append(1)
        if len(calls) == 5:
            signal.raise_signal(signal.SIGINT)
        return clip(parameters, max_norm)

    monkeypatch.setattr(train_cli.reference, "gradient_clip", clip_then_interrupt)
    out = tmp_path / "split"
    status, part, err = run_main([*args, "--out", out], capsys)
    assert status == 130 and part["interrupted"] and part["steps"] == 5, err
    assert checkpoint.load_state(out)["step"] == 5
    monkeypatch.setattr(train_cli.reference, "gradient_clip", clip)

    status, resumed, err = run_main([*args, "--out", out, "--resume"], capsys)
    assert status == 0, err
    assert "note" not in err  # same settings: no warning about a different curve
    expected, got = checkpoint.load_state(tmp_path / "full"), checkpoint.load_state(out)
    assert got["train_losses"] == expected["train_losses"]  # bitwise on CPU
    assert got["val_losses"] == expected["val_losses"]
    assert resumed["initial_loss"] == full["initial_loss"]
    assert resumed["final_loss"] == full["final_loss"]
    weights = checkpoint.load_weights(out)
    expected_weights = checkpoint.load_weights(tmp_path / "full")
    assert all(torch.equal(weights[k], expected_weights[k]) for k in expected_weights)


def test_fastlm_model_trains(corpus, tmp_path, capsys):
    argv = ["--data", corpus, *TOY, "--model", "fastlm", "--d-model", "16", "--num-layers", "1",
            "--context-length", "8", "--batch-size", "2", "--steps", "2", "--eval-batches", "1",
            "--out", tmp_path / "fastlm"]
    status, summary, err = run_main(argv, capsys)
    assert status == 0, err
    assert summary["model"] == "fastlm" and summary["final_loss"] < 6


@pytest.fixture
def good_checkpoint(corpus, tmp_path, capsys) -> Path:
    out = tmp_path / "good"
    status, _, err = run_main(["--data", corpus, *TOY, "--steps", "2", "--out", out], capsys)
    assert status == 0, err
    return out


@pytest.mark.parametrize("case, extra, message", [
    ("missing data", ["--data", "{tmp}/nowhere", "--overwrite"], "no such file or folder"),
    ("empty corpus", ["--data", "{tmp}/empty.txt", "--overwrite"], "empty"),
    ("corpus too small", ["--data", "{tmp}/short.txt", "--overwrite"], "too small"),
    ("context too long", ["--context-length", "4096", "--overwrite"], "longer than preset tiny"),
    ("other config", ["--d-model", "48", "--resume"], "d_model 32 (checkpoint) vs 48"),
    ("existing checkpoint", [], "already holds a checkpoint"),
    ("missing tokenizer", ["--tokenizer", "{tmp}/none.json", "--overwrite"], "tokenizer"),
])
def test_bad_input_is_one_line_and_keeps_checkpoint(case, extra, message, corpus, tmp_path,
                                                    good_checkpoint, capsys):
    (tmp_path / "empty.txt").write_text(" \n")
    (tmp_path / "short.txt").write_text("tiny")
    before = file_hashes(good_checkpoint)
    extra = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    status, summary, err = run_main(["--data", corpus, *TOY, "--steps", "4", *extra,
                                     "--out", good_checkpoint], capsys)
    assert status == 2 and summary is None
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert file_hashes(good_checkpoint) == before


def test_hf_tokenizer(corpus, tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    tokenizer.train([str(corpus / "a.txt")], trainer)
    path = tmp_path / "tok.json"
    tokenizer.save(str(path))
    out = tmp_path / "hf"
    status, summary, err = run_main(["--data", corpus / "a.txt", "--tokenizer", path, *TOY,
                                     "--steps", "2", "--out", out], capsys)
    assert status == 0, err
    assert checkpoint.load_config(out)["vocab_size"] == tokenizer.get_vocab_size()
    assert (out / "tokenizer.json").is_file()


def test_missing_tokenizers_package_is_one_line(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    (tmp_path / "tok.json").write_text("{}")
    status, _, err = run_main(["--data", corpus, *TOY, "--tokenizer", tmp_path / "tok.json",
                               "--out", tmp_path / "out"], capsys)
    assert status == 2 and err.strip() == ("fastlm.train: error: --tokenizer needs the "
                                           "`tokenizers` package: pip install tokenizers")


def test_without_matplotlib_a_note_replaces_the_png(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "run"
    status, summary, err = run_main(["--data", corpus, *TOY, "--steps", "2", "--out", out], capsys)
    assert status == 0 and summary["loss_curve"] is None
    assert "matplotlib is not installed" in err and not (out / "loss.png").exists()


def test_cli_error_has_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "fastlm.train", "--data", str(tmp_path / "no"),
                             "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, env=SUBPROCESS_ENV, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"fastlm.train: error: --data: no such file or folder: {tmp_path / 'no'}"]
    assert not (tmp_path / "out").exists()


# Every rank hashes the weights it holds at each save; DDP replicas must agree bit for bit.
RANK_SCRIPT = textwrap.dedent("""
    import hashlib, sys
    import torch.distributed as dist
    import fastlm.train as train_cli

    full_state = train_cli.full_state

    def hashing_full_state(loss_module, optimizer):
        digest = hashlib.sha256()
        for tensor in loss_module.model.state_dict().values():
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP: a shard
            digest.update(local.detach().cpu().numpy().tobytes())
        with open(f"{sys.argv[1]}/hash-{dist.get_rank()}.txt", "w") as f:
            f.write(digest.hexdigest())
        return full_state(loss_module, optimizer)

    train_cli.full_state = hashing_full_state
    sys.exit(train_cli.main(sys.argv[2:]))
""")


def torchrun(tmp_path, corpus, name, *extra):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    hashes = tmp_path / f"hashes-{name}"
    hashes.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               "--standalone", str(script), str(hashes), "--data", str(corpus), *TOY,
               "--steps", "4", "--out", str(tmp_path / name), *extra]
    result = subprocess.run(command, capture_output=True, text=True, env=SUBPROCESS_ENV,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    return summary, sorted(p.read_text() for p in hashes.iterdir())


def test_torchrun_ddp_and_fsdp_on_gloo(tmp_path, corpus):
    ddp, ddp_hashes = torchrun(tmp_path, corpus, "ddp")
    assert ddp["world_size"] == 2 and ddp["final_loss"] < ddp["initial_loss"]
    assert len(ddp_hashes) == 2 and ddp_hashes[0] == ddp_hashes[1]
    # FSDP2 shards the same computation: the same losses up to summation order.
    fsdp, _ = torchrun(tmp_path, corpus, "fsdp", "--fsdp")
    assert fsdp["final_loss"] == pytest.approx(ddp["final_loss"], rel=1e-5)
    assert fsdp["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-5)
    weights = checkpoint.load_weights(tmp_path / "fsdp")
    ddp_weights = checkpoint.load_weights(tmp_path / "ddp")
    assert all(torch.allclose(weights[k], ddp_weights[k], rtol=1e-4, atol=1e-6) for k in weights)
