"""Mode `off`: no drafts, so every round is one plain target step. The baseline all modes are compared with."""

from __future__ import annotations

from specchat.engine.drafters.base import Drafter, Proposal


class PlainDecoding(Drafter):
    name = "off"

    @classmethod
    def build(cls, target, draft=None, **options) -> "PlainDecoding":
        return cls()

    def propose(self, state, k, params, generator) -> Proposal:
        return Proposal.empty(state.device)

