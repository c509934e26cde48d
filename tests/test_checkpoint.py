"""Checkpoint folders under misuse and damage, through the commands: `--out` that cannot be
written, a full disk, a symbolic link, two trainings on one folder, and damaged files, each a
one-line error (exit status 2) that keeps the last good checkpoint."""

import errno
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_train import SUBPROCESS_ENV, TOY, file_hashes, run_main

import fastlm.cli.generate as generate_cli
import fastlm.cli.train as train_cli
from fastlm import checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A two-step checkpoint of TOY and its corpus (copy it before damaging it)."""
    folder = tmp_path_factory.mktemp("trained")
    corpus = folder / "corpus.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog. " * 80)
    out = folder / "checkpoint"
    argv = ["--data", corpus, *TOY, "--steps", "2", "--out", out]
    assert train_cli.main([str(a) for a in argv]) == 0
    return out, corpus


@pytest.fixture
def copy(trained, tmp_path) -> Path:
    out = tmp_path / "checkpoint"
    shutil.copytree(trained[0], out)
    return out


def resume(corpus: Path, out: Path, capsys, *extra) -> tuple[int, dict | None, str]:
    return run_main(
        ["--data", corpus, *TOY, "--steps", "4", "--resume", "--out", out, *extra], capsys
    )


def test_files_share_one_mode(trained):
    # safetensors writes its file private (0600); the others follow the umask (0644 here).
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in trained[0].iterdir()}
    umask = os.umask(0)
    os.umask(umask)
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_out_through_a_symbolic_link(trained, tmp_path, capsys):
    # Saving replaces the folder by renames: they must replace the link's target, not the link.
    target = tmp_path / "disk" / "run"
    target.mkdir(parents=True)
    link = tmp_path / "run"
    link.symlink_to(target)
    args = ["--data", trained[1], *TOY, "--out", link, "--save-every", "1"]
    status, summary, err = run_main([*args, "--steps", "2"], capsys)
    assert status == 0 and summary["checkpoint"] == str(link), err
    assert link.is_symlink() and checkpoint.load_state(target)["step"] == 2
    status, summary, err = run_main([*args, "--steps", "4", "--resume"], capsys)
    assert status == 0 and summary["steps"] == 4, err
    assert link.is_symlink() and checkpoint.load_state(target)["step"] == 4
    assert os.listdir(tmp_path / "disk") == ["run"]  # no .tmp, .old or .lock left


def test_second_training_on_the_same_out_is_refused(trained, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--data", trained[1], *TOY, "--steps", "2", "--out", out]
    with checkpoint.locked(out):  # as a training in another process holds it
        status, summary, err = run_main(args, capsys)
        assert status == 2 and summary is None
        assert err.strip().splitlines() == [
            f"fastlm-train: error: {out} is in use by another training (pid {os.getpid()}): "
            "wait for it to end, or choose another folder"
        ]
        assert not out.exists()
    status, _, err = run_main(args, capsys)  # the lock went with the holder
    assert status == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_out_below_a_file_fails_before_training(trained, tmp_path, capsys):
    (tmp_path / "notes").write_text("a file")
    out = tmp_path / "notes" / "run"
    status, _, err = run_main(["--data", trained[1], *TOY, "--steps", "2", "--out", out], capsys)
    assert status == 2
    assert err.strip().splitlines() == [
        f"fastlm-train: error: cannot create {out}: {tmp_path / 'notes'} is a file, not a folder"
    ]


def test_out_on_a_read_only_filesystem_fails_before_training(
    trained, tmp_path, capsys, monkeypatch
):
    # As on a read-only mount (which root, running these tests, cannot be kept out of by
    # permissions): every creation below `disk` fails with EROFS.
    disk = tmp_path / "disk"
    disk.mkdir()

    def refuse(real):
        def call(path, *args, **kwargs):
            if str(path).startswith(str(disk)):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real(path, *args, **kwargs)

        return call

    monkeypatch.setattr(os, "open", refuse(os.open))
    monkeypatch.setattr(os, "mkdir", refuse(os.mkdir))
    out = disk / "run"
    status, _, err = run_main(["--data", trained[1], *TOY, "--steps", "2", "--out", out], capsys)
    assert status == 2
    assert err.strip().splitlines() == [
        f"fastlm-train: error: cannot write to {disk} (Read-only file system), where {out} "
        "would be saved"
    ]


# Writes past a file size limit fail as on a full disk (EFBIG rather than ENOSPC), once the
# signal that would kill the process is ignored.
FULL_DISK = textwrap.dedent("""
    import resource, signal, sys
    import fastlm.cli.train as train_cli

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
    sys.exit(train_cli.main(sys.argv[2:]))
