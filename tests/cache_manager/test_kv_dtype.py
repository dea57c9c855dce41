"""Quantized KV storage (--kv-cache-dtype fp8 / int8): bytes per token, the quantization error
bound, the same stored bytes whichever path wrote them, export/load, and real models reading
their cache back through both attention paths."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from cache_manager import kv
from server.engine.attention import Row
from server.engine.model_runner import ModelRunner, forward
from tests.device import DEVICE, DTYPE

torch.set_grad_enabled(False)

QUANTIZED = ["fp8", "int8"]
IDS = [(i * 7919) % 49000 + 17 for i in range(48)]


def tiny_qwen2(layers=2):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return AutoModelForCausalLM.from_config(config, dtype=DTYPE).to(DEVICE).eval()


def bits(t: torch.Tensor) -> torch.Tensor:
    """One-byte tensors as uint8 (torch.equal has no float8 kernel everywhere)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.fixture(scope="module")
def qwen2():
    return tiny_qwen2()


def test_bytes_per_token_of_each_format(smollm2):
    lay = kv.layout(smollm2.model.config)  # 30 layers, 3 KV heads, head_dim 64
    assert lay.bytes_per_token(torch.float32) == 2 * 30 * 3 * 64 * 4
    assert lay.bytes_per_token(torch.bfloat16) == 2 * 30 * 3 * 64 * 2
    for name in QUANTIZED:  # one byte per value and one bf16 scale per token and head
        assert lay.bytes_per_token(torch.bfloat16, name) == lay.bytes_per_token(torch.float32, name) == 2 * 30 * 3 * (64 + 2)
    assert lay.bytes_per_token(torch.bfloat16) / lay.bytes_per_token(torch.bfloat16, "fp8") >= 1.9
    pool = kv.Pool(smollm2.model.config, kv.bytes_for(smollm2.model.config, 64, DTYPE, "fp8"), DEVICE, DTYPE, kv_dtype="fp8")
    assert pool.capacity_tokens == 64 and pool.dtype == DTYPE
    assert pool.keys[0].dtype == torch.uint8 and pool.key_scales[0].dtype == torch.bfloat16


def test_fp8_decoding_through_float16_is_exact_for_every_code():
    """The CPU's fast fp8 decoding (kv.e4m3_as_half) gives torch's own float8 conversion for
    all 254 codes that are not NaN, subnormals and both zeros included."""
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(kv.e4m3_as_half(codes).float() * 256, want)
    scale = torch.full((codes.numel(),), 0.37, dtype=torch.bfloat16)
    fast = kv.kv_format("fp8").decode(codes[:, None], scale, torch.float32)
    assert torch.equal(fast[:, 0], want * scale.float())


def test_unknown_format_names_the_choices():
    with pytest.raises(ValueError, match="auto, fp8, int8"):
        kv.kv_format("fp4")


@pytest.mark.parametrize("name,bound", [("fp8", 2**-4), ("int8", 1 / 254 + 2**-8)])
def test_quantization_error_is_within_the_formats_bound(qwen2, name, bound):
    """Each token's keys in one head come back within `bound` x their absolute maximum (fp8:
    half a unit in the last of 3 mantissa bits; int8: half a step of amax/127, and the bf16
    scale's rounding), zeros stay zeros, and reads are in the compute dtype."""
    pool = kv.Pool(qwen2.config, kv.bytes_for(qwen2.config, 64, DTYPE, name), DEVICE, DTYPE, kv_dtype=name)
    cache = pool.allocate(64)
    torch.manual_seed(1)
    k = torch.randn(1, 2, 40, 16, device=DEVICE, dtype=DTYPE) * torch.logspace(-3, 3, 40, device=DEVICE, dtype=DTYPE)[:, None]
    v = torch.zeros_like(k)
    kv.write(cache, 0, 0, k, v)
    got_k, got_v = kv.read(cache, 0, 0, 40)
    assert got_k.dtype == DTYPE and got_k.shape == k.shape
    amax = k.abs().amax(-1, keepdim=True)
    assert ((got_k - k).abs() <= bound * amax).all()
    assert torch.equal(got_v, v)


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_tokens_stored_bytes_depend_on_it_alone(qwen2, name):
    """Written all at once into consecutive blocks, or token by token into scattered ones
    (`Pool.store`, the paged path's write): the same bytes, so reuse, batching and tiers read
    the same values."""
    pool = kv.Pool(qwen2.config, 4 * kv.bytes_for(qwen2.config, 48, DTYPE, name), DEVICE, DTYPE, kv_dtype=name)
    whole = pool.allocate(48)
    scattered = kv.SequenceKV(pool)
    gap = pool.allocate(16)
    for _ in range(3):
        scattered._set_blocks(scattered.blocks + pool.take_blocks(1))
        kv.grow(gap, kv.capacity(gap) + 16)
    assert whole.base is not None and scattered.base is None
    torch.manual_seed(2)
    k, v = torch.randn(2, 1, 2, 48, 16, device=DEVICE, dtype=DTYPE)
    kv.write(whole, 1, 0, k, v)
    for p in range(48):
        pool.store(1, scattered.slots(p, p + 1), k[0, :, p : p + 1], v[0, :, p : p + 1])
    whole.length = scattered.length = 48
    a, b = kv.export(whole), kv.export(scattered)
    assert a.keys() == b.keys() == {f"{t}.{i}" for i in range(2) for t in ("k", "v", "k_scale", "v_scale")}
    assert all(torch.equal(bits(a[key]), bits(b[key])) for key in a)
    assert all(torch.equal(x, y) for x, y in zip(kv.read(whole, 1, 0, 48), kv.read(scattered, 1, 0, 48)))


