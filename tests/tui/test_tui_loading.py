"""The chat shows at once and loads its models in a background thread (issue 27, item 5): each stage on screen
while it runs, a message typed meanwhile sent once the model is ready, a failed load one line and status 1, and
quitting mid-load immediate (a real process in a pseudo-terminal)."""

from __future__ import annotations

import os
import pty
import select
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from support.fakes import FakeSession, REPLY, VOCAB
from test_tui import RecordingApp, send, wait_for
from specchat.cli.options import UserError
from specchat.tui.app import SpecChatApp, run_chat
from specchat.tui.widgets import StartupView, StatsPanel, UserView

SIZE = (120, 40)
ROOT = Path(__file__).resolve().parents[2]


class GatedLoad:
    """A loader that reports two stages and returns a FakeSession once the test opens its gate."""

    def __init__(self, session=None) -> None:
        self.gate, self.session = threading.Event(), session or FakeSession()
        self.thread: threading.Thread | None = None

    def __call__(self, progress):
        self.thread = threading.current_thread()
        with progress.status("Loading target fake-target..."):
            assert self.gate.wait(timeout=20), "the test never let the load finish"
        with progress.status("Preparing mode lookup..."):
            pass
        return self.session


def startup_text(app) -> str:
    views = list(app.query(StartupView))
    return str(views[0].render()) if views else ""


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [(80, 24), (160, 45)])
async def test_the_chat_shows_before_its_model_and_sends_what_was_typed_meanwhile(tmp_path, size):
    load = GatedLoad()
    app = RecordingApp(load=load)
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, lambda: "Loading target fake-target" in startup_text(app))
        await pilot.pause()
        screen = app.screen.region
        for widget in (app.query_one(StartupView), app.query_one("#prompt")):  # on screen, whole, at either size
            assert widget.region.height > 0 and screen.contains_region(widget.region), (widget, widget.region)
        assert app.session is None and load.thread is not threading.main_thread()
        assert "loading the model" in app.sub_title and "loading the model" in str(app.query_one("#mode-line").render())
        await send(pilot, "typed while loading")
        assert [v.text for v in app.query(UserView) if v.queued] == ["typed while loading"]
        assert "sent once the model is ready" in str(app.query_one(UserView).render())
        assert app.check_action("export", ()) is None and app.check_action("mode_key", (0,)) is None  # wait for the model
        assert app.check_action("help", ()) and app.check_action("quit", ())
        await pilot.press("f3")  # a mode key while loading does nothing (no session to switch)
        load.gate.set()
        await wait_for(pilot, lambda: app.session is not None and not app.generating and app.session.turns)
        assert not app.query(StartupView)  # the stages give way to the conversation
        assert app.session.turns[0].user == "typed while loading"
        assert str(app.query_one(UserView).render()) == "typed while loading"  # no note once sent
        assert app.session.turns[0].reply == "".join(VOCAB[i] for i in REPLY)
        assert "fake-target" in app.sub_title
        assert any("Loading target fake-target" in line and " s" in line for line, _ in app.log_lines)  # each stage's time
        assert app.query_one(StatsPanel)._shown is not None  # the panel shows the session now


@pytest.mark.asyncio
async def test_a_failed_load_ends_the_app_with_its_error():
    def fail(progress):
        with progress.status("Loading target broken.gguf..."):
            raise UserError("broken.gguf is not a GGUF model")

    app = SpecChatApp(load=fail)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.return_code is not None)
    assert app.return_code == 1 and isinstance(app.load_error, UserError) and app.session is None


def test_run_chat_raises_the_loads_error_once_the_app_is_gone(monkeypatch, capsys, tmp_path):
    """click prints a UserError as its one line; an export asked for is not written (there is no session)."""
    def fail(progress):
        raise UserError("broken.gguf is not a GGUF model")

    monkeypatch.setattr(SpecChatApp, "run", _run_headless)
    with pytest.raises(UserError, match="not a GGUF model"):
        run_chat(load=fail, export_path=tmp_path / "x.json")
    assert not (tmp_path / "x.json").exists()


def _run_headless(app):
    from textual.app import App

    return App.run(app, headless=True, size=SIZE)


QUIT_WHILE_LOADING = """
import threading
from specchat.tui.app import run_chat
from specchat.history import ConversationLog

def load(progress):
    with progress.status("Loading a model that never finishes..."):
        threading.Event().wait()

run_chat(load=load, conversation=ConversationLog({path!r}))
"""


def test_quitting_while_the_model_loads_exits_at_once_and_restores_the_terminal(tmp_path):
    """ctrl+q mid-load: status 0 within seconds although the loading thread never ends, the alternate screen left
    and the cursor shown, and no conversation file (nothing was said)."""
    code = QUIT_WHILE_LOADING.format(path=str(tmp_path / "conversation.json"))
    pid, fd = pty.fork()
    if pid == 0:  # the child: a real terminal
        os.environ["TERM"] = "xterm-256color"
        os.execv(sys.executable, [sys.executable, "-c", code])
    out = b""
    try:
        deadline = time.monotonic() + 60
        while b"never finishes" not in out:
            assert time.monotonic() < deadline, out[-2000:]
            if select.select([fd], [], [], 0.1)[0]:
                out += os.read(fd, 65536)
        quit_at = time.monotonic()
        os.write(fd, b"\x11")  # ctrl+q
        while True:
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    out += os.read(fd, 65536)
                except OSError:  # the child closed the terminal
                    break
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            assert time.monotonic() - quit_at < 10, "the chat did not exit while its model loaded"
        if not done:
            _, status = os.waitpid(pid, 0)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0
    assert out.rfind(b"\x1b[?1049l") > out.rfind(b"\x1b[?1049h") and out.rfind(b"\x1b[?25h") > out.rfind(b"\x1b[?25l")
    assert not (tmp_path / "conversation.json").exists()
