"""The host's share of a decode step (issue 47): microseconds per engine step outside the
model's forward, with the graph replay stubbed, at 1 and 64 rows.

    .venv/bin/python -m bench.host [--rows 1 64] [--steps 200] [--rounds 3] [--context 3]

The engine runs as the server runs it on a GPU (its own thread, the paged path with its bucket
padding and persistent buffers, a captured graph for every decode bucket, the next step launched
before this one is postprocessed), over a tiny Qwen2-shaped model (a vocabulary of VOCAB, so
that the logits' argmax, device work on a GPU, stays small here). Its decode graphs are stand-ins
whose replay computes nothing and whose outputs hold fixed logits and their argmax (a token that
is no end of turn); a prompt's forward is stubbed alike. What is left of a step is what the host
does: scheduling, the inputs' preparation and their one copy, the launch, sampling, stop checks,
detokenizing and emitting. The start-up heap is frozen out of the garbage collector's full
collections first, as a server's is. Three ways in the same run:

* now: greedy rows take the device's argmax (`StepOutput.greedy`, one copy of R ids) and the
  next step is launched from it before this one is postprocessed (the overlap, on CUDA by
  default); each row's text comes from tokenizers' `DecodeStream` (server/engine/detokenizer.py);
* through the sampler: the same rows sample from the [R, vocab] logits (today's path for rows
  with logprobs, bias, penalties or a grammar; on a GPU it also waits for the step's kernels),
  one step after the other;
* before: through the sampler, and transformers' `tokenizer.decode` twice for each token's
  text (the way both went before issue 47).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from cache_manager import kv
from cache_manager.manager import CacheConfig, CacheManager
from server import memory
from server.engine import detokenizer, model_runner
from server.engine.core import Engine, EngineConfig
from server.engine.sampling import SamplingParams
from server.engine.sequence import GenerationRequest, Status

VOCAB = 2048  # the first ids of SmolLM2's vocabulary: the tokenizer detokenizes what the stub picks
STEP_TOKENS = 4096  # a step's tokens (max_batch_tokens): one row's prompt of up to this many a step


def build(context: int = 4096):
    config = AutoConfig.for_model("qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context, eos_token_id=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


class Replays(dict):
    """`ModelRunner.graphs` with a stand-in graph for every (rows, blocks) bucket: replaying it
    computes nothing; its output is `size` rows of the fixed logits and their argmax.
    `replayed`: how many times one was."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits, self.greedy = logits, logits.argmax(-1)
        self.outputs: dict[int, model_runner.StepOutput] = {}  # made once per size, as a capture makes them
        self.replayed = 0

    def get(self, key, default=None):
        size = key[0]
        if size not in self.outputs:
            self.outputs[size] = model_runner.StepOutput(self.logits[:size], self.greedy[:size])
        return self, self.outputs[size]

    def replay(self) -> None:
        self.replayed += 1


def stub(runner: model_runner.ModelRunner) -> None:
    """Replace the runner's decode graphs and its forward with fixed logits (a token that is no
    end of turn)."""
    logits = torch.zeros(512, VOCAB)
    logits[:, 1000] = 1.0

    def forward(ids, pos, step, keep, model=None, embeds=None, shift=None):
        n = ids.shape[1] if keep is None else keep.numel()
        return logits[:n]

    runner._forward = forward
    runner.graphs = Replays(logits)


WAYS = ("now", "through the sampler", "before")


def measure(tokenizer, rows: int, steps: int, way: str, prompt: int = 3) -> tuple[float, float, Engine]:
    """The median and the mean seconds of an engine step with `rows` rows decoding (the replay
    and the forward stubbed), one of WAYS, each row after a prompt of `prompt` tokens (its
    block table grows with it); and the engine, stopped. The mean counts the garbage
    collector's pauses, which land on a few steps."""
    stagger = rows * -(-prompt // STEP_TOKENS)  # steps that prefill some row while others decode
    max_tokens = steps + 8 + stagger
    context = max(4096, prompt + max_tokens)
    model = build(context)
    budget = rows * kv.bytes_for(model.config, context, torch.float32)
    cache = CacheManager(model.config, "cpu", torch.float32, context, CacheConfig(budget_bytes=max(2**28, 2 * budget)))
    config = EngineConfig(max_context=context, max_running=max(rows, 1), max_batch_tokens=STEP_TOKENS, paged=True, overlap=way == "now")
    engine = Engine(model, tokenizer, config, cache)
    stub(engine.runner)
    if way != "now":
        run = engine.runner.run
        engine.runner.run = lambda plan: model_runner.StepOutput(run(plan).logits)
    times: list[float] = []
    step = engine.step

    def timed() -> None:
        t0 = time.perf_counter()
        step()
        if len(engine._running) == rows and all(seq.status is Status.DECODE for seq, _ in engine._running):
            times.append(time.perf_counter() - t0)

    engine.step = timed
    loop = asyncio.new_event_loop()
    engine.start()
    original = detokenizer._rust
    if way == "before":  # transformers' decode, twice a token, in TextStream's Python window
        detokenizer._rust = lambda tok: None
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        for i in range(rows):
            engine.submit(GenerationRequest(f"r{i}", [1 + (i + j) % 1000 for j in range(prompt)], params), loop)
        while len(times) < steps:
            time.sleep(0.05)
    finally:
        engine.stop()
        loop.close()
        detokenizer._rust = original
    timed = times[steps // 4 :]
    return statistics.median(timed), statistics.fmean(timed), engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--context", type=int, default=3, help="each row's prompt, in tokens: a step's block tables follow it")
    parser.add_argument("--rounds", type=int, default=3, help="each way this many times, alternating; the best median (and "
                        "mean) counts (a shared box's noise only ever adds time)")
    args = parser.parse_args()
    from bench.architectures import tokenizer

    tok = tokenizer()
    memory.freeze_heap()  # as a serving process does once it is ready (server/startup.py)
    print("| rows | " + " | ".join(f"{way} (us/step)" for way in WAYS) + " | now / before | now, mean (us/step) |")
    print("|---:|" + "---:|" * (len(WAYS) + 2))
    for rows in args.rows:
        t = dict.fromkeys(WAYS, float("inf"))
        mean = float("inf")
        for _ in range(args.rounds):
            for way in WAYS:
                median, average, _ = measure(tok, rows, args.steps, way, args.context)
                t[way] = min(t[way], median)
                if way == "now":
                    mean = min(mean, average)
        print(f"| {rows} | " + " | ".join(f"{t[way] * 1e6:.0f}" for way in WAYS) + f" | {t['now'] / t['before']:.2f} | {mean * 1e6:.0f} |")


if __name__ == "__main__":
    main()
