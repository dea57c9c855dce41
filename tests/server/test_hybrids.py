"""Hybrid models: layers of linear attention, Mamba or short convolutions keep a recurrent state
per sequence beside the attention layers' KV (cache_manager/state.py, server/engine/recurrent.py).

The state's bookkeeping (slots, checkpoints, the budget's split) is tested without running a
model; three families, one per kind of recurrent layer (Qwen3-Next's gated delta-net, LFM2's short
convolutions, Falcon-H1's Mamba-2 beside attention in every layer, Granite 4.0-H's Mamba-2
layers, Jamba's Mamba layers, plain Mamba, which keeps states only, MiniMax's lightning attention and RecurrentGemma's RG-LRU) give transformers' `generate` tokens alone, batched, on the paged
path, on a reused session (named or anonymous), on a regenerated and an edited history, and
after a restart from the disk tier. The per-family matrix is
tests/server/test_architectures.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench import architectures
from cache_manager import disk, kv, state
from cache_manager.manager import CacheConfig, CacheManager, NoRoom
from cache_manager.tiers import DiskTier
from server import kv_budget
from server.engine import families
from server.engine.attention import Row
from server.engine.core import Engine, EngineConfig
from server.engine.model_runner import ModelRunner
from server.engine.prompt_lookup import NgramProposer
from server.engine.sampling import SamplingParams
from server.engine.sequence import GenerationRequest
from server.engine.speculative import SpeculativeConfig
from tests.device import DEVICE, DTYPE
from tests.equivalence import assert_equivalent

# gated delta-net, short convolutions, Mamba-2 beside attention in every layer, Mamba-2 layers
# (Granite 4.0-H), Mamba layers (Jamba), Mamba alone (no layer attends), lightning attention
# (MiniMax: its state in a cache class of its own), RG-LRU (RecurrentGemma: its state kept on the
# module by transformers); both through the cache interface by kvserve's `state.state_forward`
FAMILIES = ("qwen3_next", "lfm2", "falcon_h1", "granitemoehybrid", "jamba", "mamba", "minimax", "recurrent_gemma")
FP = "hybrid-test"


def build(name: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(architectures.FAMILIES[name].config(), dtype=DTYPE).to(DEVICE).eval()


def generate(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Served:
    """One engine over a hybrid model (a disk tier below it, if given)."""

    def __init__(self, model, tokenizer, *, disk_tier=None, **engine_kw) -> None:
        self.cache = CacheManager(model.config, DEVICE, DTYPE, 2048, CacheConfig(budget_bytes=2**26), disk=disk_tier)
        self.engine = Engine(model, tokenizer, EngineConfig(max_context=2048, speculative=SpeculativeConfig(adaptive=False), **engine_kw),
                             self.cache, proposer=engine_kw.pop("proposer", None))
        self.engine.start()

    async def run(self, prompt: list[int], n: int, session: str | None = None, anonymous: bool = False):
        request = GenerationRequest(f"r-{session}", prompt, SamplingParams(max_tokens=n, temperature=0.0),
                                    session_id=session, use_session=session is not None or anonymous)
        tokens, final = [], None
        async for out in self.engine.submit(request, asyncio.get_running_loop()):
            tokens += [t.token_id for t in out.tokens]
            final = out
        return tokens, final

    def stop(self) -> None:
        self.engine.stop()


@pytest.fixture(scope="module")
def tok():
    return architectures.tokenizer()


# -- the state's shape and bookkeeping, no model run -------------------------------------------


def test_the_state_is_found_by_running_the_models_own_cache_code():
    config = architectures.FAMILIES["qwen3_next"].config()
    spec = state.spec(config, torch.bfloat16)
    shapes = {name: (shape, dtype) for name, shape, dtype in spec.shapes}
    # layer 0 is gated delta-net: a conv state in the model's dtype, a recurrent state in fp32
    assert shapes == {"conv.0.0": ((128, 4), torch.bfloat16), "rec.0.0": ((4, 16, 16), torch.float32)}
    assert spec.layers == (0,) and spec.nbytes == 128 * 4 * 2 + 4 * 16 * 16 * 4
    assert state.spec(architectures.FAMILIES["llama"].config(), torch.bfloat16) is None
    layout = kv.layout(config)
    assert layout.no_kv == (0,) and layout.owners == layout.attending == (1,)  # only layer 1 keeps KV


def test_a_state_heavier_than_the_probes_kv_still_passes_the_check():
    """The load check's probe runs two sequences: its pool gives them two slots whatever the
    state weighs against its few tokens of KV (real Qwen3-Next: 74 MiB of state, 24 KiB a token)."""
    config = architectures.FAMILIES["qwen3_next"].config()
    config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim = 8, 64, 64
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPE).to(DEVICE).eval()
    assert state.spec(config, DTYPE).nbytes > 128 * kv.layout(config).bytes_per_token(DTYPE)
    families.check(model)


def lfm2_pool(budget: int, reserve_tokens: int = 0) -> kv.Pool:
    return kv.Pool(architectures.FAMILIES["lfm2"].config(), budget, torch.device("cpu"), torch.float32, reserve_tokens=reserve_tokens)


def test_the_budget_gives_the_states_slots_and_the_kv_the_rest():
    config = architectures.FAMILIES["lfm2"].config()
    per_state = state.spec(config, torch.float32).nbytes
    one = kv.bytes_for(config, 256, torch.float32)
    assert kv.bytes_for(config, 256, torch.float32, sequences=1) == one + per_state
    pool = lfm2_pool(one + 3 * per_state, reserve_tokens=256)  # three states fit beside one full context
    assert pool.states.num_slots == 3 and pool.budget_bytes == one and pool.capacity_tokens == 256
    big = lfm2_pool(2**24)
    assert big.states.num_slots == min(2**23 // per_state, kv.MAX_STATE_SLOTS)  # up to half the budget
    assert big.budget_bytes == 2**24 - big.states.num_slots * per_state
    with pytest.raises(kv_budget.KVBudgetError):  # the KV of a full context fits, its state does not
        kv_budget.check(kv_budget.Budget(one, "--kv-budget-bytes"), one, config, torch.float32, "auto", 256)


def test_a_model_that_keeps_states_only_gives_them_the_whole_budget():
    """Mamba: no layer attends, so a token costs no bytes; the states take the budget, and the
    blocks (positions' bookkeeping only) leave every slot's sequence room for the full context."""
    config = architectures.FAMILIES["mamba"].config()
    per_state = state.spec(config, torch.float32).nbytes
    layout = kv.layout(config)
    assert layout.attending == layout.owners == () and layout.bytes_per_token(torch.float32, "fp8") == 0
    assert kv.bytes_for(config, 4096, torch.float32, sequences=1) == per_state
    pool = kv.Pool(config, 5 * per_state + 7, torch.device("cpu"), torch.float32, reserve_tokens=256)
    assert (pool.states.num_slots, pool.block_bytes, pool.budget_bytes) == (5, 0, 5 * per_state)  # what the store counts
    assert pool.capacity_tokens == 5 * kv.STATELESS_TOKENS and pool.keys == [None] * len(layout.windows)
    assert kv_budget.check(kv_budget.Budget(per_state, "--kv-budget-bytes"), per_state, config, torch.float32, "fp8", 256) == 256
    with pytest.raises(kv_budget.KVBudgetError):  # not one state
        kv_budget.check(kv_budget.Budget(per_state - 1, "--kv-budget-bytes"), per_state - 1, config, torch.float32, "auto", 256)
    assert kv_budget.attention_workspace(layout, 4, torch.bfloat16, "fp8", rows=64, chunk=2048, context=4096) == 0
    with pytest.raises(kv_budget.KVBudgetError, match="max-model-len"):  # longer than the positions' bookkeeping
        kv_budget.check(kv_budget.Budget(2**30, "--kv-budget-bytes"), 2**30, config, torch.float32, "auto", 2**29)
    long = kv.Pool(config, 2**40, torch.device("cpu"), torch.float32, reserve_tokens=2**22)  # 4M tokens of context
    per_sequence = kv.blocks_for(2**22)
    assert long.states.num_slots == kv.MAX_STATELESS_BLOCKS // per_sequence == long.num_blocks // per_sequence  # every slot's room
    manager = CacheManager(config, torch.device("cpu"), torch.float32, 256, CacheConfig(budget_bytes=2 * per_state))
    assert manager.recurrent_state()["slots"] == 2 and manager.capacity_tokens() == 2 * 256  # each slot's at the full context
    a = manager.acquire("p", "a", [1, 2, 3], 40)
    assert manager.used_tokens() == 3 * kv.BLOCK_SIZE  # a's blocks for 40 tokens
    assert manager.tier_usage()["device"][:2] == (per_state, 2 * per_state)  # one of two states held
    manager.commit(a, [1, 2, 3])
    b = manager.acquire("p", "b", [4, 5, 6], 16)
    manager.commit(b, [4, 5, 6])
    c = manager.acquire("p", "c", [7, 8, 9], 16)  # the slots decide: a, the least recently used, goes
    assert [s.session_id for s in manager.list_sessions("p")] == ["c", "b"]
    manager.release(c)


def test_a_mamba_config_as_shipped_with_no_attention_heads_is_served(tok):
    """Real Mamba, Mamba-2 and Falcon-Mamba configs name no attention heads at all (the matrix's
    tiny ones inherit a count): the layout, the load check, the runner and the budget need none."""
    from transformers import AutoConfig

    for model_type, extra in (("mamba", {}), ("mamba2", dict(num_heads=8, head_dim=16, n_groups=1, chunk_size=16)),
                              ("falcon_mamba", {})):
        config = AutoConfig.for_model(model_type, vocab_size=49152, hidden_size=64, num_hidden_layers=2, state_size=16, **extra)
        assert getattr(config, "num_attention_heads", None) is None, model_type
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPE).to(DEVICE).eval()
        families.check(model)
        assert kv.layout(config).kv_heads == 0
        served = Served(model, tok)
        try:
            prompt = prompt_of(21, 15)
            got, _ = asyncio.run(served.run(prompt, 6))
        finally:
            served.stop()
        assert_equivalent(model, prompt, got, generate(model, prompt, 6))


def fill(pool: kv.Pool, cache: kv.SequenceKV, value: float, length: int) -> None:
    for t in pool.states.tensors.values():
        t[cache.state] = value
    cache.length = length


def value_of(pool: kv.Pool, cache: kv.SequenceKV) -> float:
    [t, *_] = pool.states.tensors.values()
    return float(t[cache.state].flatten()[0])


def test_checkpoints_take_spare_slots_and_resume_goes_back_to_the_latest_fitting_one():
    pool = lfm2_pool(2**22)
    free = pool.states.num_free
    cache = pool.allocate(64)
    assert pool.states.num_free == free - 1 and not kv.can_crop(cache)
    fill(pool, cache, 1.0, 5)
    assert kv.checkpoint(cache) and not kv.checkpoint(cache)  # one per length
    fill(pool, cache, 2.0, 9)
    assert kv.checkpoint(cache) and pool.states.num_free == free - 3
    fill(pool, cache, 3.0, 12)
    with pytest.raises(ValueError):
        kv.crop(cache, 10)  # a recurrent state cannot be cut back
    assert kv.resume(cache, 12) == 12 and value_of(pool, cache) == 3.0  # nothing to cut
    assert kv.resume(cache, 8) == 5 and value_of(pool, cache) == 1.0  # the checkpoint at 9 is past 8: given up
    assert [n for n, _ in cache.checkpoints] == [5] and pool.states.num_free == free - 2
    assert kv.resume(cache, 3) == 0 and cache.checkpoints == []  # none at or before 3: an empty state
    for n in range(1, kv.MAX_CHECKPOINTS + 3):
        fill(pool, cache, float(n), n)
        kv.checkpoint(cache)
    assert [n for n, _ in cache.checkpoints] == list(range(3, kv.MAX_CHECKPOINTS + 3))  # the oldest given up
    kv.free(cache)
    assert pool.states.num_free == free


def test_files_of_another_state_layout_are_refused_not_misread():
    pool = lfm2_pool(2**22)
    cache = pool.allocate(32)
    fill(pool, cache, 1.5, 20)
    tensors = kv.export(cache)
    assert {n for n in tensors if n.startswith("state.")} == {"state.conv.0.0"}
    back = kv.load(pool, tensors, 20, 32)
    assert torch.equal(pool.states.tensors["conv.0.0"][back.state], pool.states.tensors["conv.0.0"][cache.state])
    wrong = dict(tensors, **{"state.conv.0.0": tensors["state.conv.0.0"][..., :-1]})
    with pytest.raises(ValueError):
        kv.load(pool, wrong, 20, 32)
    with pytest.raises(ValueError):  # no state where the model keeps one
        kv.load(pool, {n: t for n, t in tensors.items() if not n.startswith("state.")}, 20, 32)
    llama = kv.Pool(architectures.FAMILIES["llama"].config(), 2**22, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError):
        kv.load(llama, tensors, 20, 32)


def test_running_out_of_slots_evicts_idle_sessions_and_refuses_when_all_run():
    config = architectures.FAMILIES["lfm2"].config()
    per_state = state.spec(config, torch.float32).nbytes
    budget = kv.bytes_for(config, 256, torch.float32) + 2 * per_state  # one full context and two states
    manager = CacheManager(config, torch.device("cpu"), torch.float32, 256, CacheConfig(budget_bytes=budget))
    assert manager.recurrent_state()["slots"] == 2
    a = manager.acquire("p", "a", [1, 2, 3], 16)
    manager.commit(a, [1, 2, 3])
    b = manager.acquire("p", "b", [4, 5, 6], 16)
    manager.commit(b, [4, 5, 6])
    c = manager.acquire("p", "c", [7, 8, 9], 16)  # a is the least recently used: evicted for its slot
    assert [s.session_id for s in manager.list_sessions("p")] == ["c", "b"]
    with pytest.raises(NoRoom):
        manager.acquire("p", "d", [1, 1, 1], 16)  # c runs, b is idle: b goes; then none is left
        manager.acquire("p", "e", [2, 2, 2], 16)
    manager.release(c)


# -- served: generate's tokens on every path -----------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_hybrids_give_generates_tokens_batched_reused_regenerated_and_edited(name, tok):
    model = build(name)
    families.check(model)
    p1, extra, edit = prompt_of(20, 1), prompt_of(7, 2), prompt_of(9, 3)
    others = [prompt_of(13, 4), prompt_of(5, 5)]
    for paged in (False, True):
        served = Served(model, tok, paged=paged)
        try:
            async def play():
                batch = await asyncio.gather(*(served.run(p, 8) for p in [p1, *others]))
                g1, _ = await served.run(p1, 8, "s")
                p2 = p1 + g1 + extra
                turn2 = await served.run(p2, 8, "s")
                again = await served.run(p2, 8, "s")  # the reply regenerated
                p3 = p1 + g1 + edit
                edited = await served.run(p3, 8, "s")  # the last message edited
                return batch, [(p2, turn2), (p2, again), (p3, edited)]

            batch, turns = asyncio.run(play())
        finally:
            served.stop()
        for prompt, (got, _) in zip([p1, *others], batch):
            assert_equivalent(model, prompt, got, generate(model, prompt, 8))
        for prompt, (got, _) in turns:
            assert_equivalent(model, prompt, got, generate(model, prompt, 8))
        (p2, (_, turn2)), (_, (_, again)), (p3, (_, edited)) = turns
        assert (turn2.cached_tokens, turn2.miss_reason) == (20 + 8 - 1, None)  # the whole last turn
        assert (again.cached_tokens, again.miss_reason) == (len(p2) - 1, None)  # the state kept before the prompt's end
        assert (edited.cached_tokens, edited.miss_reason) == (27, "recurrent_checkpoint")  # where turn 2 started


@pytest.mark.parametrize("name", FAMILIES)
def test_a_first_token_alone_starts_from_no_state_on_a_recycled_slot(name):
    """A sequence whose first step is one token (a one-token prompt, or a first chunk cut to one
    token), on the paged path (where a step of single tokens is a decode step: a graph on CUDA),
    on the state slot another sequence has just left: its logits are the model's own for that
    token, not a continuation of the slot's last owner."""
    model = build(name)
    families.check(model)
    pool = kv.Pool(model.config, kv.bytes_for(model.config, 64, DTYPE) * 2, DEVICE, DTYPE, state_slots=1)
    runner = ModelRunner(model, pool, cuda_graphs=False, paged=True, max_rows=2, packed=None)
    runner.prepare()
    before = pool.allocate(16)
    runner.forward([Row(before, 6)], prompt_of(6, 7), [0])
    runner.forward([Row(before, 1)], [11], [0])
    kv.free(before)
    cache = pool.allocate(4)
    got = runner.forward([Row(cache, 1)], [42], [0])[0]
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([[42]], device=DEVICE)).logits[0, -1].float()
    torch.testing.assert_close(got, alone, atol=1e-4, rtol=1e-4)


