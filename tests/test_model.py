"""fastlm.Transformer against fastlm.reference.Transformer: checkpoints, logits, loss, gradients,
training and KV-cache generation, at sizes the interpreter runs in seconds."""

import copy

import pytest
import torch
from conftest import TINY_MODEL

import fastlm
from fastlm import reference as R
from fastlm.kernels._common import HAVE_TRITON
from fastlm.kernels.attention import MAX_HEAD_DIM
from fastlm.testing import TOLERANCE, assert_close, attention_dtype, relative_error

#: float32's bound, or float16's where the model's attention runs its float32 dots in TF32 (on
#: CUDA: TF32 is the attention kernels' float32 contract, `fastlm.testing.attention_dtype`).
FLOAT32 = attention_dtype(torch.float32, "cuda" if torch.cuda.is_available() else "cpu")

#: The LLaMA-style options at once: grouped-query (2 query heads on 1 kv head), half-split RoPE,
#: tied embeddings, another norm eps.
LLAMA_OPTIONS = dict(num_kv_heads=1, rope_interleaved=False, tie_embeddings=True, norm_eps=1e-6)


def _pair(device, dtype=torch.float32, config=TINY_MODEL):
    """A fastlm model and a float64 reference holding the same weights."""
    model = fastlm.Transformer(**config, device=device, dtype=dtype)
    ref = R.Transformer(**config, device=device, dtype=torch.float64)
    ref.load_state_dict(model.state_dict())
    return model, ref


def _tokens(device, batch=2, seq=13):
    return torch.randint(0, TINY_MODEL["vocab_size"], (batch, seq), device=device)


def _assert_grads_match(model, ref, dtype, what="grad"):
    """Every parameter's gradient against the reference's, named in the failure."""
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype, name
        assert_close(p.grad, ref_params[name].grad, dtype, f"{what} of {name}")


def test_state_dict_interchange_both_ways(device):
    ref = R.Transformer(**TINY_MODEL, device=device)
    model = fastlm.Transformer(**TINY_MODEL, device=device)
    assert model.state_dict().keys() == ref.state_dict().keys()
    for key, value in ref.state_dict().items():
        assert model.state_dict()[key].shape == value.shape, key
    model.load_state_dict(ref.state_dict(), strict=True)
    back = R.Transformer(**TINY_MODEL, device=device)
    back.load_state_dict(model.state_dict(), strict=True)
    for key, value in ref.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


def test_drop_in_submodules_share_reference_keys(device):
    args = (32, 2, 48, 24, 10000.0)
    assert (
        fastlm.TransformerBlock(*args).state_dict().keys()
        == R.TransformerBlock(*args).state_dict().keys()
    )
    mha_args = (32, 2, 24, 10000.0)
    assert (
        fastlm.MultiHeadAttentionWithRoPE(*mha_args).state_dict().keys()
        == R.MultiHeadAttentionWithRoPE(*mha_args).state_dict().keys()
    )


def test_drop_in_block_matches_reference(device):
    block = fastlm.TransformerBlock(32, 2, 48, 24, 10000.0, device=device)
    ref = R.TransformerBlock(32, 2, 48, 24, 10000.0, device=device, dtype=torch.float64)
    ref.load_state_dict(block.state_dict())
    x = torch.randn(2, 11, 32, device=device)
    assert_close(block(x), ref(x.double()), FLOAT32, "block output")


@pytest.mark.parametrize("offset", [0, 7])
def test_logits_match_reference(device, offset):
    model, ref = _pair(device)
    tokens = _tokens(device)
    positions = torch.arange(offset, offset + tokens.shape[1], device=device)
    expected = ref(tokens, positions.expand(tokens.shape[0], -1))
    assert_close(model(tokens, positions), expected, FLOAT32, "logits")


def _assert_loss_and_grads_match(model, ref, loss, tokens, targets, what):
    """`loss` (the model's on tokens and targets) and every gradient against the reference's."""
    expected = R.CrossEntropyLoss()(ref(tokens), targets)
    assert_close(loss, expected, FLOAT32, f"{what}loss")
    loss.backward()
    expected.backward()
    _assert_grads_match(model, ref, FLOAT32, f"{what}grad")


