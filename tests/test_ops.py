"""Every fastlm op as torch.library sees it: schema, fake tensors, autograd registration and AOT
dispatch (`torch.library.opcheck`), and the model compiled whole with the kernels as ops.

The kernels run through Triton's interpreter here; opcheck calls each op several times (eagerly,
on fake tensors, under AOT autograd) and compares the results, so sizes are small.
"""

import pytest
import torch
from conftest import TINY_MODEL
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

import fastlm
from fastlm import reference as R
from fastlm.kernels.rope import rope_tables
from fastlm.testing import assert_close


def _randn(*shape, device, requires_grad=False, dtype=torch.float32, scale=1.0):
    x = scale * torch.randn(*shape, device=device, dtype=dtype)
    return x.requires_grad_(requires_grad)


def _op_cases(device):
    """(op, args) for every op fastlm registers: the forward ops with inputs that require grad
    (so that opcheck exercises their autograd formulas), the backward and in-place ops without."""
    g = dict(device=device, requires_grad=True)
    n = dict(device=device)
    x, residual, weight = _randn(5, 48, **g), _randn(5, 48, **g), _randn(48, **g)
    rstd = torch.rand(5, device=device) + 0.5
    q, k, v = _randn(1, 2, 37, 16, **g), _randn(1, 1, 37, 16, **g), _randn(1, 1, 37, 16, **g)
    o, lse = torch.ops.fastlm.flash_attention(
        q.detach(), k.detach(), v.detach(), True, 0.25, -1, -1, 0.0, False, True
    )
    # Packed documents of 5, 1 and 31 tokens (one 37-token batch), with a window and the cap.
    cu = torch.tensor([0, 5, 6, 37], dtype=torch.int32, device=device)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]  # (37, H, 16) views
    varlen_flags = (True, 0.25, 7, 0, 2.0, False, False)
    o_varlen, lse_varlen = torch.ops.fastlm.flash_attention_varlen(
        *(t.detach() for t in packed), cu, cu, 31, 31, *varlen_flags
    )
    # Attention sinks (one per query head) and v of its own head dim (24 against q's 16).
    sinks, v24 = _randn(2, **g), _randn(1, 1, 37, 24, **g)
    sink_flags = (True, 0.25, 9, 0, 0.0, False, True)
    o_sinks, lse_sinks = torch.ops.fastlm.flash_attention(
        q.detach(), k.detach(), v24.detach(), *sink_flags, sinks.detach()
    )
    packed_v24 = v24[0].transpose(0, 1)
    o_varlen_sinks, lse_varlen_sinks = torch.ops.fastlm.flash_attention_varlen(
        *(t.detach() for t in (*packed[:2], packed_v24)),
        cu,
        cu,
        31,
        31,
        *varlen_flags,
        sinks.detach(),
    )
    cos, sin = rope_tables(10000.0, 16, 64, device=device)
    positions = torch.arange(3, 40, device=device)
    targets = torch.randint(0, 300, (6,), device=device)
    targets[1] = -100
    ops = torch.ops.fastlm
    # Mixture of experts: 7 tokens, k = 2 of 3 experts (expert 1 gets none), D 16, F 8.
    moe_ids = torch.tensor([[0, 2], [2, 0], [0, 2], [2, 0], [0, 2], [2, 0], [0, 2]], device=device)
    moe_weights = torch.rand(7, 2, device=device, requires_grad=True)
    gate_up, down = _randn(3, 2 * 8, 16, **g), _randn(3, 8, 16, **g)  # gpt-oss: transposed down
    moe_route = ops.moe_route(moe_ids, 3)
    # gpt-oss's layout (transposed weights, biases), experts sharded over E: a rank's 2
    # experts, global ids 1 and 2 (expert 0's rows are another rank's).
    moe_held = _randn(2, 16, 2 * 8, **g), _randn(2, 8, 16, **g), _randn(2, 2 * 8, **g)
    moe_index = torch.arange(1, 3, device=device)
    return {
        "rms_norm": (ops.rms_norm, (x, weight, 1e-5, torch.bfloat16)),
        "add_rms_norm": (
            ops.add_rms_norm,
            (_randn(5, 48, dtype=torch.bfloat16, **g), residual, weight, 1e-5, torch.bfloat16),
        ),
        "rms_norm_backward": (
            ops.rms_norm_backward,
            (
                _randn(5, 48, **n),
                _randn(5, 48, **n),
                _randn(5, 48, **n),
                _randn(48, **n),
                rstd,
                torch.bfloat16,
                torch.float32,
            ),
        ),
        "rms_norm_offset": (ops.rms_norm, (x, weight, 1e-5, torch.float32, 1.0)),
        "swiglu": (ops.swiglu, (_randn(4, 40, **g), _randn(4, 40, **g))),
        "swiglu_backward": (ops.swiglu_backward, tuple(_randn(4, 40, **n) for _ in range(3))),
        "swiglu_packed": (ops.swiglu_packed, (_randn(4, 80, **g),)),
        "swiglu_packed_backward": (
            ops.swiglu_packed_backward,
            (_randn(4, 40, **n), _randn(4, 80, **n)),
        ),
        # gpt-oss's options: the clamp reached (scale 6 against limit 7), interleaved gate/up.
        "swiglu_options": (
            ops.swiglu_options,
            (_randn(4, 40, scale=6, **g), _randn(4, 40, scale=6, **g), 1.702, 7.0, 1.0),
        ),
        "swiglu_options_backward": (
            ops.swiglu_options_backward,
            (*(_randn(4, 40, scale=6, **n) for _ in range(3)), 1.702, 7.0, 1.0),
        ),
        "swiglu_packed_options": (
            ops.swiglu_packed_options,
            (_randn(4, 80, scale=6, **g), True, 1.702, 7.0, 1.0),
        ),
        "swiglu_packed_options_backward": (
            ops.swiglu_packed_options_backward,
            (_randn(4, 40, **n), _randn(4, 80, scale=6, **n), True, 1.702, None, 1.0),
        ),
        "geglu": (ops.geglu, (_randn(4, 40, **g), _randn(4, 40, **g), "tanh")),
        "geglu_exact": (ops.geglu, (_randn(4, 40, **g), _randn(4, 40, **g), "none")),
        "geglu_backward": (ops.geglu_backward, (*(_randn(4, 40, **n) for _ in range(3)), "tanh")),
        "flash_attention": (ops.flash_attention, (q, k, v, True, 0.25, 9, 0, 3.0, False, False)),
        "flash_attention_backward": (
            ops.flash_attention_backward,
            (
                _randn(1, 2, 37, 16, **n),
                q.detach(),
                k.detach(),
                v.detach(),
                o,
                lse,
                True,
                0.25,
                -1,
                -1,
                0.0,
                False,
                False,
            ),
        ),
        "flash_attention_sinks": (ops.flash_attention, (q, k, v24, *sink_flags, sinks)),
        "flash_attention_backward_sinks": (
            ops.flash_attention_backward,
            (
                _randn(1, 2, 37, 24, **n),
                *(t.detach() for t in (q, k, v24)),
                o_sinks,
                lse_sinks,
                *sink_flags,
                sinks.detach(),
            ),
        ),
        "flash_attention_varlen": (
            ops.flash_attention_varlen,
            (*packed, cu, cu, 31, 31, *varlen_flags),
        ),
        "flash_attention_varlen_sinks": (
            ops.flash_attention_varlen,
            (*packed[:2], packed_v24, cu, cu, 31, 31, *varlen_flags, sinks),
        ),
        "flash_attention_varlen_backward_sinks": (
            ops.flash_attention_varlen_backward,
            (
                _randn(37, 2, 24, **n),
                *(t.detach() for t in (*packed[:2], packed_v24)),
                o_varlen_sinks,
                lse_varlen_sinks,
                cu,
                cu,
                31,
                31,
                *varlen_flags,
                sinks.detach(),
            ),
        ),
        "flash_attention_varlen_backward": (
            ops.flash_attention_varlen_backward,
            (
                _randn(37, 2, 16, **n),
                *(t.detach() for t in packed),
                o_varlen,
                lse_varlen,
                cu,
                cu,
                31,
                31,
                *varlen_flags,
            ),
        ),
        "flash_attention_backward_": (
            ops.flash_attention_backward_,
            (
                _randn(1, 2, 37, 16, **n),
                q.detach(),
                k.detach(),
                v.detach(),
                o,
                lse,
                True,
                0.25,
                False,
                True,
                *(_randn(1, h, 37, 16, **n) for h in (2, 1, 1)),
            ),
        ),
        "rope": (ops.rope, (_randn(1, 2, 37, 16, **g), cos, sin, positions, True, False)),
        "rope_": (
            ops.rope_,
            (
                _randn(1, 2, 37, 16, **n),
                _randn(1, 1, 37, 16, **n),
                cos,
                sin,
                positions,
                False,
                False,
            ),
        ),
        "cross_entropy": (ops.cross_entropy, (_randn(6, 300, **g), targets, -100)),
        "cross_entropy_backward": (
            ops.cross_entropy_backward,
            (
                _randn(6, 300, **n),
                targets,
                -100,
                torch.rand(6, 2, **n) + 3,  # each row's max and log-sum-exp below it
                torch.tensor(0.25, device=device),
            ),
        ),
        "cross_entropy_": (ops.cross_entropy_, (_randn(6, 300, **n), targets, -100)),
        "linear_cross_entropy": (
            ops.linear_cross_entropy,
            (_randn(6, 16, **g), _randn(300, 16, **g), targets, -100, 4, True, True),
        ),
        # soft cap 3, label smoothing 0.1, z-loss 0.01
        "cross_entropy_options": (
            ops.cross_entropy_options,
            (_randn(6, 300, **g), targets, -100, 3.0, 0.1, 0.01),
        ),
        "cross_entropy_options_backward": (
            ops.cross_entropy_options_backward,
            (
                _randn(6, 300, **n),
                targets,
                -100,
                torch.stack((torch.rand(6, **n) + 2, torch.rand(6, **n) + 5), 1),
                torch.rand(6, **n),
                3.0,
                0.1,
                0.01,
            ),
        ),
        "moe_route": (ops.moe_route, (moe_ids, 3)),
        "moe_experts": (
            ops.moe_experts,
            (
                _randn(7, 16, **g),
                moe_weights,
                *moe_held,
                _randn(2, 16, **g),  # down_bias
                *moe_route,
                True,
                True,
                "silu",
                1.702,
                1.0,
                1.0,
                moe_index,
            ),
        ),
        "moe_experts_backward": (
            ops.moe_experts_backward,
            (
                _randn(7, 16, **n),
                _randn(7, 16, **n),
                moe_weights.detach(),
                gate_up.detach(),
                down.detach().transpose(1, 2),
                None,
                None,
                *moe_route,
                False,
                False,
                "gelu_tanh",
                1.0,
                None,
                0.0,
            ),
        ),
        "linear_cross_entropy_options": (
            ops.linear_cross_entropy_options,
            (
                _randn(6, 16, **g),
                _randn(300, 16, **g),
                targets,
                -100,
                4,
                3.0,
                0.1,
                0.01,
                True,
                True,
            ),
        ),
    }


