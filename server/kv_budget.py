"""How many bytes the KV pool gets, chosen once at start-up, and the check that one sequence at
the full context fits them.

* `--kv-budget-bytes`: that, on any device.
* A GPU: measured, after the model (and a draft model) is loaded, the way vLLM and SGLang size
  their pools. One forward pass at `--max-batch-tokens` gives the activation peak; then

      budget = utilization x total memory - memory in use (weights, CUDA context, cuBLAS
               workspace, other processes) - activation peak - attention workspace - reserve
               - the vision encoder's feature cache (a vision-language model: --encoder-cache-bytes)

  The attention workspace is computed, not measured: kvserve's attention (server/engine/attention.py)
  gathers each row's keys and values out of the pool into one dense tensor per layer (in the
  compute dtype, plus the raw bytes before dequantizing a quantized pool), for a decode batch of
  `--max-running` rows over the full context or one prefill chunk of `--max-batch-tokens`
  tokens over it, with its additive mask; the larger of the two is held at once.
* A CPU: `--kv-budget-fraction` of physical RAM (the rule before the measurement existed).

Whichever it is, a budget that cannot hold one sequence at the full context is a start-up error
(`KVBudgetError`) that says what it holds, what one sequence needs, and the ways out, instead of
an out-of-memory crash or a refused request later.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from cache_manager import kv
from server.engine import vision

log = logging.getLogger(__name__)

RESERVE_BYTES = 512 * 2**20  # allocator fragmentation, the CUDA graphs' pool, sampling buffers
GiB = 2**30


class KVBudgetError(ValueError):
    """The KV budget cannot hold one sequence at the full context (message for the operator)."""


@dataclass(frozen=True, slots=True)
class Budget:
    """The KV budget chosen and where it came from (`how`: for the start-up log)."""

    nbytes: int
    how: str


def choose(settings, model, device: torch.device, max_context: int) -> Budget:
    """The KV budget for `settings` (see the module docstring); measures on CUDA (runs one
    forward pass of `model`)."""
    if settings.kv_budget_bytes is not None:
        return Budget(settings.kv_budget_bytes, "--kv-budget-bytes")
    if device.type == "cuda":
        return measure(
            model, device,
            utilization=settings.gpu_memory_utilization,
            max_batch_tokens=settings.max_batch_tokens,
            max_rows=settings.max_running,
            max_context=max_context,
            kv_dtype=settings.kv_cache_dtype,
            logits_rows=settings.max_running * (1 + (settings.speculative_max_draft if settings.speculative != "off" else 0)),
            encoder_cache_bytes=settings.encoder_cache_bytes if vision.sees_images(model, settings.deterministic) else 0,
        )
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Budget(int(total * settings.kv_budget_fraction), f"--kv-budget-fraction {settings.kv_budget_fraction} of {total / GiB:.1f} GiB RAM")


def measure(model, device: torch.device, *, utilization: float, max_batch_tokens: int, max_rows: int,
            max_context: int, kv_dtype: str, logits_rows: int, encoder_cache_bytes: int = 0) -> Budget:
    """The budget a CUDA device leaves the KV pool (the module docstring's formula); 0 or less
    when nothing is left (`check` then refuses it)."""
    peak = activation_peak(model, device, max_batch_tokens, min(logits_rows, max_batch_tokens))
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    layout = kv.layout(model.config)
    workspace = attention_workspace(layout, layout.groups * layout.kv_heads, model.dtype, kv_dtype,
                                    rows=max_rows, chunk=max_batch_tokens, context=max_context)
    nbytes = int(utilization * total) - in_use - peak - workspace - RESERVE_BYTES - encoder_cache_bytes
    how = (f"measured: {utilization} x {total / GiB:.1f} GiB - {in_use / GiB:.2f} GiB in use - "
           f"{peak / GiB:.2f} GiB forward peak at {max_batch_tokens} tokens - {workspace / GiB:.2f} GiB attention "
           f"workspace - {RESERVE_BYTES / GiB:.2f} GiB reserve")
    if encoder_cache_bytes:
        how += f" - {encoder_cache_bytes / GiB:.2f} GiB vision encoder cache"
    return Budget(max(nbytes, 0), how)


def activation_peak(model, device: torch.device, tokens: int, logits_rows: int) -> int:
    """Bytes a forward pass of `tokens` tokens allocates at its peak beyond what is held before
    it (CUDA; the model's own attention: kvserve's workspace is `attention_workspace`). Also the
    warm-up that makes cuBLAS take its workspace before free memory is read."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    ids = torch.zeros((1, tokens), dtype=torch.long, device=device)
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False, logits_to_keep=logits_rows)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def attention_workspace(layout: kv.Layout, heads: int, dtype: torch.dtype, kv_dtype: str, *, rows: int, chunk: int, context: int) -> int:
    """Bytes kvserve's attention holds at once for one layer (the module docstring): the larger
    of a decode batch of `rows` rows and a prefill chunk of `chunk` tokens, each row reading
    `context` positions; none for a model none of whose layers attends."""
    if not layout.attending:
        return 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_position = layout.kv_heads * (layout.key_dim + layout.value_dim) * itemsize  # keys and values, dequantized
    if layout.latent:  # and both side by side, as the absorbed queries meet them (server/engine/mla.py)
        per_position *= 2
    if kv.kv_format(kv_dtype).quantized:
        per_position += layout.bytes_per_token(dtype, kv_dtype) // len(layout.owners)  # one layer's stored bytes
    groups = heads // layout.kv_heads
    decode = rows * context * (per_position + itemsize)  # + the mask
    prefill = context * per_position + groups * chunk * context * itemsize
    return max(decode, prefill)


def check(budget: Budget, pool_bytes: int, model_config, dtype: torch.dtype, kv_dtype: str, max_context: int) -> int:
    """Raise KVBudgetError unless `pool_bytes` (the budget less a draft model's share) holds one
    sequence of `max_context` tokens; returns the tokens it holds."""
    per_token = kv.layout(model_config).bytes_per_token(dtype, kv_dtype)
    block_bytes = kv.BLOCK_SIZE * per_token
    tokens = max(pool_bytes, 0) // block_bytes * kv.BLOCK_SIZE if block_bytes else max_context  # states only: any
    need = kv.bytes_for(model_config, max_context, dtype, kv_dtype, sequences=1)  # a hybrid's state too
    if not block_bytes and kv.blocks_for(max_context) > kv.MAX_STATELESS_BLOCKS:  # states only: positions are bookkept
        raise KVBudgetError(f"a context of {max_context} tokens is longer than a model that keeps states only is served "
                            f"with ({kv.MAX_STATELESS_BLOCKS * kv.BLOCK_SIZE}): lower --max-model-len")
    if pool_bytes < need and not block_bytes:  # states only (Mamba): the length costs nothing
        raise KVBudgetError(f"the KV budget of {_size(pool_bytes)} ({budget.how}) holds no recurrent state of {_size(need)} "
                            "(a model none of whose layers attends keeps states only): give more memory "
                            "(--kv-budget-bytes, --gpu-memory-utilization)")
    if pool_bytes < need:
        raise KVBudgetError(
            f"the KV budget of {_size(pool_bytes)} ({budget.how}) holds {tokens} tokens of {kv_dtype} KV "
            f"({per_token} bytes per token), but one sequence at the full context of {max_context} tokens "
            f"needs {_size(need)}: give more memory (--kv-budget-bytes, --gpu-memory-utilization), store "
            f"less per token (--kv-cache-dtype fp8), or lower --max-model-len to at most {tokens}"
        )
    return tokens


def _size(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB ({nbytes} bytes)"
