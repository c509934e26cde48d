"""fastlm.reference against PyTorch's own implementations, on float64 inputs."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_MODEL

from fastlm import reference as R
from fastlm.testing import assert_close

f64 = torch.float64


def test_linear_matches_f_linear():
    layer = R.Linear(37, 53, dtype=f64)
    x = torch.randn(3, 5, 37, dtype=f64)
    assert_close(layer(x), F.linear(x, layer.w), f64)
    assert layer.w.shape == (53, 37)


def test_linear_init_is_truncated_normal():
    layer = R.Linear(300, 500)
    std = math.sqrt(2 / 800)
    assert layer.w.abs().max() <= 3 * std
    assert abs(layer.w.std().item() - std) < 0.1 * std  # truncation at 3 std shrinks it ~1%


def test_embedding_matches_f_embedding():
    emb = R.Embedding(100, 16, dtype=f64)
    ids = torch.randint(0, 100, (4, 7))
    assert torch.equal(emb(ids), F.embedding(ids, emb.w))
    assert emb.w.abs().max() <= 3 / math.sqrt(16)


def test_rmsnorm_matches_f_rms_norm():
    norm = R.RmsNorm(64, eps=1e-5, dtype=f64)
    with torch.no_grad():
        norm.g.copy_(torch.randn(64, dtype=f64))
    x = torch.randn(2, 9, 64, dtype=f64)
    assert_close(norm(x), F.rms_norm(x, (64,), norm.g, eps=1e-5), f64)


def test_rmsnorm_keeps_low_precision_dtype():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    assert R.RmsNorm(32, dtype=torch.bfloat16)(x).dtype == torch.bfloat16


def test_silu_and_swiglu():
    x = torch.randn(5, 24, dtype=f64)
    assert_close(R.SiLu()(x), F.silu(x), f64)
    ffn = R.SwiGlu(24, 40, dtype=f64)
    expected = F.linear(F.silu(F.linear(x, ffn.w1.w)) * F.linear(x, ffn.w3.w), ffn.w2.w)
    assert_close(ffn(x), expected, f64)
    assert R.FFN is R.SwiGlu


def test_softmax_matches_f_softmax_and_is_stable():
    x = torch.randn(3, 11, dtype=f64) * 1000  # exp would overflow without the max shift
    assert_close(R.softmax(x, dim=-1), F.softmax(x, dim=-1), f64)
    assert_close(R.softmax(x, dim=0), F.softmax(x, dim=0), f64)


@pytest.mark.parametrize("masked", [False, True])
def test_attention_matches_sdpa(masked):
    q, k, v = (torch.randn(2, 3, 13, 16, dtype=f64) for _ in range(3))
    mask = torch.triu(torch.ones(13, 13, dtype=torch.bool), 1) if masked else None
    out = R.ScaledDotProductAttention()(q, k, v, mask)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=masked)
    assert_close(out, expected, f64)


def _rope_by_complex_multiplication(x, positions, theta):
    """RoPE as complex rotation of pairs (x[2i] + i x[2i+1]) by exp(i p theta^(-2i/d))."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=f64) / d)
    angles = positions[..., None].to(f64) * inv_freq  # (..., T, d/2)
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


def test_rope_rotates_interleaved_pairs():
    rope = R.RoPE(10000.0, 16, 64)
    x = torch.randn(2, 3, 10, 16, dtype=f64)
    positions = torch.randint(0, 64, (2, 10))
    expected = _rope_by_complex_multiplication(x, positions[:, None, :], 10000.0)
    # The reference tables are float32: a float32 bound.
    assert_close(rope(x, positions), expected, torch.float32)
    seq_positions = torch.arange(5, 15)
    assert_close(
        rope(x, seq_positions),
        _rope_by_complex_multiplication(x, seq_positions, 1e4),
        torch.float32,
    )
    assert list(rope.state_dict()) == []


def test_multihead_attention_matches_sdpa():
    mha = R.MultiHeadAttention(32, 4, 16, dtype=f64)
    x = torch.randn(2, 11, 32, dtype=f64)
    q, k, v = F.linear(x, mha.qkv_proj.w).split(32, dim=-1)
    heads = [t.view(2, 11, 4, 8).transpose(1, 2) for t in (q, k, v)]
    o = F.scaled_dot_product_attention(*heads, is_causal=True).transpose(1, 2).reshape(2, 11, 32)
    assert_close(mha(x), F.linear(o, mha.output_proj.w), f64)


