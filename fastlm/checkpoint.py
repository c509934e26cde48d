"""Training checkpoints: a folder with the weights, the training state and the configuration.

    DIR/model.safetensors   weights; its metadata holds the model configuration and the step
    DIR/state.pt            optimizer state, step, loss history (torch.save, loaded weights_only)
    DIR/tokenizer.json      a copy of the Hugging Face tokenizer, when one was used
    DIR/loss.png            the loss curve (written by fastlm.cli.train)
    DIR/checkpoint.json     the step and the SHA-256 of each tensor file, checked when loading

The folder is the unit that is replaced, so a crash (a SIGKILL included) at any point leaves a
consistent set of files of one step. `replacing(DIR)` hands out a fresh `DIR.tmp` to write into;
when every file there is on disk, DIR moves aside to `DIR.old`, `DIR.tmp` moves to DIR (each a
`rename`, which is atomic) and `DIR.old` is deleted. The only moment without a DIR is between the
two renames, and then `DIR.old` holds the previous checkpoint: loading falls back to it. The
weights and the state also record their step, which `load_state` compares. A path that is a
symbolic link is written through: the folder it points to is the one replaced.

Every damaged or foreign file (truncated, flipped bytes, bad metadata) is a CheckpointError with
one line saying which file, never a traceback from the file's reader.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fastlm.config import ModelConfig, build_model
from fastlm.tokens import ByteTokenizer, load_tokenizer

WEIGHTS = "model.safetensors"
STATE = "state.pt"
TOKENIZER = "tokenizer.json"
LOSS_CURVE = "loss.png"
MANIFEST = "checkpoint.json"
FILES = (WEIGHTS, STATE, TOKENIZER, LOSS_CURVE, MANIFEST)


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
        raise CheckpointError(
            f"{folder} holds other files than a checkpoint's "
            f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}): "
            "choose a new or empty folder"
        )


def _fsync(path: Path) -> None:
    """Flush a file, or a folder's list of entries, to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def locked(folder: str | os.PathLike) -> Iterator[None]:
    """Hold `folder.lock` (an exclusive lock) while training into `folder`, so that a second
    training on the same folder is refused (CheckpointError) rather than the two replacing each
    other's checkpoints. The lock lies beside the folder, which every save replaces. Taking it
    also creates the folder's parents and shows, before any training, that they are writable;
    releasing it removes those it created that stayed empty (a run that failed or saved
    nothing leaves nothing behind)."""
    folder = Path(folder)
    path = _sibling(folder, ".lock")
    created = []  # the parents this call makes, deepest first
    parent = path.parent.absolute()
    while not parent.exists() and parent != parent.parent:
        created.append(parent)
        parent = parent.parent
    try:
        descriptor = _take_lock(folder, path)
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            os.close(descriptor)
    finally:
        for made in created:
            try:
                made.rmdir()
            except OSError:  # it holds the checkpoint now (or anything else): keep it
                break


def _take_lock(folder: Path, path: Path) -> int:
    """The descriptor of the lock file `path` (created with its parents), locked for this
    process; CheckpointError where another holds it or the place cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(descriptor, 100).decode(errors="replace").strip()
                os.close(descriptor)
                raise CheckpointError(
                    f"{folder} is in use by another training ({holder or path}):"
                    " wait for it to end, or choose another folder"
                ) from None
            # The previous holder removes the file as it ends; if it did so after we opened it,
            # our lock is on a file nobody else will see: lock the one there now.
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(descriptor).st_ino:
                    break
            os.close(descriptor)
        os.ftruncate(descriptor, 0)
        os.write(descriptor, f"pid {os.getpid()}".encode())
    except (FileExistsError, NotADirectoryError) as error:
        raise CheckpointError(
            f"cannot create {folder}: {error.filename} is a file, not a folder"
        ) from None
    except OSError as error:
        raise CheckpointError(
            f"cannot write to {folder.absolute().parent} ({error.strerror}), "
            f"where {folder} would be saved"
        ) from None
    return descriptor


@contextlib.contextmanager
def replacing(folder: str | os.PathLike) -> Iterator[Path]:
    """A fresh folder to write a checkpoint into; on leaving the block without an exception it
    replaces `folder` whole (see the module docstring). An exception keeps the previous one."""
    folder = Path(os.path.realpath(folder))  # a link: replace its target, keep the link
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
    _fsync(folder.parent)  # the renames themselves reach the disk
    shutil.rmtree(old, ignore_errors=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _tensor_bytes(value) -> int:
    """Bytes of the tensors in a nest of dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return 0
    return sum(_tensor_bytes(item) for item in value)


def _size(count: float) -> str:
    units = ("bytes", "KiB", "MiB", "GiB", "TiB")
    index = 0
    while count >= 1024 and index < len(units) - 1:
        count /= 1024
        index += 1
    unit = units[index]
    return f"{count:,.0f} {unit}" if unit == "bytes" else f"{count:,.1f} {unit}"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# What the writers raise when a file cannot be written (a full disk, say): torch.save a
