"""`run_verify` (what `specchat verify` runs) has teeth: at its default settings it fails broken acceptance rules
and passes the exact one, on a tiny model that samples thousands of tokens a second.

The setting: a 1-layer tiny Llama whose LM head is scaled so its next-token distributions are peaked like a
real model's (the top token ~0.7), and a draft that agrees with it only roughly: the target's logits after
the last token alone (a bigram of the target, `bigram_draft`), scaled by `scale` (3: an over-confident
draft; 0.5: an under-confident one). How visible a bug is depends on the draft: resampling from p instead
of the residual changes the output by about TV(p, q) * TV(p, residual), which is large when the draft is
over-confident on the target's top token and small when it is under-confident; a q that ignores top-k only
matters when the draft has mass outside its top k (an under-confident draft). Each bug is measured where
it changes the output, at verify's defaults: DEFAULT_SAMPLES draws, K+1 tokens, alpha 0.01 (the chi-square
test at 1/2 of it, the likelihood score and draft-direction tests at 1/4 each).

Measured with more runs than asserted here (`python benchmarks/verify_power.py --runs 50`, n = 100): every
bug below failed 50 of 50; the exact rule passed 99 of 100. (At n = 80 the top-k bugs failed in 38-39 of 40,
measured before the draft-direction test, so the default n is no smaller.)
"""

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from support.models import bigram_draft, tiny_llama, tiny_model_dir
from support.exact import PROMPT
from support.broken import BonusFromPreviousPosition, QWithoutTopK, ResampleFromPClaimingExact
from specchat.engine.acceptance import LenientRule
from specchat.engine.cache import forward_logits, new_cache
from specchat.engine.drafters import Drafter
from specchat.engine.drafters.base import Proposal
from specchat.engine.drafters.model import ModelDrafter
from specchat.engine.loop import Controls
from specchat.engine.sampling import SamplingParams
from specchat.engine.sampling import logits_to_probs
from specchat.engine.target import TargetState
from specchat.verify import (
    DEFAULT_ALPHA,
    DEFAULT_SAMPLES,
    Coverage,
    TargetConditionals,
    combined_p,
    fit_next_token,
    goodness_of_fit,
    likelihood_z,
    pooled_rank_test,
    run_verify,
)

K = 4  # the CLI's default draft length
RUNS = 20
T1 = SamplingParams(1.0)  # what `specchat verify` samples with by default
TOP2 = SamplingParams(1.0, top_k=2)


@pytest.fixture(scope="module")
def peaked_target():
    return tiny_llama(seed=0, layers=1, sharpen=40.0).requires_grad_(False)


@pytest.fixture(scope="module")
def drafts(peaked_target):
    return {"over": bigram_draft(peaked_target, scale=3.0), "under": bigram_draft(peaked_target, scale=0.5)}


def verify(target, drafter, params, *, seed, rule=None, prompt=PROMPT, **kwargs):
    """run_verify at its defaults on a tiny target, with the session a CLI run would have."""
    controls = Controls(drafter, k=K, sampling=params, **({"rule": rule} if rule else {}))
    session = SimpleNamespace(state=TargetState(target), controls=controls, eos_ids=set(),
                              generator=torch.Generator().manual_seed(seed))
    return run_verify(session, prompt, **kwargs)


# ---------------------------------------------------------------- the statistics


