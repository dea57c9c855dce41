"""Pre-quantized checkpoints through --model: a clear error naming the package when the
quantization library is missing; with torchao installed (`pip install kvserve[quant]`; its
int8 weight-only kernels run on a CPU), a tiny model quantized in-process, saved and loaded back
serves through the engine, and the CPU packed-weights path leaves its quantized layers alone."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from cache_manager import kv
from server.engine import cpu_linear
from server.model_loader import QUANTIZATION_PACKAGES, ModelSourceError, load_model, quantization_method
from server.engine.model_runner import forward
from tests.device import DEVICE, DTYPE_NAME

torch.set_grad_enabled(False)

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def tiny_qwen2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def saved(tmp_path, tokenizer, model=None):
    """A model directory (weights, config, the SmolLM2 tokenizer) as `--model` takes it."""
    (model or tiny_qwen2()).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


def _missing(method: str) -> bool:
    from server.model_loader import _importable

    return any(not _importable(module) for module, _ in QUANTIZATION_PACKAGES[method])


@pytest.mark.parametrize("method", ["gptq", "awq", "eetq", "hqq", "bitsandbytes", "compressed-tensors"])
def test_a_checkpoint_of_a_missing_quantization_library_names_the_package(tmp_path, tokenizer, method):
    if not _missing(method):
        pytest.skip(f"{method}'s library is installed here")
    path = saved(tmp_path, tokenizer)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelSourceError) as error:
        load_model(str(path), cache_dir=tmp_path / "cache", device=DEVICE.type, dtype=DTYPE_NAME)
    message = str(error.value)
    missing = [pip for module, pip in QUANTIZATION_PACKAGES[method] if _missing(method)]
    assert f"{method}-quantized" in message and "pip install" in message
    assert any(pip in message for pip in missing), message


def test_plain_checkpoints_are_not_quantized(smollm2):
    assert quantization_method(smollm2.model.config) is None


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (pip install kvserve[quant])")
def test_a_torchao_int8_checkpoint_loads_and_serves_with_its_layers_left_alone(tmp_path, tokenizer):
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    dense = tiny_qwen2()
    path = saved(tmp_path / "dense", tokenizer, dense)
    quantized = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))
    quantized.save_pretrained(tmp_path / "int8", safe_serialization=False)
    tokenizer.save_pretrained(tmp_path / "int8")

    loaded = load_model(str(tmp_path / "int8"), cache_dir=tmp_path / "cache", device="cpu", dtype="float32")
    assert quantization_method(loaded.model.config) == "torchao"
    proj = loaded.model.model.layers[0].mlp.down_proj
    assert type(proj.weight) not in (torch.Tensor, torch.nn.Parameter)  # still quantized after loading
    ids = [(i * 7919) % 49000 + 17 for i in range(24)]
    got = forward(loaded.model, kv.allocate(loaded.model.config, 32, torch.device("cpu"), torch.float32), ids, 0)
    assert "forward" not in vars(proj)  # the packed-weights path left it alone
    want = forward(dense, kv.allocate(dense.config, 32, torch.device("cpu"), torch.float32), ids, 0)
    assert (got - want).abs().max() < 0.05 * want.abs().max()  # int8 weights: close, not equal


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (pip install kvserve[quant])")
def test_pack_model_skips_quantized_layers_and_packs_the_rest():
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = tiny_qwen2()
    quantize_(model.model.layers[0], Int8WeightOnlyConfig())
    cpu_linear.pack_model(model)
    quantized = model.model.layers[0].self_attn.q_proj
    dense = model.model.layers[1].self_attn.q_proj
    assert "forward" not in vars(quantized) and "forward" in vars(dense)
