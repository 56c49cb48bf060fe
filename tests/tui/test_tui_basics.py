"""Chat basics in the app (Pilot, FakeSession): every turn saved, a resumed conversation shown, an earlier one opened
from the palette, the system prompt edited from the palette, the reply copied, the conversation exported as Markdown, replies shown as Markdown."""

from __future__ import annotations

import json

import pytest
from textual.command import CommandList
from textual.widgets import Input, OptionList

from support.fakes import FakeSession, REPLY, VOCAB
from test_tui import RecordingApp, wait_for
from specchat.history import ConversationLog
from specchat.tui.conversations import ConversationsScreen
from specchat.tui.system import SystemPromptScreen
from specchat.tui.widgets import Conversation, MarkdownReply, ReplyView, SavedReply, UserView

SIZE = (120, 40)
REPLY_TEXT = "".join(VOCAB[i] for i in REPLY)


async def send(pilot, text: str) -> None:
    prompt = pilot.app.query_one("#prompt", Input)
    prompt.value = text
    prompt.focus()
    await pilot.press("enter")


async def chat(pilot, text: str) -> None:
    await send(pilot, text)
    await wait_for(pilot, lambda: not pilot.app.generating and pilot.app.session.turns
                   and pilot.app.session.turns[-1].user == text)
    await pilot.pause()


# ------------------------------------------------------------------ saved as it goes


@pytest.mark.asyncio
async def test_each_finished_and_stopped_turn_is_saved_before_the_ui_hears_of_it(tmp_path):
    session, log = FakeSession(gated=True), ConversationLog(tmp_path / "c.json")
    app = RecordingApp(session, conversation=log)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "first")
        session.release(100)
        await wait_for(pilot, lambda: not app.generating)
        saved = json.loads(log.path.read_text())
        assert [t["user"] for t in saved["turns"]] == ["first"] and saved["turns"][0]["reply"] == REPLY_TEXT
        assert saved["turns"][0]["stop_reason"] == "eos" and saved["turns"][0]["stats"]["new_tokens"] == len(REPLY)

        while session.gate.acquire(blocking=False):  # take back the permits the first reply did not use
            pass
        done = session.rounds_made
        await send(pilot, "second")
        session.release(1)
        await wait_for(pilot, lambda: session.rounds_made > done)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.generating)
        saved = json.loads(log.path.read_text())
        assert [t["user"] for t in saved["turns"]] == ["first", "second"]
        assert saved["turns"][1]["stop_reason"] == "stopped" and saved["messages"][-1]["role"] == "assistant"


@pytest.mark.asyncio
async def test_a_failed_save_is_a_notice_not_a_crash(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    app = RecordingApp(FakeSession(), conversation=ConversationLog(blocker / "c.json"))  # a folder that cannot exist
    async with app.run_test(size=SIZE) as pilot:
        await chat(pilot, "hello")
        assert any("could not be saved" in n for n in app.notices)
        await chat(pilot, "still chatting")


@pytest.mark.asyncio
async def test_a_resumed_conversation_shows_earlier_turns_and_continues_them(tmp_path):
    first, log = FakeSession(), ConversationLog(tmp_path / "c.json")
    list(first.reply("earlier question"))
    log.save(first)

    resumed = ConversationLog.open(log.path)
    session = FakeSession()
    session.restore(resumed.messages)
    app = RecordingApp(session, conversation=resumed)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        conversation = app.query_one(Conversation)
        assert [type(w) for w in conversation.children] == [UserView, SavedReply]
        assert conversation.children[0].text == "earlier question" and conversation.children[1].text == REPLY_TEXT
        assert any("Continuing a conversation of 1 turn" in n for n in app.notices)
        await chat(pilot, "next question")
        assert [m["content"] for m in session.messages[:3]] == ["earlier question", REPLY_TEXT, "next question"]
    saved = json.loads(log.path.read_text())
    assert [t["user"] for t in saved["turns"]] == ["earlier question", "next question"]


# ------------------------------------------------------------------ an earlier conversation from the palette


def saved_conversation(question: str) -> ConversationLog:
    session, log = FakeSession(), ConversationLog()  # in the data folder's conversations/, as the app saves them
    list(session.reply(question))
    log.save(session)
    return log


@pytest.mark.asyncio
async def test_the_palette_lists_saved_conversations_newest_first_and_opens_one(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(tmp_path / "data"))
    older = saved_conversation("older question")
    newer = saved_conversation("newer question")
    session = FakeSession()
    app = RecordingApp(session, conversation=ConversationLog())
    async with app.run_test(size=SIZE) as pilot:
        await chat(pilot, "current question")  # saved too: the newest, marked as the one open
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"Open an earlier")
        await wait_for(pilot, lambda: app.screen.query_one(CommandList).option_count > 0)
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ConversationsScreen))
        options = app.screen.query_one(OptionList)
        lines = [str(options.get_option_at_index(i).prompt) for i in range(options.option_count)]
        assert len(lines) == 3 and "current question" in lines[0] and "(this one)" in lines[0]
        assert "newer question" in lines[1] and "older question" in lines[2] and "1 turn " in lines[2]

        options.highlighted = 2
        await pilot.press("enter")
        await wait_for(pilot, lambda: not isinstance(app.screen, ConversationsScreen))
        await pilot.pause()
        shown = app.query_one(Conversation).children
        assert [type(w) for w in shown] == [UserView, SavedReply]
        assert shown[0].text == "older question" and shown[1].text == REPLY_TEXT
        assert app.conversation.path == older.path

        await chat(pilot, "follow-up")
        assert [m["content"] for m in session.messages] == ["older question", REPLY_TEXT, "follow-up", REPLY_TEXT]
    assert [t["user"] for t in json.loads(older.path.read_text())["turns"]] == ["older question", "follow-up"]
    assert [t["user"] for t in json.loads(newer.path.read_text())["turns"]] == ["newer question"]
    current = [p for p in older.path.parent.glob("*.json") if p not in (older.path, newer.path)]
    assert [t["user"] for t in json.loads(current[0].read_text())["turns"]] == ["current question"]


