"""specchat against real llama-server processes: the pinned llama.cpp built by scripts/build_llama_server.py (once
per machine, into the tests' cache: 16 minutes on 2 busy cores the first time), serving the default model's GGUF on
127.0.0.1 as target and as draft, with an n-gram drafter, and without drafting."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from specchat import repack_probe
from specchat.engine import remote
from specchat.engine.sampling_params import SamplingParams
from specchat.models import default_gguf
from specchat.remote_session import RemoteSession

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import build_llama_server  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = ["List the numbers from 1 to 12, comma separated.", "Write a Python function that reverses a string.",
           "What is the capital of France? Answer in one sentence."]


@pytest.fixture(scope="module")
def binary():
    return build_llama_server.build()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server process on a free port, stopped by stop()."""

    def __init__(self, binary: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        gguf = str(default_gguf())
        # -ub 1: every position is decoded alone, in every configuration, so a verify rounds as a plain step does and
        # greedy text cannot part at a near tie (a batch of positions takes other kernels: AMX tiles here)
        cmd = [str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port), "-np", "1", "-c", "2048", "-t", "1",
               "-ub", "1", *args]
        if not repack_probe.verdict().repack:  # where llama.cpp's repacking faults in-process, it faults in the server
            cmd.append("--no-repack")
        self.log = open(os.devnull, "wb")
        self.proc = subprocess.Popen([a.replace("{gguf}", gguf) for a in cmd], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with status {self.proc.returncode}: {' '.join(cmd)}")
                time.sleep(0.2)
        raise RuntimeError("llama-server did not become ready in 120 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def servers(binary):
    """A draft-model configuration (the default model drafting for itself), an n-gram one, and plain decoding."""
    started = {}
    try:
        started["draft"] = LlamaServer(binary, "-md", "{gguf}", "--spec-type", "draft-simple", "--spec-draft-n-max", "4")
        started["ngram"] = LlamaServer(binary, "--spec-type", "ngram-simple")
        started["plain"] = LlamaServer(binary)
        yield started
    finally:
        for s in started.values():
            s.stop()


def session_over(servers, *names, **kw):
    return RemoteSession([remote.connect(servers[n].url, n) for n in names], sampling=SamplingParams(0.0, 0, 1.0),
                         max_new_tokens=kw.pop("max_new_tokens", 48), **kw)


def test_connect_tells_the_configurations_apart(servers):
    """A fresh slot says only that it speculates; after its first request it lists its types."""
    plain = remote.connect(servers["plain"].url)
    assert plain.engine == "llama-server" and plain.speculative is None and plain.model.endswith(".gguf")
    for name, spec in (("draft", "draft-simple"), ("ngram", "ngram-simple")):
        session = session_over(servers, name, max_new_tokens=4)
        assert session.server.speculative in ("on", spec)
        list(session.reply("hi"))
        assert session.server.speculative == spec and spec in session.snapshot().server


def test_the_steps_account_for_every_token_and_match_the_final_counters(servers):
    session = session_over(servers, "draft", "ngram")
    for name in ("draft", "ngram"):
        session.set_mode(name)
        for prompt in PROMPTS:
            list(session.complete([{"role": "user", "content": prompt}]))
    assert session.warnings == []
    drafted_any = 0
    for steps, turn in zip(session.reconstructions, session.turns):
        rec = steps.reconciliation()
        assert rec.ok, rec.problems
        usage = steps.usage["completion_tokens"]
        assert rec.tokens == usage == sum(len(r.tokens) for r in turn.rounds) == len(turn.reply_ids)
        assert rec.drafted == steps.final.get("draft_n", 0) == sum(r.drafted for r in turn.rounds)
        assert rec.accepted == steps.final.get("draft_n_accepted", 0) == sum(r.accepted for r in turn.rounds)
        for r in turn.rounds[:-1]:  # every step but the last emitted its accepted drafts and one more
            assert len(r.tokens) == r.accepted + 1
        drafted_any += rec.drafted
    assert drafted_any > 0


def test_a_model_drafting_for_itself_is_accepted(servers):
    """The draft is the target's own file, greedy: its drafts are the target's choices, so nearly every one is
    accepted (batched verification may break a near-tie), and full blocks end in a bonus."""
    session = session_over(servers, "draft", max_new_tokens=64)
    list(session.complete([{"role": "user", "content": PROMPTS[1]}]))
    stats = session.turns[-1].stats
    assert stats.num_draft_tokens >= 20
    assert stats.acceptance_rate >= 0.9
    kinds = {t.kind for r in session.turns[-1].rounds for t in r.tokens}
    assert {"accepted", "bonus"} <= kinds


def test_greedy_text_is_the_same_with_and_without_drafting(servers):
    session = session_over(servers, "plain", "draft", "ngram")
    texts = {}
    for name in ("plain", "draft", "ngram"):
        session.set_mode(name)
        texts[name] = ["".join(t.text for r in session.complete([{"role": "user", "content": p}]) for t in r.tokens) for p in PROMPTS]
    assert texts["draft"] == texts["plain"] == texts["ngram"]
    assert all(texts["plain"])


def test_switching_configurations_mid_session_changes_the_counters(servers):
    session = session_over(servers, "draft", "plain")
    list(session.reply(PROMPTS[0]))
    session.set_mode("plain")
    list(session.reply("And from 13 to 20?"))
    stats = session.snapshot().stats
    assert stats["draft"].num_draft_tokens > 0
    assert stats["plain"].num_draft_tokens == 0 and stats["plain"].new_tokens > 0
    assert all(t.kind == "target" for r in session.turns[-1].rounds for t in r.tokens)
    assert session.messages[-1]["role"] == "assistant" and len(session.messages) == 4


def test_a_prompt_beyond_the_context_is_the_servers_one_line(servers):
    session = session_over(servers, "plain")
    with pytest.raises(remote.RemoteError, match=r"HTTP 400.*context"):
        list(session.reply("word " * 3000))


def test_a_server_killed_mid_reply_leaves_the_partial_reply(binary):
    server = LlamaServer(binary)
    try:
        session = RemoteSession([remote.connect(server.url)], sampling=SamplingParams(0.0, 0, 1.0), max_new_tokens=200)
        got = 0
        with pytest.raises(remote.RemoteError, match="stream"):
            for r in session.reply("Write a long story about a lighthouse keeper."):
                got += len(r.tokens)
                if got >= 5:
                    server.stop()
        turn = session.turns[-1]
        assert turn.stop_reason == "interrupted" and turn.reply and len(turn.reply_ids) >= 5
        assert session.messages[-1] == {"role": "assistant", "content": turn.reply}
    finally:
        server.stop()


def test_generate_streams_from_a_server(servers):
    out = subprocess.run([sys.executable, "-m", "specchat", "generate", "--server", servers["draft"].url, "--prompt", PROMPTS[0],
                          "--max-new-tokens", "24", "--format", "json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    lines = [json.loads(line) for line in out.stdout.splitlines()]
    summary = lines[-1]
    assert summary["type"] == "summary" and summary["engine"] == "llama-server" and summary["reconciled"] is True
    assert summary["new_tokens"] == len(lines) - 1 and summary["num_draft_tokens"] > 0
