"""Self-speculative modes (layerskip, earlyexit) on the default model against plain decoding, interleaved.

For each dtype: every prompt is generated greedily by every configuration in turn (repeated), so the
load from other processes on this shared machine hits all of them alike (the order rotates every
prompt); speedups are ratios of tokens/s within the run. Configurations:
  off          plain decoding through HF's forward (the baseline every speedup is relative to)
  off-lean     plain decoding through specchat's layer-by-layer forward (how much of a mode's gain is
               just a leaner forward rather than speculation)
  layerskip    the tuned (or given) skip set, K from tune (or -k)
  earlyexit    exit layer E, shared KV cache
  hf-plain     HF generate(do_sample=False)
  hf-earlyexit HF generate(assistant_early_exit=E), the same E

Usage: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_selfspec.py [--dtypes float32,bfloat16] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from specchat.decoding import Controls, SamplingParams, TargetState, generate
from specchat.decoding.drafters import build_drafter
from specchat.decoding.drafters.layers import Decoder
from specchat.decoding.drafters.plain import PlainDecoding
from specchat.decoding.stats import Stats
from specchat.decoding.tuned import load_tuned
from specchat.models import load_model

PROMPTS = [
    "Give me three tips for writing clear emails.",
    "Explain how a bicycle gear system works.",
    "What is the difference between a list and a tuple in Python?",
    "Write a short story about a lighthouse keeper.",
]


class LeanPlain:
    """Plain decoding whose verify is specchat's layer-by-layer forward over all layers (no drafts)."""

    name = "off-lean"

    def __init__(self, model) -> None:
        self.decoder = Decoder(model)

    def reset(self) -> None:
        pass

    def propose(self, state, k, params, generator):
        from specchat.decoding.drafters.base import Proposal

        return Proposal.empty(state.device)

    def verify(self, state, draft_ids):
        ids = [state.tokens[-1], *draft_ids]
        return self.decoder.forward(ids, range(self.decoder.n_layers), state.cache, len(state.tokens) - 1, keep=len(ids))


def run_loop(model, drafter, prompt, k, tokens, eos, stats: Stats) -> list[int]:
    """One greedy generation through specchat's loop; its rounds are added to `stats`."""
    drafter.reset()
    controls = Controls(drafter, k=k, sampling=SamplingParams(0))
    out = []
    for r in generate(TargetState(model), prompt, controls, max_new_tokens=tokens, eos_ids=eos):
        stats.add(r)
        out += [t.id for t in r.tokens]
    return out


def run_hf(model, prompt, tokens, **kwargs) -> tuple[float, list[int]]:
    ids = torch.tensor([prompt])
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, do_sample=False, max_new_tokens=tokens, **kwargs)
    return time.perf_counter() - t, out[0, len(prompt):].tolist()


