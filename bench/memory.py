"""KV memory: the budget kvserve chooses, the tokens and 4k-token sessions it holds with each
--kv-cache-dtype, the later-turn TTFT over a 4k-token session, and what fp8 costs in quality.

    .venv/bin/python -m bench.memory [--device cuda --dtype bfloat16] [--layers-1p5b 4] [--skip-quality]

Two models: the default (SmolLM2-135M-Instruct, the embedded GGUF) and a random-weight model
of Qwen2.5-1.5B's shape built in-process from a Qwen2 config (hidden 1536, 12 heads, 2 KV heads
of 128, MLP 8960, vocab 151,936); on a CPU with fewer layers than its 28 (`--layers-1p5b`,
default 4) so its 4k-token prefill runs in seconds: per-token KV bytes scale with the layers, so
the ratios do not change.

For each model and KV dtype (auto = the model's dtype, fp8, int8):
* budget: what `kvserve serve` would choose on this device (server/kv_budget.py: measured on a
  GPU, --kv-budget-fraction of RAM on a CPU), and the tokens it holds;
* resident: 4k-token sessions committed one after another through the real cache manager at that
  budget until the first eviction (bookkeeping and block pool only: the pool lives on the meta
  device, so no memory is taken);
* TTFT: a later turn (32 new tokens) over a session holding 4096 tokens, the best of
  --repeats, dtypes interleaved (the best, not the median: on a shared 2-core box the other
  processes only ever add time). The 4k-token history is prefilled once (auto) and copied into each
  format's cache (quantized when stored): the later turn's work does not depend on the values.

Quality (default model only): greedy identity against the unquantized cache over --prompts
chat prompts (share of prompts whose --max-tokens tokens are identical, and of tokens before the
first difference), and the perplexity of a fixed public-domain text through each cache.
Ratios are computed in the same run; absolute times are for this machine only.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from cache_manager import kv
from cache_manager.manager import CacheConfig, CacheManager
from server import kv_budget
from server.engine.attention import Row
from server.model_loader import load_model, resolve_device_dtype
from server.engine.model_runner import forward, forward_rows
from server.settings import Settings, default_cache_dir

DTYPES = ("auto", "fp8", "int8")
SESSION = 4096
TURN = 32

TEXT = """It was the best of times, it was the worst of times, it was the age of wisdom, it was the age
of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light,
it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything
before us, we had nothing before us, we were all going direct to Heaven, we were all going direct the
other way. It is a truth universally acknowledged, that a single man in possession of a good fortune,
must be in want of a wife. However little known the feelings or views of such a man may be on his first
entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he
is considered the rightful property of some one or other of their daughters. Call me Ishmael. Some years
ago, never mind how long precisely, having little or no money in my purse, and nothing particular to
interest me on shore, I thought I would sail about a little and see the watery part of the world. It is
a way I have of driving off the spleen and regulating the circulation. Four score and seven years ago our
fathers brought forth on this continent, a new nation, conceived in Liberty, and dedicated to the
proposition that all men are created equal. Now we are engaged in a great civil war, testing whether that
nation, or any nation so conceived and so dedicated, can long endure. We are met on a great battle-field
of that war. We have come to dedicate a portion of that field, as a final resting place for those who
here gave their lives that that nation might live. It is altogether fitting and proper that we should do
this. Happy families are all alike; every unhappy family is unhappy in its own way. Everything was in
confusion in the Oblonskys' house. The wife had discovered that the husband was carrying on an intrigue
with a French girl, who had been a governess in their family, and she had announced to her husband that
she could not go on living in the same house with him."""

PROMPTS = [
    "Write a short poem about the sea.", "Explain what a hash table is.", "Give three tips for learning a language.",
    "What causes rain?", "Describe a cat to someone who has never seen one.", "How do I boil an egg?",
    "Summarize the plot of Romeo and Juliet.", "Why is the sky blue?", "List four prime numbers and explain why.",
    "Write a haiku about winter.", "What is the capital of France and what is it known for?", "How does a bicycle stay upright?",
]


def qwen2_1p5b_shape(layers: int, device: torch.device, dtype: torch.dtype):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=layers,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=True, rope_theta=1e6)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()


def resident_sessions(config, dtype: torch.dtype, kv_dtype: str, budget: int) -> int:
    """4k-token sessions committed through the cache manager until the first eviction."""
    manager = CacheManager(config, torch.device("meta"), dtype, SESSION, CacheConfig(budget_bytes=budget, kv_dtype=kv_dtype))
    prompt = list(range(SESSION))
    for i in range(1_000_000):
        lease = manager.acquire("bench", f"s{i}", prompt, SESSION)
        lease.cache.length = SESSION  # as if prefilled: the budget counts blocks, not values
        manager.commit(lease, prompt)
        if len(manager.store) <= i:  # this one evicted an earlier session
            return i
    raise RuntimeError("no eviction")


def copy_cache(src: kv.SequenceKV, config, dtype: torch.dtype, kv_dtype: str, capacity: int) -> kv.SequenceKV:
    """`src`'s KV in a cache of `kv_dtype` (quantized when stored)."""
    dst = kv.allocate(config, capacity, src.pool.device, dtype, kv_dtype=kv_dtype)
    for layer in range(len(src.pool.keys)):
        k, v = kv.read(src, layer, 0, src.length)
        kv.write(dst, layer, 0, k, v)
    dst.length = src.length
    return dst


