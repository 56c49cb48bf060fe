"""The chat app over the real engine on a tiny model (fast): Esc stops a real generation, ctrl+s exports a
streaming reply, and the conversation goes on with a consistent cache."""

from __future__ import annotations

import json
import time

import pytest
import torch
from textual.widgets import Input

from support.models import tiny_model_dir
from specchat.engine.metrics import Stats
from specchat.engine.sampling import SamplingParams
from specchat.models import load_model
from specchat.session import Session
from specchat.tui.app import SpecChatApp
from specchat.tui.widgets import ReplyView

FULL = 200  # tokens a reply may run to: far more than the test lets it


class PacedSession(Session):
    """The real session and engine; each round waits a little, so a key press lands mid-reply."""

    pause_s = 0.1  # a full reply takes ~7 s: Esc lands mid-reply even on a loaded machine

    def _rounds(self, prompt):
        for record in super()._rounds(prompt):
            time.sleep(self.pause_s)
            yield record


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(tiny_model_dir(tmp_path_factory.mktemp("tiny"), layers=2)), torch.device("cpu"), torch.float32)


def session_for(tiny, **kw):
    session = PacedSession(tiny, tiny, mode="draft", k=3, sampling=SamplingParams(1.0), seed=3, max_new_tokens=FULL, **kw)
    session.eos_ids = set()  # no early EOS: only Esc can end the first reply before FULL tokens
    return session


async def wait_for(pilot, condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await pilot.pause(0.02)


async def send(pilot, app, text: str) -> None:
    app.query_one("#prompt", Input).value = text
    await pilot.press("enter")


@pytest.mark.asyncio
async def test_escape_stops_a_real_generation_and_the_conversation_goes_on(tiny):
    session = session_for(tiny)
    app = SpecChatApp(session)
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, app, "hello world")
        await wait_for(pilot, lambda: session.turns and len(session.turns[0].rounds) >= 3)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.generating)
        turn = session.turns[0]
        assert turn.stop_reason is None and 0 < len(turn.reply_ids) < FULL  # stopped, not finished
        assert app.query_one(ReplyView).text == turn.reply and "stopped" in app.query_one(ReplyView).status
        assert turn.stats.summary() == Stats.of(turn.rounds).summary()
        assert sum(s.rounds for s in session.stats.values()) == len(turn.rounds) == app.snapshot.reply.rounds
        # the in-band plain round comes right after round 0 (whose token came with the prefill)
        assert turn.rounds[1].mode == "off" and app.snapshot.baseline is not None
        assert session.state.tokens[-len(turn.reply_ids):] == turn.reply_ids

        session.max_new_tokens, session.pause_s = 12, 0.0
        session.controls.sampling = SamplingParams(0)  # greedy: the next reply can be checked exactly
        await send(pilot, app, "the cat")
        await wait_for(pilot, lambda: len(session.turns) == 2 and not app.generating)
    second = session.turns[1]
    assert second.stop_reason == "max_new_tokens"
    # the cache reused after the stop was consistent: a fresh session given the same ids replies the same
    prompt = session.state.tokens[: second.prompt_tokens]
    fresh = Session(tiny, mode="off", sampling=SamplingParams(0), max_new_tokens=12)
    fresh.eos_ids = set()
    list(fresh.complete(prompt))
    assert fresh.turns[0].reply_ids == second.reply_ids


@pytest.mark.asyncio
async def test_ctrl_s_while_a_reply_streams_exports_the_partial_reply(tiny, tmp_path):
    session = session_for(tiny)
    session.pause_s = 0.1  # ~50 s for a full reply: the export surely lands mid-reply
    path = tmp_path / "mid.json"
    app = SpecChatApp(session, export_path=path)
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, app, "hello")
        await wait_for(pilot, lambda: session.turns and len(session.turns[0].rounds) >= 3)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: path.exists())
        assert app.generating  # the export did not wait for the reply
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.generating)
    data = json.loads(path.read_text())
    turn = data["turns"][0]
    rounds = turn["rounds"]
    assert 3 <= len(rounds) < len(session.turns[0].rounds) + 1
    assert turn["reply"] == "".join(t["text"] for r in rounds for t in r["tokens"])  # consistent with its rounds
    assert data["summary"]["total"]["rounds"] == len(rounds)  # summary taken with the same rounds
    assert sum(r["emitted"] for r in rounds) == data["summary"]["total"]["new_tokens"] == turn["new_tokens"]


@pytest.mark.asyncio
@pytest.mark.parametrize("stop", ["escape", "sigterm"])
async def test_a_real_reply_stopped_mid_stream_is_saved_with_its_partial_reply(tiny, tmp_path, stop):
    """The real engine keeps generating until the loop breaks (unlike a scripted fake that ends by itself): Esc,
    or a SIGTERM, mid-reply saves the conversation with the partial reply as its last message."""
    import os
    import signal

    from specchat.history import ConversationLog

    session = session_for(tiny)
    log = ConversationLog(tmp_path / "conversation.json")
    app = SpecChatApp(session, conversation=log)
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, app, "hello world")
        await wait_for(pilot, lambda: session.turns and len(session.turns[0].rounds) >= 3)
        if stop == "escape":
            await pilot.press("escape")
            await wait_for(pilot, lambda: not app.generating)
        else:
            os.kill(os.getpid(), signal.SIGTERM)
            await wait_for(pilot, lambda: app.return_code is not None)
    saved = json.loads(log.path.read_text())
    turn = session.turns[0]
    assert 0 < len(turn.reply_ids) < FULL and turn.stop_reason is None  # stopped mid-reply, not finished
    assert saved["messages"][-1] == {"role": "assistant", "content": turn.reply}
    assert saved["turns"][-1]["reply"] == turn.reply and saved["turns"][-1]["stop_reason"] == "stopped"
