"""Rotary position embedding (RoPE), applied in place to q and k in one launch.

Pair i of a head vector x at position p is rotated by the angle a = p * theta^(-2i / d):

    y1 = x1 cos(a) - x2 sin(a)
    y2 = x2 cos(a) + x1 sin(a)

Two layouts say which elements form pair i:
- interleaved (`fastlm.reference.RoPE`'s default): (x[2i], x[2i + 1]);
- half-split (GPT-NeoX, Hugging Face): (x[i], x[i + d/2]).

The rotation is orthogonal, so the backward is the same rotation by -a applied to the gradient.
Tables hold one angle per pair: cos and sin of shape (max_seq_len, d/2), float32.

Why in place: q and k are usually views of one fused QKV projection output; rotating them in
their own storage reads and writes each element once and allocates nothing.

Ops: `torch.ops.fastlm.rope_` rotates q and k in place in one launch (eager `apply_rope_`, inside
an autograd.Function, since PyTorch registers no autograd formula for a mutating op); the
functional `torch.ops.fastlm.rope` returns a rotated copy and has its autograd registered (what
compiled code calls, writing the result back with `copy_`).
"""

from __future__ import annotations

import torch

from fastlm.backend import interpreting, use_triton
from fastlm.kernels._common import (
    check_float,
    check_match,
    empty_like,
    interpreter_bf16,
    round_to,
    tl,
    triton,
)
from fastlm.options import check

# --------------------------------------------------------------------------------------------
# Reference math (the PyTorch backend, and what the tests and benchmarks compare with)
# --------------------------------------------------------------------------------------------


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    """(T, D) / (B, T, D) / (B, H, T, D) as a (B, H, T, D) view (unsqueeze, never a copy)."""
    if x.dim() == 2:
        return x[None, None]
    if x.dim() == 3:
        return x[:, None]
    return x


def _positions_4d(positions: torch.Tensor) -> torch.Tensor:
    """(T,) / (B, T) positions as (B or 1, 1, T) for broadcasting against (B, H, T, D/2)."""
    return positions.view(1, 1, -1) if positions.dim() == 1 else positions[:, None, :]


