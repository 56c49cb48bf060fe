"""Saved conversations (specchat/history.py), `specchat history`, `--continue` and `--system` (CliRunner)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers import REPLY, VOCAB, FakeSession, tiny_model_dir
from specchat import history
from specchat.cli.main import main
from specchat.history import ConversationLog

ROOT = Path(__file__).resolve().parent.parent
REPLY_TEXT = "".join(VOCAB[i] for i in REPLY)


@pytest.fixture
def data(tmp_path, monkeypatch):
    """A data folder of this test's own, so `history` and `--continue` see only what the test saved."""
    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data" / "conversations"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def chat(session, log, *messages):
    for text in messages:
        list(session.reply(text))
        log.save(session)


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


# ---------------------------------------------------------------- the file


def test_every_turn_is_saved_with_its_settings_and_statistics(data):
    session, log = FakeSession(mode="lookup", k=3), ConversationLog()
    session.set_system("Be brief.")
    chat(session, log, "hello there")
    saved = json.loads(log.path.read_text())
    assert log.path.parent == data and saved["format"] == history.FORMAT
    assert saved["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"},
                                 {"role": "assistant", "content": REPLY_TEXT}]
    turn = saved["turns"][0]
    assert (turn["user"], turn["reply"], turn["stop_reason"]) == ("hello there", REPLY_TEXT, "eos")
    assert (turn["model"], turn["mode"], turn["k"], turn["sampling"]["temperature"]) == ("fake-target", "lookup", 3, 0.0)
    assert turn["stats"]["new_tokens"] == len(REPLY) and turn["stats"]["acceptance_rate"] > 0

    session.set_mode("off")
    chat(session, log, "again")
    saved = json.loads(log.path.read_text())
    assert [t["user"] for t in saved["turns"]] == ["hello there", "again"]
    assert saved["turns"][0]["finished"] <= saved["turns"][1]["finished"] and saved["turns"][1]["mode"] == "off"
    assert not list(data.glob(".*"))  # atomic writes leave no temporary files behind


def test_a_stopped_turn_is_saved_as_stopped(data):
    session, log = FakeSession(), ConversationLog()
    rounds = session.reply("hi")
    next(rounds)
    rounds.close()
    log.save(session)
    turn = json.loads(log.path.read_text())["turns"][0]
    assert turn["stop_reason"] == "stopped" and turn["reply"] and turn["reply"] != REPLY_TEXT


def test_nothing_is_written_before_the_first_turn(data):
    log = ConversationLog()
    log.save(FakeSession())
    assert not log.path.exists()


def test_a_resumed_conversation_continues_the_messages_and_keeps_earlier_turns(data):
    session, log = FakeSession(), ConversationLog()
    session.set_system("Be brief.")
    chat(session, log, "first")

    resumed = ConversationLog.open(history.latest())
    assert resumed.path == log.path and resumed.system == "Be brief."
    session2 = FakeSession()
    session2.restore(resumed.messages)
    prompts = []
    session2.chat_prompt = lambda messages: prompts.append(list(messages)) or [1] * 8
    chat(session2, resumed, "second")
    assert [m["content"] for m in prompts[-1]] == ["Be brief.", "first", REPLY_TEXT, "second"]  # the next turn continues it
    saved = json.loads(log.path.read_text())
    assert [t["user"] for t in saved["turns"]] == ["first", "second"] and len(saved["messages"]) == 5
    assert saved["created"] == json.loads(json.dumps(resumed.created))


def test_set_system_replaces_the_first_message_and_re_encodes(data):
    session = FakeSession()
    list(session.reply("hi"))
    session._history = (list(session.messages), [1, 2, 3])  # as a real session leaves it
    session.set_system("New rules.")
    assert session.messages[0] == {"role": "system", "content": "New rules."} and session._history is None
    session.set_system("Other rules.")
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant"]
    assert session.system == "Other rules."
    session.set_system(None)
    assert session.system is None and [m["role"] for m in session.messages] == ["user", "assistant"]


