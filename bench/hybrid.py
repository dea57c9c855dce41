"""Hybrid models (recurrent layers beside attention): what session reuse saves in time, what a
session holds in memory, and what resuming an edited history from a checkpoint costs, measured
in one run on tiny random-weight models built here (no downloads).

    .venv/bin/python -m bench.hybrid [--quick] [--lengths 1024,4096,16384] [--repeats 5]
        [--readme docs/benchmarks.md]

The models (fp32 on the CPU, seeded random weights, dense MLPs in both so that they differ only
in their layer kinds): a Qwen3-Next-shaped hybrid (`qwen3_next`: hidden 256, 8 layers, 3:1
gated-delta-net linear attention to full attention, 4 query heads over 2 KV heads of 64) and an
attention-only model of the same hidden size and layer count (`qwen3`, 8 full-attention
layers, the same heads). Vocabulary 49152 (SmolLM2's tokenizer, `bench.architectures.tokenizer`);
prompts are random token ids; replies are greedy with end-of-turn ids biased away, so every
turn's reply is exactly `--reply` tokens.

Each model runs in its own in-process `Engine` over a `CacheManager` (the server's defaults:
512-token prefill chunks). Per history length N, one session plays:

* turn 1: N tokens of history (the session's first prefill);
* `--repeats` extension turns: the history so far + the reply + a new user message of `--user`
  tokens; reused from the state at the end of the previous turn (cached_tokens checked);
* `--repeats` edits of the last turn: its user message with its second half rewritten; it
  resumes from the checkpoint kept at the start of that turn (miss_reason
  "recurrent_checkpoint", cached_tokens checked) and recomputes the whole new message;
* fresh: the last extension turn's prompt and the last edited prompt, each on a private cache
  (no session: a prefill from the first token).

TTFT = submit to the first output token, on the caller's clock, medians over the repeats.
Tables:

1. later-turn TTFT, reused / fresh (goal <= 0.05);
2. memory per session after turn 1 and the extension turns, at the same token count on both
   models: the hybrid's KV blocks (`kv.nbytes`, its attention layers only) plus its recurrent
   state (`pool.states.spec.nbytes` per slot: the current state and each kept checkpoint),
   against the attention-only model's KV (which plays the same turns);
3. the edited turn's TTFT against a fresh prefill of the same prompt and against a plain
   extension turn.

`--readme FILE` also writes the tables into FILE between the markers `<!-- bench.hybrid:
begin -->` and `<!-- bench.hybrid: end -->` (README_BEGIN, README_END).

Full run: 1 to 2 minutes on the 2-core dev box (the 16k-token prefills most of it);
`--quick` (1k and 4k only): about 30 s.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.architectures import tokenizer
from bench.common import write_readme_block
from cache_manager import kv
from cache_manager.manager import CacheConfig, CacheManager
from server.engine import families
from server.engine.core import Engine, EngineConfig, end_of_turn_ids
from server.engine.sampling import SamplingParams
from server.engine.sequence import GenerationRequest

README_BEGIN = "<!-- bench.hybrid: begin -->"
README_END = "<!-- bench.hybrid: end -->"

LAYERS = 8
HYBRID_LAYERS = ["linear_attention"] * 3 + ["full_attention"]  # Qwen3-Next's 3:1, repeated
COMMON = {
    "vocab_size": 49152, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 32768, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "tie_word_embeddings": False,
}
HYBRID = {
    "layer_types": HYBRID_LAYERS * (LAYERS // len(HYBRID_LAYERS)), "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
    "mlp_only_layers": list(range(LAYERS)),  # dense MLPs, as the attention-only model's
}
BUDGET = {"hybrid": 2**28, "attention": 2**29}  # each engine's KV pool (and the hybrid's state slots)
MAX_BATCH_TOKENS = 512
WARM_UP = 3 * MAX_BATCH_TOKENS  # the warm-up prompt's tokens


# -- the models and their engines --------------------------------------------------------------


def build(kind: str):
    """The tiny model of `kind` ("hybrid" or "attention"), seeded, in eval mode."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_next", **COMMON, **HYBRID) if kind == "hybrid" else AutoConfig.for_model("qwen3", **COMMON)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@dataclass
class Turn:
    """One request: its prompt, reply, TTFT and what the cache manager said."""

    prompt: list[int]
    reply: list[int]
    ttft: float
    cached: int
    miss: str | None