def rope_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
    interleaved: bool = True, inverse: bool = False
) -> torch.Tensor:
    """x (T, D), (B, T, D) or (B, H, T, D) rotated as a new tensor of x's dtype (fp32 inside,
    fp64 for fp64); `inverse` rotates by -angle (the backward)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    x4 = _as_4d(x).to(compute)
    index = _positions_4d(positions)
    c, s = cos[index].to(compute), sin[index].to(compute)  # (B|1, 1, T, D/2)
    if inverse:
        s = -s
    half = x4.shape[-1] // 2
    x1, x2 = (x4[..., 0::2], x4[..., 1::2]) if interleaved else (x4[..., :half], x4[..., half:])
    y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
    y = torch.stack((y1, y2), dim=-1).flatten(-2) if interleaved else torch.cat((y1, y2), dim=-1)
    return y.to(x.dtype).view(x.shape)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _rotate_heads(
    X, Y,  #
    x_tokens, y_tokens,  #
    stride_xh, stride_yh,  #
    n_heads, token_mask, cos, sin,  #
    HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_T: tl.constexpr,  #
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BF16_BY_HAND: tl.constexpr
):
    """Rotate every head of a block of tokens from X into Y (which may be X).

    x_tokens, y_tokens: (BLOCK_T,) offsets of each token's head 0; the head dim has a unit stride.
    cos, sin: (BLOCK_T, BLOCK_HALF). Every access runs along a head's contiguous elements, which
    the compiler turns into 16-byte vectors: the interleaved layout loads whole heads and splits
    the pairs in registers, the half-split layout loads the two halves.
    """
    cos, sin = cos[:, None, :], sin[:, None, :]  # (BLOCK_T, 1, BLOCK_HALF): shared by all heads
    pair = tl.arange(0, BLOCK_HALF)[None, None, :]
    element = tl.arange(0, 2 * BLOCK_HALF)[None, None, :]
    for h0 in range(0, n_heads, BLOCK_H):
        heads = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)[None, :, None]
        row_mask = token_mask[:, None, None] & (heads < n_heads)  # (BLOCK_T, BLOCK_H, 1)
        x_rows = X + x_tokens[:, None, None] + heads * stride_xh
        y_rows = Y + y_tokens[:, None, None] + heads * stride_yh
        if INTERLEAVED:  # pairs (x[2i], x[2i + 1])
            mask = row_mask & (element < 2 * HALF)
            x = tl.load(x_rows + element, mask=mask, other=0.0).to(tl.float32)
            x1, x2 = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_H, BLOCK_HALF, 2)))
        else:  # pairs (x[i], x[i + HALF])
            mask = row_mask & (pair < HALF)
            x1 = tl.load(x_rows + pair, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(x_rows + HALF + pair, mask=mask, other=0.0).to(tl.float32)
        y1 = round_to(x1 * cos - x2 * sin, Y.dtype.element_ty, BF16_BY_HAND)
        y2 = round_to(x2 * cos + x1 * sin, Y.dtype.element_ty, BF16_BY_HAND)
        if INTERLEAVED:
            y = tl.reshape(tl.join(y1, y2), (BLOCK_T, BLOCK_H, 2 * BLOCK_HALF))
            tl.store(y_rows + element, y, mask=mask)
        else:
            tl.store(y_rows + pair, y1, mask=mask)
            tl.store(y_rows + HALF + pair, y2, mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, QOut, KOut, COS, SIN, POS,  #
    stride_qb, stride_qh, stride_qt, stride_qob, stride_qoh, stride_qot,  #
    stride_kb, stride_kh, stride_kt, stride_kob, stride_koh, stride_kot,  #
    stride_pb, stride_pt, stride_cos, stride_sin,  #
    T, HQ, HK, MAX_SEQ_LEN,  #
    HALF: tl.constexpr, INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr,  #
    BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,  #
    BF16_BY_HAND: tl.constexpr
):
    """One program per (batch, block of BLOCK_T tokens): all heads of q and of k there.

    Every tensor's last dim has a unit stride (the launcher sees to it); rows may be strided, the
    tables' too (Hugging Face's (T, D) tables sliced to (T, D/2) have a row stride of D)."""
    pid = tl.program_id(0)
    n_token_blocks = tl.cdiv(T, BLOCK_T)
    b = (pid // n_token_blocks).to(tl.int64)
    t = (pid % n_token_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = t < T
    t = t.to(tl.int64)
    position = tl.load(POS + b * stride_pb + t * stride_pt, mask=token_mask, other=0).to(tl.int64)
    # The host validates positions; clamping keeps a bad CUDA position from reading outside the
    # table before the asynchronous assert reports it.
    position = tl.minimum(tl.maximum(position, 0), MAX_SEQ_LEN - 1)

    pair = tl.arange(0, BLOCK_HALF)
    table_mask = token_mask[:, None] & (pair < HALF)[None, :]  # (BLOCK_T, BLOCK_HALF)
    cos_rows = COS + position[:, None] * stride_cos + pair[None, :]
    sin_rows = SIN + position[:, None] * stride_sin + pair[None, :]
    cos = tl.load(cos_rows, mask=table_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_rows, mask=table_mask, other=0.0).to(tl.float32)
    if INVERSE:
        sin = -sin

    _rotate_heads(
        Q, QOut, b * stride_qb + t * stride_qt, b * stride_qob + t * stride_qot, stride_qh,
        stride_qoh, HQ, token_mask, cos, sin, HALF, INTERLEAVED, BLOCK_T, BLOCK_H, BLOCK_HALF,
        BF16_BY_HAND
    )
    _rotate_heads(
        K, KOut, b * stride_kb + t * stride_kt, b * stride_kob + t * stride_kot, stride_kh,
        stride_koh, HK, token_mask, cos, sin, HALF, INTERLEAVED, BLOCK_T, BLOCK_H, BLOCK_HALF,
        BF16_BY_HAND
    )


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _launch(
    xs: tuple[torch.Tensor, ...], outs: tuple[torch.Tensor, ...], cos: torch.Tensor,
    sin: torch.Tensor, positions: torch.Tensor, interleaved: bool, inverse: bool
) -> None:
    """Rotate xs[i] into outs[i] (the same tensor for in place), all in one launch."""
    # The kernel needs a unit stride along the head dim, which views of a QKV projection have. A
    # tensor without one (a rare transposed layout) is rotated in a contiguous copy instead; the
    # tables likewise (they are small), while their rows may lie any stride apart.
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    sources = tuple(x if x.stride(-1) == 1 else x.contiguous() for x in xs)
    targets = tuple(
        out if out.stride(-1) == 1 else source if out is x else torch.empty_like(source)
        for x, out, source in zip(xs, outs, sources)
    )
    q, q_out = _as_4d(sources[0]), _as_4d(targets[0])
    # Without k the kernel's k loop runs zero times; q stands in for its pointers.
    k, k_out = (_as_4d(sources[1]), _as_4d(targets[1])) if len(xs) == 2 else (q, q_out)
    n_k_heads = k.shape[1] if len(xs) == 2 else 0
    B, HQ, T, D = q.shape
    half = D // 2
    stride_pb = 0 if positions.dim() == 1 or positions.shape[0] == 1 else positions.stride(0)
    block_half = triton.next_power_of_2(half)
    max_heads = max(HQ, n_k_heads)
    if interpreting():
        # Few, large programs: the interpreter pays per program and per loop iteration.
        block_h = triton.next_power_of_2(max_heads)
        block_t = max(1, min(triton.next_power_of_2(T), 8192 // (block_h * 2 * block_half)))
        num_warps = 1
    else:
        # A (tokens x heads x d) tile of about 4096 elements per loop iteration, 16 per thread.
        block_h = max(1, min(triton.next_power_of_2(max_heads), 4096 // (2 * block_half)))
        block_t = max(1, min(triton.next_power_of_2(T), 4096 // (block_h * 2 * block_half)))
        num_warps = max(1, min(8, block_t * block_h * 2 * block_half // 512))
    _rope_kernel[(B * triton.cdiv(T, block_t), )](
        q, k, q_out, k_out, cos, sin, positions, *q.stride()[:3], *q_out.stride()[:3],
        *k.stride()[:3], *k_out.stride()[:3], stride_pb, positions.stride(-1), cos.stride(0),
        sin.stride(0), T, HQ, n_k_heads, cos.shape[0], HALF=half, INTERLEAVED=interleaved,
        INVERSE=inverse, BLOCK_T=block_t, BLOCK_HALF=block_half, BLOCK_H=block_h,
        BF16_BY_HAND=interpreter_bf16(q_out.dtype), num_warps=num_warps
    )
    for out, target in zip(outs, targets):
        if target is not out:
            out.copy_(target)


# --------------------------------------------------------------------------------------------
# Registration: torch.ops.fastlm.rope_ (in place) and torch.ops.fastlm.rope (functional)
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("fastlm::rope_", mutates_args=("q", "k"))
def _rope_inplace_op(
    q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
    positions: torch.Tensor, interleaved: bool, inverse: bool
) -> None:
    """Rotate q and k (if given) in their own storage, in one launch."""
    xs = (q, ) if k is None else (q, k)
    if q.numel():
        _launch(xs, xs, cos, sin, positions, interleaved, inverse)


@_rope_inplace_op.register_fake
def _(q, k, cos, sin, positions, interleaved, inverse):
    return None


@torch.library.custom_op("fastlm::rope", mutates_args=())
def _rope_op(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
    interleaved: bool, inverse: bool
) -> torch.Tensor:
    """x rotated into a new contiguous tensor."""
    out = empty_like(x)
    if x.numel():
        _launch((x, ), (out, ), cos, sin, positions, interleaved, inverse)
    return out


@_rope_op.register_fake
def _(x, cos, sin, positions, interleaved, inverse):
    return x.new_empty(x.shape)


def _rope_setup(ctx, inputs, output):
    _, cos, sin, positions, interleaved, inverse = inputs
    ctx.save_for_backward(cos, sin, positions)
    ctx.flags = (interleaved, not inverse)


def _rope_grad(ctx, dy):
    # The backward is the op itself by -angle, so second derivatives come out right as well.
    return _rope_op(dy, *ctx.saved_tensors, *ctx.flags), None, None, None, None, None


torch.library.register_autograd("fastlm::rope", _rope_grad, setup_context=_rope_setup)


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns t's storage for autograd: t itself, or the base t is a view of."""
    return t if t._base is None else t._base


