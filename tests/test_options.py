"""One rule for every numeric option (`fastlm.options`), checked class-wide.

`REGISTRY` lists every numeric option of every public function, module constructor and
`torch.ops.fastlm` op: how to call it with one value of that option (small inputs), and which
values it must accept when they differ from what the option's range (`fastlm.options.OPTIONS`)
says. Each option is then tried with nan, +-inf, -1, 0, a huge value, the ends of its range and
just past them, and the wrong types (a bool, a str, a tensor, and a float for an int option):

- a value inside the range runs, and every tensor it returns (and every gradient) is finite;
- any other value raises a ValueError (out of range) or TypeError (wrong type) whose message names
  the option, before anything runs.

Public functions run on both backends (FASTLM_BACKEND=torch and triton, the interpreter here).
`test_every_numeric_option_is_registered` reads the signatures of the public API and the schemas
of the ops: a numeric parameter added later fails it until it is registered here (or listed in
SIZES, the structural sizes that shape checks cover), so it gets the same checks.

A new option: give it a range in `fastlm.options.OPTIONS`, call `fastlm.options.check` for it in
the function (and in the op), and add an `Entry` below.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

import fastlm
import fastlm.kernels
from fastlm.config import ModelConfig
from fastlm.kernels.attention import flash_attention_ref
from fastlm.kernels.rope import rope_tables
from fastlm.options import ALIASES, FLOAT32_MAX, OPTIONS, SINK_MAX, WINDOW_MAX, check
from fastlm.testing import assert_close


@dataclass
class Entry:
    """One numeric option of one callable.

    where: the callable as the API spells it; option: the parameter's name.
    run: runs the callable with the option set to a value, returns what to check for finiteness.
    none_ok: None is accepted ("not set").
    valid: values that must run, in place of those drawn from the range (a count that would
        take minutes, a bound that depends on the inputs).
    invalid: further values that must be refused although the range admits them.
    named: what the message must name (default: the option).
    type_error: the error of a value of the wrong type (ModelConfig: ValueError, the commands').
    """

    where: str
    option: str
    run: Callable[[object], object]
    none_ok: bool = False
    valid: list | None = None
    invalid: list = field(default_factory=list)
    named: str | None = None
    type_error: type = TypeError
    backends: tuple = ("torch", "triton")

    @property
    def spec(self):
        return OPTIONS[ALIASES.get(self.option, self.option)]

    def __repr__(self) -> str:
        return f"{self.where}:{self.option}"


# --------------------------------------------------------------------------------------------
# Small inputs and calls (fresh random values each run)
# --------------------------------------------------------------------------------------------

V, C, N = 11, 8, 5  # vocabulary, features, rows
B, H, T, D = 1, 2, 9, 16  # attention: batch, heads, tokens, head dim


def _backward(out) -> list[torch.Tensor]:
    """The tensors of `out`, and the gradients of its first (a loss or an output) when it has a
    graph: what must be finite."""
    tensors = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if torch.is_tensor(t)]
    first = tensors[0]
    if first.requires_grad:
        leaves = [t for t in _leaves if t.requires_grad]
        grads = torch.autograd.grad(first.float().sum(), leaves, allow_unused=True)
        tensors += [g for g in grads if g is not None]
    return tensors


_leaves: list[torch.Tensor] = []


def _leaf(*shape, dtype=torch.float32) -> torch.Tensor:
    t = torch.randn(*shape, dtype=dtype).requires_grad_()
    _leaves.append(t)
    return t


def cross_entropy(**option):
    logits, targets = _leaf(N, V), torch.randint(0, V, (N,))
    return _backward(fastlm.cross_entropy(logits, targets, **option))


def linear_cross_entropy(**option):
    x, weight, targets = _leaf(N, C), _leaf(V, C), torch.randint(0, V, (N,))
    return _backward(fastlm.linear_cross_entropy(x, weight, targets, **option))


def flash_attention(**option):
    q, k, v = _leaf(B, H, T, D), _leaf(B, H, T, D), _leaf(B, H, T, D)
    option.setdefault("causal", False)
    return _backward(fastlm.flash_attention(q, k, v, **option))


def _cu_seqlens() -> torch.Tensor:
    return torch.tensor([0, 4, T], dtype=torch.int32)  # two documents, the longest 5


def flash_attention_varlen(**option):
    q, k, v = _leaf(T, H, D), _leaf(T, H, D), _leaf(T, H, D)
    option = {"max_seqlen_q": 5, "max_seqlen_k": 5, "causal": False, **option}
    cu = _cu_seqlens()
    return _backward(fastlm.flash_attention_varlen(q, k, v, cu, cu, **option))


def rope_attention(**option):
    option = {"num_heads": 2, **option}
    kv = option.get("num_kv_heads") or option["num_heads"]
    kv = kv if isinstance(kv, int) and 0 < kv <= 2 else 2  # a refused value: any width
    qkv = _leaf(B, T, (2 + 2 * kv) * D).clone()  # not a leaf: it is rotated in place
    cos, sin = rope_tables(10000.0, D, 32)
    return _backward(fastlm.rope_attention(qkv, cos, sin, torch.arange(T), **option))


def rms_norm(**option):
    return _backward(fastlm.rms_norm(_leaf(N, C), _leaf(C), **option))


def add_rms_norm(**option):
    return _backward(fastlm.add_rms_norm(_leaf(N, C), _leaf(N, C), _leaf(C), **option))


def swiglu(**option):
    return _backward(fastlm.swiglu(_leaf(N, C), _leaf(N, C), **option))


def swiglu_packed(**option):
    return _backward(fastlm.swiglu_packed(_leaf(N, 2 * C), interleaved=True, **option))


def moe_experts(**option):
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0]])
    args = (_leaf(N, C), ids, _leaf(N, 2), _leaf(3, 2 * 4, C), _leaf(3, C, 4))
    return _backward(fastlm.moe_experts(*args, **option))


#: The values moe_experts must run (a call takes seconds in the interpreter): each range's far
#: end, and a limit that clamps nearly everything.
MOE_VALID = {"alpha": [1e6], "limit": [1e-3], "up_offset": [-1e6]}


def _moe_args(backward: bool) -> dict:
    """The moe_experts ops' arguments: 5 tokens, k = 2 of 3 experts, gpt-oss's options."""
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0]])
    gate_up = torch.randn(3, 2 * 4, C)
    sorted_assignments, offsets = OPS.moe_route(ids, 3)
    args = dict(x=torch.randn(N, C), expert_weights=torch.rand(N, 2), gate_up=gate_up,
                down=torch.randn(3, C, 4), gate_up_bias=None, down_bias=None,
                sorted_assignments=sorted_assignments, expert_offsets=offsets, transposed=False,
                interleaved=False, activation="silu", alpha=1.702, limit=7.0,
                up_offset=1.0)  # fmt: skip
    return dict(args, dout=torch.randn(N, C)) if backward else args


class _TinyLM(torch.nn.Module):
    context_length = 8

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(V, V)

    def forward(self, tokens):
        return self.embed(tokens)


def sample(**option):
    option = {"max_new_tokens": 2, **option}
    generator = torch.Generator().manual_seed(0)
    return fastlm.sample(_TinyLM(), torch.tensor([1, 2]), generator=generator, **option)


def transformer(**option):
    option = {"rope_theta": 10000.0, **option}
    model = fastlm.Transformer(V, 8, 32, 1, 2, 16, **option)
    return [*model.parameters(), model(torch.randint(0, V, (1, 8)))]


def block(**option):
    option = {"theta": 10000.0, **option}
    model = fastlm.TransformerBlock(32, 2, 16, 8, **option)
    return [model(torch.randn(1, 8, 32), torch.arange(8))]


def attention_module(**option):
    option = {"theta": 10000.0, **option}
    model = fastlm.MultiHeadAttentionWithRoPE(32, 2, 8, **option)
    return [model(torch.randn(1, 8, 32), torch.arange(8))]


def model_config(**option):
    ModelConfig(V, 8, 32, 1, 2, 16, **option).check()
    return []


# The ops: forward outputs of the public functions feed the backward ops.
OPS = torch.ops.fastlm


def _op(name: str, make_args: Callable[[], dict]) -> Callable:
    def run(**option):
        return getattr(OPS, name)(**{**make_args(), **option})

    return run


def _attention_args(varlen: bool = False) -> dict:
    shape = (T, H, D) if varlen else (B, H, T, D)
    q, k, v = (torch.randn(shape) for _ in range(3))
    args = dict(q=q, k=k, v=v, causal=False, softmax_scale=0.25, window_left=-1, window_right=-1)
    args.update(softcap=0.0, allow_tf32=True, deterministic=True)
    if varlen:
        cu = _cu_seqlens()
        args.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5)
    return args


def _attention_backward_args(varlen: bool = False) -> dict:
    args = _attention_args(varlen)
    o, lse = (OPS.flash_attention_varlen if varlen else OPS.flash_attention)(**args)
    return dict(args, do=torch.randn_like(o), o=o, lse=lse)


def _ce_args() -> dict:
    return dict(logits=torch.randn(N, V), targets=torch.randint(0, V, (N,)), ignore_index=-100)


def _ce_options_args() -> dict:
    return dict(_ce_args(), softcap=0.0, label_smoothing=0.0, z_loss=0.0)


def _ce_backward_args(options: bool) -> dict:
    args = _ce_options_args() if options else _ce_args()
    if options:  # (row losses, stats, correct): a scale per row
        return dict(args, stats=OPS.cross_entropy_options(**args)[1], scale=torch.ones(N))
    # (mean loss, n_valid, stats): one scale, the upstream gradient over n_valid
    _, n_valid, stats = OPS.cross_entropy(**args)
    return dict(args, stats=stats, scale=1.0 / n_valid.float())


def _lce_args(options: bool) -> dict:
    args = dict(x=torch.randn(N, C), weight=torch.randn(V, C), targets=torch.randint(0, V, (N,)))
    args.update(ignore_index=-100, chunk_size=3, need_dx=True, need_dweight=True)
    return dict(args, softcap=0.0, label_smoothing=0.0, z_loss=0.0) if options else args


def _rms_args() -> dict:
    return dict(x=torch.randn(N, C), weight=torch.randn(C), eps=1e-5, out_dtype=torch.float32)


def _rms_backward_args() -> dict:
    x, weight = torch.randn(N, C), torch.randn(C)
    _, rstd = OPS.rms_norm(x, weight, 1e-5, torch.float32)
    return dict(dy=torch.randn(N, C), d_summed=None, x=x, weight=weight, rstd=rstd)


# --------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------

_INTS = [-2, -1, 0, 1, 3]  # every window side and count below its range, the ends, inside
_TORCH_ONLY = ("torch",)  # pure PyTorch code: one backend


def _entries() -> list[Entry]:
    entries = []
    for name, run in (
        ("cross_entropy", cross_entropy),
        ("linear_cross_entropy", linear_cross_entropy),
    ):
        for option in ("softcap", "label_smoothing", "z_loss"):
            entries.append(Entry(f"fastlm.{name}", option, lambda v, r=run, o=option: r(**{o: v})))
        entries.append(
            Entry(
                f"fastlm.{name}",
                "ignore_index",
                lambda v, r=run: r(ignore_index=v),
                valid=[-100, 2**63 - 1],
            )
        )
    entries.append(
        Entry(
            "fastlm.linear_cross_entropy",
            "chunk_size",
            lambda v: linear_cross_entropy(chunk_size=v),
            none_ok=True,
            valid=[None, 1, 2, 2**31 - 1],
        )
    )
    for name, run in (
        ("flash_attention", flash_attention),
        ("flash_attention_varlen", flash_attention_varlen),
    ):
        entries += [
            Entry(
                f"fastlm.{name}",
                "softmax_scale",
                lambda v, r=run: r(softmax_scale=v),
                none_ok=True,
                valid=[None, -1e6, -1, 0, 0.125, 1e6],
            ),
            Entry(f"fastlm.{name}", "softcap", lambda v, r=run: r(softcap=v)),
        ]
        for side in (0, 1):  # the other side unbounded
            entries.append(
                Entry(
                    f"fastlm.{name}",
                    "window_size",
                    lambda v, r=run, s=side: r(window_size=(v, -1) if s == 0 else (-1, v)),
                    named=f"window_size[{side}]",
                    valid=[-1, 0, 3, 2**30],
                )
            )
    for option in ("max_seqlen_q", "max_seqlen_k"):
        # Below the longest document (5) the cu_seqlens check refuses it, naming it.
        entries.append(
            Entry(
                "fastlm.flash_attention_varlen",
                option,
                lambda v, o=option: flash_attention_varlen(**{o: v}),
                valid=[5, 6, 64],
                invalid=[0, 4],
            )
        )
    entries += [
        Entry(
            "fastlm.rope_attention",
            "softmax_scale",
            lambda v: rope_attention(softmax_scale=v),
            none_ok=True,
            valid=[None, 1e-3, 1e6],  # causal: <= 0 is NaN on PyTorch (docs/options.md)
        ),
        Entry(
            "fastlm.rope_attention",
            "num_kv_heads",
            lambda v: rope_attention(num_kv_heads=v),
            none_ok=True,
            valid=[None, 1, 2],
            invalid=[3],
        ),
        Entry(
            "fastlm.rope_attention",
            "max_seqlen",
            lambda v: rope_attention(max_seqlen=v),
            none_ok=True,
            valid=[None, 0, 9, 2**31 - 1],
        ),  # unpacked: read by nothing
        Entry("fastlm.rms_norm", "eps", lambda v: rms_norm(eps=v)),
        Entry("fastlm.rms_norm", "offset", lambda v: rms_norm(offset=v)),
        Entry("fastlm.add_rms_norm", "eps", lambda v: add_rms_norm(eps=v)),
        *(
            Entry(
                f"fastlm.{name}",
                option,
                lambda v, r=run, o=option: r(**{o: v}),
                none_ok=option == "limit",
            )
            for name, run in (("swiglu", swiglu), ("swiglu_packed", swiglu_packed))
            for option in ("alpha", "limit", "up_offset")
        ),  # fmt: skip
        *(
            Entry(
                "fastlm.moe_experts",
                option,
                lambda v, o=option: moe_experts(**{o: v}),
                none_ok=option == "limit",
                valid=valid,
            )
            for option, valid in MOE_VALID.items()
        ),  # fmt: skip
        # at least the 3 experts the weights hold; past them, ids there choose no expert
        Entry(
            "fastlm.moe_experts",
            "num_experts",
            lambda v: moe_experts(num_experts=v),
            none_ok=True,
            valid=[3, 4, 1000],
            invalid=[1, 2],
        ),
        Entry(
            "fastlm.kernels.rope_tables",
            "theta",
            lambda v: rope_tables(v, D, 16),
            backends=_TORCH_ONLY,
        ),
        Entry("fastlm.RmsNorm", "eps", lambda v: [fastlm.RmsNorm(C, eps=v)(torch.randn(N, C))]),
        Entry(
            "fastlm.RoPE",
            "theta",
            lambda v: [fastlm.RoPE(v, D, 8)(torch.randn(1, 8, D), torch.arange(8))],
        ),
        Entry(
            "fastlm.CrossEntropyLoss",
            "ignore_index",
            lambda v: [fastlm.CrossEntropyLoss(v)(torch.randn(N, V), torch.randint(0, V, (N,)))],
            valid=[-100, 0],
        ),
    ]
    # The model's parts hand norm_eps to RmsNorm and theta to RoPE (their messages name eps and
    # theta), and check num_kv_heads as the reference does (a ValueError or TypeError naming it;
    # 3 does not divide the 2 query heads).
    models = (
        ("fastlm.Transformer", transformer, "rope_theta"),
        ("fastlm.TransformerBlock", block, "theta"),
        ("fastlm.MultiHeadAttentionWithRoPE", attention_module, "theta"),
    )
    for where, run, theta in models:
        entries.append(Entry(where, theta, lambda v, r=run, t=theta: r(**{t: v}), named="theta"))
        entries.append(
            Entry(
                where,
                "num_kv_heads",
                lambda v, r=run: r(num_kv_heads=v),
                none_ok=True,
                valid=[None, 1, 2],
                invalid=[3],
                type_error=(TypeError, ValueError),
            )
        )
        if run is not attention_module:
            entries.append(Entry(where, "norm_eps", lambda v, r=run: r(norm_eps=v), named="eps"))
    # The mixture-of-experts options, beside a num_experts that makes them read: checked when
    # the model is built, before any kernel runs (one backend).
    moe = dict(num_experts=4, experts_per_token=2)
    for where, run, type_error in (
        ("fastlm.Transformer", transformer, TypeError),
        ("fastlm.ModelConfig", model_config, ValueError),
    ):
        for option, kwargs in (
            ("num_experts", dict(valid=[0, 2, 5], invalid=[1])),  # 1: below experts_per_token
            ("experts_per_token", dict(valid=[1, 4], invalid=[5])),
            ("num_shared_experts", dict(valid=[0, 1])),
            ("first_dense_layers", dict(valid=[0], invalid=[1])),  # 1: every layer dense
            ("aux_loss_coef", dict(valid=[0.0, 0.01, 1])),
            ("z_loss_coef", dict(valid=[0.0, 1e-3, 1])),
            ("router_bias_rate", dict(valid=[0.0, 1e-3, 1])),
        ):
            entries.append(
                Entry(
                    where,
                    option,
                    lambda v, r=run, o=option: r(**{**moe, o: v}),
                    backends=_TORCH_ONLY,
                    type_error=type_error,
                    **kwargs,
                )
            )
    # Sampling runs on PyTorch alone; ModelConfig's rule is the commands': every bad value, of
    # the wrong type too, a ValueError naming the field.
    settings = dict(none_ok=True)
    for where, run, option, kwargs in (
        ("fastlm.sample", sample, "temperature", {}),
        ("fastlm.sample", sample, "top_k", settings),
        ("fastlm.sample", sample, "top_p", settings),
        ("fastlm.sample", sample, "vocab_size", settings),
        ("fastlm.sample", sample, "max_new_tokens", dict(valid=[0, 1, 3])),
        ("fastlm.ModelConfig", model_config, "norm_eps", dict(type_error=ValueError)),
        ("fastlm.ModelConfig", model_config, "rope_theta", dict(type_error=ValueError)),
        ("fastlm.ModelConfig", model_config, "num_kv_heads",
         dict(settings, valid=[None, 1, 2], invalid=[3], type_error=ValueError)),
    ):  # fmt: skip
        entries.append(
            Entry(
                where,
                option,
                lambda v, r=run, o=option: r(**{o: v}),
                backends=_TORCH_ONLY,
                **kwargs,
            )  # fmt: skip
        )
    return entries + _op_entries()


def _op_entries() -> list[Entry]:
    """The ops' numeric arguments (their public names in the messages)."""
    ops = []

    def add(op, make_args, option, **kwargs):
        kwargs.setdefault("backends", ("triton",))
        # The schema refuses a value of the wrong type for an int (a float, a str) or a str, a
        # tensor, None for a float, naming the argument; `check` refuses a bool.
        kwargs.setdefault("type_error", (TypeError, RuntimeError))
        run = _op(op, make_args)
        ops.append(Entry(f"torch.ops.fastlm.{op}", option, lambda v: run(**{option: v}), **kwargs))

    side = dict(named="window_size", valid=[-1, 0, 3, 2**30])
    for op, make_args in (
        ("flash_attention", _attention_args),
        ("flash_attention_backward", _attention_backward_args),
        ("flash_attention_varlen", lambda: _attention_args(True)),
        ("flash_attention_varlen_backward", lambda: _attention_backward_args(True)),
    ):
        # A backward op takes the forward's options with its lse: only those run there.
        backward = op.endswith("backward")
        add(op, make_args, "softmax_scale", valid=[0.25] if backward else [-1e6, 0, 0.125, 1e6])
        add(op, make_args, "softcap", **(dict(valid=[0.0]) if backward else {}))
        add(op, make_args, "window_left", **dict(side, **(dict(valid=[-1]) if backward else {})))
        add(op, make_args, "window_right", **dict(side, **(dict(valid=[-1]) if backward else {})))
        if "varlen" in op:
            for option in ("max_seqlen_q", "max_seqlen_k"):
                # Below the longest document: the public function's check (of cu_seqlens'
                # values, on the host), not the op's.
                add(op, make_args, option, valid=[5, 64])
    add("flash_attention_backward_", _flash_backward_inplace_args, "softmax_scale", valid=[0.25])
    add("flash_attention_backward_", _flash_backward_inplace_args, "max_seqlen", valid=[0])
    for op, make_args in (
        ("cross_entropy_options", _ce_options_args),
        ("cross_entropy_options_backward", lambda: _ce_backward_args(True)),
        ("linear_cross_entropy_options", lambda: _lce_args(True)),
    ):
        for option in ("softcap", "label_smoothing", "z_loss"):
            add(op, make_args, option)
    for op, make_args in (
        ("cross_entropy", _ce_args),
        ("cross_entropy_", _ce_args),
        ("cross_entropy_backward", lambda: _ce_backward_args(False)),
        ("cross_entropy_options", _ce_options_args),
        ("cross_entropy_options_backward", lambda: _ce_backward_args(True)),
        ("linear_cross_entropy", lambda: _lce_args(False)),
        ("linear_cross_entropy_options", lambda: _lce_args(True)),
    ):
        # Any int64 is an ignore_index; the schema refuses the rest (a float, a str, a tensor).
        add(op, make_args, "ignore_index", valid=[-100, 2**63 - 1])
    for op, make_args in (
        ("linear_cross_entropy", lambda: _lce_args(False)),
        ("linear_cross_entropy_options", lambda: _lce_args(True)),
    ):
        add(op, make_args, "chunk_size", valid=[1, 2, 2**31 - 1])
    add("rms_norm", _rms_args, "eps")
    add("rms_norm", _rms_args, "offset")
    add("add_rms_norm", lambda: dict(_rms_args(), residual=torch.randn(N, C)), "eps")
    add(
        "rms_norm_backward",
        lambda: dict(_rms_backward_args(), dx_dtype=torch.float32, dx2_dtype=None),
        "offset",
    )
    for packed in (False, True):
        for backward in (False, True):
            op = (
                "swiglu"
                + ("_packed" if packed else "")
                + "_options"
                + ("_backward" if backward else "")
            )
            make_args = lambda p=packed, b=backward: _swiglu_options_args(p, b)  # noqa: E731
            for option in ("alpha", "limit", "up_offset"):
                add(op, make_args, option, none_ok=option == "limit")
    add(
        "moe_route",
        lambda: dict(expert_ids=torch.tensor([[0, 2], [1, 0]]), num_experts=3),
        "num_experts",
        valid=[3, 4, 1000],
        invalid=[0],
    )
    for backward in (False, True):
        for option, valid in MOE_VALID.items():
            op = "moe_experts_backward" if backward else "moe_experts"
            add(op, lambda b=backward: _moe_args(b), option, none_ok=option == "limit", valid=valid)
    return ops


def _swiglu_options_args(packed: bool, backward: bool) -> dict:
    """gpt-oss's options, on an interleaved gate_up when `packed`."""
    args = dict(alpha=1.702, limit=7.0, up_offset=1.0)
    if packed:
        args.update(gate_up=torch.randn(N, 2 * C), interleaved=True)
    else:
        args.update(gate=torch.randn(N, C), up=torch.randn(N, C))
    return dict(args, dy=torch.randn(N, C)) if backward else args


def _flash_backward_inplace_args() -> dict:
    args = _attention_backward_args()
    for name in ("window_left", "window_right", "softcap"):
        del args[name]
    q, k, v = args["q"], args["k"], args["v"]
    return dict(args, dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v))


