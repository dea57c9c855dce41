"""The architecture matrix: every decoder-only family transformers ships that a user could serve,
as a tiny random-weight model, either refused at load (UnsupportedModel naming a feature) or
greedy-identical to transformers' own `generate` in every way the engine runs it.

    .venv/bin/python -m bench.architectures [--families llama,gpt_oss] [--checks alone,session]
        [--device cpu] [--dtype float32] [--readme docs/benchmarks.md]

`--readme FILE` also writes the table into FILE between README_BEGIN and README_END (the
manual's matrix in docs/benchmarks.md is generated that way; tests/server/test_architectures.py
checks that it still names every family with the status the test expects).

Per family (`FAMILIES`: a tiny config, seeded weights) the first engine starts, refusing the
model as the server would (a refusal ends the row there); the references are `model.generate` (greedy, the model's own attention and
cache) on a second copy of the model that kvserve never touches; then one engine per mode
(`MODES`) runs the checks:

* alone: three prompts (39, 57 and 76 tokens) one at a time; max_batch_tokens 64, so the
  longest is prefilled in two chunks.
* batched: the same three submitted together (prefill chunks beside decode rows).
* session: two sessions, turn 1 of both together, then turn 2 of both, each extending its
  turn 1's prompt and reply: tokens those of `generate` on the whole turn-2 prompt, and
  cached_tokens exactly what turn 1 committed (`expected_reuse`).
* paged: the three together on the paged attention path (CUDA's; eager on CPU).
* exact: the three together in exact mode (`EngineConfig(exact=True)`).
* lookup: prompt-lookup speculation (`NgramProposer`, adaptive off, 6 drafted tokens at most)
  on the two prompts, of five, whose references repeat themselves most; the drafted and
  accepted counts are reported.

A check is `ok` when the tokens are identical or the first differing step is a near-tie of the
reference's own logits (tests/equivalence.py's NEAR_TIE), `DIFF` when they differ, `ERROR` when
the engine failed a request. Tiny configs: hidden 64, 4 heads of 16 over 2 KV heads, 2-4
layers, vocab 49152 (SmolLM2's tokenizer), sliding windows of 20 and 24 tokens (not a multiple
of the KV block, shorter than every prompt), MoE with 4 small experts; LongRoPE's switch is at
64 tokens, which the second prompt crosses while decoding (session a's turn 1), the third
starts past, and session b's turn 2 crosses from a short turn 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from cache_manager import kv
from cache_manager.manager import CacheConfig, CacheManager
from server.engine.core import Engine, EngineConfig, end_of_turn_ids
from server.engine import families
from server.engine.unsupported import UnsupportedModel
from server.engine.prompt_lookup import NgramProposer
from server.engine.sampling import SamplingParams
from server.engine.sequence import GenerationRequest
from server.engine.speculative import SpeculativeConfig
from server.metrics import Metrics
from tests.equivalence import NEAR_TIE

CHECKS = ("alone", "batched", "session", "paged", "exact", "lookup")
MAX_TOKENS = 10  # each reply; prompt lookup's gets LOOKUP_TOKENS
LOOKUP_TOKENS = 32
MAX_CONTEXT = 256
BUDGET = 2**24  # the KV pool of each engine
WINDOW, WINDOW_B = 20, 24  # sliding windows: not multiples of kv.BLOCK_SIZE, shorter than every prompt
LONGROPE_ORIGINAL = 64  # LongRoPE's original context: the prompts and replies cross it
DRAFTED, ACCEPTED = "kvserve_spec_decode_draft_tokens_total", "kvserve_spec_decode_accepted_tokens_total"

# -- the families ------------------------------------------------------------------------------

TINY = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, tie_word_embeddings=False,
)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)  # Mixtral's names
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)  # Qwen's names; others spell their own
# multi-head latent attention: keys 16 + 8 (rope) wide, values 12, over latents of 32 (queries) and 24 (KV:
# no width equal to another, so a transposed up-projection cannot pass)
MLA = dict(q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, head_dim=8, num_key_value_heads=4)
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16)


def _rope_factors(value: float, n: int = 8) -> list[float]:
    """LongRoPE's per-frequency factors for head_dim 16 (8 frequencies), not all alike."""
    return [value * (1 + i / n) for i in range(n)]


@dataclass(frozen=True)
class Family:
    """A tiny config of `model_type`: TINY with `overrides` (None drops a TINY key)."""

    model_type: str
    overrides: dict = field(default_factory=dict)
    note: str = ""

    def config(self) -> PretrainedConfig:
        kw = {**TINY, **self.overrides}
        return AutoConfig.for_model(self.model_type, **{k: v for k, v in kw.items() if v is not None})


def _layers(*kinds: str) -> dict:
    return dict(num_hidden_layers=len(kinds), layer_types=list(kinds))


