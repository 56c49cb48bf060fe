"""The approximate rule approx:<lambda>: lossy, labelled exact: false everywhere, greedy output unchanged."""

import json

import pytest
import torch
from click.testing import CliRunner

from support.models import tiny_llama
from specchat.engine.acceptance import EXACT, LenientRule, parse_rule
from specchat.engine.drafters.model import ModelDrafter
from specchat.engine.metrics import Stats
from specchat.engine.sampling import SamplingParams
from support.exact import ALPHA, assert_drafted_up_to, PROMPT, run, sample_and_fit
from support.models import tiny_model_dir


def test_parse_rule():
    assert parse_rule("exact") is EXACT
    rule = parse_rule("approx:0.5")
    assert isinstance(rule, LenientRule) and rule.exact is False and rule.name == "approx:0.5"
    for bad, says in [("approx:", "needs a number"), ("approx:x", "needs a number"), ("approx:0", "needs 0 < lambda < 1"),
                      ("approx:1", "needs 0 < lambda < 1"), ("approx:1.5", "needs 0 < lambda < 1"), ("typical", "unknown acceptance rule")]:
        with pytest.raises(ValueError, match=says):
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


@pytest.mark.slow
def test_it_really_is_approximate(tiny_target, record_property):
    """A small lambda moves the output towards a peaked draft's distribution: the exact-distribution test rejects
    it, at every draft position up to K (draws of K+1 tokens, K=3 drafted), while the exact rule at the same
    setting passes. Measured: approx:0.2 p = 2.4e-147 (position 3 alone: 2.4e-23), exact p = 0.28."""
    params = SamplingParams(1.0)
    peaked = tiny_llama(seed=1, layers=1, sharpen=16.0)
    fit, stats = sample_and_fit(tiny_target, ModelDrafter(peaked), params, k=3, draws=600, rule=LenientRule(0.2))
    record_property("p_value_approx", fit.p_value)
    assert_drafted_up_to(stats, 3)
    assert fit.p_value < 1e-6 and fit.per_position[2] < ALPHA, fit  # lossy, and visibly so at draft position 3
    fit, stats = sample_and_fit(tiny_target, ModelDrafter(peaked), params, k=3, draws=600)  # the same setting, exact
    record_property("p_value_exact", fit.p_value)
    assert_drafted_up_to(stats, 3)
    assert fit.passed(ALPHA), fit


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
    assert bad.exit_code == 2 and "lambda" in bad.output


def test_verify_reports_an_approximate_rule_as_lossy(tiny_dir, tmp_path):
    """verify runs the same test for an approximate rule and reports its p-value, with the verdict "approximate"
    (never PASS/FAIL) and exit 0. A disagreeing, peaked draft with K=3 (draws of K+1 tokens by default): every draft
    position is used and the rule is detected as lossy (measured p = 4.2e-10 at these settings)."""
    draft_dir = tiny_model_dir(tmp_path / "draft", seed=1, layers=1, sharpen=16.0)
    r = invoke("verify", "--target", tiny_dir, "--draft", draft_dir, "--mode", "draft", "--accept", "approx:0.1", "-k", 3,
               "-n", 60, "--seed", 0, "--format", "json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["verdict"] == "approximate" and report["exact"] is False and report["accept"] == "approx:0.1"
    assert report["tokens"] == 4 and report["max_drafted"] == 3  # K+1 tokens tested, draft position K used
    assert report["p_value"] < 1e-6, report["p_value"]


def test_parse_rule_says_what_is_wrong():
    with pytest.raises(ValueError, match=r"^approx:<lambda> needs a number, got 'approx:x'$"):
        parse_rule("approx:x")
    with pytest.raises(ValueError, match=r"^unknown acceptance rule 'typical'; use 'exact' or 'approx:<lambda>'"):
        parse_rule("typical")


def test_the_lenient_rule_by_hand_and_only_from_the_runs_generator():
    """min(1, p(x) / (lambda q(x))) per draft, never above 1; the resample is from max(0, p - lambda q): with
    p = [0, .55, .45], q = [.5, .5, 0] and lambda = .5 the residual is [0, .30, .45], whose argmax is token 2 (p's
    is token 1). A seeded run repeats whatever the global generator holds."""
    rule = LenientRule(0.5)
    p = torch.tensor([[0.0, 0.55, 0.45], [0.2, 0.2, 0.6]])  # [K+1, V], K = 1
    q = torch.tensor([[0.5, 0.5, 0.0]])  # [K, V]
    v = rule(torch.tensor([0]), q, p, torch.Generator().manual_seed(0), True)  # p(0) = 0: always rejected
    assert (v.accepted, v.next_token) == (0, 2) and v.accept_probs.tolist() == [0.0]
    v = rule(torch.tensor([1]), q, p, torch.Generator().manual_seed(0), True)  # .55 / .25 > 1: always accepted
    assert v.accepted == 1 and v.accept_probs.tolist() == [1.0] and v.next_token == 2  # the bonus: argmax p[1]
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, 50, generator=g), -1)
    q = torch.softmax(torch.randn(4, 50, generator=g), -1)
    draft = torch.multinomial(q, 1, generator=g).squeeze(-1)
    px, qx = p[torch.arange(4), draft], q[torch.arange(4), draft]
    v = LenientRule(0.3)(draft, q, p, g, False)
    assert torch.allclose(v.accept_probs, torch.clamp(px / (0.3 * qx), max=1.0)) and bool((v.accept_probs <= 1).all())
    runs = []
    for global_seed in (1, 2):
        with torch.random.fork_rng():
            torch.manual_seed(global_seed)
            run = torch.Generator().manual_seed(7)
            runs.append([(v.accepted, v.next_token) for v in (LenientRule(0.3)(draft, q, p, run, False) for _ in range(30))])
    assert runs[0] == runs[1] and len(set(runs[0])) > 1
