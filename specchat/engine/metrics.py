"""Every statistic of a run, computed from RoundRecords, and the one model of the speedup (docs/ARCHITECTURE.md).

Field names are the exported names: vLLM's counters (`num_drafts`, `num_draft_tokens`,
`num_accepted_tokens`, `num_accepted_tokens_per_pos`) and plain names for the rest, so `summary()`
writes the fields as they are plus what is derived from them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable

from specchat.engine.events import RoundRecord


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


@dataclass
class Stats:
    rounds: int = 0  # target verify forwards (the prefill is reported separately)
    num_drafts: int = 0  # rounds that proposed at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: rounds that proposed draft i+1
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: rounds that accepted draft i+1
    new_tokens: int = 0
    draft_calls: int = 0  # forwards of the drafter
    draft_s: float = 0.0
    verify_s: float = 0.0  # target forward + acceptance + cache rollback
    decode_s: float = 0.0  # wall time of every round (what tokens/s divides by)
    prefill_s: float = 0.0
    first_token_s: list[float] = field(default_factory=list)  # one per generation: prefill + first round
    # the first round of each generation: its token came with the prefill (a plain first round costs nothing),
    # so tokens/s and ms/token leave it out, as the baseline of plain rounds does
    first_round_tokens: int = 0
    first_round_s: float = 0.0
    first_round_work_s: float = 0.0  # their draft + verify time (the speedup model leaves them out too)
    exact: bool = True  # every round used an exact acceptance rule

    def add(self, r: RoundRecord) -> None:
        self.rounds += 1
        self.num_drafts += r.drafted > 0
        self.num_draft_tokens += r.drafted
        self.num_accepted_tokens += r.accepted
        grow = r.drafted - len(self.num_draft_tokens_per_pos)
        if grow > 0:
            self.num_draft_tokens_per_pos += [0] * grow
            self.num_accepted_tokens_per_pos += [0] * grow
        for i in range(r.drafted):
            self.num_draft_tokens_per_pos[i] += 1
            self.num_accepted_tokens_per_pos[i] += i < r.accepted
        self.new_tokens += r.emitted
        self.draft_calls += r.draft_calls
        self.draft_s += r.draft_s
        self.verify_s += r.verify_s
        self.decode_s += r.wall_s
        self.prefill_s += r.prefill_s
        if r.index == 0:
            self.first_token_s.append(r.prefill_s + r.wall_s)
            self.first_round_tokens += r.emitted
            self.first_round_s += r.wall_s
            self.first_round_work_s += r.draft_s + r.verify_s
        self.exact = self.exact and r.exact

    @classmethod
    def of(cls, records: Iterable[RoundRecord]) -> "Stats":
        stats = cls()
        for r in records:
            stats.add(r)
        return stats

    def merge(self, other: "Stats") -> "Stats":
        """The statistics of both runs together (a new object)."""
        out = self.copy()
        for f in dataclasses.fields(self):
            a, b = getattr(out, f.name), getattr(other, f.name)
            if f.name.endswith("_per_pos"):
                setattr(out, f.name, [x + y for x, y in zip(a + [0] * (len(b) - len(a)), b + [0] * (len(a) - len(b)))])
            elif f.name == "exact":
                out.exact = a and b
            else:
                setattr(out, f.name, a + b)
        return out

    def copy(self) -> "Stats":
        return dataclasses.replace(self, **{f.name: list(getattr(self, f.name)) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), list)})

    # -- derived
    @property
    def target_calls(self) -> int:
        return self.rounds

    @property
    def acceptance_rate(self) -> float | None:
        return _ratio(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per round, the bonus included (vLLM's 1 + accepted/drafts)."""
        return _ratio(self.new_tokens, self.rounds)

    @property
    def mean_draft_len(self) -> float | None:
        """Draft tokens per round that drafted: the K the speedup model uses (adaptive K varies it)."""
        return _ratio(self.num_draft_tokens, self.num_drafts)

    @property
    def target_calls_per_token(self) -> float | None:
        return _ratio(self.target_calls, self.new_tokens)

    @property
    def draft_calls_per_token(self) -> float | None:
        return _ratio(self.draft_calls, self.new_tokens)

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / p for a, p in zip(self.num_accepted_tokens_per_pos, self.num_draft_tokens_per_pos)]

    @property
    def tokens_per_s(self) -> float | None:
        """Decoding speed: the tokens of every round but each generation's first, over those rounds' wall time
        (the first token is the prefill's: time_to_first_token_s). One definition for the panel, generate, bench
        and the export."""
        return _ratio(self.new_tokens - self.first_round_tokens, self.decode_s - self.first_round_s)

    @property
    def ms_per_token(self) -> float | None:
        return _ratio(1000 * (self.decode_s - self.first_round_s), self.new_tokens - self.first_round_tokens)

    @property
    def time_to_first_token_s(self) -> float | None:
        return self.first_token_s[-1] if self.first_token_s else None

    @property
    def draft_ms_per_round(self) -> float | None:
        """Per round that drafted (a lookup round without a match, or an in-band plain round, drafts nothing)."""
        return _ratio(1000 * self.draft_s, self.num_drafts)

    @property
    def verify_ms_per_round(self) -> float | None:
        return _ratio(1000 * self.verify_s, self.rounds)

    @property
    def plain_step_s(self) -> float | None:
        """For mode off's statistics: the cost of one plain target step (a round's verify time)."""
        return _ratio(self.verify_s, self.rounds)

    def summary(self) -> dict:
        """Every field (except the per-generation first-token list) and every derived statistic."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "first_token_s"}
        for name in ("target_calls", "acceptance_rate", "mean_accepted_length", "mean_draft_len", "target_calls_per_token",
                     "draft_calls_per_token", "per_position_acceptance", "tokens_per_s", "ms_per_token",
                     "time_to_first_token_s", "draft_ms_per_round", "verify_ms_per_round"):
            out[name] = getattr(self, name)
        return out


# ---------------------------------------------------------------- the speedup model


def expected_tokens_per_round(acceptance: float, k: float) -> float:
    """E[tokens/round] = (1 - a^(K+1)) / (1 - a): accepted drafts plus the replacement or bonus, drafts i.i.d."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def predicted_speedup(acceptance: float, k: float, draft_cost: float, verify_cost: float) -> float:
    """Speedup over plain decoding: E[tokens/round] / (K c + v), costs relative to one plain target step."""
    return expected_tokens_per_round(acceptance, k) / (k * draft_cost + verify_cost)


