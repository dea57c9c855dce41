"""Interleaved multi-turn sessions: later-turn TTFT with session KV reuse against the same
server with reuse switched off, measured in one run.

    .venv/bin/python -m bench.sessions [--sessions 4] [--turns 4] [--doc-tokens 1500]

S sessions x T turns, round-robin (session 1 turn 1, session 2 turn 1, ..., session 1 turn 2,
...), each session with its own ~1.5k-token document as system prompt, streamed through the
openai SDK with `prompt_cache_key`. TTFT = request start to the first content chunk.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from openai import OpenAI

from bench.common import launch

WORDS = (
    "harbor lantern keeper storm ledger copper signal tide northern cliff rope engine winter "
    "season village market letter captain orchard bridge mill river granite chapel ferry "
    "weather archive island compass beacon supply record voyage current shoal reef gale"
).split()


def document(seed: int, tokens: int) -> str:
    rng = random.Random(seed)
    sentences = []
    while len(" ".join(sentences).split()) < tokens * 0.8:  # ~1.25 tokens per word here
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 16))).capitalize() + ".")
    return " ".join(sentences)


def stream_turn(client: OpenAI, model: str, messages: list, session: str, max_tokens: int):
    start = time.perf_counter()
    ttft, text, usage = None, "", None
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, prompt_cache_key=session,
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - start
            text += chunk.choices[0].delta.content
        if chunk.usage:
            usage = chunk.usage
    return ttft, text, usage


def run(base_url: str, args) -> dict:
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    convs = {f"s{i}": [{"role": "system", "content": "Answer from this document.\n" + document(i, args.doc_tokens)}] for i in range(args.sessions)}
    later, prompt_tokens, cached_tokens, doc_len = [], 0, 0, 0
    outputs = []
    for turn in range(args.turns):
        for session, messages in convs.items():
            messages.append({"role": "user", "content": f"Question {turn}: what does the document say about item {turn}?"})
            ttft, text, usage = stream_turn(client, model, messages, session, args.max_tokens)
            messages.append({"role": "assistant", "content": text})
            outputs.append(text)
            prompt_tokens += usage.prompt_tokens
            cached_tokens += usage.prompt_tokens_details.cached_tokens
            doc_len = max(doc_len, usage.prompt_tokens)
            if turn > 0:
                later.append(ttft)
    return {"later_ttft": statistics.median(later), "cache_share": cached_tokens / prompt_tokens, "outputs": outputs, "prompt": doc_len}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as logs:
        for name, flags in (("reuse", ()), ("no reuse", ("--no-session-reuse",))):
            with launch(logs, *flags) as server:
                results[name] = run(server.base_url, args)
    on, off = results["reuse"], results["no reuse"]
    print(f"{args.sessions} sessions x {args.turns} turns, round-robin, ~{on['prompt']} prompt tokens by the last turn, "
          f"streamed (SmolLM2-135M fp32, CPU)\n")
    print("| server | median later-turn TTFT (s) | prompt tokens from cache |")
    print("|---|---|---|")
    print(f"| kvserve, session reuse | {on['later_ttft']:.3f} | {on['cache_share']:.0%} |")
    print(f"| kvserve, reuse off | {off['later_ttft']:.3f} | {off['cache_share']:.0%} |")
    print(f"| **ratio reuse / off** | **{on['later_ttft'] / off['later_ttft']:.3f}** | |")
    same = sum(a == b for a, b in zip(on["outputs"], off["outputs"]))
    print(f"\ngreedy outputs identical with and without reuse: {same} of {len(on['outputs'])}")


if __name__ == "__main__":
    main()
