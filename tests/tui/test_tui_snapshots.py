"""SVG snapshots of the main screen mid-reply, per theme at 80x24 and 160x45 and with long model paths at 80x24 and
120x40, and of the panel and the help alone at 80x24 (pytest-textual-snapshot).

Update after an intended visual change with: pytest tests/tui/test_tui_snapshots.py --snapshot-update
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from textual.widgets import Input

from specchat.tui.app import SpecChatApp
from support.fakes import FakeSession


async def mid_reply(pilot) -> None:
    """Send a message, let three rounds through, show rejected drafts, select a token."""
    app = pilot.app
    app.query_one("#prompt", Input).cursor_blink = False  # a blinking cursor makes snapshots flaky
    app.query_one("#prompt", Input).value = "Tell me a story"
    await pilot.press("enter")
    app.session.release(3)
    deadline = time.monotonic() + 10
    while app.snapshot.reply.rounds < 3:
        assert time.monotonic() < deadline, "the fake session did not stream"
        await pilot.pause(0.01)
    app.redraw_reply()  # replies redraw on a 0.1 s timer while streaming: draw it now
    await pilot.press("ctrl+r")
    await pilot.pause()
    await pilot.click("ReplyView", offset=(8, 0))  # " quick": the inspector shows an accepted draft
    app.refresh_panel()  # the panel redraws on a 0.25 s timer while streaming: draw it now
    app.clear_notifications()  # toasts come and go on a timer
    await pilot.pause()


@pytest.mark.parametrize("size", [(80, 24), (160, 45)], ids=["80x24", "160x45"])
@pytest.mark.parametrize("theme", ["dark", "light", "colorblind"])
def test_main_screen_mid_reply(snap_compare, theme, size):
    app = SpecChatApp(FakeSession(gated=True), theme=theme)
    assert snap_compare(app, terminal_size=size, run_before=mid_reply)


def long_paths_session() -> FakeSession:
    """A user's GGUF pair given as long paths, sampling as the chat does: the header must keep the settings."""
    from specchat.engine.sampling import SamplingParams

    session = FakeSession(gated=True, draft_name="/home/someone/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    session.target.name = "/home/someone/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    session.info = dataclasses.replace(session.info, dtype="Q4_K_M")
    session.controls.sampling = SamplingParams(0.7, 0, 0.9)
    return session


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_main_screen_with_long_model_paths(snap_compare, size):
    assert snap_compare(SpecChatApp(long_paths_session(), theme="dark"), terminal_size=size, run_before=mid_reply)


async def panel_view(pilot) -> None:
    """Mid-reply, then ctrl+t: at 80 columns the panel replaces the chat, in two columns."""
    await mid_reply(pilot)
    await pilot.press("ctrl+t")
    await pilot.pause()
    pilot.app.refresh_panel()
    await pilot.pause()


def test_panel_alone_at_80x24(snap_compare):
    app = SpecChatApp(FakeSession(gated=True), theme="dark")
    assert snap_compare(app, terminal_size=(80, 24), run_before=panel_view)


async def help_view(pilot) -> None:
    pilot.app.query_one("#prompt", Input).cursor_blink = False
    await pilot.press("f1")
    await pilot.pause()


def test_help_at_80x24(snap_compare):
    app = SpecChatApp(FakeSession(gated=True), theme="dark")
    assert snap_compare(app, terminal_size=(80, 24), run_before=help_view)