SLIDE, FULL = "sliding_attention", "full_attention"

FAMILIES: dict[str, Family] = {
    "llama": Family("llama"),
    "mistral": Family("mistral", dict(sliding_window=WINDOW)),
    "ministral": Family("ministral", dict(sliding_window=WINDOW, **_layers(SLIDE, FULL))),
    "mixtral": Family("mixtral", dict(sliding_window=WINDOW, **MOE)),
    "qwen2": Family("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW_B, max_window_layers=1, num_hidden_layers=3)),
    "qwen2_moe": Family("qwen2_moe", dict(**EXPERTS, shared_expert_intermediate_size=64)),
    "qwen3": Family("qwen3"),
    "qwen3_moe": Family("qwen3_moe", dict(**EXPERTS)),
    "gemma": Family("gemma"),
    "gemma2": Family("gemma2", dict(sliding_window=WINDOW, query_pre_attn_scalar=16, **_layers(SLIDE, FULL)), "soft-capping"),
    "gemma3_text": Family("gemma3_text", dict(sliding_window=WINDOW, query_pre_attn_scalar=16, **_layers(SLIDE, SLIDE, FULL)),
                          "local/global RoPE"),
    "gemma3n_text": Family("gemma3n_text", dict(
        sliding_window=WINDOW, num_hidden_layers=4, layer_types=[SLIDE, FULL, SLIDE, FULL], num_kv_shared_layers=2,
        activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0], vocab_size_per_layer_input=49152,
        hidden_size_per_layer_input=8, laurel_rank=8, altup_num_inputs=2), "KV shared across layers, AltUp"),
    "vaultgemma": Family("vaultgemma", dict(sliding_window=WINDOW, query_pre_attn_scalar=16, **_layers(SLIDE, FULL))),
    "phi": Family("phi", dict(num_key_value_heads=None, head_dim=None), "partial rotary, parallel block"),
    "phi3": Family("phi3", dict(sliding_window=None)),
    "phi3-longrope": Family("phi3", dict(
        sliding_window=None, original_max_position_embeddings=LONGROPE_ORIGINAL,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=_rope_factors(1.0),
                             long_factor=_rope_factors(3.0), original_max_position_embeddings=LONGROPE_ORIGINAL)),
        "LongRoPE: short factors below 64 positions, long past them"),
    "phimoe": Family("phimoe", dict(sliding_window=None, **MOE)),
    "granite": Family("granite", dict(embedding_multiplier=2.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.0)),
    "granitemoe": Family("granitemoe", dict(attention_multiplier=0.2, **MOE)),
    "granitemoeshared": Family("granitemoeshared", dict(shared_intermediate_size=64, **MOE)),
    "olmo": Family("olmo"),
    "olmo2": Family("olmo2"),
    "olmo3": Family("olmo3", dict(sliding_window=WINDOW, **_layers(SLIDE, FULL))),
    "olmoe": Family("olmoe", dict(num_experts=4, num_experts_per_tok=2)),
    "cohere": Family("cohere"),
    "cohere2": Family("cohere2", dict(sliding_window=WINDOW, **_layers(SLIDE, SLIDE, FULL)), "NoPE global layers"),
    "smollm3": Family("smollm3", dict(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0]), "NoPE every 4th layer"),
    "glm": Family("glm"),
    "glm4": Family("glm4"),
    "glm4_moe": Family("glm4_moe", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1)),
    "exaone4": Family("exaone4", dict(sliding_window=WINDOW, **_layers(SLIDE, SLIDE, FULL))),
    "starcoder2": Family("starcoder2", dict(sliding_window=WINDOW_B)),
    "gpt_oss": Family("gpt_oss", dict(sliding_window=WINDOW, **_layers(SLIDE, FULL), **MOE, rope_parameters=dict(
        rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=64,
        rope_theta=150000.0)), "attention sinks, YaRN"),
    "deepseek_v2": Family("deepseek_v2", dict(
        MLA, q_lora_rank=None,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        moe_intermediate_size=32, n_shared_experts=1), "MLA"),
    "deepseek_v3": Family("deepseek_v3", dict(
        **MLA,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        moe_intermediate_size=32, n_shared_experts=1), "MLA: keys 24 wide, values 12"),
    "llama4_text": Family("llama4_text", dict(
        num_hidden_layers=4, intermediate_size_mlp=128, attention_chunk_size=WINDOW_B, floor_scale=16, attn_scale=0.1,
        no_rope_layers=[1, 1, 1, 0], num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2),
        "chunked attention, NoPE layers with temperature tuning"),
    "ernie4_5": Family("ernie4_5"),
    "ernie4_5_moe": Family("ernie4_5_moe", dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
                                                moe_layer_start_index=1)),
    "hunyuan_v1_dense": Family("hunyuan_v1_dense"),
    "hunyuan_v1_moe": Family("hunyuan_v1_moe", dict(num_experts=4, moe_topk=2)),
    "seed_oss": Family("seed_oss"),
    "minimax": Family("minimax", dict(layer_types=["linear_attention", "full_attention"], block_size=16, **MOE),
                      "lightning (linear) attention"),
    "minimax_m2": Family("minimax_m2", dict(**MOE)),
    "apertus": Family("apertus", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=12000000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=256)), "xIELU, llama3 RoPE"),
    "helium": Family("helium"),
    "arcee": Family("arcee"),
    "dots1": Family("dots1", dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                                  first_k_dense_replace=1)),
    "bitnet": Family("bitnet"),
    "stablelm": Family("stablelm", dict(head_dim=None)),
    "nemotron": Family("nemotron"),
    "gpt_neox": Family("gpt_neox", dict(num_key_value_heads=None, head_dim=None)),
    "gpt2": Family("gpt2", dict(num_key_value_heads=None, head_dim=None), "learned positions"),
    "gpt_bigcode": Family("gpt_bigcode", dict(num_key_value_heads=None, head_dim=None), "multi-query"),
    "opt": Family("opt", dict(num_key_value_heads=None, head_dim=None, ffn_dim=128, word_embed_proj_dim=64)),
    "falcon": Family("falcon", dict(num_key_value_heads=None, head_dim=None), "no attention interface"),
    "bloom": Family("bloom", dict(num_key_value_heads=None, head_dim=None), "ALiBi"),
    "cohere2_moe": Family("cohere2_moe", dict(sliding_window=WINDOW, **_layers(SLIDE, FULL), **EXPERTS)),
    "exaone_moe": Family("exaone_moe", dict(sliding_window=WINDOW, **_layers(SLIDE, FULL), **EXPERTS)),
    "granite_swa": Family("granite_swa", dict(sliding_window=WINDOW, **_layers(FULL, SLIDE))),
    "cwm": Family("cwm", dict(sliding_window=WINDOW, **_layers(FULL, SLIDE))),
    "nanochat": Family("nanochat"),
    "flex_olmo": Family("flex_olmo", dict(num_experts=4, num_experts_per_tok=2)),
    "laguna": Family("laguna", dict(sliding_window=WINDOW, **_layers(SLIDE, FULL), **EXPERTS)),
    "hy_v3": Family("hy_v3", dict(**EXPERTS)),
    "solar_open": Family("solar_open", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "jais2": Family("jais2"),
    "hyperclovax": Family("hyperclovax"),
    "mellum": Family("mellum", dict(sliding_window=WINDOW, **_layers(SLIDE, FULL), **EXPERTS)),
    "ministral3": Family("ministral3"),
    "mpt": Family("mpt", dict(num_key_value_heads=None, head_dim=None), "ALiBi"),
    "gpt_neo": Family("gpt_neo", dict(num_key_value_heads=None, head_dim=None, attention_types=[[["global", "local"], 1]],
                                      window_size=WINDOW), "local attention layers"),
    "gptj": Family("gptj", dict(num_key_value_heads=None, head_dim=None, rotary_dim=8)),
    "codegen": Family("codegen", dict(num_key_value_heads=None, head_dim=None, rotary_dim=8)),
    "xglm": Family("xglm", dict(num_key_value_heads=None, head_dim=None), "sinusoidal positions"),
    "persimmon": Family("persimmon", dict(num_key_value_heads=None), "partial rotary, qk layernorm"),
    "dbrx": Family("dbrx", dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=2048,
                                attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
                                ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)), "clipped QKV"),
    "jetmoe": Family("jetmoe", dict(num_key_value_heads=2, kv_channels=16, **MOE), "mixture of attention heads"),
    "diffllama": Family("diffllama", {}, "differential attention"),
    "doge": Family("doge", dict(keep_window_size=WINDOW_B), "dynamic mask attention"),
    "minicpm3": Family("minicpm3", MLA, "MLA"),
    "glm4_moe_lite": Family("glm4_moe_lite", dict(
        **MLA,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_layer_types=["dense", "sparse"]), "MLA"),
    "deepseek_v32": Family("deepseek_v32", dict(
        **MLA,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32,
        mlp_layer_types=["dense", "sparse"], layer_types=["indexed_attention"] * 2, index_topk=WINDOW_B, index_head_dim=16,
        index_n_heads=2), "MLA with a sparse top-k indexer"),
    "longcat_flash": Family("longcat_flash", dict(
        **MLA,
        num_layers=1, ffn_hidden_size=128, expert_ffn_hidden_size=32, n_routed_experts=4, zero_expert_num=2, moe_topk=2),
        "two MLA attentions per layer, zero experts"),
    "youtu": Family("youtu", MLA, "MLA"),
    "axk1": Family("axk1", dict(
        **MLA,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32),
        "MLA"),
    "axk2": Family("axk2", dict(
        **MLA,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32),
        "MLA with a sparse top-k indexer"),
    "hy_v4": Family("hy_v4", MLA, "MLA with a sparse top-k indexer"),
    "glm_moe_dsa": Family("glm_moe_dsa", dict(
        **MLA,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), "MLA with a sparse top-k indexer"),
    "mimo_v2_flash": Family("mimo_v2_flash", dict(
        v_head_dim=12, sliding_window=WINDOW, **_layers(FULL, SLIDE), mlp_layer_types=["dense", "sparse"], n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32), "sinks on sliding layers, values narrower than keys"),
    "afmoe": Family("afmoe", dict(sliding_window=WINDOW, **_layers(SLIDE, FULL), **EXPERTS, num_shared_experts=1, num_dense_layers=1),
                    "gated attention"),
    "gemma4_text": Family("gemma4_text", dict(
        sliding_window=WINDOW, **_layers(SLIDE, FULL), hidden_size_per_layer_input=8, vocab_size_per_layer_input=49152,
        per_layer_config={"01": {"head_dim": 32}}), "per-layer head size"),
    "qwen3_next": Family("qwen3_next", dict(
        layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4), "gated delta-net layers"),
    "falcon_h1": Family("falcon_h1", dict(**MAMBA2, mamba_d_ssm=128), "Mamba2 beside attention"),
    "granitemoehybrid": Family("granitemoehybrid", dict(
        layer_types=["mamba", "attention"], **MAMBA2, **MOE,
        shared_intermediate_size=64), "Mamba2 layers"),
    "lfm2": Family("lfm2", dict(full_attn_idxs=[1], block_auto_adjust_ff_dim=False), "short convolutions"),
    "qwen3_5_text": Family("qwen3_5_text", dict(
        layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4), "gated delta-net layers"),
    "olmo_hybrid": Family("olmo_hybrid", dict(
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=32), "gated delta-net layers"),
    "kimi_linear": Family("kimi_linear", dict(
        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"], num_experts=4,
        num_experts_per_token=2, moe_intermediate_size=32, linear_head_dim=16, linear_num_heads=4,
        **{**MLA, "q_lora_rank": None}), "KDA linear attention, MLA"),
    "bailing_hybrid": Family("bailing_hybrid", dict(
        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"], num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, num_expert_group=1, topk_group=1, linear_head_dim=16,
        linear_num_heads=4, **MLA), "linear attention, MLA"),
    "nemotron_h": Family("nemotron_h", dict(
        layers_block_type=["linear_attention", "full_attention", "mlp"], mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
        n_groups=1, chunk_size=16), "Mamba2 layers"),
    "bamba": Family("bamba", dict(attn_layer_indices=[1], **MAMBA2), "Mamba2 layers"),
    # the Mamba shapes of the two entries above and below, changed every way (three layers, the
    # attention one last; expansion 3; other state, head, chunk and convolution sizes)
    "bamba-shapes": Family("bamba", dict(num_hidden_layers=3, attn_layer_indices=[2], mamba_expand=3, mamba_n_heads=8, mamba_d_head=24,
                                         mamba_d_state=8, mamba_chunk_size=8, mamba_d_conv=2), "Mamba2 layers, other shapes"),
    "recurrent_gemma": Family("recurrent_gemma", dict(
        block_types=["recurrent", "attention"], lru_width=64, attention_window_size=WINDOW, num_key_value_heads=1), "RG-LRU layers"),
    "mamba": Family("mamba", dict(state_size=16, expand=2), "state-space only"),
    "mamba-shapes": Family("mamba", dict(num_hidden_layers=3, state_size=8, expand=3, conv_kernel=2, time_step_rank=4),
                           "state-space only, other shapes"),
    "falcon_mamba": Family("falcon_mamba", dict(state_size=16, expand=2), "state-space only, normed B/C/dt"),
    "mamba2": Family("mamba2", dict(num_heads=8, head_dim=16, state_size=16, n_groups=1, chunk_size=16, expand=2),
                     "Mamba2 only"),
    "jamba": Family("jamba", dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                                  num_experts=4, num_experts_per_tok=2, mamba_dt_rank=8), "Mamba layers"),
    "jamba-shapes": Family("jamba", dict(num_hidden_layers=3, attn_layer_period=3, attn_layer_offset=2, expert_layer_period=3,
                                         expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_expand=3, mamba_d_state=8,
                                         mamba_d_conv=2, mamba_dt_rank=4), "Mamba layers, other shapes"),
}


