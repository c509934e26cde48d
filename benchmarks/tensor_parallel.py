"""Tensor (and sequence) parallelism of fastlm.Transformer: tokens per second and peak memory per
GPU against FSDP alone, at Llama-3-8B and 70B layer sizes (`fastlm.tensor_parallel`).

    torchrun --nproc_per_node=8 benchmarks/tensor_parallel.py --tensor 2 4 8 --layers 2
    python benchmarks/tensor_parallel.py --simulate              # one process, no GPU needed

Under torchrun, for each model and each T it times training steps (bf16 autocast, AdamW) of a
`--layers`-layer model with T-way tensor parallelism and FSDP2 over the other world / T ranks,
and of FSDP2 alone over every rank (T = 1), and prints tokens per second of the group and the
largest peak of allocated memory over the ranks, beside the memory model of
`fastlm.tensor_parallel.memory_model`. Without CUDA it says so and exits 0 (not measured yet on
any GPU: no speed is claimed here).

`--simulate` runs one process as rank 0 of a fake group of T ranks (collectives return at once:
the numbers are meaningless, the shapes and the traffic exact), on the PyTorch backend, at the
models' sizes divided by `--scale` (head dim and vocabulary too; head counts kept), and checks
against `fastlm.tensor_parallel`'s models: the collectives of one training step (each kind, per
layer and in all, and their bytes), the parameters' bytes on the rank, and the activations one
layer saves for the backward (measured with saved-tensor hooks). Exit status 1 on a mismatch.
Results go to stdout as a markdown table (and --json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a bare checkout

import torch.distributed as dist  # noqa: E402

from benchmarks._common import markdown_table, no_cuda, time_steps_ms  # noqa: E402

#: Llama 3's layer sizes (the vocabulary of its tokenizer).
MODELS = {
    "llama3-8b": dict(d_model=4096, num_heads=32, num_kv_heads=8, d_ff=14336, vocab_size=128256),
    "llama3-70b": dict(d_model=8192, num_heads=64, num_kv_heads=8, d_ff=28672, vocab_size=128256),
}
from fastlm.tensor_parallel import ALL_GATHER, REDUCE_SCATTER  # noqa: E402
from fastlm.testing import CollectiveCounter  # noqa: E402

COLLECTIVES = ("all_reduce", ALL_GATHER, REDUCE_SCATTER)


def model_config(name: str, layers: int, seq_len: int, scale: int = 1) -> dict:
    """A fastlm.Transformer's arguments at `name`'s sizes, d_model, d_ff and the vocabulary
    divided by `scale` (heads kept, so the head dim shrinks too)."""
    sizes = MODELS[name]
    return dict(
        vocab_size=sizes["vocab_size"] // scale,
        context_length=seq_len,
        d_model=sizes["d_model"] // scale,
        num_layers=layers,
        num_heads=sizes["num_heads"],
        num_kv_heads=sizes["num_kv_heads"],
        d_ff=sizes["d_ff"] // scale,
        rope_theta=500000.0,
    )


def saved_bytes(step, model) -> int:
    """Bytes of the distinct storages autograd saves for the backward while step() runs, the
    model's parameters and buffers (RoPE's tables) left out: activations only."""
    storages = {}
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values())


def simulate_one(name: str, tensor: int, args) -> dict:
    """One fake group of `tensor` ranks: the step's collectives, parameter and activation bytes
    against the models."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fastlm import Transformer
    from fastlm.tensor_parallel import collective_model, memory_model, parallelize, reduce_gradients

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tensor)
    try:
        measured = {}
        for layers in (1, 2):  # one layer's activations: the difference
            config = model_config(name, layers, args.seq_len, args.scale)
            model = parallelize(Transformer(**config), dist.group.WORLD)
            tokens = torch.randint(0, config["vocab_size"], (args.batch, args.seq_len))
            forward = model.loss
            measured[layers] = saved_bytes(lambda f=forward, t=tokens: f(t, t), model)
        with CollectiveCounter(COLLECTIVES) as recorder:  # one step of the two-layer model
            model.loss(tokens, tokens).backward()
            reduce_gradients(model)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
    finally:
        dist.destroy_process_group()
    expected = memory_model(config, tensor, args.batch * args.seq_len)
    traffic = collective_model(config, tensor, args.batch * args.seq_len)
    calls = recorder.calls
    row = dict(
        model=name,
        T=tensor,
        all_gather=calls.get(ALL_GATHER, 0),
        reduce_scatter=calls.get(REDUCE_SCATTER, 0),
        all_reduce=calls.get("all_reduce", 0),
        params_MB=params / 2**20,
        params_model_MB=expected["parameters"] / 2**20,
        layer_activations_MB=(measured[2] - measured[1]) / 2**20,
        layer_activations_model_MB=expected["activations_per_layer"] / 2**20,
    )
    row["collective_MB"] = sum(recorder.bytes.values()) / 2**20
    row["ok"] = (
        (row["all_gather"], row["reduce_scatter"], row["all_reduce"]) == traffic["calls"]
        and dict(recorder.bytes) == traffic["bytes"]
        and params == expected["parameters"]
        and measured[2] - measured[1] == expected["activations_per_layer"]
    )
    return row