@pytest.mark.parametrize("name", QUANTIZED)
def test_export_then_load_is_bit_identical_and_formats_do_not_mix(qwen2, name):
    cache = kv.allocate(qwen2.config, 64, DEVICE, DTYPE, kv_dtype=name)
    forward(qwen2, cache, IDS[:30], 0)
    tensors = kv.to_cpu(kv.export(cache), copy=True)
    assert tensors["k.0"].dtype == kv.kv_format(name).wire and tensors["k_scale.0"].shape == (1, 2, 30)
    pool = kv.Pool(qwen2.config, kv.bytes_for(qwen2.config, 64, DTYPE, name), DEVICE, DTYPE, kv_dtype=name)
    loaded = kv.load(pool, tensors, 30, 64)
    assert all(torch.equal(x, y) for x, y in zip(kv.read(loaded, 1, 0, 30), kv.read(cache, 1, 0, 30)))
    assert torch.equal(forward(qwen2, loaded, IDS[30:34], 30), forward(qwen2, cache, IDS[30:34], 30))
    plain = kv.Pool(qwen2.config, kv.bytes_for(qwen2.config, 64, DTYPE), DEVICE, DTYPE)
    with pytest.raises(ValueError, match="auto KV format"):
        kv.load(plain, tensors, 30, 64)  # quantized tensors never load as plain ones
    plain_cache = kv.allocate(qwen2.config, 64, DEVICE, DTYPE)
    forward(qwen2, plain_cache, IDS[:30], 0)
    with pytest.raises(ValueError, match=f"{name} KV format"):
        kv.load(pool, kv.to_cpu(kv.export(plain_cache), copy=True), 30, 64)  # nor plain ones as quantized
    other = "int8" if name == "fp8" else "fp8"
    with pytest.raises(ValueError, match="does not fit"):
        kv.load(kv.Pool(qwen2.config, kv.bytes_for(qwen2.config, 64, DTYPE, other), DEVICE, DTYPE, kv_dtype=other), tensors, 30, 64)


@pytest.mark.parametrize("path", ["rows", "paged"])
@pytest.mark.parametrize("name", QUANTIZED)
def test_both_attention_paths_read_the_quantized_cache_alike(qwen2, name, path):
    """A prefill, then decode steps through the row path (reads by view, dequantized copies) or
    the paged path (`Pool.gather`, scattered blocks): the logits equal a one-sequence forward
    over a cache of the same format, and stay close to the unquantized cache's."""
    ids = IDS[:40]
    reference = kv.allocate(qwen2.config, 64, DEVICE, DTYPE, kv_dtype=name)
    want = forward(qwen2, reference, ids[:36], 0)
    pool = kv.Pool(qwen2.config, 2 * kv.bytes_for(qwen2.config, 64, DTYPE, name), DEVICE, DTYPE, kv_dtype=name)
    cache, other = kv.SequenceKV(pool), kv.SequenceKV(pool)
    for _ in range(4):  # interleaved blocks: every read gathers
        cache._set_blocks(cache.blocks + pool.take_blocks(1))
        other._set_blocks(other.blocks + pool.take_blocks(1))
    runner = ModelRunner(qwen2, pool, paged=path == "paged", max_rows=4)
    got = runner.forward([Row(cache, 36)], ids[:36], [0])[0]
    assert (got - want).abs().max() < 1e-4
    for p in range(36, 40):
        got = runner.forward([Row(cache, 1)], [ids[p]], [0])[0]
        want = forward(qwen2, reference, [ids[p]], p)
        assert (got - want).abs().max() < 1e-4
    plain = forward(qwen2, kv.allocate(qwen2.config, 64, DEVICE, DTYPE), ids, 0)
    assert (got - plain).abs().max() < 0.1 * plain.abs().max()


def test_fp8_cache_keeps_smollm2s_greedy_choices(smollm2):
    """The real model over 24 positions of a real sentence: the fp8 cache's next-token choice
    matches the unquantized cache's at (nearly) every position (bench/memory.py measures the
    identity share and perplexity over longer text)."""
    model, tok = smollm2.model, smollm2.tokenizer
    ids = tok("The quick brown fox jumps over the lazy dog because it wanted to reach the river before the sun set.")["input_ids"]
    same = 0
    caches = {name: kv.allocate(model.config, 64, DEVICE, DTYPE, kv_dtype=name) for name in ("auto", "fp8")}
    for p in range(len(ids)):
        choice = {name: int(forward(model, c, ids[p : p + 1], p).argmax()) for name, c in caches.items()}
        same += choice["auto"] == choice["fp8"]
    assert same >= len(ids) - 2, (same, len(ids))