""")


def test_full_disk_during_a_save_keeps_the_checkpoint(trained, copy, tmp_path):
    before = file_hashes(copy)
    # Room for the weights, not for the optimizer state (torch.save's RuntimeError).
    limit = (copy / checkpoint.WEIGHTS).stat().st_size + 1024
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK)
    result = subprocess.run(
        [
            sys.executable,
            str(script),
            str(limit),
            "--data",
            str(trained[1]),
            *TOY,
            "--steps",
            "4",
            "--resume",
            "--out",
            str(copy),
        ],
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
        timeout=120,
    )
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    [line] = [line for line in result.stderr.splitlines() if "error" in line]
    needed = sum(p.stat().st_size for p in copy.iterdir() if p.suffix in (".pt", ".safetensors"))
    prefix = (
        f"fastlm-train: error: cannot save the checkpoint of step 4: writing "
        f"{copy}.tmp/state.pt failed ("
    )
    assert line.startswith(prefix), line
    estimate = re.search(r"\); the checkpoint needs about ([\d.]+) KiB and ", line)
    assert estimate and float(estimate[1]) == pytest.approx(needed / 1024, rel=0.1), line
    assert line.endswith("are free there (any previous checkpoint is kept)"), line
    assert file_hashes(copy) == before and sorted(os.listdir(tmp_path)) == [
        "checkpoint",
        "full_disk.py",
    ]


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def rewrite_weights(folder: Path, metadata: dict) -> None:
    """The weights file with other metadata, and the manifest updated to match it."""
    weights = checkpoint.load_weights(folder)
    save_file(weights, folder / checkpoint.WEIGHTS, metadata=metadata)
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    digest = hashlib.sha256((folder / checkpoint.WEIGHTS).read_bytes()).hexdigest()
    manifest["sha256"][checkpoint.WEIGHTS] = digest
    (folder / checkpoint.MANIFEST).write_text(json.dumps(manifest))


def damage(case: str, folder: Path) -> None:
    state, weights = folder / checkpoint.STATE, folder / checkpoint.WEIGHTS
    manifest = folder / checkpoint.MANIFEST
    if case == "state truncated":
        state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    elif case == "state empty":
        state.write_bytes(b"")
    elif case == "state flipped byte":
        flip_byte(state, state.stat().st_size // 2)
    elif case == "weights flipped byte":
        flip_byte(weights, weights.stat().st_size - 100)  # in the last tensor's data
    elif case == "manifest missing":
        manifest.unlink()
    elif case == "manifest not JSON":
        manifest.write_text('{"step": 2, "sha256": {')
    elif case in ("config not JSON", "step not an integer"):
        metadata = {"config": json.dumps(checkpoint.load_config(folder)), "step": "2"}
        if case == "config not JSON":
            metadata["config"] = '{"d_model": 32,'
        else:
            metadata["step"] = "two"
        rewrite_weights(folder, metadata)
    elif case == "state without its keys":
        saved = checkpoint.load_state(folder)
        checkpoint.save(
            folder,
            checkpoint.load_weights(folder),
            checkpoint.load_config(folder),
            2,
            {"train_losses": saved["train_losses"]},
        )
    else:
        raise AssertionError(case)


DAMAGES = {  # case: (what resuming says, what generating says; None: generate reads it fine)
    "state truncated": ("state.pt is damaged", None),
    "state empty": ("state.pt is damaged", None),
    "state flipped byte": ("state.pt is damaged", None),
    "weights flipped byte": ("model.safetensors is damaged", "model.safetensors is damaged"),
    "manifest missing": ("has no checkpoint.json", "has no checkpoint.json"),
    "manifest not JSON": ("checkpoint.json is damaged", "checkpoint.json is damaged"),
    "config not JSON": ("its configuration is not a JSON object",) * 2,
    "step not an integer": ("its step 'two' is not a non-negative integer", None),
    "state without its keys": (
        "state.pt lacks optimizer, optimizer_kind, val_losses, settings: "
        "it was not written by fastlm-train",
        None,
    ),
}


@pytest.mark.parametrize("case", list(DAMAGES))
def test_damaged_checkpoint_is_one_line(case, trained, copy, capsys):
    damage(case, copy)
    before = file_hashes(copy)
    on_resume, on_generate = DAMAGES[case]
    status, summary, err = resume(trained[1], copy, capsys)
    assert status == 2 and summary is None
    assert len(err.strip().splitlines()) == 1 and on_resume in err, err
    assert file_hashes(copy) == before
    status = generate_cli.main(
        [
            "--checkpoint",
            str(copy),
            "--prompt",
            "The",
            "--model",
            "reference",
            "--max-new-tokens",
            "2",
        ]
    )
    out, err = capsys.readouterr()
    if on_generate is None:
        assert status == 0, err
    else:
        assert status == 2 and out == "", err
        assert len(err.strip().splitlines()) == 1 and on_generate in err, err


def test_undamaged_copy_resumes(trained, copy, capsys):
    # The damage above is what fails: the same copy, untouched, resumes.
    status, summary, err = resume(trained[1], copy, capsys)
    assert status == 0 and summary["steps"] == 4, err
    weights = checkpoint.load_weights(copy)
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_loss_curve_that_cannot_be_written_is_a_note(trained, tmp_path, capsys, monkeypatch):
    # The PNG comes last: the disk filling up there leaves a checkpoint without a curve.
    from matplotlib.figure import Figure

    def full(self, path, **kwargs):
        Path(path).write_bytes(b"\x89PNG")  # part of it got out
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(Figure, "savefig", full)
    out = tmp_path / "run"
    status, summary, err = run_main(
        ["--data", trained[1], *TOY, "--steps", "2", "--out", out], capsys
    )
    assert status == 0 and summary["loss_curve"] is None, err
    assert (
        "note: could not write the loss curve loss.png (No space left on device): this "
        "checkpoint has none"
    ) in err
    assert checkpoint.load_state(out)["step"] == 2 and not (out / "loss.png").exists()