def test_vector_pooling_matches_goodness_of_fit():
    g = torch.Generator().manual_seed(0)
    for vocab, n in [(12, 50), (12, 300), (200, 300), (1000, 40), (5, 3)]:
        for trial in range(10):
            p = torch.softmax(torch.randn(vocab, generator=g) * 3, 0)
            if trial % 3 == 0:  # zeros, as top-k leaves them
                p[: vocab // 3] = 0
                p = p / p.sum()
            observed = Counter(torch.multinomial(p, n, replacement=True, generator=g).tolist())
            a = goodness_of_fit(observed, dict(enumerate(p.tolist())))
            b = fit_next_token(observed, p)
            assert (a.dof, a.cells) == (b.dof, b.cells) and b.statistic == pytest.approx(a.statistic, rel=1e-9, abs=1e-9)


def test_pooled_rank_test_of_one_prefix_is_pearson():
    """Draws after a single prefix: the generalised statistic is exactly goodness_of_fit's Pearson statistic."""
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(20, generator=g) * 2, 0)
    tokens = torch.multinomial(p, 200, replacement=True, generator=g).tolist()
    order = torch.argsort(p, descending=True).tolist()
    cells = torch.cat([p[order].double(), torch.zeros(64 - 20 + 1, dtype=torch.float64)])
    draws = [(1, cells, order.index(t)) for t in tokens]
    pooled = pooled_rank_test(draws)
    pearson = goodness_of_fit(Counter(tokens), dict(enumerate(p.tolist())))
    assert pooled.dof == pearson.dof and pooled.statistic == pytest.approx(pearson.statistic, rel=1e-6)


