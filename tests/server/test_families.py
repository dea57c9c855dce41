"""Model families (server/engine/families.py, rope.py, the pool's key and value widths): what the
engine cannot model is refused at load by name, and what it models gives transformers'
`generate` tokens. Tiny random-weight models built here; the per-architecture matrix is
tests/server/test_architectures.py."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from cache_manager import disk, kv
from cache_manager.manager import CacheConfig, CacheManager
from server.engine import attention, context, families
from server.engine.mla import configure as configure_mla
from server.engine.core import Engine, EngineConfig
from server.engine.prompt_lookup import NgramProposer
from server.engine.sampling import SamplingParams
from server.engine.sequence import GenerationRequest
from server.engine.speculative import SpeculativeConfig
from tests.device import DEVICE, DTYPE
from tests.equivalence import assert_equivalent

SWITCH = 32  # the LongRoPE model's original_max_position_embeddings
BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=2)


def tiny(model_type: str = "llama", **config):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **{**BASE, **config})
    return AutoModelForCausalLM.from_config(cfg, dtype=DTYPE).to(DEVICE).eval()


def longrope(**config):
    rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8, long_factor=[3.0 + i for i in range(8)],
                original_max_position_embeddings=SWITCH)
    return tiny("phi3", rope_parameters=rope, original_max_position_embeddings=SWITCH, pad_token_id=0, **config)


def mla():
    return tiny("deepseek_v3", q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                moe_intermediate_size=32, num_key_value_heads=4)


def generate(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=DEVICE)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompt_of(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Served:
    """One engine over a tiny model, with the SmolLM2 tokenizer (its ids cover the vocabulary)."""

    def __init__(self, model, tokenizer, proposer=None, **engine_kw) -> None:
        self.model = model
        self.cache = CacheManager(model.config, DEVICE, DTYPE, 2048, CacheConfig(budget_bytes=2**26))
        config = EngineConfig(max_context=2048, speculative=SpeculativeConfig(adaptive=False), **engine_kw)
        self.engine = Engine(model, tokenizer, config, self.cache, proposer=proposer)
        self.engine.start()

    async def run(self, prompt: list[int], n: int, session: str | None = None):
        request = GenerationRequest(f"r-{session}", prompt, SamplingParams(max_tokens=n, temperature=0.0),
                                    session_id=session, use_session=session is not None)
        handle = self.engine.submit(request, asyncio.get_running_loop())
        tokens, final = [], None
        async for out in handle:
            tokens += [t.token_id for t in out.tokens]
            final = out
        return tokens, final

    def stop(self) -> None:
        self.engine.stop()


# -- refused by name -----------------------------------------------------------------------------


def with_attention_keyword(model, **extra):
    """Each attention module hands transformers' attention function one more keyword, as a new
    transformers release adding a feature would."""
    for layer in model.model.layers:
        layer.self_attn.forward = functools.partial(layer.self_attn.forward, **extra)
    return model


def test_an_attention_keyword_the_engine_does_not_model_is_refused_by_name():
    model = with_attention_keyword(tiny(), attention_bias_table=torch.ones(1))
    with pytest.raises(families.UnsupportedModel) as refused:
        families.check(model)
    assert refused.value.feature == "attention-attention_bias_table" and "attention_bias_table" in str(refused.value)
    # keywords that only ask what a forward returns are not features
    families.check(with_attention_keyword(tiny(), output_router_logits=False))


def test_key_and_value_widths_other_than_the_layout_are_refused():
    model = tiny()
    model.config.v_head_dim = 8  # the layout would size values 8 wide; the layers make 16
    with pytest.raises(families.UnsupportedModel) as refused:
        families.check(model)
    assert refused.value.feature == "kv-width"


def test_a_layer_that_does_not_attend_once_per_pass_is_refused():
    model = tiny(num_hidden_layers=3)
    layers = model.model.layers
    layers[2].self_attn = layers[1].self_attn  # two layers share one attention (and its layer_idx)
    with pytest.raises(families.UnsupportedModel) as refused:
        families.check(model)
    assert refused.value.feature == "kv-layers"


def test_logits_that_differ_from_transformers_are_refused():
    """A feature the checks cannot name (here: rotary positions counted from the start of the
    forward pass, as a module reading a cache length would) fails the probe."""
    model = tiny()
    rotary = model.model.rotary_emb
    original = rotary.forward
    rotary.forward = lambda x, position_ids: original(x, torch.arange(position_ids.shape[-1], device=position_ids.device)[None])
    with pytest.raises(families.UnsupportedModel) as refused:
        families.check(model)
    assert refused.value.feature == "forward-mismatch"


@pytest.mark.parametrize("model_type,config,feature", [
    ("llama", dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)), "dynamic-rope"),
])
def test_features_without_a_path_are_refused_by_name(model_type, config, feature):
    with pytest.raises(families.UnsupportedModel) as refused:
        families.check(tiny(model_type, **config))
    assert refused.value.feature == feature


# -- Llama 4: chunked attention, the NoPE layers' query temperature -------------------------------

CHUNK = 24  # Llama 4's attention_chunk_size here: every prompt below crosses a chunk's end


def llama4(**config):
    return tiny("llama4_text", num_hidden_layers=4, intermediate_size_mlp=128, attention_chunk_size=CHUNK, floor_scale=8,
                attn_scale=0.5, no_rope_layers=[1, 1, 1, 0], num_local_experts=4, num_experts_per_tok=1,
                interleave_moe_layer_step=2, head_dim=16, pad_token_id=0, **config)


@pytest.mark.parametrize("window", [None, 7, 16, -8, -16, -5])
def test_each_window_sees_what_transformers_masks_see(window):
    """`context.visible` (the one rule; the kernels and `_first_key` follow `first_visible`)
    against transformers' own mask functions: full, sliding (> 0) and chunked (< 0)."""
    from transformers.masking_utils import causal_mask_function, chunked_causal_mask_function, sliding_window_causal_mask_function

    if window is None:
        rule = causal_mask_function
    elif window > 0:
        rule = sliding_window_causal_mask_function(window)
    else:
        rule = chunked_causal_mask_function(-window, torch.zeros(1, dtype=torch.long))
    n = 50
    keys, queries = torch.arange(n)[None, :], torch.arange(n)[:, None]
    index = [torch.tensor(i) for i in range(n)]
    want = torch.tensor([[bool(rule(0, 0, q, k)) for k in index] for q in index])
    assert torch.equal(context.visible(keys, queries, window), want)
    for q in range(n):  # the first key each query reads is its first visible one
        assert attention._first_key(q, window) == int(want[q].nonzero()[0])


