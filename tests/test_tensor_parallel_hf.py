"""A Hugging Face model patched by `fastlm.hf.patch` under transformers' own tensor parallelism
(`from_pretrained(folder, tp_plan="auto")`, 2 gloo processes on the CPU, a tiny GQA Llama saved
here): loss, logits and every gradient against the unsharded model in float64.

transformers' Llama plan shards q/k/v and gate/up column-wise and o/down row-wise, with DTensor
weights whose outputs are handed on as local tensors, and keeps the LM head
`colwise_gather_output` (a DTensor sharded by vocabulary rows). So attention, RMSNorm and SwiGLU
run fastlm's kernels on plain per-rank tensors; the fused loss needs
`fastlm.tensor_parallel.lm_head_cross_entropy` (the vocabulary-parallel loss on the head's local
shard) where `fastlm.hf` calls `linear_cross_entropy`; the in-place RoPE, with grad, is refused
by autograd on the views transformers' `to_local()` returns unless q and k first go through
`fastlm.tensor_parallel.writable_in_place`. The test swaps both hooks into `fastlm.hf.forwards`
(docs/tensor-parallel.md)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_distributed import spawn

from fastlm.testing import assert_close

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="needs gloo")

CONFIG = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: each rank a KV head with its two query heads
    max_position_embeddings=64,
)


def _truth(folder: str, tokens, labels) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The unsharded, unpatched model in float64: loss, logits and every parameter's gradient."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    out = model(input_ids=tokens, labels=labels)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return out.loss.detach(), out.logits.detach(), grads


def _sharded(folder: str, **parts):
    """The model under transformers' tensor parallelism over every process, patched (float32;
    tp_size given: transformers reads the world size from torchrun's WORLD_SIZE otherwise)."""
    import fastlm.hf as hf

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, tp_plan="auto", tp_size=dist.get_world_size(), dtype=torch.float32
    )
    hf.patch(model, **parts)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _check(model, truth, tokens, labels, what: str) -> None:
    loss, logits, grads = truth
    out = model(input_ids=tokens, labels=labels)
    out.loss.backward()
    assert_close(out.loss.detach(), loss, torch.float32, f"{what}: loss")
    assert_close(out.logits.detach(), logits, torch.float32, f"{what}: logits")
    for name, p in model.named_parameters():
        assert_close(_full(p.grad), grads[name], torch.float32, f"{what}: grad {name}")
        p.grad = None


def _check_lm_head_loss(world: int) -> None:
    """lm_head_cross_entropy on a plain, a replicated and a vocabulary-sharded (Shard(0)) LM
    head, with ignored targets and label smoothing: loss, x's and the whole weight's gradients
    against float64 autograd; the placements it cannot take refused, naming the argument."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fastlm.tensor_parallel import lm_head_cross_entropy

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(7, 24)
    weight = torch.randn(19 * world, 24) * 0.5  # odd shards
    targets = torch.randint(0, weight.shape[0], (7,))
    targets[::3] = -100
    x64, w64 = (t.double().requires_grad_() for t in (x, weight))
    ref = torch.nn.functional.cross_entropy(x64 @ w64.T, targets, label_smoothing=0.1)
    ref.backward()
    for placement in (None, Replicate(), Shard(0)):
        w = weight.clone().requires_grad_()
        head = w if placement is None else distribute_tensor(w, mesh, [placement])
        if placement is not None:
            head = head.detach().requires_grad_()  # a leaf DTensor, as a model's parameter
        xi = x.clone().requires_grad_()
        loss = lm_head_cross_entropy(xi, head, targets, label_smoothing=0.1)
        loss.backward()
        assert_close(loss.detach(), ref.detach(), torch.float32, f"{placement}: loss")
        assert_close(xi.grad, x64.grad, torch.float32, f"{placement}: dx")
        assert_close(_full(head.grad), w64.grad, torch.float32, f"{placement}: dweight")
    with pytest.raises(ValueError, match=r"weight: an LM head DTensor must be Shard\(0\)"):
        lm_head_cross_entropy(x, distribute_tensor(weight, mesh, [Shard(1)]), targets)
    uneven = distribute_tensor(weight[:-1], mesh, [Shard(0)])  # 19 P - 1 rows: unequal shards
    with pytest.raises(ValueError, match="vocabulary divisible by its size"):
        lm_head_cross_entropy(x, uneven, targets.clamp(max=weight.shape[0] - 2))
    with pytest.raises(ValueError, match="x must be a plain tensor or a replicated DTensor"):
        lm_head_cross_entropy(distribute_tensor(x, mesh, [Shard(0)]), weight, targets)


def _check_writable_in_place(world: int) -> None:
    """writable_in_place copies a view of DTensor.to_local()'s output (a column-parallel
    projection's, as transformers hands it on), which then takes an in-place write and passes
    its gradient back; it leaves a linear layer's view, and anything without grad, as it is."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from fastlm.tensor_parallel import writable_in_place

    mesh = init_device_mesh("cpu", (world,))
    weight = torch.nn.Parameter(distribute_tensor(torch.randn(4 * world, 6), mesh, [Shard(0)]))
    x = DTensor.from_local(torch.randn(2, 3, 6), mesh, [Replicate()])

    def heads():  # (B, H / P, T, D) of the rank's heads, as transformers' attention views them
        return torch.nn.functional.linear(x, weight).to_local().view(2, 3, 2, 2).transpose(1, 2)

    with pytest.raises(RuntimeError, match="This view was created inside a custom Function"):
        heads().mul_(2)
    q = heads()
    copy = writable_in_place(q)
    assert copy is not q and torch.equal(copy, q)
    copy.mul_(2)  # refused on q itself
    copy.sum().backward()
    expected = 2 * x.to_local().sum((0, 1)).expand(weight.to_local().shape)
    assert_close(weight.grad.to_local(), expected, torch.float32, "gradient through the copy")
    plain = torch.nn.Linear(6, 4)(torch.randn(2, 3, 6)).view(2, 3, 2, 2).transpose(1, 2)
    assert writable_in_place(plain) is plain
    with torch.no_grad():
        assert writable_in_place(q) is q


