"""The typed options (cli/options.Options): built once per command from its click parameters, each command's
defaults from the one table (options.DEFAULTS) that its --help reads too, frozen, and refusing what click's types
cannot check in the same one line as before."""

from __future__ import annotations

import dataclasses

import pytest

from specchat.cli.bench import bench
from specchat.cli.generate import generate
from specchat.cli.main import main
from specchat.cli.options import DEFAULTS, BadOption, ModelOptions, ModeSettings, Options, UserError, local_options_given
from specchat.cli.train_head import train_head
from specchat.cli.tune import tune
from specchat.cli.verify import verify

COMMANDS = {"chat": (main, []), "generate": (generate, ["--prompt", "hi"]), "verify": (verify, []), "bench": (bench, []),
            "tune": (tune, ["--mode", "layerskip"]), "train-head": (train_head, [])}


def under_main():
    """A subcommand's context as the CLI builds it: under the group's, whose -h it inherits (click keeps a command's
    help option from its first context, and docs/cli.md shows `-h, --help`)."""
    return main.make_context("specchat", [], resilient_parsing=True)


def options(command: str, *args) -> Options:
    cmd, required = COMMANDS[command]
    return Options.from_click(command, cmd.make_context(command, [*required, *map(str, args)], parent=None if cmd is main else under_main()))


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_command_with_no_options_runs_with_its_row_of_the_table(command):
    d, o = DEFAULTS[command], options(command)
    assert o.command == command and o.mode == (d.mode or "off")
    assert (o.sampling.temperature, o.sampling.top_k, o.sampling.top_p) == (d.temperature, d.top_k, d.top_p)
    assert (o.seed, o.max_new_tokens, o.draft_len, o.models.engine) == (d.seed, d.max_new_tokens, d.draft_lens[0], d.engine)
    assert o.settings == ModeSettings() and o.servers == () and o.given <= {"prompt", "tune_mode"}  # the required ones


def test_the_commands_click_defaults_are_the_tables():
    """What each --help shows is what the command runs with: both read DEFAULTS."""
    for command in ("chat", "generate", "verify"):
        d = DEFAULTS[command]
        shown = {p.name: p.default for p in COMMANDS[command][0].params}
        assert (shown["mode"], shown["draft_len"], shown["temperature"], shown["top_k"], shown["top_p"], shown["seed"],
                shown["max_new_tokens"]) == (d.mode, "auto" if d.measured_k else d.draft_lens[0], d.temperature, d.top_k,
                                             d.top_p, d.seed, d.max_new_tokens)
    assert DEFAULTS["chat"].measured_k and DEFAULTS["generate"].measured_k and not DEFAULTS["verify"].measured_k
    shown = {p.name: p.default for p in bench.params}
    assert shown["draft_lens"] == "2,4,8,auto" and shown["temperatures"] == "0" and DEFAULTS["bench"].measured_k
    assert (shown["seed"], shown["max_new_tokens"]) == (DEFAULTS["bench"].seed, DEFAULTS["bench"].max_new_tokens)
    shown = {p.name: p.default for p in tune.params}
    assert (shown["seed"], shown["max_new_tokens"]) == (DEFAULTS["tune"].seed, DEFAULTS["tune"].max_new_tokens)
    assert {p.name: p.default for p in train_head.params}["seed"] == DEFAULTS["train-head"].seed
    assert {p.name: p.default for p in main.params}["engine"] == ModelOptions().engine  # --server compares against these


def test_the_chat_samples_and_runs_auto_and_what_the_user_says_wins():
    o = options("chat")
    assert (o.mode, o.sampling.temperature, o.sampling.top_p) == ("auto", 0.7, 0.9)
    o = options("chat", "--temperature", "0", "--mode", "lookup")
    assert (o.mode, o.sampling.temperature, o.sampling.top_p) == ("lookup", 0.0, 0.9)


def test_elsewhere_the_mode_is_draft_with_a_draft_model_else_off():
    assert options("generate").mode == "off" and options("generate", "--draft", "d").mode == "draft"
    assert options("generate", "--draft", "d", "--mode", "lookup").mode == "lookup"
    assert options("bench", "--draft", "d").mode == "draft"
    assert options("tune").mode == "off"  # tune's --mode is the mode it tunes, not the session's


