"""cache_manager.kv on real caches: crop, grow and croppability against fresh prefills."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, MistralConfig

from cache_manager import kv
from server.model_runner import forward

torch.set_grad_enabled(False)
CPU = torch.device("cpu")


def tiny(config_cls, **extra):
    torch.manual_seed(0)
    config = config_cls(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, **extra,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def models(smollm2):
    return {
        "smollm2": smollm2.model,
        "mistral-sliding": tiny(MistralConfig, sliding_window=16),
        "gemma2-hybrid": tiny(Gemma2Config, head_dim=16, sliding_window=16),
    }


IDS = [(i * 7919) % 49000 + 17 for i in range(48)]


def fresh_logits(model, ids, capacity=64):
    return forward(model, kv.allocate(model.config, capacity, CPU, torch.float32), ids, 0)


def test_capacity_bucket():
    assert kv.capacity_bucket(1, 8192) == 256
    assert kv.capacity_bucket(257, 8192) == 512
    assert kv.capacity_bucket(5000, 8192) == 8192
    assert kv.capacity_bucket(9000, 8192) == 8192


@pytest.mark.parametrize("name", ["smollm2", "mistral-sliding", "gemma2-hybrid"])
def test_bytes_for_matches_allocation(models, name):
    model = models[name]
    for capacity in (8, 64, 256):
        cache = kv.allocate(model.config, capacity, CPU, torch.float32)
        assert kv.nbytes(cache) == kv.bytes_for(model.config, capacity, torch.float32)
        assert kv.length(cache) == 0


def test_smollm2_bytes_per_token():
    # DESIGN.md: 2 x 30 layers x 3 heads x 64 dims x 4 bytes = 45 KiB of fp32 KV per token
    from transformers import AutoConfig
    from tests.conftest import test_cache_dir

    dirs = list((test_cache_dir() / "converted").glob("SmolLM2-135M-Instruct*"))
    config = AutoConfig.from_pretrained(dirs[0])
    assert kv.bytes_for(config, 1024, torch.float32) == 1024 * 2 * 30 * 3 * 64 * 4


@pytest.mark.parametrize("name", ["smollm2", "mistral-sliding", "gemma2-hybrid"])
def test_grow_keeps_state_bit_identical(models, name):
    model = models[name]
    small = kv.allocate(model.config, 32, CPU, torch.float32)
    forward(model, small, IDS[:30], 0)  # past the 16-token window of the sliding models
    bigger = kv.grow(small, model.config, 64)
    assert kv.length(bigger) == 30 and kv.capacity(bigger) == 64
    same_size = kv.allocate(model.config, 64, CPU, torch.float32)
    forward(model, same_size, IDS[:30], 0)
    a = forward(model, bigger, IDS[30:40], 30)
    b = forward(model, same_size, IDS[30:40], 30)
    assert torch.equal(a, b)
    assert (a - fresh_logits(model, IDS[:40])).abs().max() < 1e-4


@pytest.mark.parametrize("name", ["smollm2", "mistral-sliding", "gemma2-hybrid"])
def test_crop_then_edit_equals_fresh_prefill(models, name):
    model = models[name]
    cache = kv.allocate(model.config, 64, CPU, torch.float32)
    forward(model, cache, IDS[:14], 0)  # within the window: croppable
    assert kv.can_crop(cache)
    kv.crop(cache, 8)
    edited = IDS[:8] + [5, 6, 7, 8, 9]
    logits = forward(model, cache, edited[8:], 8)
    assert (logits - fresh_logits(model, edited)).abs().max() < 1e-4
    assert kv.length(cache) == len(edited)


def test_wrapped_sliding_window_cannot_crop(models):
    model = models["mistral-sliding"]
    cache = kv.allocate(model.config, 64, CPU, torch.float32)
    forward(model, cache, IDS[:20], 0)
    assert not kv.can_crop(cache)
    with pytest.raises(ValueError):
        kv.crop(cache, 10)
    kv.crop(cache, 20)  # cropping to the current length is a no-op, always allowed
    full = models["smollm2"]
    cache = kv.allocate(full.config, 64, CPU, torch.float32)
    forward(full, cache, IDS[:40], 0)
    assert kv.can_crop(cache)
