"""Speculative decoding on vs off on the same server: tokens/s of greedy generations with
prompt lookup (or a draft model) against the same requests with `"speculative": false`, in one
run, single stream and 4 concurrent streams.

    .venv/bin/python -m bench.speculative [--streams 1,4] [--repeats 2]
        [--server-flag=--speculative=ngram ...]

Workloads (each stream its own variant):
  code-edit   asked to return a ~300-token Python or JavaScript file with one function
              renamed (chat, max 400 tokens)
  extraction  JSON (response_format json_schema) whose values copy spans of a support email
  chat        free chat: a short story on a topic (drafts mostly miss)

Rate = completion tokens / wall time of the wave (first request sent to the last stream done,
prefill included), through the openai SDK, streamed. On and off alternate (off first, then on,
`--repeats` times) and the median of each is kept; the ratio is on / off. The greedy outputs of
the two modes are compared (identical or not; docs/architecture.md allows near-ties), and the
server's speculation metrics give the acceptance rate of the on runs. For the code edits, the
last column says how close the replies came to the file asked for (difflib similarity of the
reply's code block to the file with the rename applied) and how many made the rename: the
drafts can only copy what the model copies.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import re
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

from openai import AsyncOpenAI

from bench.common import ServerProcess, launch

GOALS = {"code-edit (Python)": 2.0, "code-edit (JavaScript)": 2.0, "extraction": 1.5, "chat": 0.95}

PYTHON = '''import json
from dataclasses import dataclass, field


@dataclass
class Item:
    name: str
    price: float
    quantity: int
    tags: list[str] = field(default_factory=list)


def load_items(path):
    with open(path) as f:
        rows = json.load(f)
    return [Item(r["name"], r["price"], r["quantity"], r.get("tags", [])) for r in rows]


def total_price(items):
    total = 0.0
    for item in items:
        total += item.price * item.quantity
    return total


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best


def tagged(items, tag):
    return [item for item in items if tag in item.tags]


def main():
    items = load_items("items.json")
    print("total:", total_price(items))
    print("cheapest:", cheapest(items).name)
    print("sale items:", len(tagged(items, "sale")))


if __name__ == "__main__":
    main()
'''
JAVASCRIPT = '''function formatPrice(amount, currency) {
  const symbols = { USD: "$", EUR: "€", GBP: "£" };
  const symbol = symbols[currency] || currency + " ";
  return symbol + amount.toFixed(2);
}

function cartTotal(items) {
  let total = 0;
  for (const item of items) {
    total += item.price * item.quantity;
  }
  return total;
}

function applyDiscount(total, percent) {
  if (percent < 0 || percent > 100) {
    throw new Error("invalid discount");
  }
  return total * (1 - percent / 100);
}

function countItems(items) {
  let count = 0;
  for (const item of items) {
    count += item.quantity;
  }
  return count;
}

function summary(items, currency, discount) {
  const total = applyDiscount(cartTotal(items), discount);
  return "Total: " + formatPrice(total, currency) + " for " + countItems(items) + " items";
}

module.exports = { formatPrice, cartTotal, applyDiscount, countItems, summary };
'''
CODE = {
    "code-edit (Python)": ("python", PYTHON, (("total_price", "order_total"), ("cheapest", "lowest_priced"), ("load_items", "read_items"), ("tagged", "with_tag"))),
    "code-edit (JavaScript)": ("javascript", JAVASCRIPT, (("cartTotal", "subtotal"), ("formatPrice", "priceText"), ("applyDiscount", "discounted"), ("countItems", "itemCount"))),
}

PEOPLE = (
    ("Maria Lindqvist", "maria.lindqvist@example.org", "A-48213", "17 Harbor Lane, Bergen 5003, Norway",
     ["espresso machine model CX-400", "two packs of descaling tablets"]),
    ("Tomasz Wieczorek", "t.wieczorek@example.com", "B-90377", "Ulica Polna 8, 30-012 Krakow, Poland",
     ["ergonomic office chair in dark grey", "replacement armrest kit"]),
    ("Aiko Tanabe", "aiko.tanabe@example.net", "C-11564", "3-2-1 Nishi-Shinjuku, Tokyo 160-0023, Japan",
     ["noise cancelling headphones", "USB-C charging cable, 2 metres"]),
    ("Daniel Okafor", "d.okafor@example.co.uk", "D-70925", "44 Mill Road, Cambridge CB1 2AD, United Kingdom",
     ["cast iron skillet, 28 cm", "silicone handle cover"]),
)
SCHEMA = {
    "type": "object",
    "properties": {
        "customer_name": {"type": "string", "maxLength": 60},
        "email": {"type": "string", "maxLength": 60},
        "order_id": {"type": "string", "maxLength": 20},
        "shipping_address": {"type": "string", "maxLength": 120},
        "products": {"type": "array", "items": {"type": "string", "maxLength": 80}, "maxItems": 4},
        "problem": {"type": "string", "maxLength": 200},
    },
    "required": ["customer_name", "email", "order_id", "shipping_address", "products", "problem"],
    "additionalProperties": False,
}
TOPICS = ("a lighthouse keeper", "a lost robot", "a desert caravan", "a haunted library")


def email(i: int) -> str:
    name, address_email, order, address, products = PEOPLE[i % len(PEOPLE)]
    return (
        f"From: {name} <{address_email}>\nSubject: Problem with order {order}\n\n"
        f"Hello, I am writing about my order {order}, which I placed three weeks ago. It contained "
        f"the {products[0]} and the {products[1]}. The parcel was delivered to {address}, but the "
        f"{products[0]} stopped working after two days: it makes a loud clicking noise and then "
        f"switches itself off. I would like a replacement or a refund.\n\nKind regards,\n{name}"
    )


def requested_file(workload: str, i: int) -> tuple[str, str, str]:
    """What code-edit stream i asks for: the file with its rename applied, and the old and new
    names."""
    _, code, renames = CODE[workload]
    old, new = renames[i % len(renames)]
    return code.replace(old, new), old, new


def fidelity(workload: str, texts: list[str]) -> str:
    """How close the code-edit replies came to the files asked for: the mean similarity of each
    reply's first code block to its requested file, and how many made the rename."""
    similar, renamed = [], 0
    for i, text in enumerate(texts):
        want, old, new = requested_file(workload, i)
        block = re.search(r"```[\w+-]*\n(.*?)```", text, re.DOTALL)
        code = block.group(1) if block else text
        similar.append(difflib.SequenceMatcher(None, want, code, autojunk=False).ratio())
        renamed += new in code and re.search(rf"\b{re.escape(old)}\b", code) is None
    return f"{statistics.mean(similar):.2f} similar, renamed {renamed} / {len(texts)}"


