"""What the engine tells the outside world: one RoundRecord per target forward, holding its tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# accepted:  a draft token the target accepted
# resampled: the replacement drawn from normalize(max(0, p - q)) after a rejection
# bonus:     the extra target token after a fully accepted block
# target:    a token from a round with no drafts (plain decoding)
TokenKind = Literal["accepted", "resampled", "bonus", "target"]
TOKEN_KINDS: tuple[TokenKind, ...] = ("accepted", "resampled", "bonus", "target")


@dataclass(frozen=True, slots=True)
class TokenEvent:
    id: int
    text: str  # incremental text; "" while a multi-byte character is incomplete
    kind: TokenKind
    round: int  # index of the round that produced it (0-based, per generation)
    position: int  # 1..K: draft position for accepted/resampled/bonus (bonus = K + 1); 1 for target
    p: float  # target probability of this token (after temperature/top-k/top-p)
    q: float | None  # q(x) at this position: the draft's probability of the emitted token (None for bonus and target)
    accept_prob: float | None  # min(1, p/q) for draft positions, None otherwise
    top_p: tuple[tuple[int, float], ...] = ()  # top alternatives under p: (token id, prob)
    top_q: tuple[tuple[int, float], ...] = ()  # top alternatives under q at this position
    # the target's own distribution (temperature 1, no top-k/top-p): what the model thought, also when greedy
    # makes p one-hot; the drafter reports only its warped q, so there is no raw q
    p_raw: float | None = None
    top_raw: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class RoundRecord:
    """One target forward and the tokens it emitted (statistics: docs/ARCHITECTURE.md)."""

    index: int
    mode: str
    draft_len: int  # K the drafter was asked for
    drafted: int  # drafts proposed (a drafter may propose fewer than K) and judged: drafts after an accepted EOS are not counted
    accepted: int  # drafts accepted
    draft_calls: int  # forward passes of the drafter this round
    draft_s: float
    verify_s: float  # target forward + acceptance + cache rollback
    wall_s: float = 0.0  # from the previous round's end (the caller's time between rounds too) to this one's: tokens/s's
    prefill_s: float = 0.0  # round 0 only: encoding the prompt (the part not already cached)
    tokens: list[TokenEvent] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)  # draft ids proposed after the first rejection (incl. it)
    exact: bool = True
    stop_reason: str | None = None  # "eos" | "max_new_tokens" | "context" on the last round of a generation
    # E[tokens emitted | these drafts] = 1 + a1 + a1 a2 + ... from every judged draft's acceptance probability:
    # what the round was worth, without the noise of its one accept/reject draw (mode auto compares modes by it)
    expected_tokens: float = 1.0

    @property
    def emitted(self) -> int:
        return len(self.tokens)
