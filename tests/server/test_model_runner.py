"""The model runner's decode path: bucket padding and persistent buffers (eagerly, on any device)
and CUDA graphs (replay == eager, bit for bit, fp32; the pool untouched by capture), on a tiny
random-weight model. The graph tests skip without CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from cache_manager import kv
from server.engine.attention import Row
from server.engine.model_runner import ModelRunner

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
PROMPTS = [[5 + i, 17, 33 + i, 9, 41, 2 + i, 77][: 4 + i] for i in range(5)]


def tiny(device: torch.device):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).eval()


def decode(runner: ModelRunner, steps: int) -> list[torch.Tensor]:
    """Prefill PROMPTS into `runner`'s pool, then `steps` greedy decode steps of all rows;
    the logits of every decode step."""
    caches = [runner.pool.allocate(64) for _ in PROMPTS]
    last = []
    for cache, ids in zip(caches, PROMPTS):
        last.append(int(runner.forward([Row(cache, len(ids))], ids, [0])[0].argmax()))
    out = []
    for _ in range(steps):
        logits = runner.forward([Row(c, 1) for c in caches], last, list(range(len(caches))))
        out.append(logits.clone())
        last = logits.argmax(-1).tolist()
    return out


def test_prepare_on_cpu_captures_nothing_and_decodes_through_the_buffers():
    model = tiny(torch.device("cpu"))
    pool = kv.Pool(model.config, kv.bytes_for(model.config, 64, torch.float32) * len(PROMPTS), "cpu", torch.float32)
    runner = ModelRunner(model, pool, paged=True, max_rows=8)
    runner.prepare()
    assert not runner.use_graphs and not runner.graphs and runner._meta is not None
    rows_path = ModelRunner(model, kv.Pool(model.config, pool.num_blocks * pool.block_bytes, "cpu", torch.float32), paged=False)
    for a, b in zip(decode(runner, 4), decode(rows_path, 4)):
        assert (a - b).abs().max() < 1e-4  # 5 rows padded to 8 vs each row alone


@CUDA
def test_graph_replay_equals_eager_bit_for_bit():
    model = tiny(torch.device("cuda"))
    size = kv.bytes_for(model.config, 64, torch.float32) * len(PROMPTS)
    graphed = ModelRunner(model, kv.Pool(model.config, size, "cuda", torch.float32), max_context=512, max_rows=8)
    graphed.prepare()
    assert graphed.graphs, "no graph was captured"
    eager = ModelRunner(model, kv.Pool(model.config, size, "cuda", torch.float32), max_context=512, max_rows=8, cuda_graphs=False)
    eager.prepare()
    replays = []
    for graph, _ in graphed.graphs.values():
        original = graph.replay
        graph.replay = lambda original=original: replays.append(1) or original()
    for a, b in zip(decode(graphed, 6), decode(eager, 6)):
        assert torch.equal(a, b)
    assert len(replays) == 6


@CUDA
def test_a_hybrids_recurrent_states_are_read_and_written_inside_the_graphs():
    """Qwen3-Next's gated delta-net layers (server/engine/recurrent.py): each replay gathers
    its rows' state slots from the persistent buffer and writes them back, as eager does."""
    from bench import architectures

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(architectures.FAMILIES["qwen3_next"].config(), dtype=torch.float32).cuda().eval()
    tokens = 64 * len(PROMPTS)
    size = kv.bytes_for(model.config, tokens, torch.float32, sequences=len(PROMPTS) + 1)
    runners = [ModelRunner(model, kv.Pool(model.config, size, "cuda", torch.float32, reserve_tokens=tokens), max_context=512,
                           max_rows=8, cuda_graphs=graphs) for graphs in (True, False)]
    for runner in runners:
        runner.prepare()
    assert runners[0].graphs and not runners[1].graphs
    for a, b in zip(decode(runners[0], 6), decode(runners[1], 6)):
        assert torch.equal(a, b)
    graphed, eager = (r.pool.states.tensors for r in runners)
    assert all(torch.equal(graphed[name], eager[name]) for name in graphed)


