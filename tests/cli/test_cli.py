"""The command line through click's CliRunner, on the real default model: every command and every bad input."""

import gc
import json

import pytest
from click.testing import CliRunner

from specchat.cli.main import main
from specchat.models import resolve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_dir():
    return resolve(None)[1]  # the converted default model: a plain directory, usable as --draft


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_generate_text_streams_with_legend_and_summary(default_dir):
    r = invoke("generate", "--prompt", "Write a haiku about rain", "--draft", default_dir, "--max-new-tokens", 12, "--dtype", "float32")
    assert r.exit_code == 0, r.output
    assert "draft accepted" in r.output and "resampled" in r.output  # the legend
    assert "acceptance" in r.output and "tok/s" in r.output and "stop: max_new_tokens" in r.output


def test_generate_json_lines(default_dir):
    r = invoke("generate", "--prompt", "Hello", "--draft", default_dir, "--format", "json", "--max-new-tokens", 10, "--seed", 3, "--temperature", 0.8, "--top-p", 0.9)
    assert r.exit_code == 0, r.output
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    tokens, summary = lines[:-1], lines[-1]
    assert len(tokens) == 10 and all(t["type"] == "token" and t["kind"] in {"accepted", "resampled", "bonus", "target"} for t in tokens)
    assert set(tokens[0]) == {"type", "id", "text", "kind", "round"}
    for key in ("target", "draft", "mode", "draft_len", "temperature", "top_k", "top_p", "seed", "device", "dtype", "exact",
                "prompt_tokens", "new_tokens", "stop_reason", "acceptance_rate", "mean_accepted_length", "target_calls_per_token",
                "draft_calls_per_token", "per_position_acceptance", "tokens_per_s", "ms_per_token", "time_to_first_token_s"):
        assert key in summary, key
    assert summary["mode"] == "draft" and summary["seed"] == 3 and summary["exact"] is True and summary["new_tokens"] == 10
    again = invoke("generate", "--prompt", "Hello", "--draft", default_dir, "--format", "json", "--max-new-tokens", 10, "--seed", 3, "--temperature", 0.8, "--top-p", 0.9)
    assert [json.loads(x)["id"] for x in again.stdout.splitlines()[:-1]] == [t["id"] for t in tokens]  # the seed reproduces
    other = invoke("generate", "--prompt", "Hello", "--draft", default_dir, "--format", "json", "--max-new-tokens", 10, "--seed", 4, "--temperature", 0.8, "--top-p", 0.9)
    assert [json.loads(x)["id"] for x in other.stdout.splitlines()[:-1]] != [t["id"] for t in tokens]  # and is used


def test_generate_raw_plain_mode():
    r = invoke("generate", "--prompt", "The capital of France is", "--raw", "--format", "json", "--max-new-tokens", 5)
    summary = json.loads(r.stdout.splitlines()[-1])
    assert r.exit_code == 0 and summary["mode"] == "off" and summary["target_calls_per_token"] == 1.0
    assert summary["prompt_tokens"] == 5  # no chat template around it


def test_a_loaded_session_is_out_of_the_cyclic_collectors_reach():
    """options.load_session freezes what it loaded: a full collection would otherwise scan it mid-reply."""
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    r = invoke("generate", "--prompt", "Hi", "--raw", "--max-new-tokens", 2)
    assert r.exit_code == 0, r.output
    assert gc.get_freeze_count() > 100_000  # torch, transformers and the model


def test_verify_lookup_drafts_on_its_default_prompt():
    """Lookup's default conversation repeats a sentence, so it drafts all K positions from the first round."""
    r = invoke("verify", "--mode", "lookup", "-n", 40, "--seed", 0, "--format", "json")
    report = json.loads(r.stdout)
    assert r.exit_code == 0 and report["verdict"] == "pass", r.output
    assert report["max_drafted"] == 4 and report["drafted_per_position"][3] >= 40 and report["prompt"] is None


def test_no_subcommand_starts_the_chat_or_says_why(monkeypatch):
    import specchat.tui.app as app  # noqa: F401 - fails loudly once the TUI exists but breaks

    monkeypatch.setattr(app, "run_chat", lambda session=None, load=None, **kw: print("CHAT", (session or load()).mode))
    r = invoke("--max-new-tokens", 4)
    assert r.exit_code == 0 and "CHAT auto" in r.output  # the chat's default mode
    r = invoke("--max-new-tokens", 4, "--mode", "off")
    assert r.exit_code == 0 and "CHAT off" in r.output


def test_not_a_model(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"this is not a gguf file" * 10)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    for target, expected in ((fake, "not a GGUF model"), (text, "is not a model"), (empty_dir, "no config.json")):
        r = invoke("generate", "--prompt", "hi", "--target", target)
        assert r.exit_code == 1 and expected in r.output and "Traceback" not in r.output, r.output


def test_empty_and_too_long_prompts():
    r = invoke("generate", "--prompt", "   ")
    assert r.exit_code == 1 and "prompt is empty" in r.output
    r = invoke("generate", "--prompt", "word " * 9000, "--raw")
    assert r.exit_code == 1 and "has a context of 8192" in r.output and "Traceback" not in r.output
    assert "draft accepted" not in r.output  # one line, no stream legend before it


def test_padded_embeddings_with_one_tokenizer_are_accepted(tmp_path):
    """Like Qwen's 0.5B/1.5B pair: the same tokenizer, embedding matrices of different sizes."""
    from transformers import AutoModelForCausalLM

    from support.models import tiny_model_dir

    target = tiny_model_dir(tmp_path / "target", seed=0)
    draft = tiny_model_dir(tmp_path / "draft", seed=1, layers=1)
    model = AutoModelForCausalLM.from_pretrained(draft)
    model.resize_token_embeddings(model.config.vocab_size + 13)
    model.save_pretrained(draft)
    args = ("generate", "--prompt", "hello world", "--target", target, "--format", "json", "--max-new-tokens", 20, "--dtype", "float32")
    spec = invoke(*args, "--draft", draft)
    plain = invoke(*args)
    assert spec.exit_code == 0, spec.output
    ids = lambda r: [json.loads(x)["id"] for x in r.stdout.splitlines()[:-1]]  # noqa: E731
    assert ids(spec) == ids(plain) and json.loads(spec.stdout.splitlines()[-1])["mode"] == "draft"
