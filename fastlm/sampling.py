"""Autoregressive sampling: temperature, top-k and top-p (nucleus), with a KV cache when the model
has one.

A model with a KV cache exposes `make_kv_cache(batch_size)` and accepts `forward(token_ids,
token_positions, kv_cache=cache)`; each step then feeds only the new token. Any other model (the
reference `Transformer`, say) recomputes the whole window each step. When the context is full, both
keep the last `context_length` tokens (a cached model restarts its cache on that window).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of `logits` [B, V]; temperature 0 is greedy (argmax)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
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
def generate_stream(model: torch.nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int,
                    temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                    generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token ids [B] one step at a time, for a prompt [T] or [B, T]."""
    tokens = prompt_ids if prompt_ids.dim() == 2 else prompt_ids.unsqueeze(0)  # (B, T)
    if tokens.shape[-1] == 0:
        raise ValueError("prompt_ids must hold at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    context = model.context_length
    use_cache = hasattr(model, "make_kv_cache")
    cache, cached_len = None, 0  # tokens of `window` already in the cache
    window = tokens[:, -context:]
    for _ in range(max_new_tokens):
        if use_cache:
            if cache is None:
                cache, cached_len = model.make_kv_cache(window.shape[0]), 0
            new = window[:, cached_len:]
            positions = torch.arange(cached_len, window.shape[1], device=window.device)
            logits = model(new, positions, kv_cache=cache)
            cached_len = window.shape[1]
        else:
            logits = model(window)
        next_ids = sample_next(logits[:, -1], temperature, top_k, top_p, generator)  # (B,)
        yield next_ids
        window = torch.cat([window, next_ids[:, None]], dim=1)
        if window.shape[1] > context:  # the context is full: slide, and rebuild the cache on it
            window, cache = window[:, -context:], None


def generate(model: torch.nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """The prompt followed by `max_new_tokens` sampled tokens, in the prompt's shape ([T] or [B, T])."""
    new = list(generate_stream(model, prompt_ids, max_new_tokens, temperature, top_k, top_p,
                               generator))
    tokens = prompt_ids if prompt_ids.dim() == 2 else prompt_ids.unsqueeze(0)
    out = torch.cat([tokens, *[t[:, None] for t in new]], dim=1)
    return out if prompt_ids.dim() == 2 else out.squeeze(0)