REGISTRY = _entries()

#: Numeric parameters that are sizes (their functions' shape checks cover them), not options.
SIZES = {
    "vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff", "max_seq_len",
    "d_k", "max_new_tokens", "moe_d_ff",
}  # fmt: skip


# --------------------------------------------------------------------------------------------
# The values tried
# --------------------------------------------------------------------------------------------


def _inside(entry: Entry, value) -> bool:
    spec = entry.spec
    if value is None:
        return entry.none_ok
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if spec.kind is int and not isinstance(value, int):
        return False
    if not math.isfinite(value):
        return False
    low_ok = spec.low < value if spec.low_open else spec.low <= value
    return low_ok and value <= spec.high and value not in entry.invalid


def _values(entry: Entry) -> tuple[list, list]:
    """(values that must run, values that must be refused) for `entry`."""
    spec = entry.spec
    step = 1 if spec.kind is int else max(abs(spec.high), 1.0) * 1e-3
    candidates = [math.nan, math.inf, -math.inf, -1, 0, 1, 0.5, 1e39, 2**64, spec.low,
                  spec.low - (1 if spec.kind is int else max(abs(spec.low), 1.0) * 1e-3),
                  spec.high, spec.high + step, *entry.invalid]  # fmt: skip
    if spec.kind is float:
        candidates += [float(spec.low), 1e-3]
    refused = [v for v in candidates if not _inside(entry, v)]
    if entry.valid is not None:
        accepted = list(entry.valid)
    else:
        accepted = [v for v in dict.fromkeys(candidates) if _inside(entry, v)]
    wrong_types = ["1", [1]] + ([] if entry.none_ok else [None])
    # PyTorch's dispatcher turns a bool or a 0-d tensor given for an op's number into that
    # number before the op runs: there they are 1, accepted where 1 is.
    converted = [True, torch.tensor(1.0)]
    if not entry.where.startswith("torch.ops"):
        wrong_types += converted
    elif _inside(entry, 1) and entry.valid is None:
        accepted += converted
    if spec.kind is int:
        wrong_types.append(1.0)
    return accepted, refused + wrong_types


