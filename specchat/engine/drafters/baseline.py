"""The chat's in-band baseline: a mode's rounds with one plain round after every N of them, chosen through the
loop's one drafter hook (`for_round`), so the loop itself knows nothing of it. The plain step is re-measured under
the same conditions (load, context length) as the mode it is compared with; a plain round is an ordinary decoding
round, so the reply stays exact."""

from __future__ import annotations

from specchat.engine.drafters.base import Drafter


class PlainRound(Drafter):
    """One round of `plain` (mode off's drafter) that drafts nothing whatever K is: one plain target step."""

    def __init__(self, plain: Drafter) -> None:
        self.plain, self.name = plain, plain.name

    def draft_len(self, k: int) -> int:
        return 0

    def verify(self, state, draft_ids):
        return self.plain.verify(state, draft_ids)


class InBandBaseline(Drafter):
    """`drafter`'s rounds, and after every `every` of them that did not run `plain` one plain round (0: never).

    `since` counts the mode's rounds since the last plain one, across generations (short replies get plain rounds
    too) and mode switches (the session swaps `drafter`). Every round is observed by `drafter` (auto learns plain
    decoding's rate from the plain rounds too)."""

    def __init__(self, drafter: Drafter, plain: Drafter, every: int, since: int = 0) -> None:
        self.drafter, self.plain, self.every, self.since = drafter, plain, every, since
        self.plain_round = PlainRound(plain)

    @property
    def name(self) -> str:
        return self.drafter.name

    def for_round(self, state, params, sizing=None) -> Drafter:
        drafter = self.drafter.for_round(state, params, sizing)
        if not self.every or drafter is self.plain:
            return drafter
        self.since += 1
        if self.since <= self.every:
            return drafter
        self.since = 0
        return self.plain_round

    def observe(self, record) -> None:
        self.drafter.observe(record)

    def reset(self) -> None:
        self.drafter.reset()
