"""Mode `lookup` at unit level: its n-gram index, the match it picks, its proposals, its settings. No model runs;
every expectation is worked by hand from the token lists. (Written for the mutation score of lookup.py.)"""

from __future__ import annotations

import pytest
import torch

from specchat.engine.drafters import build_drafter
from specchat.engine.drafters.lookup import LookupDrafter


class State:
    """What LookupDrafter.propose reads of a TargetState."""

    device = torch.device("cpu")

    def __init__(self, tokens):
        self.tokens = tokens


def ids(drafter, tokens, k):
    return drafter.propose(State(tokens), k, None, None).ids.tolist()


# ---------------------------------------------------------------- settings


def test_default_ngram_range_is_two_to_three():
    for d in (LookupDrafter(), LookupDrafter.build(None), build_drafter("lookup", None)):
        assert (d.max_ngram, d.min_ngram) == (3, 2)
        assert sorted(d.index) == [2, 3]
    d = LookupDrafter.build(None, None, max_ngram=5, min_ngram=1, unrelated_option=7)
    assert (d.max_ngram, d.min_ngram) == (5, 1) and sorted(d.index) == [1, 2, 3, 4, 5]
    assert sorted(LookupDrafter(max_ngram=4, min_ngram=4).index) == [4]


@pytest.mark.parametrize("min_ngram, max_ngram", [(0, 3), (3, 2), (-1, 1), (2, 1)])
def test_a_bad_ngram_range_is_refused(min_ngram, max_ngram):
    with pytest.raises(ValueError, match=rf"^need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}$"):
        LookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram)


@pytest.mark.parametrize("min_ngram, max_ngram", [(1, 1), (1, 3), (3, 3)])
def test_the_range_bounds_themselves_are_allowed(min_ngram, max_ngram):
    d = LookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
    assert sorted(d.index) == list(range(min_ngram, max_ngram + 1))


# ---------------------------------------------------------------- the index


# [1, 2, 3, 1, 2]: the n-grams that end before the last token (each has a following token), n = 1..3, mapped to
# the end of their latest occurrence; the last token's n-grams are not indexed (nothing follows them yet)
INDEX_12312 = {
    1: {(1,): 4, (2,): 2, (3,): 3},
    2: {(1, 2): 2, (2, 3): 3, (3, 1): 4},
    3: {(1, 2, 3): 3, (2, 3, 1): 4},
}


def test_the_index_holds_every_ngram_that_has_a_following_token_at_its_latest_end():
    d = LookupDrafter(max_ngram=3, min_ngram=1)
    d.match([1, 2, 3, 1, 2])
    assert d.index == INDEX_12312
    assert d.tokens == [1, 2, 3, 1, 2]


def test_the_index_grows_round_by_round_to_the_same_table():
    d = LookupDrafter(max_ngram=3, min_ngram=1)
    d.match([1])
    assert d.index == {1: {}, 2: {}, 3: {}}  # one token: nothing follows anything yet
    d.match([1, 2])
    assert d.index == {1: {(1,): 1}, 2: {}, 3: {}}
    d.match([1, 2, 3])
    d.match([1, 2, 3, 1, 2])
    assert d.index == INDEX_12312


def test_a_conversation_extended_in_place_is_indexed():
    """The loop commits tokens by extending state.tokens in place: the drafter must have kept its own copy."""
    d = LookupDrafter(max_ngram=2, min_ngram=2)
    tokens = [4, 5, 6]
    assert d.match(tokens) is None
    tokens.extend([7, 4, 5])
    assert d.match(tokens) == 2  # "4 5" ended at 2, followed by 6
    assert ids(d, tokens, 3) == [6, 7, 4]


def test_a_rewound_or_replaced_conversation_rebuilds_the_index():
    d = LookupDrafter(max_ngram=2, min_ngram=2)
    # "5 6" latest ended at 6 (followed by 9); rewound to a shorter conversation, only its own "5 6" (end 2) counts
    assert ids(d, [5, 6, 7, 8, 5, 6, 9, 5, 6], 2) == [9, 5]
    assert ids(d, [5, 6, 1, 5, 6], 3) == [1, 5, 6]
    # the same length, other tokens: "1 2" followed by 3 is gone, "1 2" is now followed by 8
    assert ids(d, [1, 2, 3, 1, 2], 1) == [3]
    assert ids(d, [1, 2, 8, 1, 2], 1) == [8]
    assert d.index == {2: {(1, 2): 2, (2, 8): 3, (8, 1): 4}}


def test_reset_forgets_the_index():
    d = LookupDrafter(max_ngram=2, min_ngram=1)
    d.match([3, 4, 3])
    assert d.index[1] and d.tokens
    d.reset()
    assert d.tokens == [] and d.index == {1: {}, 2: {}}


# ---------------------------------------------------------------- the match


def test_the_longest_ngram_wins_and_the_latest_occurrence_of_it():
    d = LookupDrafter(max_ngram=3, min_ngram=1)
    # 1-gram "6" latest at end 5 (-> 9), 2-gram "5 6" latest at end 5, 3-gram "4 5 6" at end 3 (-> 1)
    assert d.match([4, 5, 6, 1, 5, 6, 9, 4, 5, 6]) == 3
    assert d.match([5, 6, 7, 5, 6, 9, 8, 5, 6]) == 5  # no 3-gram "8 5 6" before: the latest "5 6"


