"""The approximate rule approx:<lambda>: lossy, labelled exact: false everywhere, greedy output unchanged."""

import json

import pytest
import torch
from click.testing import CliRunner

from helpers import tiny_llama
from specchat.engine import SamplingParams
from specchat.engine.acceptance import EXACT, LenientRule, parse_rule
from specchat.engine.drafters.model import ModelDrafter
from specchat.engine.metrics import Stats
from specchat.verify import goodness_of_fit
from helpers import ALPHA, PROMPT, exact_joint, run, sample_joint
from helpers import tiny_model_dir


def test_parse_rule():
    assert parse_rule("exact") is EXACT
    rule = parse_rule("approx:0.5")
    assert isinstance(rule, LenientRule) and rule.exact is False and rule.name == "approx:0.5"
    for bad in ("approx:", "approx:x", "approx:0", "approx:1", "approx:1.5", "typical"):
        with pytest.raises(ValueError):
            parse_rule(bad)


def test_accepts_more_than_exact_and_is_flagged_in_records_and_stats(tiny_target, tiny_draft):
    params = SamplingParams(1.0)
    rates = {}
    for name in ("exact", "approx:0.3"):
        stats = Stats()
        for seed in range(5):
            _, records = run(tiny_target, ModelDrafter(tiny_draft), PROMPT, k=4, params=params, max_new_tokens=40, seed=seed, rule=parse_rule(name))
            for r in records:
                stats.add(r)
        rates[name] = stats.acceptance_rate
        assert stats.exact is (name == "exact") and stats.summary()["exact"] is (name == "exact")
    assert rates["approx:0.3"] > rates["exact"] + 0.05


def test_greedy_output_is_unchanged(tiny_target, tiny_draft):
    prompt = [3, 1, 4, 1, 5]
    ref = tiny_target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40, min_new_tokens=40)
    out, _ = run(tiny_target, ModelDrafter(tiny_draft), prompt, k=3, params=SamplingParams(0), max_new_tokens=40, rule=parse_rule("approx:0.2"))
    assert out == ref[0, len(prompt):].tolist()


def test_it_really_is_approximate(tiny_target):
    """A small lambda moves the output towards a peaked draft's distribution: the exact-distribution test rejects it."""
    params = SamplingParams(1.0)
    peaked = tiny_llama(seed=1, layers=1, sharpen=16.0)
    counts = sample_joint(tiny_target, ModelDrafter(peaked), params, k=3, draws=1000, length=2, rule=LenientRule(0.2))
    assert not goodness_of_fit(counts, exact_joint(tiny_target, PROMPT, params, 2)).passed(ALPHA)
    counts = sample_joint(tiny_target, ModelDrafter(peaked), params, k=3, draws=1000, length=2)
    assert goodness_of_fit(counts, exact_joint(tiny_target, PROMPT, params, 2)).passed(ALPHA)  # the same setting, exact


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def invoke(*args):
    from specchat.cli.main import main

    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_generate_summary_says_exact_false(tiny_dir):
    common = ["generate", "--target", tiny_dir, "--draft", tiny_dir, "--prompt", "write a story", "--format", "json",
              "--max-new-tokens", 12, "--temperature", 1, "--seed", 0]
    summary = json.loads(invoke(*common, "--accept", "approx:0.5").stdout.splitlines()[-1])
    assert summary["type"] == "summary" and summary["exact"] is False and summary["accept"] == "approx:0.5"
    summary = json.loads(invoke(*common).stdout.splitlines()[-1])
    assert summary["exact"] is True and summary["accept"] == "exact"
    text = invoke(*common[:7], "--accept", "approx:0.5")
    assert "exact: false" in text.output
    bad = invoke(*common[:7], "--accept", "approx:2")
    assert bad.exit_code == 1 and "lambda" in bad.output


def test_verify_reports_distance_not_a_verdict(tiny_dir):
    r = invoke("verify", "--target", tiny_dir, "--mode", "quant", "--accept", "approx:0.3", "-n", 40, "--tokens", 1, "--seed", 0, "--format", "json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["verdict"] == "approximate" and report["exact"] is False and report["accept"] == "approx:0.3"
    assert 0 <= report["total_variation"] <= 1
