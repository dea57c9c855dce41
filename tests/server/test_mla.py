"""Multi-head latent attention served from its latent (server/engine/mla.py): the pool holds the
compressed KV and the rotary key per token and layer, the budget, the capacity and the files
count exactly that, and the attention (decode rows absorbed, prefill chunks decompressed) gives
transformers' tokens alone, in sessions
(reused, cropped, evicted, restored after a restart), in fp8 and in exact mode. A latent that
cannot be served goes back to decompressed heads, or is refused by name, never served
different. Every MLA family of the architecture matrix runs there from its latent as well
(tests/server/test_architectures.py).

The tiny shapes have no two widths alike (latent 24, nope 16, values 12, rope 8, query latent
32), so an up-projection applied transposed or to the wrong part cannot pass.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from cache_manager import disk, kv
from cache_manager.manager import CacheConfig, CacheManager
from cache_manager.tiers import DiskTier
from server.engine import families, lora, mla
from server.engine.core import Engine, EngineConfig
from server.engine.draft_model import DraftModelProposer
from server.engine.sampling import SamplingParams
from server.engine.sequence import GenerationRequest
from server.engine.speculative import SpeculativeConfig
from server.engine.unsupported import UnsupportedModel
from server.metrics import Metrics
from server.model_loader import LoadedModel
from tests.device import DEVICE, DTYPE
from tests import engines
from tests.engines import stopped_after
from tests.equivalence import assert_equivalent
from tests.inprocess import served
from tests.server.test_sessions import Harness, conversation_start

SHAPE = dict(q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=4)
BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32)
# DeepSeek-V3's long-context rope: YaRN, whose mscale enters the softmax scale the absorbed scores must keep
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=512, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
ITEMSIZE = torch.empty((), dtype=DTYPE).element_size()
LATENT_BYTES = 2 * (24 + 8) * ITEMSIZE  # per token: 2 layers x (latent 24 + rotary key 8)
HEADS_BYTES = 2 * 4 * (24 + 12) * ITEMSIZE  # decompressed: 2 layers x 4 heads x (key 16 + 8, value 12)


def deepseek(seed: int = 0, **config):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("deepseek_v3", **{**BASE, **SHAPE, "rope_parameters": YARN, **config})
    return AutoModelForCausalLM.from_config(cfg, dtype=DTYPE).to(DEVICE).eval()


@pytest.fixture(scope="module")
def model():
    model = deepseek()
    families.check(model)  # the default: the latent, held to transformers' forward by the probe
    return model


@pytest.fixture
def harness(model, tokenizer):
    yield from stopped_after(lambda **kw: Harness(model, tokenizer, 2048, **kw))


# -- the layout ----------------------------------------------------------------------------------


def test_the_pool_the_budget_and_the_files_count_the_latent_s_bytes(model, tmp_path):
    layout = kv.layout(model.config)
    assert layout.latent and (layout.kv_heads, layout.key_dim, layout.value_dim) == (1, 8, 24)
    assert layout.bytes_per_token(DTYPE) == LATENT_BYTES
    assert layout.bytes_per_token(torch.bfloat16, "fp8") == 2 * (8 + 2 + 24 + 2)  # each part its own bf16 scale
    pool = kv.Pool(model.config, kv.bytes_for(model.config, 64, DTYPE), DEVICE, DTYPE)
    assert pool.block_bytes == kv.BLOCK_SIZE * LATENT_BYTES and pool.capacity_tokens == 64
    assert pool.keys[0].shape == (1, pool.capacity_tokens + kv.BLOCK_SIZE, 8) and pool.values[0].shape[-1] == 24

    # a file of the latent comes back bit-identical; one of the heads does not fit it, and its
    # fingerprint differs, so a restart in the other mode recomputes rather than misreads
    cache = pool.allocate(40)
    for t in pool.keys + pool.values:
        t.normal_()
    cache.length = 40
    header = disk.Header("fp", disk.hash_principal("p"), "s", 40)
    name = disk.file_name(header.principal, "s")
    disk.write(tmp_path, name, header, list(range(40)), kv.export(cache))
    _, tensors = disk.read(tmp_path / name, header)
    back = kv.load(kv.Pool(model.config, kv.bytes_for(model.config, 64, DTYPE), DEVICE, DTYPE), tensors, 40, 48)
    assert all(torch.equal(a, b) for a, b in zip(kv.export(cache).values(), kv.export(back).values()))
    heads = deepseek()
    mla.configure(heads, "heads")
    assert kv.layout(heads.config).bytes_per_token(DTYPE) == HEADS_BYTES
    heads_pool = kv.Pool(heads.config, kv.bytes_for(heads.config, 64, DTYPE), DEVICE, DTYPE)
    with pytest.raises(ValueError):
        kv.load(heads_pool, tensors, 40, 48)
    assert disk.fingerprint(heads, DTYPE) != disk.fingerprint(model, DTYPE)


def test_deepseek_v3_s_real_shape_keeps_a_seventy_first_of_its_heads():
    config = AutoConfig.for_model("deepseek_v3")  # its defaults are DeepSeek-V3's: 128 heads, latent 512, rope 64
    heads = kv.layout(config).bytes_per_token(torch.bfloat16)
    setattr(config, kv.LATENT, "latent")
    latent = kv.layout(config).bytes_per_token(torch.bfloat16)
    assert latent == config.num_hidden_layers * (512 + 64) * 2
    assert heads / latent == pytest.approx(128 * (192 + 128) / 576)  # 71.1


# -- the attention -------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [dict(rope_interleave=True), dict(rope_interleave=False), dict(rope_parameters=None)],
                         ids=["interleaved", "halves", "plain-rope"])
def test_the_absorbed_attention_matches_transformers_forward(config):
    """families.check's probe (a prefill, a packed step continuing it beside another sequence,
    then a decode row beside a chunk, against transformers' forward of the whole: the absorbed
    and the decompressed paths both) passes from the latent; `latent` refuses rather than fall
    back."""
    model = deepseek(**config)
    assert mla.configure(model, "latent") == "latent"
    families.check(model)
    assert kv.layout(model.config).latent


def test_exact_mode_s_up_projections_give_a_row_the_same_bits_whatever_else_is_in_the_call(model):
    module = mla.modules(model)[0]
    torch.manual_seed(1)
    query = torch.randn(1, 4, 13, 16 + 8, device=DEVICE, dtype=DTYPE)
    whole, part = mla.absorb(module, query, True), mla.absorb(module, query[:, :, 4:7], True)
    assert torch.equal(whole[:, :, 4:7], part)
    out = torch.randn(1, 13, 4, 24, device=DEVICE, dtype=DTYPE)
    assert torch.equal(mla.expand(module, out, True)[:, 4:7], mla.expand(module, out[:, 4:7], True))
    # and they compute what the plain products do
    assert torch.allclose(whole, mla.absorb(module, query, False), atol=1e-5)


def test_a_prefill_chunk_decompresses_the_latent_as_transformers_does(model):
    """Outside exact mode a prefill chunk on the row path attends decompressed keys and values
    (cheaper than absorbing there: docs/benchmarks.md): `mla.decompress` is `expand_kv`."""
    module = mla.modules(model)[0]
    torch.manual_seed(2)
    latent, k_rot = torch.randn(1, 1, 21, 24, device=DEVICE, dtype=DTYPE), torch.randn(1, 1, 21, 8, device=DEVICE, dtype=DTYPE)
    got = mla.decompress(module, latent, k_rot)
    want = type(module).expand_kv(module, latent, k_rot)
    assert all(torch.allclose(a, b, atol=1e-6) and a.shape == b.shape for a, b in zip(got, want))


def test_sessions_reuse_crop_evict_restore_and_survive_a_restart(model, harness, tmp_path):
    """Turns played against fresh prefills of the same prompt (tests/equivalence.py): reused,
    an edited history cropped, a session evicted by another and recomputed, then all of them
    written to disk and restored by a new engine; a restart whose pool keeps heads finds the
    files foreign and recomputes."""
    metrics = Metrics()
    fingerprint = disk.fingerprint(model, DTYPE)
    tier = DiskTier(tmp_path, 2**30, 1800.0, fingerprint, metrics)
    budget = kv.bytes_for(model.config, 7 * kv.BLOCK_SIZE, DTYPE)  # one conversation at a time
    first, reference = harness(budget=budget, tiers={"disk": tier}, metrics=metrics), harness()
    convs = {sid: conversation_start(k) for k, sid in [(1, "a"), (2, "b")]}

    async def turn(h, sid, question):
        convs[sid].append({"role": "user", "content": question})
        tokens, final = await h.turn(sid, h.prompt(convs[sid]), reference=reference)
        convs[sid].append({"role": "assistant", "content": h.reply(tokens)})
        return final

    async def play():
        for question in ("Tell me about rain.", "And snow?"):
            for sid in convs:
                await turn(first, sid, question)
        # an edited history: the last answer replaced, the cache cropped to what still matches
        convs["a"][-1] = {"role": "assistant", "content": "Something else entirely."}
        final = await turn(first, "a", "Why?")
        assert 0 < final.cached_tokens < len(first.prompt(convs["a"]))

    asyncio.run(play())
    assert metrics.registry.get_sample_value("kvserve_kv_restores_total", {"tier": "disk"}) >= 1
    first.cache.close(timeout_s=30)
    first.stop()
    second = harness(tiers={"disk": DiskTier(tmp_path, 2**30, 1800.0, fingerprint, metrics)}, metrics=metrics)
    second.committed = dict(first.committed)
    final = asyncio.run(turn(second, "b", "Last one?"))
    assert final.miss_reason == "restored_disk" and final.cached_tokens > 0
    second.cache.close(timeout_s=30)
    assert list(tmp_path.glob("*.kv"))
    heads = deepseek()
    mla.configure(heads, "heads")
    foreign = DiskTier(tmp_path, 2**30, 1800.0, disk.fingerprint(heads, DTYPE), metrics)
    assert len(foreign.store) == 0 and not list(tmp_path.glob("*.kv"))


def test_an_fp8_latent_keeps_its_own_scales_and_the_quantized_tokens(model, harness):
    """--kv-cache-dtype fp8 over the latent: one byte a value and a bf16 scale per token for
    the latent and for the rotary key; turns reused from it give the tokens of fresh fp8
    prefills (the same quantization's reference)."""
    h, reference = harness(kv_dtype="fp8"), harness(kv_dtype="fp8")
    messages = conversation_start(3)

    async def play():
        for question in ("Tell me about rain.", "And snow?"):
            messages.append({"role": "user", "content": question})
            tokens, final = await h.turn("s", h.prompt(messages), reference=reference)
            messages.append({"role": "assistant", "content": h.reply(tokens)})
        return final

    assert asyncio.run(play()).cached_tokens > 0
    pool = h.cache.pool
    assert pool.keys[0].dtype == torch.uint8 and pool.values[0].shape[-1] == 24
    assert pool.key_scales[0].shape == pool.value_scales[0].shape == pool.keys[0].shape[:2]


def test_a_draft_model_with_mla_drafts_from_its_own_latent(model, tokenizer):
    """Speculation with an MLA draft model: the draft's pool keeps its latent too, and the
    verified tokens are `generate`'s."""
    draft = deepseek(seed=1)
    families.check(draft)
    proposer = DraftModelProposer(draft, 2048, budget_bytes=2**24)
    assert proposer.pool.layout.latent
    engine = Engine(model, tokenizer, EngineConfig(max_context=2048, speculative=SpeculativeConfig(max_draft=4, adaptive=False)),
                    CacheManager(model.config, DEVICE, DTYPE, 2048, CacheConfig(budget_bytes=2**24)), proposer=proposer)
    engine.start()
    try:
        prompt = list(range(100, 140))
        got, _ = asyncio.run(engines.run(engine, GenerationRequest("d", prompt, SamplingParams(max_tokens=16, temperature=0.0))))
    finally:
        engine.stop()
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=16, do_sample=False, pad_token_id=0)[0, 40:].tolist()
    assert_equivalent(model, prompt, got, want)


