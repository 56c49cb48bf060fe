"""What a new user met (issue 27): the chat's defaults, one-line answers to wrong options before any model
loads, and an export that could not be written anywhere ending in failure."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from specchat.cli import main as cli_main
from specchat.engine.drafters.auto import CANDIDATES
from specchat.modes import MODES


def invoke(*args):
    return CliRunner().invoke(cli_main.main, [str(a) for a in args])


@pytest.fixture
def captured(monkeypatch):
    """The chat's options as load_session receives them, without loading a model or starting the app."""
    seen = {}

    def fake_load(options, **kw):
        seen.update(temperature=options.sampling.temperature, top_p=options.sampling.top_p, mode=options.mode)
        raise SystemExit(0)

    monkeypatch.setattr(cli_main, "load_session", fake_load)
    monkeypatch.setattr("specchat.tui.app.run_chat", lambda load, **kw: load())  # the chat loads in the app's thread
    return seen


def test_the_chat_samples_by_default_and_generate_stays_greedy(captured):
    assert invoke().exit_code == 0
    assert (captured["temperature"], captured["top_p"], captured["mode"]) == (0.7, 0.9, "auto")
    captured.clear()
    assert invoke("--temperature", "0").exit_code == 0
    assert (captured["temperature"], captured["top_p"]) == (0.0, 0.9)  # what the user says wins
    from specchat.cli.options import generation_options

    defaults = {p.name: p.default for p in generation_options("generate")(lambda **kw: None).__click_params__}
    assert (defaults["temperature"], defaults["top_p"]) == (0.0, 1.0)  # generate and bench: greedy
    from specchat.cli.bench import bench

    assert {p.name: p.default for p in bench.params}["temperatures"] == "0"


def test_auto_is_described_with_every_candidate():
    for candidate in CANDIDATES:
        assert candidate in MODES["auto"], candidate


def test_a_wrong_theme_is_refused_before_any_model_loads_with_the_choices(captured):
    r = invoke("--theme", "nosuch")
    assert r.exit_code == 2 and not captured
    assert "no such theme" in r.output and "colorblind" in r.output and "nord" in r.output


def test_a_head_that_is_not_a_head_says_so(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("hello")
    r = invoke("generate", "--prompt", "hi", "--mode", "head", "--head", readme)
    assert r.exit_code == 1 and "not a draft head" in r.output
    r = invoke("generate", "--prompt", "hi", "--mode", "head", "--head", tmp_path / "missing.safetensors")
    assert r.exit_code == 1 and "no such file" in r.output


def test_an_export_written_nowhere_ends_in_failure(monkeypatch, tmp_path, capsys):
    from specchat import export
    from specchat.tui import app as tui_app

    class NoApp:
        def __init__(self, session, **kw):
            self.session, self.load_error, self.loader = session, None, None

        def run(self):
            pass

    def fail(session, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tui_app, "SpecChatApp", NoApp)
    monkeypatch.setattr(export, "write_export", fail)
    with pytest.raises(SystemExit) as exit_info:
        tui_app.run_chat(object(), export_path=tmp_path / "x.json", conversation=object())
    assert exit_info.value.code == 1
    assert "the session was not saved" in capsys.readouterr().err


def test_an_export_names_all_three_files(tmp_path):
    from support.fakes import FakeSession
    from specchat.export import save_export

    session = FakeSession()
    list(session.reply("hi"))
    line, saved = save_export(session, tmp_path / "s.json")
    assert saved and "s.json" in line and "s.csv" in line and "s.md" in line


def test_a_draft_with_another_tokenizer_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    from support.models import tiny_model_dir
    from specchat import models

    def no_loading(*a, **kw):
        raise AssertionError("a model was loaded before the vocabularies were compared")

    monkeypatch.setattr(models, "load_model", no_loading)
    r = invoke("generate", "--prompt", "hi", "--draft", tiny_model_dir(tmp_path / "tiny"))
    assert r.exit_code == 1 and "have different tokenizers" in r.output and "Traceback" not in r.output
