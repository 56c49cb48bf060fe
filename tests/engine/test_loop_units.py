"""The speculative loop's bookkeeping on a scripted target and drafter, with hand-worked expectations.

The target is a counter over V = 8 tokens: after token t it predicts (t + 1) % 8 (logit 5 there, 0 elsewhere),
so with greedy sampling each round's outcome is known: drafts along the chain are accepted, the first one off it
is rejected and replaced by the chain's next token. No model runs; the whole file takes well under a second.
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from specchat.engine.draft_length import MeasuredK
from specchat.engine.drafters.base import Drafter, Proposal
from specchat.engine.drafters.baseline import InBandBaseline
from specchat.engine.acceptance import EXACT
from specchat.engine.loop import AdaptiveK, Controls, clock, generate, one_hot, top_alternatives
from specchat.engine.sampling import SamplingParams

V = 8
GREEDY = SamplingParams(0)


class CounterState:
    """Just what generate() uses of a TargetState: tokens, start, verify, commit, device, vocab, context."""

    device = torch.device("cpu")
    vocab_size = V

    def __init__(self, context_len: int | None = None) -> None:
        self.context_len = context_len
        self.tokens: list[int] = []
        self.verified: list[list[int]] = []

    def start(self, prompt: list[int], progress=None) -> None:
        time.sleep(0.001)  # a measurable prefill
        self.tokens = list(prompt)
        if progress is not None:
            progress(len(prompt), len(prompt))

    @staticmethod
    def logits_after(t: int) -> torch.Tensor:
        row = torch.zeros(V)
        row[(t + 1) % V] = 5.0
        return row

    def verify(self, draft_ids: list[int]) -> torch.Tensor:
        self.verified.append(list(draft_ids))
        return torch.stack([self.logits_after(t) for t in [self.tokens[-1], *draft_ids]])

    def commit(self, new: list[int]) -> None:
        self.tokens.extend(new)


class Scripted(Drafter):
    """Drafts the counter's chain, except position `wrong_at` (0-based), which is shifted by 3 (a sure reject)."""

    def __init__(self, name: str = "scripted", wrong_at: int | None = None) -> None:
        self.name, self.wrong_at, self.ks = name, wrong_at, []

    def propose(self, state, k, params, generator):
        self.ks.append(k)
        last, ids = state.tokens[-1], []
        for j in range(k):
            last = (last + 1) % V
            ids.append((last + 3) % V if j == self.wrong_at else last)
        return Proposal(torch.tensor(ids), None, 1)


def rounds(drafter, *, k=3, max_new=7, eos=(), context_len=None, prompt=(0,), params=GREEDY, **extra):
    controls = Controls(drafter, k=k, sampling=params, **extra)
    state = CounterState(context_len)
    gen = torch.Generator().manual_seed(0)
    # at most 100 rounds: a loop that never ends fails the test instead of hanging it
    return list(itertools.islice(generate(state, list(prompt), controls, max_new_tokens=max_new, eos_ids=set(eos), generator=gen), 100)), state


def ids(records):
    return [t.id for r in records for t in r.tokens]


# ---------------------------------------------------------------- AdaptiveK


def test_adaptive_k_steps_plus_two_minus_one_within_bounds_per_mode():
    """+2 after a fully accepted block, -1 after a rejection, clamped to [k_min, k_max]; a round without drafts
    changes nothing; each mode keeps its own K."""
    a = AdaptiveK(start=3, k_min=2, k_max=6, p_min=0.5)
    assert (a.start, a.k_min, a.k_max, a.p_min) == (3, 2, 6, 0.5)
    assert a.k("x") == 3 and a.ks == {}
    a.update("x", 0, 0)
    assert a.k("x") == 3 and a.ks == {}
    a.update("x", 3, 3)
    assert a.k("x") == 5 and a.k("y") == 3
    a.update("x", 5, 5)
    assert a.k("x") == 6  # 7 clamped to k_max
    a.update("x", 6, 5)
    assert a.k("x") == 5
    a.update("y", 3, 0)
    a.update("y", 2, 1)
    a.update("y", 2, 0)
    assert a.k("y") == 2  # 3 -> 2 -> 2 (k_min), not lower
    assert AdaptiveK().k("z") == 4 and (AdaptiveK().k_min, AdaptiveK().k_max, AdaptiveK().p_min) == (1, 16, 0.0)


