"""What a module computes, found by running it: the exactness checks `patch` makes before it
gives a module a forward on fastlm's kernels.

Names are only a first guess (a leaf module with one 1-D `weight` may be a norm; a module with an
activation and two or three linear layers may be a gated MLP). Each guess is then checked: the
module's own forward and fastlm's formula for it run on the same random input with the same
random parameters, in float64 where the module allows it (so that only a different formula, not
rounding, can tell them apart), and the guess stands only where they agree. So that no value the
module happens to hold at patch time decides (an output scale still at its initial 1, a
projection initialised to zero, dropout off in eval mode):
- every parameter is replaced by a random one for the check (`random_parameters`), never the
  module's own values, which also lets a module on the meta device be checked on the CPU;
- the module runs in training mode and in eval mode (`in_both_modes`): dropout, or anything else
  its training mode does differently, is part of what it computes;
- the forward fastlm would give it must read every parameter and buffer the module has: one it
  would not read (a trainable scale beside the projections) leaves the module as it is.
A module that agrees with no formula is left as it is, with the reason.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fastlm.hf.experts import EXPERTS_ACTIVATIONS
from fastlm.hf.families import config_value
from fastlm.hf.forwards import (
    activation_of,
    input_scaled_experts_forward,
    number_holder,
    sorted_experts_forward,
    zero_experts_forward,
)
from fastlm.kernels.geglu import geglu_ref
from fastlm.kernels.moe.experts import moe_experts_ref, relu2_ref
from fastlm.kernels.rmsnorm import rms_norm_ref
from fastlm.kernels.swiglu import swiglu_packed_ref, swiglu_ref

#: The attribute names an RMSNorm keeps its epsilon under.
EPS_NAMES = ("variance_epsilon", "eps", "epsilon")
#: The relative error a probe tolerates: float64 against float64 (norms and experts' gates: the
#: module's own fp32 cast inside, 1e-7 (Beam's gate upcasts its halves), against the
#: next-closest formula's, above 1e-4: GELU's tanh form against the exact one).
EXACT, FP32_EXACT = 1e-10, 1e-5


def _relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    theirs = theirs.to(ours.dtype)
    return float((ours - theirs).norm() / theirs.norm().clamp_min(1e-30))


def _generator(device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device).manual_seed(0)


def probe_device(module: nn.Module) -> torch.device:
    """Where a module's check runs: its parameters' device, or the CPU for a module on the meta
    device (how large models are built before their weights are loaded) or without parameters."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    return torch.device("cpu") if device.type == "meta" else device


