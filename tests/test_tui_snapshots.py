"""SVG snapshots of the main screen mid-reply, one per theme (pytest-textual-snapshot).

Update after an intended visual change with: pytest tests/test_tui_snapshots.py --snapshot-update
"""

from __future__ import annotations

import time

import pytest
from textual.widgets import Input

from specchat.tui.app import SpecChatApp
from helpers import FakeSession


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
    await pilot.press("f10")
    await pilot.pause()
    await pilot.click("ReplyView", offset=(8, 0))  # " quick": the inspector shows an accepted draft
    app.refresh_panel()  # the panel redraws on a 0.25 s timer while streaming: draw it now
    app.clear_notifications()  # toasts come and go on a timer
    await pilot.pause()


@pytest.mark.parametrize("theme", ["dark", "light", "colorblind"])
def test_main_screen_mid_reply(snap_compare, theme):
    app = SpecChatApp(FakeSession(gated=True), theme=theme)
    assert snap_compare(app, terminal_size=(130, 42), run_before=mid_reply)
