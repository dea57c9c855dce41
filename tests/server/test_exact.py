"""Exact mode (`--deterministic`, server/engine/exact.py) on the real model, in the suite's dtype
(and, with an fp8 KV cache, in float32 AND bfloat16) on the test device: every request's tokens
and logprobs are bit-identical to the same request run alone, whatever runs beside it, whatever
the prefill chunk size (16, 128, 512), reused from its session or restored from the disk tier,
with prompt lookup or a draft model on or off, with an fp8 KV cache, greedy and seeded sampling
alike. Nothing here allows a near-tie: identical or failed.

Plus the building blocks: tiny random models (a sliding window, soft-capping, MHA) give every
position the same logits however its prompt is split, on both attention paths; `exact.attend`
(the paged path's) and the exact linear layers give a row the same bits whatever else is
computed with it.
"""

from __future__ import annotations

import asyncio
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig

from cache_manager import kv
from cache_manager.manager import CacheConfig, CacheManager
from cache_manager.tiers import DiskTier
from server.engine import context, cpu_linear, exact
from server.engine.attention import Row
from server.engine.model_runner import ModelRunner
from server.engine.draft_model import DraftModelProposer
from server.engine.core import Engine, EngineConfig
from server.startup import numerics
from server.metrics import Metrics
from server.settings import Settings
from server.model_loader import load_model
from server.engine.prompt_lookup import NgramProposer
from server.engine.sampling import SamplingParams, filtered_probs, softmax_rows
from server.engine.sequence import GenerationRequest
from server.engine.speculative import SpeculativeConfig
from tests.conftest import test_cache_dir as cache_dir
from tests.device import DEVICE, DTYPE_NAME, SETTINGS
from tests.engines import stopped_after

DTYPES = ["float32", "bfloat16"]
MAX_CONTEXT = 2048
TOPICS = ["the sea", "a lighthouse", "bread", "rain", "trains", "chess", "the moon", "coffee", "winter", "owls"]
LONG_DOC = " ".join(f"Note {i}: the harbor ledger lists {i * 7 % 13} crates of copper." for i in range(40))
CODE = "def cheapest(items):\n    best = None\n    for item in items:\n        if best is None or item.price < best.price:\n            best = item\n    return best\n"
COPY_PROMPTS = [
    "Rename cheapest to lowest in this code and reply with the code only:\n" + CODE,
    "Repeat this list exactly: apples, pears, plums, cherries, apricots, peaches, figs.",
    "Copy this sentence twice: the harbor ledger lists seven crates of copper.",
]


@functools.cache
def model_in(dtype: str):
    return load_model(None, cache_dir=cache_dir(), device=str(DEVICE), dtype=dtype)


@pytest.fixture(params=DTYPES)
def loaded(request):
    return model_in(request.param)


# NOTE: the mechanisms of the tests marked so (chunk sizes, the paged path, session turns,
# speculation, tier restores) keep the bits because the batch-invariant layers do, which the
# fp8-KV engine test checks end to end in both dtypes (requests together in chunks of 16, with
# sessions, vs each alone), as do the unit tests further down, layer by layer; their engine runs
# take the suite's dtype only, since bfloat16 on a CPU without bf16 instructions costs ~2.5x
# (~10 of CI's minutes). The GPU suite (KVSERVE_TEST_DTYPE=bfloat16) runs them in bf16.
suite_dtype_only = pytest.mark.parametrize("loaded", [DTYPE_NAME], indirect=True)


class Exact:
    """One engine in exact mode over `loaded`'s model; runs requests and records what each
    token carried (id, logprob, top logprobs)."""

    def __init__(self, loaded, model=None, proposer=None, tiers=None, budget=2**31, kv_dtype="auto", **engine_kw):
        self.model, self.tokenizer = model or loaded.model, loaded.tokenizer
        self.metrics = Metrics()
        cache_config = CacheConfig(budget_bytes=budget, kv_dtype=kv_dtype)
        self.cache = CacheManager(self.model.config, loaded.device, loaded.dtype, MAX_CONTEXT, cache_config, self.metrics, **(tiers or {}))
        config = EngineConfig(max_context=MAX_CONTEXT, exact=True, speculative=SpeculativeConfig(max_draft=6, adaptive=False), **engine_kw)
        self.engine = Engine(self.model, self.tokenizer, config, self.cache, metrics=self.metrics, proposer=proposer)
        self.engine.start()

    def prompt(self, text, system=None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]

    async def run(self, request):
        """[(token id, logprob, top logprobs)], the final output."""
        got, final = [], None
        async for out in self.engine.submit(request, asyncio.get_running_loop()):
            got += [(t.token_id, t.logprob, tuple(t.top)) for t in out.tokens]
            final = out
        assert final.finish_reason in ("stop", "length"), (request.request_id, final)
        return got, final

    def counter(self, name):
        return self.metrics.registry.get_sample_value(name) or 0.0

    def stop(self):
        self.engine.stop()


@pytest.fixture
def engines():
    yield from stopped_after(Exact)


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, logprobs=True, top_logprobs=3)


def seeded(n, seed):
    return SamplingParams(max_tokens=n, temperature=0.9, top_p=0.9, top_k=40, seed=seed, logprobs=True, top_logprobs=2)


def alone(request, suffix="alone"):
    """The same request in a private cache, never drafting: the reference."""
    return GenerationRequest(f"{request.request_id}-{suffix}", request.prompt_ids, request.params, principal=request.principal, use_session=False, speculative=False)


def mixed(e: Exact) -> list[GenerationRequest]:
    """18 requests: greedy ones of 3..24 tokens, a long prompt that prefills in chunks beside
    decoding rows, seeded samples, session second turns (reusing a first turn) and n = 2."""
    reqs = [GenerationRequest(f"plain-{i}", e.prompt(f"Write two sentences about {t}."), greedy(3 + 3 * i)) for i, t in enumerate(TOPICS[:8])]
    reqs.append(GenerationRequest("long", e.prompt("What does note 17 list?", system=LONG_DOC), greedy(10)))
    reqs += [GenerationRequest(f"seeded-{i}", e.prompt(f"Invent a word about {TOPICS[i]}."), seeded(10, 1000 + i)) for i in range(3)]
    reqs += [GenerationRequest(f"turn2-{i}", e.prompt(f"And {TOPICS[i]} at night?", system=f"Session {i}."), greedy(8 + i), session_id=f"s{i}") for i in range(3)]
    reqs += [GenerationRequest(f"copy-{i}", e.prompt(p), greedy(16)) for i, p in enumerate(COPY_PROMPTS[1:])]
    reqs += [GenerationRequest(f"n2-{j}", e.prompt("Name a color."), greedy(6), use_session=j == 0) for j in range(2)]
    return reqs


