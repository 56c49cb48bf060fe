"""Adaptive draft length and mode switching mid-generation: greedy identity and exact sampling are kept."""

import json

import pytest
import torch
from click.testing import CliRunner

from support.models import tiny_llama
from specchat.engine.drafters import ModeUnavailable, build_drafter
from specchat.engine.drafters.model import ModelDrafter
from specchat.engine.loop import Controls, generate
from specchat.engine.loop import AdaptiveK
from specchat.engine.draft_length import MeasuredK
from specchat.engine.sampling import SamplingParams
from specchat.engine.target import TargetState
from collections import Counter
from types import SimpleNamespace

from support.models import bigram_draft, tiny_model_dir
from support.exact import ALPHA, assert_drafted_up_to, fit_to_target, sample_and_fit, sample_joint
from support.broken import ResampleFromP, WrongTemperatureFrom
from specchat.engine.metrics import Stats


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Low-rank factors of the tiny models go to a fresh user cache, not the real one."""
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))


def test_schedule_grows_on_full_blocks_and_shrinks_on_rejections():
    a = AdaptiveK(start=4, k_min=1, k_max=8)
    a.update("draft", 4, 4)
    assert a.k("draft") == 6 and a.k("quant") == 4  # per mode
    a.update("draft", 6, 6)
    a.update("draft", 8, 8)
    assert a.k("draft") == 8  # bounded above
    for _ in range(10):
        a.update("draft", 3, 1)
    assert a.k("draft") == 1  # bounded below
    a.update("draft", 0, 0)  # a round without drafts says nothing
    assert a.k("draft") == 1


@pytest.fixture(scope="module")
def deep():
    return tiny_llama(seed=0, layers=4).requires_grad_(False)


def hf_greedy(model, prompt, n):
    return model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n)[0, len(prompt):].tolist()


@pytest.mark.parametrize("schedule", [AdaptiveK, MeasuredK])
@pytest.mark.parametrize("mode", ["draft", "lookup", "quant", "lowrank"])
def test_adaptive_greedy_matches_hf_generate(deep, tiny_draft, mode, schedule):
    prompt = [3, 1, 4, 1, 5]
    drafter = ModelDrafter(tiny_draft) if mode == "draft" else build_drafter(mode, deep, rank=2, calibration=16)
    controls = Controls(drafter, k=3, sampling=SamplingParams(0), adaptive=schedule(start=3, k_max=8))
    records = list(generate(TargetState(deep), prompt, controls, max_new_tokens=60, eos_ids=set()))
    assert [t.id for r in records for t in r.tokens] == hf_greedy(deep, prompt, 60)
    if mode != "lookup":
        assert len({r.draft_len for r in records}) > 1  # K really moved


def adaptive_draws(target, drafter, *, rule=None, draws=1000, seed=0, schedule=AdaptiveK):
    """Draws of K_MAX+1 tokens with K chosen by `schedule` (one for the whole run, so K moves within a draw and from
    draw to draw), the first K_MAX+1 tokens tested position by position; and every round's record."""
    records = []
    adaptive = schedule(start=2, k_min=1, k_max=K_MAX)
    counts = sample_joint(target, drafter, TOPP, k=2, draws=draws, length=K_MAX + 1, generated=K_MAX + 1, rule=rule, seed=seed,
                          stats=SimpleNamespace(add=records.append), adaptive=adaptive)
    return fit_to_target(target, counts, TOPP, K_MAX + 1), records


K_MAX = 5
T1 = SamplingParams(1.0)
TOPP = SamplingParams(1.0, top_p=0.8)  # where both controls below fail clearly (at T=1 alone resampling from p is subtle)


@pytest.fixture(scope="module")
def agreeing_draft(tiny_target):
    """Agrees with the target often (full blocks grow K) but not always (rejections shrink it)."""
    return bigram_draft(tiny_target, scale=2.0)


