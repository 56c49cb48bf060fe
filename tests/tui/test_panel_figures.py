"""The panel's figures mid-reply, from statistics set by hand: each number the panel prints is worked out here (the
SVG snapshots show the layout, these the arithmetic; they run in milliseconds)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
from rich.console import Console

from specchat.conversation import Conversation, Snapshot, Turn
from specchat.engine.events import RoundRecord, TokenEvent
from specchat.engine.metrics import Stats
from specchat.engine.sampling import SamplingParams
from specchat.tui.widgets.panel import estimate_speedup, modes_table, speedup_against_plain, stats_table


def text(renderable, width: int = 60) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def row(rendered: str, label: str) -> list[str]:
    """The cells after `label` on its line of a rendered table."""
    line = next(line for line in rendered.splitlines() if f" {label} " in f" {line} ")
    return line.split(label, 1)[1].split()


def lookup_stats() -> Stats:
    """12 rounds: 40 drafts, 30 accepted, 42 tokens in 2.0 s of rounds, of which the first round (the prefill's
    token and 3 more) took 0.1 s: tokens/s (42 - 4) / (2.0 - 0.1) = 20.0."""
    return Stats(rounds=12, num_drafts=10, num_draft_tokens=40, num_accepted_tokens=30, num_draft_tokens_per_pos=[10, 10, 10, 10],
                 num_accepted_tokens_per_pos=[10, 9, 7, 4], new_tokens=42, draft_calls=0, draft_s=0.12, verify_s=1.5,
                 decode_s=2.0, first_token_s=[0.25], first_round_tokens=4, first_round_s=0.1, first_round_work_s=0.09)


def plain_stats() -> Stats:
    """4 plain rounds of one token: 0.4 s, the first 0.1 s: (4 - 1) / (0.4 - 0.1) = 10 tokens/s."""
    return Stats(rounds=4, new_tokens=4, verify_s=0.38, decode_s=0.4, first_token_s=[0.2], first_round_tokens=1,
                 first_round_s=0.1, first_round_work_s=0.09)


def snapshot(reply: Stats) -> Snapshot:
    session = lookup_stats()
    return Snapshot(mode="lookup", k=4, sampling=SamplingParams(0.0), rule="exact", exact=True,
                    stats={"lookup": session, "off": plain_stats()}, reply=reply, recent=[0.75],
                    plain_for={"lookup": plain_stats()})


def test_the_stats_table_prints_this_reply_beside_the_session():
    reply = Stats(rounds=3, num_drafts=3, num_draft_tokens=12, num_accepted_tokens=6, new_tokens=9, decode_s=0.5,
                  first_round_tokens=1, first_round_s=0.1, first_token_s=[0.3], draft_s=0.03, verify_s=0.3)
    rendered = text(stats_table(reply, lookup_stats(), "lookup"))
    assert row(rendered, "acceptance") == ["50%", "75%"]  # 6/12 this reply; 30/40 the session
    assert row(rendered, "mean acc. length") == ["3.00", "3.50"]  # 9/3; 42/12
    assert row(rendered, "target calls/tok") == ["0.33", "0.29"]  # 3/9; 12/42
    assert row(rendered, "tokens/s") == ["20.0", "20.0"]  # (9-1)/(0.5-0.1); (42-4)/(2.0-0.1)
    assert row(rendered, "ms/token") == ["50.0", "50.0"]
    assert row(rendered, "1st token ms") == ["300", "250"]
    assert row(rendered, "draft ms/round") == ["10.0", "12.0"]  # 30 ms over 3 drafting rounds; 120 over 10
    assert row(rendered, "verify ms/round") == ["100.0", "125.0"]
    assert row(rendered, "tokens") == ["9", "42"]


def test_the_measured_speedup_divides_by_the_plain_rounds_of_the_same_window():
    snap = snapshot(Stats())
    measured, plain = speedup_against_plain(snap, "lookup")
    assert measured == pytest.approx(2.0) and plain.rounds == 4  # 20 tok/s over 10
    assert speedup_against_plain(snap, "off") == (1.0, None)
    rendered = text(modes_table(snap, {"draft": "needs --draft"}, None))
    assert row(rendered, "●lookup") == ["75%", "20.0", "2.00", "12"]  # acceptance, tok/s, ×off, rounds
    assert row(rendered, "off") == ["-", "10.0", "1.00", "4"]
    assert "n/a" in row(rendered, "draft")


def test_the_predicted_speedup_uses_the_speedup_model_of_the_session_s_rounds():
    value, why = estimate_speedup(snapshot(Stats()), "lookup")
    assert value is not None and value > 1
    # tokens per round and acceptance without each generation's first round (the prefill's token): (42-4)/(12-1)
    assert why.startswith("3.45 tokens/round at") and "a=0.75 K=4" in why


# ---------------------------------------------------------------- a snapshot taken while a reply streams


class Scripted(Conversation):
    """The real bookkeeping (turns, statistics per mode, in-band plain rounds, the snapshot) fed rounds by hand."""

    def __init__(self) -> None:
        super().__init__(max_new_tokens=64)
        self.controls = SimpleNamespace(mode="lookup", k=4, adaptive=None, sampling=SamplingParams(0.0), drafter=None,
                                        rule=SimpleNamespace(name="exact", exact=True))

    def play(self, rounds: list[RoundRecord]):
        turn = Turn(user="hi", prompt_tokens=3)
        self.turns.append(turn)
        return self._record(iter(rounds), turn)


def lookup(index, accepted, wall_s, *, verify_s=0.14, prefill_s=0.0, stop=None) -> RoundRecord:
    """A round that drafted 4 and emitted its accepted drafts and one more token."""
    tokens = [TokenEvent(1, "x", "accepted", index, 1, 1.0, None, None)] * (accepted + 1)
    return RoundRecord(index, "lookup", 4, 4, accepted, 0, 0.01, verify_s, wall_s, prefill_s, tokens, stop_reason=stop)


def plain(index, wall_s=0.1, stop=None) -> RoundRecord:
    """A plain round: one token, one step of 0.1 s."""
    return RoundRecord(index, "off", 0, 0, 0, 0, 0.0, 0.1, wall_s, tokens=[TokenEvent(1, "x", "target", index, 1, 1.0, None, None)],
                       stop_reason=stop)


def mid_reply() -> Snapshot:
    """A reply in mode off, one in lookup, then three rounds of a second (its fourth not yet run) when the panel
    redraws. lookup: 5 rounds, 20 drafts, 3+4+1+2+2 = 12 accepted, 17 tokens, of which the two first rounds' 4+3;
    the other 3 rounds' 10 tokens in 0.2+0.15+0.15 s. Plain: 2 in-band rounds of 1 token in 0.1 s each (10 tok/s),
    and mode off's own reply, round 0 then a slower round of 0.2 s: 4 rounds, (4-1)/(0.45-0.05) = 7.5 tok/s."""
    session = Scripted()
    session.controls.mode = "off"
    list(session.play([plain(0, wall_s=0.05), plain(1, wall_s=0.2, stop="eos")]))
    session.controls.mode = "lookup"
    list(session.play([lookup(0, 3, 0.1, verify_s=0.09, prefill_s=0.2), lookup(1, 4, 0.2), plain(2),
                       lookup(3, 1, 0.15, stop="eos")]))
    rounds = session.play([lookup(0, 2, 0.1, verify_s=0.09, prefill_s=0.3), lookup(1, 2, 0.15), plain(2),
                           lookup(3, 4, 0.2, stop="eos")])
    for _ in range(3):
        next(rounds)
    return session.snapshot()


