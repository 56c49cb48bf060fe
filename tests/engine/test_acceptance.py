"""Numerical edges of sampling and the exact rule: q(x) = 0, underflow, a vanishing residual, greedy ties."""

import pytest
import torch

from specchat.engine.acceptance import EXACT, draw_next
from specchat.engine.sampling import SamplingParams, argmax, logits_to_probs, nucleus, sample
from specchat.verify import chi2_sf


def test_greedy_is_one_hot_at_argmax_in_float32():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0]], dtype=torch.bfloat16)
    probs = logits_to_probs(logits, SamplingParams(0))
    assert probs.dtype == torch.float32 and probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_top_k_and_top_p_shape_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    top2 = logits_to_probs(logits, SamplingParams(1.0, top_k=2))
    torch.testing.assert_close(top2, torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    # top-p 0.8: 0.5 + 0.2 = 0.7 < 0.8, so 0.15 is still needed; 0.1 and 0.05 are not
    nucleus = logits_to_probs(logits, SamplingParams(1.0, top_p=0.8))
    torch.testing.assert_close(nucleus, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    assert logits_to_probs(logits, SamplingParams(1.0, top_p=0.01)).tolist() == [1.0, 0, 0, 0, 0]  # the top token always stays
    hot = logits_to_probs(logits, SamplingParams(0.5))
    torch.testing.assert_close(hot, torch.softmax(logits / 0.5, -1))


def sorted_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus by sorting the whole vocabulary (specchat's implementation before the partial sort)."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    sorted_probs = sorted_probs.masked_fill((sorted_probs.cumsum(-1) - sorted_probs) >= top_p, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return out / out.sum(-1, keepdim=True)


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.9, 0.999])
def test_the_partial_nucleus_equals_the_fully_sorted_one(top_p):
    """Peaked rows (the top 64 hold the nucleus), middling and flat ones (the top 1024 or the whole vocabulary)."""
    torch.manual_seed(0)
    logits = torch.cat([torch.randn(2, 5000) * 6, torch.randn(2, 5000) * 1.5, torch.randn(2, 5000) * 0.05])
    probs = torch.softmax(logits, -1)
    got, ref = nucleus(probs, top_p), sorted_nucleus(probs, top_p)
    assert torch.equal(got > 0, ref > 0)
    torch.testing.assert_close(got, ref, atol=1e-7, rtol=1e-5)


def test_argmax_takes_the_first_of_equal_maxima_like_torch():
    x = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 5.0]])
    assert argmax(x).tolist() == x.argmax(-1).tolist() == [1, 0]
    assert int(argmax(x[0])) == 1 and argmax(x[:, 1:]).tolist() == [0, 1]  # views and single rows


def draw_counts(draw, probs: torch.Tensor, n: int) -> torch.Tensor:
    """How often each id of probs [2, V] came up in n draws of both rows at once."""
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([draw(probs, g) for _ in range(n)])  # [n, 2]
    return torch.stack([torch.bincount(ids[:, r], minlength=probs.shape[1]) for r in range(2)])  # [2, V]


def test_sample_draws_each_row_from_its_distribution_and_never_a_zero():
    """One uniform a row through the row's CDF (engine/sampling.sample): rows need not sum to 1 (a residual, q
    restricted to a draft vocabulary). The control forgets to scale the uniform by the row's total."""
    probs = torch.tensor([[0.0, 0.1, 0.0, 0.4, 0.3, 0.2, 0.0], [0.05, 0.05, 0.1, 0.0, 0.1, 0.1, 0.1]])  # row 2 sums to 0.5

    def unscaled(probs, g):
        cdf = probs.double().cumsum(-1)
        u = torch.rand(probs.shape[0], 1, generator=g, dtype=torch.float64)
        return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[1] - 1).squeeze(-1)

    for draw, exact in ((sample, True), (unscaled, False)):
        counts = draw_counts(draw, probs, 6000)
        worst = 1.0
        for row, p in zip(counts, probs):
            support = p > 0
            if exact:
                assert not row[~support].any()  # a token of probability 0 never comes up
            expected = p / p.sum() * row.sum()
            if row[~support].any():
                worst = 0.0
            else:
                o, e = row[support].double(), expected[support].double()
                worst = min(worst, chi2_sf(float(((o - e) ** 2 / e).sum()), int(support.sum()) - 1))
        assert (worst > 1e-3) if exact else (worst < 1e-6)


def test_sample_refuses_a_row_without_mass():
    import pytest

    with pytest.raises(ValueError, match="probability mass"):
        sample(torch.tensor([[0.5, 0.5], [0.0, 0.0]]), torch.Generator().manual_seed(0))


