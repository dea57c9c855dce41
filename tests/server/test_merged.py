"""Merged projections (server/engine/merged.py): q/k/v and gate/up as one GEMM at load, on tiny
random-weight models of each family shape, against the same model unmerged: transformers' own
forward and generate, after CPU packing, and through the engine's model runner."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from bench import architectures
from cache_manager import kv
from server.engine import cpu_linear, exact, merged
from server.engine.attention import Row
from server.engine.model_runner import ModelRunner, forward
from tests.device import DEVICE, DTYPE

TOLERANCE = 1e-5 if DTYPE == torch.float32 else 2e-2
PROMPT = torch.tensor([[1, 523, 87, 4410, 9, 300, 12, 77, 2051, 6]], device=DEVICE)

# family -> groups merged in its tiny config (bench/architectures.py's FAMILIES)
EXPECTED = {
    "llama": {"qkv_merged": 2, "gate_up_merged": 2},
    "qwen2": {"qkv_merged": 3, "gate_up_merged": 3},  # q/k/v with biases
    "mistral": {"qkv_merged": 2, "gate_up_merged": 2},
    "gemma2": {"qkv_merged": 2, "gate_up_merged": 2},
    "phi3": {},  # qkv_proj and gate_up_proj are fused in its checkpoints already
    "qwen3_moe": {"qkv_merged": 2},  # the experts are one 3-D weight each: untouched
}


def build(family: str) -> nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(architectures.FAMILIES[family].config(), dtype=DTYPE).to(DEVICE).eval()


def param_bytes(model: nn.Module) -> tuple[int, int]:
    return sum(p.numel() for p in model.parameters()), sum(p.numel() * p.element_size() for p in model.parameters())


def greedy(model: nn.Module) -> list[int]:
    out = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=16, do_sample=False, pad_token_id=0)
    return out[0, PROMPT.shape[1] :].tolist()


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("family", list(EXPECTED))
def test_merged_model_matches_the_original(family):
    model = build(family)
    original = copy.deepcopy(model)
    before = param_bytes(model)
    experts = {n: p.clone() for n, p in model.named_parameters() if ".experts." in n}
    report = merged.merge(model)
    assert dict(report.merged) == EXPECTED[family] and not report.apart, report.describe()
    assert param_bytes(model) == before  # the members' weights freed, not held twice
    assert bool(experts) == (family == "qwen3_moe")
    assert all(torch.equal(p, experts[n]) for n, p in model.named_parameters() if n in experts)
    want, got = original(PROMPT).logits, model(PROMPT).logits
    assert gap(got, want) <= TOLERANCE, f"{family}: bit-identical={torch.equal(got, want)}, max |diff| {gap(got, want):.3g}"
    assert greedy(model) == greedy(original)
    if report.merged:
        memo = model.model.layers[0].self_attn.q_proj.group.memo
        assert memo.last is None  # every member took its columns: nothing kept after the forward


@pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU packing")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packing_switches_the_merged_layers_and_passes_the_slices_by(family):
    model = build(family)
    original = copy.deepcopy(model)
    merged.merge(model)
    switched = sum(cpu_linear.pack_model(model))
    unmerged = sum(cpu_linear.pack_model(original))
    layers = model.config.num_hidden_layers
    assert unmerged - switched == 3 * layers  # q, k, v, gate, up -> qkv_merged, gate_up_merged
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert "forward" in vars(attn.qkv_merged) and "forward" in vars(mlp.gate_up_merged)
    assert "forward" not in vars(attn.q_proj) and not isinstance(attn.q_proj, nn.Linear)
    want, got = original(PROMPT).logits, model(PROMPT).logits
    assert gap(got, want) <= TOLERANCE, f"{family}: bit-identical={torch.equal(got, want)}, max |diff| {gap(got, want):.3g}"
    assert greedy(model) == greedy(original)


def test_exact_mode_routes_the_merged_layer():
    model = build("llama")
    merged.merge(model)
    exact.enable(model)
    attn = model.model.layers[0].self_attn
    assert "forward" in vars(attn.qkv_merged) and "forward" not in vars(attn.k_proj)


def test_skip_list_quantized_layers_and_partial_biases_stay_apart():
    class QuantizedLike(nn.Linear):
        pass

    model = build("llama")
    layers = model.model.layers
    v = layers[1].self_attn.v_proj
    layers[1].self_attn.v_proj = QuantizedLike(v.in_features, v.out_features, bias=False, device=DEVICE, dtype=DTYPE)
    layers[0].mlp.up_proj.bias = nn.Parameter(torch.zeros(layers[0].mlp.up_proj.out_features, device=DEVICE, dtype=DTYPE))
    skip = {"model.layers.0.self_attn.k_proj"}
    report = merged.merge(model, skip=skip)
    assert dict(report.merged) == {"gate_up_merged": 1}
    assert dict(report.apart) == {"skipped": 1, "quantized": 1, "bias on some": 1}
    assert report.describe() == "gate_up 1; apart: 1 skipped, 1 bias on some, 1 quantized"
    assert type(layers[0].self_attn.q_proj) is nn.Linear and not hasattr(layers[0].self_attn, "qkv_merged")
    assert isinstance(layers[1].mlp.gate_proj, merged._Slice)
    again = merged.merge(model, skip=skip)
    assert again.merged == report.merged and again.apart == report.apart  # idempotent: merged groups are reported again


def test_a_member_called_alone_or_on_another_input_gets_its_own_rows():
    model = build("qwen2")
    attn = copy.deepcopy(model.model.layers[0].self_attn)
    merged.merge(model)
    fused = model.model.layers[0].self_attn
    x, y = torch.randn(2, 3, 64, device=DEVICE, dtype=DTYPE), torch.randn(2, 3, 64, device=DEVICE, dtype=DTYPE)
    for name, inp in (("k_proj", x), ("q_proj", y), ("v_proj", x), ("v_proj", x), ("k_proj", y)):
        assert gap(getattr(fused, name)(inp), getattr(attn, name)(inp)) <= TOLERANCE, name
    assert torch.equal(fused.k_proj.weight, attn.k_proj.weight) and torch.equal(fused.v_proj.bias, attn.v_proj.bias)


def decode(model: nn.Module, steps: int = 12) -> list[int]:
    """Greedy tokens of the prompt and `steps` decode steps through the model runner's rows path."""
    cache = kv.allocate(model.config, 64, DEVICE, DTYPE)
    ids = PROMPT[0].tolist()
    tokens = [int(forward(model, cache, ids, 0).argmax())]
    for _ in range(steps):
        tokens.append(int(forward(model, cache, tokens[-1:], kv.length(cache)).argmax()))
    return tokens


def decode_paged(model: nn.Module, steps: int = 12) -> list[int]:
    """The same through the paged path (CUDA's; eager on CPU)."""
    pool = kv.Pool(model.config, kv.bytes_for(model.config, 64, DTYPE), DEVICE, DTYPE)
    runner = ModelRunner(model, pool, paged=True, max_rows=8, cuda_graphs=False)
    runner.prepare()
    cache = pool.allocate(64)
    ids = PROMPT[0].tolist()
    tokens = [int(runner.forward([Row(cache, len(ids))], ids, [0])[0].argmax())]
    for _ in range(steps):
        tokens.append(int(runner.forward([Row(cache, 1)], tokens[-1:], [0])[0].argmax()))
    return tokens


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("path", [decode, decode_paged], ids=["rows", "paged"])
def test_engine_path_decodes_the_same_tokens(family, path):
    model = build(family)
    original = copy.deepcopy(model)
    merged.merge(model)
    assert path(model) == path(original)
