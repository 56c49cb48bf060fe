"""Mode `suffix`: suffix-automaton drafts from the conversation and a corpus, one-hot q. Hand-worked proposals,
counts and matches against brute force, incrementality, greedy identity, exact sampling, broken-rule control."""

import random

import pytest
import torch

from support.models import tiny_llama
from support.exact import ALPHA, assert_drafted_up_to, assert_greedy_rounds, run, sample_and_fit
from support.broken import ResampleFromP, ResampleFromPFrom
from specchat.engine.drafters.lookup import LookupDrafter
from specchat.engine.drafters.suffix import SuffixAutomaton, SuffixDrafter
from specchat.engine.sampling import SamplingParams


class Tokens:
    def __init__(self, tokens):
        self.tokens, self.device = tokens, torch.device("cpu")


def drafts(drafter, tokens, k=8):
    return drafter.propose(Tokens(tokens), k, None, None).ids.tolist()


# ---------------------------------------------------------------- hand-worked proposals


def test_the_longest_match_wins_and_caps_the_draft():
    # "5 6" was followed by 1 and by 2; "4 5 6", the longer match, only by 1
    d = SuffixDrafter(alpha=1)
    tokens = [4, 5, 6, 1, 9, 5, 6, 2, 4, 5, 6]
    assert d.match_length(tokens) == 3
    assert drafts(d, tokens, k=8) == [1, 9, 5]  # at most round(alpha * 3) = 3 drafts
    assert drafts(SuffixDrafter(alpha=2), tokens, k=8) == [1, 9, 5, 6, 2, 4]
    assert drafts(d, tokens, k=2) == [1, 9]  # and never more than it is asked for


def test_it_asks_for_max_spec_drafts_or_k_if_more():
    assert (SuffixDrafter().draft_len(4), SuffixDrafter().draft_len(20)) == (15, 20)
    assert SuffixDrafter(max_spec=0).draft_len(4) == 4  # K alone caps, as lookup's


def test_the_most_frequent_continuation_wins():
    # "1 2" was followed by 3 twice and by 4 once (the latest): lookup drafts 4, suffix 3
    tokens = [1, 2, 3, 1, 2, 3, 1, 2, 4, 7, 1, 2]
    d = SuffixDrafter()
    assert drafts(d, tokens) == [3, 1]
    assert d.confidence == pytest.approx(2 / 3)  # then "1 2 3" was always followed by 1
    assert LookupDrafter().propose(Tokens(tokens), 2, None, None).ids.tolist() == [4, 7]


def test_ties_go_to_the_most_recent():
    assert drafts(SuffixDrafter(), [1, 2, 3, 1, 2, 4, 1, 2], k=1) == [4]
    assert drafts(SuffixDrafter(), [1, 2, 4, 1, 2, 3, 1, 2], k=1) == [3]


def test_no_match_or_a_short_one_proposes_nothing():
    d = SuffixDrafter()
    assert drafts(d, [1, 2, 3]) == [] and d.match_length([1, 2, 3]) == 0 and d.confidence == 0.0
    assert drafts(d, [7, 1, 7]) == [] and d.match_length([7, 1, 7]) == 0  # "7" alone: shorter than min_match
    assert drafts(SuffixDrafter(min_match=1), [7, 1, 7]) == [1]


def test_the_corpus_drafts_what_the_conversation_never_said():
    d = SuffixDrafter(references=[[8, 9, 1, 2, 5, 6]])
    assert d.match_length([3, 1, 2]) == 2
    assert drafts(d, [3, 1, 2]) == [5, 6]
    later = SuffixDrafter()
    assert drafts(later, [3, 1, 2]) == []
    later.add_reference([1, 2, 5, 6])  # added after the conversation was matched: it is matched again
    assert drafts(later, [3, 1, 2]) == [5, 6]
    # a longer match in the conversation beats the corpus's
    assert drafts(SuffixDrafter(references=[[1, 2, 5, 6]]), [0, 1, 2, 8, 0, 1, 2], k=1) == [8]


