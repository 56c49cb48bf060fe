"""Saved conversations (specchat/history.py), `specchat history`, `--continue` and `--system` (CliRunner)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from support.models import tiny_model_dir
from support.fakes import FakeSession, REPLY, VOCAB
from specchat import history
from specchat.cli.main import main
from specchat.engine.draft_length import MeasuredK
from specchat.engine.sampling import SamplingParams
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
    session.controls.k = 5  # the palette's K +1, twice: the first turn ran with 3 and is saved again with 3
    chat(session, log, "again")
    saved = json.loads(log.path.read_text())
    assert [t["user"] for t in saved["turns"]] == ["hello there", "again"]
    assert [t["k"] for t in saved["turns"]] == [3, 5]
    assert saved["turns"][0]["finished"] <= saved["turns"][1]["finished"] and saved["turns"][1]["mode"] == "off"
    assert not list(data.glob(".*"))  # atomic writes leave no temporary files behind


def test_a_turn_under_k_measured_is_saved_with_k_auto(data):
    session, log = FakeSession(mode="lookup", k=3), ConversationLog()
    session.controls.adaptive = MeasuredK(start=3)  # what Session.measure_k sets (-k auto)
    chat(session, log, "hello there")
    assert json.loads(log.path.read_text())["turns"][0]["k"] == "auto"


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


def test_history_shows_a_path_model_by_its_file_name_and_keeps_the_message_readable_at_80_columns(data, monkeypatch):
    session = FakeSession()
    session.target.name = "/home/someone/models/very/deep/folder/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    message = "Explain how speculative decoding keeps the target's distribution exact, with an example"
    chat(session, ConversationLog(data / "x.json"), message)
    monkeypatch.setenv("COLUMNS", "80")
    line = invoke("history").output.splitlines()[0]
    name = line.split()[2]  # the file name, cut in its middle: its start and its quantisation
    assert "/home/someone" not in line and name.startswith("qwen2") and name.endswith("k_m") and "…" in name
    assert len(line) <= 80 and message[:25] in line


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
    assert result.exit_code == 2 and "--system needs the chat template" in result.output


@pytest.mark.parametrize("args", [["history", "--help"], ["history"]])
def test_history_does_not_import_torch(args, tmp_path):
    """Listing conversations answers at once: neither the command nor reading the files loads torch."""
    code = (f"import sys\nfrom specchat.cli.main import main\ntry:\n    main({args!r}, prog_name='specchat')\n"
            "except SystemExit:\n    pass\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)\n")
    env = {**os.environ, "SPECCHAT_DATA_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60, env=env)
    assert "NO-TORCH" in out.stderr, out.stderr
    assert ("list saved conversations" if "--help" in args else "no saved conversations") in out.stdout.lower() + out.stderr.lower()


# ---------------------------------------------------------------- what each turn keeps, and reading the files back


def test_each_turn_keeps_the_settings_it_ran_with_and_when_it_finished(data, monkeypatch):
    """The file is rewritten after every turn: an earlier turn keeps its own mode, sampling, draft, prompt size and
    the time it was first saved, whatever changed since; the conversation keeps when it was created."""
    clock = iter(f"2026-01-01T00:00:{s:02d}+00:00" for s in range(60))
    monkeypatch.setattr(history, "_now", lambda: next(clock))
    session, log = FakeSession(mode="lookup", k=3, draft_name="small-draft"), ConversationLog()
    chat(session, log, "one")
    session.set_mode("off")
    session.controls.sampling = SamplingParams(0.7, top_p=0.9)  # as the chat's sampling keys change it
    chat(session, log, "two", "three")
    log.save(session)  # saved again without a new turn: the turns already there keep their times
    saved = json.loads(log.path.read_text())
    turns = saved["turns"]
    assert [(t["mode"], t["sampling"]["temperature"], t["draft"]) for t in turns] == [
        ("lookup", 0.0, "small-draft"), ("off", 0.7, "small-draft"), ("off", 0.7, "small-draft")]
    assert [t["prompt_tokens"] for t in turns] == [t.prompt_tokens for t in session.turns]
    assert saved["created"] == "2026-01-01T00:00:00+00:00"
    finished = [t["finished"] for t in turns]
    assert finished == sorted(set(finished)) and saved["updated"] > finished[-1]  # each turn its own time, in order


def test_a_turn_that_ended_before_its_first_round_is_saved(data):
    """The reply failed (or was stopped) before any round: the app saves after it as after any turn, and the turn is
    saved with the settings then in force (it has no round to take them from), not an IndexError that would fail
    this save and every later one."""
    session, log = FakeSession(fail_at=0), ConversationLog()
    session.controls.sampling = SamplingParams(0.5)
    with pytest.raises(RuntimeError):
        list(session.reply("hi"))
    log.save(session)
    turn = json.loads(log.path.read_text())["turns"][0]
    assert (turn["user"], turn["reply"], turn["stop_reason"]) == ("hi", "", "stopped")
    assert (turn["mode"], turn["sampling"]["temperature"]) == ("lookup", 0.5)


def test_a_resumed_conversation_keeps_when_it_was_created(data):
    earlier = {"format": history.FORMAT, "created": "2025-05-05T05:05:05+00:00", "updated": "2025-05-05T05:06:00+00:00",
               "model": "fake-target", "messages": [], "turns": [{"user": "old"}]}
    path = data / "old.json"
    data.mkdir(parents=True)
    path.write_text(json.dumps(earlier))
    resumed = ConversationLog.open(path)
    chat(FakeSession(), resumed, "new")
    saved = json.loads(path.read_text())
    assert saved["created"] == "2025-05-05T05:05:05+00:00" and [t["user"] for t in saved["turns"]] == ["old", "new"]


def test_a_conversation_is_read_back_as_utf8_whatever_the_machines_default_encoding(data, monkeypatch):
    """The files are written in UTF-8; on a machine whose default encoding is another (Windows: cp1252), --continue
    and `history` still read the text as it was written, not as mojibake."""
    text = "café ☕ — naïve"
    session, log = FakeSession(), ConversationLog()
    chat(session, log, text)
    monkeypatch.setattr(io, "text_encoding", lambda encoding, stacklevel=2: encoding or "cp1252")
    assert ConversationLog.open(log.path).messages[0]["content"] == text
    assert history.conversations()[0].first_message == text


def test_a_conversation_file_with_only_the_format_is_listed_with_defaults(data):
    """A file with the format and nothing else (hand-written, or from another version) is listed, not a crash of
    `specchat history`: no time, model "?", no turns, no first message; so is one without a user message."""
    data.mkdir(parents=True)
    data.joinpath("bare.json").write_text(json.dumps({"format": history.FORMAT}))
    found = history.conversations()
    assert [(c.updated, c.model, c.turns, c.first_message) for c in found] == [("", "?", 0, "")]
    data.joinpath("bare.json").write_text(json.dumps({"format": history.FORMAT, "messages": [{"role": "system", "content": "s"}]}))
    assert history.conversations()[0].first_message == ""
    result = invoke("history")
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output


def test_a_broken_file_hides_no_other_conversation_whatever_the_listing_order(data, tmp_path):
    """A file that is not a conversation is skipped, and only it: the folder may list it before the good ones.
    The folder given is the one read (latest of an empty folder is None though the data folder has one)."""
    folder = tmp_path / "elsewhere"
    chat(FakeSession(), ConversationLog(data / "in-data.json"), "x")
    folder.mkdir()
    for name, updated in (("b.json", "2026-01-01T10:00:00+00:00"), ("d.json", "2026-01-01T11:00:00+00:00")):
        folder.joinpath(name).write_text(json.dumps({"format": history.FORMAT, "updated": updated, "turns": [{}]}))
    folder.joinpath("a.json").write_text("{not json")
    folder.joinpath("c.json").write_text('{"format": "something-else"}')
    for reverse in (False, True):
        class Listed(type(folder)):  # a folder that lists its files in a known order
            def glob(self, pattern):
                return sorted(super().glob(pattern), reverse=reverse)

        assert sorted(c.path.name for c in history.conversations(Listed(folder))) == ["b.json", "d.json"]
        assert history.latest(Listed(folder)) == folder / "d.json"
    (tmp_path / "empty").mkdir()
    assert history.latest(tmp_path / "empty") is None and history.latest() == data / "in-data.json"


def test_a_file_that_is_not_a_conversation_is_refused_with_its_path_and_why(data, tmp_path):
    """What --continue says about a file it cannot resume: the file, and whether it was unreadable or not one."""
    junk, other = tmp_path / "junk.json", tmp_path / "other.json"
    junk.write_text("{not json")
    other.write_text('{"format": "something-else"}')
    with pytest.raises(ValueError) as e:
        history.load(junk)
    assert str(e.value).startswith(f"{junk}: cannot read the conversation (Expecting property name")
    with pytest.raises(ValueError) as e:
        history.load(other)
    assert str(e.value) == f"{other}: not a specchat conversation"


def test_the_latest_is_the_last_updated_instant_across_a_change_of_utc_offset(data):
    """Saved with the offset of the time: at a daylight-saving change the later instant can be the smaller string."""
    data.mkdir(parents=True)
    for name, updated in (("a.json", "2026-03-29T02:30:00+01:00"), ("b.json", "2026-03-29T01:45:00+00:00"),
                          ("c.json", "2026-10-25T02:30:00+02:00"), ("d.json", "2026-10-25T02:10:00+01:00")):
        data.joinpath(name).write_text(json.dumps({"format": history.FORMAT, "updated": updated, "turns": [{}]}))
    assert [c.path.name for c in history.conversations()] == ["d.json", "c.json", "b.json", "a.json"]
    assert history.latest() == data / "d.json"


@pytest.mark.parametrize("fail", ["serialise", "write", "rename"])
def test_a_save_that_fails_leaves_the_previous_file_intact_and_no_stray_files(data, monkeypatch, fail):
    """The JSON cannot be made, the disk fills while it is written, or the rename is refused: the file saved after
    the previous turn is byte for byte what it was, and nothing else is left in the folder."""
    from specchat import store

    session, log = FakeSession(), ConversationLog(data / "c.json")
    chat(session, log, "first")
    before = log.path.read_bytes()
    list(session.reply("second"))
    if fail == "serialise":
        def dumps(*args, **kwargs):
            raise TypeError("not JSON serialisable")

        monkeypatch.setattr(history.json, "dumps", dumps)
    elif fail == "write":
        def write_file(path, text):
            with open(path, "w", encoding="utf-8") as f:
                f.write(text[: len(text) // 2])
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(store, "write_file", write_file)
    else:
        def no_rename(src, dst):
            raise OSError(13, "Permission denied")

        monkeypatch.setattr(store.os, "replace", no_rename)
    with pytest.raises((OSError, TypeError)):
        log.save(session)
    monkeypatch.undo()
    assert log.path.read_bytes() == before and os.listdir(data) == ["c.json"]
    assert [t["user"] for t in history.load(log.path)["turns"]] == ["first"]  # and it still reads as the conversation
