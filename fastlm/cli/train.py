"""`python -m fastlm.cli.train`: train a decoder-only language model, on a CPU, a GPU or many.

With no arguments it trains the `tiny` preset on the Python standard library's own sources
(byte tokens) for about a minute on a CPU, checkpointing to `checkpoints/tiny`. The progress
bar and notes go to stderr; stdout gets one JSON line (the run's summary) at the end.

    python -m fastlm.cli.train                                    # tiny preset, default corpus
    python -m fastlm.cli.train --data my_texts/ --preset gpt2-small --compile
    torchrun --nproc_per_node=8 -m fastlm.cli.train --preset gpt2-medium [--fsdp]
    torchrun --nproc_per_node=8 -m fastlm.cli.train --context-parallel 4   # 2 data x 4 context

Exit status: 0 done, 2 bad input (one line on stderr, no checkpoint touched), 3 diverged (a loss
or a weight became NaN or infinite: the run stopped there and saved nothing from then on, so
`--out` keeps its last good checkpoint), 130 interrupted (Ctrl-C: the last finished step was
checkpointed first; `--resume` continues it exactly).

Losses of a resumed run are those of the uninterrupted run: the weights, the optimizer state and
the step are restored, and each step's batches depend only on (seed, rank, step), not on a
sampler's state.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from fastlm import checkpoint, reference
from fastlm.checkpoint import CheckpointError
from fastlm.config import (
    FLOAT32_MAX,
    MODEL_FIELDS,
    OPTION_DEFAULTS,
    PRESETS,
    ConfigError,
    ModelConfig,
    build_model,
    check_integers,
    pick_device,
    torch_seed,
    with_defaults,
)
from fastlm.data import (
    IGNORE_INDEX,
    DataError,
    TokenSplit,
    check_split_options,
    eval_batches,
    load_split,
    load_tokenizer,
    training_batch,
)
from fastlm.distributed import context_parallel_mesh, shard_sequence

LOSS_CURVE = checkpoint.LOSS_CURVE

# Dense bf16 peak FLOP/s from the vendors' spec sheets (SXM parts), by device-name substring.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}

# What a state.pt written by this command holds besides its step.
STATE_KEYS = ("optimizer", "optimizer_kind", "train_losses", "val_losses", "settings")


def flag(key: str) -> str:
    """The command-line spelling of an argument: min_lr -> --min-lr."""
    return "--" + key.replace("_", "-")


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


class NextTokenLoss(nn.Module):
    """The model and its loss in one forward, so DDP and FSDP see the whole computation.

    A model with `loss(token_ids, targets)` (fastlm's fused linear cross-entropy) computes it
    itself; otherwise the logits go through the reference cross-entropy in float32.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.cross_entropy = reference.CrossEntropyLoss()

    def forward(
        self, token_ids: torch.Tensor, targets: torch.Tensor, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """cu_seqlens: packed documents (`Transformer.loss` / `reference.Transformer.forward`)."""
        packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        if hasattr(self.model, "loss"):
            return self.model.loss(token_ids, targets, **packed)
        logits = self.model(token_ids, **packed).float()
        if packed:  # the reference's loss has no ignore_index: leave out the document starts
            keep = targets != IGNORE_INDEX
            logits, targets = logits[keep], targets[keep]
        return self.cross_entropy(logits, targets)


def flops_per_token(model: nn.Module, config: dict) -> float:
    """Training FLOPs per token, PaLM's convention: 6 per weight used in a matmul (the embedding
    lookup is not one) plus 12 * layers * d_model * context for attention scores and values
    (the full square, although causal attention needs only half of it). A tied output
    projection is the embedding's weight used in a matmul: counted once, as a matmul weight."""
    embedding = config["vocab_size"] * config["d_model"]
    if config.get("tie_embeddings"):
        embedding = 0
    matmul_weights = sum(p.numel() for p in model.parameters()) - embedding
    attention = 12 * config["num_layers"] * config["d_model"] * config["context_length"]
    return 6 * matmul_weights + attention


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    presets = "\n".join(
        f"  {name}: " + ", ".join(f"{k}={v}" for k, v in preset.items())
        for name, preset in PRESETS.items()
    )
    parser = argparse.ArgumentParser(
        prog="fastlm-train",
        description=__doc__.split("\n\n")[0],
        epilog=f"presets:\n{presets}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--data",
        help="text file or folder (default: the Python standard library's sources, a few MB)",
    )
    parser.add_argument("--tokenizer", help="Hugging Face tokenizers JSON (default: UTF-8 bytes)")
    parser.add_argument(
        "--pack-documents",
        action="store_true",
        help="each corpus file a document: attention and positions stay within a document "
        "(packed, flash_attention_varlen), and no token predicts the next document's first",
    )
    parser.add_argument(
        "--document-separator",
        metavar="TEXT",
        help="with --pack-documents, a document also ends after each occurrence of TEXT in the "
        "text (say '<|endoftext|>' in a corpus of many documents per file)",
    )
    parser.add_argument(
        "--model",
        choices=("fastlm", "reference"),
        default="fastlm",
        help="default: %(default)s; both write the same checkpoints",
    )
    parser.add_argument(
        "--preset",
        choices=list(PRESETS),
        default="tiny",
        help="model size and training defaults (listed below); default: tiny",
    )
    parser.add_argument("--out", help="checkpoint folder (default: checkpoints/PRESET)")
    parser.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    parser.add_argument(
        "--overwrite", action="store_true", help="start afresh even though --out holds a checkpoint"
    )

    model = parser.add_argument_group("model (default: the preset's)")
    model.add_argument("--vocab-size", type=int, help="at least the tokenizer's vocabulary")
    model.add_argument("--context-length", type=int)
    model.add_argument("--d-model", type=int)
    model.add_argument("--num-layers", type=int)
    model.add_argument("--num-heads", type=int)
    model.add_argument("--d-ff", type=int)
    model.add_argument("--rope-theta", type=float, default=10000.0, help="default: %(default)s")
    model.add_argument(
        "--num-kv-heads", type=int, help="key/value heads, grouped-query attention (num-heads)"
    )
    model.add_argument(
        "--rope-interleaved",
        action=argparse.BooleanOptionalAction,
        help="RoPE on interleaved pairs (the default), or half-split ones (--no-rope-interleaved)",
    )
    model.add_argument(
        "--tie-embeddings",
        action=argparse.BooleanOptionalAction,
        help="the output projection shares the embedding's weight (default: not)",
    )
    model.add_argument("--norm-eps", type=float, help="RMSNorm's epsilon (1e-05)")

    optim = parser.add_argument_group("optimisation (default: the preset's)")
    optim.add_argument("--steps", type=int, help="optimizer steps in all (a resumed run included)")
    optim.add_argument("--batch-size", type=int, help="sequences per micro-batch and rank")
    optim.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (1)")
    optim.add_argument("--lr", type=float, help="peak learning rate")
    optim.add_argument("--min-lr", type=float, help="final learning rate (default: lr / 10)")
    optim.add_argument("--warmup", type=int, help="warm-up steps (default: steps / 20)")
    optim.add_argument("--weight-decay", type=float, default=0.1, help="default: %(default)s")
    optim.add_argument(
        "--betas", type=float, nargs=2, default=(0.9, 0.95), help="AdamW's (0.9 0.95)"
    )
    optim.add_argument(
        "--grad-clip",
        type=float,
        default=1.0,
        help="max global gradient norm; 0: no clipping (1.0)",
    )
    optim.add_argument("--seed", type=int, default=0, help="initial weights and batches (0)")

    run = parser.add_argument_group("run")
    run.add_argument(
        "--val-fraction", type=float, default=0.05, help="held-out share of the corpus (0.05)"
    )
    run.add_argument("--eval-every", type=int, help="steps between held-out evaluations")
    run.add_argument(
        "--eval-batches", type=int, default=4, help="held-out batches per evaluation (4)"
    )
    run.add_argument(
        "--save-every", type=int, help="steps between checkpoints (0: only at the end)"
    )
    run.add_argument("--device", help="default: cuda (this rank's GPU) when there is one, else cpu")
    run.add_argument("--compile", action="store_true", help="torch.compile the model and loss")
    run.add_argument("--fsdp", action="store_true", help="under torchrun, FSDP2 instead of DDP")
    run.add_argument(
        "--context-parallel",
        type=int,
        default=1,
        metavar="P",
        help="under torchrun, spread each sequence over P ranks (context parallelism; P divides "
        "the processes, 2P the context length); the others hold other data (1)",
    )
    run.add_argument(
        "--peak-tflops",
        type=float,
        help="the GPU's dense bf16 peak, for the MFU "
        f"(default: known for {', '.join(PEAK_BF16_FLOPS)})",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    preset = PRESETS[args.preset]
    for key, value in {**OPTION_DEFAULTS, **preset}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.out = args.out or os.path.join("checkpoints", args.preset)
    args.min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    args.warmup = args.steps // 20 if args.warmup is None else args.warmup
    return args


def check_args(args: argparse.Namespace) -> None:
    """ConfigError for values the model or the loop cannot use (the model's own fields are
    checked with the device, in `prepare`)."""
    positive = (
        "context_length",
        "d_model",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "d_ff",
        "steps",
        "batch_size",
        "grad_accum",
        "eval_every",
        "eval_batches",
        "vocab_size",
    )
    for key in positive:
        value = getattr(args, key)
        if value is not None and value < 1:
            raise ConfigError(f"{flag(key)} must be at least 1, got {value}")
    for key in (
        "lr",
        "min_lr",
        "weight_decay",
        "grad_clip",
        "val_fraction",
        "rope_theta",
        "norm_eps",
        "peak_tflops",
    ):
        value = getattr(args, key)
        if value is not None and not math.isfinite(value):
            raise ConfigError(f"{flag(key)} must be a finite number, got {value}")
    if args.context_length > args.max_context:
        raise ConfigError(
            f"--context-length {args.context_length} is longer than preset "
            f"{args.preset} allows ({args.max_context})"
        )
    if args.lr <= 0 or args.min_lr < 0:
        raise ConfigError(
            f"--lr must be positive and --min-lr non-negative, got {args.lr} and {args.min_lr}"
        )
    if args.weight_decay < 0:
        raise ConfigError(f"--weight-decay must be non-negative, got {args.weight_decay}")
    if not all(0 <= beta < 1 for beta in args.betas):
        raise ConfigError(f"--betas must both lie in [0, 1), got {args.betas[0]} {args.betas[1]}")
    # The schedule's largest rate; the bias correction makes the first step the largest.
    largest = "min_lr" if args.min_lr > args.lr else "lr"
    peak = getattr(args, largest)
    step_scale = peak / (1 - args.betas[0])
    if step_scale > FLOAT32_MAX:  # AdamW hands it to the update as a float32: a RuntimeError
        raise ConfigError(
            f"{flag(largest)} {peak} is too large: AdamW's first step scales it by "
            f"1 / (1 - beta1) to {step_scale:.3g}, past float32's largest number "
            f"({FLOAT32_MAX:.3g}), the weights' dtype"
        )
    if peak * args.weight_decay > 1:
        raise ConfigError(
            f"--weight-decay {args.weight_decay} times the largest learning rate ({peak}) is "
            f"{peak * args.weight_decay:.3g}: AdamW multiplies the weights by 1 - lr x weight "
            "decay each step, which must not be negative"
        )
    if not 0 <= args.warmup < args.steps:
        raise ConfigError(f"--warmup must lie in [0, --steps={args.steps}), got {args.warmup}")
    if args.grad_clip < 0:
        raise ConfigError(
            f"--grad-clip must be non-negative (0: no clipping), got {args.grad_clip}"
        )
    if args.save_every < 0:
        raise ConfigError(f"--save-every must be non-negative, got {args.save_every}")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        raise ConfigError(f"--peak-tflops must be positive, got {args.peak_tflops}")
    if args.resume and args.overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    check_split_options(args.val_fraction, args.pack_documents, args.document_separator)
    check_integers(vars(args), exempt=("seed",))  # any seed: torch_seed reduces it
    check_context_parallel(args)


def check_context_parallel(args: argparse.Namespace) -> None:
    """ConfigError for a --context-parallel the run cannot take (the number of processes is
    checked in `start_run`)."""
    P = args.context_parallel
    if P < 1:
        raise ConfigError(f"--context-parallel must be at least 1, got {P}")
    if P == 1:
        return
    if args.context_length % (2 * P):
        raise ConfigError(
            f"--context-length {args.context_length} must be divisible by 2 * --context-parallel "
            f"= {2 * P} (each sequence is cut into {2 * P} chunks)"
        )
    for refused, reason in (
        (args.model != "fastlm", "runs fastlm's model (--model fastlm)"),
        (args.pack_documents, "does not take --pack-documents (documents cross the chunks)"),
        (args.compile, "does not run under --compile yet"),
    ):
        if refused:
            raise ConfigError(f"--context-parallel {reason}")


def model_config(args: argparse.Namespace, tokenizer, run: Run) -> ModelConfig:
    """The model's configuration, checked for `--model` on this run's device, and for the
    memory training it takes."""
    vocab_size = tokenizer.vocab_size if args.vocab_size is None else args.vocab_size
    if vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"--vocab-size {vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({tokenizer.vocab_size})"
        )
    fields = {key: getattr(args, key) for key in MODEL_FIELDS if key != "vocab_size"}
    config = ModelConfig(vocab_size=vocab_size, **fields)
    check_memory(args, config, run)
    device = run.device
    try:
        config.check(args.model, device, name=flag)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return config


def memory_bytes(device: torch.device) -> int | None:
    """The memory of a CUDA device, or the host's physical memory for the CPU (None where the
    system does not say)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return None


def check_memory(args: argparse.Namespace, config: ModelConfig, run: Run) -> None:
    """ConfigError when training surely runs out of memory, so that sizes that would fail at
    their first allocation (or never finish building) fail before anything runs. Counts only
    what training cannot do without: the fp32 weights, gradients and AdamW's two moments (16
    bytes a parameter, split over the ranks under FSDP), each block's input kept for the
    backward (a micro-batch's activations, bf16 under CUDA's autocast), and the held-out
    windows' int64 token ids (on the host)."""
    parameters = config.num_parameters()
    state = 16 * parameters // (run.world_size if args.fsdp else 1)
    tokens = args.batch_size * args.context_length
    activation_bytes = 2 if run.device.type == "cuda" else 4
    activations = tokens * config.d_model * config.num_layers * activation_bytes
    windows = args.batch_size * args.eval_batches
    held_out = windows * (args.context_length + 1) * 8
    model = (
        f"{parameters:,} parameters at 16 bytes (fp32 weights, gradients and AdamW's two "
        f"moments) and activations of {tokens:,} tokens x {config.num_layers:,} layers x "
        f"{config.d_model:,}"
    )
    windows_text = f"{windows:,} held-out windows of {args.context_length + 1:,} int64 tokens"
    cpu = torch.device("cpu")
    if run.device.type == "cuda":
        needs = {run.device: (state + activations, model), cpu: (held_out, windows_text)}
    else:
        needs = {cpu: (state + activations + held_out, f"{model}; {windows_text}")}
    for device, (need, what) in needs.items():
        available = memory_bytes(device)
        if available is not None and need > available:
            raise ConfigError(
                f"training needs at least {need / 2**30:,.1f} GiB on {device} ({what}), more "
                f"than the {available / 2**30:,.1f} GiB it has: choose smaller sizes"
            )


# Settings that shape the loss curve: a resumed run that changes one continues another curve.
CURVE_SETTINGS = (
    "data",
    "tokenizer",
    "batch_size",
    "grad_accum",
    "lr",
    "min_lr",
    "warmup",
    "steps",
    "weight_decay",
    "betas",
    "grad_clip",
    "seed",
    "val_fraction",
)


def curve_settings(args: argparse.Namespace, world_size: int) -> dict:
    settings = {key: getattr(args, key) for key in CURVE_SETTINGS}
    settings["betas"] = list(settings["betas"])
    if args.pack_documents:  # only when set: checkpoints from before the flag compare equal
        settings["pack_documents"] = True
    if args.document_separator is not None:
        settings["document_separator"] = args.document_separator
    return {**settings, "world_size": world_size}


def resume_note(saved: dict, args: argparse.Namespace, world_size: int) -> str | None:
    """What a resumed run changes against the checkpoint's settings, or None."""
    settings, step = curve_settings(args, world_size), saved["step"]
    old = saved["settings"]
    changed = [key for key, value in settings.items() if old.get(key) != value]
    if not changed:
        return None
    listed = ", ".join(f"{flag(key)} {settings[key]} (was {old.get(key)})" for key in changed)
    note = (
        f"note: resuming with {listed}, so from step {step + 1} on the run differs from "
        "the one the checkpoint began"
    )
    schedule = ("lr", "min_lr", "warmup", "steps")
    if set(changed) & set(schedule) and all(
        isinstance(old.get(key), (int, float)) for key in schedule
    ):
        before = reference.cos_lr_scheduler(step, *(old[key] for key in schedule))
        after = reference.cos_lr_scheduler(step + 1, args.lr, args.min_lr, args.warmup, args.steps)
        note += (
            "; the learning-rate schedule (warm-up, then cosine decay to --min-lr at "
            f"--steps) now follows the new settings: the rate goes from {before:.3g} at "
            f"step {step} to {after:.3g} at step {step + 1}"
        )
    return note


# --------------------------------------------------------------------------------------------
# Distributed set-up
# --------------------------------------------------------------------------------------------


@dataclass
class Run:
    """Where this process trains: its rank among `world_size` and its device; with context
    parallelism, the `context` ranks of its `context_group` (neighbours in rank order) share
    each sequence, and the data is split `world_size / context` ways."""

    rank: int
    world_size: int
    device: torch.device
    context: int = 1
    context_group: dist.ProcessGroup | None = None

    @property
    def data_rank(self) -> int:
        return self.rank // self.context

    @property
    def data_size(self) -> int:
        return self.world_size // self.context

    @property
    def context_rank(self) -> int:
        return self.rank % self.context

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """`values` averaged over the ranks (gloo has no AVG, so SUM and divide)."""
        if self.world_size > 1:
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
            values = values / self.world_size
        return values


def start_run(args: argparse.Namespace) -> Run:
    """Join torchrun's process group when there is one (nccl on CUDA, gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = pick_device(args.device, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    if world_size == 1 and args.fsdp:
        raise ConfigError("--fsdp shards over several processes: start with torchrun")
    if world_size % args.context_parallel:
        raise ConfigError(
            f"--context-parallel {args.context_parallel} must divide the number of processes "
            f"({world_size}): start with torchrun --nproc_per_node=<a multiple of it>"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if device.type == "cpu":
        # The embedding's backward otherwise adds rows in thread order: with this, reruns and
        # resumed runs are bitwise equal, at no measurable cost. main() restores the setting.
        torch.use_deterministic_algorithms(True, warn_only=True)
    if world_size == 1:
        return Run(0, 1, device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    run = Run(dist.get_rank(), world_size, device, args.context_parallel)
    if run.context > 1:  # DDP and FSDP2 keep the whole world: gradients average over both
        run.context_group = context_parallel_mesh(run.context, device.type)["context"].get_group()
    return run


def agree(run: Run, action) -> object:
    """`action()`'s result on this rank. Under torchrun a command error (a rank's data shard too
    small, say, or the checkpoint folder in use) on one rank is raised on every rank: the others
    would otherwise wait for it in their next collective."""
    result, failure = None, None
    try:
        result = action()
    except (ConfigError, DataError, CheckpointError) as error:
        if run.world_size == 1:
            raise
        failure = error
    if run.world_size > 1:
        failures = [None] * run.world_size
        dist.all_gather_object(failures, failure)
        for rank, failure in enumerate(failures):
            if failure is not None:
                raise type(failure)(f"rank {rank}: {failure}")
    return result


def distribute(loss_module: NextTokenLoss, run: Run, fsdp: bool) -> nn.Module:
    """DDP, or FSDP2 with one unit per transformer block, when there are several ranks."""
    if run.world_size == 1:
        return loss_module
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in loss_module.model.blocks:
            fully_shard(block)
        return fully_shard(loss_module)
    device_ids = [run.device.index] if run.device.type == "cuda" else None
    # The buffers (RoPE tables, causal masks) are constants: no broadcast before each forward.
    # torch 2.13 renamed the option (the old name warns on every rank).
    ddp_options = inspect.signature(nn.parallel.DistributedDataParallel).parameters
    no_sync = (
        "forward_sync_buffers" if "forward_sync_buffers" in ddp_options else "broadcast_buffers"
    )
    return nn.parallel.DistributedDataParallel(
        loss_module, device_ids=device_ids, **{no_sync: False}
    )


def gradient_sync(module: nn.Module, enabled: bool):
    """A context that skips the gradient all-reduce on all but the last micro-batch."""
    if enabled or isinstance(module, NextTokenLoss):
        return contextlib.nullcontext()
    if isinstance(module, nn.parallel.DistributedDataParallel):
        return module.no_sync()
    module.set_requires_gradient_sync(False)  # FSDP2: re-enabled before the last micro-batch
    return contextlib.nullcontext()


def make_optimizer(
    parameters, args: argparse.Namespace, device: torch.device
) -> torch.optim.Optimizer:
    """PyTorch's AdamW on every device, so that a checkpoint resumes on any: fused on CUDA
    (foreach under FSDP). reference.AdamW is the same math (tests/test_reference.py)."""
    hyper = dict(lr=args.lr, betas=tuple(args.betas), weight_decay=args.weight_decay)
    fused = device.type == "cuda" and not args.fsdp
    return torch.optim.AdamW(parameters, **hyper, **({"fused": True} if fused else {}))


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class, which fixes the layout of its state."""
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def clip_gradients(module: nn.Module, max_norm: float, device: torch.device, fsdp: bool) -> None:
    """Scale the gradients to a global norm of at most `max_norm` (0: leave them)."""
    if max_norm == 0:
        return
    if fsdp or device.type == "cuda":
        # PyTorch's clip takes the norm of DTensor (FSDP) gradients over all ranks, and it never
        # waits for the GPU (the reference reads the norm back) nor launches a kernel per tensor.
        torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm, foreach=True)
    else:
        reference.gradient_clip(module.parameters(), max_norm)


