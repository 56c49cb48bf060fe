"""The chat as people expect it (issue 11): focus never strands typed text, messages sent while a reply streams
are queued, 80x24 is fully usable, no two keys clash for up to ten modes, and the sparkline shows the latest
rounds however many there were."""

from __future__ import annotations

import dataclasses
import io

import pytest
from textual.widgets import Input

from specchat.modes import MODES
from specchat.tui.app import SpecChatApp
from specchat.tui.help import HelpScreen, keys_table
from specchat.tui.keys import MAX_MODES, all_keys, mode_keys
from specchat.tui.widgets import Conversation, Inspector, StatsPanel, UserView
from support.fakes import FakeSession
from test_tui import RecordingApp, plain_text, send, wait_for


def screen_text(app) -> str:
    """What the terminal shows, as text (the compositor's lines)."""
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


# ------------------------------------------------------------------ keys


@pytest.mark.parametrize("n", range(1, MAX_MODES + 1))
def test_no_two_keys_clash_for_up_to_ten_modes(n):
    keys = all_keys([f"mode{i}" for i in range(n)])
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)


def test_a_tenth_mode_is_refused_rather_than_given_a_clashing_key():
    with pytest.raises(ValueError):
        mode_keys([f"mode{i}" for i in range(MAX_MODES + 1)])


def test_the_apps_bindings_are_the_key_schemes_and_all_differ():
    keys = [k for b in SpecChatApp.BINDINGS for k in b.key.split(",")]
    assert len(keys) == len(set(keys))
    assert set(keys) <= set(all_keys(MODES))
    assert [k for k in keys if k.startswith("f") and k[1:].isdigit() and 2 <= int(k[1:]) <= 11] == list(mode_keys(MODES).values())


def test_the_help_lists_every_mode_and_action_key():
    text = plain_text(keys_table())
    for mode, key in mode_keys(MODES).items():
        assert f"{key.upper()}" in text and mode in text
    for label in ("F1", "Esc", "^s", "^r", "^t", "^l F12", "^q", "^p", "Tab", "Enter"):
        assert label in text, label


# ------------------------------------------------------------------ focus and the queue


@pytest.mark.asyncio
async def test_after_the_inspector_esc_gives_the_focus_back_to_the_input():
    session = FakeSession()
    app = RecordingApp(session)
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, "first")
        await wait_for(pilot, lambda: not app.generating)
        prompt = app.query_one("#prompt", Input)
        await pilot.press("tab")
        assert isinstance(app.focused, Conversation)
        await pilot.press("right")
        assert app.query_one(Inspector).has_class("-shown")
        await pilot.press("escape")
        assert app.focused is prompt and not app.query_one(Inspector).has_class("-shown")
        await pilot.press(*"again", "enter")
        await wait_for(pilot, lambda: len(session.turns) == 2)
        assert session.turns[1].user == "again"

        # typing while the conversation has the focus goes to the input too, with nothing lost
        await wait_for(pilot, lambda: not app.generating)
        await pilot.press("tab", "right")
        assert isinstance(app.focused, Conversation)
        await pilot.press(*"third", "enter")
        await wait_for(pilot, lambda: len(session.turns) == 3)
        assert session.turns[2].user == "third" and app.focused is prompt


@pytest.mark.asyncio
async def test_enter_while_a_reply_streams_queues_the_message_and_stop_does_not_drop_it():
    session = FakeSession(gated=True)
    app = RecordingApp(session)
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, "first")
        session.release(1)
        await wait_for(pilot, lambda: app.snapshot.reply.rounds == 1)
        await send(pilot, "second")
        await send(pilot, "third")
        prompt = app.query_one("#prompt", Input)
        assert prompt.value == "" and len(session.turns) == 1
        views = list(app.query(UserView))
        assert [v.text for v in views] == ["first", "second", "third"]
        assert [v.queued for v in views] == [False, True, True]
        assert "queued" in views[1].render().plain and views[1].has_class("-queued")

        await pilot.press("escape")  # stop the first reply: the queue goes on
        await wait_for(pilot, lambda: len(session.turns) == 2)
        assert session.turns[1].user == "second" and not views[1].queued and views[2].queued
        shown = [w.text if isinstance(w, UserView) else "reply" for w in app.query_one(Conversation).children]
        assert shown == ["first", "reply", "second", "reply", "third"]  # each reply under its message
        assert "queued" not in views[1].render().plain
        session.release(100)
        await wait_for(pilot, lambda: len(session.turns) == 3 and not app.generating)
        assert [t.user for t in session.turns] == ["first", "second", "third"]
        assert session.turns[0].stop_reason is None and session.turns[2].stop_reason == "eos"
        assert not app.queued and not any(v.queued for v in app.query(UserView))


