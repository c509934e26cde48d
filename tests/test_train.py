"""`python -m fastlm.cli.train` end to end at toy sizes: training, exact resume after Ctrl-C,
checkpoints that survive a crash during their save, torchrun with DDP and FSDP2 on gloo, and the
one-line errors for bad input."""

import contextlib
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

import fastlm.cli.train as train_cli
import fastlm.cli.trainer as training
from fastlm import checkpoint, reference
from fastlm.cli import choose_threads
from fastlm.kernels.attention import MAX_HEAD_DIM

# CPU tests (bitwise resume holds on CPU), also on a machine with GPUs.
TOY = [
    "--model",
    "reference",
    "--d-model",
    "32",
    "--num-layers",
    "2",
    "--num-heads",
    "2",
    "--d-ff",
    "64",
    "--context-length",
    "16",
    "--batch-size",
    "4",
    "--eval-every",
    "4",
    "--eval-batches",
    "2",
    "--no-progress",
    "--device",
    "cpu",
]

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


@contextlib.contextmanager
def sigint_in_step(step: int):
    """A real SIGINT in the middle of training step `step` (during its gradient clip, the
    reference's, which CPU runs call once a step)."""
    clip, calls = train_cli.reference.gradient_clip, []

    def clip_then_interrupt(parameters, max_norm):
        calls.append(1)
        if len(calls) == step:
            signal.raise_signal(signal.SIGINT)
        return clip(parameters, max_norm)

    train_cli.reference.gradient_clip = clip_then_interrupt
    try:
        yield
    finally:
        train_cli.reference.gradient_clip = clip