def test_the_loop_follows_adaptive_k_and_sets_the_drafters_p_min():
    """AdaptiveK(start=2, k_max=3) with every draft accepted: K = 2, then 3 (2 + 2 clamped), 3, ...; with every
    first draft rejected: 2, then 1, 1 (k_min). The drafter's p_min comes from AdaptiveK, else it is reset to 0."""
    good = Scripted()
    recs, _ = rounds(good, k=9, max_new=20, adaptive=AdaptiveK(start=2, k_max=3, p_min=0.25))
    assert [r.draft_len for r in recs][:4] == [2, 3, 3, 3] and good.p_min == 0.25
    bad = Scripted(wrong_at=0)
    recs, _ = rounds(bad, k=9, max_new=5, adaptive=AdaptiveK(start=2))
    assert [r.draft_len for r in recs] == [2, 1, 1, 1, 0]  # the last one capped by the budget
    plain = Scripted()
    plain.p_min = 0.7
    rounds(plain, k=2, max_new=3)
    assert plain.p_min == 0.0


# ---------------------------------------------------------------- counts and labels


def test_full_acceptance_then_the_budget_caps_the_last_block():
    """Prompt [0], K=3, budget 7: round 0 drafts 1 2 3, all accepted, bonus 4; round 1 may draft only
    7 - 4 - 1 = 2 (the last token needs no draft): 5 6 accepted, bonus 7, and the budget is reached."""
    drafter = Scripted()
    recs, state = rounds(drafter, k=3, max_new=7)
    assert ids(recs) == [1, 2, 3, 4, 5, 6, 7] and state.tokens == [0, 1, 2, 3, 4, 5, 6, 7]
    assert drafter.ks == [3, 2] and state.verified == [[1, 2, 3], [5, 6]]
    r0, r1 = recs
    assert (r0.index, r0.mode, r0.draft_len, r0.drafted, r0.accepted, r0.draft_calls) == (0, "scripted", 3, 3, 3, 1)
    assert (r1.index, r1.draft_len, r1.drafted, r1.accepted) == (1, 2, 2, 2)
    assert r0.rejected == [] and r0.stop_reason is None and r1.stop_reason == "max_new_tokens"
    assert r0.expected_tokens == pytest.approx(4.0) and r1.expected_tokens == pytest.approx(3.0)
    assert [t.kind for t in r0.tokens] == ["accepted"] * 3 + ["bonus"]
    assert [t.position for t in r0.tokens] == [1, 2, 3, 4] and {t.round for t in r1.tokens} == {1}
    assert [t.accept_prob for t in r0.tokens] == [1.0, 1.0, 1.0, None]
    assert [t.q for t in r0.tokens] == [1.0, 1.0, 1.0, None]
    assert r0.tokens[3].top_q == () and r0.tokens[0].top_q[0] == (1, 1.0)
    assert all(t.p == 1.0 and t.top_p == ((t.id, 1.0),) for t in r0.tokens)
    assert r0.exact is True and r0.prefill_s > 0 and r1.prefill_s == 0.0
    assert r0.draft_s >= 0 and r0.verify_s >= 0 and r0.wall_s >= r0.draft_s