_CASES = [
    pytest.param(entry, backend, id=f"{entry!r}-{backend}")
    for entry in REGISTRY
    for backend in entry.backends
]


@pytest.mark.parametrize("entry, backend", _CASES)
def test_option(entry: Entry, backend: str, monkeypatch):
    monkeypatch.setenv("FASTLM_BACKEND", backend)
    accepted, refused = _values(entry)
    named = entry.named or entry.option
    for value in accepted:
        _leaves.clear()
        out = entry.run(value)
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if torch.is_tensor(t) and t.is_floating_point():
                assert torch.isfinite(t).all(), f"{entry!r} = {value!r}: a non-finite result"
    for value in refused:
        _leaves.clear()
        wrong_type = not isinstance(value, (int, float)) or isinstance(value, bool)
        wrong_type = wrong_type or (entry.spec.kind is int and isinstance(value, float))
        error = entry.type_error if wrong_type else ValueError
        if entry.where.startswith("torch.ops") and isinstance(value, int) and abs(value) >= 2**63:
            error = (ValueError, RuntimeError, TypeError, OverflowError)  # not an int64: the schema
        with pytest.raises(error) as caught:
            entry.run(value)
        message = str(caught.value)
        assert named in message or entry.option in message, f"{entry!r} = {value!r}: {message}"


