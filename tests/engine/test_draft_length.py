"""MeasuredK: the draft length that maximises expected tokens per second, from measured acceptance and costs; the
verify costs it and mode auto share. (Exactness under a moving K: tests/engine/test_adaptive.py.)"""

import random

import pytest

from specchat.engine.draft_length import MIN_ROUNDS, MeasuredK, ModeRounds, VerifyCosts
from specchat.engine.events import RoundRecord
from specchat.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(0)


def record(mode="draft", *, drafted, accepted, draft_s=0.0, verify_s=0.0, index=1, stop=None):
    return RoundRecord(index, mode, drafted, drafted, accepted, drafted, draft_s, verify_s, stop_reason=stop)


def test_the_verify_cost_is_measured_interpolated_bounded_from_above_or_unknown():
    costs = VerifyCosts()
    assert costs.cost(3) is None
    costs.add(5, 0.05)
    assert costs.cost(5) == 0.05 and costs.cost(3) == 0.05  # only a longer one known: its cost bounds it
    assert costs.cost(6) is None  # nothing as long or longer, and one point draws no line
    costs.add(1, 0.01)
    assert costs.cost(3) == pytest.approx(0.03)  # 0.01 + (0.05 - 0.01) * 2 / 4
    assert costs.cost(7) == pytest.approx(0.07)  # the line through 1 and 5, extended
    costs.add(3, 0.04)
    assert costs.cost(2) == pytest.approx(0.025) and costs.cost(4) == pytest.approx(0.045)
    # the steeper of the lines through the two longest (3 and 5: 0.005 a position) and through 1 and 5 (0.01)
    assert costs.cost(9) == pytest.approx(0.09)
    assert costs.costs(9) == [costs.cost(n) for n in range(1, 10)]  # (all at once, as K measured asks)
    costs.add(1, 0.09)  # averaged: the first counts whole, then each new one 1/8
    assert costs.seconds[1] == pytest.approx(0.02)


def test_an_extended_verify_cost_is_never_above_that_many_one_position_verifies():
    """One slow 2-position round (2.6 steps) would price a 5-position verify at 7.4 steps on the line through 1 and 2;
    five one-position verifies bound it."""
    costs = VerifyCosts()
    costs.add(1, 0.01)
    costs.add(2, 0.026)
    assert costs.cost(5) == pytest.approx(0.05)
    assert costs.cost(2) == pytest.approx(0.026)  # what was measured stays as measured


def test_a_noisy_verify_cost_never_makes_a_longer_verify_cheaper():
    """Seen in mode auto on the Qwen pair (2-core Zen 3): suffix rounds measured a 6-position verify below the
    5-position one; extended through those two, 13 positions cost less than nothing, and K jumped to 12 (a round of
    1.07 s, ten plain steps). Each cost is at least every shorter one's, and the line past the longest is at least as
    steep as the one from the shortest."""
    m = MeasuredK(start=4)
    m.verify.seconds = {1: 0.095, 2: 0.137, 3: 0.155, 4: 0.125, 5: 0.19, 6: 0.149}
    costs = [m.verify.cost(n) for n in range(1, 14)]
    assert costs == sorted(costs) and costs[3] == 0.155 and costs[5] == 0.19  # measured, raised to the shorter ones'
    assert costs[12] == pytest.approx(0.19 + 7 * (0.19 - 0.095) / 5)
    alphas = [0.72, 0.65, 0.93, 0.8, 0.87] + [0.8] * 7
    m.settings["greedy"] = {"draft": ModeRounds([100.0] * 12, [100.0 * a for a in alphas], draft_s=4.15, drafts=100, rounds=MIN_ROUNDS)}
    assert m.choose("draft") == 1


def measured(alpha: float, c: float, verify, k_max: int = 12) -> MeasuredK:
    """A MeasuredK whose mode "draft" saw acceptance alpha at every position (1000 rounds each: the prior is
    negligible), c seconds a draft and verify(n) seconds a verify of n positions for n = 1..k_max + 1."""
    m = MeasuredK(start=2, k_max=k_max)
    m.settings["greedy"] = {"draft": ModeRounds([1000.0] * k_max, [1000.0 * alpha] * k_max, draft_s=100 * c, drafts=100, rounds=MIN_ROUNDS)}
    for n in range(1, k_max + 2):
        m.verify.add(n, verify(n))
    return m