def _worker(rank: int, world: int, folder: str, seed: int) -> None:
    import fastlm.hf.forwards as forwards
    from fastlm.tensor_parallel import lm_head_cross_entropy, writable_in_place

    torch.manual_seed(seed)
    _check_lm_head_loss(world)
    _check_writable_in_place(world)
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 11))  # 11: no multiple of a block
    labels = tokens.clone()
    labels[0, :3] = -100  # ignored targets (a prompt)
    truth = _truth(folder, tokens, labels)

    # Eval mode: transformers' forward returns the logits (through the gathered LM head) with
    # the loss, and grad stays on: the DTensor (training) path of its plan.
    model = _sharded(folder, rope=False, cross_entropy=False).eval()
    assert type(model.model.layers[0].mlp.gate_proj.weight).__name__ == "DTensor"
    assert model.fastlm_patched == ("rms_norm", "swiglu", "attention")
    _check(model, truth, tokens, labels, "norms, SwiGLU, attention")

    # The fused loss, with the hook fastlm.hf needs: the vocabulary-parallel loss on the LM
    # head's shard (no logits, no gathered weight).
    hooked = forwards.linear_cross_entropy
    forwards.linear_cross_entropy = lm_head_cross_entropy
    try:
        model = _sharded(folder, rope=False).eval()
        assert "cross_entropy" in model.fastlm_patched
        assert str(model.lm_head.weight.placements) == "(Shard(dim=0),)"  # vocabulary rows
        _check(model, truth, tokens, labels, "and the vocabulary-parallel loss")
    finally:
        forwards.linear_cross_entropy = hooked

    # RoPE in place on q and k: without grad (inference, generation) transformers' colwise
    # projections run on the local weights and return plain tensors, rotated in place; with
    # grad they are views of DTensor.to_local()'s output and autograd refuses (documented:
    # patch with rope=False to train).
    model = _sharded(folder, cross_entropy=False).eval()
    assert model.fastlm_patched == ("rms_norm", "swiglu", "rope", "attention")
    with torch.no_grad():
        assert_close(model(input_ids=tokens).logits, truth[1], torch.float32, "inference logits")
    with pytest.raises(RuntimeError, match="This view was created inside a custom Function"):
        model(input_ids=tokens, labels=labels)

    # Every part patched, with both hooks fastlm.hf needs: q and k through writable_in_place
    # before the in-place RoPE, the loss through lm_head_cross_entropy.
    rotate = forwards.apply_rotary_pos_emb
    forwards._ROPE_FORWARDS.clear()  # rebuilt with the hooked RoPE

    def hooked_rotate(q, k, *args, **kwargs):
        return rotate(writable_in_place(q), writable_in_place(k), *args, **kwargs)

    forwards.apply_rotary_pos_emb = hooked_rotate
    forwards.linear_cross_entropy = lm_head_cross_entropy
    try:
        model = _sharded(folder).eval()
        assert len(model.fastlm_patched) == 5  # every part
        _check(model, truth, tokens, labels, "every part, both hooks")
    finally:
        forwards.apply_rotary_pos_emb, forwards.linear_cross_entropy = rotate, hooked
        forwards._ROPE_FORWARDS.clear()


def test_hf_tensor_parallel_runs_patched_parts(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    with torch.no_grad():  # every parameter perturbed (norm gains too): a part read wrongly shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path / "tiny")
    spawn(2, tmp_path, _worker, str(tmp_path / "tiny"), int(torch.randint(2**31, ())))
