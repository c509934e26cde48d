"""fastlm's attention inside transformers: an attention function and a mask function, both
registered as "fastlm" (`AttentionInterface`, `AttentionMaskInterface`), for every batch shape
trainers build.

The mask function builds no [B, 1, T, T] mask. It returns
- None for plain causal attention (the keys are the queries' own tokens and those before them);
- the 2-D (B, keys) padding mask, sliced as the keys are (a sliding-window cache keeps only the
  last keys), when the caller passed an `attention_mask`;
- `Packed` when transformers found several documents in one row (`position_ids` that restart;
  transformers looks for them only when no `attention_mask` and no cache is given): whether each
  token attends to the one before it, from the model's own mask function (B x T pairs);
- a 4-D mask only for what the kernels do not run: a static cache (keys past the queries'
  positions not written yet), a model's own extra mask functions (`or_mask_function`,
  `and_mask_function`, e.g. Gemma 3's bidirectional sliding window), bidirectional attention
  (`config.is_causal=False`).

The attention function then runs, in this order:
- `cu_seq_lens_q/k` and `max_length_q/k` passed by the caller (`DataCollatorWithFlattening`,
  TRL's padding-free batches): `flash_attention_varlen` on them, over the flattened batch;
- a 2-D padding mask: `flash_attention_varlen` over the flattened (B * T) tokens with three
  segments per row (leading padding, the real tokens, trailing padding), found on the device: no
  host synchronisation, the launch sized by the padded length, no copy of q, k or v when they
  are views of a projection (in training; a KV cache's keys and values are copied into that
  layout at each decoding step). The real tokens of a row must be contiguous (left or right padding,
  as tokenizers and collators pad; checked on the device, an error otherwise). Padding rows get
  output 0, as transformers' flash-attention path gives;
- `Packed`: the documents (a new one wherever a token does not attend to the one before it, in
  any row), read once per forward and mask (one host synchronisation for their count and
  longest length, shared by the layers), then `flash_attention_varlen`. Under torch.compile
  transformers reports every batch without a mask as packed, and the documents cannot be read:
  such a batch runs `flash_attention`, with a device-side check that no row restarts (packed
  documents under compile need `cu_seq_lens_q/k`);
- otherwise `flash_attention` (causal, aligned to the end of the keys: a KV cache's decode).

Every path applies the layer's `sliding_window` W as Hugging Face's eager attention does (query i
sees key j iff i - W < j <= i, counted within each document or row) through `window_size=(W - 1,
0)`, the layer's `softcap`, `scaling` and `s_aux` (gpt-oss's attention sinks, `sinks=`), and takes
a value head dim other than q's (DeepSeek's MLA). Llama 4's chunked attention (`Chunked`, from the
mask function: causal within chunks of `attention_chunk_size` tokens from each row's first real
token or each document's start) cuts every sequence into chunks and runs them as documents on
`flash_attention_varlen` (one host synchronisation for the chunk bounds). What the kernels do not
run goes to transformers' SDPA function (or the family's eager attention where the scores are
soft-capped or have sinks), with a dense mask built for it, and warns once naming why: attention
dropout in training, a 4-D mask (the caller's, a static cache's, a model's own mask functions,
chunks with a KV cache), bidirectional attention, an additive score bias (`position_bias`), a
dtype the kernels do not take, a layer's head dim the kernels do not take where they run (read
from the layer's own q and v: Gemma 4's global layers have theirs).
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from typing import NamedTuple

import torch

from fastlm.hf.families import config_value, modeling_module
from fastlm.kernels import flash_attention, flash_attention_varlen
from fastlm.kernels._common import FLOAT_DTYPES
from fastlm.kernels.attention import MAX_HEAD_DIM, MAX_HEAD_DIM_FP32
from fastlm.model import kernel_takes_head_dim, kernels_run_on
from fastlm.options import check_flag

#: Attention-function arguments that add a bias to the scores (Inkling's relative position bias,
#: ALiBi), which fastlm's kernels do not take: they run the family's eager attention.
SCORE_BIASES = ("position_bias", "alibi", "attn_bias", "attention_bias")

#: Whether fastlm's attention takes attention sinks and a value head dim of its own (issue 28's
#: kernel capabilities, which arrive with `sinks=`).
KERNEL_SINKS = "sinks" in inspect.signature(flash_attention).parameters

#: The name fastlm's attention and mask functions are registered under in transformers.
ATTENTION = "fastlm"


class Packed(NamedTuple):
    """The mask function's answer when transformers found several documents in one row
    (`position_ids` that restart): `follows` (B, T) bool on the device, whether each token
    attends to the one before it under the model's own mask function (False at each row's
    start and each document's). Read from the mask function, not from `position_ids` in the
    attention's arguments, which some families do not pass on (Llama 4's decoder layer)."""

    follows: torch.Tensor


def _packed(mask_function, batch_size: int, length: int, device) -> Packed:
    """`Packed` of the mask function, evaluated on the (B, T - 1) pairs (token t, token t - 1)
    as transformers' sdpa_mask evaluates it on all pairs (its mask functions take broadcast index
    tensors): no [T, T] mask, no host synchronisation."""
    rows = torch.arange(batch_size, device=device)[:, None]
    t = torch.arange(1, length, device=device)[None]
    head = torch.zeros((), dtype=torch.long, device=device)  # one head's mask: they are equal
    follows = torch.zeros(batch_size, length, dtype=torch.bool, device=device)
    follows[:, 1:] = mask_function(rows, head, t, t - 1)
    return Packed(follows)


class Chunked(NamedTuple):
    """The mask function's answer for Llama 4's chunked attention (causal within fixed chunks of
    `size` tokens, counted from each row's or document's first token): `mask` is what it would
    answer without the chunks (None, a padding mask or `Packed`)."""

    size: int
    mask: object


def _chunk_size(kwargs) -> int | None:
    """The chunk size of a chunked mask's call (`create_chunked_causal_mask` passes it as
    `local_size`, which the sliding-window masks pass too: told apart by the config's
    attention_chunk_size), else None. Read from plain values: no tracing of mask functions
    under torch.compile."""
    size = kwargs.get("local_size")
    config = kwargs.get("config")
    chunked = config_value(config, "attention_chunk_size")
    if size is None or chunked is None or int(size) != int(chunked):
        return None
    return int(size)


_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"fastlm.hf: attention with {reason} runs transformers' SDPA (or the model's eager "
            "attention), not fastlm's kernels",
            stacklevel=3,
        )


# --------------------------------------------------------------------------------------------
# The mask function
# --------------------------------------------------------------------------------------------


def fastlm_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True,
    use_vmap: bool = False,
    **kwargs,
):
    """transformers' mask interface for fastlm's attention (see the module docstring).

    Args:
        batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
        allow_is_causal_skip, use_vmap: as transformers' `sdpa_mask` takes them; the rest of
            `kwargs` is handed to `sdpa_mask` when a 4-D mask is needed.

    Returns:
        None, a (batch, kv_length) bool padding mask, `Packed`, or a 4-D bool mask (each
        wrapped in `Chunked` for Llama 4's chunked layers).
    """
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    # The keys are the queries' own tokens and the ones before them exactly when they end where
    # the queries end; a static cache's keys run on to its full length (and its offset is a
    # tensor, which is not read here: no host synchronisation).
    aligned = not torch.is_tensor(q_offset) and kv_offset + kv_length == q_offset + q_length
    bidirectional = "allow_is_bidirectional_skip" in kwargs  # create_bidirectional_mask's call
    chunk = _chunk_size(kwargs)
    chunked = chunk is not None
    if use_vmap or not aligned or bidirectional or (chunked and q_length != kv_length):
        reason = "a model's own mask functions" if use_vmap else "a static cache"
        if chunked and aligned and not use_vmap:
            reason = "chunked attention with a KV cache"
        _warn_once("bidirectional attention" if bidirectional else reason)
        kwargs["allow_is_bidirectional_skip"] = False  # a mask, never None (taken as causal)
        return sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function or causal_mask_function,
            attention_mask=attention_mask,
            allow_is_causal_skip=False,
            use_vmap=use_vmap,
            **kwargs,
        )
    if attention_mask is not None:
        # The 2-D mask covers every token seen (cache included); keep the ones the keys are.
        mask = attention_mask.to(torch.bool)
        if mask.shape[-1] < kv_offset + kv_length:
            mask = torch.nn.functional.pad(mask, (0, kv_offset + kv_length - mask.shape[-1]))
        mask = mask[:, kv_offset : kv_offset + kv_length]
    elif not allow_is_causal_skip:  # transformers found several documents in a row
        function = mask_function or causal_mask_function
        mask = _packed(function, batch_size, q_length, kwargs.get("device"))
    else:
        mask = None
    return Chunked(chunk, mask) if chunked else mask


# --------------------------------------------------------------------------------------------
# Sequence bounds for flash_attention_varlen, found on the device
# --------------------------------------------------------------------------------------------


def padding_segments(mask: torch.Tensor) -> torch.Tensor:
    """cu_seqlens (3 B + 1,) int32 over the flattened (B * N) tokens of a (B, N) bool padding
    mask: for each row its leading padding, its real tokens and its trailing padding. No host
    synchronisation: a row whose real tokens are not contiguous fails a device-side assertion."""
    B, N = mask.shape
    ones = mask.to(torch.int32)
    count = ones.sum(1)
    lead = (ones.cumsum(1) == 0).sum(1)
    trail = (ones.flip(1).cumsum(1) == 0).sum(1)
    contiguous = (count == 0) | (lead + count + trail == N)
    torch._assert_async(
        contiguous.all(),
        "fastlm.hf: attention_mask must have each row's ones contiguous (left or right "
        "padding), as tokenizers and collators pad; use attn_implementation='sdpa' for another",
    )
    base = torch.arange(B, device=mask.device) * N
    bounds = torch.stack((base, base + lead, base + lead + count), dim=1).flatten()
    return torch.cat((bounds, bounds.new_full((1,), B * N))).to(torch.int32)


_last_documents: list = [None]  # (weakref to a Packed's follows, its version, result)


def packed_documents(follows: torch.Tensor):
    """(cu_seqlens int32 on the device, longest length) of the documents of a `Packed` (a new
    one wherever a token does not attend to the one before it), over the flattened (B * T)
    tokens. One host synchronisation; the answer is kept for the same tensor, so that the
    layers of one forward share it."""
    cached = _last_documents[0]
    if cached is not None and cached[0]() is follows and cached[1] == follows._version:
        return cached[2]
    first = (~follows).flatten().nonzero().flatten().cpu()
    bounds = torch.cat((first, first.new_full((1,), follows.numel())))
    result = bounds.to(device=follows.device, dtype=torch.int32), int(bounds.diff().max())
    _last_documents[0] = (weakref.ref(follows), follows._version, result)
    return result


def chunk_segments(cu_seqlens: torch.Tensor, size: int) -> torch.Tensor:
    """cu_seqlens with every sequence cut into pieces of `size` tokens from its start (Llama 4's
    chunked attention: causal within each piece). One host synchronisation."""
    bounds = cu_seqlens.cpu().tolist()
    cuts = [start for a, b in zip(bounds, bounds[1:]) for start in range(a, max(b, a + 1), size)]
    cuts = sorted(set(cuts + bounds))
    return torch.tensor(cuts, dtype=torch.int32, device=cu_seqlens.device)


# --------------------------------------------------------------------------------------------
# The attention function
# --------------------------------------------------------------------------------------------


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B * T, H, D), a view when the tensor is a projection's output."""
    B, H, T, D = t.shape
    return t.transpose(1, 2).reshape(B * T, H, D)


def _varlen(query, key, value, cu_q, cu_k, max_q, max_k, options) -> torch.Tensor:
    B, _, Tq, _ = query.shape
    out = flash_attention_varlen(
        _flat(query), _flat(key), _flat(value), cu_q, cu_k, max_q, max_k, causal=True, **options
    )
    return out.view(B, Tq, *out.shape[1:])


def _autocast(query, key, value):
    """q, k, v in autocast's dtype where it is on, as SDPA would take them (a q/k norm with an
    fp32 weight gives fp32 q and k beside a bf16 v)."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return tuple(t.to(dtype) for t in (query, key, value))
    return query, key, value


def _fallback_reason(module, query, key, value, attention_mask, dropout, kwargs) -> str | None:
    if dropout:
        return "attention dropout in training"
    if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        return "bidirectional attention"
    if torch.is_tensor(attention_mask) and attention_mask.dim() == 4:
        return "a 4-D attention mask"
    bias = next((n for n in SCORE_BIASES if torch.is_tensor(kwargs.get(n))), None)
    if bias is not None:
        return f"an additive bias on the scores ({bias})"
    if kwargs.get("s_aux") is not None and not KERNEL_SINKS:
        return "attention sinks (s_aux)"
    if value.shape[-1] != query.shape[-1] and not KERNEL_SINKS:
        return "a value head dim other than the query's"
    if query.dtype not in FLOAT_DTYPES:
        return f"{query.dtype} inputs"
    sizes = {query.shape[-1], value.shape[-1]}
    untaken = sorted(d for d in sizes if not kernel_takes_head_dim(d))
    if untaken and kernels_run_on(query.device):  # the layer's own (any head dim past 512, say)
        return f"head dim {untaken[0]} (the kernel takes multiples of 8 to {MAX_HEAD_DIM})"
    fp32_untaken = query.dtype == torch.float32 and max(sizes) > MAX_HEAD_DIM_FP32
    if fp32_untaken and kernels_run_on(query.device):  # Gemma 4's global 512 in fp32
        return (
            f"fp32 head dim {max(sizes)} (the kernel takes fp32 head dims to {MAX_HEAD_DIM_FP32})"
        )
    if query.shape[2] > key.shape[2]:
        return "more queries than keys"
    return None


def fastlm_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
):
    """transformers' attention-function interface on fastlm's flash attention kernels.

    Args:
        module: the calling attention module.
        query: (B, Hq, Tq, D); key, value: (B, Hkv, Tk, D) (grouped-query heads read as they are).
        attention_mask: what `fastlm_mask` returned (or a caller's 4-D mask).
        dropout: attention dropout (runs SDPA: the kernels have none).
        scaling: the softmax scale (default D ** -0.5).
        sliding_window: this layer's window W (query i sees keys i - W < j <= i), or None.
        softcap: this layer's score cap c (scores c * tanh(s / c)), or None.
        kwargs: `position_ids`, `cu_seq_lens_q/k`, `max_length_q/k` and what else the model
            passes.

    Returns:
        (output (B, Tq, Hq, D), None): no attention weights.

    Raises:
        ValueError: cu_seq_lens_q/k with fewer queries than keys (a cache in use).
    """
    query, key, value = _autocast(query, key, value)
    chunk = None
    if isinstance(attention_mask, Chunked):
        chunk, attention_mask = attention_mask
    reason = _fallback_reason(module, query, key, value, attention_mask, dropout, kwargs)
    if reason is not None:
        _warn_once(reason)
        return _fallback(
            module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
            chunk=chunk, **kwargs,
        )  # fmt: skip
    window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
    options = dict(softmax_scale=scaling, window_size=window, softcap=float(softcap or 0.0))
    if softcap:  # the approximate cap, opted into on the model's config (docs/huggingface.md)
        approx = getattr(getattr(module, "config", None), "fastlm_softcap_approx", False)
        options["softcap_approx"] = check_flag("config.fastlm_softcap_approx", approx)
    if kwargs.get("s_aux") is not None:
        options["sinks"] = kwargs["s_aux"]
    B, _, Tq, _ = query.shape
    Tk = key.shape[2]
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    given = all(x is not None for x in (cu_q, cu_k, max_q, max_k))
    keep = None
    packed = isinstance(attention_mask, Packed)
    if given and (attention_mask is None or packed):
        if Tq != Tk:
            raise ValueError(
                f"cu_seq_lens_q/k describe packed documents, but the attention has {Tq} queries "
                f"and {Tk} keys (a cache is in use): pass use_cache=False with them"
            )
        cu_q, cu_k = (cu.to(torch.int32).contiguous() for cu in (cu_q, cu_k))
        max_q, max_k = int(max_q), int(max_k)
    elif torch.is_tensor(attention_mask):  # (B, Tk) padding
        cu_k = padding_segments(attention_mask)
        keep = attention_mask[:, Tk - Tq :]  # the queries are the last Tq keys
        cu_q = cu_k if Tq == Tk else padding_segments(keep)
        max_q, max_k = Tq, Tk
    elif packed and Tq == Tk:
        if torch.compiler.is_compiling():
            # Compiling, transformers reports every row as packed: whether position_ids restart
            # cannot be read without a host synchronisation. A row that does restart fails.
            torch._assert_async(
                attention_mask.follows[:, 1:].all(),
                "fastlm.hf: under torch.compile, packed documents need cu_seq_lens_q/k and "
                "max_length_q/k (DataCollatorWithFlattening(return_flash_attn_kwargs=True)); "
                "position_ids that restart cannot be read while compiling",
            )
            cu_q = None
        else:
            cu_q, max_q = packed_documents(attention_mask.follows)
            cu_k, max_k = cu_q, max_q
    else:
        cu_q = None
    if chunk is not None:  # Llama 4: each row or document cut into chunks (Tq == Tk here)
        if cu_q is None:
            cu_q, max_q = torch.arange(B + 1, device=query.device, dtype=torch.int32) * Tq, Tq
        cu_q = cu_k = chunk_segments(cu_q, chunk)
        max_q = max_k = min(chunk, max_q)
    if cu_q is None:
        # (B, Tq, Hq, Dv), contiguous as transformers' own attention functions give it (some
        # families .view it; the kernel writes it in q's layout, where this copies nothing).
        out = flash_attention(query, key, value, causal=True, **options)
        return out.transpose(1, 2).contiguous(), None
    out = _varlen(query, key, value, cu_q, cu_k, max_q, max_k, options)
    if keep is not None:
        out = out * keep[:, :, None, None].to(out.dtype)  # padding rows: 0
    return out, None


# --------------------------------------------------------------------------------------------
# What the kernels do not run
# --------------------------------------------------------------------------------------------


def dense_mask(attention_mask, query, key, sliding_window, causal: bool = True, chunk=None):
    """The (B, 1, Tq, Tk) bool mask Hugging Face's eager attention applies for what fastlm_mask
    returned: causal (aligned to the end of the keys) with the window, or every key where not
    causal; padding; packed documents; chunks of `chunk` tokens from each row's first real token
    or each document's start (Tq == Tk)."""
    B, _, Tq, _ = query.shape
    Tk = key.shape[2]
    rows = torch.arange(Tq, device=query.device)[:, None] + (Tk - Tq)
    cols = torch.arange(Tk, device=query.device)
    visible = cols <= rows if causal else torch.ones(Tq, Tk, dtype=torch.bool, device=cols.device)
    if sliding_window and causal:
        visible &= cols > rows - sliding_window
    visible = visible.expand(B, 1, Tq, Tk)
    packed = isinstance(attention_mask, Packed)
    if torch.is_tensor(attention_mask):
        visible = visible & attention_mask[:, None, None, :].to(torch.bool)
    elif packed:
        document = (~attention_mask.follows).cumsum(1)
        visible = visible & (document[:, None, :, None] == document[:, None, None, :])
    if chunk:
        place = torch.arange(Tq, device=query.device).expand(B, Tq)
        if packed:  # each token's place in its document
            starts = torch.where(attention_mask.follows, 0, place)
            place = place - starts.cummax(1).values
        elif torch.is_tensor(attention_mask):
            place = attention_mask.to(torch.long).cumsum(1) - 1
        piece = place // chunk
        visible = visible & (piece[:, None, :, None] == piece[:, None, None, :])
    return visible


def _fallback(
    module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
    chunk=None, **kwargs,
):  # fmt: skip
    """transformers' SDPA function, or the family's eager attention for soft-capped scores,
    attention sinks and score biases."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mask = attention_mask
    if not (torch.is_tensor(mask) and mask.dim() == 4):
        causal = kwargs.get("is_causal") is not False and getattr(module, "is_causal", True)
        mask = dense_mask(mask, query, key, sliding_window, causal, chunk)
    plain = not any(torch.is_tensor(kwargs.get(n)) for n in SCORE_BIASES)
    if plain and not softcap and kwargs.get("s_aux") is None and value.shape[-1] == query.shape[-1]:
        return sdpa_attention_forward(
            module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if mask.dtype == torch.bool:  # eager attention adds the mask to the scores
        mask = torch.zeros_like(mask, dtype=query.dtype).masked_fill(
            ~mask, torch.finfo(query.dtype).min
        )
    eager = modeling_module(module).eager_attention_forward
    return eager(
        module, query, key, value, mask, dropout=dropout, scaling=scaling, softcap=softcap,
        **kwargs,
    )  # fmt: skip


def register() -> None:
    """Register `fastlm_attention` and `fastlm_mask` as "fastlm" in transformers (idempotent).

    After it, `model.set_attn_implementation("fastlm")` selects them; `patch` calls it.

    Raises:
        ModuleNotFoundError: transformers is not installed.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, fastlm_attention)
    AttentionMaskInterface.register(ATTENTION, fastlm_mask)