def test_a_match_of_exactly_min_ngram_tokens_counts_and_a_shorter_one_does_not():
    two = LookupDrafter(max_ngram=3, min_ngram=2)
    assert two.match([7, 8, 1, 7, 8]) == 2  # only the 2-gram "7 8" occurred before
    assert ids(two, [7, 8, 1, 7, 8], 4) == [1, 7, 8]
    assert two.match([7, 9, 1, 8, 7]) is None  # only the 1-gram "7": below min_ngram
    one = LookupDrafter(max_ngram=1, min_ngram=1)
    assert one.match([7, 9, 1, 8, 7]) == 1
    assert ids(one, [7, 9, 1, 8, 7], 2) == [9, 1]


def test_a_match_at_the_very_start_of_the_conversation():
    d = LookupDrafter(max_ngram=3, min_ngram=3)
    assert d.match([1, 2, 3, 4, 1, 2, 3]) == 3  # "1 2 3" at positions 0..2: its n-gram starts at 0
    assert ids(d, [1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]


def test_too_short_a_conversation_has_no_match():
    d = LookupDrafter(max_ngram=3, min_ngram=1)
    assert d.match([]) is None and d.match([5]) is None
    assert d.match([5, 5]) == 1  # "5" at 0, followed by 5


# ---------------------------------------------------------------- proposals


def test_a_proposal_is_one_hot_costs_no_forward_and_stops_at_the_conversations_end():
    d = LookupDrafter()
    p = d.propose(State([1, 2, 3, 4, 5, 1, 2]), 2, None, None)
    assert p.ids.tolist() == [3, 4] and p.ids.dtype == torch.long and p.q is None and p.calls == 0
    p = d.propose(State([1, 2, 3, 4, 5, 1, 2]), 9, None, None)
    assert p.ids.tolist() == [3, 4, 5, 1, 2]  # fewer than K: only what followed the match
    none = d.propose(State([1, 2, 3, 4]), 3, None, None)
    assert none.ids.numel() == 0 and none.ids.dtype == torch.long and none.q is None and none.calls == 0


# ---------------------------------------------------------------- match_length


def test_match_length_counts_equal_tokens_backwards_from_end():
    tokens = [9, 1, 2, 3, 4, 7, 2, 3, 4]
    assert LookupDrafter.match_length(tokens, 5) == 3  # "2 3 4" before 5 equals the last three; 1 != 7
    assert LookupDrafter.match_length(tokens, 5, longest=2) == 2
    assert LookupDrafter.match_length(tokens, 4) == 0  # token 3 at index 3 != the last token 4
    # the whole prefix before `end` matches: counting stops at the conversation's start
    assert LookupDrafter.match_length([1, 2, 3, 1, 2, 3], 3) == 3
    assert LookupDrafter.match_length([5, 5, 5, 5], 2) == 2


def test_match_length_is_capped_at_sixteen_by_default():
    run = list(range(20))
    tokens = run + [99] + run
    assert LookupDrafter.match_length(tokens, 20) == 16
    assert LookupDrafter.match_length(tokens, 20, longest=20) == 20
    assert LookupDrafter.match_length(tokens, 20, longest=17) == 17


# ---------------------------------------------------------------- the index's cost


class CountingDict(dict):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.writes = 0

    def __setitem__(self, key, value) -> None:
        self.writes += 1
        super().__setitem__(key, value)


def test_a_round_indexes_only_the_new_ngrams_and_an_unchanged_conversation_none():
    """The index is extended as the conversation grows: a round with one more token writes one n-gram per n (not
    the whole conversation again), and the same tokens again write nothing and keep the tables."""
    d = LookupDrafter(max_ngram=3, min_ngram=2)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert d.match(tokens) == 2
    counting = {n: CountingDict(table) for n, table in d.index.items()}
    d.index = dict(counting)
    assert d.match(tokens) == 2
    assert all(d.index[n] is counting[n] and counting[n].writes == 0 for n in counting)
    tokens.append(3)
    assert d.match(tokens) == 3  # "1 2 3" ended at 3
    assert all(d.index[n] is counting[n] and counting[n].writes == 1 for n in counting)  # the n-gram ending at 10


def test_k_zero_proposes_an_empty_id_tensor():
    p = LookupDrafter().propose(State([1, 2, 3, 1, 2]), 0, None, None)
    assert p.ids.numel() == 0 and p.ids.dtype == torch.long and p.q is None and p.calls == 0


def test_proposals_are_on_the_states_device():
    """The "meta" device stands in for an accelerator: drafts and an empty proposal live where the target runs."""
    meta = torch.device("meta")
    state = State([1, 2, 3, 1, 2])
    state.device = meta
    assert LookupDrafter().propose(state, 2, None, None).ids.device == meta
    state.tokens = [1, 2, 3]
    assert LookupDrafter().propose(state, 2, None, None).ids.device == meta