# RuntimeError ("file write failed"), safetensors its own error.
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def write(
    folder: Path,
    weights: dict[str, torch.Tensor],
    config: dict,
    step: int,
    state: dict,
    tokenizer_path: str | os.PathLike | None = None,
) -> None:
    """Write weights (with `config` and `step` as metadata), the training `state`, a copy of the
    tokenizer and the manifest with the files' checksums into `folder` (one from `replacing`).
    CheckpointError, with the space the checkpoint needs, when a file cannot be written."""
    weights = {name: tensor.detach().contiguous().cpu() for name, tensor in weights.items()}
    # safetensors refuses tensors that share memory: a tied model lists one weight under two
    # keys, and each key gets its own copy in the file (loading fills the one parameter twice).
    seen = set()
    for name, tensor in weights.items():
        if tensor.untyped_storage().data_ptr() in seen:
            weights[name] = tensor.clone()
        seen.add(weights[name].untyped_storage().data_ptr())
    metadata = {"config": json.dumps(config, sort_keys=True), "step": str(step)}
    writing = WEIGHTS
    try:
        save_file(weights, folder / WEIGHTS, metadata=metadata)
        os.chmod(folder / WEIGHTS, 0o666 & ~_umask())  # safetensors creates it private (0600)
        writing = STATE
        torch.save({**state, "step": step}, folder / STATE)
        if tokenizer_path is not None:
            writing = TOKENIZER
            shutil.copyfile(tokenizer_path, folder / TOKENIZER)
        writing = MANIFEST
        checksums = {name: _sha256(folder / name) for name in (WEIGHTS, STATE)}
        (folder / MANIFEST).write_text(json.dumps({"step": step, "sha256": checksums}, indent=1))
    except WRITE_ERRORS as error:
        reason = (
            getattr(error, "strerror", None)
            or (str(error).strip().splitlines() or [type(error).__name__])[-1]
        )
        needed = _tensor_bytes(weights) + _tensor_bytes(state)
        free = shutil.disk_usage(folder).free
        raise CheckpointError(
            f"cannot save the checkpoint of step {step}: writing {folder / writing} failed "
            f"({reason}); the checkpoint needs about {_size(needed)} and {_size(free)} are free "
            "there (any previous checkpoint is kept)"
        ) from None


def save(
    folder: str | os.PathLike,
    weights: dict[str, torch.Tensor],
    config: dict,
    step: int,
    state: dict,
    tokenizer_path: str | os.PathLike | None = None,
) -> Path:
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
        raise CheckpointError(f"{folder / WEIGHTS} was not written by fastlm-train (no config)")
    return metadata


def load_config(folder: str | os.PathLike) -> dict:
    """The configuration stored with the weights."""
    folder = resolve(folder)
    text = _metadata(folder)["config"]
    try:
        config = json.loads(text)
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{folder / WEIGHTS} is damaged: its configuration is not a JSON object"
        )
    return config


def load_step(folder: str | os.PathLike) -> int:
    """The step of the weights."""
    folder = resolve(folder)
    step = _metadata(folder)["step"]
    if not step.isdigit():
        raise CheckpointError(
            f"{folder / WEIGHTS} is damaged: its step {step!r} is not a non-negative integer"
        )
    return int(step)


def _verified(folder: Path, name: str) -> Path:
    """`folder / name`, after checking it against the checksum the manifest recorded."""
    manifest_path = folder / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        expected = manifest["sha256"][name]
    except FileNotFoundError:
        raise CheckpointError(
            f"{folder} has no {MANIFEST} (the checksums of its files): it is "
            "incomplete, or was written by an older fastlm.cli.train"
        ) from None
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"{manifest_path} is damaged: it holds no checksum of {name}"
        ) from None
    if not (folder / name).is_file():
        raise CheckpointError(f"{folder} lacks {name}")
    if _sha256(folder / name) != expected:
        raise CheckpointError(
            f"{folder / name} is damaged: its contents differ from those "
            f"written (the SHA-256 recorded in {MANIFEST})"
        )
    return folder / name


