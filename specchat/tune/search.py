"""The search behind `specchat tune` (no CLI here, so tests can call it): pick a self-speculative mode's setting
for one model on a small calibration set. The command is specchat/cli/tune.py; the result is stored per
model by specchat.store and becomes the mode's default (session.drafter_options).

How (greedy decoding throughout, so everything measured is deterministic):
1. The full model writes a greedy reply to each calibration prompt; its hidden state after every
   layer is kept.
2. A candidate draft (skip set / exit layer) is scored teacher-forced: one forward over prompt +
   reply gives its argmax at every reply position, so `match[t]` says whether it would propose the
   target's token t given a correct prefix. Replaying the greedy speculative loop over `match` for
   each K gives exactly the rounds plain greedy speculation would take.
   A skip set starting at layer s reuses the kept hidden state after layer s-1; an exit layer needs
   only the norm and the LM head on a kept state.
3. Costs (draft step, verify of K+1 tokens, relative to one plain step) come from a linear model
   fitted to timings taken at the start: a head part (embed, norm, LM head, Python) plus one unit
   per layer run. Score: the i.i.d. formula (engine.metrics.predicted_speedup) from the replayed
   rounds' acceptance and K and these costs: it can score a K that never ran (the panel and the bench
   predict from measured tokens per round; measured_candidate scales the formula to that).
4. layerskip search (budget = candidate evaluations): greedy layer addition in the spirit of
   SWIFT/Draft & Verify: first every single layer, then grow the best set one layer at a time from
   the most skippable layers, then seeded random swaps (local search) with what budget is left.
   earlyexit: every E. lowrank: a few ranks, measured in the real loop.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable

import torch

from specchat.engine.cache import crop_to
from specchat.engine.drafters import ModeUnavailable, build_drafter
from specchat.engine.drafters.layers import layer_runner
from specchat.engine.drafters.plain import PlainDecoding
from specchat.engine.loop import Controls, generate
from specchat.engine.metrics import Stats, predicted_speedup, speedup_model
from specchat.engine.sampling import SamplingParams
from specchat.engine.target import TargetState
from specchat.modes import TUNABLE

CALIBRATION = [
    "Explain what a hash table is in two sentences.",
    "Write a short poem about the sea.",
    "What are three tips for staying focused while studying?",
    "How do I reverse a list in Python?",
]

LOWRANK_RANKS = [0.125, 0.25, 0.375, 0.5, 0.75]


# ---------------------------------------------------------------- costs


@dataclass
class Costs:
    """Costs relative to one plain target step (the target forward of one token with the KV cache, as `off` runs:
    the lean runner's where the target runs on it, else HF's)."""

    head: float  # the fixed part of a layer-by-layer pass: embed, final norm, LM head, Python
    layer: float  # one decoder layer on one token
    verify: dict[int, float]  # K -> verifying K+1 tokens in one forward through the layer loop

    def draft(self, layers_run: int) -> float:
        return self.head + layers_run * self.layer

    def verify_shared(self, k: int, exit_layer: int, n_layers: int) -> float:
        """earlyexit's verify: layers < E for one token (dK), layers >= E for K+1 tokens."""
        per_layer = max(self.verify[k] - self.head, 0.0) / n_layers
        return self.head + (n_layers - exit_layer) * per_layer + exit_layer * self.layer