def state_dict_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def full_state(loss_module: NextTokenLoss, optimizer: torch.optim.Optimizer):
    """Unsharded weights and optimizer state (a collective under FSDP: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = state_dict_options(cpu_offload=True)
    weights = get_model_state_dict(loss_module.model, options=options)
    return weights, get_optimizer_state_dict(loss_module, optimizer, options=options)


def load_optimizer(
    loss_module: NextTokenLoss, optimizer: torch.optim.Optimizer, state: dict
) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    try:
        set_optimizer_state_dict(loss_module, optimizer, state, options=state_dict_options())
    except (KeyError, ValueError, TypeError, RuntimeError) as error:
        raise CheckpointError(f"the optimizer state does not fit the model ({error})") from None


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the most memory PyTorch allocated; CPU: the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def peak_flops(args: argparse.Namespace, device: torch.device) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def plot_losses(path: Path, train_losses: list[float], val_losses: list[list[float]]) -> str | None:
    """Write the loss-curve PNG; a note instead when matplotlib is missing or the file cannot
    be written (the checkpoint, whose files are written by then, goes without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed, so no loss-curve PNG (pip install matplotlib)"
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(range(1, len(train_losses) + 1), train_losses, label="training", linewidth=0.8)
    if val_losses:
        steps, losses = zip(*val_losses)
        axes.plot(steps, losses, "o-", label="held-out")
    axes.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="fastlm-train")
    axes.legend()
    axes.grid(alpha=0.3)
    try:
        figure.savefig(path, format="png")
    except OSError as error:  # a full disk, say
        path.unlink(missing_ok=True)
        return (
            f"could not write the loss curve {path.name} ({error.strerror}): this checkpoint "
            "has none"
        )
    finally:
        plt.close(figure)
    return None