def test_no_match_crosses_a_boundary_between_references():
    assert drafts(SuffixDrafter(references=[[1, 2, 3, 4]]), [0, 2, 3]) == [4]  # the control: one sequence matches
    split = SuffixDrafter(references=[[1, 2], [3, 4]])
    assert drafts(split, [0, 2, 3]) == [] and split.match_length([0, 2, 3]) == 0
    ends = SuffixDrafter(references=[[5, 1, 2]])  # the match ends its sequence: nothing follows it
    assert ends.match_length([9, 1, 2]) == 2 and drafts(ends, [9, 1, 2]) == []
    # an empty reference first: its separator must be no token id either (a separator 1 would match the context's
    # last token 1 and propose the next reference's start)
    empty_first = SuffixDrafter(references=[[], [5, 6, 7]], min_match=1)
    assert drafts(empty_first, [0, 1]) == [] and empty_first.match_length([0, 1]) == 0
    assert drafts(empty_first, [0, 5])[:1] == [6]  # the control: a real match


def test_the_corpus_keeps_the_most_recent_tokens():
    d = SuffixDrafter(references=[[1, 2, 3, 4], [5, 6, 7, 8]], max_corpus=10)
    assert drafts(d, [0, 1, 2]) == [3, 4] and drafts(d, [0, 5, 6]) == [7, 8]
    d.add_reference([9, 10, 11, 12])  # 12 tokens > 10: the oldest go, down to half the cap
    assert drafts(d, [0, 1, 2]) == [] and drafts(d, [0, 5, 6]) == [] and drafts(d, [0, 9, 10]) == [11, 12]
    assert d.corpus_tokens == 4 and d.corpus.size == 5  # and a separator
    d.add_reference(list(range(20, 40)))  # longer than the cap: its last 10 tokens
    assert d.corpus_tokens == 10 and drafts(d, [0, 30, 31]) == [32, 33] and drafts(d, [0, 28, 29]) == []


def test_a_new_conversation_never_drafts_from_the_old_one():
    d = SuffixDrafter()
    assert drafts(d, [1, 2, 3, 1, 2]) == [3, 1]
    assert drafts(d, [7, 1, 2]) == []  # rewound and replaced: "1 2" never occurred in it
    assert d.tokens == [7, 1, 2]


def test_the_confidence_threshold_stops_at_a_rare_branch():
    # "1 2" was always followed by 3, then by five different tokens once each (the latest: 14), then by "1 2"
    tokens = [1, 2, 3, 10, 1, 2, 3, 11, 1, 2, 3, 12, 1, 2, 3, 13, 1, 2, 3, 14, 1, 2]
    d = SuffixDrafter(min_confidence=0.1, alpha=4)  # alpha allows 8: only the threshold or the end stops a draft
    assert drafts(d, tokens) == [3, 14, 1, 2] and d.confidence == pytest.approx(0.2)  # 1 * 1/5 * 1 * 1
    d = SuffixDrafter(min_confidence=0.25, alpha=4)
    assert drafts(d, tokens) == [3] and d.confidence == 1.0


def test_a_saved_sequence_that_ends_after_the_match_counts_against_the_draft_s_confidence():
    """Where a saved conversation ended right after the match, that ending is one of the continuations seen: it
    weighs in the confidence (count / all continuations' counts) though it is never drafted; a draft that reaches
    a sequence's end stops there."""
    corpus = [[9, 5, 6, 7, 8, 4], [9, 5, 6, 7]]  # "5 6 7" went on with 8 once, and ended a sequence once
    d = SuffixDrafter(references=corpus, min_confidence=0.1, alpha=4)
    assert drafts(d, [1, 5, 6, 7]) == [8, 4] and d.confidence == pytest.approx(0.5)  # 1/2 * 1 (then the end)
    assert drafts(SuffixDrafter(references=corpus, min_confidence=0.6, alpha=4), [1, 5, 6, 7]) == []  # 1/2 < 0.6
    d = SuffixDrafter(references=[[9, 5, 6, 7, 8]], min_confidence=0.1, alpha=4)
    assert drafts(d, [1, 5, 6, 7]) == [8] and d.confidence == 1.0  # the sequence's end stops the draft, nothing crosses it