def test_llama4_layers_are_chunked_and_their_nope_queries_take_their_own_positions_temperature(tokenizer):
    """Llama 4's text model: chunked layers in the layout, and prompts crossing chunk ends
    batched (row and paged path, prefill split over several steps), then continued on a
    session: generate's tokens. Without the position temperature (the packed step's index
    instead, as transformers would read it from its cache) the load probe refuses the model."""
    from server.engine import temperature

    model = llama4()
    assert kv.layout(model.config).windows == (-CHUNK, -CHUNK, -CHUNK, None)
    families.check(model)
    prompts = [prompt_of(61, 11), prompt_of(30, 12), prompt_of(5, 13)]
    for paged in (False, True):
        served = Served(model, tokenizer, paged=paged, max_batch_tokens=40)
        try:
            async def play():
                batch = await asyncio.gather(*(served.run(p, 12) for p in prompts))
                first, _ = await served.run(prompts[1], 12, "s")
                turn2 = prompts[1] + first + prompt_of(20, 14)
                return batch, turn2, await served.run(turn2, 12, "s")

            batch, turn2, (got2, final2) = asyncio.run(play())
        finally:
            served.stop()
        assert served.engine.runner.paths["temperature"] == "by position"
        for prompt, (got, _) in zip(prompts, batch):
            assert_equivalent(model, prompt, got, generate(model, prompt, 12))
        assert final2.cached_tokens == 30 + 12 - 1
        assert_equivalent(model, turn2, got2, generate(model, turn2, 12))
    plain = llama4()
    for module in temperature.modules(plain):  # a forward of its own already: `enable` leaves it
        module.forward = functools.partial(type(module).forward, module)
    with pytest.raises(families.UnsupportedModel) as refused:
        families.check(plain)
    assert refused.value.feature == "forward-mismatch"


# -- attention sinks -------------------------------------------------------------------------------


