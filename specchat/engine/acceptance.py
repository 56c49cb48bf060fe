"""Acceptance rules: which drafts the target keeps, and the token that ends the round."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from specchat.engine.sampling import argmax, sample


class Verdict(NamedTuple):
    accepted: int  # n: drafts 1..n are kept
    next_token: int  # the replacement (n < K) or the bonus (n == K)
    accept_probs: torch.Tensor  # [K] probability each draft had of being accepted


class AcceptRule(Protocol):
    name: str
    exact: bool  # False for lossy rules: every summary and export must say so

    def __call__(
        self, draft_ids: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None, greedy: bool
    ) -> Verdict: ...


def draft_token_probs(draft_ids: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p(x_i) and q(x_i) for each draft token: [K] ids, [K, V] q, [K+1, V] p -> ([K], [K])."""
    rows = torch.arange(draft_ids.numel(), device=draft_ids.device)
    return p[rows, draft_ids], q[rows, draft_ids]


def first_rejection(accept: torch.Tensor) -> int:
    """[K] bool -> index of the first False, or K when all are True."""
    rejected = (~accept).nonzero()
    return int(rejected[0, 0]) if rejected.numel() else accept.numel()


def draw_next(
    n: int, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None, greedy: bool, residual: bool = True
) -> int:
    """The token that ends the round: bonus from p[K], or (residual=True) a draw from normalize(max(0, p - q))."""
    if n == q.shape[0]:
        dist = p[n]
    else:
        dist = (p[n] - q[n]).clamp_min(0.0) if residual else p[n]
        if not dist.sum() > 0:  # p ~ q up to float error: the residual vanished, fall back to p
            dist = p[n]
    if greedy:
        return int(argmax(dist))
    return int(sample(dist.unsqueeze(0), generator))  # (sample takes a row of any total)


class ExactRule:
    """Accept x with probability min(1, p(x)/q(x)); on rejection resample from the residual.

    This is the rule of Leviathan et al. / Chen et al. and preserves the target distribution exactly.
    With a one-hot q (deterministic drafter) it accepts with probability p(x) and the residual is p with
    x removed; with greedy p and q it is argmax matching.
    """

    name = "exact"
    exact = True

    def __call__(self, draft_ids, q, p, generator, greedy) -> Verdict:
        px, qx = draft_token_probs(draft_ids, q, p)  # [K], [K]
        # q(x) = 0 cannot happen for a token drawn from q, but underflow must never give inf/NaN
        ratio = torch.where(qx > 0, px / qx.clamp_min(torch.finfo(qx.dtype).tiny), (px > 0).to(px.dtype))
        accept_probs = ratio.clamp(max=1.0)
        u = torch.rand(accept_probs.shape, generator=generator, device=accept_probs.device)  # [K]
        n = first_rejection(u < accept_probs)
        return Verdict(n, draw_next(n, q, p, generator, greedy), accept_probs)


EXACT = ExactRule()


class LenientRule:
    """Lossy: accept x with probability min(1, p(x) / (lambda * q(x))), resample from normalize(max(0, p - lambda*q)).

    lambda = 1 would be the exact rule; smaller lambda accepts more drafts (lambda -> 0 keeps every
    draft: the output becomes the draft's). Greedy output is unchanged (an argmax mismatch has p(x) = 0).
    Not distribution-preserving, so `exact` is False and every report says so.
    """

    exact = False

    def __init__(self, lam: float) -> None:
        if not 0 < lam < 1:
            raise ValueError(f"approx:<lambda> needs 0 < lambda < 1 (lambda = 1 is the exact rule), got {lam}")
        self.lam = lam
        self.name = f"approx:{lam:g}"

    def __call__(self, draft_ids, q, p, generator, greedy) -> Verdict:
        px, qx = draft_token_probs(draft_ids, q, p)  # [K], [K]
        accept_probs = (px / (self.lam * qx).clamp_min(torch.finfo(qx.dtype).tiny)).clamp(max=1.0)
        u = torch.rand(accept_probs.shape, generator=generator, device=accept_probs.device)  # [K]
        n = first_rejection(u < accept_probs)
        return Verdict(n, draw_next(n, self.lam * q, p, generator, greedy), accept_probs)


def parse_rule(spec: str) -> AcceptRule:
    """`exact`, or `approx:<lambda>` for the lossy LenientRule (0 < lambda < 1)."""
    if spec == "exact":
        return EXACT
    if spec.startswith("approx:"):
        try:
            lam = float(spec.removeprefix("approx:"))
        except ValueError:
            raise ValueError(f"approx:<lambda> needs a number, got {spec!r}") from None
        return LenientRule(lam)
    raise ValueError(f"unknown acceptance rule {spec!r}; use 'exact' or 'approx:<lambda>' (e.g. approx:0.5)")
