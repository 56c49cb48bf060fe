"""The draft length K, measured: each round, per mode, the K that maximises expected tokens per second of engine time,

    E[tokens | K] / (K c + v(K + 1)),    E[tokens | K] = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_K

(Leviathan et al. 2023, section 3.5, with a per-position a_i), where a_i is how often draft i was accepted when drafts
1..i-1 were and c a draft token's seconds, from this mode's recent rounds, and v(n) a verify of n positions'
seconds, from every mode's (the same target forward whichever mode drafted; plain rounds give v(1)).

Why: the best K is a property of the pair and the machine, not of the method: how much a verify's cost grows with
its positions differs between CPUs several-fold, so a fixed K is right on one of them at most. K depends only on
earlier rounds, never on this round's draws, and every round runs the exact rule, so the output follows the target's
distribution whatever K is chosen.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from specchat.engine.sampling_params import SamplingParams, setting_key

WINDOW = 32  # rounds a mode's estimates average over (exponential weights): acceptance moves with the text
MIN_ROUNDS = 2  # a mode's rounds at its starting K before K moves: a bad start K costs most in a first reply
EXPLORE_EVERY = 6  # every this many rounds of a mode, the best K's neighbour runs (below, then above): their costs stay measured
PRIOR = 2.0  # rounds a_i's prior weighs: the acceptance pooled over every position (an untried one is neither hope nor doom)


class VerifyCosts:
    """Seconds of a verify by the positions it fed, averaged: the same target forward whichever mode drafted."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}  # positions -> seconds (the first counts whole, then 1/8)

    def add(self, positions: int, seconds: float) -> None:
        known = self.seconds.get(positions)
        self.seconds[positions] = seconds if known is None else known + (seconds - known) / 8

    def cost(self, positions: int) -> float | None:
        """Measured, but never below a shorter verify's measured cost (more positions never cost less: one noisy
        round must not make a long verify look cheap); between two measured, on the line through them; past the
        longest, on the steeper of the lines through the two longest and through the shortest and the longest
        (two close, noisy points draw any slope, even a falling one), never above `positions` one-position
        verifies, which one slow round of two positions would otherwise multiply; else the nearest above, which
        bounds it; else None."""
        return self._cost(positions, *self._envelope())

    def costs(self, longest: int) -> list[float | None]:
        """cost(1) .. cost(longest), the measured costs sorted once (K measured prices every K each round)."""
        lengths, costs = self._envelope()
        return [self._cost(n, lengths, costs) for n in range(1, longest + 1)]

    def _envelope(self) -> tuple[list[int], dict[int, float]]:
        """The measured lengths, sorted, and each one's cost raised to every shorter one's."""
        lengths, costs, most = sorted(self.seconds), {}, 0.0
        for n in lengths:
            most = costs[n] = max(most, self.seconds[n])
        return lengths, costs

    @staticmethod
    def _cost(positions: int, lengths: list[int], costs: dict[int, float]) -> float | None:
        if positions in costs:
            return costs[positions]
        above = [n for n in lengths if n > positions]
        below = [n for n in lengths if n < positions]
        if above and below:
            a, b = below[-1], above[0]
            return costs[a] + (costs[b] - costs[a]) * (positions - a) / (b - a)
        if len(below) < 2:
            return costs[above[0]] if above else None
        first, a, b = below[0], below[-2], below[-1]
        slope = max((costs[b] - costs[a]) / (b - a), (costs[b] - costs[first]) / (b - first))
        line = costs[b] + slope * (positions - b)
        return min(line, positions * costs[1]) if 1 in costs else line


@dataclass
class ModeRounds:
    """One mode's recent rounds, exponentially weighted."""

    reached: list[float]  # [k_max] rounds in which draft i was judged with drafts 1..i-1 accepted
    accepted: list[float]  # [k_max] ... and draft i accepted too
    draft_s: float = 0.0  # seconds of drafting
    drafts: float = 0.0  # drafts those seconds made
    rounds: int = 0  # rounds seen (unweighted)

    def acceptance(self) -> list[float]:
        """a_1..a_kmax, each shrunk toward the acceptance pooled over all positions by PRIOR rounds."""
        pooled = (sum(self.accepted) + 0.5) / (sum(self.reached) + 1.0)
        return [(accepted + PRIOR * pooled) / (reached + PRIOR) for reached, accepted in zip(self.reached, self.accepted)]


