"""The token inspector says something in greedy mode (issue 11, item 8): the model's own probabilities beside the
warped p and q, alternatives with real probabilities, and up/down move by line."""

from __future__ import annotations

import pytest
import torch

from support.models import tiny_model_dir
from support.fakes import FakeSession
from specchat.engine.events import TokenEvent
from specchat.engine.sampling import SamplingParams
from specchat.models import load_model
from specchat.session import Session
from specchat.tui.widgets import Conversation, Inspector, ReplyView
from test_tui import RecordingApp, plain_text, send, wait_for


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(tiny_model_dir(tmp_path_factory.mktemp("tiny"), layers=2)), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("mode", ["off", "draft"])
def test_greedy_token_events_carry_the_models_own_probabilities(tiny, mode):
    session = Session(tiny, tiny, mode=mode, k=3, sampling=SamplingParams(0), max_new_tokens=12)
    session.eos_ids = set()
    tokens = [t for r in session.reply("the cat and the dog") for t in r.tokens]
    assert all(t.p == 1.0 for t in tokens)  # greedy: the warped p is one-hot
    assert any(t.p_raw < 0.999 for t in tokens)  # the model itself was not that sure
    for t in tokens:
        ids, probs = zip(*t.top_raw)
        assert ids[0] == t.id and probs[0] == pytest.approx(t.p_raw)  # greedy takes the model's argmax
        assert list(probs) == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-5 and probs[1] > 0


def test_unwarped_sampling_reports_p_itself(tiny):
    session = Session(tiny, mode="off", sampling=SamplingParams(1.0), seed=1, max_new_tokens=8)
    session.eos_ids = set()
    for record in session.reply("hello"):
        for t in record.tokens:
            assert t.p_raw == pytest.approx(t.p) and t.top_raw == t.top_p


def test_the_inspector_shows_the_models_probabilities_and_no_zero_fillers():
    token = TokenEvent(id=5, text=" fox", kind="accepted", round=0, position=1, p=1.0, q=1.0, accept_prob=1.0,
                       top_p=((5, 1.0), (0, 0.0), (1, 0.0)), top_q=((5, 1.0), (2, 0.0)),
                       p_raw=0.4312, top_raw=((5, 0.4312), (7, 0.2101)))
    inspector = Inspector()
    inspector.show_token(token, lambda tid: f"tok{tid}")
    text = plain_text(inspector.content)
    assert "p(x) 1.0000" in text and "model at T=1: p(x) 0.4312" in text
    assert "target at T=1" in text and "tok7" in text and "0.2101" in text
    assert "tok0" not in text and "tok2" not in text  # zero-probability alternatives are not listed


@pytest.mark.asyncio
async def test_up_and_down_move_by_line_not_by_reply():
    session = FakeSession()
    app = RecordingApp(session)
    async with app.run_test(size=(40, 40)) as pilot:  # narrow: the reply wraps over several lines
        await send(pilot, "go")
        await wait_for(pilot, lambda: not app.generating)
        reply = app.query_one(ReplyView)
        lines = reply.token_lines()
        assert len(lines) >= 3
        conversation = app.query_one(Conversation)
        conversation.focus()
        conversation.select(reply, lines[0][0][1])
        await pilot.press("down")
        assert reply.selected in [token for _, token in lines[1]]
        await pilot.press("down")
        assert reply.selected in [token for _, token in lines[2]]
        await pilot.press("up")
        assert reply.selected in [token for _, token in lines[1]]


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
async def test_the_selected_token_is_scrolled_into_view(size):
    """After a reply taller than the chat, Home/End/up/down select tokens above and below the view: the chat
    follows the selection, and the inspector (which takes room below the chat) never covers it."""
    from support.fakes import REPLY

    session = FakeSession(reply=REPLY * 30)
    session.max_new_tokens = len(REPLY) * 12
    app = RecordingApp(session)
    async with app.run_test(size=size) as pilot:
        await send(pilot, "go")
        await wait_for(pilot, lambda: not app.generating)
        reply = app.query_one(ReplyView)
        conversation = app.query_one(Conversation)
        assert reply.virtual_region.height > conversation.scrollable_content_region.height  # taller than the view

        def visible() -> bool:
            row = reply.virtual_region.y + reply.token_row(reply.selected)
            top = conversation.scroll_offset.y
            return top <= row < top + conversation.scrollable_content_region.height

        conversation.focus()
        for key in ("home", "down", "down", "end", "up", "home"):
            await pilot.press(key)
            await pilot.pause(0.05)
            assert visible(), key
