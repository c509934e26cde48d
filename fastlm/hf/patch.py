"""`patch`: one call that puts any Hugging Face causal LM on fastlm's kernels, module by module,
by what each module computes (`fastlm.hf.probe`), never by the family's name."""

from __future__ import annotations

import inspect
import math
import warnings

import torch
from torch import nn

from fastlm.hf import attention as attention_module
from fastlm.hf import experts, probe
from fastlm.hf.families import module_head_dim, transformers_module
from fastlm.hf.forwards import (
    SLICE_KV_SHARED,
    PatchedParts,
    bind,
    is_patched_forward,
    rope_attention_forward,
    rotary_names,
)
from fastlm.kernels.attention import MAX_HEAD_DIM
from fastlm.model import kernel_takes_head_dim, kernels_run_on


class _Report:
    """What each step patched (part -> module count) and left (what -> why)."""

    def __init__(self):
        self.parts: dict[str, int] = {}
        self.left: dict[str, str] = {}
        self.on_op: set[int] = set()  # ids of the experts modules run on fastlm.moe_experts

    def ran(self, part: str, count: int = 1) -> None:
        self.parts[part] = self.parts.get(part, 0) + count

    def leave(self, what: str, why: str) -> None:
        self.left.setdefault(what, why)


def _hugging_face_model(model: object) -> nn.Module:
    """The transformers causal LM inside a PEFT wrapper (or the model itself); TypeError for
    anything else."""
    transformers = transformers_module()
    if not isinstance(model, transformers.PreTrainedModel) and hasattr(model, "get_base_model"):
        model = model.get_base_model()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    # The head: an nn.Linear, or a module around one (PEFT's LoRA on lm_head) with its weight.
    weight = getattr(head, "weight", None)
    if not isinstance(model, transformers.PreTrainedModel) or not (
        isinstance(head, nn.Module) and torch.is_tensor(weight) and weight.dim() == 2
    ):
        raise TypeError(
            "model must be a transformers PreTrainedModel with a causal-LM head (an lm_head "
            "with a 2-D weight: a ...ForCausalLM), or a PEFT model around one; got "
            f"{type(model).__name__}"
        )
    return model


def _unpatch(model: nn.Module) -> None:
    """The forwards a previous `patch` gave the model's modules taken away, so that each is
    found again from its own code (patching twice finds what patching once does)."""
    for module in model.modules():
        for method in ("forward", "_apply_gate"):
            if is_patched_forward(module.__dict__.get(method)):
                delattr(module, method)


def _own_modules(model: nn.Module):
    """The model's modules of transformers' model classes (not torch's own layers)."""
    return [m for m in model.modules() if not type(m).__module__.startswith("torch.")]


def _patch_norms(model, report) -> None:
    """Every leaf module computing RMSNorm's math; a norm (by its class name) that does not,
    left with the reason."""
    count = 0
    for module in model.modules():
        name = type(module).__name__
        is_norm = "norm" in name.lower() and not any(True for _ in module.children())
        if probe.norm_candidate(module):
            options = probe.rms_norm_options(module)
            if isinstance(options, dict):
                bind([module], "rms_norm", **options)
                count += 1
            elif is_norm:  # other 1-D modules are no norms: not reported
                report.leave(name, options)
        elif is_norm:
            params = sorted(n for n, _ in module.named_parameters())
            why = f"parameters {', '.join(params)}" if params else "no weight"
            report.leave(name, f"{why}: not RMSNorm's one weight")
    if count:
        report.ran("rms_norm", count)


def _eager_calls_apply_gate(module) -> bool:
    """Whether the experts' own (eager) forward calls `_apply_gate`, as gpt-oss's does; most
    compute the gate inline. transformers wraps that forward to dispatch on the implementation."""
    forward = inspect.unwrap(type(module).forward)
    try:
        return "_apply_gate(" in inspect.getsource(forward)
    except (OSError, TypeError):  # no source to read: assume inline
        return False


