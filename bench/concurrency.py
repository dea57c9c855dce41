"""Concurrent streams on one server: aggregate decode tokens/s and TTFT at 1, 4, 8 and 16
streams against 1 stream, and a session's later-turn TTFT while other streams decode against
the same turn on the idle server, all measured in one run.

    .venv/bin/python -m bench.concurrency [--streams 1,4,8,16] [--max-tokens 64]
        [--doc-tokens 1000] [--load-streams 8] [--server-flag=--max-running=16 ...]

Every request is greedy and streamed through the openai SDK with usage included. A wave starts
N streams at once, each asking for a story on its own topic; aggregate tok/s = the sum of
usage.completion_tokens / the wave's wall time (first request sent to last stream done, so
prefill is included). A story may end before --max-tokens (there is no ignore_eos); only the
tokens generated are counted. TTFT = request start to the first content chunk.

Baseline: transformers' own continuous batching (`generate_batch`, paged attention) on the same
default model, greedy, the same prompts and max_tokens, run in-process after the server stopped
(`--no-transformers-baseline` skips it; it is skipped anyway when a --model flag is passed).

Session TTFT: a ~1k-token document as system prompt under `prompt_cache_key`, turn 1 done on the
idle server; turn 2 (one more user message) is timed on the idle server, then for a second
session while --load-streams other streams are decoding (each past its first chunk).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from openai import AsyncOpenAI, OpenAI

from bench.common import launch
from bench.sessions import document, stream_turn

TOPICS = (
    "a lighthouse keeper", "a lost robot", "a desert caravan", "a haunted library",
    "a mountain village", "a deep-sea diver", "a clockmaker's apprentice", "a dragon egg",
    "a space station cook", "a river ferry", "a forgotten king", "a talking fox",
    "a winter market", "a pirate cartographer", "a glass city", "a runaway train",
)
QUESTIONS = ("What does the document say about the harbor?", "And what does it say about the winter season?")
SESSION_MAX_TOKENS = 16


def story_prompt(i: int) -> str:
    part = f" (part {i // len(TOPICS) + 1})" if i >= len(TOPICS) else ""
    return f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}{part}."


def transformers_batch(levels: list[int], max_tokens: int) -> dict[int, float]:
    """Aggregate tok/s of transformers' continuous batching per level (wall time includes prefill)."""
    from transformers import GenerationConfig

    from server.model_loader import load_model
    from server.settings import default_cache_dir

    loaded = load_model(None, cache_dir=default_cache_dir(), device="cpu", dtype="float32")
    tokenizer = loaded.tokenizer
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    rates = {}
    warm = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    loaded.model.generate_batch(inputs=[[1, 2, 3]], generation_config=warm, progress_bar=False)
    for n in levels:
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": story_prompt(i)}], add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(n)
        ]
        start = time.perf_counter()
        outputs = loaded.model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        rates[n] = sum(len(o.generated_tokens) for o in outputs.values()) / (time.perf_counter() - start)
    return rates


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (the single value when there is one)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass(slots=True)
class Wave:
    streams: int
    tokens: int
    tok_s: float
    ttfts: list[float]


@dataclass(slots=True)
class Turn:
    ttft: float
    prompt_tokens: int
    cached_tokens: int


async def story(client: AsyncOpenAI, model: str, i: int, max_tokens: int,
                on_first: Callable[[], None] = lambda: None) -> tuple[float, int]:
    """(TTFT, completion tokens) of one streamed story; `on_first` runs at the first content chunk."""
    start = time.perf_counter()
    ttft, tokens = None, 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": story_prompt(i)}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - start
            on_first()
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    assert ttft is not None and tokens > 0, f"stream {i} produced no text"
    return ttft, tokens


async def wave(client: AsyncOpenAI, model: str, n: int, max_tokens: int) -> Wave:
    start = time.perf_counter()
    results = await asyncio.gather(*(story(client, model, i, max_tokens) for i in range(n)))
    wall = time.perf_counter() - start
    tokens = sum(tokens for _, tokens in results)
    return Wave(n, tokens, tokens / wall, [ttft for ttft, _ in results])


