"""Deliberately broken acceptance rules and drafters: the controls a distribution test (and `verify`) must fail."""

from __future__ import annotations

import torch

from specchat.engine.acceptance import ExactRule, Verdict, draft_token_probs, draw_next, first_rejection
from specchat.engine.drafters import Drafter
from specchat.engine.drafters.model import ModelDrafter
from specchat.engine.sampling import SamplingParams, logits_to_probs


class ResampleFromP(ExactRule):
    """Deliberately broken: the right acceptance test, but a rejection resamples from p, not the residual."""

    exact = False

    def __call__(self, draft_ids, q, p, generator, greedy) -> Verdict:
        px, qx = draft_token_probs(draft_ids, q, p)
        accept_probs = (px / qx).clamp(max=1.0)
        n = first_rejection(torch.rand(accept_probs.shape, generator=generator) < accept_probs)
        return Verdict(n, draw_next(n, q, p, generator, greedy, residual=False), accept_probs)


class ResampleFromPFrom(ExactRule):
    """Deliberately broken from draft position `position` on: a rejection there resamples from p instead of p
    with the rejected draft removed (earlier positions are right). Invisible unless position `position` is drafted."""

    exact = False

    def __init__(self, position: int) -> None:
        self.position = position

    def __call__(self, draft_ids, q, p, generator, greedy) -> Verdict:
        px, qx = draft_token_probs(draft_ids, q, p)
        accept_probs = (px / qx).clamp(max=1.0)
        n = first_rejection(torch.rand(accept_probs.shape, generator=generator) < accept_probs)
        return Verdict(n, draw_next(n, q, p, generator, greedy, residual=n + 1 < self.position), accept_probs)


class ResampleFromPClaimingExact(ResampleFromP):
    """ResampleFromP marked exact, as a silent bug would be: `verify` must say FAIL, not "approximate"."""

    exact = True


class BonusFromPreviousPosition(ExactRule):
    """Deliberately broken: after a fully accepted block the bonus is drawn from p[K-1] instead of p[K]."""

    def __call__(self, draft_ids, q, p, generator, greedy) -> Verdict:
        px, qx = draft_token_probs(draft_ids, q, p)
        accept_probs = (px / qx).clamp(max=1.0)
        n = first_rejection(torch.rand(accept_probs.shape, generator=generator) < accept_probs)
        k = draft_ids.numel()
        if n == k and k > 0:
            return Verdict(n, draw_next(n - 1, q, p, generator, greedy, residual=False), accept_probs)  # p[K-1]
        return Verdict(n, draw_next(n, q, p, generator, greedy), accept_probs)


class QWithoutTopK(ModelDrafter):
    """Deliberately broken drafter: it samples its drafts with the session's top-k but reports the q computed
    without top-k (reverse=True: samples without top-k, reports the top-k-filtered q)."""

    name = "draft"

    def __init__(self, model, reverse: bool = False) -> None:
        super().__init__(model)
        self.reverse = reverse
        self.logits: list[torch.Tensor] = []

    def next_logits(self, feed, vocab_size):
        logits = super().next_logits(feed, vocab_size)
        self.logits.append(logits)
        return logits

    def propose(self, state, k, params, generator):
        no_top_k = SamplingParams(params.temperature, 0, params.top_p)
        drawn_with, reported = (no_top_k, params) if self.reverse else (params, no_top_k)
        self.logits = []
        proposal = super().propose(state, k, drawn_with, generator)
        if proposal.q is not None:
            proposal.q = logits_to_probs(torch.stack(self.logits[: proposal.ids.numel()]), reported)
        return proposal


class WrongTemperatureFrom(ModelDrafter):
    """Deliberately broken drafter, the bug the independent check used: from draft position `position` on it
    samples its drafts at temperature T * `factor` but reports q at the session's T (positions before are
    right). A test that only ever drafts K < `position` cannot see it."""

    def __init__(self, model, position: int = 3, factor: float = 0.5) -> None:
        super().__init__(model)
        self.position, self.factor = position, factor
        self.true_logits: list[torch.Tensor] = []

    def next_logits(self, feed, vocab_size):
        logits = super().next_logits(feed, vocab_size)  # one call per draft position, in order
        self.true_logits.append(logits)
        return logits / self.factor if len(self.true_logits) >= self.position else logits

    def propose(self, state, k, params, generator):
        self.true_logits = []
        proposal = super().propose(state, k, params, generator)
        n = proposal.ids.numel()
        if proposal.q is not None and n >= self.position:
            reported = logits_to_probs(torch.stack(self.true_logits[self.position - 1 : n]), params)
            proposal.q = torch.cat([proposal.q[: self.position - 1], reported.to(proposal.q.device)])
        return proposal


class ReportsWrongQ(Drafter):
    """Deliberately broken wrapper around any drafter with a q: the drafts are sampled from the right q, but from
    draft position `position` on the q it reports is that q at another temperature (q ** (1 / factor),
    renormalised; the zeros of top-k / top-p stay zeros). For drafts that nearly always agree with the target
    (quant) resampling from p instead of the residual hardly shows, a wrong q does."""

    def __init__(self, inner: Drafter, position: int = 3, factor: float = 2.0) -> None:
        self.inner, self.position, self.factor = inner, position, factor
        self.name = inner.name

    def propose(self, state, k, params, generator):
        self.inner.p_min = self.p_min
        proposal = self.inner.propose(state, k, params, generator)
        if proposal.q is not None and proposal.ids.numel() >= self.position:
            q = proposal.q.clone()
            wrong = q[self.position - 1 :] ** (1.0 / self.factor)
            q[self.position - 1 :] = wrong / wrong.sum(-1, keepdim=True)
            proposal.q = q
        return proposal

    def verify(self, state, draft_ids):
        return self.inner.verify(state, draft_ids)

    def reset(self) -> None:
        self.inner.reset()
