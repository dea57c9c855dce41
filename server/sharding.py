"""How a model is split over tensor-parallel ranks (server/parallel.py): transformers' own plan
for its family, loaded shard by shard (`plan`), and this rank's KV heads (`keep_rank_kv_heads`).

The attention heads are split evenly: each rank computes heads / N query heads. The KV heads
are split evenly where N divides them; where they are fewer than the ranks (and divide N),
every rank keeps the one KV head its query heads read, as vLLM does: the plan's key and value
projections are replicated instead of split, then cut to that head. Refused by name
(`UnsupportedModel`): a family without a plan, heads N does not divide, and what kvserve does not
shard yet (recurrent layers, pictures, quantized weights).
"""

from __future__ import annotations

import re

import torch
import transformers

from cache_manager import kv, state
from server.engine.unsupported import UnsupportedModel

_KV_PROJECTIONS = ("k_proj", "v_proj")


def plan(config, ranks: int, *, vision: bool, quantized: bool):
    """The `distributed_config` that loads `config`'s model split over `ranks` ranks, or
    UnsupportedModel naming why it cannot be."""
    from transformers.distributed import DistributedConfig

    text = config.get_text_config(decoder=True)
    kind = text.model_type
    rules = getattr(text, "base_model_tp_plan", None)
    if not rules:
        raise UnsupportedModel("tensor-parallel-plan", f"{kind} has no tensor-parallel plan in transformers {transformers.__version__}: "
                               "serve it with --tensor-parallel-size 1")
    heads, kv_heads = _heads(text)
    if heads % ranks:
        raise UnsupportedModel("tensor-parallel-heads", f"{kind}'s {heads} attention heads do not split over {ranks} ranks: "
                               f"choose a --tensor-parallel-size that divides {heads}")
    overrides = {}
    if kv_heads % ranks:
        projections = _kv_projections(rules)
        if kv_heads > ranks or ranks % kv_heads or projections is None:
            raise UnsupportedModel("tensor-parallel-heads", f"{kind}'s {kv_heads} KV heads neither split over {ranks} ranks nor "
                                   f"divide them: choose a --tensor-parallel-size that divides {kv_heads} or that {kv_heads} divides")
        prefix = _base_prefix(config)
        overrides = {f"{prefix}{rule}": "replicate" for rule in projections}
    if vision:
        raise UnsupportedModel("tensor-parallel-vision", "a vision-language model is not served with --tensor-parallel-size > 1 yet")
    if quantized:
        raise UnsupportedModel("tensor-parallel-quantized", "quantized weights are not sharded by kvserve yet: --tensor-parallel-size 1")
    if state.spec(config, torch.float32) is not None:
        raise UnsupportedModel("tensor-parallel-recurrent", f"{kind} keeps recurrent state, which kvserve does not shard yet: "
                               "--tensor-parallel-size 1")
    return DistributedConfig(tp_size=ranks, tp_plan=overrides or "auto")


def keep_rank_kv_heads(model, ranks: int) -> None:
    """After loading: mark the text config (`kv.SHARDS`: each rank's pool keeps its share of
    the KV heads) and, where the KV projections were replicated (`plan`), cut them to this
    rank's KV head, telling each attention module its query heads per KV head."""
    import torch.distributed as dist

    text = model.config.get_text_config(decoder=True)
    setattr(text, kv.SHARDS, ranks)
    heads, kv_heads = _heads(text)
    if kv_heads % ranks == 0:
        return
    head = dist.get_rank() // (ranks // kv_heads)  # the KV head this rank's query heads read
    width = getattr(text, "head_dim", None) or text.hidden_size // heads
    patterns = [re.compile(re.escape(rule).replace(r"\*", r"\d+") + "$") for rule in _kv_projections(text.base_model_tp_plan)]
    for name, module in model.named_modules():
        if any(p.search(name) for p in patterns):
            rows = slice(head * width, (head + 1) * width)
            module.weight = torch.nn.Parameter(module.weight.detach()[rows].clone(), requires_grad=False)
            if module.bias is not None:
                module.bias = torch.nn.Parameter(module.bias.detach()[rows].clone(), requires_grad=False)
            module.out_features = width
        elif hasattr(module, "num_key_value_groups"):
            module.num_key_value_groups = heads // ranks  # this rank's query heads, all over its one KV head


def _heads(text) -> tuple[int, int]:
    """The text config's attention heads and KV heads (as many as the heads where it names none)."""
    heads = getattr(text, "num_attention_heads", 0) or 0
    return heads, getattr(text, "num_key_value_heads", None) or heads


def _kv_projections(rules: dict[str, str]) -> list[str] | None:
    """The plan's rules for the key and value projections (both, or None: fused or named
    otherwise)."""
    found = [rule for rule in rules if rule.rsplit(".", 1)[-1] in _KV_PROJECTIONS]
    return found if len(found) == 2 else None


def _base_prefix(config) -> str:
    """The causal LM's attribute holding the base model, as transformers' full plan keys start."""
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    prefix = getattr(model_class, "base_model_prefix", "model") if model_class is not None else "model"
    return f"{prefix}." if prefix else ""
