"""Mode auto under a loaded machine's noise: does its choice settle on a mode that loses to plain decoding?

The real AutoDrafter chooses between plain decoding and one drafting mode whose true rate is `--ratio` of plain
decoding's (0.75: the Qwen2.5-Coder 1.5B/0.5B pair's draft on llama.cpp, issue 54). Every round's seconds are drawn
with lognormal noise of coefficient of variation `--cv` (0.1 idle, 0.3-0.5 load ~5 on 2 cores) times a load
factor that drifts every 50 rounds (lognormal, sigma 0.3), so rates measured at different times disagree as they do
live. A drafting round drafts 4 tokens accepted with probability 0.45 each; auto counts the expectation given its
drafts (1.8 tokens), as the loop's RoundRecord.expected_tokens does. With `--baseline N` one plain round runs after
every N rounds of another mode, as the chat does (session.measure_baseline, N = 32): those count for plain
decoding in auto's table too. The figure is the share of rounds spent on the losing mode, over `--seeds` sessions of
`--rounds` rounds.

    python benchmarks/auto_noise.py --cv 0.1,0.3,0.5,0.8 --baseline 0,32
"""

from __future__ import annotations

import argparse
import math
import random
from types import SimpleNamespace

from specchat.engine.drafters.auto import AutoDrafter
from specchat.engine.drafters.base import Drafter
from specchat.engine.drafters.plain import PlainDecoding
from specchat.engine.sampling import SamplingParams

STEP_S = 0.25  # a plain step: 4 tok/s, the Qwen pair's on 2 cores
DRAFTS, ACCEPT = 4, 0.45
EXPECTED = sum(ACCEPT**i for i in range(DRAFTS + 1))  # 1 + a + a^2 + ... : tokens a round gives, in expectation


class Draft(Drafter):
    name, catches_up = "draft", True  # a draft model: after another mode ran, its first round catches up

    def reset(self) -> None:
        pass


def record(mode: str, tokens: int, expected: float, draft_s: float, verify_s: float, drafted: int) -> SimpleNamespace:
    return SimpleNamespace(mode=mode, drafted=drafted, index=1, tokens=[SimpleNamespace(id=0)] * tokens, expected_tokens=expected,
                           stop_reason=None, draft_s=draft_s, verify_s=verify_s, draft_len=DRAFTS)


def session(seed: int, cv: float, rounds: int, ratio: float, baseline: int) -> float:
    """The share of `rounds` that ran the losing mode in one session."""
    rng = random.Random(seed)
    auto = AutoDrafter({"off": PlainDecoding(), "draft": Draft()})
    state, params = SimpleNamespace(tokens=[0], head=None), SamplingParams(0.7)
    losing, since, load = 0, 0, 1.0
    round_s = EXPECTED / (ratio / STEP_S)  # a drafting round's mean seconds: its rate is `ratio` of plain decoding's

    def noisy(seconds: float) -> float:
        return seconds * load * math.exp(rng.gauss(0, cv) - cv * cv / 2)  # mean `seconds * load`

    for i in range(rounds):
        if i % 50 == 0:
            load = math.exp(rng.gauss(0, 0.3))
        mode = auto.for_round(state, params).name
        since = 0 if mode == "off" else since + 1
        if baseline and since > baseline:  # the chat's in-band plain round
            mode, since = "off", 0
        if mode == "off":
            rec = record("off", 1, 1.0, 0.0, noisy(STEP_S), 0)
        else:
            losing += 1
            emitted = 1 + next((j for j in range(DRAFTS) if rng.random() >= ACCEPT), DRAFTS)
            rec = record("draft", emitted, EXPECTED, noisy(0.4 * round_s), noisy(0.6 * round_s), DRAFTS)
        state.tokens = state.tokens + [0] * len(rec.tokens)
        auto.observe(rec)
    return losing / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cv", default="0.1,0.3,0.5,0.8", help="per-round noise, comma-separated")
    parser.add_argument("--baseline", default="0,32", help="plain round every N rounds of another mode (0: none)")
    parser.add_argument("--ratio", type=float, default=0.75, help="the losing mode's true rate over plain decoding's")
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args()
    print("| in-band plain round | per-round CV | share of rounds on the losing mode: mean | worst session |")
    print("|---|---|---|---|")
    for baseline in (int(b) for b in args.baseline.split(",")):
        for cv in (float(c) for c in args.cv.split(",")):
            shares = [session(seed, cv, args.rounds, args.ratio, baseline) for seed in range(args.seeds)]
            every = f"every {baseline} rounds" if baseline else "none"
            print(f"| {every} | {cv:g} | {sum(shares) / len(shares):.3f} | {max(shares):.3f} |")


if __name__ == "__main__":
    main()
