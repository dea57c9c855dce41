"""The only code that touches KV cache tensors (transformers `StaticCache` internals).

Verified against transformers 5.23 (see DESIGN.md, "cache facts"): each `StaticLayer` writes at
its `cumulative_length`, and the attention mask follows the `cache_position`s the caller passes.
Keep every touch of those internals in this module so a transformers upgrade breaks one file.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig, StaticCache

MIN_BUCKET = 256


def capacity_bucket(n_tokens: int, max_context: int, min_bucket: int = MIN_BUCKET) -> int:
    """Smallest power-of-two capacity >= n_tokens (at least `min_bucket`), capped at the context.

    NOTE: a StaticCache attends over its whole capacity every step, so capacities follow need
    instead of always being the full context.
    """
    capacity = min_bucket
    while capacity < n_tokens:
        capacity *= 2
    return min(capacity, max_context)


def allocate(config: PretrainedConfig, capacity: int, device: torch.device, dtype: torch.dtype) -> StaticCache:
    """A StaticCache for one sequence, its tensors allocated now (not on the first forward)."""
    text_config = config.get_text_config(decoder=True)
    cache = StaticCache(config=text_config, max_cache_len=capacity)
    heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or (
        text_config.hidden_size // text_config.num_attention_heads
    )
    probe = torch.empty((1, heads, 0, head_dim), device=device, dtype=dtype)
    for layer in cache.layers:
        layer.lazy_initialization(probe, probe)
    return cache


def nbytes(cache: StaticCache) -> int:
    """Bytes held by the cache's key and value tensors."""
    return sum(
        layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        for layer in cache.layers
        if layer.is_initialized
    )


def capacity(cache: StaticCache) -> int:
    """How many positions the full-attention layers can hold."""
    return max(layer.max_cache_len for layer in cache.layers)
