"""--engine auto on a GGUF file (choose_engine.py): which files the lean engine reads, from the header alone; the
engine whose step + verify was smaller wins; a measurement is remembered per file, CPU, threads and build, a failed
one is not; and the real child measures the default model on both engines."""

from __future__ import annotations

import json

import pytest
import torch

from specchat import choose_engine
from specchat.choose_engine import Choice, decide
from specchat.engine.gguf_model import header_problem
from specchat.models import default_gguf
from support.gguf import write_gguf
from support.models import tiny_llama


def test_the_lean_engine_reads_the_default_model_and_says_why_it_does_not_read_another_file(tmp_path):
    assert header_problem(default_gguf()) is None
    path = write_gguf(tiny_llama(0), tmp_path / "tiny.gguf")
    assert header_problem(path) is None  # float32 matrices: read too
    other = tmp_path / "other.gguf"  # the same file calling itself another architecture
    other.write_bytes(path.read_bytes().replace(b"general.architecture\x08\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00llama",
                                                 b"general.architecture\x08\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00gemma"))
    assert header_problem(other) == "a gemma model"
    assert header_problem(tmp_path / "missing.gguf") is not None


def test_the_engine_with_the_smaller_step_and_verify_wins_and_the_reason_gives_both():
    choice = decide({"lean": [3.8, 7.5], "llama.cpp": [4.9, 16.6]})
    assert choice.engine == "lean" and "3.8" in choice.reason and "16.6" in choice.reason and choice.measured
    assert decide({"lean": [9.0, 12.0], "llama.cpp": [4.9, 15.0]}).engine == "llama.cpp"  # 21 against 19.9


def test_a_measurement_is_remembered_and_a_failed_one_is_not(tmp_path, monkeypatch):
    monkeypatch.setattr(choose_engine, "choice_path", lambda path, threads: tmp_path / f"{path.name}-{threads}.json")
    calls = []

    def fake_child(path, threads):
        calls.append(path)
        return Choice("llama.cpp", "could not be compared", measured=False) if "broken" in path.name else decide(
            {"lean": [1.0, 2.0], "llama.cpp": [2.0, 4.0]})

    monkeypatch.setattr(choose_engine, "measure_in_child", fake_child)
    choose_engine.choose.cache_clear()
    good, broken = tmp_path / "good.gguf", tmp_path / "broken.gguf"
    assert choose_engine.choose(good, "2").engine == "lean" and choose_engine.made(good).engine == "lean"
    assert json.loads((tmp_path / "good.gguf-2.json").read_text())["engine"] == "lean"
    assert choose_engine.choose(broken, "2").engine == "llama.cpp" and not (tmp_path / "broken.gguf-2.json").exists()
    choose_engine.choose.cache_clear()  # a later start: the good file's choice is read, the broken one measured again
    choose_engine.choose(good, "2"), choose_engine.choose(broken, "2")
    assert calls == [good, broken, broken]
    assert choose_engine.known(good, "2") and not choose_engine.known(good, "1")
    choose_engine.choose.cache_clear()


def test_auto_asks_the_measurement_for_a_file_both_engines_run(monkeypatch):
    from specchat.engine import llamacpp
    from specchat.models import pick_engine

    if not llamacpp.available():
        pytest.skip("llama-cpp-python is not installed")
    asked = []
    monkeypatch.setattr(choose_engine, "choose", lambda path, threads: asked.append(path) or Choice("lean", "measured"))
    assert pick_engine("auto", None, torch.device("cpu")) == "lean" and asked == [default_gguf()]
    assert pick_engine("llama.cpp", None, torch.device("cpu")) == "llama.cpp" and len(asked) == 1  # asked for: no measuring


@pytest.mark.slow
def test_the_child_measures_the_default_model_on_both_engines():
    from specchat.engine import llamacpp

    if not llamacpp.available():
        pytest.skip("llama-cpp-python is not installed")
    choice = choose_engine.measure_in_child(default_gguf(), "2")
    assert choice.measured, choice.reason
    assert choice.engine in ("lean", "llama.cpp") and "a verify of 5 positions" in choice.reason
