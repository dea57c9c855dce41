"""Thinking models: how much of a later turn's prompt a session serves from cache when the
template drops earlier thinking, and what the thinking budget does to a turn's cost.

    .venv/bin/python -m bench.thinking [--turns 4] [--readme README.md]

The models are tests/thinking.py's: tiny random-weight Llamas over tokenizers with each
family's markers and chat templates reproducing each family's (no weights can be downloaded
here), saved to a directory and served by a real `kvserve serve` process, driven with the
official openai client. What they show is the server's bookkeeping, which the weights do not
change: which tokens a turn reuses, and how many tokens a budget lets the thinking take.

1. Sessions: a `--turns`-turn chat in one session (the budget makes every turn think), each
   answer sent back with its `reasoning_content`. Per later turn, the share of its prompt
   served from cache (`cached_tokens / prompt_tokens`), for DeepSeek-R1 (drops all earlier
   thinking), Qwen3 (drops thinking before the last question) and Qwen3 with
   `chat_template_kwargs: {"preserve_thinking": true}` (keeps it). Each turn is also sent alone
   in a fresh session: "identical" counts the turns whose answer (reasoning included) equals
   that fresh prefill's.
2. Budget: one DeepSeek-R1 turn with `max_tokens` 256 under thinking budgets 0, 16, 64 and
   none: completion and reasoning tokens and the turn's wall time, each the median of 3.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from openai import OpenAI

from bench.common import launch
from server.model_loader import load_model
from server.settings import default_cache_dir
from tests import thinking

README_START, README_END = "<!-- bench.thinking:start -->", "<!-- bench.thinking:end -->"


def save_family(base, family: str, root: Path) -> Path:
    """tests/thinking.py's tiny model of `family`, saved where `kvserve serve --model` reads it."""
    loaded = thinking.tiny_model(thinking.family_tokenizer(base, family))
    path = root / family
    loaded.model.save_pretrained(path)
    loaded.tokenizer.save_pretrained(path)
    return path


def question(turn: int) -> dict:
    return {"role": "user", "content": f"Question {turn}: what is {turn} + {turn}?"}


def turn_messages(answers: list[dict], turn: int) -> list[dict]:
    messages = []
    for t in range(turn + 1):
        messages.append(question(t))
        if t < turn:
            messages.append(answers[t])
    return messages


def ask(client: OpenAI, model: str, messages: list[dict], session: str, body: dict, grammar: bool):
    extra = {"response_format": {"type": "json_object"}} if grammar else {}
    return client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=48, **extra,
        extra_body={"max_reasoning_tokens": 12, "prompt_cache_key": session, **body})


def sessions(client: OpenAI, model: str, turns: int, body: dict, grammar: bool) -> tuple[list[float], int]:
    """Per later turn the share of its prompt served from cache, and how many turns equal a
    fresh prefill of the same messages."""
    answers, shares, identical = [], [], 0
    tag = f"{model}-{sorted(body.items())}"
    for turn in range(turns):
        out = ask(client, model, turn_messages(answers, turn), f"chat-{tag}", body, grammar)
        message = out.choices[0].message
        if turn:
            shares.append(out.usage.prompt_tokens_details.cached_tokens / out.usage.prompt_tokens)
        fresh = ask(client, model, turn_messages(answers, turn), f"fresh-{tag}-{turn}", body, grammar)
        identical += fresh.choices[0].message == message
        answers.append({"role": "assistant", "content": message.content or "",
                        "reasoning_content": (message.model_extra or {}).get("reasoning_content")})
    return shares, identical


def budget_costs(client: OpenAI, model: str) -> list[tuple[str, int, int, float]]:
    rows = []
    for budget in (0, 16, 64, None):
        runs = []
        for i in range(3):
            t0 = time.perf_counter()
            out = client.chat.completions.create(
                model=model, messages=[question(0)], temperature=0, max_tokens=256,
                extra_body={"max_reasoning_tokens": budget, "prompt_cache_key": f"budget-{budget}-{i}"})
            runs.append((time.perf_counter() - t0, out.usage))
        seconds = statistics.median(r[0] for r in runs)
        usage = runs[0][1]
        rows.append(("none" if budget is None else str(budget), usage.completion_tokens,
                     usage.completion_tokens_details.reasoning_tokens, seconds))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--readme", type=Path, help="write the tables into this README between the markers")
    args = parser.parse_args()
    base = load_model(None, cache_dir=default_cache_dir()).tokenizer
    lines = [f"Sessions, {args.turns} turns (share of each later turn's prompt served from cache):", "",
             "| template | turn 2 | turn 3 | turn 4 | answers identical to a fresh prefill |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cases = [("deepseek_r1", "DeepSeek-R1 (drops earlier thinking)", {}, False),
                 ("qwen3", "Qwen3 (drops thinking before the last question)", {}, True),
                 ("qwen3", "Qwen3, `preserve_thinking: true` (keeps it)", {"chat_template_kwargs": {"preserve_thinking": True}}, True)]
        paths = {family: save_family(base, family, root) for family in {c[0] for c in cases}}
        for family in paths:
            with launch(root, "--model", str(paths[family]), "--served-model-name", family) as server:
                client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
                for name, label, body, grammar in (c for c in cases if c[0] == family):
                    shares, identical = sessions(client, name, args.turns, body, grammar)
                    cells = [f"{s:.0%}" for s in shares] + [""] * (3 - len(shares))
                    lines.append(f"| {label} | {' | '.join(cells[:3])} | {identical}/{args.turns} |")
                if family == "deepseek_r1":
                    budget_rows = budget_costs(client, family)
    lines += ["", "Thinking budget, one DeepSeek-R1 turn with `max_tokens` 256 (median of 3):", "",
              "| max_reasoning_tokens | completion tokens | reasoning tokens | seconds |", "|---|---|---|---|"]
    lines += [f"| {b} | {c} | {r} | {s:.2f} |" for b, c, r, s in budget_rows]
    table = "\n".join(lines)
    print(table)
    if args.readme:
        text = args.readme.read_text()
        start, end = text.index(README_START) + len(README_START), text.index(README_END)
        args.readme.write_text(text[:start] + "\n" + table + "\n" + text[end:])


if __name__ == "__main__":
    main()
