"""`python -m fastlm.cli.train`: train a decoder-only language model, on a CPU, a GPU or many.

With no arguments it trains the `tiny` preset on the Python standard library's own sources
(byte tokens) for about a minute on a CPU, checkpointing to `checkpoints/tiny`. The progress
bar and notes go to stderr; stdout gets one JSON line (the run's summary) at the end.

    python -m fastlm.cli.train                                    # tiny preset, default corpus
    python -m fastlm.cli.train --data my_texts/ --preset gpt2-small --compile
    torchrun --nproc_per_node=8 -m fastlm.cli.train --preset gpt2-medium [--fsdp]
    torchrun --nproc_per_node=8 -m fastlm.cli.train --context-parallel 4   # 2 data x 4 context
    torchrun --nproc_per_node=8 -m fastlm.cli.train --tensor-parallel 2 --context-parallel 2 --fsdp
    torchrun --nproc_per_node=8 -m fastlm.cli.train --preset gpt2-small-moe --expert-parallel 4

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
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from fastlm import checkpoint, metrics_log, reference, token_cache
from fastlm.checkpoint import CheckpointError
from fastlm.cli import cpu_threads
from fastlm.cli.trainer import (
    LOSS_CURVE,
    PEAK_BF16_FLOPS,
    STATE_KEYS,
    Run,
    StopRequest,
    Throughput,
    Trainer,
    agree,
    curve_settings,
    peak_flops,
    peak_memory_bytes,
    start_run,
)
from fastlm.config import (
    MODEL_FIELDS,
    OPTION_DEFAULTS,
    PRESETS,
    ConfigError,
    ModelConfig,
    check_integers,
    with_defaults,
)
from fastlm.corpus import corpus_sources
from fastlm.data import DataError, check_split_options, load_split
from fastlm.expert_parallel import check_expert_parallel
from fastlm.metrics_log import LOGGERS, MetricsLog
from fastlm.options import FLOAT32_MAX
from fastlm.overwrite import check_spares_inputs
from fastlm.tensor_parallel import check_plan
from fastlm.tokens import load_tokenizer, lossy_note


def flag(key: str) -> str:
    """The command-line spelling of an argument: min_lr -> --min-lr."""
    return "--" + key.replace("_", "-")


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
        help="text file or folder, Parquet/JSON Lines files or folders of them, a datasets "
        "folder, or a fastlm-prepare folder (default: the Python standard library's sources)",
    )
    parser.add_argument(
        "--text-column", default="text", help="Parquet column or JSON field (%(default)s)"
    )
    parser.add_argument("--tokenizer", help="Hugging Face tokenizers JSON (default: UTF-8 bytes)")
    parser.add_argument(
        "--skip-empty",
        action="store_true",
        help="skip records whose text is null or empty (counted in a note) instead of "
        "refusing a null one",
    )
    parser.add_argument(
        "--pack-documents",
        action="store_true",
        help="each document (a text file, or a record) apart: attention and positions stay "
        "within a document (packed, flash_attention_varlen), and no token predicts the next "
        "document's first",
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
    moe = parser.add_argument_group(
        "mixture of experts (default: the preset's; docs/moe-training.md)"
    )
    moe.add_argument(
        "--num-experts", type=int, help="experts per MoE layer; 0: the dense model (0)"
    )
    moe.add_argument("--experts-per-token", type=int, help="k, the experts a token uses (2)")
    moe.add_argument("--moe-d-ff", type=int, help="each expert's hidden width (--d-ff)")
    moe.add_argument(
        "--num-shared-experts", type=int, help="experts every token uses, one SwiGLU (0)"
    )
    moe.add_argument("--first-dense-layers", type=int, help="the first layers stay dense (0)")
    moe.add_argument(
        "--router",
        choices=("softmax", "sigmoid"),
        help="softmax top-k (the default), or sigmoid scores with a balancing bias",
    )
    moe.add_argument(
        "--normalize-top-k",
        action=argparse.BooleanOptionalAction,
        help="renormalise each token's k weights to sum 1 (the default)",
    )
    moe.add_argument("--aux-loss-coef", type=float, help="load-balancing loss coefficient (0.01)")
    moe.add_argument("--z-loss-coef", type=float, help="router z-loss coefficient (0.001)")
    moe.add_argument(
        "--router-bias-rate", type=float, help="the sigmoid router's bias step per step (0.001)"
    )

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
    run.add_argument(
        "--threads",
        type=int,
        help="CPU threads (default: OMP_NUM_THREADS if set, else the cores the machine's load "
        "leaves free, at least 1, and no more than the model's step pays for: 1, and 1 more for "
        "each 2 GFLOP of a step: a micro-batch's forward and backward)",
    )
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
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="T",
        help="under torchrun, split each layer over T ranks (tensor and sequence parallelism: "
        "heads, d_ff and the vocabulary divisible by T); a (data x context x tensor) mesh (1)",
    )
    run.add_argument(
        "--expert-parallel",
        type=int,
        default=1,
        metavar="P",
        help="under torchrun, spread each MoE layer's experts over P ranks (expert parallelism: "
        "E / P experts each, P divides the processes and --num-experts); every rank keeps its "
        "own data (1)",
    )
    run.add_argument(
        "--peak-tflops",
        type=float,
        help="the GPU's dense bf16 peak, for the MFU "
        f"(default: known for {', '.join(PEAK_BF16_FLOPS)})",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument(
        "--log",
        "--logger",  # under torchrun: its parser takes --log for an abbreviation of its own
        dest="log",
        action="append",
        choices=LOGGERS,
        default=[],
        help="also log the metrics to TensorBoard or Weights & Biases (offline without "
        "WANDB_API_KEY); may be given twice; --logger under torchrun",
    )
    run.add_argument("--log-dir", help="where --log writes (default: OUT.logs beside --out)")
    args = parser.parse_args(argv)

    preset = PRESETS[args.preset]
    for key, value in {**OPTION_DEFAULTS, **preset}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.out = args.out or os.path.join("checkpoints", args.preset)
    args.log_dir = args.log_dir or os.path.normpath(args.out) + ".logs"
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
        "threads",
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
        "aux_loss_coef",
        "z_loss_coef",
        "router_bias_rate",
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
    metrics_log.check_available(args.log)
    check_integers(vars(args), exempt=("seed",))  # any seed: torch_seed reduces it
    check_context_parallel(args)
    check_tensor_parallel(args)
    check_expert_parallel_args(args)


def check_expert_parallel_args(args: argparse.Namespace) -> None:
    """ConfigError for an --expert-parallel the run cannot take, the processes included (from
    torchrun's WORLD_SIZE): all before any process group is made."""
    P = args.expert_parallel
    if P < 1:
        raise ConfigError(f"--expert-parallel must be at least 1, got {P}")
    if P == 1:
        return
    if not args.num_experts:
        raise ConfigError(
            f"--expert-parallel {P} spreads a mixture of experts' experts, but the model is "
            "dense (--num-experts 0): pass --num-experts or an MoE --preset"
        )
    for refused, reason in (
        (args.model != "fastlm", "runs fastlm's model (--model fastlm)"),
        (args.tensor_parallel > 1, "does not combine with --tensor-parallel yet"),
    ):
        if refused:
            raise ConfigError(f"--expert-parallel {reason}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        check_expert_parallel(args.num_experts, P, world, name=flag)
    except (TypeError, ValueError) as error:
        raise ConfigError(str(error)) from None


def check_tensor_parallel(args: argparse.Namespace) -> None:
    """ConfigError for a --tensor-parallel the run cannot take (the model's heads, d_ff and
    vocabulary are checked with its configuration, the processes in `start_run`)."""
    T = args.tensor_parallel
    if T < 1:
        raise ConfigError(f"--tensor-parallel must be at least 1, got {T}")
    if T == 1:
        return
    shard = args.context_length // args.context_parallel
    if shard % T:
        raise ConfigError(
            f"--context-length {args.context_length} / --context-parallel "
            f"{args.context_parallel} = {shard} tokens must be divisible by --tensor-parallel {T} "
            "(sequence parallelism splits them)"
        )
    if args.model != "fastlm":
        raise ConfigError("--tensor-parallel runs fastlm's model (--model fastlm)")


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
        check_plan(config.as_dict(), args.tensor_parallel, name=flag)
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
    if args.overwrite and out.exists():
        inputs = [("--data", s.path) for s in corpus_sources(args.data, exclude=(out,))]
        if args.tokenizer is not None:
            inputs.append(("--tokenizer", args.tokenizer))
        check_spares_inputs(out, "--out", inputs, CheckpointError)
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
    if args.tokenizer is None and args.data is not None and token_cache.is_cache(args.data):
        copy = Path(args.data) / token_cache.TOKENIZER  # the tokenizer it was prepared with
        if copy.is_file():
            args.tokenizer = str(copy)
            say(f"note: tokenizer {copy}, the one {args.data} was prepared with")
    tokenizer = load_tokenizer(args.tokenizer)
    note = lossy_note(tokenizer)
    if note:
        say(note)
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
            args.text_column,
            exclude=(out,),  # a checkpoint folder inside --data is none of its text
            skip_empty=args.skip_empty,
            progress=not args.no_progress and run.is_main,
        ),
    )
    return Trainer(args, run, config, tokenizer.name, out, split, saved)


