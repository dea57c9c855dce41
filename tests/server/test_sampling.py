import math

import pytest
import torch

from server.engine.sampling import (
    SamplingParams,
    apply_logit_bias,
    apply_penalties,
    filtered_probs,
    logprob_infos,
    make_generator,
    sample,
    sample_rows,
)
from tests.device import DEVICE


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


def test_logit_bias_adds_each_rows_own_to_listed_ids_only():
    logits = torch.zeros(3, 5, device=DEVICE)
    out = apply_logit_bias(logits, [{1: 2.5, 4: -100}, {}, {0: 1.0, 4: 0.5}])
    assert out.tolist() == [[0, 2.5, 0, 0, -100], [0] * 5, [1.0, 0, 0, 0, 0.5]]
    assert logits.tolist() == [[0] * 5] * 3  # input untouched
    assert apply_logit_bias(logits, [{}, {}, {}]) is logits


def test_penalties_follow_openai_definition():
    logits = torch.tensor([1.0, 1.0, 1.0], device=DEVICE)
    counts = torch.tensor([0, 1, 3], device=DEVICE)
    out = apply_penalties(logits, counts, presence=0.5, frequency=0.25)
    assert out.tolist() == pytest.approx([1.0, 1.0 - 0.5 - 0.25, 1.0 - 0.5 - 0.75])


def kept(logits, **params):
    probs = filtered_probs(torch.as_tensor(logits, device=DEVICE)[None], [SamplingParams(max_tokens=1, **params)])[0]
    return [p > 0 for p in probs.tolist()]


def test_top_k_keeps_k_largest():
    assert kept([1.0, 5.0, 3.0, 4.0], top_k=2) == [False, True, False, True]


def test_top_p_keeps_smallest_set_reaching_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], device=DEVICE)
    assert kept(probs.log(), top_p=0.75) == [True, True, False, False]
    # the most likely token always survives
    assert kept(probs.log(), top_p=0.1) == [True, False, False, False]


@pytest.mark.parametrize("params", [{"top_p": 5e-324}, {"top_p": 1e-50, "top_k": 3}, {"temperature": 5e-324}])
def test_extreme_parameters_draw_the_most_likely_token(params):
    """A top_p or temperature that rounds to 0 in float32 (schemathesis found top_p=5e-324
    turning every probability into NaN: a 500) samples the argmax."""
    logits = torch.tensor([[0.1, 2.0, 1.0, -1.0]], device=DEVICE)
    for seed in range(5):
        assert sample_rows(logits, [SamplingParams(max_tokens=1, **params)], [make_generator(seed)]) == [1]


def test_each_row_filters_with_its_own_parameters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3, device=DEVICE))
    params = [SamplingParams(max_tokens=1, top_k=1, temperature=1), SamplingParams(max_tokens=1, top_p=0.75), SamplingParams(max_tokens=1)]
    probs = filtered_probs(logits, params)
    assert [[p > 0 for p in row] for row in probs.tolist()] == [
        [True, False, False, False], [True, True, False, False], [True] * 4,
    ]
    # a row's probabilities do not depend on the other rows
    assert torch.equal(probs[1], filtered_probs(logits[1:2], params[1:2])[0])


def test_seeded_rows_draw_from_their_own_generators():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    params = [SamplingParams(max_tokens=1, seed=s, **kw) for s, kw in zip((1, 2, 3, 4), ({}, {"temperature": 0}, {"top_p": 0.9}, {}))]
    together = sample_rows(logits, params, [make_generator(s) for s in (1, 2, 3, 4)])
    alone = [sample_rows(logits[i : i + 1], params[i : i + 1], [make_generator(s)])[0] for i, s in enumerate((1, 2, 3, 4))]
    assert together == alone
    assert together[1] == int(logits[1].argmax())


def test_rows_without_a_generator_draw_together_each_from_its_own_distribution():
    """Rows without a generator (the engine's unseeded requests) are drawn in one call: each row's draws follow its own filtered
    distribution (two tokens at 3:1 in one row, 1:3 in the other; a point mass in a third)."""
    logits = torch.full((3, 50), -math.inf, device=DEVICE)
    logits[0, 7], logits[0, 9] = math.log(3.0), 0.0
    logits[1, 7], logits[1, 9] = 0.0, math.log(3.0)
    logits[2, 30] = 0.0
    params = [SamplingParams(max_tokens=1)] * 3
    draws = [sample_rows(logits, params, [None] * 3) for _ in range(400)]
    firsts = [d[0] for d in draws]
    seconds = [d[1] for d in draws]
    assert set(firsts) == set(seconds) == {7, 9} and {d[2] for d in draws} == {30}
    assert 0.65 < firsts.count(7) / 400 < 0.85 and 0.65 < seconds.count(9) / 400 < 0.85


