"""The drafter interface: every draft source (one file each) proposes tokens with the q they came from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specchat.engine.sampling import SamplingParams
from specchat.engine.target import Target


@dataclass
class Proposal:
    ids: torch.Tensor  # [K'] proposed tokens, K' <= K
    q: torch.Tensor | None  # [K', V] float32, exactly what each token was drawn from; None = deterministic (one-hot)
    calls: int  # forward passes the drafter spent

    @staticmethod
    def empty(device: torch.device, calls: int = 0) -> "Proposal":
        return Proposal(torch.empty(0, dtype=torch.long, device=device), None, calls)


class Drafter:
    """Proposes up to K tokens after `state.tokens`.

    A drafter keeps whatever state it likes (a KV cache, an n-gram index) and re-syncs it to
    `state.tokens` at the start of `propose`: the loop may have rolled back, another mode may have
    run in between, or a new conversation turn may have begun. The loop owns acceptance, the target
    cache and timing.
    """

    name: str
    # Drafters that run a model stop drafting when the draft's top probability falls below p_min
    # (llama.cpp's --draft-p-min; the loop sets it each round from AdaptiveK, 0 = never). It depends only
    # on the draft's own distribution, so the rule stays exact. Drafters without a model ignore it.
    p_min: float = 0.0
    # True for a drafter with a cache of its own (the head, a draft model): its first round after a prompt or after
    # another mode's rounds feeds every position it missed, a switching cost that auto does not count as its rate
    catches_up: bool = False

    def propose(self, state: Target, k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal:
        raise NotImplementedError

    def draft_len(self, k: int) -> int:
        """How many drafts to ask for in a round whose K is `k`: k, except for a drafter whose own rule bounds its
        drafts and whose drafts cost nothing (suffix: as many as its match supports)."""
        return k

    def for_round(self, state: Target, params: SamplingParams, sizing=None) -> "Drafter":
        """The drafter that runs the next round: itself, except for a mode that chooses among others (auto) and the
        chat's in-band baseline around a mode (baseline.py). `sizing`: the loop's draft_length.MeasuredK when K is
        measured (auto prices its drafting modes by it), else None."""
        return self

    def observe(self, record) -> None:
        """Called with every round's RoundRecord once the round is done (auto learns from it)."""

    def verify(self, state: Target, draft_ids: list[int]) -> torch.Tensor:
        """Target logits [K+1, V] for the pending token and the drafts.

        A self-speculative drafter that shares computation with the target (early exit reuses its KV
        entries) overrides this; it must leave `state.cache` holding every layer for all tokens fed.
        """
        return state.verify(draft_ids)

    def reset(self) -> None:
        """Forget all cached state."""
