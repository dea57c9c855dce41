"""Llama 4's query temperature inside kvserve's steps.

Llama 4's NoPE layers (no rotary embedding, `no_rope_layers`) scale each query by a temperature
that grows with the token's position: 1 + attn_scale * log1p(floor((p + 1) / floor_scale))
(`attn_temperature_tuning`). transformers takes p from its cache, as the cache's length plus the
token's index in the forward pass, which in a packed kvserve step (many sequences' tokens in one
flattened row, no transformers cache) would be the token's index in the step. Inside a step the
NoPE layer runs this module's forward instead, the same computation with p the token's own
position (`StepContext.positions`: its rope position, which for Llama 4, with no pictures
moving positions, is its position in the cache); outside one (transformers' own `generate`,
the families probe's reference) it runs its own.
"""

from __future__ import annotations

import torch

from server.engine import context


def modules(model) -> list[torch.nn.Module]:
    """The model's attention modules that scale queries by their position's temperature."""
    return [m for m in model.modules()
            if getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True) and hasattr(m, "floor_scale")]


def enable(model) -> int:
    """Switch every such module to the step's positions inside a kvserve step (once); returns
    how many run so (a module whose forward something else replaced first is left as it is)."""
    return sum(context.step_forward(module, _forward) for module in modules(model))


def scales(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """Each position's query temperature (float32), as Llama 4 computes it."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def _forward(module, original):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def forward(hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        step = context.current()
        if step is None:
            return original(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        if step.positions is None:
            raise RuntimeError("a step with 3-D rope positions (M-RoPE) reached Llama 4's query temperature")
        shape = hidden_states.shape[:-1]
        query = module.q_proj(hidden_states).view(*shape, -1, module.head_dim)
        key = module.k_proj(hidden_states).view(*shape, -1, module.head_dim)
        value = module.v_proj(hidden_states).view(*shape, -1, module.head_dim).transpose(1, 2)
        if hasattr(module, "qk_norm"):  # as transformers' forward (its NoPE layers have none)
            query, key = module.qk_norm(query), module.qk_norm(key)
        temperature = scales(step.positions.reshape(-1), module.floor_scale, module.attn_scale)
        query = (query * temperature.view(1, -1, 1, 1)).to(query.dtype)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, module.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS[module.config._attn_implementation]
        out, weights = attend(module, query, key, value, attention_mask, dropout=0.0, scaling=module.scaling, **kwargs)
        return module.o_proj(out.reshape(*shape, -1).contiguous()), weights

    return forward
