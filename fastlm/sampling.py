"""Autoregressive sampling: temperature, top-k and top-p (nucleus), with a KV cache when the model
has one. `fastlm.sample` (this module's `sample`) is the public function; `python -m
fastlm.cli.generate` is the command built on `sample_stream`.

A model with a KV cache exposes `make_kv_cache(batch_size)` and accepts `forward(token_ids,
kv_cache=cache)`; each step then feeds only the new token, also past the context, where the cache
slides (`fastlm.KVCache`): each token attends to itself and the context_length - 1 tokens before
it, their keys and values as computed when each was new, at the relative distances of the
context (a sliding-window attention). Any other model (the reference `Transformer`, say) runs
the whole window each step, padded on the right to the full context: causal attention keeps the
padding out of the real tokens' logits, and every step has the same shape, so code specialised
per shape (the reference's einx expressions) is prepared once rather than once per length. Past
the context it re-encodes the last `context_length` tokens at every step, from position 0: not
what the sliding cache computes (whose step costs one token's forward, not context_length
tokens').
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from fastlm.options import check


def check_sampling(
    temperature: float, top_k: int | None = None, top_p: float | None = None
) -> tuple[float, int | None, float | None]:
    """The sampler's settings, checked, as Python numbers (a huge int temperature as a float).

    Args:
        temperature: a finite number >= 0 (0: greedy).
        top_k: an integer >= 1, or None.
        top_p: a number in (0, 1], or None.

    Returns:
        (temperature as a float, top_k, top_p as a float or None).

    Raises:
        TypeError: naming the argument, for a setting that is not a number of its kind.
        ValueError: naming the argument, for a setting out of its range (`fastlm.options`).
    """
    return (
        check("temperature", temperature),
        check("top_k", top_k, none_ok=True),
        check("top_p", top_p, none_ok=True),
    )


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token id per row of `logits`; temperature 0 is greedy (argmax).

    The logits are shifted by each row's maximum and divided by the temperature in float64 (finite
    for any temperature > 0), then cut to the top_k largest and to the smallest set of likeliest
    tokens whose probability reaches top_p (the likeliest always stays), and one token is drawn
    from the softmax of what is left.

    Args:
        logits: (B, V), a float dtype.
        temperature: >= 0 (default 1.0); 0 takes the argmax.
        top_k: keep only the k likeliest tokens (default None: all).
        top_p: keep the nucleus of probability top_p, in (0, 1] (default None: all).
        generator: the random generator to draw with (default: PyTorch's global one).

    Returns:
        (B,) int64 token ids.

    Raises:
        ValueError: a bad setting (`check_sampling`), or (temperature > 0) logits that are not all
            finite.
    """
    temperature, top_k, top_p = check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    if not torch.isfinite(logits).all():
        raise ValueError(
            "the model's logits are not all finite (inf or NaN), so there is no "
            "distribution to sample from; was the checkpoint trained to a NaN loss?"
        )
    # In float64 and relative to the row's maximum, dividing by any temperature > 0 stays
    # finite (the likeliest token at 0, the others below it), down to the smallest float.
    logits = logits.double()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def sample_stream(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the next token ids one step at a time, as `sample` draws them.

    Args:
        model: a model with `context_length` whose forward gives logits (B, T, V); one with
            `make_kv_cache` is run with its KV cache (see the module docstring).
        prompt_ids: (T,) or (B, T) token ids, T >= 1.
        max_new_tokens: the number of steps, >= 0.
        temperature, top_k, top_p, generator: as in `sample_next`.
        vocab_size: only ids below it (those a tokenizer can decode) are ever drawn (default
            None: every logit of the model), >= 1.

    Yields:
        (B,) int64, the next token of each row (B = 1 for a 1-D prompt).

    Raises:
        ValueError: a bad setting, an empty prompt, a negative max_new_tokens or a vocab_size
            below 1 (at the first step).
    """
    check_sampling(temperature, top_k, top_p)
    tokens = prompt_ids if prompt_ids.dim() == 2 else prompt_ids.unsqueeze(0)  # (B, T)
    if tokens.shape[-1] == 0:
        raise ValueError("prompt_ids must hold at least one token")
    check("max_new_tokens", max_new_tokens)
    check("vocab_size", vocab_size, none_ok=True)
    context = model.context_length
    window = tokens[:, -context:]
    cache = model.make_kv_cache(window.shape[0]) if hasattr(model, "make_kv_cache") else None
    new = window  # the tokens the cache has not seen
    for _ in range(max_new_tokens):
        length = window.shape[1]
        if cache is not None:
            logits = model(new, kv_cache=cache)[:, -1]
        else:
            padded = window.new_zeros(window.shape[0], context)
            padded[:, :length] = window
            logits = model(padded)[:, length - 1]
        next_ids = sample_next(logits[:, :vocab_size], temperature, top_k, top_p, generator)
        yield next_ids
        new = next_ids[:, None]
        window = torch.cat([window, new], dim=1)[:, -context:]


def sample(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """The prompt followed by `max_new_tokens` sampled tokens, in the prompt's shape.

    Runs under torch.no_grad. Past the context, a model with a KV cache slides it (each token
    attends to the context_length - 1 before it); any other model re-encodes the last
    context_length tokens at each step (see the module docstring).

    Args:
        model: as in `sample_stream`: a model with `context_length`, run with its KV cache when it
            has `make_kv_cache` (`fastlm.Transformer`).
        prompt_ids: (T,) or (B, T) token ids, T >= 1.
        max_new_tokens: the number of tokens to draw, >= 0.
        temperature: >= 0 (default 1.0); 0 is greedy.
        top_k: keep only the k likeliest tokens at each step (default None: all).
        top_p: keep the nucleus of probability top_p, in (0, 1] (default None: all).
        generator: the random generator to draw with (default: PyTorch's global one).
        vocab_size: only ids below it are ever drawn (see `sample_stream`; default None).

    Returns:
        (T + max_new_tokens,) or (B, T + max_new_tokens) token ids, on prompt_ids' device.

    Raises:
        ValueError: as `sample_stream` and `sample_next`.
    """
    new = list(
        sample_stream(
            model, prompt_ids, max_new_tokens, temperature, top_k, top_p, generator, vocab_size
        )
    )
    tokens = prompt_ids if prompt_ids.dim() == 2 else prompt_ids.unsqueeze(0)
    out = torch.cat([tokens, *[t[:, None] for t in new]], dim=1)
    return out if prompt_ids.dim() == 2 else out.squeeze(0)
