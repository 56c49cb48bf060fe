"""The scripted stand-in for Session (support.fakes.FakeSession) keeps the books like the real one."""

from __future__ import annotations

from support.fakes import FakeSession, REPLY, VOCAB, WRONG

# ------------------------------------------------------------------ the fake's own checks


def test_fake_session_records_turns_and_stats_like_session():
    session = FakeSession(mode="lookup", k=4)
    records = list(session.reply("hello there"))
    turn = session.turns[0]
    assert turn.reply == "".join(VOCAB[i] for i in REPLY)
    assert turn.stop_reason == "eos"
    assert session.messages[-1] == {"role": "assistant", "content": turn.reply}
    assert session.stats["lookup"].new_tokens == len(REPLY) == session.total.new_tokens
    assert [r.accepted for r in records[:3]] == [4, 2, 0]
    assert {t.kind for t in records[0].tokens} == {"accepted", "bonus"}
    assert records[1].tokens[-1].kind == "resampled" and records[1].rejected == WRONG[:2]


def test_fake_session_stopping_early_keeps_the_partial_turn():
    session = FakeSession()
    rounds = session.reply("hi")
    next(rounds)
    rounds.close()
    assert len(session.turns[0].rounds) == 1
    assert session.turns[0].stop_reason is None
    assert session.messages[-1]["content"] == session.turns[0].reply != ""
