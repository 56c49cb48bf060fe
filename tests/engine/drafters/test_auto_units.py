"""Mode `auto` at unit level: Rate's arithmetic, what is remembered and saved, each branch of the choice at its
boundaries, and how a round is credited. No model runs: candidates are stand-ins, rates are set by hand, and every
expected number is worked out in the comments. (Written for the mutation score of drafters/auto.py.)"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest

from specchat.engine.drafters.auto import CV_FLOOR, MAX_TRAIL, SPREAD, AutoDrafter, Rate, Shadow, setting_key
from specchat.engine.drafters.base import Drafter
from specchat.engine.drafters.plain import PlainDecoding
from specchat.engine.errors import ModeUnavailable
from specchat.engine.sampling import SamplingParams

DAY = 86400.0
T1 = SamplingParams(1.0)
T1_KEY = "T=1 top_k=0 top_p=1"
GREEDY = SamplingParams(0.0)


class Named(Drafter):
    def __init__(self, name: str, max_draft: int | None = None) -> None:
        self.name, self.resets = name, 0
        self.catches_up = name in ("head", "draft")  # as the real ones: quant's int8 copy drafts on the target's cache
        if max_draft is not None:
            self.max_draft = max_draft

    def reset(self) -> None:
        self.resets += 1


class Suffix(Named):
    """A suffix drafter whose match length and drafts are scripted."""

    def __init__(self, length: int = 0, drafts: tuple[int, ...] = ()) -> None:
        super().__init__("suffix")
        self.length, self.scripted = length, list(drafts)

    def match_length(self, tokens) -> int:
        return self.length

    def drafts(self, tokens, k) -> tuple[list[int], float]:
        return self.scripted[:k], 1.0 if self.scripted else 0.0


class Memory:
    def __init__(self, rates=None) -> None:
        self.rates, self.saved = rates if rates is not None else {}, []

    def load(self) -> dict:
        return self.rates

    def save(self, rates: dict) -> None:
        self.saved.append(rates)


def auto_with(*modes, suffix: Suffix | None = None, memory=None) -> AutoDrafter:
    candidates = {"off": PlainDecoding(), **{m: Named(m) for m in modes}}
    if suffix is not None:
        candidates["suffix"] = suffix
    return AutoDrafter(candidates, memory)


def rate(per_s: float, rounds: int = 6, last: int = 0, wait: int = 16, **kw) -> Rate:
    """A rate of `per_s` tokens per second (tokens = per_s, seconds = 1: per_s exactly)."""
    return Rate(per_s, 1.0, rounds=rounds, last=last, wait=wait, **kw)


def record(mode, *, drafted=2, index=5, tokens=(0, 0), expected=2.0, stop=None, draft_s=0.25, verify_s=0.75, draft_len=4):
    return SimpleNamespace(mode=mode, drafted=drafted, index=index, tokens=[SimpleNamespace(id=t) for t in tokens],
                           expected_tokens=expected, stop_reason=stop, draft_s=draft_s, verify_s=verify_s, draft_len=draft_len)


# ---------------------------------------------------------------- Rate


def test_rate_add_is_a_plain_mean_over_the_first_sixteen_rounds_then_weighs_one_sixteenth():
    r = Rate()
    before = time.time()
    r.add(2.0, 0.5, at=7)
    assert (r.tokens, r.seconds, r.rounds, r.live, r.last) == (2.0, 0.5, 1, 1, 7)
    assert before <= r.measured_at <= time.time()
    r.add(4.0, 1.5, at=9)
    assert (r.tokens, r.seconds, r.rounds, r.live, r.last) == (3.0, 1.0, 2, 2, 9)
    r = Rate()
    for i in range(1, 17):
        r.add(float(i), 1.0, at=i)
    assert r.tokens == pytest.approx(8.5) and r.rounds == 16  # the mean of 1..16
    r.add(25.0, 1.0, at=17)
    assert r.tokens == pytest.approx(8.5 + (25.0 - 8.5) / 16) and r.seconds == pytest.approx(1.0)


def test_rate_per_second_and_its_upper_bound():
    assert Rate().per_s == 0.0 and Rate(3.0, 0.0).per_s == 0.0  # nothing measured: no rate, no division by zero
    assert Rate(3.0, 1.5).per_s == 2.0
    assert Rate(2.0, 1.0).upper == pytest.approx(3.0)  # no rounds: as one, 2 * (1 + 0.5)
    assert Rate(2.0, 1.0, rounds=4).upper == pytest.approx(2.5)  # 2 * (1 + 0.5 / 2)
    # a remembered rate: all of its rounds, earlier and this session's, narrow the bound: 9 + 7 = 16
    assert Rate(2.0, 1.0, rounds=3, earlier=9, live=7).upper == pytest.approx(2.25)
    assert Rate(2.0, 1.0, rounds=25, earlier=9, live=7).upper == pytest.approx(2.2)  # 2 * (1 + 0.5 / 5)


def test_a_rate_is_saved_with_all_its_rounds_and_its_time():
    r = Rate(2.0, 0.5, most=5.0, rounds=3, earlier=40, live=2, measured_at=1234.5, round_ceiling=10.0,
             round_ceiling_sq=104.0)  # this session's rounds' ceilings: mean 10, standard deviation 2
    assert r.saved() == {"tokens": 2.0, "seconds": 0.5, "most": 5.0, "ceiling_cv": pytest.approx(0.2), "rounds": 42,
                         "at": 1234.5}
    assert Rate(2.0, 0.5, live=1, ceiling_cv=0.15).saved()["ceiling_cv"] == 0.15  # one round: what it had


def test_the_ceiling_is_the_rate_with_every_draft_accepted_with_its_timings_spread():
    r = Rate()
    assert r.ceiling == math.inf  # nothing measured: no bound
    r.add(2.0, 0.5, at=1, most=5.0)  # 2 tokens of 5 possible, 0.5 s
    assert r.most == 5.0 and r.ceiling == pytest.approx(10.0 * 1.5)  # one round: the widest spread, 0.5
    r.add(4.0, 0.5, at=2, most=5.0)  # acceptance varies, timing does not
    assert r.ceiling == pytest.approx(10.0 * (1 + 0.1 / math.sqrt(2)))  # the floor, 0.1
    assert r.spread == pytest.approx(1 / 3)  # the rate's: per-round rates 4 and 8
    r.add(1.0, 0.5, at=3, most=1.0)  # a round that drafted nothing: its ceiling is its token
    assert r.most == pytest.approx(11 / 3)
    plain = Rate()
    plain.add(1.0, 0.01, at=1)  # `most` not given: what it gave (plain decoding's one token)
    plain.add(1.0, 0.03, at=2)
    assert plain.most == 1.0 and plain.ceiling == pytest.approx(plain.upper)  # its rate's upper bound


def test_a_remembered_ceiling_is_loaded_only_when_it_makes_sense():
    now = 1_000_000_000.0
    entry = {"tokens": 2.0, "seconds": 0.5, "rounds": 50, "at": now}
    assert Rate.remembered({**entry, "most": 5.0}, now).most == 5.0
    assert Rate.remembered(entry, now).ceiling == math.inf  # saved before it was kept
    # its spread as saved (within CV_FLOOR..SPREAD), over all its rounds: 10 * (1 + 0.2 / sqrt 50)
    assert Rate.remembered({**entry, "most": 5.0, "ceiling_cv": 0.2}, now).ceiling == pytest.approx(10 * (1 + 0.2 / 50**0.5))
    assert Rate.remembered({**entry, "ceiling_cv": 0.01}, now).ceiling_cv == CV_FLOOR
    assert Rate.remembered({**entry, "ceiling_cv": None}, now).ceiling_cv == SPREAD
    assert Rate.remembered({**entry, "most": 1.0}, now).most == 0.0  # below its tokens: not a ceiling
    assert Rate.remembered({**entry, "most": "x"}, now).most == 0.0


def test_a_remembered_rate_weighs_at_most_three_rounds_halved_per_week():
    now = 1_000_000_000.0
    fresh = Rate.remembered({"tokens": 4, "seconds": 2, "rounds": 50, "at": now}, now)
    assert (fresh.tokens, fresh.seconds, fresh.rounds, fresh.earlier, fresh.measured_at, fresh.wait, fresh.live) == (
        4.0, 2.0, 3, 50, now, 8, 0)
    assert fresh.last == 0
    assert Rate.remembered({"tokens": 4, "seconds": 2, "rounds": 2, "at": now}, now).rounds == 2  # min(3, 2)
    # half a week: 3 * 2 ** -0.5 = 2.12 -> 2; a week: 1.5 -> 2 (rounded half up); 1.2 weeks: 1.31 -> 1
    assert Rate.remembered({"tokens": 4, "seconds": 2, "rounds": 50, "at": now - 3.5 * DAY}, now).rounds == 2
    assert Rate.remembered({"tokens": 4, "seconds": 2, "rounds": 50, "at": now - 7 * DAY}, now).rounds == 2
    assert Rate.remembered({"tokens": 4, "seconds": 2, "rounds": 50, "at": now - 8.4 * DAY}, now).rounds == 1
    # weight exactly 1 (one round, fresh) is kept; a little under one is forgotten
    assert Rate.remembered({"tokens": 4, "seconds": 2, "rounds": 1, "at": now}, now).rounds == 1
    assert Rate.remembered({"tokens": 4, "seconds": 2, "rounds": 1, "at": now - 60}, now) is None
    # a time in the future (another machine's clock): not weighted up
    assert Rate.remembered({"tokens": 4, "seconds": 2, "rounds": 50, "at": now + 30 * DAY}, now).rounds == 3
    assert Rate.remembered({"tokens": 4, "seconds": 2, "rounds": 1, "at": now + 30 * DAY}, now).rounds == 1


@pytest.mark.parametrize("entry", [
    {"tokens": 0, "seconds": 2, "rounds": 50},
    {"tokens": -1, "seconds": 2, "rounds": 50},
    {"tokens": 4, "seconds": 0, "rounds": 50},
    {"tokens": 4, "seconds": -2, "rounds": 50},
    {"tokens": 4, "seconds": 2, "rounds": 0},
    {"tokens": 4, "seconds": 2},  # KeyError
    {"tokens": None, "seconds": 2, "rounds": 50},  # TypeError
    {"tokens": "fast", "seconds": 2, "rounds": 50},  # ValueError
    {"tokens": 4, "seconds": 2, "rounds": "many"},
])
def test_an_unusable_remembered_rate_is_dropped(entry):
    now = 1_000_000_000.0
    assert Rate.remembered({"at": now, **entry}, now) is None


def test_a_remembered_rate_needs_its_time():
    assert Rate.remembered({"tokens": 4, "seconds": 2, "rounds": 50}, 0.0) is None
    assert Rate.remembered({"tokens": 4, "seconds": 2, "rounds": 50, "at": "today"}, 0.0) is None
    assert Rate.remembered({"tokens": 4, "seconds": 2, "rounds": 50, "at": 5.0}, 5.0).rounds == 3


def test_setting_key():
    assert setting_key(None) == "greedy" and setting_key(SamplingParams(0)) == "greedy"
    assert setting_key(SamplingParams(0.7, top_k=5, top_p=0.9)) == "T=0.7 top_k=5 top_p=0.9"
    assert setting_key(T1) == T1_KEY


# ---------------------------------------------------------------- building and the initial state


def test_build_tries_every_candidate_in_order_with_the_options_and_skips_the_unavailable():
    calls = []

    def build_candidate(mode, target, draft, **options):
        calls.append((mode, target, draft, options))
        if mode in ("head", "draft"):
            raise ModeUnavailable(f"no {mode}")
        return Named(mode)

    memory = Memory()
    auto = AutoDrafter.build("T", "D", build_candidate=build_candidate, memory=memory, k=3, quant_backend="ao")
    assert [c[0] for c in calls] == ["off", "suffix", "head", "quant", "draft"]
    assert all(c[1:3] == ("T", "D") for c in calls)
    assert calls[0][3] == {"k": 3, "quant_backend": "ao"}
    assert calls[3][3] == {"k": 3, "quant_backend": "int8"}  # quant only in its int8 form
    assert list(auto.candidates) == ["off", "suffix", "quant"] and auto.memory is memory
    with pytest.raises(ValueError, match="^auto needs plain decoding among its candidates$"):
        AutoDrafter({"head": Named("head")})


def test_the_initial_state():
    auto = auto_with("head", suffix=Suffix())
    assert auto.arm_mode == {"off": "off", "head": "head", "suffix≥6": "suffix", "suffix3-5": "suffix", "suffix2": "suffix"}
    assert (auto.rounds, auto.arm, auto.choice, auto.ran, auto.caught_up) == (0, "off", "off", None, None)
    assert auto.why == "measuring every mode first" and auto.memory is None and auto.known == {}
    assert list(auto.tables) == ["greedy"] and auto.rates is auto.tables["greedy"]
    assert set(auto.rates) == set(auto.arm_mode) and all(r == Rate() for r in auto.rates.values())
    assert auto_with("head").arm_mode == {"off": "off", "head": "head"}


def test_reset_resets_every_candidate_and_keeps_the_rates():
    auto = auto_with("head", "draft")
    auto.ran = "head"
    auto.rates["head"] = rate(50.0)
    auto.reset()
    assert [c.resets for m, c in auto.candidates.items() if m != "off"] == [1, 1] and auto.ran is None
    assert auto.rates["head"].per_s == 50.0


def test_max_draft_is_the_chosen_candidates():
    auto = AutoDrafter({"off": PlainDecoding(), "head": Named("head", max_draft=5)})
    assert auto.max_draft is None
    auto.choice = "head"
    assert auto.max_draft == 5


def test_draft_len_is_the_chosen_candidates():
    suffix = Suffix(2)
    suffix.draft_len = lambda k: max(k, 15)
    auto = AutoDrafter({"off": PlainDecoding(), "suffix": suffix})
    assert auto.draft_len(4) == 4
    auto.choice = "suffix"
    assert auto.draft_len(4) == 15


# ---------------------------------------------------------------- remembering


def test_the_table_of_a_setting_starts_from_what_is_remembered_for_it():
    now = time.time()
    good = {"tokens": 3.0, "seconds": 1.0, "rounds": 30, "at": now}
    memory = Memory({T1_KEY: {"head": good, "off": "fast", "lookup": good, "draft": {**good, "at": now - 100 * DAY}},
                     "greedy": ["not", "a", "table"]})
    auto = auto_with("head", "draft", memory=memory)
    assert auto.known is memory.rates
    table = auto._table(T1)
    assert auto._table(T1) is table  # made once per setting
    assert table["head"].per_s == 3.0 and table["head"].earlier == 30 and table["head"].wait == 8
    assert table["off"] == Rate() and table["draft"] == Rate()  # not a table / too old: measured afresh
    assert set(table) == {"off", "head", "draft"}  # an arm that is not a candidate is not loaded
    assert all(r == Rate() for r in auto._table(None).values())


def test_save_merges_this_sessions_rates_into_what_was_remembered():
    old = {"tokens": 1.0, "seconds": 1.0, "rounds": 9, "at": 5.0}
    memory = Memory({T1_KEY: {"off": old, "lookup": old}, "T=0.5 top_k=0 top_p=1": {"head": old}, "greedy": 7})
    auto = auto_with("head", memory=memory)
    table = auto._table(T1)
    table["head"] = Rate(2.0, 0.5, rounds=1, live=1, measured_at=10.0)  # measured now
    table["off"] = Rate(9.0, 9.0, rounds=3, earlier=9, live=0)  # only remembered: not re-saved
    auto.save()
    assert memory.saved == [{T1_KEY: {"off": old, "lookup": old, "head": {"tokens": 2.0, "seconds": 0.5, "most": 0.0, "ceiling_cv": 0.5, "rounds": 1,
                                                                     "at": 10.0}},
                             "T=0.5 top_k=0 top_p=1": {"head": old}, "greedy": {}}]
    assert memory.rates[T1_KEY] == {"off": old, "lookup": old}  # what was loaded is not changed in place
    auto_with("head").save()  # no memory: nothing to do


def test_learnt_from_counts_the_current_settings_rounds():
    auto = auto_with("head", "draft")
    auto.rates["off"] = Rate(1.0, 1.0, earlier=100, live=3)
    auto.rates["head"] = Rate(1.0, 1.0, earlier=20, live=4)
    assert auto.learnt_from == (120, 7)


# ---------------------------------------------------------------- the suffix arms


@pytest.mark.parametrize("length, arm", [(0, None), (1, "suffix2"), (2, "suffix2"), (3, "suffix3-5"), (5, "suffix3-5"),
                                         (6, "suffix≥6"), (40, "suffix≥6")])
def test_the_suffix_arm_is_chosen_by_the_length_of_its_match(length, arm):
    assert auto_with("head", suffix=Suffix(length)).match_arm([1, 2, 3]) == arm


def test_without_a_suffix_drafter_there_is_no_suffix_arm():
    assert auto_with("head").match_arm([1, 2, 1, 2]) is None


# ---------------------------------------------------------------- choose, branch by branch


def settled(auto, **per_s):
    """Every arm measured WARMUP (6) rounds, at round 0, at these rates; the session at round 10."""
    for arm, value in per_s.items():
        auto.rates[arm] = rate(value)
    auto.rounds = 10
    return auto


def test_each_eligible_arm_is_measured_min_rounds_times_first():
    auto = auto_with("head", "draft")
    assert auto.choose([1]) == ("off", "measuring every mode first")
    auto.rates["off"] = rate(100.0, rounds=1)
    assert auto.choose([1])[0] == "off"
    auto.rates["off"] = rate(100.0, rounds=2)
    assert auto.choose([1]) == ("head", "measuring every mode first")
    auto.rates["head"] = rate(50.0, rounds=2)
    assert auto.choose([1]) == ("draft", "measuring every mode first")


def test_after_a_prefill_the_warm_up_gives_the_round_to_a_drafting_arm_whose_round_counts():
    """Round 0's token comes with the prefill: plain decoding's round 0 is free and not counted, so spending the
    warm-up's round on it measured nothing (a session of short replies stayed in plain decoding's warm-up)."""
    auto = auto_with("head", "quant")  # head catches up on a cache of its own: its first round is not counted either
    assert auto.choose([1], prefilled=True) == ("quant", "measuring every mode first")
    assert auto.choose([1], prefilled=False) == ("off", "measuring every mode first")
    auto.ran = "head"  # head ran last, but the new prompt is new to its cache: its round 0 catches up, uncounted
    assert auto.choose([1], prefilled=True)[0] == "quant"
    auto.rates["head"], auto.rates["quant"] = rate(50.0, rounds=2), rate(60.0, rounds=2)
    assert auto.choose([1], prefilled=True)[0] == "off"  # only plain decoding still needs rounds: as before
    drafter = auto.for_round(SimpleNamespace(tokens=[1, 2], head=object()), GREEDY)  # a TargetState right after start()
    assert drafter.name == "off" and auto.why == "measuring every mode first"


def test_a_session_of_two_token_replies_leaves_the_warm_up_in_two_replies():
    """Each reply: round 0 after the prefill, then one plain step (no room for drafts before the budget's end).
    Round 0 given to plain decoding, uncounted, took a third reply."""
    auto = auto_with("quant")
    for reply in range(2):
        state = SimpleNamespace(tokens=[1] * (10 * reply + 5), head=object())
        mode = auto.for_round(state, T1).name
        auto.observe(record(mode, drafted=1 if mode != "off" else 0, index=0, tokens=(0,), expected=1.5, draft_len=1))
        state.head = None
        mode = auto.for_round(state, T1).name
        auto.observe(record(mode, drafted=0, index=1, tokens=(0,), expected=1.0, draft_len=0))
    assert auto.rates["off"].rounds >= 2 and auto.rates["quant"].rounds >= 2  # every candidate measured: warm-up over


def test_a_round_0_that_drafted_nothing_does_not_read_as_a_measurement():
    """One-token replies: each is a round 0 with no room for a draft, so nothing is ever measured; the reason shown
    says so instead of "measuring" forever. A choice made from earlier rates keeps its reason."""
    auto = auto_with("quant")
    for reply in range(3):
        mode = auto.for_round(SimpleNamespace(tokens=[1] * (5 + reply), head=object()), T1).name
        auto.observe(record(mode, drafted=0, index=0, tokens=(0,), stop="max_new_tokens", draft_len=0))
    assert mode == "quant" and not any(rate.rounds for rate in auto.rates.values())
    assert auto.why == "measuring every mode first (quant drafted nothing in round 0: no step to time)"
    settled(auto, off=100.0, quant=50.0)
    auto.for_round(SimpleNamespace(tokens=[1] * 9, head=object()), T1)
    auto.observe(record("off", drafted=0, index=0, tokens=(0,), stop="max_new_tokens", draft_len=0))
    assert auto.why == "off 100 tok/s vs quant 50"


def test_an_unmatched_suffix_arm_is_not_eligible_and_a_matched_one_is():
    suffix = Suffix(0)
    auto = settled(auto_with("head", suffix=suffix), off=100.0, head=200.0)
    assert auto.choose([1]) == ("head", "head 200 tok/s vs off 100")  # the suffix arms have no rounds, yet wait
    suffix.length = 4
    assert auto.choose([1]) == ("suffix3-5", "measuring every mode first")
    auto.rates["suffix3-5"] = rate(300.0)
    assert auto.choose([1]) == ("suffix3-5", "suffix3-5 300 tok/s vs off 100, head 200")


def test_the_fastest_wins_and_plain_decoding_wins_a_tie():
    auto = settled(auto_with("head", "draft"), off=100.0, head=200.0, draft=150.0)
    assert auto.choose([1]) == ("head", "head 200 tok/s vs off 100, draft 150")
    auto = settled(auto_with("head", "draft"), off=100.0, head=100.0, draft=50.0)
    auto.leader = "draft"
    assert auto.choose([1])[0] == "off"
    auto = settled(auto_with("head", "draft"), off=100.0, head=100.0, draft=50.0)
    auto.leader = "head"  # the incumbent within 5%: kept
    assert auto.choose([1])[0] == "head"


def test_the_leader_is_watched_closely_again():
    auto = settled(auto_with("head"), off=100.0, head=200.0)
    auto.rates["head"].wait = 64
    auto.choose([1])
    assert auto.rates["head"].wait == 16 and auto.rates["off"].wait == 16


def test_an_arm_that_only_caught_up_runs_again_for_its_counted_round():
    auto = settled(auto_with("head", "draft"), off=100.0, head=200.0, draft=150.0)
    auto.caught_up = "draft"
    assert auto.choose([1]) == ("draft", "re-measuring draft")
    auto.caught_up = "head"  # the leader anyway
    assert auto.choose([1])[0] == "head" and not auto.why.startswith("re-measuring")
    auto = settled(auto_with("head", suffix=Suffix(0)), off=100.0, head=200.0, suffix2=500.0)
    auto.caught_up = "suffix2"  # no match now: not eligible
    assert auto.choose([1]) == ("head", "head 200 tok/s vs off 100")


def test_a_challenger_is_measured_while_its_upper_bound_is_above_the_leaders_rate():
    # head leads at 200; draft at 180 over 5 rounds may reach 180 * (1 + 0.5 / sqrt 5) = 220
    auto = settled(auto_with("head", "draft"), off=100.0, head=200.0)
    auto.rates["draft"] = rate(180.0, rounds=5)
    assert auto.choose([1]) == ("draft", "measuring draft: it may beat head")
    auto.rates["draft"] = rate(180.0, rounds=6)  # WARMUP rounds: settled
    assert auto.choose([1])[0] == "head"
    auto.rates["draft"] = rate(150.0, rounds=5)  # at most 183.5: cannot win
    assert auto.choose([1])[0] == "head"
    auto.rates["draft"] = rate(160.0, rounds=4)  # at most 160 * 1.25 = 200: only equals the leader
    assert auto.choose([1])[0] == "head"
    auto.rates["draft"] = rate(161.0, rounds=4)
    assert auto.choose([1])[0] == "draft"


def test_a_losing_arm_is_re_measured_after_its_wait_which_doubles_up_to_64_times_its_trail():
    auto = settled(auto_with("head", "draft"), off=100.0, head=200.0, draft=150.0)  # draft trails by 4/3, off by 2
    auto.rounds = 40
    for arm in auto.rates.values():
        arm.last = 30
    auto.rates["draft"].last = 19  # 40 - 19 = 21: not over its wait of 16 * 4/3
    assert auto.choose([1])[0] == "head"
    auto.rates["draft"].last = 18  # 22 rounds
    assert auto.choose([1]) == ("draft", "re-measuring draft") and auto.rates["draft"].wait == 32
    auto.rates["draft"].wait = 40
    auto.rates["draft"].last, auto.rounds = 0, 53  # 53 rounds: not over 40 * 4/3
    assert auto.choose([1])[0] == "head"
    auto.rounds = 54
    assert auto.choose([1])[0] == "draft" and auto.rates["draft"].wait == 64  # 80 capped
    auto.rates["off"].last, auto.rounds = 199, 200
    assert auto.choose([1])[0] == "draft" and auto.rates["draft"].wait == 64  # not beyond
    auto.rates["draft"] = rate(20.0, rounds=20)  # 10x behind: the trail counts up to MAX_TRAIL
    auto.rates["draft"].last, auto.rates["draft"].wait = 200 - 16 * MAX_TRAIL, 16
    assert auto.choose([1])[0] == "head"
    auto.rates["draft"].last -= 1
    assert auto.choose([1])[0] == "draft"


def test_an_arm_that_cannot_beat_the_leader_with_every_draft_accepted_is_not_run_again():
    """(A draft model on llama.cpp: 5 tokens at most for ~6 plain steps.) rate() has seconds = 1 and no rounds of
    this session: the ceiling is most * (1 + 0.5 / sqrt(rounds))."""
    auto = auto_with("draft")
    auto.rates["off"] = rate(100.0, rounds=2)
    auto.rates["draft"] = rate(50.0, rounds=1, most=60.0)  # one round: at most 60 * 1.5 = 90 < off's 100
    assert auto.choose([1]) == ("off", "off 100 tok/s vs draft 50 (≤90)")  # not measured a second time
    auto.rates["draft"] = rate(50.0, rounds=1, most=70.0)  # at most 105: it could still win
    assert auto.choose([1]) == ("draft", "measuring every mode first")
    auto = settled(auto_with("head", "draft"), off=50.0, head=200.0, draft=20.0)
    auto.rates["draft"].most = 80.0  # its ceiling: 80 * (1 + 0.5 / sqrt 6) = 96.3
    auto.rounds = auto.rates["off"].last = 10_000  # long over the draft's wait (off just measured)
    assert auto.choose([1])[0] == "head"
    auto.rates["head"] = rate(90.0, last=10_000)  # the leader's rate falls below the draft's ceiling (a change of
    assert auto.choose([1]) == ("draft", "re-measuring draft")  # load): measured again


def test_the_incumbent_stays_unless_another_is_more_than_five_percent_faster():
    auto = settled(auto_with("head", "draft"), off=20.0, head=20.0 * 1.05, draft=10.0)
    auto.leader = "off"
    assert auto.choose([1])[0] == "off"  # exactly 5% faster: not enough
    auto.rates["head"] = rate(21.01)
    assert auto.choose([1])[0] == "head"
    auto = settled(auto_with("head", suffix=Suffix(0)), off=100.0, head=104.0, suffix2=1000.0)
    auto.leader = "suffix2"  # the incumbent has no match now: not kept
    assert auto.choose([1]) == ("head", "head 104 tok/s vs off 100")


def test_a_round_run_to_re_measure_an_arm_does_not_make_it_the_incumbent():
    """Seen on the Qwen pair (greedy): draft led at 17 tok/s, plain decoding was re-measured for a round at about 16,
    and the 5% that keeps an incumbent kept plain decoding for 8 rounds. The leader the rates chose stays the
    incumbent (16.2 here: within 5% of 17)."""
    auto = settled(auto_with("draft"), off=16.0, draft=17.0)
    assert auto.choose([1])[0] == "draft"
    auto.rounds = 100  # long past plain decoding's wait: it runs once to be re-measured
    assert auto.choose([1]) == ("off", "re-measuring off")
    auto.arm, auto.rates["off"] = "off", rate(16.2, last=100)
    assert auto.choose([1])[0] == "draft"  # 17 < 16.2 x 1.05, but off only ran to be measured


def test_with_k_measured_a_drafting_arm_is_priced_at_what_k_measured_expects_of_it():
    """Seen on the Qwen pair (2-core Zen 3): a cold start's rounds at the start K (4) priced the draft model below plain
    decoding, where at the K=1 that K measured moved to it beat plain decoding; the race then left it for 16 rounds
    or more. With K measured (`sizing`), a drafting arm's rate is what K measured expects at the K it will run; an arm
    K measured knows nothing of yet, and every arm under a fixed K, keep their own rounds' rate."""
    auto = settled(auto_with("head", "draft"), off=10.0, head=9.0, draft=8.0)
    state = SimpleNamespace(tokens=[1], head=None)
    # K measured's expectation under the round's sampling setting (head: None, it has not drafted)
    sizing = SimpleNamespace(rate=lambda mode, params: {"draft": 11.0}.get(mode) if params == GREEDY else None)
    assert auto.for_round(state, GREEDY, sizing) is auto.candidates["draft"]
    assert [auto.rates[a].per_s for a in ("off", "head", "draft")] == [10.0, 9.0, 11.0]
    assert auto.why == "draft 11 tok/s vs off 10, head 9"
    assert auto.for_round(state, GREEDY) is auto.candidates["off"]  # a fixed K: 8 and 9 against 10
    assert auto.rates["draft"].per_s == 8.0
    assert auto.rates["draft"].saved()["tokens"] == 8.0  # what is saved is its own rounds'


def test_the_explanation_names_where_the_figures_come_from():
    auto = settled(auto_with("head"), off=100.0, head=200.0)
    auto.rates["off"].earlier, auto.rates["head"].earlier, auto.rates["head"].live = 1200, 34, 5
    assert auto.explain("head", ["off", "head"]) == "learnt over 1,234 rounds earlier + 5 now: head 200 tok/s vs off 100"
    assert auto.explain("head", ["head"]) == "learnt over 1,234 rounds earlier + 5 now: head 200 tok/s"
    auto.rates["off"].earlier = auto.rates["head"].earlier = 0
    auto.rates["head"].live = 2000
    assert auto.explain("off", ["off", "head"]) == "off 100 tok/s vs head 200"
    auto.rates["off"].most = 1.0  # its ceiling: 1 token / 0.01 s x (1 + 0.5 / sqrt 6) = 120, below the head's 200
    auto.rates["off"].tokens, auto.rates["off"].seconds = 1.0, 0.01
    assert auto.explain("head", ["off", "head"]) == "head 200 tok/s vs off 100 (≤120)"  # it cannot win


def test_for_round_counts_rounds_and_uses_the_settings_table():
    auto = auto_with("head")
    drafter = auto.for_round(SimpleNamespace(tokens=[1, 2], head=None), T1)
    assert drafter is auto.candidates["off"] and auto.rounds == 1 and auto.rates is auto.tables[T1_KEY]
    auto.rates["off"] = rate(100.0, rounds=2)
    drafter = auto.for_round(SimpleNamespace(tokens=[1, 2], head=None), T1)
    assert drafter is auto.candidates["head"] and (auto.arm, auto.choice, auto.rounds) == ("head", "head", 2)
    assert auto.why == "measuring every mode first"
    suffix = Suffix(7)
    auto = auto_with(suffix=suffix)
    auto.rates = auto._table(T1)
    auto._table(T1)["off"] = rate(100.0)
    assert auto.for_round(SimpleNamespace(tokens=[1], head=None), T1) is suffix and (auto.arm, auto.choice) == ("suffix≥6", "suffix")


# ---------------------------------------------------------------- observe


def test_a_round_is_credited_to_the_arm_that_ran_it():
    auto = auto_with("head", suffix=Suffix(3))
    auto.rounds, auto.arm, auto.ran = 12, "suffix3-5", "suffix"
    auto.observe(record("suffix", expected=2.5, draft_s=0.25, verify_s=0.75))
    r = auto.rates["suffix3-5"]
    assert (r.rounds, r.tokens, r.seconds, r.last) == (1, 2.5, 1.0, 12)  # seconds: draft + verify
    assert r.most == 3.0  # with both drafts accepted
    assert auto.caught_up is None and auto.ran == "suffix"
    auto.observe(record("off", drafted=0, tokens=[0], expected=1.0))  # another mode ran: credited to it
    assert auto.rates["off"].rounds == 1 and auto.rates["suffix3-5"].rounds == 1
    auto.observe(record("lookup"))  # not an arm here: ignored
    assert sum(r.rounds for r in auto.rates.values()) == 2


def test_a_cached_drafters_first_round_after_another_mode_only_catches_up():
    auto = auto_with("head", "draft", "quant")
    auto.arm = "draft"
    auto.observe(record("draft"))
    assert auto.rates["draft"].rounds == 0 and auto.caught_up == "draft" and auto.ran == "draft"
    auto.observe(record("draft"))
    assert auto.rates["draft"].rounds == 1 and auto.caught_up is None
    auto.arm = "head"
    auto.observe(record("head"))
    assert auto.rates["head"].rounds == 0 and auto.caught_up == "head"
    auto.arm = "quant"
    auto.observe(record("quant"))  # it shares the target's cache: nothing to catch up on, counted at once
    assert auto.rates["quant"].rounds == 1 and auto.caught_up is None and auto.ran == "quant"
    auto.arm = "off"
    auto.observe(record("off", drafted=0))
    auto.observe(record("off", drafted=0))  # plain decoding has no cache: counted at once, both times
    assert auto.rates["off"].rounds == 2 and auto.caught_up is None and auto.ran == "off"


def test_a_cached_drafters_first_round_of_a_reply_only_catches_up_even_after_its_own_rounds():
    """Seen on the Qwen pair: draft ran the end of one reply, and its first round of the next, which fed the draft
    model the new prompt (190 ms against ~55), counted as a round of draft: its rate fell from 28 to 24 tok/s,
    below plain decoding's 27, for the next 40 rounds."""
    auto = auto_with("draft", "quant")
    auto.ran = auto.arm = "draft"
    auto.observe(record("draft", index=3))
    assert auto.rates["draft"].rounds == 1
    auto.observe(record("draft", index=0, draft_s=0.15, verify_s=0.04))  # a new reply
    assert auto.rates["draft"].rounds == 1 and auto.caught_up == "draft"
    assert auto.rates["draft"].catch_up_s == pytest.approx(0.19)
    auto.observe(record("draft", index=0, drafted=0, draft_len=0))  # no drafts asked for: nothing fed
    assert auto.rates["draft"].rounds == 1 and auto.caught_up is None  # (round 0 without drafts: the prefill's token)
    auto.arm = "quant"
    auto.observe(record("quant", index=0))  # on the target's cache: nothing to catch up on
    assert auto.rates["quant"].rounds == 1


def test_only_round_zero_without_drafts_is_skipped():
    auto = auto_with("head")
    auto.observe(record("off", drafted=0, index=0))  # the prefill's token: no step to time
    assert auto.rates["off"].rounds == 0
    auto.observe(record("off", drafted=0, index=1))
    auto.observe(record("off", drafted=1, index=0))
    assert auto.rates["off"].rounds == 2


def test_a_cut_round_counts_the_tokens_it_emitted():
    auto = auto_with("head")
    auto.ran = auto.arm = "head"
    auto.observe(record("head", tokens=[1], expected=3.0, stop="eos", draft_s=0.0, verify_s=1.0))
    assert auto.rates["head"].tokens == 1.0
    auto.observe(record("head", tokens=[1], expected=3.0, stop=None, draft_s=0.0, verify_s=1.0))
    assert auto.rates["head"].tokens == 2.0  # (1 + 3) / 2


def test_a_tie_goes_to_plain_decoding_wherever_it_stands_among_the_candidates():
    auto = AutoDrafter({"head": Named("head"), "off": PlainDecoding(), "draft": Named("draft")})
    settled(auto, head=100.0, off=100.0, draft=50.0)
    auto.arm = "draft"
    assert list(auto.arm_mode)[0] == "head" and auto.choose([1])[0] == "off"


def test_a_three_round_rate_is_forgotten_log2_3_half_lives_after_it_was_measured():
    """3 * 0.5 ** (age / 7 days) falls below one round at age = 7 days * log2(3) (a day of 86400 s)."""
    now = 1_000_000_000.0
    limit = 7 * 86400 * math.log2(3)
    entry = {"tokens": 4, "seconds": 2, "rounds": 3}
    assert Rate.remembered({**entry, "at": now - limit + 10}, now).rounds == 1
    assert Rate.remembered({**entry, "at": now - limit - 10}, now) is None


# ---------------------------------------------------------------- shadows: suffix drafts scored without running them


@pytest.mark.parametrize("drafts, seen, tokens", [
    ([5, 6, 7], [], None),  # nothing emitted yet
    ([5, 6, 7], [5, 6], None),  # all matched so far, the third undecided
    ([5, 6, 7], [5, 6, 7], 4),  # all matched: the bonus token too
    ([5, 6, 7], [5, 6, 7, 9, 9], 4),
    ([5, 6, 7], [9], 1),  # the first rejected: the target's own token only
    ([5, 6, 7], [5, 9, 7], 2),  # a match after a mismatch does not count
    ([5], [5], 2),
])
def test_a_shadow_scores_the_drafts_the_emitted_tokens_match(drafts, seen, tokens):
    assert Shadow("suffix2", {}, drafts, list(seen)).tokens() == tokens


def test_every_round_but_a_cut_or_a_prefills_feeds_the_verify_cost_of_its_positions_and_sets_k():
    auto = auto_with("head")
    auto.observe(record("off", drafted=0, index=0, verify_s=0.001, draft_len=4))  # the prefill's token: no verify
    assert auto.verify.seconds == {} and auto.k == 4
    auto.observe(record("off", drafted=0, index=1, verify_s=0.01, draft_len=6))
    auto.observe(record("head", drafted=3, verify_s=0.04, draft_len=6))
    auto.observe(record("head", drafted=2, verify_s=0.5, stop="eos", draft_len=2))  # a cut round: K was cut too
    assert auto.verify.seconds == {1: 0.01, 4: 0.04} and auto.k == 6


def test_a_matched_suffix_arm_is_measured_by_shadows_in_rounds_another_mode_runs():
    """Drafts [7, 8] after each context; the target emits 7 then something else: 2 tokens a shadow, at the verify
    cost of 3 positions (interpolated between the measured 1 and 5) plus a lookup's time."""
    suffix = Suffix(2, drafts=(7, 8))
    auto = settled(auto_with("head", suffix=suffix), off=100.0, head=50.0)
    auto.k, auto.next_position, auto.suffix_draft_s = 4, 3, 0.001
    auto.verify.seconds = {1: 0.01, 5: 0.05}
    suffix.scripted = [7, 8]
    tokens = [1, 2, 3]
    assert auto.for_round(SimpleNamespace(tokens=tokens, head=None), GREEDY).name == "off"  # no forced suffix round: it has a cost
    assert [(s.arm, s.drafts) for s in auto.shadows] == [("suffix2", [7, 8])]
    auto.observe(record("off", drafted=0, tokens=[7], draft_s=0.0, verify_s=0.01))
    assert len(auto.shadows) == 1 and auto.rates["suffix2"].rounds == 0  # 7 matched; 8 undecided
    auto.for_round(SimpleNamespace(tokens=tokens + [7], head=None), GREEDY)
    auto.observe(record("off", drafted=0, tokens=[9], draft_s=0.0, verify_s=0.01))  # decides the first: 2 tokens
    r = auto.rates["suffix2"]
    # the first shadow: 7 matched, 9 is not 8: 2 tokens; the second (after 7, drafts 7, 8): 9 at once, 1 token
    assert (r.rounds, r.tokens, r.seconds, r.last) == (2, 1.5, pytest.approx(0.031), auto.rounds)
    assert auto.shadows == []
    assert auto.rates["off"].rounds == 6 + 2  # what ran is measured as ever


def test_without_a_cost_for_k_plus_one_positions_a_suffix_arm_is_run_to_measure_it():
    suffix = Suffix(2, drafts=(7, 8))
    auto = settled(auto_with("head", suffix=suffix), off=100.0, head=50.0)
    auto.k, auto.verify.seconds = 4, {1: 0.01}
    assert auto.choose([1, 2, 3]) == ("suffix2", "measuring every mode first")
    auto.verify.seconds[3] = 0.03  # its round: now 5 positions are on the line through 1 and 3
    assert auto.choose([1, 2, 3])[0] == "off"


def test_shadows_ask_for_and_are_priced_at_the_suffix_drafters_own_draft_length():
    """suffix asks for at least 6 drafts where K is 2 (SuffixDrafter.draft_len): its shadows draft 6, and it is
    shadowed once a verify of 7 positions has a cost (here extrapolated through the measured 1 and 3)."""
    suffix = Suffix(6, drafts=(7, 8, 9, 10, 11, 12, 13))
    suffix.draft_len = lambda k: max(k, 6)
    auto = settled(auto_with("head", suffix=suffix), off=100.0, head=50.0)
    auto.k, auto.next_position, auto.verify.seconds = 2, 3, {3: 0.03}
    assert auto.choose([1, 2, 3]) == ("suffix≥6", "measuring every mode first")  # v(7) unknown: it runs
    auto.verify.seconds[1] = 0.01
    assert auto.verify.cost(7) == pytest.approx(0.07)
    assert auto.for_round(SimpleNamespace(tokens=[1, 2, 3], head=None), GREEDY).name == "off"
    assert [s.drafts for s in auto.shadows] == [[7, 8, 9, 10, 11, 12]]


def test_shadows_are_dropped_at_a_new_prompt_a_reset_and_undecided_at_a_replys_end():
    suffix = Suffix(2, drafts=(7, 8))
    auto = settled(auto_with("head", suffix=suffix), off=100.0, head=50.0)
    auto.k, auto.verify.seconds, auto.next_position = 4, {1: 0.01, 5: 0.05}, 3
    auto.for_round(SimpleNamespace(tokens=[1, 2, 3], head=None), GREEDY)
    auto.observe(record("off", drafted=0, tokens=[7], stop="eos"))  # 8 never judged: dropped, not scored
    assert auto.shadows == [] and auto.rates["suffix2"].rounds == 0
    auto.for_round(SimpleNamespace(tokens=[1, 2, 3, 7, 4, 4], head=None), GREEDY)  # the next prompt (3 + 1 tokens expected: 6)
    assert len(auto.shadows) == 1
    auto.observe(record("off", drafted=0, tokens=[9], stop="eos"))  # decided at the end: scored
    assert auto.rates["suffix2"].rounds == 1 and auto.shadows == []
    auto.for_round(SimpleNamespace(tokens=[1, 2], head=None), GREEDY)
    assert len(auto.shadows) == 1
    auto.next_position = 99  # a rewind (or a cancelled reply): the next round does not continue this one
    auto.for_round(SimpleNamespace(tokens=[1, 2], head=None), GREEDY)
    assert len(auto.shadows) == 1  # the old one dropped, this round's added
    auto.reset()
    assert auto.shadows == []


def test_no_shadow_where_suffix_runs_has_no_match_or_k_is_unknown():
    suffix = Suffix(2, drafts=(7, 8))
    auto = settled(auto_with("head", suffix=suffix), off=100.0, head=50.0)
    auto.verify.seconds = {1: 0.01, 5: 0.05}
    auto.for_round(SimpleNamespace(tokens=[1], head=None), GREEDY)
    assert auto.shadows == []  # K not known yet (no round observed)
    auto.k = 4
    auto.rates["suffix2"] = rate(500.0)
    assert auto.for_round(SimpleNamespace(tokens=[1], head=None), GREEDY).name == "suffix" and auto.shadows == []
    suffix.length = 0
    auto.for_round(SimpleNamespace(tokens=[1], head=None), GREEDY)
    assert auto.shadows == []


def test_the_bound_spreads_as_far_as_the_arms_own_rounds_vary():
    """Two plain rounds at one step's cost settle plain decoding (the narrowest spread, CV_FLOOR); rounds of 5 and 1
    tokens keep the widest (SPREAD); a remembered rate, with no rounds of this session, keeps SPREAD too."""
    steady, uneven = Rate(), Rate()
    for i, seconds in enumerate((0.25, 0.26)):
        steady.add(1.0, seconds, at=i + 1)
    for i, (tokens, seconds) in enumerate(((5.0, 0.65), (1.0, 0.61))):
        uneven.add(tokens, seconds, at=i + 1)
    assert steady.spread == CV_FLOOR and uneven.spread == SPREAD
    assert steady.upper == pytest.approx(steady.per_s * (1 + CV_FLOOR / 2**0.5))
    middling = Rate()
    for i, tokens in enumerate((3.0, 2.0, 3.0, 2.0)):
        middling.add(tokens, 1.0, at=i + 1)
    assert middling.spread == pytest.approx(0.2)  # rates 3, 2, 3, 2 (exponentially weighted): sd 0.5 over 2.5
    assert Rate.remembered({"tokens": 4, "seconds": 2, "rounds": 50, "at": 1e9}, 1e9).spread == SPREAD


def test_a_rounds_verify_in_steps_is_priced_at_the_k_the_caller_names():
    """The panel says "a (K+1)-position verify costs N steps" with its own K: the figure must be for K + 1 positions,
    not for the latest round's (a suffix round asks for 15 drafts; the chat once read 6.5 steps for 5 positions)."""
    auto = auto_with("draft")
    auto.observe(record("draft", drafted=4, verify_s=0.030, draft_len=4))  # 5 positions: 1.5 steps
    auto.observe(record("suffix", drafted=14, verify_s=0.120, draft_len=15))  # 15 positions: 6 steps
    auto.rates = {"off": rate(50.0)}  # a plain step 20 ms
    assert auto.k == 15
    assert auto.verify_steps(4) == pytest.approx(1.5) and auto.verify_steps(14) == pytest.approx(6.0)
    assert auto.verify_steps(0) is None
