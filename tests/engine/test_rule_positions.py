"""The exact rule position by position, without a model: fixed position-dependent target rows P[K+1, V] and
draft rows Q[K, V]. Draft j is drawn from Q[j]; whatever the round keeps, the j-th emitted token must follow
P[j] (among rounds that emitted at least j tokens), including the bonus from P[K]. Bugs that touch only one
draft position (a residual at position 2 or 4, a bonus from the wrong row) fail here."""

from collections import Counter

import pytest
import torch

from specchat.engine.acceptance import EXACT, ExactRule, Verdict, draft_token_probs, draw_next, first_rejection
from specchat.verify import goodness_of_fit

K, V, DRAWS, ALPHA = 4, 6, 20_000, 1e-3


def rows(seed: int, n: int) -> torch.Tensor:
    """[n, V] peaked random distributions, a different one per position."""
    return torch.softmax(2.0 * torch.randn(n, V, generator=torch.Generator().manual_seed(seed)), -1)


P = rows(0, K + 1)  # [K+1, V]
Q = 0.6 * P[:K] + 0.4 * rows(1, K)  # [K, V]: near p (acceptance ~0.6-0.7), so the bonus is reached often


class ResidualBrokenAt(ExactRule):
    """Deliberately broken at one draft position: a rejection there resamples from p instead of the residual."""

    exact = False

    def __init__(self, position: int) -> None:
        self.position = position  # 1-based draft position

    def __call__(self, draft_ids, q, p, generator, greedy) -> Verdict:
        px, qx = draft_token_probs(draft_ids, q, p)
        accept_probs = (px / qx).clamp(max=1.0)
        n = first_rejection(torch.rand(accept_probs.shape, generator=generator) < accept_probs)
        return Verdict(n, draw_next(n, q, p, generator, greedy, residual=n + 1 != self.position), accept_probs)


class BonusFromWrongRow(ExactRule):
    """Deliberately broken: a fully accepted block takes its bonus from p[K-1] instead of p[K]."""

    exact = False

    def __call__(self, draft_ids, q, p, generator, greedy) -> Verdict:
        verdict = EXACT(draft_ids, q, p, generator, greedy)
        if verdict.accepted < q.shape[0]:
            return verdict
        return Verdict(verdict.accepted, int(torch.multinomial(p[-2], 1, generator=generator)), verdict.accept_probs)


def emitted_by_position(rule, seed: int = 0) -> list[Counter]:
    """[j]: counts of the (j+1)-th emitted token over DRAWS rounds."""
    g = torch.Generator().manual_seed(seed)
    counts = [Counter() for _ in range(K + 1)]
    for _ in range(DRAWS):
        draft = torch.multinomial(Q, 1, generator=g).squeeze(-1)  # [K]: draft j from Q[j]
        verdict = rule(draft, Q, P, g, False)
        tokens = [*draft[: verdict.accepted].tolist(), verdict.next_token]
        for j, token in enumerate(tokens):
            counts[j][token] += 1
    return counts


def position_p_values(rule) -> list[float]:
    return [goodness_of_fit(c, dict(enumerate(P[j].tolist()))).p_value for j, c in enumerate(emitted_by_position(rule))]


@pytest.mark.slow
def test_exact_rule_follows_p_at_every_position():
    counts = emitted_by_position(EXACT)
    assert all(sum(c.values()) >= 500 for c in counts), "every position, the bonus included, must be reached often"
    assert min(position_p_values(EXACT)) >= ALPHA


@pytest.mark.parametrize("position", [1, 2, 4])
@pytest.mark.slow
def test_a_residual_broken_at_one_position_fails_there(position):
    p_values = position_p_values(ResidualBrokenAt(position))
    assert p_values[position - 1] < ALPHA, p_values
    assert min(p for j, p in enumerate(p_values) if j != position - 1) >= ALPHA  # and only there


@pytest.mark.slow
def test_a_bonus_from_the_wrong_row_fails_at_the_last_position():
    p_values = position_p_values(BonusFromWrongRow())
    assert p_values[K] < ALPHA and min(p_values[:K]) >= ALPHA, p_values
