"""The forwards `patch` puts on a model's modules, and how they are attached so that a patched
model pickles.

Each module gets a `PatchedForward` as its instance `forward` (or `_apply_gate` for experts): a
callable holding the module, the name of one of the `PARTS` functions and that part's options
(plain values: attribute names, an activation, a scale), which `fastlm.hf.probe` found by running
the module's own code. It pickles as that triple (a bound method would pickle as
`getattr(module, "<function name>")`, which a module does not have), so `torch.save` /
`torch.load`, `pickle` and `copy.deepcopy` of a patched model work, also in a fresh process.
"""

from __future__ import annotations

import inspect
import math
import types
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from fastlm.backend import use_triton
from fastlm.hf.families import IGNORE_INDEX, modeling_module
from fastlm.kernels import cross_entropy, geglu, rms_norm, swiglu_packed
from fastlm.kernels import swiglu as swiglu_op
from fastlm.kernels.moe.experts import moe_experts
from fastlm.kernels.rope import rope_ref
from fastlm.tensor_parallel import lm_head_cross_entropy

# --------------------------------------------------------------------------------------------
# Norms and gated MLPs
# --------------------------------------------------------------------------------------------


def rms_norm_forward(self, x: torch.Tensor, eps_name: str, offset: float, promoted: bool):
    """x / rms(x) * (weight + offset) in fp32, rounded once, by `rms_norm`. The output dtype is
    x's, or the promotion of x's and the weight's (LLaMA's `weight * normed.to(x.dtype)`), as
    the module's own forward gives it. A weight of another dtype than x's is read in fp32
    (exact: the kernel's math is fp32). A norm without a weight (Gemma 4's value norm) is
    scaled by ones."""
    weight = getattr(self, "weight", None)
    if weight is None:
        weight = x.new_ones(x.shape[-1], dtype=torch.float32)
    out_dtype = torch.promote_types(x.dtype, weight.dtype) if promoted else x.dtype
    if weight.dtype not in (x.dtype, torch.float32):
        weight = weight.float()
    return rms_norm(x, weight, getattr(self, eps_name), offset=offset, out_dtype=out_dtype)


def activation_of(act: object) -> str | None:
    """ "silu", "tanh" (a tanh GELU), "none" (the exact GELU) or None for another activation.
    A guess from the type: `fastlm.hf.probe` checks it against the module's own output."""
    if isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation":
        return "silu"
    if isinstance(act, nn.GELU):
        return act.approximate
    name = type(act).__name__
    if name in ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation"):
        return "tanh"  # each computes 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
    if name in ("GELUActivation", "GELU"):
        return "none"
    return None


def gated(gate: torch.Tensor, up: torch.Tensor, activation: str, **options) -> torch.Tensor:
    """act(gate) * up by fastlm's kernel for the activation (SiLU with `swiglu`'s clamp options:
    DeepSeek-V4's dense MLPs)."""
    if activation == "silu":
        return swiglu_op(gate, up, **options)
    return geglu(gate, up, activation)


def packed_gated(gate_up: torch.Tensor, activation: str, gate_first: bool,
                 **options) -> torch.Tensor:  # fmt: skip
    """act(gate) * up of one (..., 2 I) projection holding both halves."""
    if activation == "silu" and gate_first:
        return swiglu_packed(gate_up, **options)  # its gradient comes back as one tensor
    first, second = gate_up.chunk(2, dim=-1)
    pair = (first, second) if gate_first else (second, first)
    return gated(*pair, activation, **options)


def clamp_options(module: nn.Module, limit_name: str | None = None, alpha_name: str | None = None,
                  up_offset: float = 0.0) -> dict:  # fmt: skip
    """`swiglu`'s clamp options (limit, alpha, up_offset) of a clamped gate, the limit and alpha
    read now from the module's attributes `limit_name` and `alpha_name` (None: alpha 1), where
    `fastlm.hf.probe` found its forward reads them on every call; {} for no clamp."""
    if limit_name is None:
        return {}
    alpha = float(getattr(module, alpha_name)) if alpha_name is not None else 1.0
    return dict(limit=float(getattr(module, limit_name)), alpha=alpha, up_offset=up_offset)