def test_loss_and_every_gradient_match_reference(device):
    model, ref = _pair(device)
    tokens, targets = _tokens(device), _tokens(device)
    loss = model.loss(tokens, targets)
    expected = R.CrossEntropyLoss()(ref(tokens), targets)
    assert_close(loss, expected, FLOAT32, "loss")
    loss.backward()
    expected.backward()
    _assert_grads_match(model, ref, FLOAT32)


def test_loss_ignore_index(device):
    model, ref = _pair(device)
    tokens, targets = _tokens(device), _tokens(device)
    targets[0, :5] = -100
    targets[1, -2:] = -100
    keep = targets != -100
    loss = model.loss(tokens, targets)
    expected = R.CrossEntropyLoss()(ref(tokens)[keep], targets[keep])
    assert_close(loss, expected, FLOAT32, "loss with ignore_index")
    loss.backward()
    expected.backward()
    _assert_grads_match(model, ref, FLOAT32, "grad with ignore_index")


def test_torch_backend_gives_the_same_logits(device, monkeypatch):
    model = fastlm.Transformer(**TINY_MODEL, device=device)
    tokens = _tokens(device)
    kernels = model(tokens)
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    assert_close(kernels, model(tokens), FLOAT32, "torch-backend logits")


def test_training_curves_match_reference(device):
    """10 AdamW steps from the same initialisation, at a rate that takes the loss below 0.7 of
    its start (about 0.15 here): the loss curves stay together. Two sequences a step (every
    kernel still sees a batch and several blocks): under the interpreter each kernel costs by
    the program, and four took twice as long."""
    model = fastlm.Transformer(**TINY_MODEL, device=device)
    ref = R.Transformer(**TINY_MODEL, device=device)
    ref.load_state_dict(model.state_dict())
    opts = [R.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01) for m in (model, ref)]
    data = _tokens(device, batch=2, seq=TINY_MODEL["context_length"] + 1)
    inputs, targets = data[:, :-1], data[:, 1:]
    curves = [[], []]
    for _ in range(10):
        losses = (model.loss(inputs, targets), R.CrossEntropyLoss()(ref(inputs), targets))
        for curve, loss, opt in zip(curves, losses, opts):
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
    ours, theirs = torch.tensor(curves[0]), torch.tensor(curves[1])
    assert theirs[-1] < 0.7 * theirs[0], "the reference did not learn: the check would be empty"
    # Both train in float32 through different kernels; 10 steps of Adam amplify rounding a little.
    assert relative_error(ours, theirs) < 1e-3, (ours, theirs)


