"""The first reply of a fresh process: mode auto with nothing learnt, auto with what earlier sessions learnt, and
plain decoding, on prompts nobody tuned on.

Every run is a new `specchat generate --format json` process (models load, auto builds its candidates, one reply).
"Learnt" sessions start from a copy of a state folder that earlier sessions filled on *other* prompts (--learn-prompts,
the project's own bench prompts): each run gets a fresh copy, so nothing is learnt from the held-out prompts
themselves. Configurations are interleaved within each repetition (rotated order), and each ratio is paired with
the plain run of the same prompt and repetition. Decode tokens/s is the summary's (every round after the first).

    python benchmarks/first_reply.py --reps 3                     # the default model on its default engine
    python benchmarks/first_reply.py --reps 3 --args "--engine torch"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent


def prompts(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def generate(prompt: str, mode: str, state: Path, args: argparse.Namespace) -> dict:
    """One fresh process; its summary line."""
    cmd = [sys.executable, "-m", "specchat", "generate", "--prompt", prompt, "--mode", mode, "--format", "json",
           "--max-new-tokens", str(args.max_new_tokens), "--temperature", str(args.temperature), "--seed", "1",
           *shlex.split(args.args)]
    env = {**os.environ, "SPECCHAT_STATE_DIR": str(state), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if run.returncode != 0:  # say why, not only that it failed
        raise SystemExit(f"specchat generate exited {run.returncode} ({mode}, {prompt[:40]!r}): {run.stderr.strip()[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def learn(state: Path, args: argparse.Namespace) -> dict:
    """Earlier sessions: auto over the learning prompts, `--learn-sessions` times each."""
    for _ in range(args.learn_sessions):
        for p in prompts(args.learn_prompts):
            generate(p["prompt"], "auto", state, args)
    [saved] = (state / "auto").glob("*.json")
    return json.loads(saved.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=Path, default=HERE / "heldout-prompts.jsonl")
    ap.add_argument("--learn-prompts", type=Path, default=HERE / "bench-prompts-short.jsonl")
    ap.add_argument("--learn-sessions", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--args", default="", help="more `specchat generate` options, e.g. '--engine torch'")
    args = ap.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="first-reply-"))
    learnt = scratch / "learnt"
    print(f"load average before: {os.getloadavg()}", flush=True)
    known = learn(learnt, args)
    rounds = {arm: r["rounds"] for arm, r in known["rates"].get("greedy" if args.temperature == 0 else next(iter(known["rates"])), {}).items()}
    print(f"learnt on {args.learn_prompts.name} x{args.learn_sessions}: rounds per arm {rounds}", flush=True)

    configs = ["off", "auto, nothing learnt", "auto, learnt"]
    runs: dict[str, dict[str, list[dict]]] = {p["name"]: {c: [] for c in configs} for p in prompts(args.prompts)}
    for rep in range(args.reps):
        for i, p in enumerate(prompts(args.prompts)):
            order = configs[(rep + i) % 3:] + configs[: (rep + i) % 3]
            for config in order:
                state = scratch / f"run-{rep}-{i}-{configs.index(config)}"
                if config == "auto, learnt":
                    shutil.copytree(learnt, state)
                runs[p["name"]][config].append(generate(p["prompt"], "off" if config == "off" else "auto", state, args))
    print(f"load average after: {os.getloadavg()}\n")

    print("| prompt | off tok/s | auto, nothing learnt | auto, learnt | rounds by mode (learnt, last rep) |")
    print("|---|---|---|---|---|")
    ratios = {c: [] for c in configs[1:]}
    for name, by in runs.items():
        cells = []
        for config in configs[1:]:
            paired = [r["tokens_per_s"] / o["tokens_per_s"] for r, o in zip(by[config], by["off"])]
            ratios[config].append(statistics.median(paired))
            cells.append(f"{statistics.median(paired):.2f}x ({min(paired):.2f}-{max(paired):.2f})")
        off = statistics.median(r["tokens_per_s"] for r in by["off"])
        print(f"| {name} | {off:.1f} | {cells[0]} | {cells[1]} | {by['auto, learnt'][-1]['rounds_by_mode']} |")
    for config, values in ratios.items():
        print(f"{config}: median over prompts {statistics.median(values):.2f}x, lowest {min(values):.2f}x")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
