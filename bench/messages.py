"""A multi-turn, Claude-Code-like session through /v1/messages against the same conversation
through /v1/chat/completions, on one real server, measured in one run.

    .venv/bin/python -m bench.messages [--turns 6] [--system-tokens 1500] [--max-tokens 48]

Each API runs under its own API key (kvserve keeps each key's KV apart), so neither reuses the
other's prefixes. A turn is a user request, a forced tool call (tool_choice any / required), its
result, and the answer that follows: two requests, streamed, with a ~1.5k-token system prompt and
three tools as an agent sends them. TTFT = request start to the first content (text or tool
input). Printed per API: later turns' TTFT, cached / prompt tokens, and the messages / chat
ratios; the greedy outputs must be equal (the same conversation renders the same prompt).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from anthropic import Anthropic
from openai import OpenAI

from bench.common import launch
from bench.sessions import document

TOOLS = [
    {"name": "read_file", "description": "Read a file of the project", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string", "maxLength": 40}}, "required": ["path"], "additionalProperties": False}},
    {"name": "run", "description": "Run a shell command", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string", "maxLength": 40}}, "required": ["command"], "additionalProperties": False}},
    {"name": "search", "description": "Search the code", "input_schema": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 40}}, "required": ["query"], "additionalProperties": False}},
]
ASKS = ["Why does the build fail?", "Fix the failing test.", "Now run the linter.", "Summarise the change.",
        "Which file holds the config?", "Add a changelog entry.", "Check the docs build.", "Open a pull request."]


class MessagesSide:
    """The conversation as Anthropic's content blocks, sent through the anthropic SDK."""

    def __init__(self, url: str, key: str, model: str, system: str, max_tokens: int) -> None:
        self.client = Anthropic(base_url=url, api_key=key, max_retries=0, timeout=600)
        self.model, self.system, self.max_tokens = model, system, max_tokens
        self.messages: list[dict] = []

    def turn(self, ask: str, forced: bool) -> tuple[float, dict, list]:
        if ask:
            self.messages.append({"role": "user", "content": ask})
        start, ttft = time.perf_counter(), None
        choice = {"type": "any"} if forced else {"type": "auto"}
        with self.client.messages.stream(model=self.model, system=self.system, messages=self.messages, tools=TOOLS, tool_choice=choice,
                                         max_tokens=self.max_tokens, extra_body={"temperature": 0}) as stream:
            for event in stream:
                if ttft is None and event.type in ("content_block_start", "content_block_delta"):
                    ttft = time.perf_counter() - start
            message = stream.get_final_message()
        content = [block.model_dump(exclude_none=True) for block in message.content]
        self.messages.append({"role": "assistant", "content": content})
        calls = [b for b in content if b["type"] == "tool_use"]
        if calls:
            self.messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": c["id"], "content": "ok: 3 lines"} for c in calls]})
        usage = {"prompt": message.usage.input_tokens + message.usage.cache_read_input_tokens, "cached": message.usage.cache_read_input_tokens}
        return ttft or time.perf_counter() - start, usage, [(b.get("text"), b.get("name"), b.get("input")) for b in content]


class ChatSide:
    """The same conversation as chat messages, sent through the openai SDK."""

    def __init__(self, url: str, key: str, model: str, system: str, max_tokens: int) -> None:
        self.client = OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=600)
        self.model, self.max_tokens = model, max_tokens
        self.messages: list[dict] = [{"role": "system", "content": system}]
        self.tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
                      for t in TOOLS]

    def turn(self, ask: str, forced: bool) -> tuple[float, dict, list]:
        if ask:
            self.messages.append({"role": "user", "content": ask})
        start, ttft, text, calls, usage = time.perf_counter(), None, "", {}, None
        for chunk in self.client.chat.completions.create(
            model=self.model, messages=self.messages, tools=self.tools, tool_choice="required" if forced else "auto",
            max_tokens=self.max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
        ):
            if chunk.usage:
                usage = chunk.usage
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            if ttft is None and (delta.content or delta.tool_calls):
                ttft = time.perf_counter() - start
            text += delta.content or ""
            for call in delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
                entry["arguments"] += call.function.arguments or ""
        message = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for c in calls.values()]
        self.messages.append(message)
        for c in calls.values():
            self.messages.append({"role": "tool", "tool_call_id": c["id"], "content": "ok: 3 lines"})
        out = ([(text, None, None)] if text or not calls else []) + [(None, c["name"], _parsed(c["arguments"])) for c in calls.values()]
        return ttft or time.perf_counter() - start, {"prompt": usage.prompt_tokens, "cached": usage.prompt_tokens_details.cached_tokens}, out


def _parsed(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def session(side, turns: int) -> dict:
    """Runs the session; later turns' (from the second) TTFTs and token counts, and the outputs."""
    ttfts, prompt, cached, outputs = [], 0, 0, []
    for turn in range(turns):
        for forced, ask in ((True, ASKS[turn % len(ASKS)]), (False, "")):
            ttft, usage, out = side.turn(ask, forced)
            outputs.append(out)
            if turn:
                ttfts.append(ttft)
                prompt += usage["prompt"]
                cached += usage["cached"]
    return {"ttft": statistics.median(ttfts), "prompt": prompt, "cached": cached, "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    system = "You are a coding agent. Project notes:\n" + document(7, args.system_tokens)
    with tempfile.TemporaryDirectory() as tmp, launch(tmp, "--api-key", "chat-key", "--api-key", "messages-key") as server:
        model = OpenAI(base_url=server.base_url, api_key="chat-key").models.list().data[0].id
        chat = session(ChatSide(server.url, "chat-key", model, system, args.max_tokens), args.turns)
        messages = session(MessagesSide(server.url, "messages-key", model, system, args.max_tokens), args.turns)
    same = sum(a == b for a, b in zip(messages["outputs"], chat["outputs"]))
    print(f"{args.turns} turns x 2 requests, system ~{args.system_tokens} tokens, {len(TOOLS)} tools, {args.max_tokens} tokens per answer; "
          f"later turns (2..{args.turns}):")
    print("| API | median TTFT (ms) | cached / prompt tokens |")
    print("|---|---|---|")
    for name, side in (("/v1/chat/completions", chat), ("/v1/messages", messages)):
        print(f"| {name} | {side['ttft'] * 1000:.0f} | {side['cached']} / {side['prompt']} ({side['cached'] / side['prompt']:.3f}) |")
    print(f"messages / chat: TTFT {messages['ttft'] / chat['ttft']:.2f}, cached tokens {messages['cached'] / chat['cached']:.3f}, "
          f"prompt tokens {messages['prompt'] / chat['prompt']:.3f}; outputs identical: {same} of {len(chat['outputs'])}")


if __name__ == "__main__":
    main()
