"""`fastlm-train --log`: TensorBoard event files read back, a Weights & Biases run offline, a
failing logger that warns once while training goes on, and a missing package refused up front."""

import glob
import json
import sys

import pytest
from test_train import TOY, run_main

from fastlm import checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 80)
    return path


def test_tensorboard_event_file_read_back(corpus, tmp_path, capsys):
    """Each step's training loss, learning rate, gradient norm and tokens/s, and each
    evaluation's held-out loss and peak memory; the summary and loss.png stay."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, logs = tmp_path / "run", tmp_path / "logs"
    args = ["--data", corpus, *TOY, "--steps", "8", "--out", out, "--log", "tensorboard"]
    status, summary, err = run_main([*args, "--log-dir", logs], capsys)
    assert status == 0, err
    assert summary["final_loss"] is not None and (out / "loss.png").is_file()
    events = EventAccumulator(str(logs))
    events.Reload()
    scalars = {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}
    state = checkpoint.load_state(out)
    losses = [(e.step, e.value) for e in scalars["train/loss"]]
    assert [s for s, _ in losses] == list(range(1, 9))
    # TensorBoard keeps float32.
    assert [v for _, v in losses] == pytest.approx(state["train_losses"], rel=1e-6)
    held_out = [(e.step, e.value) for e in scalars["eval/loss"]]
    assert held_out == [(s, pytest.approx(v, rel=1e-6)) for s, v in state["val_losses"]]
    assert [e.step for e in scalars["system/peak_memory_bytes"]] == [4, 8]
    assert all(e.value > 0 for e in scalars["system/peak_memory_bytes"])
    lrs = [e.value for e in scalars["train/lr"]]
    assert lrs[-1] < max(lrs)  # the cosine schedule, after warm-up
    assert all(e.value > 0 for e in scalars["train/grad_norm"])
    assert len(scalars["train/tokens_per_second"]) == 8
    assert "system/mfu" not in scalars  # no GPU, no peak: no MFU


def test_default_log_dir_is_beside_the_checkpoint(corpus, tmp_path, capsys):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    args = ["--data", corpus, *TOY, "--steps", "2", "--out", out, "--log", "tensorboard"]
    status, _, err = run_main(args, capsys)
    assert status == 0, err
    assert glob.glob(str(tmp_path / "run.logs" / "events.out.tfevents.*"))
    checkpoint.check_replaceable(out)  # the checkpoint folder holds only its own files


def test_wandb_offline(corpus, tmp_path, capsys, monkeypatch):
    """Without WANDB_API_KEY the run is offline, in the log folder; its record file holds the
    logged metrics."""
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_PROJECT", "WANDB_NAME", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    logs = tmp_path / "logs"
    args = ["--data", corpus, *TOY, "--steps", "4", "--out", tmp_path / "run"]
    status, summary, err = run_main([*args, "--log", "wandb", "--log-dir", logs], capsys)
    assert status == 0, err
    records = glob.glob(str(logs / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(records) == 1
    data = open(records[0], "rb").read()
    for key in ("train/loss", "train/lr", "train/grad_norm", "eval/loss"):
        assert key.encode() in data, key
    losses = checkpoint.load_state(tmp_path / "run")["train_losses"]
    assert all(json.dumps(loss).encode() in data for loss in losses)


@pytest.mark.parametrize("failing", ["__init__", "add_scalar"])
def test_a_failing_logger_warns_once_and_training_goes_on(
    corpus, tmp_path, capsys, monkeypatch, failing
):
    """A logger that cannot start, or fails at its first write: one warning, then the run
    trains to its end without it."""
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(SummaryWriter, failing, full_disk)
    args = ["--data", corpus, *TOY, "--steps", "6", "--out", tmp_path / "run"]
    status, summary, err = run_main([*args, "--log", "tensorboard"], capsys)
    assert status == 0 and summary["steps"] == 6, err
    assert err.count("the tensorboard logger failed") == 1, err
    assert "No space left on device" in err and "training goes on without it" in err


def test_missing_logger_package_is_refused_before_training(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    args = ["--data", corpus, *TOY, "--steps", "2", "--out", tmp_path / "run"]
    status, _, err = run_main([*args, "--log", "wandb"], capsys)
    assert status == 2 and "pip install 'fastlm[wandb]'" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()