OP_NAMES = [
    "rms_norm",
    "rms_norm_offset",
    "add_rms_norm",
    "rms_norm_backward",
    "swiglu",
    "swiglu_backward",
    "swiglu_packed",
    "swiglu_packed_backward",
    "swiglu_options",
    "swiglu_options_backward",
    "swiglu_packed_options",
    "swiglu_packed_options_backward",
    "geglu",
    "geglu_exact",
    "geglu_backward",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_backward_",
    "flash_attention_varlen",
    "flash_attention_varlen_backward",
    "flash_attention_sinks",
    "flash_attention_backward_sinks",
    "flash_attention_varlen_sinks",
    "flash_attention_varlen_backward_sinks",
    "rope",
    "rope_",
    "cross_entropy",
    "cross_entropy_backward",
    "cross_entropy_",
    "linear_cross_entropy",
    "cross_entropy_options",
    "cross_entropy_options_backward",
    "linear_cross_entropy_options",
    "moe_route",
    "moe_experts",
    "moe_experts_backward",
]


def test_every_registered_op_is_checked(device):
    from torch._library.custom_ops import OPDEFS

    registered = {name.split("::")[1] for name in OPDEFS if name.startswith("fastlm::")}
    # An option of an op with its own kernel specialisation gets a case of its own, named
    # <op>_<option>.
    options = {"rms_norm_offset", "geglu_exact"}
    options |= {"flash_attention_sinks", "flash_attention_backward_sinks"}
    options |= {"flash_attention_varlen_sinks", "flash_attention_varlen_backward_sinks"}
    assert registered == set(OP_NAMES) - options and set(OP_NAMES) == set(_op_cases(device))


