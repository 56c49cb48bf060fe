"""What specchat costs on top of a serving engine: the same requests streamed by a bare client and through
specchat's RemoteSession, interleaved; and how long `specchat --server URL` takes to show its prompt.

    python benchmarks/remote_overhead.py --server http://127.0.0.1:8080 [--reps 5] [--tokens 128]

Both clients send the same body (specchat's: timings_per_token, so the server does the same work) and count
tokens/s the same way: completion tokens over the time from the first token's chunk to the last chunk. The
bare client reads the SSE lines and parses each JSON (any client must, to get the text). Start-up: the chat
in a pseudo-terminal, from exec to the message input on screen. Prints medians, ratios and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import select
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specchat.engine import remote  # noqa: E402
from specchat.engine.sampling_params import SamplingParams  # noqa: E402
from specchat.remote_session import RemoteSession  # noqa: E402

PROMPTS = [json.loads(line)["prompt"] for line in (Path(__file__).parent / "heldout-prompts.jsonl").read_text().splitlines() if line.strip()]


def bare(server: remote.Server, body: dict) -> tuple[int, float]:
    """(tokens, tokens/s) as a minimal streaming client sees them."""
    request = urllib.request.Request(f"{server.url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    first = last = None
    tokens = 0
    with urllib.request.urlopen(request, timeout=300) as response:
        for line in response:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if (chunk.get("choices") or [{}])[0].get("delta", {}).get("content"):
                first = first or time.perf_counter()
            last = time.perf_counter()
    return tokens, tokens / (last - first)


def through_specchat(session: RemoteSession, prompt: str) -> tuple[int, float]:
    t_first = None
    tokens = 0
    for record in session.complete([{"role": "user", "content": prompt}]):
        t_first = t_first or time.perf_counter()
        tokens += len(record.tokens)
    return tokens, tokens / (time.perf_counter() - t_first)


def startup_s(url: str) -> float:
    """From exec to the chat's message input on a pseudo-terminal (its placeholder text drawn)."""
    pid, fd = pty.fork()
    if pid == 0:
        os.environ.update(TERM="xterm-256color", COLUMNS="120", LINES="40")
        os.execvp(sys.executable, [sys.executable, "-m", "specchat", "--server", url])
    t0 = time.perf_counter()
    seen = b""
    try:
        while b"Enter sends" not in seen.replace(b"\x1b", b""):
            ready, _, _ = select.select([fd], [], [], 30)
            if not ready:
                raise RuntimeError("no prompt within 30 s")
            seen += os.read(fd, 65536)
            seen = seen[-200000:]
        return time.perf_counter() - t0
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--startups", type=int, default=5)
    args = ap.parse_args()
    server = remote.connect(args.server)
    session = RemoteSession([server], sampling=SamplingParams(0.0, 0, 1.0), max_new_tokens=args.tokens)
    print(f"{server.label} at {server.url}; load average before {os.getloadavg()}")
    ratios, rows = [], []
    for rep in range(args.reps):
        for i, prompt in enumerate(PROMPTS):
            body = remote.Request([{"role": "user", "content": prompt}], args.tokens, 0.0, 0, 1.0).body(server)
            pair = {}
            for who in (("bare", "specchat") if (rep + i) % 2 == 0 else ("specchat", "bare")):  # alternate the order
                pair[who] = bare(server, body) if who == "bare" else through_specchat(session, prompt)
            assert pair["bare"][0] == pair["specchat"][0], f"token counts differ: {pair}"
            ratios.append(pair["specchat"][1] / pair["bare"][1])
            rows.append(pair)
    print(f"tokens/s bare {statistics.median(p['bare'][1] for p in rows):.1f}, through specchat "
          f"{statistics.median(p['specchat'][1] for p in rows):.1f}; ratio (specchat over bare) median {statistics.median(ratios):.3f} "
          f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}-{statistics.quantiles(ratios, n=4)[2]:.3f}, {len(ratios)} pairs)")
    print(f"reconstruction warnings: {len(session.warnings)} in {len(session.turns)} replies")
    times = [startup_s(args.server) for _ in range(args.startups)]
    print(f"`specchat --server URL` to the message input: median {statistics.median(times):.2f} s "
          f"(min {min(times):.2f}, max {max(times):.2f}); torch imported: {torch_imported()}")
    print(f"load average after {os.getloadavg()}")


def torch_imported() -> bool:
    code = ("import sys; from specchat.cli import main; import specchat.tui.app, specchat.remote_session; "
            "print('torch' in sys.modules)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "True"


if __name__ == "__main__":
    main()
