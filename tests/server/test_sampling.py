import math

import pytest
import torch

from server.sampling import (
    SamplingParams,
    apply_logit_bias,
    apply_penalties,
    filter_top_k,
    filter_top_p,
    make_generator,
    sample,
    top_logprobs,
)


def test_params_validate_bounds():
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=1, temperature=3)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=1, top_p=0)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=1, top_logprobs=21)
    assert SamplingParams(max_tokens=1, temperature=0).greedy
    assert SamplingParams(max_tokens=1, top_k=1).greedy
    assert not SamplingParams(max_tokens=1).greedy


def test_logit_bias_adds_to_listed_ids_only():
    logits = torch.zeros(5)
    out = apply_logit_bias(logits, {1: 2.5, 4: -100})
    assert out.tolist() == [0, 2.5, 0, 0, -100]
    assert logits.tolist() == [0] * 5  # input untouched


def test_penalties_follow_openai_definition():
    logits = torch.tensor([1.0, 1.0, 1.0])
    counts = torch.tensor([0, 1, 3])
    out = apply_penalties(logits, counts, presence=0.5, frequency=0.25)
    assert out.tolist() == pytest.approx([1.0, 1.0 - 0.5 - 0.25, 1.0 - 0.5 - 0.75])


def test_top_k_keeps_k_largest():
    out = filter_top_k(torch.tensor([1.0, 5.0, 3.0, 4.0]), 2)
    assert out[1] == 5 and out[3] == 4
    assert math.isinf(out[0]) and math.isinf(out[2])


def test_top_p_keeps_smallest_set_reaching_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    out = filter_top_p(probs.log(), 0.75)
    kept = [not math.isinf(v) for v in out.tolist()]
    assert kept == [True, True, False, False]
    # the most likely token always survives
    assert not math.isinf(filter_top_p(probs.log(), 0.1)[0])


def test_seeded_sampling_is_reproducible_and_greedy_is_argmax():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(max_tokens=1, temperature=1.0)
    draws_a = [sample(logits, params, g) for g in [make_generator(7)] for _ in range(20)]
    g = make_generator(7)
    draws_b = [sample(logits, params, g) for _ in range(20)]
    assert draws_a == draws_b
    assert len(set(draws_a)) > 1
    assert sample(logits, SamplingParams(max_tokens=1, temperature=0), make_generator(None)) == int(logits.argmax())


def test_top_logprobs_sorted():
    lp = torch.log_softmax(torch.tensor([0.0, 3.0, 1.0, 2.0]), -1)
    top = top_logprobs(lp, 2)
    assert [t for t, _ in top] == [1, 3]
    assert top[0][1] > top[1][1]
