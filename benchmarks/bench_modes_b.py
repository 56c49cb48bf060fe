"""Modes quant, lowrank and lookup, adaptive K and the approximate rule on the default model, interleaved.

For each dtype, every prompt is generated greedily by every configuration in turn, so the load from other
processes on this shared machine falls on all of them alike; speedups are ratios of tokens/s within one
run. Workloads:
  chat    ordinary chat prompts: off, quant, lowrank, lookup, each at fixed K and with --adaptive
  repeat  a prompt that invites repetition (rewrite a given function): off, lookup (fixed / adaptive),
          HF generate plain and with prompt_lookup_num_tokens
Speedups are reported three ways: total tokens/s ratio, the median over passes of (config / plain) wall-time
ratios, and the same median on this process's CPU time (one thread), which time stolen by other processes
on a shared machine does not inflate.
Every configuration's greedy output is checked against plain decoding (exact modes must match).
Memory: each drafter's extra bytes (factors / int8 copy / draft KV cache) and the process RSS growth when
it is built.

Usage: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_modes_b.py [--dtypes float32,bfloat16] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from specchat.decoding import Controls, SamplingParams, TargetState, generate
from specchat.decoding.acceptance import parse_rule
from specchat.decoding.drafters import build_drafter
from specchat.decoding.drafters.plain import PlainDecoding
from specchat.decoding.loop import AdaptiveK
from specchat.decoding.stats import Stats
from specchat.models import load_model

CHAT = [
    "Give me three tips for writing clear emails.",
    "Explain how a bicycle gear system works.",
    "What is the difference between a list and a tuple in Python?",
]
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax'''
REPEAT = [f"Here is a Python function:\n\n{CODE}\n\nRewrite it exactly, but rename `subtotal` to `net`. Show the full code."]


ADAPTIVE_P_MIN = 0.7  # what the CLI's --adaptive uses (specchat/cli.py configure_controls)


def merge(total: Stats, one: Stats) -> None:
    """Add one generation's counters to a running total (Stats keeps sums, so fields add up)."""
    for f in ("rounds", "draft_rounds", "drafted", "accepted", "emitted", "draft_calls", "draft_s", "verify_s", "wall_s", "prefill_s"):
        setattr(total, f, getattr(total, f) + getattr(one, f))
    n = max(len(total.proposed_at), len(one.proposed_at))
    total.proposed_at = [a + b for a, b in zip(total.proposed_at + [0] * n, one.proposed_at + [0] * n)][:n]
    total.accepted_at = [a + b for a, b in zip(total.accepted_at + [0] * n, one.accepted_at + [0] * n)][:n]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_loop(model, drafter, prompt, k, tokens, eos, stats: Stats, adaptive=None, rule="exact") -> list[int]:
    """adaptive: None (fixed K), True (the CLI's --adaptive) or AdaptiveK keyword arguments."""
    drafter.reset()
    if adaptive is True:
        adaptive = dict(k_max=max(16, 2 * k), p_min=ADAPTIVE_P_MIN)
    controls = Controls(drafter, k=k, sampling=SamplingParams(0), rule=parse_rule(rule),
                        adaptive=AdaptiveK(start=k, **adaptive) if adaptive else None)
    out = []
    for r in generate(TargetState(model), prompt, controls, max_new_tokens=tokens, eos_ids=eos):
        stats.add(r)
        out += [t.id for t in r.tokens]
    return out


def run_hf(model, prompt, tokens, eos, **kwargs) -> tuple[float, list[int]]:
    ids = torch.tensor([prompt])
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens,
                             eos_token_id=list(eos), **kwargs)
    return time.perf_counter() - t, out[0, len(prompt):].tolist()