def test_a_rejection_emits_the_accepted_drafts_and_a_resampled_token():
    """Drafts 1 5 3 after [0]: 1 accepted, 5 rejected (the target wants 2), 2 resampled; all 3 drafts were
    judged, 1 accepted, [5, 3] rejected; expected tokens 1 + (1 + 1*0 + 1*0*1) = 2."""
    recs, _ = rounds(Scripted(wrong_at=1), k=3, max_new=4)
    r = recs[0]
    assert [t.id for t in r.tokens] == [1, 2] and [t.kind for t in r.tokens] == ["accepted", "resampled"]
    assert (r.draft_len, r.drafted, r.accepted, r.rejected) == (3, 3, 1, [5, 3])
    assert r.expected_tokens == pytest.approx(2.0)
    assert r.tokens[1].q == 0.0 and r.tokens[1].accept_prob is None and r.tokens[1].top_q[0] == (5, 1.0)
    assert r.stop_reason is None
    recs, _ = rounds(Scripted(wrong_at=0), k=3, max_new=4)
    assert [(t.id, t.kind) for t in recs[0].tokens] == [(1, "resampled")] and recs[0].rejected == [4, 2, 3]
    assert (recs[0].drafted, recs[0].accepted, recs[0].expected_tokens) == (3, 0, 1.0)


def test_a_round_without_drafts_is_a_plain_target_step():
    """K=0: one token per round, labelled "target", nothing drafted or proposed, no q."""
    drafter = Scripted()
    recs, state = rounds(drafter, k=0, max_new=3)
    assert ids(recs) == [1, 2, 3] and drafter.ks == [] and state.verified == [[], [], []]
    for r in recs:
        assert (r.draft_len, r.drafted, r.accepted, r.draft_calls, r.expected_tokens) == (0, 0, 0, 0, 1.0)
        (t,) = r.tokens
        assert (t.kind, t.position, t.q, t.top_q, t.accept_prob) == ("target", 1, None, (), None)
    assert [r.stop_reason for r in recs] == [None, None, "max_new_tokens"]


# ---------------------------------------------------------------- stopping


def test_eos_inside_the_accepted_drafts_ends_the_reply_and_uncounts_the_drafts_after_it():
    """Drafts 1 2 3 all accepted, EOS = 2: the reply ends at 2; the draft 3 after it is neither drafted nor
    accepted (2 judged, 2 accepted, expected 1 + 1 + 1)."""
    recs, state = rounds(Scripted(), k=3, max_new=50, eos={2})
    (r,) = recs
    assert [t.id for t in r.tokens] == [1, 2] and state.tokens == [0, 1, 2]
    assert (r.drafted, r.accepted, r.stop_reason, r.expected_tokens) == (2, 2, "eos", 3.0)
    assert [t.kind for t in r.tokens] == ["accepted", "accepted"]
    # drafts 1 2 6: 2 accepted, then rejected; EOS = 2 is the last accepted draft: 2 judged, not 3
    (r,) = rounds(Scripted(wrong_at=2), k=3, max_new=50, eos={2})[0]
    assert [t.id for t in r.tokens] == [1, 2] and (r.drafted, r.accepted, r.stop_reason) == (2, 2, "eos")


def test_eos_as_the_resampled_token_keeps_every_draft_judged():
    """Drafts 1 5 3, 5 rejected, 2 resampled and 2 is EOS: all 3 drafts were judged, 1 accepted."""
    recs, _ = rounds(Scripted(wrong_at=1), k=3, max_new=50, eos={2})
    (r,) = recs
    assert [t.id for t in r.tokens] == [1, 2] and (r.drafted, r.accepted, r.stop_reason) == (3, 1, "eos")


def test_eos_as_the_first_token_and_as_the_bonus():
    """EOS = 1 as a plain step ends after one token; EOS = 4 as the bonus after 1 2 3 ends that round."""
    recs, _ = rounds(Scripted(), k=0, max_new=50, eos={1})
    assert ids(recs) == [1] and recs[0].stop_reason == "eos"
    recs, _ = rounds(Scripted(), k=3, max_new=50, eos={4})
    assert ids(recs) == [1, 2, 3, 4] and len(recs) == 1 and recs[0].stop_reason == "eos"
    assert (recs[0].drafted, recs[0].accepted) == (3, 3)


