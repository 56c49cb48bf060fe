"""Turn a finished bench into DIR/report.md (also printed), DIR/results.json and DIR/speedup.png."""

from __future__ import annotations

import json
from pathlib import Path

from specchat.fmt import num as fmt
from specchat.store import write_atomic

PLOT_HINT = "speedup.png skipped: matplotlib is not installed (pip install -e '.[plot]' in the specchat source folder, or pip install matplotlib)"


def fmt_spread(s: dict, scale: float = 1.0) -> str:
    if not s or s["median"] is None:
        return "-"
    if s["n"] == 1:
        return fmt(s["median"], scale=scale)
    return f"{fmt(s['median'], scale=scale)} ({fmt(s['min'], scale=scale)}–{fmt(s['max'], scale=scale)})"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def memory_cell(row: dict) -> str:
    """Peak memory, and what building the mode's drafter added (an int8 or low-rank copy of the target)."""
    extra = row.get("drafter_memory_mb")
    return fmt(row["memory_mb"]) + (f" (+{fmt(extra)})" if extra and extra >= 1 else "")


def quality_cell(row: dict, checks: dict) -> str:
    """Greedy identity for exact greedy configs, the distribution test for sampled ones, quality for approximate."""
    label = row["config"]
    if not row["exact"]:
        q = next((x for x in checks["approximate"] if x["config"] == label), None)
        if not q:
            return "approximate"
        return f"approx: agree {fmt(q['greedy_agreement'])}, logp {fmt(q['mean_logprob'])} (off {fmt(q['plain_mean_logprob'])})"
    if row["mode"] == "off":
        return "baseline"
    if row["temperature"] == 0:
        bad = [f for f in checks["greedy_identity"]["failures"] if f["config"] == label]
        return "identical to off" if not bad else "**MISMATCH** on " + ", ".join(sorted({f["prompt"] for f in bad}))
    v = next((x for x in checks["distribution"] if x["mode"] == row["mode"] and x["temperature"] == row["temperature"]), None)
    return f"verify {v['verdict']} (p={fmt(v['p_value'], 2)})" if v else "-"


def markdown(results: dict) -> str:
    s, m, checks = results["settings"], results["machine"], results["checks"]
    hardware = m["gpu"] or f"{m['cpu']}, {m['cores']} cores" + (f", {m['memory_gb']} GB" if m.get("memory_gb") else "")
    if m.get("load_average"):
        hardware += f", load average {m['load_average'][0]} at the end"
    out = [
        "# specchat bench",
        "",
        f"- models: target `{s['target']}`" + (f", draft `{s['draft']}`" if s["draft"] else ", no draft model"),
        f"- hardware: {hardware}; device {m['device']}, dtype {m['dtype']}, {m['torch_threads']} torch threads; "
        f"torch {m['torch']}, transformers {m['transformers']}",
        f"- workload: {len(results['prompts'])} prompts ({', '.join(p['name'] for p in results['prompts'])}), "
        f"max {s['max_new_tokens']} new tokens, {s['repeat']} repeat(s), interleaved after a warm-up, "
        "the order rotated per prompt; "
        f"temperature {', '.join(f'{t:g}' for t in s['temperatures'])} (0 = greedy), top-k off, top-p 1, seed {s['seed']}",
        *(["- mode auto started from the rates earlier sessions on this setup learnt (--learnt), and saved its own"]
          if s.get("learnt") and "auto" in s["modes"] else []),
        "- tok/s: new tokens / decode time (prefill excluded), median (min–max) over prompts × repeats. "
        "speedup: median of paired ratios to `off` at the same temperature on the same prompt, same run. "
        "predicted: tokens per round / (draft + verify time per round), measured (first rounds left out), the time "
        "relative to one plain target step (docs/ARCHITECTURE.md).",
        "",
    ]
    rows = [r for r in results["configs"] if not r["peer"]]
    out.append(table(
        ["config", "tok/s", "speedup", "predicted", "meas/pred", "target calls/tok", "acceptance", "mean acc. len",
         "TTFT ms", "draft ms/round", "verify ms/round", "other ms/round", "c", "v", "memory MB (+drafter)", "quality"],
        [[r["config"], fmt_spread(r["tokens_per_s"]), fmt(r["speedup"]), fmt(r["predicted_speedup"]),
          fmt(r["measured_over_predicted"]), fmt(r["target_calls_per_token"]), fmt(r["acceptance_rate"]),
          fmt(r["mean_accepted_length"]), fmt_spread(r["time_to_first_token_s"], 1000), fmt(r["draft_ms_per_round"]),
          fmt(r["verify_ms_per_round"]), fmt(r["overhead_ms_per_round"]), fmt(r["draft_cost"]), fmt(r["verify_cost"]),
          memory_cell(r), quality_cell(r, checks)] for r in rows],
    ))
    auto_lines = []
    for r in rows:
        if r.get("k_chosen"):
            chosen = ", ".join(f"{mode} {k}" for mode, k in r["k_chosen"].items())
            auto_lines.append(f"- {r['config']}: K measured per mode as the chat's `-k auto` (from {r['k']}), one measurement "
                              f"over all its runs; the K it chose last: {chosen}")
        best = r.get("vs_best")
        if best and best["ratio"] is not None:
            by_prompt = ", ".join(f"{p} {fmt(v)}" for p, v in best.get("by_prompt", {}).items())
            auto_lines.append(f"- {r['config']} against the fastest single mode, `{best['config']}`: {fmt(best['ratio'])}x "
                              "(median of paired ratios, same prompt and repeat)" + (f"; by prompt: {by_prompt}" if by_prompt else ""))
        if r.get("time_by_mode"):
            shares = ", ".join(f"{mode} {100 * share:.0f}%" for mode, share in r["time_by_mode"].items())
            auto_lines.append(f"- {r['config']}'s decode time by the mode it ran: {shares} (every round, with its reason, "
                              "is in results.json)")
    if auto_lines:
        out += [""] + auto_lines
    if results["peers"]:
        out += ["", "## Hugging Face peers (same models, prompts, K and sampling; end-to-end tok/s including the prefill)", ""]
        out.append(table(
            ["specchat", "HF peer", "specchat tok/s", "HF tok/s", "specchat / HF", "specchat speedup vs off",
             "HF speedup vs generate()", "HF target calls/tok", "HF TTFT ms"],
            [[p["specchat"] or "-", p["peer"], fmt_spread(p["specchat_e2e_tokens_per_s"]), fmt_spread(p["peer_e2e_tokens_per_s"]),
              fmt(p["ratio"]), fmt(p["specchat_e2e_speedup"]), fmt(p["peer_speedup"]), fmt(p["peer_target_calls_per_token"]),
              fmt_spread(p["peer_time_to_first_token_s"], 1000)] for p in results["peers"]],
        ))
    out += ["", "## Checks", ""]
    identity = checks["greedy_identity"]
    failures = identity["failures"]
    verdicts = {"pass": f"PASS ({identity['compared']} runs identical)", "not run": "not run (no exact mode besides off at T=0)"}
    out.append("- greedy identity (every exact mode at T=0 vs plain greedy, token for token): " + (
        verdicts[identity["verdict"]] if identity["verdict"] in verdicts else "**FAIL**: " + "; ".join(
            f"{f['config']} on prompt {f['prompt']!r} (repeat {f['repeat']}) differs from token {f['first_difference']}"
            for f in failures)))
    if failures and m["dtype"] != "float32":
        out.append(f"  (in {m['dtype']}, one forward over K+1 positions rounds differently from K+1 one-token forwards, "
                   "so a near-tied argmax can flip; rerun with --dtype float32 to tell rounding from a bug)")
    for v in checks["distribution"]:
        out.append(f"- distribution test {v['config']} on {v['prompt']!r}: {v['verdict'].upper()} "
                   f"(p={fmt(v['p_value'])}, TV {fmt(v['total_variation'])}, {v['samples']} draws of {v['tokens']} tokens"
                   + (" and as many plain ones)" if v.get("test_kind") == "homogeneity" else " against the target's exact probabilities)"))
    if checks.get("hf_greedy"):
        h = checks["hf_greedy"]
        out.append(f"- plain greedy vs HF generate() greedy: {h['identical']}/{h['compared']} identical"
                   + (f" (differ on {', '.join(h['differ_on'])})" if h["differ_on"] else ""))
    for mode, why in results.get("skipped_modes", {}).items():
        out.append(f"- mode {mode} not measured: {why}")
    return "\n".join(out) + "\n"