class _WithoutCache(torch.nn.Module):
    """The same model seen without make_kv_cache: generate() recomputes the whole window."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.context_length = model.context_length

    def forward(self, token_ids):
        return self.model(token_ids)


def test_kv_cache_generation_matches_full_recompute(device):
    """Within the context; past it the cache slides, which is not recomputing the window
    (test_generate_cli.py's test_past_the_context_the_kv_cache_slides)."""
    model = fastlm.Transformer(**{**TINY_MODEL, "context_length": 24}, device=device)
    prompt = _tokens(device, batch=1, seq=6)[0]
    cached = fastlm.sample(model, prompt, max_new_tokens=8, temperature=0.0)
    recomputed = fastlm.sample(_WithoutCache(model), prompt, max_new_tokens=8, temperature=0.0)
    assert torch.equal(cached, recomputed), (cached, recomputed)
    assert cached.shape == (14,)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_kv_cache_logits_match_full_forward(device, autocast):
    """Cached decoding gives the full forward's logits; under autocast the cache holds bf16 keys
    and values and the blocks' GEMMs read their weights cast once per forward."""
    model = fastlm.Transformer(**TINY_MODEL, device=device)
    tokens = _tokens(device, batch=2, seq=9)
    cache = model.make_kv_cache()
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
        steps = [
            model(tokens[:, :6], kv_cache=cache),
            model(tokens[:, 6:8], kv_cache=cache),
            model(tokens[:, 8:], kv_cache=cache),
        ]
        full = model(tokens)
    assert cache.length == 9
    if autocast:
        assert cache.k[0].dtype == torch.bfloat16
    dtype = torch.bfloat16 if autocast else FLOAT32
    assert_close(torch.cat(steps, dim=1), full, dtype, "cached logits")


def test_bad_input_names_the_argument(device):
    model = fastlm.Transformer(**TINY_MODEL, device=device)
    with pytest.raises(ValueError, match="context_length"):
        model(_tokens(device, seq=TINY_MODEL["context_length"] + 1))
    with pytest.raises(ValueError, match="token_ids"):
        model(torch.full((1, 4), TINY_MODEL["vocab_size"], device=device))
    with pytest.raises(ValueError, match="targets"):
        model.loss(_tokens(device), _tokens(device, seq=12))


@pytest.mark.parametrize("options", [{}, LLAMA_OPTIONS], ids=["seed", "llama"])
def test_autocast_bf16_matches_reference(device, gemms, options):
    """Under bf16 autocast the residual stream stays fp32 and the matmuls run in bf16, as in the
    reference: the loss agrees to bf16 accuracy, and each gradient (fp32, from the GEMMs straight
    where the device has the mixed GEMM: `gemms`) is as close to the float64 model's as the
    reference's own under autocast, with the LLaMA-style options too.

    Why not a fixed bf16 bound: bf16 GEMM operands (u = 2^-9) over contractions of 32 to 64
    random-signed terms leave these gradients 1e-2 to 4.5e-2 off in the reference itself (above
    TOLERANCE[bf16] for some seeds), so two bf16 computations of them differ by as much (the
    fixed bound failed 2 runs in 240). The bound is the reference's own error, twice (the two
    round apart: fastlm's error reached 1.9 times the reference's where the reference happened
    to land close), plus half of TOLERANCE[bf16] for a gradient it gets almost exactly. Over
    7,920 gradients (120 seeds, both GEMM paths, both configs) fastlm's worst was 0.57 of it."""
    model, ref = _pair(device, config={**TINY_MODEL, **options})
    truth = copy.deepcopy(ref)  # float64, no autocast
    ref.float()
    tokens, targets = _tokens(device), _tokens(device)
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        loss = model.loss(tokens, targets)
        expected = R.CrossEntropyLoss()(ref(tokens).float(), targets)
    assert_close(loss, expected, torch.bfloat16, "autocast loss")
    loss.backward()
    expected.backward()
    R.CrossEntropyLoss()(truth(tokens), targets).backward()
    ref_params, true_params = dict(ref.named_parameters()), dict(truth.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype, name
        exact = true_params[name].grad
        ours, theirs = relative_error(p.grad, exact), relative_error(ref_params[name].grad, exact)
        bound = 2 * theirs + TOLERANCE[torch.bfloat16] / 2
        assert ours <= bound, f"autocast grad of {name}: {ours:.2e} off, the reference {theirs:.2e}"


def test_heads_the_kernel_cannot_take_run_on_the_torch_backend(device, monkeypatch):
    """Heads of 4 dims: the reference runs them and so does fastlm's PyTorch backend; where the
    Triton kernels would run, the model refuses at construction, saying what to change."""
    config = {**TINY_MODEL, "d_model": 8, "num_heads": 2}
    monkeypatch.setenv("FASTLM_BACKEND", "triton")
    if HAVE_TRITON:
        message = (
            r"d_model 8 / num_heads 2 gives heads of 4 dims, but fastlm's attention kernel "
            rf"takes multiples of 8 up to {MAX_HEAD_DIM}: change d_model or num_heads "
            r"\(with d_model 8: num_heads 1\)"
        )
        with pytest.raises(ValueError, match=message):
            fastlm.Transformer(**config, device=device)
    else:  # tests/without_triton.py: asking for the kernels names what to install
        with pytest.raises(ModuleNotFoundError, match="pip install triton"):
            fastlm.Transformer(**config, device=device)
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    model, ref = _pair(device, config=config)
    tokens, targets = _tokens(device), _tokens(device)
    assert_close(model(tokens), ref(tokens), FLOAT32, "logits, heads of 4 dims")
    loss = model.loss(tokens, targets)
    _assert_loss_and_grads_match(model, ref, loss, tokens, targets, "heads of 4 dims: ")


def test_blocks_run_through_their_forward(device, monkeypatch):
    """FSDP2 gathers a block's sharded weights in a hook on the block's forward: the model calls
    each block (with the residual stream as a (residual, delta) pair), never around it."""
    monkeypatch.setenv("FASTLM_BACKEND", "torch")  # the hooks, not the kernels, are tested here
    model = fastlm.Transformer(**TINY_MODEL, device=device)
    calls = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda module, args: calls.append(module))
    tokens, targets = _tokens(device), _tokens(device)
    model.loss(tokens, targets)
    model(tokens)
    model(tokens[:, :3], kv_cache=model.make_kv_cache())
    assert calls == list(model.blocks) * 3
    block, x = model.blocks[0], torch.randn(2, 5, TINY_MODEL["d_model"], device=device)
    residual, delta = block((x, None))
    assert torch.equal(residual + delta, block(x))


def test_fsdp2_autocast_step_matches_the_unsharded_model(device, tmp_path):
    """Under FSDP2 (one process, gloo) each block's weights are gathered in its forward hook, and
    the block casts the gathered weights for autocast: the loss and every gradient equal the
    unsharded model's bit for bit, and no block hands FSDP a view (which would drop its hooks)."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if device != "cpu" or not dist.is_gloo_available():
        pytest.skip("a one-process gloo group on the CPU")

    class Loss(torch.nn.Module):  # FSDP2's hooks run on a module's forward, not on .loss
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, tokens, targets):
            return self.model.loss(tokens, targets)

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        plain, _ = _pair(device)
        sharded = fastlm.Transformer(**TINY_MODEL, device=device)
        sharded.load_state_dict(plain.state_dict())
        for block in sharded.blocks:
            fully_shard(block)
        sharded_loss = fully_shard(Loss(sharded))
        tokens, targets = _tokens(device), _tokens(device)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*returned a view tensor")
            with torch.autocast(device, dtype=torch.bfloat16):
                expected = plain.loss(tokens, targets)
                loss = sharded_loss(tokens, targets)
            expected.backward()
            loss.backward()
        assert torch.equal(loss, expected)
        plain_params = dict(plain.named_parameters())
        for name, p in sharded.named_parameters():
            grad = p.grad.full_tensor()
            assert grad.dtype == torch.float32, name
            assert torch.equal(grad, plain_params[name].grad), name
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "options",
    [
        LLAMA_OPTIONS,
        dict(num_kv_heads=2, rope_interleaved=False),
        dict(num_kv_heads=1, tie_embeddings=True),
    ],
)
def test_llama_options_match_reference(device, options):
    """Grouped-query attention, half-split RoPE, tied embeddings and norm_eps: logits, loss and
    every gradient as the reference's (heads of 16 dims, so 2 query heads share 1 kv head)."""
    config = {**TINY_MODEL, **options}
    model, ref = _pair(device, config=config)
    assert model.state_dict().keys() == ref.state_dict().keys()
    tokens, targets = _tokens(device), _tokens(device)
    assert_close(model(tokens), ref(tokens), FLOAT32, "logits")
    loss = model.loss(tokens, targets)
    _assert_loss_and_grads_match(model, ref, loss, tokens, targets, f"{options}: ")


def test_llama_options_kv_cache_logits_match_full_forward(device):
    model = fastlm.Transformer(**TINY_MODEL, **LLAMA_OPTIONS, device=device)
    tokens = _tokens(device, batch=2, seq=9)
    cache = model.make_kv_cache()
    steps = [model(tokens[:, :6], kv_cache=cache), model(tokens[:, 6:], kv_cache=cache)]
    assert cache.k[0].shape[1] == 1  # one key/value head cached
    assert_close(torch.cat(steps, dim=1), model(tokens), FLOAT32, "cached logits")


def test_tied_model_loads_its_own_state_dict(device):
    model = fastlm.Transformer(**TINY_MODEL, tie_embeddings=True, device=device)
    ref = R.Transformer(**TINY_MODEL, tie_embeddings=True, device=device)
    ref.load_state_dict(model.state_dict(), strict=True)
    assert ref.out_linear.w is ref.embedding.w
    assert torch.equal(ref.embedding.w, model.embedding.w)


# Packed documents: 26 tokens in two rows of 13, split 5 | 1 | 11 | 9, the 11 running from the
# first row into the second.
PACKED_DOCS = [5, 1, 11, 9]


def _packed_reference(ref, tokens, docs):
    """The reference's logits [B * T, vocab] with each document run on its own from position 0."""
    flat, start, logits = tokens.reshape(-1), 0, []
    for n in docs:
        logits.append(ref(flat[start : start + n][None])[0])
        start += n
    return torch.cat(logits)


def _cu_seqlens(docs, device):
    return torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], device=device).int()


