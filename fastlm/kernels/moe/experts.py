"""Fused mixture-of-experts experts: the routed tokens through their experts' gated MLPs.

For tokens x (T, D), the router's choice expert_ids (T, k) and expert_weights (T, k), and the
stacked experts' weights gate_up (E, 2F, D) and down (E, D, F) (transformers 5's layouts; with
`transposed`, (E, D, 2F) and (E, F, D), read through their strides, never copied):

    out[t] = sum_j w[t, j] * (down_e @ h[t, j] + b2_e),    e = expert_ids[t, j]
    h[t, j] = act(gate, up),  (gate, up) = split(gate_up_e @ x[t] + b1_e)

with `split` the halves of the 2F rows (gate first) or, `interleaved`, their even and odd rows
(gpt-oss), and act SwiGLU (with gpt-oss's alpha, limit, up_offset) or GeGLU
(`fastlm.kernels.swiglu.gated_unit`). Each assignment (t, j) is one row a = t k + j.

Non-gated experts (transformers' `has_gate=False`: Nemotron-H) have no gate: gate_up holds the
up projection alone, (E, F, D) (transposed (E, D, F)), and h[t, j] = act(up_e @ x[t] + b1_e)
with act ReLU² (`relu(u)^2`, act'(u) = 2 relu(u)); the kernels are the same with one
projection instead of two (GATED off). The kernels are in `fastlm.kernels.moe.kernels`; this
module has the reference, the launchers, the ops and the public function.

Forward (four launches after the routing metadata of `fastlm.kernels.moe.routing`):

1. grouped GEMM 1 over the expert-major order: each program takes BLOCK_M rows of one expert,
   loads their x rows by token index (no permuted copy of x), multiplies by the expert's gate
   and up rows and applies the activation in its epilogue: h (T k, F) in x's dtype;
2. grouped GEMM 2: y = w * (h @ down_e^T + b2_e), written to row a (the token-major order);
3. combine: out[t] = sum_j y[t k + j], in a fixed order (no atomics: deterministic).

Backward, with g = dout (T, D):

    dh[a]      = w_a * (down_e^T g[t])            d w_a = <g[t], down_e h_a + b2_e>
    (d gate, d up) = act'(dh)                      d b1_e = sum over e's rows of (d gate | d up)
    (non-gated: d up = dh act'(up) alone)
    d down_e   = sum over e's rows of (w_a g[t]) h_a^T,   d b2_e = sum of w_a g[t]
    d gate_up_e = sum over e's rows of (d gate | d up) x[t]^T
    dx[t]      = sum_j gate_up_e^T (d gate | d up)[a]

1. one kernel per (tile, F block) recomputes gate and up (x gathered, both projections) and
   down_e^T g[t] in one loop over D, then writes w_a h and (d gate | d up) in sorted order and
   each F block's share of d w (summed over blocks afterwards: no atomics; <g[t], b2_e> by
   block 0 alone);
2. the weight gradients: per expert a GEMM whose reduction runs over that expert's rows (ragged
   in K), one program per (expert, output tile) summing every row, so no atomics; the bias
   gradients (d b2 = sum of w_a g[t]) in a loop of their own after it;
3. dx: grouped GEMM 1's kernel on (d gate | d up) against gate_up^T, then the combine.

Saved for the backward: the inputs (x, expert_weights, the weights and biases: no copies) and
the routing metadata (sorted_assignments (T k,) int32, expert_offsets (E + 1,) int32). Not
saved: gate/up (T k, 2F), h (T k, F) and y (T k, D), recomputed in the backward (one more
grouped GEMM's worth of work, docs/moe.md has the bytes this saves).

Math in fp32 accumulators; h, y and the gradients' intermediates in x's dtype, as an unfused
model rounds them. fp32 inputs multiply in IEEE fp32 (no TF32).
"""

from __future__ import annotations

import torch

from fastlm.backend import interpreting, use_triton
from fastlm.kernels._common import (
    capability,
    check_float,
    check_match,
    check_values,
    empty,
    interpreter_bf16,
    refuse_double_backward,
    triton,
)
from fastlm.kernels.geglu import geglu_ref
from fastlm.kernels.moe.kernels import (
    _combine_kernel,
    _expert_grad_kernel,
    _grouped_gemm_kernel,
    _hidden_backward_kernel,
)
from fastlm.kernels.moe.routing import route, route_ref
from fastlm.kernels.swiglu import GELU, GELU_TANH, SILU_OPTIONS, split_gate_up, swiglu_ref
from fastlm.options import check

#: The kernels' constant of the non-gated ReLU² (after swiglu's gated units' constants) and of
#: no activation (the plain GEMMs).
RELU2, NO_ACTIVATION = 4, -1
#: The activations and their constant in the kernels (SwiGLU always through SILU_OPTIONS: with
#: the default options its math is SiLU's).
ACTIVATIONS = {"silu": SILU_OPTIONS, "gelu_tanh": GELU_TANH, "gelu": GELU, "relu2": RELU2}
#: The activations of non-gated experts, act(up) with no gate (gate_up then holds up alone).
UNGATED = ("relu2", )

# --------------------------------------------------------------------------------------------
# Reference math (the PyTorch backend, and what the tests compare with in float64)
# --------------------------------------------------------------------------------------------


def relu2_ref(up: torch.Tensor) -> torch.Tensor:
    """ReLU², relu(up)^2 (Nemotron-H's experts), in up's dtype."""
    return torch.relu(up).square()


