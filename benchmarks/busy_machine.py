"""Decoding speed of `specchat generate` on a quiet machine and beside one CPU-bound competitor, per thread setting.

Each configuration is a fresh `specchat generate` process (as a user runs it: greedy, mode off, the default
model, 64 new tokens); its summary's decode tokens/s is recorded. Configurations run interleaved, each
repetition visiting all of them, so drift in the machine's load hits all alike. The competitor is one
`python -c 'while True: pass'` process, started before and stopped after each busy run.

    python benchmarks/busy_machine.py [--reps 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CONFIGS = {  # name -> (extra environment, extra arguments)
    "default": ({}, []),
    "--threads 1": ({}, ["--threads", "1"]),
    "--threads 2, spin-wait": ({"OMP_WAIT_POLICY": "ACTIVE"}, ["--threads", "2"]),
}
PROMPT = "Explain how a lighthouse keeper's day is organised, step by step."


def run(env_extra: dict, args: list[str], tokens: int) -> dict:
    env = {**os.environ, **env_extra, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "specchat", "generate", "--prompt", PROMPT, "--max-new-tokens", str(tokens), "--format", "json", *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    a = parser.parse_args()
    print("load average before:", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    results: dict[tuple[str, bool], list[tuple[float, int]]] = {}
    for _ in range(a.reps):
        for busy in (False, True):
            for name, (env, args) in CONFIGS.items():
                competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
                try:
                    summary = run(env, args, a.tokens)
                finally:
                    if competitor:
                        competitor.kill()
                        competitor.wait()
                results.setdefault((name, busy), []).append((summary["tokens_per_s"], summary["threads"]))
    print("load average after:", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    quiet_default = statistics.median(t for t, _ in results[("default", False)])
    print(f"\nmedian decode tokens/s over {a.reps} interleaved runs ({a.tokens} tokens, greedy, mode off)")
    print(f"{'setting':>24} | {'quiet':>7} | {'1 competitor':>12} | busy/quiet | threads used (quiet, busy)")
    for name in CONFIGS:
        quiet, busy = (statistics.median(t for t, _ in results[(name, b)]) for b in (False, True))
        threads = (results[(name, False)][0][1], results[(name, True)][0][1])
        print(f"{name:>24} | {quiet:7.1f} | {busy:12.1f} | {busy / quiet:10.2f} | {threads}")
    print(f"\nbusy default / quiet default: {statistics.median(t for t, _ in results[('default', True)]) / quiet_default:.2f}")


if __name__ == "__main__":
    main()
