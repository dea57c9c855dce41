"""cache_manager.kv and server/engine/attention.py on real caches: crop and grow against fresh prefills,
both attention paths (rows, and the paged batch with its bucket padding) against transformers'
own attention."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, MistralConfig

from cache_manager import kv
from server.engine import attention, cpu_linear, model_runner
from server.engine.attention import Row
from server.engine.model_runner import ModelRunner, forward
from tests.device import DEVICE, DTYPE

torch.set_grad_enabled(False)


def tiny(config_cls, **extra):
    torch.manual_seed(0)
    config = config_cls(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, **extra,
    )
    return AutoModelForCausalLM.from_config(config, dtype=DTYPE).to(DEVICE).eval()


@pytest.fixture(scope="module")
def models(smollm2):
    return {
        "smollm2": smollm2.model,
        "mistral-sliding": tiny(MistralConfig, sliding_window=16),
        "gemma2-hybrid": tiny(Gemma2Config, head_dim=16, sliding_window=16),
    }


IDS = [(i * 7919) % 49000 + 17 for i in range(48)]


def fresh_logits(model, ids, capacity=64):
    return forward(model, kv.allocate(model.config, capacity, DEVICE, DTYPE), ids, 0)


def test_capacity_is_whole_blocks():
    cache = kv.allocate(tiny_config(), 33, DEVICE, DTYPE)
    assert kv.capacity(cache) == 48 and len(cache.blocks) == 3 and cache.base == 0
    kv.grow(cache, 40)  # fits already: nothing appended
    assert kv.capacity(cache) == 48


def tiny_config():
    return MistralConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024)


@pytest.mark.parametrize("name", ["smollm2", "mistral-sliding", "gemma2-hybrid"])
def test_bytes_for_matches_allocation(models, name):
    model = models[name]
    for capacity in (8, 64, 256):
        cache = kv.allocate(model.config, capacity, DEVICE, DTYPE)
        assert kv.nbytes(cache) == kv.bytes_for(model.config, capacity, DTYPE)
        assert kv.length(cache) == 0


def test_smollm2_bytes_per_token():
    # docs/architecture.md: 2 x 30 layers x 3 heads x 64 dims x 4 bytes = 45 KiB of fp32 KV per token
    from transformers import AutoConfig
    from tests.conftest import test_cache_dir

    dirs = list((test_cache_dir() / "converted").glob("SmolLM2-135M-Instruct*"))
    config = AutoConfig.from_pretrained(dirs[0])
    assert kv.bytes_for(config, 1024, torch.float32) == 1024 * 2 * 30 * 3 * 64 * 4


@pytest.mark.parametrize("name", ["smollm2", "mistral-sliding", "gemma2-hybrid"])
def test_grow_keeps_state_bit_identical(models, name):
    model = models[name]
    pool = kv.Pool(model.config, kv.bytes_for(model.config, 96, DTYPE), DEVICE, DTYPE)
    small = pool.allocate(32)
    other = pool.allocate(16)  # takes the blocks after small's: growing must go elsewhere
    forward(model, small, IDS[:30], 0)  # past the 16-token window of the sliding models
    bigger = kv.grow(small, 64)
    assert bigger is small and kv.length(bigger) == 30 and kv.capacity(bigger) == 64
    assert bigger.blocks[:2] == [0, 1] and 2 not in bigger.blocks and bigger.base is None  # gathered
    kv.free(other)
    same_size = kv.allocate(model.config, 64, DEVICE, DTYPE)
    forward(model, same_size, IDS[:30], 0)
    a = forward(model, bigger, IDS[30:40], 30)
    b = forward(model, same_size, IDS[30:40], 30)
    assert torch.equal(a, b)
    assert (a - fresh_logits(model, IDS[:40])).abs().max() < 1e-4


@pytest.mark.parametrize("name", ["smollm2", "mistral-sliding", "gemma2-hybrid"])
def test_crop_then_edit_equals_fresh_prefill(models, name):
    model = models[name]
    cache = kv.allocate(model.config, 64, DEVICE, DTYPE)
    forward(model, cache, IDS[:14], 0)  # within the window: croppable
    assert kv.can_crop(cache)
    kv.crop(cache, 8)
    edited = IDS[:8] + [5, 6, 7, 8, 9]
    logits = forward(model, cache, edited[8:], 8)
    assert (logits - fresh_logits(model, edited)).abs().max() < 1e-4
    assert kv.length(cache) == len(edited)


@pytest.mark.parametrize("name", ["mistral-sliding", "gemma2-hybrid"])
def test_sliding_window_caches_crop_after_wrapping(models, name):
    """Sliding layers keep every position in the pool: a cache past its window still crops."""
    model = models[name]
    cache = kv.allocate(model.config, 64, DEVICE, DTYPE)
    forward(model, cache, IDS[:40], 0)
    assert kv.can_crop(cache)
    kv.crop(cache, 22)
    edited = IDS[:22] + [5, 6, 7, 8, 9]
    logits = forward(model, cache, edited[22:], 22)
    assert (logits - fresh_logits(model, edited)).abs().max() < 1e-4
    with pytest.raises(ValueError):
        kv.crop(cache, 28)  # past the length


def stock_logits(model, ids):
    """transformers' own attention (the fallback kv keeps for calls outside the engine)."""
    return model(input_ids=torch.tensor([ids], device=DEVICE)).logits[0, -1].float()


