"""Training checkpoints: a folder with the weights, the training state and the configuration.

    DIR/model.safetensors   weights; its metadata holds the model configuration and the step
    DIR/state.pt            optimizer state, step, loss history (torch.save, loaded weights_only)
    DIR/tokenizer.json      a copy of the Hugging Face tokenizer, when one was used

Every file is written to a temporary name in the same folder and moved into place with
`os.replace`, which is atomic: a crash leaves the previous file or the new one, never half of
one. The weights and the state each record their step, so a crash between the two moves is
detected on load instead of silently mixing two steps.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

WEIGHTS = "model.safetensors"
STATE = "state.pt"
TOKENIZER = "tokenizer.json"


class CheckpointError(ValueError):
    """A missing, inconsistent or mismatched checkpoint (the commands exit with 2)."""


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint folder for `path`: the folder itself, or the folder of its weights file."""
    path = Path(path)
    folder = path.parent if path.name == WEIGHTS else path
    if not (folder / WEIGHTS).is_file():
        raise CheckpointError(f"no checkpoint at {path} (expected {folder / WEIGHTS})")
    return folder


def exists(folder: str | os.PathLike) -> bool:
    return (Path(folder) / WEIGHTS).is_file()


def atomic_write(target: Path, write) -> None:
    """Call `write(temporary_path)`, flush it to disk, then move it onto `target`."""
    temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        write(temporary)
        with open(temporary, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def save(folder: str | os.PathLike, weights: dict[str, torch.Tensor], config: dict, step: int,
         state: dict, tokenizer_path: str | os.PathLike | None = None) -> Path:
    """Write weights (with `config` and `step` as metadata) and the training `state` atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = {name: tensor.detach().contiguous().cpu() for name, tensor in weights.items()}
    metadata = {"config": json.dumps(config, sort_keys=True), "step": str(step)}
    atomic_write(folder / WEIGHTS, lambda tmp: save_file(weights, tmp, metadata=metadata))
    atomic_write(folder / STATE, lambda tmp: torch.save({**state, "step": step}, tmp))
    copy = folder / TOKENIZER
    if tokenizer_path is not None and Path(tokenizer_path).resolve() != copy.resolve():
        atomic_write(copy, lambda tmp: shutil.copyfile(tokenizer_path, tmp))
    return folder


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
                              f"training state from step {state.get('step')} (interrupted save?)")
    return state


def check_config(saved: dict, wanted: dict, where: str | os.PathLike) -> None:
    """CheckpointError naming every field where the checkpoint's configuration differs."""
    differences = [f"{key} {saved.get(key)!r} (checkpoint) vs {wanted.get(key)!r}"
                   for key in sorted(set(saved) | set(wanted)) if saved.get(key) != wanted.get(key)]
    if differences:
        raise CheckpointError(f"the checkpoint at {where} has another configuration: "
                              + ", ".join(differences))
