"""The plain PyTorch model math that fastlm starts from: the ground truth for every kernel.

Everything here is written for clarity, not speed: explicit softmax, an explicit [seq x seq]
attention matrix, einx for the projections. fastlm's kernels and its drop-in modules are tested
against these classes (usually on float64 inputs), and the state_dict keys of `Transformer` are the
checkpoint format that `fastlm.Transformer` reads and writes.

Shapes in comments: B batch, H heads, T sequence, D head dim, C model dim, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import einx
import torch
from torch import nn

# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------


def _trunc_normal(shape: tuple[int, ...], std: float, device=None, dtype=None) -> torch.Tensor:
    """A fresh tensor drawn from N(0, std^2) truncated at +-3 std."""
    w = torch.empty(shape, device=device, dtype=dtype)
    nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)
    return w


class Linear(nn.Module):
    """y = x W^T with no bias; W is [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        std = math.sqrt(2.0 / (in_features + out_features))
        self.w = nn.Parameter(_trunc_normal((out_features, in_features), std, device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return einx.dot("... [in], out [in] -> ... out", x, self.w)


class Embedding(nn.Module):
    """Lookup of rows of W [num_embeddings, embedding_dim] by token id."""

    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        std = 1.0 / math.sqrt(embedding_dim)
        self.w = nn.Parameter(_trunc_normal((num_embeddings, embedding_dim), std, device, dtype))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.w[token_ids]


class RmsNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * g over the last dim, computed in float32 (float64 stays
    float64, so that the reference in float64 is exact to float64 rounding)."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.d_model = d_model
        self.eps = eps
        self.g = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x = x.to(torch.promote_types(in_dtype, torch.float32))
        rms_inv = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x * rms_inv * self.g).to(in_dtype)


class SiLu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x) * x


class SwiGlu(nn.Module):
    """w2(silu(w1 x) * w3 x): w1 is the gate, w3 the value, w2 the output projection."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device, dtype)
        self.w2 = Linear(d_ff, d_model, device, dtype)
        self.w3 = Linear(d_model, d_ff, device, dtype)
        self.silu = SiLu()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.silu(self.w1(x)) * self.w3(x))


FFN = SwiGlu


class RoPE(nn.Module):
    """Rotary position embedding: pair i of a head vector at position p is rotated by the angle
    p * theta^(-2i / d_k).

    The pairs are interleaved, (x[2i], x[2i+1]), by default (the original RoPE paper's); with
    `interleaved=False` they are half-split, (x[i], x[i + d_k/2]), the layout of GPT-NeoX and of
    Hugging Face's Llama checkpoints.
    """

    def __init__(
        self, theta: float, d_k: int, max_seq_len: int, device=None, interleaved: bool = True
    ):
        super().__init__()
        if d_k % 2:
            raise ValueError(f"d_k must be even, got {d_k}")
        self.theta = theta
        self.d_k = d_k
        self.max_seq_len = max_seq_len
        self.interleaved = interleaved
        inv_freq = 1.0 / theta ** (
            torch.arange(0, d_k, 2, device=device, dtype=torch.float32) / d_k
        )
        positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)  # (L, d_k / 2)
        # Each angle once per element of its pair, where that element lies: (L, d_k).
        freqs = angles.repeat_interleave(2, dim=-1) if interleaved else angles.repeat(1, 2)
        self.register_buffer("cos_cached", freqs.cos(), persistent=False)
        self.register_buffer("sin_cached", freqs.sin(), persistent=False)

    @staticmethod
    def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
        """(a, b) -> (-b, a) for each interleaved pair."""
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)

    @staticmethod
    def rotate_halves(x: torch.Tensor) -> torch.Tensor:
        """(a, b) -> (-b, a) for each half-split pair: [x1, x2] -> [-x2, x1]."""
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor) -> torch.Tensor:
        cos = self.cos_cached[token_positions]  # (T, D) or (B, T, D)
        sin = self.sin_cached[token_positions]
        if x.dim() == 4 and cos.dim() == 3:  # x is (B, H, T, D): broadcast over heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rotated = self.rotate_pairs(x) if self.interleaved else self.rotate_halves(x)
        return (x * cos + rotated * sin).to(x.dtype)

    def extra_repr(self) -> str:
        return f"theta={self.theta}, d_k={self.d_k}, interleaved={self.interleaved}"


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


def softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """exp(x - max) / sum(exp(x - max)): the max is subtracted so that exp cannot overflow."""
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum(dim=dim, keepdim=True)


class ScaledDotProductAttention(nn.Module):
    """softmax(q k^T / sqrt(d_k) with masked scores set to -1e9) v; mask is True where masked."""

    def forward(self, q, k, v, mask: torch.Tensor | None = None) -> torch.Tensor:
        scores = einx.dot("... q [d], ... k [d] -> ... q k", q, k) / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(mask, -1e9)
        return einx.dot("... q [k], ... [k] d -> ... q d", softmax(scores, dim=-1), v)


def check_kv_heads(num_heads: int, num_kv_heads: int | None) -> int:
    """num_kv_heads (None: num_heads), ValueError unless it divides num_heads."""
    if num_kv_heads is None:
        return num_heads
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be a positive int or None, got {num_kv_heads!r}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    return num_kv_heads


class MultiHeadAttention(nn.Module):
    """Causal multi-head self-attention with one fused q|k|v projection.

    With num_kv_heads < num_heads (grouped-query attention) k and v have num_kv_heads heads each,
    query head h reading key/value head h // (num_heads / num_kv_heads); qkv_proj then has
    (num_heads + 2 num_kv_heads) * head_dim outputs: q's heads, then k's, then v's.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        max_seq_len: int,
        device=None,
        dtype=None,
        num_kv_heads: int | None = None,
    ):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of num_heads ({num_heads})")
        self.d_model = d_model
        self.num_heads = num_heads
        self.num_kv_heads = check_kv_heads(num_heads, num_kv_heads)
        self.head_dim = d_model // num_heads
        self.max_seq_len = max_seq_len
        qkv_width = (num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(d_model, qkv_width, device, dtype)
        self.output_proj = Linear(d_model, d_model, device, dtype)
        self.attention = ScaledDotProductAttention()
        causal = torch.triu(
            torch.ones(max_seq_len, max_seq_len, dtype=torch.bool, device=device), 1
        )
        self.register_buffer("causal_mask", causal, persistent=False)

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.qkv_proj(x)  # (B, T, (H + 2 Hkv) D)
        kv_width = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split((self.d_model, kv_width, kv_width), dim=-1)
        split = "b t (h d) -> b h t d"
        return tuple(einx.id(split, t, d=self.head_dim) for t in (q, k, v))

    def _attend(self, q, k, v, mask: torch.Tensor | None = None) -> torch.Tensor:
        """mask (T, T), True where masked: default causal."""
        T = q.shape[-2]
        group = self.num_heads // self.num_kv_heads
        if group > 1:  # each key/value head serves `group` consecutive query heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        mask = self.causal_mask[:T, :T] if mask is None else mask
        out = self.attention(q, k, v, mask)  # (B, H, T, D)
        return self.output_proj(einx.id("b h t d -> b t (h d)", out))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self._attend(*self._heads(x), mask)


class MultiHeadAttentionWithRoPE(MultiHeadAttention):
    """MultiHeadAttention with RoPE applied to q and k (interleaved or half-split pairs)."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        max_seq_len: int,
        theta: float,
        device=None,
        dtype=None,
        num_kv_heads: int | None = None,
        rope_interleaved: bool = True,
    ):
        super().__init__(d_model, num_heads, max_seq_len, device, dtype, num_kv_heads)
        self.rope = RoPE(theta, self.head_dim, max_seq_len, device, rope_interleaved)

    def forward(
        self,
        x: torch.Tensor,
        token_positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q, k, v = self._heads(x)  # (B, H, T, D), k and v (B, Hkv, T, D)
        if token_positions is None:
            token_positions = torch.arange(x.shape[-2], device=x.device).expand(x.shape[0], -1)
        return self._attend(self.rope(q, token_positions), self.rope(k, token_positions), v, mask)


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(.)).

    The constructor builds the block from the classes named below, so that a subclass of the same
    parameters (fastlm.model's, on the kernels) swaps the parts without repeating it."""

    norm_class = RmsNorm
    attention_class = MultiHeadAttentionWithRoPE
    ffn_class = SwiGlu

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        max_seq_len: int,
        theta: float,
        device=None,
        dtype=None,
        num_kv_heads: int | None = None,
        rope_interleaved: bool = True,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        self.rms_norm1 = self.norm_class(d_model, norm_eps, device=device, dtype=dtype)
        self.mult_head_atten = self.attention_class(
            d_model, num_heads, max_seq_len, theta, device, dtype, num_kv_heads, rope_interleaved
        )
        self.rms_norm2 = self.norm_class(d_model, norm_eps, device=device, dtype=dtype)
        self.ffe = self.ffn_class(d_model, d_ff, device, dtype)

    def forward(
        self,
        x: torch.Tensor,
        token_positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.mult_head_atten(self.rms_norm1(x), token_positions, mask)
        return x + self.ffe(self.rms_norm2(x))


def check_token_input(
    token_ids: torch.Tensor, vocab_size: int, context_length: int, check_values: bool = True
) -> None:
    """ValueError for a sequence longer than the context or (unless check_values is False: the
    check reads the ids back to the host) a token id outside the vocabulary."""
    if token_ids.dim() != 2 or token_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"token_ids must be an integer tensor of shape (batch, seq), "
            f"got {tuple(token_ids.shape)} {token_ids.dtype}"
        )
    if token_ids.shape[-1] > context_length:
        raise ValueError(
            f"token_ids has {token_ids.shape[-1]} tokens, more than context_length={context_length}"
        )
    if not check_values or not token_ids.numel():
        return
    if token_ids.min() < 0 or token_ids.max() >= vocab_size:
        raise ValueError(
            f"token_ids must lie in [0, {vocab_size}), got values in "
            f"[{int(token_ids.min())}, {int(token_ids.max())}]"
        )


class Transformer(nn.Module):
    """Decoder-only language model: embedding, pre-norm blocks, final norm, vocabulary logits.

    The LLaMA-style options: `num_kv_heads` (grouped-query attention; default num_heads),
    `rope_interleaved` (False: RoPE's half-split pairs, as Hugging Face's checkpoints hold them),
    `tie_embeddings` (out_linear.w is embedding.w, one parameter under both state_dict keys) and
    `norm_eps` (every RMSNorm's). Their defaults give the original model (multi-head attention,
    interleaved pairs, untied embeddings, eps 1e-5).

    The constructor builds the model from the classes named below, so that a subclass of the same
    parameters (fastlm.Transformer, on the kernels) swaps the parts without repeating it.
    """

    embedding_class = Embedding
    block_class = TransformerBlock
    norm_class = RmsNorm
    linear_class = Linear

    def __init__(
        self,
        vocab_size: int,
        context_length: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        d_ff: int,
        rope_theta: float,
        device=None,
        dtype=None,
        *,
        num_kv_heads: int | None = None,
        rope_interleaved: bool = True,
        tie_embeddings: bool = False,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.embedding = self.embedding_class(vocab_size, d_model, device, dtype)
        self.blocks = nn.ModuleList(
            self.block_class(
                d_model,
                num_heads,
                d_ff,
                context_length,
                rope_theta,
                device,
                dtype,
                num_kv_heads,
                rope_interleaved,
                norm_eps,
            )
            for _ in range(num_layers)
        )
        self.final_norm = self.norm_class(d_model, norm_eps, device=device, dtype=dtype)
        self.out_linear = self.linear_class(d_model, vocab_size, device, dtype)
        tie(self, tie_embeddings)

    def forward(
        self,
        token_ids: torch.Tensor,
        token_positions: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V). cu_seqlens: packed documents (see `document_mask`): the B * T
        tokens run as one row in which each token attends only to its own document's earlier
        tokens, at its position in that document unless token_positions says otherwise."""
        check_token_input(token_ids, self.vocab_size, self.context_length)
        B, T = token_ids.shape
        mask = None
        x = self.embedding(token_ids)  # (B, T, C)
        if cu_seqlens is not None:
            mask, positions = document_mask(cu_seqlens, B * T)  # (B T, B T), (B T,)
            if token_positions is not None:
                positions = token_positions.expand(B, T).reshape(B * T)
            x, token_positions = x.reshape(1, B * T, -1), positions[None]
        for block in self.blocks:
            x = block(x, token_positions, mask)
        return self.out_linear(self.final_norm(x)).reshape(B, T, -1)  # (B, T, V)


def document_mask(cu_seqlens: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For n_tokens packed tokens split into documents at cu_seqlens (int32, [num_docs + 1],
    from 0 up to n_tokens): the (n_tokens, n_tokens) mask, True where token i may not see token
    j (j in another document, or later), and each token's position in its document."""
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D int32 with at least 2 entries, got {cu_seqlens}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != n_tokens or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(
            f"cu_seqlens must rise from 0 to the {n_tokens} packed tokens, got {bounds}"
        )
    index = torch.arange(n_tokens, device=cu_seqlens.device)
    document = torch.bucketize(index, cu_seqlens[1:].long(), right=True)  # (n_tokens,)
    mask = (document[:, None] != document[None, :]) | (index[None, :] > index[:, None])
    return mask, index - cu_seqlens.long()[document]


def tie(model: nn.Module, tie_embeddings: bool) -> None:
    """Make model.out_linear.w the very parameter model.embedding.w when tie_embeddings (both
    are (vocab, d_model)); state_dict then lists it under both keys, and loading either
    checkpoint layout fills it."""
    model.tie_embeddings = bool(tie_embeddings)
    if tie_embeddings:
        model.out_linear.w = model.embedding.w


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


class CrossEntropyLoss(nn.Module):
    """Mean over all positions of -log softmax(logits)[target]."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = logits.reshape(-1, logits.shape[-1])
        shifted = logits - logits.amax(dim=-1, keepdim=True)
        log_probs = shifted - torch.log(torch.exp(shifted).sum(dim=-1, keepdim=True))
        return -log_probs.gather(-1, targets.reshape(-1, 1)).mean()


class SGDDecay(torch.optim.Optimizer):
    """SGD whose step size decays as lr / sqrt(t + 1)."""

    def __init__(self, params, lr: float = 1e-3):
        if lr < 0:
            raise ValueError(f"lr must be non-negative, got {lr}")
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                t = state.get("t", 0)
                p -= group["lr"] / math.sqrt(t + 1) * p.grad
                state["t"] = t + 1
        return loss


class AdamW(torch.optim.Optimizer):
    """Adam with bias correction and decoupled weight decay (Loshchilov & Hutter)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ):
        if lr < 0:
            raise ValueError(f"lr must be non-negative, got {lr}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["t"] = 0
                    state["m"] = torch.zeros_like(p)
                    state["sm"] = torch.zeros_like(p)
                state["t"] += 1
                t, m, sm = state["t"], state["m"], state["sm"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                sm.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                step_size = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t)
                p.addcdiv_(m, sm.sqrt().add_(group["eps"]), value=-step_size)
                p.mul_(1 - lr * group["weight_decay"])
        return loss


def cos_lr_scheduler(
    t: int, lr_max: float, lr_min: float, warmup_iters: int, cos_cycle_iters: int
) -> float:
    """Linear warm-up to lr_max, cosine decay to lr_min at cos_cycle_iters, then lr_min."""
    if t < warmup_iters:
        return t / warmup_iters * lr_max
    if t <= cos_cycle_iters:
        progress = (t - warmup_iters) / (cos_cycle_iters - warmup_iters)
        return lr_min + 0.5 * (1 + math.cos(math.pi * progress)) * (lr_max - lr_min)
    return lr_min


def gradient_clip(parameters: Iterable[nn.Parameter], max_norm: float, eps: float = 1e-6) -> float:
    """Scale all gradients in place so that their global L2 norm is at most max_norm.

    Returns the norm before clipping.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    if norm > max_norm:
        for g in grads:
            g.mul_(max_norm / (norm + eps))
    return float(norm)
