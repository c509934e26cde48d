"""Training checkpoints: a folder with the weights, the training state and the configuration.

    DIR/model.safetensors   weights; its metadata holds the model configuration and the step
    DIR/state.pt            optimizer state, step, loss history (torch.save, loaded weights_only)
    DIR/tokenizer.json      a copy of the Hugging Face tokenizer, when one was used
    DIR/loss.png            the loss curve (written by fastlm.train)

The folder is the unit that is replaced, so a crash (a SIGKILL included) at any point leaves a
consistent set of files of one step. `replacing(DIR)` hands out a fresh `DIR.tmp` to write into;
when every file there is on disk, DIR moves aside to `DIR.old`, `DIR.tmp` moves to DIR (each a
`rename`, which is atomic) and `DIR.old` is deleted. The only moment without a DIR is between the
two renames, and then `DIR.old` holds the previous checkpoint: loading falls back to it. The
weights and the state also record their step, which `load_state` compares.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

WEIGHTS = "model.safetensors"
STATE = "state.pt"
TOKENIZER = "tokenizer.json"
LOSS_CURVE = "loss.png"
FILES = (WEIGHTS, STATE, TOKENIZER, LOSS_CURVE)


class CheckpointError(ValueError):
    """A missing, inconsistent or mismatched checkpoint (the commands exit with 2)."""


def _sibling(folder: Path, suffix: str) -> Path:
    folder = folder.absolute()  # so that "." has a name to add the suffix to
    return folder.with_name(folder.name + suffix)


def current(folder: str | os.PathLike) -> Path | None:
    """Where the checkpoint of `folder` lies: the folder, or `folder.old` when a save was
    interrupted between its two renames; None when there is none."""
    folder = Path(folder)
    for candidate in (folder, _sibling(folder, ".old")):
        if (candidate / WEIGHTS).is_file():
            return candidate
    return None


def exists(folder: str | os.PathLike) -> bool:
    return current(folder) is not None


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint folder for `path`: the folder itself, or the folder of its weights file."""
    path = Path(path)
    folder = path.parent if path.name == WEIGHTS else path
    found = current(folder)
    if found is None:
        raise CheckpointError(f"no checkpoint at {path} (expected {folder / WEIGHTS})")
    return found


def check_replaceable(folder: str | os.PathLike) -> None:
    """CheckpointError unless `folder` is missing, empty or holds only checkpoint files: saving
    replaces the whole folder, which must never take a user's other files with it."""
    folder = Path(folder)
    if not folder.exists():
        return
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is a file, not a checkpoint folder")
    others = sorted(p.name for p in folder.iterdir() if p.name not in FILES)
    if others:
        raise CheckpointError(f"{folder} holds other files than a checkpoint's "
                              f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}): "
                              "choose a new or empty folder")


def _fsync(path: Path) -> None:
    """Flush a file, or a folder's list of entries, to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def replacing(folder: str | os.PathLike) -> Iterator[Path]:
    """A fresh folder to write a checkpoint into; on leaving the block without an exception it
    replaces `folder` whole (see the module docstring). An exception keeps the previous one."""
    folder = Path(folder)
    check_replaceable(folder)
    staging, old = _sibling(folder, ".tmp"), _sibling(folder, ".old")
    shutil.rmtree(staging, ignore_errors=True)  # a crashed save's leftovers
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for path in staging.iterdir():
        _fsync(path)
    _fsync(staging)
    if folder.exists():
        # With no `folder`, `old` is the last good checkpoint of a crashed save: it stays until
        # the new one is in place. Otherwise it is a crashed save's leftover.
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
    staging.rename(folder)
    _fsync(folder.absolute().parent)  # the renames themselves reach the disk
    shutil.rmtree(old, ignore_errors=True)


def write(folder: Path, weights: dict[str, torch.Tensor], config: dict, step: int, state: dict,
          tokenizer_path: str | os.PathLike | None = None) -> None:
    """Write weights (with `config` and `step` as metadata), the training `state` and a copy of
    the tokenizer into `folder` (one from `replacing`)."""
    weights = {name: tensor.detach().contiguous().cpu() for name, tensor in weights.items()}
    metadata = {"config": json.dumps(config, sort_keys=True), "step": str(step)}
    save_file(weights, folder / WEIGHTS, metadata=metadata)
    torch.save({**state, "step": step}, folder / STATE)
    if tokenizer_path is not None:
        shutil.copyfile(tokenizer_path, folder / TOKENIZER)


def save(folder: str | os.PathLike, weights: dict[str, torch.Tensor], config: dict, step: int,
         state: dict, tokenizer_path: str | os.PathLike | None = None) -> Path:
    """Replace the checkpoint in `folder` with one of `step` (see `write`), all or nothing."""
    with replacing(folder) as staging:
        write(staging, weights, config, step, state, tokenizer_path)
    return Path(folder)


def _metadata(folder: Path) -> dict[str, str]:
    try:
        with safe_open(folder / WEIGHTS, framework="pt") as f:
            metadata = f.metadata() or {}
    except Exception as error:  # safetensors raises its own error types for damaged files
        raise CheckpointError(f"cannot read {folder / WEIGHTS}: {error}") from None
    if "config" not in metadata or "step" not in metadata:
        raise CheckpointError(f"{folder / WEIGHTS} was not written by fastlm.train (no config)")
    return metadata


def load_config(folder: str | os.PathLike) -> dict:
    """The configuration stored with the weights."""
    return json.loads(_metadata(resolve(folder))["config"])


def load_weights(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    folder = resolve(folder)
    with safe_open(folder / WEIGHTS, framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def load_state(folder: str | os.PathLike) -> dict:
    """The training state; CheckpointError when it is missing or not of the weights' step."""
    folder = resolve(folder)
    if not (folder / STATE).is_file():
        raise CheckpointError(f"{folder} holds weights but no training state ({STATE}), "
                              "so it cannot be resumed")
    state = torch.load(folder / STATE, map_location="cpu", weights_only=True)
    weights_step = int(_metadata(folder)["step"])
    if state.get("step") != weights_step:
        raise CheckpointError(f"{folder}: the weights are from step {weights_step} but the "
                              f"training state from step {state.get('step')}")
    return state


def check_config(saved: dict, wanted: dict, where: str | os.PathLike) -> None:
    """CheckpointError naming every field where the checkpoint's configuration differs."""
    differences = [f"{key} {saved.get(key)!r} (checkpoint) vs {wanted.get(key)!r}"
                   for key in sorted(set(saved) | set(wanted)) if saved.get(key) != wanted.get(key)]
    if differences:
        raise CheckpointError(f"the checkpoint at {where} has another configuration: "
                              + ", ".join(differences))
