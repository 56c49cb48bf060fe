"""Two checkouts' whole session path, interleaved: which of them decodes the default model faster on this machine.

    git worktree add /tmp/base <commit>
    python benchmarks/session_ab.py /tmp/base . --modes off,suffix --reps 3

One worker process per checkout (its own code on PYTHONPATH), both loaded before the first reply; each prompt and
configuration is asked of both in turn, the order alternating, so a slow moment of a shared machine falls on both.
Prints per configuration the new/base ratio of tok/s (the rounds' own seconds, as the chat's panel counts them), its
range, and how many replies were the same tokens. Lean engine, 2 threads, the held-out prompts, seed 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PROMPTS = Path(__file__).with_name("heldout-prompts.jsonl")


def worker(tokens: int) -> None:
    """Answer "prompt-index temperature mode" lines with {"tps", "tokens"}, one session per configuration."""
    from specchat import threads

    threads.prepare_process()
    threads.prepare_for_gguf()  # the GGUF engines' longer spin, as specchat runs them
    try:
        from specchat import heap

        heap.keep_freed_pages()  # as the specchat command does (a checkout from before heap.py has none)
    except ImportError:
        pass
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from specchat.engine.sampling import SamplingParams
    from specchat.models import load_model
    from specchat.session import Session

    threads.set_threads(2)
    model = load_model(None, torch.device("cpu"), torch.float32, engine="lean")
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    sessions = {}
    print("ready", flush=True)
    for line in sys.stdin:
        index, temperature, mode = line.split()
        key = (float(temperature), mode)
        if key not in sessions:
            params = SamplingParams(key[0], 0, 0.9 if key[0] > 0 else 1.0)
            sessions[key] = Session(model, None, mode=mode, k=4, sampling=params, seed=0, earlier_sessions=False)
            sessions[key].max_new_tokens = tokens
        records = list(sessions[key].complete(model.chat_ids([{"role": "user", "content": prompts[int(index)]}])))[1:]
        made, seconds = sum(len(r.tokens) for r in records), sum(r.wall_s for r in records)
        print(json.dumps({"tps": made / seconds, "tokens": [t.id for r in records for t in r.tokens]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("--modes", default="off")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    trees = {"base": Path(args.base).resolve(), "new": Path(args.new).resolve()}
    workers = {}
    for name, tree in trees.items():
        env = dict(os.environ, PYTHONPATH=str(tree))
        workers[name] = subprocess.Popen([sys.executable, __file__, "--worker", str(args.tokens)], cwd=tree, env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for w in workers.values():
        if w.stdout.readline().strip() != "ready":
            sys.exit("a worker did not start")

    def ask(name: str, line: str) -> dict:
        workers[name].stdin.write(line + "\n")
        workers[name].stdin.flush()
        return json.loads(workers[name].stdout.readline())

    n = sum(1 for line in PROMPTS.read_text().splitlines() if line.strip())
    configs = [(float(t), mode) for mode in args.modes.split(",") for t in args.temperatures.split(",")]
    print("load before", os.getloadavg())
    for t, mode in configs:  # a first reply each: the kernels' first calls
        for name in trees:
            ask(name, f"0 {t} {mode}")
    ratios = {c: [] for c in configs}
    same = dict.fromkeys(configs, 0)
    tps = {(c, name): [] for c in configs for name in trees}
    for rep in range(args.reps):
        for i in range(n):
            for c in configs:
                order = list(trees) if (i + rep) % 2 == 0 else list(trees)[::-1]
                out = {name: ask(name, f"{i} {c[0]} {c[1]}") for name in order}
                ratios[c].append(out["new"]["tps"] / out["base"]["tps"])
                same[c] += out["new"]["tokens"] == out["base"]["tokens"]
                for name in trees:
                    tps[(c, name)].append(out[name]["tps"])
    print("load after", os.getloadavg())
    for c in configs:
        r = ratios[c]
        print(f"T={c[0]:g} mode {c[1]}: new/base {statistics.median(r):.3f}x (range {min(r):.2f}-{max(r):.2f}, n={len(r)}); "
              f"base {statistics.median(tps[(c, 'base')]):.1f}, new {statistics.median(tps[(c, 'new')]):.1f} tok/s; "
              f"same tokens {same[c]}/{len(r)}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]))
    else:
        main()
