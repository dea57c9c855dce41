"""LoRA adapters on one base model (server/engine/lora.py): what serving them costs in decode
throughput, what making one resident costs, and what session reuse saves on an adapter,
measured in one run on a tiny random-weight Llama-shaped model built here (no downloads).

    .venv/bin/python -m bench.lora [--quick] [--tokens 128] [--repeats 3] [--readme docs/benchmarks.md]

The model (fp32 on the CPU, seeded random weights): Llama-shaped, hidden 512, 8 layers, 8 query
heads over 4 KV heads of 64, MLP 1536, vocabulary 49152 (SmolLM2's tokenizer,
`bench.architectures.tokenizer`), untied LM head. NOTE: at this size the LM head is about half
of a decode step's products (a 135M-class model: about a fifth), so the adapters' share of a
step, and their cost, is smaller here than on a real model. The first table gives the deltas'
multiply-adds against the base's beside each measured ratio; the deltas are many small
products, each slower per multiply-add than the base's, so what they cost runs well above it.

The adapters: 16 made here with PEFT (`get_peft_model(..., LoraConfig(r=16, lora_alpha=32,
target_modules=every projection, init_lora_weights=False))`, each seeded differently, so A and
B are random and every adapter differs) and saved into a temporary directory.

1. Decode throughput, 16 concurrent streams of --tokens greedy tokens each (end-of-turn biased
   away, so every stream runs to the end) on 32-token random prompts, private caches. Rate =
   the tokens generated after the last stream's first token / the time from then to the last
   token (the prefills are left out). Cases: the base alone (an engine without adapters); 1, 4
   and 16 adapters resident with the streams spread evenly across them; 4 resident with one
   stream on an adapter and 15 on the base (a step with any adapter row computes every
   row's delta over all resident ranks); 16 resident and every stream on the base (no delta
   computed). Each resident set has its own engine over its own copy of the model (the same
   weights), all built up front; the rounds run in turns (round r of every case before round r+1
   of any, one engine busy at a time), so the machine's drift falls on every case alike. Medians
   of --repeats rounds, each case's ratio to the base alone of the same run.
2. Loading and swapping: `lora.read` (the PEFT files read and checked, as a load does) timed
   for each of the 16 adapters; then, all 16 loaded over 4 device slots, each swapped into a
   slot in turn (`Adapters.acquire`: its A and B copied over the least recently used slot's);
   its file's size, its host memory and a device slot's.
3. Sessions on an adapter: turn 1 of a session with --history tokens of history on one of 4
   resident adapters (requests keyed by `lora.session_principal`, as the HTTP layer does), then
   --session-repeats later turns (the history so far + an 8-token reply + a 48-token user
   message), each reused (cached_tokens checked); a fresh prefill of the last turn's prompt on
   the same adapter, private cache. TTFT = submit to the first output token, medians. The base
   model's engine plays the same turns for scale, and the adapter session's last prompt is
   sent on another adapter under the same session id (it must reuse nothing).

`--readme FILE` also writes the tables into FILE between the markers `<!-- bench.lora: begin
-->` and `<!-- bench.lora: end -->` (README_BEGIN, README_END).

Full run: about 3 minutes on the 2-core dev box; `--quick` (64 tokens, 1 round): about 1. Other
processes on the CPU skew the ratios badly (torch's threads wait for each other), so the run ends
printing the load average before and after it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.architectures import tokenizer
from bench.common import write_readme_block
from cache_manager.manager import CacheConfig, CacheManager
from server.engine import lora
from server.engine.core import Engine, EngineConfig, end_of_turn_ids
from server.engine.sampling import SamplingParams
from server.engine.sequence import GenerationRequest

README_BEGIN = "<!-- bench.lora: begin -->"
README_END = "<!-- bench.lora: end -->"

CONFIG = {
    "vocab_size": 49152, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "tie_word_embeddings": False,
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 16, 32
ADAPTERS = 16
STREAMS = 16
PROMPT = 32  # each stream's prompt
MAX_CONTEXT = 4096
BUDGET = 2**27  # each engine's KV pool
PRINCIPAL = "bench"
REPLY, USER = 8, 48  # a session turn's reply and new user message


def build():
    """The tiny model, seeded (every call gives the same weights), in eval mode."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **CONFIG), dtype=torch.float32).eval()