# ------------------------------------------------------------------ 80x24


@pytest.mark.asyncio
async def test_80x24_is_usable_chat_and_panel_switch_with_ctrl_t():
    session = FakeSession()
    app = RecordingApp(session)
    async with app.run_test(size=(80, 24)) as pilot:
        await send(pilot, "hello")
        await wait_for(pilot, lambda: not app.generating)
        text = screen_text(app)
        for shown in ("F1 help", "^s export", "^r rejected", "^t panel", "^l log", "^p palette"):
            assert shown.lower() in text.lower(), shown  # every action's key is in the footer
        assert not app.query_one(StatsPanel).display or not app.query_one("#side").display

        await pilot.press("ctrl+t")
        await pilot.pause()
        text = screen_text(app)
        assert not app.query_one("#chat").display and isinstance(app.focused, StatsPanel)
        for shown in ("mean acc. length", "verify ms/round", "recent rounds", "acceptance by draft position",
                      "estimated speedup", "modes this session", "×off", *MODES):
            assert shown in text, shown
        for key in mode_keys(MODES).values():
            assert key.upper() in text
        assert "…" not in text  # nothing truncated

        await pilot.press("ctrl+t")
        await pilot.pause()
        assert app.query_one("#chat").display and app.focused is app.query_one("#prompt", Input)

        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


@pytest.mark.asyncio
async def test_wide_terminals_show_chat_and_panel_and_ctrl_t_hides_the_panel():
    app = RecordingApp(FakeSession())
    async with app.run_test(size=(160, 45)) as pilot:
        assert app.query_one("#side").display and app.query_one("#chat").display
        await pilot.press("ctrl+t")
        await pilot.pause()
        assert not app.query_one("#side").display and app.query_one("#chat").display


# ------------------------------------------------------------------ the sparkline


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [(160, 45), (100, 30), (80, 24)])
async def test_the_sparkline_shows_the_latest_rounds_after_more_rounds_than_fit(size):
    app = RecordingApp(FakeSession())
    async with app.run_test(size=size) as pilot:
        if size[0] < 100:
            await pilot.press("ctrl+t")  # narrow: the panel replaces the chat
        await pilot.pause()
        # 300 rounds, far more than any width: old ones accepted nothing, the latest 150 everything
        app.snapshot = dataclasses.replace(app.session.snapshot(), recent=[0.0] * 150 + [1.0] * 150)
        app.refresh_panel(retake=False)
        await pilot.pause()
        line = next(line for line in screen_text(app).splitlines() if "recent rounds" in line)
        bars = line.split("recent rounds", 1)[1].strip().split(" ")[0]  # (two columns: the other column's text follows)
        assert len(bars) >= 10 and set(bars) == {"█"}, line  # the latest rounds, not the oldest, not blank


