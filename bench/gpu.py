"""Decode throughput of kvserve's engine against plain transformers on the same weights, in one
process, with the memory-bandwidth floor of a decode step:

    .venv/bin/python -m bench.gpu --model DIR [--streams 1,8,32,64] [--tokens 128] [--dtype bfloat16]

Rows, per stream count N (N prompts of 16 tokens, `--tokens` greedy tokens each, end-of-turn
suppressed so every side generates exactly that many):
* kvserve: the engine (model runner, KV pool, CUDA graphs on CUDA) fed N requests at once;
* transformers `generate` with a static cache (on CUDA transformers compiles it and replays CUDA
  graphs) over a batch of N, and `generate_batch` (its continuous batching), `--baselines`;
* the floor: reading the weights once per step at the device's measured copy bandwidth.
Ratios are printed against `generate` measured in the same run. `--temperature T` (> 0) has
kvserve's rows draw instead (end-of-turn suppressed alike), the OpenAI default at 1; the
baselines stay greedy. `--grammar` adds a table for each of `GRAMMARS`: kvserve's rows under
it, with the overlap (the server's way on CUDA) and without it (each step waiting for the last
one's tokens, the way constrained rows ran before 2026-12-01), beside the free rows' rate of the
first table; the model directory's tokenizer builds the grammars. On CPU it runs too (a tiny
model: `--model tiny`), which is how CI-less checks keep it working; the figures that matter
come from a GPU (../shared/tools/gpu/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig

from cache_manager.manager import CacheConfig, CacheManager
from grammars import GrammarCompiler, spec_from_request
from server.engine.core import Engine, EngineConfig
from server.engine.sampling import SamplingParams
from server.engine.sequence import GenerationRequest
from server.model_loader import resolve_source
from server.settings import default_cache_dir
from server.startup import weights_bytes

PROMPT_TOKENS = 16
# what `--grammar` rows write, neither ever forced to end early whatever random weights pick:
# * code: code in a JSON string that is never closed, so that a row is in an accepting state
#   at every token (end-of-turn allowed, and suppressed by the bias), and no token is forced;
# * form: short objects in a list that is never closed, whose keys and punctuation are forced
#   after each value (of at most 3 digits, or true / false): a row of forced tokens, a step of
#   more than decode rows, every few tokens at each stream (launched ahead since 2026-12-01)
GRAMMARS = {
    "code": r'\{"code": "[a-zA-Z0-9 _(),.:=+\-]*',
    "form": r'\[(\{"id": [0-9]{1,3}, "ok": (true|false)\}, )*',
}


def load(path: str, device: torch.device, dtype: torch.dtype, vocab: int = 1000):
    if path == "tiny":  # CPU smoke run: a random 2-layer model
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
        return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def tokenizer_for(path: str):
    """The model's tokenizer, which `--grammar` builds its grammar with: the model directory's;
    for 'tiny', the default model's."""
    return AutoTokenizer.from_pretrained(resolve_source(None, default_cache_dir())[0] if path == "tiny" else path)


def grammar_for(tokenizer, vocab: int, eos: int | None, regex: str):
    """`regex` compiled for `tokenizer` and the model's `vocab`."""
    compiler = GrammarCompiler(tokenizer, vocab, eos_token_ids=None if eos is None else [eos])
    return compiler.compile(spec_from_request(None, None, guided_regex=regex))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def floor_tokens_per_s(model, device: torch.device) -> float | None:
    """One stream's bound: the weights read once per step at the measured copy bandwidth."""
    if device.type != "cuda":
        return None
    return copy_bandwidth(device) / weights_bytes(model)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s the device reads and writes in a 1 GiB copy (read + write counted)."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    return 20 * x.numel() / (time.perf_counter() - t)


def prompts(n: int, vocab: int) -> list[list[int]]:
    return [[(100 + i * 31 + j * 7) % (vocab - 10) + 5 for j in range(PROMPT_TOKENS)] for i in range(n)]


def kvserve_rate(model, device, n: int, tokens: int, eos: int | None, args, grammar=None,
                 overlap: bool | None = None) -> tuple[float, dict[str, int]]:
    """Tokens/s of the engine generating `tokens` for each of n requests at once (`grammar`:
    each row under it; `overlap`: the engine's, None: its default), and its steps by launch
    (`Engine.steps`: "ahead", the overlap, or why a step waited). On the paged path, on CPU too
    (the server's way on CUDA)."""
    config = EngineConfig(max_context=args.max_context, max_running=max(64, n), max_queue=max(64, n),
                          max_batch_tokens=max(512, n * PROMPT_TOKENS), cuda_graphs=args.cuda_graphs, paged=True, overlap=overlap)
    cache = CacheManager(model.config, device, model.dtype, args.max_context, CacheConfig(budget_bytes=args.kv_bytes, reuse=False))
    engine = Engine(model, Tokenizer(eos), config, cache)
    engine.start()
    bias = {eos: -1000.0} if eos is not None else {}
    params = SamplingParams(max_tokens=tokens, temperature=args.temperature, logit_bias=bias)

    async def wave() -> int:
        loop = asyncio.get_running_loop()
        handles = [engine.submit(GenerationRequest(f"r{i}", ids, params, grammar=grammar), loop)
                   for i, ids in enumerate(prompts(n, model.config.vocab_size))]
        done = 0
        for handle in handles:
            async for out in handle:
                done += len(out.tokens)
        return done

    try:
        asyncio.run(wave())  # warm-up
        before = dict(engine.steps)
        t = time.perf_counter()
        generated = asyncio.run(wave())
        rate = generated / (time.perf_counter() - t)
        return rate, {launch: n - before[launch] for launch, n in engine.steps.items()}
    finally:
        engine.stop()


