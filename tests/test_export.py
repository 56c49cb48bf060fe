"""Session export: contents, atomic writes, and partial replies."""

from __future__ import annotations

import csv
import json
import os

import pytest

from specchat import store
from specchat.export import CSV_COLUMNS, export_paths, session_data, write_export
from specchat.store import write_atomic
from helpers import REPLY, FakeSession


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


@pytest.mark.parametrize("fail", ["write", "rename"])
def test_an_export_that_fails_leaves_the_previous_export_intact_and_no_stray_files(tmp_path, monkeypatch, fail):
    """write_export's own path: the disk fills while the CSV is written, or the first rename fails: the previous
    JSON, CSV and Markdown are byte for byte what they were, and nothing else is left in the folder."""
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
        def no_rename(src, dst):
            raise OSError(13, "Permission denied")

        monkeypatch.setattr(store.os, "replace", no_rename)
    with pytest.raises(OSError):
        write_export(second, tmp_path / "s.json")
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert after == before
