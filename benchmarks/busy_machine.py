"""Decoding speed of `specchat generate` on a quiet machine and beside one CPU-bound competitor, per thread setting.

Each run is a fresh `specchat generate` process (as a user runs it: greedy, mode off, the default model) and
its tokens are timed as they arrive. Two cases: the competitor (one `python -c 'while True: pass'`) already
runs when specchat starts, or it starts after the 80th token (the first 20 tokens are left out of the quiet
rate, which the mid-run case measures before the competitor starts). Configurations run interleaved, each repetition visiting all of them, so drift in the machine's load
hits all alike.

    python benchmarks/busy_machine.py [--reps 2] [--tokens 320] [--configs "NAME;NAME"] [--args '--engine torch']
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONFIGS = {  # name -> (environment, extra arguments)
    "default": ({}, []),
    "--threads 1": ({}, ["--threads", "1"]),
    "--threads 2 (spin, fixed)": ({}, ["--threads", "2"]),
    "passive, --threads 2 (before)": ({"OMP_WAIT_POLICY": "PASSIVE"}, ["--threads", "2"]),
    # libgomp's own spin: llama.cpp's threads (the same OpenMP runtime as torch's) wait between decodes
    "default, GOMP_SPINCOUNT=300000": ({"GOMP_SPINCOUNT": "300000"}, []),
    "--threads 2, GOMP_SPINCOUNT=300000": ({"GOMP_SPINCOUNT": "300000"}, ["--threads", "2"]),
    "default, GOMP_SPINCOUNT=10000": ({"GOMP_SPINCOUNT": "10000"}, []),  # torch's brief spin
}
PROMPT = "Write a long, detailed story about a lighthouse keeper and a storm, with many chapters."
COMPETITOR = [sys.executable, "-c", "while True: pass"]
SWITCH_AT = 80  # tokens before the competitor starts, in the mid-run case


def run(env_extra: dict, args: list[str], tokens: int, competitor: str) -> tuple[float, float, int]:
    """(quiet tok/s or NaN, busy tok/s, threads at the end); the competitor starts "before" or "during"."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env.update(env_extra, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "specchat", "generate", "--prompt", PROMPT, "--max-new-tokens", str(tokens), "--format", "json", *args]
    other = subprocess.Popen(COMPETITOR) if competitor == "before" else None
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
        times, summary = [], {}
        for line in proc.stdout:
            event = json.loads(line)
            if event["type"] != "token":
                summary = event
                continue
            times.append(time.monotonic())
            if competitor == "during" and len(times) == SWITCH_AT:
                other = subprocess.Popen(COMPETITOR)
        proc.wait()
    finally:
        if other:
            other.kill()
            other.wait()
    if proc.returncode != 0 or len(times) < SWITCH_AT + 40:
        raise SystemExit(f"{cmd} failed or stopped early ({len(times)} tokens)")
    switch = SWITCH_AT if competitor == "during" else 20
    quiet = (switch - 20) / (times[switch - 1] - times[19]) if competitor == "during" else float("nan")  # tokens 20..79
    busy = (len(times) - switch) / (times[-1] - times[switch - 1])
    return quiet, busy, summary.get("threads")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=320)
    parser.add_argument("--configs", default=None, help="names of CONFIGS to run, separated by semicolons (default: all)")
    parser.add_argument("--args", default="", help="extra arguments for every `specchat generate`, e.g. '--engine torch'")
    a = parser.parse_args()
    configs = {n: c for n, c in CONFIGS.items() if a.configs is None or n in a.configs.split(";")}
    print("load average before:", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    quiet, before, during, threads = {}, {}, {}, {}
    for _ in range(a.reps):
        for name, (env, args) in configs.items():
            args = [*args, *a.args.split()]
            _, b, t_before = run(env, args, a.tokens, "before")
            q_during, d, t_during = run(env, args, a.tokens, "during")  # its first tokens are the quiet measurement
            for into, x in ((quiet, q_during), (before, b), (during, d)):
                into.setdefault(name, []).append(x)
            threads[name] = (t_before, t_during)
            print(f"  {name}: quiet {q_during:.1f}, competitor before {b:.1f}, after token {SWITCH_AT} {d:.1f} tok/s", flush=True)
    print("load average after:", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(f"\nmedian decode tokens/s over {a.reps} interleaved runs (up to {a.tokens} tokens, greedy, mode off)")
    print(f"{'setting':>30} | {'quiet':>6} | {'competitor from the start':>25} | {'competitor from token ' + str(SWITCH_AT):>25} | threads at the end")
    for name in configs:
        q, b, d = (statistics.median(x[name]) for x in (quiet, before, during))
        print(f"{name:>30} | {q:6.1f} | {b:12.1f} ({b / q:.2f} quiet) | {d:12.1f} ({d / q:.2f} quiet) | {threads[name]}")


if __name__ == "__main__":
    main()
