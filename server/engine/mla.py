"""Multi-head latent attention served from its latent: DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash,
MiniCPM3, LongCat, Kimi-Linear's attention layers, every family whose attention module
decompresses a latent through `expand_kv`.

Per token and layer such a model computes a normalized compressed KV c (`kv_lora_rank` wide,
512 for DeepSeek-V3) and one rotary key k_rot shared by every head (`qk_rope_head_dim`, 64);
transformers' `expand_kv` turns them into per-head keys [k_nope_h | k_rot] and values v_h with
`kv_b_proj` (W_h = [W_UK_h; W_UV_h] per head), and a pool holding those holds 128 x (192 + 128)
values per token where the latent is 576 (`kv.Layout.latent`: 71x less for DeepSeek-V3).

Served from the latent, the pool keeps (k_rot, c) as one KV "head" (key and value), and the
attention absorbs the up-projection (`absorb`, `expand`): a head's score q_h . k_h is
q_nope_h . (W_UK_h c) + q_rot_h . k_rot = (W_UK_h^T q_nope_h) . c + q_rot_h . k_rot, so the
query [W_UK_h^T q_nope_h | q_rot_h] meets the key [c | k_rot] (`meet`) with the module's own
scale (YaRN's mscale included); the output sum_j p_j W_UV_h c_j = W_UV_h (sum_j p_j c_j) leaves
through the value up-projection. That is multi-query attention with one KV head of
`kv_lora_rank + qk_rope_head_dim` and values the keys' first `kv_lora_rank` columns, which every
attention path of server/engine/attention.py runs as it runs grouped-query attention. A long
prefill chunk (`decompresses`) instead attends the keys and values decompressed from the pool
(`decompress`), as transformers does, which costs less from some length on; exact mode absorbs
everywhere.

The seam: every MLA module of transformers 5.x normalizes the latent, rotates k_rot and then
calls `self.expand_kv(latent, k_rot)`; inside a kvserve step over a latent pool the module's
`expand_kv` (`enable`) hands them on as they are, as the key (k_rot) and value (c) the
attention function receives. Everything before it (projections, norms, LongCat's scales, the
rope, interleaved or not) stays the family's own code.

`configure` decides per model (`--mla-cache`): the latent wherever it can (`refusal` says where
it cannot: a `kv_b_proj` that is not a plain dense weight, LoRA adapters that may target it),
transformers' decompressed heads otherwise. families.check's probe then holds the latent to
transformers' own forward, and a family whose latent differs goes back to its heads (`auto`) or
is refused by name (`latent`), never served different.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from cache_manager import kv
from server.engine import context, exact
from server.engine.unsupported import UnsupportedModel

MODES = ("auto", "latent", "heads")

log = logging.getLogger(__name__)


def modules(model) -> list[torch.nn.Module]:
    """The model's MLA attention modules: those that decompress a latent through `expand_kv`
    with a `kv_b_proj`."""
    return [m for m in model.modules() if callable(getattr(type(m), "expand_kv", None)) and hasattr(m, "kv_b_proj")]


def refusal(found: list[torch.nn.Module]) -> str | None:
    """Why a model with these MLA modules (`modules`) cannot be served from its latent (None: it can)."""
    for module in found:
        proj = module.kv_b_proj
        if type(proj) is not torch.nn.Linear or type(proj.weight) not in (torch.Tensor, torch.nn.Parameter) or proj.bias is not None:
            return (f"{type(module).__name__}.kv_b_proj is not a plain dense linear layer ({type(proj).__name__}), whose "
                    "weight the latent's attention absorbs")
    return None


def configure(model, mode: str = "auto", *, lora: bool = False) -> str:
    """Decide how `model`'s pool keeps an MLA model's KV, before any pool is sized for it:
    "latent" (`mode` auto or latent, where `refusal` allows it and, in auto, no LoRA adapter may
    target `kv_b_proj`) or "heads". Marks the text config (`kv.LATENT`), which `kv.layout` reads.
    Returns the choice, or "n/a" for a model without MLA. UnsupportedModel when `mode` is
    "latent" and the model cannot be served so."""
    if mode not in MODES:
        raise ValueError(f"unknown MLA cache mode {mode!r}: choose one of {', '.join(MODES)}")
    config = model.config.get_text_config(decoder=True)
    found = modules(model)
    if not found:
        if mode == "latent":
            raise UnsupportedModel("mla-latent", "--mla-cache latent: it has no multi-head latent attention")
        return "n/a"
    reason = refusal(found)
    if reason is None and lora and mode == "auto":
        reason = "LoRA adapters are served, and one may target kv_b_proj, which the latent's attention absorbs"
    if mode == "latent" and reason is not None:
        raise UnsupportedModel("mla-latent", f"--mla-cache latent: {reason}")
    choice = "heads" if mode == "heads" or reason is not None else "latent"
    if mode == "auto" and reason is not None:
        log.info("MLA: its pool keeps decompressed keys and values per head: %s", reason)
    setattr(config, kv.LATENT, choice)
    model._kvserve_mla_required = mode == "latent"
    return choice


def configured(model) -> bool:
    """Whether `configure` has decided for `model`."""
    return getattr(model.config.get_text_config(decoder=True), kv.LATENT, None) is not None


def fall_back(model, why: str) -> None:
    """The latent failed families.check's probe: back to the decompressed heads (`auto`), or
    UnsupportedModel naming why (`--mla-cache latent`)."""
    if getattr(model, "_kvserve_mla_required", False):
        raise UnsupportedModel("mla-latent", f"--mla-cache latent: served from its latent, {why}")
    log.warning("MLA: served from its latent, %s; its pool keeps decompressed keys and values per head instead", why)
    setattr(model.config.get_text_config(decoder=True), kv.LATENT, "heads")


def enable(model) -> bool:
    """Switch every MLA module's `expand_kv` to hand the latent on inside a kvserve step over a
    latent pool (the module docstring); outside one, and over a pool of heads, it decompresses
    as before. Later calls do nothing. Returns whether the model has MLA modules."""
    found = modules(model)
    for module in found:
        if "expand_kv" not in vars(module):
            module.expand_kv = _expand_kv(module.expand_kv)
    return bool(found)


def _expand_kv(original):
    def expand_kv(latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        step = context.current()
        if step is not None and step.pool.layout.latent:
            return k_rot, latent  # the pool's key and value: [1, 1, N, rope], [1, 1, N, rank]
        return original(latent, k_rot)

    return expand_kv


def _weights(module) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's key and value up-projections per head, views of `kv_b_proj`'s weight:
    W_UK [H, nope, rank] and W_UV [H, v, rank]."""
    nope = module.qk_nope_head_dim
    weight = module.kv_b_proj.weight
    per_head = weight.view(-1, nope + module.v_head_dim, weight.shape[1])
    return per_head[:, :nope], per_head[:, nope:]


