"""Mode `auto`: each round, the mode measured fastest so far (in this session, and earlier ones on this setup).

It does not draft itself: `for_round` hands the loop one of its candidates (plain decoding, the suffix drafter,
the draft head, the int8 copy of mode quant, a draft model: whichever can run), and the loop runs that round
exactly as if the user had chosen that mode. The choice depends only on earlier rounds, never on this round's
draws, and every candidate is exact, so `auto` is exact too.

What it measures: per arm (a mode; suffix has one per match length) and sampling setting, tokens per second of
engine time (draft + verify), exponentially weighted; an estimate weighs half as much against a new round for every
DECAY rounds its arm went unmeasured, so a change of load reaches it at once. A round counts its expected tokens
(RoundRecord.expected_tokens: less noisy than the one draw); one that drafted nothing, as a plain step at its mode's
cost; a cached drafter's catching-up round (`Drafter.catches_up`: its first after another mode's, and a reply's
first, which feeds it the new prompt), a switching cost, not at all.

How it chooses: every candidate runs MIN_ROUNDS counted rounds, then up to WARMUP while its upper bound (Rate.upper,
which narrows with its rounds by the spread of its own per-round rates) is above the leader's rate: a UCB-style race.
An arm whose ceiling (Rate.ceiling: its rate had every draft been accepted) is below the leader's rate cannot win
and is not run until the leader's rate falls below it. Otherwise the leader runs, except that a losing candidate
runs again after a wait that doubles with each loss (FIRST_WAIT to MAX_WAIT rounds, stretched by `trail`), and the
incumbent (the arm it last chose on the rates, not one it ran to measure) stays unless another is faster by more than
HYSTERESIS (switching drafters costs a resync).

What it remembers (`memory`: store.LearntRates, one file per target, draft, engine, device, dtype, threads and
machine): every arm's rate and ceiling, so a new session's first reply runs the best known mode. A remembered rate
weighs as PRIOR_ROUNDS rounds, halved every HALF_LIFE_DAYS, and its arm is re-measured after REMEMBERED_WAIT rounds,
so a rate learnt under other load cannot pin a bad choice.

Suffix shadows: suffix is a candidate only where the context has a match, and is measured without running it. In
rounds other modes run, its drafts are scored against the tokens that follow (the target's, whatever mode ran) at
the cost of a verify that long (`VerifyCosts`, from every mode's rounds) plus a lookup; so it runs only where it is
fastest, or where no verify as long as its drafts has a cost yet.

Left out: lookup (suffix's special case); layerskip and earlyexit, which draft with nearly the whole target (0.8-0.9
of a step a draft) and can only lose; lowrank and quant's torch.ao copy, whose seconds of building would stall a
reply. quant is a candidate as the lean runner's int8 copy only. The others stay one key away.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from specchat.engine.draft_length import VerifyCosts
from specchat.engine.drafters.base import Drafter
from specchat.engine.errors import ModeUnavailable
from specchat.engine.sampling_params import setting_key

CANDIDATES = ("off", "suffix", "head", "quant", "draft")  # in the order their first rounds run
ONLY = {"quant": {"quant_backend": "int8"}}  # a candidate only in this form
PRICED = ("head", "quant", "draft")  # priced by K measured where K is measured (`price`); suffix by its shadows
MIN_ROUNDS = 2  # counted rounds every candidate runs before the choice starts
WARMUP = 6  # a candidate that could still beat the leader is measured up to this many rounds
SPREAD = 0.5  # the widest spread of a rate's bound, used until two rounds tell (per-round CV reaches 0.8-0.9)
CV_FLOOR = 0.1  # the narrowest: even plain steps vary ~10% round to round, so two equal rounds are not exact
PRIOR_ROUNDS = 3  # a remembered rate weighs as this many rounds of this session (halved every HALF_LIFE_DAYS)
HALF_LIFE_DAYS = 7.0  # a remembered rate's weight halves every this many days (under one round: forgotten)
REMEMBERED_WAIT = 8  # an arm known only from earlier sessions runs again after this many rounds
WINDOW = 16  # rounds an estimate averages over (exponential weights)
DECAY = 16  # an estimate weighs half as much against a new round for every DECAY auto rounds it went unmeasured
FIRST_WAIT, MAX_WAIT = 16, 64  # rounds before a losing candidate runs again, doubling after each loss (times `trail`)
MAX_TRAIL = 4  # the most a wait stretches for an arm far behind the leader, or costly to re-measure (catching up)
HYSTERESIS = 0.05  # another mode must be this much faster to replace the one running
# the suffix drafter's arms: a long match predicts a copy, a 2-token one is a guess
MATCH_ARMS = ((6, "suffix≥6"), (3, "suffix3-5"), (1, "suffix2"))  # (shortest match, arm), longest first


@dataclass
class Rate:
    """Exponentially weighted tokens and seconds per round of one arm (a mode; suffix has one per match length)."""

    tokens: float = 0.0
    seconds: float = 0.0
    most: float = 0.0  # tokens a round would have given with every draft accepted (1 + its drafts), weighted alike
    rounds: int = 0
    last: int = 0  # the auto round of its latest measurement
    wait: int = FIRST_WAIT  # rounds it may go unmeasured
    earlier: int = 0  # rounds measured in earlier sessions (what `rounds` starts from weighs less: PRIOR_ROUNDS)
    live: int = 0  # rounds measured in this session
    measured_at: float = 0.0  # unix time of the latest measurement (kept with the rate between sessions)
    catch_up_s: float = 0.0  # seconds of its latest catching-up round (a drafter with a cache of its own), not counted
    round_rate: float = 0.0  # this session's per-round rates (tokens / seconds of each round), weighted as above
    round_rate_sq: float = 0.0  # ... and their squares: how much they vary (`spread`)
    round_ceiling: float = 0.0  # the same of each round's ceiling (most / seconds): its timing alone varies
    round_ceiling_sq: float = 0.0
    ceiling_cv: float = SPREAD  # the ceiling's spread until two rounds of this session tell (remembered: as saved)
    expected: float | None = None  # a drafting mode's rate as K measured expects it at the K it runs next (`price`)

    @classmethod
    def remembered(cls, entry: dict, now: float) -> "Rate | None":
        """A rate saved by an earlier session, weighted down by its age; None when too old or unreadable."""
        try:
            tokens, seconds, earlier, at = float(entry["tokens"]), float(entry["seconds"]), int(entry["rounds"]), float(entry["at"])
        except (KeyError, TypeError, ValueError):
            return None
        weight = min(PRIOR_ROUNDS, earlier) * 0.5 ** (max(now - at, 0.0) / (HALF_LIFE_DAYS * 86400))
        if weight < 1 or tokens <= 0 or seconds <= 0:
            return None
        most, cv = entry.get("most", 0.0), entry.get("ceiling_cv", SPREAD)  # (saved before they were kept: none)
        most = float(most) if isinstance(most, (int, float)) and most >= tokens else 0.0
        cv = min(SPREAD, max(CV_FLOOR, float(cv))) if isinstance(cv, (int, float)) else SPREAD
        return cls(tokens, seconds, most, rounds=int(weight + 0.5), wait=REMEMBERED_WAIT, earlier=earlier, measured_at=at,
                   ceiling_cv=cv)

    def saved(self) -> dict:
        return {"tokens": self.tokens, "seconds": self.seconds, "most": self.most,
                "ceiling_cv": self._cv(self.round_ceiling, self.round_ceiling_sq, self.ceiling_cv),
                "rounds": self.earlier + self.live, "at": self.measured_at}

    def add(self, tokens: float, seconds: float, at: int, most: float | None = None) -> None:
        # what the estimate so far weighs against this round, in rounds: at most WINDOW - 1, less the longer the arm
        # went unmeasured (halved every DECAY rounds), so a rate measured before a change of load gives way at once
        kept = min(self.rounds, WINDOW - 1) * 0.5 ** (max(at - self.last - 1, 0) / DECAY) if self.rounds else 0.0
        w = 1.0 / (1.0 + max(kept, 1.0)) if self.rounds else 1.0
        self.rounds += 1
        self.live += 1
        self.measured_at = time.time()
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)
        most = tokens if most is None else max(most, tokens)
        self.most += w * (most - self.most)
        r = tokens / seconds if seconds > 0 else 0.0
        c = most / seconds if seconds > 0 else 0.0
        w = 1.0 if self.live == 1 else w  # a remembered rate brings no per-round rates
        self.round_rate += w * (r - self.round_rate)
        self.round_rate_sq += w * (r * r - self.round_rate_sq)
        self.round_ceiling += w * (c - self.round_ceiling)
        self.round_ceiling_sq += w * (c * c - self.round_ceiling_sq)
        self.last = at

    @property
    def per_s(self) -> float:
        """Tokens per second: K measured's expectation where there is one, else its rounds' (what is saved)."""
        if self.expected is not None:
            return self.expected
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def spread(self) -> float:
        """How far one round's rate strays from the arm's, relative: the coefficient of variation of this session's
        per-round rates, at least CV_FLOOR and at most SPREAD; SPREAD until two rounds of this session tell. Plain
        decoding's rounds all give one token at nearly the same cost, so two of them settle its rate; a drafting
        mode's rounds give 1 to K+1 tokens, greedy ones without the smoothing of acceptance probabilities."""
        return self._cv(self.round_rate, self.round_rate_sq)

    def _cv(self, mean: float, mean_sq: float, before: float = SPREAD) -> float:
        if self.live < 2 or mean <= 0:
            return before
        return min(SPREAD, max(CV_FLOOR, math.sqrt(max(mean_sq - mean**2, 0.0)) / mean))

    @property
    def _n(self) -> int:
        """The rounds its estimates rest on (a remembered one: all of its rounds)."""
        return max(self.rounds, self.earlier + self.live, 1)

    @property
    def ceiling(self) -> float:
        """Its rate if every draft were accepted, with the spread of its rounds' timing: drafts and verifies cost
        what they cost whatever the target says, so no luck in acceptance brings it above this (inf until a round
        tells). Plain decoding's is its rate's upper bound."""
        if self.seconds <= 0 or self.most <= 0:
            return math.inf
        cv = self._cv(self.round_ceiling, self.round_ceiling_sq, self.ceiling_cv)
        return self.most / self.seconds * (1 + cv / math.sqrt(self._n))

    @property
    def upper(self) -> float:
        """What the rate could still be, given how few rounds it rests on and how much they vary."""
        return self.per_s * (1 + self.spread / math.sqrt(self._n))


