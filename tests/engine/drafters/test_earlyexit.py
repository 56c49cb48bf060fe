"""Mode `earlyexit` (shares the target's KV cache and runs the verify itself): greedy identity, cache
consistency, the distribution test with its control, switching modes mid-generation, the default model."""

import itertools

import pytest
import torch

from support.exact import chat_ids, SMOL_PROMPTS
from specchat.engine.cache import forward_logits, new_cache
from specchat.engine.drafters import ModeUnavailable, build_drafter
from specchat.engine.drafters.earlyexit import EarlyExitDrafter, builtin_exit
from specchat.engine.drafters.model import ModelDrafter
from specchat.engine.drafters.plain import PlainDecoding
from specchat.engine.loop import Controls, generate
from specchat.engine.metrics import Stats
from specchat.engine.sampling import SamplingParams
from specchat.engine.target import TargetState
from specchat.session import drafter_options
from specchat.store import save_tuned
from support.exact import ALPHA, assert_drafted_up_to, check_mode_distribution, fit_to_target, PROMPT, run


@pytest.mark.parametrize("exit_layer", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_matches_hf_generate(deep_target, exit_layer, k):
    prompt = [3, 1, 4, 1, 5]
    ref = deep_target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40, min_new_tokens=40)
    drafter = build_drafter("earlyexit", deep_target, exit_layer=exit_layer)
    out, records = run(deep_target, drafter, prompt, k=k, params=SamplingParams(0), max_new_tokens=40)
    assert out == ref[0, len(prompt) :].tolist()
    assert sum(r.drafted for r in records) > 0


def test_greedy_exercises_full_blocks_and_rejections(deep_target):
    """The identity above covers every path: bonus tokens after full blocks, and rollbacks after rejections."""
    for mode, opts in (("earlyexit", {"exit_layer": 2}), ("layerskip", {"skip_layers": [0, 2]})):
        _, records = run(deep_target, build_drafter(mode, deep_target, **opts), [3, 1, 4, 1, 5], k=3, params=SamplingParams(0), max_new_tokens=40)
        assert any(r.drafted and r.accepted == r.drafted for r in records), mode
        assert any(r.accepted < r.drafted for r in records), mode


def test_shared_cache_is_the_targets_own(deep_target):
    """After every round all layers hold tokens[:-1], and the next logits equal a fresh full forward."""
    state = TargetState(deep_target)
    controls = Controls(build_drafter("earlyexit", deep_target, exit_layer=2), k=4, sampling=SamplingParams(1.0))
    gen = torch.Generator().manual_seed(1)
    for _ in generate(state, PROMPT, controls, max_new_tokens=40, eos_ids=set(), generator=gen):
        assert {layer.get_seq_length() for layer in state.cache.layers} == {len(state.tokens) - 1}
    fresh = forward_logits(deep_target, new_cache(deep_target), state.tokens, keep=1)[-1]
    torch.testing.assert_close(state.verify([])[-1], fresh, rtol=1e-4, atol=1e-5)


def test_verify_without_a_matching_proposal_falls_back(deep_target):
    """K = 0 rounds and drafts proposed by someone else still get the full model's logits."""
    state = TargetState(deep_target)
    state.start(PROMPT)
    drafter = EarlyExitDrafter.build(deep_target, exit_layer=2)
    ref = forward_logits(deep_target, new_cache(deep_target), [*PROMPT, 7, 8], keep=3)
    torch.testing.assert_close(drafter.verify(state, [7, 8]), ref, rtol=1e-4, atol=1e-5)


# Each setting draws K+1 = 4 tokens per sample, so the first round drafts positions 1..3 and may earn the bonus,
# and is tested position by position against the target's exact conditionals. The rough target's drafts disagree
# often (many residual draws: resampling from p shows); the deep target's agree (~0.9 per position), so draft
# position 3 is reached and judged often enough that a q wrong only from position 3 on shows.
SETTINGS = {  # name: (target fixture, sampling case, exit layer)
    "rough, topp0.8": ("rough_target", "topp0.8", 2),
    "deep, t1": ("deep_target", "t1", 2),
}