@pytest.mark.asyncio
async def test_the_panel_says_when_the_drafter_caps_k():
    """Mode head's file may cap drafting (max_draft): the panel must not claim K drafts per round."""
    app = RecordingApp(FakeSession())
    async with app.run_test(size=(160, 45)) as pilot:
        await pilot.pause()
        app.snapshot = dataclasses.replace(app.session.snapshot(), k=4, max_draft=1)
        app.refresh_panel(retake=False)
        await pilot.pause()
        assert "K 4 (drafts ≤1)" in screen_text(app)
        app.snapshot = dataclasses.replace(app.session.snapshot(), k=4, max_draft=None)
        app.refresh_panel(retake=False)
        await pilot.pause()
        assert "K 4" in screen_text(app) and "drafts ≤" not in screen_text(app)
        app.snapshot = dataclasses.replace(app.session.snapshot(), k=4, draft_len=15)  # mode suffix asks for more
        app.refresh_panel(retake=False)
        await pilot.pause()
        assert "K 4 (≤15 on a long match)" in screen_text(app)


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [(160, 45), (80, 24)])
async def test_the_panel_says_what_auto_runs_and_never_hides_approximate(size):
    """Mode auto: the mode line names the mode it runs, the next line the rule before the sampling settings (a cut
    at a narrow panel's width never falls on APPROXIMATE), and the speedup section why auto runs it."""
    from specchat.engine.drafters.auto import Standing
    from specchat.engine.sampling import SamplingParams

    app = RecordingApp(FakeSession())
    async with app.run_test(size=size) as pilot:
        if size[0] < 100:  # chat and panel take turns below 100 columns
            await pilot.press("ctrl+t")
        await pilot.pause()
        app.snapshot = dataclasses.replace(app.session.snapshot(), mode="auto", choice="head", why="head 22 tok/s vs off 19",
                                           standings=(Standing("head", 22.0, 30.0, 9), Standing("off", 19.0, None, 4)),
                                           rule="approx:0.5", exact=False, sampling=SamplingParams(0.7, top_k=40, top_p=0.9))
        app.refresh_panel(retake=False)
        await pilot.pause()
        region = app.query_one(StatsPanel).region  # the panel's part of the screen: what it shows, as it wraps
        text = " ".join(" ".join(line[region.x:region.right] for line in screen_text(app).splitlines()[region.y:region.bottom]).split())
        assert "mode auto→head" in text and "APPROXIMATE T=0.7 top-k 40 top-p 0.9" in text
        assert "why auto runs head" in text and "head is fastest so far: 1.16× plain decoding (22 vs 19 tok/s)" in text


@pytest.mark.asyncio
async def test_while_auto_runs_plain_decoding_the_mode_line_shows_no_k():
    """Plain decoding drafts nothing, and the K a measured session has for it is only the start K: the line said
    `mode auto→off  K 4 measured`."""
    app = RecordingApp(FakeSession())
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        for choice, shown in (("off", False), ("head", True)):
            app.snapshot = dataclasses.replace(app.session.snapshot(), mode="auto", choice=choice, k=4, k_measured=True)
            app.refresh_panel(retake=False)
            await pilot.pause()
            line = str(app.query_one("#mode-line").render())
            assert f"mode auto→{choice}" in line and ("K 4 measured" in line) == shown, line


@pytest.mark.parametrize("k", [4, 16])
def test_why_auto_runs_plain_decoding_is_said_in_words_within_its_six_lines(k):
    """Where plain decoding wins, the panel says what auto measured, what a round must give to pay on this machine
    and what would change it, within the section's fixed 6 lines at the narrowest panel (38 columns, 36 of text)."""
    from rich.console import Console

    from specchat.conversation import Snapshot
    from specchat.engine.drafters.auto import Standing
    from specchat.engine.metrics import Stats
    from specchat.engine.sampling import SamplingParams
    from specchat.tui.widgets.panel import auto_story

    arms = (Standing("off", 4.25, None, 12), Standing("draft", 3.13, 4.4, 8), Standing("quant", 2.96, 3.9, 6), Standing("head", 1.5, 5.0, 3))
    snapshot = Snapshot(mode="auto", k=k, sampling=SamplingParams(0.7, 0, 0.9), rule="exact", exact=True, stats={}, reply=Stats(),
                        recent=[], choice="off", why="off 4 tok/s vs draft 3", standings=arms, verify_steps=12.75)
    story = auto_story(snapshot)
    # tokens/s below 10 keep a decimal: a 0.74x draft no longer reads as level with plain decoding ("draft 4 vs off 4");
    # the most an arm could reach (every draft accepted) is given where even that is below plain decoding's
    assert story.startswith("Plain decoding is fastest here: 4.2 tok/s; draft 3.1, quant 3.0 (max 3.9), head 1.5.")
    assert f"A {k + 1}-position verify costs 12.8 steps: a round must give 12.8+ tokens." in story
    assert story.endswith("Repeated text or a cheaper draft would change it.")
    repeats = dataclasses.replace(snapshot, standings=(*arms, Standing("suffix3-5", 6.0, 9.0, 4), Standing("suffix2", 2.0, 3.0, 4)))
    assert auto_story(repeats).startswith("Plain decoding is fastest here: 4.2 tok/s; draft 3.1, quant 3.0 (max 3.9), "
                                          "head 1.5; suffix 6.0 where the text repeats.")  # not a rival elsewhere
    suffix = dataclasses.replace(snapshot, choice="suffix", why="suffix≥6 30 tok/s vs off 4",
                                 standings=(Standing("suffix≥6", 30.0, 40.0, 5), *arms))
    assert auto_story(suffix) == "suffix is fastest so far: 7.06× plain decoding (30 vs 4.2 tok/s)."  # its arm's rate
    console = Console(width=36, record=True, file=io.StringIO())
    console.print(story)
    assert len(console.export_text().splitlines()) <= 6