def test_verify_takes_temperature_0_as_its_default_and_keeps_any_other():
    assert options("verify", "--temperature", "0").sampling.temperature == 1.0
    assert options("verify", "--temperature", "0.5").sampling.temperature == 0.5
    assert options("generate", "--temperature", "0").sampling.greedy


def test_tune_and_train_head_run_a_plain_greedy_session_on_torch_with_their_own_seed_and_length():
    o = options("tune", "--tokens", "20", "--seed", "3")
    assert (o.mode, o.sampling.greedy, o.models.engine, o.models.draft) == ("off", True, "torch", None)
    assert (o.max_new_tokens, o.seed) == (20, 3)
    assert options("train-head", "--seed", "5").seed == 5 and options("train-head").max_new_tokens == 16


def test_options_are_frozen_and_hashable():
    o = options("generate", "--skip-layers", "1,2")
    for obj, name in ((o, "mode"), (o.models, "target"), (o.settings, "skip_layers"), (o.sampling, "temperature")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, None)
    assert hash(o) == hash(options("generate", "--skip-layers", "1,2"))


def test_given_names_what_the_user_set_even_at_its_default():
    assert options("generate", "-k", "4").given == {"prompt", "draft_len"}
    assert "mode" in options("chat", "--mode", "auto").given and "mode" not in options("chat").given


def test_mode_settings_are_parsed_once_into_a_drafters_options(tmp_path):
    head = tmp_path / "h.safetensors"
    head.write_bytes(b"")
    o = options("generate", "--skip-layers", "3, 5,", "--rank", "0.25", "--exit-layer", "2", "--head", head, "--draft-vocab", "9")
    assert o.settings == ModeSettings(skip_layers=(3, 5), exit_layer=2, rank=0.25, head_file=str(head), draft_vocab=9)
    assert o.settings.drafter_options() == {"skip_layers": [3, 5], "exit_layer": 2, "rank": 0.25, "head_file": str(head),
                                            "draft_vocab": 9}
    assert options("generate", "--rank", "8").settings.rank == 8 and isinstance(options("generate", "--rank", "8").settings.rank, int)
    assert ModeSettings().drafter_options() == {}


@pytest.mark.parametrize("args, error, message", [
    (["--skip-layers", "a,b"], BadOption, "--skip-layers must be comma-separated layer numbers, got 'a,b'"),
    (["--rank", "x"], BadOption, "--rank must be a fraction or an integer, got 'x'"),
    (["--head", "missing.safetensors"], UserError, "--head missing.safetensors: no such file"),
    (["--server", "=http://x"], BadOption, "--server =http://x: expected URL or NAME=URL"),
    (["--server", "a=http://x", "--server", "http://y"], BadOption, "--server: name each of several servers, as NAME=URL"),
])
def test_values_click_cannot_check_are_refused_when_the_options_are_built(args, error, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error) as caught:
        options("generate", *args)
    assert caught.value.format_message() == message and caught.value.exit_code == (2 if error is BadOption else 1)


def test_servers_are_parsed_into_names_and_urls():
    assert options("generate", "--server", "http://x:1").servers == ((None, "http://x:1"),)
    assert options("bench", "--server", "a=http://x", "--server", "b = http://y").servers == (("a", "http://x"), ("b", "http://y"))


def test_with_a_server_the_local_options_set_are_named_by_their_flags():
    assert local_options_given(options("generate", "--server", "http://x", "--device", "auto")) == []  # the default: no effect
    given = local_options_given(options("generate", "--server", "http://x", "--target", "t.gguf", "--accept", "approx:0.5",
                                        "--exit-layer", "2"))
    assert given == ["--target", "--accept", "--exit-layer"]


def test_from_click_reads_the_running_commands_context_and_needs_one():
    with generate.make_context("generate", ["--prompt", "hi", "--seed", "7"], parent=under_main()):  # as inside the command
        assert Options.from_click("generate").seed == 7
    with pytest.raises(RuntimeError, match="no active click context"):  # click's: no command is running
        Options.from_click("generate")