def test_sinks_join_the_softmax_denominator_as_gpt_oss_does():
    """`_attend` with sinks against gpt-oss's eager formula (float64), GQA folded as the engine
    folds it: a KV head's query heads side by side."""
    torch.manual_seed(0)
    kv_heads, groups, t, length, d = 2, 3, 5, 9, 8
    q, k, v = torch.randn(1, kv_heads * groups, t, d), torch.randn(1, kv_heads, length, d), torch.randn(1, kv_heads, length, d)
    sinks = torch.randn(kv_heads * groups)
    allowed = attention._causal(length - t, t, torch.arange(length), None)
    mask = context.additive(allowed, torch.float32)
    got = attention._attend(q.reshape(1, kv_heads, groups * t, d), k, v, mask.repeat(groups, 1), 0.5, None,
                            attention._sink_rows(sinks.view(kv_heads, groups, 1), t))
    scores = torch.einsum("bhtd,bhld->bhtl", q.double(), k.double().repeat_interleave(groups, 1)) * 0.5 + mask.double()
    combined = torch.cat([scores, sinks.double().view(1, -1, 1, 1).expand(1, -1, t, 1)], dim=-1)
    want = torch.einsum("bhtl,bhld->bhtd", F.softmax(combined, dim=-1)[..., :-1], v.double().repeat_interleave(groups, 1))
    assert torch.allclose(got.view(1, kv_heads * groups, t, d).double(), want, atol=1e-5)


# -- MLA: keys and values of their own widths ------------------------------------------------------


def test_mla_keys_and_values_keep_their_own_widths_in_the_pool_the_budget_and_the_files(tmp_path):
    """--mla-cache heads: transformers' decompressed keys and values (the latent's own tests:
    tests/server/test_mla.py)."""
    model = mla()
    configure_mla(model, "heads")
    layout = kv.layout(model.config)
    assert (layout.kv_heads, layout.key_dim, layout.value_dim) == (4, 24, 12)
    itemsize = torch.empty((), dtype=DTYPE).element_size()
    assert layout.bytes_per_token(DTYPE) == 2 * 4 * (24 + 12) * itemsize  # 2 layers, 4 heads, keys 24 + values 12
    assert layout.bytes_per_token(torch.bfloat16, "fp8") == 2 * 4 * (24 + 2 + 12 + 2)  # a byte a value, a bf16 scale a vector
    families.check(model)
    cache = kv.allocate(model.config, 64, torch.device("cpu"), torch.float32)
    for t in cache.pool.keys + cache.pool.values:
        t.normal_()
    cache.length = 20
    assert cache.pool.keys[0].shape[-1] == 24 and cache.pool.values[0].shape[-1] == 12
    name = disk.file_name(disk.hash_principal("p"), "s")
    header = disk.Header("fp", disk.hash_principal("p"), "s", 20)
    disk.write(tmp_path, name, header, list(range(20)), kv.export(cache))
    tokens, tensors = disk.read(tmp_path / name, header)
    pool = kv.Pool(model.config, kv.bytes_for(model.config, 64, torch.float32), torch.device("cpu"), torch.float32)
    back = kv.load(pool, tensors, 20, 64)
    for a, b in zip(kv.export(cache).values(), kv.export(back).values()):
        assert torch.equal(a, b)
    other = kv.Pool(tiny().config, 2**20, torch.device("cpu"), torch.float32)  # equal widths: the file does not fit
    with pytest.raises(ValueError):
        kv.load(other, tensors, 20, 64)


# -- KV shared across layers (Gemma 3n) ------------------------------------------------------------


def test_layers_sharing_kv_read_their_source_and_the_pool_stores_it_once(tokenizer):
    model = tiny("gemma3n_text", num_hidden_layers=4, num_kv_shared_layers=2, head_dim=16, sliding_window=20,
                 layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=16,
                 vocab_size_per_layer_input=1000, intermediate_size=[128] * 4, activation_sparsity_pattern=[0.0] * 4,
                 laurel_rank=8, altup_num_inputs=4)
    layout = kv.layout(model.config)
    assert layout.sources == (0, 1, 0, 1) and layout.owners == (0, 1) and layout.windows == (20, None, 20, None)
    plain = kv.Layout(layout.windows, layout.kv_heads, layout.key_dim, layout.value_dim)
    assert 2 * layout.bytes_per_token(DTYPE) == plain.bytes_per_token(DTYPE)
    cache = kv.allocate(model.config, 64, DEVICE, DTYPE)
    assert cache.pool.keys[2] is cache.pool.keys[0] and cache.pool.values[3] is cache.pool.values[1]
    cache.length = 5
    assert set(kv.export(cache)) == {"k.0", "k.1", "v.0", "v.1"}
    prompt = prompt_of(30)
    want = generate(model, prompt, 12)
    served = Served(model, tokenizer)
    try:
        got, _ = asyncio.run(served.run(prompt, 12))
    finally:
        served.stop()
    assert_equivalent(model, prompt, got, want)


