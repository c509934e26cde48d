"""The training loop's pieces behind `fastlm-train`: the next-token loss, the distributed set-up
(DDP, FSDP2, a data x context mesh), the optimizer and the full state a checkpoint holds, the
reporting (throughput, peak memory, MFU, the loss plot), and `Trainer`, which runs the steps and
the evaluations and saves. `fastlm.cli.train` is the command around it: its arguments, their
checks, and the run from start to summary."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import os
import resource
import signal
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fastlm import checkpoint, expert_parallel, reference, tensor_parallel
from fastlm.checkpoint import CheckpointError
from fastlm.config import ConfigError, ModelConfig, build_model, pick_device, torch_seed
from fastlm.data import IGNORE_INDEX, DataError, eval_batches, training_batch
from fastlm.distributed import context_parallel_mesh, shard_sequence
from fastlm.tokens import TokenSplit

LOSS_CURVE = checkpoint.LOSS_CURVE

# Dense bf16 peak FLOP/s from the vendors' spec sheets (SXM parts), by device-name substring.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}

# What a state.pt written by this command holds besides its step.
STATE_KEYS = ("optimizer", "optimizer_kind", "train_losses", "val_losses", "settings")


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


class NextTokenLoss(nn.Module):
    """The model and its loss in one forward, so DDP and FSDP see the whole computation.

    A model with `loss(token_ids, targets)` (fastlm's fused linear cross-entropy) computes it
    itself; otherwise the logits go through the reference cross-entropy in float32. In training
    mode a mixture-of-experts model's `auxiliary_loss()` (its load-balancing and z-losses, times
    their coefficients) is added; in eval mode the loss is the cross-entropy alone.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.cross_entropy = reference.CrossEntropyLoss()

    def forward(
        self, token_ids: torch.Tensor, targets: torch.Tensor, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """cu_seqlens: packed documents (`Transformer.loss` / `reference.Transformer.forward`)."""
        loss = self.next_token_loss(token_ids, targets, cu_seqlens)
        auxiliary = self.model.auxiliary_loss() if self.training else None
        return loss if auxiliary is None else loss + auxiliary

    def next_token_loss(self, token_ids, targets, cu_seqlens) -> torch.Tensor:
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
    projection is the embedding's weight used in a matmul: counted once, as a matmul weight. A
    mixture-of-experts layer counts the experts one token uses (k of E) and its router."""
    embedding = config["vocab_size"] * config["d_model"]
    if config.get("tie_embeddings"):
        embedding = 0
    matmul_weights = sum(p.numel() for p in model.parameters()) - embedding
    for layer in model.moe_layers():  # a token uses k of the E experts
        router, experts = layer.router, layer.experts
        unused = router.num_experts - router.experts_per_token
        matmul_weights -= unused * (experts.gate_up[0].numel() + experts.down[0].numel())
    attention = 12 * config["num_layers"] * config["d_model"] * config["context_length"]
    return 6 * matmul_weights + attention


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


# --------------------------------------------------------------------------------------------
# Distributed set-up
# --------------------------------------------------------------------------------------------


@dataclass
class Run:
    """Where this process trains: its rank among `world_size` and its device; with context
    parallelism, the `context` ranks of its `context_group` (neighbours in rank order) share
    each sequence, and the data is split `world_size / context` ways. With tensor parallelism
    the `tensor` ranks of `tensor_group` (neighbours) share each layer, DDP and FSDP2 run over
    `data_mesh` (the data x context ranks) and the data is split world / (context x tensor).
    With expert parallelism the `expert` ranks of `expert_group` (neighbours) share each MoE
    layer's experts, and `expert_replicas` (the ranks r + k expert, k = 0, 1, ...) hold the same
    ones; the data split is the one without it (each rank's tokens go to the experts' ranks and
    back)."""

    rank: int
    world_size: int
    device: torch.device
    context: int = 1
    context_group: dist.ProcessGroup | None = None
    tensor: int = 1
    tensor_group: dist.ProcessGroup | None = None
    data_mesh: object = None
    expert: int = 1
    expert_group: dist.ProcessGroup | None = None
    expert_replicas: dist.ProcessGroup | None = None

    @property
    def data_rank(self) -> int:
        return self.rank // (self.context * self.tensor)

    @property
    def data_size(self) -> int:
        return self.world_size // (self.context * self.tensor)

    @property
    def context_rank(self) -> int:
        return self.rank // self.tensor % self.context

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
    if world_size % (args.context_parallel * args.tensor_parallel):
        raise ConfigError(
            f"--tensor-parallel {args.tensor_parallel} x --context-parallel "
            f"{args.context_parallel} must divide the number of processes ({world_size})"
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
    if args.tensor_parallel > 1:  # a (data x context x tensor) mesh, tensor ranks neighbours
        from torch.distributed.device_mesh import init_device_mesh

        run.tensor = args.tensor_parallel
        shape = (world_size // (run.context * run.tensor), run.context, run.tensor)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("data", "context", "tensor"))
        run.tensor_group = mesh["tensor"].get_group()
        run.context_group = mesh["context"].get_group() if run.context > 1 else None
        run.data_mesh = mesh["data", "context"]._flatten("data_context")
    elif run.context > 1:  # DDP and FSDP2 keep the whole world: gradients average over both
        run.context_group = context_parallel_mesh(run.context, device.type)["context"].get_group()
    if args.expert_parallel > 1:  # any split of the world will do: DDP averages over all of it
        mesh = expert_parallel.expert_parallel_mesh(
            args.expert_parallel, args.num_experts, device.type
        )
        run.expert = args.expert_parallel
        run.expert_group, run.expert_replicas = (mesh[d].get_group() for d in ("expert", "data"))
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

        # Expert parallelism's experts stay out of FSDP2, as out of DDP: each rank holds its own
        # E / P of them, whole (FSDP would shard and average them over all ranks as if every
        # rank held the same ones), and `reduce_expert_gradients` averages them over their
        # replicas. Sharding them over the replicas too would take a second mesh dimension, a
        # divide factor and a norm over two meshes, to save memory EP already divides by P.
        ignored = set(expert_parallel.expert_parameters(loss_module))
        for block in loss_module.model.blocks:
            fully_shard(block, mesh=run.data_mesh, ignored_params=ignored)
        return fully_shard(loss_module, mesh=run.data_mesh, ignored_params=ignored)
    device_ids = [run.device.index] if run.device.type == "cuda" else None
    # The buffers (RoPE tables, causal masks) are constants: no broadcast before each forward.
    # torch 2.13 renamed the option (the old name warns on every rank).
    ddp_options = inspect.signature(nn.parallel.DistributedDataParallel).parameters
    no_sync = (
        "forward_sync_buffers" if "forward_sync_buffers" in ddp_options else "broadcast_buffers"
    )
    group = run.data_mesh.get_group() if run.data_mesh is not None else None
    # Each rank's experts are its own (neither broadcast from rank 0 nor averaged over the
    # world): `expert_parallel.reduce_expert_gradients` averages them over their replicas.
    experts = expert_parallel.expert_parameter_names(loss_module)
    if experts:
        DDP = nn.parallel.DistributedDataParallel
        DDP._set_params_and_buffers_to_ignore_for_model(loss_module, experts)
    return nn.parallel.DistributedDataParallel(
        loss_module, device_ids=device_ids, process_group=group, **{no_sync: False}
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
    (foreach under FSDP; a loop over the parameters under FSDP with expert parallelism, whose
    experts are plain tensors beside FSDP2's DTensors: a foreach or fused kernel takes one kind
    per list). reference.AdamW is the same math (tests/test_reference.py)."""
    hyper = dict(lr=args.lr, betas=tuple(args.betas), weight_decay=args.weight_decay)
    if args.fsdp and args.expert_parallel > 1:
        hyper["foreach"] = False
    elif device.type == "cuda" and not args.fsdp:
        hyper["fused"] = True
    return torch.optim.AdamW(parameters, **hyper)


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class, which fixes the layout of its state."""
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def clip_gradients(
    module: nn.Module, max_norm: float, device: torch.device, fsdp: bool
) -> torch.Tensor | float | None:
    """Scale the gradients to a global norm of at most `max_norm` (0: leave them); the norm
    before clipping (None with 0), a tensor where reading it back would wait for the GPU."""
    if max_norm == 0:
        return None
    if fsdp or device.type == "cuda":
        # PyTorch's clip takes the norm of DTensor (FSDP) gradients over all ranks, and it never
        # waits for the GPU (the reference reads the norm back) nor launches a kernel per tensor.
        return torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm, foreach=True)
    return reference.gradient_clip(module.parameters(), max_norm)


def state_dict_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def full_state(loss_module: NextTokenLoss, optimizer: torch.optim.Optimizer):
    """Unsharded weights and optimizer state (a collective under FSDP: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = loss_module.model
    tensor = hasattr(model, "tensor_heads")  # tensor-parallel: every rank gathers its shards
    options = state_dict_options(cpu_offload=not tensor)
    weights = get_model_state_dict(model, options=options)
    state = get_optimizer_state_dict(loss_module, optimizer, options=options)
    if tensor:  # whole tensors: the checkpoint resumes on any mesh
        weights = {k: v.cpu() for k, v in tensor_parallel.full_state_dict(weights, model).items()}
        state = tensor_parallel.full_optimizer_state(state, model, device="cpu")
    # All E experts of each layer, whatever --expert-parallel: likewise (a no-op without it).
    expert_parallel.full_expert_state(model, optimizer, weights, state, prefix=LOSS_PREFIX)
    return weights, state


# The model's parameter names in an optimizer state dict of the NextTokenLoss around it.
LOSS_PREFIX = "model."


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
        if saved is not None:  # whole tensors, before any sharding
            checkpoint.fit_weights(self.model, saved["weights"], out)
        # Counted on the whole model, before any rank keeps only its share of it.
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        self.flops_per_token = flops_per_token(self.model, self.config)
        if run.expert > 1:  # this rank's experts, sliced from the whole ones
            expert_parallel.set_expert_parallel(self.model, run.expert_group)
            if saved is not None:
                optimizer_state = expert_parallel.shard_expert_optimizer_state(
                    self.model, saved["optimizer"], prefix=LOSS_PREFIX
                )
                saved = {**saved, "optimizer": optimizer_state}
        if run.tensor > 1:
            tensor_parallel.parallelize(self.model, run.tensor_group)
            if saved is not None:
                saved = {
                    **saved,
                    "optimizer": tensor_parallel.shard_optimizer_state(
                        saved["optimizer"], self.model
                    ),
                }
        if run.context_group is not None:
            self.model.set_context_parallel(run.context_group)
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
        self.grad_norm = None  # the last step's, before clipping (None without clipping)
        # A mixture of experts' balance over the last step (`Transformer.update_router_bias`).
        self.moe_stats: dict[str, float] = {}
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
            auxiliary = self.model.auxiliary_loss()  # in `loss`; the cross-entropy is reported
            if auxiliary is not None:
                loss = loss - auxiliary
            total += loss.detach().float()
        if self.run.tensor > 1:  # the norms' gains: each tensor rank's tokens' share
            tensor_parallel.reduce_gradients(self.model)
            norm = None
            if args.grad_clip:
                data = self.run.data_mesh.get_group() if args.fsdp else None
                norm = tensor_parallel.clip_grad_norm_(self.model, args.grad_clip, data)
        elif self.run.expert > 1:  # DDP or FSDP2 left the experts' gradients alone
            expert_parallel.reduce_expert_gradients(
                self.model, self.run.expert_replicas, self.run.world_size
            )
            norm = None
            if args.grad_clip:
                norm = expert_parallel.clip_grad_norm_(self.model, args.grad_clip)
        else:
            norm = clip_gradients(self.wrapped, args.grad_clip, self.run.device, args.fsdp)
        # Kept for --log (read back only there: on a GPU reading it waits for the step).
        if args.log and hasattr(norm, "full_tensor"):  # FSDP's DTensor: every rank gathers it
            norm = norm.full_tensor()
        self.grad_norm = norm
        self.optimizer.step()
        # The sigmoid routers' balancing bias, from the step's assignments on every rank.
        self.moe_stats = self.model.update_router_bias(self.run.mean)
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