def random_parameters(module: nn.Module, device: torch.device, prefix: str = "") -> dict:
    """{name: random float64 values of the parameter's shape} for every parameter of `module`
    (names prefixed by `prefix`), on `device`: matrices N(0, 1 / fan-in), so that activations
    keep their scale; vectors (norm gains, biases, scales) N(0.3, 0.5), never all 0 or all 1. A
    tensor-parallel parameter (a DTensor) gets a DTensor of the same placements (a collective:
    every rank patches, so every rank takes part)."""
    generator = _generator(device)
    values = {}
    for name, p in module.named_parameters():
        random = torch.randn(p.shape, generator=generator, dtype=torch.float64, device=device)
        random = random / p.shape[-1] ** 0.5 if p.dim() >= 2 else random * 0.5 + 0.3
        if hasattr(p, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor

            random = distribute_tensor(random, p.device_mesh, p.placements)
        values[prefix + name] = random
    return values


def unread_state(module: nn.Module, read: tuple[str, ...]) -> list[str]:
    """The module's parameters and buffers outside its children named in `read`: what a forward
    that reads only those children would not read."""
    state = itertools.chain(module.named_parameters(), module.named_buffers())
    return [name for name, _ in state if name.split(".")[0] not in read]


@contextlib.contextmanager
def _fixed_randomness(device: torch.device):
    """The global random state as it was afterwards (a check's dropout draws nothing the user's
    run would see)."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield


def seeded(device: torch.device) -> None:
    """The same random draws for each of two calls that should compute the same thing (the
    dropout of a LoRA head in training mode)."""
    torch.default_generator.manual_seed(0)  # not torch.manual_seed: it seeds every GPU
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(0)


def in_both_modes(module: nn.Module, device: torch.device, call) -> list:
    """[call() in training mode, call() in eval mode] of the module and all its children, their
    modes restored and the global random state untouched: what a module computes includes what
    it does in training (dropout), whichever mode it is in when it is patched."""
    modes = [(m, m.training) for m in module.modules()]
    try:
        with _fixed_randomness(device):
            outputs = []
            for training in (True, False):
                module.train(training)
                outputs.append(call())
            return outputs
    finally:
        for m, training in modes:
            m.training = training


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
    weight, in training and eval mode, against the formula in float64; then on a half-precision
    input beside a weight of another dtype, for the output dtype (x's, or the promotion of x's
    and the weight's). A module holding buffers is left (the forward would not read them)."""
    eps_name = _eps_name(module)
    if eps_name is None:
        return "no epsilon attribute (" + ", ".join(EPS_NAMES) + ")"
    inputs = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]  # fmt: skip
    if len(inputs) > 1:  # Bamba's gate=None: a norm on one tensor, gated when given two
        return "its forward takes more than one tensor (a gated norm)"
    buffers = [name for name, _ in module.named_buffers()]
    if buffers:
        return f"buffers {', '.join(buffers)} besides its weight: not RMSNorm's one weight"
    eps = getattr(module, eps_name)
    scaled = getattr(module, "weight", None) is not None
    size = module.weight.shape[0] if scaled else 24  # without a weight: any width
    device = probe_device(module)
    generator = _generator()
    weight = torch.randn(size, generator=generator) * 0.5 + 0.3 if scaled else torch.ones(size)
    weight = weight.to(device)
    x = torch.randn(2, 3, size, generator=generator).to(device)

    def call(weight, t):  # the module's own forward with `weight` as its weight, if it has one
        return functional_call(module, {"weight": weight} if scaled else {}, (t,))

    inputs = [x, x * (eps**0.5 * 0.7)]  # the second one's mean square is about eps / 2

    def outputs():
        return [call(weight, t).cpu() for t in inputs]

    try:
        with torch.no_grad():
            modes = in_both_modes(module, device, outputs)
    except TypeError:
        return "its forward takes more than one tensor (a gated norm)"
    except Exception as error:  # noqa: BLE001 (another forward's form: left, with why)
        return f"its forward failed on one tensor ({type(error).__name__})"
    weight, inputs = weight.cpu(), [t.cpu() for t in inputs]
    offset = None
    for candidate in (0.0, 1.0) if scaled else (0.0,):
        expected = [
            rms_norm_ref(t.double(), weight.double(), eps, offset=candidate) for t in inputs
        ]
        if all(
            out.shape == ref.shape and _relative(ref, out) <= FP32_EXACT
            for outs in modes
            for out, ref in zip(outs, expected)
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
#: The numbers a gate probe puts in those places, one each: limits (the first one above every
#: real limit's order, so that the probe's inputs still reach it) and alphas.
PROBE_LIMITS, PROBE_ALPHAS = (7.3, 9.1), (1.3, 2.1)


def _number_names(module: nn.Module, names: tuple[str, ...]) -> list[str]:
    """The names among `names` under which the module holds a real number."""
    values = {n: getattr(module, n, None) for n in names}
    return [n for n, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _clamp_numbers(module: nn.Module) -> dict:
    """{name: the number a probe puts there} for each limit and alpha the module holds."""
    limits = dict(zip(_number_names(module, LIMIT_NAMES), PROBE_LIMITS))
    return {**limits, **dict(zip(_number_names(module, ALPHA_NAMES), PROBE_ALPHAS))}


@contextlib.contextmanager
def _attributes_put(module: nn.Module, values: dict):
    """The module with `values` ({attribute: value}) in place, its own put back after."""
    kept = {name: getattr(module, name) for name in values}
    try:
        for name, value in values.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in kept.items():
            setattr(module, name, value)


def _clamp_options(module: nn.Module) -> list[tuple[dict, dict]]:
    """(options for `forwards.clamp_options`, `swiglu`'s clamp options with `_clamp_numbers`'
    values) for each clamp a module that holds a limit may use (gpt-oss's alpha and offset of
    up, or SiLU's alpha 1 and none), after none. The probe runs the module with
    `_clamp_numbers` in place, so which attribute its forward reads shows (the patched forward
    reads the same one on every call: a limit changed after `patch` is used)."""
    numbers = _clamp_numbers(module)
    limits = _number_names(module, LIMIT_NAMES)
    options = [({}, {})]
    for limit, alpha, up_offset in itertools.product(
        limits, [*_number_names(module, ALPHA_NAMES), None], (1.0, 0.0)
    ):
        names = dict(limit_name=limit, alpha_name=alpha, up_offset=up_offset)
        values = dict(limit=numbers[limit], alpha=numbers.get(alpha, 1.0), up_offset=up_offset)
        options.append((names, values))
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


def mlp_options(module: nn.Module) -> tuple[str, dict] | str:
    """("mlp", {gate, up, down, activation}) or ("packed_mlp", {gate_up, down, activation,
    gate_first}) for `forwards`' gated MLP forwards if the module computes
    down(act(gate(x)) * up(x)) with SiLU or a GELU (exact or tanh) by its linear children (SiLU
    clamped as DeepSeek-V4's: `_clamp_options`, added to the options), else why not. Every
    assignment of the children to the roles that the shapes allow is run in float64 against the
    module's own forward, with random parameters (`random_parameters`), on random input at each
    of PROBE_SCALES, in training and eval mode; a parameter or buffer outside its linear
    children (which the forward would not read) leaves it."""
    activation, act = _activation(module)
    if activation is None and act is not None:
        return f"{type(getattr(module, act)).__name__} activation"
    # No activation module (the forward calls F.silu or F.gelu itself): each one fastlm has.
    activations = [activation] if activation else ["silu", "tanh", "none"]
    linears = {n: c for n, c in module.named_children() if isinstance(c, nn.Linear)}
    unread = unread_state(module, tuple(linears))
    if unread:
        return f"{', '.join(unread)} besides its linear layers (a gated MLP's forward reads none)"
    device = probe_device(module)
    params = random_parameters(module, device)
    first = next(iter(linears.values()))
    x = torch.randn(2, 3, first.in_features, generator=_generator(), dtype=torch.float64)
    inputs = [scale * x.to(device) for scale in PROBE_SCALES]

    def outputs():
        return [functional_call(module, params, (t,)) for t in inputs]

    try:
        with torch.no_grad(), _attributes_put(module, _clamp_numbers(module)):
            modes = in_both_modes(module, device, outputs)
    except Exception as error:  # noqa: BLE001
        return f"its forward failed on one tensor ({type(error).__name__})"

    def apply(name, t):
        return F.linear(t, params[f"{name}.weight"], params.get(f"{name}.bias"))

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
        for names, values in clamps if activation == "silu" else [({}, {})]:
            try:
                with torch.no_grad():
                    ours = [run(kind, roles, activation, values, t) for t in inputs]
            except RuntimeError:  # shapes that do not chain
                break
            if all(_agree(ours, expected) for expected in modes):
                return kind, dict(roles, activation=activation, **names)
    return "not down(act(gate(x)) * up(x)) of its linear layers (or clamped where fastlm cannot)"


def _agree(ours: list, theirs: list, bound: float = EXACT) -> bool:
    """Each of `ours` equal to its counterpart in `theirs` within `bound` (relative)."""
    return all(
        torch.is_tensor(b)
        and (a.shape, a.device) == (b.shape, b.device)
        and _relative(a, b) <= bound
        for a, b in zip(ours, theirs)
    )


#: The gated activations fastlm has, as `fastlm.hf.forwards.activation_of` names them.
GATE_ACTIVATIONS = ("silu", "tanh", "none")


def _gate_candidates(module: nn.Module) -> list[tuple[dict, dict]]:
    """The gates an experts' `_apply_gate` may compute, as (`forwards.experts_gate` options, the
    reference's clamp values: `_clamp_options`): act(first half) * second half for the module's
    activation (each of GATE_ACTIVATIONS for a callable whose type names none), then (for
    experts that hold a limit) gpt-oss's clamped SwiGLU in both layouts, with and without the
    offset of up."""
    activation, name = _activation(module)
    # An activation whose type names none of them (LFM2-MoE's `act_fn` is the function F.silu):
    # each one fastlm has, the module's own gate telling which.
    kinds = [activation] if activation is not None else list(GATE_ACTIVATIONS) if name else []
    candidates = [(dict(activation=kind, interleaved=False), {}) for kind in kinds]
    for (names, values), interleaved in itertools.product(
        _clamp_options(module)[1:], (True, False)
    ):
        candidates.append((dict(activation="silu", interleaved=interleaved, **names), values))
    return candidates


def _reference_gate(gate_up: torch.Tensor, activation: str, interleaved: bool, **options):
    if activation == "silu":
        return swiglu_packed_ref(gate_up, interleaved, **options)
    return _reference_gated(*gate_up.chunk(2, dim=-1), activation)


class _Gate(nn.Module):
    """An experts module's `_apply_gate` as a forward, so that `functional_call` can run it with
    the experts' parameters replaced."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return type(self.experts)._apply_gate(self.experts, gate_up)


def experts_gate_options(module: nn.Module) -> dict | str:
    """Options for `forwards.experts_gate` if the experts' `_apply_gate` (transformers' experts
    call it on the (S, 2 I) gate/up projections, between their two GEMMs) is one of
    `_gate_candidates`, else why not. Each runs in float64 against the module's own, in training
    and eval mode, on values up to twice its limit (so that the clamp's side of each projection
    is told apart) and at PROBE_SCALES beyond that, within FP32_EXACT (a gate computed in fp32
    inside is the op's math, which computes it in fp32). The module's own gate runs with its
    parameters and buffers on the meta device: one it reads (which fastlm's gate would not)
    fails it, and it is left."""
    candidates = _gate_candidates(module)
    if not candidates:
        return "their activation is none fastlm has (SiLU, GELU), and they hold no clamp limit"
    numbers = _clamp_numbers(module)
    scale = 2 * max([1.0, *(numbers[n] for n in _number_names(module, LIMIT_NAMES))])
    gate_up = scale * torch.randn(7, 2 * 5, generator=_generator(), dtype=torch.float64)
    inputs = [s * gate_up for s in PROBE_SCALES]
    gate = _Gate(module)
    state = itertools.chain(gate.named_parameters(), gate.named_buffers())
    absent = {name: torch.empty_like(t, device="meta") for name, t in state}

    def outputs():
        return [functional_call(gate, absent, (t,)) for t in inputs]

    try:
        with torch.no_grad(), _attributes_put(module, numbers):
            modes = in_both_modes(module, torch.device("cpu"), outputs)
    except Exception as error:  # noqa: BLE001
        why = type(error).__name__
        return f"their gate failed on one tensor, given none of their weights ({why})"
    for options, values in candidates:
        gate_options = {k: options[k] for k in ("activation", "interleaved")}
        ours = [_reference_gate(t, **gate_options, **values) for t in inputs]
        if all(_agree(ours, expected, FP32_EXACT) for expected in modes):
            return options
    return "their gate is neither act(gate) * up nor gpt-oss's clamped SwiGLU of the projection"


def peft_wrapped_experts(module: nn.Module) -> bool:
    """An MoE block (a `router` and a `top_k`) whose `experts` PEFT wrapped to adapt their
    stacked weights (`target_parameters`): the adapted weights exist only inside the wrapper's
    forward, which only the block's own forward calls."""
    experts = getattr(module, "experts", None)
    return (
        hasattr(experts, "base_layer")
        and hasattr(module, "router")
        and isinstance(getattr(module, "top_k", None), int)
    )


#: The op's non-gated activations by formula (`fastlm.moe_experts`'s UNGATED).
UNGATED_REFERENCES = {"relu2": relu2_ref}


def ungated_experts_candidate(module: nn.Module) -> bool:
    """transformers' non-gated experts: its experts interface's `has_gate` False (act(up)
    between the two GEMMs: Nemotron-H's)."""
    return getattr(module, "has_gate", None) is False and hasattr(type(module), "_apply_gate")


def ungated_experts_options(module: nn.Module) -> dict | str:
    """{"activation": name} if non-gated experts' `act_fn` (what transformers' experts
    implementations call between the GEMMs when there is no gate) is one of
    UNGATED_REFERENCES, else why not: run in float64 in training and eval mode at PROBE_SCALES
    on values of both signs, against each formula."""
    act = getattr(module, "act_fn", None)
    if not callable(act):
        return "they have no act_fn"
    up = torch.randn(7, 10, generator=_generator(), dtype=torch.float64)
    inputs = [s * up for s in PROBE_SCALES]
    try:
        with torch.no_grad():
            modes = in_both_modes(module, torch.device("cpu"), lambda: [act(t) for t in inputs])
    except Exception as error:  # noqa: BLE001
        return f"their activation failed on one tensor ({type(error).__name__})"
    for name, formula in UNGATED_REFERENCES.items():
        if all(_agree([formula(t) for t in inputs], expected) for expected in modes):
            return dict(activation=name)
    return f"their activation ({type(act).__name__}) is none fastlm has without a gate (ReLU²)"


def input_scaled_experts_candidate(module: nn.Module) -> bool:
    """A `router` child, an `experts` child with stacked 3-D `gate_up_proj` and `down_proj` that
    does not dispatch through transformers' experts interface (which gives its classes an
    `_apply_gate`), and a `top_k`: maybe an MoE block that scales each token's input by its
    router score (Llama 4's)."""
    experts = getattr(module, "experts", None)
    stacked = isinstance(experts, nn.Module) and all(
        isinstance(getattr(experts, n, None), torch.Tensor) and getattr(experts, n).dim() == 3
        for n in ("gate_up_proj", "down_proj")
    )
    return (
        stacked
        and not hasattr(type(experts), "_apply_gate")
        and isinstance(getattr(module, "router", None), nn.Linear)
        and isinstance(getattr(module, "top_k", None), int)
    )


class _InputScaled(nn.Module):
    """`forwards.input_scaled_experts_forward` on the reference experts as a forward, so that
    `functional_call` can run it with the block's parameters replaced."""

    def __init__(self, block: nn.Module, **options):
        super().__init__()
        self.block, self.options = block, options

    def forward(self, x: torch.Tensor):
        options = dict(self.options, experts_op=moe_experts_ref)
        return input_scaled_experts_forward(self.block, x, **options)


def input_scaled_experts_options(module: nn.Module) -> dict | str:
    """Options for `forwards.input_scaled_experts_forward` (the experts' layout, activation and
    the shared expert's child name) if the block computes it, else why not: both run in float64
    on random parameters, in training and eval mode, their outputs and router logits compared."""
    experts = module.experts
    activation = EXPERTS_ACTIVATIONS.get(_activation(experts)[0])
    if activation is None:
        return "their experts' activation is none fastlm has (SiLU, GELU)"
    others = [n for n, _ in module.named_children() if n not in ("router", "experts")]
    unread = [n for n, _ in itertools.chain(experts.named_parameters(), experts.named_buffers())]
    unread = [n for n in unread if n not in ("gate_up_proj", "down_proj")]
    if len(others) > 1 or unread or unread_state(module, ("router", "experts", *others)):
        return "it holds more than a router, stacked gate/up and down experts and a shared expert"
    device = probe_device(module)
    values = random_parameters(module, device)
    hidden = module.router.in_features
    x = torch.randn(7, hidden, generator=_generator(device), dtype=torch.float64, device=device)
    with torch.no_grad():
        theirs = in_both_modes(module, device, lambda: functional_call(module, values, (x,)))
        values = {f"block.{name}": value for name, value in values.items()}
        shared = next(iter(others), None)
        for transposed in (True, False):
            options = dict(transposed=transposed, activation=activation, shared=shared)
            try:
                ours = functional_call(_InputScaled(module, **options), values, (x,))
            except RuntimeError:  # the other layout's shapes do not chain
                continue
            if all(isinstance(t, tuple) and _agree(list(ours), list(t)) for t in theirs):
                return options
    return "it is not sum_j down_e(act(gate_up_e(score_j x))) over the router's choice"


def experts_module(module: nn.Module) -> bool:
    """Whether a module holds a mixture's experts, whatever their form: transformers' experts
    interface (its classes have an `_apply_gate`), a module of the model's own classes that
    holds a stacked parameter (3 or more dims) and whose class name says so ("expert", "moe"),
    or an `experts` list of modules. `patch` names in `left` every one it does not run on
    `fastlm.moe_experts`."""
    if hasattr(type(module), "_apply_gate"):
        return True
    if type(module).__module__.startswith("torch."):
        return False
    if isinstance(getattr(module, "experts", None), nn.ModuleList):
        return True
    name = type(module).__name__.lower()
    stacked = any(p.dim() >= 3 for p in module.parameters(recurse=False))
    return stacked and ("expert" in name or "moe" in name)


def _positional(module: nn.Module) -> int:
    """How many positional arguments the module's forward takes."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    parameters = inspect.signature(module.forward).parameters.values()
    return sum(p.kind in kinds for p in parameters)


def zero_experts_candidate(module: nn.Module) -> bool:
    """Stacked experts (3-D `gate_up_proj` and `down_proj`) outside transformers' experts
    interface, called as its experts are, (hidden_states, top_k_index, top_k_weights), with
    gate_up holding at least as many experts as down: maybe experts beside identity "zero
    experts" (LongCat-Flash's: ids from down's E on, up to gate_up's)."""
    weights = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights):
        return False
    if hasattr(type(module), "_apply_gate") or _positional(module) != 3:
        return False
    return weights[0].shape[0] >= weights[1].shape[0]


def _choices(tokens: int, routed: int, total: int, generator) -> torch.Tensor:
    """(tokens, k) distinct ids per row: two of the `routed` experts and, with zero experts
    (total > routed), one of those, in random column order; else min(3, routed) experts."""
    rows = []
    for _ in range(tokens):
        if total == routed:
            row = torch.randperm(routed, generator=generator)[: min(3, routed)]
        else:
            zero = routed + torch.randperm(total - routed, generator=generator)[:1]
            row = torch.cat((torch.randperm(routed, generator=generator)[: min(2, routed)], zero))
            row = row[torch.randperm(row.numel(), generator=generator)]
        rows.append(row)
    return torch.stack(rows)


def _stacked_experts_layout(
    module: nn.Module, ids_past: int, ours, attributes: dict | None = None
) -> dict | str | None:
    """The layout and activation ({transposed, activation, interleaved}) under which `ours`
    (t, ids, weights, {gate_up_proj, down_proj}, options) -> output agrees with the stacked
    experts' forward, called as transformers' experts are, with `attributes` put in place: both
    run in float64 on random parameters (`random_parameters`), in training and eval mode, at
    PROBE_SCALES, on random weights and random choices that hold one of the `ids_past` ids past
    down's E in every row (none for 0); None if no layout does, or why the module is no
    candidate (an activation fastlm lacks, state besides the two projections)."""
    activation = EXPERTS_ACTIVATIONS.get(_activation(module)[0])
    if activation is None:
        return "their activation is none fastlm has (SiLU, GELU)"
    unread = unread_state(module, ("gate_up_proj", "down_proj"))
    if unread:
        return f"{', '.join(unread)} besides their stacked gate/up and down projections"
    device = probe_device(module)
    values = random_parameters(module, device)
    routed = module.down_proj.shape[0]
    generator = _generator()
    ids = _choices(7, routed, routed + ids_past, generator).to(device)
    weights = torch.rand(ids.shape, generator=generator, dtype=torch.float64).to(device)
    held = {name: values[name] for name in ("gate_up_proj", "down_proj")}

    def outputs(inputs):
        return lambda: [functional_call(module, values, (t, ids, weights)) for t in inputs]

    for transposed, interleaved in itertools.product((False, True), (False, True)):
        if interleaved and activation != "silu":
            continue
        options = dict(transposed=transposed, activation=activation, interleaved=interleaved)
        size = module.gate_up_proj.shape[1 if transposed else 2]
        x = torch.randn(7, size, generator=generator, dtype=torch.float64).to(device)
        inputs = [s * x for s in PROBE_SCALES]
        try:
            with torch.no_grad(), _attributes_put(module, attributes or {}):
                theirs = in_both_modes(module, device, outputs(inputs))
                mine = [ours(t, ids, weights, held, options) for t in inputs]
        except RuntimeError:  # the other layout's shapes do not chain
            continue
        if all(_agree(mine, t) for t in theirs):
            return options
    return None


def zero_experts_options(module: nn.Module) -> dict | str:
    """Options for `forwards.zero_experts_forward` (the layout and activation) if the module
    computes it, else why not (`_stacked_experts_layout`, every row choosing experts and a zero
    expert)."""

    def ours(t, ids, weights, held, options):
        return zero_experts_forward(
            _Holder(held), t, ids, weights, **options, experts_op=moe_experts_ref
        )

    zero_experts = module.gate_up_proj.shape[0] - module.down_proj.shape[0]
    found = _stacked_experts_layout(module, zero_experts, ours)
    return found or (
        "they are not sum_j w_j down_e(act(gate_up_e x)) over their experts plus w_j x over ids "
        "past down's experts (zero experts)"
    )


def unclamped_experts_candidate(module: nn.Module) -> bool:
    """Stacked experts (3-D `gate_up_proj` and `down_proj` of one E) outside transformers'
    experts interface, called as its experts are, that hold a limit: maybe experts that clamp
    only where the limit is finite (Step 3.7's)."""
    weights = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights):
        return False
    same_e = weights[0].shape[0] == weights[1].shape[0]
    return same_e and _positional(module) == 3 and bool(_number_names(module, LIMIT_NAMES))


def unclamped_experts_options(module: nn.Module) -> dict | str:
    """Options for `forwards.unclamped_experts_forward` (the limit's name, the layout, the
    activation) if the module, with its limit at infinity (no clamp: how Step 3.7 marks the
    layers it does not clamp), computes sum_j w_j down_e(act(gate) * up) over its experts, an
    id of E choosing none, else why not (`_stacked_experts_layout`, an id of E in every row)."""

    def ours(t, ids, weights, held, options):
        return moe_experts_ref(t, ids, weights, *held.values(), **options)

    unclamped = {name: math.inf for name in _number_names(module, LIMIT_NAMES)}
    found = _stacked_experts_layout(module, 1, ours, unclamped)
    if isinstance(found, dict):
        return dict(found, limit_name=next(iter(unclamped)))
    return found or (
        "with an infinite limit they are not sum_j w_j down_e(act(gate_up_e x)) over their "
        "experts, an id past them choosing none"
    )


class _Holder:
    """Stands for a module with the given attributes (a forward that reads only those)."""

    def __init__(self, attributes: dict):
        self.__dict__.update(attributes)


def _stacked_children(module: nn.Module) -> list[str]:
    """The children holding one stacked 3-D `weight` (ScatterMoE's parallel experts)."""
    return [
        name
        for name, child in module.named_children()
        if isinstance(getattr(child, "weight", None), torch.Tensor) and child.weight.dim() == 3
    ]


def sorted_experts_candidate(module: nn.Module) -> bool:
    """A `router` child and two children holding one stacked (E, out, in) weight each: maybe an
    MoE block whose router sorts its choice by expert (`forwards.sorted_experts_forward`:
    JetMoE's MoE MLP)."""
    return len(_stacked_children(module)) == 2 and isinstance(
        getattr(module, "router", None), nn.Module
    )


class _Sorted(nn.Module):
    """`forwards.sorted_experts_forward` on the reference experts as a forward, so that
    `functional_call` can run it with the block's parameters replaced."""

    def __init__(self, block: nn.Module, **options):
        super().__init__()
        self.block, self.options = block, options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        options = dict(self.options, experts_op=moe_experts_ref)
        return sorted_experts_forward(self.block, x, **options)


def sorted_experts_options(module: nn.Module) -> dict | str:
    """Options for `forwards.sorted_experts_forward` (which stacked child is gate/up and which
    down, the activation, the block's bias) if the block computes it, else why not: both run in
    float64 on random parameters, in training and eval mode, at PROBE_SCALES. A block whose own
    forward does not run (its experts called through other methods) is left with that reason."""
    stacked = _stacked_children(module)
    biases = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 1]
    if unread_state(module, ("router", *stacked, *biases)) or len(biases) > 1:
        return "it holds more than a router, two stacked projections and a bias"
    device = probe_device(module)
    values = random_parameters(module, device)
    size = getattr(module, stacked[0]).weight.shape[2]
    x = torch.randn(2, 3, size, generator=_generator(), dtype=torch.float64).to(device)
    inputs = [s * x for s in PROBE_SCALES]

    def outputs():
        return [functional_call(module, values, (t,)) for t in inputs]

    try:
        with torch.no_grad():
            theirs = in_both_modes(module, device, outputs)
    except Exception as error:  # noqa: BLE001
        message = str(error).splitlines()[0][:100] if str(error) else ""
        return (
            f"its forward fails on one tensor ({type(error).__name__}: {message}): its stacked "
            "projections are called through its other methods (e.g. a mixture of attention "
            "heads: a query projection per expert, attention, an output projection per expert), "
            "not as an MLP's experts, which fastlm.moe_experts computes"
        )
    activation = EXPERTS_ACTIVATIONS.get(_activation(module)[0])
    if activation is None:
        return "its activation is none fastlm has (SiLU, GELU)"
    values = {f"block.{name}": value for name, value in values.items()}
    for gate_up, down in (stacked, stacked[::-1]):
        options = dict(router="router", gate_up=gate_up, down=down, activation=activation,
                       bias=next(iter(biases), None))  # fmt: skip
        try:
            with torch.no_grad():
                ours = [functional_call(_Sorted(module, **options), values, (t,)) for t in inputs]
        except (RuntimeError, ValueError, TypeError):  # shapes that do not chain
            continue
        if all(_agree(ours, t) for t in theirs):
            return options
    return "it is not sum_j g_j down_e(act(gate) * up) + bias over its router's sorted choice"


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


