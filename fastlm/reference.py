"""The plain PyTorch model math: the ground truth for every kernel.

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

from fastlm.options import check, check_flag

# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------


def _trunc_normal(shape: tuple[int, ...], std: float, device=None, dtype=None) -> torch.Tensor:
    """A fresh tensor drawn from N(0, std^2) truncated at +-3 std."""
    w = torch.empty(shape, device=device, dtype=dtype)
    nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)
    return w


class Linear(nn.Module):
    """y = x W^T with no bias; W is [out_features, in_features].

    W is drawn from N(0, std^2), std = sqrt(2 / (in_features + out_features)), truncated at
    +-3 std.

    Args:
        in_features: x's last dim.
        out_features: y's last dim.
        device, dtype: of the weight `w` (default: PyTorch's defaults).
    """

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        std = math.sqrt(2.0 / (in_features + out_features))
        self.w = nn.Parameter(_trunc_normal((out_features, in_features), std, device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T.

        Args:
            x: (..., in_features), the weight's dtype.

        Returns:
            (..., out_features).
        """
        return einx.dot("... [in], out [in] -> ... out", x, self.w)


class Embedding(nn.Module):
    """Lookup of rows of W [num_embeddings, embedding_dim] by token id.

    W is drawn from N(0, std^2), std = 1 / sqrt(embedding_dim), truncated at +-3 std.

    Args:
        num_embeddings: the vocabulary size.
        embedding_dim: the width of a row (the model dim).
        device, dtype: of the weight `w` (default: PyTorch's defaults).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        std = 1.0 / math.sqrt(embedding_dim)
        self.w = nn.Parameter(_trunc_normal((num_embeddings, embedding_dim), std, device, dtype))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The rows of W at `token_ids`.

        Args:
            token_ids: integer tensor of any shape, values in [0, num_embeddings).

        Returns:
            (*token_ids.shape, embedding_dim) in W's dtype.
        """
        return self.w[token_ids]


class RmsNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * g over the last dim, computed in float32 (float64 stays
    float64, so that the reference in float64 is exact to float64 rounding).

    Args:
        d_model: the normalised (last) dim.
        eps: added to the mean square (default 1e-5).
        device, dtype: of the gain `g`, initialised to ones (default: PyTorch's defaults).
    """

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.d_model = d_model
        self.eps = eps
        self.g = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised x.

        Args:
            x: (..., d_model), any float dtype.

        Returns:
            x's shape and dtype.
        """
        in_dtype = x.dtype
        x = x.to(torch.promote_types(in_dtype, torch.float32))
        rms_inv = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x * rms_inv * self.g).to(in_dtype)


class SiLu(nn.Module):
    """silu(x) = x * sigmoid(x), elementwise; no parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """sigmoid(x) * x.

        Args:
            x: any shape and float dtype.

        Returns:
            x's shape and dtype.
        """
        return torch.sigmoid(x) * x


class SwiGlu(nn.Module):
    """w2(silu(w1 x) * w3 x): w1 is the gate, w3 the value, w2 the output projection.

    Also importable as `FFN`.

    Args:
        d_model: the input and output width.
        d_ff: the hidden width (w1, w3: d_model -> d_ff; w2: d_ff -> d_model).
        device, dtype: of the three `Linear` weights (default: PyTorch's defaults).
    """

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device, dtype)
        self.w2 = Linear(d_ff, d_model, device, dtype)
        self.w3 = Linear(d_model, d_ff, device, dtype)
        self.silu = SiLu()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward output.

        Args:
            x: (..., d_model), the weights' dtype.

        Returns:
            (..., d_model).
        """
        return self.w2(self.silu(self.w1(x)) * self.w3(x))


FFN = SwiGlu


class MoeExperts(nn.Module):
    """The experts of a mixture of experts: E `SwiGlu` FFNs. Token t goes through the experts its
    router picked, expert_ids[t, j], and its output is their sum weighted by
    expert_weights[t, j]: out[t] = sum_j expert_weights[t, j] * experts[expert_ids[t, j]](x[t]).

    Written from the definition, one expert at a time (`fastlm.moe_experts` is checked against
    it).

    Args:
        num_experts: E.
        d_model, d_ff: each expert's `SwiGlu` widths.
        device, dtype: of the experts' weights.
    """

    def __init__(self, num_experts: int, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.experts = nn.ModuleList(
            SwiGlu(d_model, d_ff, device, dtype) for _ in range(num_experts)
        )

    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        """The weighted sum of the chosen experts' outputs.

        Args:
            x: (T, d_model), the weights' dtype.
            expert_ids: (T, k) integer, each in [0, num_experts).
            expert_weights: (T, k), x's dtype.

        Returns:
            (T, d_model).
        """
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tokens, slots = (expert_ids == e).nonzero(as_tuple=True)
            out = out.index_add(0, tokens, expert_weights[tokens, slots, None] * expert(x[tokens]))
        return out

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up (E, 2 d_ff, d_model), down (E, d_model, d_ff)): the experts' weights in
        transformers' stacked layout (gate w1 above up w3), differentiable to each expert's."""
        gate_up = torch.stack([torch.cat((f.w1.w, f.w3.w)) for f in self.experts])
        return gate_up, torch.stack([f.w2.w for f in self.experts])


# --------------------------------------------------------------------------------------------
# Mixture of experts
# --------------------------------------------------------------------------------------------

#: The router kinds: softmax top-k (Mixtral, Qwen3-MoE) and sigmoid scores with a selection bias
#: (DeepSeek-V3's auxiliary-loss-free balancing).
ROUTERS = ("softmax", "sigmoid")


def check_moe_options(
    num_experts: int,
    experts_per_token: int,
    moe_d_ff: int | None,
    num_shared_experts: int,
    first_dense_layers: int,
    router: str,
    normalize_top_k: bool,
    aux_loss_coef: float,
    z_loss_coef: float,
    router_bias_rate: float,
    num_layers: int | None = None,
    name: Callable[[str], str] = str,
) -> None:
    """A ValueError (a TypeError for a wrong type: the option rule, `fastlm.options.check`)
    naming the option, for mixture-of-experts options no model can run.

    num_experts 0 is the dense model (the other options are then not read, but must still be
    well-formed); otherwise 1 <= experts_per_token <= num_experts, moe_d_ff None (d_ff) or
    positive, num_shared_experts and first_dense_layers non-negative (first_dense_layers below
    num_layers, so that one layer at least is a mixture), router one of `ROUTERS`,
    normalize_top_k a bool, the coefficients and the bias rate finite and non-negative.

    Args:
        num_experts, experts_per_token, moe_d_ff, num_shared_experts, first_dense_layers, router,
            normalize_top_k, aux_loss_coef, z_loss_coef, router_bias_rate: as in `Transformer`.
        num_layers: the model's blocks (None: not checked against first_dense_layers).
        name: spells an option in the message (the commands pass their flags).
    """
    # The option rule of every numeric option (fastlm/options.py): a wrong type a TypeError,
    # nan, inf or out of range a ValueError naming the option.
    for option, value in (
        ("num_experts", num_experts),
        ("experts_per_token", experts_per_token),
        ("num_shared_experts", num_shared_experts),
        ("first_dense_layers", first_dense_layers),
        ("aux_loss_coef", aux_loss_coef),
        ("z_loss_coef", z_loss_coef),
        ("router_bias_rate", router_bias_rate),
    ):
        check(name(option), value, spec=option)
    if moe_d_ff is not None and (
        isinstance(moe_d_ff, bool) or not isinstance(moe_d_ff, int) or moe_d_ff < 1
    ):  # a size, as d_ff
        raise ValueError(f"{name('moe_d_ff')} must be an integer >= 1 or None, got {moe_d_ff!r}")
    if router not in ROUTERS:
        raise ValueError(f"{name('router')} must be one of {', '.join(ROUTERS)}, got {router!r}")
    check_flag(name("normalize_top_k"), normalize_top_k)
    if num_experts == 0:
        return
    if experts_per_token > num_experts:
        raise ValueError(
            f"{name('experts_per_token')} ({experts_per_token}) must be at most "
            f"{name('num_experts')} ({num_experts})"
        )
    if num_layers is not None and first_dense_layers >= num_layers:
        raise ValueError(
            f"{name('first_dense_layers')} ({first_dense_layers}) must be below the "
            f"{num_layers} layers ({name('num_layers')}), or the model has no mixture-of-experts "
            f"layer (num_experts 0 is the dense model)"
        )


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of the assignments `expert_ids` (any shape, ids in [0, num_experts)) each
    expert got: (num_experts,) int64, by index_add (torch.bincount would read the largest id
    back to the host on a GPU)."""
    ids = expert_ids.flatten()
    ones = torch.ones_like(ids, dtype=torch.int64)
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).index_add_(0, ids, ones)


class Router(nn.Module):
    """Each token's k experts and their weights, from scores s = x W^T (logits, (T, E)).

    - "softmax" (Mixtral, Qwen3-MoE): p = softmax(s); the k largest p are chosen and are the
      weights, renormalised to sum 1 with `normalize_top_k`.
    - "sigmoid" (DeepSeek-V3's auxiliary-loss-free balancing): p = sigmoid(s); the k largest
      p + b are chosen, b the buffer `selection_bias` (E,), but the weights are the unbiased p of
      the chosen experts (renormalised with `normalize_top_k`): b steers the choice, never the
      output, and learns by `update_bias`, not by gradient.

    The logits and everything after them are computed in float32 (float64 stays float64), as the
    models it follows compute their routers. While training, the router counts the
    assignments each expert gets (`load`, a non-persistent buffer) for `update_bias` and the
    balance statistics; `reset_load` clears it.

    Args:
        d_model: D.
        num_experts: E.
        experts_per_token: k.
        kind: "softmax" or "sigmoid" (`ROUTERS`).
        normalize_top_k: renormalise the k weights to sum 1.
        device, dtype: of `weight` (E, D) and `selection_bias`.
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        experts_per_token: int,
        kind: str = "softmax",
        normalize_top_k: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.experts_per_token = experts_per_token
        self.kind = kind
        self.normalize_top_k = normalize_top_k
        std = math.sqrt(2.0 / (d_model + num_experts))
        self.weight = nn.Parameter(_trunc_normal((num_experts, d_model), std, device, dtype))
        if kind == "sigmoid":
            self.register_buffer(
                "selection_bias", torch.zeros(num_experts, device=device, dtype=dtype)
            )
        self.register_buffer(
            "load", torch.zeros(num_experts, device=device, dtype=torch.float32), persistent=False
        )

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """s = x W^T in float32 (float64 for float64): (T, D) -> (T, E)."""
        compute = torch.promote_types(x.dtype, torch.float32)
        return x.to(compute) @ self.weight.to(compute).T

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The routing of x's tokens.

        Args:
            x: (T, d_model).

        Returns:
            (expert_ids (T, k) int64, expert_weights (T, k) float32 (float64 for a float64 x),
            logits (T, E)): the weights differentiable to x and W through p.
        """
        logits = self.logits(x)  # (T, E)
        k = self.experts_per_token
        if self.kind == "softmax":
            probs = torch.softmax(logits, dim=-1)  # (T, E)
            weights, ids = probs.topk(k, dim=-1)  # (T, k) each
        else:
            probs = torch.sigmoid(logits)  # (T, E)
            biased = probs.detach() + self.selection_bias.to(probs.dtype)
            ids = biased.topk(k, dim=-1).indices  # (T, k): chosen by the biased scores
            weights = probs.gather(-1, ids)  # (T, k): weighted by the unbiased ones
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.training:
            with torch.no_grad():
                self.load += expert_counts(ids, self.num_experts)
        return ids, weights, logits

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Each token's distribution over the experts, (T, E), for the load-balancing loss: the
        softmax, or the sigmoid scores normalised to sum 1 (DeepSeek-V3's balance loss)."""
        if self.kind == "softmax":
            return torch.softmax(logits, dim=-1)
        probs = torch.sigmoid(logits)
        return probs / probs.sum(dim=-1, keepdim=True)

    def reset_load(self) -> None:
        """Start counting the assignments afresh."""
        self.load.zero_()

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """Auxiliary-loss-free balancing (DeepSeek-V3): b_e += rate * sign(mean(load) - load_e),
        so an expert that got fewer assignments than the mean is chosen more readily. A softmax
        router has no bias: nothing happens.

        Args:
            load: (E,) the assignments each expert got over the step (all ranks').
            rate: the step size (DeepSeek-V3: 1e-3).
        """
        if self.kind == "sigmoid":
            step = torch.sign(load.mean() - load) * rate
            self.selection_bias += step.to(self.selection_bias.dtype)


class StackedExperts(nn.Module):
    """E SwiGLU experts stacked as transformers 5 holds them: `gate_up` (E, 2F, D), expert e's
    gate rows (the seed FFN's w1) above its up rows (w3), and `down` (E, D, F) (w2). Each expert
    is initialised as the seed's `SwiGlu`: N(0, 2 / (D + F)) truncated at +-3 std.

    The forward is the definition, one expert at a time:
    out[t] = sum_j w[t, j] * down_e (silu(gate_e x[t]) * up_e x[t]), e = expert_ids[t, j].

    Args:
        num_experts: E.
        d_model: D.
        d_ff: F, each expert's hidden width.
        device, dtype: of the weights.
    """

    def __init__(self, num_experts: int, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.num_experts = num_experts
        self.d_ff = d_ff
        std = math.sqrt(2.0 / (d_model + d_ff))
        shape = (num_experts, 2 * d_ff, d_model)
        self.gate_up = nn.Parameter(_trunc_normal(shape, std, device, dtype))
        self.down = nn.Parameter(_trunc_normal((num_experts, d_model, d_ff), std, device, dtype))

    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        """The weighted sum of each token's experts' outputs.

        Args:
            x: (T, D), the weights' dtype.
            expert_ids: (T, k) integer in [0, E).
            expert_weights: (T, k) float.

        Returns:
            (T, D) in x's dtype.
        """
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tokens, slots = (expert_ids == e).nonzero(as_tuple=True)  # e's assignments
            gate, up = self.gate_up[e].split(self.d_ff)  # (F, D) each
            g, u = x[tokens] @ gate.T, x[tokens] @ up.T  # (n_e, F) each
            y = (torch.sigmoid(g) * g * u) @ self.down[e].T  # (n_e, D)
            w = expert_weights[tokens, slots, None].to(x.dtype)  # (n_e, 1)
            out = out.index_add(0, tokens, w * y)
        return out


class MoeLayer(nn.Module):
    """A mixture-of-experts feed-forward: out = experts(x, router(x)) + shared(x).

    The router (`Router`, parameter `router.weight` (E, D), for "sigmoid" also the buffer
    `router.selection_bias` (E,)) picks k experts per token; `experts` (`StackedExperts`:
    `experts.gate_up` (E, 2F, D), `experts.down` (E, D, F)) computes their weighted sum, through
    the one method `run_experts(x, expert_ids, expert_weights)` (where expert parallelism plugs
    in); `shared` (a `SwiGlu` of num_shared_experts * F, absent without shared experts) sees every
    token.

    Its auxiliary losses, from the last forward, are kept in `losses` (graph-connected scalars)
    for the model to add (`Transformer.auxiliary_loss`):

    - "balance": Switch Transformer's E * sum_e f_e P_e, f_e the share of the T k assignments
      that went to e, P_e the mean over tokens of the router's probability of e
      (`Router.probabilities`); 1 when perfectly balanced. (transformers' Qwen3-MoE loss is k
      times this: its f sums to k.)
    - "z": ST-MoE's router z-loss, the mean over tokens of logsumexp(logits)^2.

    Args:
        d_model: D.
        num_experts: E.
        experts_per_token: k.
        d_ff: F, each expert's hidden width.
        num_shared_experts: the shared experts, one SwiGLU of num_shared_experts * F (0: none).
        router: "softmax" or "sigmoid".
        normalize_top_k: renormalise each token's k weights to sum 1.
        device, dtype: of the parameters.
    """

    router_class = Router
    experts_class = StackedExperts
    ffn_class = SwiGlu

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        experts_per_token: int,
        d_ff: int,
        num_shared_experts: int = 0,
        router: str = "softmax",
        normalize_top_k: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.router = self.router_class(
            d_model, num_experts, experts_per_token, router, normalize_top_k, device, dtype
        )
        self.experts = self.experts_class(num_experts, d_model, d_ff, device, dtype)
        self.shared = None
        if num_shared_experts:
            self.shared = self.ffn_class(d_model, num_shared_experts * d_ff, device, dtype)
        self.losses: dict[str, torch.Tensor] = {}

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The router's (expert_ids, expert_weights, logits) for x (T, D) (`Router.forward`)."""
        return self.router(x)

    def run_experts(
        self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts' weighted sum (T, D) for x (T, D): the one place the experts run."""
        return self.experts(x, expert_ids, expert_weights)

    def auxiliary_losses(self, logits: torch.Tensor, expert_ids: torch.Tensor) -> dict:
        """{"balance": E sum_e f_e P_e, "z": mean logsumexp(logits)^2} for logits (T, E) and the
        chosen expert_ids (T, k)."""
        E = self.router.num_experts
        counts = expert_counts(expert_ids, E)  # (E,)
        share = counts.to(logits.dtype) / expert_ids.numel()  # f_e: (E,), sums to 1
        mean_probs = self.router.probabilities(logits).mean(dim=0)  # P_e: (E,)
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        return {"balance": E * (share * mean_probs).sum(), "z": z}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output; its auxiliary losses are left in `losses`.

        Args:
            x: (..., D).

        Returns:
            x's shape, x's dtype.
        """
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (T, D)
        expert_ids, expert_weights, logits = self.route(x)  # (T, k), (T, k), (T, E)
        self.losses = self.auxiliary_losses(logits, expert_ids)
        out = self.run_experts(x, expert_ids, expert_weights)  # (T, D)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.reshape(shape)


class RoPE(nn.Module):
    """Rotary position embedding: pair i of a head vector at position p is rotated by the angle
    p * theta^(-2i / d_k).

    The pairs are interleaved, (x[2i], x[2i+1]), by default (the RoPE paper's); with
    `interleaved=False` they are half-split, (x[i], x[i + d_k/2]), the layout of GPT-NeoX and of
    Hugging Face's Llama checkpoints. The cos and sin tables are non-persistent float32 buffers
    `cos_cached` and `sin_cached` of shape (max_seq_len, d_k), each angle repeated for both
    elements of its pair (the state_dict is empty).

    Args:
        theta: the base (10000.0 in most models).
        d_k: the head dim, even.
        max_seq_len: the number of positions the tables hold.
        device: of the tables (default: PyTorch's default device).
        interleaved: the pair layout (default True: interleaved).

    Raises:
        ValueError: an odd d_k.
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
        """(a, b) -> (-b, a) for each interleaved pair.

        Args:
            x: (..., D), D even.

        Returns:
            x's shape and dtype.
        """
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)

    @staticmethod
    def rotate_halves(x: torch.Tensor) -> torch.Tensor:
        """(a, b) -> (-b, a) for each half-split pair: [x1, x2] -> [-x2, x1].

        Args:
            x: (..., D), D even.

        Returns:
            x's shape and dtype.
        """
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor) -> torch.Tensor:
        """x rotated by the angles of its tokens' positions, as a new tensor.

        Args:
            x: (T, d_k), (B, T, d_k) or (B, H, T, d_k), any float dtype.
            token_positions: (T,), or (B, T) for a batched x, integers in [0, max_seq_len); (B, T)
                positions broadcast over the heads of a 4-D x.

        Returns:
            x's shape and dtype (computed in float32, or in x's dtype where wider).
        """
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
    """exp(x - max) / sum(exp(x - max)): the max is subtracted so that exp cannot overflow.

    Args:
        x: any shape, a float dtype.
        dim: the dim normalised over.

    Returns:
        x's shape and dtype.
    """
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum(dim=dim, keepdim=True)


class ScaledDotProductAttention(nn.Module):
    """softmax(q k^T / sqrt(d_k) with masked scores set to -1e9) v; mask is True where masked.

    No parameters; an explicit [Tq x Tk] score matrix.
    """

    def forward(self, q, k, v, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The attention output.

        Args:
            q: (..., Tq, d_k).
            k: (..., Tk, d_k), q's leading dims (or broadcastable to them) and dtype.
            v: (..., Tk, d_v).
            mask: bool, broadcastable to (..., Tq, Tk), True where query i may not see key j; None
                (the default): every query sees every key.

        Returns:
            (..., Tq, d_v).
        """
        scores = einx.dot("... q [d], ... k [d] -> ... q k", q, k) / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(mask, -1e9)
        return einx.dot("... q [k], ... [k] d -> ... q d", softmax(scores, dim=-1), v)


def check_kv_heads(num_heads: int, num_kv_heads: int | None) -> int:
    """The number of key/value heads, checked against num_heads.

    Args:
        num_heads: the query heads.
        num_kv_heads: the key/value heads, or None for num_heads (no grouping).

    Returns:
        num_kv_heads (None: num_heads).

    Raises:
        ValueError: num_kv_heads not a positive int or None, or not a divisor of num_heads.
    """
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
    (num_heads + 2 num_kv_heads) * head_dim outputs: q's heads, then k's, then v's. head_dim is
    d_model / num_heads; output_proj maps the heads back to d_model.

    Args:
        d_model: the input and output width, a multiple of num_heads.
        num_heads: the query heads.
        max_seq_len: the longest sequence (the causal mask buffer is (max_seq_len, max_seq_len)).
        device, dtype: of the weights (default: PyTorch's defaults).
        num_kv_heads: the key/value heads, dividing num_heads (default None: num_heads).

    Raises:
        ValueError: d_model not a multiple of num_heads, or a bad num_kv_heads (`check_kv_heads`).
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
        """Attention of x's tokens to each other, without positions.

        Args:
            x: (B, T, d_model), T <= max_seq_len, the weights' dtype.
            mask: bool (T, T) (or broadcastable to (B, H, T, T)), True where query i may not see key
                j; default None: causal.

        Returns:
            (B, T, d_model).
        """
        return self._attend(*self._heads(x), mask)


class MultiHeadAttentionWithRoPE(MultiHeadAttention):
    """MultiHeadAttention with RoPE applied to q and k (interleaved or half-split pairs).

    Args:
        d_model, num_heads, max_seq_len, device, dtype, num_kv_heads: as in `MultiHeadAttention`;
            max_seq_len also sizes RoPE's tables.
        theta: RoPE's base.
        rope_interleaved: RoPE's pair layout, as `RoPE`'s `interleaved` (default True).

    Raises:
        ValueError: as `MultiHeadAttention`, or an odd head dim (`RoPE`).
    """

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
        """Attention of x's tokens, q and k rotated by their positions.

        Args:
            x: (B, T, d_model), T <= max_seq_len, the weights' dtype.
            token_positions: (T,) or (B, T) integers in [0, max_seq_len) (default: 0 to T - 1 in
                every row).
            mask: as in `MultiHeadAttention.forward` (default: causal).

        Returns:
            (B, T, d_model).
        """
        q, k, v = self._heads(x)  # (B, H, T, D), k and v (B, Hkv, T, D)
        if token_positions is None:
            token_positions = torch.arange(x.shape[-2], device=x.device).expand(x.shape[0], -1)
        return self._attend(self.rope(q, token_positions), self.rope(k, token_positions), v, mask)


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(.)).

    The constructor builds the block from the classes named below (`norm_class`,
    `attention_class`, `ffn_class`), so that a subclass with the same parameters (fastlm.model's,
    on the kernels) swaps the parts without repeating it. The parts are `rms_norm1`,
    `mult_head_atten`, `rms_norm2` and `ffe`: the state_dict keys.

    Args:
        d_model: the model width.
        num_heads: the query heads; d_model / num_heads is the head dim.
        d_ff: the feed-forward's hidden width.
        max_seq_len: the longest sequence (RoPE's tables, the causal mask).
        theta: RoPE's base.
        device, dtype: of the parameters (default: PyTorch's defaults).
        num_kv_heads: key/value heads for grouped-query attention (default None: num_heads).
        rope_interleaved: RoPE's pair layout (default True: interleaved).
        norm_eps: both RMSNorms' epsilon (default 1e-5).
        moe: the keyword arguments of a `MoeLayer` (but d_model, device, dtype), which is then
            the feed-forward `ffe` in place of the SwiGLU of d_ff (default None: the SwiGLU).

    Raises:
        ValueError: as `MultiHeadAttentionWithRoPE`.
    """

    norm_class = RmsNorm
    attention_class = MultiHeadAttentionWithRoPE
    ffn_class = SwiGlu
    moe_class = MoeLayer

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
        moe: dict | None = None,
    ):
        super().__init__()
        self.rms_norm1 = self.norm_class(d_model, norm_eps, device=device, dtype=dtype)
        self.mult_head_atten = self.attention_class(
            d_model, num_heads, max_seq_len, theta, device, dtype, num_kv_heads, rope_interleaved
        )
        self.rms_norm2 = self.norm_class(d_model, norm_eps, device=device, dtype=dtype)
        if moe:
            self.ffe = self.moe_class(d_model, **moe, device=device, dtype=dtype)
        else:
            self.ffe = self.ffn_class(d_model, d_ff, device, dtype)

    def forward(
        self,
        x: torch.Tensor,
        token_positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x after the block's attention and feed-forward sub-layers.

        Args:
            x: (B, T, d_model).
            token_positions: as in `MultiHeadAttentionWithRoPE.forward` (default: 0 to T - 1).
            mask: as in `MultiHeadAttention.forward` (default: causal).

        Returns:
            (B, T, d_model).
        """
        x = x + self.mult_head_atten(self.rms_norm1(x), token_positions, mask)
        return x + self.ffe(self.rms_norm2(x))


def check_token_input(
    token_ids: torch.Tensor, vocab_size: int, context_length: int, check_values: bool = True
) -> None:
    """Check a model's token ids: an integer (batch, seq) tensor within the context and vocabulary.

    Args:
        token_ids: the tokens, int32 or int64, (batch, seq).
        vocab_size: ids must lie in [0, vocab_size).
        context_length: the longest sequence.
        check_values: False skips the vocabulary check (it reads the ids back to the host).

    Raises:
        ValueError: token_ids not a 2-D int32/int64 tensor, a sequence longer than the context, or
            (unless check_values is False) a token id outside the vocabulary.
    """
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

    The LLaMA-style options are `num_kv_heads`, `rope_interleaved`, `tie_embeddings` and
    `norm_eps`; their defaults give a plain multi-head model (multi-head attention, interleaved
    pairs, untied embeddings, eps 1e-5). The state_dict keys (`embedding.w`,
    `blocks.<i>.{rms_norm1.g, mult_head_atten.qkv_proj.w, mult_head_atten.output_proj.w,
    rms_norm2.g, ffe.w1.w, ffe.w2.w, ffe.w3.w}`, `final_norm.g`, `out_linear.w`) are the checkpoint
    format both this model and `fastlm.Transformer` read and write.

    The constructor builds the model from the classes named below (`embedding_class`,
    `block_class`, `norm_class`, `linear_class`), so that a subclass with the same parameters
    (fastlm.Transformer, on the kernels) swaps the parts without repeating it.

    Args:
        vocab_size: the number of token ids; the logits' last dim.
        context_length: the longest sequence, and the positions RoPE's tables hold.
        d_model: the model width, a multiple of num_heads; d_model / num_heads is the head dim,
            which must be even (RoPE rotates pairs).
        num_layers: the number of blocks.
        num_heads: the query heads of each attention.
        d_ff: the feed-forward's hidden width.
        rope_theta: RoPE's base (10000.0 in most models).
        device, dtype: of the parameters (default: PyTorch's defaults).
        num_kv_heads: key/value heads, for grouped-query attention: a divisor of num_heads;
            default None: num_heads.
        rope_interleaved: RoPE's pairs (x[2i], x[2i+1]) if True (the default); False: the
            half-split pairs (x[i], x[i + D/2]), as Hugging Face's checkpoints hold them.
        tie_embeddings: True makes out_linear.w the very parameter embedding.w, one parameter
            under both state_dict keys (default False).
        norm_eps: every RMSNorm's epsilon (default 1e-5).
        num_experts: E > 0 makes the feed-forward of every layer from first_dense_layers on a
            mixture of experts (`MoeLayer`, at `blocks.<i>.ffe`: `router.weight`,
            `router.selection_bias` for the sigmoid router, `experts.gate_up`, `experts.down`,
            `shared.w1.w`...); default 0: the dense model, the other options below unread.
        experts_per_token: k, the experts each token goes through (default 2).
        moe_d_ff: each expert's hidden width (default None: d_ff; the dense layers keep d_ff).
        num_shared_experts: experts every token goes through, one SwiGLU of
            num_shared_experts * moe_d_ff (default 0: none).
        first_dense_layers: the first layers keep the dense SwiGLU (default 0).
        router: "softmax" (default; Mixtral, Qwen3-MoE) or "sigmoid" (DeepSeek-V3's
            auxiliary-loss-free balancing: a selection bias updated by `update_router_bias`).
        normalize_top_k: renormalise each token's k weights to sum 1 (default True).
        aux_loss_coef: the load-balancing loss's coefficient in `auxiliary_loss` (default 0.01).
        z_loss_coef: the router z-loss's coefficient (default 0.001).
        router_bias_rate: the sigmoid router's bias step in `update_router_bias` (default 1e-3).

    The auxiliary losses: each forward leaves each MoE layer's losses in its `losses`;
    `auxiliary_loss()` is aux_loss_coef times their mean over the MoE layers of the balance loss
    plus z_loss_coef times that of the z-loss, for the training loss to add (fastlm-train adds it
    to the cross-entropy in training mode; it reports the cross-entropy apart).

    Raises:
        ValueError: d_model not a multiple of num_heads, an odd head dim, or a num_kv_heads that
            is not a positive divisor of num_heads; a mixture-of-experts option out of range
            (`check_moe_options`), naming it.
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
        num_experts: int = 0,
        experts_per_token: int = 2,
        moe_d_ff: int | None = None,
        num_shared_experts: int = 0,
        first_dense_layers: int = 0,
        router: str = "softmax",
        normalize_top_k: bool = True,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.001,
        router_bias_rate: float = 0.001,
    ):
        super().__init__()
        check_moe_options(
            num_experts,
            experts_per_token,
            moe_d_ff,
            num_shared_experts,
            first_dense_layers,
            router,
            normalize_top_k,
            aux_loss_coef,
            z_loss_coef,
            router_bias_rate,
            num_layers,
        )
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.aux_loss_coef = aux_loss_coef
        self.z_loss_coef = z_loss_coef
        self.router_bias_rate = router_bias_rate
        moe = None
        if num_experts:
            moe = dict(
                num_experts=num_experts,
                experts_per_token=experts_per_token,
                d_ff=d_ff if moe_d_ff is None else moe_d_ff,
                num_shared_experts=num_shared_experts,
                router=router,
                normalize_top_k=normalize_top_k,
            )
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
                moe=moe if layer >= first_dense_layers else None,
            )
            for layer in range(num_layers)
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
        """Logits (B, T, V) of every position.

        Args:
            token_ids: (B, T) int32 or int64 in [0, vocab_size), T <= context_length.
            token_positions: (T,) or (B, T) integers in [0, context_length), the positions RoPE
                rotates by (default: 0 to T - 1 in every row; with cu_seqlens each token's
                position in its document).
            cu_seqlens: packed documents (see `document_mask`): int32 (num_docs + 1,) from 0 to
                B * T; the B * T tokens run as one row in which each token attends only to its own
                document's earlier tokens, at its position in that document unless token_positions
                says otherwise. Default None: each row is one sequence.

        Returns:
            (B, T, vocab_size) in the parameters' dtype.

        Raises:
            ValueError: token_ids not a 2-D integer tensor, longer than context_length, or with an
                id outside the vocabulary; a bad cu_seqlens (`document_mask`).
        """
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

    def moe_layers(self) -> list[MoeLayer]:
        """The mixture-of-experts layers, in order (empty for a dense model)."""
        return [block.ffe for block in self.blocks if isinstance(block.ffe, MoeLayer)]

    def auxiliary_loss(self) -> torch.Tensor | None:
        """aux_loss_coef * mean over MoE layers of the balance loss + z_loss_coef * mean of the
        z-loss, of the last forward (graph-connected: add it to the loss before backward);
        None for a dense model or before a forward."""
        layers = [layer for layer in self.moe_layers() if layer.losses]
        if not layers:
            return None
        balance = torch.stack([layer.losses["balance"] for layer in layers]).mean()
        z = torch.stack([layer.losses["z"] for layer in layers]).mean()
        return self.aux_loss_coef * balance + self.z_loss_coef * z

    @torch.no_grad()
    def update_router_bias(self, reduce: Callable | None = None) -> dict[str, float]:
        """After an optimizer step: each sigmoid router's bias steps toward balance from the
        assignments its experts got since the last call (`Router.update_bias`), every router's
        count is reset, and the balance of those assignments is returned.

        Args:
            reduce: sums (or averages) a tensor over the data-parallel ranks, so that every rank
                updates its bias by the same counts (default None: this process's counts).

        Returns:
            {"load_max_over_mean": the largest over layers of max_e load_e / mean_e load_e,
            "balance_loss", "z_loss": the means over layers of the last forward's losses};
            empty for a dense model.
        """
        layers = self.moe_layers()
        if not layers:
            return {}
        loads = torch.stack([layer.router.load for layer in layers])  # (L, E)
        if reduce is not None:
            loads = reduce(loads)
        for layer, load in zip(layers, loads):
            layer.router.update_bias(load, self.router_bias_rate)
            layer.router.reset_load()
        ratio = (loads.amax(dim=1) / loads.mean(dim=1).clamp_min(1e-30)).max()
        stats = {"load_max_over_mean": float(ratio)}
        with_losses = [layer.losses for layer in layers if layer.losses]
        for key, name in (("balance", "balance_loss"), ("z", "z_loss")):
            if with_losses:
                stats[name] = float(torch.stack([lo[key].detach() for lo in with_losses]).mean())
        return stats


def document_mask(cu_seqlens: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention mask and positions of packed documents.

    Args:
        cu_seqlens: int32 (num_docs + 1,), from 0 up to n_tokens, non-decreasing: document i is
            tokens cu_seqlens[i] to cu_seqlens[i + 1] - 1.
        n_tokens: the number of packed tokens.

    Returns:
        (mask, positions): the (n_tokens, n_tokens) bool mask, True where token i may not see token
        j (j in another document, or later), and each token's position in its document, (n_tokens,)
        int64.

    Raises:
        ValueError: cu_seqlens not 1-D int32 with at least 2 entries, or not rising from 0 to
            n_tokens.
    """
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
    """Tie a model's output projection to its embedding, or record that it is untied.

    When tie_embeddings, model.out_linear.w becomes the very parameter model.embedding.w (both are
    (vocab, d_model)); state_dict then lists it under both keys, and loading either checkpoint
    layout fills it.

    Args:
        model: a Transformer (with `embedding.w` and `out_linear.w`).
        tie_embeddings: whether to tie; stored as model.tie_embeddings.
    """
    model.tie_embeddings = bool(tie_embeddings)
    if tie_embeddings:
        model.out_linear.w = model.embedding.w


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


class CrossEntropyLoss(nn.Module):
    """Mean over all positions of -log softmax(logits)[target]; no parameters."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy, every position counted.

        Args:
            logits: (..., V), a float dtype.
            targets: int64 ids in [0, V), logits' leading shape (...).

        Returns:
            A scalar in logits' dtype.
        """
        logits = logits.reshape(-1, logits.shape[-1])
        shifted = logits - logits.amax(dim=-1, keepdim=True)
        log_probs = shifted - torch.log(torch.exp(shifted).sum(dim=-1, keepdim=True))
        return -log_probs.gather(-1, targets.reshape(-1, 1)).mean()


class SGDDecay(torch.optim.Optimizer):
    """SGD whose step size decays as lr / sqrt(t + 1), t counting each parameter's steps.

    Args:
        params: the parameters (or parameter groups) to optimise.
        lr: the initial step size, >= 0 (default 1e-3).

    Raises:
        ValueError: a negative lr.
    """

    def __init__(self, params, lr: float = 1e-3):
        if lr < 0:
            raise ValueError(f"lr must be non-negative, got {lr}")
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One update of every parameter that has a gradient: p -= lr / sqrt(t + 1) * grad.

        Args:
            closure: optional, re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or None.
        """
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
    """Adam with bias correction and decoupled weight decay (Loshchilov & Hutter).

    Each step, with g the gradient and t the step count: m = beta1 m + (1 - beta1) g,
    v = beta2 v + (1 - beta2) g^2, p -= lr sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + eps),
    then p *= 1 - lr * weight_decay.

    Args:
        params: the parameters (or parameter groups) to optimise.
        lr: the learning rate, >= 0 (default 1e-3).
        betas: (beta1, beta2), each in [0, 1) (default (0.9, 0.999)).
        eps: added to sqrt(v) (default 1e-8).
        weight_decay: the decoupled decay rate (default 0.01).

    Raises:
        ValueError: a negative lr, or betas outside [0, 1).
    """

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
        """One update of every parameter that has a gradient.

        Args:
            closure: optional, re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or None.
        """
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
    """Linear warm-up to lr_max, cosine decay to lr_min at cos_cycle_iters, then lr_min.

    Args:
        t: the step.
        lr_max: the rate at the end of the warm-up.
        lr_min: the rate from cos_cycle_iters on.
        warmup_iters: the warm-up's steps (t / warmup_iters * lr_max before it ends).
        cos_cycle_iters: the step at which the cosine reaches lr_min, after warmup_iters.

    Returns:
        The learning rate at step t.
    """
    if t < warmup_iters:
        return t / warmup_iters * lr_max
    if t <= cos_cycle_iters:
        progress = (t - warmup_iters) / (cos_cycle_iters - warmup_iters)
        return lr_min + 0.5 * (1 + math.cos(math.pi * progress)) * (lr_max - lr_min)
    return lr_min


def gradient_clip(parameters: Iterable[nn.Parameter], max_norm: float, eps: float = 1e-6) -> float:
    """Scale all gradients in place so that their global L2 norm is at most max_norm.

    Args:
        parameters: the parameters; those without a gradient are skipped.
        max_norm: the largest global norm left.
        eps: added to the norm in the scale max_norm / (norm + eps) (default 1e-6).

    Returns:
        The norm before clipping (0.0 when no parameter has a gradient).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    if norm > max_norm:
        for g in grads:
            g.mul_(max_norm / (norm + eps))
    return float(norm)