# Tensor options: one value per head, so the rule is applied to each element (and the tensor's
# type, dtype and shape). `sinks` (attention sinks, one logit per query head): -inf is "no sink"
# (the plain result, tested bit for bit in test_attention), any logit up to SINK_MAX in magnitude
# as float32 holds it runs; nan, +inf and what float32 or the kernels' base 2 cannot hold (an fp32
# 2.5e38, a float64 1e300) are refused; a number where a tensor belongs, an integer tensor or
# another shape too.
TENSOR_OPTIONS = [
    ("flash_attention", flash_attention),
    ("flash_attention_varlen", flash_attention_varlen),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("where, run", TENSOR_OPTIONS, ids=[w for w, _ in TENSOR_OPTIONS])
def test_sinks_follow_the_rule(where, run, backend, monkeypatch):
    monkeypatch.setenv("FASTLM_BACKEND", backend)
    largest = _largest_sink()
    for fill in (-math.inf, -largest, -1e30, -1.0, 0.0, 1.0, 1e30, largest):
        _leaves.clear()
        for t in run(sinks=torch.full((H,), fill)):
            assert torch.isfinite(t).all(), f"{where}: sinks = {fill}: a non-finite result"
    refused = [
        (torch.full((H,), math.nan), ValueError),
        (torch.full((H,), math.inf), ValueError),
        (torch.full((H,), 2.5e38), ValueError),  # float32, but inf in base 2
        (torch.full((H,), -2.5e38), ValueError),
        (torch.full((H,), 1e300, dtype=torch.float64), ValueError),  # inf in float32
        (torch.zeros(H + 1), ValueError),
        (torch.zeros(H, dtype=torch.int64), TypeError),
        (0.5, TypeError),
    ]
    for value, error in refused:
        _leaves.clear()
        with pytest.raises(error, match="sinks"):
            run(sinks=value)


def _largest_sink() -> float:
    """The largest sink the rule accepts: SINK_MAX rounded down to float32."""
    largest = torch.tensor(SINK_MAX).float()
    if largest.item() > SINK_MAX:
        largest = torch.nextafter(largest, torch.tensor(0.0))
    return largest.item()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_largest_sinks_are_exact(backend, monkeypatch):
    """At the rule's bound (+-SINK_MAX as float32) the results are the exact ones, forward and
    backward: head 0's sink outweighs every key (output 0, lse the sink, no gradient), head 1's
    weighs nothing (the result without sinks, a gradient of 0). The ops refuse what the
    functions refuse."""
    monkeypatch.setenv("FASTLM_BACKEND", backend)
    largest = _largest_sink()
    q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
    sinks = torch.tensor([largest, -largest], requires_grad=True)
    o, lse = fastlm.flash_attention(q, k, v, sinks=sinks, return_lse=True)
    do = torch.randn_like(o)
    dq, dk, dv, dsinks = torch.autograd.grad(o, (q, k, v, sinks), do)
    qkv = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o_ref, lse_ref = flash_attention_ref(*qkv, return_lse=True)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(o_ref, qkv, do.double())
    assert torch.equal(o[:, 0], torch.zeros_like(o[:, 0]))
    assert_close(lse[:, 0], torch.full_like(lse[:, 0], largest, dtype=torch.float64), torch.float32)
    assert_close(o[:, 1], o_ref[:, 1], torch.float32, "head 1's output")
    assert_close(lse[:, 1], lse_ref[:, 1], torch.float32, "head 1's lse")
    # The keys' gradients: head 0 reads none (P = 0), head 1 as without a sink.
    assert torch.equal(dq[:, 0], torch.zeros_like(dq[:, 0]))
    for name, out, ref in (("dq", dq, dq_ref), ("dk", dk, dk_ref), ("dv", dv, dv_ref)):
        assert_close(out[:, 1], ref[:, 1], torch.float32, f"head 1's {name}")
        assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0])), f"head 0's {name}"
    assert torch.equal(dsinks, torch.zeros_like(dsinks))
    args = dict(_attention_args(), sinks=torch.full((H,), 1e300, dtype=torch.float64))
    with pytest.raises(ValueError, match="sinks"):
        OPS.flash_attention(**args)
    with pytest.raises(ValueError, match="sinks"):
        OPS.flash_attention_backward(**_attention_backward_args(), sinks=args["sinks"])