def bench_dtype(dtype, args) -> dict:
    loaded = load_model(None, torch.device("cpu"), dtype)
    model, tok = loaded.model, loaded.tokenizer
    eos = {model.generation_config.eos_token_id}
    drafters, memory = {"off": PlainDecoding()}, {}
    for key, mode, opts in (("quant", "quant", {}), ("lowrank", "lowrank", {"rank": args.rank}), ("lookup", "lookup", {}),
                            ("lookup-min1", "lookup", {"min_ngram": 1})):
        before, t = rss_bytes(), time.perf_counter()
        drafters[key] = build_drafter(mode, model, **opts)
        memory[key] = {"rss_growth_mb": (rss_bytes() - before) / 2**20, "build_s": time.perf_counter() - t,
                       "weight_mb": getattr(drafters[key], "weight_bytes", 0) / 2**20}
    k = args.k
    # name -> (drafter, K, adaptive, rule)
    chat_configs = {"off": ("off", 1, False, "exact")}
    for mode in args.chat_modes.split(","):
        chat_configs[f"{mode} K={k}"] = (mode, k, False, "exact")
    for mode in ("quant", "lookup"):
        chat_configs[f"{mode} adaptive"] = (mode, k, True, "exact")
    if args.approx:
        chat_configs[f"quant K={k} approx:0.5"] = ("quant", k, False, "approx:0.5")  # greedy: same text
    for p_min in args.p_min:  # llama.cpp-style confidence stop, with a fixed K and with the schedule
        chat_configs[f"quant K={k} p-min={p_min:g}"] = ("quant", k, dict(k_min=k, k_max=k, p_min=p_min), "exact")
        chat_configs[f"quant adaptive p-min={p_min:g}"] = ("quant", k, dict(k_max=max(16, 2 * k), p_min=p_min), "exact")
    if args.only:
        chat_configs = {n: c for n, c in chat_configs.items() if n == "off" or any(o in n for o in args.only.split(","))}
    repeat_configs = {"off": ("off", 1, False, "exact"), f"lookup K={k}": ("lookup", k, False, "exact"),
                      "lookup K=8": ("lookup", 8, False, "exact"), "lookup adaptive": ("lookup", k, True, "exact")}
    hf_repeat = {"hf-plain": {}, f"hf-lookup {args.hf_lookup}": {"prompt_lookup_num_tokens": args.hf_lookup}}
    encode = lambda text: list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False))  # noqa: E731
    workloads = {"chat": ([encode(p) for p in CHAT[: args.prompts]], chat_configs, {}, args.tokens),
                 "repeat": ([encode(p) for p in REPEAT], repeat_configs, hf_repeat, args.repeat_tokens)}
    # warm-up: first-call costs of every drafter
    for name, (mode, kk, adaptive, rule) in chat_configs.items():
        run_loop(model, drafters[mode], workloads["chat"][0][0], kk, 8, eos, Stats(), adaptive, rule)
    run_hf(model, workloads["chat"][0][0], 4, eos)
    results = {}
    for wname, (prompts, configs, hf, tokens) in workloads.items():
        if wname not in args.workloads.split(","):
            continue
        stats = {name: Stats() for name in configs}
        hf_time = {name: [0.0, 0] for name in hf}
        passes = {name: [] for name in [*configs, *hf]}  # tok/s of each (repeat, prompt) pass
        cpu_passes = {name: [] for name in passes}  # tokens per CPU second of this process (one thread)
        mismatches = []
        for _ in range(args.repeats):
            for pi, prompt in enumerate(prompts):
                ref = None
                for name, (mode, kk, adaptive, rule) in configs.items():
                    one = Stats()
                    cpu0 = time.process_time()
                    out = run_loop(model, drafters[mode], prompt, kk, tokens, eos, one, adaptive, rule)
                    cpu_passes[name].append(one.emitted / (time.process_time() - cpu0))
                    passes[name].append(one.tokens_per_s)
                    merge(stats[name], one)
                    ref = ref if ref is not None else out
                    if out != ref:
                        mismatches.append((name, pi))
                for name, kw in hf.items():
                    cpu0 = time.process_time()
                    secs, out = run_hf(model, prompt, tokens, eos, **kw)
                    cpu_passes[name].append(len(out) / (time.process_time() - cpu0))
                    hf_time[name][0] += secs
                    hf_time[name][1] += len(out)
                    passes[name].append(len(out) / secs)
                    if out != ref:
                        mismatches.append((name, pi))
        off = stats["off"]
        plain_ms = 1000 * off.wall_s / off.rounds
        def median_ratio(name, passes=passes):
            return statistics.median(a / b for a, b in zip(passes[name], passes["off"]))

        rows = {}
        for name, s in stats.items():
            mode = configs[name][0]
            rows[name] = {
                "tokens": s.emitted,
                "tokens_per_s": s.tokens_per_s,
                "speedup": s.tokens_per_s / off.tokens_per_s,
                "speedup_median": median_ratio(name),
                "cpu_speedup_median": median_ratio(name, cpu_passes),
                "acceptance": s.acceptance_rate,
                "mean_accepted_length": s.mean_accepted_length,
                "target_calls_per_token": s.target_calls_per_token,
                "draft_step_cost": (1000 * s.draft_s / s.draft_calls / plain_ms) if s.draft_calls else None,
                "verify_cost": 1000 * s.verify_s / s.rounds / plain_ms,
                "mean_k": sum(s.proposed_at) / s.rounds if s.rounds else 0,
                "extra_mb": getattr(drafters[mode], "extra_bytes", 0) / 2**20,
            }
        for name, (secs, count) in hf_time.items():
            rows[name] = {"tokens": count, "tokens_per_s": count / secs, "speedup": count / secs / off.tokens_per_s,
                          "speedup_median": median_ratio(name), "cpu_speedup_median": median_ratio(name, cpu_passes)}
        results[wname] = {"rows": rows, "plain_step_ms": plain_ms, "greedy_mismatches": mismatches, "tokens": tokens}
    return {"memory": memory, **results}