def build(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    """The family's tiny model with seeded random weights, in eval mode."""
    torch.manual_seed(seed)
    config = FAMILIES[name].config()
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()


def tokenizer():
    """SmolLM2's tokenizer (converting the default model once, if it is not yet, into
    $KVSERVE_CACHE_DIR as the server would)."""
    from server.model_loader import convert_gguf, default_gguf_path
    from server.settings import default_cache_dir

    cache_dir = os.environ.get("KVSERVE_CACHE_DIR") or default_cache_dir()
    return AutoTokenizer.from_pretrained(convert_gguf(default_gguf_path(), Path(cache_dir)))


# -- prompts and references --------------------------------------------------------------------

TEXTS = (  # 39, 57 and 76 tokens: LongRoPE's second prompt crosses 64 while decoding, the third starts past it
    "The harbor keeper wrote in the ledger every single evening: the tide, the wind, the ships that came in and the "
    "ones that did not, and what the old fishermen said about the weather.",
    "Once upon a time, in a village between two rivers, there lived a miller who kept a copper lantern burning in his "
    "window all winter long, so that travellers crossing the old stone bridge at night could always find their way to "
    "the market square and to the warm inn beside it.",
    "Granite cliffs rise over the northern shore, where the beacon stands on a ridge of dark stone. In the old days the "
    "keepers carried coal up the narrow stairs twice a day, and in storms they stayed awake until dawn, watching for the "
    "lights of ships that had lost their course in the gale, counting the hours by the bell of the chapel on the hill below.",
)
REPEATED = "apples, pears, plums, cherries; apples, pears, plums, cherries; apples, pears, plums, cherries; apples, pears,"
MORE = " And then, once more, tell me the rest of the story."  # 14 tokens


@dataclass(slots=True)
class Reference:
    """`generate`'s greedy tokens for one prompt (cut after its first end-of-turn token) and
    the raw logits [vocab] at each step."""

    tokens: list[int]
    logits: list[torch.Tensor]


@torch.inference_mode()
def reference(model, prompt: list[int], n: int, eos_ids: frozenset[int], pad_id: int) -> Reference:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=sorted(eos_ids),
        pad_token_id=pad_id, return_dict_in_generate=True, output_logits=True, top_k=None, top_p=None, temperature=None,
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
    return Reference(tokens[:end], [x[0].float().cpu() for x in out.logits[:end]])


def compare(got: list[int], finish: str, want: Reference, eos_ids: frozenset[int]) -> str:
    """`ok` (identical, or a near-tie where they part) or `DIFF ...`; `got` ends at an
    end-of-turn token when `finish` is "stop" (the engine never emits that token)."""
    EOS = -1
    a = got + [EOS] if finish == "stop" else list(got)
    b = [EOS if t in eos_ids else t for t in want.tokens]
    if a == b:
        return "ok"
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if i < min(len(a), len(b)):
        top = torch.topk(want.logits[i], 2).values
        gap = float(top[0] - top[1])
        if gap < NEAR_TIE:
            return f"ok (near-tie at step {i}, gap {gap:.1e})"
        return f"DIFF at step {i} (gap {gap:.2g}): {a} != {b}"
    return f"DIFF length {len(a)} != {len(b)} ({finish}): {a} != {b}"


# -- the engine --------------------------------------------------------------------------------


class _Failures(logging.Handler):
    """The exceptions the engine thread logged (a failed step or request), first line each."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        text = f"{type(exc).__name__}: {exc}" if exc is not None else record.getMessage()
        self.messages.append(text.splitlines()[0] if text else repr(exc))


@contextlib.contextmanager
def _engine_failures():
    handler = _Failures()
    logger = logging.getLogger("server.engine")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


class Served:
    """One started engine over the family's model, with its own KV pool. Refuses the model as
    the server does (`server.startup.build_context`): `families.check` before any cache is
    sized for it, then the engine's own checks as it starts."""

    def __init__(self, model, tok, proposer=None, **engine_kw) -> None:
        families.check(model)
        self.metrics = Metrics()
        cache = CacheManager(model.config, model.device, model.dtype, MAX_CONTEXT, CacheConfig(budget_bytes=BUDGET), self.metrics)
        config = EngineConfig(**{"max_context": MAX_CONTEXT, "max_batch_tokens": 64, **engine_kw})
        self.engine = Engine(model, tok, config, cache, metrics=self.metrics, proposer=proposer)
        self.engine.start()

    async def generate(self, prompt: list[int], max_tokens: int = MAX_TOKENS, session: str | None = None):
        """(tokens, final output) of one greedy request; a private cache without `session`."""
        request = GenerationRequest(f"r{id(prompt)}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                    session_id=session, use_session=session is not None)
        tokens, final = [], None
        async for out in self.engine.submit(request, asyncio.get_running_loop()):
            tokens += [t.token_id for t in out.tokens]
            final = out
        return tokens, final

    def counter(self, name: str) -> float:
        return self.metrics.registry.get_sample_value(name) or 0.0

    def stop(self) -> None:
        self.engine.stop()


# -- one family --------------------------------------------------------------------------------


@dataclass
class Result:
    """One row of the matrix. status: "served", "refused" (the engine refused it when it
    started: `refusal` is the exception's type, `feature` UnsupportedModel's slug) or "error"
    (building the model or the reference failed: `message`)."""

    family: str
    status: str
    feature: str | None = None
    refusal: str | None = None
    message: str = ""
    checks: dict[str, str] = field(default_factory=dict)
    kv_bytes_per_token: int | None = None
    drafted: int = 0  # prompt lookup's drafted tokens, and how many of them were accepted
    accepted: int = 0
    seconds: float = 0.0
    layer_types: tuple[str, ...] = ()

    def failed(self) -> list[str]:
        """Checks that neither passed nor were refused at start-up by name (a mode a family is
        not served in: a hybrid's speculation, say)."""
        return [f"{name}: {result}" for name, result in self.checks.items() if not result.startswith(("ok", "refused"))]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def rope_switch(config) -> int | None:
    """LongRoPE's switch (original_max_position_embeddings), None for other rope."""
    text_config = config.get_text_config(decoder=True)
    rope = getattr(text_config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "longrope":
        return None
    return rope.get("original_max_position_embeddings") or text_config.original_max_position_embeddings


def expected_reuse(committed: list[int], prompt: list[int], switch: int | None) -> int:
    """The cached_tokens of a session turn: the common prefix of what the session committed and
    the prompt (all but the prompt's last token at most). With LongRoPE, none when the cache and
    the prompt are on different sides of the switch: a cache of at most `switch` tokens holds
    short-factor keys (`generate` recomputes a sequence from its first token when it crosses),
    a longer one long-factor keys."""
    common = next((i for i, (x, y) in enumerate(zip(committed, prompt)) if x != y), min(len(committed), len(prompt)))
    if switch is not None and (len(committed) > switch) != (len(prompt) > switch):
        return 0
    return min(common, len(prompt) - 1)


def lookups(prompt: list[int], reply: list[int]) -> int:
    """How many of the reply's steps prompt lookup drafts at, about: those whose last token
    occurred before (`NgramProposer` matches down to one token)."""
    return sum(reply[i - 1] in prompt or reply[i - 1] in reply[: i - 1] for i in range(1, len(reply)))


class Case:
    """One family's prompts and their references (computed at construction, on a model no
    engine may touch), and the checks, each a coroutine over a started engine returning one
    outcome per request (`compare`'s, or `ERROR: ...`)."""

    def __init__(self, model, tok) -> None:
        self.eos_ids = end_of_turn_ids(model, tok)
        self.switch = rope_switch(model.config)
        encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        self.prompts = [encode(t) for t in TEXTS]
        self.refs: dict[tuple, Reference] = {}  # (max tokens, *prompt) -> its reference

        def ref(prompt: list[int], n: int = MAX_TOKENS) -> Reference:
            key = (n, *prompt)
            if key not in self.refs:
                self.refs[key] = reference(model, prompt, n, self.eos_ids, tok.pad_token_id)
            return self.refs[key]

        for p in self.prompts:
            ref(p)
        more = encode(MORE)
        # session a: turn 1 crosses LongRoPE's switch while decoding, turn 2 reuses it; session b:
        # a short turn 1, then a turn 2 past the switch (with LongRoPE: recomputed)
        self.sessions = {
            "a": (self.prompts[1], self.prompts[1] + self.refs[(MAX_TOKENS, *self.prompts[1])].tokens + more),
            "b": (self.prompts[0], self.prompts[0] + self.refs[(MAX_TOKENS, *self.prompts[0])].tokens + more + more),
        }
        for _, turn2 in self.sessions.values():
            ref(turn2)
        # prompt lookup: the two candidates whose reference replies repeat most of what came before
        # (a random model rarely copies its prompt: one holding its own reply may)
        replies = [self.refs[(MAX_TOKENS, *p)].tokens for p in self.prompts]
        candidates = [encode(REPEATED)] + [p + r + p for p, r in zip(self.prompts, replies)] + [self.prompts[0] + replies[0] * 3]
        drafts = {i: lookups(p, ref(p, LOOKUP_TOKENS).tokens) for i, p in enumerate(candidates)}
        self.lookups = [candidates[i] for i in sorted(drafts, key=lambda i: -drafts[i])[:2]]

    def outcome(self, got: list[int], final, prompt: list[int], n: int = MAX_TOKENS) -> str:
        if final is None or final.finish_reason not in ("stop", "length"):
            return f"ERROR: request ended {final.finish_reason if final else 'without output'} ({final.error if final else ''})"
        return compare(got, final.finish_reason, self.refs[(n, *prompt)], self.eos_ids)

    async def alone(self, s: Served) -> list[str]:
        return [self.outcome(*(await s.generate(p)), p) for p in self.prompts]

    async def batched(self, s: Served) -> list[str]:
        outs = await asyncio.gather(*(s.generate(p) for p in self.prompts))
        return [self.outcome(*out, p) for out, p in zip(outs, self.prompts)]

    async def session(self, s: Served) -> list[str]:
        """Both sessions' turn 1 together, then both turn 2s: tokens, and cached_tokens exactly
        `expected_reuse`."""
        firsts = await asyncio.gather(*(s.generate(t1, session=k) for k, (t1, _) in self.sessions.items()))
        seconds = await asyncio.gather(*(s.generate(t2, session=k) for k, (_, t2) in self.sessions.items()))
        out = []
        for (k, (t1, t2)), (got1, final1), (got2, final2) in zip(self.sessions.items(), firsts, seconds):
            out += [self.outcome(got1, final1, t1), self.outcome(got2, final2, t2)]
            if final1.finish_reason in ("stop", "length") and final2.finish_reason in ("stop", "length"):
                committed = t1 + (got1 if final1.finish_reason == "stop" else got1[:-1])
                expected = expected_reuse(committed, t2, self.switch)
                if final2.cached_tokens != expected:
                    out.append(f"DIFF session {k}: cached_tokens {final2.cached_tokens} != {expected}")
        return out

    paged = exact = batched  # the same requests on the paged path, in exact mode

    async def lookup(self, s: Served) -> list[str]:
        outs = await asyncio.gather(*(s.generate(p, LOOKUP_TOKENS) for p in self.lookups))
        return [self.outcome(*out, p, LOOKUP_TOKENS) for out, p in zip(outs, self.lookups)]


# engine settings -> the checks run on one engine with them (prompt lookup's engine also gets a
# proposer); the first engine to start is where a refusal comes
MODES: tuple[tuple[dict, tuple[str, ...]], ...] = (
    ({}, ("alone", "batched", "session")),
    ({"paged": True}, ("paged",)),
    ({"exact": True}, ("exact",)),
    ({"speculative": SpeculativeConfig(max_draft=6, adaptive=False)}, ("lookup",)),
)


def _start(model, tok, engine_kw: dict) -> Served:
    proposer = NgramProposer() if "speculative" in engine_kw else None
    return Served(model, tok, proposer=proposer, **engine_kw)


@contextlib.contextmanager
def _one_thread():
    """Torch ops on one thread inside: the references run on the caller's thread while an
    engine thread holds an OpenMP team of its own, and two teams on a small machine wait on
    each other's wake-ups (docs/architecture.md, "One OpenMP team")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _refused(exc: BaseException) -> bool:
    """A refusal: UnsupportedModel, or a ValueError raised by `kv.layout` (the layer kinds)."""
    if isinstance(exc, UnsupportedModel):
        return True
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "layout" and frame.f_globals.get("__name__") == kv.__name__:
            return isinstance(exc, ValueError)
        tb = tb.tb_next
    return False


def run_family(name: str, tok, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               checks: tuple[str, ...] = CHECKS) -> Result:
    """Build the family's tiny model and start its first engine (a refusal ends here), compute
    the references on a second copy of the model that kvserve never touches, then run each
    check on its engine; the row."""
    t0 = time.perf_counter()
    result = Result(name, "error")
    try:
        model = build(name, device, dtype)
        layer_types, _ = transformers.cache_utils.get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
        result.layer_types = tuple(layer_types)
    except Exception as exc:
        result.message = f"build: {_first_line(exc)}"
        return result
    engines = [(kw, [c for c in names if c in checks]) for kw, names in MODES]
    engines = [(kw, names) for kw, names in engines if names]
    case = None
    for i, (engine_kw, names) in enumerate(engines):
        with _engine_failures() as failures:
            try:
                served = _start(model, tok, engine_kw)
            except Exception as exc:
                if i == 0:
                    result.status = "refused" if _refused(exc) else "error"
                    result.refusal = type(exc).__name__
                    result.feature = getattr(exc, "feature", None)
                    result.message = f"{'' if result.status == 'refused' else 'engine start: '}{_first_line(exc)}"
                    break
                outcome = f"refused [{exc.feature}]" if isinstance(exc, UnsupportedModel) else f"ERROR at start: {_first_line(exc)}"
                result.checks.update((c, outcome) for c in names)
                continue
            if i == 0:  # as its engine keeps it (an MLA model's latent: server/engine/mla.py)
                result.kv_bytes_per_token = served.engine.cache_manager.pool.layout.bytes_per_token(dtype)
            try:
                if case is None:
                    try:
                        with _one_thread():
                            case = Case(build(name, device, dtype), tok)
                    except Exception as exc:
                        result.message = f"reference generate: {_first_line(exc)}"
                        break
                result.status = "served"
                for c in names:
                    seen = len(failures.messages)
                    result.checks[c] = _summary(_run(getattr(case, c), served), failures.messages[seen:])
                    if c == "lookup":
                        result.drafted, result.accepted = int(served.counter(DRAFTED)), int(served.counter(ACCEPTED))
            finally:
                served.stop()
    result.seconds = time.perf_counter() - t0
    return result


def _run(fn: Callable, served: Served) -> list[str]:
    try:
        return asyncio.run(fn(served))
    except Exception as exc:
        return [f"ERROR: {_first_line(exc)}"]


def _summary(outcomes: list[str], logged: list[str]) -> str:
    """A check's result: its first failure (an error with what the engine logged), else `ok`
    (with a near-tie's note, if any)."""
    bad = [o for o in outcomes if not o.startswith("ok")]
    if not bad:
        return next((o for o in outcomes if o != "ok"), "ok")
    if bad[0].startswith("ERROR") and logged:
        return f"ERROR: {logged[0]}"
    return bad[0]


# -- the table ---------------------------------------------------------------------------------


def _cell(result: str) -> str:
    if result.startswith("ok"):
        return "ok" + (" (tie)" if "near-tie" in result else "")
    if result.startswith("refused"):
        return result
    return result.split(":")[0].split(" at ")[0].split(" (")[0].strip()


_KINDS = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked", "linear_attention": "linear",
          "dummy": "MLP only"}


def table(results: list[Result]) -> str:
    """The matrix in markdown, then each failure's or refusal's message (first line)."""
    lines = [
        f"transformers {transformers.__version__}, torch {torch.__version__}",
        "",
        "| family | status | " + " | ".join(CHECKS) + " | KV bytes/token | layers | what it exercises |",
        "|---" * (len(CHECKS) + 5) + "|",
    ]
    for r in results:
        kinds = ", ".join(sorted({_KINDS.get(k, k) for k in r.layer_types}))
        cells = [_cell(r.checks[c]) if c in r.checks else "-" for c in CHECKS]
        if "lookup" in r.checks and r.checks["lookup"].startswith("ok"):
            cells[CHECKS.index("lookup")] += f" ({r.accepted}/{r.drafted})"
        status = {"served": "served", "refused": f"refused [{r.feature or r.refusal}]"}.get(r.status, "error")
        kv_bytes = str(r.kv_bytes_per_token) if r.kv_bytes_per_token is not None else "-"
        note = FAMILIES[r.family].note if r.family in FAMILIES else ""
        lines.append(f"| {r.family} | {status} | " + " | ".join(cells) + f" | {kv_bytes} | {kinds} | {note} |")
    notes = [(r.family, r.message or "; ".join(r.failed())) for r in results if r.message or r.failed()]
    if notes:
        lines += ["", "Refusals and failures (first line):", ""]
        lines += [f"- {family}: {text if len(text) < 300 else text[:297] + '...'}" for family, text in notes]
    return "\n".join(lines)


README_BEGIN = "<!-- bench.architectures: begin (generated: python -m bench.architectures --readme docs/benchmarks.md) -->"
README_END = "<!-- bench.architectures: end -->"


def write_readme(path: str, text: str) -> None:
    """Replace what stands between README_BEGIN and README_END in `path` with `text`."""
    with open(path, encoding="utf-8") as f:
        readme = f.read()
    head, begin, rest = readme.partition(README_BEGIN)
    _, end, tail = rest.partition(README_END)
    if not begin or not end:
        raise SystemExit(f"{path} has no {README_BEGIN} ... {README_END} block")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{head}{README_BEGIN}\n{text}\n{README_END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated names from FAMILIES")
    parser.add_argument("--checks", default=",".join(CHECKS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--readme", default=None, help="also write the table into this file's generated block")
    args = parser.parse_args()
    names = [n for n in args.families.split(",") if n]
    checks = tuple(c for c in args.checks.split(",") if c)
    unknown = [n for n in names if n not in FAMILIES] + [c for c in checks if c not in CHECKS]
    if unknown:
        parser.error(f"unknown families or checks {unknown}; choose from {', '.join(FAMILIES)}; {', '.join(CHECKS)}")
    torch.set_grad_enabled(False)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    tok = tokenizer()
    results = []
    for name in names:
        results.append(run_family(name, tok, torch.device(args.device), getattr(torch, args.dtype), checks))
        r = results[-1]
        cells = " ".join(f"{c} {_cell(v)}" for c, v in r.checks.items())
        print(f"{name}: {r.status} {r.feature or r.refusal or ''} {cells} ({r.seconds:.1f} s)", flush=True)
    print()
    print(table(results))
    if args.readme:
        write_readme(args.readme, table(results))


if __name__ == "__main__":
    main()
