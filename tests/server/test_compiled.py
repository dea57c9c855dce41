"""The compiled forward (server/engine/compiled.py): inductor compiles the paged path's decode
steps in one graph without a break, twice at most (one row; any other bucket), and the steps of
more than decode rows once more; both give the eager forward's greedy tokens; features that keep
the eager forward say so by name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench import architectures
from cache_manager import kv
from server.engine import attention, compiled, context, mla
from server.engine.context import Row
from server.engine.model_runner import ModelRunner
from tests.device import DEVICE, DTYPE

STEPS = 12
# rows per step across the row buckets 1, 2, 4 and 8 (dynamic in the rows: no recompilation)
ROW_COUNTS = (1, 2, 3, 5)


def build(family: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(architectures.FAMILIES[family].config(), dtype=DTYPE).to(DEVICE).eval()


def prompt(row: int, vocab: int) -> list[int]:
    return [(row * 131 + t * 17 + 3) % vocab for t in range(4 + 3 * row)]


def greedy_steps(runner: ModelRunner, rows: int) -> list[list[int]]:
    """`rows` prompts prefilled, then STEPS decode steps of all of them, each row's argmax fed back."""
    vocab, pool = runner.model.config.vocab_size, runner.pool
    prompts = [prompt(r, vocab) for r in range(rows)]
    caches = [pool.allocate(len(p) + STEPS + 1) for p in prompts]
    try:
        ids = runner.forward([Row(c, len(p)) for c, p in zip(caches, prompts)], sum(prompts, []), list(range(rows))).argmax(-1).tolist()
        out = [ids]
        for _ in range(STEPS):
            ids = runner.forward([Row(c, 1) for c in caches], ids, list(range(rows))).argmax(-1).tolist()
            out.append(ids)
        return out
    finally:
        for cache in caches:
            kv.free(cache)


def staggered_steps(runner: ModelRunner) -> list[list[int]]:
    """Steps of more than decode rows, each row's argmax fed back: row r's prompt arrives at
    step 2r beside the others' decode rows, in two chunks where it is long (the first keeps no
    logits); at step 5 row 0's token comes with two more (as a grammar forces them), and at step
    8 every row's does (no decode row at all)."""
    vocab, pool = runner.model.config.vocab_size, runner.pool
    prompts = [prompt(r, vocab) for r in range(len(ROW_COUNTS))]
    caches = [pool.allocate(len(p) + 3 * STEPS) for p in prompts]
    pending: dict[int, list[int]] = {}  # row -> its tokens in the next step
    out = []
    try:
        for step in range(STEPS + 2 * len(prompts)):
            rows, ids, keep, whose = [], [], [], []
            for r, p in enumerate(prompts):
                first_chunk = step == 2 * r and len(p) > 6
                if first_chunk:
                    tokens = p[:6]
                elif step == 2 * r:
                    tokens = p
                elif step == 2 * r + 1 and len(p) > 6:
                    tokens = p[6:]
                elif r in pending:
                    tokens = pending[r] + ([(r + 5) % vocab, 7] if (step, r) == (5, 0) or step == 8 else [])
                else:
                    continue
                if not first_chunk:
                    keep.append(len(rows))
                    whose.append(r)
                rows.append(Row(caches[r], len(tokens)))
                ids += tokens
            chosen = runner.forward(rows, ids, keep).argmax(-1).tolist()
            pending.update((r, [c]) for r, c in zip(whose, chosen))
            out.append(chosen)
        return out
    finally:
        for cache in caches:
            kv.free(cache)


def runner_for(model, *, compile: str, paged: bool | None = None, kv_dtype: str = "auto", **kwargs) -> ModelRunner:
    pool = kv.Pool(model.config, kv.bytes_for(model.config, 64, DTYPE, kv_dtype) * max(ROW_COUNTS), DEVICE, DTYPE, kv_dtype=kv_dtype)
    runner = ModelRunner(model, pool, cuda_graphs=False, paged=paged, max_rows=max(ROW_COUNTS), merge=True, compile=compile, **kwargs)
    runner.prepare()
    return runner


@pytest.mark.parametrize("family, packed, kv_dtype, kernel", [("qwen2", True, "fp8", True), ("gemma2", None, "auto", True),
                                                              ("deepseek_v3", None, "auto", False)],
                         ids=["qwen2-packed-fp8-kernel", "gemma2-dense-kernel", "deepseek_v3-mla-latent-gathered"])
def test_the_compiled_decode_forward_gives_the_eager_tokens_in_one_graph(family, packed, kv_dtype, kernel, monkeypatch):
    """qwen2: biased q/k/v merged, a sliding-window layer, the CPU's packed linear layers, fp8
    KV (the store writes scales too, the kernel reads codes and scales); gemma2: soft-capping,
    alternating windows, dense weights; both with the paged attention kernel for every batch
    (`attention_kernel`, as on a GPU; on CPU under Triton's interpreter); deepseek_v3: MLA from
    its latent (server/engine/mla.py: the absorbing products inside the graph), its batches
    gathered. On the paged path (a GPU's), where the prompts' and the staggered steps (prefill
    chunks beside decode rows, forced tokens) run compiled too. Against the same paged path run
    eagerly, and against the row path the CPU serves by default."""
    model = build(family)
    mla.configure(model)  # the latent where the model has MLA, as the server does
    torch._dynamo.reset()
    before, breaks = compiled.compilations(), compiled.graph_breaks()
    fast = runner_for(model, compile="require", paged=True, packed=packed, kv_dtype=kv_dtype, attention_kernel=kernel)
    assert fast.paths["paged_attention"] == ("kernel" if kernel else "gather")
    assert fast.paths["compile"] == "decode+mixed", fast.fallbacks
    # the warm-up compiled the three graphs: the steps below add none, whatever their rows
    assert compiled.compilations() - before == 3
    got = {rows: greedy_steps(fast, rows) for rows in ROW_COUNTS}
    opaque = []  # the layers' calls of the opaque op, which only the compiled steps make
    attend = attention._attend_batches
    monkeypatch.setattr(attention, "_attend_batches", lambda *a: opaque.append(context.current().opaque) or attend(*a))
    staggered = staggered_steps(fast)
    monkeypatch.undo()
    assert opaque and all(opaque), "the staggered steps did not run the compiled forward"
    assert compiled.compilations() - before == 3, "a recompilation during the steps"
    assert compiled.graph_breaks() == breaks
    for paged in (True, None):
        eager = runner_for(model, compile="off", paged=paged, packed=packed, kv_dtype=kv_dtype, attention_kernel=kernel)
        assert eager.paths["compile"] == "off"
        for rows in ROW_COUNTS:
            assert greedy_steps(eager, rows) == got[rows], (paged, rows)
        assert staggered_steps(eager) == staggered, paged