@pytest.mark.parametrize("setting, bug", [
    ("rough, topp0.8", None),
    ("rough, topp0.8", "resample from p"),  # control; measured p = 2.4e-44 at 1000 draws, 1.5e-22 at 600
    ("deep, t1", None),
    ("deep, t1", "q at the wrong temperature from position 3"),  # control; p = 3.2e-21 at 1000, 1.9e-12 at 600
])
@pytest.mark.slow
def test_sampled_output_matches_target_distribution(request, record_property, setting, bug):
    """K=3 with draws of K+1 tokens; each broken control must fail at the same settings as its exact run."""
    fixture, case, exit_layer = SETTINGS[setting]
    target = request.getfixturevalue(fixture)
    drafter = build_drafter("earlyexit", target, exit_layer=exit_layer)
    check_mode_distribution(target, drafter, case, bug, draws=600, record_property=record_property)


def switching(target, drafters, params, max_new_tokens, seed=0, stats=None):
    """Generate while changing controls.drafter after every round, cycling through `drafters`; `stats` (a Stats)
    collects every round."""
    state = TargetState(target)
    cycle = itertools.cycle(drafters)
    controls = Controls(next(cycle), k=3, sampling=params)
    out, modes = [], []
    gen = torch.Generator().manual_seed(seed)
    for record in generate(state, PROMPT, controls, max_new_tokens=max_new_tokens, eos_ids=set(), generator=gen):
        out += [t.id for t in record.tokens]
        modes.append(record.mode)
        if stats is not None:
            stats.add(record)
        controls.drafter = next(cycle)
    return out, modes


def test_switching_modes_mid_generation_keeps_greedy_output(deep_target):
    from conftest import tiny_llama

    drafters = [
        build_drafter("earlyexit", deep_target, exit_layer=2),
        build_drafter("layerskip", deep_target, skip_layers=[1]),
        PlainDecoding(),
        build_drafter("earlyexit", deep_target, exit_layer=1),
        ModelDrafter(tiny_llama(seed=1, layers=1)),
    ]
    ref = deep_target.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=60, min_new_tokens=60)
    out, modes = switching(deep_target, drafters, SamplingParams(0), 60)
    assert out == ref[0, len(PROMPT) :].tolist()
    assert {"earlyexit", "layerskip", "off", "draft"} <= set(modes)


def test_switching_modes_keeps_the_distribution(rough_target, record_property):
    """Draws of K+1 = 4 tokens (K=3: the first round drafts every position), the drafter changing after every
    round, tested position by position."""
    from collections import Counter

    params = SamplingParams(1.0)
    drafters = [build_drafter("earlyexit", rough_target, exit_layer=2), build_drafter("layerskip", rough_target, skip_layers=[2])]
    counts, stats = Counter(), Stats()
    for seed in range(300):
        out, _ = switching(rough_target, drafters[seed % 2 :] + drafters[: seed % 2], params, 4, seed=seed, stats=stats)
        counts[tuple(out)] += 1
    assert_drafted_up_to(stats, 3)
    assert stats.rounds > 300  # some draws ran a second round, with the other drafter
    fit = fit_to_target(rough_target, counts, params, 4)
    record_property("p_value", fit.p_value)
    assert fit.passed(ALPHA), fit


def test_default_exit_layer_tuned_then_builtin(deep_target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    def build(**options):
        return EarlyExitDrafter.build(deep_target, **drafter_options(deep_target, "earlyexit", options))

    assert build().exit_layer == builtin_exit(4)
    save_tuned(deep_target, "earlyexit", {"exit_layer": 1})
    assert build().exit_layer == 1
    assert build(exit_layer=3).exit_layer == 3
    with pytest.raises(ModeUnavailable, match="exit-layer"):
        EarlyExitDrafter.build(deep_target, exit_layer=4)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", SMOL_PROMPTS)
def test_default_model_greedy_matches_hf_generate(smol, smol_greedy, prompt):  # noqa: F811
    ids = chat_ids(smol, prompt)
    ref = smol_greedy(ids, 24)
    drafter = build_drafter("earlyexit", smol.model, exit_layer=24)
    state = TargetState(smol.model)
    records = list(generate(state, ids, Controls(drafter, k=3, sampling=SamplingParams(0)), max_new_tokens=24,
                            eos_ids={smol.model.generation_config.eos_token_id}))
    assert [t.id for r in records for t in r.tokens] == ref
    assert sum(r.accepted for r in records) > 0
