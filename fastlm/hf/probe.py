"""What a module computes, found by running it: the exactness checks `patch` makes before it
gives a module a forward on fastlm's kernels.

Names are only a first guess (a leaf module with one 1-D `weight` may be a norm; a module with an
activation and two or three linear layers may be a gated MLP). Each guess is then checked: the
module's own forward and fastlm's formula for it run on the same random input with the same
random parameters, in float64 where the module allows it (so that only a different formula, not
rounding, can tell them apart), and the guess stands only where they agree. A module that agrees
with no formula is left as it is, with the reason.
"""

from __future__ import annotations

import inspect
import itertools

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fastlm.hf.families import config_value
from fastlm.hf.forwards import activation_of
from fastlm.kernels.geglu import geglu_ref
from fastlm.kernels.rmsnorm import rms_norm_ref
from fastlm.kernels.swiglu import swiglu_packed_ref, swiglu_ref

#: The attribute names an RMSNorm keeps its epsilon under.
EPS_NAMES = ("variance_epsilon", "eps", "epsilon")
#: The relative error a probe tolerates: float64 against float64 (norms: the module's own fp32
#: cast inside, 1e-7, against the next-closest formula's, above 1e-3).
EXACT, FP32_EXACT = 1e-10, 1e-5


def _relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    theirs = theirs.to(ours.dtype)
    return float((ours - theirs).norm() / theirs.norm().clamp_min(1e-30))


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


# --------------------------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------------------------


def norm_candidate(module: nn.Module) -> bool:
    """A leaf module whose only parameter is a 1-D `weight`, or one with no parameter and an
    epsilon (a norm without a scale: Gemma 4's value and router norms, Llama 4's L2 norm)."""
    params = dict(module.named_parameters())
    if any(True for _ in module.children()):
        return False
    if not params:
        return _eps_name(module) is not None
    return list(params) == ["weight"] and params["weight"].dim() == 1


def _eps_name(module: nn.Module) -> str | None:
    return next((n for n in EPS_NAMES if isinstance(getattr(module, n, None), float)), None)


def rms_norm_options(module: nn.Module) -> dict | str:
    """{eps_name, offset, promoted} for `forwards.rms_norm_forward` if the module computes
    x / sqrt(mean(x^2) + eps) * (weight + offset) with offset 0 or 1 (Gemma's), else why not;
    a module without a weight must compute x / sqrt(mean(x^2) + eps) (offset 0, weight 1).

    Checked on fp32 inputs at two scales (one where eps decides the result) with a random fp32
    weight, against the formula in float64; then on a half-precision input beside a weight of
    another dtype, for the output dtype (x's, or the promotion of x's and the weight's)."""
    eps_name = _eps_name(module)
    if eps_name is None:
        return "no epsilon attribute (" + ", ".join(EPS_NAMES) + ")"
    inputs = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]  # fmt: skip
    if len(inputs) > 1:  # Bamba's gate=None: a norm on one tensor, gated when given two
        return "its forward takes more than one tensor (a gated norm)"
    eps = getattr(module, eps_name)
    scaled = getattr(module, "weight", None) is not None
    buffer = next(module.buffers(), None)
    size = module.weight.shape[0] if scaled else 24  # without a weight: any width
    generator = _generator()
    weight = torch.randn(size, generator=generator) * 0.5 + 0.3 if scaled else torch.ones(size)
    x = torch.randn(2, 3, size, generator=generator)
    device = module.weight.device if scaled else getattr(buffer, "device", torch.device("cpu"))
    if device.type == "meta":
        return "its weight is on the meta device"

    def call(weight, t):  # the module's own forward with `weight` as its weight, if it has one
        return functional_call(module, {"weight": weight} if scaled else {}, (t,))

    inputs = [x, x * (eps**0.5 * 0.7)]  # the second one's mean square is about eps / 2
    try:
        with torch.no_grad():
            outputs = [call(weight.to(device), t.to(device)).cpu() for t in inputs]
    except TypeError:
        return "its forward takes more than one tensor (a gated norm)"
    except Exception as error:  # noqa: BLE001 (another forward's form: left, with why)
        return f"its forward failed on one tensor ({type(error).__name__})"
    offset = None
    for candidate in (0.0, 1.0) if scaled else (0.0,):
        expected = [
            rms_norm_ref(t.double(), weight.double(), eps, offset=candidate) for t in inputs
        ]
        if all(
            out.shape == ref.shape and _relative(ref, out) <= FP32_EXACT
            for out, ref in zip(outputs, expected)
        ):
            offset = candidate
            break
    if offset is None:
        return "not RMSNorm's math (x / rms(x) * weight, or * (1 + weight))"
    half = torch.bfloat16
    other = torch.float32 if scaled and module.weight.dtype != torch.float32 else half
    x_dtype = half if other == torch.float32 or not scaled else torch.float32
    with torch.no_grad():
        out = call(weight.to(device, other), x.to(device, x_dtype))
    promoted = torch.promote_types(x_dtype, other)
    if out.dtype not in (x_dtype, promoted):
        return f"its output dtype is {out.dtype} for {x_dtype} input and a {other} weight"
    return dict(eps_name=eps_name, offset=offset, promoted=out.dtype != x_dtype)