def test_a_failed_step_leaves_every_state_as_it_was():
    model = build("qwen3_next")
    families.check(model)
    pool = kv.Pool(model.config, kv.bytes_for(model.config, 64, DTYPE, sequences=2), DEVICE, DTYPE, reserve_tokens=64)
    runner = ModelRunner(model, pool, cuda_graphs=False, packed=None)
    cache = pool.allocate(32)
    ids = prompt_of(12, 6)
    runner.forward([Row(cache, 10)], ids[:10], [0])
    before = {n: t[cache.state].clone() for n, t in pool.states.tensors.items()}
    norm = model.model.norm
    original = norm.forward
    norm.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a fault after every layer ran"))
    with pytest.raises(RuntimeError):
        runner.forward([Row(cache, 2)], ids[10:], [0])
    norm.forward = original
    assert cache.length == 10 and all(torch.equal(t[cache.state], before[n]) for n, t in pool.states.tensors.items())
    retried = runner.forward([Row(cache, 2)], ids[10:], [0])
    with torch.no_grad():
        whole = model(input_ids=torch.tensor([ids], device=DEVICE)).logits[0, -1].float()
    assert torch.allclose(retried[0], whole, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_sessions_come_back_from_disk_after_a_restart_bit_for_bit(name, tok, tmp_path):
    model = build(name)
    families.check(model)
    p1 = prompt_of(24, 7)
    first = Served(model, tok, disk_tier=DiskTier(tmp_path, 2**30, 1800.0, FP))
    try:
        g1, _ = asyncio.run(first.run(p1, 6, "kept"))
        kept = kv.export(first.cache.store.get(("anonymous", "kept")).kv)
        first.cache.close(timeout_s=30)  # what SIGTERM does after the drain
    finally:
        first.stop()
    [path] = tmp_path.glob("*.kv")
    header = disk.read_header(path)
    tokens, tensors = disk.read(path, header)
    assert tokens == p1 + g1[:-1] and set(tensors) == set(kept)
    assert all(torch.equal(tensors[n].cpu(), kept[n].cpu()) for n in kept)  # the state too, bit for bit

    second = Served(model, tok, disk_tier=DiskTier(tmp_path, 2**30, 1800.0, FP))  # a new process
    try:
        p2 = p1 + g1 + prompt_of(5, 8)
        g2, final = asyncio.run(second.run(p2, 6, "kept"))
    finally:
        second.stop()
    assert final.miss_reason == "restored_disk" and final.cached_tokens == len(p1) + len(g1) - 1
    assert_equivalent(model, p2, g2, generate(model, p2, 6))


def test_anonymous_requests_reuse_each_other_at_the_kept_states(tok):
    """Without a session id: a request extending another's whole history reuses its state; one
    that leaves it inside (where no state was kept) resumes from the kept one before."""
    model = build("qwen3_next")
    served = Served(model, tok)
    try:
        async def play():
            p1 = prompt_of(70, 9)
            g1, _ = await served.run(p1, 6, anonymous=True)
            p2 = p1 + g1 + prompt_of(4, 10)
            second = await served.run(p2, 6, anonymous=True)
            p3 = p1[:66] + prompt_of(10, 11)  # leaves it at 66: anonymous reuse counts whole blocks of 32
            third = await served.run(p3, 6, anonymous=True)
            return [(p2, second), (p3, third)]

        (p2, (g2, second)), (p3, (g3, third)) = asyncio.run(play())
    finally:
        served.stop()
    assert second.cached_tokens == 70 + 6 - 1 and second.miss_reason is None
    assert third.cached_tokens == 0 and third.miss_reason == "not_croppable"  # kept: 75 and 79 only (the latest turn)
    assert_equivalent(model, p2, g2, generate(model, p2, 6))
    assert_equivalent(model, p3, g3, generate(model, p3, 6))


@pytest.mark.parametrize("mode,feature", [("speculative", "recurrent-speculative"), ("deterministic", "recurrent-exact")])
def test_speculation_and_exact_mode_are_refused_at_start_up_by_name(mode, feature, tok):
    model = build("lfm2")
    cache = CacheManager(model.config, DEVICE, DTYPE, 2048, CacheConfig(budget_bytes=2**26))
    kw = {"proposer": NgramProposer()} if mode == "speculative" else {}
    config = EngineConfig(max_context=2048, exact=mode == "deterministic")
    with pytest.raises(families.UnsupportedModel) as refused:
        Engine(model, tok, config, cache, **kw)
    assert refused.value.feature == feature


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["qwen3_next", "mamba"])
async def test_the_http_api_reports_the_state_and_reuse_of_a_hybrid(name, tok):
    """Over HTTP (the official client): /v1/models shows the recurrent state, a later turn
    reuses its session (usage.prompt_tokens_details.cached_tokens), an edited turn resumes from
    a checkpoint and says so (X-Cache-Miss-Reason); Mamba's tokens take no KV bytes."""
    from server.model_loader import LoadedModel
    from tests.inprocess import openai_client

    model = build(name)
    loaded = LoadedModel(model=model, tokenizer=tok, model_id="tiny-qwen3-next", device=DEVICE, dtype=DTYPE, max_context=2048)
    async with openai_client(loaded, kv_budget_bytes=2**26) as (client, http):
        [card] = (await client.models.list()).data
        kv_info = card.model_extra["kv_cache"]
        state_info = kv_info["recurrent_state"]
        assert state_info["layers"] == len(state.spec(model.config, DTYPE).layers) and state_info["bytes_per_sequence"] > 0
        assert state_info["slots"] == (min(2**26 // state_info["bytes_per_sequence"], kv.MAX_STATE_SLOTS) if name == "mamba" else
                                       state_info["slots"]) >= 1
        assert (kv_info["bytes_per_token"] == 0) == (name == "mamba") and kv_info["capacity_tokens"] >= 2048
        session = {"X-Session-ID": "h"}
        messages = [{"role": "user", "content": "Count to three."}]
        first = await client.chat.completions.create(model="tiny-qwen3-next", messages=messages, max_tokens=6, temperature=0,
                                                     extra_headers=session)
        messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Again."}]
        second = await client.chat.completions.with_raw_response.create(model="tiny-qwen3-next", messages=messages, max_tokens=6,
                                                                        temperature=0, extra_headers=session)
        assert second.parse().usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens
        assert "x-cache-miss-reason" not in second.headers
        messages[-1] = {"role": "user", "content": "Once more, slowly."}
        edited = await client.chat.completions.with_raw_response.create(model="tiny-qwen3-next", messages=messages, max_tokens=6,
                                                                        temperature=0, extra_headers=session)
        assert edited.headers["x-cache-miss-reason"] == "recurrent_checkpoint"
        assert 0 < edited.parse().usage.prompt_tokens_details.cached_tokens < second.parse().usage.prompt_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mamba_scan_continued_from_its_kept_state_is_the_scan_of_the_whole(dtype):
    """Jamba's selective scan starts from zero (as mamba_ssm's kernel); `recurrent._scan` runs
    the same recurrence from a kept state: two halves, the second from the first's state, give
    the whole's output and state, in bf16 too (the state stays float32, as the scan keeps it)."""
    from transformers.models.jamba import modeling_jamba

    from server.engine import recurrent

    torch.manual_seed(0)
    b, d, n, t = 2, 8, 4, 12
    x, dt, z = (torch.randn(b, d, t, dtype=dtype) for _ in range(3))
    B, C = (torch.randn(b, n, t, dtype=dtype) for _ in range(2))
    A, D, bias = -torch.rand(d, n) - 0.5, torch.randn(d), torch.randn(d)
    original = getattr(modeling_jamba.mamba_selective_scan, "__wrapped__", modeling_jamba.mamba_selective_scan)
    scan = recurrent._scan(original)

    def run(lo: int, hi: int):
        return scan(x[..., lo:hi], dt[..., lo:hi], A, B[..., lo:hi], C[..., lo:hi], D=D, z=z[..., lo:hi], delta_bias=bias,
                    delta_softplus=True, return_last_state=True)

    whole, last = run(0, t)
    first, kept = run(0, t // 2)
    token = recurrent._INITIAL.set(kept)
    try:
        second, state_after = run(t // 2, t)
    finally:
        recurrent._INITIAL.reset(token)
    assert kept.dtype == torch.float32
    # NOTE: equal but for an ulp of fp32 (a slice's vectorised exp rounds its tail apart)
    torch.testing.assert_close(torch.cat([first, second], dim=-1), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state_after, last, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["recurrent_gemma", "minimax"])
def test_a_block_kvserve_runs_over_the_cache_interface_is_its_own_forward_in_any_chunks(name):
    """RecurrentGemma keeps its block's state on the module, MiniMax in a cache class of its
    own; kvserve's forward of the block (`state.state_forward`) keeps it in transformers' cache
    interface instead (here over two rows' state slots, as a step keeps them). A sequence of 13
    tokens in chunks of 5, 1, 4 and 3 (a first chunk, a decode step, continued chunks; MiniMax's
    in blocks of 4 positions, so chunks span blocks) gives the block's own forward over the whole."""
    from server.engine.recurrent import _RowStates

    config = architectures.FAMILIES[name].config()
    if name == "minimax":
        config.block_size = 4
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPE).to(DEVICE).eval()
    block, keyword = state.recurrent_modules(model)[0]
    forward = state.state_forward(block)
    slots = state.Slots(state.spec(config, DTYPE), 2, DEVICE)
    rows = torch.tensor([0, 1], device=DEVICE)
    torch.manual_seed(1)
    x = torch.randn(2, 13, config.hidden_size, device=DEVICE, dtype=DTYPE)
    positions = torch.arange(13, device=DEVICE)[None].expand(2, 13)
    with torch.no_grad():
        whole = block(x, positions, None, use_cache=False)[0] if name == "recurrent_gemma" else block(x, None, None)[0]
        pieces, at = [], 0
        for n in (5, 1, 4, 3):  # each chunk over the two rows' slots, as a step runs it
            cache = _RowStates(slots, rows, previous=at > 0)
            pieces.append(forward(x[:, at : at + n], **{keyword: cache})[0])
            for state_name, index, values in cache.written():
                slots.put(state_name, index, values)
            at += n
    tolerance = 1e-5 if DTYPE == torch.float32 else 2e-2
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=tolerance, atol=tolerance)
    if name == "recurrent_gemma":  # the recurrence in full precision, as transformers keeps it
        assert slots.tensors[f"rec.{block.layer_idx}.0"].dtype == torch.float32


def test_minimaxs_own_forward_is_transformers_bit_for_bit_where_generate_runs_it():
    """What `generate` computes (a prompt from no state, then one token at a time from the
    state) kvserve's `_lightning` computes with the same operations: equal bits, the kept state
    too (a prompt of 6 tokens in blocks of 4, then 4 steps), against MiniMax's own cache."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    from server.engine.recurrent import _RowStates

    config = architectures.FAMILIES["minimax"].config()
    config.block_size = 4
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPE).to(DEVICE).eval()
    block, keyword = state.recurrent_modules(model)[0]
    forward = state.state_forward(block)
    slots, rows = state.Slots(state.spec(config, DTYPE), 1, DEVICE), torch.tensor([0], device=DEVICE)
    torch.manual_seed(1)
    x = torch.randn(1, 10, config.hidden_size, device=DEVICE, dtype=DTYPE)
    with torch.no_grad():
        own = MiniMaxCache()
        at = 0
        for n in (6, 1, 1, 1, 1):
            want = block(x[:, at : at + n], None, None, past_key_values=own)[0]
            cache = _RowStates(slots, rows, previous=at > 0)
            got = forward(x[:, at : at + n], **{keyword: cache})[0]
            for state_name, index, values in cache.written():
                slots.put(state_name, index, values)
            assert torch.equal(got, want), at
            at += n
    assert torch.equal(slots.tensors[f"rec.{block.layer_idx}.0"][0:1], own.get_linear_cache(block.layer_idx))