def test_the_choice_is_the_k_with_the_most_expected_tokens_per_second():
    # alpha 0.9, a draft 0.1 of a step, a verify 1 + 0.25 a position: E / cost = 1.41, 1.59, 1.68, 1.706, 1.704, 1.68
    # at K = 1..6 (E = 1.9, 2.71, 3.44, 4.10, 4.69, 5.22; cost = 1.35, 1.7, 2.05, 2.4, 2.75, 3.1)
    assert measured(0.9, 0.1, lambda n: 1 + 0.25 * (n - 1)).choose("draft") == 4
    # drafts free and a verify as cheap as a step whatever its length: the longest K pays most
    assert measured(0.9, 0.0, lambda n: 1.0).choose("draft") == 12
    # a verify that costs a step per position gains nothing from drafts: the shortest
    assert measured(0.9, 0.05, lambda n: float(n)).choose("draft") == 1
    # the same pair where a verify costs twice as much a position (another CPU): a shorter K
    assert measured(0.9, 0.1, lambda n: 1 + 0.5 * (n - 1)).choose("draft") == 2  # 1.9 / 1.6, 2.71 / 2.2, 3.44 / 2.8


def test_the_rate_is_the_expected_tokens_per_second_at_the_chosen_k_or_none_before_a_draft():
    m = measured(0.9, 0.1, lambda n: 1 + 0.25 * (n - 1))  # K = 4 (above): E = 4.0951, a round 4 x 0.1 + 2.0
    assert m.rate("draft") == pytest.approx(4.0951 / 2.4)
    assert m.rate("head") is None and "head" not in m.settings["greedy"]  # (asking adds nothing to save)
    m.observe(record("head", drafted=2, accepted=1, draft_s=0.2, verify_s=1.0, index=0))
    assert m.rate("head") is None  # a reply's first round: its draft time includes the prompt, not counted


def test_k_starts_at_start_then_follows_the_choice_with_a_neighbour_every_explore_rounds():
    m = MeasuredK(start=3, k_max=8)
    assert m.k("draft") == 3 and m.k("head") == 3
    ks = []
    for i in range(60):
        k = m.k("draft")
        ks.append(k)
        # every draft accepted, drafts free, a verify as cheap as a step: the longest K wins once measured
        m.observe(record(drafted=k, accepted=k, draft_s=0.0, verify_s=1.0))
    assert ks[:MIN_ROUNDS] == [3] * MIN_ROUNDS
    assert ks[-1] == 8 and m.best["draft"] == 8  # it walked up to k_max through the neighbours it measured
    assert m.k("head") == 3  # per mode


def rate(k: int, alpha: float, c: float, slope: float) -> float:
    """Expected tokens per second at K = k: acceptance alpha at every position, a draft c, a verify 1 + slope a draft."""
    return sum(alpha**i for i in range(k + 1)) / (k * c + 1 + slope * k)


@pytest.mark.parametrize("start, slope", [(2, 0.25), (5, 0.5), (4, 0.1)])
def test_the_chosen_k_converges_on_simulated_rounds(start, slope):
    """Rounds drawn from a pair with acceptance 0.9 at every position, a draft 0.1 of a step, a verify 1 + slope a
    draft: from `start`, the choices of the last 200 rounds give on average 98% of the best rate or more (the
    optimum, K = 4, 2 and 7 here, is flat, and 32 rounds of acceptance are a noisy estimate: seeds 0-2 gave
    99.5-100%, no choice below 94%)."""
    rng = random.Random(0)
    m = MeasuredK(start=start, k_max=10)
    chosen = []
    for _ in range(400):
        k = m.k("draft")
        accepted = next((i for i in range(k) if rng.random() >= 0.9), k)
        m.observe(record(drafted=k, accepted=accepted, draft_s=0.1 * k, verify_s=1 + slope * k))
        chosen.append(m.best.get("draft", start))
    best = max(rate(k, 0.9, 0.1, slope) for k in range(1, 11))
    ratios = [rate(k, 0.9, 0.1, slope) / best for k in chosen[-200:]]
    assert sum(ratios) / len(ratios) >= 0.98 and min(ratios) >= 0.9, chosen[-200:]


def test_acceptance_counts_each_position_reached_and_a_cut_round_nothing():
    m = MeasuredK(start=4, k_max=4)
    m.observe(record(drafted=4, accepted=1))  # draft 1 accepted, draft 2 rejected: 3 and 4 were never judged
    stats = m.settings["greedy"]["draft"]
    assert stats.reached == [1.0, 1.0, 0.0, 0.0] and stats.accepted == [1.0, 0.0, 0.0, 0.0]
    m.observe(record(drafted=4, accepted=4, stop="eos"))  # the reply's last round: cut, left out
    m.observe(record(drafted=0, accepted=0))  # no drafts: nothing about K
    assert stats.rounds == 1 and stats.reached == [1.0, 1.0, 0.0, 0.0]