def scattered_caches(model, n, capacity):
    """`n` caches of one pool whose blocks interleave (none consecutive: every read gathers)."""
    blocks = kv.blocks_for(capacity)
    pool = kv.Pool(model.config, kv.bytes_for(model.config, capacity, DTYPE) * n, DEVICE, DTYPE)
    caches = [kv.SequenceKV(pool) for _ in range(n)]
    for b in range(blocks):
        for cache in caches:
            cache._set_blocks(cache.blocks + pool.take_blocks(1))
    return pool, caches


def test_a_steps_block_tables_follow_every_change_of_a_caches_blocks():
    """`paged_inputs` copies each cache's block table from its array (`SequenceKV.table`): the
    array follows every change of the blocks (grown after the last block, scattered between
    others' blocks, trimmed, freed), and a step's tables are each row's blocks, cut at the
    step's width, then the trash block, with padding rows all trash."""
    config = tiny_config()
    pool = kv.Pool(config, kv.bytes_for(config, 256, DTYPE) * 3, DEVICE, DTYPE)
    caches = [kv.SequenceKV(pool) for _ in range(3)]

    def check(blocks: int) -> None:
        for cache in caches:
            assert cache.table.tolist() == cache.blocks
        positions, slots, tables = model_runner.paged_inputs(pool, caches, [1] * 3, 4, 1, blocks)
        assert tables.shape == (4, blocks)
        for cache, row in zip(caches, tables.tolist()):
            held = cache.blocks[:blocks]
            assert row == held + [pool.trash_block] * (blocks - len(held))
        assert tables[3].tolist() == [pool.trash_block] * blocks and positions[3] == 0
        bs = pool.block_size
        assert slots[:3] == [c.blocks[c.length // bs] * bs + c.length % bs for c in caches]

    for n in (16, 40, 100):  # interleaved: none consecutive past the first
        for cache in caches:
            kv.grow(cache, n)
    for cache, length in zip(caches, (5, 37, 99)):
        cache.length = length
    check(8)
    check(2)  # a row holding more blocks than the step reads
    kv.crop(caches[1], 3)
    kv.trim(caches[1])
    kv.free(caches[2])
    kv.grow(caches[2], 20)
    check(8)
    assert caches[1].blocks and len(caches[1].blocks) == 1 and len(caches[2].blocks) == 2


@pytest.mark.parametrize("path", ["rows", "paged"])
@pytest.mark.parametrize("name", ["smollm2", "mistral-sliding", "gemma2-hybrid"])
def test_a_batch_of_rows_equals_each_sequence_alone(models, name, path):
    """One forward pass over rows of different lengths, prefill chunks and decode tokens mixed,
    past the sliding window: every row's logits match transformers' own full-sequence pass.
    `rows`: every row on the row path, each cache in a pool of its own; `paged`: decode rows on
    the paged path (padded to a bucket when they are alone in a step), the caches' blocks
    interleaved in one pool."""
    model = models[name]
    seqs = [IDS[:40], IDS[5:25][::-1], IDS[10:47]]
    if path == "rows":
        caches = [kv.allocate(model.config, 64, DEVICE, DTYPE) for _ in seqs]
        runner = ModelRunner(model, caches[0].pool, paged=False)
    else:
        pool, caches = scattered_caches(model, len(seqs), 64)
        runner = ModelRunner(model, pool, paged=True, max_rows=4)
    done = [0, 0, 0]

    def step(counts):
        rows = [Row(c, n) for c, n in zip(caches, counts) if n]
        ids = [t for s, d, n in zip(seqs, done, counts) for t in s[d : d + n]]
        logits = runner.forward(rows, ids, list(range(len(rows))))
        for i, n in enumerate(counts):
            done[i] += n
        return logits

    step([17, 3, 0])  # prefills of different lengths
    step([1, 9, 30])  # a decode token, a chunk, a whole prompt (wraps the 16-token window)
    for _ in range(3):
        step([1, 1, 1])  # decode, all past the window
    logits = step([19, 5, 4])  # chunks that wrap the ring again
    assert [kv.length(c) for c in caches] == done == [40, 20, 37]
    for row, s in enumerate(seqs):
        assert (logits[row] - stock_logits(model, s)).abs().max() < 1e-4


@pytest.mark.parametrize("bias", [False, True])
def test_packed_cpu_linear_equals_f_linear_at_every_row_count(bias):
    """enable() runs a CPU linear layer on its oneDNN-packed weight: any row count (one decode
    token, a verification, a prefill chunk) gives F.linear's rows up to rounding."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 80, bias=bias)
    assert cpu_linear._pack(layer), "this CPU build has oneDNN: the layer must be packed"
    for n in [*range(1, 41), 64, 300]:
        x = torch.randn(1, n, 96)
        out = layer(x)
        assert out.shape == (1, n, 80)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_equals_f_linear_at_every_row_count(bias):
    """The CPU product where oneDNN cannot pack (one row as two, 9-32 rows padded to a multiple
    of 8, more through F.linear) returns exactly the rows asked for, equal to F.linear up to
    rounding."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 80, bias=bias)
    for n in range(1, 41):
        x = torch.randn(1, n, 96)
        out = cpu_linear._cpu_linear(layer, x)
        assert out.shape == (1, n, 80)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_fallback_attention_is_untouched_outside_the_engine(models):
    model = models["mistral-sliding"]
    model_runner.forward_rows(model, [Row(kv.allocate(model.config, 64, DEVICE, DTYPE), 4)], IDS[:4], [0])
    assert model.config._attn_implementation == attention.ATTN_IMPLEMENTATION
    fresh = tiny(MistralConfig, sliding_window=16)  # same seed, same weights, never switched
    assert torch.equal(stock_logits(model, IDS[:40]), stock_logits(fresh, IDS[:40]))


def test_bfloat16_batches_like_float32():
    model = tiny(MistralConfig, sliding_window=16).to(torch.bfloat16)
    caches = [kv.allocate(model.config, 64, DEVICE, torch.bfloat16) for _ in range(2)]
    model_runner.forward_rows(model, [Row(caches[0], 20), Row(caches[1], 6)], IDS[:20] + IDS[:6], [])
    logits = model_runner.forward_rows(model, [Row(caches[0], 1), Row(caches[1], 1)], IDS[20:21] + IDS[6:7], [0, 1])
    assert caches[0].pool.keys[0].dtype == torch.bfloat16 and logits.dtype == torch.float32
    for row, n in enumerate((21, 7)):
        ref = stock_logits(model, IDS[:n])
        assert (logits[row] - ref).abs().max() < 0.05 * ref.abs().max()


def test_chunked_layers_have_a_negative_window_and_kinds_it_cannot_batch_are_refused():
    config = MistralConfig(num_hidden_layers=3, sliding_window=16, attention_chunk_size=8)
    config.layer_types = ["full_attention", "chunked_attention", "sliding_attention"]
    assert kv.layout(config).windows == (None, -8, 16)  # Llama 4's chunks of 8 (`kv.Layout`)
    config.layer_types = ["full_attention", "indexed_attention", "sliding_attention"]
    with pytest.raises(ValueError, match="indexed_attention"):
        kv.layout(config)


@pytest.mark.parametrize("counts", [[1, 1, 1], [3, 7]], ids=["decode", "chunks"])
def test_padded_rows_write_only_their_own_slots_and_the_trash_block(models, counts):
    """Paged rows and their padding. `decode`: 3 decode rows padded to a bucket of 4 (the
    padding row is token 0 at position 0); `chunks`: rows of 3 and 7 tokens in one batch padded
    to the widest (the 3-token row has 4 padding tokens). Each row writes exactly its new
    positions' slots, padding writes the trash block only, every other slot of the pool is
    untouched, and the logits equal the row path's, unpadded."""
    model = models["gemma2-hybrid"]
    pool, caches = scattered_caches(model, len(counts), 64)
    runner = ModelRunner(model, pool, paged=True, max_rows=4)
    for i, cache in enumerate(caches):
        runner.forward([Row(cache, 10 + i)], IDS[: 10 + i], [0])
    before = [t.clone() for t in pool.keys + pool.values]
    lengths = [c.length for c in caches]
    ids = [t for i, n in enumerate(counts) for t in IDS[20 + 10 * i : 20 + 10 * i + n]]
    padded = runner.forward([Row(c, n) for c, n in zip(caches, counts)], ids, list(range(len(caches))), counts)
    bs = pool.block_size
    written = {c.blocks[p // bs] * bs + p % bs for c, n0, n in zip(caches, lengths, counts) for p in range(n0, n0 + n)}
    trash = set(range(pool.trash_block * bs, (pool.trash_block + 1) * bs))
    for old, new in zip(before, pool.keys + pool.values):
        changed = set((old != new).any(dim=(0, 2)).nonzero().flatten().tolist())
        assert written <= changed and changed <= written | trash
    for cache, n in zip(caches, lengths):
        kv.crop(cache, n)
    rows = [Row(c, n) for c, n in zip(caches, counts)]
    alone = ModelRunner(model, pool, paged=False).forward(rows, ids, list(range(len(caches))), counts)
    assert (padded - alone).abs().max() < 1e-4


def test_runner_buckets():
    assert [model_runner.bucket(n) for n in (1, 3, 5, 17, 33, 600)] == [1, 4, 8, 24, 48, 600]
    assert [model_runner.block_bucket(n, 512) for n in (1, 16, 17, 300, 900)] == [16, 16, 32, 512, 512]


@pytest.mark.parametrize("heads, kv_heads, ranks, local, groups", [
    (8, 8, 1, 8, 1),  # one process
    (8, 4, 2, 2, 2),  # the KV heads split evenly
    (8, 2, 4, 1, 2),  # fewer KV heads than ranks: each rank keeps the one its 2 query heads read
    (8, 1, 2, 1, 4),  # MQA: the one KV head on every rank
])
def test_a_tensor_parallel_rank_keeps_its_kv_heads(heads, kv_heads, ranks, local, groups):
    """kv.SHARDS (server/sharding.py): one rank's pool holds its KV heads, and its query heads
    per KV head, which attention groups by."""
    config = MistralConfig(hidden_size=64, num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=2)
    setattr(config, kv.SHARDS, ranks)
    layout = kv.layout(config)
    assert (layout.kv_heads, layout.groups) == (local, groups)
    assert layout.kv_heads * layout.groups == heads // ranks
    one = MistralConfig(hidden_size=64, num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=2)
    assert layout.bytes_per_token(torch.float32) * kv_heads == kv.layout(one).bytes_per_token(torch.float32) * local
