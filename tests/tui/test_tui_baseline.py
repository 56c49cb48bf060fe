"""The panel's speedups compare against a plain step measured in-band, under the same conditions, and say how old
it is (issue 11, item 5): plain rounds interleaved with a mode's keep the reply exact and refresh the baseline."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from support.models import tiny_model_dir
from support.fakes import FakeSession
from specchat.engine.events import RoundRecord, TokenEvent
from specchat.engine.metrics import Baseline
from specchat.engine.sampling import SamplingParams
from specchat.models import load_model
from specchat.session import Session
from specchat.tui.widgets.panel import baseline_text, estimate_speedup
from test_tui import RecordingApp, panel_text, send, wait_for


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(tiny_model_dir(tmp_path_factory.mktemp("tiny"), layers=2)), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("mode", ["draft", "lookup"])
def test_interleaved_plain_rounds_keep_the_reply_exact_and_measure_the_baseline(tiny, mode):
    session = Session(tiny, tiny, mode=mode, k=3, sampling=SamplingParams(0), max_new_tokens=40)
    session.eos_ids = set()
    session.measure_baseline(every=4)
    list(session.reply("the cat and the dog"))
    turn = session.turns[0]
    modes = [r.mode for r in turn.rounds]
    assert modes[:2] == [mode, "off"]  # the first plain round comes early (round 0's token came with the prefill)
    plain_at = [i for i, m in enumerate(modes) if m == "off"]
    assert len(plain_at) >= 3 and all(b - a == 5 for a, b in zip(plain_at, plain_at[1:]))  # 4 of the mode, 1 plain
    assert all(r.drafted == 0 and [t.kind for t in r.tokens] == ["target"] for r in turn.rounds if r.mode == "off")
    assert session.stats[mode].num_draft_tokens > 0

    fresh = Session(tiny, mode="off", sampling=SamplingParams(0), max_new_tokens=40)
    fresh.eos_ids = set()
    list(fresh.complete(session.state.tokens[: turn.prompt_tokens]))
    assert fresh.turns[0].reply_ids == turn.reply_ids  # greedy: identical to plain decoding

    snapshot = session.snapshot()
    plain = [r for r in turn.rounds if r.mode == "off" and r.index > 0]
    assert snapshot.baseline.rounds == len(plain)
    assert snapshot.baseline.step_s == pytest.approx(sum(r.verify_s for r in plain) / len(plain))
    assert snapshot.plain_step_s == snapshot.baseline.step_s
    assert snapshot.speedup(mode).plain_step_s == snapshot.baseline.step_s


def test_without_measure_baseline_no_plain_round_is_added(tiny):
    session = Session(tiny, tiny, mode="draft", k=3, sampling=SamplingParams(0), max_new_tokens=20)
    session.eos_ids = set()
    list(session.reply("hello"))
    assert {r.mode for r in session.turns[0].rounds} == {"draft"} and session.snapshot().baseline is None


def plain_round(index: int, verify_s: float) -> RoundRecord:
    token = TokenEvent(id=1, text="x", kind="target", round=index, position=1, p=1.0, q=None, accept_prob=None)
    return RoundRecord(index=index, mode="off", draft_len=0, drafted=0, accepted=0, draft_calls=0, draft_s=0.0,
                       verify_s=verify_s, wall_s=verify_s + 0.001, tokens=[token])


class ScriptedRounds(FakeSession):
    """The real Session's bookkeeping over rounds given in advance."""

    def __init__(self, records: list[RoundRecord]) -> None:
        super().__init__(mode="off")
        self.records = records

    def _rounds(self, prompt):
        yield from self.records


def test_the_baseline_is_the_latest_plain_rounds_not_the_whole_session():
    """Plain rounds measured earlier under another load (slow) must not set the baseline of now."""
    session = ScriptedRounds([plain_round(i, 0.100) for i in range(40)] + [plain_round(40 + i, 0.020) for i in range(16)])
    before = time.monotonic()
    list(session.reply("hi"))
    snapshot = session.snapshot()
    assert snapshot.stats["off"].plain_step_s == pytest.approx((40 * 0.100 + 16 * 0.020) / 56)  # the whole session
    assert snapshot.baseline.rounds == 16 and snapshot.plain_step_s == pytest.approx(0.020)
    assert before <= snapshot.baseline.measured_at <= time.monotonic()


def test_the_panel_says_how_old_the_baseline_is():
    base = FakeSession().snapshot()
    snapshot = dataclasses.replace(base, baseline=Baseline(step_s=0.030, tokens_per_s=30.0, rounds=4, measured_at=100.0))
    assert baseline_text(snapshot, now=112.0).plain == "vs plain: 30.0 ms/step, 12 s ago"
    assert "3 min ago" in baseline_text(snapshot, now=100.0 + 180).plain
    assert baseline_text(base).plain == ""
    value, why = estimate_speedup(snapshot, "off")
    assert value == 1.0 and "30.0 ms/step" in why


@pytest.mark.asyncio
async def test_the_panel_shows_the_baseline_and_its_age():
    session = FakeSession(mode="off")
    app = RecordingApp(session)
    async with app.run_test(size=(160, 45)) as pilot:
        await send(pilot, "plain first")
        await wait_for(pilot, lambda: not app.generating)
        assert app.snapshot.baseline is not None and "vs plain: 30.0 ms/step" in panel_text(app)
        assert "s ago" in panel_text(app)