def later_turn_ttft(model, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """Seconds to the first token of a 32-token turn over a 4096-token session (the best of
    `repeats`)."""
    device = model.device
    history = [(i * 7919) % 30000 + 100 for i in range(SESSION)]
    turn = [(i * 104729) % 30000 + 100 for i in range(TURN)]
    base = kv.allocate(model.config, SESSION + TURN, device, dtype)
    for start in range(0, SESSION, 512):  # chunked: the activations of 4k tokens at once are large
        forward(model, base, history[start : start + 512], start)
    caches = {name: copy_cache(base, model.config, dtype, name, SESSION + TURN) for name in DTYPES}
    times: dict[str, list[float]] = {name: [] for name in DTYPES}
    for r in range(repeats + 1):
        for name, cache in caches.items():
            kv.crop(cache, SESSION)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            int(forward(model, cache, turn, SESSION).argmax())
            if r > 0:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
    return {name: min(t) for name, t in times.items()}


def greedy(model, ids: list[int], kv_dtype: str, n: int) -> list[int]:
    cache = kv.allocate(model.config, len(ids) + n, model.device, model.dtype, kv_dtype=kv_dtype)
    logits = forward(model, cache, ids, 0)
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = forward(model, cache, [out[-1]], kv.length(cache))
    return out


def identity(loaded, kv_dtype: str, prompts: int, max_tokens: int) -> tuple[float, float]:
    """(share of prompts with identical greedy outputs, share of tokens before the first
    difference) against the unquantized cache."""
    tok, same, kept, total = loaded.tokenizer, 0, 0, 0
    for text in PROMPTS[:prompts]:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        ids = tok(chat, add_special_tokens=False)["input_ids"]
        want, got = greedy(loaded.model, ids, "auto", max_tokens), greedy(loaded.model, ids, kv_dtype, max_tokens)
        same += got == want
        kept += next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), max_tokens)
        total += max_tokens
    return same / prompts, kept / total


def perplexity(model, ids: list[int], kv_dtype: str, chunk: int = 256) -> float:
    """exp(mean NLL) of `ids` read through a cache of `kv_dtype`, in chunks (each chunk's
    queries read the chunk's own keys back from the cache, as serving does)."""
    cache = kv.allocate(model.config, len(ids), model.device, model.dtype, kv_dtype=kv_dtype)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, chunk):
        part = ids[start : min(start + chunk, len(ids) - 1)]
        logits = forward_rows(model, [Row(cache, len(part))], part, [0], [len(part)])
        targets = torch.tensor(ids[start + 1 : start + 1 + len(part)], device=logits.device)
        nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        count += len(part)
    return math.exp(nll / count)


