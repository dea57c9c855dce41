"""The architecture matrix (bench/architectures.py): every decoder-only family transformers ships
that a user could serve, as a tiny random-weight model, is either refused at load (as the server
loads it: `families.check`, then the engine as it starts) by `UnsupportedModel` naming the
feature this file expects, or greedy-identical to transformers' own `generate` (identical
tokens, or a near-tie where they part: tests/equivalence.py) alone, batched, reusing a session,
on the paged path, in exact mode and with prompt lookup. No family may run and differ.

A family that starts being refused, or stops being refused, fails here until `REFUSED` says so.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import architectures
from cache_manager import kv
from tests.device import DEVICE, DTYPE

# Hybrids and pure state-space models (recurrent state per sequence, cache_manager/state.py): served, but not with
# speculation or in exact mode, which their engines refuse at start-up by name
HYBRIDS = ("qwen3_next", "qwen3_5_text", "olmo_hybrid", "kimi_linear", "bailing_hybrid", "granitemoehybrid", "jamba", "jamba-shapes", "bamba", "bamba-shapes",
           "nemotron_h", "falcon_h1", "lfm2", "mamba", "mamba-shapes", "falcon_mamba", "mamba2", "minimax", "recurrent_gemma")
# Multi-head latent attention: served from the latent (server/engine/mla.py), whose bytes the pool counts
MLA = ("deepseek_v2", "deepseek_v3", "minicpm3", "glm4_moe_lite", "longcat_flash", "youtu", "axk1", "kimi_linear", "bailing_hybrid")
HYBRID_MODES = {"exact": "refused [recurrent-exact]", "lookup": "refused [recurrent-speculative]"}

# family -> the feature UnsupportedModel names when the engine refuses it
REFUSED = {
    # attention kvserve does not model
    "deepseek_v32": "layers-indexed_attention",  # MLA with a sparse top-k indexer, as the next three
    "axk2": "layers-indexed_attention",
    "hy_v4": "layers-indexed_attention",
    "glm_moe_dsa": "layers-indexed_attention",
    "gemma4_text": "per-layer-config",  # a head size per layer (transformers' per_layer_config)
    "doge": "attention-mask",  # its attention adds a learned dynamic mask to the scores
    "mimo_v2_flash": "kv-width",  # its sliding layers have twice the KV heads of its full ones
    # modeling code that never calls kvserve's attention
    "falcon": "attention-backend",
    "bloom": "attention-backend",
    "mpt": "attention-backend",
    "gpt_neo": "attention-backend",
    "gptj": "attention-backend",
    "codegen": "attention-backend",
    "xglm": "attention-backend",
}


@pytest.mark.parametrize("family", list(architectures.FAMILIES))
def test_family_is_refused_by_name_or_matches_generate(family, tokenizer):
    result = architectures.run_family(family, tokenizer, DEVICE, DTYPE)
    if family in REFUSED:
        assert result.status == "refused" and result.refusal == "UnsupportedModel", (result.status, result.message)
        assert result.feature == REFUSED[family], result.message
        return
    assert result.status == "served", result.message
    assert not result.failed(), result.failed()
    assert set(result.checks) == set(architectures.CHECKS)
    if family in MLA:  # the latent and the rotary key per token and attention layer, nothing per head
        config = architectures.FAMILIES[family].config()
        text = config.get_text_config(decoder=True)
        per_token = (text.kv_lora_rank + text.qk_rope_head_dim) * DTYPE.itemsize
        assert result.kv_bytes_per_token == len(kv.layout(config).owners) * per_token, result.kv_bytes_per_token
    if family in HYBRIDS:
        assert {c: result.checks[c] for c in HYBRID_MODES} == HYBRID_MODES
        return
    assert not any(r.startswith("refused") for r in result.checks.values()), result.checks
    assert result.drafted > 0, "prompt lookup drafted nothing"


def test_every_refusal_names_a_family_of_the_matrix():
    assert set(REFUSED) <= set(architectures.FAMILIES)


def test_the_manual_s_matrix_names_every_family_as_this_test_expects():
    """The manual's generated matrix (`python -m bench.architectures --readme docs/benchmarks.md`)
    lists every family of the matrix, served or refused with the feature `REFUSED` names."""
    readme = (Path(__file__).parents[2] / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    block = readme.partition(architectures.README_BEGIN)[2].partition(architectures.README_END)[0]
    rows = {}
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 2 and cells[0] in architectures.FAMILIES:
            rows[cells[0]] = cells[1]
    assert set(rows) == set(architectures.FAMILIES), "regenerate the manual's matrix"
    for family, status in rows.items():
        assert status == (f"refused [{REFUSED[family]}]" if family in REFUSED else "served"), (family, status)
    assert "| error |" not in block and "DIFF" not in block