def test_the_context_window_limits_the_reply_and_names_itself():
    """Context 6 with prompt [0]: at most 5 new tokens. Budget 50: the context stops it ("context"); budget 5
    (the same limit): "max_new_tokens". K=9 is capped to 4 so the verify never passes the window."""
    drafter = Scripted()
    recs, state = rounds(drafter, k=9, max_new=50, context_len=6)
    assert ids(recs) == [1, 2, 3, 4, 5] and len(state.tokens) == 6
    assert drafter.ks == [4] and recs[-1].stop_reason == "context"
    recs, _ = rounds(Scripted(), k=9, max_new=5, context_len=6)
    assert ids(recs) == [1, 2, 3, 4, 5] and recs[-1].stop_reason == "max_new_tokens"
    recs, _ = rounds(Scripted(), k=1, max_new=50, context_len=4, prompt=(0, 1))
    assert ids(recs) == [2, 3] and [r.draft_len for r in recs] == [1] and recs[-1].stop_reason == "context"


def test_a_full_block_past_the_budget_is_cut_to_it():
    """K=4 with budget 3 after a 1-token first round would overshoot; the loop caps the draft to 1 and emits 2."""
    drafter = Scripted()
    recs, _ = rounds(drafter, k=0, max_new=1)
    assert ids(recs) == [1]
    recs, _ = rounds(drafter, k=4, max_new=3)
    assert ids(recs) == [1, 2, 3] and [r.emitted for r in recs] == [3] and drafter.ks == [2]


# ---------------------------------------------------------------- baseline rounds, callbacks, events


def test_baseline_runs_one_plain_round_after_every_baseline_every_rounds():
    """every=2: two rounds of the mode, one plain (K=0, the baseline drafter), and so on, chosen through the drafter
    hook alone; the count carries over between generations."""
    off = Scripted("off")
    baseline = InBandBaseline(Scripted("mode"), off, every=2)
    controls = Controls(baseline, k=1, sampling=GREEDY)
    assert controls.mode == "mode"
    recs = list(generate(CounterState(), [0], controls, max_new_tokens=10, eos_ids=set()))
    assert [r.mode for r in recs] == ["mode", "mode", "off", "mode", "mode", "off"]
    assert [r.draft_len for r in recs] == [1, 1, 0, 1, 1, 0] and off.ks == []
    assert [t.kind for t in recs[2].tokens] == ["target"] and baseline.since == 0
    recs = list(generate(CounterState(), [0], controls, max_new_tokens=2, eos_ids=set()))
    assert baseline.since == 1  # one mode round (2 tokens) counted
    never = InBandBaseline(Scripted("mode"), off, every=0)
    recs = list(generate(CounterState(), [0], Controls(never, k=1, sampling=GREEDY), max_new_tokens=8, eos_ids=set()))
    assert {r.mode for r in recs} == {"mode"} and never.since == 0


def test_the_baseline_counts_only_rounds_that_did_not_run_plain_and_passes_every_round_on():
    """A mode that picks plain decoding itself (auto choosing off, mode off) is not interrupted by another plain round;
    the mode's drafter observes every round, the plain ones too (auto learns plain decoding's rate from them)."""

    class Picks(Scripted):
        def __init__(self, picks):
            super().__init__("picker")
            self.picks, self.seen = picks, []

        def for_round(self, state, params, sizing=None):
            return self.picks.pop(0)

        def observe(self, record):
            self.seen.append(record.mode)

    off, mode = Scripted("off"), Scripted("mode")
    picker = Picks([mode, off, off, mode, mode, mode])
    baseline = InBandBaseline(picker, off, every=2)
    recs = list(generate(CounterState(), [0], Controls(baseline, k=1, sampling=GREEDY), max_new_tokens=11, eos_ids=set()))
    assert [r.mode for r in recs] == ["mode", "off", "off", "mode", "off", "mode"]
    assert [r.draft_len for r in recs] == [1, 1, 1, 1, 0, 1]  # only the baseline's own round drafts nothing
    assert picker.seen == [r.mode for r in recs] and baseline.since == 1