def compare(requests, got, want) -> int:
    """How many of `got` equal `want` bit for bit (tokens, logprobs, top logprobs); asserts all."""
    identical = [g[0] == w[0] for g, w in zip(got, want)]
    for r, g, w, same in zip(requests, got, want, identical):
        assert same, f"{r.request_id}: {g[0]} != {w[0]}"
    return sum(identical)


@suite_dtype_only
def test_together_equals_alone_at_every_chunk_size(loaded, engines):
    """18 mixed requests at once (decode rows beside prefill chunks, sessions reusing their
    first turn) on engines whose steps carry 16, 128 and 512 tokens, against each request
    alone (its prompt in one pass, a fresh prefill): 100% bit-identical."""
    reference = engines(loaded)

    async def go():
        runs = {}
        for budget in (16, 128, 512):
            e = engines(loaded, max_batch_tokens=budget)
            for i in range(3):
                await e.run(GenerationRequest(f"turn1-{i}", e.prompt(f"Tell me about {TOPICS[i]}.", system=f"Session {i}."), greedy(4), session_id=f"s{i}"))
            reqs = mixed(e)
            runs[budget] = (reqs, await asyncio.gather(*(e.run(r) for r in reqs)))
        reqs = runs[16][0]
        want = [await reference.run(alone(r)) for r in reqs]
        return reqs, runs, want

    reqs, runs, want = asyncio.run(go())
    assert len(reqs) >= 16
    for budget, (_, got) in runs.items():
        n = compare(reqs, got, want)
        print(f"\n{loaded.dtype} chunk {budget}: together vs alone {n}/{len(reqs)} bit-identical")
        finals = {r.request_id: f for r, (_, f) in zip(reqs, got)}
        assert all(finals[f"turn2-{i}"].cached_tokens > 0 for i in range(3))  # reuse under batching


def test_an_fp8_kv_cache_keeps_the_bits(loaded, engines):
    """`--kv-cache-dtype fp8` (a big model's setting on one GPU): a token's stored bytes depend
    on its own values only, and every read dequantizes them alike, so requests together in
    chunks of 16 (sessions reusing their first turn among them) equal each alone, bit for bit."""
    e = engines(loaded, kv_dtype="fp8", max_batch_tokens=16)
    reference = engines(loaded, kv_dtype="fp8")

    async def go():
        for i in range(3):
            await e.run(GenerationRequest(f"turn1-{i}", e.prompt(f"Tell me about {TOPICS[i]}.", system=f"Session {i}."), greedy(4), session_id=f"s{i}"))
        reqs = mixed(e)[8:]
        got = await asyncio.gather(*(e.run(r) for r in reqs))
        return reqs, got, [await reference.run(alone(r)) for r in reqs]

    reqs, got, want = asyncio.run(go())
    n = compare(reqs, got, want)
    print(f"\n{loaded.dtype} fp8 KV together vs alone: {n}/{len(reqs)} bit-identical")
    assert any(f.cached_tokens > 0 for _, f in got)  # a session's reuse among them


@suite_dtype_only
def test_the_paged_path_is_batch_invariant_too(loaded, engines):
    """The attention path CUDA takes (decode rows bucket-padded from the persistent buffers,
    multi-token rows in padded batches: `exact.attend`, the torch formulation on CPU),
    run eagerly here: requests together in chunks of 64 vs each alone on the same path, chunked
    at the default size: bit-identical."""
    e = engines(loaded, paged=True, max_batch_tokens=64)
    reference = engines(loaded, paged=True)

    async def go():
        reqs = [r for r in mixed(e) if not r.request_id.startswith("turn2")][:10]
        got = await asyncio.gather(*(e.run(r) for r in reqs))
        return reqs, got, [await reference.run(alone(r)) for r in reqs]

    reqs, got, want = asyncio.run(go())
    n = compare(reqs, got, want)
    print(f"\n{loaded.dtype} paged path together vs alone: {n}/{len(reqs)} bit-identical")


@suite_dtype_only
def test_session_turns_equal_fresh_prefills(loaded, engines):
    """Three turns of two interleaved sessions, the third editing history (a crop): each turn
    equals a fresh prefill of its prompt, bit for bit."""
    e = engines(loaded)

    async def go():
        convs = {sid: [{"role": "system", "content": f"You are assistant {k}. {LONG_DOC[: 300 * k]}"}] for k, sid in ((1, "a"), (2, "b"))}
        pairs = []
        for turn in range(3):
            for sid, messages in convs.items():
                if turn == 2:
                    messages[:] = messages[:2]  # edit: drop the first reply
                messages.append({"role": "user", "content": f"Question {turn} about {TOPICS[turn]}?"})
                text = e.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                r = GenerationRequest(f"{sid}-{turn}", e.tokenizer(text, add_special_tokens=False)["input_ids"], greedy(6), session_id=sid)
                got, want = await e.run(r), await e.run(alone(r))
                if turn == 1:
                    assert got[1].cached_tokens > 0
                pairs.append((r, got, want))
                messages.append({"role": "assistant", "content": e.tokenizer.decode([t for t, _, _ in got[0]], skip_special_tokens=True)})
        return pairs

    pairs = asyncio.run(go())
    n = compare([p[0] for p in pairs], [p[1] for p in pairs], [p[2] for p in pairs])
    print(f"\n{loaded.dtype} session turns vs fresh prefill: {n}/{len(pairs)} bit-identical")


def tiny_llama(seed, dtype):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=MAX_CONTEXT, eos_token_id=2), dtype=dtype).to(DEVICE).eval()