def simulate(args) -> list[dict]:
    return [simulate_one(name, t, args) for name in args.models for t in args.tensor]


def measure(name: str, tensor: int, args, world: int) -> dict:
    """Training steps of `name` with T-way tensor parallelism x FSDP2 over the other world / T
    ranks (T = 1: FSDP2 alone), bf16 autocast, AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fastlm import Transformer
    from fastlm.cli.trainer import NextTokenLoss
    from fastlm.tensor_parallel import memory_model, parallelize, reduce_gradients

    config = model_config(name, args.layers, args.seq_len)
    mesh = init_device_mesh("cuda", (world // tensor, tensor), mesh_dim_names=("data", "tensor"))
    with torch.device("meta"):  # no rank ever holds the whole model
        model = Transformer(**config)
    if tensor > 1:
        parallelize(model, mesh["tensor"])
    model.to_empty(device="cuda")
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    loss = NextTokenLoss(model)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["data"])
    fully_shard(loss, mesh=mesh["data"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    tokens = torch.randint(0, config["vocab_size"], (args.batch, args.seq_len), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss(tokens, tokens).backward()
        if tensor > 1:
            reduce_gradients(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    ms = time_steps_ms(step, args.steps)
    peak = torch.tensor(float(torch.cuda.max_memory_allocated()), device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    data = world // tensor
    held = memory_model(config, tensor, args.batch * args.seq_len, data=data)
    return dict(
        model=name,
        T=tensor,
        FSDP=data,
        ms=ms,
        tokens_per_s=args.batch * args.seq_len * data / ms * 1e3,
        peak_GB=peak.item() / 2**30,
        model_GB=sum(held.values()) / 2**30,
    )


def distributed(args) -> list[dict]:
    """Per model: FSDP2 alone, then each T of tensor parallelism x FSDP2 (rows on rank 0)."""
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    rows = []
    for name in args.models:
        for tensor in [1, *args.tensor]:
            rows.append(measure(name, tensor, args, world))
            torch.cuda.empty_cache()
    dist.destroy_process_group()
    return rows if rank == 0 else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", action="store_true", help="one process, a fake group")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--tensor", nargs="+", type=int, default=[2, 4, 8], metavar="T")
    parser.add_argument("--layers", type=int, default=2, help="blocks of the model (2)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row")
    parser.add_argument("--batch", type=int, default=1, help="rows per data rank (1)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (10)")
    parser.add_argument("--scale", type=int, default=16, help="--simulate: sizes divided (16)")
    parser.add_argument("--json", type=Path, help="also write the rows there")
    args = parser.parse_args(argv)
    if args.simulate:
        import os

        if not torch.cuda.is_available():  # the kernels' path, through Triton's interpreter
            os.environ.setdefault("TRITON_INTERPRET", "1")
        args.seq_len = args.seq_len or 32
        rows = simulate(args)
    else:
        if no_cuda("benchmarks/tensor_parallel.py"):
            return 0
        args.seq_len = args.seq_len or 4096
        rows = distributed(args)
    if rows:
        print(markdown_table(rows, list(rows[0])))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all(row.get("ok", True) for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