def test_on_probs_gets_each_rounds_tokens_p_and_q():
    """on_probs sees the emitted ids, p [K+1, V] and q [K, V] (one-hot rows for a deterministic drafter)."""
    seen = []
    rounds(Scripted(wrong_at=1), k=3, max_new=4, on_probs=lambda new, p, q: seen.append((new, p.shape, q.clone())))
    new, p_shape, q = seen[0]
    assert new == [1, 2] and tuple(p_shape) == (4, V) and torch.equal(q, one_hot(torch.tensor([1, 5, 3]), V))


def test_sampled_events_report_the_warped_and_the_raw_probabilities():
    """At temperature 0.5 the event's p is softmax(logits / 0.5) and p_raw the model's own softmax(logits);
    top_p / top_raw list 5 alternatives, most likely first."""
    recs, _ = rounds(Scripted(), k=2, max_new=3, params=SamplingParams(0.5))
    warped = torch.softmax(CounterState.logits_after(0) / 0.5, -1)
    raw = torch.softmax(CounterState.logits_after(0), -1)
    t = recs[0].tokens[0]
    assert t.id == 1 and t.p == pytest.approx(float(warped[1])) and t.p_raw == pytest.approx(float(raw[1]))
    assert len(t.top_p) == 5 and t.top_p[0] == (1, pytest.approx(float(warped[1])))
    assert len(t.top_raw) == 5 and t.top_raw[0] == (1, pytest.approx(float(raw[1])))
    assert t.accept_prob == pytest.approx(float(warped[1])) and t.text == ""


@pytest.mark.parametrize("params", [SamplingParams(0.7, 0, 0.9), SamplingParams(1.3, 3, 1.0), SamplingParams(0.5, 0, 0.2)])
def test_top_lists_are_those_of_p_and_q_without_a_pass_over_them(params):
    """top_p comes from the logits' top list and top_q from the drafts (q one-hot): each event's lists are what a
    top-n over its rows of p and q gives, less the tokens of probability 0 (warping dropped them)."""
    seen = []
    recs, _ = rounds(Scripted(wrong_at=1), k=3, max_new=8, params=params,
                     on_probs=lambda new, p, q: seen.append((p.clone(), q.clone())))
    for rec, (p, q) in zip(recs, seen):
        for i, t in enumerate(rec.tokens):
            assert t.top_p == tuple((j, v) for j, v in top_alternatives(p[i : i + 1])[0] if v > 0)
            assert t.top_q == (tuple((j, v) for j, v in top_alternatives(q[i : i + 1])[0] if v > 0) if i < len(q) else ())
    assert any(t.top_q for r in recs for t in r.tokens)
    if params.top_p < 0.5:  # the nucleus holds the counter's one likely token: the rest were dropped
        assert all(len(t.top_p) == 1 for r in recs for t in r.tokens)


def test_decode_names_each_token_and_one_hot_top_alternatives():
    controls = Controls(Scripted(), k=1, sampling=GREEDY)
    assert controls.mode == "scripted"
    recs = list(generate(CounterState(), [0], controls, max_new_tokens=2, eos_ids=set(), decode=lambda i: f"<{i}>"))
    assert [t.text for t in recs[0].tokens] == ["<1>", "<2>"]
    assert torch.equal(one_hot(torch.tensor([2, 0]), 3), torch.tensor([[0.0, 0, 1], [1, 0, 0]]))
    assert top_alternatives(torch.tensor([[0.1, 0.5, 0.4]])) == [((1, 0.5), (2, pytest.approx(0.4)), (0, pytest.approx(0.1)))]
    assert len(top_alternatives(torch.full((2, 9), 1 / 9))[1]) == 5


# ---------------------------------------------------------------- what the loop hands its parts