# --------------------------------------------------------------------------------------------
# Gated MLPs and experts
# --------------------------------------------------------------------------------------------


def _reference_gated(gate: torch.Tensor, up: torch.Tensor, activation: str, **options):
    """act(gate) * up, with `swiglu`'s clamp options for SiLU."""
    if activation == "silu":
        return swiglu_ref(gate, up, **options)
    return geglu_ref(gate, up, activation)


#: The input scales every gated candidate is checked at. The formulas are exact at both; a bound
#: the module applies (gpt-oss's clamp at 7, DeepSeek-V4's at 10) shows at the second, so a clamp
#: fastlm does not know is never taken for a plain SwiGLU.
PROBE_SCALES = (1.0, 1e3)
#: Where gated modules keep their clamped SwiGLU's numbers (gpt-oss: alpha 1.702, limit 7).
LIMIT_NAMES, ALPHA_NAMES = ("limit", "swiglu_limit"), ("alpha", "swiglu_alpha")


def _numbers(module: nn.Module, names: tuple[str, ...]) -> list[float]:
    """The real numbers the module holds under `names`, in order, without repeats."""
    values = [getattr(module, n, None) for n in names]
    numbers = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return list(dict.fromkeys(numbers))


def _clamp_options(module: nn.Module) -> list[dict]:
    """`swiglu`'s clamp options a module that holds a limit may use (gpt-oss's alpha and offset
    of up, or SiLU's alpha 1 and none), after none."""
    options = [{}]
    for limit, alpha, up_offset in itertools.product(
        _numbers(module, LIMIT_NAMES), [*_numbers(module, ALPHA_NAMES), 1.0], (1.0, 0.0)
    ):
        options.append(dict(alpha=alpha, limit=limit, up_offset=up_offset))
    return options


def _activation(module: nn.Module) -> tuple[str | None, str | None]:
    """(activation kind, attribute name) of the module's activation child or attribute."""
    for name in ("act_fn", "activation_fn", "act", "activation"):
        act = getattr(module, name, None)
        if act is not None and callable(act):
            return activation_of(act), name
    return None, None


#: Words in the class names of MLPs (which may call F.silu themselves, as LFM2's does).
MLP_NAMES = ("MLP", "Mlp", "FeedForward", "FFN")


def mlp_candidate(module: nn.Module) -> bool:
    """Two or three direct nn.Linear children and an activation (or an MLP's class name):
    maybe a gated MLP."""
    linears = [c for c in module.children() if isinstance(c, nn.Linear)]
    named = any(word in type(module).__name__ for word in MLP_NAMES)
    return 2 <= len(linears) <= 3 and (_activation(module)[1] is not None or named)