def test_reference_conditionals_are_fresh_forwards(peaked_target):
    """Batched, right-padded sequences of different lengths give what a fresh forward of each prefix gives."""
    params = SamplingParams(0.7, top_k=5)
    reference = TargetConditionals(peaked_target, PROMPT, params)
    reference.BATCH = 3
    sequences = [(4,), (4, 5, 6), (7, 8), (4, 5, 6, 7, 1), (9,)]
    got = dict(reference.many(sequences))
    assert list(got) == sequences and reference.forwards == 2
    for seq in sequences:
        for j in range(len(seq)):
            fresh = forward_logits(peaked_target, new_cache(peaked_target), PROMPT + list(seq[:j]), keep=1)[-1]
            torch.testing.assert_close(got[seq][j], logits_to_probs(fresh, params), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- power and level, at the defaults

BROKEN = {
    # bug -> (draft, sampling, how the loop is broken)
    "resample from p, not the residual": ("over", T1, lambda d: (ModelDrafter(d), ResampleFromPClaimingExact())),
    "bonus from p[K-1], not p[K]": ("over", T1, lambda d: (ModelDrafter(d), BonusFromPreviousPosition())),
    "q without top-k (drafts sampled with it)": ("under", TOP2, lambda d: (QWithoutTopK(d), None)),
    "q with top-k (drafts sampled without it)": ("under", TOP2, lambda d: (QWithoutTopK(d, reverse=True), None)),
}


@pytest.mark.parametrize("bug", list(BROKEN))
@pytest.mark.slow
def test_a_broken_rule_fails_at_the_defaults(peaked_target, drafts, bug):
    draft, params, broken = BROKEN[bug]
    reports = []
    for seed in range(RUNS):
        drafter, rule = broken(drafts[draft])
        reports.append(verify(peaked_target, drafter, params, seed=seed, rule=rule))
    failed = sum(r["verdict"] == "fail" for r in reports)
    assert failed >= RUNS - 1, (bug, failed, [round(r["p_value"], 4) for r in reports])
    assert all(r["max_drafted"] == K for r in reports)  # every draft position was exercised


@pytest.mark.parametrize("draft, params", [("over", T1), ("under", TOP2)], ids=["over-confident draft, T=1", "under-confident draft, top-k 2"])
@pytest.mark.slow
def test_the_exact_rule_passes_at_the_expected_rate(peaked_target, drafts, draft, params):
    reports = [verify(peaked_target, ModelDrafter(drafts[draft]), params, seed=100 + seed) for seed in range(RUNS)]
    passed = sum(r["verdict"] == "pass" for r in reports)
    assert passed >= RUNS - 2, (passed, [round(r["p_value"], 4) for r in reports])  # alpha 0.01: ~0.2 failures expected
    r = reports[0]
    assert r["alpha"] == DEFAULT_ALPHA and r["tokens"] == K + 1 and r["generated"] == K + 1
    assert r["max_drafted"] == K and len(r["drafted_per_position"]) == K and min(r["drafted_per_position"]) > 0
    assert [p["position"] for p in r["positions"]] == list(range(1, K + 2))
    assert r["dof"] == sum(p["dof"] for p in r["positions"]) > 0


def test_a_failure_says_where(peaked_target, drafts):
    """The wrong bonus is the (K+1)-th token of a fully accepted first round."""
    r = verify(peaked_target, ModelDrafter(drafts["over"]), T1, seed=0, rule=BonusFromPreviousPosition())
    assert r["verdict"] == "fail" and r["worst_position"] == K + 1
    assert r["positions"][K]["p_value"] < 1e-6 and all(p["p_value"] > DEFAULT_ALPHA for p in r["positions"][:K])
    assert r["likelihood_z"] < -3  # the wrong bonus is a token the target finds unlikely there


def test_the_three_tests_share_alpha():
    """The chi-square test gets 1/2 of alpha, the likelihood and draft-direction tests 1/4 each: the level stays alpha."""
    assert combined_p(0.004, 1.0, 1.0) == pytest.approx(0.008)
    assert combined_p(1.0, 0.002, 1.0) == pytest.approx(0.008) and combined_p(1.0, 1.0, 0.002) == pytest.approx(0.008)
    assert combined_p(0.9, 0.9, 0.9) == 1.0 and combined_p(0.9, 0.9) == 1.0


def lenient_output(p: torch.Tensor, q: torch.Tensor, lam: float) -> torch.Tensor:
    """The exact output distribution of one draft position under LenientRule(lam): accepted mass min(q, p / lam),
    the rest from normalize(max(0, p - lam q))."""
    accepted = torch.minimum(q, p / lam)
    residual = (p - lam * q).clamp_min(0)
    return accepted + (1 - accepted.sum()) * residual / residual.sum()


def direction_z(rounds: int, seed: int, lam: float | None) -> float:
    """Coverage's draft-direction z over `rounds` synthetic rounds of 3 drafted positions (V = 50): tokens drawn
    from p (lam None), or from the lenient rule's output."""
    g = torch.Generator().manual_seed(seed)
    cov = Coverage(tested=4)
    for _ in range(rounds):
        p = torch.softmax(torch.randn(4, 50, generator=g) * 2.5, -1)  # [K+1, V]
        q = torch.softmax(torch.randn(3, 50, generator=g) * 2.5, -1)  # [K, V]
        out = p[:3] if lam is None else torch.stack([lenient_output(p[i], q[i], lam) for i in range(3)])
        cov.add_probs(torch.multinomial(out, 1, generator=g)[:, 0].tolist(), p, q)
    assert cov.direction_tokens == 3 * rounds
    return likelihood_z(cov.direction_score, cov.direction_variance)


def test_the_draft_direction_statistic_is_standard_normal_when_exact_and_large_when_lenient():
    """Model-free: tokens drawn from p give z ~ N(0, 1) (mean and spread over 40 runs); the lossy rule at
    lambda 0.5 shifts it far to the positive side (towards the draft) in 400 rounds."""
    exact = torch.tensor([direction_z(100, seed, None) for seed in range(40)])
    assert abs(float(exact.mean())) < 0.5 and 0.7 < float(exact.std()) < 1.4, exact
    lenient = [direction_z(400, seed, 0.5) for seed in range(5)]
    assert min(lenient) > 4, lenient


# ---------------------------------------------------------------- parallel engines (what the CLI runs on a CPU)


def parallel_session(target, draft, seed, rule=None):
    """A real Session (Session.engine builds the other engines) over the tiny target and a bigram draft."""
    from specchat.models import LoadedModel
    from specchat.session import Session

    tokenizer = SimpleNamespace(eos_token_id=None)
    session = Session(LoadedModel(target, tokenizer, "tiny"), LoadedModel(draft, tokenizer, "bigram"), mode="draft",
                      k=K, sampling=T1, seed=seed)
    session.eos_ids = set()
    if rule is not None:
        session.controls.rule = rule
    return session


def test_parallel_engines_make_every_draw_once_and_reproducibly(peaked_target, drafts):
    threads = torch.get_num_threads()
    a = run_verify(parallel_session(peaked_target, drafts["over"], seed=3), PROMPT, engines=2)
    b = run_verify(parallel_session(peaked_target, drafts["over"], seed=3), PROMPT, engines=2)
    assert torch.get_num_threads() == threads  # the engines ran single-threaded, then torch got its threads back
    assert a["engines"] == 2 and a["verdict"] == "pass" and a["max_drafted"] == K
    assert a["positions"][0]["draws"] == DEFAULT_SAMPLES  # every draw reached the first token's test once
    assert a["drafted_per_position"][0] >= DEFAULT_SAMPLES and a["acceptance_rate"] is not None
    assert (a["statistic"], a["distinct_continuations"], a["drafted_per_position"]) == (
        b["statistic"], b["distinct_continuations"], b["drafted_per_position"])


def test_a_broken_rule_fails_on_parallel_engines(peaked_target, drafts):
    """The engines copy the session's rule: a broken one is still caught."""
    reports = [run_verify(parallel_session(peaked_target, drafts["over"], seed, ResampleFromPClaimingExact()), PROMPT, engines=2)
               for seed in range(5)]
    assert sum(r["verdict"] == "fail" for r in reports) >= 4, [round(r["p_value"], 4) for r in reports]


# ---------------------------------------------------------------- verdicts


class NeverDrafts(Drafter):
    """Like lookup on a conversation without repeats: every round is a plain target step."""

    name = "lookup"

    def propose(self, state, k, params, generator):
        return Proposal.empty(state.device)


def test_nothing_drafted_is_not_a_pass(peaked_target):
    r = verify(peaked_target, NeverDrafts(), T1, seed=0, samples=40)
    assert r["verdict"] == "untested" and r["reason"] == "nothing drafted: nothing was tested"
    assert r["max_drafted"] == 0 and r["drafted_per_position"] == [0] * K and r["acceptance_rate"] is None


def test_an_approximate_rule_gets_its_p_value(peaked_target, drafts):
    r = verify(peaked_target, ModelDrafter(drafts["under"]), T1, seed=0, rule=LenientRule(0.3))
    assert r["verdict"] == "approximate" and r["exact"] is False
    assert r["p_value"] < DEFAULT_ALPHA and 0 <= r["total_variation"] <= 1  # lambda 0.3 is far from exact
    assert r["direction_z"] > 3 and r["direction_tokens"] >= DEFAULT_SAMPLES * K  # the output leans towards the draft


def test_short_tests_still_draft_every_position(peaked_target, drafts):
    """--tokens 2 tests two tokens, but the draws still generate K+1 so the first round drafts K."""
    r = verify(peaked_target, ModelDrafter(drafts["over"]), T1, seed=0, length=2, samples=40)
    assert r["tokens"] == 2 and r["generated"] == K + 1 and len(r["positions"]) == 2
    assert r["max_drafted"] == 2  # drafts at positions 1 and 2 are the tested ones
    r = verify(peaked_target, ModelDrafter(drafts["over"]), T1, seed=0, length=7, samples=40)
    assert r["generated"] == 7 and r["max_drafted"] == K


def test_two_sample_homogeneity_is_still_there(peaked_target, drafts):
    """The two-sample test passes the exact rule and fails its broken control (200 draws each: at 100 the control
    passed at 2 of 4 seeds)."""
    r = verify(peaked_target, ModelDrafter(drafts["over"]), T1, seed=1, test="homogeneity", samples=200)
    assert r["test_kind"] == "homogeneity" and r["plain_samples"] == 200 and r["positions"] == []
    assert r["verdict"] == "pass" and r["p_value"] > DEFAULT_ALPHA
    broken = verify(peaked_target, ModelDrafter(drafts["over"]), T1, seed=1, test="homogeneity", samples=200,
                    rule=ResampleFromPClaimingExact())
    assert broken["verdict"] == "fail" and broken["p_value"] < 1e-6


# ---------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory):
    """A tiny model directory with peaked next-token distributions (LM head x20), its own draft (acceptance ~1)."""
    return tiny_model_dir(tmp_path_factory.mktemp("sharp"), sharpen=20.0)


def verify_cli(model, *extra):
    from click.testing import CliRunner

    from specchat.cli.main import main

    args = ["verify", "--target", str(model), "--draft", str(model), "--seed", "0", "--dtype", "float32", *extra]
    return CliRunner().invoke(main, args, catch_exceptions=False)


@pytest.fixture
def broken_exact(monkeypatch):
    """`--accept exact` gives a rule that claims to be exact but draws the bonus from p[K-1]: a silent bug."""
    import specchat.engine.acceptance as acceptance

    monkeypatch.setattr(acceptance, "parse_rule", lambda spec: BonusFromPreviousPosition())


def test_cli_verify_passes_the_exact_rule(sharp_model):
    import json

    r = verify_cli(sharp_model, "-n", 60, "--format", "json")
    report = json.loads(r.stdout)
    assert r.exit_code == 0 and report["verdict"] == "pass" and report["p_value"] >= report["alpha"], r.output
    assert report["exact"] is True and report["samples"] == 60 and report["mode"] == "draft"
    assert report["max_drafted"] == K and report["acceptance_rate"] > 0.9  # every round drafted and kept all K
    assert report["tokens"] == report["generated"] == K + 1 and [p["position"] for p in report["positions"]] == [1, 2, 3, 4, 5]
    assert min(report["drafted_per_position"]) > 0  # every draft position was tested
    # the verdict's p-value is the weighted Bonferroni of the chi-square (1/2 of alpha), the likelihood and the
    # draft-direction tests (1/4 each)
    assert report["p_value"] == pytest.approx(
        min(1.0, report["chi2_p_value"] / 0.5, report["likelihood_p"] / 0.25, report["direction_p"] / 0.25))


def test_cli_verify_reports_fail_and_exits_1_on_a_broken_rule(sharp_model, broken_exact):
    import json

    r = verify_cli(sharp_model, "--format", "json")
    report = json.loads(r.stdout)
    assert r.exit_code == 1 and report["verdict"] == "fail" and report["exact"] is True, r.output
    assert report["p_value"] < 1e-6 and report["worst_position"] == K + 1 and report["max_drafted"] == K
    r = verify_cli(sharp_model)
    assert r.exit_code == 1 and "FAIL" in r.stdout and "PASS" not in r.stdout, r.output
    assert f"the largest contribution is at token {K + 1}" in " ".join(r.stdout.split())  # rich wraps lines


def test_cli_untested_exits_nonzero(tmp_path):
    import json

    from click.testing import CliRunner

    from specchat.cli.main import main

    model = tiny_model_dir(tmp_path / "tiny")
    args = ["verify", "--target", str(model), "--mode", "lookup", "--prompt", "hello world rain cat", "-n", "20",
            "--seed", "0", "--format", "json", "--dtype", "float32"]
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    report = json.loads(r.stdout)
    if report["max_drafted"]:
        pytest.skip("a reply happened to repeat a bigram")
    assert r.exit_code == 1 and report["verdict"] == "untested" and "nothing drafted" in report["reason"]


def test_the_command_has_run_verifys_defaults():
    import specchat.cli.verify as command
    import specchat.verify as module

    assert (command.DEFAULT_SAMPLES, command.DEFAULT_ALPHA, command.DEFAULT_PROMPT, command.TESTS) == (
        module.DEFAULT_SAMPLES, module.DEFAULT_ALPHA, module.DEFAULT_PROMPT, module.TESTS)
    params = {p.name: p for p in command.verify.params}
    assert params["samples"].default == module.DEFAULT_SAMPLES and params["alpha"].default == module.DEFAULT_ALPHA
    assert params["tokens"].default is None and params["test"].default == "target"
