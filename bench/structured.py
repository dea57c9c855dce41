"""Constrained vs free decoding: tokens/s of a generation under a JSON schema against the same
generation unconstrained, on one server in one run.

    .venv/bin/python -m bench.structured [--repeats 3]

Rate = (completion tokens - 1) / (last chunk - first chunk), prefill left out. The free run
generates as many tokens as the constrained one did (end-of-turn suppressed), from the same
prompt. Key-heavy schemas gain from llguidance fast-forward: forced key tokens go through the
model in one forward pass instead of one pass each.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from openai import OpenAI

from bench.common import launch

PROMPT = [{"role": "user", "content": "Describe a fictional city in detail as JSON."}]
SCHEMAS = {
    "list of strings": {
        "type": "object",
        "properties": {"facts": {"type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 8, "maxItems": 8}},
        "required": ["facts"],
        "additionalProperties": False,
    },
    "key-heavy (24 keys)": {
        "type": "object",
        "properties": {f"statistic_number_{i}_of_the_city_registry": {"type": "integer", "minimum": 0, "maximum": 99} for i in range(24)},
        "required": [f"statistic_number_{i}_of_the_city_registry" for i in range(24)],
        "additionalProperties": False,
    },
}


def timed_stream(client: OpenAI, model: str, **kwargs) -> tuple[float, int]:
    stamps, tokens = [], 0
    for chunk in client.chat.completions.create(model=model, messages=PROMPT, temperature=0, stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return (tokens - 1) / (stamps[-1] - stamps[0]), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as logs, launch(logs) as server:
        client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        for name, schema in SCHEMAS.items():
            fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
            constrained, free, n = [], [], 0
            for _ in range(args.repeats):
                rate, n = timed_stream(client, model, response_format=fmt, max_tokens=800)
                constrained.append(rate)
                free.append(timed_stream(client, model, max_tokens=n, logit_bias={"2": -100})[0])
            rows.append((name, n, statistics.median(constrained), statistics.median(free)))
    print(f"constrained vs free decoding, 1 stream, median of {args.repeats} (SmolLM2-135M fp32, CPU)\n")
    print("| schema | tokens | constrained tok/s | free tok/s | **ratio** |")
    print("|---|---|---|---|---|")
    for name, n, c, f in rows:
        print(f"| {name} | {n} | {c:.1f} | {f:.1f} | **{c / f:.2f}** |")


if __name__ == "__main__":
    main()
