"""A first start that asks before it writes gigabytes (issue 54, item 2): a start on torch that would convert more
than models.CONSENT_BYTES of GGUF into the user cache needs --yes or the user's yes (generate: [y/N] on a
terminal, else exit status 2 naming --yes; the chat: a dialog), and `specchat cache` lists and removes what the
cache holds, never anything outside it. A tiny GGUF (a fraction of a second to convert) with the threshold lowered
stands in for a 1.5B pair; every test has a cache folder of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from support.models import tiny_llama
from support.fakes import FakeSession
from support.gguf import write_gguf
from support.process import run_env
from specchat import models, usercache
from specchat.cli import options
from specchat.cli.main import main
from specchat.cli.options import Declined, ModelOptions, load_models
from specchat.tui.app import SpecChatApp
from specchat.tui.consent import ConsentScreen
from test_tui import wait_for

SIZE = (120, 40)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache folder of this test's own; the tests' shared one (the default model's conversion) is left alone.
    The small-batch kernel is already loaded (conftest), so nothing compiles into it."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    """A tiny float32 GGUF transformers converts; any conversion counts as a big one (the threshold lowered)."""
    path = write_gguf(tiny_llama(0), tmp_path / "tiny.gguf", readable=True)
    monkeypatch.setattr(models, "CONSENT_BYTES", 1000)
    return path


def invoke(*args, **kwargs):
    return CliRunner().invoke(main, [str(a) for a in args], **kwargs)


def generate(gguf, *extra, **kwargs):
    return invoke("generate", "--prompt", "ab", "--raw", "--engine", "torch", "--device", "cpu", "--target", gguf,
                  "--max-new-tokens", "2", *extra, **kwargs)


def written(cache) -> list[str]:
    """What the cache holds but the content keys' memo (64 bytes per file hashed, written by the size estimate)."""
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file() and ".keys" not in p.parts)


# ---------------------------------------------------------------- the estimate


def test_the_estimate_is_what_the_conversion_writes_and_zero_once_done(cache, gguf):
    estimate = models.conversion_bytes(gguf)
    assert estimate == gguf.stat().st_size  # F32 stored as float32: the file's size (its header counted as weights)
    out = models.convert_gguf(gguf)
    weights = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert 0.8 * estimate <= weights <= 1.2 * estimate
    assert models.conversion_bytes(gguf) == 0


def test_the_threshold_is_a_gigabyte():
    assert models.CONSENT_BYTES == 1e9


# ---------------------------------------------------------------- generate


def test_generate_refuses_a_big_first_start_without_yes_and_writes_nothing(cache, gguf, keep_threads):
    r = generate(gguf)
    lines = r.output.strip().splitlines()
    size = f"{models.conversion_bytes(gguf) / 1e3:.1f} kB"
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert lines[0].startswith("Error: ") and "--yes" in lines[0] and size in lines[0] and "tiny.gguf" in lines[0]
    assert written(cache) == [] and not models.converted_dir(gguf).exists()


def test_generate_with_yes_converts_and_records_where_from(cache, gguf, keep_threads):
    r = generate(gguf, "--yes")
    assert r.exit_code == 0, r.output
    assert (models.converted_dir(gguf) / "config.json").is_file()
    record = json.loads(usercache.source_record(models.converted_dir(gguf).name).read_text())
    assert [s["path"] for s in record["sources"]] == [str(gguf.resolve())]
    assert record["sha256"] == usercache.content_key(gguf)
    assert generate(gguf).exit_code == 0  # converted: nothing more to write, nothing to ask


def test_generate_below_the_threshold_does_not_ask(cache, gguf, keep_threads, monkeypatch):
    monkeypatch.setattr(models, "CONSENT_BYTES", models.conversion_bytes(gguf))  # "more than": exactly it passes
    assert generate(gguf).exit_code == 0


@pytest.mark.parametrize("answer", ["n", "y"])
def test_generate_asks_on_a_terminal(answer, cache, gguf, keep_threads, monkeypatch):
    monkeypatch.setattr(options, "can_ask_on_terminal", lambda: True)
    r = generate(gguf, input=f"{answer}\n")
    assert "Go ahead? [y/N]" in r.output and "tiny.gguf" in r.output
    if answer == "n":
        assert r.exit_code == 1 and r.output.strip().splitlines()[-1].startswith("specchat: declined: nothing converted"), r.output
        assert written(cache) == []
    else:
        assert r.exit_code == 0 and (models.converted_dir(gguf) / "config.json").is_file(), r.output


