"""The chat over serving engines (two stand-in llama-servers): the header names the server, tokens stream with
the kinds rebuilt from its counters, the mode keys switch configurations, and what a server does not send
(rejected drafts, p and q, its K) is said, not invented."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from textual.widgets import Static

from support import remote_standin
from support.remote_standin import chunk, finish_chunk
from test_tui import send, wait_for
from specchat.engine import remote
from specchat.engine.sampling_params import SamplingParams
from specchat.remote_session import RemoteSession
from specchat.tui.app import SpecChatApp
from specchat.tui.widgets import Inspector, ReplyView

# "Hello, world" in 5 tokens: the first plain (prefill), then 3 drafted / 2 accepted (accepted, accepted,
# resampled), then 1 drafted / 1 accepted (accepted, bonus) cut short by the end token's stop
SPEC = [chunk(1, text="Hel"), chunk(2, 3, 2, text="lo"), chunk(3, 3, 2, text=","), chunk(4, 3, 2, text=" wor"),
        chunk(5, 4, 3, text="ld"), finish_chunk(), chunk(5, 4, 3, usage=5)]
PLAIN = [chunk(1, text="Hel"), chunk(2, text="lo"), chunk(3, text="!"), finish_chunk(), chunk(3, usage=3)]


@pytest.fixture
def servers():
    spec, plain = remote_standin.start(), remote_standin.start()
    spec.script, plain.script = SPEC, PLAIN
    plain.slots_speculative = False
    yield spec, plain
    spec.shutdown()
    plain.shutdown()


def text(widget) -> str:
    console = Console(width=100, record=True, file=io.StringIO())
    console.print(widget.content)
    return console.export_text()


@pytest.mark.asyncio
async def test_the_chat_streams_a_server_and_switches_configurations(servers):
    spec, plain = servers
    session = RemoteSession([remote.connect(spec.url, "spec"), remote.connect(plain.url, "plain")],
                            sampling=SamplingParams(0.0, 0, 1.0))
    app = SpecChatApp(session, conversation=None)
    async with app.run_test(size=(160, 45)) as pilot:
        assert "llama-server model.gguf (draft-simple)" in app.sub_title and spec.url in app.sub_title
        await send(pilot, "hi")
        await wait_for(pilot, lambda: not app.generating and session.turns)
        view = app.query_one(ReplyView)
        assert [t.kind for t in view.tokens] == ["target", "accepted", "accepted", "resampled", "accepted"]
        assert session.turns[0].reply == "Hello, world" and session.warnings == []
        panel = text(app.query_one("#speedup", Static))
        assert "no plain configuration has run" in panel  # nothing to compare with yet: no invented speedup
        assert "draft ms/round" not in text(app.query_one("#stats", Static))

        await pilot.press("f3")  # the second configuration
        await wait_for(pilot, lambda: session.mode == "plain")
        assert plain.url in app.sub_title
        await send(pilot, "again")
        await wait_for(pilot, lambda: not app.generating and len(session.turns) == 2)
        assert plain.bodies and plain.bodies[-1]["messages"][-1]["content"] == "again"
        assert [m["content"] for m in plain.bodies[-1]["messages"][:2]] == ["hi", "Hello, world"]  # the conversation goes on
        await pilot.press("f2")
        await wait_for(pilot, lambda: session.mode == "spec")
        await pilot.pause(0.1)
        app.refresh_panel()
        await pilot.pause(0.1)
        assert "measured against plain" in text(app.query_one("#speedup", Static))
        modes = text(app.query_one("#modes", Static))
        assert "spec" in modes and "plain" in modes and "×plain" in modes

        await pilot.press("f4")  # no third configuration: said, nothing changes
        await pilot.pause(0.1)
        assert session.mode == "spec"
        before = session.controls.k
        app.action_draft_length(1)  # K is the server's: a warning, no change
        assert session.controls.k is before is None
        app.action_toggle_rejected()
        assert app.show_rejected is False


@pytest.mark.asyncio
async def test_the_inspector_says_what_the_server_does_not_send(servers):
    spec, _ = servers
    session = RemoteSession([remote.connect(spec.url)], sampling=SamplingParams(0.0, 0, 1.0))
    app = SpecChatApp(session, conversation=None)
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, "hi")
        await wait_for(pilot, lambda: not app.generating and session.turns)
        inspector = app.query_one(Inspector)
        inspector.show_token(app.query_one(ReplyView).tokens[3], session.token_text)
        shown = text(inspector)
        assert "resampled" in shown and "the server does not send them" in shown and "nan" not in shown


@pytest.mark.asyncio
async def test_a_stream_that_breaks_keeps_the_partial_reply_on_screen(servers):
    spec, _ = servers
    spec.script, spec.cut = SPEC[:3], True
    session = RemoteSession([remote.connect(spec.url)], sampling=SamplingParams(0.0, 0, 1.0))
    app = SpecChatApp(session, conversation=None)
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, "hi")
        await wait_for(pilot, lambda: not app.generating and session.turns)
        assert session.turns[0].reply == "Hello," and session.turns[0].stop_reason == "interrupted"
        assert app.query_one(ReplyView).status == "error"
        assert any("ended before the reply did" in line for line, _ in app.log_lines)
        assert session.messages[-1] == {"role": "assistant", "content": "Hello,"}