@pytest.mark.asyncio
@pytest.mark.parametrize("size, names", [
    ((80, 24), ["SmolLM2-135M-Instruct · Q4_1 · T=0.7 top-p 0.9"]),
    ((120, 40), ["SmolLM2-135M-Instruct · cpu Q4_1 llama.cpp · T=0.7 top-p 0.9"]),
])
async def test_the_header_keeps_the_sampling_and_the_default_model_s_whole_name(size, names):
    """The sampling settings always show; where the room is short, the device and kernel go before the model's name
    is cut (at 80 columns the header lost the sampling settings, at 120 a path model's showed "cpu Q4…")."""
    from specchat.engine.sampling import SamplingParams

    session = FakeSession()
    session.target.name = "SmolLM2-135M-Instruct"
    session.info = dataclasses.replace(session.info, dtype="Q4_1", kernel="llama.cpp")
    session.controls.sampling = SamplingParams(0.7, 0, 0.9)
    app = RecordingApp(session)
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        header = screen_text(app).splitlines()[0]
        assert all(name in header for name in names), header
        assert "…" not in header


@pytest.mark.asyncio
async def test_a_measured_k_is_shown_as_measured_and_k_plus_one_fixes_it_from_there():
    """-k auto: the mode line shows the K measured for the mode running; the palette's K + 1 fixes K at that plus
    one (the measured K would otherwise ignore it)."""
    from specchat.engine.draft_length import MeasuredK

    session = FakeSession()
    session.controls.adaptive = measured = MeasuredK(start=4)
    measured.best["lookup"] = 2
    app = RecordingApp(session)
    async with app.run_test(size=(120, 40)) as pilot:
        app.refresh_panel()
        await pilot.pause()
        line = str(app.query_one("#mode-line").render())
        assert "K 2 measured" in line and "long match" not in line  # a model's drafts go to K, not to the start K
        app.action_draft_length(1)
        await pilot.pause()
        line = str(app.query_one("#mode-line").render())
        assert session.controls.adaptive is None and session.controls.k == 3
        assert "K 3" in line and "measured" not in line


@pytest.mark.asyncio
async def test_the_header_follows_a_resize_at_once():
    """The title is fitted to the width the terminal has after a resize, not the one before (the Resize event's
    size: the app's own had not followed yet)."""
    app = RecordingApp(FakeSession(draft_name="a-draft-model-with-a-long-name-Q4_K_M.gguf"))
    async with app.run_test(size=(160, 45)) as pilot:
        await pilot.pause()
        wide = app.sub_title
        assert wide == app.title_line(160) and wide != app.title_line(70)
        await pilot.resize_terminal(70, 30)
        await pilot.pause()
        assert app.sub_title == app.title_line(70)
        await pilot.resize_terminal(160, 45)
        await pilot.pause()
        assert app.sub_title == wide