@dataclass
class Shadow:
    """A suffix draft of a round another mode ran, scored against the tokens that followed it: the target's tokens,
    drawn from its distribution whatever mode ran (every candidate is exact), so 1 + the drafts they match is what
    running it would have emitted, in expectation, at any temperature."""

    arm: str
    table: dict[str, Rate]  # the sampling setting's rates it counts in
    drafts: list[int]
    seen: list[int] = field(default_factory=list)  # the tokens emitted since

    def tokens(self) -> int | None:
        """Tokens a round of these drafts would have emitted; None while the tokens so far match them all."""
        matched = 0
        while matched < min(len(self.seen), len(self.drafts)) and self.seen[matched] == self.drafts[matched]:
            matched += 1
        return matched + 1 if matched == len(self.drafts) or matched < len(self.seen) else None


@dataclass(frozen=True)
class Standing:
    """One arm as the front ends show it: its rate, and the most it could reach (every draft accepted)."""

    arm: str
    per_s: float  # tokens per second of engine time
    ceiling: float | None  # tokens per second had every draft been accepted; None before a round tells
    rounds: int  # what the rate rests on (earlier sessions' included)


class AutoDrafter(Drafter):
    name = "auto"

    @classmethod
    def build(cls, target, draft=None, *, build_candidate, memory=None, **options) -> "AutoDrafter":
        """`build_candidate` is drafters.build_drafter (passed in: this module is one of the drafters it imports);
        `memory` keeps the rates between sessions (store.LearntRates: load() and save(dict)), None: this session only."""
        candidates = {}
        for mode in CANDIDATES:
            try:
                candidates[mode] = build_candidate(mode, target, draft, **{**options, **ONLY.get(mode, {})})
            except ModeUnavailable:  # no head for this target, no draft model, no int8 kernel: not a candidate
                pass
        return cls(candidates, memory)

    def __init__(self, candidates: dict[str, Drafter], memory=None) -> None:
        if "off" not in candidates:
            raise ValueError("auto needs plain decoding among its candidates")
        self.candidates = candidates
        # the arms whose rates are compared: one per mode, and suffix split by the length of its match
        self.arm_mode = {mode: mode for mode in candidates if mode != "suffix"}
        if "suffix" in candidates:
            self.arm_mode.update({label: "suffix" for _, label in MATCH_ARMS})
        self.memory = memory
        self.known = memory.load() if memory is not None else {}  # setting -> arm -> a rate saved by an earlier session
        self.tables: dict[str, dict[str, Rate]] = {}  # sampling setting (setting_key) -> arm -> its rate
        self.rates = self._table(None)
        self.rounds = 0
        self.arm = self.choice = "off"  # the arm and the mode of the latest round
        self.leader = "off"  # the arm the rates chose last: what HYSTERESIS keeps (a round run to measure leaves it)
        self.ran: str | None = None  # the mode whose drafter ran the latest round (None: caches just reset)
        self.caught_up: str | None = None  # the arm whose latest round only caught up (it runs again, counted)
        self.why = "measuring every mode first"
        self.k = 0  # drafts a round asks for (the loop's K, from the latest round)
        self.verify = VerifyCosts()  # what a verify costs by its positions: the same for every arm
        self.suffix_draft_s = 0.0  # seconds of a suffix draft (a lookup), averaged over its rounds
        self.shadows: list[Shadow] = []  # suffix drafts of rounds other modes ran, not yet scored
        self.next_position = 0  # len(state.tokens) the next round starts from, if it continues this one
        self.matched: str | None = None  # the suffix arm of the latest round's context (None: no match)

    def reset(self) -> None:
        """The candidates forget their caches; the rates stay: they are what this session learnt about the machine."""
        for drafter in self.candidates.values():
            drafter.reset()
        self.ran = None
        self.shadows = []

    @property
    def max_draft(self) -> int | None:
        return getattr(self.candidates[self.choice], "max_draft", None)

    def draft_len(self, k: int) -> int:
        """What the mode it runs asks for (the loop asks that mode itself; this is for the panel)."""
        return self.candidates[self.choice].draft_len(k)

    def _table(self, params) -> dict[str, Rate]:
        key = setting_key(params)
        if key not in self.tables:
            known, now = self.known.get(key), time.time()
            known = known if isinstance(known, dict) else {}  # (a hand-edited file: what is not a table is ignored)
            remembered = {arm: Rate.remembered(known[arm], now) if isinstance(known.get(arm), dict) else None for arm in self.arm_mode}
            self.tables[key] = {arm: remembered[arm] or Rate() for arm in self.arm_mode}
        return self.tables[key]

    def save(self) -> None:
        """Keep what this session measured for the next one (with what earlier sessions measured for arms and
        settings it did not run)."""
        if self.memory is None:
            return
        saved = {key: dict(arms) for key, arms in self.known.items() if isinstance(arms, dict)}
        for key, table in self.tables.items():
            saved.setdefault(key, {}).update({arm: rate.saved() for arm, rate in table.items() if rate.live})
        self.memory.save(saved)

    @property
    def learnt_from(self) -> tuple[int, int]:
        """Rounds behind the current setting's rates: (from earlier sessions, this session's)."""
        return sum(r.earlier for r in self.rates.values()), sum(r.live for r in self.rates.values())

    def for_round(self, state, params, sizing=None) -> Drafter:
        self.rounds += 1
        self.rates = self._table(params)
        self.price(sizing, params)
        if len(state.tokens) != self.next_position:  # a new prompt, or a rewind: what follows the shadows is unknown
            self.shadows = []
        self.next_position = len(state.tokens)
        # right after a prefill (round 0) the pending token's logits came with it: plain decoding's round is free and
        # measures nothing, a drafting round's verify is a real step
        self.arm, self.why = self.choose(state.tokens, prefilled=state.head is not None)
        self.choice = self.arm_mode[self.arm]
        if self.matched is not None and self.choice != "suffix" and self.k > 0:
            suffix = self.candidates["suffix"]
            drafts, _ = suffix.drafts(state.tokens, suffix.draft_len(self.k))
            if drafts:
                self.shadows.append(Shadow(self.matched, self.rates, drafts))
        return self.candidates[self.choice]

    def price(self, sizing, params) -> None:
        """With K measured (`sizing`: the loop's MeasuredK), a drafting mode is priced at what K measured's model
        expects of it at the K it will run, from its rounds at every K under this sampling setting (`params`). Its
        own rounds' rate mixes Ks: a cold start's rounds at the start K priced the draft model below plain decoding
        on a CPU where K=1 beats plain decoding (Zen 3, the Qwen pair), and the race left it for 16 rounds or more."""
        for arm, mode in self.arm_mode.items():
            if mode in PRICED:
                self.rates[arm].expected = sizing.rate(mode, params) if sizing is not None else None

    def match_arm(self, tokens: list[int]) -> str | None:
        """The suffix drafter's arm for this context (by how long its match is), or None when it has no match."""
        suffix = self.candidates.get("suffix")
        length = suffix.match_length(tokens) if suffix is not None else 0
        return next((label for shortest, label in MATCH_ARMS if length >= shortest), None) if length else None

    def choose(self, tokens: list[int], prefilled: bool = False) -> tuple[str, str]:
        """The arm for the next round and why, from the rates so far. `prefilled`: the round follows a prefill."""
        rates = self.rates
        self.matched = matched = self.match_arm(tokens)
        eligible = [arm for arm, mode in self.arm_mode.items() if mode != "suffix" or arm == matched]
        # the arms measured by running them: a suffix arm is measured by its shadows, for free, once a verify as long
        # as its drafts has a cost (until then, it runs to measure one)
        suffix = self.candidates.get("suffix")
        shadowed = suffix is not None and self.verify.cost(suffix.draft_len(self.k) + 1) is not None
        best = max(eligible, key=lambda a: (rates[a].per_s, a == "off"))
        # an arm whose ceiling is below the leader's rate is not run again: it cannot win, whatever its acceptance
        # (a draft model on llama.cpp, where its round costs ~6 plain steps for 5 tokens at most); it is tried again
        # only when the leader's rate falls below its ceiling (a change of load)
        run_to_measure = [arm for arm in eligible if not (shadowed and self.arm_mode[arm] == "suffix")
                          and (arm == best or rates[arm].ceiling >= rates[best].per_s)]
        warming = [arm for arm in run_to_measure if rates[arm].rounds < MIN_ROUNDS]
        if warming:  # after a prefill, an arm whose round then counts: one that drafts, on a cache it need not catch up
            counted = [arm for arm in warming if self.arm_mode[arm] != "off"
                       and not getattr(self.candidates[self.arm_mode[arm]], "catches_up", False)]
            return (counted[0] if prefilled and counted else warming[0]), "measuring every mode first"
        rates[best].wait = FIRST_WAIT  # the leader: watched closely again once it loses the lead
        if self.caught_up in eligible and self.caught_up != best:
            return self.caught_up, f"re-measuring {self.caught_up}"  # the round that counts, after catching up
        for arm in run_to_measure:
            if arm != best and rates[arm].rounds < WARMUP and rates[arm].upper > rates[best].per_s:
                return arm, f"measuring {arm}: it may beat {best}"
        for arm in run_to_measure:
            if arm != best and self.rounds - rates[arm].last > rates[arm].wait * self.trail(arm, best):
                rates[arm].wait = min(2 * rates[arm].wait, MAX_WAIT)
                return arm, f"re-measuring {arm}"
        if self.leader in eligible and rates[self.leader].per_s * (1 + HYSTERESIS) >= rates[best].per_s:
            best = self.leader
        self.leader = best
        return best, self.explain(best, eligible)

    def trail(self, arm: str, best: str) -> float:
        """How much longer `arm` waits to be re-measured: how far it trails the leader, times what a re-measurement
        costs in its rounds (a cached drafter's catching-up round too: a draft model's prefill of a new prompt cost
        ~2 of its rounds on the Qwen pair), from 1 up to MAX_TRAIL."""
        rate = self.rates[arm]
        behind = self.rates[best].per_s / max(rate.per_s, 1e-9)
        rounds = 1 + rate.catch_up_s / rate.seconds if rate.seconds > 0 else 1.0
        return min(max(behind * rounds, 1.0), MAX_TRAIL)

    def explain(self, best: str, eligible: list[str]) -> str:
        """The leader's rate against the others', each with its ceiling where that is below the leader's (it cannot
        win: not run again), and where the figures come from."""
        lead = self.rates[best].per_s
        others = ", ".join(f"{a} {self.rates[a].per_s:.0f}" + (f" (≤{c:.0f})" if (c := self.rates[a].ceiling) < lead else "")
                           for a in eligible if a != best)
        why = f"{best} {lead:.0f} tok/s" + (f" vs {others}" if others else "")
        earlier, live = self.learnt_from  # where the figures come from first: the line is cut at the panel's width
        return (f"learnt over {earlier:,} rounds earlier + {live:,} now: " if earlier else "") + why

    def observe(self, record) -> None:
        self.next_position += len(record.tokens)
        if record.stop_reason is None:
            self.k = record.draft_len
            if record.drafted or record.index > 0:  # (round 0 without drafts: its token came with the prefill)
                self.verify.add(record.drafted + 1, record.verify_s)
        if record.mode == "suffix" and record.drafted:
            self.suffix_draft_s += (record.draft_s - self.suffix_draft_s) / 8
        self.score_shadows([event.id for event in record.tokens], ended=record.stop_reason is not None)
        drafter = self.candidates.get(record.mode)
        # a reply's first round feeds a cached drafter the new prompt (the target prefilled it), whatever ran before
        fresh = record.mode != self.ran or (record.index == 0 and record.draft_len > 0)
        catching_up = getattr(drafter, "catches_up", False) and fresh
        self.ran = record.mode
        self.caught_up = self.arm if catching_up else None
        if catching_up:  # its draft time includes feeding what it missed: not this mode's cost per round
            if self.arm in self.rates:
                self.rates[self.arm].catch_up_s = record.draft_s + record.verify_s  # what its next re-measurement costs more
            return
        if not record.drafted and record.index == 0:  # its token came with the prefill, there is no step to time
            self.why = self.unmeasured(record.mode)
            return
        # the arm that ran, credited with what it gave, drafts or none: a drafter that proposes nothing (a head
        # below --adaptive's p_min) is a plain step at its own cost; counted for off, it would never
        # finish its warm-up and auto would run it forever
        arm = self.arm if record.mode == self.arm_mode.get(self.arm) else record.mode
        if arm not in self.rates:
            return
        tokens = record.expected_tokens if record.stop_reason is None else len(record.tokens)  # the last round is cut
        self.rates[arm].add(tokens, record.draft_s + record.verify_s, self.rounds, most=record.drafted + 1)

    def unmeasured(self, mode: str) -> str:
        """The reason after a round 0 that drafted nothing: a round run to measure an arm must not read as a
        measurement (a session of one-token replies has no other rounds, and never leaves the warm-up)."""
        if not self.why.startswith(("measuring", "re-measuring")):
            return self.why  # a choice made from the rates so far: still why
        return f"{self.why} ({mode} drafted nothing in round 0: no step to time)"

    def standings(self) -> tuple[Standing, ...]:
        """The current setting's measured arms, fastest first."""
        arms = [Standing(arm, r.per_s, r.ceiling if math.isfinite(r.ceiling) else None, r._n)
                for arm, r in self.rates.items() if r.rounds]
        return tuple(sorted(arms, key=lambda a: -a.per_s))

    def verify_steps(self, k: int) -> float | None:
        """What a verify of a full round of `k` drafts (k + 1 positions) costs in plain steps on this machine: the
        number of tokens a round must give to pay; None until both are measured. The caller's K, the one it names
        beside the figure (the last round's K may be a long suffix match's 15)."""
        plain, verify = self.rates.get("off"), self.verify.cost(k + 1) if k else None
        return verify * plain.per_s if verify is not None and plain is not None and plain.per_s > 0 else None

    def score_shadows(self, emitted: list[int], ended: bool) -> None:
        """Credit each suffix arm with the shadows the tokens emitted so far decide, at the verify cost of their
        length (a lookup's draft time added); a reply's end drops the undecided."""
        pending = []
        for shadow in self.shadows:
            shadow.seen.extend(emitted)
            tokens = shadow.tokens()
            cost = self.verify.cost(len(shadow.drafts) + 1)
            if tokens is not None and cost is not None:
                shadow.table[shadow.arm].add(tokens, cost + self.suffix_draft_s, self.rounds, most=len(shadow.drafts) + 1)
            elif tokens is None and not ended:
                pending.append(shadow)
        self.shadows = pending