def test_mid_reply_the_stats_table_shows_the_reply_so_far_beside_the_session_in_its_mode():
    snap = mid_reply()
    rendered = text(stats_table(snap.reply, snap.stats["lookup"], "lookup"))
    # the reply so far: 3 rounds (the in-band plain one included), 8 drafts, 2+2 accepted, 3+3+1 tokens
    assert row(rendered, "acceptance") == ["50%", "60%"]  # 4/8; 12/20
    assert row(rendered, "mean acc. length") == ["2.33", "3.40"]  # 7/3; 17/5
    assert row(rendered, "target calls/tok") == ["0.43", "0.29"]  # 3/7; 5/17
    assert row(rendered, "tokens/s") == ["16.0", "20.0"]  # (7-3)/(0.35-0.1); (17-7)/(0.7-0.2)
    assert row(rendered, "ms/token") == ["62.5", "50.0"]
    assert row(rendered, "1st token ms") == ["400", "400"]  # prefill 0.3 + round 0's 0.1: the latest reply's
    assert row(rendered, "draft ms/round") == ["10.0", "10.0"]  # 10 ms per drafting round
    assert row(rendered, "verify ms/round") == ["110.0", "120.0"]  # (0.09+0.14+0.1)/3; (2*0.09+3*0.14)/5
    assert row(rendered, "tokens") == ["7", "17"]


def test_mid_reply_the_modes_table_and_speedups_count_the_rounds_so_far():
    snap = mid_reply()
    # against the plain rounds run in-band among its own (20 over 10 tok/s), not all of mode off's (7.5)
    assert speedup_against_plain(snap, "lookup") == (pytest.approx(2.0), snap.plain_for["lookup"])
    rendered = text(modes_table(snap, {}, None))
    assert row(rendered, "●lookup") == ["60%", "20.0", "2.00", "5"]  # acceptance, tok/s, ×off, rounds
    assert row(rendered, "off") == ["-", "7.5", "1.00", "4"]
    value, why = estimate_speedup(snap, "lookup")
    # the rounds after each reply's first: 10 tokens in 3 rounds of 0.01 + 0.14 s, 1.5 plain steps of 0.1 s each
    assert value == pytest.approx(10 / 3 / 1.5)
    assert why.startswith("3.33 tokens/round at 1.50 plain steps (100.0 ms) each; a=0.60 K=4,")