@CUDA
def test_capture_writes_only_the_trash_block_and_allocates_nothing():
    model = tiny(torch.device("cuda"))
    pool = kv.Pool(model.config, kv.bytes_for(model.config, 256, torch.float32), "cuda", torch.float32)
    runner = ModelRunner(model, pool, max_context=512, max_rows=4)
    runner.prepare()
    assert runner.graphs and pool.allocator.num_free == pool.num_blocks
    live = pool.trash_block * pool.block_size
    for t in pool.keys + pool.values:
        assert not t[:, :live].any()  # every slot a sequence could own is still zero


def test_a_bucket_of_no_rows_is_all_padding():
    """What a graph is captured over: every row token 0 at position 0, writing the trash
    block's first slot, reading the trash block, with no logit bias."""
    model = tiny(torch.device("cpu"))
    pool = kv.Pool(model.config, kv.bytes_for(model.config, 64, torch.float32), "cpu", torch.float32)
    runner = ModelRunner(model, pool, paged=True, max_rows=4)
    runner.prepare()
    inputs, step = runner._padding_step(4, 16)
    (batch,) = step.batches
    trash = pool.trash_block
    assert inputs.ids.tolist() == [[0] * 4] and inputs.positions.tolist() == [[0] * 4] and batch.positions.tolist() == [0] * 4
    assert not inputs.bias_ids.any() and not inputs.bias_values.any()  # token 0 plus 0.0: no bias
    assert batch.slots.tolist() == [trash * pool.block_size] * 4 and batch.tables.tolist() == [[trash] * 16] * 4


def test_a_decode_steps_argmax_adds_each_rows_logit_bias():
    """`StepOutput.greedy` is each row's argmax after its logit bias, exactly as the sampler's
    host path adds it (`sampling.apply_logit_bias`), in a captured graph where there is one:
    biases that ban a row's own argmax and lift another token, a row without, padding rows;
    a row with more than BIAS_SLOTS entries leaves the step's argmax to the host (None)."""
    from server.engine.model_runner import BIAS_SLOTS
    from server.engine.sampling import apply_logit_bias
    from tests.device import DEVICE

    model = tiny(DEVICE)
    pool = kv.Pool(model.config, kv.bytes_for(model.config, 64, torch.float32) * len(PROMPTS), DEVICE, torch.float32)
    runner = ModelRunner(model, pool, paged=True, max_context=512, max_rows=8)
    runner.prepare()
    caches = [pool.allocate(64) for _ in PROMPTS]
    last = [int(runner.forward([Row(c, len(ids))], ids, [0])[0].argmax()) for c, ids in zip(caches, PROMPTS)]
    for step in range(3):
        raw = runner.forward([Row(c, 1) for c in caches], last, list(range(len(caches)))).clone()
        for cache in caches:
            kv.crop(cache, cache.length - 1)
        own = raw.argmax(-1).tolist()
        biases = [{own[0]: -100.0, (own[0] + 1) % 128: 0.25}, {}, {t: 0.5 * t / 128 for t in range(BIAS_SLOTS)}, {own[3]: -0.01}, {7: 3.0}]
        out = runner._step([Row(c, 1) for c in caches], last, list(range(len(caches))), None, None, None, biases)
        assert torch.equal(out.logits, raw)  # the logits stay the model's (logprobs)
        assert out.greedy.tolist() == apply_logit_bias(raw.clone(), biases).argmax(-1).tolist()
        assert out.greedy.tolist() != own
        for cache in caches:
            kv.crop(cache, cache.length - 1)
        over = biases[:2] + [{t: 0.1 for t in range(BIAS_SLOTS + 1)}] + biases[3:]
        assert runner._step([Row(c, 1) for c in caches], last, list(range(len(caches))), None, None, None, over).greedy is None
        last = out.greedy.tolist()