class Tokenizer:
    """What the engine asks of a tokenizer, for random-weight models (ids only)."""

    def __init__(self, eos: int | None) -> None:
        self.eos_token_id = eos

    def decode(self, ids, **kwargs) -> str:
        return "".join(f"<{i}>" for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [f"<{i}>" for i in ids] if isinstance(ids, list) else f"<{ids}>"


def generate_rate(model, device, n: int, tokens: int) -> float:
    ids = torch.tensor(prompts(n, model.config.vocab_size), device=device)

    def run():
        return model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                              cache_implementation="static", pad_token_id=0)

    run()
    sync(device)
    t = time.perf_counter()
    run()
    sync(device)
    return n * tokens / (time.perf_counter() - t)


def generate_batch_rate(model, n: int, tokens: int) -> float:
    config = GenerationConfig(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate_batch(inputs=prompts(n, model.config.vocab_size), generation_config=config, progress_bar=False)
    t = time.perf_counter()
    out = model.generate_batch(inputs=prompts(n, model.config.vocab_size), generation_config=config, progress_bar=False)
    return sum(len(o.generated_tokens) for o in out.values()) / (time.perf_counter() - t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model directory, or 'tiny' (CPU smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--kv-bytes", type=int, default=4 << 30)
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--temperature", type=float, default=0.0, help="kvserve's rows draw at this temperature (0: greedy)")
    parser.add_argument("--grammar", action="store_true", help="also kvserve's rows under a grammar, with the overlap and without")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.set_grad_enabled(False)
    tokenizer = tokenizer_for(args.model) if args.grammar else None
    model = load(args.model, device, dtype, len(tokenizer) if tokenizer is not None else 1000)
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    floor = floor_tokens_per_s(model, device)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), {dtype}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params, {args.tokens} tokens per stream")
    if floor is not None:
        print(f"HBM floor: {floor:.0f} tok/s for one stream")
    # NOTE: the baselines first: kvserve's engine switches the model to its own attention, which
    # `generate_batch` refuses (plain `generate` falls back to the original one).
    baselines = {n: (generate_rate(model, device, n, args.tokens), generate_batch_rate(model, n, args.tokens)) for n in args.streams} if args.baselines else {}
    print("| streams | kvserve tok/s | transformers generate (static) | kvserve / generate | generate_batch | kvserve / generate_batch |")
    print("|---|---|---|---|---|---|")
    free = {}
    for n in args.streams:
        ours = free[n] = kvserve_rate(model, device, n, args.tokens, eos, args)[0]
        if n in baselines:
            static, batch = baselines[n]
            print(f"| {n} | {ours:.0f} | {static:.0f} | {ours / static:.2f} | {batch:.0f} | {ours / batch:.2f} |", flush=True)
        else:
            print(f"| {n} | {ours:.0f} | - | - | - | - |", flush=True)
    if not args.grammar:
        return
    for name, regex in GRAMMARS.items():
        grammar = grammar_for(tokenizer, model.config.vocab_size, eos, regex)
        print(f"\nkvserve's rows under a grammar, {name} (regex {regex}):\n")
        print("| streams | free tok/s | grammar, overlap | steps launched ahead | steps waited for | grammar, no overlap "
              "| overlap / no overlap | grammar (overlap) / free |")
        print("|---|---|---|---|---|---|---|---|")
        for n in args.streams:
            on, steps = kvserve_rate(model, device, n, args.tokens, eos, args, grammar, overlap=True)
            off = kvserve_rate(model, device, n, args.tokens, eos, args, grammar, overlap=False)[0]
            print(f"| {n} | {free[n]:.0f} | {on:.0f} | {shares(steps, 'ahead')} | {shares(steps)} | {off:.0f} | {on / off:.2f} "
                  f"| {on / free[n]:.2f} |", flush=True)


def shares(steps: dict[str, int], launch: str | None = None) -> str:
    """The share of `steps` (by launch: `kvserve_rate`) launched as `launch`; None: those of
    the reasons steps waited, largest first ("-": none waited)."""
    total = max(1, sum(steps.values()))
    if launch is not None:
        return f"{steps[launch] / total:.2f}"
    waits = sorted(((n, why) for why, n in steps.items() if why != "ahead" and n), reverse=True)
    return ", ".join(f"{why} {n / total:.2f}" for n, why in waits) or "-"


if __name__ == "__main__":
    main()