def test_the_estimate_adds_target_and_draft_and_counts_one_content_once(cache, gguf, monkeypatch, tmp_path):
    """--target and --draft naming the same content convert it once; two files, twice."""
    other = write_gguf(tiny_llama(1), tmp_path / "other.gguf", readable=True)
    monkeypatch.setattr(models, "CONSENT_BYTES", models.conversion_bytes(gguf) * 1.5)
    (tmp_path / "elsewhere").mkdir()
    copy = tmp_path / "elsewhere" / gguf.name  # another path, the same name and bytes: the same conversion
    copy.write_bytes(gguf.read_bytes())
    options.ask_before_writing(False, None, [gguf, copy])  # one conversion, under the threshold: no question
    with pytest.raises(options.BadOption, match="converts tiny.gguf and other.gguf once.*--yes"):
        options.ask_before_writing(False, None, [gguf, other])


# ---------------------------------------------------------------- the chat


def chat_load(gguf, **extra):
    models = ModelOptions(target=str(gguf), device="cpu", engine="torch", **extra)

    def load(progress):
        load_models(models, progress)
        return FakeSession()

    return load


@pytest.mark.asyncio
async def test_the_chat_asks_and_yes_converts(cache, gguf, keep_threads):
    app = SpecChatApp(load=chat_load(gguf))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ConsentScreen), timeout=30)
        question = str(app.screen.query_one("#consent-question").render())
        assert "Converting tiny.gguf" in question and "kB into the user cache" in question and "Go ahead?" in question
        await pilot.pause(0.2)
        assert app.session is None and not models.converted_dir(gguf).exists()  # nothing while it asks
        await pilot.press("y")
        await wait_for(pilot, lambda: app.session is not None, timeout=30)
    assert (models.converted_dir(gguf) / "config.json").is_file() and app.load_error is None


@pytest.mark.asyncio
@pytest.mark.parametrize("key", ["n", "escape", "enter"])  # Enter: the focused button is "Quit"
async def test_the_chat_asks_and_no_ends_it_writing_nothing(key, cache, gguf, keep_threads):
    app = SpecChatApp(load=chat_load(gguf))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ConsentScreen), timeout=30)
        await pilot.press(key)
        await wait_for(pilot, lambda: app.return_code is not None, timeout=30)
    assert app.return_code == 1 and isinstance(app.load_error, Declined) and app.session is None
    assert app.load_error.exit_code == 1 and "nothing converted" in str(app.load_error)
    assert written(cache) == []


@pytest.mark.asyncio
async def test_the_chat_with_yes_does_not_ask(cache, gguf, keep_threads):
    app = SpecChatApp(load=chat_load(gguf, yes=True))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.session is not None or isinstance(app.screen, ConsentScreen), timeout=30)
        assert not isinstance(app.screen, ConsentScreen)
    assert (models.converted_dir(gguf) / "config.json").is_file()


def test_the_chat_takes_yes():
    assert any(p.name == "yes" and "-y" in p.opts for p in main.params)


# ---------------------------------------------------------------- specchat cache


def fill(cache, tmp_path):
    """A cache as a user's: a conversion and its tokenizer from a file that is still there, a requantised copy from
    one since removed, an old conversion of unknown source, kernels; and things specchat did not write."""
    models_dir = cache / "models"
    here, gone = tmp_path / "here.gguf", tmp_path / "gone.gguf"
    here.write_bytes(b"GGUF here" * 100)
    gone.write_bytes(b"GGUF gone" * 100)
    names = {}
    for path in (here, gone):
        names[path.stem] = f"{path.stem}-{usercache.content_key(path)[:12]}"
    conv = models_dir / names["here"]
    conv.mkdir(parents=True)
    (conv / "config.json").write_text("{}")
    (conv / "model.safetensors").write_bytes(b"\0" * 5000)
    (models_dir / f"{names['here']}-tokenizer").mkdir()
    (models_dir / f"{names['here']}-tokenizer" / "tokenizer_config.json").write_text("{}")
    usercache.record_source(names["here"], here)
    (models_dir / f"{names['gone']}.Q2_K.gguf").write_bytes(b"\0" * 3000)
    usercache.record_source(names["gone"], gone)
    gone.unlink()
    old = models_dir / "old-model-0123456789ab"
    old.mkdir()
    (old / "config.json").write_text("{}")
    (cache / "kernels").mkdir()
    (cache / "kernels" / "smallbatch-x.so").write_bytes(b"\0" * 100)
    (cache / "notes.txt").write_text("mine")  # not specchat's
    (models_dir / "my-own-model").mkdir()  # not specchat's name pattern
    return names, here


def test_the_cache_is_listed_with_sizes_sources_and_what_is_stale(cache, tmp_path):
    names, here = fill(cache, tmp_path)
    r = invoke("cache")
    assert r.exit_code == 0, r.output
    out = r.output
    assert out.splitlines()[0].startswith(f"{cache}: 5 entries, ")
    for name in (names["here"], f"{names['here']}-tokenizer", f"{names['gone']}.Q2_K.gguf", "old-model-0123456789ab", "kernels"):
        assert f"  {name} " in out, name
    assert f"from {here.resolve()}" in out and "source unknown" in out and "stale: no longer at" in out
    assert "5.0 kB" in out and "3.0 kB" in out  # sizes
    assert out.count("STALE") == 1 and "--stale removes the 1 stale (3.0 kB)" in out
    assert "notes.txt" not in out and "my-own-model" not in out and ".source.json" not in out
    assert time.strftime("%Y-%m-%d") in out  # last used


