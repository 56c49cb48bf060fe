"""Running the speculative loop and testing its output against the target's exact distribution: the joint
distribution enumerated, draws counted, the position-by-position fit, and one mode's distribution test with its
broken-rule controls (support/broken.py)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from specchat.engine.cache import forward_logits, new_cache
from specchat.engine.llamacpp import target_state
from specchat.engine.loop import Controls, generate
from specchat.engine.sampling import SamplingParams, logits_to_probs
from specchat.verify import TargetConditionals, conditional_tests, sample_continuations
from support.broken import ReportsWrongQ, ResampleFromP


PROMPT = [1, 2, 3]
ALPHA = 1e-3  # with fixed seeds the outcome is deterministic; alpha bounds the chance a correct rule fails


def run(target, drafter, prompt, *, k, params, max_new_tokens, seed=0, rule=None, state=None, adaptive=None):
    state = state or target_state(target)
    controls = Controls(drafter, k=k, sampling=params, adaptive=adaptive, **({"rule": rule} if rule else {}))
    generator = torch.Generator().manual_seed(seed)
    records = list(generate(state, prompt, controls, max_new_tokens=max_new_tokens, eos_ids=set(), generator=generator))
    return [t.id for r in records for t in r.tokens], records


def exact_joint(target, prompt, params, length):
    """Enumerate the target's exact distribution over its first `length` tokens: {tuple: prob}."""
    dist = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for prefix, mass in dist.items():
            logits = forward_logits(target, new_cache(target), prompt + list(prefix), keep=1)[-1]
            for tok, p in enumerate(logits_to_probs(logits, params).tolist()):
                if p > 0:
                    nxt[prefix + (tok,)] = mass * p
        dist = nxt
    return dist


def sample_joint(target, drafter, params, *, k, draws, length, rule=None, seed=0, generated=None, stats=None, adaptive=None,
                 prompt=PROMPT):
    """`draws` independent generations of `generated` tokens (default `length`) from `prompt` (the prefix cache is
    reused); the counts of their first `length` tokens. `stats` (a Stats) collects every round.

    The loop never drafts past the token budget, so a draw of `length` tokens drafts at most length-1: a test
    of draft position K needs `generated` >= K+1 (then the first round drafts all K)."""
    controls = Controls(drafter, k=k, sampling=params, **({"rule": rule} if rule else {}), adaptive=adaptive)
    generator = torch.Generator().manual_seed(seed)
    drawn = sample_continuations(target_state(target), prompt, controls, draws=draws, length=max(length, generated or 0),
                                 eos_ids=set(), generator=generator, stats=stats)
    counts = Counter()
    for seq, count in drawn.items():
        counts[seq[:length]] += count
    return counts


@dataclass
class PositionFit:
    """The first `depth` tokens of the draws against the target's exact conditionals (specchat.verify's test,
    position by position): per position the chi-square over every prefix and the likelihood score test,
    combined as verify combines them; `p_value` is the smallest of them times the number of positions
    (Bonferroni: the level stays alpha, and a bug at one position is not diluted by the others)."""

    positions: list[dict]
    p_value: float

    def passed(self, alpha: float) -> bool:
        return self.p_value >= alpha

    @property
    def per_position(self) -> list[float]:
        return [p["combined_p"] for p in self.positions]

    @property
    def worst_position(self) -> int:
        return min(self.positions, key=lambda p: p["combined_p"])["position"]

    def __repr__(self) -> str:
        return f"PositionFit(p={self.p_value:.3g}, per position {[f'{p:.3g}' for p in self.per_position]})"


def fit_to_target(target, counts: Counter, params, depth: int, prompt=PROMPT) -> PositionFit:
    positions, _, _ = conditional_tests(counts, TargetConditionals(target, prompt, params), depth)
    return PositionFit(positions, min(1.0, depth * min(p["combined_p"] for p in positions)))