def plot(results: dict, path: Path) -> bool:
    """Speedup per mode against K, one panel per temperature; HF peers dashed. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    temps = results["settings"]["temperatures"]
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        rows = [r for r in results["configs"] if r["temperature"] == t and r["k"] > 0 and not r.get("k_measured")]
        colours = {}
        for name in dict.fromkeys((r["mode"], r["accept"]) for r in rows):
            pts = sorted((r["k"], r["hf_speedup"] if r["peer"] else r["speedup"]) for r in rows if (r["mode"], r["accept"]) == name)
            pts = [(k, s) for k, s in pts if s is not None]
            if pts:
                label = name[0] + ("" if name[1] == "exact" else f" ({name[1]})") + (" (vs HF generate)" if name[0].startswith("hf-") else "")
                (line,) = ax.plot(*zip(*pts), marker="o", linestyle="--" if name[0].startswith("hf-") else "-", label=label)
                colours[name] = line.get_color()
        measured = [r for r in results["configs"] if r["temperature"] == t and r.get("k_measured") and r["speedup"] is not None]
        for i, r in enumerate(measured):  # K measured has no one K: a level line in its mode's colour
            ax.axhline(r["speedup"], linestyle=":", color=colours.get((r["mode"], r["accept"]), f"C{len(colours) + i}"),
                       label=f"{r['mode']}, K measured" + ("" if r["accept"] == "exact" else f" ({r['accept']})"))
        if ks := results["settings"]["draft_lens"]:
            ax.set_xticks(ks)
            ax.set_xlim(min(ks) - 1, max(ks) + 1)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xlabel("draft length K")
        ax.set_ylabel("speedup over plain decoding")
        ax.set_title(f"T={t:g}")
        ax.legend(fontsize=8)
    s = results["settings"]
    fig.suptitle(f"{s['target']} ({results['machine']['device']}, {results['machine']['dtype']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write(results: dict, out_dir: Path) -> tuple[str, str | None]:
    """Write the three outputs; returns the Markdown and a note when the plot was skipped."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = markdown(results)
    write_atomic(out_dir / "report.md", text)
    write_atomic(out_dir / "results.json", json.dumps(results, indent=1))
    note = None if plot(results, out_dir / "speedup.png") else PLOT_HINT
    return text, note
