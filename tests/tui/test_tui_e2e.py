"""End to end with the real default model (SmolLM2-135M): a short reply, a mode switch, an export.

The first run converts the default GGUF into the user cache (~20 s); later runs load in seconds.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from textual.widgets import Input

from specchat.engine.sampling import SamplingParams
from specchat.tui.app import SpecChatApp
from specchat.tui.widgets import ReplyView

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_model():
    from specchat.models import load_model

    return load_model(None, torch.device("cpu"), torch.float32)


async def wait_for(pilot, condition, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the real model"
        await pilot.pause(0.05)


@pytest.mark.asyncio
async def test_chat_with_the_default_model(default_model, tmp_path):
    from specchat.session import Session

    session = Session(default_model, mode="off", k=3, sampling=SamplingParams(temperature=0.0), seed=0, max_new_tokens=12)
    path = tmp_path / "e2e.json"
    app = SpecChatApp(session, export_path=path)
    async with app.run_test(size=(120, 40)) as pilot:
        app.query_one("#prompt", Input).value = "What is the capital of France?"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.snapshot.reply.rounds >= 2)
        # switch mid-reply to a mode the engine has; one it lacks must give a notice, not a crash
        await pilot.press("f8")
        await wait_for(pilot, lambda: app.pending_mode is None)
        await wait_for(pilot, lambda: not app.generating)
        first = session.turns[0]
        assert first.reply.strip() and app.query_one(ReplyView).text == first.reply
        assert "Paris" in first.reply
        lookup_ok = "lookup" not in app.unavailable
        assert session.mode == ("lookup" if lookup_ok else "off")

        await pilot.press("f2")
        await wait_for(pilot, lambda: app.pending_mode is None and session.mode == "off")
        app.query_one("#prompt", Input).value = "And of Italy?"
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.generating and len(session.turns) == 2)
        assert session.turns[1].reply.strip()
        assert {r.mode for r in session.turns[1].rounds} == {"off"}
        await pilot.press("ctrl+s")

    data = json.loads(path.read_text())
    assert data["config"]["target"] == "SmolLM2-135M-Instruct"
    assert [t["user"] for t in data["turns"]] == ["What is the capital of France?", "And of Italy?"]
    assert data["turns"][0]["reply"] == first.reply
    assert data["summary"]["modes"]["off"]["new_tokens"] > 0
    assert data["summary"]["total"]["new_tokens"] == sum(len(t.reply_ids) for t in session.turns)
    # the second prompt holds the whole conversation (chat template over every turn)
    assert data["turns"][1]["prompt_tokens"] > data["turns"][0]["prompt_tokens"]


def test_next_turn_continues_the_exact_ids_so_the_whole_cache_is_reused(default_model):
    from specchat.engine.cache import common_prefix
    from specchat.session import Session

    session = Session(default_model, mode="off", sampling=SamplingParams(temperature=0.0), seed=0, max_new_tokens=10)
    list(session.reply("Name three fruits."))
    cached = list(session.state.tokens)  # prompt 1 + reply 1, exactly as generated
    messages = [*session.messages, {"role": "user", "content": "And three vegetables?"}]
    prompt = session.prompt_for(messages)
    assert prompt[: len(cached)] == cached  # nothing the cache holds is encoded again
    text = default_model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert default_model.tokenizer.decode(prompt, skip_special_tokens=False) == text  # and it is the same conversation
    list(session.reply("And three vegetables?"))
    assert common_prefix(cached, session.state.tokens) == len(cached)
    assert session.turns[1].prompt_tokens == len(prompt)
    # reusing the cache changes nothing: a fresh session given the same ids replies the same
    fresh = Session(default_model, mode="off", sampling=SamplingParams(temperature=0.0), seed=0, max_new_tokens=10)
    list(fresh.complete(prompt))
    assert fresh.turns[0].reply_ids == session.turns[1].reply_ids


@pytest.mark.asyncio
async def test_the_chat_s_default_mode_auto_with_the_default_model(default_model):
    """What `specchat` opens with: mode auto over off, suffix, the shipped head and quant's int8 copy. The reply is
    plain greedy's, the head is tried, and the panel says what auto runs."""
    from specchat.session import Session
    from test_tui import panel_text

    question = "Name three rivers in Europe."
    plain = Session(default_model, mode="off", sampling=SamplingParams(temperature=0.0), seed=0, max_new_tokens=40)
    list(plain.reply(question))
    session = Session(default_model, mode="auto", sampling=SamplingParams(temperature=0.0), seed=0, max_new_tokens=40)
    assert set(session.controls.drafter.candidates) == {"off", "suffix", "head", "quant"}
    app = SpecChatApp(session)
    async with app.run_test(size=(120, 40)) as pilot:
        app.query_one("#prompt", Input).value = question
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.generating and len(session.turns) == 1)
        await pilot.pause(0.5)  # the panel's next redraw
        panel = panel_text(app)
    turn = session.turns[0]
    assert turn.reply_ids == plain.turns[0].reply_ids
    assert {"off", "head"} <= {r.mode for r in turn.rounds}
    assert f"mode auto→{session.mode_drafter.choice}" in panel  # (the chat wrapped it in its in-band baseline)