def make_adapters(root: Path) -> list[Path]:
    """ADAPTERS PEFT LoRA adapters of `build()`'s model saved under `root`, each seeded apart."""
    from peft import LoraConfig, get_peft_model

    model, paths = build(), []
    for i in range(ADAPTERS):
        torch.manual_seed(1000 + i)  # after build(), which seeds its own weights
        peft_model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, init_lora_weights=False))
        paths.append(root / f"adapter-{i}")
        peft_model.save_pretrained(paths[-1])
        model = peft_model.unload()  # the plain base again, for the next one
    return paths


def products(model, rank_sum: int) -> tuple[int, int]:
    """Multiply-adds a token costs in the linear layers (the LM head included), and what the
    LoRA deltas add to them with `rank_sum` resident ranks: ((x @ A.T) * mask) @ B.T per
    targeted layer."""
    base = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    delta = sum((m.in_features + m.out_features) * rank_sum for name, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and name.rpartition(".")[2] in TARGETS)
    return base, delta


# -- engines and requests ----------------------------------------------------------------------


class Served:
    """One started engine over its own copy of the model, with `adapters` resident; a request
    names its adapter by index, 1.. (0: the base)."""

    def __init__(self, tok, adapters: list[lora.Adapter]) -> None:
        self.model = build()
        self.adapters = None
        if adapters:
            self.adapters = lora.Adapters(self.model, max_loras=len(adapters), max_rank=RANK)
            for adapter in adapters:
                self.adapters.add(adapter)
        self.by_slot = {0: None, **{i + 1: a for i, a in enumerate(adapters)}}
        cache = CacheManager(self.model.config, torch.device("cpu"), torch.float32, MAX_CONTEXT, CacheConfig(budget_bytes=BUDGET))
        self.engine = Engine(self.model, tok, EngineConfig(max_context=MAX_CONTEXT, max_running=STREAMS), cache, adapters=self.adapters)
        self.no_eos = {i: -100.0 for i in end_of_turn_ids(self.model, tok)}  # every reply runs to max_tokens
        self.engine.start()

    def request(self, prompt: list[int], max_tokens: int, slot: int, session: str | None = None) -> GenerationRequest:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logit_bias=self.no_eos)
        return GenerationRequest(f"r{time.monotonic_ns()}-{random.random()}", prompt, params, adapter=self.by_slot[slot],
                                 principal=lora.session_principal(PRINCIPAL, self.by_slot[slot]),
                                 session_id=session, use_session=session is not None)

    async def stream(self, request: GenerationRequest):
        """([(arrival time, tokens)] of each output that carried tokens, the token ids, the
        final output); raises unless the request ran to max_tokens."""
        stamps, ids, final = [], [], None
        async for out in self.engine.submit(request, asyncio.get_running_loop()):
            if out.tokens:
                stamps.append((time.perf_counter(), len(out.tokens)))
                ids += [t.token_id for t in out.tokens]
            final = out
        if final is None or final.finish_reason != "length" or len(ids) != request.params.max_tokens:
            raise RuntimeError(f"request on {request.adapter} ended {final and final.finish_reason} "
                               f"({final and final.error}) after {len(ids)} of {request.params.max_tokens} tokens")
        return stamps, ids, final

    def stop(self) -> None:
        self.engine.stop()


def tokens_of(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, CONFIG["vocab_size"]) for _ in range(n)]


def decode_rate(served: Served, slots: list[int], tokens: int, seed: int) -> float:
    """One round: a stream per entry of `slots` (its adapter) at once; the decode rate (the
    module docstring)."""
    rng = random.Random(seed)
    requests = [served.request(tokens_of(rng, PROMPT), tokens, slot) for slot in slots]

    async def play():
        return await asyncio.gather(*(served.stream(r) for r in requests))

    streams = [stamps for stamps, _, _ in asyncio.run(play())]
    start = max(s[0][0] for s in streams)  # every stream has its first token
    end = max(s[-1][0] for s in streams)
    return sum(k for s in streams for t, k in s if t > start) / (end - start)