@pytest.mark.slow
def test_adaptive_sampling_matches_target_distribution(tiny_target, agreeing_draft):
    fit, records = adaptive_draws(tiny_target, ModelDrafter(agreeing_draft))
    first_round_k = Counter(r.draft_len for r in records if r.index == 0)  # never capped by the budget (K_MAX+1 tokens)
    assert len(first_round_k) >= 3 and max(first_round_k) == K_MAX, first_round_k  # K really moved, up to K_MAX
    assert_drafted_up_to(Stats.of(records), K_MAX)
    assert fit.passed(ALPHA), fit


@pytest.mark.slow
def test_measured_k_sampling_matches_target_distribution(tiny_target, agreeing_draft):
    """K from measured costs: it moves with the timings of earlier rounds, never with this round's draws."""
    fit, records = adaptive_draws(tiny_target, ModelDrafter(agreeing_draft), schedule=MeasuredK)
    assert len({r.draft_len for r in records}) >= 3  # K really moved (the choice and its neighbours)
    assert fit.passed(ALPHA), fit


@pytest.mark.slow
def test_measured_k_distribution_test_catches_a_broken_rule(tiny_target, agreeing_draft):
    fit, records = adaptive_draws(tiny_target, ModelDrafter(agreeing_draft), rule=ResampleFromP(), schedule=MeasuredK)
    assert len({r.draft_len for r in records}) >= 3
    assert fit.p_value < ALPHA / 100, fit


@pytest.mark.parametrize("bug", ["resample from p", "q at the wrong temperature from position 3"])
@pytest.mark.slow
def test_adaptive_distribution_test_catches_a_broken_rule(tiny_target, agreeing_draft, bug):
    drafter, rule = ((ModelDrafter(agreeing_draft), ResampleFromP()) if bug == "resample from p"
                     else (WrongTemperatureFrom(agreeing_draft, position=3), None))
    fit, records = adaptive_draws(tiny_target, drafter, rule=rule)
    assert len({r.draft_len for r in records if r.index == 0}) >= 3
    assert fit.p_value < ALPHA / 100, fit  # measured: 1e-6 or less (see the report of issue 12)


def test_switching_modes_every_round_keeps_greedy_output(deep, tiny_draft):
    """Rotate through every mode that builds, one round each, as the TUI's keys would: output = plain greedy."""
    drafters = [ModelDrafter(tiny_draft)]
    for mode in ("off", "lookup", "quant", "lowrank", "layerskip", "earlyexit"):
        try:
            drafters.append(build_drafter(mode, deep, rank=2, calibration=16))
        except ModeUnavailable:
            pass
    assert {"lookup", "quant", "lowrank"} <= {d.name for d in drafters}
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for k in (2, 4):
        controls = Controls(drafters[0], k=k, sampling=SamplingParams(0))
        out, used = [], []
        for i, record in enumerate(generate(TargetState(deep), prompt, controls, max_new_tokens=60, eos_ids=set())):
            out += [t.id for t in record.tokens]
            used.append(record.mode)
            controls.drafter = drafters[(i + 1) % len(drafters)]
        assert out == hf_greedy(deep, prompt, 60)
        assert set(used) == {d.name for d in drafters}


def test_cli_adaptive_flag(tmp_path):
    """--adaptive puts AdaptiveK in charge: K starts at -k and grows while drafts are accepted. A peaked model
    (sharpen): on a flat one --adaptive's confidence stop (0.7) ends every draft at once."""
    from specchat.cli.main import main

    target = tiny_model_dir(tmp_path / "tiny", sharpen=200.0)
    args = ["generate", "--target", str(target), "--prompt", "write a short story", "--format", "json", "--max-new-tokens", "30",
            "--mode", "quant", "--dtype", "float32"]
    fixed = CliRunner().invoke(main, args, catch_exceptions=False)
    adaptive = CliRunner().invoke(main, [*args, "--adaptive"], catch_exceptions=False)
    assert fixed.exit_code == 0 and adaptive.exit_code == 0, adaptive.output
    ids = lambda r: [json.loads(x)["id"] for x in r.stdout.splitlines()[:-1]]  # noqa: E731
    assert ids(fixed) == ids(adaptive)  # greedy: the schedule changes speed, never the text
    summary = json.loads(adaptive.stdout.splitlines()[-1])
    assert summary["draft_len"] == 4  # the schedule's start, not K measured ("auto")
    assert len(summary["per_position_acceptance"]) > 4  # it drafted past its start: K grew


