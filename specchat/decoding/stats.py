"""Running statistics over RoundRecords, with the definitions of DESIGN.md section 4."""

from __future__ import annotations

from dataclasses import dataclass, field

from specchat.decoding.events import RoundRecord


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def expected_tokens_per_round(acceptance: float, k: int) -> float:
    """E[tokens/round] = (1 - a^(K+1)) / (1 - a): accepted drafts plus the replacement or bonus."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def predicted_speedup(acceptance: float, k: int, draft_cost: float, verify_cost: float) -> float:
    """Speedup over plain decoding; costs are relative to one plain target step."""
    return expected_tokens_per_round(acceptance, k) / (k * draft_cost + verify_cost)


@dataclass
class Stats:
    rounds: int = 0
    draft_rounds: int = 0  # rounds that proposed at least one draft (vLLM's num_drafts)
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    draft_calls: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    first_token_s: list[float] = field(default_factory=list)  # one per generation
    proposed_at: list[int] = field(default_factory=list)  # [i]: rounds in which draft i+1 was proposed
    accepted_at: list[int] = field(default_factory=list)  # [i]: rounds in which draft i+1 was accepted
    exact: bool = True

    def add(self, r: RoundRecord) -> None:
        self.rounds += 1
        self.draft_rounds += r.drafted > 0
        self.drafted += r.drafted
        self.accepted += r.accepted
        self.emitted += r.emitted
        self.draft_calls += r.draft_calls
        self.draft_s += r.draft_s
        self.verify_s += r.verify_s
        self.wall_s += r.wall_s
        self.prefill_s += r.prefill_s
        self.exact = self.exact and r.exact
        if r.index == 0:
            self.first_token_s.append(r.prefill_s + r.wall_s)
        grow = r.drafted - len(self.proposed_at)
        if grow > 0:
            self.proposed_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(r.drafted):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < r.accepted

    @property
    def target_calls(self) -> int:
        return self.rounds  # one verify forward per round; the prefill is reported separately

    @property
    def acceptance_rate(self) -> float | None:
        return _ratio(self.accepted, self.drafted)

    @property
    def mean_accepted_length(self) -> float | None:
        return _ratio(self.emitted, self.rounds)

    @property
    def target_calls_per_token(self) -> float | None:
        return _ratio(self.target_calls, self.emitted)

    @property
    def draft_calls_per_token(self) -> float | None:
        return _ratio(self.draft_calls, self.emitted)

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / p for a, p in zip(self.accepted_at, self.proposed_at)]

    @property
    def tokens_per_s(self) -> float | None:
        return _ratio(self.emitted, self.wall_s)

    @property
    def ms_per_token(self) -> float | None:
        return _ratio(1000 * self.wall_s, self.emitted)

    @property
    def time_to_first_token_s(self) -> float | None:
        return self.first_token_s[-1] if self.first_token_s else None

    @property
    def draft_ms_per_round(self) -> float | None:
        return _ratio(1000 * self.draft_s, self.rounds)

    @property
    def verify_ms_per_round(self) -> float | None:
        return _ratio(1000 * self.verify_s, self.rounds)

    def summary(self) -> dict:
        """Every statistic, under DESIGN.md's names, plus vLLM-style counters."""
        return {
            "rounds": self.rounds,
            "num_drafts": self.draft_rounds,
            "num_draft_tokens": self.drafted,
            "num_accepted_tokens": self.accepted,
            "num_accepted_tokens_per_pos": list(self.accepted_at),
            "new_tokens": self.emitted,
            "target_calls": self.target_calls,
            "draft_calls": self.draft_calls,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "target_calls_per_token": self.target_calls_per_token,
            "draft_calls_per_token": self.draft_calls_per_token,
            "per_position_acceptance": self.per_position_acceptance,
            "tokens_per_s": self.tokens_per_s,
            "ms_per_token": self.ms_per_token,
            "time_to_first_token_s": self.time_to_first_token_s,
            "prefill_s": self.prefill_s,
            "decode_s": self.wall_s,
            "draft_ms_per_round": self.draft_ms_per_round,
            "verify_ms_per_round": self.verify_ms_per_round,
            "exact": self.exact,
        }