def requests(workload: str, i: int) -> dict:
    """The chat request of stream i for a workload (greedy)."""
    if workload in CODE:
        language, code, _ = CODE[workload]
        _, old, new = requested_file(workload, i)
        ask = (f"Rename the function {old} to {new} everywhere in this code. Reply with the complete "
               f"modified code only.\n\n```{language}\n{code}```")
        return {"messages": [{"role": "user", "content": ask}], "max_tokens": 400}
    if workload == "extraction":
        ask = "Extract the customer's details from this support email as JSON.\n\n" + email(i)
        fmt = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": SCHEMA, "strict": True}}
        return {"messages": [{"role": "user", "content": ask}], "max_tokens": 300, "response_format": fmt}
    return {"messages": [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}."}], "max_tokens": 160}


@dataclass(slots=True)
class Wave:
    tok_s: float
    texts: list[str]


async def one(client: AsyncOpenAI, model: str, body: dict, speculative: bool) -> tuple[str, int]:
    text, tokens = "", 0
    stream = await client.chat.completions.create(
        model=model, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"speculative": speculative}, **body,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return text, tokens


async def wave(client: AsyncOpenAI, model: str, workload: str, streams: int, speculative: bool) -> Wave:
    start = time.perf_counter()
    results = await asyncio.gather(*(one(client, model, requests(workload, i), speculative) for i in range(streams)))
    wall = time.perf_counter() - start
    return Wave(sum(n for _, n in results) / wall, [t for t, _ in results])


def counters(server: ServerProcess) -> tuple[float, float]:
    """The server's drafted and accepted token counts so far."""
    return server.metric("kvserve_spec_decode_draft_tokens_total"), server.metric("kvserve_spec_decode_accepted_tokens_total")


@dataclass(slots=True)
class Row:
    workload: str
    streams: int
    off: float
    on: float
    identical: int
    outputs: int
    drafted: float
    accepted: float
    copy: str  # code edits: how close the replies came to the requested file (`fidelity`)


async def run(server: ServerProcess, args: argparse.Namespace) -> list[Row]:
    client = AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=900)
    model = (await client.models.list()).data[0].id
    for workload in args.workloads:  # warm-up: every kernel shape a workload meets, both modes
        await wave(client, model, workload, 1, True)
    rows = []
    for workload in args.workloads:
        for streams in args.streams:
            off, on, texts_off, texts_on = [], [], [], []
            drafted = accepted = 0.0
            for _ in range(args.repeats):
                w = await wave(client, model, workload, streams, False)
                off.append(w.tok_s)
                texts_off = w.texts
                d0, a0 = counters(server)
                w = await wave(client, model, workload, streams, True)
                d1, a1 = counters(server)
                on.append(w.tok_s)
                texts_on = w.texts
                drafted, accepted = drafted + d1 - d0, accepted + a1 - a0
            identical = sum(a == b for a, b in zip(texts_off, texts_on))
            copy = fidelity(workload, texts_on) if workload in CODE else "-"
            rows.append(Row(workload, streams, statistics.median(off), statistics.median(on), identical, streams, drafted, accepted, copy))
            print(f"  {workload} x{streams}: off {rows[-1].off:.1f} on {rows[-1].on:.1f} tok/s", file=sys.stderr, flush=True)
    return rows