class Served:
    """One started engine over `model` with its own pool; the server's checks at start."""

    def __init__(self, model, tok, max_context: int, budget: int) -> None:
        families.check(model)  # as the server does before it sizes a cache
        self.cache = CacheManager(model.config, torch.device("cpu"), torch.float32, max_context, CacheConfig(budget_bytes=budget))
        config = EngineConfig(max_context=max_context, max_batch_tokens=MAX_BATCH_TOKENS)
        self.engine = Engine(model, tok, config, self.cache)
        self.no_eos = {i: -100.0 for i in end_of_turn_ids(model, tok)}  # every reply runs to max_tokens
        self.engine.start()

    def turn(self, prompt: list[int], max_tokens: int, session: str | None = None) -> Turn:
        """Run one greedy request (a private cache without `session`) to its end."""
        return asyncio.run(self._turn(prompt, max_tokens, session))

    async def _turn(self, prompt: list[int], max_tokens: int, session: str | None) -> Turn:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logit_bias=self.no_eos)
        request = GenerationRequest(f"r{time.monotonic_ns()}", prompt, params, session_id=session, use_session=session is not None)
        start = time.perf_counter()
        ttft, reply, final = None, [], None
        async for out in self.engine.submit(request, asyncio.get_running_loop()):
            if out.tokens and ttft is None:
                ttft = time.perf_counter() - start
            reply += [t.token_id for t in out.tokens]
            final = out
        if final is None or final.finish_reason != "length":
            raise RuntimeError(f"request ended {final and final.finish_reason} ({final and final.error})")
        return Turn(prompt, reply, ttft, final.cached_tokens, final.miss_reason)

    def session_bytes(self, session: str) -> tuple[int, int, int, int]:
        """(tokens, KV bytes, state slots, bytes a slot) the idle session holds: its blocks, and
        on a hybrid one state slot for its current state plus one per kept checkpoint."""
        entry = next(e for e in self.cache.store.entries() if e.session_id == session)
        states = self.cache.pool.states
        if states is None:
            return len(entry.tokens), kv.nbytes(entry.kv), 0, 0
        return len(entry.tokens), kv.nbytes(entry.kv), 1 + len(entry.kv.checkpoints), states.spec.nbytes

    def stop(self) -> None:
        self.engine.stop()


# -- one history length ------------------------------------------------------------------------


@dataclass
class Row:
    """What one history length measured on one model."""

    n: int
    extension: list[float] = field(default_factory=list)
    edit: list[float] = field(default_factory=list)
    fresh: list[float] = field(default_factory=list)  # the last extension turn's prompt, private cache
    fresh_edit: list[float] = field(default_factory=list)  # the last edited prompt, private cache
    tokens: int = 0  # the session after turn 1 and the extension turns
    kv_bytes: int = 0
    slots: int = 0  # recurrent-state slots it holds, of `slot_bytes` each
    slot_bytes: int = 0
    prompt: int = 0  # the last extension turn's prompt length
    problems: list[str] = field(default_factory=list)


def tokens_of(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(n)]