def _gated_ref(gate, up, activation: str, alpha: float, limit: float | None, up_offset: float):
    if activation == "silu":
        return swiglu_ref(gate, up, alpha=alpha, limit=limit, up_offset=up_offset)
    return geglu_ref(gate, up, "tanh" if activation == "gelu_tanh" else "none")


def moe_experts_ref(
    x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, gate_up: torch.Tensor,
    down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None, *, transposed: bool = False, interleaved: bool = False,
    activation: str = "silu", alpha: float = 1.0, limit: float | None = None,
    up_offset: float = 0.0, num_experts: int | None = None, expert_index: torch.Tensor | None = None
) -> torch.Tensor:
    """`moe_experts` as a loop over experts in PyTorch: fp32 inside (fp64 for fp64), h rounded
    to x's dtype as the kernels round it, the result in x's dtype. A non-gated activation
    (UNGATED) takes gate_up as the up projection alone: h = act(gate_up_e x + b1_e).
    `expert_index` (E,): the global id of each weight slot (the ops' argument for experts
    sharded over E); the ids of expert_ids no slot holds contribute nothing, so `num_experts`
    (the op's, for ids past the weights' E) needs nothing here."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.zeros(x.shape, device=x.device, dtype=compute)
    for e in range(gate_up.shape[0]):
        held = e if expert_index is None else int(expert_index[e])
        tokens, slots = (expert_ids == held).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        w1 = gate_up[e].T if transposed else gate_up[e]  # (2F, D), or (F, D) non-gated
        w2 = down[e].T if transposed else down[e]  # (D, F)
        gu = x[tokens].to(compute) @ w1.to(compute).T
        if gate_up_bias is not None:
            gu = gu + gate_up_bias[e].to(compute)
        if activation in UNGATED:
            h = relu2_ref(gu).to(x.dtype)
        else:
            gate, up = split_gate_up(gu, interleaved)
            h = _gated_ref(gate, up, activation, alpha, limit, up_offset).to(x.dtype)
        y = h.to(compute) @ w2.to(compute).T
        if down_bias is not None:
            y = y + down_bias[e].to(compute)
        out = out.index_add(0, tokens, y * expert_weights[tokens, slots, None].to(compute))
    return out.to(x.dtype)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _indexed(t: torch.Tensor, transposed: bool) -> tuple[int, int, int]:
    """t's strides in the (E, rows, columns) order of the untransposed layout: a transposed
    weight (or its gradient) is the untransposed one with its last two strides swapped."""
    s = t.stride()
    return (s[0], s[2], s[1]) if transposed else s


def _gated(activation: str, interleaved: bool) -> bool:
    """Whether the activation has a gate; `interleaved` (gate and up rows paired) needs one."""
    gated = activation not in UNGATED
    if interleaved and not gated:
        raise ValueError(
            f"interleaved pairs gate and up rows; activation={activation!r} has no gate"
        )
    return gated


class _Layout:
    """The experts' weights as the kernels index them: W1[e, n, k] (n over gate_up's 2F rows,
    k over D) and W2[e, d, f] through strides, whatever `transposed` says; where gate and up of
    hidden column c are (rows gate_step c and up_row + gate_step c). Non-gated (`activation` in
    UNGATED): W1's F rows are up's, hidden column c row c."""

    def __init__(
        self, gate_up: torch.Tensor, down: torch.Tensor, transposed: bool, interleaved: bool,
        activation: str
    ):
        self.w1 = _indexed(gate_up, transposed)  # strides over e, the 2F (or F) rows, D
        self.w2 = _indexed(down, transposed)  # strides over e, D, F
        self.num_experts = gate_up.shape[0]
        self.gated = _gated(activation, interleaved)
        rows = gate_up.shape[2] if transposed else gate_up.shape[1]
        self.d_ff = rows // 2 if self.gated else rows
        self.gate_step, self.up_row = (2, 1) if interleaved else (1, self.d_ff)
        self.activation = ACTIVATIONS[activation]


def _bias_strides(bias: torch.Tensor | None) -> tuple[int, int]:
    return (0, 0) if bias is None else bias.stride()


def _configs(dtype: torch.dtype, major: int) -> dict:
    """Tiles per kernel and per GPU generation (`major`: the compute capability's, 0 off CUDA):
    small under the interpreter (it pays per element of a tile, and the tests' odd sizes then
    span several tiles), MMA-sized on a GPU (8 warps where two or three accumulators share a
    program), smaller for fp32, whose IEEE dots run without tensor cores: the compile report's
    rows (each arch compiled with its own choice) show no spills with these."""
    if interpreting():
        small = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=1)
        grad = dict(BLOCK_I=64, BLOCK_J=64, BLOCK_R=16, num_warps=1)
        return dict(
            gated=small, plain=small, hidden=small, hidden_transposed=small, hidden_plain=small,
            grad=grad, combine=dict(BLOCK_T=16, BLOCK_D=64, num_warps=1)
        )  # fmt: skip
    combine = dict(BLOCK_T=4, BLOCK_D=512, num_warps=4)
    if dtype == torch.float32:
        return dict(
            gated=dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=16, num_warps=8, num_stages=2),
            plain=dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=16, num_warps=4, num_stages=2),
            hidden=dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, num_warps=8, num_stages=2),
            hidden_transposed=dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, num_warps=8, num_stages=2),
            hidden_plain=dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, num_warps=8, num_stages=2),
            grad=dict(BLOCK_I=32, BLOCK_J=64, BLOCK_R=16, num_warps=4, num_stages=2),
            combine=combine,
        )
    # The backward's recompute kernel by the hot-loop model (docs/moe.md; bf16, D 2048, F 768):
    # SwiGLU 64% -> 67% on sm_90a at 128 x 64 x 32 once its loop lost the row masks, 74% at
    # K 64 on Hopper and Blackwell, whose tensor cores read both operands from shared memory;
    # K 64 spills on sm_80 (mma.sync's operands sit in registers), which keeps K 32. gpt-oss's
    # form (gate/up pairs, the clamp, biases: more registers in the epilogue; 128 x 64 spills)
    # at 64 x 128 x 64 on sm_90a (71%), 128 x 32 x 128 on sm_100a (64 x 128 spills there),
    # 128 x 32 x 32 on sm_80. Non-gated experts (ReLU², two products, not three: one
    # accumulator fewer) at K 128 on Hopper and Blackwell: 69% -> 74% on sm_90a.
    hidden_plain = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=2)
    if major >= 10:
        hidden = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3)
        hidden_transposed = dict(BLOCK_M=128, BLOCK_N=32, BLOCK_K=128, num_warps=8, num_stages=2)
    elif major == 9:
        hidden = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3)
        hidden_transposed = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=2)
    else:
        hidden = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, num_warps=8, num_stages=3)
        hidden_transposed = dict(BLOCK_M=128, BLOCK_N=32, BLOCK_K=32, num_warps=8, num_stages=3)
        hidden_plain = hidden  # K 128 spills there
    return dict(
        # 128-row tiles: the hot-loop model (docs/moe.md) gives the tensor cores 70-72% of the
        # forward GEMMs' loop on sm_90a against 58-68% at 64 rows (74% and 81% once A's rows
        # took no mask in the loop)
        gated=dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3),
        # 72% -> 76% (dx 68% -> 72%) at K 128 with two stages (128 KB of shared memory)
        plain=dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=2),
        hidden=hidden,
        hidden_transposed=hidden_transposed,
        hidden_plain=hidden_plain,
        # The ragged-K weight gradients: 38% and 51% -> 65% at 128 x 256, R 64, then 80% once
        # their loop's whole blocks took no mask, int32 row offsets, and the bias sums (and
        # d down's routing-weight scale, now on h) left it (docs/moe.md)
        grad=dict(BLOCK_I=128, BLOCK_J=256, BLOCK_R=64, num_warps=8, num_stages=3),
        combine=combine,
    )


def _tile_grid(n_rows: int, num_experts: int, block_m: int, n_cols: int, block_n: int):
    """A grid with at least one program per tile: the tiles number at most cdiv(n_rows, BLOCK_M)
    plus one partial tile per expert; the programs past the last one return at once."""
    return (triton.cdiv(n_rows, block_m) + min(num_experts, n_rows), triton.cdiv(n_cols, block_n))


def _fp32_dot(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or interpreter_bf16(dtype)


def _option_args(options: dict) -> tuple[float, float, float]:
    """The kernels' (alpha, limit, up_offset) arguments: a limit of None is 0 (CLAMP off)."""
    alpha, limit, up_offset = options["alpha"], options["limit"], options["up_offset"]
    return float(alpha), 0.0 if limit is None else float(limit), float(up_offset)


def _past_int32(*tensors: torch.Tensor) -> bool:
    """Whether an element offset of one of these tensors may reach 2^31 (int32 offsets then
    overflow): the last element's offset, sum of (size - 1) stride, bounds them all."""
    return any(sum((n - 1) * s for n, s in zip(t.shape, t.stride())) >= 2**31 for t in tensors)


def _e_pad(num_experts: int) -> int:
    return max(16, triton.next_power_of_2(num_experts))


def _grouped_gemm(
    a, weight, w_strides, n_cols, sorted_assignments, expert_offsets, out, top_k, *, gather_a=False,
    scatter_out=False, act=None, bias=None, scale=None, config
):
    """`_grouped_gemm_kernel` over every tile: out's rows (sorted, or scattered to assignments)
    = a's rows (sorted, or gathered by token) times W_e[n, k] (`w_strides`: e, n, k) for n <
    n_cols. `act`: (layout, options) for the first GEMM's activation (of gate/up pairs when
    `layout.gated`, else of each column)."""
    n_rows, K = sorted_assignments.numel(), a.shape[1]
    num_experts = expert_offsets.numel() - 1
    grid = _tile_grid(n_rows, num_experts, config["BLOCK_M"], n_cols, config["BLOCK_N"])
    gated = act is not None and act[0].gated
    if act is None:
        activation, options = NO_ACTIVATION, dict(alpha=1.0, limit=None, up_offset=0.0)
        up_row, gate_step = 0, 1
    else:
        layout, options = act
        activation, up_row, gate_step = layout.activation, layout.up_row, layout.gate_step
    _grouped_gemm_kernel[grid](
        a, weight, bias if bias is not None else a,
        scale if scale is not None else a, sorted_assignments, expert_offsets, out, a.stride(0),
        a.stride(1), *w_strides, *_bias_strides(bias), out.stride(0), n_cols, K, num_experts, top_k,
        up_row, gate_step, *_option_args(options), E_PAD=_e_pad(num_experts), GATHER_A=gather_a,
        SCATTER_OUT=scatter_out, GATED=gated, PAIRED=gated and gate_step == 2,
        ACTIVATION=activation, CLAMP=options["limit"] is not None, HAS_BIAS=bias is not None,
        HAS_SCALE=scale is not None, MASK_K=K % config["BLOCK_K"] != 0, FP32_DOT=_fp32_dot(a.dtype),
        BF16_BY_HAND=interpreter_bf16(out.dtype), **config
    )


def _combine(y: torch.Tensor, out: torch.Tensor, top_k: int, config: dict) -> None:
    T, D = out.shape
    grid = (triton.cdiv(T, config["BLOCK_T"]), triton.cdiv(D, config["BLOCK_D"]))
    _combine_kernel[grid](
        y, out, y.stride(0), out.stride(0), T, D, top_k, BF16_BY_HAND=interpreter_bf16(out.dtype),
        **config
    )


def experts_forward(
    x, expert_weights, gate_up, down, gate_up_bias, down_bias, sorted_assignments, expert_offsets,
    transposed, interleaved, activation, options, some_held_elsewhere=False
) -> torch.Tensor:
    """out (T, D): grouped GEMM 1 (gather, activation), grouped GEMM 2 (scale, scatter), combine.
    `some_held_elsewhere`: the offsets cover only some assignments (experts sharded over E), whose
    rows the GEMMs do not write: they start at zero."""
    T, D = x.shape
    top_k = expert_weights.shape[1]
    layout = _Layout(gate_up, down, transposed, interleaved, activation)
    config = _configs(x.dtype, capability(x))
    sorted_assignments, expert_offsets = sorted_assignments.contiguous(), expert_offsets.contiguous(
    )
    out = empty((T, D), device=x.device, dtype=x.dtype)
    n = sorted_assignments.numel()
    if n == 0:
        return out
    scale = expert_weights.reshape(-1).contiguous()  # assignment a = t k + j, unit stride
    h = empty((n, layout.d_ff), device=x.device, dtype=x.dtype)
    _grouped_gemm(
        x, gate_up, layout.w1, layout.d_ff, sorted_assignments, expert_offsets, h, top_k,
        gather_a=True, act=(layout, options), bias=gate_up_bias,
        config=config["gated" if layout.gated else "plain"]  # non-gated: one accumulator
    )
    y = (torch.zeros if some_held_elsewhere else empty)((n, D), device=x.device, dtype=x.dtype)
    _grouped_gemm(
        h, down, layout.w2, D, sorted_assignments, expert_offsets, y, top_k, scatter_out=True,
        bias=down_bias, scale=scale, config=config["plain"]
    )
    _combine(y, out, top_k, config["combine"])
    return out


def _expert_grad(
    a, b, sorted_assignments, expert_offsets, out, out_strides, top_k, *, gather_a=False,
    gather_b=False, scale=None, bias_out=None, config
):
    """`_expert_grad_kernel`: out[e] (I, J) through `out_strides` (e, i, j), and bias_out[e]."""
    num_experts = expert_offsets.numel() - 1
    I, J = a.shape[1], b.shape[1]
    grid = (num_experts, triton.cdiv(I, config["BLOCK_I"]), triton.cdiv(J, config["BLOCK_J"]))
    masks = dict(MASK_I=I % config["BLOCK_I"] != 0, MASK_J=J % config["BLOCK_J"] != 0)
    _expert_grad_kernel[grid](
        a, b, scale if scale is not None else a, sorted_assignments, expert_offsets,
        out, bias_out if bias_out is not None else out, a.stride(0), a.stride(1), b.stride(0),
        b.stride(1), *out_strides, *_bias_strides(bias_out), I, J, top_k, GATHER_A=gather_a,
        GATHER_B=gather_b, HAS_BIAS=bias_out is not None, BIAS_SCALE=scale is not None, **masks,
        INT64=_past_int32(a, b), FP32_DOT=_fp32_dot(a.dtype),
        BF16_BY_HAND=interpreter_bf16(out.dtype), **config
    )


def experts_backward(
    dout, x, expert_weights, gate_up, down, gate_up_bias, down_bias, sorted_assignments,
    expert_offsets, transposed, interleaved, activation, options, some_held_elsewhere=False
):
    """(dx, d expert_weights, d gate_up, d down, d gate_up_bias, d down_bias) in the inputs'
    layouts and dtypes; a bias gradient is an empty tensor for a missing bias.
    `some_held_elsewhere`: as in `experts_forward` (their dx rows and d w start at zero)."""
    zeros_or_empty = torch.zeros if some_held_elsewhere else empty
    T, D = x.shape
    top_k = expert_weights.shape[1]
    layout = _Layout(gate_up, down, transposed, interleaved, activation)
    F, E = layout.d_ff, layout.num_experts
    w1_rows = 2 * F if layout.gated else F
    config = _configs(x.dtype, capability(x))
    sorted_assignments, expert_offsets = sorted_assignments.contiguous(), expert_offsets.contiguous(
    )
    n = sorted_assignments.numel()
    device, dtype = x.device, x.dtype
    dx = empty((T, D), device=device, dtype=dtype)
    d_gate_up = empty(gate_up.shape, device=device, dtype=dtype)
    d_down = empty(down.shape, device=device, dtype=dtype)
    d_b1 = empty((E, w1_rows), device=device, dtype=dtype) if gate_up_bias is not None else None
    d_b2 = empty((E, D), device=device, dtype=dtype) if down_bias is not None else None
    scale = expert_weights.reshape(-1).contiguous()
    # the recompute kernel's tiles: transposed weights (gpt-oss's), non-gated experts, the rest
    hidden = config["hidden_transposed" if transposed else "hidden" if layout.
                    gated else "hidden_plain"]
    n_col_blocks = triton.cdiv(F, hidden["BLOCK_N"])
    dw_blocks = zeros_or_empty((n_col_blocks, n), device=device, dtype=torch.float32)
    h = empty((n, F), device=device, dtype=dtype)
    dgu = empty((n, w1_rows), device=device, dtype=dtype)  # columns in gate_up's row order
    if n > 0:
        _hidden_backward_kernel[_tile_grid(n, E, hidden["BLOCK_M"], F, hidden["BLOCK_N"])](
            x, dout, gate_up, down, gate_up_bias if gate_up_bias is not None else x,
            down_bias if down_bias is not None else x, scale, sorted_assignments,
            expert_offsets, dgu, h, dw_blocks, x.stride(0), x.stride(1), dout.stride(0),
            dout.stride(1), *layout.w1, *layout.w2,
            *_bias_strides(gate_up_bias), *_bias_strides(down_bias), dgu.stride(0), h.stride(0),
            dw_blocks.stride(0), F, D, E, top_k, layout.up_row, layout.gate_step,
            *_option_args(options), E_PAD=_e_pad(E), ACTIVATION=layout.activation,
            CLAMP=options["limit"] is not None, HAS_B1=gate_up_bias is not None, HAS_B2=down_bias
            is not None, GATED=layout.gated, PAIRED=layout.gated and layout.gate_step == 2,
            MASK_K=D % hidden["BLOCK_K"] != 0, FP32_DOT=_fp32_dot(dtype),
            BF16_BY_HAND=interpreter_bf16(dtype), **hidden
        )
    # d down[e, d, f] = sum g[token][d] (w h)[f], w h written by the kernel above; with a down
    # bias, whose gradient sums w g[token], w scales g's rows instead (in registers).
    # d gate_up[e, n, d] = sum dgu[n] x[token][d]
    _expert_grad(
        dout, h, sorted_assignments, expert_offsets, d_down, _indexed(d_down, transposed), top_k,
        gather_a=True, scale=scale, bias_out=d_b2, config=config["grad"]
    )
    _expert_grad(
        dgu, x, sorted_assignments, expert_offsets, d_gate_up, _indexed(d_gate_up, transposed),
        top_k, gather_b=True, bias_out=d_b1, config=config["grad"]
    )
    if n > 0:
        # dx: each assignment's gate_up_e^T dgu in token-major rows, then summed per token
        dx_rows = zeros_or_empty((n, D), device=device, dtype=dtype)
        w1 = layout.w1
        _grouped_gemm(
            dgu, gate_up, (w1[0], w1[2], w1[1]), D, sorted_assignments, expert_offsets, dx_rows,
            top_k, scatter_out=True, config=config["plain"]
        )
        _combine(dx_rows, dx, top_k, config["combine"])
    else:
        dx.zero_()
    d_weights = dw_blocks.sum(0).view(expert_weights.shape).to(expert_weights.dtype)
    # an empty tensor for a missing bias (custom ops return tensors), each its own
    return (
        dx, d_weights, d_gate_up, d_down, x.new_empty(0) if d_b1 is None else d_b1,
        x.new_empty(0) if d_b2 is None else d_b2
    )


# --------------------------------------------------------------------------------------------
# Registration: torch.ops.fastlm.moe_route, .moe_experts and its backward
# --------------------------------------------------------------------------------------------


def _checked_options(activation: str, alpha: float, limit: float | None, up_offset: float) -> dict:
    """The activation's options by `fastlm.options.check` (the public function and the ops);
    alpha, limit and up_offset are SwiGLU's, so GeGLU and ReLU² take only their defaults."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    options = dict(
        alpha=check("alpha", alpha), limit=check("limit", limit, none_ok=True),
        up_offset=check("up_offset", up_offset)
    )
    if activation != "silu" and options != dict(alpha=1.0, limit=None, up_offset=0.0):
        raise ValueError(
            f"alpha, limit and up_offset are SwiGLU's options; activation={activation!r} takes "
            f"their defaults (1, None, 0), got {options}"
        )
    return options


@torch.library.custom_op("fastlm::moe_route", mutates_args=())
def _route_op(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` of the router's ids over all `num_experts` experts (the weights' E: with experts
    sharded over E, a rank's weights hold fewer, and the routing stays the whole one)."""
    return route(expert_ids, _checked_num_experts(num_experts))


def _checked_num_experts(num_experts: int) -> int:
    """num_experts by the option rule, and at least one expert (the option's 0 means a dense
    model, which has no routing)."""
    if check("num_experts", num_experts) < 1:
        raise ValueError(f"num_experts must be at least 1 to route, got {num_experts}")
    return num_experts


@_route_op.register_fake
def _(expert_ids, num_experts):
    _checked_num_experts(num_experts)
    sorted_assignments = expert_ids.new_empty(expert_ids.numel(), dtype=torch.int32)
    return sorted_assignments, expert_ids.new_empty(num_experts + 1, dtype=torch.int32)


def _held_offsets(
    expert_offsets: torch.Tensor, expert_index: torch.Tensor | None, gate_up: torch.Tensor
) -> torch.Tensor:
    """The row offsets of the experts whose weights are here: all of `expert_offsets` without
    `expert_index`; with it (experts sharded over E: the global ids e0, e0 + 1, .., of gate_up's
    E_local slots), entries e0 .. e0 + E_local, gathered on the device (no host sync): the
    kernels then run those experts' rows only, and the assignments to other experts stay zero.
    ValueError for an expert_index that is not such a range (its values checked as
    `check_values` checks: on the host for CPU tensors, else by a device-side assert)."""
    if expert_index is None:
        return expert_offsets
    held = gate_up.shape[0]
    if (
        expert_index.dtype not in (torch.int32, torch.int64) or expert_index.dim() != 1
        or expert_index.shape[0] != held or expert_index.device != expert_offsets.device
    ):
        raise ValueError(
            f"expert_index must be a 1-D int32 or int64 tensor of gate_up's {held} experts on "
            f"{expert_offsets.device}, got {expert_index.dtype} {tuple(expert_index.shape)} on "
            f"{expert_index.device}"
        )
    num_experts = expert_offsets.numel() - 1
    ids = expert_index[:1].to(torch.int64) + torch.arange(held + 1, device=expert_index.device)
    valid = (ids[:-1] == expert_index) & (ids[:-1] >= 0) & (ids[:-1] < num_experts)
    check_values(
        expert_index, valid,
        f"expert_index must be consecutive ids e0, e0 + 1, .. within [0, {num_experts})"
    )
    return expert_offsets.index_select(0, ids)


@torch.library.custom_op("fastlm::moe_experts", mutates_args=())
def _experts_op(
    x: torch.Tensor, expert_weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
    sorted_assignments: torch.Tensor, expert_offsets: torch.Tensor, transposed: bool,
    interleaved: bool, activation: str, alpha: float, limit: float | None, up_offset: float,
    expert_index: torch.Tensor | None = None
) -> torch.Tensor:
    options = _checked_options(activation, alpha, limit, up_offset)
    offsets = _held_offsets(expert_offsets, expert_index, gate_up)
    if gate_up.shape[0] == 0:  # a rank holding none of the experts
        return x.new_zeros(x.shape)
    sharded = expert_index is not None
    return experts_forward(
        x, expert_weights, gate_up, down, gate_up_bias, down_bias, sorted_assignments, offsets,
        transposed, interleaved, activation, options, some_held_elsewhere=sharded
    )


@_experts_op.register_fake
def _(
    x, expert_weights, gate_up, down, gate_up_bias, down_bias, sorted_assignments, expert_offsets,
    transposed, interleaved, activation, alpha, limit, up_offset, expert_index=None
):
    return x.new_empty(x.shape)


@torch.library.custom_op("fastlm::moe_experts_backward", mutates_args=())
def _experts_backward_op(
    dout: torch.Tensor, x: torch.Tensor, expert_weights: torch.Tensor, gate_up: torch.Tensor,
    down: torch.Tensor, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
    sorted_assignments: torch.Tensor, expert_offsets: torch.Tensor, transposed: bool,
    interleaved: bool, activation: str, alpha: float, limit: float | None, up_offset: float,
    expert_index: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    options = _checked_options(activation, alpha, limit, up_offset)
    offsets = _held_offsets(expert_offsets, expert_index, gate_up)
    if gate_up.shape[0] == 0:  # a rank holding none of the experts
        return tuple(
            t.new_zeros(t.shape)
            for t in _backward_fake(x, expert_weights, gate_up, down, gate_up_bias, down_bias)
        )
    sharded = expert_index is not None
    return experts_backward(
        dout, x, expert_weights, gate_up, down, gate_up_bias, down_bias, sorted_assignments,
        offsets, transposed, interleaved, activation, options, some_held_elsewhere=sharded
    )


def _backward_fake(x, expert_weights, gate_up, down, gate_up_bias, down_bias):
    """The backward's outputs, empty: an empty (0,) tensor for a missing bias's gradient."""

    def bias_grad(bias):
        return x.new_empty(0) if bias is None else bias.new_empty(bias.shape)

    return (
        x.new_empty(x.shape), expert_weights.new_empty(expert_weights.shape),
        gate_up.new_empty(gate_up.shape), down.new_empty(down.shape), bias_grad(gate_up_bias),
        bias_grad(down_bias)
    )


@_experts_backward_op.register_fake
def _(dout, x, expert_weights, gate_up, down, gate_up_bias, down_bias, *rest):
    return _backward_fake(x, expert_weights, gate_up, down, gate_up_bias, down_bias)


def _experts_setup(ctx, inputs, output):
    """Saved: the inputs as they are, the routing metadata (module docstring) and expert_index;
    the layout and the options kept as Python values."""
    ctx.save_for_backward(*inputs[:8], inputs[14] if len(inputs) > 14 else None)
    ctx.rest = inputs[8:14]


def _experts_grad(ctx, dout):
    saved = ctx.saved_tensors
    x, expert_weights, gate_up, down, gate_up_bias, down_bias, sorted_assignments, offsets = saved[:
                                                                                                   8
                                                                                                   ]
    index = saved[8]
    dx, d_weights, d_gate_up, d_down, d_b1, d_b2 = _experts_backward_op(
        dout, x, expert_weights, gate_up, down, gate_up_bias, down_bias, sorted_assignments,
        offsets, *ctx.rest, expert_index=index
    )
    return (
        dx, d_weights, d_gate_up, d_down, None if gate_up_bias is None else d_b1,
        None if down_bias is None else d_b2, *(None, ) * 9
    )


torch.library.register_autograd("fastlm::moe_experts", _experts_grad, setup_context=_experts_setup)
refuse_double_backward("fastlm::moe_experts_backward", "moe_experts")

# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------


def _check_ids(expert_ids: object, x: torch.Tensor, num_experts: int) -> None:
    """expert_ids: an integer tensor (T, k) on x's device, 1 <= k <= E, every id in [0, E):
    checked on the host for CPU tensors; on a GPU and under torch.compile a device-side assert
    (no host sync per step), as `fastlm.cross_entropy` checks its targets. The kernels never
    read out of bounds with a bad id either way (`fastlm.kernels.moe.routing`)."""
    if not isinstance(expert_ids, torch.Tensor):
        raise TypeError(f"expert_ids must be a torch.Tensor, got {type(expert_ids).__name__}")
    if expert_ids.dtype.is_floating_point or expert_ids.dtype.is_complex or (
        expert_ids.dtype == torch.bool
    ):
        raise TypeError(f"expert_ids must have an integer dtype, got {expert_ids.dtype}")
    if expert_ids.device != x.device:
        raise ValueError(f"expert_ids is on {expert_ids.device}, but x is on {x.device}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0] or expert_ids.shape[1] == 0:
        raise ValueError(
            f"expert_ids must be (T, k) = ({x.shape[0]}, k) with k >= 1 for x of shape "
            f"{tuple(x.shape)}, got {tuple(expert_ids.shape)}"
        )
    if expert_ids.shape[1] > num_experts:
        raise ValueError(
            f"expert_ids picks k = {expert_ids.shape[1]} experts per token, more than the "
            f"{num_experts} experts it chooses among"
        )
    valid = (expert_ids >= 0) & (expert_ids < num_experts)
    check_values(expert_ids, valid, f"expert_ids must lie in [0, {num_experts})")


def _check_weights(x, gate_up, down, gate_up_bias, down_bias, transposed, gated=True) -> None:
    """The experts' weights against x: shapes (the module docstring's layouts), E, F and D;
    not `gated`: gate_up is up alone, (E, F, D)."""
    for name, t in (("gate_up", gate_up), ("down", down)):
        check_float(name, t)
        check_match(name, t, "x", x)
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (E, ., .), got {tuple(t.shape)}")
    D = x.shape[1]
    E = gate_up.shape[0]
    two_f = gate_up.shape[2] if transposed else gate_up.shape[1]
    gate_up_d = gate_up.shape[1] if transposed else gate_up.shape[2]
    rows = "2F" if gated else "F"
    want = f"(E, D, {rows})" if transposed else f"(E, {rows}, D)"
    if E == 0 or two_f == 0 or (gated and two_f % 2) or gate_up_d != D:
        even = "an even, non-zero 2F" if gated else "F >= 1 (the up projection alone: non-gated)"
        raise ValueError(
            f"gate_up must be {want} with D = {D} (x's last dim), E >= 1 and {even}, "
            f"got {tuple(gate_up.shape)} (transposed={transposed})"
        )
    F = two_f // 2 if gated else two_f
    want_down = (E, F, D) if transposed else (E, D, F)
    if tuple(down.shape) != want_down:
        raise ValueError(
            f"down must be {want_down} (E, F and D of gate_up {tuple(gate_up.shape)} and x; "
            f"transposed={transposed}), got {tuple(down.shape)}"
        )
    for name, bias, shape in (
        ("gate_up_bias", gate_up_bias, (E, two_f)), ("down_bias", down_bias, (E, D))
    ):  # fmt: skip
        if bias is None:
            continue
        check_float(name, bias)
        check_match(name, bias, "x", x)
        if tuple(bias.shape) != shape:
            raise ValueError(f"{name} must be {shape}, got {tuple(bias.shape)}")


def moe_experts(
    x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, gate_up: torch.Tensor,
    down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None, *, transposed: bool = False, interleaved: bool = False,
    activation: str = "silu", alpha: float = 1.0, limit: float | None = None,
    up_offset: float = 0.0, num_experts: int | None = None
) -> torch.Tensor:
    """The routed experts' output: out[t] = sum_j w[t, j] expert_{ids[t, j]}(x[t]).

    Each expert is a gated MLP, down_e(act(gate, up)) with (gate, up) = gate_up_e x (+ biases), or
    with a non-gated activation ("relu2") an MLP down_e(act(up_e x)); the math, the kernels and what
    the backward saves are in this module's docstring. Gradients flow to x, expert_weights (the
    router learns), gate_up, down and the biases; expert_ids has none. Deterministic: no atomics,
    forward or backward. On DTensors: tokens replicated, the experts' weights replicated or
    sharded over E or (interleaved layout) F, the output then a `Partial` sum
    (`fastlm.sharding`, docs/moe.md); the PyTorch backend gathers DTensors whole and returns a
    `Replicate` output.

    Args:
        x: (T, D) float32, float16 or bfloat16, the tokens (any strides).
        expert_ids: (T, k) integer tensor, the router's choices, each in [0, E); 1 <= k <= E.
        expert_weights: (T, k) float, each choice's weight (any float dtype of the kernels; its
            gradient in its dtype).
        gate_up: (E, 2F, D), or (E, D, 2F) with `transposed`, x's dtype and device: each
            expert's gate and up projections (gate the first F rows, up the last; `interleaved`:
            gate the even rows, up the odd ones). Non-gated ("relu2"): up alone, (E, F, D) or
            (E, D, F).
        down: (E, D, F), or (E, F, D) with `transposed`, x's dtype and device.
        gate_up_bias: None or (E, 2F) in gate_up's row order ((E, F) non-gated); down_bias:
            None or (E, D).
        transposed: the weights stored (E, in, out) (gpt-oss) rather than (E, out, in).
        interleaved: gate and up in alternate rows of gate_up (gpt-oss); gated activations only.
        activation: "silu" (SwiGLU, the default), "gelu_tanh" or "gelu" (GeGLU), or the
            non-gated "relu2" (relu(up)^2: Nemotron-H's experts).
        alpha, limit, up_offset: SwiGLU's options, as in `fastlm.swiglu` (gpt-oss: 1.702, 7,
            1); other activations take the defaults.
        num_experts: how many ids the router chooses among, when more than the E experts the
            weights hold (E by default): a choice of an id in [E, num_experts) runs no expert
            and adds nothing to out, its weight's gradient from out 0 (LongCat-Flash's "zero
            experts", whose identity term is the caller's). Plain tensors only.

    Returns:
        (T, D) in x's dtype.

    Raises:
        TypeError: x, expert_weights, the weights or the biases not a tensor of float32,
            float16 or bfloat16, the weights and biases not in x's dtype; expert_ids not an
            integer tensor; an option that is not a real number.
        ValueError: shapes that do not fit (each message names the argument), k > E, an id
            outside [0, E) (CPU tensors; a device-side assert on a GPU), tensors on two devices,
            an unknown activation or an option outside its range, `interleaved` with a
            non-gated activation, num_experts below E or with DTensor weights.
    """
    options = _checked_options(activation, alpha, limit, up_offset)
    for name, flag in (("transposed", transposed), ("interleaved", interleaved)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    gated = _gated(activation, interleaved)
    check_float("x", x)
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"x must be (T, D) with D >= 1, got {tuple(x.shape)}")
    _check_weights(x, gate_up, down, gate_up_bias, down_bias, transposed, gated)
    held = gate_up.shape[0]
    num_experts = _router_num_experts(num_experts, gate_up)
    _check_ids(expert_ids, x, num_experts)
    check_float("expert_weights", expert_weights)
    if expert_weights.device != x.device:
        raise ValueError(f"expert_weights is on {expert_weights.device}, but x is on {x.device}")
    if expert_weights.shape != expert_ids.shape:
        raise ValueError(
            f"expert_weights must have expert_ids' shape {tuple(expert_ids.shape)}, got "
            f"{tuple(expert_weights.shape)}"
        )
    layout = dict(transposed=transposed, interleaved=interleaved, activation=activation)
    if not use_triton(x):
        inputs = [x, expert_ids, expert_weights, gate_up, down, gate_up_bias, down_bias]
        if hasattr(x, "placements"):  # DTensors: whole (the reference has no sharding rules)
            return _on_whole(moe_experts_ref, inputs, dict(layout, **options))
        return moe_experts_ref(*inputs, **layout, **options)
    sorted_assignments, expert_offsets = _route_op(expert_ids, num_experts)
    # Past E ids, the op's argument for experts sharded over E says which ids the weights hold.
    index = _expert_index(gate_up) if num_experts == held else torch.arange(held, device=x.device)
    return _experts_op(
        x, expert_weights, gate_up, down, gate_up_bias, down_bias, sorted_assignments,
        expert_offsets, transposed, interleaved, activation, **options, expert_index=index
    )


def _router_num_experts(num_experts: object, gate_up: torch.Tensor) -> int:
    """num_experts by the option rule (`fastlm.options.check`), at least gate_up's E, past it on
    plain weights only (a DTensor's local op takes its expert_index from the sharding); None:
    gate_up's E."""
    held = gate_up.shape[0]
    num_experts = check("num_experts", num_experts, none_ok=True)
    if num_experts is None:
        return held
    if num_experts < held:
        raise ValueError(f"num_experts must be at least gate_up's E = {held}, got {num_experts}")
    if num_experts > held and hasattr(gate_up, "placements"):
        raise ValueError("num_experts beyond gate_up's experts takes plain tensors, not DTensors")
    return num_experts


def _on_whole(fn, inputs: list, kwargs: dict) -> torch.Tensor:
    """fn on DTensor inputs gathered whole on every rank (`full_tensor`, through which the
    gradients flow back to each input's placement), its output `Replicate` on x's mesh."""
    from torch.distributed.tensor import DTensor, Replicate

    out = fn(*[None if t is None else t.full_tensor() for t in inputs], **kwargs)
    mesh = inputs[0].device_mesh
    return DTensor.from_local(out, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _expert_index(gate_up: torch.Tensor) -> torch.Tensor | None:
    """For a DTensor gate_up sharded over E (a Shard(0) on some mesh dim): arange(E) placed as
    gate_up's E dim is (Shard(0) there, Replicate elsewhere), so that each rank's local op learns
    the global ids of the experts it holds (`fastlm.sharding`); else None. Each rank builds its
    own share of it: no communication."""
    placements = getattr(gate_up, "placements", None)
    if placements is None or not any(p.is_shard(0) for p in placements):
        return None
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    index = torch.arange(gate_up.shape[0], device=gate_up.device)
    on_e = [Shard(0) if p.is_shard(0) else Replicate() for p in placements]
    return distribute_tensor(index, gate_up.device_mesh, on_e, src_data_rank=None)


__all__ = ["moe_experts", "moe_experts_ref", "relu2_ref", "route_ref"]