class MeasuredK:
    """K per mode and sampling setting by measured cost (above); the loop asks `k(mode, params)` before a round and
    hands it the round after. Acceptance depends on the setting (greedy agreement is not T=0.7's sum of min(p, q)),
    so a mode's rounds are kept per setting; a verify's cost is shared by all.

    A mode starts at `start` (the user's -k) and moves once MIN_ROUNDS rounds have measured it; every EXPLORE_EVERY
    rounds it runs a neighbour of its best K, so the verify costs on either side stay measured and the line through
    them can move the choice further. `p_min` > 0 also stops a model draft when its top probability falls below it.
    `memory` (store.LearntRates of this setup): a session starts from what the last one measured, at its weights
    (new rounds outweigh them within WINDOW rounds, a verify's cost within 8), and `save` keeps this one's.
    """

    def __init__(self, start: int = 4, k_min: int = 1, k_max: int = 12, p_min: float = 0.0, memory=None) -> None:
        self.start, self.k_min, self.k_max, self.p_min = start, k_min, k_max, p_min
        self.settings: dict[str, dict[str, ModeRounds]] = {}  # setting_key -> mode -> its rounds
        self.verify = VerifyCosts()
        self.best: dict[str, int] = {}  # mode -> the K the model chose last (what the panel shows as its K)
        self.last_mode: str | None = None  # the mode of the latest round observed
        self.memory = memory
        if memory is not None:
            self.recall(memory.load())

    def recall(self, saved: dict) -> None:
        """What `save` wrote; anything else (another version's file, a hand edit) is ignored, whole or in part."""
        try:
            verify = {int(n): float(s) for n, s in saved.get("verify", {}).items() if int(n) >= 1 and float(s) > 0}
            settings = {str(key): {str(mode): self._recalled(m) for mode, m in modes.items()}
                        for key, modes in saved.get("settings", {}).items()}
        except (AttributeError, KeyError, TypeError, ValueError):
            return
        self.verify.seconds, self.settings = verify, settings

    def _recalled(self, m: dict) -> ModeRounds:
        """One mode's rounds as `save` wrote them, padded to k_max."""
        reached, accepted = ([float(x) for x in m[key]][: self.k_max] for key in ("reached", "accepted"))
        return ModeRounds(reached + [0.0] * (self.k_max - len(reached)), accepted + [0.0] * (self.k_max - len(accepted)),
                          float(m["draft_s"]), float(m["drafts"]), min(int(m["rounds"]), MIN_ROUNDS))

    def save(self) -> None:
        if self.memory is not None:
            self.memory.save({"verify": {str(n): s for n, s in self.verify.seconds.items()},
                              "settings": {key: {mode: asdict(stats) for mode, stats in modes.items() if stats.rounds}
                                           for key, modes in self.settings.items()}})

    def _rounds(self, mode: str, params: SamplingParams | None) -> ModeRounds:
        modes = self.settings.setdefault(setting_key(params), {})
        if mode not in modes:
            modes[mode] = ModeRounds([0.0] * self.k_max, [0.0] * self.k_max)
        return modes[mode]

    def k(self, mode: str, params: SamplingParams | None = None) -> int:
        """The K of `mode`'s next round under `params` (no side effect but `best`: the panel may ask as well as the
        loop)."""
        stats = self._rounds(mode, params)
        if stats.rounds < MIN_ROUNDS:
            return self.start
        best = self.best[mode] = self.choose(mode, params)
        if stats.rounds % EXPLORE_EVERY:
            return best
        neighbour = best - 1 if stats.rounds // EXPLORE_EVERY % 2 else best + 1  # below, then above
        return neighbour if self.k_min <= neighbour <= self.k_max else best

    def choose(self, mode: str, params: SamplingParams | None = None) -> int:
        """The K with the most expected tokens per second among those whose verify has a cost; the start K until the
        mode has drafted."""
        return self._best(mode, params)[0]

    def rate(self, mode: str, params: SamplingParams | None = None) -> float | None:
        """The tokens per second `mode` is expected to give at the K `choose` finds, from all its rounds at any K;
        None until it has drafted. What auto prices a drafting mode by: its measured rate mixes rounds at every K it
        ran, a cold start's among them."""
        return self._best(mode, params)[1] if mode in self.settings.get(setting_key(params), {}) else None

    def _best(self, mode: str, params: SamplingParams | None) -> tuple[int, float | None]:
        stats = self._rounds(mode, params)
        if stats.drafts <= 0:
            return self.start, None
        c, alphas, verify = stats.draft_s / stats.drafts, stats.acceptance(), self.verify.costs(self.k_max + 1)
        best, best_rate, tokens, chain = self.start, None, 1.0, 1.0
        for k in range(1, self.k_max + 1):
            chain *= alphas[k - 1]
            tokens += chain
            v = verify[k]  # a verify of k + 1 positions
            if k < self.k_min or v is None:
                continue
            rate = tokens / (k * c + v)
            if best_rate is None or rate > best_rate:
                best, best_rate = k, rate
        return best, best_rate

    def observe(self, record, params: SamplingParams | None = None) -> None:
        """Fold a finished round, run under `params`, in: which drafts were accepted, what drafting and the verify
        cost. A reply's last round (cut at EOS or the budget) is left out; so is the draft time of a reply's first
        round and of a mode's first round after another's, which include feeding the draft what it missed (a prompt,
        other modes' tokens)."""
        switched, self.last_mode = record.mode != self.last_mode, record.mode
        if record.stop_reason is not None:
            return
        if record.drafted or record.index > 0:  # (a reply's first plain round: its token came with the prefill)
            self.verify.add(record.drafted + 1, record.verify_s)
        if not record.drafted:  # no drafts (no match, plain decoding): nothing more about K
            return
        stats = self._rounds(record.mode, params)
        keep = 1.0 - 1.0 / WINDOW
        for i in range(self.k_max):
            stats.reached[i] *= keep
            stats.accepted[i] *= keep
        for i in range(min(record.drafted, record.accepted + 1, self.k_max)):
            stats.reached[i] += 1.0
            stats.accepted[i] += 1.0 if i < record.accepted else 0.0
        if record.index > 0 and not switched:
            stats.draft_s = keep * stats.draft_s + record.draft_s
            stats.drafts = keep * stats.drafts + record.drafted
        stats.rounds += 1