class Recording(Scripted):
    """Records what the loop hands a drafter: for_round's, propose's and observe's arguments."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.calls = []

    def for_round(self, state, params, sizing=None):
        self.calls.append(("for_round", state, params, sizing))
        return self

    def propose(self, state, k, params, generator):
        self.calls.append(("propose", state, params, generator))
        return super().propose(state, k, params, generator)

    def observe(self, record):
        self.calls.append(("observe", record))


class RecordingRule:
    """The exact rule, recording the generator and the greedy flag it is called with."""

    def __init__(self, exact: bool) -> None:
        self.exact, self.name, self.calls = exact, "recording", []

    def __call__(self, draft_ids, q, p, generator, greedy):
        self.calls.append((generator, greedy))
        return EXACT(draft_ids, q, p, generator, greedy)


def test_the_loop_hands_its_parts_the_state_the_sampling_and_the_runs_generator():
    """auto chooses from (state, sampling) and learns from every record; a drafter samples with the run's
    generator; the rule gets the generator and the greedy flag; the record says whether the rule was exact."""
    for params in (SamplingParams(0.7), GREEDY):
        drafter, rule = Recording(wrong_at=1), RecordingRule(exact=False)
        state, gen = CounterState(), torch.Generator().manual_seed(0)
        controls = Controls(drafter, k=2, sampling=params, rule=rule)
        recs = list(generate(state, [0], controls, max_new_tokens=6, eos_ids=set(), generator=gen))
        kinds = [c[0] for c in drafter.calls]
        assert kinds[:3] == ["for_round", "propose", "observe"] and kinds.count("for_round") == len(recs)
        for call in drafter.calls:
            if call[0] == "for_round":
                assert call[1] is state and call[2] is params and call[3] is None  # a fixed K: nothing to price by
            elif call[0] == "propose":
                assert call[1] is state and call[2] is params and call[3] is gen
        observed = [c[1] for c in drafter.calls if c[0] == "observe"]
        assert len(observed) == len(recs) and all(a is b for a, b in zip(observed, recs))
        assert rule.calls and all(g is gen and greedy is params.greedy for g, greedy in rule.calls)
        assert {r.exact for r in recs} == {False}


def test_the_loop_hands_the_chooser_the_measured_k_that_sizes_its_rounds():
    """auto prices its drafting modes by K measured (drafters/auto.py `price`); HF's schedule is no such measure."""
    for adaptive, handed in ((MeasuredK(start=2), True), (AdaptiveK(start=2), False)):
        drafter = Recording(wrong_at=1)
        controls = Controls(drafter, k=2, sampling=GREEDY, adaptive=adaptive)
        list(generate(CounterState(), [0], controls, max_new_tokens=6, eos_ids=set()))
        sizes = [call[3] for call in drafter.calls if call[0] == "for_round"]
        assert sizes and all(s is (adaptive if handed else None) for s in sizes)


def test_a_sampled_reply_depends_only_on_the_runs_generator():
    """The same seed gives the same reply whatever the global RNG holds, with drafts (residual draws) and
    without (plain steps); another seed gives another reply. At T = 1.5 the counter's next token has p ~ 0.8."""

    def reply(k: int, seed: int, global_seed: int) -> list[int]:
        with torch.random.fork_rng():
            torch.manual_seed(global_seed)
            controls = Controls(Scripted(wrong_at=0), k=k, sampling=SamplingParams(1.5))
            gen = torch.Generator().manual_seed(seed)
            return ids(list(generate(CounterState(), [0], controls, max_new_tokens=30, eos_ids=set(), generator=gen)))

    for k in (0, 2):
        assert reply(k, 0, 1) == reply(k, 0, 2)
        assert reply(k, 0, 1) != reply(k, 1, 1)


class Soft(Scripted):
    """Drafts the chain with q = 0.5 on each drafted token (a sampled drafter's proposal, not a one-hot)."""

    def propose(self, state, k, params, generator):
        drafted = super().propose(state, k, params, generator).ids  # [K]
        q = torch.full((k, V), 0.5 / (V - 1))
        q[torch.arange(k), drafted] = 0.5
        return Proposal(drafted, q, 1)