class _RoPEFunction(torch.autograd.Function):
    """Rotates q (and k) in place with `fastlm::rope_`; the gradient is rotated back by -angle.

    Autograd refuses a Function that marks two view inputs dirty, and q and k are usually views
    of one fused QKV output. So the Function marks the *roots* dirty (the tensors owning the
    storage: q and k themselves, or the base they view), and returns those; the rotated tensors
    travel in a tuple autograd does not look into. Views of a root (q, k, and v too) see the
    root's new version and re-derive their history from it, so gradients flow through here.
    The backward rotates gradients in place, which is not itself differentiable: a second
    derivative raises (once_differentiable) rather than come out wrong.
    """

    @staticmethod
    def forward(ctx, cos, sin, positions, interleaved, rotated, *roots):
        _rope_inplace_op(*_q_and_k(rotated), cos, sin, positions, interleaved, False)
        ctx.mark_dirty(*roots)
        ctx.save_for_backward(cos, sin, positions)
        ctx.interleaved = interleaved
        ctx.root_layouts = [(r.shape, r.stride(), r.storage_offset()) for r in roots]
        # For each rotated tensor: which root it lies in, whether it is that root, its geometry.
        ctx.regions = [
            (
                next(i
                     for i, r in enumerate(roots)
                     if r is _root(t)), t._base is None, t.shape, t.stride(), t.storage_offset()
            )
            for t in rotated
        ]
        return roots

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *root_grads):
        cos, sin, positions = ctx.saved_tensors
        # Never rotate the incoming gradients in place: autograd may hand one gradient tensor to
        # several nodes (AddBackward passes it to both inputs; sum() passes a stride-0
        # expansion), so writing into it could corrupt another branch.
        grads = list(root_grads)
        for i, (shape, stride, _) in enumerate(ctx.root_layouts):
            if not any(index == i and is_root for index, is_root, *_ in ctx.regions):
                # A base whose untouched parts (v, say) pass their gradient through unchanged;
                # the rotated regions are then rotated in place in this copy, which we own.
                grads[i] = torch.empty_strided(
                    shape, stride, dtype=root_grads[i].dtype, device=root_grads[i].device
                )
                grads[i].copy_(root_grads[i])
        regions = []
        for index, is_root, shape, stride, offset in ctx.regions:
            if is_root:  # One read and one write per element, into a fresh buffer.
                grads[index] = _rope_op(
                    root_grads[index], cos, sin, positions, ctx.interleaved, True
                )
            else:
                regions.append(
                    grads[index].as_strided(shape, stride, offset - ctx.root_layouts[index][2])
                )
        if regions:
            _rope_inplace_op(*_q_and_k(regions), cos, sin, positions, ctx.interleaved, True)
        return (None, None, None, None, None, *grads)


