"""One set of rounds, one predicted speedup: the panel, the bench, tune and the export show the same number."""

import dataclasses

import pytest

from specchat.bench import runner
from specchat.engine.events import RoundRecord
from specchat.engine.metrics import Stats, expected_tokens_per_round, predicted_speedup, speedup_model
from specchat.engine.sampling import SamplingParams
from specchat.export import mode_summary
from specchat.conversation import Snapshot
from specchat.tui.widgets.panel import estimate_speedup
from specchat.tune.search import measured_candidate


def rounds(mode, n, drafted, accepted, draft_s, verify_s):
    out = []
    for i in range(n):
        a = accepted[i % len(accepted)]
        r = RoundRecord(index=i, mode=mode, draft_len=drafted, drafted=drafted, accepted=a, draft_calls=drafted,
                        draft_s=draft_s, verify_s=verify_s, wall_s=draft_s + verify_s + 0.001)
        r.tokens = [None] * (a + 1)  # Stats only counts them
        out.append(r)
    return out


PLAIN = Stats.of(rounds("off", 20, 0, [0], 0.0, 0.020))  # plain step: 20 ms
QUANT = Stats.of(rounds("quant", 12, 4, [4, 1, 0, 3], 0.012, 0.030))  # K=4, a=0.5, 3 ms per draft token


def test_the_model_by_hand():
    model = speedup_model(QUANT, PLAIN.plain_step_s)
    assert (model.acceptance, model.k) == (0.5, 4.0)
    assert model.draft_cost == pytest.approx(0.15) and model.verify_cost == pytest.approx(1.5)
    # rounds 1..11 (round 0 came with the prefill): tokens 2+1+4 + 2*(5+2+1+4) = 31; each costs 12 + 30 ms = 2.1 steps
    assert (model.tokens_per_round, model.round_cost, model.rounds) == (pytest.approx(31 / 11), pytest.approx(2.1), 11)
    assert model.predicted == pytest.approx(31 / 11 / 2.1)  # 1.342
    # i.i.d. acceptance 0.5 at each of 4 positions would give 1.94 tokens a round: these rounds accept in runs
    assert model.iid == pytest.approx(expected_tokens_per_round(0.5, 4) / (4 * 0.15 + 1.5))  # 0.923
    assert speedup_model(QUANT, None) is None and speedup_model(Stats(), 0.02) is None


def test_rounds_that_draft_nothing_cost_and_yield_as_measured():
    """Lookup's pattern: a round drafts only after a match, and then its drafts are mostly right. The i.i.d.
    formula charges every round K drafts and credits it (1 - a^(K+1)) / (1 - a) tokens; the model takes what the
    rounds did: 10 plain rounds (1 token, 20 ms) and 10 rounds that drafted 4 and accepted all (5 tokens, 24 ms)."""
    plain = rounds("lookup", 11, 0, [0], 0.0, 0.020)[1:]  # no round 0 here (no prefill in this window)
    drafting = rounds("lookup", 11, 4, [4], 0.0001, 0.024)[1:]
    for r in plain + drafting:
        r.index = 1
    model = speedup_model(Stats.of(plain + drafting), PLAIN.plain_step_s)
    assert model.tokens_per_round == pytest.approx(3.0)  # (10 * 1 + 10 * 5) / 20
    assert model.round_cost == pytest.approx((10 * 0.020 + 10 * 0.0241) / 20 / 0.020)  # 1.1025 plain steps
    assert model.predicted == pytest.approx(3.0 / 1.1025)  # 2.72
    assert model.iid == pytest.approx(5 / (0.0001 / 0.02 + (10 * 0.020 + 10 * 0.024) / 20 / 0.020))  # a = 1: 4.52


def test_panel_bench_tune_and_export_show_one_number():
    expected = speedup_model(QUANT, PLAIN.plain_step_s).predicted
    snapshot = Snapshot(mode="quant", k=4, sampling=SamplingParams(0), rule="exact", exact=True,
                        stats={"off": PLAIN, "quant": QUANT}, reply=QUANT, recent=[])
    panel, why = estimate_speedup(snapshot, "quant")
    bench = runner.predict(runner.Config("quant", 4, 0.0), QUANT, PLAIN, measured=None)["predicted_speedup"]
    tune = measured_candidate({"rank": 0.5}, QUANT, PLAIN, ks=[4]).predicted_speedup
    export = mode_summary(snapshot, "quant")["speedup_model"]["predicted_speedup"]
    assert panel == bench == tune == export == pytest.approx(expected)
    assert "K=4" in why and "a=0.50" in why