def open_session(client: OpenAI, model: str, seed: int, doc_tokens: int) -> tuple[str, list[dict]]:
    """Runs turn 1 of a new session; returns its key and the messages of turn 2."""
    session = f"bench-concurrency-{seed}"
    messages = [
        {"role": "system", "content": "Answer from this document.\n" + document(seed, doc_tokens)},
        {"role": "user", "content": QUESTIONS[0]},
    ]
    _, text, _ = stream_turn(client, model, messages, session, SESSION_MAX_TOKENS)
    return session, [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": QUESTIONS[1]}]


def next_turn(client: OpenAI, model: str, session: str, messages: list[dict]) -> Turn:
    ttft, _, usage = stream_turn(client, model, messages, session, SESSION_MAX_TOKENS)
    return Turn(ttft, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens)


async def turn_under_load(aclient: AsyncOpenAI, client: OpenAI, model: str, session: str,
                          messages: list[dict], n_load: int, max_tokens: int) -> tuple[Turn, int]:
    """Times the session's turn once `n_load` other streams are all decoding; returns the turn and
    how many of them were still decoding when it ended. The load streams are cancelled after."""
    decoding = asyncio.Event()
    started = 0

    def on_first() -> None:
        nonlocal started
        started += 1
        if started == n_load:
            decoding.set()

    load = [asyncio.create_task(story(aclient, model, 100 + i, max_tokens, on_first)) for i in range(n_load)]
    waiter = asyncio.create_task(decoding.wait())
    try:
        done, _ = await asyncio.wait([waiter, *load], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # a load stream that failed fails the benchmark
        if not decoding.is_set():
            raise RuntimeError("a load stream ended before all were decoding; raise --load-max-tokens")
        turn = await asyncio.to_thread(next_turn, client, model, session, messages)
        return turn, sum(not task.done() for task in load)
    finally:
        for task in (waiter, *load):
            task.cancel()
        await asyncio.gather(waiter, *load, return_exceptions=True)


async def run(base_url: str, args: argparse.Namespace) -> tuple[list[Wave], Turn, Turn, int]:
    aclient = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    model = (await aclient.models.list()).data[0].id
    await story(aclient, model, 0, 8)  # warm-up
    waves = [await wave(aclient, model, n, args.max_tokens) for n in args.streams]
    session, messages = open_session(client, model, 1, args.doc_tokens)
    idle = next_turn(client, model, session, messages)
    session, messages = open_session(client, model, 2, args.doc_tokens)
    loaded, still = await turn_under_load(aclient, client, model, session, messages, args.load_streams, args.load_max_tokens)
    return waves, idle, loaded, still


def report(args: argparse.Namespace, waves: list[Wave], idle: Turn, loaded: Turn, still: int,
           baseline: dict[int, float]) -> None:
    base = waves[0]
    ratios = ", ".join(f"{w.streams} streams {w.tok_s / base.tok_s:.2f}x" for w in waves[1:])
    print(f"aggregate decode against {base.streams} stream(s): {ratios or '(one level only)'}")
    print(f"session turn-2 TTFT with {args.load_streams} streams decoding / idle: {loaded.ttft / idle.ttft:.2f}x\n")
    print(f"concurrent greedy streams, max_tokens {args.max_tokens}, one wave per level (SmolLM2-135M fp32, CPU)\n")
    extra = " transformers generate_batch tok/s | kvserve / transformers |" if baseline else ""
    print(f"| streams | aggregate tok/s | ratio to {base.streams} | TTFT p50 (s) | TTFT p99 (s) | TTFT p50 ratio to {base.streams} |{extra}")
    print("|---|---|---|---|---|---|" + ("---|---|" if baseline else ""))
    base_p50 = percentile(base.ttfts, 0.5)
    for w in waves:
        p50 = percentile(w.ttfts, 0.5)
        cells = f" {baseline[w.streams]:.1f} | {w.tok_s / baseline[w.streams]:.2f} |" if baseline else ""
        print(f"| {w.streams} | {w.tok_s:.1f} | **{w.tok_s / base.tok_s:.2f}** | {p50:.3f} | "
              f"{percentile(w.ttfts, 0.99):.3f} | {p50 / base_p50:.2f} |{cells}")
    print("\ncompletion tokens per wave (streams x max_tokens unless a story ended early): "
          + ", ".join(f"{w.tokens} of {w.streams * args.max_tokens}" for w in waves))
    print(f"\nsession turn 2 (~{loaded.prompt_tokens} prompt tokens), {still} of {args.load_streams} load streams "
          "still decoding when it ended\n")
    print("| server state | turn-2 TTFT (s) | cached / prompt tokens |")
    print("|---|---|---|")
    print(f"| idle | {idle.ttft:.3f} | {idle.cached_tokens} / {idle.prompt_tokens} |")
    print(f"| {args.load_streams} streams decoding | {loaded.ttft:.3f} | {loaded.cached_tokens} / {loaded.prompt_tokens} |")
    print(f"| **ratio load / idle** | **{loaded.ttft / idle.ttft:.2f}** | |")
    print("\n    " + shlex.join([".venv/bin/python", "-m", "bench.concurrency", *sys.argv[1:]]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=lambda s: [int(n) for n in s.split(",")], default=[1, 4, 8, 16],
                        help="comma-separated concurrency levels; the first is the baseline")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--load-streams", type=int, default=8)
    parser.add_argument("--load-max-tokens", type=int, default=512)
    parser.add_argument("--transformers-baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="also run transformers' generate_batch at each level (default model only)")
    parser.add_argument("--server-flag", action="append", default=[], metavar="FLAG",
                        help="passed to `kvserve serve`, e.g. --server-flag=--max-running=16 (repeatable)")
    args = parser.parse_args()
    flags = [part for flag in args.server_flag for part in shlex.split(flag)]
    with tempfile.TemporaryDirectory() as logs, launch(logs, *flags) as server:
        results = asyncio.run(run(server.base_url, args))
    baseline = {}
    if args.transformers_baseline and not any(f.startswith("--model") for f in flags):
        baseline = transformers_batch(args.streams, args.max_tokens)
    report(args, *results, baseline)


if __name__ == "__main__":
    main()
