"""Mode auto against each single mode, paired: issue 25's goal that auto reach >= 0.97x the best single mode.

One session per mode, each asked the same prompts one after another (a user's session of unrelated questions:
auto learns as it goes, from nothing: earlier_sessions=False), modes interleaved per prompt in a rotated order.
A reply's figure is decode tokens per second: every token but the first (the prompt's prefill gives its logits) over
every round's draft and verify time. Round 0 counts: there a draft model or the head first catches up on the whole
prompt, which a session of that mode pays, as auto pays it in a later round (before 2026-12-03 round 0 was left
out, which favoured mode draft in auto's ratios). auto's ratio to a mode is paired
with that mode's reply to the same prompt, repetition and temperature, run next to it, and summarised as the
geometric mean and median of those ratios: a bench's ratio of two medians of ratios to plain decoding carries
the noise of three configurations where this carries two.

    python benchmarks/auto_pairs.py --prompts benchmarks/heldout-prompts.jsonl --modes quant,suffix --reps 3
    python benchmarks/auto_pairs.py --target 1.5b.gguf --draft 0.5b.gguf --modes draft,quant --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections import Counter
from pathlib import Path

from specchat import threads

threads.prepare_process()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from specchat.engine.sampling import SamplingParams  # noqa: E402
from specchat.models import load_model  # noqa: E402
from specchat.session import Session  # noqa: E402


def decode_rate(session: Session, prompt: str) -> tuple[float, Counter]:
    """Tokens per second of a fresh conversation's reply (all but the prefill's token, over every round's draft and
    verify time), and its rounds by mode."""
    records = list(session.complete(session.chat_prompt([{"role": "user", "content": prompt}])))
    tokens = sum(len(r.tokens) for r in records) - 1
    seconds = sum(r.draft_s + r.verify_s for r in records)
    return tokens / seconds, Counter(r.mode for r in records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="benchmarks/heldout-prompts.jsonl", help="JSON lines with a 'prompt' field")
    ap.add_argument("--target", default=None, help="default: the embedded default model")
    ap.add_argument("--draft", default=None, help="a draft model (mode draft, and a candidate of auto)")
    ap.add_argument("--engine", default="torch", choices=["llama.cpp", "torch"])
    ap.add_argument("--modes", default="quant", help="the single modes auto is compared with")
    ap.add_argument("--temperature", default="0,0.7")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.engine == "llama.cpp":
        threads.prepare_for_gguf()
    threads.set_threads(args.threads)
    device = torch.device("cpu")
    target = load_model(args.target, device, torch.float32, engine=args.engine)
    draft = load_model(args.draft, device, torch.float32, engine=args.engine) if args.draft else None
    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    modes = ["auto", *args.modes.split(",")]
    temperatures = [float(t) for t in args.temperature.split(",")]
    sessions = {(m, t): Session(target, draft, mode=m, k=args.k, sampling=SamplingParams(t), max_new_tokens=args.max_new_tokens,
                                earlier_sessions=False) for m in modes for t in temperatures}
    rates: dict[tuple, float] = {}  # (mode, temperature, prompt, rep) -> tok/s
    rounds: dict[float, Counter] = {t: Counter() for t in temperatures}  # auto's rounds by the mode it chose
    print(f"load average before: {os.getloadavg()}", file=sys.stderr, flush=True)
    turn = 0
    for rep in range(args.reps):
        for i, prompt in enumerate(prompts):
            for t in temperatures:
                shift, turn = turn % len(modes), turn + 1
                for m in modes[shift:] + modes[:shift]:
                    rates[m, t, i, rep], by_mode = decode_rate(sessions[m, t], prompt)
                    if m == "auto":
                        rounds[t] += by_mode
            print(f"  rep {rep} prompt {i}: " + ", ".join(f"{m} {rates[m, temperatures[0], i, rep]:.1f}" for m in modes),
                  file=sys.stderr, flush=True)
    print(f"load average after: {os.getloadavg()}", file=sys.stderr)

    print(f"\n{Path(args.target).name if args.target else 'default model'}"
          + (f" + {Path(args.draft).name}" if args.draft else "")
          + f", {args.engine}, K={args.k}, {len(prompts)} prompts of {args.prompts}, {args.max_new_tokens} tokens at most, {args.reps} reps\n")
    print("| T | mode | its tok/s (median) | auto × mode: geometric mean | median | range | auto's rounds by mode |")
    print("|---|---|---|---|---|---|---|")
    for t in temperatures:
        for m in modes[1:]:
            keys = [(i, rep) for i in range(len(prompts)) for rep in range(args.reps)]
            ratios = [rates["auto", t, i, rep] / rates[m, t, i, rep] for i, rep in keys]
            geo = math.exp(statistics.fmean(math.log(r) for r in ratios))
            print(f"| {t:g} | {m} | {statistics.median(rates[m, t, i, rep] for i, rep in keys):.1f} | {geo:.3f} | "
                  f"{statistics.median(ratios):.3f} | {min(ratios):.2f}-{max(ratios):.2f} | {dict(rounds[t].most_common())} |")


if __name__ == "__main__":
    main()