def budget_rows(name: str, model, settings: Settings, device: torch.device, dtype: torch.dtype, max_context: int, repeats: int) -> list[str]:
    budget = kv_budget.choose(settings, model, device, max_context)
    lay = kv.layout(model.config)
    ttft = later_turn_ttft(model, dtype, repeats)
    rows, resident = [], {}
    for kv_dtype in DTYPES:
        per_token = lay.bytes_per_token(dtype, kv_dtype)
        tokens = budget.nbytes // (kv.BLOCK_SIZE * per_token) * kv.BLOCK_SIZE
        resident[kv_dtype] = resident_sessions(model.config, dtype, kv_dtype, budget.nbytes)
        rows.append(f"| {name} | {kv_dtype} | {budget.nbytes / 2**30:.2f} | {per_token:,} | {tokens:,} | {resident[kv_dtype]} "
                    f"| {ttft[kv_dtype] * 1000:.0f} | {ttft[kv_dtype] / ttft['auto']:.2f}x |")
    bf16 = resident_sessions(model.config, torch.bfloat16, "auto", budget.nbytes)  # the GPU default's cache
    print(f"{name}: budget {budget.how}")
    print(f"{name}: resident 4k sessions fp8/auto = {resident['fp8'] / resident['auto']:.2f}x (>= 1.9 wanted; "
          f"against a bf16 cache in the same budget: {resident['fp8']} / {bf16} = {resident['fp8'] / bf16:.2f}x), "
          f"later-turn TTFT fp8/auto = {ttft['fp8'] / ttft['auto']:.2f}x (<= 1.1 wanted), int8/auto = {ttft['int8'] / ttft['auto']:.2f}x")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--layers-1p5b", type=int, default=None, help="layers of the 1.5B-shaped model (default: 28 on a GPU, 4 on a CPU)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--models", choices=["both", "default", "1.5b"], default="both", help="which models' capacity and TTFT rows")
    args = parser.parse_args()
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    settings = Settings(device=device.type, dtype=str(dtype).removeprefix("torch."))
    loaded = load_model(None, cache_dir=default_cache_dir(), device=device.type, dtype=settings.dtype)
    layers = args.layers_1p5b or (28 if device.type == "cuda" else 4)
    print(f"device {device}, dtype {dtype}; 1.5B shape with {layers} of 28 layers")
    header = ["| model | KV dtype | budget GiB | KV bytes/token | tokens held | 4k sessions resident | later-turn TTFT ms | TTFT vs auto |",
              "|---|---|---|---|---|---|---|---|"]
    rows = []
    if args.models in ("both", "default"):
        rows += budget_rows("SmolLM2-135M", loaded.model, settings, device, dtype, loaded.max_context, args.repeats)
    if args.models in ("both", "1.5b"):
        big = qwen2_1p5b_shape(layers, device, dtype)
        rows += budget_rows(f"Qwen2.5-1.5B shape ({layers} layers)", big, settings, device, dtype, 32768, args.repeats)
        del big
    print("\n".join(header + rows))
    if args.skip_quality:
        return
    ids = loaded.tokenizer(TEXT)["input_ids"]
    ppl = {name: perplexity(loaded.model, ids, name) for name in DTYPES}
    print(f"\nquality, SmolLM2-135M ({dtype}), against the unquantized cache:")
    print("| KV dtype | identical greedy outputs | tokens before the first difference | perplexity | change |")
    print("|---|---|---|---|---|")
    for name in DTYPES:
        same, kept = identity(loaded, name, args.prompts, args.max_tokens) if name != "auto" else (1.0, 1.0)
        print(f"| {name} | {same:.0%} of {args.prompts} | {kept:.1%} | {ppl[name]:.3f} | {ppl[name] / ppl['auto'] - 1:+.2%} |")
    print(f"({len(ids)} tokens of text; {args.max_tokens} greedy tokens per prompt)")


if __name__ == "__main__":
    main()
