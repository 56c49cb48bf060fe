"""What Conversation records for the panel: the baseline of plain rounds, each mode's in-band plain rounds
(Snapshot.plain_for, what its measured speedup divides by) and the snapshot's fields, from RoundRecords built by
hand and fed through the real `_record` (no model, no torch)."""

from types import SimpleNamespace

import pytest

from specchat.conversation import BASELINE_ROUNDS, RECENT_ROUNDS, Conversation, Turn
from specchat.engine.events import RoundRecord, TokenEvent
from specchat.engine.metrics import Stats
from specchat.engine.sampling_params import SamplingParams


def rnd(mode, index, drafted=0, accepted=0, verify_s=0.020, wall_s=None):
    """One round: `accepted + 1` tokens, drafts at 1 ms each, wall time draft + verify unless given."""
    draft_s = 0.001 * drafted
    r = RoundRecord(index=index, mode=mode, draft_len=drafted, drafted=drafted, accepted=accepted,
                    draft_calls=drafted, draft_s=draft_s, verify_s=verify_s,
                    wall_s=draft_s + verify_s if wall_s is None else wall_s)
    r.tokens = [TokenEvent(id=7, text="a", kind="target", round=index, position=1, p=1.0, q=None, accept_prob=None)
                for _ in range(accepted + 1)]
    return r


class Chat(Conversation):
    """The smallest subclass: the real __init__, controls whose mode the test sets between rounds."""

    def __init__(self, mode="auto", drafter=None, extra=None):
        super().__init__(max_new_tokens=64)
        self.controls = SimpleNamespace(mode=mode, k=4, adaptive=None, sampling=SamplingParams(temperature=0.0),
                                        rule=SimpleNamespace(name="exact", exact=True),
                                        drafter=drafter or SimpleNamespace(name=mode))
        self.extra = extra or {}

    def turn(self):
        self.turns.append(Turn(user="hi", prompt_tokens=3))

    def feed(self, *records, mode=None):
        """Run `records` through _record in the current turn, with the session's mode set to `mode` first."""
        if mode is not None:
            self.controls.mode = mode
        return list(self._record(iter(records), self.turns[-1]))

    def _snapshot_extra(self):
        return self.extra


def test_in_band_plain_rounds_count_for_the_mode_of_the_drafting_round_before_them():
    """Auto switches quant -> lookup -> quant with plain rounds between: each plain round (round 0 excepted: its
    token came with the prefill) belongs to the latest drafting mode, also across turns, and a plain round 0
    does not make "off" that mode."""
    chat = Chat("auto")
    chat.turn()
    q0, q1, q2 = rnd("quant", 0, 4, 2), rnd("quant", 1, 4, 3), rnd("quant", 2, 4, 1)
    p3 = rnd("off", 3, verify_s=0.020, wall_s=0.025)
    l4, l5 = rnd("lookup", 4, 3, 3), rnd("lookup", 5, 3, 0)
    p6, p7 = rnd("off", 6, verify_s=0.030, wall_s=0.040), rnd("off", 7, verify_s=0.010, wall_s=0.010)
    q8, p9 = rnd("quant", 8, 4, 4), rnd("off", 9, verify_s=0.040, wall_s=0.050)
    chat.feed(q0, q1, q2, p3, l4, l5, p6, p7, q8, p9)
    chat.turn()
    p0, p1 = rnd("off", 0, verify_s=0.500, wall_s=0.600), rnd("off", 1, verify_s=0.060, wall_s=0.075)
    chat.feed(p0, p1)  # the next reply opens plain: round 0 is not timed, round 1 is still quant's (q8 drafted last)
    snap = chat.snapshot()
    assert set(snap.plain_for) == {"quant", "lookup"}
    quant, lookup = snap.plain_for["quant"], snap.plain_for["lookup"]
    assert quant == Stats.of([p3, p9, p1]) and lookup == Stats.of([p6, p7])
    assert (quant.rounds, quant.verify_s, quant.decode_s) == (3, pytest.approx(0.120), pytest.approx(0.150))
    assert (lookup.rounds, lookup.verify_s, lookup.decode_s) == (2, pytest.approx(0.040), pytest.approx(0.050))
    # the baseline: every timed plain round, in-band or not: p3, p6, p7, p9, p1 (not p0)
    assert snap.baseline.rounds == 5
    assert snap.baseline.step_s == pytest.approx((0.020 + 0.030 + 0.010 + 0.040 + 0.060) / 5)  # 32 ms
    assert snap.baseline.tokens_per_s == pytest.approx(5 / (0.025 + 0.040 + 0.010 + 0.050 + 0.075))  # 25 tok/s
    # the per-mode statistics are by round mode: quant's four rounds, not auto's
    assert (snap.stats["quant"].rounds, snap.stats["lookup"].rounds, snap.stats["off"].rounds) == (4, 2, 6)


def test_plain_rounds_the_user_chose_are_no_modes_in_band_baseline():
    """Switching to mode off after quant: those rounds feed the baseline but are not quant's window (they did not
    run among its rounds); quant keeps only its own in-band round."""
    chat = Chat("quant")
    chat.turn()
    inband = rnd("off", 2, verify_s=0.020, wall_s=0.025)
    chat.feed(rnd("quant", 0, 4, 4), rnd("quant", 1, 4, 2), inband)
    chat.turn()
    chosen = [rnd("off", i, verify_s=0.050, wall_s=0.050) for i in range(3)]
    chat.feed(*chosen, mode="off")
    snap = chat.snapshot()
    assert snap.plain_for == {"quant": Stats.of([inband])}
    assert snap.baseline.rounds == 3  # the in-band round and the chosen rounds 1 and 2
    assert snap.baseline.step_s == pytest.approx((0.020 + 0.050 + 0.050) / 3)