def test_a_wide_window_is_no_window():
    """The largest window side the rule accepts is the unbounded window, not an int32 overflow
    inside the kernel (which would mask every key): the float64 reference of full attention, at
    float32's bound, on both backends."""
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    reference = flash_attention_ref(q.double(), k.double(), v.double(), False)
    for backend in ("torch", "triton"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FASTLM_BACKEND", backend)
            wide = fastlm.flash_attention(q, k, v, False, window_size=(WINDOW_MAX, WINDOW_MAX))
        assert_close(wide, reference, torch.float32, f"{backend} output")


def test_the_rule_itself():
    """`check` on the cases the registry relies on: the type before the value, the range's ends,
    None only when allowed."""
    assert check("softcap", 0) == 0.0 and isinstance(check("softcap", 0), float)
    assert check("chunk_size", 7) == 7 and check("top_p", None, none_ok=True) is None
    with pytest.raises(TypeError, match="softcap must be a real number"):
        check("softcap", math.nan > 0)  # a bool, though False == 0
    with pytest.raises(TypeError, match="top_p must be a real number .* or None, got str"):
        check("top_p", "0.5", none_ok=True)
    with pytest.raises(ValueError, match=r"top_p must be a finite number in \(0, 1\], got 0"):
        check("top_p", 0)
    with pytest.raises(ValueError, match=r"eps must be a finite number in \(0, 3.4e38\]"):
        check("eps", FLOAT32_MAX * 2)
    with pytest.raises(ValueError, match=r"window_size\[1\] must be an int in \[-1, 2\*\*30\]"):
        check("window_size[1]", -2, spec="window_size")


def _numeric(annotation) -> bool:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    text = str(text)
    return any(word in text.replace("|", " ").replace("[", " ").replace(",", " ").split()
               for word in ("float", "int"))  # fmt: skip


def _public_callables() -> dict[str, Callable]:
    found = {}
    for module, prefix in ((fastlm, "fastlm"), (fastlm.kernels, "fastlm.kernels")):
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj) and f"fastlm.{name}" not in found:  # the kernels' once, as fastlm's
                found[f"{prefix}.{name}"] = obj
    return found


def test_every_numeric_option_is_registered():
    """Each numeric parameter of the public API and each float/int argument of an op is in the
    registry (or is a size): a new one fails here until it gets the class-wide checks."""
    registered = {(entry.where, entry.option) for entry in REGISTRY}
    missing = []
    for where, obj in _public_callables().items():
        target = obj.__init__ if inspect.isclass(obj) else obj
        try:
            parameters = inspect.signature(target).parameters.values()
        except (TypeError, ValueError):
            continue
        for p in parameters:
            if p.name in ("self", "device", "dtype") or not _numeric(p.annotation):
                continue
            if (where, p.name) not in registered and p.name not in SIZES:
                missing.append(f"{where}({p.name})")
    for name in dir(OPS):
        packet = getattr(OPS, name)
        if not hasattr(packet, "default"):
            continue
        for argument in packet.default._schema.arguments:
            if str(argument.real_type) in ("float", "int", "SymInt"):  # not a ScalarType
                if (f"torch.ops.fastlm.{name}", argument.name) not in registered:
                    missing.append(f"torch.ops.fastlm.{name}({argument.name})")
    assert not missing, "numeric options without an Entry in tests/test_options.py: " + ", ".join(
        missing
    )
