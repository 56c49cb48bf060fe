"""Run every configuration on the same prompts in one process, interleaved, and keep every raw measurement.

Interleaving (for each repeat and prompt, one generation of every configuration in turn) spreads the
noise of a shared machine over all configurations instead of letting it fall on whichever ran last; the turn
order rotates from one prompt to the next, so no configuration always runs right after the same other one.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from specchat.bench.peers import early_exit_layer, run_peer
from specchat.engine.acceptance import parse_rule
from specchat.engine.draft_length import MeasuredK
from specchat.engine.loop import Controls, generate
from specchat.engine.loop import clock
from specchat.engine.metrics import Stats, speedup_model
from specchat.engine.sampling import SamplingParams
from specchat.engine.target import TargetState
from specchat.machine import hardware_info, memory_mb, reset_peak
from specchat.verify import run_verify

WARMUP_TOKENS = 8

# specchat mode -> the Hugging Face implementation of the same idea (see peers.py)
PEER_OF = {"off": "hf-generate", "draft": "hf-assisted", "lookup": "hf-lookup", "earlyexit": "hf-earlyexit"}


@dataclass(frozen=True)
class Config:
    """One measured configuration: a specchat mode or an HF peer, K, temperature and acceptance rule."""

    mode: str  # specchat mode, or a peer name from PEER_OF's values
    k: int  # draft length; 0 for plain decoding; where measured, the K it starts from
    temperature: float
    accept: str = "exact"
    measured: bool = False  # K measured (MeasuredK, the chat's -k auto): one measurement over all the config's runs

    @property
    def is_peer(self) -> bool:
        return self.mode.startswith("hf-")

    @property
    def exact(self) -> bool:
        return self.is_peer or parse_rule(self.accept).exact

    @property
    def label(self) -> str:
        parts = [self.mode]
        if self.k:
            parts.append("K=auto" if self.measured else f"K={self.k}")
        parts.append(f"T={self.temperature:g}")
        if self.accept != "exact":
            parts.append(self.accept)
        return " ".join(parts)


@dataclass
class Prompt:
    name: str
    kind: str
    text: str
    ids: list[int] = field(default_factory=list)


@dataclass
class Context:
    """What every measured generation needs: models, drafters, stop tokens, limits."""

    target: object  # LoadedModel
    draft: object | None  # LoadedModel
    device: torch.device
    drafters: dict  # mode -> Drafter
    eos_ids: set[int]
    max_new_tokens: int
    seed: int = 0
    exit_layer: int | None = None  # for the hf-earlyexit peer
    stats: dict = field(default_factory=dict)  # config label -> Stats over all its measured generations
    steady: dict = field(default_factory=dict)  # the same without each generation's first round (draft prefill)
    measured: dict = field(default_factory=dict)  # config label -> its MeasuredK, kept from run to run as a chat keeps it


def build_configs(modes, ks, temperatures, accepts, *, peers: bool, measured_from: int | None = None) -> list[Config]:
    """Plain decoding once per temperature, every other mode for every K and rule, and with `measured_from` with K
    measured from that K; with `peers`, the HF implementation of each requested mode that has one (PEER_OF), at the
    same fixed K and temperature."""
    configs = []
    for t in temperatures:
        configs.append(Config("off", 0, t))
        if peers:
            configs.append(Config("hf-generate", 0, t))
        for mode in modes:
            if mode == "off":
                continue
            for k in ks:
                configs += [Config(mode, k, t, a) for a in accepts]
            if measured_from:
                configs += [Config(mode, measured_from, t, a, measured=True) for a in accepts]
        if peers:
            for k in ks:
                configs += [Config(PEER_OF[m], k, t) for m in modes if m != "off" and m in PEER_OF]
    return configs


def run_seed(ctx: Context, prompt_index: int, repeat: int) -> int:
    """The same seed for every configuration on one prompt and repeat, so sampled runs are paired."""
    return ctx.seed + 1000 * repeat + prompt_index


def run_specchat(ctx: Context, cfg: Config, ids: list[int], seed: int, max_new_tokens: int, *, warmup: bool = False) -> tuple[dict, list]:
    """One generation through the engine, from a cold cache (no prefix reuse between runs). A measured K carries
    over from the configuration's earlier runs (not its warm-up's), as it does from reply to reply in a chat."""
    drafter = ctx.drafters[cfg.mode]
    drafter.reset()
    state = TargetState(ctx.target.model)
    adaptive = None
    if cfg.measured:
        adaptive = MeasuredK(start=cfg.k) if warmup else ctx.measured.setdefault(cfg.label, MeasuredK(start=cfg.k))
    controls = Controls(drafter, k=cfg.k, sampling=SamplingParams(cfg.temperature), rule=parse_rule(cfg.accept), adaptive=adaptive)
    generator = torch.Generator(device=state.device).manual_seed(seed)
    reset_peak(ctx.device)
    records, rounds = [], []
    t0 = clock(ctx.device)
    for record in generate(state, ids, controls, max_new_tokens=max_new_tokens, eos_ids=ctx.eos_ids, generator=generator):
        records.append(record)
        rounds.append(round_row(record, getattr(drafter, "why", None)))  # mode auto: why it ran this round's mode
    elapsed = clock(ctx.device) - t0
    if hasattr(drafter, "save"):  # mode auto with --learnt: keep the rates for the next session, as the chat does
        drafter.save()
    stats = Stats.of(records)
    tokens = [t.id for r in records for t in r.tokens]
    run = {
        "tokens": tokens,
        "new_tokens": len(tokens),
        "e2e_s": elapsed,
        "e2e_tokens_per_s": len(tokens) / elapsed if elapsed else None,
        "tokens_per_s": stats.tokens_per_s,  # decode only, prefill excluded
        "time_to_first_token_s": stats.time_to_first_token_s,
        "stop_reason": records[-1].stop_reason if records else None,
        "memory_mb": memory_mb(ctx.device),
        "stats": stats.summary(),
        "rounds": rounds,
    }
    return run, records


def round_row(record, reason: str | None) -> dict:
    """One round as results.json keeps it: where a run's time went, round by round (mode auto: which mode, and why)."""
    row = {"mode": record.mode, "drafted": record.drafted, "accepted": record.accepted, "emitted": record.emitted,
           "draft_ms": 1000 * record.draft_s, "verify_ms": 1000 * record.verify_s, "wall_ms": 1000 * record.wall_s}
    return {**row, "reason": reason} if reason is not None else row