def absorb(module, query: torch.Tensor, exact_mode: bool) -> torch.Tensor:
    """The module's queries [1, H, N, nope + rope] as they meet the latent: [1, H, N, rank +
    rope], each head's q_nope through its key up-projection (W_UK_h^T q_nope_h), q_rot as it is."""
    nope = module.qk_nope_head_dim
    w_uk, _ = _weights(module)
    q_nope, q_rot = query[0, :, :, :nope], query[0, :, :, nope:]
    if exact_mode:
        per_head = _exact_weights(module)[0]
        q_lat = torch.stack([exact.product(q_nope[h], per_head[h]) for h in range(q_nope.shape[0])])
    else:
        q_lat = torch.matmul(q_nope, w_uk)  # [H, N, nope] @ [H, nope, rank]
    return torch.cat([q_lat, q_rot], dim=-1)[None]


def expand(module, out: torch.Tensor, exact_mode: bool) -> torch.Tensor:
    """The attention's output over the latent [1, N, H, rank] through each head's value
    up-projection: [1, N, H, v] (what the module's `o_proj` takes)."""
    _, w_uv = _weights(module)
    per_head = out[0].transpose(0, 1)  # [H, N, rank]
    if exact_mode:
        weights = _exact_weights(module)[1]
        o = torch.stack([exact.product(per_head[h], weights[h]) for h in range(per_head.shape[0])])
    else:
        o = torch.matmul(per_head, w_uv.transpose(1, 2))  # [H, N, rank] @ [H, rank, v]
    return o.transpose(0, 1)[None]


def _exact_weights(module) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact mode's up-projections as linear layers' weights, one per head, made once:
    W_UK_h^T [H, rank, nope] and W_UV_h [H, v, rank], contiguous (each head's product is an
    F.linear over whole tiles of rows, `exact.product`, as the linear layers' are)."""
    weights = getattr(module, "_kvserve_mla_exact", None)
    if weights is None:
        w_uk, w_uv = _weights(module)
        weights = module._kvserve_mla_exact = (w_uk.transpose(1, 2).contiguous(), w_uv.contiguous())
    return weights


def decompresses(module, tokens: int) -> bool:
    """Whether a row of `tokens` new tokens attends the keys decompressed rather than absorbed:
    per key position, absorbing costs H * tokens * (2 rank + rope) multiply-adds, decompressing
    H * rank * (nope + v) once plus H * tokens * (nope + rope + v), so it pays for rows longer
    than rank (nope + v) / (2 rank - nope - v) tokens (from 399 for GLM-4.7-Flash's shape, 171
    for DeepSeek-V3's; measured: docs/benchmarks.md, "MLA from its latent")."""
    rank, nope, v = module.kv_b_proj.in_features, module.qk_nope_head_dim, module.v_head_dim
    saved = 2 * rank - nope - v
    return tokens > 1 and (saved <= 0 or tokens * saved > rank * (nope + v))


def decompress(module, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A latent pool's positions as transformers' `expand_kv` decompresses them: latent [1, 1,
    L, rank] and k_rot [1, 1, L, rope] -> keys [1, H, L, nope + rope] and values [1, H, L, v],
    through `kv_b_proj`'s weight itself (no LoRA wrapper or packed copy sees these rows, which
    are not the step's tokens)."""
    nope, v, rope = module.qk_nope_head_dim, module.v_head_dim, k_rot.shape[-1]
    length = latent.shape[2]
    per_head = F.linear(latent[0, 0], module.kv_b_proj.weight).view(length, -1, nope + v).transpose(0, 1)  # [H, L, nope + v]
    heads = per_head.shape[0]
    keys = per_head.new_empty(heads, length, nope + rope)
    keys[..., :nope] = per_head[..., :nope]
    keys[..., nope:] = k_rot[0]
    return keys[None], per_head[None, :, :, nope:]


def meet(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The keys a query meets: a latent pool's (keys narrower than the absorbed query) are its
    latent and rotary key side by side, [..., rank + rope]; any other pool's as they are."""
    if keys.shape[-1] == query.shape[-1]:
        return keys
    return torch.cat([values, keys], dim=-1)
