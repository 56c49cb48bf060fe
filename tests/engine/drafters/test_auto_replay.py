"""benchmarks/auto_replay.py: a replayed round gives the drafts that match the recorded reply, plus one, at the
recorded costs; the real AutoDrafter runs on it. Hand-worked on a synthetic recording with constant times."""

import importlib.util
import json
import random
from pathlib import Path

import pytest

from specchat.engine.drafters import auto

PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "auto_replay.py"
K, LIMIT, DRAFT_S, CATCH_UP_S = 4, 21, 0.02, 0.5


def verify_s(n: int) -> float:
    return 0.1 + 0.01 * n


@pytest.fixture(scope="module")
def replay():
    spec = importlib.util.spec_from_file_location("auto_replay", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recording(tmp_path: Path, replies: int = 3) -> str:
    """quant's drafts always match the reply, the draft model's never; every time is a constant."""
    data = {"target": "t", "draft": "d", "k": K, "max_new_tokens": LIMIT, "prompts_file": "p", "load_before": [0.0] * 3,
            "load_after": [0.0] * 3, "modes": {"quant": {"catches_up": False}, "draft": {"catches_up": True}},
            "verify_s": {str(n): [verify_s(n)] for n in range(1, 17)},
            "catch_up_s": {"draft": {str(g): [DRAFT_S + CATCH_UP_S * g / 64] for g in (8, 16, 32, 64)}}, "replies": []}
    for r in range(replies):
        reply = [100 + 10 * r + i for i in range(LIMIT)]  # no token repeats: suffix never matches
        data["replies"].append({
            "name": f"r{r}", "prompt": [1, 2, 3 + r], "reply": reply, "eos": False,
            "drafts": {"quant": [reply[j : j + K] for j in range(LIMIT)], "draft": [[7] * K for _ in range(LIMIT)]},
            "draft_s": {"quant": [DRAFT_S] * LIMIT, "draft": [DRAFT_S] * LIMIT}})
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_a_replayed_mode_emits_its_matching_drafts_plus_one_at_the_recorded_costs(replay, tmp_path):
    trace = replay.Trace(recording(tmp_path))
    rates, rounds = replay.replay_session(trace, "quant", auto, [0, 1, 2], 1, random.Random(0))
    # rounds at positions 0, 5, 10 and 15 emit 5 tokens each (round 0 verifies its drafts only: the pending token's
    # logits came with the prefill, and so the first token is not counted); at 20 one token is left, drafted by
    # nobody: a one-position verify
    assert rates[0, 0] == pytest.approx(20 / (DRAFT_S + verify_s(4) + 3 * (DRAFT_S + verify_s(5)) + verify_s(1)))
    assert rounds == {"quant": 5 * 3}
    rates, rounds = replay.replay_session(trace, "draft", auto, [0, 1, 2], 1, random.Random(0))
    # every draft rejected: one token a round at a draft's cost and a verify of 5 positions; at positions 17-20
    # fewer drafts fit in the reply's 21 tokens, each costing a quarter of the recorded time of four
    end = sum(n / K * DRAFT_S + verify_s(n + 1) for n in (3, 2, 1, 0))
    assert rates[0, 1] == pytest.approx(20 / (DRAFT_S + verify_s(4) + 16 * (DRAFT_S + verify_s(5)) + end))
    # the session's first reply: round 0 also feeds the draft model the 3-token prompt (the timed catch-ups, less a
    # usual round, scaled down from the 8-token gap: CATCH_UP_S x 8/64 x 3/8); the next prompts share 2 tokens
    first = DRAFT_S + CATCH_UP_S * 3 / 64 + verify_s(4)
    assert rates[0, 0] == pytest.approx(20 / (first + 16 * (DRAFT_S + verify_s(5)) + end))
    assert rounds == {"draft": 21 * 3}


def test_auto_replayed_finds_the_mode_that_is_faster(replay, tmp_path):
    trace = replay.Trace(recording(tmp_path, replies=4))
    rates, rounds = replay.replay_session(trace, "auto", auto, [0, 1, 2, 3], 2, random.Random(0))
    quant, _ = replay.replay_session(trace, "quant", auto, [0, 1, 2, 3], 2, random.Random(0))
    assert rounds["quant"] > rounds["draft"] + rounds["off"]
    assert rates[1, 3] / quant[1, 3] > 0.95  # the last reply: auto runs quant
    assert rates[0, 0] / quant[0, 0] < 0.8  # the first: it measured every mode


def test_auto_replayed_from_learnt_rates_starts_with_the_best_mode(replay, tmp_path):
    trace = replay.Trace(recording(tmp_path))
    memory = replay.Memory()
    replay.replay_session(trace, "auto", auto, [0, 1, 2], 1, random.Random(0), memory)
    assert memory.rates["greedy"]["quant"]["rounds"] > 0  # what the session saved
    fresh, _ = replay.replay_session(trace, "auto", auto, [0, 1, 2], 1, random.Random(0))
    learnt, rounds = replay.replay_session(trace, "auto", auto, [0, 1, 2], 1, random.Random(0), memory)
    assert learnt[0, 0] > 1.2 * fresh[0, 0]


def test_a_replay_with_k_measured_moves_k_within_the_recorded_drafts(replay, tmp_path):
    """--measured-k: K from MeasuredK, from the start K up to the recorded K (a round drafts the first K recorded).
    quant's drafts always match: from K=1 (2 tokens a round: 11 rounds a 21-token reply) K measured walks up through
    the verify lengths it explores, toward the recorded K=4 (5 a round: 5 rounds a reply, as the recorded K runs)."""
    trace = replay.Trace(recording(tmp_path))
    _, fixed = replay.replay_session(trace, "quant", auto, [0, 1, 2], 1, random.Random(0))
    _, measured = replay.replay_session(trace, "quant", auto, [0, 1, 2], 1, random.Random(0), measured_k=1)
    assert fixed["quant"] == 5 * 3 < measured["quant"] < 11 * 3
