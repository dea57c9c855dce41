"""server/sharding.py's plan, read from configs alone (no ranks): which families' tensor-parallel
plans kvserve runs and which it refuses by name before a weight loads. The shards themselves are
tested on real ranks in tests/e2e/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import transformers

from server import sharding
from server.engine.unsupported import UnsupportedModel


@pytest.mark.parametrize("model_type, styles", [
    ("phi3", "colwise_gather_output, rowwise_split_input"),  # q/k/v gathered on every rank: every head on every rank
    ("olmo2", "colwise_gather_output, rowwise_split_input"),
    ("deepseek_v2", "mla_kv_a_proj"),
])
def test_a_plan_style_kvserve_does_not_run_is_refused_by_name(model_type, styles):
    with pytest.raises(UnsupportedModel) as refused:
        sharding.plan(transformers.CONFIG_MAPPING[model_type](), 2, vision=False, quantized=False)
    assert refused.value.feature == "tensor-parallel-plan"
    assert f"shards layers as {styles}, which kvserve does not run" in str(refused.value)


def test_a_plan_that_leaves_the_heads_whole_is_refused_by_name():
    """DeepSeek-V3's plan shards its experts alone: every rank would compute every head, where each
    rank's pool keeps its share of them."""
    with pytest.raises(UnsupportedModel, match="plan does not split the attention heads") as refused:
        sharding.plan(transformers.CONFIG_MAPPING["deepseek_v3"](), 2, vision=False, quantized=False)
    assert refused.value.feature == "tensor-parallel-plan"


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mixtral", "qwen3_moe", "gemma3_text"])
def test_plans_of_split_heads_and_experts_are_run(model_type):
    config = transformers.CONFIG_MAPPING[model_type]()
    assert sharding.plan(config, 2, vision=False, quantized=False).tp_size == 2
