"""Reuse decisions on hand-built token lists: exact prefix lengths and miss reasons."""

import pytest

from cache_manager.prefix import (
    DIVERGED,
    MISS_REASONS,
    NEW_SESSION,
    TOO_SHORT,
    ReuseDecision,
    common_prefix_len,
    decide_reuse,
)

# -- common_prefix_len -------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ([], [], 0),
        ([], [1, 2], 0),
        ([1, 2], [], 0),
        ([1, 2, 3], [1, 2, 3], 3),
        ([1, 2, 3], [1, 2, 3, 4, 5], 3),
        ([1, 2, 3, 4, 5], [1, 2, 3], 3),
        ([1, 2, 3], [1, 9, 3], 1),
        ([7, 2, 3], [1, 2, 3], 0),
        ([1, 2, 3, 4], [1, 2, 3, 5], 3),
        ([0], [0], 1),
        ((1, 2, 3), [1, 2, 4], 2),  # tuple vs list: compared by content
        (range(5), [0, 1, 2, 9], 3),
    ],
)
def test_common_prefix_len(a, b, expected):
    assert common_prefix_len(a, b) == expected
    assert common_prefix_len(b, a) == expected


@pytest.mark.parametrize("diff_at", [0, 1, 255, 256, 257, 511, 512, 1000, 1999])
def test_common_prefix_len_long_lists_cross_chunk_boundaries(diff_at):
    a = list(range(2000))
    b = list(range(2000))
    b[diff_at] = -1
    assert common_prefix_len(a, b) == diff_at
    assert common_prefix_len(tuple(a), b) == diff_at


def test_common_prefix_len_long_identical_and_extension():
    a = [5] * 1000
    assert common_prefix_len(a, a + [6, 7]) == 1000
    assert common_prefix_len(a, list(a)) == 1000


# -- ReuseDecision -----------------------------------------------------------------


def test_reuse_decision_validates_its_fields():
    with pytest.raises(ValueError):
        ReuseDecision(0, None)  # a miss always says why
    with pytest.raises(ValueError):
        ReuseDecision(3, DIVERGED)  # a hit has no reason
    with pytest.raises(ValueError):
        ReuseDecision(-1, DIVERGED)
    with pytest.raises(ValueError):
        ReuseDecision(0, "bogus")
    with pytest.raises(ValueError):
        ReuseDecision(0, DIVERGED, crop=True)
    assert ReuseDecision(3, None).hit
    assert not ReuseDecision(0, NEW_SESSION).hit


def test_reuse_decision_is_frozen():
    d = ReuseDecision(2, None)
    with pytest.raises(AttributeError):
        d.n_reused = 3  # type: ignore[misc]


def test_miss_reasons_are_the_documented_set():
    assert MISS_REASONS == (
        "new_session",
        "evicted",
        "expired",
        "diverged",
        "not_croppable",
        "too_short",
        "rope_switch",
        "recurrent_checkpoint",
    )


# -- decide_reuse ------------------------------------------------------------------

CACHED = [10, 11, 12, 13, 14]


def test_new_session_when_nothing_is_cached():
    assert decide_reuse([], [1, 2, 3]) == ReuseDecision(0, NEW_SESSION)


def test_extension_reuses_every_cached_token():
    # Turn N+1 of a chat: the prompt is the cached conversation plus new tokens.
    d = decide_reuse(CACHED, CACHED + [15, 16])
    assert d == ReuseDecision(5, None, crop=False)
    assert d.hit


def test_extension_by_one_token_reuses_all_cached():
    assert decide_reuse(CACHED, CACHED + [99]) == ReuseDecision(5, None)


def test_fully_cached_prompt_recomputes_its_last_token():
    assert decide_reuse(CACHED, CACHED) == ReuseDecision(4, None, crop=True)


def test_regenerate_prompt_is_a_prefix_of_cached():
    # Cached = prompt + the previous answer; regenerating resends only the prompt.
    prompt = CACHED[:3]
    assert decide_reuse(CACHED, prompt) == ReuseDecision(2, None, crop=True)


def test_edit_in_the_middle_crops_to_the_common_prefix():
    prompt = [10, 11, 99, 13, 14, 15]
    assert decide_reuse(CACHED, prompt) == ReuseDecision(2, None, crop=True)


