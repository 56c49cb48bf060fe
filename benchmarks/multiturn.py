"""Multi-turn chats with repeated material (an edit loop that shows the code again, a review that quotes it back, a
follow-up that quotes an earlier answer), and single general prompts: plain decoding against the drafters that
need no model (lookup, suffix) and auto, on one engine, in one process.

Each conversation runs whole in every mode (a mode's later turns see its own earlier replies; greedy, so every
mode gives the same replies), modes interleaved per conversation and repetition (rotated order). A turn's figure is
decode tokens per second (every round after the first); per conversation, its turns' tokens over their time. Ratios
are paired with mode off's run of the same conversation and repetition. auto runs without learnt rates
(earlier_sessions=False): what a first conversation gets.

    python benchmarks/multiturn.py --reps 2                      # the default model on llama.cpp
    python benchmarks/multiturn.py --reps 2 --engine torch       # the same GGUF dequantised on torch (float32)
    python benchmarks/multiturn.py --modes off,suffix,suffix:8   # a mode:K runs that mode with K drafts (else --k)
    python benchmarks/multiturn.py --modes off,suffix,suffix@0   # suffix@N: at most max(K, N) drafts (default 15)
    python benchmarks/multiturn.py --set tuning                  # the conversations settings are chosen on
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from specchat import threads

threads.prepare_process()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from specchat.engine.sampling import SamplingParams  # noqa: E402
from specchat.models import load_model  # noqa: E402
from specchat.session import Session  # noqa: E402

CODE = '''def total(items):
    t = 0
    for i in items:
        if i["price"] > 0:
            t = t + i["price"] * i["qty"]
    return t
'''

CONVERSATIONS = {
    "edit loop": [
        "Write a Python function that returns the largest even number in a list, or None if there is none.",
        "Add type hints to that function and show the whole function again.",
        "Now rename the variables to be more descriptive and show the complete code once more.",
    ],
    "code review": [
        f"Review this Python code. Quote each line you comment on, then say what to change.\n\n```python\n{CODE}```",
        "Show the corrected version of the whole function.",
    ],
    "follow-up": [
        "What are the main differences between a list and a tuple in Python?",
        "Repeat your answer, but as a bulleted list.",
    ],
    "general": ["Why is the sky blue? Answer in a short paragraph."],
}

# For choosing settings (`--set tuning`); the figures reported come from CONVERSATIONS above, which no setting was
# chosen on.
SCRIPT = '''#!/bin/sh
src=$1
dst=$2
tar czf "$dst/backup-$(date +%F).tar.gz" "$src"
echo "done"
'''

TUNING = {
    "refactor": [
        f"Here is a shell script:\n\n```sh\n{SCRIPT}```\n\nAdd a comment above each line and show the whole script.",
        "Now make it exit with an error when fewer than two arguments are given. Show the complete script again.",
    ],
    "js edit loop": [
        "Write a JavaScript function that counts the vowels in a string.",
        "Make it ignore upper and lower case and show the whole function again.",
        "Add a JSDoc comment above it and show the complete code once more.",
    ],
    "summary": [
        "Explain what a hash table is in a short paragraph.",
        "Repeat that paragraph word for word, then add one sentence about collisions.",
    ],
    "recipe": ["Give me a simple recipe for pancakes."],
}


def run_conversation(session: Session, turns: list[str]) -> tuple[int, float, list[int], dict]:
    """(tokens, seconds, reply ids, rounds by mode) over the conversation's turns, each turn's first round left out."""
    tokens, seconds, ids, by_mode = 0, 0.0, [], {}
    for text in turns:
        records = list(session.reply(text))
        for r in records:
            by_mode[r.mode] = by_mode.get(r.mode, 0) + 1
            ids += [t.id for t in r.tokens]
        tokens += sum(len(r.tokens) for r in records[1:])
        seconds += sum(r.draft_s + r.verify_s for r in records[1:])
    return tokens, seconds, ids, by_mode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--engine", default="llama.cpp", choices=["llama.cpp", "torch"])
    ap.add_argument("--modes", default="off,lookup,suffix,auto")
    ap.add_argument("--set", default="report", choices=["report", "tuning"], help="tuning: the conversations settings are chosen on")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.engine == "llama.cpp":
        threads.prepare_for_gguf()
    threads.set_threads(args.threads)
    target = load_model(args.target, torch.device("cpu"), torch.float32, engine=args.engine)
    modes = args.modes.split(",")
    conversations = TUNING if args.set == "tuning" else CONVERSATIONS
    results = {name: {m: [] for m in modes} for name in conversations}
    print(f"load average before: {os.getloadavg()}", file=sys.stderr, flush=True)
    for rep in range(args.reps):
        for i, (name, turns) in enumerate(conversations.items()):
            shift = (rep + i) % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                spec, _, max_spec = mode.partition("@")
                mode_name, _, k = spec.partition(":")
                options = {"max_spec": int(max_spec)} if max_spec else {}
                session = Session(target, mode=mode_name, k=int(k or args.k), sampling=SamplingParams(0), max_new_tokens=args.max_new_tokens,
                                  earlier_sessions=False, mode_options=options)
                results[name][mode].append(run_conversation(session, turns))
                print(f"  {name} {mode}: {results[name][mode][-1][0] / results[name][mode][-1][1]:.1f} tok/s", file=sys.stderr, flush=True)
    print(f"load average after: {os.getloadavg()}", file=sys.stderr)

    print(f"\n{Path(args.target).name if args.target else 'default model'}, {args.engine}, greedy, K={args.k} (mode:K: K), "
          f"{args.max_new_tokens} tokens a turn at most, {args.reps} reps\n")
    print("| conversation | turns | off tok/s | " + " | ".join(f"{m} × off" for m in modes[1:]) + " | same replies | rounds by mode (auto) |")
    print("|---|---|---|" + "---|" * (len(modes) - 1) + "---|---|")
    for name, by in results.items():
        off = by["off"]
        cells = []
        for m in modes[1:]:
            ratios = [(t / s) / (ot / os_) for (t, s, _, _), (ot, os_, _, _) in zip(by[m], off)]
            cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
        same = sum(r[2] == o[2] for m in modes[1:] for r, o in zip(by[m], off))
        auto = by["auto"][-1][3] if "auto" in by else {}
        print(f"| {name} | {len(conversations[name])} | {statistics.median(t / s for t, s, _, _ in off):.1f} | "
              + " | ".join(cells) + f" | {same}/{(len(modes) - 1) * args.reps} | {auto} |")


if __name__ == "__main__":
    main()
