"""Later-turn TTFT of ~1.5k-token sessions whose KV is resident, restored from the disk tier,
restored after a server restart, or recomputed, as ratios to recomputing; measured in one run.

    .venv/bin/python -m bench.tiers [--sessions 3] [--doc-tokens 1500]
    python -m bench.tiers --tier host --doc-tokens 7000 --kv-bytes-per-token 23040   # GPU, bf16

One server with a disk tier (or, `--tier host`, a host-memory tier: CUDA only) and a device
budget that holds one such session:

* resident: a session's next turn right after its previous one;
* restored from disk: its next turn after another session's turn evicted it to disk;
* recomputed: the same prompt under a new session id (a full prefill);
* after a restart (disk tier): SIGTERM (the sessions are written), a new server over the same
  directory, each session's next turn.

Every turn is streamed through the openai SDK with `prompt_cache_key`; TTFT = request start to
the first content chunk. Greedy replies of the restored turns are compared with the recomputed
ones.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from openai import OpenAI

from bench.common import launch
from bench.sessions import document, stream_turn
from cache_manager.kv import BLOCK_SIZE, blocks_for


def turn(client: OpenAI, model: str, messages: list, session: str, question: str, max_tokens: int):
    """Ask `question` in `session` (the messages are not changed); (ttft, text, cached)."""
    ttft, text, usage = stream_turn(client, model, [*messages, {"role": "user", "content": question}], session, max_tokens)
    return ttft, text, usage.prompt_tokens_details.cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--doc-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--tier", choices=["disk", "host"], default="disk")
    parser.add_argument("--kv-bytes-per-token", type=int, default=46080, help="KV bytes per token (SmolLM2: fp32 46080, bf16 23040)")
    args = parser.parse_args()
    restored = f"restored from {args.tier}"
    times: dict[str, list[float]] = {"resident": [], restored: [], "recomputed": []}
    if args.tier == "disk":
        times["restored after a restart"] = []
    bucket_bytes = blocks_for(int(args.doc_tokens * 1.3)) * BLOCK_SIZE * args.kv_bytes_per_token
    same = total = 0
    convs = {f"s{i}": [{"role": "system", "content": "Answer from this document.\n" + document(i, args.doc_tokens)}] for i in range(args.sessions)}
    with tempfile.TemporaryDirectory() as logs:
        tier = ("--kv-disk-dir", str(Path(logs) / "kv")) if args.tier == "disk" else ("--kv-host-bytes", str(bucket_bytes * 2 * args.sessions))
        # the context is what the budget holds (a smaller budget than one full context is refused)
        context = int(blocks_for(int(args.doc_tokens * 1.3)) * 1.5) * BLOCK_SIZE
        flags = (*tier, "--kv-budget-bytes", str(int(bucket_bytes * 1.5)), "--max-model-len", str(context))
        with launch(logs, *flags) as server:
            client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)
            model = client.models.list().data[0].id
            for session, messages in convs.items():
                _, text, _ = turn(client, model, messages, session, "What is this document about?", args.max_tokens)
                messages += [{"role": "user", "content": "What is this document about?"}, {"role": "assistant", "content": text}]
                ttft, _, cached = turn(client, model, messages, session, "Name one place in it.", args.max_tokens)
                assert cached > 0
                times["resident"].append(ttft)
            for session, messages in convs.items():  # each was evicted by the next one
                ttft, text, cached = turn(client, model, messages, session, "Name one thing in it.", args.max_tokens)
                assert cached > 0, "not restored"
                times[restored].append(ttft)
                ttft, fresh, cached = turn(client, model, messages, session + "-fresh", "Name one thing in it.", args.max_tokens)
                assert cached == 0
                times["recomputed"].append(ttft)
                same, total = same + (text == fresh), total + 1
        if args.tier == "disk":  # SIGTERM wrote every session; a new server over the same directory
            with launch(logs, *flags) as server:
                client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)
                for session, messages in convs.items():
                    ttft, text, cached = turn(client, model, messages, session, "Name one thing in it.", args.max_tokens)
                    assert cached > 0, "not restored after the restart"
                    times["restored after a restart"].append(ttft)
                    _, fresh, _ = turn(client, model, messages, session + "-fresh2", "Name one thing in it.", args.max_tokens)
                    same, total = same + (text == fresh), total + 1
    recompute = statistics.median(times["recomputed"])
    print(f"{args.sessions} sessions of ~{args.doc_tokens} document tokens, device budget for one, {args.tier} tier on\n")
    print("| later turn | median TTFT (s) | ratio to recompute |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.3f} | {statistics.median(values) / recompute:.3f}x |")
    print(f"\ngreedy replies of restored turns identical to recomputed ones: {same} of {total}")


if __name__ == "__main__":
    main()
