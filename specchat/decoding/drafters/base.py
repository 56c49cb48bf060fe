"""The drafter interface: every draft source (one file each) proposes tokens with the q they came from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from specchat.decoding.sampling import SamplingParams

if TYPE_CHECKING:
    from specchat.decoding.loop import TargetState


@dataclass
class Proposal:
    ids: torch.Tensor  # [K'] proposed tokens, K' <= K
    q: torch.Tensor | None  # [K', V] float32, exactly what each token was drawn from; None = deterministic (one-hot)
    calls: int  # forward passes the drafter spent

    @staticmethod
    def empty(device: torch.device) -> "Proposal":
        return Proposal(torch.empty(0, dtype=torch.long, device=device), None, 0)


class Drafter(Protocol):
    """Proposes up to K tokens after `state.tokens`.

    A drafter keeps whatever state it likes (a KV cache, an n-gram index) and re-syncs it to
    `state.tokens` at the start of `propose`: the loop may have rolled back, another mode may have
    run in between, or a new conversation turn may have begun. The loop owns verification,
    acceptance, the target cache and timing.
    """

    name: str

    def propose(self, state: TargetState, k: int, params: SamplingParams, generator: torch.Generator | None) -> Proposal: ...

    def reset(self) -> None:
        """Forget all cached state."""

    # Optional: `verify(self, state, draft_ids: list[int]) -> [K+1, V] logits`. A self-speculative
    # drafter that shares computation with the target (e.g. early exit reusing its KV entries) may
    # run the verify forward itself; it must leave `state.cache` holding every layer for all tokens
    # fed, as `TargetState.verify` does. Drafters without it use `state.verify`.