def test_q_zero_never_gives_nan():
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    verdict = EXACT(torch.tensor([1]), q, p, torch.Generator().manual_seed(0), greedy=False)
    assert verdict.accept_probs.tolist() == [1.0]  # p(x) > 0 = q(x): accept
    verdict = EXACT(torch.tensor([0]), torch.tensor([[0.0, 1.0, 0.0]]), p, torch.Generator().manual_seed(0), greedy=False)
    assert verdict.accept_probs.tolist() == [0.0] and verdict.accepted == 0  # p(x) = q(x) = 0: reject, no NaN
    assert verdict.next_token in (1, 2)


def test_vanishing_residual_falls_back_to_p_not_token_zero():
    p = torch.tensor([[0.0, 0.25, 0.75], [0.0, 0.5, 0.5]])
    q = p[:1].clone()  # p == q: max(0, p - q) is all zero
    g = torch.Generator().manual_seed(0)
    draws = [draw_next(0, q, p, g, greedy=False) for _ in range(400)]
    assert 0 not in draws and 0.6 < draws.count(2) / 400 < 0.9


def test_one_hot_q_accepts_with_probability_p_and_removes_x_from_the_residual():
    p = torch.tensor([[0.3, 0.6, 0.1], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    g = torch.Generator().manual_seed(1)
    outcomes = [EXACT(torch.tensor([1]), q, p, g, greedy=False) for _ in range(4000)]
    accepted = sum(v.accepted for v in outcomes) / 4000
    assert abs(accepted - 0.6) < 0.03
    replacements = [v.next_token for v in outcomes if v.accepted == 0]
    assert 1 not in replacements and abs(replacements.count(0) / len(replacements) - 0.75) < 0.05


def test_greedy_rule_is_argmax_matching():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    verdict = EXACT(torch.tensor([1, 1]), q, p, torch.Generator().manual_seed(0), greedy=True)
    assert verdict.accepted == 1 and verdict.next_token == 2
    verdict = EXACT(torch.tensor([1, 2]), torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]), p, None, greedy=True)
    assert verdict.accepted == 2 and verdict.next_token == 0  # all accepted: the bonus is p's argmax


@pytest.mark.parametrize("temperature", [0.5, 0.7, 1.0, 1.6])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (0, 0.9), (0, 0.5), (20, 1.0), (20, 0.8), (3, 0.95)])
def test_warping_matches_transformers_warpers(temperature, top_k, top_p):
    """p and q are warped by one function, so a bug that changes both alike (the order of temperature, top-k and
    top-p) is invisible to the distribution tests: check it against an independent reference, transformers' own
    warpers in the order its generate() applies them (temperature, top-k, top-p), at T != 1 with top-p too."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(int(100 * temperature) + 7 * top_k + int(100 * top_p))
    logits = torch.randn(4, 300, generator=g) * 3  # [rows, V]
    reference = logits.clone()
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    for warper in warpers:
        reference = warper(None, reference)
    expected = torch.softmax(reference, dim=-1)
    got = logits_to_probs(logits, SamplingParams(temperature, top_k, top_p))
    assert torch.equal(got > 0, expected > 0)  # the same tokens kept
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_the_rule_draws_only_from_the_runs_generator_and_reports_probabilities_at_most_one():
    """A seeded run repeats whatever else used torch's global generator meanwhile (a rule or residual draw that
    fell back to the global one survived every other test: mutation run, benchmarks/RESULTS.md section 11), and
    each acceptance probability is min(1, p(x)/q(x)), never above 1 (the loop's expected tokens sum them)."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, 50, generator=g), -1)  # [K+1, V]
    q = torch.softmax(torch.randn(4, 50, generator=g), -1)  # [K, V]
    draft = torch.multinomial(q, 1, generator=g).squeeze(-1)  # [K]
    verdicts = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)  # the global generator differs between the two runs
        run = torch.Generator().manual_seed(7)
        verdicts.append([(v.accepted, v.next_token) for v in (EXACT(draft, q, p, run, False) for _ in range(30))])
        verdicts[-1] += [draw_next(0, q, p, run, False) for _ in range(30)]
    assert verdicts[0] == verdicts[1]
    v = EXACT(draft, q, p, torch.Generator().manual_seed(3), False)
    px, qx = p[torch.arange(4), draft], q[torch.arange(4), draft]
    assert torch.allclose(v.accept_probs, torch.clamp(px / qx, max=1.0)) and bool((v.accept_probs <= 1).all())