def load_weights(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    folder = resolve(folder)
    path = _verified(folder, WEIGHTS)
    try:
        with safe_open(path, framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as error:  # safetensors raises its own error types for damaged files
        raise CheckpointError(f"cannot read {path}: {error}") from None


def fit_weights(
    model: torch.nn.Module, weights: dict[str, torch.Tensor], where: str | os.PathLike
) -> None:
    """Load `weights` (from the checkpoint at `where`) into `model`; CheckpointError when they
    do not fit it."""
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:  # missing keys or other shapes than the configuration's
        first_line = str(error).strip().splitlines()[0]
        raise CheckpointError(
            f"{where}: the weights do not fit the stored configuration ({first_line})"
        ) from None


def load_state(folder: str | os.PathLike) -> dict:
    """The training state; CheckpointError when it is missing, damaged or not of the weights'
    step."""
    folder = resolve(folder)
    if not (folder / STATE).is_file():
        raise CheckpointError(
            f"{folder} holds weights but no training state ({STATE}), so it cannot be resumed"
        )
    path = _verified(folder, STATE)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # zip, pickle and torch errors of every kind
        reason = str(error).strip().splitlines()
        raise CheckpointError(
            f"cannot read {path}: {reason[0] if reason else repr(error)}"
        ) from None
    weights_step = load_step(folder)
    if not isinstance(state, dict) or state.get("step") != weights_step:
        got = state.get("step") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"{folder}: the weights are from step {weights_step} but the "
            f"training state from step {got}"
        )
    return state


def check_config(saved: dict, wanted: dict, where: str | os.PathLike) -> None:
    """CheckpointError naming every field where the checkpoint's configuration differs."""
    differences = [
        f"{key} {saved.get(key)!r} (checkpoint) vs {wanted.get(key)!r}"
        for key in sorted(set(saved) | set(wanted))
        if saved.get(key) != wanted.get(key)
    ]
    if differences:
        raise CheckpointError(
            f"the checkpoint at {where} has another configuration: " + ", ".join(differences)
        )


# --------------------------------------------------------------------------------------------
# A checkpoint as a model
# --------------------------------------------------------------------------------------------


#: A Hugging Face model folder's config file (a fastlm checkpoint has none).
HF_CONFIG = "config.json"
#: config.json's record of the tokenizer a model was trained with ("bytes", or "hf-<digest>"),
#: written by fastlm-export.
TOKENIZER_FIELD = "fastlm_tokenizer"


def load_model(
    folder: str | os.PathLike, model_name: str = "fastlm", device: torch.device | str = "cpu"
):
    """(model, tokenizer) of a checkpoint of fastlm-train, in eval mode: the model built from its
    stored configuration, its weights checked against their checksum; or those of a Hugging Face
    model folder (`load_hf_model`). This is what fastlm-generate and fastlm-export load.

        from fastlm.checkpoint import load_model
        model, tokenizer = load_model("checkpoints/tiny")   # model_name "reference": PyTorch's
        ids = fastlm.sample(model, tokenizer.encode("def main(").long(), 50, temperature=0.8)
        print(tokenizer.decode(ids.tolist()))

    Args:
        folder: the checkpoint folder (or its model.safetensors), or a Hugging Face folder.
        model_name: "fastlm" (the kernels) or "reference".
        device: where to build the model.

    Raises:
        CheckpointError: no checkpoint there, a damaged one, or one that cannot run here.
    """
    if (Path(folder) / HF_CONFIG).is_file():
        return load_hf_model(Path(folder), model_name, device)
    folder = resolve(folder)
    stored = load_config(folder)
    try:
        config = ModelConfig.from_dict(stored)
        config.check(model_name, device)
    except KeyError as error:
        raise CheckpointError(f"{folder}: {error.args[0]}") from None
    except ValueError as error:
        raise CheckpointError(
            f"{folder}: the stored configuration cannot run here: {error}"
        ) from None
    tokenizer_name = stored.get("tokenizer")
    if not isinstance(tokenizer_name, str):
        raise CheckpointError(f"{folder}: the stored configuration names no tokenizer")
    tokenizer_path = folder / TOKENIZER if tokenizer_name != "bytes" else None
    if tokenizer_path is not None and not tokenizer_path.is_file():
        raise CheckpointError(
            f"{folder} was trained with a tokenizer file but holds no {TOKENIZER}"
        )
    tokenizer = load_tokenizer(tokenizer_path)
    if tokenizer.name != tokenizer_name:  # a Hugging Face tokenizer's name is its file's digest
        raise CheckpointError(f"{tokenizer_path} is not the tokenizer the model was trained with")
    model = build_model(config, model_name, device)
    fit_weights(model, load_weights(folder), folder)
    return model.eval(), tokenizer


def load_hf_model(folder: Path, model_name: str, device: torch.device | str):
    """A Llama, Mistral or Qwen2 model folder (`fastlm.hf.from_hf` converts it, in float32) and
    its tokenizer.json, or the byte tokenizer for a folder fastlm-export wrote from a byte-level
    model."""
    from fastlm.hf import from_hf
    from fastlm.hf.families import transformers_module

    try:
        transformers = transformers_module()
    except ModuleNotFoundError as error:
        raise CheckpointError(f"{folder} is a Hugging Face model folder: {error}") from None
    try:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(f"{folder}: cannot load the Hugging Face model ({error})") from None
    try:
        model = from_hf(hf_model, model=model_name)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{folder}: {error}") from None
    if (folder / TOKENIZER).is_file():
        tokenizer = load_tokenizer(folder / TOKENIZER)
    elif getattr(hf_model.config, TOKENIZER_FIELD, None) == "bytes":
        tokenizer = ByteTokenizer()
    else:
        raise CheckpointError(
            f"{folder} holds no {TOKENIZER} (fastlm-generate reads a fast tokenizer's file)"
        )
    return model.to(device).eval(), tokenizer
