"""The C row kernels (kernels/smallbatch.c, `row_*`) against the library paths they replace in engine/sampling.py:
the same top lists and draws to the bit, the same nucleus and probabilities to float32's rounding."""

import math

import numpy as np
import pytest
import torch

from specchat.engine import smallbatch
from specchat.engine.loop import unwarped_alternatives
from specchat.engine.sampling import SamplingParams, log_normaliser, logits_to_probs, sample, top_n, tops_of

pytestmark = pytest.mark.skipif(smallbatch.rows is None, reason="the kernel library does not build here")


def both(fn, monkeypatch):
    """fn() with the row kernels, then without them."""
    monkeypatch.setattr(smallbatch, "rows_enabled", True)
    with_c = fn()
    monkeypatch.setattr(smallbatch, "rows_enabled", False)
    without = fn()
    monkeypatch.setattr(smallbatch, "rows_enabled", True)
    return with_c, without


def logit_rows(seed: int, vocab: int) -> torch.Tensor:
    """[4, V]: plain, tied at the top, peaked (a nucleus of a few), and with -inf entries (a top-k's mask)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(4, vocab, generator=gen) * 3
    rows[1, : min(40, vocab)] = 9.0
    rows[2, vocab // 2] += 25.0
    rows[3, ::3] = float("-inf")
    rows[3, 1] = 4.0
    return rows


@pytest.mark.parametrize("vocab", [3, 17, 200, 49152 + 5])
@pytest.mark.parametrize("n", [1, 5, 64])
def test_top_lists_are_the_sorted_orders_with_ties_to_the_lower_id(vocab, n, monkeypatch):
    """Vocabularies shorter than a vector, with a tail after the last vector, and a real one."""
    n = min(n, vocab)
    x = logit_rows(n + vocab, vocab)
    x[0] = torch.round(x[0])  # many ties everywhere
    (values, ids), (ref_values, ref_ids) = both(lambda: top_n(x, n), monkeypatch)
    sorted_values, sorted_ids = torch.sort(x, dim=-1, descending=True, stable=True)
    assert torch.equal(values, sorted_values[:, :n]) and torch.equal(ids, sorted_ids[:, :n])
    assert torch.equal(values, ref_values) and torch.equal(ids, ref_ids)


def test_a_row_with_nans_leaves_the_top_list_to_torch():
    x = torch.tensor([[1.0, float("nan"), 3.0]])
    assert top_n(x, 3)[1].tolist() == torch.topk(x, 3).indices.tolist()


@pytest.mark.parametrize("vocab", [3, 17, 200, 49152 + 5])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9), SamplingParams(0.3, top_k=40, top_p=0.95),
     SamplingParams(2.0, top_p=0.5), SamplingParams(1.3, top_k=7)],
    ids=str,
)
def test_probabilities_are_the_libraries_to_float32s_rounding(vocab, params, monkeypatch):
    """The same nonzero set (ties at the nucleus' edge kept by the lower id, masked logits exactly 0) and values
    within 1e-5 of torch's softmax and nucleus (x / t rounds the exponent: ~30 x float32's 6e-8 at t = 0.3)."""
    x = logit_rows(vocab, vocab)
    probs, ref = both(lambda: logits_to_probs(x, params), monkeypatch)
    assert torch.equal(probs > 0, ref > 0)
    torch.testing.assert_close(probs, ref, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(probs.double().sum(-1), torch.ones(4, dtype=torch.float64), rtol=0, atol=1e-6)


def test_the_nucleus_is_the_float64_sorted_mass_rule():
    """Against a reference in float64 (numpy's exp, a stable sort by value, the cumulative mass before each token):
    the kept sets are equal on 200 random rows of 5000 ids at temperatures that keep 1 to thousands of tokens. The cut
    that falls (1e-2, 1e-4, 0 of the total) must not change the set: the flat rows need the last one."""
    gen = torch.Generator().manual_seed(0)
    sizes = []
    for trial in range(200):
        t, top_p = [0.2, 0.7, 1.0, 3.0, 20.0][trial % 5], [0.5, 0.9, 0.99][trial % 3]
        x = torch.randn(1, 5000, generator=gen) * 2
        kept = (logits_to_probs(x, SamplingParams(t, top_p=top_p))[0] > 0).numpy()
        e = np.exp((x[0].double().numpy() - x.max().item()) / t)
        order = np.argsort(-e, kind="stable")
        before = np.concatenate([[0.0], np.cumsum(e[order])[:-1]])
        ref = np.zeros(5000, dtype=bool)
        ref[order[before < top_p * e.sum()]] = True
        assert (kept == ref).all(), (trial, kept.sum(), ref.sum())
        sizes.append(kept.sum())
    assert min(sizes) == 1 and max(sizes) > 1000


def test_a_uniform_row_keeps_the_lowest_ids():
    """50000 equal logits at top-p 0.9: no cut above 0 holds the mass, the sort of all of them keeps ties by id."""
    probs = logits_to_probs(torch.zeros(1, 50000), SamplingParams(1.0, top_p=0.9))[0]
    assert (probs[:45000] > 0).all() and not (probs[45000:] > 0).any()


def test_draws_are_the_librarys_to_the_bit(monkeypatch):
    """The same uniforms from the generator and the same float64 sums in id order: nuclei, whole rows, residual-like
    rows that sum to less than 1, and an entry too small to move the sum."""
    gen = torch.Generator().manual_seed(1)
    for trial in range(30):
        x = (torch.randn(3, 5000, generator=gen) * 3).softmax(-1)
        x[0] = logits_to_probs(x[0].log(), SamplingParams(1.0, top_p=0.7))
        x[1] = (x[1] - 2e-4).clamp_min(0.0)
        x[2, trial] = 1e-30
        draws = lambda: [sample(x, torch.Generator().manual_seed(trial + i)) for i in range(20)]  # noqa: E731
        with_c, without = both(draws, monkeypatch)
        assert all(torch.equal(a, b) for a, b in zip(with_c, without))


def test_the_inspectors_unwarped_probabilities_are_the_softmaxs():
    x = logit_rows(5, 49152)[:3]
    ids = [7, 40, 49152 // 2]
    probs, tops = unwarped_alternatives(x, ids)
    ref = x.double().softmax(-1)
    assert probs == pytest.approx([ref[i, t].item() for i, t in enumerate(ids)], rel=1e-5)
    for row, top in zip(ref, tops):
        values, top_ids = torch.sort(row, descending=True, stable=True)
        assert [i for i, _ in top] == top_ids[:5].tolist()
        assert [p for _, p in top] == pytest.approx(values[:5].tolist(), rel=1e-5)
    assert log_normaliser(x).tolist() == pytest.approx(torch.logsumexp(x.double(), -1).tolist(), rel=1e-6)
    assert math.isinf(log_normaliser(torch.full((1, 20), float("-inf"))).item())


@pytest.mark.parametrize("vocab", [3, 17, 40, 200, 49152 + 5])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_tops_split_across_threads_are_the_whole_rows(vocab, threads, monkeypatch):
    """rows_summary: each thread's part of a row (parts of 16 columns, as the LM head's loop splits them; a part may be
    empty) merged into the sorted top list with ties to the lower id, also for ties across parts, and the parts'
    exp-sums into the row's log-sum-exp."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    x = logit_rows(vocab + threads, vocab)
    x[0] = torch.round(x[0])  # ties everywhere, across the parts' boundaries too
    x[1, -min(8, vocab):] = 9.0  # the tied top at both ends of the row
    n = min(5, vocab)
    tops, ref = both(lambda: tops_of(x, n), monkeypatch)
    sorted_values, sorted_ids = torch.sort(x, dim=-1, descending=True, stable=True)
    assert torch.equal(tops.values, sorted_values[:, :n]) and torch.equal(tops.ids, sorted_ids[:, :n])
    assert torch.equal(tops.ids, ref.ids)
    assert tops.log_z == pytest.approx(torch.logsumexp(x.double(), -1).tolist(), rel=1e-6)
    assert torch.equal(logits_to_probs(x, SamplingParams(0), tops), logits_to_probs(x, SamplingParams(0)))


def test_tops_of_rows_without_a_full_list_are_the_librarys():
    """A row of -inf has no normaliser; NaNs never enter a list (as top_n's), and a row with fewer other values than n
    goes to the library path (as top_n)."""
    x = torch.randn(2, 100)
    x[0] = float("-inf")
    tops = tops_of(x, 5)
    assert math.isinf(tops.log_z[0]) and tops.log_z[1] == pytest.approx(torch.logsumexp(x[1].double(), -1).item(), rel=1e-6)
    x[1, 3] = float("nan")
    assert torch.equal(tops_of(x, 3).ids, top_n(x, 3)[1])
    few = torch.tensor([[1.0, float("nan"), 3.0]])
    assert tops_of(few, 3).ids.tolist() == top_n(few, 3)[1].tolist() == [[1, 2, 0]]
