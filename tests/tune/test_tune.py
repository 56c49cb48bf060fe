"""`specchat tune`: the replay model is exact for greedy, the search is deterministic for a seed, the CLI saves
a default that the drafters then use."""

import json

import pytest
from click.testing import CliRunner

from specchat.engine.drafters import build_drafter
from specchat.engine.drafters.layers import Decoder
from specchat.engine.metrics import Stats, predicted_speedup
from specchat.engine.sampling import SamplingParams
from specchat.tune.search import LOWRANK_RANKS, Costs, matches, reference, replay, tune_model
from support.exact import run

COSTS = Costs(head=0.1, layer=0.2, verify={k: 1 + 0.05 * k for k in range(1, 9)})
PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]


def test_replay_counts_rounds_like_greedy_speculation():
    # round 1 drafts 2, both match, bonus; round 2 may draft only 1 (one token left after it): it matches
    assert replay([True, True, False, True, False], 2) == (2, 3, 3)
    assert replay([True] * 6, 3) == (2, 4, 4)
    assert replay([False] * 4, 4) == (4, 6, 0)  # the last round drafts nothing


@pytest.mark.parametrize("mode,setting", [("layerskip", {"skip_layers": [0, 2]}), ("earlyexit", {"exit_layer": 2})])
@pytest.mark.parametrize("k", [2, 4])
def test_teacher_forced_replay_predicts_the_real_loop(deep_target, mode, setting, k):
    """Greedy is deterministic: the replayed rounds and acceptances are exactly the loop's."""
    decoder = Decoder(deep_target)
    ref = reference(decoder, [3, 1, 4, 1, 5], 40)
    if mode == "layerskip":
        match = matches(decoder, ref, [i for i in range(4) if i not in setting["skip_layers"]])
    else:
        match = matches(decoder, ref, hidden=ref.hidden[setting["exit_layer"]])
    out, records = run(deep_target, build_drafter(mode, deep_target, **setting), [3, 1, 4, 1, 5], k=k,
                       params=SamplingParams(0), max_new_tokens=40)
    assert out == ref.targets.tolist()
    assert replay(match, k) == (len(records), sum(r.drafted for r in records), sum(r.accepted for r in records))


@pytest.mark.parametrize("mode", ["layerskip", "earlyexit"])
def test_tune_is_deterministic_for_a_seed(deep_target, mode):
    a = tune_model(deep_target, PROMPTS, mode, seed=3, budget=12, max_new_tokens=24, costs=COSTS)
    b = tune_model(deep_target, PROMPTS, mode, seed=3, budget=12, max_new_tokens=24, costs=COSTS)
    assert [(c.setting, c.k, c.predicted_speedup) for c in a.candidates] == [(c.setting, c.k, c.predicted_speedup) for c in b.candidates]
    if mode == "layerskip":
        assert len(a.candidates) <= 12
    # The winner, checked against the real loop rather than against the list it was picked from (that the best is
    # the maximum of a list sorted by that key holds by construction). The winner's setting and every setting of
    # the search's first stage (earlyexit: each exit layer; layerskip: each single layer skipped), run greedily at
    # every K in 1..8: none may predict more than the winner (so its K is the best for its setting too), and the
    # winner's numbers must be what the loop measures at its setting and K, through the Costs model and the one
    # speedup formula.
    n = deep_target.config.num_hidden_layers
    if mode == "layerskip":
        settings = [{"skip_layers": [i]} for i in range(n)]
        costs = lambda s, k: (COSTS.draft(n - len(s["skip_layers"])), COSTS.verify[k])
    else:
        settings = [{"exit_layer": e} for e in range(1, n)]
        costs = lambda s, k: (COSTS.draft(s["exit_layer"]), COSTS.verify_shared(k, s["exit_layer"], n))

    def measured(setting, k):
        stats = Stats()
        for prompt in PROMPTS:
            _, records = run(deep_target, build_drafter(mode, deep_target, **setting), prompt, k=k,
                             params=SamplingParams(0), max_new_tokens=24)
            for r in records:
                stats.add(r)
        return stats, predicted_speedup(stats.acceptance_rate or 0.0, k, *costs(setting, k))

    best = a.best
    stats, speedup = measured(best.setting, best.k)
    assert best.acceptance == pytest.approx(stats.acceptance_rate, abs=1e-12)
    assert best.mean_accepted_length == pytest.approx(stats.new_tokens / stats.rounds, abs=1e-12)
    assert (best.draft_cost, best.verify_cost) == pytest.approx(costs(best.setting, best.k))
    assert best.predicted_speedup == pytest.approx(speedup, abs=1e-12)
    assert all(s in [c.setting for c in a.candidates] for s in settings)
    for setting in [best.setting, *settings]:
        for k in range(1, 9):
            assert measured(setting, k)[1] <= best.predicted_speedup + 1e-12, (setting, k, best)


def test_tune_command_saves_the_default(tmp_path, monkeypatch):
    from support.models import tiny_model_dir

    from specchat.cli.main import main
    from specchat.engine.drafters.layerskip import builtin_skip
    from specchat.models import load_model
    from specchat.session import Session

    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = tiny_model_dir(tmp_path / "tiny", layers=4)
    result = CliRunner().invoke(main, ["tune", "--mode", "layerskip", "--target", str(model_dir), "--dtype", "float32",
                                       "--budget", "6", "--tokens", "12", "--seed", "1", "--no-confirm"])
    assert result.exit_code == 0, result.output
    assert "layerskip: best settings" in result.output
    saved = json.loads(next((tmp_path / "cache" / "tuned").glob("*.json")).read_text())
    import torch

    loaded = load_model(str(model_dir), torch.device("cpu"), torch.float32)
    session = Session(loaded, mode="layerskip")  # a session picks up what was saved
    entry = saved["layerskip"]
    if entry.get("recommendation", "layerskip") == "layerskip":  # the setting beat plain decoding: it is the default
        assert session.drafter("layerskip").skip_layers == entry["skip_layers"] and entry["seed"] == 1
    else:  # nothing beat plain decoding: the advice is saved, the mode keeps its built-in setting
        assert entry["recommendation"] == "off" and "skip_layers" not in entry and entry["best_found"]["seed"] == 1
        assert "nothing beats plain decoding" in result.output
        assert session.drafter("layerskip").skip_layers == builtin_skip(4)


def test_tune_lowrank_finds_a_rank(deep_target):
    result = tune_model(deep_target, PROMPTS, "lowrank", budget=2, max_new_tokens=12, costs=COSTS)
    assert result.best.setting["rank"] in LOWRANK_RANKS


def test_tune_lowrank_says_when_unavailable(deep_target, monkeypatch):
    import specchat.tune.search as search
    from specchat.engine.drafters import ModeUnavailable

    def unavailable(mode, model, **options):
        raise ModeUnavailable("needs the lean runner")

    monkeypatch.setattr(search, "build_drafter", unavailable)
    with pytest.raises(ModeUnavailable, match="^cannot tune lowrank: needs the lean runner$"):
        tune_model(deep_target, PROMPTS, "lowrank", costs=COSTS)