def test_a_changed_source_makes_its_entries_stale(cache, tmp_path):
    names, here = fill(cache, tmp_path)
    assert not any(e.stale for e in usercache.entries() if e.name.startswith(names["here"]))
    here.write_bytes(b"GGUF HERE" * 100)  # same size, other bytes
    stat = here.stat()
    os.utime(here, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert [e.name for e in usercache.entries() if e.stale] == sorted(
        [names["here"], f"{names['here']}-tokenizer", f"{names['gone']}.Q2_K.gguf"])


def test_remove_by_name_stale_and_all(cache, tmp_path):
    names, here = fill(cache, tmp_path)
    r = invoke("cache", "--remove", "kernels")
    assert r.exit_code == 0 and "removed kernels (100 B)" in r.output, r.output
    assert not (cache / "kernels").exists()

    r = invoke("cache", "--stale")
    assert r.exit_code == 0 and f"removed {names['gone']}.Q2_K.gguf" in r.output, r.output
    assert not (cache / "models" / f"{names['gone']}.Q2_K.gguf").exists()
    assert not usercache.source_record(names["gone"]).exists()  # its record went with its last entry
    assert (cache / "models" / names["here"]).is_dir() and (cache / "models" / "old-model-0123456789ab").is_dir()

    r = invoke("cache", "--remove", names["here"])
    assert r.exit_code == 0 and usercache.source_record(names["here"]).exists()  # the tokenizer still uses it
    r = invoke("cache", "--all")
    assert r.exit_code == 0 and "freed" in r.output, r.output
    assert usercache.entries() == [] and not usercache.source_record(names["here"]).exists()
    assert (cache / "notes.txt").read_text() == "mine" and (cache / "models" / "my-own-model").is_dir()
    assert here.is_file()  # the source file is the user's
    assert "holds nothing of specchat's" in invoke("cache").output


@pytest.mark.parametrize("name", ["no-such-entry", "../notes.txt", "NOTES", "/etc/passwd", "models", "..", ".keys",
                                  "my-own-model", "{outside}"])
def test_unknown_names_and_paths_are_refused_and_nothing_is_removed(name, cache, tmp_path):
    names, _ = fill(cache, tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    before = sorted(p for p in tmp_path.rglob("*"))
    r = invoke("cache", "--remove", "kernels", "--remove", name.format(outside=outside))
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), r.output
    assert sorted(p for p in tmp_path.rglob("*")) == before  # not even the valid name before it


def test_an_entry_that_is_a_link_is_unlinked_not_followed(cache, tmp_path):
    """A model entry pointing elsewhere (a user's symlink): removing it removes the link, never what it points at."""
    fill(cache, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text("{}")
    link = cache / "models" / "linked-model-abcdefabcdef"
    link.symlink_to(elsewhere, target_is_directory=True)
    inner = cache / "models" / "old-model-0123456789ab" / "weights"
    inner.symlink_to(elsewhere / "config.json")  # a link inside a removed folder
    assert "linked-model-abcdefabcdef" in invoke("cache").output
    assert invoke("cache", "--remove", "linked-model-abcdefabcdef").exit_code == 0
    assert invoke("cache", "--remove", "old-model-0123456789ab").exit_code == 0
    assert not link.exists() and not link.is_symlink() and (elsewhere / "config.json").read_text() == "{}"


def test_remove_refuses_an_entry_outside_the_cache(cache, tmp_path):
    """The last guard: an Entry whose path lies outside the cache folder is never deleted."""
    outside = tmp_path / "outside-model-0123456789ab"
    outside.mkdir()
    entry = usercache.Entry(outside.name, outside, "torch conversion", 0, 0.0, None, "unknown", False)
    with pytest.raises(usercache.UnknownEntry):
        usercache.remove(entry)
    assert outside.is_dir()


def test_options_that_do_not_go_together(cache):
    r = invoke("cache", "--all", "--stale")
    assert r.exit_code == 2 and r.output.strip().startswith("Error: give one of"), r.output


@pytest.mark.parametrize("args", [["cache", "--help"], ["cache"]], ids=str)
def test_the_cache_command_does_not_import_torch(args, cache, tmp_path):
    code = (f"import sys\nfrom specchat.cli.main import main\ntry:\n    main({args!r}, prog_name='specchat')\n"
            "except SystemExit:\n    pass\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)\n")
    fill(cache, tmp_path)
    env = run_env(SPECCHAT_CACHE_DIR=str(cache))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.stderr.strip().splitlines()[-1] == "NO-TORCH", r.stderr
    assert ("List what the user cache holds" if "--help" in args else "entries") in r.stdout, r.stdout