@pytest.mark.parametrize("name", OP_NAMES)
def test_opcheck(device, name):
    op, args = _op_cases(device)[name]
    results = torch.library.opcheck(op, args)
    assert set(results.values()) == {"SUCCESS"}, results


class _OpRecordingBackend:
    """aot_eager that also records the ops of the forward and backward graphs it compiles."""

    def __init__(self):
        self.ops = set()
        self.backend = aot_autograd(fw_compiler=self._compile, bw_compiler=self._compile)

    def _compile(self, gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function":
                # A mutating op appears functionalised: auto_functionalized(op, ...).
                functionalised = "auto_functionalized" in str(node.target)
                self.ops.add(str(node.args[0] if functionalised else node.target))
        return make_boxed_func(gm.forward)

    def __call__(self, gm, example_inputs):
        return self.backend(gm, example_inputs)


KERNEL_OPS = {
    "fastlm.rms_norm.default",
    "fastlm.add_rms_norm.default",
    "fastlm.rms_norm_backward.default",
    "fastlm.rope_.default",
    "fastlm.flash_attention.default",
    "fastlm.flash_attention_backward_.default",
    "fastlm.swiglu.default",
    "fastlm.swiglu_backward.default",
    "fastlm.linear_cross_entropy.default",
}


def _compiled_loss_matches_reference(device, backend):
    model = fastlm.Transformer(**TINY_MODEL, device=device)
    ref = R.Transformer(**TINY_MODEL, device=device, dtype=torch.float64)
    ref.load_state_dict(model.state_dict())
    tokens = torch.randint(0, TINY_MODEL["vocab_size"], (2, 13), device=device)
    targets = torch.randint(0, TINY_MODEL["vocab_size"], (2, 13), device=device)
    counters.clear()
    loss = torch.compile(model.loss, backend=backend, fullgraph=True)(tokens, targets)
    loss.backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    expected = R.CrossEntropyLoss()(ref(tokens), targets)
    expected.backward()
    assert_close(loss, expected, torch.float32, "compiled loss")
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert_close(p.grad, ref_params[name].grad, torch.float32, f"compiled grad of {name}")


def test_model_compiles_whole_with_the_kernels(device):
    """fullgraph=True (any graph break raises) of the loss and its backward; the graphs hold the
    kernels as ops, not the PyTorch fallback, and the result matches the float64 reference.
    On the CPU the ops run through the interpreter at run time (aot_eager); on CUDA the test
    below compiles with Inductor."""
    backend = _OpRecordingBackend()
    _compiled_loss_matches_reference(device, backend)
    assert KERNEL_OPS <= backend.ops, KERNEL_OPS - backend.ops


def test_model_compiles_whole_on_pytorch(device, monkeypatch):
    monkeypatch.setenv("FASTLM_BACKEND", "torch")
    backend = _OpRecordingBackend()
    _compiled_loss_matches_reference(device, backend)
    assert not any(op.startswith("fastlm.") for op in backend.ops)


@pytest.mark.cuda
def test_model_compiles_whole_with_inductor(device):
    _compiled_loss_matches_reference(device, "inductor")


def test_model_compiles_whole_under_autocast(device, gemms):
    """The autocast step (the block's weights cast together, fp32 weight gradients out of the
    GEMMs: `fastlm.kernels.linear`) compiles without a graph break and gives the eager step's
    loss and gradients."""
    eager = fastlm.Transformer(**TINY_MODEL, device=device)
    compiled = fastlm.Transformer(**TINY_MODEL, device=device)
    compiled.load_state_dict(eager.state_dict())
    tokens = torch.randint(0, TINY_MODEL["vocab_size"], (2, 13), device=device)
    targets = torch.randint(0, TINY_MODEL["vocab_size"], (2, 13), device=device)
    backend = _OpRecordingBackend()
    counters.clear()
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        expected = eager.loss(tokens, targets)
        loss = torch.compile(compiled.loss, backend=backend, fullgraph=True)(tokens, targets)
    expected.backward()
    loss.backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert any("foreach_copy" in op for op in backend.ops), "the weights were not cast together"
    assert_close(loss, expected, torch.bfloat16, "compiled autocast loss")
    eager_params = dict(eager.named_parameters())
    for name, p in compiled.named_parameters():
        assert p.grad.dtype == torch.float32, name
        assert_close(p.grad, eager_params[name].grad, torch.bfloat16, f"compiled grad of {name}")


def _strided_copies(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """t's values in other memory layouts: rows padded (a slice of wider rows), a last dim with
    stride 2, and column-major (the last two dims transposed in memory)."""
    if t.dim() == 0:
        return {}
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1] + 3, dtype=t.dtype, device=t.device)
    padded = wide[..., 1 : t.shape[-1] + 1]
    every_other = torch.empty(*t.shape, 2, dtype=t.dtype, device=t.device)[..., 1]
    copies = {"padded rows": padded, "last stride 2": every_other}
    if t.dim() >= 2:
        copies["column-major"] = torch.empty_like(t.transpose(-1, -2)).transpose(-1, -2)
    for copy in copies.values():
        copy.copy_(t)
    return copies


def _op_results(op, args) -> list[torch.Tensor]:
    """The op's tensor outputs, then its tensor arguments (which show what a mutating op wrote)."""
    out = op(*args)
    out = out if isinstance(out, tuple) else (out,)
    return [t for t in (*out, *args) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name", OP_NAMES)
def test_ops_read_every_input_through_its_strides(device, name):
    """Each torch.ops.fastlm op, called directly, gives the same results for any memory layout of
    any tensor argument (weights, tables, saved statistics, targets, positions, ...)."""
    op, args = _op_cases(device)[name]
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    fresh = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    expected = _op_results(op, fresh)
    for i, arg in enumerate(args):
        if not isinstance(arg, torch.Tensor):
            continue
        for layout, strided in _strided_copies(arg).items():
            inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            inputs[i] = strided
            for j, (got, want) in enumerate(zip(_op_results(op, inputs), expected)):
                tolerance = want.dtype if want.is_floating_point() else torch.float64
                assert_close(got, want, tolerance, f"{name}: result {j}, argument {i} {layout}")
