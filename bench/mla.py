"""Multi-head latent attention from its latent (server/engine/mla.py) against transformers'
decompressed heads, in the same run.

    .venv/bin/python -m bench.mla [--device cuda --dtype bfloat16] [--contexts 1024,4096] [--streams 1,4]
        [--budget-gib 40] [--steps 16]

Two parts:

* Real shapes, arithmetic (no weights): KV bytes per token in bf16 of each MLA family's
  published shape, heads against latent, and the 8k-token sessions one budget (--budget-gib)
  holds each way, through `kv.layout` as the server computes it.
* A random-weight model with GLM-4.7-Flash's attention shape (20 heads, latent 512, rotary
  key 64, keys 192 + 64, values 256, query latent 768), 2 layers, hidden 1024, dense MLP, built
  in-process, decompressed and latent on the same weights:
  - greedy identity: 24 tokens from a 64-token prompt, latent against heads;
  - decode tokens/s of --streams rows at --contexts positions (the runner's eager step, its
    default path for the device: rows on CPU, paged on CUDA), heads vs latent;
  - prefill of a --contexts-token prompt (chunks of 512), heads vs latent: the latent absorbs
    in prefill too, and this is what that costs;
  - a later turn: 64 new tokens over a cached --contexts-token session against the whole
    prompt prefilled fresh (latent);
  - kernels per layer of a decode step (bench/kernels.py's counter), heads vs latent.

Ratios are of the same run; absolute times are for this machine only.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench import kernels
from cache_manager import kv
from server.engine import families, mla
from server.engine.attention import Row
from server.engine.model_runner import ModelRunner

SESSION = 8192
CHUNK = 512
TURN = 64

# (name, model_type, the attention shape as published); layers as published too
REAL = (
    ("DeepSeek-V3 / R1", "deepseek_v3", dict(num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512, qk_rope_head_dim=64,
                                              qk_nope_head_dim=128, v_head_dim=128)),
    ("Kimi K2", "deepseek_v3", dict(num_hidden_layers=61, num_attention_heads=64, kv_lora_rank=512, qk_rope_head_dim=64,
                                     qk_nope_head_dim=128, v_head_dim=128)),
    ("LongCat-Flash", "longcat_flash", dict(num_layers=28, num_attention_heads=64, kv_lora_rank=512, qk_rope_head_dim=64,
                                            qk_nope_head_dim=128, v_head_dim=128)),
    ("MiniCPM3-4B", "minicpm3", dict(num_hidden_layers=62, num_attention_heads=40, kv_lora_rank=256, qk_rope_head_dim=32,
                                      qk_nope_head_dim=64, v_head_dim=64)),
    ("GLM-4.7-Flash", "glm4_moe_lite", dict(num_hidden_layers=47, num_attention_heads=20, kv_lora_rank=512, qk_rope_head_dim=64,
                                            qk_nope_head_dim=192, v_head_dim=256)),
    ("DeepSeek-V2-Lite", "deepseek_v2", dict(num_hidden_layers=27, num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64,
                                             qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None)),
)

# GLM-4.7-Flash's attention on a small body
SHAPE = dict(num_attention_heads=20, num_key_value_heads=20, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192,
             v_head_dim=256, q_lora_rank=768, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
             first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
             moe_intermediate_size=256, vocab_size=32000, max_position_embeddings=65536, rope_interleave=True,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def real_shapes(budget_gib: float) -> list[str]:
    rows = ["| model | KV bytes/token, heads | latent | heads / latent | 8k sessions in "
            f"{budget_gib:g} GiB, heads | latent |", "|---|---:|---:|---:|---:|---:|"]
    budget = int(budget_gib * 2**30)
    for name, model_type, shape in REAL:
        config = AutoConfig.for_model(model_type, num_key_value_heads=shape["num_attention_heads"], **shape)
        heads = kv.layout(config).bytes_per_token(torch.bfloat16)
        setattr(config, kv.LATENT, "latent")
        latent = kv.layout(config).bytes_per_token(torch.bfloat16)
        sessions = [budget // (kv.blocks_for(SESSION) * kv.BLOCK_SIZE * b) for b in (heads, latent)]
        rows.append(f"| {name} | {heads:,} | {latent:,} | {heads / latent:.1f}x | {sessions[0]:,} | {sessions[1]:,} |")
    return rows


def build(device, dtype, mode: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v3", **SHAPE), dtype=dtype).to(device).eval()
    mla.configure(model, mode)
    families.check(model)
    return model


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, SHAPE["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Runner:
    """One model's runner over a pool for `streams` sequences of `context` + a little."""

    def __init__(self, model, streams: int, context: int) -> None:
        self.model = model
        room = context + 2 * TURN + 64
        self.pool = kv.Pool(model.config, kv.bytes_for(model.config, room, model.dtype) * streams, model.device, model.dtype)
        self.runner = ModelRunner(model, self.pool, cuda_graphs=False, max_rows=max(streams, 1))
        self.caches = [self.pool.allocate(room) for _ in range(streams)]

    def prefill(self, cache, ids: list[int]) -> int:
        """`ids` into `cache` in chunks of CHUNK; the greedy next token."""
        logits = None
        for i in range(0, len(ids), CHUNK):
            part = ids[i : i + CHUNK]
            logits = self.runner.forward([Row(cache, len(part))], part, [0])
        return int(logits[0].argmax())

    def decode(self, next_ids: list[int], steps: int) -> tuple[float, list[list[int]]]:
        """`steps` decode steps of every stream: seconds per step (best of the steps' halves)
        and the greedy tokens."""
        out = [[t] for t in next_ids]
        times = []
        for _ in range(steps):
            sync(self.model.device)
            t0 = time.perf_counter()
            logits = self.runner.forward([Row(c, 1) for c in self.caches], [o[-1] for o in out], list(range(len(out))))
            ids = logits.argmax(-1).tolist()
            sync(self.model.device)
            times.append(time.perf_counter() - t0)
            for o, t in zip(out, ids):
                o.append(t)
        times.sort()
        return sum(times[: max(1, len(times) // 2)]) / max(1, len(times) // 2), out

    def release(self) -> None:
        for cache in self.caches:
            kv.free(cache)
        self.pool.release()


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def identical(models) -> str:
    got = {}
    for mode, model in models.items():
        r = Runner(model, 1, 64)
        first = r.prefill(r.caches[0], prompt(64, 7))
        got[mode] = r.decode([first], 23)[1][0]
        r.release()
    same = sum(a == b for a, b in zip(got["heads"], got["latent"]))
    prefix = next((i for i, (a, b) in enumerate(zip(got["heads"], got["latent"])) if a != b), len(got["heads"]))
    return f"greedy: {same}/{len(got['heads'])} tokens alike, identical prefix {prefix}"


def measure(models, streams: int, context: int, steps: int) -> dict[str, dict[str, float]]:
    out = {}
    for mode, model in models.items():
        r = Runner(model, streams, context)
        t0 = time.perf_counter()
        firsts = [r.prefill(c, prompt(context, i)) for i, c in enumerate(r.caches)]
        sync(model.device)
        prefill = (time.perf_counter() - t0) / streams
        step, _ = r.decode(firsts, steps)
        row = {"decode_tok_s": streams / step, "prefill_s": prefill, "bytes": r.pool.layout.bytes_per_token(model.dtype)}
        if mode == "latent" and streams == 1:  # a later turn over the cached context, against it fresh
            cache = r.caches[0]
            kv.crop(cache, context)
            t0 = time.perf_counter()
            r.prefill(cache, prompt(TURN, 99))
            sync(model.device)
            row["turn_s"] = time.perf_counter() - t0
            row["fresh_s"] = prefill
        r.release()
        out[mode] = row
    return out


def kernel_counts(models) -> str:
    counts = {mode: kernels.count_decode_step(model, 1) for mode, model in models.items()}
    per_layer = {mode: sum(c.layers[-1].values()) for mode, c in counts.items()}
    return f"kernels per layer of a decode step: heads {per_layer['heads']}, latent {per_layer['latent']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--streams", default="1,4")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--budget-gib", type=float, default=40.0)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    print("\n".join(real_shapes(args.budget_gib)))
    models = {mode: build(device, dtype, mode) for mode in ("heads", "latent")}
    print(identical(models))
    print(kernel_counts(models))
    print("| streams | context | decode tok/s, heads | latent | latent speed-up | prefill s, heads | latent | latent speed-up |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    turns = []
    for context in (int(c) for c in args.contexts.split(",")):
        for streams in (int(s) for s in args.streams.split(",")):
            m = measure(models, streams, context, args.steps)
            h, lat = m["heads"], m["latent"]
            print(f"| {streams} | {context} | {h['decode_tok_s']:.1f} | {lat['decode_tok_s']:.1f} | "
                  f"{lat['decode_tok_s'] / h['decode_tok_s']:.2f} | {h['prefill_s']:.2f} | {lat['prefill_s']:.2f} | "
                  f"{h['prefill_s'] / lat['prefill_s']:.2f} |", flush=True)
            if "turn_s" in lat:
                turns.append(f"later turn over {context} cached tokens: {lat['turn_s'] * 1000:.0f} ms vs "
                             f"{lat['fresh_s'] * 1000:.0f} ms fresh ({lat['fresh_s'] / lat['turn_s']:.1f}x)")
    print(f"KV bytes per token of this model: heads {h['bytes']:,}, latent {lat['bytes']:,} ({h['bytes'] / lat['bytes']:.1f}x)")
    print("\n".join(turns))


if __name__ == "__main__":
    main()