def fmt(v, digits=3):
    return "-" if v is None else f"{v:.{digits}g}" if isinstance(v, float) else str(v)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeat-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--rank", type=float, default=None, help="lowrank rank (default: tuned or built-in)")
    ap.add_argument("--hf-lookup", type=int, default=5)
    ap.add_argument("--p-min", type=float, nargs="*", default=[])
    ap.add_argument("--chat-modes", default="quant,lowrank,lookup,lookup-min1")
    ap.add_argument("--approx", action="store_true", help="also quant with approx:0.5 (greedy: the same text)")
    ap.add_argument("--only", default=None, help="comma-separated substrings: keep only these chat configurations (and off)")
    ap.add_argument("--workloads", default="chat,repeat")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    meta = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
            "torch": torch.__version__, "tokens": args.tokens, "repeat_tokens": args.repeat_tokens, "k": args.k, "greedy": True}
    out = {"meta": meta}
    for name in args.dtypes.split(","):
        out[name] = bench_dtype(getattr(torch, name), args)
        for wname in args.workloads.split(","):
            w = out[name][wname]
            print(f"\n## {name} / {wname}  (plain step {w['plain_step_ms']:.1f} ms; greedy mismatches: {w['greedy_mismatches'] or 'none'})")
            print("| config | tok/s | speedup (total) | speedup (median of passes) | CPU-time speedup (median) | acceptance | mean accepted len | target calls/token | draft step cost | verify cost | mean K | extra MB |")
            print("|---|---|---|---|---|---|---|---|---|---|---|---|")
            for cname, r in w["rows"].items():
                print(f"| {cname} | {fmt(r['tokens_per_s'])} | {fmt(r['speedup'])} | {fmt(r['speedup_median'])} | {fmt(r['cpu_speedup_median'])} | {fmt(r.get('acceptance'))} | "
                      f"{fmt(r.get('mean_accepted_length'))} | {fmt(r.get('target_calls_per_token'))} | {fmt(r.get('draft_step_cost'))} | "
                      f"{fmt(r.get('verify_cost'))} | {fmt(r.get('mean_k'))} | {fmt(r.get('extra_mb'))} |")
        print("memory at build:", json.dumps(out[name]["memory"]))
    print("\n", json.dumps(meta))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