def _patch_mlps(model, report) -> None:
    for module in _own_modules(model):
        name = type(module).__name__
        if probe.mlp_candidate(module):
            found = probe.mlp_options(module)
            if isinstance(found, str):
                if any(word in name for word in probe.MLP_NAMES):
                    report.leave(name, found)
                continue
            kind, options = found
            bind([module], kind, **options)
        elif probe.ungated_experts_candidate(module):  # act(up), no gate: Nemotron-H's experts
            found = probe.ungated_experts_options(module)
            if isinstance(found, str) or not experts.use_op(module, found):
                why = "a post-expert norm or expert parallelism"  # use_op's other refusals
                report.leave(name, found if isinstance(found, str) else why)
            else:
                _on_op(report, module)
            continue
        elif hasattr(type(module), "_apply_gate"):
            options = probe.experts_gate_options(module)
            if isinstance(options, str) and probe.unclamped_experts_candidate(module):
                _unclamped_experts(report, module, options)  # Step 3.7's
                continue
            if isinstance(options, str):
                report.leave(name, options)
                continue
            bind([module], "experts_gate", "_apply_gate", **options)
            eager = getattr(model.config, "_experts_implementation", None) == "eager"
            if experts.use_op(module, options):  # the whole experts on fastlm.moe_experts
                _on_op(report, module)
                continue
            if getattr(module, "has_post_expert_norm", False):
                report.leave(
                    name,
                    "a norm of each expert's output (has_post_expert_norm) before the weighted "
                    "sum, which fastlm.moe_experts does not compute: their GEMMs transformers' "
                    "own, their gate on fastlm's kernel",
                )
            elif eager and not _eager_calls_apply_gate(module):
                report.leave(
                    f"{name} (eager)",
                    "experts_implementation 'eager' computes the gate inline; "
                    "set_experts_implementation('grouped_mm') runs it on the kernel",
                )
        elif probe.peft_wrapped_experts(module):
            report.leave(
                name,
                "PEFT adapts its experts' stacked weights only inside their wrapper's forward, "
                "which only the block's own forward calls",
            )
            continue
        elif probe.input_scaled_experts_candidate(module):
            found = probe.input_scaled_experts_options(module)
            if isinstance(found, str):
                report.leave(name, found)
            else:  # the whole block's experts on fastlm.moe_experts
                bind([module], "input_scaled_experts", **found)
                _on_op(report, module.experts)
            continue
        elif probe.zero_experts_candidate(module):  # LongCat-Flash's, beside zero experts
            found = probe.zero_experts_options(module)
            if hasattr(module.down_proj, "placements"):  # its forward would run the family's
                found = "DTensor weights (tensor parallelism): the family's own loop over the ids"
            if isinstance(found, str):
                report.leave(name, found)
            else:
                bind([module], "zero_experts", **found)
                _on_op(report, module)
            continue
        elif probe.sorted_experts_candidate(module):  # JetMoE's MoE MLP (and its MoA, left)
            found = probe.sorted_experts_options(module)
            if isinstance(found, str):
                report.leave(name, found)
            else:
                bind([module], "sorted_experts", **found)
                _on_op(report, *(getattr(module, found[n]) for n in ("gate_up", "down")))
            continue
        else:
            continue
        report.ran("swiglu" if options["activation"] == "silu" else "geglu")
    _name_experts_left(model, report)


def _unclamped_experts(report, module, gate_found: str) -> None:
    """Experts whose gate fastlm lacks but which clamp only where their limit is finite: bound
    to `forwards.unclamped_experts_forward` if the probe finds their unclamped math the op's;
    on the op while the limit is infinite, and named in `left` with a finite one now."""
    name = type(module).__name__
    if hasattr(module.down_proj, "placements"):  # its forward would run the family's
        report.leave(name, "DTensor weights (tensor parallelism): the family's own loop")
        return
    found = probe.unclamped_experts_options(module)
    if isinstance(found, str):
        report.leave(name, gate_found)
        return
    bind([module], "unclamped_experts", **found)
    limit = getattr(module, found["limit_name"])
    if math.isfinite(limit):
        report.leave(
            name,
            f"their gate clamps after the activation (limit {limit:g}), which fastlm.moe_experts "
            "does not compute: their own forward (on the op where the limit is infinite)",
        )
    else:
        _on_op(report, module)


def _on_op(report, *modules) -> None:
    """The experts `modules` (one mixture's) run on fastlm.moe_experts."""
    report.ran("moe_experts")
    report.on_op.update(id(m) for m in modules)


def _name_experts_left(model, report) -> None:
    """Every experts module (`probe.experts_module`) not on fastlm.moe_experts named in `left`,
    under its class or the class of a module holding it that a step named already: no mixture's
    experts stay on the family's code unsaid."""
    named = {what.split(" ")[0] for what in report.left}
    classes: dict[str, str] = {}
    for path, module in model.named_modules():
        classes[path] = type(module).__name__
        if id(module) in report.on_op or not probe.experts_module(module):
            continue
        parts = path.split(".")
        holders = {classes[".".join(parts[:i])] for i in range(len(parts) + 1)}
        if not named & holders:
            report.leave(classes[path], _experts_form(module))
            named.add(classes[path])