def test_a_draft_stops_below_the_threshold_not_at_it():
    tokens = [1, 2, 3, 10, 1, 2, 3, 11, 1, 2, 3, 12, 1, 2, 3, 13, 1, 2, 3, 14, 1, 2]  # "14" has confidence exactly 0.2
    assert drafts(SuffixDrafter(min_confidence=0.2, alpha=4), tokens) == [3, 14, 1, 2]


def test_build_passes_every_option_and_bad_ones_are_refused():
    d = SuffixDrafter.build(None, references=[[1, 2, 3]], min_match=3, alpha=2.0, min_confidence=0.5, max_corpus=7,
                            max_spec=9)
    assert (list(d.references), d.min_match, d.alpha, d.min_confidence, d.max_corpus, d.max_spec) == (
        [[1, 2, 3]], 3, 2.0, 0.5, 7, 9)
    assert d.confidence == 0.0  # nothing proposed yet
    SuffixDrafter(min_match=1, alpha=0.01, max_corpus=1, max_spec=0)  # the smallest allowed
    for bad in ({"min_match": 0}, {"alpha": 0.0}, {"max_corpus": 0}, {"max_spec": -1}):
        with pytest.raises(ValueError, match="need min_match >= 1, alpha > 0, max_corpus >= 1, max_spec >= 0"):
            SuffixDrafter(**bad)


def test_the_corpus_cap_drops_the_oldest_down_to_half():
    """Over the cap (11), the oldest sequences go until at most half of it (5) is left; at the cap, none goes."""
    d = SuffixDrafter(references=[[1] * 6, [2], [3] * 4], max_corpus=11)
    assert [len(ids) for ids in d.references] == [6, 1, 4] and d.corpus_tokens == 11
    d.add_reference([4])
    assert [len(ids) for ids in d.references] == [4, 1] and d.corpus_tokens == 5


def test_a_single_token_match_in_the_corpus_drafts_when_allowed():
    assert drafts(SuffixDrafter(min_match=1, references=[[5, 9]]), [7, 5]) == [9]


def test_a_reference_added_later_is_matched_from_the_start_of_the_context():
    d = SuffixDrafter(references=[[8]])
    assert d.match_length([2, 3]) == 0
    d.add_reference([1, 2, 3, 4, 5, 6])
    assert d.match_length([2, 3]) == 2 and drafts(d, [2, 3]) == [4, 5]
    d = SuffixDrafter(references=[[5, 7, 9, 1]])
    assert drafts(d, [7, 9]) == [1]
    d.add_reference([7, 9, 2])
    d.add_reference([7, 9, 2])
    assert drafts(d, [7, 9]) == [2]  # "7 9" is now followed by 2 twice, by 1 once (the match starts at the root)


def test_the_automaton_is_minimal():
    """As many states as there are classes of substrings with the same end positions (plus the root), each with
    the length of its longest string: the online construction's invariant (a correct but bloated automaton, e.g.
    one that always clones, drafts the same and costs more)."""
    for seed in range(3):
        r = random.Random(seed)
        seq = [r.randrange(3) for _ in range(40)]
        automaton = SuffixAutomaton()
        automaton.extend(seq)
        classes: dict[tuple, int] = {}
        for i in range(len(seq)):
            for j in range(i + 1, len(seq) + 1):
                sub = seq[i:j]
                ends = tuple(e for e in range(len(sub), len(seq) + 1) if seq[e - len(sub) : e] == sub)
                classes[ends] = max(classes.get(ends, 0), len(sub))
        assert len(automaton.length) == len(classes) + 1
        assert sorted(automaton.length[1:]) == sorted(classes.values())


# ---------------------------------------------------------------- against brute force


def state_of(automaton, sub):
    state = 0
    for token in sub:
        state = automaton.next[state].get(token)
        if state is None:
            return None
    return state


@pytest.mark.parametrize("seed", range(4))
def test_occurrence_counts_and_latest_ends_match_brute_force(seed):
    r = random.Random(seed)
    seq = [r.randrange(3) for _ in range(80)]
    automaton = SuffixAutomaton()
    automaton.extend(seq)
    for n in range(1, 9):
        for sub in {tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)}:
            ends = [e for e in range(n, len(seq) + 1) if tuple(seq[e - n : e]) == sub]
            state = state_of(automaton, sub)
            assert (automaton.count[state], automaton.recent[state]) == (len(ends), ends[-1]), sub
    absent = next(s for s in ([r.randrange(3) for _ in range(9)] for _ in range(1000)) if str(s)[1:-1] not in str(seq))
    assert state_of(automaton, absent) is None


