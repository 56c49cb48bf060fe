"""Distribution checks: does a speculative mode sample from the target's distribution?

Used by `specchat verify` (two samples: speculative vs plain) and by the tests (one sample against
the exact distribution enumerated from the target). Both are Pearson chi-square tests with sparse
cells pooled so that every expected count is at least 5.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

MIN_EXPECTED = 5.0


@dataclass(frozen=True)
class ChiSquare:
    statistic: float
    dof: int
    p_value: float
    cells: int  # cells after pooling

    def passed(self, alpha: float) -> bool:
        return self.p_value >= alpha


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square(dof): the regularised upper incomplete gamma Q(dof/2, x/2)."""
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)))


def _pool(keys: list, weight: dict, min_weight: float) -> list[list]:
    """Group keys (rarest first) so every group's weight is at least min_weight.

    Ties are broken by the key itself, never by insertion order: in a two-sample test insertion
    order tells which sample an outcome came from, and grouping by it would fake a difference.
    """
    groups, current, acc = [], [], 0.0
    for key in sorted(keys, key=lambda k: (weight[k], repr(k))):
        current.append(key)
        acc += weight[key]
        if acc >= min_weight:
            groups.append(current)
            current, acc = [], 0.0
    if current:  # leftover too light on its own: merge into the last group
        if groups:
            groups[-1].extend(current)
        else:
            groups.append(current)
    return groups


def goodness_of_fit(observed: Counter, probs: dict) -> ChiSquare:
    """Observed outcome counts against exact outcome probabilities (which must sum to ~1)."""
    n = sum(observed.values())
    expected = {k: n * v for k, v in probs.items()}
    for k in observed:  # an outcome with probability 0 that still occurred
        expected.setdefault(k, 0.0)
    groups = _pool(list(expected), expected, MIN_EXPECTED)
    stat = 0.0
    for g in groups:
        e = sum(expected[k] for k in g)
        o = sum(observed.get(k, 0) for k in g)
        stat += (o - e) ** 2 / e if e > 0 else (float("inf") if o else 0.0)
    return ChiSquare(stat, len(groups) - 1, chi2_sf(stat, len(groups) - 1), len(groups))


def homogeneity(a: Counter, b: Counter) -> ChiSquare:
    """Two samples of outcomes: were they drawn from the same distribution? (2 x C contingency table)"""
    na, nb = sum(a.values()), sum(b.values())
    total = Counter(a) + Counter(b)
    # pool by combined count so the smaller sample's expected count per cell is >= MIN_EXPECTED
    groups = _pool(list(total), total, MIN_EXPECTED * (na + nb) / min(na, nb))
    stat = 0.0
    for g in groups:
        t = sum(total[k] for k in g)
        for sample, n in ((a, na), (b, nb)):
            e = t * n / (na + nb)
            o = sum(sample.get(k, 0) for k in g)
            stat += (o - e) ** 2 / e
    dof = len(groups) - 1
    return ChiSquare(stat, dof, chi2_sf(stat, dof), len(groups))


def total_variation(a: Counter, b: Counter) -> float:
    """Empirical total-variation distance between two samples of outcomes."""
    na, nb = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a.get(k, 0) / na - b.get(k, 0) / nb) for k in set(a) | set(b))


def sample_continuations(
    state, prompt: list[int], controls, *, draws: int, length: int, eos_ids: set[int], generator, stats=None
) -> Counter:
    """Counts of the first `length` tokens over `draws` independent generations from one prompt.

    The target state is reused between draws, so the prompt is encoded once.
    """
    from specchat.engine.loop import generate

    counts: Counter = Counter()
    for _ in range(draws):
        tokens = []
        for record in generate(state, prompt, controls, max_new_tokens=length, eos_ids=eos_ids, generator=generator):
            tokens += [t.id for t in record.tokens]
            if stats is not None:
                stats.add(record)
        counts[tuple(tokens)] += 1
    return counts


def run_verify(session, prompt: list[int], *, samples: int, length: int, alpha: float, progress=None) -> dict:
    """`samples` continuations with the session's mode and as many with plain sampling, compared.

    Exact rules get a verdict from a chi-square homogeneity test at level `alpha`; an approximate
    rule gets the measured total-variation distance instead of a verdict.
    """
    from specchat.engine.drafters.plain import PlainDecoding
    from specchat.engine.loop import Controls
    from specchat.engine.metrics import Stats

    speculative = session.controls
    plain = Controls(PlainDecoding(), k=0, sampling=speculative.sampling)
    stats = Stats()
    common = dict(draws=samples, length=length, eos_ids=session.eos_ids, generator=session.generator)
    if progress:
        progress(f"sampling {samples} continuations with mode {speculative.mode}...")
    spec_counts = sample_continuations(session.state, prompt, speculative, stats=stats, **common)
    if progress:
        progress(f"sampling {samples} continuations with plain decoding...")
    plain_counts = sample_continuations(session.state, prompt, plain, **common)
    test = homogeneity(spec_counts, plain_counts)
    exact = speculative.rule.exact
    return {
        "samples": samples,
        "tokens": length,
        "test": "chi-square homogeneity (2 x C, cells pooled to expected counts >= 5)",
        "statistic": test.statistic,
        "dof": test.dof,
        "p_value": test.p_value,
        "cells": test.cells,
        "alpha": alpha,
        "total_variation": total_variation(spec_counts, plain_counts),
        "acceptance_rate": stats.acceptance_rate,
        "exact": exact,
        "verdict": ("pass" if test.passed(alpha) else "fail") if exact else "approximate",
    }