@pytest.mark.parametrize(
    "backend,strided", [("auto", False), ("auto", True), ("torch", False)], ids=str
)
def test_packed_documents_match_each_document_alone(device, monkeypatch, backend, strided):
    """cu_seqlens: each document attends only within itself and is rotated from position 0, so
    the loss and every gradient are the reference's run on each document alone (also on the
    torch backend, and with cu_seqlens a strided column of a table)."""
    monkeypatch.setenv("FASTLM_BACKEND", backend)
    model, ref = _pair(device)
    tokens, targets = _tokens(device), _tokens(device)
    targets[0, 4] = -100  # the first document's last target: the next document's first token
    cu = _cu_seqlens(PACKED_DOCS, device)
    if strided:
        cu = torch.stack([cu, torch.full_like(cu, 10**6)], 1)[:, 0]
    logits = model(tokens, cu_seqlens=cu)
    expected_logits = _packed_reference(ref, tokens, PACKED_DOCS)
    assert_close(logits.reshape(-1, logits.shape[-1]), expected_logits, FLOAT32, "logits")
    loss = model.loss(tokens, targets, cu_seqlens=cu, max_seqlen=11)
    keep = targets.reshape(-1) != -100
    expected = R.CrossEntropyLoss()(expected_logits[keep], targets.reshape(-1)[keep])
    assert_close(loss, expected, FLOAT32, "packed loss")
    loss.backward()
    expected.backward()
    _assert_grads_match(model, ref, FLOAT32, "packed grad")