def edited(message: list[int], rng: random.Random) -> list[int]:
    """The message with its second half rewritten (its first token kept, at least)."""
    keep = max(1, len(message) // 2)
    return message[:keep] + tokens_of(rng, len(message) - keep)


def check(row: Row, what: str, turn: Turn, cached: int, miss: str | None) -> None:
    if (turn.cached, turn.miss) != (cached, miss):
        row.problems.append(f"N={row.n} {what}: cached_tokens {turn.cached}, miss_reason {turn.miss!r}; "
                            f"expected {cached}, {miss!r}")


def play(served: Served, n: int, args, *, edits: bool, fresh: bool) -> Row:
    """One session of N tokens of history on `served`: turn 1, the extension turns, then (with
    `edits`) the edits of the last turn, and (with `fresh`) the fresh prefills; the session's
    memory is read after the extension turns."""
    rng = random.Random(n)
    row, session = Row(n), f"s{n}-{rng.random()}"
    t = served.turn(tokens_of(rng, n), args.reply, session)
    check(row, "turn 1", t, 0, "new_session")
    history = t.prompt + t.reply
    for i in range(args.repeats):
        message = tokens_of(rng, args.user)
        t = served.turn(history + message, args.reply, session)
        check(row, f"extension {i + 1}", t, len(history) - 1, None)
        row.extension.append(t.ttft)
        start, last = history, t
        history = t.prompt + t.reply
    row.tokens, row.kv_bytes, row.slots, row.slot_bytes = served.session_bytes(session)
    row.prompt = len(last.prompt)
    edit_prompt = None
    if edits:
        message = last.prompt[len(start):]
        for i in range(args.repeats):
            edit_prompt = start + edited(message, rng)
            t = served.turn(edit_prompt, args.reply, session)
            check(row, f"edit {i + 1}", t, len(start) - 1, "recurrent_checkpoint")
            row.edit.append(t.ttft)
    if fresh:
        for _ in range(args.fresh_repeats if n <= 4096 else 1):
            row.fresh.append(served.turn(last.prompt, 1).ttft)
            if edit_prompt is not None:
                row.fresh_edit.append(served.turn(edit_prompt, 1).ttft)
    return row


def warm_up(served: Served) -> None:
    """A prefill of several chunks and a few decode steps, so the first measured turn pays no
    first-call costs."""
    served.turn(tokens_of(random.Random(0), WARM_UP), 4)


def run_model(kind: str, tok, args, *, edits: bool, fresh: bool) -> list[Row]:
    model = build(kind)
    longest = max(args.lengths) + (args.repeats + 2) * (args.user + args.reply)  # a session's last prompt and reply, about
    served = Served(model, tok, max(longest, WARM_UP + 64), BUDGET[kind])
    try:
        warm_up(served)
        rows = []
        for n in args.lengths:
            t0 = time.perf_counter()
            rows.append(play(served, n, args, edits=edits, fresh=fresh))
            print(f"{kind} N={n}: {time.perf_counter() - t0:.1f} s", flush=True)
        return rows
    finally:
        served.stop()


# -- the tables --------------------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def tables(hybrid: list[Row], attention: list[Row], args) -> str:
    lines = [
        (f"Tiny random-weight models, fp32, CPU ({torch.get_num_threads()} threads): a Qwen3-Next-shaped hybrid "
        f"(hidden 256, {LAYERS} layers, 3:1 gated delta-net : full attention) and an attention-only qwen3 of the same "
        f"size; replies of {args.reply} tokens, new user messages of {args.user}; medians of {args.repeats} turns "
        f"(fresh prefills: of {args.fresh_repeats} up to 4k tokens, of 1 past)."),
        "",
        ("Later-turn TTFT on the hybrid, session reuse against a fresh prefill of the same prompt (and, for scale, "
         "the attention-only model's reused turn of the same length):"),
        "",
        "| history (tokens) | prompt | reused TTFT (s) | fresh TTFT (s) | **reused / fresh** | attention-only reused TTFT (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r, a in zip(hybrid, attention):
        lines.append(f"| {r.n} | {r.prompt} | {med(r.extension):.3f} | {med(r.fresh):.3f} | **{med(r.extension) / med(r.fresh):.3f}** "
                     f"| {med(a.extension):.3f} |")
    lines += [
        "",
        (f"Memory one idle session holds after those turns (hybrid: KV of its {LAYERS // 4} attention layers + "
        f"recurrent state, {hybrid[0].slot_bytes / 2**10:.0f} KiB a slot: the current state and each kept checkpoint, at most "
        f"{kv.MAX_CHECKPOINTS}; attention-only: KV of {LAYERS} layers):"),
        "",
        ("| history (tokens) | session tokens | hybrid KV (MiB) | hybrid state (MiB, slots) | hybrid total (MiB) "
        "| attention-only KV (MiB) | **hybrid / attention-only** |"),
        "|---|---|---|---|---|---|---|",
    ]
    for h, a in zip(hybrid, attention):
        state = h.slots * h.slot_bytes
        total = h.kv_bytes + state
        same = "" if h.tokens == a.tokens else f" (attention-only: {a.tokens})"
        lines.append(f"| {h.n} | {h.tokens}{same} | {mib(h.kv_bytes)} | {mib(state)} ({h.slots}) | {mib(total)} "
                     f"| {mib(a.kv_bytes)} | **{total / a.kv_bytes:.3f}** |")
    lines += [
        "",
        ("An edited last user message on the hybrid (resumes from the checkpoint at its turn's start, recomputes the "
        "new message), against a fresh prefill of the same prompt and against a plain extension turn:"),
        "",
        "| history (tokens) | edited TTFT (s) | fresh TTFT (s) | extension TTFT (s) | **edited / fresh** | **edited / extension** |",
        "|---|---|---|---|---|---|",
    ]
    for r in hybrid:
        lines.append(f"| {r.n} | {med(r.edit):.3f} | {med(r.fresh_edit):.3f} | {med(r.extension):.3f} "
                     f"| **{med(r.edit) / med(r.fresh_edit):.3f}** | **{med(r.edit) / med(r.extension):.2f}** |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1k and 4k tokens of history only")
    parser.add_argument("--lengths", default=None, help="comma-separated history lengths (default 1024,4096,16384)")
    parser.add_argument("--repeats", type=int, default=5, help="extension turns and edits per length")
    parser.add_argument("--fresh-repeats", type=int, default=2, help="fresh prefills per prompt up to 4k tokens (1 past)")
    parser.add_argument("--user", type=int, default=48, help="tokens of each new user message")
    parser.add_argument("--reply", type=int, default=8, help="tokens of each reply")
    parser.add_argument("--readme", default=None, help="also write the tables into this file's bench.hybrid block")
    args = parser.parse_args()
    args.lengths = [int(x) for x in (args.lengths or ("1024,4096" if args.quick else "1024,4096,16384")).split(",")]
    if args.repeats < 1 or args.fresh_repeats < 1:
        parser.error("--repeats and --fresh-repeats must be >= 1")
    torch.set_grad_enabled(False)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    tok = tokenizer()
    hybrid = run_model("hybrid", tok, args, edits=True, fresh=True)
    attention = run_model("attention", tok, args, edits=False, fresh=False)
    text = tables(hybrid, attention, args)
    print()
    print(text)
    problems = [p for r in hybrid + attention for p in r.problems]
    print("\ncached_tokens and miss_reason as expected on every turn" if not problems else "\nUNEXPECTED:\n" + "\n".join(problems))
    print(f"\nwall time {time.perf_counter() - t0:.0f} s")
    if args.readme:
        write_readme_block(Path(args.readme), README_BEGIN, README_END, text)


if __name__ == "__main__":
    main()