def test_trains_end_to_end(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    status, summary, err = run_main(
        [
            "--data",
            corpus,
            *TOY,
            "--steps",
            "12",
            "--lr",
            "1e-2",
            "--grad-accum",
            "2",
            "--out",
            out,
        ],
        capsys,
    )
    assert status == 0, err
    for key in (
        "initial_loss",
        "final_loss",
        "val_loss",
        "tokens_per_second",
        "peak_memory_bytes",
        "checkpoint",
    ):
        assert summary[key] is not None, key
    assert summary["final_loss"] < summary["initial_loss"] - 0.5
    assert summary["steps"] == 12 and summary["checkpoint"] == str(out)
    assert {"model.safetensors", "state.pt", "loss.png"} <= set(os.listdir(out))
    config = checkpoint.load_config(out)
    assert (config["d_model"], config["vocab_size"], config["tokenizer"]) == (32, 256, "bytes")
    assert len(checkpoint.load_state(out)["train_losses"]) == 12


@pytest.mark.parametrize("model", ["reference", "fastlm"])
def test_resume_after_ctrl_c_matches_uninterrupted_run(
    model, corpus, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("FASTLM_BACKEND", "torch")  # the interpreted kernels are test_model's
    args = ["--data", corpus, *TOY, "--model", model, "--steps", "8", "--save-every", "3"]
    status, full, err = run_main([*args, "--out", tmp_path / "full"], capsys)
    assert status == 0, err

    # A real SIGINT in the middle of step 5 (during its gradient clip): the loop finishes the
    # step, checkpoints it, and exits with 130.
    out = tmp_path / "split"
    with sigint_in_step(5):
        status, part, err = run_main([*args, "--out", out], capsys)
    assert status == 130 and part["interrupted"] and part["steps"] == 5, err
    assert checkpoint.load_state(out)["step"] == 5

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


def test_fastlm_model_trains_like_the_reference(corpus, tmp_path, capsys, monkeypatch):
    # The same seed gives both models the same initial weights and batches. fastlm's PyTorch
    # path (its kernels run interpreted in test_model, too slowly for training here) computes
    # the same math in another order (chunked linear cross-entropy, residual adds fused into
    # the norms): the losses differ by float32 rounding, 1e-7 relative after 8 steps
    # (measured), so 1e-5 leaves room for the steps to amplify it yet fails on any real change.
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    losses = {}
    for model in ("reference", "fastlm"):
        status, summary, err = run_main(
            ["--data", corpus, *TOY, "--model", model, "--steps", "8", "--out", tmp_path / model],
            capsys,
        )
        assert status == 0 and summary["model"] == model, err
        state = checkpoint.load_state(tmp_path / model)
        losses[model] = state["train_losses"] + [loss for _, loss in state["val_losses"]]
    assert losses["reference"][-3] < losses["reference"][0] - 0.3  # it learns
    assert losses["fastlm"] == pytest.approx(losses["reference"], rel=1e-5, abs=0)


def test_grad_clip_zero_leaves_gradients(corpus):
    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    training.clip_gradients(model, 0.0, torch.device("cpu"), fsdp=False)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    training.clip_gradients(model, 1e-3, torch.device("cpu"), fsdp=False)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert norm == pytest.approx(1e-3, rel=1e-3)


# Each crash point is the n-th call of a step of `checkpoint.save`, made to raise as a SIGKILL
# there would stop it; the step it was about to write is `crashed_step`, the last good one before.
CRASHES = {
    "writing the files": ("torch.save", 1),
    "before moving the old folder aside": ("rename", 1),
    "between the two renames": ("rename", 2),
    "before deleting the old folder": ("rmtree", 3),
}


@pytest.mark.parametrize("crash", list(CRASHES))
def test_crash_during_save_keeps_a_consistent_checkpoint(crash, tmp_path, monkeypatch):
    out = tmp_path / "checkpoint"

    def save(step):
        weights = {"w": torch.full((3,), float(step))}
        checkpoint.save(out, weights, {"size": 3}, step, {"losses": [float(step)]})

    def loads_step(step):
        assert checkpoint.load_state(out) == {"losses": [float(step)], "step": step}
        assert checkpoint.load_weights(out)["w"].tolist() == [float(step)] * 3

    save(1)
    (out / "loss.png").write_bytes(b"png")  # a checkpoint file besides the two
    name, crash_at = CRASHES[crash]
    owner, attribute = {
        "torch.save": (torch, "save"),
        "rename": (Path, "rename"),
        "rmtree": (checkpoint.shutil, "rmtree"),
    }[name]
    real, calls = getattr(owner, attribute), []

    def crashing(*args, **kwargs):
        calls.append(args)
        if len(calls) == crash_at:
            raise OSError(f"simulated crash in {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, attribute, crashing)
    # A failed write is reported as a CheckpointError (saying what space the checkpoint needs),
    # a failed rename as the OSError itself.
    with pytest.raises((OSError, checkpoint.CheckpointError), match="simulated crash"):
        save(2)
    monkeypatch.setattr(owner, attribute, real)
    # Only once the new folder is in place does the checkpoint move on to step 2.
    loads_step(2 if crash == "before deleting the old folder" else 1)
    assert checkpoint.exists(out)
    save(3)  # the next save recovers: step 3 in `out`, no leftovers beside it
    loads_step(3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
    assert sorted(os.listdir(out)) == ["checkpoint.json", "model.safetensors", "state.pt"]


def test_resume_after_a_crash_between_the_renames(corpus, tmp_path, capsys, monkeypatch):
    args = ["--data", corpus, *TOY, "--steps", "4", "--save-every", "2"]
    status, _, err = run_main([*args, "--out", tmp_path / "full"], capsys)
    assert status == 0, err
    # The step-2 save renames once (there is no old folder yet), the step-4 save twice: its
    # second rename, which moves the new folder into place, fails as a SIGKILL would stop it.
    real, calls = Path.rename, []

    def crashing_rename(self, target):
        calls.append(self)
        if len(calls) == 3:
            raise OSError("simulated crash")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", crashing_rename)
    out = tmp_path / "run"
    with pytest.raises(OSError, match="simulated crash"):
        run_main([*args, "--out", out], capsys)
    monkeypatch.setattr(Path, "rename", real)
    assert not out.exists() and checkpoint.load_state(out)["step"] == 2  # from run.old

    status, _, err = run_main([*args, "--out", out, "--resume"], capsys)
    assert status == 0, err
    expected = checkpoint.load_state(tmp_path / "full")["train_losses"]
    assert checkpoint.load_state(out)["train_losses"] == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "full", "run"]


def test_cpu_threads_are_chosen_from_the_load_and_said(corpus, tmp_path, capsys):
    """--threads, else OMP_NUM_THREADS, else the cores the load leaves free (at least one); the
    choice is in the start line and each evaluation's line; a bad --threads is one line."""
    assert choose_threads(None, 2, 7.3, {}) == (1, "the load 7.3 leaves 1 of 2 cores free")
    assert choose_threads(None, 8, 1.6, {})[0] == 6
    assert choose_threads(None, 4, 0.0, {"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS")
    assert choose_threads(2, 4, 9.0, {"OMP_NUM_THREADS": "3"}) == (2, "--threads")
    args = ["--data", corpus, *TOY, "--steps", "4", "--out", tmp_path / "run", "--threads", "1"]
    status, _, err = run_main(args, capsys)
    assert status == 0 and "1 x cpu, 1 CPU thread (--threads)" in err, err
    assert "tokens/s on 1 CPU thread" in err
    status, _, err = run_main([*args[:-1], "0"], capsys)
    assert status == 2 and "--threads must be at least 1, got 0" in err, err


def test_folder_with_other_files_is_refused(corpus, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    status, _, err = run_main(["--data", corpus, *TOY, "--steps", "2", "--out", out], capsys)
    assert status == 2 and "holds other files than a checkpoint's (notes.txt)" in err, err
    assert os.listdir(out) == ["notes.txt"]


@pytest.fixture
def good_checkpoint(corpus, tmp_path, capsys) -> Path:
    out = tmp_path / "good"
    status, _, err = run_main(["--data", corpus, *TOY, "--steps", "2", "--out", out], capsys)
    assert status == 0, err
    return out


@pytest.mark.parametrize(
    "case, extra, message",
    [
        ("missing data", ["--data", "{tmp}/nowhere", "--overwrite"], "no such file or folder"),
        ("empty corpus", ["--data", "{tmp}/empty.txt", "--overwrite"], "empty"),
        ("corpus too small", ["--data", "{tmp}/short.txt", "--overwrite"], "too small"),
        (
            "context too long",
            ["--context-length", "4096", "--overwrite"],
            "longer than preset tiny",
        ),
        ("negative clip", ["--grad-clip", "-1", "--overwrite"], "--grad-clip must be non-negative"),
        ("missing GPU", ["--device", "cuda:7", "--overwrite"], "cuda:7 does not exist"),
        ("other config", ["--d-model", "48", "--resume"], "d_model 32 (checkpoint) vs 48"),
        ("existing checkpoint", [], "already holds a checkpoint"),
        ("missing tokenizer", ["--tokenizer", "{tmp}/none.json", "--overwrite"], "tokenizer"),
        # Numbers that argparse takes but nothing can train with: refused before anything runs.
        ("lr nan", ["--lr", "nan", "--overwrite"], "--lr must be a finite number, got nan"),
        ("lr inf", ["--lr", "inf", "--overwrite"], "--lr must be a finite number, got inf"),
        ("min-lr nan", ["--min-lr", "nan", "--overwrite"], "--min-lr must be a finite number"),
        (
            "weight decay nan",
            ["--weight-decay", "nan", "--overwrite"],
            "--weight-decay must be a finite number",
        ),
        (
            "negative weight decay",
            ["--weight-decay", "-0.1", "--overwrite"],
            "--weight-decay must be non-negative",
        ),
        ("grad clip nan", ["--grad-clip", "nan", "--overwrite"], "--grad-clip must be a finite"),
        (
            "rope theta 0",
            ["--rope-theta", "0", "--overwrite"],
            "--rope-theta must be a finite number in [1, 3.4e38], got 0.0",
        ),
        (
            "rope theta -5",
            ["--rope-theta", "-5", "--overwrite"],
            "--rope-theta must be a finite number in [1, 3.4e38], got -5.0",
        ),
        ("rope theta nan", ["--rope-theta", "nan", "--overwrite"], "--rope-theta must be a finite"),
        ("betas", ["--betas", "1.5", "0.9", "--overwrite"], "--betas must both lie in [0, 1)"),
        ("device foo", ["--device", "foo", "--overwrite"], "--device must be cpu, cuda or cuda:N"),
        (
            "device meta",
            ["--device", "meta", "--overwrite"],
            "--device must be cpu, cuda or cuda:N",
        ),
        (
            "odd head dim",
            ["--d-model", "30", "--num-heads", "2", "--overwrite"],
            "--d-model 30 / --num-heads 2 gives heads of 15 dims, but RoPE rotates pairs",
        ),
        # Finite, but beyond what the optimizer or the model's float32 tables can hold.
        ("lr 1e300", ["--lr", "1e300", "--overwrite"], "--lr 1e+300 is too large"),
        ("min-lr 1e300", ["--min-lr", "1e300", "--overwrite"], "--min-lr 1e+300 is too large"),
        (
            "weight decay 1e300",
            ["--weight-decay", "1e300", "--overwrite"],
            "--weight-decay 1e+300 times the largest learning rate",
        ),
        (
            "rope theta 1e-300",
            ["--rope-theta", "1e-300", "--overwrite"],
            "--rope-theta must be a finite number in [1, 3.4e38], got 1e-300",
        ),
        (
            "norm eps 1e300",
            ["--norm-eps", "1e300", "--overwrite"],
            "--norm-eps must be a finite number in (0, 3.4e38], got 1e+300",
        ),
        # Integers past 64 bits, and sizes no memory here holds.
        ("steps 2**70", ["--steps", str(2**70), "--overwrite"], "--steps must be at most 2**63"),
        ("grad accum 10**20", ["--grad-accum", "1" + "0" * 20, "--overwrite"], "--grad-accum"),
        ("batch size 10**20", ["--batch-size", "1" + "0" * 20, "--overwrite"], "--batch-size"),
        ("batch size 10**15", ["--batch-size", "1" + "0" * 15, "--overwrite"], "needs at least"),
        ("d-ff 10**11", ["--d-ff", "1" + "0" * 11, "--overwrite"], "needs at least"),
        ("layers 10**18", ["--num-layers", "1" + "0" * 18, "--overwrite"], "needs at least"),
        ("vocab 10**12", ["--vocab-size", "1" + "0" * 12, "--overwrite"], "needs at least"),
        ("eval batches 10**15", ["--eval-batches", "1" + "0" * 15, "--overwrite"], "needs at"),
    ],
)
def test_bad_input_is_one_line_and_keeps_checkpoint(
    case, extra, message, corpus, tmp_path, good_checkpoint, capsys
):
    (tmp_path / "empty.txt").write_text(" \n")
    (tmp_path / "short.txt").write_text("tiny")
    before = file_hashes(good_checkpoint)
    extra = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    status, summary, err = run_main(
        ["--data", corpus, *TOY, "--steps", "4", *extra, "--out", good_checkpoint], capsys
    )
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
    status, summary, err = run_main(
        ["--data", corpus / "a.txt", "--tokenizer", path, *TOY, "--steps", "2", "--out", out],
        capsys,
    )
    assert status == 0, err
    assert checkpoint.load_config(out)["vocab_size"] == tokenizer.get_vocab_size()
    assert (out / "tokenizer.json").is_file()
    # --overwrite never deletes an input: here the tokenizer copy inside the checkpoint.
    copy, before = out / "tokenizer.json", file_hashes(out)
    argv = ["--data", corpus / "a.txt", "--tokenizer", copy, *TOY, "--out", out, "--overwrite"]
    status, _, err = run_main(argv, capsys)
    assert status == 2 and f"--out {out} holds --tokenizer {copy}, which this" in err, err
    assert file_hashes(out) == before


def test_missing_tokenizers_package_is_one_line(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    (tmp_path / "tok.json").write_text("{}")
    status, _, err = run_main(
        ["--data", corpus, *TOY, "--tokenizer", tmp_path / "tok.json", "--out", tmp_path / "out"],
        capsys,
    )
    assert status == 2 and err.strip() == (
        "fastlm-train: error: --tokenizer needs the `tokenizers` package: pip install tokenizers"
    )


def test_without_matplotlib_a_note_replaces_the_png(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "run"
    status, summary, err = run_main(["--data", corpus, *TOY, "--steps", "2", "--out", out], capsys)
    assert status == 0 and summary["loss_curve"] is None
    assert "matplotlib is not installed" in err and not (out / "loss.png").exists()


def test_cli_error_has_no_traceback(tmp_path):
    """A data path that does not exist, found once --out is locked: one line, and nothing left
    behind, not even the folders the lock made for --out."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastlm.cli.train",
            "--data",
            str(tmp_path / "no"),
            "--out",
            str(tmp_path / "new" / "out"),
        ],
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
        timeout=120,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"fastlm-train: error: --data: no such file or folder: {tmp_path / 'no'}"
    ]
    assert os.listdir(tmp_path) == []


def strict_json(line: str) -> dict:
    """json.loads without Python's extensions: a bare NaN or Infinity is an error, as elsewhere."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_head_dim_the_kernels_cannot_run(corpus, tmp_path, capsys, monkeypatch):
    # Heads of 2 dims: PyTorch's attention runs them, fastlm's kernel does not (it takes
    # multiples of 8). Where the kernels would run the command refuses before training, saying
    # what to change; with the PyTorch backend it trains, as the reference does.
    args = [
        "--data",
        corpus,
        *TOY,
        "--model",
        "fastlm",
        "--d-model",
        "16",
        "--num-heads",
        "8",
        "--steps",
        "2",
    ]
    monkeypatch.setenv("FASTLM_BACKEND", "triton")
    status, summary, err = run_main([*args, "--out", tmp_path / "kernels"], capsys)
    assert status == 2 and summary is None and not (tmp_path / "kernels").exists()
    assert err.strip().splitlines() == [
        "fastlm-train: error: --d-model 16 / --num-heads 8 gives heads of 2 dims, but fastlm's "
        f"attention kernel takes multiples of 8 up to {MAX_HEAD_DIM}: change --d-model or "
        "--num-heads (with --d-model 16: --num-heads 2), or run PyTorch's attention with "
        "FASTLM_BACKEND=torch"
    ]
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    status, summary, err = run_main([*args, "--out", tmp_path / "torch"], capsys)
    assert status == 0 and summary["steps"] == 2, err


@pytest.mark.parametrize(
    "resume, save_every, cause, step",
    [
        # The first update leaves the weights finite, but no loss of them is: the save that
        # step asks for is refused.
        (False, 1, "the weights of step 1 are not finite or give no finite loss", 1),
        # No save before the end: the training loss of step 2 is the first that is not finite.
        (False, 0, "the training loss is nan at step 2", 2),
        # Resumed from step 2: the held-out loss of step 4 is NaN, before the save of step 4.
        (True, 2, "the held-out loss is nan at step 4", 4),
    ],
)
def test_a_diverging_run_stops_and_keeps_the_last_good_checkpoint(
    resume, save_every, cause, step, corpus, tmp_path, capsys, good_checkpoint
):
    """A learning rate that the checks let through but that blows the weights up. The run stops
    at the first loss or weight that is not finite, says so, exits with status 3 and writes
    nothing from then on: a resumed checkpoint stays as it was, a fresh run leaves none. The
    summary is strict JSON."""
    out = good_checkpoint if resume else tmp_path / "fresh"
    before = file_hashes(good_checkpoint)
    args = ["--lr", "1e30", "--weight-decay", "0", "--grad-clip", "0", "--save-every", save_every]
    status = train_cli.main(
        [str(a) for a in ["--data", corpus, *TOY, "--steps", "6", *args, "--out", out]]
        + (["--resume"] if resume else [])
    )
    stdout, err = capsys.readouterr()
    summary = strict_json(stdout.strip().splitlines()[-1])
    assert status == 3, err
    assert summary["diverged"] is True and summary["val_loss"] is None, summary
    assert f"fastlm-train: {cause}: the run diverged and stops, saving nothing more" in err, err
    assert summary["steps"] == step
    if resume:
        assert f"{out} keeps the checkpoint of step 2" in err, err
        assert summary["checkpoint"] == str(out)
    else:
        assert f"nothing was written to {out}" in err, err
        assert summary["checkpoint"] is None and summary["loss_curve"] is None
        assert not out.exists() and not Path(f"{out}.lock").exists()
    assert file_hashes(good_checkpoint) == before


def test_any_integer_seed(corpus, tmp_path, capsys):
    """Seeds past torch's 64 bits (either sign): torch's generators take them modulo 2**64."""
    for seed in (2**70, -(2**70)):
        args = ["--data", corpus, *TOY, "--steps", "2", "--seed", seed]
        status, summary, err = run_main([*args, "--out", tmp_path / str(seed)], capsys)
        assert status == 0 and summary["steps"] == 2, err


def test_resume_notes(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--data", corpus, *TOY, "--out", out]
    status, _, err = run_main([*args, "--steps", "4"], capsys)
    assert status == 0, err
    before = file_hashes(out)
    # At or below the checkpoint's step: nothing to do, and it says so.
    for steps in ("4", "3"):
        status, summary, err = run_main(
            [*args, "--steps", steps, "--warmup", "0", "--resume"], capsys
        )
        assert status == 0 and summary["steps"] == 4, err
        assert (
            f"note: the checkpoint is at step 4 and --steps is {steps}: nothing to train "
            "(a larger --steps continues it)"
        ) in err, err
        assert file_hashes(out) == before
    # A larger --steps stretches the learning-rate schedule: the note says what changes.
    status, summary, err = run_main([*args, "--steps", "8", "--resume"], capsys)
    assert status == 0 and summary["steps"] == 8, err
    lr = train_cli.PRESETS["tiny"]["lr"]  # TOY's, and --min-lr is lr / 10
    lr_before = train_cli.reference.cos_lr_scheduler(4, lr, lr / 10, 0, 4)
    lr_after = train_cli.reference.cos_lr_scheduler(5, lr, lr / 10, 0, 8)
    assert (
        "note: resuming with --steps 8 (was 4), so from step 5 on the run differs from the "
        "one the checkpoint began; the learning-rate schedule (warm-up, then cosine decay to "
        "--min-lr at --steps) now follows the new settings: the rate goes from "
        f"{lr_before:.3g} at step 4 to {lr_after:.3g} at step 5"
    ) in err, err


def test_log_lines_instead_of_a_progress_bar_when_stderr_is_not_a_terminal(
    corpus, tmp_path, capsys
):
    toy = [a for a in TOY if a != "--no-progress"]
    status, _, err = run_main(
        ["--data", corpus, *toy, "--steps", "8", "--out", tmp_path / "run"], capsys
    )
    assert status == 0, err
    assert "\r" not in err and "training:" not in err, err  # no bar redraws in a log
    steps = [line.split(":")[0] for line in err.splitlines() if line.startswith("step ")]
    assert steps == ["step 4/8", "step 8/8"], err
    assert "training loss" in err and "tokens/s" in err


def test_skipped_and_repaired_corpus_files_are_named(tmp_path, capsys):
    folder = tmp_path / "binary"
    folder.mkdir()
    (folder / "image.bin").write_bytes(b"\x89PNG\0\0\0")
    (folder / "notes-utf16.txt").write_bytes("plain notes".encode("utf-16"))
    status, _, err = run_main(["--data", folder, *TOY, "--out", tmp_path / "out"], capsys)
    assert status == 2
    assert err.strip().splitlines() == [
        f"fastlm-train: error: the corpus at {folder} is empty (skipped as binary, with NUL "
        f"bytes: {folder / 'image.bin'}, {folder / 'notes-utf16.txt'}; UTF-16 text must be "
        "converted to UTF-8)"
    ]
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Un café, deux cafés. ".encode("latin-1") * 100)
    status, _, err = run_main(
        ["--data", latin1, *TOY, "--steps", "1", "--out", tmp_path / "latin1"], capsys
    )
    assert status == 0, err
    assert (
        f"warning: {latin1} is not valid UTF-8: 200 undecodable bytes replaced by U+FFFD" in err
    ), err


def test_cpu_checkpoint_state_fits_the_cuda_optimizer(corpus, tmp_path, capsys):
    # The same optimizer class on every device (fused on CUDA): the optimizer state a CPU run
    # saved loads into the optimizer a CUDA run makes, so --resume works across devices.
    out = tmp_path / "run"
    status, _, err = run_main(["--data", corpus, *TOY, "--steps", "2", "--out", out], capsys)
    assert status == 0, err
    saved = checkpoint.load_state(out)
    args = train_cli.parse_args(["--lr", "1e-3"])
    config = checkpoint.load_config(out)
    model = reference.Transformer(
        **{key: value for key, value in config.items() if key != "tokenizer"}
    )
    cuda_optimizer = training.make_optimizer(model.parameters(), args, torch.device("cuda"))
    assert training.optimizer_kind(cuda_optimizer) == saved["optimizer_kind"]
    training.load_optimizer(training.NextTokenLoss(model), cuda_optimizer, saved["optimizer"])
    assert all(cuda_optimizer.state[p]["step"] == 2 for p in model.parameters())


@pytest.mark.cuda
def test_cpu_checkpoint_resumes_on_cuda(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    status, _, err = run_main(["--data", corpus, *TOY, "--steps", "2", "--out", out], capsys)
    assert status == 0, err
    toy_cuda = [a if a != "cpu" else "cuda" for a in TOY]
    status, summary, err = run_main(
        ["--data", corpus, *toy_cuda, "--steps", "4", "--out", out, "--resume"], capsys
    )
    assert status == 0 and summary["steps"] == 4 and summary["device"] == "cuda", err


# Every rank hashes the weights it holds at each save (DDP replicas must agree bit for bit) and
# records its exit status; rank 0 keeps a copy of each checkpoint it saves.
RANK_SCRIPT = textwrap.dedent("""
    import hashlib, os, shutil, sys, time
    import torch.distributed as dist
    import fastlm.cli.train as train_cli
    import fastlm.cli.trainer as training

    full_state, save = training.full_state, training.Trainer.save

    def hashing_full_state(loss_module, optimizer):
        digest = hashlib.sha256()
        for tensor in loss_module.model.state_dict().values():
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP: a shard
            digest.update(local.detach().cpu().numpy().tobytes())
        with open(f"{sys.argv[1]}/hash-{dist.get_rank()}.txt", "w") as f:
            f.write(digest.hexdigest())
        return full_state(loss_module, optimizer)

    def save_and_keep(trainer):
        note = save(trainer)
        if dist.get_rank() == 0:
            shutil.copytree(trainer.out, f"{sys.argv[1]}/checkpoint-{trainer.step}")
        return note

    training.full_state, training.Trainer.save = hashing_full_state, save_and_keep
    status = train_cli.main(sys.argv[2:])
    with open(f"{sys.argv[1]}/status-{os.environ['RANK']}.txt", "w") as f:
        f.write(str(status))
    if status:
        time.sleep(2)  # torchrun stops the other ranks when one fails: let them record theirs
    sys.exit(status)
""")


def torchrun(tmp_path, data, name, *extra) -> tuple[subprocess.CompletedProcess, Path]:
    """The finished torchrun, two ranks on gloo, and the folder of the ranks' records. fastlm's
    model runs its PyTorch path (the kernels run interpreted in test_model, too slowly here)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    records = tmp_path / f"records-{name}"
    records.mkdir()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--standalone",
        str(script),
        str(records),
        "--data",
        str(data),
        *TOY,
        "--steps",
        "4",
        "--out",
        str(tmp_path / name),
        *extra,
    ]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=240,
        env={**SUBPROCESS_ENV, "FASTLM_BACKEND": "torch"},
    )
    return result, records


#: RANK_SCRIPT's training runs one after another in one torchrun launch (a launch, torch and
#: fastlm imported in each rank, costs more than a toy run): argv[1] a JSON list of [records,
#: [what rank 0 copies before the run, where] or null, the run's argv]; each run's stdout and
#: stderr go to records/stdout-<rank>.txt and stderr-<rank>.txt. gloo cannot join a new group
#: through torchrun's store after one is destroyed (its stale keys), so the first run's
#: init_process_group makes the group the later runs keep (theirs and every destroy are
#: skipped); it is destroyed once, at the end.
RUNS_SCRIPT = textwrap.dedent("""
    import contextlib, json, os, runpy, shutil, sys
    import torch
    import torch.distributed as dist
    import fastlm.cli.trainer as training

    # What rank.py (or a test's prefix to it) wraps, restored before each run wraps it again.
    originals = training.full_state, training.Trainer.save, torch.compile
    init, destroy = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group = lambda *a, **k: None if dist.is_initialized() else init(*a, **k)
    dist.destroy_process_group = lambda *a, **k: None
    rank = os.environ["RANK"]
    for records, copy, argv in json.loads(open(sys.argv[1]).read()):
        if copy and rank == "0":
            shutil.copytree(*copy)
        if copy:
            dist.barrier()  # the copy is there before any rank resumes from it
        sys.argv = [sys.argv[0], records, *argv]
        training.full_state, training.Trainer.save, torch.compile = originals
        with (
            open(f"{records}/stdout-{rank}.txt", "w") as out,
            open(f"{records}/stderr-{rank}.txt", "w") as err,
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            try:
                runpy.run_path(os.path.join(os.path.dirname(__file__), "rank.py"))
            except SystemExit as status:
                if status.code:
                    raise
    destroy()
""")


def torchrun_runs(tmp_path, data, runs: dict) -> tuple[subprocess.CompletedProcess, dict]:
    """`torchrun`'s runs, {name: (extra, (copy from, to) or None)}, in one launch: the finished
    launch and, per run, its records folder, rank 0's stdout and both ranks' stderr. The first
    run copies nothing: the ranks wait for a copy on the group it makes."""
    if next(iter(runs.values()))[1]:
        raise ValueError("the first run makes the process group: it cannot wait for a copy")
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    (tmp_path / "runs.py").write_text(RUNS_SCRIPT)
    folders, plan = {}, []
    for name, (extra, copy) in runs.items():
        folders[name] = tmp_path / f"records-{name}"
        folders[name].mkdir()
        argv = ["--data", data, *TOY, "--steps", "4", "--out", tmp_path / name, *extra]
        plan.append([str(folders[name]), copy and [str(c) for c in copy], [str(a) for a in argv]])
    (tmp_path / "runs.json").write_text(json.dumps(plan))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
         str(tmp_path / "runs.py"), str(tmp_path / "runs.json")],
        capture_output=True,
        text=True,
        timeout=240,
        env={**SUBPROCESS_ENV, "FASTLM_BACKEND": "torch"},
    )  # fmt: skip

    def read(path):
        return path.read_text() if path.exists() else ""

    outputs = {
        name: dict(
            records=folder,
            stdout=read(folder / "stdout-0.txt"),
            stderr=read(folder / "stderr-0.txt") + read(folder / "stderr-1.txt"),
        )
        for name, folder in folders.items()
    }
    if result.returncode:  # what each run said, then torchrun's own report
        result.stderr = "".join(o["stderr"] for o in outputs.values()) + result.stderr
    return result, outputs


def test_torchrun_ddp_and_fsdp_on_gloo(tmp_path, corpus):
    """Both models under DDP and FSDP2 (which shards the same computation): the same losses up
    to summation order. fastlm's FSDP run resumes the step-2 checkpoint of its DDP run. (One
    launch runs the four: `torchrun_runs`.)"""
    copy = (tmp_path / "records-fastlm-ddp" / "checkpoint-2", tmp_path / "fastlm-fsdp")
    runs = {
        "reference-ddp": (["--model", "reference"], None),
        "fastlm-ddp": (["--model", "fastlm", "--save-every", "2"], None),
        "fastlm-fsdp": (["--model", "fastlm", "--fsdp", "--resume"], copy),
        "reference-fsdp": (["--model", "reference", "--fsdp"], None),
    }
    result, outputs = torchrun_runs(tmp_path, corpus, runs)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries, hashes = {}, {}
    for name, output in outputs.items():
        assert "deprecated" not in output["stderr"], output["stderr"][-3000:]  # DDP's buffers
        summaries[name] = json.loads(output["stdout"].strip().splitlines()[-1])
        hashes[name] = [p.read_text() for p in output["records"].glob("hash-*")]
    expected = summaries["reference-ddp"]
    assert expected["world_size"] == 2 and expected["final_loss"] < expected["initial_loss"]
    expected_weights = checkpoint.load_weights(tmp_path / "reference-ddp")
    for name, summary in summaries.items():
        model, mode = name.split("-")
        assert summary["steps"] == 4 and summary["model"] == model, name
        assert summary["final_loss"] == pytest.approx(expected["final_loss"], rel=1e-5), name
        assert summary["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5), name
        weights = checkpoint.load_weights(tmp_path / name)
        assert all(
            torch.allclose(weights[k], expected_weights[k], rtol=1e-4, atol=1e-6) for k in weights
        ), name
        if mode == "ddp":
            assert len(hashes[name]) == 2 and hashes[name][0] == hashes[name][1], name
    resumed = checkpoint.load_state(tmp_path / "fastlm-fsdp")["train_losses"]
    uninterrupted = checkpoint.load_state(tmp_path / "fastlm-ddp")["train_losses"]
    assert resumed == pytest.approx(uninterrupted, rel=1e-5)


def test_torchrun_data_error_on_one_rank_stops_every_rank(tmp_path):
    # The ranks split the text by characters: rank 0's ASCII half is 200 bytes, rank 1's half
    # 600 (3 bytes a character). 5% held out leaves rank 0 10 tokens, too few for a window of
    # 16, and rank 1 30: only rank 0 fails, and rank 1 must not wait for it.
    data = tmp_path / "lopsided.txt"
    data.write_text("a" * 200 + "速" * 200)
    result, records = torchrun(tmp_path, data, "lopsided")
    assert result.returncode != 0
    statuses = {p.name: p.read_text() for p in records.glob("status-*")}
    assert statuses == {"status-0.txt": "2", "status-1.txt": "2"}, result.stderr[-3000:]
    error = "fastlm-train: error: rank 0: the corpus is too small: 200 tokens per rank"
    assert result.stderr.count(error) == 2, result.stderr[-3000:]  # (torchrun then reports)
    assert not (tmp_path / "lopsided").exists()


def test_llama_options_train_save_resume_and_generate(corpus, tmp_path, capsys, monkeypatch):
    """The LLaMA-style flags reach the model and its checkpoint (a tied weight saved under both
    keys), --resume checks them, generate rebuilds the model from the checkpoint alone, and a
    checkpoint from before the options existed resumes as the model it was."""
    from fastlm.cli import generate as generate_cli

    monkeypatch.setenv("FASTLM_BACKEND", "torch")  # the interpreted kernels are test_model's
    options = ["--num-kv-heads", "1", "--no-rope-interleaved", "--tie-embeddings"]
    out = tmp_path / "llama"
    args = ["--data", corpus, *TOY, "--model", "fastlm", "--out", out, "--norm-eps", "1e-6"]
    status, summary, err = run_main([*args, *options, "--steps", "4"], capsys)
    assert status == 0, err
    config = checkpoint.load_config(out)
    assert (config["num_kv_heads"], config["rope_interleaved"], config["tie_embeddings"]) == (
        1,
        False,
        True,
    )
    assert config["norm_eps"] == 1e-6
    weights = checkpoint.load_weights(out)
    assert torch.equal(weights["embedding.w"], weights["out_linear.w"])
    assert weights["blocks.0.mult_head_atten.qkv_proj.w"].shape == (64, 32)  # 2 + 2 * 1 heads
    status, _, err = run_main([*args, *options, "--steps", "6", "--resume"], capsys)
    assert status == 0, err
    status, _, err = run_main([*args, "--steps", "8", "--resume"], capsys)  # options left out
    assert status == 2 and "another configuration" in err and "num_kv_heads" in err, err
    model, _ = generate_cli.load_model(out, "fastlm", "cpu")
    assert model.out_linear.w is model.embedding.w
    assert model.blocks[0].mult_head_atten.num_kv_heads == 1

    old = tmp_path / "old"
    status, _, err = run_main(["--data", corpus, *TOY, "--out", old, "--steps", "2"], capsys)
    assert status == 0, err
    stored = checkpoint.load_config(old)
    seed_config = {k: v for k, v in stored.items() if k not in train_cli.OPTION_DEFAULTS}
    checkpoint.save(old, checkpoint.load_weights(old), seed_config, 2, checkpoint.load_state(old))
    status, _, err = run_main(
        ["--data", corpus, *TOY, "--out", old, "--steps", "4", "--resume"], capsys
    )
    assert status == 0, err


def test_pack_documents_splits_windows_at_document_starts():
    """cu_seqlens split the flattened windows at each document start inside a window and at each
    row's start; the target before a document start (its first token) is ignored."""
    from fastlm.data import IGNORE_INDEX, batch_at

    tokens = torch.arange(100)
    starts = torch.tensor([0, 7, 9, 30, 36])
    inputs, targets, cu = batch_at(tokens, 8, torch.tensor([5, 28]), starts)
    # Row 0 holds tokens 5..12 (documents begin at 7 and 9), row 1 tokens 28..35 (one at 30,
    # and one at 36, just past the window: the last target, token 36, is its first).
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 4, 8, 10, 16]
    assert inputs[0].tolist() == list(range(5, 13))
    ignored = (targets == IGNORE_INDEX).nonzero().tolist()
    assert ignored == [[0, 1], [0, 3], [1, 1], [1, 7]]
    unpacked = batch_at(tokens, 8, torch.tensor([5, 28]))
    assert unpacked[2] is None and torch.equal(unpacked[0], inputs)


def test_pack_documents_tokenizes_each_file(corpus):
    """Each corpus file is a document: its tokens begin where its text does, in both parts."""
    from fastlm.data import load_split
    from fastlm.tokens import ByteTokenizer

    split = load_split(corpus, ByteTokenizer(), 16, 0.1, pack_documents=True)
    plain = load_split(corpus, ByteTokenizer(), 16, 0.1)
    assert torch.equal(split.train, plain.train) and torch.equal(split.val, plain.val)
    a_bytes = len(("The quick brown fox jumps over the lazy dog. " * 60).encode()) + 1
    assert split.train_starts.tolist() == [0, a_bytes]
    assert split.val_starts.tolist() == [] and plain.train_starts is None


def test_pack_documents_trains(corpus, tmp_path, capsys, monkeypatch):
    """--pack-documents trains the fastlm model (PyTorch backend: interpreted kernels would be
    too slow here; test_model checks the kernels with cu_seqlens) and the reference, from the
    same first loss; the summary counts the targets left out at document starts."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    args = ["--data", corpus, *TOY, "--pack-documents", "--steps", "8"]
    status, summary, err = run_main([*args, "--model", "fastlm", "--out", tmp_path / "f"], capsys)
    assert status == 0, err
    assert summary["final_loss"] < summary["initial_loss"]
    assert 0 < summary["targets_ignored"] < summary["targets"]
    status, ref, err = run_main([*args, "--model", "reference", "--out", tmp_path / "r"], capsys)
    assert status == 0, err
    assert ref["initial_loss"] == pytest.approx(summary["initial_loss"], rel=1e-4)
    assert ref["targets_ignored"] == summary["targets_ignored"]
    status, plain, err = run_main(
        ["--data", corpus, *TOY, "--steps", "8", "--out", tmp_path / "p"], capsys
    )
    assert status == 0 and plain["targets_ignored"] == 0, err


def test_document_separator_ends_documents(tmp_path, corpus, capsys):
    """--document-separator: a document also ends after each occurrence of the separator, which
    stays its last token; without --pack-documents it is refused."""
    from fastlm.data import DataError, load_split
    from fastlm.tokens import ByteTokenizer

    path = tmp_path / "many.txt"
    docs = ["first document. " * 3, "second one. " * 4, "third. " * 9]
    path.write_text("<|sep|>".join(docs))
    split = load_split(
        path, ByteTokenizer(), 8, 0.1, pack_documents=True, document_separator="<|sep|>"
    )
    first_end = len(docs[0]) + len("<|sep|>")
    assert split.train_starts.tolist() == [0, first_end, first_end + len(docs[1]) + len("<|sep|>")]
    with pytest.raises(DataError, match="needs --pack-documents"):
        load_split(path, ByteTokenizer(), 8, 0.1, document_separator="<|sep|>")
    out = tmp_path / "new" / "out"
    args = ["--data", corpus, *TOY, "--document-separator", "x", "--out", out]
    status, _, err = run_main(args, capsys)
    assert status == 2 and "--document-separator needs --pack-documents" in err
    assert not out.parent.exists()  # refused before --out's folder is locked


def test_moe_preset_resume_matches_uninterrupted_run(corpus, tmp_path, capsys, monkeypatch):
    """The MoE preset (made toy-sized) with the sigmoid router: its balancing bias moves each
    step, is checkpointed, and a run interrupted at step 4 and resumed ends with the
    uninterrupted run's losses, weights and biases, bitwise; the balance is reported."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")  # the interpreted kernels are test_moe_model's
    moe = ["--preset", "tiny-moe", "--num-experts", "4", "--moe-d-ff", "24", "--router",
           "sigmoid", "--router-bias-rate", "0.01"]  # fmt: skip
    args = ["--data", corpus, *TOY, *moe, "--model", "fastlm", "--steps", "6", "--save-every", "3"]
    status, full, err = run_main([*args, "--out", tmp_path / "full"], capsys)
    assert status == 0, err
    assert "experts' tokens max/mean" in err and "balance loss" in err
    out = tmp_path / "split"
    with sigint_in_step(4):
        status, part, err = run_main([*args, "--out", out], capsys)
    assert status == 130 and part["steps"] == 4, err
    status, resumed, err = run_main([*args, "--out", out, "--resume"], capsys)
    assert status == 0, err
    expected, got = checkpoint.load_state(tmp_path / "full"), checkpoint.load_state(out)
    assert got["train_losses"] == expected["train_losses"]
    weights = checkpoint.load_weights(out)
    expected_weights = checkpoint.load_weights(tmp_path / "full")
    assert weights.keys() == expected_weights.keys()
    assert all(torch.equal(weights[k], expected_weights[k]) for k in expected_weights)
    biases = [k for k in weights if k.endswith("router.selection_bias")]
    assert len(biases) == 2 and all(weights[k].abs().sum() > 0 for k in biases)


def test_moe_bad_options_are_one_line(corpus, tmp_path, capsys):
    moe = ["--data", corpus, *TOY, "--preset", "tiny-moe", "--out", tmp_path / "run"]
    status, _, err = run_main([*moe, "--num-experts", "4", "--experts-per-token", "5"], capsys)
    assert status == 2 and "--experts-per-token (5) must be at most --num-experts (4)" in err
    assert not (tmp_path / "run").exists()
