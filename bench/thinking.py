"""Thinking models: how much of a later turn's prompt a session serves from cache when the
template drops earlier thinking, and what the thinking budget does to a turn's cost.

    .venv/bin/python -m bench.thinking [--turns 4] [--readme docs/benchmarks.md]

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
2. Budget: one DeepSeek-R1 turn answering a small JSON schema (its grammar starts after the
   thinking), `max_tokens` 256, under thinking budgets 0, 16, 64, 192 and none: completion and
   reasoning tokens, whether an answer came, and the turn's wall time (median of 3, budgets
   interleaved). A random-weight model never ends its thinking by itself: unbudgeted, it
   spends max_tokens thinking and never answers, as a real one can on a hard question.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from openai import OpenAI

from bench.common import launch, write_readme_block
from server.model_loader import load_model
from server.settings import default_cache_dir
from tests import thinking

README_START, README_END = "<!-- bench.thinking:start -->", "<!-- bench.thinking:end -->"


def save_family(base, family: str, root: Path, name: str | None = None) -> Path:
    """tests/thinking.py's tiny model of `family`, saved where `kvserve serve --model` reads it."""
    loaded = thinking.tiny_model(thinking.family_tokenizer(base, family))
    path = root / (name or family)
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


ANSWER = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["answer"], "additionalProperties": False}}}


def budget_costs(client: OpenAI, model: str, max_tokens: int) -> list[tuple[str, int, int, bool, float]]:
    """Per budget: completion and reasoning tokens, whether a valid answer came, and the
    turn's wall time (median of 3, budgets interleaved). The answer is a small JSON object (its
    grammar starts after the thinking), so a turn ends once the thinking does."""
    budgets = (0, 16, 64, 192, None)
    runs: dict = {b: [] for b in budgets}
    for i in range(3):
        for budget in budgets:
            t0 = time.perf_counter()
            out = client.chat.completions.create(
                model=model, messages=[question(0)], temperature=0, max_tokens=max_tokens, response_format=ANSWER,
                extra_body={"max_reasoning_tokens": budget, "prompt_cache_key": f"budget-{budget}-{i}"})
            runs[budget].append((time.perf_counter() - t0, out))
    rows = []
    for budget in budgets:
        out = runs[budget][0][1]
        answered = out.choices[0].finish_reason == "stop" and bool(out.choices[0].message.content)
        rows.append(("none" if budget is None else str(budget), out.usage.completion_tokens,
                     out.usage.completion_tokens_details.reasoning_tokens, answered, statistics.median(r[0] for r in runs[budget])))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--readme", type=Path, help="write the tables into this README between the markers")
    parser.add_argument("--save-model", nargs=2, metavar=("FAMILY", "DIR"), help="only save FAMILY's tiny model to DIR (for bench.clients --thinking)")
    args = parser.parse_args()
    base = load_model(None, cache_dir=default_cache_dir()).tokenizer
    if args.save_model:
        family, where = args.save_model
        print(save_family(base, family, Path(where).parent, name=Path(where).name))
        return
    lines = [f"Sessions, {args.turns} turns (share of each later turn's prompt served from cache):", "",
             "| template | turn 2 | turn 3 | turn 4 | answers identical to a fresh prefill |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cases = [("deepseek_r1", "DeepSeek-R1 (drops earlier thinking)", {}, False),
                 ("qwen3", "Qwen3 (drops thinking before the last question)", {}, True),
                 ("qwen3", "Qwen3, `preserve_thinking: true` (keeps it)", {"chat_template_kwargs": {"preserve_thinking": True}}, True)]
        paths = {family: save_family(base, family, root) for family in dict.fromkeys(c[0] for c in cases)}
        for family in paths:
            with launch(root, "--model", str(paths[family]), "--served-model-name", family) as server:
                client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
                for name, label, body, grammar in (c for c in cases if c[0] == family):
                    shares, identical = sessions(client, name, args.turns, body, grammar)
                    cells = [f"{s:.0%}" for s in shares] + [""] * (3 - len(shares))
                    lines.append(f"| {label} | {' | '.join(cells[:3])} | {identical}/{args.turns} |")
                if family == "deepseek_r1":
                    budget_rows = budget_costs(client, family, 256)
    lines += ["", "Thinking budget, one DeepSeek-R1 turn answering a JSON schema, `max_tokens` 256 (median of 3):", "",
              "| max_reasoning_tokens | completion tokens | reasoning tokens | answered | seconds |", "|---|---|---|---|---|"]
    lines += [f"| {b} | {c} | {r} | {'yes' if a else 'no (max_tokens)'} | {s:.2f} |" for b, c, r, a, s in budget_rows]
    table = "\n".join(lines)
    print(table)
    if args.readme:
        write_readme_block(args.readme, README_START, README_END, table)


if __name__ == "__main__":
    main()