def bench_dtype(dtype, args) -> dict:
    loaded = load_model(None, torch.device("cpu"), dtype)
    model, tok = loaded.model, loaded.tokenizer
    eos = {model.generation_config.eos_token_id}
    n = model.config.num_hidden_layers
    ls_tuned, ee_tuned = load_tuned(model, "layerskip") or {}, load_tuned(model, "earlyexit") or {}
    layerskip = build_drafter("layerskip", model, skip_layers=args.skip_layers)
    earlyexit = build_drafter("earlyexit", model, exit_layer=args.exit_layer)
    k_ls = args.k or ls_tuned.get("k", 4)
    k_ee = args.k or ee_tuned.get("k", 4)
    configs = {
        "off": (PlainDecoding(), 1),
        "off-lean": (LeanPlain(model), 1),
        f"layerskip K={k_ls}": (layerskip, k_ls),
        f"earlyexit K={k_ee}": (earlyexit, k_ee),
    }
    for k in args.more_k:  # the same drafters at other draft lengths, to show the trend
        configs[f"layerskip K={k}"] = (layerskip, k)
        configs[f"earlyexit K={k}"] = (earlyexit, k)
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False)) for p in PROMPTS[: args.prompts]]
    stats = {name: Stats() for name in configs}
    hf = {"hf-plain": [0.0, 0], "hf-earlyexit": [0.0, 0]}
    extra_bytes = {"layerskip": 0, "earlyexit": 0}
    # warm-up (allocator, first-call costs) on a short generation of every configuration
    for name, (drafter, k) in configs.items():
        run_loop(model, drafter, prompts[0], k, 8, eos, Stats())
    run_hf(model, prompts[0], 8)
    names = list(configs) + (list(hf) if args.hf else [])
    outputs: dict[tuple[str, int], list[int]] = {}
    step = 0
    for rep in range(args.repeats):
        for pi, prompt in enumerate(prompts):
            # rotate the order every time, so no configuration always runs in the same slot of the cycle
            order = names[step % len(names):] + names[: step % len(names)]
            step += 1
            for name in order:
                if name in configs:
                    drafter, k = configs[name]
                    out = run_loop(model, drafter, prompt, k, args.tokens, eos, stats[name])
                    if drafter is layerskip:
                        extra_bytes["layerskip"] = max(extra_bytes["layerskip"], drafter.extra_bytes)
                else:
                    kw = {"assistant_early_exit": earlyexit.exit_layer} if name == "hf-earlyexit" else {}
                    secs, out = run_hf(model, prompt, args.tokens, **kw)
                    hf[name][0] += secs
                    hf[name][1] += len(out)
                outputs[name, pi] = out
    mismatches = sorted({(name, pi) for (name, pi), out in outputs.items() if out != outputs["off", pi]})
    off = stats["off"]
    plain_step_ms = 1000 * off.wall_s / off.rounds
    rows = {}
    for name, s in stats.items():
        k = configs[name][1]
        rows[name] = {
            "k": 0 if name.startswith("off") else k,
            "tokens": s.emitted,
            "tokens_per_s": s.tokens_per_s,
            "speedup": s.tokens_per_s / off.tokens_per_s,
            "acceptance": s.acceptance_rate,
            "mean_accepted_length": s.mean_accepted_length,
            "target_calls_per_token": s.target_calls_per_token,
            # costs relative to one plain (HF) step: one draft step, one verify forward
            "draft_cost": (1000 * s.draft_s / s.draft_calls / plain_step_ms) if s.draft_calls else None,
            "verify_cost": 1000 * s.verify_s / s.rounds / plain_step_ms,
            "draft_ms_per_round": s.draft_ms_per_round,
            "verify_ms_per_round": s.verify_ms_per_round,
        }
    for name, (secs, count) in hf.items():
        if count:
            rows[name] = {"tokens": count, "tokens_per_s": count / secs, "speedup": (count / secs) / off.tokens_per_s}
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "skip_layers": layerskip.skip_layers,
        "exit_layer": earlyexit.exit_layer,
        "layers": n,
        "rows": rows,
        "extra_memory_bytes": extra_bytes,
        "mismatches_vs_off": mismatches,
    }


def fmt(v, spec=".3g"):
    return "-" if v is None else format(v, spec)


def markdown(result: dict) -> str:
    lines = [
        f"### {result['dtype']}: layerskip skips {result['skip_layers']} of {result['layers']} layers; earlyexit E={result['exit_layer']}",
        "",
        "| config | K | tokens | tok/s | speedup vs off | acceptance | tokens/round | target calls/token | draft cost | verify cost |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["rows"].items():
        lines.append(
            f"| {name} | {r.get('k', '-')} | {r['tokens']} | {fmt(r['tokens_per_s'])} | {fmt(r['speedup'], '.2f')} | "
            f"{fmt(r.get('acceptance'))} | {fmt(r.get('mean_accepted_length'))} | {fmt(r.get('target_calls_per_token'))} | "
            f"{fmt(r.get('draft_cost'))} | {fmt(r.get('verify_cost'))} |"
        )
    mem = result["extra_memory_bytes"]
    lines += ["", f"extra memory: layerskip draft KV cache {mem['layerskip'] / 2**20:.1f} MiB at most; earlyexit 0 (shares the target cache); weights: none",
              f"greedy outputs differing from `off`: {result['mismatches_vs_off'] or 'none'}", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("-k", type=int, default=None, help="draft length for both modes (default: tuned, else 4)")
    p.add_argument("--skip-layers", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--exit-layer", type=int, default=None)
    p.add_argument("--more-k", type=lambda s: [int(x) for x in s.split(",") if x], default=[3], help="extra draft lengths to run ('' for none)")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip HF generate and assistant_early_exit")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    header = (f"machine: {platform.machine()}, {os.cpu_count()} cores (shared), torch {torch.__version__}, "
              f"threads {torch.get_num_threads()}; greedy, {args.tokens} new tokens x {args.prompts} chat prompts x {args.repeats}")
    print(header + "\n", flush=True)
    results = []
    for name in args.dtypes.split(","):
        result = bench_dtype({"float32": torch.float32, "bfloat16": torch.bfloat16}[name], args)
        results.append(result)
        print(markdown(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
