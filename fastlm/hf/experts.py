"""transformers' experts modules on `fastlm.moe_experts`: an implementation registered with
their `ExpertsInterface` (transformers/integrations/moe.py) under the name "fastlm".

transformers 5 keeps a family's experts as one module with stacked weights (`gate_up_proj`,
`down_proj`, optional biases; `is_transposed`, `is_concatenated`) whose forward dispatches on
`config._experts_implementation` to a function (self, hidden_states, top_k_index,
top_k_weights). `use_op` checks that a module is of that form and that its gate is one the op
computes (the options `fastlm.hf.probe.experts_gate_options` found by running its `_apply_gate`),
then points the config at "fastlm". Non-gated experts (`has_gate` False: `up_proj` (E, F, D),
act(up) between the GEMMs; Nemotron-H's ReLU²) run on the op's non-gated activation the same way,
their `act_fn` checked by `fastlm.hf.probe.ungated_experts_options`. A module of a shared config
that `use_op` did not accept (a post-expert norm, expert parallelism, a gate the op lacks) runs
transformers' `grouped_mm`.
"""

from __future__ import annotations

import torch

from fastlm.hf.forwards import clamp_options
from fastlm.kernels.moe.experts import UNGATED, moe_experts

NAME = "fastlm"

#: The probe's activation names (`fastlm.hf.forwards.activation_of`) as moe_experts's.
EXPERTS_ACTIVATIONS = {"silu": "silu", "tanh": "gelu_tanh", "none": "gelu"}


def fastlm_experts_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts' output by `fastlm.moe_experts`, in hidden_states' dtype (the input cast to
    the weights' dtype first, as transformers' grouped_mm casts it)."""
    options = getattr(self, "_fastlm_moe_options", None)
    if options is None or self._is_expert_parallel:
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    options = dict(options)
    # gpt-oss's limit and alpha read now, where the module's own gate reads them on every call.
    options.update(clamp_options(self, **options.pop("clamp")))
    first = "gate_up_proj" if self.has_gate else "up_proj"  # non-gated: up alone
    x = hidden_states.to(getattr(self, first).dtype)
    biases = (None, None)
    if self.has_bias:
        biases = (getattr(self, f"{first}_bias"), self.down_proj_bias)
    out = moe_experts(
        x,
        top_k_index,
        top_k_weights.to(x.dtype),
        getattr(self, first),
        self.down_proj,
        *biases,
        transposed=self.is_transposed,
        **options,
    )
    return out.to(hidden_states.dtype)


def register() -> None:
    """fastlm's implementation in transformers' ExpertsInterface, under NAME."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, fastlm_experts_forward)


def use_op(module: torch.nn.Module, gate_options: dict) -> bool:
    """Run the experts `module` on fastlm.moe_experts when it is transformers' stacked-experts
    form with a gated activation the op has (`gate_options`: the probe's activation,
    interleaved, and where gpt-oss's alpha and limit are read, and its up_offset), or, for
    non-gated experts, the op's non-gated activation (`gate_options`:
    `probe.ungated_experts_options`'); True if it now does."""
    has_gate = getattr(module, "has_gate", None)
    first = "gate_up_proj" if has_gate else "up_proj"
    weights = getattr(module, first, None), getattr(module, "down_proj", None)
    stacked = all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights)
    form = stacked and has_gate is not None and hasattr(module, "config")
    if not form or getattr(module, "has_post_expert_norm", True) or module._is_expert_parallel:
        return False
    if not has_gate:
        if gate_options["activation"] not in UNGATED:
            return False
        options = dict(activation=gate_options["activation"], interleaved=False, clamp={})
    else:
        activation = EXPERTS_ACTIVATIONS.get(gate_options["activation"])
        if activation is None:
            return False
        clamp = {k: v for k, v in gate_options.items() if k not in ("activation", "interleaved")}
        if activation != "silu" and clamp:
            return False
        options = dict(activation=activation, interleaved=gate_options["interleaved"], clamp=clamp)
    register()
    module._fastlm_moe_options = options
    module.config._experts_implementation = NAME
    return True