def test_multihead_attention_with_rope_default_positions():
    mha = R.MultiHeadAttentionWithRoPE(32, 4, 16, 10000.0, dtype=f64)
    x = torch.randn(2, 11, 32, dtype=f64)
    explicit = torch.arange(11).expand(2, 11)
    assert torch.equal(mha(x), mha(x, explicit))


def test_block_keeps_original_attribute_names():
    block = R.TransformerBlock(32, 4, 64, 16, 10000.0)
    keys = set(block.state_dict())
    assert {
        "rms_norm1.g",
        "rms_norm2.g",
        "mult_head_atten.qkv_proj.w",
        "mult_head_atten.output_proj.w",
        "ffe.w1.w",
        "ffe.w2.w",
        "ffe.w3.w",
    } == keys


def _tiny_transformer(**kwargs):
    # Four heads of 8 (grouped-query cases need a head count with divisors).
    return R.Transformer(**{**TINY_MODEL, "context_length": 16, "num_heads": 4, **kwargs})


def test_transformer_rejects_bad_tokens():
    model = _tiny_transformer()
    with pytest.raises(ValueError, match="context_length"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[0, 61\)"):
        model(torch.full((1, 4), 61))
    with pytest.raises(ValueError, match="token_ids"):
        model(torch.zeros(1, 4))


def test_cross_entropy_matches_f_cross_entropy():
    logits = torch.randn(3, 7, 50, dtype=f64) * 30
    targets = torch.randint(0, 50, (3, 7))
    expected = F.cross_entropy(logits.reshape(-1, 50), targets.reshape(-1))
    assert_close(R.CrossEntropyLoss()(logits, targets), expected, f64)


def test_adamw_matches_torch_adamw():
    w0 = torch.randn(20, 10, dtype=f64)
    ours, theirs = w0.clone().requires_grad_(), w0.clone().requires_grad_()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt_ours, opt_theirs = R.AdamW([ours], **kw), torch.optim.AdamW([theirs], **kw)
    for _ in range(10):
        grad = torch.randn_like(w0)
        for p, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            p.grad = grad.clone()
            opt.step()
    # PyTorch decays before the Adam update, the reference after: the two differ by
    # O(lr^2 * weight_decay) per step, far above float64 rounding, far below the update size.
    assert_close(ours, theirs, torch.float32, "AdamW weights", scale=10)
    assert opt_ours.state[ours]["t"] == 10


def test_sgd_decay_steps_shrink():
    p = torch.zeros(3, dtype=f64, requires_grad=True)
    opt = R.SGDDecay([p], lr=1.0)
    deltas = []
    for _ in range(3):
        p.grad = torch.ones(3, dtype=f64)
        before = p.detach().clone()
        opt.step()
        deltas.append((before - p.detach())[0].item())
    assert deltas == pytest.approx([1.0, 1 / math.sqrt(2), 1 / math.sqrt(3)])


def test_cos_lr_schedule_known_points():
    args = dict(lr_max=1.0, lr_min=0.1, warmup_iters=10, cos_cycle_iters=110)
    assert R.cos_lr_scheduler(0, **args) == 0.0
    assert R.cos_lr_scheduler(5, **args) == pytest.approx(0.5)
    assert R.cos_lr_scheduler(10, **args) == pytest.approx(1.0)
    assert R.cos_lr_scheduler(60, **args) == pytest.approx(0.55)
    assert R.cos_lr_scheduler(110, **args) == pytest.approx(0.1)
    assert R.cos_lr_scheduler(500, **args) == 0.1


def test_gradient_clip_matches_clip_grad_norm():
    ours = [torch.randn(5, 4, dtype=f64, requires_grad=True) for _ in range(3)]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn_like(a) * 10
        b.grad = a.grad.clone()
    norm = R.gradient_clip(ours, max_norm=1.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm=1.0)
    assert norm == pytest.approx(expected.item())
    for a, b in zip(ours, theirs):
        assert_close(a.grad, b.grad, f64)


def test_gradient_clip_leaves_small_gradients():
    p = torch.zeros(4, dtype=f64, requires_grad=True)
    p.grad = torch.full((4,), 0.1, dtype=f64)
    R.gradient_clip([p], max_norm=1.0)
    assert torch.equal(p.grad, torch.full((4,), 0.1, dtype=f64))


def test_tiny_transformer_learns():
    model = _tiny_transformer()
    opt = R.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    loss_fn = R.CrossEntropyLoss()
    tokens = torch.randint(0, 61, (4, 17))
    losses = []
    for _ in range(30):
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def _rope_by_half_split(x, positions, theta):
    """RoPE on half-split pairs (x[i], x[i + d/2]): the interleaved rotation of the permuted
    vector, permuted back."""
    d = x.shape[-1]
    to_pairs = torch.stack((torch.arange(d // 2), torch.arange(d // 2, d)), dim=-1).flatten()
    rotated = _rope_by_complex_multiplication(x[..., to_pairs], positions, theta)
    return rotated[..., torch.argsort(to_pairs)]


def test_rope_rotates_half_split_pairs():
    rope = R.RoPE(10000.0, 16, 64, interleaved=False)
    x = torch.randn(2, 3, 10, 16, dtype=f64)
    positions = torch.randint(0, 64, (2, 10))
    expected = _rope_by_half_split(x, positions[:, None, :], 10000.0)
    assert_close(rope(x, positions), expected, torch.float32)
    # Hugging Face's formula: x * cos + rotate_half(x) * sin with cos = cat(cos, cos).
    x1, x2 = x[..., :8], x[..., 8:]
    assert torch.equal(R.RoPE.rotate_halves(x), torch.cat((-x2, x1), dim=-1))


@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_grouped_query_attention_repeats_kv_heads(num_kv_heads):
    """Query head h reads key/value head h // (num_heads / num_kv_heads), as SDPA's
    enable_gqa and Hugging Face's repeat_kv do; q|k|v sit side by side in qkv_proj."""
    mha = R.MultiHeadAttention(32, 4, 16, dtype=f64, num_kv_heads=num_kv_heads)
    assert mha.qkv_proj.w.shape == ((4 + 2 * num_kv_heads) * 8, 32)
    x = torch.randn(2, 11, 32, dtype=f64)
    q, k, v = F.linear(x, mha.qkv_proj.w).split((32, 8 * num_kv_heads, 8 * num_kv_heads), -1)
    q = q.view(2, 11, 4, 8).transpose(1, 2)
    k, v = (t.view(2, 11, num_kv_heads, 8).transpose(1, 2) for t in (k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected = F.linear(o.transpose(1, 2).reshape(2, 11, 32), mha.output_proj.w)
    assert_close(mha(x), expected, f64)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        R.MultiHeadAttention(32, 4, 16, num_kv_heads=3)


def test_transformer_options():
    """num_kv_heads, rope_interleaved, tie_embeddings and norm_eps reach every layer; a tied
    model holds one parameter under both state_dict keys."""
    model = _tiny_transformer(
        num_kv_heads=2, rope_interleaved=False, tie_embeddings=True, norm_eps=1e-6
    )
    attention = model.blocks[1].mult_head_atten
    assert attention.num_kv_heads == 2 and not attention.rope.interleaved
    assert model.out_linear.w is model.embedding.w
    assert len(list(model.parameters())) == len(model.state_dict()) - 1
    assert {"embedding.w", "out_linear.w"} <= set(model.state_dict())
    norms = [m for m in model.modules() if isinstance(m, R.RmsNorm)]
    assert len(norms) == 5 and all(m.eps == 1e-6 for m in norms)
    defaults = _tiny_transformer()
    assert defaults.out_linear.w is not defaults.embedding.w
    assert defaults.blocks[0].mult_head_atten.rope.interleaved
    tokens = torch.randint(0, 61, (2, 9))
    logits = model(tokens)
    logits.sum().backward()  # one gradient, from both uses of the tied weight
    assert model.embedding.w.grad is not None and logits.shape == (2, 9, 61)