def test_draft_time_that_includes_catching_up_is_left_out():
    """A reply's first round and a mode's first round after another mode's feed the draft what it missed."""
    m = MeasuredK()
    m.observe(record(drafted=2, accepted=2, draft_s=5.0, index=0))  # a reply's first round
    m.observe(record(drafted=2, accepted=2, draft_s=0.2))
    m.observe(record("off", drafted=0, accepted=0))
    m.observe(record(drafted=2, accepted=2, draft_s=3.0))  # back from another mode
    m.observe(record(drafted=2, accepted=2, draft_s=0.2))
    stats = m.settings["greedy"]["draft"]
    assert stats.draft_s / stats.drafts == pytest.approx(0.1)
    assert stats.rounds == 4  # their acceptance and verify still count


def test_every_mode_s_rounds_price_the_verify_and_plain_rounds_give_a_one_position_verify():
    """A verify is the same target forward whichever mode drafted: the line through a plain step and one mode's
    verify prices the others' K at once (a reply's first plain round came with the prefill: no step to time)."""
    m = MeasuredK(start=4)
    m.observe(record("off", drafted=0, accepted=0, verify_s=9.0, index=0))
    m.observe(record("off", drafted=0, accepted=0, verify_s=1.0))
    m.observe(record("draft", drafted=4, accepted=4, verify_s=2.0))
    assert m.verify.seconds == {1: 1.0, 5: 2.0}
    assert m.verify.cost(3) == pytest.approx(1.5) and "off" not in m.settings["greedy"]  # plain rounds teach nothing else about K


class Memory:
    """store.LearntRates' interface, in memory."""

    def __init__(self, saved=None) -> None:
        self.saved = saved if saved is not None else {}

    def load(self) -> dict:
        return self.saved

    def save(self, data: dict) -> None:
        self.saved = data


def test_a_new_session_starts_from_what_the_last_one_measured_and_ignores_a_foreign_file():
    memory = Memory()
    m = MeasuredK(start=4, memory=memory)
    for _ in range(40):  # a verify costs a step per position: K = 1 pays most
        k = m.k("draft")
        m.observe(record(drafted=k, accepted=k, draft_s=0.05 * k, verify_s=1.0 + k))
    m.save()
    assert m.choose("draft") == 1
    again = MeasuredK(start=4, memory=memory)
    assert again.k("draft") == 1 and again.verify.seconds == pytest.approx(m.verify.seconds)
    for foreign in ({"settings": {"greedy": {"draft": {"reached": "x"}}}}, {"verify": [1, 2]},
                    {"settings": {"greedy": {"draft": {"reached": [1.0]}}}}, {"settings": [1]},
                    {"modes": {"draft": m.settings["greedy"]["draft"].__dict__}}):  # (the last: before settings were kept)
        fresh = MeasuredK(start=4, memory=Memory(foreign))
        assert fresh.settings == {} and fresh.verify.seconds == {} and fresh.k("draft") == 4
    short = MeasuredK(start=4, k_max=16, memory=memory)  # a file from a shorter k_max: padded
    assert len(short.settings["greedy"]["draft"].reached) == 16 and short.k("draft") == 1


def test_acceptance_is_kept_per_sampling_setting_and_a_verify_s_cost_for_all():
    """Greedy agreement is not T=0.7's acceptance: rounds under one setting neither move K nor price the mode
    under another, and each setting's rounds are saved and recalled as its own; the verify costs are shared."""
    warm, memory = SamplingParams(0.7, top_p=0.9), Memory()
    m = MeasuredK(start=4, memory=memory)
    for _ in range(40):  # greedy: every draft accepted, drafts free, a verify as cheap as a step: K goes up
        k = m.k("draft", GREEDY)
        m.observe(record(drafted=k, accepted=k, draft_s=0.0, verify_s=1.0), GREEDY)
    assert m.choose("draft", GREEDY) == 12 and m.rate("draft", GREEDY) > 1
    assert m.k("draft", warm) == 4 and m.rate("draft", warm) is None  # nothing measured at T=0.7 yet
    for _ in range(40):  # T=0.7: every draft rejected, a tenth of a step each
        k = m.k("draft", warm)
        m.observe(record(drafted=k, accepted=0, draft_s=0.1 * k, verify_s=1.0), warm)
    assert m.choose("draft", warm) == 1 and m.rate("draft", warm) == pytest.approx(1 / 1.1, rel=0.02)
    assert m.choose("draft", GREEDY) == 12  # greedy's rounds unchanged by T=0.7's
    m.save()
    again = MeasuredK(start=4, memory=memory)
    assert again.k("draft", GREEDY) == 12 and again.k("draft", warm) == 1 and again.verify.seconds == m.verify.seconds