def report(rows: list[Row], flags: list[str], args: argparse.Namespace) -> None:
    print(f"\nspeculative decoding on / off, greedy, median of {args.repeats} (SmolLM2-135M fp32, CPU; "
          f"server flags: {' '.join(flags)})\n")
    print("| workload | streams | off tok/s | on tok/s | **ratio on / off** | goal | accepted / drafted | identical outputs | reply vs requested file |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        goal = GOALS[r.workload]
        rate = f"{r.accepted / r.drafted:.0%} of {r.drafted:.0f}" if r.drafted else "nothing drafted"
        print(f"| {r.workload} | {r.streams} | {r.off:.1f} | {r.on:.1f} | **{r.on / r.off:.2f}** | "
              f">= {goal} {'met' if r.on / r.off >= goal else 'missed'} | {rate} | {r.identical} / {r.outputs} | {r.copy} |")
    print("\n    " + shlex.join([".venv/bin/python", "-m", "bench.speculative", *sys.argv[1:]]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=lambda s: [int(n) for n in s.split(",")], default=[1, 4])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workloads", type=lambda s: s.split(","), default=list(GOALS))
    parser.add_argument("--server-flag", action="append", default=[], metavar="FLAG",
                        help="passed to `kvserve serve` (default --speculative=ngram), repeatable")
    args = parser.parse_args()
    flags = [part for flag in args.server_flag for part in shlex.split(flag)] or ["--speculative=ngram"]
    with tempfile.TemporaryDirectory() as logs, launch(logs, *flags) as server:
        rows = asyncio.run(run(server, args))
    report(rows, flags, args)


if __name__ == "__main__":
    main()
