"""Mode draft with a fixed K against drafts that stop when the draft's confidence drops (its top probability below
p_min, llama.cpp's --draft-p-min; AdaptiveK with k_min = k_max = K carries it) and against K measured
(`MeasuredK`), and against a draft whose LM head scores only its lowest ids (`--draft-vocab`), on the lean engine.

    python benchmarks/confidence_stop.py [--target FILE.gguf] [--draft FILE.gguf] [--configs k3,k4,k6p0.5,m4,m4v65536]
        [--temperature 0] [--reps 2] [--tokens 96]

Configurations `kN` (fixed K = N), `kNpP` (up to N drafts while the top probability is >= P) and `mN` (K measured,
from N; one MeasuredK for all of the configuration's replies, as a chat session keeps it), each with `vV` appended
for `--draft-vocab V`, and plain decoding,
answer every held-out prompt in turn (the order alternating); prints each one's median decode tokens/s over plain
decoding's (per prompt and repetition), acceptance, drafts a round, and whether greedy replies matched.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from pathlib import Path

from specchat import threads

threads.prepare_process()
threads.prepare_for_gguf()  # the GGUF engines' longer spin, as specchat runs them
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from specchat.engine.draft_length import MeasuredK  # noqa: E402
from specchat.engine.loop import AdaptiveK  # noqa: E402
from specchat.engine.sampling_params import SamplingParams  # noqa: E402
from specchat.models import load_model  # noqa: E402
from specchat.session import Session  # noqa: E402

PAIR = Path.home() / ".cache" / "specchat-bench-models"
PROMPTS = Path(__file__).with_name("heldout-prompts.jsonl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(PAIR / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"))
    ap.add_argument("--draft", default=str(PAIR / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
    ap.add_argument("--configs", default="k3,k4,k6p0.5,k6p0.6")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()
    cpu = torch.device("cpu")
    target = load_model(args.target, cpu, torch.float32, engine="lean")
    draft = load_model(args.draft, cpu, torch.float32, engine="lean")
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    sampling = SamplingParams(temperature=args.temperature, top_p=0.9) if args.temperature else SamplingParams(0.0)
    configs = {"off": (0, None, None)} | {c: (int(m[2]), float(m[3]) if m[3] else None, int(m[4]) if m[4] else None)
                                          for c in args.configs.split(",") if (m := re.fullmatch(r"([km])(\d+)(?:p([\d.]+))?(?:v(\d+))?", c))}
    measured = {name: MeasuredK(start=configs[name][0], p_min=configs[name][1] or 0.0) for name in configs if name.startswith("m")}
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in configs}
    matched = 0
    for rep in range(args.reps):
        for i, prompt in enumerate(prompts):
            replies = {}
            for name in list(configs)[:: 1 if (i + rep) % 2 == 0 else -1]:
                k, p_min, vocab = configs[name]
                session = Session(target, draft, mode="draft" if k else "off", k=k or 4, sampling=sampling, seed=rep,
                                  max_new_tokens=args.tokens, earlier_sessions=False,
                                  mode_options={"draft_vocab": vocab} if vocab else None)
                if name in measured:
                    session.controls.adaptive = measured[name]
                elif p_min is not None:
                    session.controls.adaptive = AdaptiveK(start=k, k_min=k, k_max=k, p_min=p_min)
                ids, first = [], None
                for record in session.reply(prompt):
                    first = first or time.perf_counter()
                    ids += [t.id for t in record.tokens]
                stats = session.total
                results[name].append((len(ids) / (time.perf_counter() - first), stats.acceptance_rate or 0.0, stats.mean_draft_len or 0.0))
                replies[name] = ids
            matched += all(r == replies["off"] for r in replies.values())
    print(f"temperature {args.temperature}, {args.reps} x {len(prompts)} prompts, {args.tokens} tokens")
    for name in list(configs)[1:]:
        ratio = statistics.median(a[0] / b[0] for a, b in zip(results[name], results["off"]))
        print(f"{name:10s} over plain: {ratio:.3f}   acceptance {statistics.median(r[1] for r in results[name]):.2f}   "
              f"drafts a round {statistics.median(r[2] for r in results[name]):.2f}")
    for name, m in measured.items():
        print(f"{name}: the K it chose at the end: {m.best}")
    print(f"replies identical to plain decoding's: {matched} of {len(results['off'])}"
          f"{' (greedy)' if not args.temperature else ' (sampled: not expected)'}; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
