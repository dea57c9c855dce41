"""LoRA adapters in the engine (server/engine/lora.py): PEFT's files read and checked against the
base, each adapter's greedy tokens equal to PEFT's own `generate`, rows of different adapters
(and the base) batched in one step giving what each gives alone, on the row and the paged path.
Adapters are made here with PEFT on a tiny random model, with random non-zero B matrices so that
each one changes the output. The HTTP side is tests/server/test_lora_api.py."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file

from cache_manager.manager import CacheConfig, CacheManager
from server.engine import lora
from server.engine.core import Engine, EngineConfig
from server.engine.sampling import SamplingParams
from server.engine.sequence import GenerationRequest
from server.model_loader import load_model
from tests.device import DEVICE, DTYPE
from tests.equivalence import assert_equivalent
from tests.server.test_families import generate, prompt_of, tiny

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(path, seed: int, r: int = 8, targets=TARGETS, **config) -> str:
    """A PEFT LoRA adapter of `tiny()` saved in `path`, its A and B random."""
    model = tiny()
    torch.manual_seed(seed)  # after tiny(), which seeds its own weights
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False, **config))
    peft_model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"a": make_adapter(root / "a", 1), "b": make_adapter(root / "b", 2, r=4, targets=["q_proj", "v_proj"]), "root": root}


def peft_model(path: str):
    return PeftModel.from_pretrained(tiny(), path).eval()


def loaded_adapters(model, adapter_dirs, max_loras: int, names=("a", "b")) -> lora.Adapters:
    adapters = lora.Adapters(model, max_loras=max_loras, max_rank=64)
    for name in names:
        adapters.add(lora.read(adapter_dirs[name], model, name=name, max_rank=64))
    return adapters


def run_mix(engine: Engine, adapters: lora.Adapters, prompts: list[list[int]], mix: list[tuple[int, str | None]], max_tokens: int) -> list[list[int]]:
    """The greedy tokens of one request per (prompt index, adapter name or None), all at once."""

    async def run(k: int, i: int, name: str | None) -> list[int]:
        request = GenerationRequest(f"mix-{k}", prompts[i], SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                    adapter=adapters.get(name) if name else None, use_session=False)
        return [t.token_id async for out in engine.submit(request, asyncio.get_running_loop()) for t in out.tokens]

    async def play():
        return await asyncio.gather(*(run(k, i, name) for k, (i, name) in enumerate(mix)))

    return asyncio.run(play())


# -- reading and checking an adapter -----------------------------------------------------------


def test_an_adapter_is_read_with_its_rank_scaling_and_a_key_of_its_weights(adapter_dirs):
    model = tiny()
    a = lora.read(adapter_dirs["a"], model, name="a", max_rank=64)
    assert (a.rank, a.scaling, len(a.key)) == (8, 2.0, 12)
    assert set(a.weights) == {f"model.layers.{i}.{kind}.{t}" for i in range(2)
                              for kind, names in (("self_attn", TARGETS[:4]), ("mlp", TARGETS[4:])) for t in names if t in names}
    b = lora.read(adapter_dirs["b"], model, name="b", max_rank=64)
    assert b.key != a.key and lora.session_principal("p", b) == f"p|lora:b:{b.key}" and lora.session_principal("p", None) == "p"


@pytest.mark.parametrize("damage,reason", [
    ("missing", "not-found"), ("garbage", "corrupt"), ("not_lora", "not-lora"), ("dora", "unsupported"),
    ("bias", "unsupported"), ("other_base", "shapes"), ("missing_module", "targets"), ("rank", "rank"), ("nan", "corrupt"),
])
def test_adapters_that_do_not_fit_are_refused_with_the_reason(adapter_dirs, tmp_path, damage, reason):
    model = tiny()
    path = tmp_path / "x"
    max_rank = 64
    if damage == "missing":
        path.mkdir()
    elif damage == "dora":
        make_adapter(path, 3, use_dora=True)
    elif damage == "bias":
        make_adapter(path, 3, bias="lora_only")
    elif damage == "other_base":  # an adapter of a wider model
        other = tiny(hidden_size=96)
        torch.manual_seed(3)
        get_peft_model(other, LoraConfig(r=8, target_modules=TARGETS, init_lora_weights=False)).save_pretrained(path)
    elif damage == "rank":
        make_adapter(path, 3)
        max_rank = 4
    else:
        make_adapter(path, 3)
        config, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
        if damage == "garbage":
            weights.write_bytes(b"not a safetensors file")
        elif damage == "not_lora":
            config.write_text(json.dumps({**json.loads(config.read_text()), "peft_type": "PREFIX_TUNING"}))
        elif damage in ("missing_module", "nan"):
            from safetensors.torch import load_file

            tensors = load_file(str(weights))
            key = next(k for k in tensors if "q_proj.lora_A" in k)
            if damage == "nan":
                tensors[key] = torch.full_like(tensors[key], float("nan"))
            else:
                tensors[key.replace("q_proj", "w_qkv")] = tensors.pop(key)
                tensors[key.replace("q_proj", "w_qkv").replace("lora_A", "lora_B")] = tensors.pop(key.replace("lora_A", "lora_B"))
            save_file(tensors, str(weights))
    with pytest.raises(lora.AdapterError) as refused:
        lora.read(path, model, name="x", max_rank=max_rank)
    assert refused.value.reason == reason and "'x'" in str(refused.value)


def test_loading_device_slots_and_least_recently_used_swaps(adapter_dirs):
    """Loaded adapters wait in host memory; `acquire` gives each a device slot, swapping over the
    least recently used one no running sequence holds, and None when every slot is held."""
    model = tiny()
    adapters = lora.Adapters(model, max_loras=2, max_rank=64, max_loaded=3)
    a, b, c = (lora.read(adapter_dirs[d], model, name=n, max_rank=64) for d, n in (("a", "a"), ("b", "b"), ("a", "c")))
    for adapter in (a, b, c):
        adapters.add(adapter)
    with pytest.raises(lora.AdapterError) as clash:
        adapters.add(a)
    assert clash.value.reason == "name-clash"
    with pytest.raises(lora.AdapterError) as full:
        adapters.add(lora.read(adapter_dirs["a"], model, name="d", max_rank=64))
    assert full.value.reason == "too-many"
    adapters.allocate()  # two slots of rank 8 (the largest), over the layers any of them targets
    assert adapters.slots == ["a", "b"] and adapters.rank == 8 and adapters.names == ["a", "b", "c"]
    assert adapters.acquire(a) == 1 and adapters.acquire(b) == 2 and adapters.swaps == 0
    assert adapters.acquire(c) is None  # both slots run sequences: c waits
    adapters.release(a)
    assert adapters.acquire(c) == 1 and adapters.slots == ["c", "b"] and adapters.swaps == 1
    stack_a, stack_b = adapters._stacks["model.layers.0.self_attn.q_proj"]
    wa, wb = c.weights["model.layers.0.self_attn.q_proj"]
    assert torch.equal(stack_a[:8], wa.to(stack_a)) and torch.equal(stack_b[:, :8], wb.to(stack_b))
    adapters.release(b)
    adapters.release(c)
    assert adapters.acquire(a) == 2  # b's slot: used longest ago
    wb_only = adapters._stacks["model.layers.0.mlp.up_proj"][0]  # b targets no MLP layer: its block was zero, a's is not
    assert wb_only[8:].abs().sum() > 0
    assert adapters.remove("b").name == "b" and adapters.names == ["a", "c"] and adapters.get("b") is None
    with pytest.raises(lora.AdapterGone):
        adapters.acquire(b)
    with pytest.raises(lora.AdapterError) as bigger:  # the layout is fixed: rank 8 at most
        adapters.add(lora.read(make_adapter(adapter_dirs["root"] / "r16", 9, r=16), model, name="f", max_rank=64))
    assert bigger.value.reason == "rank"


def test_a_reserved_layout_takes_any_adapter_up_to_the_limits_without_changing_shape(adapter_dirs):
    """--enable-lora-loading: max_loras slots of max_rank over every linear layer but the head,
    allocated once; adapters loaded later fill them in place."""
    model = tiny()
    adapters = lora.Adapters(model, max_loras=2, max_rank=16, reserve=True)
    adapters.allocate()
    head = model.get_output_embeddings()
    assert adapters.modules == {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
    shapes = {n: tuple(t.shape for t in s) for n, s in adapters._stacks.items()}
    assert shapes["model.layers.0.self_attn.q_proj"][0][0] == 32 and adapters.slots == [None, None]
    a = lora.read(adapter_dirs["a"], model, name="a", max_rank=16)
    adapters.add(a)
    assert adapters.acquire(a) == 1 and {n: tuple(t.shape for t in s) for n, s in adapters._stacks.items()} == shapes


# -- served: PEFT's tokens, alone and mixed ------------------------------------------------------


def test_each_adapter_gives_pefts_tokens_alone_and_mixed_with_others_in_one_step(adapter_dirs, tokenizer):
    prompts = [prompt_of(20, 1), prompt_of(11, 2), prompt_of(6, 3)]
    # per (prompt, slot): transformers + PEFT on fresh copies (slot 0: the base alone)
    references = {0: tiny(), 1: peft_model(adapter_dirs["a"]), 2: peft_model(adapter_dirs["b"])}
    wants = {(i, s): generate(references[s], p, 10) for i, p in enumerate(prompts) for s in references}
    assert wants[(0, 1)] != wants[(0, 0)] and wants[(0, 2)] != wants[(0, 0)]  # each adapter changes the output
    model = tiny()
    adapters = lora.Adapters(model, max_loras=4, max_rank=64)
    for name in ("a", "b"):
        adapters.add(lora.read(adapter_dirs[name], model, name=name, max_rank=64))
    by_slot = {0: None, 1: adapters.get("a"), 2: adapters.get("b")}
    mix = [(i, s) for i in range(3) for s in range(3)]
    for paged in (False, True):
        cache = CacheManager(model.config, DEVICE, DTYPE, 2048, CacheConfig(budget_bytes=2**26))
        engine = Engine(model, tokenizer, EngineConfig(max_context=2048, paged=paged), cache, adapters=adapters)
        engine.start()
        try:
            async def run(i: int, slot: int) -> list[int]:
                request = GenerationRequest(f"r-{i}-{slot}", prompts[i], SamplingParams(max_tokens=10, temperature=0.0),
                                            adapter=by_slot[slot], use_session=False)
                return [t.token_id async for out in engine.submit(request, asyncio.get_running_loop()) for t in out.tokens]

            async def play():
                alone = [await run(i, s) for i, s in mix]
                together = await asyncio.gather(*(run(i, s) for i, s in mix))
                return alone, together

            alone, together = asyncio.run(play())
        finally:
            engine.stop()
        assert engine.runner.paths["lora"] == "2 slots of rank 8"
        for (i, s), got_alone, got_mixed in zip(mix, alone, together):
            assert got_mixed == got_alone, (paged, i, s)  # a row's adapter delta ignores its neighbours
            assert_equivalent(references[s], prompts[i], got_alone, wants[(i, s)])


def test_in_exact_mode_a_mixed_step_gives_each_row_the_bits_it_gets_alone(adapter_dirs, tokenizer):
    """--deterministic: every generated token's logprob, bit for bit, alone and beside rows of
    other adapters (and the base) in one step."""
    model = tiny()
    adapters = lora.Adapters(model, max_loras=4, max_rank=64)
    for name in ("a", "b"):
        adapters.add(lora.read(adapter_dirs[name], model, name=name, max_rank=64))
    by_slot = {0: None, 1: adapters.get("a"), 2: adapters.get("b")}
    prompts = [prompt_of(17, 4), prompt_of(9, 5), prompt_of(23, 6)]
    cache = CacheManager(model.config, DEVICE, DTYPE, 2048, CacheConfig(budget_bytes=2**26))
    engine = Engine(model, tokenizer, EngineConfig(max_context=2048, exact=True), cache, adapters=adapters)
    engine.start()
    try:
        async def run(i: int, slot: int) -> list[tuple[int, float]]:
            params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True)
            request = GenerationRequest(f"x-{i}-{slot}", prompts[i], params, adapter=by_slot[slot], use_session=False)
            return [(t.token_id, t.logprob) async for out in engine.submit(request, asyncio.get_running_loop()) for t in out.tokens]

        async def play():
            mix = [(0, 1), (1, 2), (2, 0), (1, 1)]
            alone = [await run(i, s) for i, s in mix]
            return alone, await asyncio.gather(*(run(i, s) for i, s in mix))

        alone, together = asyncio.run(play())
    finally:
        engine.stop()
    assert together == alone


def test_more_adapters_than_device_slots_swap_in_turn_and_each_gives_its_own_tokens(adapter_dirs, tokenizer):
    """--max-loras 1 with two adapters and the base mixed: a row waits until the one slot is
    free, the other adapter is swapped in, and every request still gives PEFT's tokens."""
    prompts = [prompt_of(14, 7), prompt_of(8, 8)]
    references = {"a": peft_model(adapter_dirs["a"]), "b": peft_model(adapter_dirs["b"]), None: tiny()}
    model = tiny()
    adapters = loaded_adapters(model, adapter_dirs, max_loras=1)
    cache = CacheManager(model.config, DEVICE, DTYPE, 2048, CacheConfig(budget_bytes=2**26))
    engine = Engine(model, tokenizer, EngineConfig(max_context=2048), cache, adapters=adapters)
    engine.start()
    mix = [(i, name) for i in range(2) for name in ("a", "b", None, "b", "a")]
    try:
        got = run_mix(engine, adapters, prompts, mix, 8)
    finally:
        engine.stop()
    assert adapters.swaps >= 2 and adapters.slots in (["a"], ["b"])
    for (i, name), tokens in zip(mix, got):
        assert_equivalent(references[name], prompts[i], tokens, generate(references[name], prompts[i], 8))