def test_a_drafters_own_q_is_what_the_rule_and_the_events_see():
    """Greedy p is one-hot on the chain: each draft is accepted with min(1, 1 / 0.5) = 1, and the events and
    on_probs report q = 0.5 (the drafter's), not the 1.0 of a deterministic drafter's one-hot."""
    seen = []
    recs, _ = rounds(Soft(), k=2, max_new=3, on_probs=lambda new, p, q: seen.append(q.clone()))
    (r,) = recs
    assert [(t.id, t.kind) for t in r.tokens] == [(1, "accepted"), (2, "accepted"), (3, "bonus")]
    assert [t.q for t in r.tokens] == [0.5, 0.5, None] and [t.accept_prob for t in r.tokens[:2]] == [1.0, 1.0]
    assert seen[0][0, 1] == 0.5 and seen[0][1, 2] == 0.5


def test_no_room_for_a_token_means_no_round():
    """A budget of 0, or a prompt that fills the context window: no round, nothing committed."""
    recs, state = rounds(Scripted(), k=3, max_new=0)
    assert recs == [] and state.tokens == [0]
    recs, state = rounds(Scripted(), k=3, max_new=5, context_len=3, prompt=(0, 1, 2))
    assert recs == [] and state.tokens == [0, 1, 2]


def test_round_indices_count_up_and_times_are_durations_within_the_call():
    """Rounds 0, 1, 2, ... (and their events say so); each time is a duration, never more than the whole call."""
    t0 = time.perf_counter()
    recs, _ = rounds(Scripted(wrong_at=1), k=3, max_new=9)
    total = time.perf_counter() - t0
    assert len(recs) >= 3 and [r.index for r in recs] == list(range(len(recs)))
    assert all({t.round for t in r.tokens} == {r.index} for r in recs)
    assert 0 < recs[0].prefill_s <= total
    for r in recs:
        assert 0 <= r.draft_s <= r.wall_s <= total and 0 <= r.verify_s <= r.wall_s


def test_clock_waits_for_a_cuda_device_before_reading_the_time(monkeypatch):
    """CUDA launches are asynchronous: the clock synchronises that device first; a CPU clock does not."""
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    cuda = torch.device("cuda", 0)
    assert clock(cuda) <= time.perf_counter() and synced == [cuda]
    clock(torch.device("cpu"))
    assert synced == [cuda]


class Greedy(Scripted):
    """Proposes what it is asked the first time, then 5 drafts whatever K it is asked for."""

    def propose(self, state, k, params, generator):
        return super().propose(state, 5 if self.ks else k, params, generator)


def test_a_drafter_that_proposes_more_than_asked_cannot_pass_the_budget():
    """K=1, budget 4: round 0 emits 1 and the bonus 2; round 1 (asked for 1) drafts 3..7, all accepted, and would
    emit 6 tokens: it is cut to the 2 left."""
    recs, state = rounds(Greedy(), k=1, max_new=4)
    assert [ids([r]) for r in recs] == [[1, 2], [3, 4]] and state.tokens == [0, 1, 2, 3, 4]
    assert recs[-1].stop_reason == "max_new_tokens"


class Wide(Scripted):
    """Asks for at least 6 drafts whatever the round's K (as suffix asks for up to its max_spec)."""

    def draft_len(self, k):
        return max(k, 6)


def test_a_drafter_may_widen_its_k_and_the_budget_still_caps_it():
    """K=2 widened to 6: round 0 drafts 1..6, bonus 7; budget 10 leaves 3, so round 1 may draft 2 (0 1: the counter
    is mod 8), bonus 2.
    With AdaptiveK the widening applies to adaptive's K as well."""
    drafter = Wide()
    recs, state = rounds(drafter, k=2, max_new=10)
    assert drafter.ks == [6, 2] and [r.draft_len for r in recs] == [6, 2]
    assert ids(recs) == [i % V for i in range(1, 11)] and state.verified == [[1, 2, 3, 4, 5, 6], [0, 1]]
    drafter = Wide()
    rounds(drafter, k=2, max_new=30, adaptive=AdaptiveK(start=5, k_max=9))
    assert drafter.ks[:3] == [6, 7, 9]  # max(5, 6), then adaptive's 5 + 2 and 9 (7 + 2 clamped): wider than 6
    assert Scripted().draft_len(3) == 3  # the default asks for K