def _float64_call(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    params = {name: p.detach().double() for name, p in module.named_parameters()}
    with torch.no_grad():
        return functional_call(module, params, (x,))


def mlp_options(module: nn.Module) -> tuple[str, dict] | str:
    """("mlp", {gate, up, down, activation}) or ("packed_mlp", {gate_up, down, activation,
    gate_first}) for `forwards`' gated MLP forwards if the module computes
    down(act(gate(x)) * up(x)) with SiLU or a GELU (exact or tanh) by its linear children (SiLU
    clamped as DeepSeek-V4's: `_clamp_options`, added to the options), else why not. Every
    assignment of the children to the roles that the shapes allow is run in float64 against the
    module's own forward (random input at each of PROBE_SCALES, its own weights)."""
    activation, act = _activation(module)
    if activation is None and act is not None:
        return f"{type(getattr(module, act)).__name__} activation"
    # No activation module (the forward calls F.silu or F.gelu itself): each one fastlm has.
    activations = [activation] if activation else ["silu", "tanh", "none"]
    linears = {n: c for n, c in module.named_children() if isinstance(c, nn.Linear)}
    if any(p.device.type == "meta" for p in module.parameters()):
        return "its weights are on the meta device"
    first = next(iter(linears.values()))
    x = torch.randn(2, 3, first.in_features, generator=_generator(), dtype=torch.float64)
    inputs = [scale * x.to(first.weight.device) for scale in PROBE_SCALES]
    try:
        expected = [_float64_call(module, t) for t in inputs]
    except Exception as error:  # noqa: BLE001
        return f"its forward failed on one tensor ({type(error).__name__})"
    weights = {n: (c.weight.detach().double(), _bias(c)) for n, c in linears.items()}
    apply = lambda name, t: F.linear(t, *weights[name])  # noqa: E731
    candidates = []
    names = list(linears)
    if len(names) == 3:
        for down in names:
            gate, up = (n for n in names if n != down)
            candidates += [("mlp", dict(gate=gate, up=up, down=down)),
                           ("mlp", dict(gate=up, up=gate, down=down))]  # fmt: skip
    else:
        for down in names:
            (gate_up,) = (n for n in names if n != down)
            for gate_first in (True, False):
                candidates.append(("packed_mlp", dict(gate_up=gate_up, down=down,
                                                      gate_first=gate_first)))  # fmt: skip

    def run(kind, roles, activation, options, t):
        if kind == "mlp":
            pair = apply(roles["gate"], t), apply(roles["up"], t)
        else:
            first_half, second = apply(roles["gate_up"], t).chunk(2, dim=-1)
            pair = (first_half, second) if roles["gate_first"] else (second, first_half)
        return apply(roles["down"], _reference_gated(*pair, activation, **options))

    clamps = _clamp_options(module)
    for (kind, roles), activation in itertools.product(candidates, activations):
        for options in clamps if activation == "silu" else [{}]:
            try:
                with torch.no_grad():
                    ours = [run(kind, roles, activation, options, t) for t in inputs]
            except RuntimeError:  # shapes that do not chain
                break
            if all(a.shape == b.shape and _relative(a, b) <= EXACT for a, b in zip(ours, expected)):
                return kind, dict(roles, activation=activation, **options)
    return "not down(act(gate(x)) * up(x)) of its linear layers (or clamped where fastlm cannot)"


def _bias(linear: nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach().double()


def _gate_candidates(module: nn.Module) -> list[dict]:
    """The gates an experts' `_apply_gate` may compute, as `forwards.experts_gate` options:
    act(first half) * second half for the module's activation, then (for experts that hold a
    limit) gpt-oss's clamped SwiGLU in both layouts, with and without the offset of up."""
    activation, _ = _activation(module)
    candidates = [] if activation is None else [dict(activation=activation, interleaved=False)]
    for options, interleaved in itertools.product(_clamp_options(module)[1:], (True, False)):
        candidates.append(dict(activation="silu", interleaved=interleaved, **options))
    return candidates


def _reference_gate(gate_up: torch.Tensor, activation: str, interleaved: bool, **options):
    if activation == "silu":
        return swiglu_packed_ref(gate_up, interleaved, **options)
    return _reference_gated(*gate_up.chunk(2, dim=-1), activation)


def experts_gate_options(module: nn.Module) -> dict | str:
    """Options for `forwards.experts_gate` if the experts' `_apply_gate` (transformers' experts
    call it on the (S, 2 I) gate/up projections, between their two GEMMs) is one of
    `_gate_candidates`, else why not. Each runs in float64 against the module's own, on values
    up to twice its limit (so that the clamp's side of each projection is told apart) and at
    PROBE_SCALES beyond that."""
    candidates = _gate_candidates(module)
    if not candidates:
        return "their activation is none fastlm has (SiLU, GELU), and they hold no clamp limit"
    scale = 2 * max([1.0, *_numbers(module, LIMIT_NAMES)])
    gate_up = scale * torch.randn(7, 2 * 5, generator=_generator(), dtype=torch.float64)
    inputs = [s * gate_up for s in PROBE_SCALES]
    try:
        with torch.no_grad():
            expected = [type(module)._apply_gate(module, t) for t in inputs]
    except Exception as error:  # noqa: BLE001
        return f"their gate failed on one tensor ({type(error).__name__})"
    for options in candidates:
        ours = [_reference_gate(t, **options) for t in inputs]
        if all(
            torch.is_tensor(b) and a.shape == b.shape and _relative(a, b) <= EXACT
            for a, b in zip(ours, expected)
        ):
            return options
    return "their gate is neither act(gate) * up nor gpt-oss's clamped SwiGLU of the projection"


# --------------------------------------------------------------------------------------------
# The logits
# --------------------------------------------------------------------------------------------


class _Decoder(nn.Module):
    """Stands in for the decoder while the logits are probed: returns fixed hidden states."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs):
        from transformers.modeling_outputs import MoeModelOutputWithPast

        class Output(MoeModelOutputWithPast):
            def __getattr__(self, name):  # a family's own output field (Gemma 4's cache)
                if name.startswith("__"):
                    raise AttributeError(name)
                return None

        return Output(last_hidden_state=self.hidden)


#: Config fields that multiply the logits, and those that divide them.
LOGIT_MULTIPLIERS = ("logit_scale", "logits_scale", "output_multiplier")
LOGIT_DIVISORS = ("logits_scaling",)


def logit_options(model: nn.Module, decoder: str) -> dict | str:
    """{scale, cap} for `forwards.causal_lm_forward` if the family's forward computes its
    logits as lm_head(hidden) * scale, soft-capped at cap (`final_logit_softcapping`), from
    `model.<decoder>`'s output, else why not. The scale is 1, a multiplier or the inverse of a
    divisor from the config; the forward runs in float64 on random hidden states with a stand-in
    for the decoder, which is put back."""
    config = model.config
    head = model.get_output_embeddings()
    scales = [1.0] + [float(getattr(config, n)) for n in LOGIT_MULTIPLIERS if _number(config, n)]
    scales += [1.0 / float(getattr(config, n)) for n in LOGIT_DIVISORS if _number(config, n)]
    caps = [None] + ([float(config.final_logit_softcapping)]
                     if _number(config, "final_logit_softcapping") else [])  # fmt: skip
    device = head.weight.device
    hidden = torch.randn(1, 5, head.weight.shape[1], generator=_generator(), dtype=torch.float64)
    hidden = hidden.to(device) * 2
    weight = head.weight.detach().double()
    head_name = _head_name(model)
    real = getattr(model, decoder)
    setattr(model, decoder, _Decoder(hidden))
    try:
        ids = torch.zeros(1, 5, dtype=torch.long, device=device)
        arguments = dict(input_ids=ids, use_cache=False)
        if "output_router_logits" in inspect.signature(type(model).forward).parameters:
            arguments["output_router_logits"] = False
        with torch.no_grad():
            params = {head_name: weight}
            if head.bias is not None:
                params[head_name.replace(".weight", ".bias")] = head.bias.detach().double()
            logits = functional_call(model, params, (), arguments).logits
    except Exception as error:  # noqa: BLE001
        return f"its forward could not be run on stand-in hidden states ({type(error).__name__})"
    finally:
        setattr(model, decoder, real)
    # A head under transformers' tensor parallelism is a DTensor: the formula takes it whole
    # (a collective: every rank patches, so every rank gathers).
    dense = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
    plain = hidden @ dense.T
    if head.bias is not None:
        plain = plain + head.bias.detach().double()
    for scale in scales:
        for cap in caps:
            ours = plain * scale
            ours = ours if cap is None else cap * torch.tanh(ours / cap)
            if torch.is_tensor(logits) and logits.shape == ours.shape:
                if _relative(ours, logits) <= EXACT:
                    return dict(scale=scale, cap=cap)
    return "its logits are not lm_head(hidden) times a config scale, soft-capped"


def _number(config, name: str) -> bool:
    value = config_value(config, name)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value not in (0,)


def _head_name(model: nn.Module) -> str:
    head = model.get_output_embeddings()
    name = next(n for n, m in model.named_modules() if m is head)
    return f"{name}.weight"