def test_broken_files_are_skipped_and_the_latest_is_the_last_updated(data):
    old, new = ConversationLog(data / "a.json"), ConversationLog(data / "b.json")
    chat(FakeSession(), new, "newer")
    chat(s := FakeSession(), old, "older")
    data.joinpath("junk.json").write_text("{not json")
    data.joinpath("other.json").write_text('{"format": "something-else"}')
    chat(s, old, "older again")  # updated last: now the latest
    found = history.conversations()
    assert [c.path.name for c in found] == ["a.json", "b.json"]
    assert found[0].first_message == "older" and found[0].turns == 2 and found[0].model == "fake-target"
    assert history.latest() == data / "a.json"


# ---------------------------------------------------------------- the CLI


def test_history_lists_date_model_turns_and_first_message(data):
    result = invoke("history")
    assert result.exit_code == 0 and "no saved conversations" in result.output
    chat(FakeSession(), ConversationLog(data / "x.json"), "How do I\nsort a list?", "thanks")
    result = invoke("history", "--paths")
    assert result.exit_code == 0, result.output
    line = result.output.splitlines()[0]
    assert "fake-target" in line and "2 turns" in line and "How do I sort a list?" in line
    assert line[:4].isdigit() and str(data / "x.json") in result.output


def test_continue_without_a_saved_conversation_is_one_line(data):
    result = invoke("--continue")
    assert result.exit_code == 1 and "no saved conversation" in result.output and "Traceback" not in result.output


def test_continue_restores_the_messages_and_system_overrides(data, tiny, monkeypatch):
    session, log = FakeSession(), ConversationLog()
    session.set_system("Old rules.")
    chat(session, log, "hello world")
    ran = {}
    monkeypatch.setattr("specchat.tui.app.run_chat", lambda load, **kw: ran.update(session=load(), **kw))

    result = invoke("--target", tiny, "--continue")
    assert result.exit_code == 0, result.output
    assert ran["session"].messages == session.messages and ran["conversation"].path == log.path

    result = invoke("--target", tiny, "--continue", "--system", "New rules.")
    assert result.exit_code == 0, result.output
    assert ran["session"].messages[0] == {"role": "system", "content": "New rules."}
    assert ran["session"].messages[1:] == session.messages[1:]


def test_a_new_chat_gets_a_new_conversation_file_and_the_system_message(data, tiny, monkeypatch):
    ran = {}
    monkeypatch.setattr("specchat.tui.app.run_chat", lambda load, **kw: ran.update(session=load(), **kw))
    result = invoke("--target", tiny, "--system", "Be brief.")
    assert result.exit_code == 0, result.output
    assert ran["session"].messages == [{"role": "system", "content": "Be brief."}]
    assert ran["conversation"].path.parent == data and not ran["conversation"].earlier


def test_generate_puts_the_system_message_before_the_prompt(tiny):
    def prompt_tokens(*extra):
        result = invoke("generate", "--target", tiny, "--prompt", "hello world", "--max-new-tokens", 2, "--format", "json", *extra)
        assert result.exit_code == 0, result.output
        return json.loads(result.output.strip().splitlines()[-1])["prompt_tokens"]

    assert prompt_tokens("--system", "the quick brown fox") >= prompt_tokens() + 4  # the system message's words
    result = invoke("generate", "--target", tiny, "--prompt", "hi", "--raw", "--system", "x")
    assert result.exit_code == 1 and "--system needs the chat template" in result.output


@pytest.mark.parametrize("args", [["history", "--help"], ["history"]])
def test_history_does_not_import_torch(args, tmp_path):
    """Listing conversations answers at once: neither the command nor reading the files loads torch."""
    code = (f"import sys\nfrom specchat.cli.main import main\ntry:\n    main({args!r}, prog_name='specchat')\n"
            "except SystemExit:\n    pass\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)\n")
    env = {**os.environ, "SPECCHAT_DATA_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60, env=env)
    assert "NO-TORCH" in out.stderr, out.stderr
    assert ("list saved conversations" if "--help" in args else "no saved conversations") in out.stdout.lower() + out.stderr.lower()