# -- LongRoPE: factors per sequence, a recompute where generate recomputes ------------------------


def test_longrope_rows_of_a_packed_step_take_their_own_factors(tokenizer):
    """Three sequences decoded together, one above the switch from its prompt, one crossing
    it while the others decode, one staying below: each gives generate's tokens, on the row
    and the paged path."""
    model = longrope()
    prompts = [prompt_of(40, 1), prompt_of(26, 2), prompt_of(9, 3)]
    wants = [generate(model, p, 14) for p in prompts]
    for paged in (False, True):
        served = Served(model, tokenizer, paged=paged)
        try:
            async def all_at_once():
                return await asyncio.gather(*(served.run(p, 14) for p in prompts))

            results = asyncio.run(all_at_once())
        finally:
            served.stop()
        for prompt, want, (got, final) in zip(prompts, wants, results):
            assert_equivalent(model, prompt, got, want)
        # the crossing sequence was recomputed, the others were not
        assert [final.miss_reason == "rope_switch" for _, final in results] == [False, True, False]


def test_a_session_crossing_the_switch_is_recomputed_and_says_so(tokenizer):
    model = longrope()
    served = Served(model, tokenizer)
    try:
        async def play():
            first, _ = await served.run(prompt_of(12), 6, "s")
            second_prompt = prompt_of(12) + first + [5, 6, 7]  # 21 tokens: below the switch
            second, below = await served.run(second_prompt, 4, "s")
            third_prompt = second_prompt + second + [8, 9, 10, 11, 12, 13, 14, 15]  # 36: past it
            third, past = await served.run(third_prompt, 4, "s")
            fourth_prompt = third_prompt + third + [16]  # long keys, extended: reused
            fourth, again = await served.run(fourth_prompt, 4, "s")
            return [(second_prompt, second, below), (third_prompt, third, past), (fourth_prompt, fourth, again)]

        turns = asyncio.run(play())
    finally:
        served.stop()
    (_, _, below), (_, _, past), (_, _, again) = turns
    assert below.cached_tokens == 17 and below.miss_reason is None
    assert past.cached_tokens == 0 and past.miss_reason == "rope_switch"
    assert again.cached_tokens > SWITCH and again.miss_reason is None
    for prompt, got, _ in turns:
        assert_equivalent(model, prompt, got, generate(model, prompt, 4))


def test_prompt_lookup_drafts_stop_short_of_the_switch(tokenizer):
    """A repetitive prompt that prompt lookup drafts from, crossing the switch while drafting:
    generate's tokens, and no draft was written across the switch."""
    model = longrope()
    prompt = (prompt_of(6) * 4)[:24]
    want = generate(model, prompt, 20)
    served = Served(model, tokenizer, proposer=NgramProposer(1, 3))
    try:
        got, final = asyncio.run(served.run(prompt, 20))
    finally:
        served.stop()
    assert_equivalent(model, prompt, got, want)
    assert final.finish_reason == "length"
    cache = kv.allocate(model.config, 64, DEVICE, DTYPE)
    cache.length = 28  # positions 28..31 may be drafted and cropped, 32 not (before the recompute)
    assert kv.can_crop_after(cache, 4) and not kv.can_crop_after(cache, 5)
    cache.length = SWITCH + 1  # long keys already: any draft that fits
    assert kv.can_crop_after(cache, 20)


def test_the_server_refuses_an_unsupported_family_at_load_naming_the_feature(tokenizer):
    """build_context checks the family before sizing any cache: the load fails with the
    feature named (in the log and the process state; /ready says the load failed)."""
    from server.startup import create_app
    from server.model_loader import LoadedModel
    from server.settings import Settings
    from tests.device import SETTINGS
    from tests.inprocess import ready_once_loaded

    model = tiny(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    loaded = LoadedModel(model=model, tokenizer=tokenizer, model_id="tiny-dynamic-rope", device=DEVICE, dtype=DTYPE, max_context=2048)
    app = create_app(Settings(**SETTINGS), loaded=loaded)
    ready = asyncio.run(ready_once_loaded(app))
    assert "[dynamic-rope]" in app.state.kv.load_error and "dynamic NTK" in app.state.kv.load_error
    assert ready.status_code == 503 and "failed to load" in ready.json()["error"]["message"]
