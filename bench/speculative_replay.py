"""How far prompt lookup could go on bench.speculative's replies: an offline replay that
compares the drafts the server makes with drafts that know the reply in advance.

    .venv/bin/python -m bench.speculative_replay [--workloads "code-edit (Python)",...]

For each workload's first request (bench/speculative.py), in-process on the default model:
the greedy reply is decoded with kvserve's own forward pass, one token per step; the forward
pass over 1-32 positions is timed at that context (median of 7); then the reply is replayed
step by step with drafts from

  shipped      prompt lookup as the server runs it (NgramProposer, draft lengths by `allocate`
               from the row's acceptance rate and the timed step costs), from an even start
               (a server's new sequences start from its recent rates);
  best source  at every step the earlier occurrence of the last token whose continuation
               matches the reply longest (knows the future), draft lengths as shipped;
  perfect      exactly the longest run of the reply's next tokens that follows an earlier
               occurrence of the last token, when drafting it pays (knows the future);
  perfect, 4 streams
               the 4 streams' replies of bench.speculative decoded in one batch, every row
               drafting its perfect run at every step, against the same batch without drafts
               (the forward pass of 4 rows timed at 1-16 positions each).

Ratio = decode time with no drafts / with them: the sum over steps of the timed cost of each
step's positions (prefill, HTTP and grammar work left out, so the server's own on/off ratios
come out lower). A reply the model rewrites rather than copies caps even the perfect drafter.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench import speculative as workloads
from cache_manager import kv
from server.engine import model_runner
from server.engine.attention import Row
from server.engine.core import end_of_turn_ids
from server.model_loader import load_model
from server.engine.prompt_lookup import NgramProposer
from server.settings import Settings, default_cache_dir
from server.engine.speculative import Draft, SpecState, StepCost, allocate

SIZES = (*range(1, 17), 20, 24, 28, 32)  # positions one row is timed at
STREAMS = 4  # the perfect drafter also runs bench.speculative's 4 streams in one batch


def greedy_reply(model, prompt: list[int], max_tokens: int, eos: frozenset[int]) -> tuple[list[int], kv.SequenceKV]:
    """The greedy reply (kvserve's forward pass, one token per step) and the cache it leaves."""
    cache = kv.allocate(model.config, len(prompt) + max_tokens + 64, model.device, model.dtype)
    logits = model_runner.forward_rows(model, [Row(cache, len(prompt))], prompt, [0])
    reply: list[int] = []
    while len(reply) < max_tokens:
        token = int(torch.argmax(logits[0]))
        if token in eos:
            break
        reply.append(token)
        logits = model_runner.forward_rows(model, [Row(cache, 1)], [token], [0])
    return reply, cache


def step_cost(model, rows: list[tuple[kv.SequenceKV, list[int]]], sizes, repeats: int) -> StepCost:
    """The forward pass of all `rows` (a cache holding the ids, the ids) at the end of their
    ids, timed at each of `sizes` positions per row (median of `repeats`), by its total
    positions."""
    cost = StepCost()
    for n in sizes:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            # any ids time alike
            model_runner.forward_rows(model, [Row(c, n) for c, _ in rows], [t for _, ids in rows for t in ids[-n:]], list(range(len(rows))), [n] * len(rows))
            times.append(time.perf_counter() - start)
            for c, _ in rows:
                kv.crop(c, kv.length(c) - n)
        cost.observe(n * len(rows), statistics.median(times))
    return cost


class _Seq:
    def __init__(self, prompt: list[int]) -> None:
        self.prompt_ids = prompt
        self.all_ids: list[int] = []
        self.spec = SpecState()


class BestSource(NgramProposer):
    """Drafts from the earlier occurrence of the last token whose continuation matches the
    reply longest (the replay's future: `ids`, prompt and reply)."""

    def __init__(self, ids: list[int]) -> None:
        super().__init__()
        self.ids = ids

    def limit(self, seq, k: int) -> int:
        ids, n = seq.all_ids, len(seq.all_ids)
        best, best_run = None, -1
        for end in range(n - 1):
            if ids[end] == ids[-1]:
                run = _common(ids, end + 1, self.ids, n, n - end - 1)  # copies known tokens only
                if run > best_run:
                    best, best_run = end, run
        seq.spec.proposer = best
        return 0 if best is None else min(k, n - best - 1)

    def propose(self, seqs: list, ks: list[int]) -> list[Draft]:
        return [Draft(s.all_ids[s.spec.proposer + 1 : s.spec.proposer + 1 + k]) for s, k in zip(seqs, ks)]

    def peek(self, seq) -> int:
        return seq.all_ids[seq.spec.proposer + 1]


def _common(a: list[int], i: int, b: list[int], j: int, limit: int) -> int:
    """Length of the common run of a[i:] and b[j:], at most `limit`."""
    n = 0
    while n < limit and i + n < len(a) and j + n < len(b) and a[i + n] == b[j + n]:
        n += 1
    return n


def replay(prompt: list[int], reply: list[int], proposer, cost: StepCost, max_draft: int) -> float:
    """Decode seconds of `reply` with drafts as the server chooses them (Speculator.draft, one
    row): a step computes the pending token and its draft, keeps the accepted prefix."""
    seq, seconds, i = _Seq(prompt), 0.0, 0
    while i < len(reply):
        seq.all_ids = prompt + reply[: i + 1]
        i += 1
        k = min(max_draft, len(reply) - i)
        spec = seq.spec
        spec.settle_shadow(seq.all_ids)
        k = proposer.limit(seq, k) if k > 0 else 0
        if k > 0:
            k = allocate([spec.alpha], [k], 1, lambda n: cost.seconds(1 + n), 1 << 30)[0]
            if k == 0:
                spec.skip(len(seq.all_ids), proposer.peek(seq))
        if k > 0:
            draft = proposer.propose([seq], [k])[0].tokens
            accepted = _common(draft, 0, reply, i, len(draft))
            spec.record(len(draft), accepted)
            i += accepted
        seconds += cost.seconds(1 + k)
    return seconds


def perfect(prompt: list[int], reply: list[int], cost: StepCost, max_draft: int) -> float:
    """Decode seconds of `reply` when every step drafts exactly the longest run of the reply's
    next tokens that follows an earlier occurrence of the last token (if drafting it pays)."""
    seconds, i = 0.0, 0
    while i < len(reply):
        i += 1
        run = _perfect_run(prompt, reply, i, max_draft)
        if run and (run + 1) / cost.seconds(1 + run) <= 1 / cost.seconds(1):
            run = 0
        seconds += cost.seconds(1 + run)
        i += run
    return seconds


def _perfect_run(prompt: list[int], reply: list[int], i: int, max_draft: int) -> int:
    """The longest run of reply[i:] (at most max_draft) that follows an earlier occurrence of
    the last known token, reply[i - 1]."""
    ids, n = prompt + reply, len(prompt) + i  # ids[:n] are known
    run = max((_common(ids, end + 1, ids, n, min(max_draft, n - end - 1)) for end in range(n - 1) if ids[end] == ids[n - 1]), default=0)
    return min(run, len(reply) - i)


def batch_cost(model, rows: list[tuple[list[int], list[int]]]) -> StepCost:
    """The forward pass of all `rows` (prompt, reply) at the end of their replies, timed at
    1-16 positions each (median of 5), by its total positions."""
    held = []
    for prompt, reply in rows:
        ids = prompt + reply
        cache = kv.allocate(model.config, len(ids) + 64, model.device, model.dtype)
        model_runner.forward_rows(model, [Row(cache, len(ids))], ids, [0])
        held.append((cache, ids))
    return step_cost(model, held, range(1, 17), repeats=5)


def lockstep(rows: list[tuple[list[int], list[int]]], cost: StepCost, max_draft: int, drafts: bool) -> float:
    """Decode seconds of the rows' replies in one batch: every step each unfinished row
    computes its pending token and, with `drafts`, its perfect run (`_perfect_run`)."""
    done, seconds = [0] * len(rows), 0.0
    while any(i < len(reply) for i, (_, reply) in zip(done, rows)):
        positions = 0
        for j, (prompt, reply) in enumerate(rows):
            if done[j] < len(reply):
                done[j] += 1
                run = _perfect_run(prompt, reply, done[j], max_draft) if drafts else 0
                positions += 1 + run
                done[j] += run
        seconds += cost.seconds(positions)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", type=lambda s: s.split(","), default=["code-edit (Python)", "code-edit (JavaScript)", "chat"])
    args = parser.parse_args()
    settings = Settings()
    loaded = load_model(None, cache_dir=default_cache_dir(), device="cpu", dtype="float32")
    tok = loaded.tokenizer
    eos = end_of_turn_ids(loaded.model, tok)
    max_draft = settings.speculative_max_draft
    print(f"\nprompt lookup replayed against drafts that know the reply (SmolLM2-135M fp32, CPU, "
          f"decode only, up to {max_draft} drafted tokens per step)\n")
    print(f"| workload | reply tokens | no drafts (s) | **shipped** | best source | perfect | perfect, {STREAMS} streams |")
    print("|---|---|---|---|---|---|---|")
    for workload in args.workloads:
        rows = []  # (prompt, reply) of each stream's request
        for i in range(STREAMS):
            body = workloads.requests(workload, i)
            text = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
            prompt = tok(text, add_special_tokens=False)["input_ids"]
            reply, cache = greedy_reply(loaded.model, prompt, body["max_tokens"], eos)
            rows.append((prompt, reply))
            if i == 0:
                cost = step_cost(loaded.model, [(cache, prompt + reply)], SIZES, repeats=7)
            del cache
        prompt, reply = rows[0]
        base = len(reply) * cost.seconds(1)
        ratios = [
            base / replay(prompt, reply, NgramProposer(settings.speculative_ngram_min, settings.speculative_ngram_max), cost, max_draft),
            base / replay(prompt, reply, BestSource(prompt + reply), cost, max_draft),
            base / perfect(prompt, reply, cost, max_draft),
        ]
        batch = batch_cost(loaded.model, rows)
        ratios.append(lockstep(rows, batch, max_draft, drafts=False) / lockstep(rows, batch, max_draft, drafts=True))
        print(f"| {workload} | {len(reply)} | {base:.2f} | **{ratios[0]:.2f}** | " + " | ".join(f"{r:.2f}" for r in ratios[1:]) + " |", flush=True)
    print("\n    .venv/bin/python -m bench.speculative_replay")


if __name__ == "__main__":
    main()