def test_a_plain_round_before_any_drafting_round_belongs_to_no_mode():
    """Auto opening with plain rounds: nothing has drafted yet, so there is no mode to compare them with."""
    chat = Chat("auto")
    chat.turn()
    chat.feed(rnd("off", 0), rnd("off", 1, verify_s=0.030, wall_s=0.030))
    assert chat.snapshot().plain_for == {}
    after = rnd("off", 3, verify_s=0.010, wall_s=0.010)
    chat.feed(rnd("quant", 2, 4, 1), after)
    snap = chat.snapshot()
    assert snap.plain_for == {"quant": Stats.of([after])}
    assert snap.baseline.rounds == 2 and snap.baseline.step_s == pytest.approx(0.020)


def test_the_baseline_is_the_latest_sixteen_plain_rounds():
    """Four slow plain rounds then sixteen fast ones: the baseline is the recent sixteen (20 ms a step, one token
    per 25 ms), not the session's average."""
    assert BASELINE_ROUNDS == 16
    chat = Chat("off")
    chat.turn()
    slow = [rnd("off", i, verify_s=1.0, wall_s=1.0) for i in range(5)]  # round 0 untimed, 1-4 timed
    fast = [rnd("off", i, verify_s=0.020, wall_s=0.025) for i in range(5, 21)]
    chat.feed(*slow, *fast)
    base = chat.snapshot().baseline
    assert (base.rounds, base.step_s, base.tokens_per_s) == (16, pytest.approx(0.020), pytest.approx(40.0))


def test_the_snapshot_before_any_turn():
    """A new session's panel: empty statistics, no baseline, nothing the drafter does not say."""
    chat = Chat("quant")
    snap = chat.snapshot()
    assert snap.reply == Stats() and snap.recent == [] and snap.baseline is None and snap.plain_for == {}
    assert (snap.max_draft, snap.choice, snap.why, snap.server, snap.warnings) == (None, None, None, None, ())
    assert chat.notices == [] and list(chat.notices) == []  # the app adds them to its startup warnings


def test_reply_is_the_latest_turns_statistics_as_a_copy():
    """The panel's "this reply" column: the latest turn only, and a copy (a later round does not change it)."""
    chat = Chat("quant")
    chat.turn()
    chat.feed(rnd("quant", 0, 4, 4), rnd("quant", 1, 4, 0))
    chat.turn()
    chat.feed(rnd("quant", 0, 3, 2))
    snap = chat.snapshot()
    assert (snap.reply.rounds, snap.reply.new_tokens, snap.reply.num_draft_tokens) == (1, 3, 3)
    chat.feed(rnd("quant", 1, 3, 3))
    assert snap.reply.rounds == 1 and chat.snapshot().reply.rounds == 2


def test_recent_is_each_drafting_rounds_acceptance_oldest_first_across_turns():
    """accepted / drafted per round that drafted (plain rounds skipped), the earlier turn first."""
    chat = Chat("auto")
    chat.turn()
    chat.feed(rnd("quant", 0, 4, 1), rnd("off", 1), rnd("quant", 2, 4, 3))
    chat.turn()
    chat.feed(rnd("lookup", 0, 2, 1), rnd("quant", 1, 5, 0), rnd("quant", 2, 4, 4))
    assert chat.snapshot().recent == [0.25, 0.75, 0.5, 0.0, 1.0]


def test_recent_keeps_the_latest_rounds_only():
    """The sparkline's window: the latest RECENT_ROUNDS drafting rounds, so the first five of 205 drop out."""
    chat = Chat("quant")
    chat.turn()
    records = [rnd("quant", i, 4, i % 5) for i in range(RECENT_ROUNDS + 5)]
    chat.feed(*records)
    recent = chat.snapshot().recent
    assert len(recent) == RECENT_ROUNDS == 200
    assert recent == [(i % 5) / 4 for i in range(5, RECENT_ROUNDS + 5)]


def test_the_drafters_own_fields_and_the_subclasss_extra_reach_the_snapshot():
    """max_draft (the head's file), draft_len (suffix's), auto's choice and why, and a remote session's server and warnings."""
    drafter = SimpleNamespace(name="auto", max_draft=3, choice="quant", why="quant 2.1 > lookup 1.4 tok/step")
    chat = Chat("auto", drafter=drafter, extra={"server": "vllm at http://x: m", "warnings": ("step 3",)})
    snap = chat.snapshot()
    assert (snap.max_draft, snap.choice, snap.why) == (3, "quant", "quant 2.1 > lookup 1.4 tok/step")
    assert (snap.server, snap.warnings) == ("vllm at http://x: m", ("step 3",))
    assert (snap.mode, snap.k, snap.rule, snap.exact) == ("auto", 4, "exact", True)
    assert snap.draft_len is None  # a drafter that does not say
    drafter.draft_len = lambda k: max(k, 15)  # mode suffix (or auto running it) asks for more than K
    assert Chat("auto", drafter=drafter).snapshot().draft_len == 15


def test_autos_verify_in_steps_is_for_the_k_the_snapshot_shows():
    """The panel's "a (K+1)-position verify costs N steps" reads both from the snapshot: N must be priced at its K
    (auto's own latest K may be a suffix round's 15)."""
    auto = SimpleNamespace(name="auto", choice="off", why="", standings=lambda: (), verify_steps=lambda k: 10.0 + k)
    chat = Chat("auto", drafter=auto)
    chat.controls.k = 3
    snap = chat.snapshot()
    assert (snap.k, snap.verify_steps) == (3, 13.0)
