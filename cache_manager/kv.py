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


def _kv_shape(text_config) -> tuple[int, int]:
    heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or (
        text_config.hidden_size // text_config.num_attention_heads
    )
    return heads, head_dim


def allocate(config: PretrainedConfig, capacity: int, device: torch.device, dtype: torch.dtype) -> StaticCache:
    """A StaticCache for one sequence, its tensors allocated now (not on the first forward)."""
    text_config = config.get_text_config(decoder=True)
    cache = StaticCache(config=text_config, max_cache_len=capacity)
    heads, head_dim = _kv_shape(text_config)
    probe = torch.empty((1, heads, 0, head_dim), device=device, dtype=dtype)
    for layer in cache.layers:
        layer.lazy_initialization(probe, probe)
    # NOTE: a sliding layer's own size is min(window, capacity), so the layers alone cannot
    # tell how many positions the cache may take; the requested capacity is kept beside them.
    cache.kvserve_capacity = capacity
    return cache


def length(cache: StaticCache) -> int:
    """Tokens written so far (the same on every layer)."""
    layer = cache.layers[0]
    return int(layer.cumulative_length_int if layer.is_sliding else layer.cumulative_length)


def _set_length(layer, n: int) -> None:
    layer.cumulative_length.fill_(n)
    if layer.is_sliding:
        layer.cumulative_length_int = n


def can_crop(cache: StaticCache) -> bool:
    """Whether the cache can be cut back to any shorter length.

    Full-attention layers always can. A sliding-window layer can while it has not wrapped
    (length <= its window): past that, the oldest positions were overwritten.
    """
    n = length(cache)
    return all(not layer.is_sliding or n <= layer.max_cache_len for layer in cache.layers)


def crop(cache: StaticCache, n: int) -> None:
    """Cut the cache back to its first `n` tokens, in place.

    NOTE: StaticLayer has no crop(); each layer writes at its `cumulative_length` and the mask
    follows the `cache_position`s the caller passes, so lowering the lengths is the crop. The
    stale positions past `n` are masked out, then overwritten by the next writes.
    """
    current = length(cache)
    if not 0 <= n <= current:
        raise ValueError(f"cannot crop a cache of {current} tokens to {n}")
    if n < current and not can_crop(cache):
        raise ValueError("a sliding-window layer has wrapped: this cache cannot be cropped")
    for layer in cache.layers:
        _set_length(layer, n)


def grow(cache: StaticCache, config: PretrainedConfig, new_capacity: int) -> StaticCache:
    """A larger cache holding the same tokens: allocate, copy the KV, copy the lengths.

    The old cache is left as it was (the caller drops it). A sliding layer that has wrapped is
    already at its window size, so it is copied whole.
    """
    n = length(cache)
    if new_capacity < n:
        raise ValueError(f"new capacity {new_capacity} < {n} cached tokens")
    first = cache.layers[0]
    bigger = allocate(config, new_capacity, first.keys.device, first.keys.dtype)
    for old, new in zip(cache.layers, bigger.layers):
        kept = min(n, old.max_cache_len)
        new.keys[:, :, :kept].copy_(old.keys[:, :, :kept])
        new.values[:, :, :kept].copy_(old.values[:, :, :kept])
        _set_length(new, n)
    return bigger


def bytes_for(config: PretrainedConfig, capacity: int, dtype: torch.dtype) -> int:
    """Bytes `allocate(config, capacity, ...)` will take, without allocating."""
    text_config = config.get_text_config(decoder=True)
    layers = StaticCache(config=text_config, max_cache_len=capacity).layers  # tensors are lazy
    heads, head_dim = _kv_shape(text_config)
    per_position = 2 * heads * head_dim * torch.empty((), dtype=dtype).element_size()
    return sum(layer.max_cache_len for layer in layers) * per_position


def nbytes(cache: StaticCache) -> int:
    """Bytes held by the cache's key and value tensors."""
    return sum(
        layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        for layer in cache.layers
        if layer.is_initialized
    )


def capacity(cache: StaticCache) -> int:
    """How many positions the cache may take before it must grow (sliding layers roll past
    their window, but a layer smaller than its window must not roll: it would shrink it)."""
    return cache.kvserve_capacity
