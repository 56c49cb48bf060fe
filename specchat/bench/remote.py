"""`specchat bench --server A --server B ...`: the same prompts through each serving configuration (and, with
--target, through local modes on the same model), interleaved, so every ratio compares runs made side by side.

Per run: tokens/s and the first token's latency as this client measures them, the steps rebuilt from the
server's counters and whether they matched its final counters. Per configuration: medians, and the median of the
per-run tokens/s ratios to the baseline (a configuration that does not draft: a plain server, or local mode off).
"""

from __future__ import annotations

import json
import statistics
from datetime import datetime, timezone
from pathlib import Path

from specchat.engine.metrics import Stats
from specchat.store import write_atomic


def run_all(configs: dict, prompts: list[dict], repeat: int, steps) -> list[dict]:
    """configs: name -> a session (RemoteSession or Session); each prompt once per configuration per pass, the
    configurations in turn, so load changes hit all of them alike (the order rotated from one prompt to the next, as
    runner.run_all does)."""
    runs, names = [], list(configs)
    for rep in range(repeat):
        for i, prompt in enumerate(prompts):
            shift = (rep * len(prompts) + i) % len(names)
            for name in names[shift:] + names[:shift]:
                session = configs[name]
                steps(f"pass {rep + 1}/{repeat} · {prompt['name']} · {name}")
                seen = len(session.warnings)  # a warning after this belongs to this run
                messages = [{"role": "user", "content": prompt["prompt"]}]
                rounds = list(session.complete(session.chat_prompt(messages)))
                runs.append({
                    "config": name, "prompt": prompt["name"], "pass": rep, "text": session.turns[-1].reply,
                    "rounds": len(rounds), "stats": Stats.of(rounds).summary(),
                    "reconciled": len(session.warnings) == seen,
                })
    return runs


def baseline_of(configs: dict, runs: list[dict]) -> str:
    """A server that does not speculate (its /slots say so), else local mode off, else a configuration that never
    drafted in this run (an n-gram drafter that found nothing), else the first."""
    plain = [n for n, s in configs.items() if s.info.remote and s.info.server.speculative is None]
    local_off = [n for n, s in configs.items() if not s.info.remote and s.mode == "off"]
    never = [n for n in configs if all(r["stats"]["num_draft_tokens"] == 0 for r in runs if r["config"] == n)]
    return (plain + local_off + never + list(configs))[0]


def summarise(configs: dict, runs: list[dict]) -> dict:
    base = baseline_of(configs, runs)
    by_key = {(r["prompt"], r["pass"], r["config"]): r for r in runs}
    rows = []
    for name, session in configs.items():
        mine = [r for r in runs if r["config"] == name]
        ratios = []
        for r in mine:
            ref = by_key.get((r["prompt"], r["pass"], base))
            if ref and r["stats"]["tokens_per_s"] and ref["stats"]["tokens_per_s"]:
                ratios.append(r["stats"]["tokens_per_s"] / ref["stats"]["tokens_per_s"])
        total, info = session.total, session.info
        same_text = [r["text"] == by_key[(r["prompt"], r["pass"], base)]["text"] for r in mine if (r["prompt"], r["pass"], base) in by_key]
        rows.append({
            "config": name,
            "engine": info.engine,
            "what": info.server.label if info.remote else f"local {session.mode} on {info.engine}",
            "median_tokens_per_s": statistics.median(r["stats"]["tokens_per_s"] or 0 for r in mine),
            "median_ratio_to_baseline": statistics.median(ratios) if ratios else None,
            "median_first_token_s": statistics.median(r["stats"]["time_to_first_token_s"] or 0 for r in mine),
            "acceptance_rate": total.acceptance_rate,
            "mean_accepted_length": total.mean_accepted_length,
            "target_calls_per_token": total.target_calls_per_token,
            "runs_reconciled": sum(r["reconciled"] for r in mine),
            "runs": len(mine),
            "same_text_as_baseline": sum(same_text),
        })
    return {"baseline": base, "rows": rows}


def report(summary: dict, meta: dict) -> str:
    def f(x, spec=".2f"):
        return "–" if x is None else format(x, spec)

    lines = [
        "# specchat bench: serving engines", "",
        f"{meta['created']} · {meta['prompts']} prompts × {meta['repeat']} passes · max {meta['max_new_tokens']} tokens · "
        f"{meta['sampling']} · client load average {meta['load_average']}", "",
        f"Baseline: **{summary['baseline']}** (ratios are medians of per-run tokens/s ratios, runs interleaved). Times are "
        "measured by this client; acceptance and steps come from each server's counters.", "",
        "| config | what | tok/s | × baseline | 1st token s | acceptance | mean acc. len | calls/token | steps match | same text |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:
        lines.append(f"| {r['config']} | {r['what']} | {f(r['median_tokens_per_s'], '.1f')} | {f(r['median_ratio_to_baseline'])} | "
                     f"{f(r['median_first_token_s'], '.3f')} | {f(r['acceptance_rate'])} | {f(r['mean_accepted_length'])} | "
                     f"{f(r['target_calls_per_token'], '.3f')} | {r['runs_reconciled']}/{r['runs']} | {r['same_text_as_baseline']}/{r['runs']} |")
    lines += ["", "*same text*: the reply equals the baseline's on the same prompt and pass (expected for every "
              "configuration when greedy and the model is the same)."]
    return "\n".join(lines) + "\n"


def write(out_dir: Path, summary: dict, meta: dict, runs: list[dict]) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    text = report(summary, meta)
    write_atomic(out_dir / "report.md", text)
    write_atomic(out_dir / "results.json", json.dumps({"meta": meta, **summary, "runs": runs}, indent=1, default=str))
    return text


def meta_for(prompts: list[dict], sampling: str, *, repeat: int, max_new_tokens: int, servers: list[str], target: str | None,
             modes: str | None) -> dict:
    import os

    return {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "prompts": len(prompts), "repeat": repeat,
        "max_new_tokens": max_new_tokens, "sampling": sampling,
        "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()), "servers": servers,
        "target": target, "modes": modes,
    }