def sample_and_fit(target, drafter, params, *, k, draws, rule=None, seed=0, adaptive=None, depth=None, prompt=PROMPT):
    """Draws from `prompt` that generate K+1 tokens (more with `depth`), their first `depth` (default K+1) tokens
    tested with `fit_to_target`; also the Stats of every round, to check which draft positions were really used."""
    from specchat.engine.metrics import Stats

    depth = depth or k + 1
    stats = Stats()
    counts = sample_joint(target, drafter, params, k=k, draws=draws, length=depth, generated=k + 1, rule=rule, seed=seed,
                          stats=stats, adaptive=adaptive, prompt=prompt)
    return fit_to_target(target, counts, params, depth, prompt), stats


def assert_drafted_up_to(stats, k: int) -> None:
    """Every draft position 1..K was proposed in some round, and none beyond K."""
    per_pos = stats.num_draft_tokens_per_pos
    assert len(per_pos) == k and min(per_pos) > 0, f"draft positions used: {per_pos}, wanted 1..{k}"


SAMPLING_CASES = {
    "t1": SamplingParams(1.0),
    "t0.7-topk5": SamplingParams(0.7, top_k=5),
    "topp0.8": SamplingParams(1.0, top_p=0.8),
}


def chat_ids(loaded, text):
    return loaded.chat_ids([{"role": "user", "content": text}])


SMOL_PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a list."]
CONTROLS = {  # name: (wrap the drafter, make the rule): deliberately broken variants that must fail
    "resample from p": (lambda d: d, ResampleFromP),
    "q at the wrong temperature from position 3": (lambda d: ReportsWrongQ(d, position=3, factor=0.25), lambda: None),
}


def check_mode_distribution(target, drafter, case: str, bug: str | None, *, draws: int, record_property=None) -> None:
    """K=3 with draws of K+1 tokens, position by position against the exact conditionals: the exact drafter passes;
    with `bug` (a CONTROLS name) the same settings must fail, a wrong q from position 3 exactly there."""
    rule = None
    if bug:
        wrap, make_rule = CONTROLS[bug]
        drafter, rule = wrap(drafter), make_rule()
    fit, stats = sample_and_fit(target, drafter, SAMPLING_CASES[case], k=3, draws=draws, rule=rule)
    assert_verdict(fit, stats, 3, bug, record_property)


def assert_verdict(fit, stats, k: int, bug: str | None, record_property=None) -> None:
    """A distribution test's verdict: draft positions 1..K were all used; the exact drafter passes; with `bug`
    (a control) the same settings fail by far, a q wrong from position 3 exactly there."""
    if record_property is not None:
        record_property("p_value", fit.p_value)
    assert_drafted_up_to(stats, k)
    if bug is None:
        assert fit.passed(ALPHA), fit
    else:
        assert fit.p_value < 1e-6, fit
        if bug.startswith("q at the wrong temperature"):  # the bug is where it is: drafts 1 and 2 are right
            assert fit.worst_position == 3 and min(fit.per_position[:2]) > ALPHA, fit


def assert_greedy_rounds(records) -> None:
    """Each greedy round as its tokens tell it: the accepted drafts first (accepted with probability 1: p and q are
    one-hot at the same token), then the target's own token, a bonus only after all drafts were accepted; the
    first rejected draft is not the token the target put in its place (greedy rejects only a non-argmax draft)."""
    for r in records:
        kinds, n = [t.kind for t in r.tokens], r.accepted
        if r.drafted == 0:
            assert kinds == ["target"] * len(kinds) and len(kinds) == 1, (r.index, kinds)
            continue
        assert kinds[:n] == ["accepted"] * n and all(t.accept_prob == 1.0 for t in r.tokens[:n]), (r.index, kinds)
        if len(r.tokens) > n:
            assert kinds[n] == ("bonus" if n == r.drafted else "resampled"), (r.index, kinds)
            if r.rejected:
                assert r.rejected[0] != r.tokens[n].id, r.index