def test_confidence_stop_drafts_less_and_keeps_greedy_identity(deep):
    """p-min: the quant draft stops when unsure; fewer drafts, the same greedy text."""
    prompt = [3, 1, 4, 1, 5]
    drafter = build_drafter("quant", deep)
    drafted = {}
    for p_min in (0.0, 0.5):
        controls = Controls(drafter, k=4, sampling=SamplingParams(0), adaptive=AdaptiveK(start=4, p_min=p_min))
        records = list(generate(TargetState(deep), prompt, controls, max_new_tokens=40, eos_ids=set()))
        assert [t.id for r in records for t in r.tokens] == hf_greedy(deep, prompt, 40)
        drafted[p_min] = sum(r.drafted for r in records) / sum(r.draft_len for r in records)
    assert drafted[0.5] < drafted[0.0]
    assert drafter.p_min == 0.5
    list(generate(TargetState(deep), prompt, Controls(drafter, k=4, sampling=SamplingParams(0)), max_new_tokens=4, eos_ids=set()))
    assert drafter.p_min == 0.0  # without --adaptive the stop is off again


@pytest.fixture(scope="module")
def rough():
    return tiny_llama(seed=0, layers=4, initializer_range=0.1).requires_grad_(False)


@pytest.mark.parametrize("rule", [None, ResampleFromP()], ids=["exact", "resample from p (control)"])
@pytest.mark.slow
def test_confidence_stop_keeps_the_distribution(rough, rule):
    """Sampled drafts with p-min: whether position 2 is drafted depends on the token drawn at position 1. Draws of
    K+1 tokens, so the first round may draft all K=3; the broken rule at the same settings must fail."""
    drafter = build_drafter("lowrank", rough, rank=2, calibration=16)
    # since lowrank drafts on the target's cache its q is closer to p: at p_min 0.3 position 3 was never drafted, and
    # at p_min 0.2 the control gave p = 1.3e-6 at 1000 draws, 5.5e-10 at 1500
    fit, stats = sample_and_fit(rough, drafter, T1, k=3, draws=1500, rule=rule, seed=1, adaptive=AdaptiveK(start=3, p_min=0.2))
    assert stats.rounds > stats.num_drafts and stats.num_draft_tokens < 3 * stats.num_drafts  # the stop fired, not always
    assert_drafted_up_to(stats, 3)
    if rule is None:
        assert fit.passed(ALPHA), fit
    else:
        assert fit.p_value < 1e-6, fit


@pytest.mark.slow
def test_default_model_switching_and_adaptive_keep_greedy_output(smol, smol_greedy):
    from support.exact import chat_ids

    prompt = chat_ids(smol, "Write a Python function that reverses a list.")
    eos = smol.model.generation_config.eos_token_id
    ref = smol_greedy(prompt, 40)
    drafters = [build_drafter(mode, smol.model) for mode in ("quant", "lookup", "off")]
    controls = Controls(drafters[0], k=4, sampling=SamplingParams(0), adaptive=AdaptiveK(start=4, p_min=0.3))
    out = []
    for i, record in enumerate(generate(TargetState(smol.model), prompt, controls, max_new_tokens=40, eos_ids={eos})):
        out += [t.id for t in record.tokens]
        controls.drafter = drafters[(i + 1) % len(drafters)]
    assert out == ref