def test_packed_documents_match_the_reference_with_cu_seqlens(device):
    """reference.Transformer takes cu_seqlens too (a block-diagonal causal mask over the packed
    row, positions restarting per document): it equals each document run alone, and fastlm's
    model equals it, with the reference's default positions and with given ones."""
    model, ref = _pair(device)
    tokens, cu = _tokens(device), _cu_seqlens(PACKED_DOCS, device)
    expected = ref(tokens, cu_seqlens=cu)
    assert expected.shape == (*tokens.shape, TINY_MODEL["vocab_size"])
    assert_close(
        expected.reshape(-1, expected.shape[-1]),
        _packed_reference(ref, tokens, PACKED_DOCS),
        torch.float64,
        "reference",
    )
    assert_close(model(tokens, cu_seqlens=cu), expected, FLOAT32, "logits")
    positions = torch.randint(0, TINY_MODEL["context_length"], tokens.shape, device=device)
    assert_close(
        model(tokens, positions, cu_seqlens=cu),
        ref(tokens, positions, cu_seqlens=cu),
        FLOAT32,
        "logits at given positions",
    )
    with pytest.raises(ValueError, match="rise from 0"):
        ref(tokens, cu_seqlens=_cu_seqlens([5, 1, 11], device))


def test_packed_documents_bad_input(device):
    model = fastlm.Transformer(**TINY_MODEL, device=device)
    tokens, cu = _tokens(device), _cu_seqlens(PACKED_DOCS, device)
    with pytest.raises(ValueError, match="do not run with a KV cache"):
        model(tokens, cu_seqlens=cu, kv_cache=model.make_kv_cache())
    with pytest.raises(ValueError, match="max_seqlen is 25, but no document may be longer"):
        model(tokens, cu_seqlens=cu, max_seqlen=25)
    with pytest.raises(ValueError, match="no sequence longer than max_seqlen = 9"):
        model(tokens, cu_seqlens=cu, max_seqlen=9)
    with pytest.raises(ValueError, match="end at the packed length 26"):
        model(tokens, cu_seqlens=_cu_seqlens([5, 1, 11], device))