class Throughput:
    """Tokens per second over this run's steps after the first, which pays for compilation and
    warm-up (over the first alone while there is no other)."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.step_seconds: list[float] = []

    def add(self, seconds: float) -> None:
        self.step_seconds.append(seconds)

    @property
    def total_seconds(self) -> float:
        return sum(self.step_seconds)

    @property
    def tokens_per_second(self) -> float:
        timed = self.step_seconds[1:] or self.step_seconds
        return len(timed) * self.tokens_per_step / sum(timed) if timed else 0.0


class StopRequest:
    """Ctrl-C asks the loop to stop after the current step (which is then checkpointed); a
    second Ctrl-C interrupts at once."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):  # runs between bytecodes of the main thread
        self.requested = True
        signal.signal(signal.SIGINT, self._previous)

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._previous)


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


class Trainer:
    """This rank's share of a run: the model (wrapped for DDP or FSDP), optimizer, data and the
    loss history, which a checkpoint restores whole."""

    def __init__(
        self,
        args: argparse.Namespace,
        run: Run,
        config: ModelConfig,
        tokenizer_name: str,
        out: Path,
        split: TokenSplit,
        saved: dict | None,
    ):
        self.args, self.run, self.split, self.out = args, run, split, out
        self.config = {**config.as_dict(), "tokenizer": tokenizer_name}  # what a checkpoint keeps
        torch.manual_seed(torch_seed(args.seed))  # the same initial weights on every rank
        self.model = build_model(config, args.model, run.device)
        if run.context_group is not None:
            self.model.set_context_parallel(run.context_group)
        if saved is not None:
            checkpoint.fit_weights(self.model, saved["weights"], out)
        self.loss_module = NextTokenLoss(self.model)
        self.wrapped = distribute(self.loss_module, run, args.fsdp)
        self.optimizer = make_optimizer(self.wrapped.parameters(), args, run.device)
        if saved is not None:
            if saved["optimizer_kind"] != optimizer_kind(self.optimizer):
                raise CheckpointError(
                    f"{out} holds {saved['optimizer_kind']} state, but this run "
                    f"uses {optimizer_kind(self.optimizer)} (a checkpoint of "
                    "an older fastlm-train)"
                )
            load_optimizer(self.loss_module, self.optimizer, saved["optimizer"])
        self.loss_fn = torch.compile(self.wrapped) if args.compile else self.wrapped
        self.step = saved["step"] if saved else 0
        self.train_losses: list[float] = list(saved["train_losses"]) if saved else []
        # Targets this rank's training batches left out (document starts under --pack-documents)
        # and all of them, this run: rows are windows of the token stream, never padded.
        self.targets_ignored = self.targets_seen = 0
        self.val_losses: list[list[float]] = list(saved["val_losses"]) if saved else []
        self.validation = eval_batches(
            split.val, args.batch_size, args.context_length, args.eval_batches, split.val_starts
        )

    def autocast(self):
        if self.run.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def loss(
        self, token_ids: torch.Tensor, targets: torch.Tensor, cu_seqlens: torch.Tensor | None
    ) -> torch.Tensor:
        device = self.run.device
        packed = () if cu_seqlens is None else (cu_seqlens.to(device),)
        if self.run.context > 1:  # this rank's chunks of each sequence
            token_ids, targets = (
                shard_sequence(t, self.run.context_rank, self.run.context)
                for t in (token_ids, targets)
            )
        with self.autocast():
            return self.loss_fn(token_ids.to(device), targets.to(device), *packed)

    def train_step(self, stop: StopRequest) -> tuple[float, bool]:
        """One optimizer step; its loss averaged over micro-batches and ranks, and whether any
        rank asked to stop (one collective for both keeps the ranks stopping together)."""
        args = self.args
        lr = reference.cos_lr_scheduler(
            self.step + 1, args.lr, args.min_lr, args.warmup, args.steps
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.run.device)
        for micro in range(args.grad_accum):
            last = micro == args.grad_accum - 1
            if last and args.fsdp:
                self.wrapped.set_requires_gradient_sync(True)
            token_ids, targets, cu_seqlens = training_batch(
                self.split.train,
                args.batch_size,
                args.context_length,
                args.seed,
                self.run.data_rank,
                self.step,
                micro,
                self.split.train_starts,
            )
            self.targets_seen += targets.numel()
            self.targets_ignored += int((targets == IGNORE_INDEX).sum())  # on the host: no sync
            with gradient_sync(self.wrapped, last):
                loss = self.loss(token_ids, targets, cu_seqlens)
                (loss / args.grad_accum).backward()
            total += loss.detach().float()
        clip_gradients(self.wrapped, args.grad_clip, self.run.device, args.fsdp)
        self.optimizer.step()
        self.step += 1
        flags = torch.tensor(float(stop.requested), device=self.run.device)
        loss, stopping = self.run.mean(torch.stack([total / args.grad_accum, flags])).tolist()
        self.train_losses.append(loss)
        return loss, stopping > 0

    @torch.no_grad()
    def held_out_loss(self) -> float:
        """Mean loss on the fixed held-out batches (all ranks)."""
        self.loss_fn.eval()
        total = sum(self.loss(*batch).float() for batch in self.validation)
        self.loss_fn.train()
        return self.run.mean(total / len(self.validation)).item()

    def evaluate(self) -> float:
        """held_out_loss, recorded in the history."""
        loss = self.held_out_loss()
        self.val_losses.append([self.step, loss])
        return loss

    def fit_to_save(self, held_out: float | None) -> bool:
        """Whether the weights may be written (every rank agrees): all finite, and their
        held-out loss (`held_out`, this step's evaluation, or computed now and not recorded)
        finite too. A finite but diverged model (weights so large that the next loss
        overflows) fails the second test."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]
        finite = torch.stack([torch.isfinite(p).all() for p in local]).all()
        if self.run.mean(finite.float()).item() < 1:
            return False
        return math.isfinite(self.held_out_loss() if held_out is None else held_out)

    def save(self) -> str | None:
        """Checkpoint and loss curve (rank 0 writes; under FSDP every rank gathers); a note
        when the curve cannot be drawn."""
        weights, optimizer_state = full_state(self.loss_module, self.optimizer)
        if not self.run.is_main:
            return None
        state = {
            "optimizer": optimizer_state,
            "optimizer_kind": optimizer_kind(self.optimizer),
            "train_losses": self.train_losses,
            "val_losses": self.val_losses,
            "settings": curve_settings(self.args, self.run.data_size),
        }
        # The curve is part of the checkpoint folder, which is replaced whole.
        with checkpoint.replacing(self.out) as folder:
            checkpoint.write(folder, weights, self.config, self.step, state, self.args.tokenizer)
            note = plot_losses(folder / LOSS_CURVE, self.train_losses, self.val_losses)
        return note


def claim_out(args: argparse.Namespace, out: Path, config: dict, stack: contextlib.ExitStack):
    """Lock the checkpoint folder for this run and check it suits the run, before any data is
    read: a checkpoint is never replaced without --resume or --overwrite, nor a folder of other
    files, and a folder that cannot be written fails now rather than at the first save."""
    stack.enter_context(checkpoint.locked(out))
    if checkpoint.exists(out) and not (args.resume or args.overwrite):
        raise CheckpointError(
            f"{args.out} already holds a checkpoint: pass --resume to continue "
            "it, --overwrite to replace it, or another --out"
        )
    checkpoint.check_replaceable(out)
    if args.resume:
        checkpoint.check_config(with_defaults(checkpoint.load_config(out)), config, args.out)


def load_saved(out: Path) -> dict:
    """The training state to resume, with the weights under "weights", all of it checked (from
    `out`, or `out.old` after an interrupted save)."""
    folder = checkpoint.resolve(out)
    saved = checkpoint.load_state(folder)
    missing = [key for key in STATE_KEYS if key not in saved]
    if missing:
        raise CheckpointError(
            f"{folder / checkpoint.STATE} lacks {', '.join(missing)}: it was "
            "not written by fastlm-train"
        )
    return {**saved, "weights": checkpoint.load_weights(folder)}


def prepare(
    args: argparse.Namespace, run: Run, out: Path, stack: contextlib.ExitStack, say
) -> Trainer:
    """Check the configuration and the checkpoint folder before reading any data, then build
    the trainer (restored from the checkpoint with --resume)."""
    tokenizer = load_tokenizer(args.tokenizer)
    config = model_config(args, tokenizer, run)
    stored = {**config.as_dict(), "tokenizer": tokenizer.name}
    agree(run, lambda: claim_out(args, out, stored, stack) if run.is_main else None)
    saved = None
    if args.resume:
        saved = load_saved(out)
        note = resume_note(saved, args, run.data_size)
        if note:
            say(note)
        if args.steps <= saved["step"]:
            say(
                f"note: the checkpoint is at step {saved['step']} and --steps is {args.steps}: "
                "nothing to train (a larger --steps continues it)"
            )
    split = agree(
        run,
        lambda: load_split(
            args.data,
            tokenizer,
            args.context_length,
            args.val_fraction,
            run.data_rank,
            run.data_size,
            say,
            args.pack_documents,
            args.document_separator,
        ),
    )
    return Trainer(args, run, config, tokenizer.name, out, split, saved)


def finite_or_none(value: float | None) -> float | None:
    """JSON has no NaN or infinity: null instead."""
    return value if value is not None and math.isfinite(value) else None


def train(args: argparse.Namespace) -> int:
    check_args(args)
    run = start_run(args)
    # Resolved once: a link to a folder is written through, and stays a link.
    out = Path(os.path.realpath(args.out))
    with contextlib.ExitStack() as stack:  # holds the lock on `out` until the run ends
        return run_training(args, run, out, stack)


def run_training(args: argparse.Namespace, run: Run, out: Path, stack: contextlib.ExitStack) -> int:
    def say(message: str) -> None:
        if run.is_main:
            tqdm.write(message, file=sys.stderr)

    trainer = prepare(args, run, out, stack, say)
    parameters = sum(p.numel() for p in trainer.model.parameters())
    tokens_per_step = args.batch_size * args.context_length * args.grad_accum * run.data_size
    work_per_token = flops_per_token(trainer.model, trainer.config)
    peak = peak_flops(args, run.device)
    say(
        f"fastlm-train: {args.model} model, {parameters / 1e6:.2f}M parameters, preset "
        f"{args.preset}, {len(trainer.split.train) * run.data_size / 1e6:.2f}M training tokens, "
        f"{run.world_size} x {run.device.type}"
        + (", FSDP" if args.fsdp else "")
        + (f", context parallel {run.context}" if run.context > 1 else "")
    )
    if peak:
        say(
            f"MFU counts {work_per_token / 1e6:.1f} MFLOP/token (PaLM convention) against "
            f"{peak / 1e12:.0f} TFLOP/s dense bf16 per GPU"
        )

    def mfu(tokens_per_second: float) -> float | None:
        return work_per_token * tokens_per_second / (peak * run.world_size) if peak else None

    throughput = Throughput(tokens_per_step)
    interrupted, plot_note, diverged = False, None, None  # diverged: what went non-finite
    saved_step = trainer.step if args.resume else None  # what --out holds of this run
    # A bar only on a terminal: in a log file each redraw would be a line of its own. The
    # line printed at each evaluation says the same.
    progress = tqdm(
        total=args.steps,
        initial=min(trainer.step, args.steps),
        desc="training",
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5,
        disable=args.no_progress or not run.is_main or not sys.stderr.isatty(),
    )
    with StopRequest() as stop:
        while trainer.step < args.steps:
            started = time.perf_counter()
            loss, interrupted = trainer.train_step(stop)
            throughput.add(time.perf_counter() - started)
            step = trainer.step
            if not math.isfinite(loss):
                diverged = f"the training loss is {loss} at step {step}"
            postfix = {"loss": f"{loss:.3f}", "tok/s": f"{throughput.tokens_per_second:,.0f}"}
            if peak:
                postfix["mfu"] = f"{mfu(throughput.tokens_per_second):.1%}"
            progress.set_postfix(postfix, refresh=False)
            progress.update()
            held_out = None
            if not diverged and (step % args.eval_every == 0 or step == args.steps):
                held_out = trainer.evaluate()
                say(
                    f"step {step}/{args.steps}: training loss {loss:.4f}, held-out loss "
                    f"{held_out:.4f}, {throughput.tokens_per_second:,.0f} tokens/s"
                )
                if not math.isfinite(held_out):
                    diverged = f"the held-out loss is {held_out} at step {step}"
            periodic_save = args.save_every and step % args.save_every == 0
            if not diverged and (interrupted or step == args.steps or periodic_save):
                if trainer.fit_to_save(held_out):
                    plot_note, saved_step = trainer.save(), step
                else:
                    diverged = f"the weights of step {step} are not finite or give no finite loss"
            if diverged:
                kept = (
                    f"{args.out} keeps the checkpoint of step {saved_step}"
                    if saved_step is not None
                    else f"nothing was written to {args.out}"
                )
                say(
                    f"fastlm-train: {diverged}: the run diverged and stops, saving nothing "
                    f"more ({kept}); a lower --lr, or --grad-clip, may help"
                )
                break
            if interrupted:
                say(
                    f"interrupted: checkpoint of step {step} saved in {args.out}; "
                    "--resume continues it"
                )
                break
    progress.close()
    if plot_note:
        say(f"note: {plot_note}")
    if not trainer.val_losses:  # interrupted before the first evaluation, or nothing to train
        trainer.evaluate()
    written = saved_step is not None

    if run.is_main:
        curve = out / LOSS_CURVE
        summary = {
            "initial_loss": trainer.train_losses[0] if trainer.train_losses else None,
            "final_loss": trainer.train_losses[-1] if trainer.train_losses else None,
            "val_loss": trainer.val_losses[-1][1],
            "tokens_per_second": round(throughput.tokens_per_second, 1),
            "peak_memory_bytes": peak_memory_bytes(run.device),
            "checkpoint": str(args.out) if written else None,
            "loss_curve": str(Path(args.out) / LOSS_CURVE) if written and curve.is_file() else None,
            "mfu": mfu(throughput.tokens_per_second),
            "steps": trainer.step,
            "targets": trainer.targets_seen,
            "targets_ignored": trainer.targets_ignored,
            "train_seconds": round(throughput.total_seconds, 2),
            "parameters": parameters,
            "model": args.model,
            "preset": args.preset,
            "device": run.device.type,
            "world_size": run.world_size,
            "interrupted": interrupted,
            "diverged": diverged is not None,
        }
        summary = {
            key: finite_or_none(value) if isinstance(value, float) else value
            for key, value in summary.items()
        }
        print(json.dumps(summary, allow_nan=False), flush=True)
    if run.world_size > 1:
        # Leave together: a rank that tears down its gloo connections while rank 0 is still
        # writing the checkpoint can abort ("terminate called without an active exception").
        dist.barrier()
    if diverged:
        return 3
    return 130 if interrupted else 0


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, train, and return the exit status; bad input is one line on stderr."""
    args = parse_args(argv)
    deterministic = torch.are_deterministic_algorithms_enabled()
    deterministic_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        return train(args)
    except (ConfigError, DataError, CheckpointError) as error:
        print(f"fastlm-train: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C, or one before training started: nothing saved
        print("fastlm-train: interrupted before a checkpoint could be saved", file=sys.stderr)
        return 130
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=deterministic_warn_only)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