def _experts_form(module) -> str:
    """Why patch left an experts module that no step named: what it holds and takes."""
    if hasattr(type(module), "_apply_gate"):  # `experts.use_op` refused it
        return (
            "their gate on fastlm's kernel where it is one, their GEMMs transformers' own: a "
            "post-expert norm or expert parallelism, which fastlm.moe_experts does not compute"
        )
    stacked = [n for n, p in module.named_parameters(recurse=False) if p.dim() >= 3]
    arguments = ", ".join(inspect.signature(module.forward).parameters)
    return (
        f"stacked {', '.join(stacked) or 'experts'} and a forward({arguments}) of a form "
        "fastlm.hf has no probe for (not transformers' experts interface, nor the forms "
        "fastlm.hf.probe checks): the family's code"
    )


def _calls_attention_interface(module: nn.Module) -> bool:
    code = inspect.unwrap(type(module).forward).__code__
    return "ALL_ATTENTION_FUNCTIONS" in code.co_names


def _attention_modules(model):
    """(modules calling transformers' attention interface, names of other attention classes)."""
    calling, other = [], set()
    for module in _own_modules(model):
        name = type(module).__name__
        if _calls_attention_interface(module):
            calling.append(module)
        elif "Attention" in name or "Mixer" in name or "DeltaNet" in name:
            if "Decoder" not in name and "Layer" not in name:
                other.add(name)
    return calling, other


def _patch_rope(model, report) -> None:
    calling, _ = _attention_modules(model)
    patched = [m for m in calling if rope_attention_forward(type(m)) is not None]
    for cls in {type(m) for m in calling if m not in patched}:
        other = rotary_names(inspect.unwrap(cls.forward), usable=False)
        if other:  # NoPE modules call none, and need none
            report.leave(
                f"rope of {cls.__name__}",
                f"{other[0]} takes neither (q, k, cos, sin) nor (xq, xk, freqs_cis): not "
                "fastlm's kernel",
            )
    if patched:
        bind(patched, "attention")
        report.ran("rope", len(patched))
        _first_forward(model)


def _first_forward(model) -> str | None:
    """The model run once on 4 tokens (no gradients): each RoPE function finds its layout on the
    shapes the model gives it before anything compiles the model, and a family whose code does
    not take fastlm's attention shows. None, or the error it raised."""
    embedding = model.get_input_embeddings()
    if any(p.device.type == "meta" for p in model.parameters()):
        return None
    ids = torch.arange(4, device=embedding.weight.device)[None] % embedding.weight.shape[0]
    # In eval mode (no dropout), its warnings kept from the user's own first forward.
    modes, warned = [(m, m.training) for m in model.modules()], set(attention_module._warned)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.eval()
            model(input_ids=ids, use_cache=False)
    except Exception as error:  # noqa: BLE001 (reported by the caller that needs it)
        return f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
    finally:
        for module, training in modes:
            module.training = training
        attention_module._warned.intersection_update(warned)
    return None


def _patch_attention(model, report) -> None:
    calling, other = _attention_modules(model)
    for name in sorted(other):
        report.leave(name, "does not call transformers' attention interface (left as it is)")
    if not calling:
        report.leave("attention", "no module calls transformers' attention interface")
        return
    # Each layer's head dim from the layer (Gemma 4's global layers have their own): layers
    # whose head dim the kernel does not take run SDPA (fastlm_attention's fallback).
    device = model.get_input_embeddings().weight.device
    untaken: dict[int, list[int]] = {}  # head dim -> the layers (attention modules) of that dim
    for index, module in enumerate(calling):
        size = module_head_dim(module, model.config)
        if kernels_run_on(device) and size is not None and not kernel_takes_head_dim(size):
            untaken.setdefault(size, []).append(getattr(module, "layer_idx", index))
    why = f"fastlm's kernel takes multiples of 8 to {MAX_HEAD_DIM}"
    if sum(map(len, untaken.values())) == len(calling):
        report.leave("attention", f"head_dim {', '.join(map(str, untaken))}: {why}")
        return
    attention_module.register()
    before = model.config._attn_implementation
    try:
        model.set_attn_implementation(attention_module.ATTENTION)
    except (ValueError, AttributeError) as error:
        report.leave("attention", f"set_attn_implementation refused it: {error}")
        return
    bind([m for m in model.modules() if hasattr(type(m), SLICE_KV_SHARED)], "kv_shared_inputs",
         SLICE_KV_SHARED)  # fmt: skip
    failure = _first_forward(model)
    if failure is not None:  # a family reading the mask tensor itself (Doge's dynamic mask)
        model.set_attn_implementation(before)
        report.leave("attention", f"its forward fails on fastlm's attention ({failure})")
        return
    for size, layers in untaken.items():
        report.leave(
            f"attention of layers {', '.join(map(str, layers))}",
            f"head_dim {size}: {why}; they run SDPA (or the family's eager attention)",
        )
    report.ran("attention", len(calling) - sum(map(len, untaken.values())))