def turn(served: Served, prompt: list[int], max_tokens: int, slot: int, session: str | None = None):
    """(TTFT in s, reply ids, final output) of one greedy request (a private cache without
    `session`)."""

    async def play():
        start = time.perf_counter()
        stamps, ids, final = await served.stream(served.request(prompt, max_tokens, slot, session))
        return stamps[0][0] - start, ids, final

    return asyncio.run(play())


# -- 1. decode throughput ----------------------------------------------------------------------


@dataclass
class Case:
    name: str
    engine: str  # which resident set: "base", "1", "4", "16"
    slots: list[int]  # each stream's adapter (1..; 0: the base)
    rates: list[float] = field(default_factory=list)  # tokens/s, a round each

    @property
    def resident(self) -> int:
        return 0 if self.engine == "base" else int(self.engine)


def cases() -> list[Case]:
    return [
        Case("base alone (no adapters loaded)", "base", [0] * STREAMS),
        Case("1 adapter, 16 streams on it", "1", [1] * STREAMS),
        Case("4 adapters, 4 streams each", "4", [1 + i % 4 for i in range(STREAMS)]),
        Case("16 adapters, 1 stream each", "16", [1 + i for i in range(STREAMS)]),
        Case("4 adapters, 1 stream on one, 15 on the base", "4", [1] + [0] * (STREAMS - 1)),
        Case("16 adapters resident, all 16 streams on the base", "16", [0] * STREAMS),
    ]


def throughput(engines: dict[str, Served], args) -> list[Case]:
    table = cases()
    for case in table:  # warm-up: each case's shapes once, untimed
        decode_rate(engines[case.engine], case.slots, 16, seed=0)
    for r in range(args.repeats):
        t0 = time.perf_counter()
        for case in table:
            case.rates.append(decode_rate(engines[case.engine], case.slots, args.tokens, seed=1 + r))
        rates = ", ".join(f"{case.rates[-1]:.0f}" for case in table)
        print(f"throughput round {r + 1}: {time.perf_counter() - t0:.1f} s (tokens/s, the cases in order: {rates})", flush=True)
    return table


# -- 2. making an adapter resident -------------------------------------------------------------


@dataclass
class Residency:
    read_ms: list[float]  # `lora.read` per adapter, in order
    swap_ms: list[float]  # `Adapters.acquire` of an adapter not resident, over an idle slot
    file_bytes: int  # one adapter's adapter_model.safetensors
    weights_bytes: int  # one adapter's A and B as read (host memory)
    slot_bytes: int  # one device slot's part of the layers' matrices
    adapters: list[lora.Adapter]