def test_features_that_keep_the_eager_forward_are_named():
    model = build("llama")
    runner = runner_for(model, compile="require", exact=True)
    assert runner.paths["compile"] == "eager"
    assert "exact mode" in runner.fallbacks["compile"]
    # its decode steps run as without compilation: the row path
    assert greedy_steps(runner, 2) == greedy_steps(runner_for(model, compile="off", exact=True), 2)


def test_a_failed_compilation_falls_back_alone_and_ends_a_tensor_parallel_rank(monkeypatch):
    """A compiled forward that fails at warm-up leaves the eager one, named, on a server of one
    rank; on a tensor-parallel rank (its text config marked sharded) the runner raises instead,
    as the other ranks may be waiting inside the same compiled collective."""
    model = build("llama")

    def broken(model):
        def forward(*args, **kwargs):
            raise RuntimeError("inductor ran out of registers")
        return forward

    monkeypatch.setattr(compiled, "decode_forward", broken)
    alone = runner_for(model, compile="require")
    assert alone.paths["compile"] == "eager"
    assert "compiling the decode forward failed (RuntimeError: inductor ran out of registers)" in alone.fallbacks["compile"]
    assert greedy_steps(alone, 2) == greedy_steps(runner_for(model, compile="off"), 2)
    monkeypatch.setattr(model.config.get_text_config(decoder=True), kv.SHARDS, 2, raising=False)
    with pytest.raises(RuntimeError, match=r"compiling the decode forward failed on this tensor-parallel rank .*serve with --compile off"):
        ModelRunner(model, alone.pool, cuda_graphs=False, max_rows=2, compile="require").prepare()


def test_a_failed_compilation_of_the_mixed_steps_leaves_them_eager_alone(monkeypatch):
    """Where the steps of more than decode rows fail to compile, they run the eager forward,
    named (`compile_mixed`), and the decode steps stay compiled."""
    model = build("llama")

    def broken(self):
        raise RuntimeError("inductor ran out of registers")

    monkeypatch.setattr(ModelRunner, "_padding_chunk", broken)
    runner = runner_for(model, compile="require", paged=True)
    assert runner.paths["compile"] == "decode" and runner._compiled_mixed is None
    assert "compile" not in runner.fallbacks
    assert "steps of more than decode rows failed (RuntimeError: inductor ran out of registers)" in runner.fallbacks["compile_mixed"]
    eager = runner_for(model, compile="off", paged=True)
    assert staggered_steps(runner) == staggered_steps(eager)


def test_a_released_runner_holds_no_step_buffers_and_still_decodes():
    """At shutdown (`startup.close`) the runner drops its decode buffer, graphs and compiled
    forward as the pool drops its storage: nothing it held keeps device memory from a model
    started next in the same process. A step after that runs eagerly, with the same tokens."""
    import gc
    import weakref

    runner = runner_for(build("llama"), compile="off", paged=True)
    before = greedy_steps(runner, 3)
    buffer = weakref.ref(runner._meta.untyped_storage())
    runner.release()
    gc.collect()
    assert buffer() is None and not runner.graphs and runner._compiled is None
    assert greedy_steps(runner, 3) == before


@pytest.mark.anyio
async def test_a_server_with_a_required_compilation_answers_as_the_eager_one(tokenizer):
    """The official client on an app serving a tiny Llama with `compile="require"`: the engine
    paths say "decode" in /v1/models and /metrics, and concurrent greedy chats (batched decode
    steps, each launched before the previous one is postprocessed: `overlap="on"`) give the
    tokens of the same app without compilation nor overlap."""
    import asyncio

    from tests import thinking
    from tests.inprocess import openai_client

    loaded = thinking.tiny_model(thinking.family_tokenizer(tokenizer, "qwen3"))
    asks = [[{"role": "user", "content": f"Count to {n}, please."}] for n in range(3)]

    async def answers(**settings) -> tuple[list[str], dict, str]:
        async with openai_client(loaded, **settings) as (client, http):
            done = await asyncio.gather(*(client.chat.completions.create(
                model=loaded.model_id, messages=ask, temperature=0, max_tokens=12) for ask in asks))
            engine = (await http.get("/v1/models")).json()["data"][0]["engine"]
            return [c.choices[0].message.content for c in done], engine, (await http.get("/metrics")).text

    got, engine, metrics = await answers(compile="require", overlap="on")
    assert engine["compile"] == "decode" and "compile" not in engine["fallbacks"]
    assert engine["overlap"] == "on"  # the compiled steps launched ahead of their postprocess too
    assert 'compile="decode"' in metrics and 'overlap="on"' in metrics
    expected, engine, _ = await answers(compile="off")
    assert engine["compile"] == "off" and engine["overlap"] == "off"
    assert got == expected