def mlp_forward(self, x: torch.Tensor, gate: str, up: str, down: str, activation: str, **clamp):
    """down(act(gate(x)) * up(x)) on the module's own projections (their biases included), SiLU
    clamped as `clamp` (`clamp_options`' names) says."""
    projections = getattr(self, gate)(x), getattr(self, up)(x)
    return getattr(self, down)(gated(*projections, activation, **clamp_options(self, **clamp)))


def packed_mlp_forward(self, x: torch.Tensor, gate_up: str, down: str, activation: str,
                       gate_first: bool, **clamp):  # fmt: skip
    """down(act(gate) * up) on one fused gate/up projection (Phi-3's, GLM-4's)."""
    gate_and_up = getattr(self, gate_up)(x)
    options = clamp_options(self, **clamp)
    return getattr(self, down)(packed_gated(gate_and_up, activation, gate_first, **options))


def experts_gate(self, gate_up: torch.Tensor, activation: str, interleaved: bool = False,
                 **clamp) -> torch.Tensor:  # fmt: skip
    """The experts' gate on (S, 2 I) projections: what transformers' experts call between their
    two GEMMs. gate first and up second, or interleaved with gpt-oss's clamp (`clamp_options`'
    names: its alpha and limit, read on every call, and up_offset)."""
    options = clamp_options(self, **clamp)
    if interleaved:
        return swiglu_packed(gate_up, interleaved=True, **options)
    return packed_gated(gate_up, activation, True, **options)


def input_scaled_experts_forward(self, hidden_states: torch.Tensor, transposed: bool,
                                 activation: str, shared: str | None, experts_op=None):  # fmt: skip
    """Llama 4's MoE block: each token's top-k experts take the token scaled by its router score
    (the router's own output, 0 outside the top k) and their outputs add, beside the shared
    expert:

        out[t] = shared(x[t]) + sum_j down_e(act(gate_up_e(s[t, e] x[t]))),  e = ids[t, j]

    Llama 4's own forward runs every expert over every token (those it did not choose take a
    zero row); here only the chosen ones run, on `fastlm.moe_experts` with weight 1 (the score
    scales the input, not the output). Returns (out (T, D), router logits (T, E)), as it does.
    `experts_op`: the experts' math (the probe passes the float64 reference)."""
    if not isinstance(getattr(self.experts, "gate_up_proj", None), torch.Tensor):
        # PEFT wrapped the experts after patch (LoRA by target_parameters): the adapted weights
        # exist only while the wrapper's forward runs, so the block's own forward runs them.
        return type(self).forward(self, hidden_states)
    experts_op = experts_op or moe_experts
    x = hidden_states.reshape(-1, hidden_states.shape[-1])  # (T, D)
    scores, logits = self.router(x)  # (T, E) each
    ids = torch.topk(logits, self.top_k, dim=1).indices  # (T, k), as the router chose them
    k, tokens = ids.shape[1], x.shape[0]
    routed_in = x * scores.gather(1, ids).T.reshape(k, tokens, 1)  # (k, T, D)
    routed = experts_op(
        routed_in.reshape(k * tokens, -1),
        ids.T.reshape(-1, 1),
        x.new_ones(k * tokens, 1),
        self.experts.gate_up_proj,
        self.experts.down_proj,
        transposed=transposed,
        activation=activation,
    ).view(k, tokens, -1)
    out = routed.sum(0)
    if shared is not None:
        out = getattr(self, shared)(x) + out
    return out, logits


def zero_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor, transposed: bool, activation: str,
                         interleaved: bool, experts_op=None) -> torch.Tensor:  # fmt: skip
    """Experts beside identity "zero experts" (LongCat-Flash's): of the router's N ids, the first
    E (down_proj's E) are experts and the others output their input,

        out[t] = sum_{j: e < E} w[t, j] down_e(act(gate_up_e x[t])) + (sum_{j: e >= E} w[t, j]) x[t]

    with e = top_k_index[t, j] and N gate_up_proj's E (LongCat allocates its rows for every id;
    those of zero experts are never read). The first sum on `fastlm.moe_experts` over the E
    experts, a zero expert's choice running no expert (the op's `num_experts`); the second, the
    weighted identity, in PyTorch: each slot's weight gets its own term's gradient.
    `experts_op`: the experts' math (the probe passes the float64 reference)."""
    if experts_op is None and hasattr(self.down_proj, "placements"):
        # Sharded by transformers' tensor parallelism: the family's own loop over the ids.
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    experts_op = experts_op or moe_experts
    down = self.down_proj
    routed = down.shape[0]
    x = hidden_states
    out = experts_op(
        x, top_k_index, top_k_weights.to(x.dtype), self.gate_up_proj[:routed], down,
        num_experts=self.gate_up_proj.shape[0], transposed=transposed, activation=activation,
        interleaved=interleaved,
    )  # fmt: skip
    identity = (top_k_weights * (top_k_index >= routed)).sum(1, keepdim=True)  # (T, 1)
    return (out + identity * x).to(x.dtype)