@suite_dtype_only
@pytest.mark.parametrize("source", ["ngram", "self", "tiny"])
def test_speculation_on_equals_off(loaded, engines, source):
    """Prompt lookup, SmolLM2 drafting for itself (every draft accepted) and a tiny random draft
    model (nearly every draft rejected and cropped), greedy and seeded, with sessions: every
    output equals the request run alone without speculation, bit for bit."""
    if source == "ngram":
        proposer = NgramProposer()
    else:
        draft = loaded.model if source == "self" else tiny_llama(0, loaded.dtype)
        proposer = DraftModelProposer(draft, MAX_CONTEXT, budget_bytes=2**28, exact=True)
    e = engines(loaded, proposer=proposer)
    reference = engines(loaded)

    async def go():
        first = [GenerationRequest(f"c{i}", e.prompt(p), greedy(20), session_id=f"c{i}") for i, p in enumerate(COPY_PROMPTS)]
        first += [GenerationRequest(f"s{i}", e.prompt(p), seeded(14, 7 + i)) for i, p in enumerate(COPY_PROMPTS[1:])]
        got = await asyncio.gather(*(e.run(r) for r in first))
        more = e.tokenizer("<|im_end|>\n<|im_start|>user\nOnce more, please.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        second = [GenerationRequest(f"c{i}-2", r.prompt_ids + [t for t, _, _ in g[0]] + more, greedy(12), session_id=f"c{i}") for i, (r, g) in enumerate(zip(first, got))]
        got += await asyncio.gather(*(e.run(r) for r in second))
        reqs = first + second
        want = [await reference.run(alone(r)) for r in reqs]
        return reqs, got, want

    reqs, got, want = asyncio.run(go())
    n = compare(reqs, got, want)
    drafted = e.counter("kvserve_spec_decode_draft_tokens_total")
    print(f"\n{loaded.dtype} speculation ({source}) on vs off: {n}/{len(reqs)} bit-identical, {drafted:.0f} drafted")
    assert drafted > 10


@suite_dtype_only
def test_a_restored_session_equals_a_fresh_prefill(loaded, engines, tmp_path):
    """Two sessions in a budget that holds one running request: each turn evicts the other
    session to the disk tier, the next restores it; and a new engine over the same directory
    (a restart) restores both. Every turn equals a fresh prefill, bit for bit."""
    metrics = Metrics()
    # prompts of ~110-180 tokens: a running request reserves room for 190 at most, and with
    # the other session's idle KV (>= 7 blocks of 16) it never fits
    budget = kv.bytes_for(loaded.model.config, 190, loaded.dtype)

    def tier():
        return DiskTier(tmp_path, 2**31, 1800.0, "exact-test", metrics)

    e = engines(loaded, tiers={"disk": tier()}, budget=budget)
    reference = engines(loaded)
    convs = {sid: [{"role": "system", "content": f"Assistant {sid}. {LONG_DOC[:320]}"}] for sid in "ab"}

    async def turn(engine, sid, question):
        messages = convs[sid]
        messages.append({"role": "user", "content": question})
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        r = GenerationRequest(f"{sid}-{len(messages)}", engine.tokenizer(text, add_special_tokens=False)["input_ids"], greedy(5), session_id=sid)
        got, want = await engine.run(r), await reference.run(alone(r))
        messages.append({"role": "assistant", "content": engine.tokenizer.decode([t for t, _, _ in got[0]], skip_special_tokens=True)})
        return r, got, want

    async def go(engine, turns):
        return [await turn(engine, sid, f"Question {k} for {sid}?") for k in range(turns) for sid in "ab"]

    played = asyncio.run(go(e, 2))
    restored = [p for p in played[2:] if p[1][1].miss_reason == "restored_disk"]
    assert len(restored) == 2, [(len(p[0].prompt_ids), p[1][1].miss_reason) for p in played]
    e.stop()
    e.cache.close()
    again = engines(loaded, tiers={"disk": tier()}, budget=budget)
    after = asyncio.run(go(again, 1))
    assert any(p[1][1].miss_reason == "restored_disk" for p in after)
    played += after
    n = compare([p[0] for p in played], [p[1] for p in played], [p[2] for p in played])
    print(f"\n{loaded.dtype} restored sessions vs fresh prefill: {n}/{len(played)} bit-identical ({len(restored)} restored, then a restart)")


# -- the building blocks on random tensors -------------------------------------------------------


@pytest.fixture
def torch_formulation(monkeypatch):
    """`exact.attend` as its torch formulation on every device (on CUDA, the server's fallback
    where the Triton kernel is unusable)."""
    monkeypatch.setattr(exact, "KERNELS", {})


@functools.cache
def checked_kernel():
    """server/engine/exact_kernel.py once `exact.use_kernel` has compiled and checked its
    kernels on the test device (as the server does at start-up; on CPU Triton's
    interpreter runs it: TRITON_INTERPRET, tests/conftest.py)."""
    saved = dict(exact.KERNELS)
    exact.KERNELS.pop(DEVICE.type, None)
    try:
        assert exact.use_kernel(DEVICE, torch.float32)
        return exact.KERNELS[DEVICE.type]
    finally:
        exact.KERNELS.clear()
        exact.KERNELS.update(saved)


@pytest.fixture
def kernel(monkeypatch):
    """`exact.attend` as the Triton kernel on the test device, for this test. Returns
    server/engine/exact_kernel.py."""
    pytest.importorskip("triton")
    monkeypatch.setattr(exact, "KERNELS", {DEVICE.type: checked_kernel()})
    return exact.KERNELS[DEVICE.type]


# NOTE: Triton 3.9's interpreter multiplies bfloat16 as raw 16-bit integers in tl.dot, so on
# CPU the kernel runs in float32 and float16 (the same code path as bfloat16); a GPU runs all.
KERNEL_DTYPES = ["float32", "float16"] if DEVICE.type == "cpu" else ["float32", "bfloat16", "float16"]


def numpy_rows_invariant() -> bool:
    """Whether numpy's float32 matmul gives a row the same bits whatever rows stand beside it.
    Triton's interpreter computes `tl.dot` with numpy, so on CPU the kernel's bits are numpy's
    BLAS's: where that rounds a row by its neighbours (OpenBLAS's AVX2 kernels on a CPU without
    AVX-512, measured), a bit-invariance test of the interpreted kernel tests numpy, not the
    kernel, and is skipped; a GPU runs the compiled kernel and always checks."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 32), dtype=np.float32)
    x = rng.standard_normal((64, 96), dtype=np.float32)
    mixed = x @ w
    return all(np.array_equal(np.repeat(x[i : i + 1], 64, 0) @ w, np.broadcast_to(mixed[i], (64, 32))) for i in (0, 35, 63))


INTERPRETED_BITS = pytest.mark.skipif(DEVICE.type == "cpu" and not numpy_rows_invariant(),
                                      reason="Triton's interpreter multiplies with numpy, whose BLAS here rounds a row by its neighbours")


# NOTE: on CUDA the torch formulation is the fallback where the Triton kernel is unusable, and
# its batch invariance there is not promised (docs/guides/exact-mode.md: cuBLAS picks its kernels by shape): these
# two tests then measure it rather than gate it.
FALLBACK_MEASURED = pytest.mark.xfail(DEVICE.type == "cuda", reason="the torch fallback's invariance on a GPU is measured, not promised", strict=False)


SINKS = pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])


def folded_sinks(sinks, heads, count):
    """Sinks per query head [heads * groups] (gpt-oss's `sinks`) as `exact.attend` takes them
    for a KV head's queries folded [groups * count]: row r of KV head h is query head
    h * groups + r // count. [1, heads, groups * count, 1]; None stays None."""
    if sinks is None:
        return None
    return sinks.view(heads, -1, 1).expand(-1, -1, count).reshape(1, heads, -1, 1)


def some_sinks(heads, groups, on):
    """Sink logits for heads * groups query heads (None unless `on`), large enough to weigh."""
    return torch.randn(heads * groups, device=DEVICE) * 2 + 1 if on else None


@FALLBACK_MEASURED
@SINKS
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_of_a_query_ignores_other_queries_and_keys_past_it(dtype, sinks, torch_formulation):
    """A query at position p: alone (keys 0..p) and inside chunks of 16, 128 and 512 queries
    reading keys to the chunk's end (and a block further): the same bits; with attention sinks
    too."""
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    heads, groups, dim, n = 3, 3, 64, 1024
    q = torch.randn(1, heads, groups, n, dim, device=DEVICE).to(dt)
    k = torch.randn(1, heads, n + exact.KV_BLOCK, dim, device=DEVICE).to(dt)
    v = torch.randn(1, heads, n + exact.KV_BLOCK, dim, device=DEVICE).to(dt)
    head_sinks = some_sinks(heads, groups, sinks)

    def attend(start, count, extra=0):
        length = start + count + extra
        mask = torch.arange(length, device=DEVICE)[None, :] <= torch.arange(start, start + count, device=DEVICE)[:, None]
        additive = torch.zeros(mask.shape, device=DEVICE, dtype=dt).masked_fill(~mask, float("-inf")).repeat(groups, 1)
        folded = q[:, :, :, start : start + count].reshape(1, heads, groups * count, dim)
        sinks = folded_sinks(head_sinks, heads, count)
        return exact.attend(folded, k[:, :, :length], v[:, :, :length], additive, dim**-0.5, None, sinks=sinks).view(1, heads, groups, count, dim)

    checked = 0
    for p in (0, 5, 63, 64, 200, 511, 700, 1000):
        single = attend(p, 1)[..., 0, :]
        for chunk in (16, 128, 512):
            start = p // chunk * chunk
            count = min(chunk, n - start)
            for extra in (0, exact.KV_BLOCK):
                assert torch.equal(attend(start, count, extra)[..., p - start, :], single), (p, chunk, extra)
                checked += 1
    assert checked == 48


@FALLBACK_MEASURED
@SINKS
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_of_a_row_ignores_the_rows_batched_with_it(dtype, sinks, torch_formulation):
    """`exact.attend` as the paged path calls it: a row's queries (1 or 8 positions, 3 query
    heads per KV head) alone, reading its own keys, and inside batches of 2-64 rows of other
    lengths reading the longest one's: the same bits; with attention sinks too. On CUDA this
    asks whether cuBLAS's batched matmuls change kernels with the batch (the reason for the
    Triton kernel)."""
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    heads, groups, dim = 3, 3, 64
    lengths = [int(x) for x in torch.randint(1, 1000, (64,))]
    keys = torch.randn(64, heads, exact.aligned(1000), dim, device=DEVICE).to(dt)
    values = torch.randn(64, heads, exact.aligned(1000), dim, device=DEVICE).to(dt)
    head_sinks = some_sinks(heads, groups, sinks)

    def attend(rows, width, length):
        """Rows `rows`, `width` queries each (the last at position lengths[i] - 1), keys read to `length`."""
        q = torch.stack([torch.randn(heads, groups * width, dim, generator=torch.Generator().manual_seed(i)) for i in rows]).to(DEVICE, dt)
        positions = torch.tensor([[lengths[i] - width + t for t in range(width)] for i in rows], device=DEVICE).clamp(min=0)
        allowed = torch.arange(length, device=DEVICE)[None, None, :] <= positions[:, :, None]  # [B, width, L]
        mask = torch.zeros(allowed.shape, device=DEVICE).masked_fill(~allowed, float("-inf")).repeat(1, groups, 1)[:, None]
        return exact.attend(q, keys[rows, :, :length], values[rows, :, :length], mask, dim**-0.5, None, sinks=folded_sinks(head_sinks, heads, width))

    checked = 0
    for width in (1, 8):
        alone = [attend([i], width, lengths[i]) for i in range(64)]
        for size in (2, 5, 16, 64):
            rows = list(range(64 - size, 64))
            together = attend(rows, width, max(lengths[i] for i in rows))
            for j, i in enumerate(rows):
                assert torch.equal(together[j], alone[i][0]), (width, size, i)
                checked += 1
    assert checked == 2 * (2 + 5 + 16 + 64)


def reference_attention(q, keys, values, mask, scale, softcap, sinks=None):
    """Attention in float64, the textbook formula; `sinks` [.., M, 1]: a logit per query
    row that joins the softmax and is dropped from its weights (gpt-oss's)."""
    scores = q.double() @ keys.double().transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask.double()
    if sinks is None:
        return torch.softmax(scores, -1) @ values.double()
    logits = torch.cat([scores, sinks.double().expand(*scores.shape[:-1], 1)], -1)
    return torch.softmax(logits, -1)[..., :-1] @ values.double()


def window_mask(positions, length, window=None, dtype=torch.float32):
    """Additive mask [B, 1, M, L]: a query at position p sees keys <= p (and > p - window; a
    negative window: chunked, keys of p's chunk of -window positions)."""
    keys = torch.arange(length, device=positions.device)[None, None, :]
    queries = positions[:, :, None]
    allowed = keys <= queries
    if window is not None and window > 0:
        allowed &= keys > queries - window
    elif window is not None:
        allowed &= keys // -window == queries // -window
    return torch.zeros(allowed.shape, device=positions.device).masked_fill(~allowed, float("-inf"))[:, None].to(dtype)


@pytest.mark.parametrize("softcap", [None, 50.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_the_kernel_computes_attention(kernel, dtype, softcap):
    """The Triton kernel against float64 attention: 3 rows, 2 KV heads of 3 query heads, a
    head size that is not a power of two, key counts off its block size, a window."""
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    b, heads, groups, width, dim, length = 3, 2, 3, 7, 24, 150
    q = torch.randn(b, heads, groups * width, dim, device=DEVICE).to(dt)
    keys, values = (torch.randn(b, heads, length, dim, device=DEVICE).to(dt) for _ in range(2))
    last = torch.tensor([40, 149, 6], device=DEVICE)
    positions = (last[:, None] - torch.arange(width, device=DEVICE).flip(0)[None, :]).clamp(min=0).repeat(1, groups)
    for window in (None, 30, -32):
        mask = window_mask(positions, length, window, dt)
        want = reference_attention(q, keys, values, mask, dim**-0.5, softcap)
        for bounds in ({}, dict(positions=positions[:, :width], window=window)):
            got = kernel.attend(q, keys, values, mask, dim**-0.5, softcap, **bounds)
            tolerance = 1e-5 if dt == torch.float32 else 4e-3
            assert got.dtype == dt and torch.allclose(got.double(), want, atol=tolerance, rtol=tolerance), (window, bounds, (got.double() - want).abs().max())


def gpt_oss_attention(q, keys, values, mask, scale, sinks):
    """transformers' gpt_oss `eager_attention_forward` (the semantics of attention sinks) in
    float64: q [B, Hq, T, D], keys/values [B, Hkv, L, D], mask [B, 1, T, L], sinks [Hq].
    Returns [B, Hq, T, D]."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = torch.nn.Module().eval()
    module.sinks, module.num_key_value_groups = sinks.double(), q.shape[1] // keys.shape[1]
    out, _ = eager_attention_forward(module, q.double(), keys.double(), values.double(), mask.double(), scale)
    return out.transpose(1, 2)


SINK_PATHS = [("torch", d) for d in DTYPES] + [("kernel", d) for d in KERNEL_DTYPES]


@pytest.mark.parametrize("softcap", [None, 50.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("path,dtype", SINK_PATHS, ids=[f"{p}-{d}" for p, d in SINK_PATHS])
def test_sinks_join_the_softmax_denominator(path, dtype, softcap, request):
    """Attention sinks (gpt-oss's: a logit per query head in the softmax's denominator, with
    no value) in `exact.attend`, by the torch formulation and the Triton kernel (its chunks
    walked and spread, told the positions): float64 attention over [scores, sink] with the
    sink's weight dropped, which is transformers' gpt_oss `eager_attention_forward` on the
    unfolded heads. 3 rows of other lengths, 2 KV heads of 3 query heads of 7 positions folded
    into each, a head size that is not a power of two, two chunks of keys, a window,
    soft-capping (the sink not capped); sinks that weigh (the result is not the sink-less
    one); sinks given for the padded query rows too (`exact.query_rows`) change nothing."""
    request.getfixturevalue("torch_formulation" if path == "torch" else "kernel")
    from server.engine import exact_kernel

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    b, heads, groups, width, dim, length = 3, 2, 3, 7, 24, exact_kernel.CHUNK + 88
    q = torch.randn(b, heads * groups, width, dim, device=DEVICE).to(dt)  # transformers' layout
    keys, values = (torch.randn(b, heads, length, dim, device=DEVICE).to(dt) for _ in range(2))
    head_sinks = some_sinks(heads, groups, True)
    folded, sinks = q.reshape(b, heads, groups * width, dim), folded_sinks(head_sinks, heads, width)
    padding = exact.query_rows(groups * width) - groups * width
    padded_sinks = F.pad(sinks, (0, 0, 0, padding), value=7.0)
    positions = (torch.tensor([40, length - 1, 530], device=DEVICE)[:, None] - torch.arange(width, device=DEVICE).flip(0)).clamp(min=0)
    tolerance = 1e-5 if dt == torch.float32 else 4e-3
    for window in (None, 30, -48):
        mask = window_mask(positions.repeat(1, groups), length, window, dt)
        want = reference_attention(folded, keys, values, mask, dim**-0.5, softcap, sinks)
        if softcap is None:
            hf = gpt_oss_attention(q, keys, values, window_mask(positions, length, window, dt), dim**-0.5, head_sinks)
            assert torch.allclose(hf.reshape(want.shape), want, atol=1e-12, rtol=1e-12)
        unsunk = reference_attention(folded, keys, values, mask, dim**-0.5, softcap)
        assert (want - unsunk).abs().max() > 0.05  # the sinks weigh
        got = exact.attend(folded, keys, values, mask, dim**-0.5, softcap, sinks=sinks)
        assert got.dtype == dt and torch.allclose(got.double(), want, atol=tolerance, rtol=tolerance), (window, (got.double() - want).abs().max())
        assert torch.equal(exact.attend(folded, keys, values, mask, dim**-0.5, softcap, sinks=padded_sinks), got), window
        if path == "kernel":
            for parallel in (False, True):
                bounded = exact_kernel.attend(folded, keys, values, mask, dim**-0.5, softcap, parallel, positions=positions, window=window, sinks=sinks)
                assert torch.equal(bounded, got), (window, parallel)


@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_sinks_of_minus_infinity_weigh_nothing(path, request):
    """Sinks of -inf (weight exp(-inf) = 0) give exactly the bits of no sinks, by the torch
    formulation and the kernel (walked and spread), float32 and a half type: the sink is one
    step added to the sink-less computation, which stays as it was."""
    request.getfixturevalue("torch_formulation" if path == "torch" else "kernel")
    from server.engine import exact_kernel

    torch.manual_seed(0)
    b, heads, m, dim, length = 2, 2, 6, 64, exact_kernel.CHUNK + 40
    positions = torch.tensor([length - 1, 300], device=DEVICE)[:, None] - torch.arange(m, device=DEVICE).flip(0)
    none = torch.full((1, heads, m, 1), float("-inf"), device=DEVICE)
    for dtype in ("float32", "bfloat16" if path == "torch" else "float16"):
        dt = getattr(torch, dtype)
        q = torch.randn(b, heads, m, dim, device=DEVICE).to(dt)
        keys, values = (torch.randn(b, heads, length, dim, device=DEVICE).to(dt) for _ in range(2))
        mask = window_mask(positions, length, None, dt)
        for softcap in (None, 30.0):
            want = exact.attend(q, keys, values, mask, dim**-0.5, softcap)
            assert torch.equal(exact.attend(q, keys, values, mask, dim**-0.5, softcap, sinks=none), want), (dtype, softcap)
            if path == "kernel":
                for parallel in (False, True):
                    got = exact_kernel.attend(q, keys, values, mask, dim**-0.5, softcap, parallel, sinks=none)
                    assert torch.equal(got, exact_kernel.attend(q, keys, values, mask, dim**-0.5, softcap, parallel)), (dtype, softcap, parallel)


# the kernel's invariance with attention sinks: on CPU (the interpreter) in one dtype, as the
# sink is the same float32 step after the merge in every dtype
KERNEL_SINKS = [(d, s) for s in (False, True) for d in KERNEL_DTYPES if not s or DEVICE.type != "cpu" or d == "float32"]


@INTERPRETED_BITS
@pytest.mark.parametrize("dtype,sinks", KERNEL_SINKS, ids=[f"{d}-{'sinks' if s else 'no-sinks'}" for d, s in KERNEL_SINKS])
def test_the_kernel_gives_a_query_the_same_bits_in_any_launch(kernel, dtype, sinks):
    """A query at position p, decoded (alone, reading keys 0..p, its chunks spread over
    programs), inside chunks of 16 and 128 queries reading to the chunk's end or further (its
    chunks walked by one program), and inside a batch of rows of other lengths: the same bits,
    for p on both sides of a chunk boundary and for the batch's other rows; launches that know
    the positions (skipping the blocks a tile cannot see) and launches that do not. With a
    window too; with attention sinks too (their weight joins after the merge, in `_attend`
    when walked and in `_combine` when spread)."""
    from server.engine import exact_kernel

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    heads, groups, dim, n = 2, 2, 64, exact_kernel.CHUNK * 2 + 76
    lengths = [n, 17, exact_kernel.CHUNK + 18, 64, 1, 2 * exact_kernel.CHUNK - 1, 700, 90]
    q = torch.randn(len(lengths), heads, groups, n, dim, device=DEVICE).to(dt)
    keys, values = (torch.randn(len(lengths), heads, n + 70, dim, device=DEVICE).to(dt) for _ in range(2))
    head_sinks = some_sinks(heads, groups, sinks)

    def attend(rows, start, count, length, window, parallel, bounded):
        """Rows `rows`' queries start..start+count-1 (clamped to a row's own length), keys to
        `length`; `bounded`: the launch knows the positions (and skips what a tile cannot see)."""
        positions = torch.tensor([[min(start + t, lengths[r] - 1) for t in range(count)] for r in rows], device=DEVICE)
        folded = torch.stack([q[r, :, :, positions[i]] for i, r in enumerate(rows)]).reshape(len(rows), heads, groups * count, dim)
        mask = window_mask(positions.repeat(1, groups), length, window, dt)
        bounds = dict(positions=positions, window=window) if bounded else {}
        out = exact_kernel.attend(folded, keys[rows, :, :length], values[rows, :, :length], mask, dim**-0.5, None, parallel, **bounds,
                                  sinks=folded_sinks(head_sinks, heads, count))
        return out.view(len(rows), heads, groups, count, dim)

    checked = 0
    for window in (None, 50):
        for p in (0, exact_kernel.CHUNK - 1, exact_kernel.CHUNK, n - 1):
            single = attend([0], p, 1, p + 1, window, True, False)[0, :, :, 0]
            for chunk in (16, 128):
                start = p // chunk * chunk
                count = min(chunk, n - start)
                for extra, bounded in ((0, False), (70, False), (70, True)):
                    got = attend([0], start, count, start + count + extra, window, False, bounded)[0, :, :, p - start]
                    assert torch.equal(got, single), (window, p, chunk, extra, bounded)
                    checked += 1
            together = attend(list(range(len(lengths))), p, 1, n, window, None, p % 2 == 0)
            assert torch.equal(together[0, :, :, 0], single), (window, p)
            for r in range(1, len(lengths)):
                at = min(p, lengths[r] - 1)
                alone = attend([r], at, 1, at + 1 + 70 * (r % 3 == 0), window, r % 2 == 0, r % 3 == 0)
                assert torch.equal(together[r, :, :, 0], alone[0, :, :, 0]), (window, p, r)
            checked += len(lengths)
    assert checked == 2 * 4 * (6 + 8)


@INTERPRETED_BITS
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_the_linear_kernel_gives_a_row_the_same_bits_among_any_rows(kernel, dtype):
    """The Triton linear kernel: F.linear's result (against float64), and a row's bits alone,
    among 2..300 rows and at any place among them; inputs off its step, outputs off its column
    tiles, with a bias and without, and the wide layers' column tiles (`linear_block_n`)."""
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    for inputs, outputs, rows, bias in ((150, 200, 300, True), (150, 200, 300, False), (96, 8200, 70, True)):
        w, b, x = torch.randn(outputs, inputs, device=DEVICE).to(dt), torch.randn(outputs, device=DEVICE).to(dt), torch.randn(rows, inputs, device=DEVICE).to(dt)
        b = b if bias else None
        got = kernel.linear(x[None], w, b)[0]
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        tolerance = 1e-5 if dt == torch.float32 else 4e-3
        assert got.dtype == dt and torch.allclose(got.double(), want, atol=tolerance, rtol=tolerance), (inputs, outputs, (got.double() - want).abs().max())
        single = {i: kernel.linear(x[i : i + 1], w, b)[0] for i in range(0, rows, 37)}
        for m in (2, 3, 65, 130, rows):
            for at in (0, m // 2, m - 1):
                for i in single:
                    if 0 <= i - at and i - at + m <= rows:
                        assert torch.equal(kernel.linear(x[i - at : i - at + m], w, b)[at], single[i]), (outputs, m, at, i)


def test_a_tile_check_tells_place_dependent_products(kernel):
    """`exact.tiles_invariant` passes a product that computes each row alone (the linear
    kernel) and fails one that rounds a row by its place in the tile; `exact.enable` then
    gives a layer the kernel only where its shape fails (never on CPU, whose tiles measured
    invariant)."""
    w = torch.randn(300, 96, device=DEVICE)
    if DEVICE.type != "cpu" or numpy_rows_invariant():  # the interpreter's bits are numpy's (`numpy_rows_invariant`)
        assert exact.tiles_invariant(w, None, product=lambda x, w, b: kernel.linear(x, w, b))
    assert not exact.tiles_invariant(w, None, product=lambda x, w, b: F.linear(x, w, b) + torch.arange(len(x), device=x.device)[:, None] * 1e-3)
    layer = torch.nn.Linear(96, 300).to(DEVICE)
    exact.enable(torch.nn.Sequential(layer))
    assert layer.kvserve_exact_kernel == (DEVICE.type != "cpu" and not exact.tiles_invariant(layer.weight, layer.bias))


TINY = {  # attention shapes SmolLM2 lacks: a window (not a whole number of spans), soft-capping, MHA
    "gemma2-window-softcap": lambda **c: Gemma2Config(head_dim=16, num_attention_heads=6, num_key_value_heads=2, sliding_window=20, **c),
    "llama-mha": lambda **c: LlamaConfig(num_attention_heads=4, num_key_value_heads=4, **c),
}

# CPU: the row path (the server's), the paged path with the torch formulation, and the paged path
# with the Triton attention kernel (interpreted: float32, as the interpreter is slow; the kernel
# tests above cover float16), its linear layers on the CPU's tiles as the server has them (the
# interpreted linear kernel took four fifths of this test's minutes; its own test above holds
# its bits). CUDA: the paged path as the server runs it (the attention kernel; cuBLAS's tiles,
# or the linear kernel where `exact.enable` finds them unfit), and with every linear layer by
# the kernel.
PATHS = [(p, d) for p in ("row", "paged") for d in DTYPES] + [("kernel", "float32")] if DEVICE.type == "cpu" else [(p, d) for p in ("paged", "kernel") for d in DTYPES]


@pytest.mark.parametrize("path,dtype", PATHS)
@pytest.mark.parametrize("kind", list(TINY))
def test_a_position_has_the_same_logits_however_the_prompt_is_split(kind, dtype, path, request):
    """Tiny random models through the model runner in exact mode, on the row path (CPU's
    spans) and the paged path: every position's logits decoded one token at a time, prefilled
    in one chunk, in chunks of 7, split 33 + 1 + 1 + rest, and in chunks of 16 beside another
    sequence's decode rows: the same bits."""
    if path == "kernel":
        if DEVICE.type == "cpu" and not numpy_rows_invariant():
            pytest.skip("Triton's interpreter multiplies with numpy, whose BLAS here rounds a row by its neighbours")
        request.getfixturevalue("kernel")
    torch.manual_seed(0)
    config = TINY[kind](vocab_size=1024, hidden_size=96, intermediate_size=128, num_hidden_layers=3, max_position_embeddings=MAX_CONTEXT)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).to(DEVICE).eval()
    pool = kv.Pool(model.config, 2**24, DEVICE, model.dtype)
    linear_kernel = path == "kernel" and DEVICE.type != "cpu"  # (its weights plain, not packed)
    runner = ModelRunner(model, pool, paged=path != "row", exact=True, cuda_graphs=False, max_rows=4, packed=not linear_kernel)
    runner.prepare()
    if linear_kernel:  # the linear layers by the Triton kernel too (where cuBLAS's tiles fail `tiles_invariant`)
        for layer in model.modules():
            if type(layer) is torch.nn.Linear:
                layer.kvserve_exact_kernel = True
    ids = torch.randint(0, 1024, (100,), generator=torch.Generator().manual_seed(1)).tolist()

    def logits(chunks, beside=False):
        cache, other = pool.allocate(100), pool.allocate(100)
        out, at = [], 0
        if beside:
            runner.forward([Row(other, 5)], ids[:5], [0])
        for n in chunks:
            rows, tokens = [Row(cache, n)], ids[at : at + n]
            if beside:
                rows.append(Row(other, 1))
                tokens = tokens + [ids[at % 7]]
            out.append(runner.forward(rows, tokens, [0], [n]))
            at += n
        kv.free(cache)
        kv.free(other)
        return torch.cat(out)

    decoded = logits([1] * 100)
    for chunks, beside in (([100], False), ([7] * 14 + [2], False), ([33, 1, 1, 65], False), ([16] * 6 + [4], True)):
        assert torch.equal(logits(chunks, beside), decoded), (chunks, beside)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_rows_ignore_the_other_rows(dtype):
    """Normalization layers in exact mode (a transformers RMSNorm over the hidden size and
    over a head's size, a LayerNorm) give each row the same bits among 1..300 rows. Off CPU
    they run in fixed tiles of rows (`exact.norm`); the CPU's norms are per row already."""
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norms = torch.nn.ModuleList([LlamaRMSNorm(576), LlamaRMSNorm(64), torch.nn.LayerNorm(576)]).to(DEVICE, dt)
    for layer in norms:
        torch.nn.init.normal_(layer.weight)
    exact.enable(norms)
    assert all(isinstance(layer.forward, functools.partial) for layer in norms)
    with context.entered(context.StepContext(exact=True)):
        for layer in norms:
            x = torch.randn(400, layer.weight.shape[0], device=DEVICE).to(dt)
            single = [layer(x[i : i + 1])[0] for i in range(0, 400, 37)]
            for m in (2, 3, 5, 64, 65, 300):
                for j, i in enumerate(range(0, 400 - m, 37)):
                    assert torch.equal(layer(x[i : i + m])[0], single[j]), (layer, m, i)


def test_sampling_filters_a_row_alike_among_any_rows():
    """Temperature / top-k / top-p probabilities and log-probabilities of a row over SmolLM2's
    vocabulary size and an odd one (GPT-2's): alone and among 2-64 rows, the same bits (the
    top-p running mass is an integer scan, `sampling._mass_before_fixed`; off CPU a softmax's
    rows are padded to whole 16 bytes, `sampling.softmax_rows`); and the cut is top-p's: a
    token goes once the mass before it reaches top_p, the first never."""
    torch.manual_seed(0)
    params = [SamplingParams(max_tokens=1, temperature=0.6 + 0.01 * i, top_p=0.7 + 0.004 * i, top_k=0 if i % 3 else 40, seed=i) for i in range(64)]
    for vocab in (49152, 50257):
        logits = torch.randn(64, vocab, device=DEVICE) * 4
        alone = [(filtered_probs(logits[i : i + 1], [params[i]])[0], softmax_rows(logits[i : i + 1], log=True)[0]) for i in range(64)]
        for size in (2, 5, 16, 64):
            together = filtered_probs(logits[:size], params[:size]), softmax_rows(logits[:size], log=True)
            for i in range(size):
                assert torch.equal(together[0][i], alone[i][0]) and torch.equal(together[1][i], alone[i][1]), (vocab, size, i)
    logits = torch.tensor([[0.5, 0.2, 0.3, 1e-9], [0.9, 0.05, 0.03, 0.02]], device=DEVICE).log()
    cut = filtered_probs(logits, [SamplingParams(max_tokens=1, top_p=0.75), SamplingParams(max_tokens=1, top_p=0.01)])
    assert torch.allclose(cut, torch.tensor([[0.625, 0, 0.375, 0], [1, 0, 0, 0]], device=DEVICE)), cut


def test_tiles_are_one_shape():
    """`exact.by_tiles` hands its function whole tiles only (the last one zero-padded) and
    returns each row's own result, whatever the leading shape."""
    seen = []

    def rowwise(rows):
        seen.append(tuple(rows.shape))
        return torch.cat([rows * 2, rows.sum(-1, keepdim=True)], -1)

    x = torch.randn(3, 7, 5, 6)
    out = exact.by_tiles(rowwise, x, 16, one_call=False)
    assert set(seen) == {(16, 6)} and len(seen) == 7  # 105 rows: 7 tiles
    assert out.shape == (3, 7, 5, 7) and torch.equal(out, rowwise(x.reshape(-1, 6)).reshape(3, 7, 5, 7))
    seen.clear()
    exact.by_tiles(rowwise, x, 16, one_call=True)
    assert seen[0] == (112, 6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "dense"])
def test_linear_rows_ignore_the_other_rows(dtype, packed, request):
    """A linear layer in exact mode gives each row the same bits with 1..300 rows beside it, at
    any place among them (off CPU through cuBLAS's tiles or, for a shape that fails
    `tiles_invariant`, the Triton kernel)."""
    if DEVICE.type != "cpu":
        request.getfixturevalue("kernel")
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    model = torch.nn.Sequential(torch.nn.Linear(576, 1536), torch.nn.Linear(1536, 576, bias=False)).to(DEVICE, dt)
    model.device = torch.device(DEVICE)
    cpu_linear.pack_model(model, packed)
    exact.enable(model)
    x = torch.randn(1, 400, 576, device=DEVICE).to(dt)
    with context.entered(context.StepContext(exact=True)):
        single = [model(x[:, i : i + 1])[0, 0] for i in range(0, 400, 37)]
        for m in (2, 3, 7, 8, 9, 16, 17, 33, 64, 100, 300):
            for at in (0, m - 1):
                for j, i in enumerate(range(0, 400, 37)):
                    if i - at >= 0 and i - at + m <= 400:
                        out = model(x[:, i - at : i - at + m])[0, at]
                        assert torch.equal(out, single[j]), (m, at, i)


@pytest.mark.anyio
async def test_models_say_which_mode_runs(app_client):
    """`/v1/models` (and one model's card) carry the mode; the fingerprint differs by mode."""
    seen = {}
    for deterministic in (False, True):
        async with app_client(deterministic=deterministic) as client:
            listed = (await client.get("/v1/models")).json()["data"][0]
            card = (await client.get(f"/v1/models/{listed['id']}")).json()
            assert listed["deterministic"] is card["deterministic"] is deterministic
            body = {"model": listed["id"], "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
            seen[deterministic] = (await client.post("/v1/chat/completions", json=body)).json()["system_fingerprint"]
    assert seen[False] != seen[True]


def test_session_files_and_fingerprints_name_exact_modes_numerics():
    """What a session file's fingerprint and `system_fingerprint` carry besides the model:
    nothing in the default mode; in exact mode the mode, the platform whose libraries round
    (the CPU's vector extensions, or the GPU and CUDA version) and torch's version, and on
    CUDA its attention (the Triton kernel; a fallback to the torch formulation would compute
    other KV bits)."""
    loaded = model_in("float32")
    assert numerics(Settings(**SETTINGS), loaded) == ""
    mode = numerics(Settings(**SETTINGS, deterministic=True), loaded)
    platform = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else torch.backends.cpu.get_cpu_capability()
    assert mode.startswith("deterministic:") and platform in mode and torch.__version__ in mode, mode
    assert mode.endswith(", triton") if DEVICE.type == "cuda" else "triton" not in mode


def test_values_narrower_or_wider_than_keys(kernel):
    """MLA's values (DeepSeek-V3: keys 192 wide, values 128): the kernel against the torch
    formulation, and a row's bits alone and beside another row."""
    torch.manual_seed(0)
    for dk, dv in ((24, 16), (16, 24)):
        q, keys, values = torch.randn(2, 2, 6, dk, device=DEVICE), torch.randn(2, 2, 40, dk, device=DEVICE), torch.randn(2, 2, 40, dv, device=DEVICE)
        mask = torch.zeros(2, 1, 6, 40, device=DEVICE)
        mask[0, ..., 30:] = float("-inf")
        got = kernel.attend(q, keys, values, mask, 0.3, None)
        assert got.shape == (2, 2, 6, dv)
        with torch.no_grad():
            want = torch.softmax(q.double() @ keys.double().transpose(-1, -2) * 0.3 + mask.double(), -1) @ values.double()
        assert torch.allclose(got.double(), want, atol=1e-4)
        assert torch.equal(kernel.attend(q[:1], keys[:1], values[:1], mask[:1], 0.3, None), got[:1])