#: Where a family may keep the numbers of its logits, on its config or on the model itself
#: (Cohere copies `logit_scale` onto the model): multipliers, divisors (Granite's
#: `logits_scaling`) and the final soft cap (Gemma 2's).
LOGIT_MULTIPLIERS = ("logit_scale", "logits_scale", "output_multiplier")
LOGIT_DIVISORS = ("logits_scaling",)
LOGIT_CAPS = ("final_logit_softcapping",)
#: The numbers the logit probe puts in those places, one each (none another's inverse).
#: Where LOGIT_* are looked for.
LOGIT_HOLDERS = ("config", "model")
PROBE_NUMBERS = (1.7, 2.3, 0.41, 3.1, 0.29, 2.7, 0.53, 1.9, 0.37, 2.9)


def _logit_places(model: nn.Module) -> list[tuple[str, str]]:
    """(holder, name) of each place in LOGIT_* that holds a number or None."""
    places = []
    for holder in LOGIT_HOLDERS:
        obj = number_holder(model, holder)
        for name in (*LOGIT_MULTIPLIERS, *LOGIT_DIVISORS, *LOGIT_CAPS):
            value = config_value(obj, name, False)  # a per-layer field is not the model's
            if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
                places.append((holder, name))
    return places


@contextlib.contextmanager
def _numbers_put(model: nn.Module, numbers: dict):
    """The model with `numbers` ({(holder, name): value}) in their places, put back after."""
    with contextlib.ExitStack() as stack:
        for holder in LOGIT_HOLDERS:
            values = {name: v for (where, name), v in numbers.items() if where == holder}
            stack.enter_context(_attributes_put(number_holder(model, holder), values))
        yield