def test_unloading_an_adapter_ends_its_requests_and_drops_exactly_its_sessions(adapter_dirs, tokenizer):
    model = tiny()
    adapters = loaded_adapters(model, adapter_dirs, max_loras=2)
    a, b = adapters.get("a"), adapters.get("b")
    cache = CacheManager(model.config, DEVICE, DTYPE, 2048, CacheConfig(budget_bytes=2**26))
    engine = Engine(model, tokenizer, EngineConfig(max_context=2048), cache, adapters=adapters)
    engine.start()
    prompt = prompt_of(12, 9)
    try:
        async def run(adapter, session: str, max_tokens: int = 4) -> list:
            request = GenerationRequest(f"u-{session}-{max_tokens}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                        principal=lora.session_principal("p", adapter), session_id=session, adapter=adapter)
            return [out async for out in engine.submit(request, asyncio.get_running_loop())]

        async def play():
            for adapter in (a, b, None):
                await run(adapter, "s1")  # one kept session each: p|lora:a, p|lora:b and p
            long = asyncio.create_task(run(a, "s2", max_tokens=2000))
            while not engine._running:
                await asyncio.sleep(0.01)
            unloaded, dropped = await asyncio.wrap_future(engine.unload_adapter("a"))
            outputs = await long
            return unloaded, dropped, outputs

        unloaded, dropped, outputs = asyncio.run(play())
        assert unloaded is a and dropped >= 1  # its kept session (the running one rolled back, dropped too)
        assert outputs[-1].error == "adapter_unloaded"
        assert adapters.names == ["b"] and adapters.slots.count("a") == 0
        assert cache.list_sessions(lora.session_principal("p", a)) == []
        assert [s.session_id for s in cache.list_sessions(lora.session_principal("p", b))] == ["s1"]
        assert [s.session_id for s in cache.list_sessions("p")] == ["s1"]
        with pytest.raises(KeyError):
            engine.unload_adapter("a").result(timeout=10)
        late = GenerationRequest("late", prompt, SamplingParams(max_tokens=2), adapter=a, use_session=False)  # resolved before the unload

        async def submit_late():
            return [out async for out in engine.submit(late, asyncio.get_running_loop())]

        assert asyncio.run(submit_late())[-1].error == "adapter_unloaded"
    finally:
        engine.stop()


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_speculation_drafts_with_the_base_and_verifies_with_each_row_s_adapter(adapter_dirs, tokenizer, drafter):
    """Prompt lookup, or a draft model (the base itself, so most drafts of an adapter row are
    rejected): each adapter's greedy tokens are still PEFT's."""
    from server.engine.draft_model import DraftModelProposer
    from server.engine.prompt_lookup import NgramProposer

    prompts = [prompt_of(8, 10) * 3, prompt_of(6, 11) * 4]  # repeats: prompt lookup finds drafts
    references = {"a": peft_model(adapter_dirs["a"]), "b": peft_model(adapter_dirs["b"]), None: tiny()}
    model = tiny()
    adapters = loaded_adapters(model, adapter_dirs, max_loras=2)
    proposer = NgramProposer() if drafter == "ngram" else DraftModelProposer(tiny(), 2048, 2**24)
    cache = CacheManager(model.config, DEVICE, DTYPE, 2048, CacheConfig(budget_bytes=2**26))
    engine = Engine(model, tokenizer, EngineConfig(max_context=2048), cache, proposer=proposer, adapters=adapters)
    engine.start()
    mix = [(i, name) for i in range(2) for name in ("a", None, "b")]
    try:
        got = run_mix(engine, adapters, prompts, mix, 12)
    finally:
        engine.stop()
    for (i, name), tokens in zip(mix, got):
        assert_equivalent(references[name], prompts[i], tokens, generate(references[name], prompts[i], 12))


def test_an_adapter_of_the_default_model_gives_pefts_tokens_chunked_and_batched(smollm2, tmp_path):
    """A PEFT adapter made here on SmolLM2 (q/v and the MLP, random A and B): the engine's
    greedy tokens equal PEFT's `generate`, with prompts prefilled in 7-token chunks beside the
    base model's rows."""
    from tests.conftest import test_cache_dir
    from tests.device import DTYPE_NAME

    def fresh():  # the session's model may carry packed CPU weights, which do not deep-copy
        return load_model(None, cache_dir=test_cache_dir(), device=str(DEVICE), dtype=DTYPE_NAME).model

    base, plain = fresh(), fresh()
    torch.manual_seed(21)
    reference = get_peft_model(fresh(), LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                                   target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])).eval()
    reference.save_pretrained(tmp_path / "smol")
    adapters = lora.Adapters(base, max_loras=1, max_rank=16)
    adapters.add(lora.read(tmp_path / "smol", base, name="smol", max_rank=16))
    tok = smollm2.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False) for text in ("Write a haiku about the sea.", "What is a KV cache?")]
    wants = {(i, name): generate(reference if name else plain, p, 10) for i, p in enumerate(prompts) for name in ("smol", None)}
    assert wants[(0, "smol")] != wants[(0, None)]
    cache = CacheManager(base.config, DEVICE, DTYPE, 2048, CacheConfig(budget_bytes=2**27))
    engine = Engine(base, tok, EngineConfig(max_context=2048, max_batch_tokens=7), cache, adapters=adapters)
    engine.start()
    try:
        got = run_mix(engine, adapters, prompts, list(wants), 10)
    finally:
        engine.stop()
    for ((i, name), want), tokens in zip(wants.items(), got):
        assert_equivalent(reference if name else plain, prompts[i], tokens, want)