@pytest.mark.asyncio
async def test_no_other_conversation_opens_while_a_reply_streams(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(tmp_path / "data"))
    saved_conversation("saved question")
    session = FakeSession(gated=True)
    app = RecordingApp(session, conversation=ConversationLog())
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "streaming")
        await wait_for(pilot, lambda: app.generating)
        app.action_open_conversation()
        await pilot.pause()
        assert not isinstance(app.screen, ConversationsScreen) and any("reply is streaming" in n for n in app.notices)
        session.release(100)
        await wait_for(pilot, lambda: not app.generating)


# ------------------------------------------------------------------ system prompt


@pytest.mark.asyncio
async def test_the_system_prompt_is_edited_from_the_palette_and_says_the_prefix_is_re_encoded():
    session = FakeSession()
    session.set_system("Be brief.")
    app = RecordingApp(session)
    async with app.run_test(size=SIZE) as pilot:
        await chat(pilot, "hello")
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"System prompt")
        await wait_for(pilot, lambda: app.screen.query_one(CommandList).option_count > 0)
        assert "System prompt" in str(app.screen.query_one(CommandList).get_option_at_index(0).prompt)
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, SystemPromptScreen))
        field = app.screen.query_one("#system-input", Input)
        assert field.value == "Be brief."
        field.value = "Answer in French."
        await pilot.press("enter")
        await wait_for(pilot, lambda: not isinstance(app.screen, SystemPromptScreen))
        assert session.system == "Answer in French." and session.messages[0]["content"] == "Answer in French."
        assert any("re-encodes the conversation" in n for n in app.notices)
        assert app.query_one("#prompt", Input).value == ""  # the dialog's Enter did not send a chat message
        assert len(session.turns) == 1

        notices = len(app.notices)
        app.action_edit_system()
        await wait_for(pilot, lambda: isinstance(app.screen, SystemPromptScreen))
        await pilot.press("escape")  # cancel: nothing changes
        await wait_for(pilot, lambda: not isinstance(app.screen, SystemPromptScreen))
        assert session.system == "Answer in French." and len(app.notices) == notices


# ------------------------------------------------------------------ copy and Markdown export


