"""Session export: contents, atomic writes, and partial replies."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
from dataclasses import asdict
from datetime import datetime, timedelta

import pytest
import torch

from specchat import store
from specchat.engine.acceptance import LenientRule
from specchat.engine.remote import Server
from specchat.engine.sampling import SamplingParams
from specchat.export import CSV_COLUMNS, conversation_markdown, export_paths, save_export, session_data, write_export
from specchat.store import write_atomic
from support.fakes import FakeSession, REPLY, VOCAB

REPLY_TEXT = "".join(VOCAB[i] for i in REPLY)


def test_export_paths_put_the_csv_beside_the_json(tmp_path):
    assert export_paths(tmp_path / "a.json") == (tmp_path / "a.json", tmp_path / "a.csv")
    assert export_paths(tmp_path / "a.csv") == (tmp_path / "a.json", tmp_path / "a.csv")
    assert export_paths(tmp_path / "run1") == (tmp_path / "run1.json", tmp_path / "run1.csv")


def test_export_holds_every_turn_round_and_token(tmp_path):
    session = FakeSession(mode="lookup", k=3)
    list(session.reply("one"))
    session.set_mode("off")
    list(session.reply("two"))
    json_path, csv_path = write_export(session, tmp_path / "s.json")
    data = json.loads(json_path.read_text())
    assert data["format"] == "specchat-session/1"
    assert data["config"]["modes_used"] == ["lookup", "off"]
    assert data["config"]["draft_lengths"] == sorted({r.draft_len for t in session.turns for r in t.rounds})
    assert data["config"]["draft_len"] == 3 and data["config"]["dtype"] == "float32"
    assert set(data["summary"]["modes"]) == {"lookup", "off"}
    assert data["summary"]["modes"]["off"]["num_draft_tokens"] == 0
    tokens = [t for turn in data["turns"] for r in turn["rounds"] for t in r["tokens"]]
    assert len(tokens) == 2 * len(REPLY) == data["summary"]["total"]["new_tokens"]
    assert all(t["kind"] in {"accepted", "resampled", "bonus", "target"} for t in tokens)
    assert tokens[0]["top_p"] and tokens[0]["q"] == 0.8
    rows = list(csv.reader(csv_path.open()))
    assert rows[0] == CSV_COLUMNS
    assert len(rows) - 1 == sum(len(t["rounds"]) for t in data["turns"])


def test_the_export_names_the_modes_that_ran_not_only_the_one_selected_at_the_end(tmp_path):
    session = FakeSession(mode="lookup", k=3)
    list(session.reply("one"))
    session.set_mode("off")  # selected, but no round has run in it
    data = session_data(session)
    rounds = len(session.turns[0].rounds)
    assert data["config"]["mode"] == "off" and data["config"]["rounds_by_mode"] == {"lookup": rounds}
    assert f"lookup {rounds} rounds" in conversation_markdown(session, data) and "mode off" not in conversation_markdown(session, data)


def test_a_stopped_reply_is_exported_as_far_as_it_went(tmp_path):
    session = FakeSession()
    rounds = session.reply("stop me")
    next(rounds), next(rounds)
    rounds.close()
    data = session_data(session)
    turn = data["turns"][0]
    assert turn["stop_reason"] == "stopped" and len(turn["rounds"]) == 2
    assert turn["reply"] == session.turns[0].reply and turn["new_tokens"] == len(session.turns[0].reply_ids)


def test_nan_is_written_as_null(tmp_path):
    session = FakeSession()
    list(session.reply("x"))
    session.turns[0].rounds[0].draft_s = float("nan")
    json_path, _ = write_export(session, tmp_path / "n.json")
    assert json.loads(json_path.read_text())["turns"][0]["rounds"][0]["draft_s"] is None


def test_write_is_atomic_the_old_file_survives_a_failed_write(tmp_path, monkeypatch):
    path = tmp_path / "keep.json"
    write_atomic(path, "old")
    mode = path.stat().st_mode

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(store.os, "replace", fail)
    with pytest.raises(OSError):
        write_atomic(path, "new")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["keep.json"]  # no temporary file left behind
    monkeypatch.undo()
    write_atomic(path, "new")
    assert path.read_text() == "new" and path.stat().st_mode == mode


def test_a_new_file_gets_the_mode_a_plain_open_gives_and_the_process_umask_is_never_changed(tmp_path, monkeypatch):
    """The umask is process-wide: setting it even briefly would give a file another thread creates meanwhile 0666."""
    real_umask = os.umask
    old_mask = real_umask(0o027)
    try:
        def umask(mask):
            pytest.fail(f"os.umask({mask:#o}) called during an atomic write")

        monkeypatch.setattr(os, "umask", umask)
        write_atomic(tmp_path / "new.json", "x")
        with store.atomic_path(tmp_path / "new.bin") as tmp:
            tmp.write_bytes(b"x")
        monkeypatch.undo()
        with open(tmp_path / "plain", "w"):
            pass
        mode = (tmp_path / "plain").stat().st_mode & 0o777
        assert mode == 0o640
        assert (tmp_path / "new.json").stat().st_mode & 0o777 == mode
        assert (tmp_path / "new.bin").stat().st_mode & 0o777 == mode
    finally:
        real_umask(old_mask)


def test_a_directory_written_first_by_another_process_is_kept(tmp_path):
    """Two first starts converting the same model at once: the second finds the folder there and keeps it."""
    out = tmp_path / "model"
    with store.atomic_path(out) as mine:
        mine.mkdir()
        (mine / "config.json").write_text("mine")
        with store.atomic_path(out) as theirs:  # the other process finishes first
            theirs.mkdir()
            (theirs / "config.json").write_text("theirs")
    assert (out / "config.json").read_text() == "theirs" and os.listdir(tmp_path) == ["model"]


@pytest.mark.parametrize("fail", ["write", "rename", "second rename"])
def test_an_export_that_fails_leaves_the_previous_export_intact_and_no_stray_files(tmp_path, monkeypatch, fail):
    """write_export's own path: the disk fills while the CSV is written, or the first or second rename fails (the
    first file already replaced): the previous JSON, CSV and Markdown are byte for byte what they were, and nothing
    else is left in the folder."""
    first = FakeSession()
    list(first.reply("first"))
    json_path, csv_path = write_export(first, tmp_path / "s.json")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert set(before) == {"s.json", "s.csv", "s.md"}

    second = FakeSession()
    list(second.reply("second"))
    list(second.reply("third"))
    if fail == "write":  # the second file written (the CSV) cannot be flushed: the disk is full
        calls = []

        def fsync(fd):
            calls.append(fd)
            if len(calls) == 2:
                raise OSError(28, "No space left on device")

        monkeypatch.setattr(store.os, "fsync", fsync)
    else:
        real_replace, renames = os.replace, []

        def no_rename(src, dst):
            renames.append(dst)
            if len(renames) == (2 if fail == "second rename" else 1):
                raise OSError(13, "Permission denied")
            real_replace(src, dst)

        monkeypatch.setattr(store.os, "replace", no_rename)
    with pytest.raises(OSError):
        write_export(second, tmp_path / "s.json")
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert after == before


# ---------------------------------------------------------------- what each file holds


def test_every_round_and_token_is_exported_with_what_was_recorded(tmp_path):
    """Each round's and token's fields under their own names, each round with the sampling it ran under, and the
    CSV row of every round (milliseconds, the settings, the round's text) with plain newlines."""
    session = FakeSession(mode="lookup", k=3)
    list(session.reply("one"))
    session.controls.sampling = SamplingParams(0.7, top_k=5, top_p=0.9)  # as the chat's sampling keys change it
    list(session.reply("two"))
    json_path, csv_path = write_export(session, tmp_path / "s.json")
    data = json.loads(json_path.read_text())
    greedy, sampled = asdict(SamplingParams(0.0)), asdict(SamplingParams(0.7, top_k=5, top_p=0.9))
    assert data["config"]["sampling_used"] == [greedy, sampled]  # each once, in the order first used

    token_fields = ("id", "text", "kind", "position", "p", "q", "accept_prob")
    round_fields = ("index", "mode", "draft_len", "drafted", "accepted", "emitted", "draft_calls", "draft_s", "verify_s",
                    "wall_s", "prefill_s", "exact", "stop_reason", "rejected")
    expected_rows = []
    for i, (turn, exported) in enumerate(zip(session.turns, data["turns"])):
        assert (exported["index"], exported["user"], exported["reply"]) == (i, turn.user, turn.reply)
        assert (exported["prompt_tokens"], exported["new_tokens"]) == (turn.prompt_tokens, len(turn.reply_ids))
        assert len(exported["rounds"]) == len(turn.rounds) > 1
        for r, s, out in zip(turn.rounds, turn.sampling, exported["rounds"]):
            assert set(out) == {*round_fields, "sampling", "tokens"}
            assert {f: out[f] for f in round_fields} == {f: getattr(r, f) for f in round_fields}
            assert out["sampling"] == asdict(s)
            for t, t_out in zip(r.tokens, out["tokens"], strict=True):
                assert set(t_out) == {*token_fields, "top_p", "top_q"}
                assert {f: t_out[f] for f in token_fields} == {f: getattr(t, f) for f in token_fields}
                assert (t_out["top_p"], t_out["top_q"]) == ([list(a) for a in t.top_p], [list(a) for a in t.top_q])
            expected_rows.append({
                "turn": str(i), "round": str(r.index), "mode": r.mode, "draft_len": str(r.draft_len),
                "drafted": str(r.drafted), "accepted": str(r.accepted), "emitted": str(len(r.tokens)),
                "draft_calls": str(r.draft_calls), "draft_ms": f"{r.draft_s * 1000:.3f}",
                "verify_ms": f"{r.verify_s * 1000:.3f}", "wall_ms": f"{r.wall_s * 1000:.3f}",
                "prefill_ms": f"{r.prefill_s * 1000:.3f}", "exact": str(r.exact), "stop_reason": r.stop_reason or "",
                "temperature": str(s.temperature), "top_k": str(s.top_k), "top_p": str(s.top_p),
                "text": "".join(t.text for t in r.tokens),
            })
    assert list(csv.DictReader(csv_path.open(newline=""))) == expected_rows
    assert expected_rows[0]["draft_ms"] == "6.000" and expected_rows[0]["stop_reason"] == "" and "\n" in expected_rows[3]["text"]
    assert b"\r" not in csv_path.read_bytes()  # rows end in "\n", as in the other two files


def test_a_round_without_its_sampling_settings_is_exported_with_them_empty(tmp_path):
    """session_data pads a turn's sampling list shorter than its rounds (Conversation._record keeps them in step
    today): those rounds say null in the JSON and leave the CSV's sampling columns empty, and the export is written."""
    session = FakeSession()
    list(session.reply("x"))
    session.turns[0].sampling.clear()
    json_path, csv_path = write_export(session, tmp_path / "s.json")
    data = json.loads(json_path.read_text())
    assert [r["sampling"] for r in data["turns"][0]["rounds"]] == [None] * len(session.turns[0].rounds)
    assert data["config"]["sampling_used"] == []
    rows = list(csv.DictReader(csv_path.open(newline="")))
    assert len(rows) == len(session.turns[0].rounds) and {(r["temperature"], r["top_k"], r["top_p"]) for r in rows} == {("", "", "")}


def test_the_configuration_says_what_ran(tmp_path):
    """The configuration block, key by key: models, engine, runner and kernel (their defaults when the session has
    none), device, rule, seed, and whether every round was exact; the creation time carries its time zone."""
    session = FakeSession(mode="lookup", k=3, draft_name="small-draft")
    list(session.reply("one"))
    data = session_data(session)
    config = {k: v for k, v in data["config"].items() if k != "hardware"}
    assert config == {
        "target": "fake-target", "draft": "small-draft", "engine": "torch", "device": "cpu", "dtype": "float32",
        "runner": "hf", "kernel": "torch", "server": None, "mode": "lookup", "draft_len": 3,
        "sampling": asdict(SamplingParams(0.0)), "acceptance_rule": "exact", "exact": True, "seed": 0,
        "max_new_tokens": 64, "modes_used": ["lookup"], "rounds_by_mode": {"lookup": len(session.turns[0].rounds)},
        "draft_lengths": [1, 3], "sampling_used": [asdict(SamplingParams(0.0))],
    }
    hardware = data["config"]["hardware"]  # a local session: the machine and the libraries that ran the models
    assert (hardware["device"], hardware["dtype"], hardware["torch"]) == ("cpu", "float32", torch.__version__)
    assert datetime.fromisoformat(data["created"]).utcoffset() == timedelta(0)

    session.info = dataclasses.replace(session.info, engine="llama.cpp", runner="lean", kernel="fused")
    session.turns[0].rounds[1].exact = False  # one round under an approximate rule: the session was not exact
    config = session_data(session)["config"]
    assert (config["engine"], config["runner"], config["kernel"], config["exact"]) == ("llama.cpp", "lean", "fused", False)

    fresh = FakeSession()
    fresh.controls.rule = LenientRule(0.5)  # no round yet: the rule in force says it
    config = session_data(fresh)["config"]
    assert (config["acceptance_rule"], config["exact"]) == ("approx:0.5", False)


def test_a_remote_session_exports_the_server_and_only_the_clients_machine(tmp_path):
    """A serving engine's session (its EngineInfo names the server): the server's configuration under its own key, and the client's
    machine without the torch keys of a local run (the models did not run here)."""
    session = FakeSession()
    server = Server(name="llama-server", url="http://127.0.0.1:8080", engine="llama-server", model="m", speculative="draft")
    session.info = dataclasses.replace(session.info, server=server)
    list(session.reply("hi"))
    config = session_data(session)["config"]
    assert config["server"] == asdict(server)
    assert "cpu" in config["hardware"] and "torch" not in config["hardware"] and "device" not in config["hardware"]


def test_a_turn_that_ended_before_its_first_round_is_exported_and_says_so(tmp_path):
    """The reply failed (or was stopped) before any round: the turn is in the export, with no rounds and that reason."""
    session = FakeSession(fail_at=0)
    with pytest.raises(RuntimeError):
        list(session.reply("hi"))
    turn = session_data(session)["turns"][0]
    assert (turn["user"], turn["rounds"], turn["stop_reason"]) == ("hi", [], "stopped before the first round")


def test_the_markdown_holds_the_settings_and_every_message(tmp_path):
    """The conversation as written beside the JSON: title, one line of settings (the draft, greedy or T), then each
    message under its role's title; a role the chat does not name itself gets its own name as the title."""
    session = FakeSession(mode="lookup", k=4, draft_name="small-draft")
    session.controls.sampling = SamplingParams(0.7)
    session.set_system("Be brief.")
    list(session.reply("hi"))
    json_path, _ = write_export(session, tmp_path / "s.json")
    created = json.loads(json_path.read_text())["created"]
    assert (tmp_path / "s.md").read_text() == (
        f"# specchat conversation, {created}\n\n*fake-target + small-draft · lookup {len(session.turns[0].rounds)} rounds · K=4 · T=0.7*\n\n"
        f"## System\n\nBe brief.\n\n## User\n\nhi\n\n## Assistant\n\n{REPLY_TEXT.strip()}\n")

    other = FakeSession(mode="off", k=2)  # greedy, no draft model
    other.restore([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a "}, {"role": "tool", "content": "42"}])
    json_path, _ = write_export(other, tmp_path / "o.json")
    created = json.loads(json_path.read_text())["created"]
    assert (tmp_path / "o.md").read_text() == (
        f"# specchat conversation, {created}\n\n*fake-target · mode off · K=2 · greedy*\n\n"
        "## User\n\nq\n\n## Assistant\n\na\n\n## Tool\n\n42\n")


def test_the_markdown_says_which_replies_stopped_before_their_end(tmp_path):
    """A reply stopped (Esc) or cut at max_new_tokens is marked under it, as the chat's status line marks it; a
    finished one, a resumed conversation's and a reply still streaming (no message yet) are not."""
    session = FakeSession()
    session.restore([{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "old reply"}])
    list(session.reply("cut"))
    list(session.reply("whole"))
    rounds = session.reply("stop me")
    next(rounds)
    rounds.close()
    streaming = session.reply("in flight")
    next(streaming)  # the export taken mid-reply: its turn is in the JSON, its message not yet written
    data = session_data(session)
    assert [t["stop_reason"] for t in data["turns"]] == ["eos", "eos", "stopped", "stopped"]
    data["turns"][0]["stop_reason"] = "max_new_tokens"  # what the engine says of a reply cut at the limit
    text = conversation_markdown(session, data)
    streaming.close()
    parts = text.split("## Assistant\n\n")[1:]
    assert len(parts) == 4 and "*(" not in parts[0] and "*(" not in parts[2]
    assert parts[1].endswith("*(stopped at max new tokens)*\n\n## User\n\nwhole\n\n")
    assert parts[3].endswith("*(stopped)*\n\n## User\n\nin flight\n")


def test_each_mode_summary_has_its_predicted_speedup(tmp_path):
    """Beside a mode's statistics, the speedup the session's own measurements predict (null without a plain step)."""
    session = FakeSession(mode="lookup", k=3)
    list(session.reply("one"))
    session.set_mode("off")
    list(session.reply("two"))
    modes = json.loads(write_export(session, tmp_path / "s.json")[0].read_text())["summary"]["modes"]
    predicted = session.snapshot().speedup("lookup").as_dict()
    assert modes["lookup"]["speedup_model"] == predicted and predicted["predicted_speedup"] > 1
    assert modes["off"]["speedup_model"] is None


# ---------------------------------------------------------------- save_export: a session is not lost to a bad path


@pytest.fixture
def exports(tmp_path, monkeypatch):
    """The user data folder's exports/ of this test's own."""
    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data" / "exports"


def saved_session():
    session = FakeSession()
    list(session.reply("keep me"))
    return session


def test_save_export_writes_where_asked_and_names_the_three_files(tmp_path, exports):
    line, saved = save_export(saved_session(), tmp_path / "s.json")
    assert (line, saved) == (f"session exported to {tmp_path / 's.json'}, {tmp_path / 's.csv'} and {tmp_path / 's.md'}", True)
    assert json.loads((tmp_path / "s.json").read_text())["turns"][0]["user"] == "keep me" and not exports.exists()


def test_an_export_to_a_bad_path_is_saved_in_the_data_folder_instead(tmp_path, exports):
    """The folder cannot be made (a file is in the way): the session goes to a timestamped file in exports/, and the
    line says why the first path failed and where the files are."""
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "sub" / "s.json"
    line, saved = save_export(saved_session(), bad)
    names = sorted(p.name for p in exports.iterdir())
    assert saved and len(names) == 3 and re.fullmatch(r"specchat-session-\d{8}-\d{6}\.csv", names[0]), names
    json_path = exports / names[1]
    assert names == [json_path.with_suffix(s).name for s in (".csv", ".json", ".md")]
    assert line == (f"could not write the export to {bad} (Not a directory); saved the session to {json_path}, "
                    f"{json_path.with_suffix('.csv')} and {json_path.with_suffix('.md')} instead")
    assert json.loads(json_path.read_text())["turns"][0]["user"] == "keep me"


def test_an_export_that_fails_with_any_error_is_still_saved_and_says_why(tmp_path, exports):
    """Not only an OSError: whatever the first write raised (here a path with a NUL byte), the session is saved
    in exports/ and the line names the error's type and message."""
    line, saved = save_export(saved_session(), tmp_path / "bad\0name.json")
    assert saved and "(ValueError: embedded null byte); saved the session to " in line
    assert sorted(p.suffix for p in exports.iterdir()) == [".csv", ".json", ".md"]


def test_an_export_that_cannot_be_written_anywhere_says_the_session_was_not_saved(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(tmp_path / "file" / "data"))  # the fallback's folder cannot be made either
    bad = tmp_path / "file" / "sub" / "s.json"
    line, saved = save_export(saved_session(), bad)
    assert not saved
    assert re.fullmatch(rf"could not write the export to {re.escape(str(bad))} \(Not a directory\) nor to "
                        rf"{re.escape(str(tmp_path / 'file' / 'data' / 'exports'))}/specchat-session-\d{{8}}-\d{{6}}\.json "
                        r"\(Not a directory\): the session was not saved", line), line


def test_an_export_whose_second_rename_fails_leaves_no_file_where_there_was_none(tmp_path, monkeypatch):
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(13, "Permission denied")
        real_replace(src, dst)

    session = FakeSession()
    list(session.reply("first"))
    monkeypatch.setattr(store.os, "replace", replace)
    with pytest.raises(OSError):
        write_export(session, tmp_path / "s.json")
    assert os.listdir(tmp_path) == []
