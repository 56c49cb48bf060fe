"""Mode draft with the draft's LM head restricted to its N lowest token ids (`--draft-vocab N`), against the
full head, HF's forward for the draft, and plain decoding: one process, configurations interleaved per prompt
and repetition, greedy (output compared token for token with plain decoding).

    python benchmarks/draft_vocab.py TARGET DRAFT [--vocab 8192,16384,32768] [--k 4] [--tokens 48] [--reps 2]
        [--prompts benchmarks/bench-prompts-short.jsonl] [--dtype float32] [--threads N]

Prints, per configuration: speedup over plain (median of per-prompt paired ratios of decode tokens/s),
acceptance, draft ms per draft token relative to a plain target step (c), and whether greedy output matched.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from specchat import threads  # noqa: E402

threads.prepare_process()  # OpenMP waits as specchat's own commands wait (OMP_WAIT_POLICY=PASSIVE: as before that changed)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from specchat.engine.drafters.model import ModelDrafter  # noqa: E402
from specchat.engine.drafters.plain import PlainDecoding  # noqa: E402
from specchat.engine.loop import Controls, generate
from specchat.engine.metrics import Stats  # noqa: E402
from specchat.engine.runner import lean_runner  # noqa: E402
from specchat.engine.sampling import SamplingParams
from specchat.engine.target import TargetState  # noqa: E402
from specchat.models import load_model, pick_dtype  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("draft")
    ap.add_argument("--vocab", default="8192,16384,32768")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompts", default="benchmarks/bench-prompts-short.jsonl")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    dtype = pick_dtype(args.dtype, device)
    target, draft = load_model(args.target, device, dtype), load_model(args.draft, device, dtype)
    prompts = [json.loads(line) for line in open(args.prompts) if line.strip()]
    ids = {p["name"]: target.chat_ids([{"role": "user", "content": p["prompt"]}]) for p in prompts}

    configs = {"off": PlainDecoding(), "draft, HF forward": ModelDrafter(draft.model)}
    configs["draft, lean, float32 weights"] = ModelDrafter(draft.model, lean=lean_runner(draft.model))
    configs["draft, lean, full head"] = ModelDrafter.build(target.model, draft.model)  # bfloat16 weights on the CPU
    for n in [int(v) for v in args.vocab.split(",") if v]:
        configs[f"draft, lean, --draft-vocab {n}"] = ModelDrafter.build(target.model, draft.model, draft_vocab=n)

    def run(drafter, prompt_ids):
        drafter.reset()
        controls = Controls(drafter, k=args.k, sampling=SamplingParams(0.0))
        records = list(generate(TargetState(target.model), prompt_ids, controls, max_new_tokens=args.tokens, eos_ids=target.eos_ids))
        return [t.id for r in records for t in r.tokens], Stats.of(r for r in records if r.index > 0)

    for drafter in configs.values():  # warm-up
        run(drafter, ids[prompts[0]["name"]][:32])
    results = {name: {"ratio": [], "stats": Stats(), "identical": True} for name in configs}
    for rep in range(args.reps):
        for p in prompts:
            plain_tokens, plain_stats = None, None
            for name, drafter in configs.items():
                tokens, stats = run(drafter, ids[p["name"]])
                if name == "off":
                    plain_tokens, plain_stats = tokens, stats
                    results["off"]["stats"] = results["off"]["stats"].merge(stats)
                    continue
                results[name]["ratio"].append(stats.tokens_per_s / plain_stats.tokens_per_s)
                results[name]["stats"] = results[name]["stats"].merge(stats)
                results[name]["identical"] &= tokens == plain_tokens
                print(f"rep {rep} {p['name']:>8} {name:<30} {stats.tokens_per_s / plain_stats.tokens_per_s:.2f}x", file=sys.stderr, flush=True)
    step = results["off"]["stats"].plain_step_s
    print(f"target {target.name}, draft {draft.name}, {dtype}, {torch.get_num_threads()} threads, K={args.k}, greedy, "
          f"{args.tokens} tokens x {len(prompts)} prompts x {args.reps}; plain step {1000 * step:.1f} ms; load {os.getloadavg()}")
    print("| config | speedup over off | acceptance | c (draft ms per draft token / plain step) | greedy identical |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        if name == "off":
            continue
        s = r["stats"]
        c = s.draft_s / s.num_draft_tokens / step if s.num_draft_tokens and step else float("nan")
        print(f"| {name} | {statistics.median(r['ratio']):.2f} | {s.acceptance_rate:.3f} | {c:.3f} | {r['identical']} |")


if __name__ == "__main__":
    main()