@dataclass(frozen=True)
class SpeedupModel:
    """The predicted speedup and what it rests on, as measured. Every front end shows this one.

    predicted = tokens per round / cost of a round in plain steps, both measured over the same rounds (each
    generation's first left out, as tokens/s does). The i.i.d. formula (`iid`: acceptance a at every position,
    K drafts every round) misses where that does not hold: lookup accepts in runs and drafts only after a
    match (in a chat the formula gave 1.53x where 1.96x was measured). It stays for what
    only it can do: extrapolate to another K (tune)."""

    acceptance: float  # a
    k: float  # draft tokens per drafting round
    draft_cost: float  # c: one draft token, in plain target steps
    verify_cost: float  # v: one verify forward, in plain target steps
    plain_step_s: float  # the plain step the costs are relative to
    tokens_per_round: float  # emitted per round, the bonus or replacement included
    round_cost: float  # draft + verify of a round, in plain target steps
    rounds: int  # the rounds tokens_per_round and round_cost rest on

    @property
    def predicted(self) -> float:
        return self.tokens_per_round / self.round_cost if self.round_cost else 0.0

    @property
    def iid(self) -> float:
        return predicted_speedup(self.acceptance, self.k, self.draft_cost, self.verify_cost)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "predicted_speedup": self.predicted, "iid_speedup": self.iid}


def speedup_model(stats: Stats | None, plain_step_s: float | None) -> SpeedupModel | None:
    """The model for a mode's statistics against a plain step measured in seconds; None until both exist (and
    a round besides each generation's first)."""
    if stats is None or not plain_step_s or not stats.num_draft_tokens:
        return None
    rounds = stats.rounds - len(stats.first_token_s)
    if rounds <= 0:
        return None
    return SpeedupModel(
        acceptance=stats.acceptance_rate or 0.0,
        k=stats.mean_draft_len or 0.0,
        draft_cost=stats.draft_s / stats.num_draft_tokens / plain_step_s,
        verify_cost=stats.verify_s / stats.rounds / plain_step_s,
        plain_step_s=plain_step_s,
        tokens_per_round=(stats.new_tokens - stats.first_round_tokens) / rounds,
        round_cost=(stats.draft_s + stats.verify_s - stats.first_round_work_s) / rounds / plain_step_s,
        rounds=rounds,
    )


@dataclass(frozen=True)
class Baseline:
    """Plain decoding as measured by the latest plain rounds (mode off's, or the ones interleaved in-band with
    another mode's): what the predicted and measured speedups compare against, so both sides ran under the
    same load. `measured_at` (time.monotonic()) says how old it is."""

    step_s: float  # mean verify time of one plain round: one plain target step
    tokens_per_s: float
    rounds: int
    measured_at: float

    @classmethod
    def of(cls, rounds: Iterable[tuple[float, RoundRecord]]) -> "Baseline | None":
        """From (time, record) pairs of plain rounds; None without any."""
        rounds = list(rounds)
        wall = sum(r.wall_s for _, r in rounds)
        if not rounds or not wall:
            return None
        step_s = sum(r.verify_s for _, r in rounds) / len(rounds)
        return cls(step_s, sum(r.emitted for _, r in rounds) / wall, len(rounds), max(t for t, _ in rounds))


def measured_speedup(stats: Stats | None, plain: Stats | Baseline | None) -> float | None:
    """tokens/s of a mode over tokens/s of plain decoding (pass the plain rounds of the same window: the ones
    interleaved with the mode's, Snapshot.plain_for)."""
    if stats is None or plain is None or not stats.tokens_per_s or not plain.tokens_per_s:
        return None
    return stats.tokens_per_s / plain.tokens_per_s


MIN_ROUNDS = 10  # fewer drafting rounds than this, or fewer plain rounds than MIN_PLAIN: a figure is shown greyed
MIN_PLAIN = 3


def enough(stats: Stats | None, plain: Stats | None = None) -> bool:
    """Whether a mode's figures (and their plain baseline's) rest on enough rounds to be shown as more than a hint."""
    return stats is not None and stats.rounds >= MIN_ROUNDS and (plain is None or plain.rounds >= MIN_PLAIN)
