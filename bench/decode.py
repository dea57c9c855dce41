"""Single-stream decode speed: the server path (real uvicorn process, streamed through the
openai SDK) against plain transformers `generate` on the same model, measured in one run.

    .venv/bin/python -m bench.decode [--tokens 128] [--repeats 3] [--model DIR --device cuda --dtype bfloat16]

Any model kvserve loads (`--model`: an HF directory, hub id or GGUF file; default the embedded
SmolLM2), on any device (default CPU, fp32, where docs/benchmarks.md's figures come from).

Decode rate = (tokens - 1) / (time of last token - time of first token), so prefill is left out
of both sides. End-of-turn is suppressed so both sides generate exactly --tokens tokens.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from openai import OpenAI

from bench.common import launch
from server.model_loader import load_model
from server.settings import default_cache_dir

MESSAGES = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def transformers_rate(loaded, tokens: int) -> float:
    tok = loaded.tokenizer
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    eos = list({2, tok.eos_token_id})

    def timed(n: int) -> float:
        start = time.perf_counter()
        loaded.model.generate(ids.to(loaded.device), max_new_tokens=n, min_new_tokens=n, do_sample=False, suppress_tokens=eos)
        return time.perf_counter() - start

    first = timed(1)  # prefill + first token
    return (tokens - 1) / (timed(tokens) - first)


def server_rate(client: OpenAI, model: str, tokens: int) -> float:
    stamps = []
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=tokens, temperature=0,
        logit_bias={"2": -100}, stream=True, stream_options={"include_usage": True},
    )
    generated = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if chunk.usage:
            generated = chunk.usage.completion_tokens
    assert generated == tokens, generated
    # NOTE: chunks carry text, and a token that ends mid-character is sent with the next one;
    # the span first..last chunk still covers (almost exactly) tokens - 1 decode steps.
    return (tokens - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    loaded = load_model(args.model, cache_dir=default_cache_dir(), device=args.device, dtype=args.dtype)
    name = loaded.model.config.name_or_path or "SmolLM2-135M"
    hf = [transformers_rate(loaded, args.tokens) for _ in range(args.repeats)]
    del loaded
    flags = (["--model", args.model] if args.model else []) + ["--device", args.device, "--dtype", args.dtype]
    with tempfile.TemporaryDirectory() as logs, launch(logs, *flags) as server:
        client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        server_rate(client, model, 8)  # warm the HTTP path
        ours = [server_rate(client, model, args.tokens) for _ in range(args.repeats)]
    hf_med, ours_med = statistics.median(hf), statistics.median(ours)
    print(f"decode, 1 stream, {args.tokens} tokens, median of {args.repeats} ({name}, {args.dtype}, {args.device})\n")
    print("| path | tokens/s |")
    print("|---|---|")
    print(f"| transformers generate | {hf_med:.1f} |")
    print(f"| kvserve (HTTP stream) | {ours_med:.1f} |")
    print(f"| **ratio kvserve / generate** | **{ours_med / hf_med:.2f}** |")


if __name__ == "__main__":
    main()