def logit_options(model: nn.Module, decoder: str) -> dict | str:
    """{scale_from, cap_from} for `forwards.causal_lm_forward` if the family's forward computes
    its logits from `model.<decoder>`'s output h as lm_head(h) times a number it reads on each
    call, soft-capped at another (`forwards.logit_numbers`: each None, or where it is read
    from), else why not.

    The forward runs in float64, in training and eval mode, with a stand-in for the decoder
    (put back after) that returns random hidden states, a random head, and a distinct number in
    every place the family may read one from (`_logit_places`; a cap of None switched on), so
    that which places it reads shows whatever values they hold at patch time: the patched
    forward reads the same places on every call, so a value changed after `patch` (Gemma 2's
    `final_logit_softcapping`) is used as the family's own forward would. A parameter or buffer
    of the model outside the decoder and the head (which that forward would not read) leaves it.
    """
    head = model.get_output_embeddings()
    head_prefix = next(n for n, m in model.named_modules() if m is head)
    unread = unread_state(model, (decoder, head_prefix))
    if unread:
        return f"{', '.join(unread)} besides its decoder and head (the fused loss reads none)"
    device = probe_device(head)
    params = random_parameters(head, device, prefix=f"{head_prefix}.")
    hidden = torch.randn(1, 5, head.weight.shape[1], generator=_generator(), dtype=torch.float64)
    hidden = hidden.to(device) * 2
    places = _logit_places(model)
    numbers = dict(zip(places, PROBE_NUMBERS))
    arguments = dict(input_ids=torch.zeros(1, 5, dtype=torch.long, device=device), use_cache=False)
    if "output_router_logits" in inspect.signature(type(model).forward).parameters:
        arguments["output_router_logits"] = False
    own = {name[len(head_prefix) + 1 :]: value for name, value in params.items()}

    def logits():
        """(the family's logits, lm_head(h)), each after the same random draws."""
        seeded(device)
        theirs = functional_call(model, params, (), arguments).logits
        seeded(device)
        return theirs, functional_call(head, own, (hidden,))

    real = getattr(model, decoder)
    setattr(model, decoder, _Decoder(hidden))
    try:
        with torch.no_grad(), _numbers_put(model, numbers):
            modes = in_both_modes(model, device, logits)
    except Exception as error:  # noqa: BLE001
        return f"its forward could not be run on stand-in hidden states ({type(error).__name__})"
    finally:
        setattr(model, decoder, real)
    # A head under transformers' tensor parallelism is a DTensor: lm_head(h) taken whole.
    modes = [(theirs, _whole(plain)) for theirs, plain in modes]
    scales = [(None, 1.0)]
    scales += [((*p, False), numbers[p]) for p in places if p[1] in LOGIT_MULTIPLIERS]
    scales += [((*p, True), 1 / numbers[p]) for p in places if p[1] in LOGIT_DIVISORS]
    caps = [(None, None)] + [(p, numbers[p]) for p in places if p[1] in LOGIT_CAPS]
    for (scale_from, scale), (cap_from, cap) in itertools.product(scales, caps):
        ours = [plain * scale for _, plain in modes]
        ours = [t if cap is None else cap * torch.tanh(t / cap) for t in ours]
        if _agree(ours, [theirs for theirs, _ in modes]):
            return dict(scale_from=scale_from, cap_from=cap_from)
    return "its logits are not lm_head(hidden) times a number it holds, soft-capped"


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t
