"""docs/cli.md and docs/keys.md are what scripts/gen_docs.py writes from the code now: an option, command or key
added without rerunning the generator fails here, so the reference cannot drift from `specchat --help` and F1."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import click

from specchat.cli.generate import generate
from specchat.tui.keys import ACTION_KEYS, key_label

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_docs.py"
REGENERATE = "stale: run `python scripts/gen_docs.py` and commit the result"


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_docs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_docs = load_generator()


def test_the_docs_are_what_the_generator_writes():
    assert gen_docs.stale_files(ROOT) == [], REGENERATE


def test_a_new_option_makes_cli_md_stale(monkeypatch, capsys):
    fake = click.Option(["--fake-option"], help="An option nobody documented.")
    monkeypatch.setattr(generate, "params", [*generate.params, fake])
    assert "| `--fake-option TEXT` |  | An option nobody documented. |" in gen_docs.cli_markdown()
    assert gen_docs.stale_files(ROOT) == ["docs/cli.md"]
    assert gen_docs.main(["--check"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "docs/cli.md" in err[0] and "keys.md" not in err[0]


def test_a_new_key_makes_keys_md_stale(monkeypatch):
    monkeypatch.setitem(ACTION_KEYS, "fake", ("ctrl+g", "fake", "an action nobody documented"))
    assert "| `^g` | an action nobody documented |" in gen_docs.keys_markdown()
    assert gen_docs.stale_files(ROOT) == ["docs/keys.md"]


def test_writing_then_a_hand_edit(monkeypatch, tmp_path, capsys):
    """A fresh checkout's files written, then one edited by hand: --check names that one."""
    monkeypatch.setattr(gen_docs, "ROOT", tmp_path)
    assert gen_docs.main([]) == 0
    assert gen_docs.main(["--check"]) == 0
    keys = tmp_path / "docs" / "keys.md"
    keys.write_text(keys.read_text(encoding="utf-8") + "\nA hand-written note.\n", encoding="utf-8")
    capsys.readouterr()
    assert gen_docs.main(["--check"]) == 1
    assert capsys.readouterr().err.startswith("docs/keys.md: stale")


def test_every_key_the_app_binds_is_in_keys_md():
    """keys.md is read from the F1 table; the app binds its keys from keys.py: the two agree on every key."""
    from specchat.modes import MODES
    from specchat.tui.app import SpecChatApp

    text = (ROOT / "docs" / "keys.md").read_text(encoding="utf-8")
    documented = {key for line in text.splitlines() if line.startswith("| `") for key in line.split("`")[1].split()}
    bound = [binding for binding in SpecChatApp.BINDINGS if not binding.action.startswith("mode_key")]
    bound += SpecChatApp.BINDINGS[:len(MODES)]  # F2..: only the keys a mode is on
    missing = {key_label(key) for binding in bound for key in binding.key.split(",")} - documented
    assert not missing, f"bound but not in docs/keys.md: {sorted(missing)}"


def test_the_check_runs_without_torch():
    """As `specchat --help`: the generator imports the command modules, which load torch only when a command runs."""
    code = ("import sys; sys.path.insert(0, 'scripts'); import gen_docs; "
            "code = gen_docs.main(['--check']); print(code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["0", "False"], done.stdout + done.stderr
