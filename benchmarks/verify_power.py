"""Power and level of `run_verify` at its defaults, on the tiny setting of tests/test_verify.py.

Usage: python benchmarks/verify_power.py [--runs 50]

Each broken rule (and the exact one) runs `--runs` times with different seeds at verify's defaults (100 draws,
K = 4, K+1 tokens tested, alpha 0.01); the table gives how many runs failed, and how many failed by each of the
three tests alone (chi-square at 1/2 alpha, likelihood and draft direction at 1/4 each). The suite asserts a
smaller number of runs; this is the longer measurement docs/commands.md quotes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_verify import BROKEN, T1, TOP2, verify  # noqa: E402

from support.broken import ResampleFromPClaimingExact  # noqa: E402
from support.models import bigram_draft, tiny_llama  # noqa: E402
from specchat.engine.acceptance import LenientRule  # noqa: E402
from specchat.engine.drafters.model import ModelDrafter  # noqa: E402
from specchat.verify import CHI2_SHARE, DEFAULT_ALPHA, DIRECTION_SHARE, LIKELIHOOD_SHARE  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args()
    target = tiny_llama(seed=0, layers=1, sharpen=40.0).requires_grad_(False)
    drafts = {"over": bigram_draft(target, scale=3.0), "under": bigram_draft(target, scale=0.5)}
    cases = dict(BROKEN)
    cases["resample from p, under-confident draft"] = ("under", TOP2, lambda d: (ModelDrafter(d), ResampleFromPClaimingExact()))
    cases["approx:0.5 (lossy), over-confident draft"] = ("over", T1, lambda d: (ModelDrafter(d), LenientRule(0.5)))
    cases["approx:0.5 (lossy), under-confident draft"] = ("under", TOP2, lambda d: (ModelDrafter(d), LenientRule(0.5)))
    cases["exact, over-confident draft, T=1"] = ("over", T1, lambda d: (ModelDrafter(d), None))
    cases["exact, under-confident draft, top-k 2"] = ("under", TOP2, lambda d: (ModelDrafter(d), None))
    print(f"| case | runs | significant at {DEFAULT_ALPHA} | by chi-square | by likelihood | by draft direction |")
    print("|---|---|---|---|---|---|")
    for name, (draft, params, broken) in cases.items():
        hits = [0, 0, 0, 0]
        for seed in range(args.runs):
            drafter, rule = broken(drafts[draft])
            r = verify(target, drafter, params, seed=1000 + seed, rule=rule)
            a = r["alpha"]
            hits[0] += r["p_value"] < a
            hits[1] += r["chi2_p_value"] < CHI2_SHARE * a
            hits[2] += r["likelihood_p"] < LIKELIHOOD_SHARE * a
            hits[3] += r["direction_p"] < DIRECTION_SHARE * a
        print(f"| {name} | {args.runs} | {hits[0]} | {hits[1]} | {hits[2]} | {hits[3]} |", flush=True)


if __name__ == "__main__":
    main()