def run_one(ctx: Context, cfg: Config, ids: list[int], seed: int, max_new_tokens: int, *, warmup: bool = False) -> dict:
    if cfg.is_peer:
        return run_peer(ctx, cfg, ids, seed, max_new_tokens)
    run, records = run_specchat(ctx, cfg, ids, seed, max_new_tokens, warmup=warmup)
    if not warmup:
        stats, steady = ctx.stats.setdefault(cfg.label, Stats()), ctx.steady.setdefault(cfg.label, Stats())
        for r in records:
            stats.add(r)
            if r.index > 0:
                steady.add(r)
    return run


def run_all(ctx: Context, configs: list[Config], prompts: list[Prompt], repeat: int, progress=None) -> list[dict]:
    """Warm up every configuration once, then for each repeat and prompt run all configurations in turn, the order
    rotated by one from each prompt to the next."""
    step = progress or (lambda _msg: None)
    for cfg in configs:
        step(f"warm-up {cfg.label}")
        run_one(ctx, cfg, prompts[0].ids, ctx.seed, min(WARMUP_TOKENS, ctx.max_new_tokens), warmup=True)
    runs = []
    for r in range(repeat):
        for i, prompt in enumerate(prompts):
            shift = (r * len(prompts) + i) % len(configs)
            for cfg in configs[shift:] + configs[:shift]:
                step(f"{cfg.label} on {prompt.name} ({r + 1}/{repeat})")
                run = run_one(ctx, cfg, prompt.ids, run_seed(ctx, i, r), ctx.max_new_tokens)
                runs.append({"config": cfg.label, "mode": cfg.mode, "k": cfg.k, "k_measured": cfg.measured, "temperature": cfg.temperature,
                             "accept": cfg.accept, "prompt": prompt.name, "repeat": r, **run})
    return runs