def residency(paths: list[Path]) -> Residency:
    """Read every adapter in turn, load them all, then swap each into one of 4 device slots in
    turn on a model whose layers are wrapped (as in a started engine), timing each step."""
    model = build()
    adapters = lora.Adapters(model, max_loras=4, max_rank=RANK)
    lora.read(paths[0], model, name="warm-up", max_rank=RANK)  # first-call costs, untimed
    read_ms, read = [], []
    for i, path in enumerate(paths):
        t0 = time.perf_counter()
        read.append(lora.read(path, model, name=f"adapter-{i}", max_rank=RANK))
        read_ms.append((time.perf_counter() - t0) * 1e3)
        adapters.add(read[-1])
    adapters.attach()  # the first 4 resident
    swap_ms = []
    for adapter in read[4:] + read[:4]:  # each swapped over the least recently used slot
        t0 = time.perf_counter()
        adapters.acquire(adapter)
        swap_ms.append((time.perf_counter() - t0) * 1e3)
        adapters.release(adapter)
    assert adapters.swaps == len(read)
    return Residency(read_ms, swap_ms, (paths[0] / "adapter_model.safetensors").stat().st_size,
                     read[0].nbytes, adapters.nbytes // 4, read)


# -- 3. sessions on an adapter -----------------------------------------------------------------


@dataclass
class Sessions:
    name: str
    prompt: int = 0  # the last later turn's prompt
    cached: int = 0  # its cached_tokens
    reused: list[float] = field(default_factory=list)  # the later turns' TTFTs (s)
    fresh: list[float] = field(default_factory=list)  # the fresh prefills' TTFTs (s)


def sessions(served: Served, slot: int, name: str, args, problems: list[str], other_slot: int | None = None) -> Sessions:
    """One session of --history tokens on `slot`: turn 1, the later turns (reused), the fresh
    prefills of the last prompt; with `other_slot`, that prompt under the same session id on
    another adapter too (nothing must be reused)."""
    rng = random.Random(7)
    session, row = f"s-{name}-{rng.random()}", Sessions(name)
    turn(served, tokens_of(random.Random(1), 600), 2, slot)  # a chunked prefill's first-call costs, untimed
    prompt = tokens_of(rng, args.history)
    _, reply, final = turn(served, prompt, REPLY, slot, session)
    if final.cached_tokens != 0:
        problems.append(f"{name}, turn 1: cached_tokens {final.cached_tokens}, expected 0")
    for i in range(args.session_repeats):
        history = prompt + reply
        prompt = history + tokens_of(rng, USER)
        first, reply, final = turn(served, prompt, REPLY, slot, session)
        if final.cached_tokens != len(history) - 1:
            problems.append(f"{name}, turn {i + 2}: cached_tokens {final.cached_tokens} (miss_reason {final.miss_reason!r}), "
                            f"expected {len(history) - 1}")
        row.reused.append(first)
    row.prompt, row.cached = len(prompt), final.cached_tokens
    for _ in range(args.fresh_repeats):
        first, _, final = turn(served, prompt, 1, slot)
        if final.cached_tokens != 0:
            problems.append(f"{name}, fresh prefill: cached_tokens {final.cached_tokens}, expected 0")
        row.fresh.append(first)
    if other_slot is not None:
        _, _, final = turn(served, prompt, 1, other_slot, session)
        if final.cached_tokens != 0:
            problems.append(f"{name}: the session's prompt on adapter slot {other_slot} under the same session id "
                            f"reused {final.cached_tokens} tokens (miss_reason {final.miss_reason!r}), expected 0")
    return row


# -- the tables --------------------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def tables(table: list[Case], res: Residency, rows: list[Sessions], model, args) -> str:
    base_rate = med(table[0].rates)
    base_products, _ = products(model, 0)
    lines = [
        (f"Tiny random-weight Llama-shaped model (hidden 512, 8 layers, vocabulary 49152, untied LM head), fp32, CPU "
         f"({torch.get_num_threads()} threads); PEFT LoRA adapters of rank {RANK} on all 7 projections of every layer. "
         f"{STREAMS} concurrent streams of {args.tokens} greedy tokens (32-token prompts); decode rate after the last stream's "
         f"first token, median of {args.repeats} round(s), each engine's rounds in turn with the others'."),
        "",
        ("| case | resident adapters (rank sum) | streams on an adapter | tokens/s | **/ base alone** "
         "| LoRA products / base's, a token |"),
        "|---|---|---|---|---|---|",
    ]
    for case in table:
        on = sum(1 for s in case.slots if s)
        _, delta = products(model, case.resident * RANK)
        share = f"{delta / base_products:.2f}" if on else "0 (not computed)"
        lines.append(f"| {case.name} | {case.resident} ({case.resident * RANK}) | {on} | {med(case.rates):.0f} "
                     f"| **{med(case.rates) / base_rate:.2f}** | {share} |")
    lines += [
        "",
        (f"Loading an adapter (`lora.read`: its files read and checked, median of {len(res.read_ms)} adapters, max in "
         f"brackets) and swapping one into a device slot (`Adapters.acquire` of an adapter not resident: its A and B "
         f"copied over the least recently used slot's, in every targeted layer; median of {len(res.swap_ms)} swaps, max "
         "in brackets), on a model whose layers are wrapped. Memory: one adapter's A and B in host memory, and one "
         "device slot."),
        "",
        "| file (MiB) | host memory (MiB) | a device slot (MiB) | `lora.read` (ms) | a swap (ms) |",
        "|---|---|---|---|---|",
        (f"| {mib(res.file_bytes)} | {mib(res.weights_bytes)} | {mib(res.slot_bytes)} | {med(res.read_ms):.1f} ({max(res.read_ms):.1f}) "
         f"| {med(res.swap_ms):.2f} ({max(res.swap_ms):.2f}) |"),
        "",
        (f"A later turn of a session ({args.history} tokens of history, then turns of a {REPLY}-token reply and a "
         f"{USER}-token user message; medians of {args.session_repeats} later turns and {args.fresh_repeats} fresh "
         "prefills), reused against a fresh prefill of the same prompt on the same adapter, private cache:"),
        "",
        "| served as | prompt (tokens) | cached tokens | reused TTFT (ms) | fresh TTFT (ms) | **reused / fresh** |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row.name} | {row.prompt} | {row.cached} | {med(row.reused) * 1e3:.0f} | {med(row.fresh) * 1e3:.0f} "
                     f"| **{med(row.reused) / med(row.fresh):.3f}** |")
    if len(rows) == 2:
        lines += ["", f"The adapter's fresh prefill against the base model's: {med(rows[1].fresh) / med(rows[0].fresh):.2f}x."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 tokens a stream, 1 round, 2 later turns")
    parser.add_argument("--tokens", type=int, default=None, help="tokens a stream generates (default 128; --quick 64)")
    parser.add_argument("--repeats", type=int, default=None, help="throughput rounds (default 3; --quick 1)")
    parser.add_argument("--history", type=int, default=1024, help="tokens of a session's first turn")
    parser.add_argument("--session-repeats", type=int, default=None, help="later turns of a session (default 5; --quick 2)")
    parser.add_argument("--fresh-repeats", type=int, default=None, help="fresh prefills of its last prompt (default 3; --quick 1)")
    parser.add_argument("--readme", default=None, help="also write the tables into this file's bench.lora block")
    args = parser.parse_args()
    defaults = {"tokens": (128, 64), "repeats": (3, 1), "session_repeats": (5, 2), "fresh_repeats": (3, 1)}
    for key, (full, quick) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if min(args.repeats, args.session_repeats, args.fresh_repeats) < 1 or args.tokens < 2:
        parser.error("--repeats, --session-repeats and --fresh-repeats must be >= 1, --tokens >= 2")
    torch.set_grad_enabled(False)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    t0, load_before = time.perf_counter(), os.getloadavg()[0]
    tok = tokenizer()
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as root:
        paths = make_adapters(Path(root))
        print(f"{ADAPTERS} adapters made: {time.perf_counter() - t0:.1f} s", flush=True)
        res = residency(paths)
    engines: dict[str, Served] = {}
    try:
        for name, n in (("base", 0), ("1", 1), ("4", 4), ("16", 16)):
            engines[name] = Served(tok, res.adapters[:n])
        print(f"engines started: {time.perf_counter() - t0:.1f} s", flush=True)
        table = throughput(engines, args)
        for name in ("1", "16"):  # the sessions need only the base's and the 4 adapters' engines
            engines.pop(name).stop()
        rows = [sessions(engines["base"], 0, "base model", args, problems),
                sessions(engines["4"], 1, "adapter (4 resident)", args, problems, other_slot=2)]
        model = engines["base"].model
    finally:
        for served in engines.values():
            served.stop()
    text = tables(table, res, rows, model, args)
    print()
    print(text)
    print("\ncached_tokens as expected on every turn" if not problems else "\nUNEXPECTED:\n" + "\n".join(problems))
    print(f"\nwall time {time.perf_counter() - t0:.0f} s; load average (1 min, this run's own threads count in it) "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs")
    if args.readme:
        write_readme_block(Path(args.readme), README_BEGIN, README_END, text)


if __name__ == "__main__":
    main()