# -- where the latent cannot serve ---------------------------------------------------------------


def test_a_latent_that_differs_goes_back_to_heads_or_is_refused_by_name(monkeypatch):
    """A latent path the probe finds different from transformers (here: the value
    up-projection skipped for one head) is never served: `auto` keeps heads, `latent` refuses."""
    expand = mla.expand

    def wrong(module, out, exact_mode):
        o = expand(module, out, exact_mode).clone()
        o[..., 0, :] = 0
        return o

    monkeypatch.setattr(mla, "expand", wrong)
    model = deepseek()
    families.check(model)
    assert not kv.layout(model.config).latent and getattr(model.config, kv.LATENT) == "heads"
    model = deepseek()
    mla.configure(model, "latent")
    with pytest.raises(UnsupportedModel) as refused:
        families.check(model)
    assert refused.value.feature == "mla-latent" and "forward-mismatch" in str(refused.value)


def test_lora_keeps_heads_in_auto_and_an_adapter_on_kv_b_proj_is_refused_over_the_latent(tmp_path):
    model = deepseek()
    assert mla.configure(model, "auto", lora=True) == "heads"
    assert mla.configure(model, "latent", lora=True) == "latent"
    torch.manual_seed(3)
    peft_model = get_peft_model(deepseek(), LoraConfig(r=4, lora_alpha=8, target_modules=["kv_b_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path)
    adapters = lora.Adapters(model, max_loras=1, max_rank=8, max_loaded=1)
    with pytest.raises(lora.AdapterError) as refused:
        adapters.load("a", tmp_path)
    assert refused.value.reason == "targets" and "--mla-cache heads" in str(refused.value)
    with pytest.raises(UnsupportedModel, match=r"no multi-head latent attention.*\[mla-latent\]"):
        mla.configure(AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **{k: BASE[k] for k in ("vocab_size", "hidden_size")},
                                                                            num_hidden_layers=1, num_attention_heads=4)), "latent")


def test_the_server_serves_the_latent_by_default_and_heads_when_asked(tokenizer):
    """--mla-cache: the engine's paths name the layout, and the same budget holds as many
    more tokens as the latent is smaller."""

    async def capacity(**settings):
        loaded = LoadedModel(model=deepseek(), tokenizer=tokenizer, model_id="tiny-mla", device=DEVICE, dtype=DTYPE, max_context=2048)
        async with served(loaded, kv_budget_bytes=2**22, **settings) as s:
            card = (await s.http.get("/v1/models")).json()["data"][0]
            chat = await s.http.post("/v1/chat/completions", json={
                "model": "tiny-mla", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4, "temperature": 0})
            assert chat.status_code == 200, chat.text
            assert card["kv_cache"]["bytes_per_token"] == (LATENT_BYTES if settings.get("mla_cache") != "heads" else HEADS_BYTES)
            return card["engine"]["mla"], card["kv_cache"]["capacity_tokens"]

    latent, latent_tokens = asyncio.run(capacity())
    heads, heads_tokens = asyncio.run(capacity(mla_cache="heads"))
    assert (latent, heads) == ("latent", "heads")
    assert latent_tokens == 2**22 // (kv.BLOCK_SIZE * LATENT_BYTES) * kv.BLOCK_SIZE
    assert heads_tokens == 2**22 // (kv.BLOCK_SIZE * HEADS_BYTES) * kv.BLOCK_SIZE
