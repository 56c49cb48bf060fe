"""The panel's figures mid-reply, from statistics set by hand: each number the panel prints is worked out here (the
SVG snapshots show the layout, these the arithmetic; they run in milliseconds)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from specchat.conversation import Snapshot
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
