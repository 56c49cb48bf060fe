"""One set of rounds, one predicted speedup: the panel, the bench, tune and the export show the same number."""

import pytest

from specchat.bench import runner
from specchat.engine.events import RoundRecord
from specchat.engine.metrics import Stats, expected_tokens_per_round, predicted_speedup, speedup_model
from specchat.engine.sampling import SamplingParams
from specchat.export import mode_summary
from specchat.conversation import Snapshot
from specchat.tui.widgets.panel import estimate_speedup
from specchat.tune.search import measured_candidate


def rounds(mode, n, drafted, accepted, draft_s, verify_s):
    out = []
    for i in range(n):
        a = accepted[i % len(accepted)]
        r = RoundRecord(index=i, mode=mode, draft_len=drafted, drafted=drafted, accepted=a, draft_calls=drafted,
                        draft_s=draft_s, verify_s=verify_s, wall_s=draft_s + verify_s + 0.001)
        r.tokens = [None] * (a + 1)  # Stats only counts them
        out.append(r)
    return out


PLAIN = Stats.of(rounds("off", 20, 0, [0], 0.0, 0.020))  # plain step: 20 ms
QUANT = Stats.of(rounds("quant", 12, 4, [4, 1, 0, 3], 0.012, 0.030))  # K=4, a=0.5, 3 ms per draft token


def test_the_model_by_hand():
    model = speedup_model(QUANT, PLAIN.plain_step_s)
    assert (model.acceptance, model.k) == (0.5, 4.0)
    assert model.draft_cost == pytest.approx(0.15) and model.verify_cost == pytest.approx(1.5)
    assert model.predicted == pytest.approx(expected_tokens_per_round(0.5, 4) / (4 * 0.15 + 1.5))
    assert speedup_model(QUANT, None) is None and speedup_model(Stats(), 0.02) is None


def test_panel_bench_tune_and_export_show_one_number():
    expected = speedup_model(QUANT, PLAIN.plain_step_s).predicted
    snapshot = Snapshot(mode="quant", k=4, sampling=SamplingParams(0), rule="exact", exact=True,
                        stats={"off": PLAIN, "quant": QUANT}, reply=QUANT, recent=[])
    panel, why = estimate_speedup(snapshot, "quant")
    bench = runner.predict(runner.Config("quant", 4, 0.0), QUANT, PLAIN, measured=None)["predicted_speedup"]
    tune = measured_candidate({"rank": 0.5}, QUANT, PLAIN, ks=[4]).predicted_speedup
    export = mode_summary(snapshot, "quant")["speedup_model"]["predicted_speedup"]
    assert panel == bench == tune == export == pytest.approx(expected)
    assert "K=4" in why and "a=0.50" in why


def test_predicted_speedup_by_hand():
    assert predicted_speedup(0.8, 4, 0.1, 1.3) == pytest.approx(3.3616 / 1.7)
    assert predicted_speedup(0.0, 4, 0.1, 1.2) == pytest.approx(0.625)  # nothing accepted: a slowdown
    assert predicted_speedup(1.0, 3, 0.0, 1.0) == pytest.approx(4.0)  # free, perfect drafts


def test_merge_equals_counting_everything_once():
    both = Stats.of(rounds("off", 20, 0, [0], 0.0, 0.020) + rounds("quant", 12, 4, [4, 1, 0, 3], 0.012, 0.030))
    merged = PLAIN.merge(QUANT)
    for key, value in both.summary().items():
        assert merged.summary()[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    assert merged.first_token_s == both.first_token_s
    assert PLAIN.summary()["num_draft_tokens"] == 0  # merge made a new object