def test_seeded_sampling_is_reproducible_and_greedy_is_argmax():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=7)
    draws_a = [sample(logits, params, g) for g in [make_generator(7)] for _ in range(20)]
    g = make_generator(7)
    draws_b = [sample(logits, params, g) for _ in range(20)]
    assert draws_a == draws_b
    assert len(set(draws_a)) > 1
    assert sample(logits, SamplingParams(max_tokens=1, temperature=0), make_generator(None)) == int(logits.argmax())


def test_logprob_infos_give_each_row_its_chosen_and_top_logprobs():
    lp = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 1.0, 0.5]], device=DEVICE), -1)
    (chosen0, top0), (chosen1, top1) = logprob_infos(lp, [2, 3], [2, 0])
    assert [t for t, _ in top0] == [1, 3] and top0[0][1] > top0[1][1] and top1 == []
    assert chosen0 == float(lp[0, 2]) and chosen1 == float(lp[1, 3])
    assert top0[0][1] == float(lp[0, 1])
    tied = torch.log_softmax(torch.tensor([[1.0, 2.0, 0.0, 2.0, 2.0]] * 3, device=DEVICE), -1)
    assert [t for t, _ in logprob_infos(tied, [0, 0, 0], [3, 2, 1])[1][1]] == [1, 3]  # ties: lower id first


def test_a_step_whose_tokens_are_chosen_on_the_device_takes_them_and_others_the_sampler():
    """`sampler.chosen_on_device` with the model runner's argmax of each row (a decode step's
    `greedy`): greedy rows take it as it is (a logit bias included: the runner's argmax adds
    it), and `choose` takes what it chose; a row with logprobs or penalties leaves the whole
    step to `choose`, which reads the logits. The argmax here is
    deliberately not the logits' own, so the test sees which was used."""
    from server.engine import sampler
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import GenerationRequest, Sequence

    def seq(**params):
        return Sequence(GenerationRequest("r", [1], SamplingParams(**{"max_tokens": 4, "temperature": 0.0, **params})), None, DEVICE)

    logits = torch.zeros(2, 8, device=DEVICE)
    logits[:, 5] = 1.0  # the logits' own argmax: 5
    given = torch.tensor([3, 4, 2], device=DEVICE)
    plain = [seq(), seq(top_k=1), seq(logit_bias={1: 5.0})]
    chosen = sampler.chosen_on_device(plain, torch.zeros(3, 8, device=DEVICE), given)
    assert chosen is given
    assert [t.token_id for t in sampler.choose(plain, logits.clone(), chosen)] == [3, 4, 2]
    assert [t.token_id for t in sampler.choose(plain, torch.zeros(3, 8, device=DEVICE).index_fill_(1, torch.tensor([5], device=DEVICE), 1.0))] == [5, 5, 1]
    for other in (dict(logprobs=True), dict(presence_penalty=0.5)):
        mixed = [seq(), seq(**other)]
        assert sampler.chosen_on_device(mixed, logits.clone(), given[:2]) is None, other
        got = [t.token_id for t in sampler.choose(mixed, logits.clone(), None)]
        assert got[0] == 5 and 3 not in got and 4 not in got, other


def test_draws_chosen_on_the_device_are_the_samplers_draws():
    """Rows that draw (seeded and not, with top-k, top-p and a logit bias) beside greedy rows:
    the tokens `chosen_on_device` draws without a sync are those `choose` draws on the host
    from the same generators' states, and the greedy rows keep the runner's argmax. Without
    the runner's argmax (a step of more than decode rows) every row is chosen there, greedy
    rows included, and the tokens are the same."""
    from server.engine import sampler
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import GenerationRequest, Sequence

    def rows():
        params = [dict(temperature=0.0), dict(temperature=0.9, seed=7), dict(temperature=1.3), dict(temperature=0.8, top_k=20, top_p=0.9, seed=11),
                  dict(temperature=1.0, top_p=0.5, logit_bias={3: 4.0, 9: -100.0}), dict(temperature=0.6, seed=2, logit_bias={int(argmax[5]): -3.0})]
        return [Sequence(GenerationRequest(f"r{i}", [1], SamplingParams(max_tokens=4, **p)), None, DEVICE) for i, p in enumerate(params)]

    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    argmax = logits.argmax(-1)
    for k in range(3):
        on_device, on_host = rows(), rows()
        torch.manual_seed(5 + k)
        chosen = sampler.chosen_on_device(on_device, logits.clone(), argmax)
        assert chosen is not None and chosen.device == logits.device
        torch.manual_seed(5 + k)
        drawn = [t.token_id for t in sampler.choose(on_host, logits.clone())]
        assert chosen.tolist() == drawn
        assert drawn[0] == int(argmax[0])
        torch.manual_seed(5 + k)
        assert sampler.chosen_on_device(rows(), logits.clone(), None).tolist() == drawn