def measure_costs(model, k_max: int, reps: int = 7, context: int = 64) -> Costs:
    """Time a plain step, verifies of 2..k_max+1 tokens and layer-by-layer passes, interleaved (one of each
    per repetition, so load from other processes hits all alike); medians fit the linear model."""
    decoder = layer_runner(model)  # the path the target and its self-speculative drafters run: lean runner or HF modules
    n = decoder.n_layers
    cache = decoder.new_cache()
    decoder.step([i % decoder.vocab_size for i in range(context)], cache, 0, keep=1)  # a context to attend to
    cases = {"plain": ([5], None), "full": ([5], range(n)), "half": ([5], range(n // 2))}
    # both modes verify through the same layer loop (the lean runner or drafters/layers.py), so time verifies through it too
    cases.update({k: ([5] * (k + 1), range(n)) for k in range(1, k_max + 1)})
    times: dict = {name: [] for name in cases}
    for rep in range(reps + 1):
        for name, (ids, layers) in cases.items():
            t = time.perf_counter()
            if layers is None:
                decoder.step(ids, cache, context, keep=len(ids))
            else:
                decoder.forward(ids, layers, cache, context)
            if rep:  # the first repetition warms up
                times[name].append(time.perf_counter() - t)
            crop_to(cache, context)
    ms = {name: 1000 * statistics.median(ts) for name, ts in times.items()}
    layer_ms = max(ms["full"] - ms["half"], 1e-6) / (n - n // 2)
    head_ms = max(ms["full"] - n * layer_ms, 0.0)
    verify, floor = {}, ms["full"] / ms["plain"]
    for k in range(1, k_max + 1):  # more positions never cost less: keep the curve monotone against timing noise
        verify[k] = floor = max(floor, ms[k] / ms["plain"])
    return Costs(head=head_ms / ms["plain"], layer=layer_ms / ms["plain"], verify=verify)


# ---------------------------------------------------------------- calibration data


@dataclass
class Reference:
    """One calibration prompt with the full model's greedy reply and its hidden state after every layer."""

    start: int  # prompt length: reply tokens are ids[start:]
    targets: torch.Tensor  # [T] the reply
    hidden: list[torch.Tensor]  # N+1 entries [1, S, D]: embeddings, then after each layer


@torch.inference_mode()
def reference(decoder, prompt: list[int], max_new_tokens: int) -> Reference:
    model = decoder.model
    out = model.generate(
        torch.tensor([prompt], device=decoder.device), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0
    )
    ids = out[0].tolist()
    h = decoder.embed(ids)
    hidden = [h]
    for i in range(decoder.n_layers):
        h = decoder.run(h, [i], None, 0)
        hidden.append(h)
    return Reference(len(prompt), torch.tensor(ids[len(prompt):], device=decoder.device), hidden)


@torch.inference_mode()
def matches(decoder, ref: Reference, layer_ids: list[int] | None = None, hidden: torch.Tensor | None = None) -> list[bool]:
    """Teacher-forced: does the draft's argmax equal the target's reply token at each position?

    Either a kept-layer list (run from the last kept state the draft shares with the full model) or a
    final hidden state (early exit).
    """
    if hidden is None:
        shared = 0  # the draft equals the full model up to its first skipped layer
        while shared < len(layer_ids) and layer_ids[shared] == shared:
            shared += 1
        hidden = decoder.run(ref.hidden[shared], layer_ids[shared:], None, 0)
    logits = decoder.logits(hidden[:, ref.start - 1 : -1])  # [T, V]: position t-1 predicts reply token t
    return (logits.argmax(-1) == ref.targets).tolist()


def replay(match: list[bool], k: int) -> tuple[int, int, int]:
    """Greedy speculation over a match sequence: (rounds, drafted, accepted) to emit all of it.

    Mirrors the loop: a round drafts min(K, tokens left - 1), keeps the matching prefix, then adds one
    target token (the replacement or the bonus).
    """
    pos = rounds = drafted = accepted = 0
    while pos < len(match):
        k_round = min(k, len(match) - pos - 1)
        n = 0
        while n < k_round and match[pos + n]:
            n += 1
        drafted += k_round
        accepted += n
        pos += n + 1
        rounds += 1
    return rounds, drafted, accepted


# ---------------------------------------------------------------- scoring and search


@dataclass
class Candidate:
    setting: dict  # {"skip_layers": [...]} / {"exit_layer": E} / {"rank": r}
    k: int
    acceptance: float
    mean_accepted_length: float
    draft_cost: float
    verify_cost: float
    predicted_speedup: float


def score(setting: dict, match_lists: list[list[bool]], k_max: int, draft_cost: float, verify_cost: Callable[[int], float]) -> Candidate:
    """Best K for this draft: replay every K, then the predicted speedup from the replayed acceptance."""
    tokens = sum(len(m) for m in match_lists)
    best = None
    for k in range(1, k_max + 1):
        rounds = drafted = accepted = 0
        for m in match_lists:
            r, d, a = replay(m, k)
            rounds, drafted, accepted = rounds + r, drafted + d, accepted + a
        acceptance = accepted / max(drafted, 1)
        speedup = predicted_speedup(acceptance, k, draft_cost, verify_cost(k))
        cand = Candidate(setting, k, acceptance, tokens / rounds, draft_cost, verify_cost(k), speedup)
        if best is None or cand.predicted_speedup > best.predicted_speedup:
            best = cand
    return best


def search_layerskip(decoder, refs, costs: Costs, *, seed: int, budget: int, k_max: int, tick) -> list[Candidate]:
    n = decoder.n_layers
    seen: dict[tuple[int, ...], Candidate] = {}

    def evaluate(skip: tuple[int, ...]) -> Candidate:
        skip = tuple(sorted(skip))
        if skip not in seen:
            kept = [i for i in range(n) if i not in skip]
            match_lists = [matches(decoder, ref, kept) for ref in refs]
            seen[skip] = score({"skip_layers": list(skip)}, match_lists, k_max, costs.draft(len(kept)), lambda k: costs.verify[k])
            tick(seen[skip])
        return seen[skip]

    rng = random.Random(seed)
    # 1. every single layer (in a seeded order, so a small budget samples them fairly)
    order = list(range(n))
    rng.shuffle(order)
    for i in order[: max(1, min(n, budget))]:
        evaluate((i,))
    # most skippable first: acceptance with that layer alone skipped
    ranked = sorted((s[0] for s in seen), key=lambda i: (-seen[(i,)].acceptance, i))
    pool = ranked[: max(4, n // 2)]
    # 2. greedy growth from the best single layer, adding the pool layer that keeps the best score
    current = (ranked[0],)
    while len(seen) < budget and len(current) < n - 1:
        options = [tuple(sorted((*current, i))) for i in pool if i not in current]
        if not options:
            break
        scored = []
        for s in options:
            if s not in seen and len(seen) >= budget:
                break
            scored.append(evaluate(s))
        if not scored:
            break
        current = tuple(max(scored, key=lambda c: (c.predicted_speedup, c.acceptance)).setting["skip_layers"])
    # 3. seeded local search: swap one skipped layer for one kept layer around the best so far
    tries = 0
    while len(seen) < budget and tries < 4 * budget:
        tries += 1
        best = tuple(max(seen.values(), key=lambda c: c.predicted_speedup).setting["skip_layers"])
        out = rng.choice(best)
        into = rng.choice([i for i in range(n) if i not in best])
        evaluate(tuple(sorted({*best, into} - {out})))
    return sorted(seen.values(), key=lambda c: -c.predicted_speedup)


def search_earlyexit(decoder, refs, costs: Costs, *, k_max: int, tick) -> list[Candidate]:
    n = decoder.n_layers
    out = []
    for e in range(1, n):
        match_lists = [matches(decoder, ref, hidden=ref.hidden[e]) for ref in refs]
        cand = score({"exit_layer": e}, match_lists, k_max, costs.draft(e), lambda k: costs.verify_shared(k, e, n))
        out.append(cand)
        tick(cand)
    return sorted(out, key=lambda c: -c.predicted_speedup)


def measured_candidate(setting: dict, spec: Stats, plain: Stats, ks) -> Candidate:
    """A setting measured in the real loop: the speedup model from its statistics, at the best K of `ks`. Other
    K come from the i.i.d. formula (c and v as measured at the run's K), scaled by what the run measured over
    what the formula gives at the run's K, so the run's own K scores exactly the model's prediction."""
    model = speedup_model(spec, plain.plain_step_s)
    a, c, v = (model.acceptance, model.draft_cost, model.verify_cost) if model else (0.0, 1.0, 1.0)
    scale = model.predicted / model.iid if model and model.iid else 1.0
    predicted = {k: predicted_speedup(a, k, c, v) * scale for k in ks}
    k = max(predicted, key=predicted.get)
    return Candidate(setting, k, a, spec.mean_accepted_length or 1.0, c, v, predicted[k])


def search_lowrank(model, prompts, *, seed: int, budget: int, k_max: int, max_new_tokens: int, tick) -> list[Candidate]:
    """No teacher forcing for low rank (its draft is a different model, not a subset of the target's layers):
    run the real loop, greedy, K=4, and time draft steps and verifies against plain steps in the same run."""
    try:
        build_drafter("lowrank", model, rank=LOWRANK_RANKS[0])
    except ModeUnavailable as e:
        raise ModeUnavailable(f"cannot tune lowrank: {e}") from None

    def run(drafter, k):
        stats = Stats()
        for prompt in prompts:
            controls = Controls(drafter, k=k, sampling=SamplingParams(0))
            for r in generate(TargetState(model), prompt, controls, max_new_tokens=max_new_tokens, eos_ids=set()):
                stats.add(r)
        return stats

    out = []
    for rank in LOWRANK_RANKS[: max(1, budget)]:
        drafter = build_drafter("lowrank", model, rank=rank)
        cand = measured_candidate({"rank": rank}, run(drafter, 4), run(PlainDecoding(), 1), range(1, k_max + 1))
        out.append(cand)
        tick(cand)
    return sorted(out, key=lambda c: -c.predicted_speedup)


@dataclass
class TuneResult:
    mode: str
    best: Candidate
    candidates: list[Candidate]  # best first
    costs: Costs | None  # None for lowrank (measured per candidate)
    seed: int
    calibration_tokens: int
    extra: dict = field(default_factory=dict)

    def saved_entry(self) -> dict:
        return {
            **self.best.setting,
            "k": self.best.k,
            "acceptance": round(self.best.acceptance, 4),
            "predicted_speedup": round(self.best.predicted_speedup, 4),
            "draft_cost": round(self.best.draft_cost, 4),
            "verify_cost": round(self.best.verify_cost, 4),
            "seed": self.seed,
            "calibration_tokens": self.calibration_tokens,
            "tuned_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **self.extra,
        }


def tune_model(
    model,
    prompts: list[list[int]],
    mode: str,
    *,
    seed: int = 0,
    budget: int = 80,
    k_max: int = 8,
    max_new_tokens: int = 48,
    costs: Costs | None = None,
    progress: Callable[[str, Candidate | None], None] | None = None,
) -> TuneResult:
    """The core of `specchat tune`, without the CLI. Deterministic for a seed given `costs` (timings
    are measured when `costs` is None, and only they can vary between runs)."""
    if mode not in TUNABLE:
        raise ModeUnavailable(f"tune supports {', '.join(TUNABLE)}; not {mode!r}")
    note = progress or (lambda msg, cand: None)
    tick = lambda cand: note("candidate", cand)  # noqa: E731
    torch.manual_seed(seed)
    decoder = layer_runner(model)
    if mode == "lowrank":  # costs are measured per rank, in the real loop
        cands = search_lowrank(model, prompts, seed=seed, budget=budget, k_max=k_max, max_new_tokens=max_new_tokens, tick=tick)
        return TuneResult(mode, cands[0], cands, None, seed, 0)
    if costs is None:
        note("measuring step costs", None)
        costs = measure_costs(model, k_max)
    note("greedy replies of the full model", None)
    refs = [reference(decoder, p, max_new_tokens) for p in prompts]
    tokens = sum(len(r.targets) for r in refs)
    if mode == "layerskip":
        cands = search_layerskip(decoder, refs, costs, seed=seed, budget=budget, k_max=k_max, tick=tick)
    else:
        cands = search_earlyexit(decoder, refs, costs, k_max=k_max, tick=tick)
    return TuneResult(mode, cands[0], cands, costs, seed, tokens)


def measure_speed(session, mode: str, prompts: list[list[int]], k: int, max_new_tokens: int, repeats: int = 2) -> dict:
    """Tokens/s of the tuned mode and of plain decoding, interleaved prompt by prompt in one run."""
    stats = {m: Stats() for m in ("off", mode)}
    for _ in range(repeats):
        for prompt in prompts:
            for m in stats:
                drafter = session.drafter(m)
                drafter.reset()
                controls = Controls(drafter, k=k if m != "off" else 1, sampling=SamplingParams(0))
                rounds = generate(TargetState(session.target.model), prompt, controls, max_new_tokens=max_new_tokens, eos_ids=session.eos_ids)
                for r in rounds:
                    stats[m].add(r)
    off, on = stats["off"], stats[mode]
    return {
        "tokens_per_s_off": off.tokens_per_s,
        "tokens_per_s": on.tokens_per_s,
        "measured_speedup": on.tokens_per_s / off.tokens_per_s,
        "measured_acceptance": on.acceptance_rate,
        "target_calls_per_token": on.target_calls_per_token,
    }
