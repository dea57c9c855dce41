"""Differential attention (DiffLlama) in one attention call per layer inside kvserve's steps.

DiffLlama's layer attends twice with the same queries and keys: once to the first half of its
value heads, once to the second half (each half repeated to the KV heads), and subtracts the
second result, scaled by a learned lambda, from the first. kvserve's attention stores the KV it
is handed at every call, so two calls per layer would store each position twice. Both calls
share their softmax, and a softmax's product with values side by side is the two products side
by side, so inside a step the layer makes one call whose values are both halves concatenated
along the head width (the pool's values are twice the head size wide: `kv.layout`). Outside
kvserve's steps (transformers' own `generate`) the layer runs its own forward.
"""

from __future__ import annotations

import sys

import torch

from server.engine import context


def modules(model) -> list[torch.nn.Module]:
    """The model's differential attention modules (their learned lambdas and group norm)."""
    return [m for m in model.modules() if hasattr(m, "lambda_q1") and hasattr(m, "lambda_init") and hasattr(m, "groupnorm")]


def enable(model) -> int:
    """Switch every differential attention module to one call inside a kvserve step (once);
    returns how many run so (a module whose forward something else replaced first is left as
    it is)."""
    return sum(context.step_forward(module, _forward) for module in modules(model))


def _forward(module, original):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    rotate = sys.modules[type(module).__module__].apply_rotary_pos_emb

    def forward(hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        if context.current() is None:
            return original(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        shape = (*hidden_states.shape[:-1], -1, module.head_dim)
        query, key, value = (p(hidden_states).view(shape).transpose(1, 2) for p in (module.q_proj, module.k_proj, module.v_proj))
        query, key = rotate(query, key, *position_embeddings)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, module.layer_idx)
        # each half of the value heads repeated to the KV heads, the two halves side by side
        value = torch.cat([half.repeat(1, 2, 1, 1) for half in torch.chunk(value, 2, dim=1)], dim=-1)
        attend = ALL_ATTENTION_FUNCTIONS[module.config._attn_implementation]
        out, weights = attend(module, query, key, value, attention_mask, dropout=0.0, scaling=module.scaling, **kwargs)
        first, second = torch.chunk(out, 2, dim=2)  # the heads' two halves, paired as the model pairs them
        lambdas = [torch.exp(torch.sum(q * k, dim=-1, dtype=torch.float32)).to(query.dtype)
                   for q, k in ((module.lambda_q1, module.lambda_k1), (module.lambda_q2, module.lambda_k2))]
        out = first - (lambdas[0] - lambdas[1] + module.lambda_init) * second
        out = (1 - module.lambda_init) * module.groupnorm(out)
        return module.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), weights

    return forward