# ---------------------------------------------------------------- aggregation


def spread(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def paired_ratios(runs: list[dict], label: str, base: str, key: str) -> dict[tuple[str, int], float]:
    """(prompt, repeat) -> run[key] / base run[key] on the same prompt and repeat."""
    by_key = {(r["prompt"], r["repeat"]): r[key] for r in runs if r["config"] == base}
    return {(r["prompt"], r["repeat"]): r[key] / by_key[(r["prompt"], r["repeat"])] for r in runs
            if r["config"] == label and r[key] and by_key.get((r["prompt"], r["repeat"]))}


def paired_ratio(runs: list[dict], label: str, base: str, key: str) -> float | None:
    """Median over (prompt, repeat) of run[key] / base run[key]: prompt-to-prompt variation cancels."""
    ratios = paired_ratios(runs, label, base, key)
    return statistics.median(ratios.values()) if ratios else None


def summarise(ctx: Context, configs: list[Config], runs: list[dict]) -> list[dict]:
    """Per configuration: tokens/s median and spread, speedups, engine statistics, predicted speedup."""
    rows = []
    for cfg in configs:
        mine = [r for r in runs if r["config"] == cfg.label]
        plain = Config("off", 0, cfg.temperature).label
        row = {
            "config": cfg.label, "mode": cfg.mode, "k": cfg.k, "k_measured": cfg.measured, "temperature": cfg.temperature, "accept": cfg.accept,
            "exact": cfg.exact, "peer": cfg.is_peer, "generations": len(mine),
            "new_tokens": sum(r["new_tokens"] for r in mine),
            "tokens_per_s": spread([r["tokens_per_s"] for r in mine]),
            "e2e_tokens_per_s": spread([r["e2e_tokens_per_s"] for r in mine]),
            "time_to_first_token_s": spread([r["time_to_first_token_s"] for r in mine]),
            "memory_mb": max((r["memory_mb"] for r in mine), default=None),
            "speedup": None, "e2e_speedup": paired_ratio(runs, cfg.label, plain, "e2e_tokens_per_s"),
        }
        if cfg.is_peer:
            hf_plain = Config("hf-generate", 0, cfg.temperature).label
            row["hf_speedup"] = paired_ratio(runs, cfg.label, hf_plain, "e2e_tokens_per_s")
            calls = sum(r["target_calls"] for r in mine)
            row["target_calls_per_token"] = calls / row["new_tokens"] if row["new_tokens"] else None
        else:
            row["speedup"] = paired_ratio(runs, cfg.label, plain, "tokens_per_s")
            stats = ctx.stats.get(cfg.label, Stats()).summary()
            row.update({key: stats[key] for key in (
                "acceptance_rate", "mean_accepted_length", "target_calls_per_token", "draft_calls_per_token",
                "per_position_acceptance", "draft_ms_per_round", "verify_ms_per_round", "rounds")})
            row["overhead_ms_per_round"] = _overhead_ms(ctx.stats.get(cfg.label))
            row.update(predict(cfg, ctx.steady.get(cfg.label), ctx.steady.get(plain), row["speedup"]))
            if cfg.measured and cfg.label in ctx.measured:  # the K it chose last, per mode run (auto: each it ran)
                row["k_chosen"] = dict(ctx.measured[cfg.label].best)
        rows.append(row)
    for row in rows:
        if row["mode"] == "auto" and not row["peer"]:
            row["vs_best"] = against_best(rows, row, runs)
            row["time_by_mode"] = time_by_mode(runs, row["config"])
    return rows


def against_best(rows: list[dict], auto: dict, runs: list[dict]) -> dict | None:
    """auto paired with the fastest exact single mode at its K and temperature (plain decoding included): what auto
    is for. Paired directly rather than as a ratio of two speedups, which carries the noise of three configurations."""
    rivals = [r for r in rows if not r["peer"] and r["exact"] and r["mode"] != "auto" and r["temperature"] == auto["temperature"]
              and (r["mode"] == "off" or (r["k"], r["k_measured"]) == (auto["k"], auto["k_measured"])) and r["speedup"] is not None]
    if not rivals:
        return None
    best = max(rivals, key=lambda r: r["speedup"])
    ratios = paired_ratios(runs, auto["config"], best["config"], "tokens_per_s")
    prompts = dict.fromkeys(prompt for prompt, _ in ratios)  # in the order they ran
    by_prompt = {p: statistics.median(v for (q, _), v in ratios.items() if q == p) for p in prompts}
    return {"config": best["config"], "ratio": statistics.median(ratios.values()) if ratios else None, "by_prompt": by_prompt}


def time_by_mode(runs: list[dict], label: str) -> dict[str, float]:
    """The share of a configuration's decode time (its runs' rounds after the first, as tok/s counts them) spent in
    each mode's rounds: for mode auto, where its time went."""
    seconds: dict[str, float] = {}
    for run in runs:
        if run["config"] == label:
            for r in run.get("rounds", [])[1:]:
                seconds[r["mode"]] = seconds.get(r["mode"], 0.0) + r["wall_ms"]
    total = sum(seconds.values())
    return {mode: s / total for mode, s in sorted(seconds.items(), key=lambda kv: -kv[1])} if total else {}


def _overhead_ms(stats: Stats | None) -> float | None:
    """Round wall time spent outside the draft and verify timers (building token events, bookkeeping)."""
    if not stats or not stats.rounds:
        return None
    return 1000 * (stats.decode_s - stats.draft_s - stats.verify_s) / stats.rounds


def predict(cfg: Config, stats: Stats | None, plain: Stats | None, measured: float | None) -> dict:
    """The speedup model (engine.metrics) with c and v measured in this run relative to one plain target
    step (mode off at the same temperature).

    `stats` should leave out each generation's first round: a model drafter encodes the whole prompt
    there, a one-off cost (it shows in TTFT) that is not the per-step cost the model means.
    """
    model = speedup_model(stats, plain.plain_step_s if plain else None) if cfg.mode != "off" else None
    if model is None:
        return {"plain_step_ms": None, "draft_cost": None, "verify_cost": None, "predicted_speedup": None,
                "measured_over_predicted": None}
    return {"plain_step_ms": 1000 * model.plain_step_s, "draft_cost": model.draft_cost, "verify_cost": model.verify_cost,
            "predicted_speedup": model.predicted,
            "measured_over_predicted": measured / model.predicted if measured and model.predicted else None}


def peer_pairs(rows: list[dict]) -> list[dict]:
    """Each HF peer beside the specchat configuration that does the same thing (if it was measured)."""
    inverse = {v: k for k, v in PEER_OF.items()}
    pairs = []
    for r in rows:
        if not r["peer"]:
            continue
        mode = inverse[r["mode"]]
        ours = next((x for x in rows if not x["peer"] and x["mode"] == mode and x["k"] == r["k"] and not x["k_measured"]
                     and x["temperature"] == r["temperature"] and x["accept"] == "exact"), None)
        ratio = None
        if ours and ours["e2e_tokens_per_s"]["median"] and r["e2e_tokens_per_s"]["median"]:
            ratio = ours["e2e_tokens_per_s"]["median"] / r["e2e_tokens_per_s"]["median"]
        pairs.append({
            "specchat": ours["config"] if ours else None, "peer": r["config"], "ratio": ratio,
            "specchat_e2e_tokens_per_s": ours["e2e_tokens_per_s"] if ours else None,
            "peer_e2e_tokens_per_s": r["e2e_tokens_per_s"],
            "specchat_e2e_speedup": ours["e2e_speedup"] if ours else None,
            "peer_speedup": r["hf_speedup"],
            "peer_target_calls_per_token": r["target_calls_per_token"],
            "peer_time_to_first_token_s": r["time_to_first_token_s"],
        })
    return pairs


# ---------------------------------------------------------------- quality checks


def greedy_identity(configs: list[Config], runs: list[dict]) -> dict:
    """Every exact specchat mode at temperature 0 must reproduce plain greedy output token for token.

    {"verdict": "pass" | "fail" | "not run" (no exact greedy mode besides off), "compared": runs compared,
    "failures": [{"config", "prompt", "repeat", "first_difference"}]}"""
    plain = {(r["prompt"], r["repeat"]): r["tokens"] for r in runs if r["config"] == Config("off", 0, 0.0).label}
    failures, compared = [], 0
    for cfg in configs:
        if cfg.is_peer or cfg.mode == "off" or cfg.temperature != 0 or not cfg.exact:
            continue
        for r in runs:
            if r["config"] != cfg.label:
                continue
            ref = plain.get((r["prompt"], r["repeat"]))
            if ref is None:
                continue
            compared += 1
            if r["tokens"] != ref:
                at = next((i for i, (a, b) in enumerate(zip(r["tokens"], ref)) if a != b), min(len(ref), len(r["tokens"])))
                failures.append({"config": cfg.label, "prompt": r["prompt"], "repeat": r["repeat"], "first_difference": at})
    verdict = "fail" if failures else "pass" if compared else "not run"
    return {"verdict": verdict, "compared": compared, "failures": failures}


def hf_greedy_match(runs: list[dict]) -> dict | None:
    """Does plain specchat greedy equal HF generate greedy? (informational: batching can flip near-ties in bf16)"""
    hf = {(r["prompt"], r["repeat"]): r["tokens"] for r in runs if r["config"] == Config("hf-generate", 0, 0.0).label}
    if not hf:
        return None
    ours = [r for r in runs if r["config"] == Config("off", 0, 0.0).label and (r["prompt"], r["repeat"]) in hf]
    differ = sorted({r["prompt"] for r in ours if r["tokens"] != hf[(r["prompt"], r["repeat"])]})
    return {"compared": len(ours), "identical": len(ours) - sum(r["tokens"] != hf[(r["prompt"], r["repeat"])] for r in ours),
            "differ_on": differ}


@torch.inference_mode()
def mean_logprob(model, prompt_ids: list[int], output_ids: list[int]) -> float | None:
    """Mean log-probability of `output_ids` under the target (temperature 1) after the prompt."""
    if not output_ids:
        return None
    ids = torch.tensor([prompt_ids + output_ids], device=model.device)
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()  # [N, V]
    logp = torch.log_softmax(logits, dim=-1)
    return float(logp[torch.arange(len(output_ids)), torch.tensor(output_ids, device=model.device)].mean())


def approximate_quality(ctx: Context, configs: list[Config], runs: list[dict], prompts: list[Prompt]) -> list[dict]:
    """Approximate rules: agreement with the target's greedy output, and mean target log-prob (vs plain)."""
    ids_of = {p.name: p.ids for p in prompts}
    approx = [c for c in configs if not c.exact]
    out = []
    for cfg in approx:
        plain = Config("off", 0, cfg.temperature).label
        greedy = {r["prompt"]: r["tokens"] for r in runs if r["config"] == Config("off", 0, 0.0).label and r["repeat"] == 0}
        agree, lp, lp_plain = [], [], []
        for r in runs:
            if r["config"] != cfg.label or r["repeat"] != 0:
                continue
            ref = greedy.get(r["prompt"])
            if cfg.temperature == 0 and ref:
                n = min(len(ref), len(r["tokens"]))
                agree.append(sum(a == b for a, b in zip(r["tokens"][:n], ref[:n])) / max(n, 1))
            lp.append(mean_logprob(ctx.target.model, ids_of[r["prompt"]], r["tokens"]))
            base = next(x for x in runs if x["config"] == plain and x["prompt"] == r["prompt"] and x["repeat"] == 0)
            lp_plain.append(mean_logprob(ctx.target.model, ids_of[r["prompt"]], base["tokens"]))
        mean = lambda xs: statistics.fmean(x for x in xs if x is not None) if any(x is not None for x in xs) else None  # noqa: E731
        out.append({"config": cfg.label, "greedy_agreement": mean(agree) if agree else None,
                    "mean_logprob": mean(lp), "plain_mean_logprob": mean(lp_plain)})
    return out


def distribution_checks(ctx: Context, configs: list[Config], prompt: Prompt, samples: int, progress=None) -> list[dict]:
    """`specchat verify`'s test (one sample against the target's exact conditionals, first K+1 tokens, alpha
    0.01) for each exact mode and temperature > 0 (first K listed). A mode that drafted nothing on this
    prompt gets the verdict "untested", not a pass."""
    from types import SimpleNamespace

    done, out = set(), []
    for cfg in configs:
        if cfg.is_peer or cfg.mode == "off" or cfg.temperature == 0 or not cfg.exact or (cfg.mode, cfg.temperature) in done:
            continue
        done.add((cfg.mode, cfg.temperature))
        if progress:
            progress(f"verify {cfg.label}: {samples} samples")
        drafter = ctx.drafters[cfg.mode]
        drafter.reset()
        session = SimpleNamespace(
            state=TargetState(ctx.target.model),
            controls=Controls(drafter, k=cfg.k, sampling=SamplingParams(cfg.temperature), rule=parse_rule(cfg.accept),
                              adaptive=MeasuredK(start=cfg.k) if cfg.measured else None),
            eos_ids=ctx.eos_ids,
            generator=torch.Generator(device=ctx.device).manual_seed(ctx.seed),
        )
        result = run_verify(session, prompt.ids, samples=samples, alpha=0.01)
        out.append({"config": cfg.label, "mode": cfg.mode, "temperature": cfg.temperature, "prompt": prompt.name, **result})
    return out


def results(ctx: Context, plan, configs: list[Config], prompts: list[Prompt], rows, checks, runs, dtype) -> dict:
    """Everything `results.json` holds: settings, machine, prompts, per-configuration rows, checks, raw runs."""
    return {
        "settings": {
            "target": ctx.target.name, "draft": ctx.draft.name if ctx.draft else None, "modes": list(ctx.drafters),
            "draft_lens": plan.ks, "measured_k": plan.measured_from is not None, "temperatures": plan.temperatures, "top_k": 0, "top_p": 1.0, "accept": plan.rules,
            "prompts": plan.prompts_spec, "max_new_tokens": ctx.max_new_tokens, "repeat": plan.repeat,
            "peers": plan.peers, "seed": ctx.seed, "verify_samples": plan.verify_samples,
            "learnt": plan.learnt,
            "mode_options": plan.settings, "hf_early_exit_layer": early_exit_layer(ctx) if plan.peers else None,
        },
        "machine": hardware_info(ctx.device, dtype),
        "prompts": [{"name": p.name, "kind": p.kind, "text": p.text, "prompt_tokens": len(p.ids)} for p in prompts],
        "configs": rows,
        "peers": peer_pairs(rows),
        "checks": checks,
        "skipped_modes": plan.skipped,
        "runs": runs,
    }