def _decoder_name(model) -> str | None:
    code = inspect.unwrap(type(model).forward).__code__
    for name in ("model", "transformer", model.base_model_prefix):
        if name in code.co_names and isinstance(getattr(model, name, None), nn.Module):
            return name
    return None


def _patch_loss(model, report) -> None:
    loss_type = getattr(model.config, "loss_type", None)
    forward = model.__dict__.get("forward")
    decoder = _decoder_name(model)
    code = inspect.unwrap(type(model).forward).__code__
    moe = "load_balancing_loss_func" in code.co_names
    if loss_type not in (None, "ForCausalLM"):
        report.leave("cross_entropy", f"loss_type is {loss_type!r}, not ForCausalLM")
    elif forward is not None and not is_patched_forward(forward):
        # TRL's SFTTrainer wraps the forward with its own fused LM head when it is built.
        # Named by its code, not by __qualname__, which functools.wraps copies from the model's.
        owner = getattr(forward, "__func__", forward)
        code = getattr(owner, "__code__", None)
        name = repr(owner)
        if code is not None:
            name = f"{owner.__globals__.get('__name__', '?')}.{code.co_qualname}"
        report.leave(
            "cross_entropy",
            f"the model's forward is already replaced, by {name}: a trainer built before "
            "patch? Patch the model before building the trainer; its own loss head stays in use",
        )
    elif decoder is None:
        report.leave("cross_entropy", "its forward calls no decoder attribute fastlm knows")
    elif moe and not all(
        hasattr(model, n) for n in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
    ):
        report.leave("cross_entropy", "an auxiliary loss of a form fastlm does not know")
    else:
        options = probe.logit_options(model, decoder)
        if isinstance(options, str):
            report.leave("cross_entropy", options)
            return
        parameters = inspect.signature(type(model).forward).parameters.values()
        names = tuple(p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD)[1:]
        bind([model], "causal_lm", names=names, decoder=decoder, moe=moe, **options)
        report.ran("cross_entropy")


def patch(
    model: nn.Module,
    *,
    rms_norm: bool = True,
    rope: bool = True,
    swiglu: bool = True,
    attention: bool = True,
    cross_entropy: bool = True,
) -> nn.Module:
    """Run a Hugging Face causal LM on fastlm's kernels, in place, module by module.

    Each part is found by what a module computes, whatever the family (see `fastlm.hf.probe`):

    Args:
        model: any transformers PreTrainedModel with a causal-LM head (a ...ForCausalLM), or a
            PEFT model around one, on any device (the meta device too). Patch before building a
            trainer (TRL's trainers wrap the forward then). A patched model patched again has
            each part found again.
        rms_norm: every module computing RMSNorm's math (LLaMA's `weight * x_hat`, Gemma's
            `(1 + weight) * x_hat`, over a head or a whole projection) by `rms_norm`.
        rope: RoPE by fastlm's kernel on the rotary embedding's own cos/sin, inside each
            attention module's own forward, in each layout the kernel takes (half-split or
            interleaved pairs, partial rotary, half-width tables), checked on first use.
        swiglu: gated MLPs (split or fused gate/up projections, SiLU or GELU) by `swiglu`,
            `swiglu_packed` or `geglu`, and MoE experts by `moe_experts` (transformers' experts
            interface, Llama 4's block, LongCat-Flash's beside zero experts, JetMoE's MoE MLP);
            every experts module not run on it is named in `left`.
        attention: every module calling transformers' attention interface, by fastlm's flash
            attention in every batch shape (see `fastlm.hf.attention`), registered as
            "fastlm" with transformers.
        cross_entropy: with labels, the loss by fused linear cross-entropy, with the family's
            logit scale and final soft cap (read on every call, where the family reads them;
            a LoRA adapter on lm_head: its logits into fastlm's cross-entropy).

    Returns:
        The model. `fastlm_patched` (on the transformers model) lists the parts that run on
        the kernels, with `.modules` ({part: modules}) and `.left` ({what: why} for what stays
        as it is, each also one warning).

    Raises:
        ModuleNotFoundError: transformers is not installed (saying what to install).
        TypeError: model is not a transformers causal LM (or a PEFT model around one).
    """
    target = _hugging_face_model(model)
    _unpatch(target)
    report = _Report()
    steps = (
        (rms_norm, _patch_norms),
        (swiglu, _patch_mlps),
        (rope, _patch_rope),
        (attention, _patch_attention),
        (cross_entropy, _patch_loss),
    )
    for wanted, step in steps:
        if wanted:
            step(target, report)
    for what, why in report.left.items():
        warnings.warn(f"fastlm.hf.patch: left unpatched: {what} ({why})", stacklevel=2)
    target.fastlm_patched = PatchedParts(tuple(report.parts), report.left, report.parts)
    return model