def unclamped_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor, limit_name: str, transposed: bool,
                              activation: str, interleaved: bool) -> torch.Tensor:  # fmt: skip
    """Experts that clamp only where their limit is finite (Step 3.7's gate, min(act(gate), L) *
    clamp(up, -L, L), whose L is infinite on every layer a checkpoint does not clamp): with the
    limit (read on every call) infinite, `fastlm.moe_experts`, an id of E choosing no expert
    (`num_experts` E + 1, as the family's own loop skips it); with a finite one, or DTensor
    weights (transformers' tensor parallelism), the family's own forward."""
    if math.isfinite(getattr(self, limit_name)) or hasattr(self.down_proj, "placements"):
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    x = hidden_states
    out = moe_experts(
        x, top_k_index, top_k_weights.to(x.dtype), self.gate_up_proj, self.down_proj,
        num_experts=self.down_proj.shape[0] + 1, transposed=transposed, activation=activation,
        interleaved=interleaved,
    )  # fmt: skip
    return out.to(x.dtype)


def sorted_experts_forward(self, hidden_states: torch.Tensor, router: str, gate_up: str,
                           down: str, activation: str, bias: str | None,
                           experts_op=None) -> torch.Tensor:  # fmt: skip
    """An MoE block whose router returns its choice sorted by expert, as ScatterMoE's does
    (JetMoE's MoE MLP): (order, token of each sorted slot, its gate, tokens per expert, logits),
    order[i] the assignment t k + j of sorted slot i. Its experts are stacked projections
    (`gate_up`'s weight (E, 2F, D), `down`'s (E, D, F)) and it adds a bias:

        out[t] = sum_j g[t, j] down_e(act(gate) * up) + bias,   (gate, up) = gate_up_e x[t]

    The router's own forward gives the choice (its tokens-per-expert list is its own host
    sync); the (T, k) ids and gates are put back in assignment order and the experts run on
    `fastlm.moe_experts`. `experts_op`: the experts' math (the probe passes the reference)."""
    experts_op = experts_op or moe_experts
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    order, _, gates, sizes, _ = getattr(self, router)(x)
    first, second = getattr(self, gate_up).weight, getattr(self, down).weight
    tokens, slots = x.shape[0], order.numel()
    counts = torch.as_tensor(sizes, device=order.device)
    sorted_ids = torch.repeat_interleave(torch.arange(first.shape[0], device=order.device), counts)
    ids = torch.empty_like(order).scatter_(0, order, sorted_ids).view(tokens, -1)
    weights = gates.new_zeros(slots).index_copy(0, order, gates).view(tokens, -1)
    out = experts_op(x, ids, weights.to(x.dtype), first, second, activation=activation)
    if bias is not None:
        out = out + getattr(self, bias)
    return out.view(shape)


# --------------------------------------------------------------------------------------------
# RoPE: the module's own attention forward, its apply_rotary_* function by fastlm's kernel
# --------------------------------------------------------------------------------------------

#: The layouts fastlm's RoPE kernel takes, as (interleaved, table, regrouped): pairs
#: (x[i], x[i + R/2]) or (x[2i], x[2i+1]) over the first R rotary dims, their angles read from
#: the W-wide tables as "half" (the first W/2 entries, R = W: Hugging Face's cat(freqs, freqs)),
#: "even" (every other entry, R = W: Cohere's repeat_interleave(freqs, 2)) or "all" (R = 2 W:
#: gpt-oss's tables, each angle once); regrouped: the interleaved pairs' results written
#: half-split (DeepSeek-V3's rope_interleave). Tried in this order against the family's own
#: function.
LAYOUTS = tuple((interleaved, table, False) for table in ("half", "even", "all")
                for interleaved in (False, True)) + ((True, "half", True),)  # fmt: skip