def test_a_row_of_nan_logits_draws_minus_one_and_leaves_the_other_draws_alone():
    """A row whose logits are NaN (a model that overflowed on its input) draws -1 on the device,
    with nothing raised there: on CUDA `torch.multinomial`'s check of its input is a device-side
    assert, after which the process serves no request. The other rows, seeded and not (one
    drawing in the same call as the NaN row), draw what they draw without it. `choose` gives
    that row None and the others their tokens, drawn once, whether the device chose them or the
    host; `draw_rows` refuses it, as it does a row of no probability at all."""
    from server.engine import sampler
    from server.engine.sampling import draw_rows
    from server.engine.sequence import GenerationRequest, Sequence

    params = [dict(temperature=0.9, seed=7), dict(temperature=1.0), dict(temperature=0.8, top_k=5, seed=3), dict(temperature=1.2), dict(temperature=0.0)]

    def rows():
        return [Sequence(GenerationRequest(f"r{i}", [1], SamplingParams(max_tokens=4, **p)), None, DEVICE) for i, p in enumerate(params)]

    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    argmax = logits.argmax(-1)
    poisoned = logits.clone()
    poisoned[1] = float("nan")
    torch.manual_seed(3)
    clean = sampler.chosen_on_device(rows(), logits.clone(), argmax).tolist()
    torch.manual_seed(3)
    dirty = sampler.chosen_on_device(rows(), poisoned, argmax)
    assert dirty.tolist() == clean[:1] + [-1] + clean[2:]
    on_device = sampler.choose(rows(), poisoned.clone(), dirty)
    torch.manual_seed(3)
    on_host = sampler.choose(rows(), poisoned.clone())
    torch.manual_seed(3)
    clean_on_host = [info.token_id for info in sampler.choose(rows(), logits.clone())]
    for got, want in ((on_device, clean), (on_host, clean_on_host)):
        assert got[1] is None
        assert [info.token_id for i, info in enumerate(got) if i != 1] == want[:1] + want[2:]
    with pytest.raises(ValueError, match=r"rows \[1\] drew from no distribution"):
        draw_rows(poisoned.softmax(-1), [None] * len(params))
    with pytest.raises(ValueError):
        draw_rows(torch.zeros(1, 8, device=DEVICE), [None])


def test_choosing_on_the_device_reads_nothing_back():
    """`chosen_on_device` (greedy rows beside draws with top-k, top-p and a bias, seeded or not) asks
    the device for no value (no `int()`, `.item()`, `bool()` of a tensor): on a GPU such a read
    waits for the step's kernels, and the step launched ahead from these tokens would wait too."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from server.engine import sampler
    from server.engine.sampling import SamplingParams
    from server.engine.sequence import GenerationRequest, Sequence

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.reads = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                self.reads.append(func)
            return func(*args, **(kwargs or {}))

    params = [dict(temperature=0.0), dict(temperature=0.9, top_k=5, seed=3), dict(temperature=1.1, top_p=0.8), dict(temperature=0.7, logit_bias={4: 2.0})]
    seqs = [Sequence(GenerationRequest(f"r{i}", [1], SamplingParams(max_tokens=4, **p)), None, DEVICE) for i, p in enumerate(params)]
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with Reads() as mode:
        chosen = sampler.chosen_on_device(seqs, logits, logits.argmax(-1))
        every = sampler.chosen_on_device(seqs, logits, None)  # every row chosen here
    assert chosen is not None and chosen.shape == (4,)
    assert every is not None and every.shape == (4,) and int(every[0]) == int(chosen[0])  # (the greedy row; the others drew again)
    assert mode.reads == []
