"""How a model is split over tensor-parallel ranks (server/parallel.py): transformers' own plan
for its family, loaded shard by shard (`plan`), and this rank's KV heads (`keep_rank_kv_heads`).

The attention heads are split evenly: each rank computes heads / N query heads. The KV heads
are split evenly where N divides them; where they are fewer than the ranks (and divide N),
every rank keeps the one KV head its query heads read, as vLLM does: the plan's key and value
projections are replicated instead of split, then cut to that head. Refused by name
(`UnsupportedModel`): a family without a plan, heads N does not divide, and what kvserve does not
shard yet (recurrent layers, pictures, quantized weights), and plan styles kvserve does not run.

After loading, the model runs on plain local shards (`localize`): transformers keeps each
sharded weight as a distributed tensor, swapped to a local one around every layer's forward,
with its communication in the forward it installs on the layer. kvserve takes the local
tensors and puts the communication in forward hooks of its own (an all-reduce after a
row-parallel layer, the experts and the vocabulary-parallel embedding; an all-gather after the
head), so the layers are plain `nn.Linear`s again that kvserve merges, packs, compiles and
captures as with one process, and the hooks run whichever forward a layer ends up with.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
import transformers

from cache_manager import kv, state
from server.engine.unsupported import UnsupportedModel

_KV_PROJECTIONS = ("k_proj", "v_proj")
# the styles of a base model's plan kvserve runs (`localize`): all but the last two need no
# communication of their own on local shards (each rank's slice of the output features, or
# a whole copy: "replicate" is `plan`'s, for KV heads fewer than the ranks); "rowwise" and
# "moe_tp_experts" sum the ranks' partial outputs
_STYLES = frozenset({"colwise", "packed_colwise", "packed_rowwise", "replicated_with_grad_allreduce", "local_params", "replicate",
                     "rowwise", "moe_tp_experts"})
# ... and around it: the vocabulary-parallel embedding and the head gathered on every rank
_OUTER_STYLES = frozenset({"embedding_rowwise", "colwise_gather_output"})


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
    styles = sorted({style for style in rules.values() if style not in _STYLES})
    if styles:
        raise UnsupportedModel("tensor-parallel-plan", f"{kind}'s tensor-parallel plan shards layers as {', '.join(styles)}, which kvserve "
                               "does not run: serve it with --tensor-parallel-size 1")
    if not any(rule.rsplit(".", 1)[-1] == "k_proj" and style == "colwise" for rule, style in rules.items()):
        # every rank would compute every head, where each rank's pool keeps its share of them
        raise UnsupportedModel("tensor-parallel-plan", f"{kind}'s tensor-parallel plan does not split the attention heads over the ranks: "
                               "serve it with --tensor-parallel-size 1")
    heads, kv_heads, _ = kv.attention_heads(text)
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
    text = model.config.get_text_config(decoder=True)
    setattr(text, kv.SHARDS, ranks)
    heads, kv_heads, width = kv.attention_heads(text)
    if kv_heads % ranks == 0:
        return
    head = dist.get_rank() // (ranks // kv_heads)  # the KV head this rank's query heads read
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


def localize(model) -> None:
    """Make the loaded shard plain: every distributed weight becomes this rank's local tensor
    (one tensor where weights are tied), transformers' forwards go, and each layer whose plan
    style communicates gets kvserve's hook for it (module doc). UnsupportedModel for a style
    `_STYLES` and `_OUTER_STYLES` do not name."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    rules = getattr(model, "tp_plan", None) or {}
    local: dict[int, torch.nn.Parameter] = {}  # id of a distributed weight -> its local one
    for name, module in model.named_modules():
        style = rules.get(replace_layer_number_by_wildcard(name)) if name else None
        if style is not None and style not in _STYLES | _OUTER_STYLES:
            raise UnsupportedModel("tensor-parallel-plan", f"{type(model).__name__}'s tensor-parallel plan shards {name} as {style}, "
                                   "which kvserve does not run: serve it with --tensor-parallel-size 1")
        offset, width = 0, getattr(module, "out_features", None)  # a vocabulary-parallel embedding's first row; the whole output
        for key, param in list(module._parameters.items()):
            if isinstance(param, DTensor):
                if key == "weight":
                    offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)[1][0]
                if id(param) not in local:
                    local[id(param)] = torch.nn.Parameter(param.to_local(), requires_grad=False)
                module._parameters[key] = local[id(param)]
        if isinstance(module, torch.nn.Linear):  # the widths of this rank's slice (merged.py reads them)
            module.out_features, module.in_features = module.weight.shape
        elif isinstance(module, torch.nn.Embedding):
            module.num_embeddings, module.embedding_dim = module.weight.shape
        if style is not None:
            module.__dict__.pop("forward", None)  # transformers' forward for its plan (the class's own stays)
        elif "install_forward" in getattr(module.__dict__.get("forward"), "__qualname__", ""):
            # a layer the plan reached by a rule read otherwise here: kvserve would pack or merge it
            # without the communication in transformers' forward
            raise UnsupportedModel("tensor-parallel-plan", f"{type(model).__name__}'s tensor-parallel plan shards {name} by a rule "
                                   "kvserve does not read: serve it with --tensor-parallel-size 1")
        if style == "rowwise":
            if module.bias is not None and dist.get_rank():
                module.bias = None  # added once, by rank 0, into the sum
            module.register_forward_hook(_sum)
        elif style == "moe_tp_experts":
            module.register_forward_hook(_sum)
        elif style == "embedding_rowwise":
            _vocabulary_parallel(module, offset)
        elif style == "colwise_gather_output":
            module.register_forward_hook(_gather(width))


def _sum(module, args, output: torch.Tensor) -> torch.Tensor:
    """A forward hook: the ranks' partial outputs summed, on every rank."""
    # NOTE: contiguous: a layer's output may be a strided view (cpu_linear's transposed
    # product), which gloo reduces wrongly without a word and NCCL refuses
    output = output.contiguous()
    dist.all_reduce(output)
    return output


def _vocabulary_parallel(module: torch.nn.Embedding, start: int) -> None:
    """`module` holds the vocabulary's rows from `start`: it looks up the ids among them, zeros
    for the others (through the class's forward, so a scaled embedding stays scaled), and the
    ranks' lookups are summed."""
    rows, forward = module.num_embeddings, type(module).forward
    module.padding_idx = None  # a global row (the pad token's), which only gradients read

    def lookup(ids: torch.Tensor) -> torch.Tensor:
        ids = ids - start
        mine = (ids >= 0) & (ids < rows)
        out = forward(module, torch.where(mine, ids, 0))
        return out * mine.unsqueeze(-1).to(out.dtype)

    module.forward = lookup
    module.register_forward_hook(_sum)


def _gather(width: int):
    """A forward hook: each rank's slice of the `width` output features (the last rank's may be
    shorter) gathered into the whole, on every rank."""
    ranks = dist.get_world_size()
    part = -(-width // ranks)  # torch.chunk's split: every rank's slice but the last's

    def hook(module, args, output: torch.Tensor) -> torch.Tensor:
        mine = torch.nn.functional.pad(output, (0, part - output.shape[-1])).contiguous()
        every = mine.new_empty((ranks * mine.shape[0], *mine.shape[1:]))
        dist.all_gather_into_tensor(every, mine)  # the ranks' slices one after another along the first dimension
        return every.unflatten(0, (ranks, -1)).movedim(0, -2).flatten(-2)[..., :width]

    return hook


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