def _rotated(x: torch.Tensor, table_cos, table_sin, positions, interleaved: bool) -> torch.Tensor:
    """x (B, H, T, R) rotated into a new tensor: fastlm's functional RoPE op (the family's
    function returns new tensors too: q may be a split's output, k an expand)."""
    if use_triton(x) and x.dtype != torch.float64:
        return torch.ops.fastlm.rope(x, table_cos, table_sin, positions, interleaved, False)
    return rope_ref(x, table_cos, table_sin, positions, interleaved)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout, heads_dim: int):
    """x rotated as `layout` (one of LAYOUTS) by the rotary embedding's (B or 1, T, W) cos and
    sin, x's heads on dim `heads_dim` (1: (B, H, T, D); 2: (B, T, H, D)); dims past the rotary
    ones pass through."""
    interleaved, table, regrouped = layout
    width = cos.shape[-1]
    rotary = 2 * width if table == "all" else width
    rows = cos.shape[0] * cos.shape[1]
    pick = {"half": slice(0, width // 2), "even": slice(0, width, 2), "all": slice(None)}[table]
    table_cos = cos[..., pick].reshape(rows, rotary // 2)
    table_sin = sin[..., pick].reshape(rows, rotary // 2)
    positions = torch.arange(rows, device=x.device).view(cos.shape[0], cos.shape[1])
    heads = x if heads_dim == 1 else x.transpose(1, 2)  # (B, H, T, D)
    out = _rotated(heads[..., :rotary], table_cos, table_sin, positions, interleaved)
    if regrouped:  # (y1[0], y2[0], y1[1], ...) -> (y1[0], y1[1], ..., y2[0], y2[1], ...)
        out = out.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    if rotary < x.shape[-1]:
        out = torch.cat((out, heads[..., rotary:]), dim=-1)
    # (B, T, H, D) back in that layout's own contiguous order, as the family's function gives
    # it (its caller may .view the result).
    return out if heads_dim == 1 else out.transpose(1, 2).contiguous()


class RotaryFunction:
    """A family's `apply_rotary_pos_emb(q, k, cos, sin, ..., unsqueeze_dim=1)`, its one-tensor
    form `apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1)` (Gemma 4's and Gemma 3n's: q and k
    rotated by separate calls, a KV-shared layer's q alone), or its
    `apply_rotary_emb(xq, xk, freqs_cis)` (DeepSeek-V2's, Llama 4's: pairs (x[2i], x[2i+1]) as
    complex numbers times freqs_cis[..., i], a rotation scaled by |freqs_cis|), on fastlm's
    kernel; complex frequencies are the tables cos = freqs_cis.real, sin = freqs_cis.imag.

    Which layout (and, for freqs_cis, which dim holds the heads) it computes is found on first
    use for each shape (head dims, table width, unsqueeze_dim) by running it and each of
    `LAYOUTS` on small random float64 inputs of that shape and of its tables' structure: the
    first that agrees to fp32 rounding runs from then on; a shape none matches runs the family's
    own function, with one warning naming it. `patch` runs the model once on a few tokens so
    that this happens before any torch.compile (a shape first seen while compiling runs the
    family's function)."""

    def __init__(self, original: types.FunctionType):
        self.original = original
        parameters = inspect.signature(original).parameters
        self.names = tuple(parameters)
        self.complex = len(self.names) == 3  # (xq, xk, freqs_cis)
        # The tensors it rotates: those before cos (q and k, or x alone), or xq and xk.
        self.rotated = 2 if self.complex or "cos" not in self.names else self.names.index("cos")
        self.unsqueeze_default = getattr(parameters.get("unsqueeze_dim"), "default", 1)
        self.layouts: dict[tuple, tuple | None] = {}

    def _tables(self, values: dict) -> tuple | None:
        """(the tensors to rotate, cos, sin, unsqueeze_dim) of a call, or None for one the
        kernel cannot take."""
        xs = tuple(values.get(name) for name in self.names[: self.rotated])
        if self.complex:
            freqs = values.get(self.names[2])
            if not torch.is_tensor(freqs) or not freqs.is_complex():
                return None
            cos, sin = freqs.real, freqs.imag
            unsqueeze = None  # the heads' dim: found with the layout
        else:
            cos, sin = (values.get(name) for name in self.names[self.rotated : self.rotated + 2])
            unsqueeze = values.get("unsqueeze_dim", self.unsqueeze_default)
        if not all(torch.is_tensor(t) for t in (*xs, cos, sin)) or cos.dim() != 3:
            return None
        return xs, cos, sin, unsqueeze

    def __call__(self, *args, **kwargs):
        values = dict(zip(self.names, args), **kwargs)
        tables = self._tables(values)
        if tables is None:
            return self.original(*args, **kwargs)
        xs, cos, sin, unsqueeze = tables
        key = (tuple(x.shape[-1] for x in xs), cos.shape[-1], unsqueeze, xs[0].dim())
        if key not in self.layouts:
            if torch.compiler.is_compiling():
                return self.original(*args, **kwargs)
            given = self.names[: self.rotated + (1 if self.complex else 2)]
            rest = {n: v for n, v in values.items() if n not in given}
            structure = "once" if self.complex else _structure(cos)
            self.layouts[key] = self._find_layout(key, rest, structure)
        found = self.layouts[key]
        if found is None:
            return self.original(*args, **kwargs)
        layout, heads_dim = found
        out = tuple(rotate(x, cos, sin, layout, heads_dim) for x in xs)
        return out if len(out) > 1 else out[0]

    def _probe(self, key, rest: dict, structure: str, heads_dim: int):
        """(the tensors, cos, sin, the family's outputs as a tuple) on random float64 inputs of
        the key's shape, heads on `heads_dim`; the outputs None when the function does not take
        them."""
        dims, width, _, _ = key
        generator = torch.Generator().manual_seed(0)
        shape = lambda d: (2, 3, 5, d) if heads_dim == 1 else (2, 5, 3, d)  # noqa: E731
        xs = tuple(torch.randn(shape(d), generator=generator, dtype=torch.float64) for d in dims)
        angles = torch.rand(2, 5, width, generator=generator, dtype=torch.float64) * 6
        if structure == "twice":
            angles = torch.cat((angles[..., : width // 2],) * 2, dim=-1)
        elif structure == "pairs":
            angles = angles[..., : width // 2].repeat_interleave(2, dim=-1)
        if self.complex:  # a scaled rotation, as YaRN's attention_scaling makes freqs_cis
            freqs = torch.polar(torch.full_like(angles, 1.25), angles)
            cos, sin, tables = freqs.real, freqs.imag, (freqs,)
        else:
            cos, sin = angles.cos(), angles.sin()
            tables = (cos, sin)
        with torch.no_grad():
            try:
                expected = self.original(*xs, *tables, **rest)
            except Exception:  # noqa: BLE001 (a function of another form: left as it is)
                expected = None
        if torch.is_tensor(expected):
            expected = (expected,)
        return xs, cos, sin, expected

    def _find_layout(self, key, rest: dict, structure: str) -> tuple | None:
        dims, width, unsqueeze, rank = key
        heads_dims = (1, 2) if self.complex else (unsqueeze,)
        for heads_dim in heads_dims if rank == 4 else ():
            if heads_dim not in (1, 2):
                continue
            xs, cos, sin, expected = self._probe(key, rest, structure, heads_dim)
            if expected is None or len(expected) != len(xs):
                continue
            for layout in LAYOUTS:
                rotary = 2 * width if layout[1] == "all" else width
                if rotary > min(dims) or rotary % 2:
                    continue
                ours = (rotate(t, cos, sin, layout, heads_dim) for t in xs)
                # 1e-5: some families rotate in fp32 (Ernie's q.float(), DeepSeek-V2's
                # xq.float()); a wrong layout is off by O(1).
                if all(_agrees(a, b, 1e-5) for a, b in zip(ours, expected)):
                    return layout, heads_dim
        warnings.warn(
            f"fastlm.hf: RoPE by {self.original.__module__}.{self.original.__qualname__} on "
            f"head dims {'/'.join(map(str, dims))} with tables {width} wide is none of the "
            "layouts fastlm's kernel takes: it runs as the family wrote it",
            stacklevel=4,
        )
        return None


def _structure(cos: torch.Tensor) -> str:
    """How the tables hold their angles: "twice" (Hugging Face's cat(freqs, freqs)), "pairs"
    (Cohere's repeat_interleave(freqs, 2)) or "once" (gpt-oss's)."""
    half = cos.shape[-1] // 2
    if torch.equal(cos[..., :half], cos[..., half : 2 * half]):
        return "twice"
    if torch.equal(cos[..., 0::2], cos[..., 1::2]):
        return "pairs"
    return "once"


def _agrees(ours: torch.Tensor, theirs: object, bound: float) -> bool:
    if not torch.is_tensor(theirs) or ours.shape != theirs.shape:
        return False
    scale = theirs.abs().max().clamp_min(1e-30)
    return bool(((ours - theirs).abs().max() / scale) <= bound)


_ROTARY_FUNCTIONS: dict[types.FunctionType, RotaryFunction] = {}


def rotary_names(forward: types.FunctionType, usable: bool = True) -> list[str]:
    """The `apply_rotary*` functions of its module a forward calls; `usable`: only those taking
    (q, k, cos, sin, ...), (x, cos, sin, ...) or (xq, xk, freqs_cis) (`RotaryFunction`'s
    forms)."""
    names = []
    for name in forward.__code__.co_names:
        function = forward.__globals__.get(name)
        if name.startswith("apply_rotary") and isinstance(function, types.FunctionType):
            if not usable or len(inspect.signature(function).parameters) >= 3:
                names.append(name)
    return names


class _Forwards(dict):
    """attention class -> its forward with fastlm's RoPE, filled when a model is patched, so
    that a compiled forward only looks it up; a class missing (a model unpickled in a fresh
    process) is built on first use."""

    def __missing__(self, cls: type) -> types.FunctionType:
        return rope_attention_forward(cls)


_ROPE_FORWARDS = _Forwards()


def rope_attention_forward(cls: type) -> types.FunctionType | None:
    """cls.forward (transformers' own attention forward of the family) with each
    `apply_rotary*` function it calls bound to a `RotaryFunction` of it, or None when it calls
    none.

    The function is rebuilt from the same code with a copy of its module's globals, so the
    family's attention runs exactly as written (q/k norms, fused projections, soft-capping,
    caches) and no other model or class is touched."""
    if cls in _ROPE_FORWARDS:
        return _ROPE_FORWARDS[cls]
    forward = inspect.unwrap(cls.forward)  # under deprecate_kwarg's wrapper
    names = rotary_names(forward)
    if not names:
        return None
    scope = dict(forward.__globals__)
    # Without __name__, torch.compile guards these globals by this dict itself rather than by
    # the family's module (where the names hold transformers' own functions).
    scope.pop("__name__", None)
    for name in names:
        original = forward.__globals__[name]
        if original not in _ROTARY_FUNCTIONS:
            _ROTARY_FUNCTIONS[original] = RotaryFunction(original)
        scope[name] = _ROTARY_FUNCTIONS[original]
    rebuilt = types.FunctionType(
        forward.__code__, scope, forward.__name__, forward.__defaults__, forward.__closure__
    )
    rebuilt.__kwdefaults__ = forward.__kwdefaults__
    _ROPE_FORWARDS[cls] = rebuilt
    return rebuilt


def attention_forward(self, *args, **kwargs):
    if "past_key_values" in kwargs and "cache" not in kwargs:  # the name before transformers 5.2x
        kwargs["cache"] = kwargs.pop("past_key_values")
    return _ROPE_FORWARDS[type(self)](self, *args, **kwargs)


#: The decoder method of transformers' Gemma 4 models that slices the layers' inputs and masks
#: to the kept logits' queries before the KV-shared layers (`v[:, :, keep, :]` of each mask).
SLICE_KV_SHARED = "_maybe_slice_kv_shared_inputs"


def kv_shared_inputs(self, hidden_states, per_layer_inputs, position_embeddings, masks, *args,
                     **kwargs):  # fmt: skip
    """The decoder's own SLICE_KV_SHARED where every mask is 4-D or None; the inputs whole
    where fastlm's mask function gave a padding mask or packed documents, which are not sliced
    by queries (transformers keeps them whole for flash attention's 2-D masks likewise): the
    kept queries then run with all the others, the result the same."""
    if all(m is None or (torch.is_tensor(m) and m.dim() == 4) for m in masks.values()):
        own = getattr(type(self), SLICE_KV_SHARED)
        return own(self, hidden_states, per_layer_inputs, position_embeddings, masks, *args,
                   **kwargs)  # fmt: skip
    return hidden_states, per_layer_inputs, position_embeddings, masks


# --------------------------------------------------------------------------------------------
# The loss: fused linear cross-entropy on the final hidden states
# --------------------------------------------------------------------------------------------


def number_holder(model: nn.Module, holder: str) -> object:
    """Where a family keeps a number of its logits: "config" (model.config) or "model"."""
    return model.config if holder == "config" else model


def logit_numbers(model: nn.Module, scale_from: tuple | None, cap_from: tuple | None):
    """(scale, cap) of the family's logits, read now from where `fastlm.hf.probe.logit_options`
    found the family reads them: scale_from (holder, name, divides) gives the number at
    `model.config.<name>` (holder "config") or `model.<name>` ("model"), or its inverse where it
    divides; cap_from (holder, name) the soft cap (None or 0: none). None: 1 and no cap."""

    def read(holder, name):
        return getattr(number_holder(model, holder), name)

    scale = 1.0
    if scale_from is not None:
        holder, name, divides = scale_from
        scale = 1.0 / read(holder, name) if divides else float(read(holder, name))
    cap = read(*cap_from) if cap_from is not None else None
    return scale, (float(cap) if cap else None)


def output_logits(hidden: torch.Tensor, head: nn.Module, scale: float, cap: float | None):
    """The family's logits: head(hidden) times its logit scale, soft-capped."""
    logits = head(hidden)
    if scale != 1.0:
        logits = logits * scale
    return logits if not cap else cap * torch.tanh(logits / cap)


def linear_head(head: nn.Module) -> bool:
    """Whether the head computes x W^T + b by nn.Linear's own forward, so that the fused loss may
    read its weight: a LoRA adapter on it (PEFT's lora.Linear) or a quantized linear runs its
    own forward, and the loss takes its logits."""
    return isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward


def causal_lm_forward(self, *args, names: tuple, decoder: str, scale_from: tuple | None,
                      cap_from: tuple | None, moe: bool, **kwargs):  # fmt: skip
    """The ForCausalLM forward with the loss by fused linear cross-entropy (see `patch`): the
    arguments (positional ones by the family forward's parameter `names`, read at patch time:
    binding a signature here would stop torch.compile) go to the decoder (`self.<decoder>`)
    as the family's forward passes them, but the loss's own; the logits are
    `lm_head(hidden) * scale`, soft-capped at `cap`, each read on every call from where
    `fastlm.hf.probe` found the family's forward reads them (`logit_numbers`). A head that is
    not a plain nn.Linear (a LoRA adapter on lm_head) gives its logits, and the loss is
    fastlm's cross-entropy on them. MoE families add the router's auxiliary loss as their
    forward does."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
    from transformers.modeling_utils import slice_logits_to_keep

    call = dict(zip(names, args), **kwargs)
    labels = call.pop("labels", None)
    shift_labels = call.pop("shift_labels", None)
    num_items_in_batch = call.pop("num_items_in_batch", None)
    logits_to_keep = call.pop("logits_to_keep", 0)
    return_dict = call.pop("return_dict", None)
    if "past_key_values" in call and "cache" not in call:
        call["cache"] = call.pop("past_key_values")
    if moe and call.get("output_router_logits") is None:
        call["output_router_logits"] = self.config.output_router_logits
    outputs = getattr(self, decoder)(**call)
    hidden = outputs[0]  # the final norm's output (B, T, C)
    head = self.get_output_embeddings()
    scale, cap = logit_numbers(self, scale_from, cap_from)
    loss = logits = None
    if labels is not None or shift_labels is not None:
        if shift_labels is None:  # position t predicts label t + 1; the last predicts nothing
            shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        shift_labels = shift_labels.to(hidden.device)
        if linear_head(head):
            loss = _fused_loss(hidden, head, shift_labels, scale, cap)
        else:  # the head's own forward (a LoRA adapter's too), its logits into the loss
            logits = output_logits(hidden, head, scale, cap)
            loss = cross_entropy(logits, shift_labels, IGNORE_INDEX)
        if num_items_in_batch is not None:  # transformers' sum / num_items_in_batch
            counted = (shift_labels != IGNORE_INDEX).sum().clamp_min(1)
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss * counted / num_items_in_batch
    if logits is not None:  # the unfused loss's: they exist already
        logits = slice_logits_to_keep(logits, logits_to_keep)
    elif loss is None or not self.training:
        logits = output_logits(slice_logits_to_keep(hidden, logits_to_keep), head, scale, cap)
    rest = {name: value for name, value in outputs.items() if name != "last_hidden_state"}
    if moe:
        aux_loss = None
        if call["output_router_logits"]:
            aux_loss = modeling_module(self).load_balancing_loss_func(
                outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                call.get("attention_mask"),
            )  # fmt: skip
            if loss is not None:
                loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        result = MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits, **rest)
    else:
        result = CausalLMOutputWithPast(loss=loss, logits=logits, **rest)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    return result if return_dict else result.to_tuple()


def _fused_loss(hidden, head: nn.Linear, shift_labels, scale: float, cap: float | None):
    """Mean cross-entropy of `head(hidden) * scale`, capped, by fused linear cross-entropy."""
    scaled = hidden * scale if scale != 1.0 else hidden
    weight = head.weight
    if head.bias is not None:  # [s h, 1] . [W, s b] = s (h . W + b): one more column (Phi)
        scaled = torch.cat((scaled, scaled.new_ones(*scaled.shape[:-1], 1)), dim=-1)
        weight = torch.cat((weight, head.bias.to(weight.dtype)[:, None] * scale), dim=-1)
    # linear_cross_entropy, or its vocabulary-parallel form when transformers' tensor
    # parallelism (tp_plan="auto") left the head a DTensor sharded by vocabulary rows.
    return lm_head_cross_entropy(scaled, weight, shift_labels, IGNORE_INDEX, softcap=cap or 0.0)


# --------------------------------------------------------------------------------------------
# Attaching them
# --------------------------------------------------------------------------------------------

#: The forwards a module can be given, by name (what a pickled PatchedForward stores).
PARTS = {
    "rms_norm": rms_norm_forward,
    "mlp": mlp_forward,
    "packed_mlp": packed_mlp_forward,
    "experts_gate": experts_gate,
    "input_scaled_experts": input_scaled_experts_forward,
    "zero_experts": zero_experts_forward,
    "sorted_experts": sorted_experts_forward,
    "unclamped_experts": unclamped_experts_forward,
    "attention": attention_forward,
    "kv_shared_inputs": kv_shared_inputs,
    "causal_lm": causal_lm_forward,
}


def _restore_registration() -> None:
    """Loading a patched model in a fresh process: fastlm's attention must be registered with
    transformers again, since the model's config names it."""
    from fastlm.hf.attention import register

    register()


class PatchedForward:
    """A module's forward replaced by `PARTS[part]` with keyword `options`; pickles as
    (module, part, options)."""

    __slots__ = ("module", "part", "options")

    def __init__(self, module: nn.Module, part: str, options: dict | None = None):
        self.module, self.part, self.options = module, part, dict(options or {})

    def __call__(self, *args, **kwargs):
        return PARTS[self.part](self.module, *args, **kwargs, **self.options)

    @property
    def __signature__(self) -> inspect.Signature:
        # The module's own forward's: trainers read it (which dataset columns to keep, whether
        # the model takes num_items_in_batch).
        return inspect.signature(type(self.module).forward.__get__(self.module))

    def __reduce__(self):
        return (_load_forward, (self.module, self.part, self.options))

    def __repr__(self) -> str:
        return f"fastlm.hf {self.part} forward of {type(self.module).__name__}"


def _load_forward(module: nn.Module, part: str, options: dict | None = None) -> PatchedForward:
    _restore_registration()
    return PatchedForward(module, part, options)


def bind(modules, part: str, method: str = "forward", **options) -> None:
    """Give each module PARTS[part] (with `options`) as its `method` (its forward by default)."""
    for module in modules:
        setattr(module, method, PatchedForward(module, part, options))


def is_patched_forward(forward: object) -> bool:
    return isinstance(forward, PatchedForward)


class PatchedParts(tuple):
    """`model.fastlm_patched`: the parts that run on fastlm's kernels (a tuple of names, in
    patch order), with `left`: {what was left as it is: why} and `modules`: {part: how many
    modules run it}. Unpickling it registers fastlm's attention with transformers (a model
    patched for attention alone has no other fastlm object)."""

    left: dict[str, str]
    modules: dict[str, int]

    def __new__(cls, parts=(), left=None, modules=None):
        self = super().__new__(cls, parts)
        self.left, self.modules = dict(left or {}), dict(modules or {})
        return self

    def __reduce__(self):
        return (_load_parts, (tuple(self), self.left, self.modules))

    def __repr__(self) -> str:
        return f"PatchedParts({tuple(self)!r}, left={self.left!r}, modules={self.modules!r})"


def _load_parts(parts: tuple, left=None, modules=None) -> PatchedParts:
    _restore_registration()
    return PatchedParts(parts, left, modules)