def moe_text(stats: dict[str, float]) -> str:
    """A mixture of experts' balance over the last step, for the evaluation line."""
    return (
        f"; experts' tokens max/mean {stats['load_max_over_mean']:.2f}, balance loss "
        f"{stats['balance_loss']:.4f}, z-loss {stats['z_loss']:.4g}"
    )


def finite_or_none(value: float | None) -> float | None:
    """JSON has no NaN or infinity: null instead."""
    return value if value is not None and math.isfinite(value) else None


def train(args: argparse.Namespace) -> int:
    check_args(args)
    run = start_run(args)
    if run.device.type == "cpu":
        args.cpu_threads, args.threads_why = cpu_threads(args.threads)
        torch.set_num_threads(args.cpu_threads)  # main() restores the setting
    # Resolved once: a link to a folder is written through, and stays a link.
    out = Path(os.path.realpath(args.out))
    with contextlib.ExitStack() as stack:  # holds the lock on `out` until the run ends
        return run_training(args, run, out, stack)


def run_training(args: argparse.Namespace, run: Run, out: Path, stack: contextlib.ExitStack) -> int:
    def say(message: str) -> None:
        if run.is_main:
            tqdm.write(message, file=sys.stderr)

    trainer = prepare(args, run, out, stack, say)
    # counted on the whole model (expert parallelism holds a share of the experts here)
    parameters = trainer.num_parameters
    tokens_per_step = args.batch_size * args.context_length * args.grad_accum * run.data_size
    work_per_token = trainer.flops_per_token
    threads_text = ""
    if run.device.type == "cpu":  # the model known: its micro-batch's forward and backward
        step_work = work_per_token * args.batch_size * args.context_length
        args.cpu_threads, args.threads_why = cpu_threads(args.threads, step_work)
        torch.set_num_threads(args.cpu_threads)  # main() restores the setting
        threads_text = f"{args.cpu_threads} CPU thread{'s' if args.cpu_threads > 1 else ''}"
    peak = peak_flops(args, run.device)
    say(
        f"fastlm-train: {args.model} model, {parameters / 1e6:.2f}M parameters, preset "
        f"{args.preset}, {len(trainer.split.train) * run.data_size / 1e6:.2f}M training tokens, "
        f"{run.world_size} x {run.device.type}"
        + (", FSDP" if args.fsdp else "")
        + (f", context parallel {run.context}" if run.context > 1 else "")
        + (f", tensor parallel {run.tensor}" if run.tensor > 1 else "")
        + (f", expert parallel {run.expert}" if run.expert > 1 else "")
        + (f", {threads_text} ({args.threads_why})" if run.device.type == "cpu" else "")
    )
    if peak:
        say(
            f"MFU counts {work_per_token / 1e6:.1f} MFLOP/token (PaLM convention) against "
            f"{peak / 1e12:.0f} TFLOP/s dense bf16 per GPU"
        )

    def mfu(tokens_per_second: float) -> float | None:
        return work_per_token * tokens_per_second / (peak * run.world_size) if peak else None

    throughput = Throughput(tokens_per_step)
    # --log: TensorBoard / Weights & Biases, on the main rank (a failing logger only warns).
    logged = {**trainer.config, **curve_settings(args, run.data_size), "preset": args.preset}
    metrics = MetricsLog(args.log if run.is_main else [], Path(args.log_dir), logged, say)
    stack.callback(metrics.close)
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
            moe = trainer.moe_stats
            if moe:  # the busiest expert's tokens over the mean (the worst layer's), the losses
                postfix["load"] = f"{moe['load_max_over_mean']:.2f}"
                postfix["bal"] = f"{moe['balance_loss']:.3f}"
                postfix["z"] = f"{moe['z_loss']:.3g}"
            progress.set_postfix(postfix, refresh=False)
            progress.update()
            if metrics.loggers:
                norm = trainer.grad_norm
                lr = trainer.optimizer.param_groups[0]["lr"]
                metrics.log(
                    {
                        "train/loss": loss,
                        "train/lr": lr,
                        "train/grad_norm": None if norm is None else float(norm),
                        "train/tokens_per_second": throughput.tokens_per_second,
                        **{f"moe/{key}": value for key, value in moe.items()},
                    },
                    step,
                )
            held_out = None
            if not diverged and (step % args.eval_every == 0 or step == args.steps):
                held_out = trainer.evaluate()
                if metrics.loggers:
                    measured = {
                        "eval/loss": held_out,
                        "system/mfu": mfu(throughput.tokens_per_second),
                    }
                    measured["system/peak_memory_bytes"] = peak_memory_bytes(run.device)
                    metrics.log(measured, step, flush=True)
                say(
                    f"step {step}/{args.steps}: training loss {loss:.4f}, held-out loss "
                    f"{held_out:.4f}, {throughput.tokens_per_second:,.0f} tokens/s"
                    + (f" on {threads_text}" if threads_text else "")
                    + (moe_text(trainer.moe_stats) if trainer.moe_stats else "")
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
    threads = torch.get_num_threads()
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
        torch.set_num_threads(threads)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