def test_edit_of_the_last_cached_token():
    prompt = [10, 11, 12, 13, 99, 15]
    assert decide_reuse(CACHED, prompt) == ReuseDecision(4, None, crop=True)


def test_first_token_differs_is_diverged():
    assert decide_reuse(CACHED, [99, 11, 12]) == ReuseDecision(0, DIVERGED)


def test_single_token_prompt():
    assert decide_reuse(CACHED, [10]) == ReuseDecision(0, TOO_SHORT)
    assert decide_reuse(CACHED, [99]) == ReuseDecision(0, DIVERGED)
    assert decide_reuse([10], [10]) == ReuseDecision(0, TOO_SHORT)


def test_empty_prompt_is_too_short():
    assert decide_reuse(CACHED, []) == ReuseDecision(0, TOO_SHORT)


def test_two_token_prompt_equal_to_cache_reuses_one():
    assert decide_reuse([1, 2], [1, 2]) == ReuseDecision(1, None, crop=True)


def test_one_token_cache_extended():
    assert decide_reuse([1], [1, 2, 3]) == ReuseDecision(1, None)


def test_reused_tokens_never_exceed_prompt_minus_one():
    for cut in range(len(CACHED) + 3):
        prompt = (CACHED + [15, 16])[:cut]
        d = decide_reuse(CACHED, prompt)
        assert d.n_reused == max(0, min(cut - 1, len(CACHED)))
        assert d.n_reused <= max(0, len(prompt) - 1)


# -- reuse in blocks (anonymous reuse) -----------------------------------------------


def test_block_rounds_down_where_reuse_stops_inside_the_cache():
    cached = list(range(100))
    prompt = list(range(70)) + [999] * 10
    assert decide_reuse(cached, prompt) == ReuseDecision(70, None, crop=True)
    assert decide_reuse(cached, prompt, block=32) == ReuseDecision(64, None, crop=True)
    # 64..95 matching tokens all report 64: the count no longer says which token differed
    for n in range(64, 96):
        assert decide_reuse(cached, list(range(n)) + [999], block=32).n_reused == 64
    # the fully cached prompt (its last token is recomputed) is rounded as well
    assert decide_reuse(cached, cached, block=32).n_reused == 96


def test_block_shorter_common_prefix_is_too_short():
    assert decide_reuse(list(range(100)), list(range(31)) + [999], block=32) == ReuseDecision(0, TOO_SHORT)


def test_block_keeps_an_extension_of_the_whole_cache_exact():
    cached = list(range(45))
    assert decide_reuse(cached, cached + [7, 8], block=32) == ReuseDecision(45, None)


def test_block_must_be_positive():
    with pytest.raises(ValueError):
        decide_reuse([1], [1, 2], block=0)


def test_a_rope_switch_reuses_only_keys_of_the_factors_the_prompt_needs():
    """LongRoPE (switch at 8): keys of a cache of <= 8 tokens took the short factors, of a
    longer one the long factors; a prompt longer than 8 needs long ones."""
    short, long = list(range(100, 107)), list(range(100, 112))
    # short keys, short prompt: reused as usual
    assert decide_reuse(short, short + [1], rope_switch=8, computed=7) == ReuseDecision(7, None)
    # short keys, a prompt past the switch: recomputed with the long factors
    assert decide_reuse(short, short + [1, 2, 3], rope_switch=8, computed=7) == ReuseDecision(0, "rope_switch")
    # long keys, a prompt extending them: reused
    assert decide_reuse(long, long + [1], rope_switch=8, computed=12) == ReuseDecision(12, None)
    # long keys cut back inside the long part: reused; cut to the switch or below: recomputed
    assert decide_reuse(long, long[:10] + [1, 2], rope_switch=8, computed=12) == ReuseDecision(10, None, crop=True)
    assert decide_reuse(long, long[:8] + [1, 2, 3, 4], rope_switch=8, computed=12) == ReuseDecision(0, "rope_switch")
    assert decide_reuse(long, long[:5] + [1], rope_switch=8, computed=12) == ReuseDecision(0, "rope_switch")
    # without a switch nothing changes
    assert decide_reuse(short, short + [1, 2, 3], computed=7) == ReuseDecision(7, None)
