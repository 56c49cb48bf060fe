"""Pilot tests of the chat app against a scripted FakeSession (fast, deterministic, no model)."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console
from rich.style import Style
from textual.color import Color
from textual.widgets import Input

from specchat.engine.sampling import SamplingParams
from specchat.tui import app as app_module
from specchat.tui.app import SpecChatApp, run_chat
from specchat.tui.log import LogScreen
from specchat.tui.themes import BUILTIN_THEMES, DEFAULT_THEME, load_themes, rich_token_styles
from specchat.tui.widgets import Conversation, Inspector, Legend, ReplyView, StatsPanel
from support.fakes import ACCEPT_PATTERN, FakeSession, REPLY, VOCAB, WRONG

SIZE = (120, 40)


class RecordingApp(SpecChatApp):
    """The real app, remembering every notice it showed."""

    def __init__(self, *args, **kwargs) -> None:
        self.notices: list[str] = []
        super().__init__(*args, **kwargs)

    def notify(self, message, **kwargs) -> None:
        self.notices.append(str(message))
        super().notify(message, **kwargs)


async def wait_for(pilot, condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.01)


async def send(pilot, text: str) -> None:
    app = pilot.app
    app.query_one("#prompt", Input).value = text
    app.query_one("#prompt", Input).focus()
    await pilot.press("enter")


def rounds_shown(app) -> int:
    return app.snapshot.reply.rounds


def plain_text(renderable) -> str:
    console = Console(width=60, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def panel_text(app) -> str:
    return "".join(plain_text(w.content) for w in app.query_one(StatsPanel).query("Static"))


def theme_color(app, kind: str) -> Color:
    return Color.parse(app.get_css_variables()[f"token-{kind}"])


# ------------------------------------------------------------------ streaming


@pytest.mark.asyncio
async def test_reply_streams_round_by_round_in_token_colours():
    session = FakeSession(gated=True)
    app = RecordingApp(session)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "tell me a story")
        assert app.generating
        session.release(1)
        await wait_for(pilot, lambda: rounds_shown(app) == 1)
        reply = app.query_one(ReplyView)
        # round 0 accepts all 4 drafts, then a bonus token
        assert [t.kind for t in reply.tokens] == ["accepted"] * 4 + ["bonus"]
        assert reply.text == "".join(VOCAB[i] for i in REPLY[:5])
        await wait_for(pilot, lambda: "100%" in panel_text(app))  # this reply's acceptance (redrawn within 0.25 s)
        # each token is drawn in its theme colour
        content = reply.content()
        colours = {content.plain[s.start : s.end]: s.style.foreground for s in content.spans}
        assert colours[" The"] == theme_color(app, "accepted")
        assert colours[" jumps"] == theme_color(app, "bonus")

        session.release(1)
        await wait_for(pilot, lambda: rounds_shown(app) == 2)
        assert [t.kind for t in reply.tokens[5:]] == ["accepted", "accepted", "resampled"]
        content = reply.content()
        resampled = next(s for s in content.spans if content.plain[s.start : s.end] == " lazy")
        assert resampled.style.foreground == theme_color(app, "resampled")
        assert resampled.style.bold  # the dark theme marks replacements in bold too

        session.release(100)
        await wait_for(pilot, lambda: not app.generating)
        assert reply.text == session.turns[0].reply == "".join(VOCAB[i] for i in REPLY)
        assert session.messages[-1]["content"] == reply.text
        assert app.snapshot.reply.rounds == len(session.turns[0].rounds)
        assert "greedy" in panel_text(app) and "lookup" in panel_text(app)


@pytest.mark.asyncio
async def test_plain_tokens_use_the_target_colour_and_the_panel_measures_a_plain_step():
    session = FakeSession(mode="off")
    app = RecordingApp(session)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hi")
        await wait_for(pilot, lambda: not app.generating)
        reply = app.query_one(ReplyView)
        assert {t.kind for t in reply.tokens} == {"target"}
        content = reply.content()
        assert {s.style.foreground for s in content.spans} == {theme_color(app, "target")}
        text = panel_text(app)
        assert "1.00× predicted" in text and "30.0 ms/step" in text  # the fake plain round verifies in 30 ms


@pytest.mark.asyncio
async def test_speedup_is_estimated_once_a_plain_step_is_measured():
    session = FakeSession(mode="lookup")
    app = RecordingApp(session)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "first")
        await wait_for(pilot, lambda: not app.generating)
        assert "no plain step measured yet" in panel_text(app)  # this fake runs no plain rounds in-band
        await pilot.press("f2")
        await wait_for(pilot, lambda: session.mode == "off")
        await send(pilot, "second")
        await wait_for(pilot, lambda: not app.generating)
        await pilot.press("f8")
        await wait_for(pilot, lambda: session.mode == "lookup")
        text = panel_text(app)
        assert "predicted" in text and "no plain step" not in text and "K=" in text
        # measured only against plain rounds of its own window: off's rounds ran in another reply
        assert "measured" not in text and "no plain round among them yet" in text


# ------------------------------------------------------------------ keys


@pytest.mark.asyncio
async def test_every_key():
    session = FakeSession(mode="lookup", available=("off", "lookup"))
    app = RecordingApp(session, export_path=None)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hello")
        await wait_for(pilot, lambda: not app.generating)

        await pilot.press("f2")
        await wait_for(pilot, lambda: session.mode == "off")

        await pilot.press("f3")  # no draft model was loaded
        await wait_for(pilot, lambda: any("--draft" in n for n in app.notices))
        assert session.mode == "off"

        for key, mode in [("f4", "layerskip"), ("f5", "earlyexit"), ("f6", "lowrank"), ("f7", "quant")]:
            await pilot.press(key)
            await wait_for(pilot, lambda: mode in app.unavailable)
            assert any(mode in n and "unavailable" in n for n in app.notices)
            assert session.mode == "off"  # an unavailable mode never replaces the running one
        assert "n/a" in panel_text(app)  # unavailable modes in the panel's modes table
        await pilot.press("f4")  # a second press just repeats the notice
        await pilot.pause()
        assert sum("layerskip" in n for n in app.notices) == 2

        await pilot.press("f8")
        await wait_for(pilot, lambda: session.mode == "lookup")

        legend = app.query_one(Legend)
        await pilot.press("ctrl+r")
        assert legend.show_rejected and all(r.show_rejected for r in app.query(ReplyView))
        reply = app.query_one(ReplyView)
        shown = reply.content().plain
        assert "".join(VOCAB[i] for i in WRONG[:2]) in shown  # round 1 rejected two drafts
        await pilot.press("ctrl+r")
        assert not legend.show_rejected and VOCAB[WRONG[0]] not in reply.content().plain

        await pilot.press("ctrl+l")
        assert isinstance(app.screen, LogScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, LogScreen)
        await pilot.press("f12")  # the log's old key still works
        assert isinstance(app.screen, LogScreen)
        await pilot.press("ctrl+l")
        assert not isinstance(app.screen, LogScreen)

        await pilot.press("escape")  # nothing streaming: Esc does nothing
        assert not app.generating

        await pilot.press("ctrl+q")
    assert app.return_code == 0


@pytest.mark.asyncio
async def test_ctrl_s_exports_json_and_csv(tmp_path):
    session = FakeSession()
    path = tmp_path / "out" / "session.json"
    app = RecordingApp(session, export_path=path)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hello")
        await wait_for(pilot, lambda: not app.generating)
        await pilot.press("f2")
        await wait_for(pilot, lambda: session.mode == "off")
        await send(pilot, "again")
        await wait_for(pilot, lambda: not app.generating)
        await pilot.press("ctrl+s")
    data = json.loads(path.read_text())
    config = data["config"]
    assert (config["target"], config["draft"], config["device"], config["dtype"]) == ("fake-target", None, "cpu", "float32")
    assert config["modes_used"] == ["lookup", "off"] and config["exact"] is True
    assert config["sampling"] == {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    assert config["hardware"]["cores"] >= 1
    assert [t["user"] for t in data["turns"]] == ["hello", "again"]
    assert data["turns"][0]["reply"] == "".join(VOCAB[i] for i in REPLY)
    lookup_rounds = data["turns"][0]["rounds"]
    assert [r["accepted"] for r in lookup_rounds] == [min(a, r["draft_len"]) for a, r in zip(ACCEPT_PATTERN * 3, lookup_rounds)]
    assert lookup_rounds[1]["tokens"][-1]["kind"] == "resampled" and lookup_rounds[1]["rejected"] == WRONG[:2]
    assert {t["kind"] for r in data["turns"][1]["rounds"] for t in r["tokens"]} == {"target"}
    lookup = data["summary"]["modes"]["lookup"]
    assert lookup == {**session.stats["lookup"].summary(), "speedup_model": session.snapshot().speedup("lookup").as_dict()}
    assert data["summary"]["total"]["new_tokens"] == 2 * len(REPLY)
    rows = list(csv.DictReader(path.with_suffix(".csv").open()))
    assert len(rows) == sum(len(t.rounds) for t in session.turns)
    assert rows[0]["mode"] == "lookup" and rows[-1]["mode"] == "off" and rows[-1]["stop_reason"] == "eos"
    assert "".join(r["text"] for r in rows) == session.turns[0].reply + session.turns[1].reply


# ------------------------------------------------------------------ mid-reply control


@pytest.mark.asyncio
async def test_mode_switch_mid_reply_takes_effect_next_round():
    session = FakeSession(gated=True)
    app = RecordingApp(session)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "go")
        session.release(2)
        await wait_for(pilot, lambda: rounds_shown(app) == 2)
        await pilot.press("f2")
        await wait_for(pilot, lambda: session.mode == "off")
        assert app.generating
        session.release(100)
        await wait_for(pilot, lambda: not app.generating)
        modes = [r.mode for r in session.turns[0].rounds]
        assert modes[:2] == ["lookup", "lookup"] and set(modes[2:]) == {"off"}
        assert session.stats["lookup"].rounds == 2 and session.stats["off"].rounds == len(modes) - 2
        kinds = [t.kind for t in app.query_one(ReplyView).tokens]
        assert kinds[-1] == "target" and "accepted" in kinds
        assert session.turns[0].reply == "".join(VOCAB[i] for i in REPLY)  # one reply, whatever the modes
        assert re.search(r"reply +off", panel_text(app))  # the panel's columns: this reply, mode off in the session


@pytest.mark.asyncio
async def test_escape_stops_the_reply_and_keeps_it():
    session = FakeSession(gated=True)
    app = RecordingApp(session)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "go")
        session.release(2)
        await wait_for(pilot, lambda: rounds_shown(app) == 2)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.generating)
        turn = session.turns[0]
        assert len(turn.rounds) == 2 and turn.stop_reason is None
        reply = app.query_one(ReplyView)
        assert reply.text == turn.reply != ""
        assert "stopped" in reply.status
        assert session.messages[-1] == {"role": "assistant", "content": turn.reply}
        assert session.stats["lookup"].rounds == 2 == app.snapshot.reply.rounds
        # the conversation goes on after a stop
        session.release(100)
        await send(pilot, "next")
        await wait_for(pilot, lambda: len(session.turns) == 2 and not app.generating)
        assert session.turns[1].stop_reason == "eos"


@pytest.mark.asyncio
async def test_settings_from_the_command_palette_apply_to_the_next_round():
    session = FakeSession(gated=True)
    app = RecordingApp(session)
    async with app.run_test(size=SIZE) as pilot:
        commands = {c.title: c for c in app.get_system_commands(app.screen)}
        for title in ["Mode: off (F2)", "Mode: lookup (F8)", "Mode: quant (F7)", "Stop reply (Esc)",
                      "Export session (^s)", "Toggle rejected drafts (^r)", "Toggle panel (^t)", "Keys (F1)", "Draft length up", "Draft length down",
                      "Temperature up", "Temperature down", "Greedy / sampling", "Theme: light", "Quit"]:
            assert title in commands, title
        assert [title for title in commands if title.startswith("Keys")] == ["Keys (F1)"]  # not Textual's too
        await send(pilot, "go")
        session.release(1)
        await wait_for(pilot, lambda: rounds_shown(app) == 1)
        commands["Draft length down"].callback()
        commands["Draft length down"].callback()
        assert session.controls.k == 2
        session.release(1)
        await wait_for(pilot, lambda: rounds_shown(app) == 2)
        assert session.turns[0].rounds[-1].draft_len == 2
        commands["Greedy / sampling"].callback()
        assert session.controls.sampling == SamplingParams(temperature=0.7)
        commands["Temperature up"].callback()
        assert session.controls.sampling.temperature == pytest.approx(0.8)
        session.release(1)
        await wait_for(pilot, lambda: rounds_shown(app) == 3)
        assert session.turns[0].sampling[-1].temperature == pytest.approx(0.8)
        assert "T=0.8" in panel_text(app)
        commands["Greedy / sampling"].callback()
        assert session.controls.sampling.greedy
        for _ in range(20):
            commands["Draft length up"].callback()
        assert session.controls.k == 16  # clamped
        commands["Theme: light"].callback()
        assert app.theme == "light"
        session.release(100)
        await wait_for(pilot, lambda: not app.generating)


# ------------------------------------------------------------------ inspector


@pytest.mark.asyncio
async def test_inspector_by_click_and_keyboard():
    session = FakeSession()
    app = RecordingApp(session)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "go")
        await wait_for(pilot, lambda: not app.generating)
        reply = app.query_one(ReplyView)
        await pilot.click(ReplyView, offset=(2, 0))  # " The": padding 1, then the token (drawn by the reply's chunk)
        await pilot.pause()
        inspector = app.query_one(Inspector)
        text = plain_text(inspector.content)
        assert reply.selected == 0
        assert "' The'" in text and "accepted" in text and "round 0" in text and "position 1" in text
        assert "p(x) 0.9000" in text and "q(x) 0.8000" in text and "accept 1.000" in text
        assert "' maybe'" in text  # top alternatives are decoded to text

        conversation = app.query_one(Conversation)
        conversation.focus()
        await pilot.press("right", "right")
        assert reply.selected == 2
        await pilot.press("end")
        last = reply.tokens[reply.selected]
        assert last.kind == "bonus" or last.kind == "resampled"
        text = plain_text(inspector.content)
        assert last.kind in text and "q(x) -" in text and "q: no draft here" in text
        await pilot.press("home", "left")  # already first: stays
        assert reply.selected == 0


# ------------------------------------------------------------------ themes


@pytest.mark.asyncio
async def test_broken_theme_file_gives_a_notice_and_falls_back(tmp_path):
    (tmp_path / "broken.toml").write_text('name = "broken"\n[colors]\nprimary = "not a colour"\n')
    (tmp_path / "half.toml").write_text("name = [unclosed\n")
    dirs = [BUILTIN_THEMES, tmp_path]
    app = RecordingApp(FakeSession(), theme="broken", theme_dirs=dirs)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert app.theme == "dark"
        assert any("broken.toml" in n and "not a colour" in n for n in app.notices)
        assert any("half.toml" in n and "TOML" in n for n in app.notices)
        assert any("'broken' is not available" in n for n in app.notices)
        assert any("broken.toml" in line for line, _ in app.log_lines)  # also in the log view


@pytest.mark.asyncio
async def test_a_user_theme_is_used_and_colours_the_tokens(tmp_path):
    (tmp_path / "mine.toml").write_text(
        'dark = true\n[colors]\nprimary = "#336699"\nbackground = "#000000"\n[tokens]\naccepted = "#ff00ff"\n'
    )
    app = RecordingApp(FakeSession(), theme="mine", theme_dirs=[BUILTIN_THEMES, tmp_path])
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "go")
        await wait_for(pilot, lambda: not app.generating)
        assert app.theme == "mine" and not app.notices
        content = app.query_one(ReplyView).content()
        assert content.spans[0].style.foreground == Color.parse("#ff00ff")


def test_builtin_themes_load_from_the_package():
    loaded = load_themes([BUILTIN_THEMES])
    assert {"dark", "light", "colorblind"} <= set(loaded.themes) and not loaded.problems
    assert loaded.themes["light"].dark is False
    for theme in loaded.themes.values():
        assert {f"token-{k}" for k in ("accepted", "resampled", "bonus", "target", "rejected")} <= set(theme.variables)
    package_dir = Path(app_module.__file__).resolve().parent / "themes"
    assert (package_dir / "dark.toml").is_file()  # what an installed wheel ships as package data


def test_generate_colours_each_kind_as_the_chat_s_default_theme_does():
    variables = load_themes([BUILTIN_THEMES]).themes[DEFAULT_THEME].variables
    styles = rich_token_styles()
    for kind in ("accepted", "resampled", "bonus"):
        style = Style.parse(styles[kind])
        assert style.color.triplet.hex == variables[f"token-{kind}"].lower()
        text_style = variables[f"token-{kind}-style"]
        assert text_style == "none" or getattr(style, text_style) is True
    assert styles["target"] == "default"  # plain tokens keep the terminal's own colour


# ------------------------------------------------------------------ bad input


@pytest.mark.asyncio
async def test_bad_input_is_refused_with_a_notice_and_the_conversation_kept():
    session = FakeSession(context_len=40, gated=True)
    app = RecordingApp(session)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "   ")
        assert not session.turns and any("Type a message" in n for n in app.notices)

        long = " ".join(["word"] * 100)
        await send(pilot, long)
        assert not session.turns and any("context of 40" in n for n in app.notices)
        assert app.query_one("#prompt", Input).value == long  # kept, so the user can shorten it

        await send(pilot, "short")
        session.release(1)
        await wait_for(pilot, lambda: rounds_shown(app) == 1)
        await send(pilot, "while streaming")  # queued (test_tui_layout.py tests the queue)
        assert len(session.turns) == 1 and app.queued
        await pilot.press("f5")  # an unavailable mode while streaming: a notice, the reply goes on
        await wait_for(pilot, lambda: "earlyexit" in app.unavailable)
        session.release(100)
        await wait_for(pilot, lambda: not app.generating)
        assert session.turns[0].stop_reason == "eos" and session.mode == "lookup"
        await wait_for(pilot, lambda: len(session.turns) == 2 and not app.generating)  # the queued message went


@pytest.mark.asyncio
async def test_a_long_prompt_shows_how_far_it_has_been_read_until_the_first_token():
    session = FakeSession(gated=True)
    app = RecordingApp(session)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "a long message")
        await pilot.pause()
        reading = threading.Thread(target=session.controls.on_prefill, args=(2048, 5120))  # as the decoder's thread calls it
        reading.start()
        reading.join()
        await wait_for(pilot, lambda: app.reply_view.status == "reading the prompt: 2,048 of 5,120 tokens…")
        session.release(1)
        await wait_for(pilot, lambda: app.snapshot.reply.rounds >= 1)
        assert app.reply_view.status == ""
        session.release(100)
        await wait_for(pilot, lambda: not app.generating)


@pytest.mark.asyncio
async def test_keys_while_a_drafter_is_building():
    session = FakeSession(mode="off", available=("off", "lookup", "quant"), slow_modes=("quant",))
    app = RecordingApp(session)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f7")
        await pilot.pause()
        assert app.pending_mode == "quant" and "switching to quant" in panel_text(app)
        # what takes the seconds is said in a notice too: the panel is hidden on a narrow terminal
        assert [n for n in app.notices if n.startswith("Preparing")] == ["Preparing mode quant: making an int8 copy of the target…"]
        await send(pilot, "meanwhile")  # chatting goes on in the current mode while it builds
        await wait_for(pilot, lambda: not app.generating)
        assert {r.mode for r in session.turns[0].rounds} == {"off"}
        await pilot.press("f8")  # changed our mind before the build finished: the last key wins
        await wait_for(pilot, lambda: session.mode == "lookup")
        session.build_gate.set()
        await wait_for(pilot, lambda: "quant" in session._drafters)
        await pilot.pause(0.05)
        assert session.mode == "lookup" and app.pending_mode is None
        await pilot.press("f7")  # built now: switching is immediate
        await wait_for(pilot, lambda: session.mode == "quant")
        assert sum(n.startswith("Preparing") for n in app.notices) == 1


@pytest.mark.asyncio
async def test_a_failing_generation_is_reported_and_the_app_survives():
    session = FakeSession(fail_at=2)
    app = RecordingApp(session)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "go")
        await wait_for(pilot, lambda: not app.generating)
        assert any("scripted failure" in n for n in app.notices)
        assert any("Traceback" in line for line, _ in app.log_lines)
        assert len(session.turns[0].rounds) == 2 and app.query_one(ReplyView).status == "error"
        session.fail_at = None
        await send(pilot, "again")
        await wait_for(pilot, lambda: not app.generating and len(session.turns) == 2)
        assert session.turns[1].stop_reason == "eos"


def test_run_chat_writes_the_export_even_when_the_app_crashes(tmp_path, monkeypatch):
    session = FakeSession()

    def crash(self):
        list(self.session.reply("before the crash"))
        raise RuntimeError("boom")

    monkeypatch.setattr(SpecChatApp, "run", crash)
    path = tmp_path / "crash.json"
    with pytest.raises(RuntimeError, match="^boom$"):
        run_chat(session, export_path=path)
    data = json.loads(path.read_text())
    assert data["turns"][0]["user"] == "before the crash" and data["turns"][0]["reply"] == session.turns[0].reply


@pytest.mark.asyncio
async def test_warnings_and_prints_go_to_the_log_view_not_the_screen():
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    app = RecordingApp(FakeSession())
    async with app.run_test(size=SIZE) as pilot:
        warnings.warn("a python warning")
        logging.getLogger("somelib").warning("a library warning")
        hf_logging.get_logger("transformers.models").warning("a transformers warning")
        print("a stray print")
        await pilot.pause(0.05)
        lines = "\n".join(line for line, _ in app.log_lines)
        for text in ("a python warning", "a library warning", "a transformers warning", "a stray print"):
            assert text in lines
        await pilot.press("f12")
        assert isinstance(app.screen, LogScreen)


@pytest.mark.asyncio
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
async def test_a_kill_or_a_closed_terminal_saves_the_partial_reply_and_exits_cleanly(sig, tmp_path):
    """SIGTERM / SIGHUP mid-reply: the reply stops after its round, the turn is saved with what was generated,
    and the app exits normally (restoring the terminal) with status 128 + the signal; a queued message is not sent."""
    from specchat.history import ConversationLog

    session = FakeSession(gated=True)
    log = ConversationLog(tmp_path / "conversation.json")
    app = RecordingApp(session, conversation=log)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "go")
        session.release(2)
        await wait_for(pilot, lambda: rounds_shown(app) == 2)
        await send(pilot, "queued meanwhile")
        os.kill(os.getpid(), sig)
        await wait_for(pilot, lambda: app.return_code is not None)
    assert app.return_code == 128 + sig
    saved = json.loads((tmp_path / "conversation.json").read_text())
    assert len(saved["turns"]) == 1 and saved["turns"][0]["reply"] == session.turns[0].reply != ""
    assert saved["turns"][0]["stop_reason"] == "stopped" and len(session.turns) == 1
