"""Exact mode (`--deterministic`) against the default mode: the time per generated token at 1, 8
and 32 concurrent streams, and how often the default mode's outputs are identical where exact
mode's always are (alone vs together, session reuse vs a fresh prefill, speculation on vs off).

    .venv/bin/python -m bench.deterministic [--streams 1,8,32] [--tokens 32] [--dtype float32]
        [--device cpu] [--rounds 2]

In-process engines (no HTTP: the HTTP path costs both modes the same) on the default model,
one per mode, sharing the model. Each round runs every wave in both modes back to back, the
mode that goes first alternating, so a shared or throttling machine slows both alike; the
ratio is exact / default of the summed wall time per generated token (prefill included). Every
request is greedy with its own topic; a story may end before --tokens, only generated tokens
count.

Identity: N requests together vs each alone (N = the largest --streams), second turns of 8
sessions reusing their first vs fresh prefills, and prompt-lookup speculation on vs off over
copy-heavy prompts; each pair counts as identical when tokens and logprobs are equal bit for
bit. Printed for both modes (exact mode: 100% or a bug): tokens identical / tokens and
logprobs identical.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

from cache_manager.manager import CacheConfig, CacheManager
from server.engine import exact
from server.engine.core import Engine, EngineConfig
from server.model_loader import load_model
from server.engine.prompt_lookup import NgramProposer
from server.engine.sampling import SamplingParams
from server.engine.sequence import GenerationRequest
from server.settings import default_cache_dir
from server.engine.speculative import SpeculativeConfig

TOPICS = ["the sea", "a lighthouse", "bread", "rain", "trains", "chess", "the moon", "coffee", "winter", "owls",
          "maps", "bees", "glass", "rivers", "clocks", "salt"]
COPY = [
    "Repeat this list exactly: apples, pears, plums, cherries, apricots, peaches, figs, dates, limes.",
    "Copy this sentence twice: the harbor ledger lists seven crates of copper and two of tin.",
    "Rewrite with 'lowest' for 'cheapest': def cheapest(items): return min(items, key=lambda i: i.price)",
]


class Bench:
    def __init__(self, loaded, deterministic: bool, max_running: int, proposer=None, paged=None) -> None:
        self.tokenizer = loaded.tokenizer
        cache = CacheManager(loaded.model.config, loaded.device, loaded.dtype, loaded.max_context, CacheConfig(budget_bytes=2**31))
        config = EngineConfig(max_context=loaded.max_context, max_running=max_running, exact=deterministic,
                              speculative=SpeculativeConfig(adaptive=False), paged=paged)
        self.engine = Engine(loaded.model, loaded.tokenizer, config, cache, proposer=proposer)
        self.engine.start()

    def prompt(self, text: str, system: str | None = None) -> list[int]:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]

    async def run(self, request: GenerationRequest) -> list[tuple]:
        out = []
        async for chunk in self.engine.submit(request, asyncio.get_running_loop()):
            out += [(t.token_id, t.logprob) for t in chunk.tokens]
        return out

    async def wave(self, requests: list[GenerationRequest]) -> list[list[tuple]]:
        return await asyncio.gather(*(self.run(r) for r in requests))


def story(b: Bench, i: int, tokens: int, tag: str) -> GenerationRequest:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=True)
    return GenerationRequest(f"{tag}-{i}", b.prompt(f"Tell a short story about {TOPICS[i % len(TOPICS)]} ({i})."), params, use_session=False)


def timed(b: Bench, n: int, tokens: int, tag: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = asyncio.run(b.wave([story(b, i, tokens, tag) for i in range(n)]))
    return time.perf_counter() - t0, sum(len(o) for o in outs)


def identity(b: Bench, spec: Bench, n: int, tokens: int) -> dict[str, tuple[int, int]]:
    """(identical, pairs) for each comparison, on `b` (and `spec`: the same mode speculating)."""
    async def go():
        reqs = [story(b, i, tokens, "id") for i in range(n)]
        together = await b.wave(reqs)
        alone = [await b.run(r) for r in reqs]
        params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=True)
        firsts = [GenerationRequest(f"t1-{i}", b.prompt(f"Tell me about {TOPICS[i]}.", system=f"Session {i}."), params, session_id=f"bench-{i}") for i in range(8)]
        replies = await b.wave(firsts)
        more = b.tokenizer("<|im_end|>\n<|im_start|>user\nAnd at night?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        seconds = [GenerationRequest(f"t2-{i}", r.prompt_ids + [t for t, _ in rep] + more, params, session_id=f"bench-{i}") for i, (r, rep) in enumerate(zip(firsts, replies))]
        reused = await b.wave(seconds)
        fresh = [await b.run(GenerationRequest(r.request_id + "-fresh", r.prompt_ids, params, use_session=False)) for r in seconds]
        copies = [GenerationRequest(f"c-{i}", b.prompt(COPY[i % len(COPY)] + f" ({i})"), params, use_session=False) for i in range(8)]
        drafted = await spec.wave(copies)
        plain = [await b.run(r) for r in copies]
        pairs = {"alone vs together": (together, alone), "reuse vs fresh": (reused, fresh), "speculation on vs off": (drafted, plain)}
        # (tokens identical, tokens and logprobs identical, pairs)
        return {k: (sum([t for t, _ in x] == [t for t, _ in y] for x, y in zip(got, want)), sum(x == y for x, y in zip(got, want)), len(got))
                for k, (got, want) in pairs.items()}

    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--paged", action="store_true", help="exact mode on the paged attention path (CUDA's)")
    parser.add_argument("--no-identity", action="store_true", help="time only")
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    loaded = load_model(None, cache_dir=default_cache_dir(), device=args.device, dtype=args.dtype)
    modes = {m: Bench(loaded, m, max(streams), paged=True if m and args.paged else None) for m in (False, True)}
    name = {False: "default", True: "exact"}
    print(f"device {args.device}, {args.dtype}, torch threads {torch.get_num_threads()}, {args.tokens} tokens per stream")
    for b in modes.values():  # warm both paths up
        timed(b, 2, 4, "warm")
    runner = modes[True].engine.runner
    kernel = "the Triton kernel" if loaded.device.type in exact.KERNELS else "the torch formulation"
    print(f"exact mode's attention: {f'the paged path, {kernel}' if runner.paged else 'the row path (spans)'}")
    by_kernel = [n for n, m in loaded.model.named_modules() if getattr(m, "kvserve_exact_kernel", False)]
    print(f"exact mode's linear layers: {f'{len(by_kernel)} by the Triton kernel (their tiles failed exact.tiles_invariant)' if by_kernel else 'fixed row tiles'}")
    totals = {(n, m): [0.0, 0] for n in streams for m in modes}
    for r in range(args.rounds):
        for n in streams:
            order = [False, True] if (r + n) % 2 == 0 else [True, False]
            for m in order:
                seconds, tokens = timed(modes[m], n, args.tokens, f"r{r}")
                totals[(n, m)][0] += seconds
                totals[(n, m)][1] += tokens
    print("\n| streams | default ms/token | exact ms/token | **exact / default** |\n|---|---|---|---|")
    for n in streams:
        per = {m: 1000 * totals[(n, m)][0] / max(totals[(n, m)][1], 1) for m in modes}
        print(f"| {n} | {per[False]:.1f} | {per[True]:.1f} | **{per[True] / per[False]:.2f}x** |")
    if args.no_identity:
        for b in modes.values():
            b.engine.stop()
        return
    print("\nidentical outputs: tokens / tokens and logprobs bit for bit, of pairs")
    print("\n| mode | alone vs together | reuse vs fresh | speculation on vs off |\n|---|---|---|---|")
    for m, b in modes.items():
        spec = Bench(loaded, m, max(streams), proposer=NgramProposer())
        shares = identity(b, spec, max(streams), args.tokens)
        spec.engine.stop()
        print(f"| {name[m]} | " + " | ".join(f"{t} / {b} of {n}" for t, b, n in shares.values()) + " |")
    for b in modes.values():
        b.engine.stop()


if __name__ == "__main__":
    main()