def longest_earlier(tokens, texts):
    """The longest suffix of `tokens` that is a substring of one of `texts`."""
    n = 0
    while n < len(tokens) and any(str(tokens[-n - 1 :])[1:-1] in str(t) for t in texts):
        n += 1
    return n


def first_draft(tokens, length):
    """The token most often after an earlier occurrence of the last `length` tokens (ties: the latest)."""
    after = [tokens[e] for e in range(length, len(tokens)) if tokens[e - length : e] == tokens[-length:]]
    return max(after, key=lambda t: (after.count(t), max(i for i, u in enumerate(after) if u == t)))


@pytest.mark.parametrize("seed", range(4))
def test_incremental_matches_and_drafts_match_brute_force(seed):
    """Grown token by token, with a reference added half way: the match length is the longer of the longest
    suffix seen earlier in the context and the longest found in one reference; the first draft from the context
    is its most frequent continuation; and every proposal equals a fresh drafter's."""
    r = random.Random(seed)
    references = [[r.randrange(4) for _ in range(30)] for _ in range(2)]
    tokens = [r.randrange(4) for _ in range(60)]
    d = SuffixDrafter(references=references[:1], min_confidence=0)
    for i in range(1, len(tokens) + 1):
        if i == 30:
            d.add_reference(references[1])
        context, corpus = tokens[:i], references[: 1 + (i >= 30)]
        in_context, in_corpus = longest_earlier(context, [context[:-1]]), longest_earlier(context, corpus)
        longest = max(in_context, in_corpus)
        assert d.match_length(context) == (longest if longest >= 2 else 0), (i, in_context, in_corpus)
        proposed = drafts(d, context)
        assert proposed == drafts(SuffixDrafter(references=corpus, min_confidence=0), context), i
        if in_context >= max(2, in_corpus):
            assert proposed[0] == first_draft(context, in_context), i


def test_proposing_after_one_more_token_does_not_rebuild():
    r = random.Random(0)
    tokens = [r.randrange(20) for _ in range(2000)]
    d = SuffixDrafter(references=[tokens[:500]])
    drafts(d, tokens[:1999])
    context = d.context
    assert d.appended == 1999
    drafts(d, tokens)
    assert d.appended == 2000 and d.context is context  # one token appended, the same automaton
    drafts(d, tokens)
    assert d.appended == 2000 and d.context is context  # the same tokens again: nothing appended
    drafts(d, tokens[:1000])  # rewound: rebuilt from the start
    assert d.appended == 3000 and d.context is not context


# ---------------------------------------------------------------- exactness on the tiny model

# "1 2" occurs earlier, followed by "3 1 2 ...": suffix drafts from the first round on
REPEATING = [1, 2, 3, 1, 2]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, layers=2).requires_grad_(False)


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("corpus", [False, True])
def test_greedy_matches_hf_generate(target, k, corpus):
    ref = target.generate(torch.tensor([REPEATING]), do_sample=False, max_new_tokens=40, min_new_tokens=40)
    expected = ref[0, len(REPEATING) :].tolist()
    # the corpus: the reply itself with its first tokens changed, and a sequence the reply never follows
    references = [[(t + 1) % 12 for t in expected[:8]] + expected[8:], [5, 6, 7, 8, 9, 10]] if corpus else None
    drafter = SuffixDrafter.build(target, references=references)
    out, records = run(target, drafter, REPEATING, k=k, params=SamplingParams(0), max_new_tokens=40)
    assert out == expected
    assert_greedy_rounds(records)
    assert sum(r.accepted for r in records) > 0
    assert k == 1 or sum(r.drafted - r.accepted for r in records) > 0  # and some drafts were rejected
    assert all(r.draft_calls == 0 for r in records)  # no model