def test_predicted_speedup_by_hand():
    assert predicted_speedup(0.8, 4, 0.1, 1.3) == pytest.approx(3.3616 / 1.7)
    assert predicted_speedup(0.5, 2, 0.25, 1.0) == pytest.approx(1.75 / 1.5)
    assert predicted_speedup(0.0, 4, 0.1, 1.2) == pytest.approx(0.625)  # nothing accepted: a slowdown
    assert predicted_speedup(1.0, 3, 0.0, 1.0) == pytest.approx(4.0)  # free, perfect drafts


def test_merge_equals_counting_everything_once():
    both = Stats.of(rounds("off", 20, 0, [0], 0.0, 0.020) + rounds("quant", 12, 4, [4, 1, 0, 3], 0.012, 0.030))
    merged = PLAIN.merge(QUANT)
    for key, value in both.summary().items():
        assert merged.summary()[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    assert merged.first_token_s == both.first_token_s
    assert PLAIN.summary()["num_draft_tokens"] == 0  # merge made a new object


# ---------------------------------------------------------------- the panel's figures, hand-worked (issue 27 item 1)


def rec(index, mode, drafted, accepted, emitted, wall_s, draft_s=0.0):
    from specchat.engine.events import RoundRecord

    r = RoundRecord(index=index, mode=mode, draft_len=drafted, drafted=drafted, accepted=accepted, draft_calls=1 if drafted else 0,
                    draft_s=draft_s, verify_s=wall_s - draft_s, wall_s=wall_s)
    from specchat.engine.events import TokenEvent

    r.tokens = [TokenEvent(id=1, text="x", kind="target", round=index, position=1, p=1.0, q=None, accept_prob=None)] * emitted
    return r


def test_tokens_per_s_leaves_out_each_generations_first_round():
    """Round 0's token came with the prefill (a plain round 0 costs ~nothing): counted, it made plain decoding
    look 1.03-1.32x faster than itself. Two generations of 1 + 2 plain rounds at 10 ms a token: 100 tok/s."""
    stats = Stats.of([rec(0, "off", 0, 0, 1, 0.0001), rec(1, "off", 0, 0, 1, 0.01), rec(2, "off", 0, 0, 1, 0.01),
                      rec(0, "off", 0, 0, 1, 0.0001), rec(1, "off", 0, 0, 1, 0.01), rec(2, "off", 0, 0, 1, 0.01)])
    assert stats.tokens_per_s == pytest.approx(100.0) and stats.ms_per_token == pytest.approx(10.0)
    assert stats.new_tokens == 6 and stats.first_round_tokens == 2


def test_draft_time_is_per_round_that_drafted():
    """3 rounds, one of them drafting 4 tokens in 8 ms: 8 ms per drafting round, not 2.7."""
    stats = Stats.of([rec(1, "lookup", 4, 2, 3, 0.02, 0.008), rec(2, "lookup", 0, 0, 1, 0.01), rec(3, "lookup", 0, 0, 1, 0.01)])
    assert stats.draft_ms_per_round == pytest.approx(8.0)


def conversation_with(records_and_modes):
    """Rounds through the real bookkeeping (Conversation._record), each with the mode the user had selected."""
    from types import SimpleNamespace

    from specchat.conversation import Conversation, Turn

    conv = Conversation(max_new_tokens=100)
    conv.controls = SimpleNamespace(mode="off", k=4, sampling=SamplingParams(0.0), rule=SimpleNamespace(name="exact", exact=True), drafter=None, adaptive=None)
    turn = Turn(user="", prompt_tokens=0)
    for selected, record in records_and_modes:
        conv.controls.mode = selected
        list(conv._record(iter([record]), turn))
    return conv


def test_a_mode_is_measured_against_the_plain_rounds_of_its_own_window():
    """Lookup: 2 tokens per 10 ms round, with in-band plain rounds at 10 ms among them -> 2.00x. Later the user
    runs mode off with the context grown (20 ms steps): lookup's ratio does not drift; off itself is 1.00."""
    from specchat.tui.widgets.panel import speedup_against_plain

    lookup = [("lookup", rec(i, "lookup", 2, 1, 2, 0.01)) for i in range(1, 11)]
    inband = [("lookup", rec(11 + i, "off", 0, 0, 1, 0.01)) for i in range(3)]
    later_off = [("off", rec(i, "off", 0, 0, 1, 0.02)) for i in range(1, 6)]
    conv = conversation_with(lookup[:5] + inband[:1] + lookup[5:] + inband[1:] + later_off)
    snap = conv.snapshot()
    ratio, plain = speedup_against_plain(snap, "lookup")
    assert ratio == pytest.approx(2.0) and plain.rounds == 3
    assert speedup_against_plain(snap, "off")[0] == 1.0
    from specchat.engine.metrics import enough

    assert enough(snap.stats["lookup"], plain)
    assert not enough(Stats.of([rec(1, "lookup", 2, 1, 2, 0.01)]), plain)  # one round: a hint, shown greyed


def test_every_statistic_of_hand_worked_rounds():
    """A generation of four rounds, worked by hand:
    round 0: plain (the prefill's token), 1 token, 2 ms;
    round 1: drafted 3, accepted 1 -> accepted + resampled = 2 tokens, 1 draft call, draft 3 ms, verify 12 ms;
    round 2: drafted 3, accepted 3 -> 3 accepted + bonus = 4 tokens, 1 draft call, draft 3 ms, verify 12 ms;
    round 3: plain (an in-band or no-match round) 1 token, verify 10 ms."""
    rounds = [rec(0, "lookup", 0, 0, 1, 0.002), rec(1, "lookup", 3, 1, 2, 0.015, 0.003), rec(2, "lookup", 3, 3, 4, 0.015, 0.003),
              rec(3, "lookup", 0, 0, 1, 0.010)]
    rounds[0].prefill_s = 0.050
    s = Stats.of(rounds)
    assert (s.rounds, s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.new_tokens) == (4, 2, 6, 4, 8)
    assert s.num_draft_tokens_per_pos == [2, 2, 2] and s.num_accepted_tokens_per_pos == [2, 1, 1]
    assert s.per_position_acceptance == [1.0, 0.5, 0.5]
    assert s.acceptance_rate == pytest.approx(4 / 6)
    assert s.mean_accepted_length == pytest.approx(8 / 4)  # tokens per target call, bonus included
    assert s.mean_draft_len == pytest.approx(3.0)
    assert s.target_calls_per_token == pytest.approx(4 / 8) and s.draft_calls_per_token == pytest.approx(2 / 8)
    assert s.tokens_per_s == pytest.approx(7 / 0.040)  # rounds 1-3: 7 tokens in 40 ms
    assert s.ms_per_token == pytest.approx(40 / 7)
    assert s.time_to_first_token_s == pytest.approx(0.052)  # prefill + round 0
    assert s.draft_ms_per_round == pytest.approx(3.0)  # 6 ms over the 2 rounds that drafted
    assert s.verify_ms_per_round == pytest.approx((0.002 + 0.012 + 0.012 + 0.010) * 1000 / 4)


# ---------------------------------------------------------------- edges found by mutation testing (issue 26)


def test_add_sums_every_generations_prefill_counts_a_one_token_draft_and_any_inexact_round():
    """Two generations (prefill 50 ms and 30 ms): prefill_s is their sum, first_token_s one per generation; a round
    that drafted a single token is a drafting round; one round under an approximate rule makes the whole run inexact."""
    rounds = [rec(0, "draft", 1, 0, 1, 0.004, 0.001), rec(1, "draft", 1, 1, 2, 0.010, 0.001),
              rec(0, "draft", 0, 0, 1, 0.002), rec(1, "draft", 1, 1, 2, 0.010, 0.001)]
    rounds[0].prefill_s, rounds[2].prefill_s = 0.050, 0.030
    rounds[1].exact = False
    s = Stats.of(rounds)
    assert s.prefill_s == pytest.approx(0.080)
    assert s.first_token_s == pytest.approx([0.054, 0.032]) and s.time_to_first_token_s == pytest.approx(0.032)
    assert (s.num_drafts, s.num_draft_tokens, s.mean_draft_len) == (3, 3, 1.0)
    assert s.exact is False and Stats.of(rounds[2:]).exact is True


def test_merge_adds_per_position_counts_of_different_lengths_and_keeps_inexact():
    """K=3 (accepted 1) merged with K=1 (accepted 1, approximate rule): position by position [2, 1, 1] drafted,
    [2, 0, 0] accepted, whichever side is longer; the merge is exact only if both are."""
    k3 = Stats.of([rec(1, "draft", 3, 1, 2, 0.010, 0.003)])
    k1_rounds = [rec(1, "draft", 1, 1, 2, 0.010, 0.001)]
    k1_rounds[0].exact = False
    k1 = Stats.of(k1_rounds)
    for merged in (k3.merge(k1), k1.merge(k3)):
        assert merged.num_draft_tokens_per_pos == [2, 1, 1] and merged.num_accepted_tokens_per_pos == [2, 0, 0]
        assert merged.exact is False
    assert k3.merge(k3).exact is True


def test_copy_shares_no_list_with_the_original():
    """Snapshots hand out copies: adding a round to a copy (which grows the per-position lists in place) must not
    change the statistics it was copied from."""
    s = Stats.of([rec(0, "draft", 1, 1, 2, 0.010, 0.001)])
    c = s.copy()
    c.add(rec(0, "draft", 3, 2, 3, 0.010, 0.003))
    assert s.num_draft_tokens_per_pos == [1] and s.num_accepted_tokens_per_pos == [1] and len(s.first_token_s) == 1
    assert c.num_draft_tokens_per_pos == [2, 1, 1] and len(c.first_token_s) == 2


def test_summary_leaves_out_the_first_token_list():
    """The per-generation list stays out of the summary (its last value is time_to_first_token_s)."""
    out = Stats.of([rec(0, "off", 0, 0, 1, 0.002)]).summary()
    assert "first_token_s" not in out and out["time_to_first_token_s"] == pytest.approx(0.002)


def test_the_model_when_nothing_is_accepted_and_with_one_round_after_the_first():
    """Three rounds drafting 2 and accepting none (2 ms drafting, 10 ms verifying, plain step 10 ms): a = 0 stays 0
    (c = 0.1, v = 1.0, iid 1 / 1.2). Only a generation's first round: no model (no round to measure); one round
    after it: a model resting on that one round."""
    rejected = Stats.of([rec(i, "draft", 2, 0, 1, 0.012, 0.002) for i in range(3)])
    model = speedup_model(rejected, 0.010)
    assert (model.acceptance, model.k, model.rounds) == (0.0, 2.0, 2)
    assert (model.draft_cost, model.verify_cost) == (pytest.approx(0.1), pytest.approx(1.0))
    assert model.iid == pytest.approx(1 / 1.2) and model.predicted == pytest.approx(1 / 1.2)
    assert speedup_model(Stats.of([rec(0, "draft", 2, 1, 2, 0.012, 0.002)]), 0.010) is None
    one = speedup_model(Stats.of([rec(0, "draft", 2, 1, 2, 0.012, 0.002), rec(1, "draft", 2, 2, 3, 0.012, 0.002)]), 0.010)
    assert one.rounds == 1 and one.tokens_per_round == 3.0 and one.round_cost == pytest.approx(1.2)


def test_the_models_dict_names_both_speedups():
    """The export's keys: every field, then predicted_speedup and iid_speedup."""
    from specchat.engine.metrics import SpeedupModel

    model = speedup_model(QUANT, PLAIN.plain_step_s)
    d = model.as_dict()
    fields = [f.name for f in dataclasses.fields(SpeedupModel)]
    assert list(d) == fields + ["predicted_speedup", "iid_speedup"]
    assert d["predicted_speedup"] == model.predicted and d["iid_speedup"] == model.iid


def test_baseline_of_hand_worked_plain_rounds():
    """Two plain rounds, 10 ms and 30 ms, one token each, at times 7 and 5: a step of 20 ms, 2 tokens / 40 ms = 50
    tok/s, measured at the latest time. No rounds, or rounds without wall time: no baseline."""
    from specchat.engine.metrics import Baseline

    b = Baseline.of([(7.0, rec(1, "off", 0, 0, 1, 0.010)), (5.0, rec(2, "off", 0, 0, 1, 0.030))])
    assert (b.step_s, b.tokens_per_s, b.rounds, b.measured_at) == (pytest.approx(0.020), pytest.approx(50.0), 2, 7.0)
    assert Baseline.of([]) is None and Baseline.of([(1.0, rec(1, "off", 0, 0, 1, 0.0))]) is None


def test_measured_speedup_by_hand_and_none_without_either_side():
    """QUANT: rounds 1..11 give 31 tokens at 43 ms a round; PLAIN: 1 token per 21 ms. Without a side, or a side
    without tokens/s, there is no ratio (not an error)."""
    from specchat.engine.metrics import Baseline, measured_speedup

    assert measured_speedup(QUANT, PLAIN) == pytest.approx((31 / (11 * 0.043)) / (1 / 0.021))
    baseline = Baseline(step_s=0.02, tokens_per_s=50.0, rounds=3, measured_at=0.0)
    assert measured_speedup(QUANT, baseline) == pytest.approx(31 / (11 * 0.043) / 50.0)
    assert measured_speedup(None, PLAIN) is None and measured_speedup(QUANT, None) is None
    assert measured_speedup(Stats(), PLAIN) is None and measured_speedup(QUANT, Stats()) is None