def _q_and_k(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    return tensors[0], (tensors[1] if len(tensors) > 1 else None)


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def rope_frequencies(theta: float, d_k: int, device=None) -> torch.Tensor:
    """theta^(-2i / d_k) for each pair i, (d_k // 2,) float32, as `fastlm.reference.RoPE` and
    `rope_tables` compute them.

    Args:
        theta: the base.
        d_k: the head dim (even).
        device: where to compute them.

    Returns:
        The angle of each pair per position.
    """
    theta = check("theta", theta)
    if d_k % 2:
        raise ValueError(f"d_k must be even, got {d_k}")
    return 1.0 / theta**(torch.arange(0, d_k, 2, device=device, dtype=torch.float32) / d_k)


def rope_tables(theta: float, d_k: int, max_seq_len: int,
                device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * theta^(-2i / d_k), each (max_seq_len, d_k // 2) float32.

    Computed exactly as `fastlm.reference.RoPE` computes its tables (one column per pair; the
    reference repeats each column twice): the `cos`, `sin` that `apply_rope_` and `rope_attention`
    take.

    Args:
        theta: the RoPE base (10000.0 in most models).
        d_k: the head dim, even.
        max_seq_len: the number of positions, at least 1; row p holds position p's angles.
        device: where to build the tables (default: PyTorch's default device).

    Returns:
        (cos, sin), each (max_seq_len, d_k // 2) float32.

    Raises:
        TypeError: a theta that is not a real number.
        ValueError: max_seq_len below 1, an odd d_k, or a theta outside [1, 3.4e38] (below 1 the
            frequencies outgrow float32; `fastlm.options`).
    """
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
    inv_freq = rope_frequencies(theta, d_k, device)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # (L, d_k / 2)
    return angles.cos(), angles.sin()


def check_positions(
    token_positions: object, batch: int, seq: int, max_seq_len: int, device: torch.device,
    check_values: bool = True
) -> torch.Tensor:
    """Validated positions for `batch` sequences of `seq` tokens on `device`, returned there; see
    apply_rope_ for how CUDA values are checked. Without check_values only their type, shape and
    device are (for a caller that checked the values once, for every layer)."""
    if not isinstance(token_positions, torch.Tensor):
        raise TypeError(
            f"token_positions must be a torch.Tensor, got {type(token_positions).__name__}"
        )
    if token_positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"token_positions must be int32 or int64, got {token_positions.dtype}")
    shape = tuple(token_positions.shape)
    if not (shape == (seq, ) or (len(shape) == 2 and shape[1] == seq and shape[0] in (1, batch))):
        raise ValueError(
            f"token_positions must have shape ({seq},) or ({batch}, {seq}), got {shape}"
        )
    on_host = token_positions.device.type == "cpu"
    if not on_host and token_positions.device != torch.device(device):
        raise ValueError(
            f"token_positions is on {token_positions.device}, but the rotated tensor is on {device}"
        )
    message = f"token_positions must lie in [0, {max_seq_len})"
    if check_values and on_host and not torch.compiler.is_compiling():
        if token_positions.numel(
        ) and (token_positions.min() < 0 or token_positions.max() >= max_seq_len):
            raise ValueError(
                f"{message}, got values in [{int(token_positions.min())}, "
                f"{int(token_positions.max())}]"
            )
    elif check_values and token_positions.device == torch.device(device):  # device or compiled
        in_range = ((token_positions >= 0) & (token_positions < max_seq_len)).all()
        torch._assert_async(in_range, message)
    return token_positions.to(device)


def _check_positions(
    token_positions: object, x: torch.Tensor, max_seq_len: int, check_values: bool = True
) -> torch.Tensor:
    """check_positions for the rotated tensor x, (T, D) to (B, H, T, D)."""
    x4 = _as_4d(x)
    return check_positions(
        token_positions, x4.shape[0], x4.shape[2], max_seq_len, x.device, check_values
    )


def check_rotatable(name: str, t: object) -> None:
    """The per-tensor checks: kernel dtype, 2 to 4 dims, no leaf that autograd would track."""
    check_float(name, t)
    if not 2 <= t.dim() <= 4:
        raise ValueError(f"{name} must be (T, D), (B, T, D) or (B, H, T, D), got {tuple(t.shape)}")
    if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
        raise ValueError(f"{name} has elements sharing memory (an expand); rotate a copy")
    if torch.is_grad_enabled() and t.requires_grad and not torch.compiler.is_compiling():
        base = t._base
        if t.is_leaf or (base is not None and base.is_leaf and base.requires_grad):
            raise ValueError(
                f"{name} is a leaf tensor that requires grad (or a view of one); RoPE "
                "rotates in place, so pass a computed tensor or use torch.no_grad()"
            )


def check_rope_args(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, token_positions: object, *,
    name: str = "q", check_values: bool = True
) -> torch.Tensor:
    """The tables against x (named `name` in errors), and the positions (see _check_positions);
    returns the positions on x's device."""
    check_float("cos", cos)
    check_match("sin", sin, "cos", cos)
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"the head dim of {name} must be even, got {d}")
    if cos.dim() != 2 or cos.shape[1] != d // 2 or sin.shape != cos.shape:
        raise ValueError(
            f"cos and sin must both be (max_seq_len, {d // 2}), got "
            f"{tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if cos.device != x.device:
        raise ValueError(f"cos is on {cos.device}, but {name} is on {x.device}")
    return _check_positions(token_positions, x, cos.shape[0], check_values)


def rotate_in_place(
    tensors: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
    token_positions: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, ...]:
    """Check everything on the host, then rotate the tensors (one or two, by the names their
    errors use) in place together; the backend rule is decided here."""
    (first_name, first), *rest = tensors.items()
    for name, t in tensors.items():
        check_rotatable(name, t)
    for name, t in rest:
        check_match(name, t, first_name, first)
        a, b = _as_4d(t), _as_4d(first)
        if (a.shape[0], a.shape[2], a.shape[3]) != (b.shape[0], b.shape[2], b.shape[3]):
            raise ValueError(
                f"{name} {tuple(t.shape)} and {first_name} {tuple(first.shape)} must "
                "agree in batch, sequence and head dim (heads may differ)"
            )
        if t is first:
            raise ValueError(f"{name} and {first_name} are the same tensor")
    positions = check_rope_args(first, cos, sin, token_positions, name=first_name)
    rotated = tuple(tensors.values())
    if not use_triton(first):
        # PyTorch writes the rotation back in place; autograd tracks in-place writes to views.
        for t in rotated:
            t.copy_(rope_ref(t, cos, sin, positions, interleaved))
        return rotated
    if torch.compiler.is_compiling():
        # Dynamo models neither `_base` nor a Function that dirties tensors it does not return:
        # compiled code calls the functional op and writes its result back in place, where
        # ordinary in-place autograd on views takes over.
        for t in rotated:
            t.copy_(_rope_op(t, cos, sin, positions, interleaved, False))
        return rotated
    roots = []
    for t in rotated:
        if not any(_root(t) is r for r in roots):
            roots.append(_root(t))
    _RoPEFunction.apply(cos, sin, positions, interleaved, rotated, *roots)
    return rotated


def apply_rope_(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    token_positions: torch.Tensor, *, interleaved: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place, in one launch, and return them (the same tensor objects).

    Pair i of each head vector at position p is rotated by p * theta^(-2i / D), its cos and sin read
    from the tables at the token's position. Autograd: the gradients of q and k are the incoming
    ones rotated by -angle.

    Out-of-range positions: positions on the CPU are checked on the host and raise ValueError
    (they are then copied to q's device). Positions already on a CUDA device are checked without a
    host sync, by `torch._assert_async`: a bad value is reported as a device-side assertion (a
    RuntimeError at a later synchronisation, which ends the CUDA context), and the kernel clamps
    positions so that it never reads outside the tables meanwhile. Pass CPU positions where a
    catchable ValueError matters more than the sync.

    Args:
        q: (B, Hq, T, D), also (B, T, D) or (T, D); float32, float16 or bfloat16; D even. Any
            strides: views of a fused QKV projection output, such as
            `qkv[..., :C].view(B, T, H, D).transpose(1, 2)`, are rotated in the caller's storage.
            Slice or index the fused output (PyTorch refuses in-place autograd on `split`/`chunk`
            outputs).
        k: (B, Hk, T, D) (or q's 3-D or 2-D form), q's dtype and device, batch, sequence and head
            dim; Hq and Hk may differ (grouped-query attention). Not q itself.
        cos, sin: (max_seq_len, D // 2), one float dtype, on q's device; see `rope_tables`.
        token_positions: (T,) or (B, T) int32 or int64 in [0, max_seq_len), any offset; on the CPU
            or on q's device.
        interleaved: pairs (x[2i], x[2i+1]) if True (the default), else the half-split pairs
            (x[i], x[i + D/2]).

    Returns:
        (q, k), the tensors passed in, rotated.

    Raises:
        TypeError: q, k, cos or sin not a tensor of float32, float16 or bfloat16, k's dtype not
            q's or sin's not cos's, or token_positions not an int32/int64 tensor.
        ValueError: a shape other than the above, an odd D, k the same tensor as q, elements
            sharing memory (an expand: rotate a copy), an input on another device, a leaf tensor
            that requires grad (or a view of one), as any in-place op on it would, or (on the CPU)
            a position out of range.
    """
    return rotate_in_place({"q": q, "k": k}, cos, sin, token_positions, interleaved)