def test_a_long_match_drafts_past_k_in_the_loop(target):
    """The prompt repeats 9 tokens: the first round's match is 8 long, so it drafts 8 where K is 2 (a copy in
    progress pays past K), and 2 with max_spec 0. Greedy output is the same either way."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2, 3, 4, 5, 6, 7, 8]
    wide, records = run(target, SuffixDrafter(), prompt, k=2, params=SamplingParams(0), max_new_tokens=20)
    assert records[0].draft_len == 15 and records[0].drafted == 8  # round(alpha * 8) drafts, the whole match's continuation
    narrow, records = run(target, SuffixDrafter(max_spec=0), prompt, k=2, params=SamplingParams(0), max_new_tokens=20)
    assert records[0].draft_len == 2 and records[0].drafted == 2
    assert wide == narrow


# As lookup's test: drafts the peaked target often accepts, found by search. "9 0 6" occurred at the start followed
# by "5 1 5", so the first round drafts all three (a 3-token match allows 3); the target accepts all three in ~53%
# (t1) / ~70% (t0.7-topk5) of the draws, and a wrong residual at position 3 moves a lot of mass.
PEAKED_PROMPT = [9, 0, 6, 5, 1, 5, 8, 3, 9, 0, 6]


@pytest.fixture(scope="module")
def peaked():
    return tiny_llama(seed=0, layers=2, sharpen=8.0, initializer_range=0.1).requires_grad_(False)


CASES = {"t1": SamplingParams(1.0), "t0.7-topk5": SamplingParams(0.7, top_k=5)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("bug", [None, "resample from p at position 3"])
@pytest.mark.slow
def test_sampled_output_matches_target_distribution(peaked, record_property, case, bug):
    """K=3 with draws of K+1 tokens: the first round drafts positions 1..3 and may earn the bonus. The control
    (q is one-hot, so no wrong q: a wrong residual instead) is broken only at draft position 3 and must fail at
    the same settings; measured p = 3.0e-25 (t1), 4.8e-20 (t0.7-topk5), all at position 3."""
    rule = ResampleFromPFrom(3) if bug else None
    fit, stats = sample_and_fit(peaked, SuffixDrafter(), CASES[case], k=3, draws=500, rule=rule, prompt=PEAKED_PROMPT)
    record_property("p_value", fit.p_value)
    assert_drafted_up_to(stats, 3)
    assert stats.num_accepted_tokens_per_pos[2] > 200  # draft 3 is judged, and often kept: not only proposed
    if bug is None:
        assert fit.passed(ALPHA), fit
    else:
        assert fit.p_value < 1e-6 and fit.worst_position == 3 and min(fit.per_position[:2]) > ALPHA, fit


@pytest.mark.slow
def test_distribution_test_catches_a_broken_rule_with_one_hot_q(peaked, record_property):
    """Resampling from p (not p with the draft removed) after any rejected one-hot draft must fail (measured:
    p = 3.0e-19)."""
    fit, stats = sample_and_fit(peaked, SuffixDrafter(), CASES["t1"], k=3, draws=500, rule=ResampleFromP(), prompt=PEAKED_PROMPT)
    record_property("p_value", fit.p_value)
    assert_drafted_up_to(stats, 3)
    assert fit.p_value < 1e-6, fit


def test_second_continuations_are_the_next_most_frequent():
    """benchmarks/tree_gain.py measures a 2-way branch from the continuation seen second most often after the context
    each draft came from: hand-worked on a context where [1, 2] was followed by 3 twice and by 4 once, and [1, 2, 3]
    by 1 only."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "tree_gain.py"
    spec = importlib.util.spec_from_file_location("tree_gain", path)
    tree_gain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tree_gain)
    drafter = SuffixDrafter()
    tokens = [1, 2, 3, 1, 2, 4, 2, 3, 7, 1, 2, 3, 1, 1, 2]
    ids = drafts(drafter, tokens, k=2)
    assert ids == [3, 1]  # [1, 2] -> 3 (2 of 3), then [1, 2, 3] -> 1
    assert tree_gain.second_continuations(drafter, tokens, ids) == [4, None]  # [1, 2, 3] was followed by 1 only
    assert tree_gain.second_continuations(drafter, [5, 6], [9]) == [None]  # no match