@pytest.mark.asyncio
async def test_ctrl_y_copies_the_last_reply_or_the_selected_one(tmp_path):
    session = FakeSession()
    app = RecordingApp(session)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+y")
        assert any("No reply to copy" in n for n in app.notices)
        await chat(pilot, "one")
        await pilot.press("ctrl+y")
        assert app.clipboard == REPLY_TEXT
        first = app.query(ReplyView).first()
        session.script = [REPLY[1], REPLY[2], 0]
        await chat(pilot, "two")
        await pilot.press("ctrl+y")
        assert app.clipboard == VOCAB[REPLY[1]] + VOCAB[REPLY[2]]
        app.query_one(Conversation).select(first, 0)  # a token of the first reply selected (inspector)
        await pilot.press("ctrl+y")
        assert app.clipboard == REPLY_TEXT


@pytest.mark.asyncio
async def test_export_writes_the_conversation_as_markdown_beside_json_and_csv(tmp_path):
    session = FakeSession()
    session.set_system("Be brief.")
    app = RecordingApp(session, export_path=tmp_path / "s.json")
    async with app.run_test(size=SIZE) as pilot:
        await chat(pilot, "hello there")
        await pilot.press("ctrl+s")
        await pilot.pause()
    text = (tmp_path / "s.md").read_text()
    assert (tmp_path / "s.json").exists() and (tmp_path / "s.csv").exists()
    assert text.startswith("# specchat conversation") and "fake-target" in text and "lookup 7 rounds" in text
    assert text.index("## System\n\nBe brief.") < text.index("## User\n\nhello there") < text.index(f"## Assistant\n\n{REPLY_TEXT.strip()}")
    assert any("s.md" in n for n in app.notices)


# ------------------------------------------------------------------ Markdown view


@pytest.mark.asyncio
async def test_ctrl_o_shows_finished_replies_as_markdown_and_back():
    session = FakeSession(gated=True)
    session.restore([{"role": "user", "content": "saved"}, {"role": "assistant", "content": "**bold** and `code`"}])
    app = RecordingApp(session)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "first")
        session.release(100)
        await wait_for(pilot, lambda: not app.generating)
        await pilot.press("ctrl+o")
        await pilot.pause()
        reply, saved = app.query_one(ReplyView), app.query_one(SavedReply)
        twins = {m.reply: m for m in app.query(MarkdownReply)}
        assert set(twins) == {reply, saved} and all(m.display for m in twins.values())
        assert not reply.display and not saved.display
        assert twins[saved].source == "**bold** and `code`" and twins[reply].source == REPLY_TEXT

        while session.gate.acquire(blocking=False):  # take back the permits the first reply did not use
            pass
        await send(pilot, "second")  # a streaming reply keeps its coloured tokens until it ends
        session.release(1)
        await wait_for(pilot, lambda: len(app.query(ReplyView)) == 2)
        streaming = app.query(ReplyView).last()
        assert streaming.display and streaming not in {m.reply for m in app.query(MarkdownReply)}
        session.release(100)
        await wait_for(pilot, lambda: not app.generating)
        await pilot.pause()
        assert not streaming.display and any(m.reply is streaming and m.display for m in app.query(MarkdownReply))

        await pilot.press("ctrl+o")  # back to the coloured tokens
        await pilot.pause()
        assert all(r.display for r in app.query(ReplyView)) and saved.display
        assert not any(m.display for m in app.query(MarkdownReply))


def test_new_keys_do_not_clash_and_stay_out_of_the_80_column_footer():
    from specchat.modes import MODES
    from specchat.tui.keys import ACTION_KEYS, NOT_IN_FOOTER, all_keys

    keys = all_keys(MODES)
    assert len(keys) == len(set(keys))
    assert {"copy_reply", "toggle_markdown"} <= set(ACTION_KEYS) and {"copy_reply", "toggle_markdown"} <= NOT_IN_FOOTER


@pytest.mark.asyncio
async def test_the_first_reply_of_a_resumed_conversation_says_it_reads_the_earlier_messages(tmp_path):
    """Its first round waits for the whole conversation to be encoded: the reply says why, until it starts."""
    first = FakeSession()
    list(first.reply("earlier question"))
    session = FakeSession(gated=True)
    session.restore(first.messages)
    app = RecordingApp(session)
    async with app.run_test(size=SIZE) as pilot:
        app.query_one("#prompt", Input).value = "next"
        await pilot.press("enter")
        await pilot.pause(0.05)
        reply = app.query_one(ReplyView)
        assert reply.status == "reading the 2 earlier messages first…"
        session.release(1)
        await wait_for(pilot, lambda: reply.tokens)
        assert reply.status == ""
        session.release(100)
        await wait_for(pilot, lambda: not app.generating)
