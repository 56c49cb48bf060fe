"""engine/sampling's contracts that tests/engine/test_acceptance.py's numerical edges leave open (issue 26, found by
mutation testing): any leading shape and dtype, top-k 1, the nucleus's boundary and partial sort, and the draw's
float64 uniform."""

import re

import numpy as np
import pytest
import torch

from specchat.engine import smallbatch
from specchat.engine.sampling import SamplingParams, argmax, logits_to_probs, nucleus, sample, top_n


@pytest.fixture(autouse=True, params=["row kernels", "numpy and torch"])
def paths(request, monkeypatch):
    """Every contract here holds on both paths: the C row kernels (where the library is built) and without them."""
    monkeypatch.setattr(smallbatch, "rows_enabled", request.param == "row kernels")


def test_argmax_of_other_dtypes_any_leading_shape_and_a_tensor_that_needs_grad():
    """The non-numpy path (bfloat16, or a tensor that requires grad: numpy takes neither) reduces the last dim of
    [..., V] like the numpy one: [2, 3, 4] -> [2, 3]."""
    x = torch.tensor([[[0, 3, 1, 2], [5, 1, 0, 0], [0, 0, 0, 7]], [[1, 0, 0, 0], [0, 0, 2, 0], [0, 4, 3, 0]]],
                     dtype=torch.bfloat16)
    assert argmax(x).tolist() == [[1, 0, 3], [0, 2, 1]]
    assert argmax(torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]], requires_grad=True)).tolist() == [1, 0]


def test_argmax_of_a_float32_cpu_tensor_goes_through_numpy(monkeypatch):
    """The fast path the docstring measures (6 us against torch's 87 over 49k ids) is the one taken; others are not."""
    calls = []
    numpy_argmax = np.argmax
    monkeypatch.setattr(np, "argmax", lambda *a, **k: calls.append(1) or numpy_argmax(*a, **k))
    assert argmax(torch.tensor([[0.0, 3.0, 1.0]])).tolist() == [1] and len(calls) == 1
    assert argmax(torch.tensor([[0.0, 3.0, 1.0]], dtype=torch.float64)).tolist() == [1] and len(calls) == 1


def test_greedy_is_one_hot_for_any_leading_shape():
    """[V] and [B, T, V] logits, not only [N, V]: the one-hot goes at each row's argmax on the last dim."""
    assert logits_to_probs(torch.tensor([0.1, 3.0, 2.9, -1.0]), SamplingParams(0)).tolist() == [0.0, 1.0, 0.0, 0.0]
    logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]], [[0.0, 0.0, 1.0], [0.0, 5.0, 1.0]]])
    expected = [[[0, 1, 0], [1, 0, 0]], [[0, 0, 1], [0, 1, 0]]]
    assert logits_to_probs(logits, SamplingParams(0)).tolist() == expected


def test_top_k_one_keeps_only_the_top_token():
    """top-k 1 is a real setting (not "off", which is 0): sampling then always gives the most likely token."""
    probs = logits_to_probs(torch.tensor([[0.1, 2.0, 1.0], [3.0, 0.0, 1.0]]), SamplingParams(1.0, top_k=1))
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_nucleus_drops_a_token_whose_mass_before_is_exactly_top_p():
    """[0.5, 0.25, 0.25] (exact in binary): at top-p 0.5 the second token has 0.5 before it, which already reaches
    top-p, so only the first stays; at 0.75 the third is dropped the same way."""
    probs = torch.tensor([[0.5, 0.25, 0.25]])
    assert nucleus(probs, 0.5).tolist() == [[1.0, 0.0, 0.0]]
    torch.testing.assert_close(nucleus(probs, 0.75), torch.tensor([[2 / 3, 1 / 3, 0.0]]))


def test_a_token_whose_mass_before_is_exactly_top_p_is_dropped_from_logits():
    """The same boundary from logits, as logits_to_probs (and the row kernel) sees it: four equal tokens (e^0 = 1
    exactly) among masked ones, top-p 0.5: the third has exactly half the mass before it."""
    logits = torch.full((1, 100), float("-inf"))
    logits[0, 10:14] = 0.0
    probs = logits_to_probs(logits, SamplingParams(1.0, top_p=0.5))
    assert probs[0, 10:12].tolist() == [0.5, 0.5] and probs.sum() == 1.0 and not probs[0, 12:].any()


def test_nucleus_sorts_only_the_smallest_top_n_that_holds_top_p(monkeypatch):
    """200 ids, the top 64 at 2^-7 each (exactly 0.5 in all) and 136 sharing the other half: top-p 0.5 is reached
    by the top 64 (>=, at equality), so only they are sorted; top-p 0.6 needs the whole vocabulary (the path without
    the row kernels, which do their own cut: tests/engine/test_row_kernels.py)."""
    from specchat.engine import sampling

    monkeypatch.setattr(smallbatch, "rows_enabled", False)
    sizes = []
    top = sampling.top_n
    monkeypatch.setattr(sampling, "top_n", lambda x, n: sizes.append(n) or top(x, n))
    probs = torch.cat([torch.full((64,), 2.0 ** -7), torch.full((136,), 0.5 / 136)])[None]
    out = nucleus(probs, 0.5)
    assert sizes == [64] and torch.equal(out[0, :64], torch.full((64,), 1 / 64)) and not out[0, 64:].any()
    sizes.clear()
    nucleus(probs, 0.6)
    assert sizes == [64, 200]


def test_sample_draws_one_float64_uniform_a_row_from_the_run_generator():
    """Each draw is the first cumulative sum above u * total, u one float64 uniform a row from the given generator
    (53 bits: a float32 uniform's 24 would quantise a token's chance to multiples of 2^-24 of the row's mass)."""
    probs = torch.tensor([[0.25, 0.0, 0.75], [0.1, 0.2, 0.2]])  # the second row sums to 0.5
    cdf = probs.double().cumsum(-1)
    got, ref = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(50):
        u = torch.rand((2, 1), generator=ref, dtype=torch.float64) * cdf[:, -1:]
        assert sample(probs, got).tolist() == (cdf <= u).sum(-1).tolist()


def test_sample_never_draws_a_zero_probability_token_at_a_uniform_of_exactly_zero(monkeypatch):
    """torch.rand can return 0: the first cumulative sum *above* 0 is the first token with mass, never one before
    it (a search for the first sum >= u would give token 0 here)."""
    monkeypatch.setattr(torch, "rand", lambda shape, **k: torch.zeros(shape, dtype=k.get("dtype") or torch.float32))
    assert sample(torch.tensor([[0.0, 0.0, 0.5, 0.5], [0.0, 1.0, 0.0, 0.0]]), None).tolist() == [2, 1]
    # and a uniform exactly at a cumulative sum belongs to the next token with mass
    monkeypatch.setattr(torch, "rand", lambda shape, **k: torch.full(shape, 0.25, dtype=k.get("dtype") or torch.float32))
    assert sample(torch.tensor([[0.25, 0.0, 0.75]]), None).tolist() == [2]
    long_row = torch.zeros(1, 100)
    long_row[0, 40], long_row[0, 70] = 0.25, 0.75  # (past the row kernel's first vectors)
    assert sample(long_row, None).tolist() == [70]


def test_sample_refuses_a_row_without_mass_with_the_whole_message():
    with pytest.raises(ValueError, match="^" + re.escape("cannot sample from a row without probability mass") + "$"):
        sample(torch.tensor([[0.0, 0.0]]), torch.Generator().manual_seed(0))



def test_sample_over_the_support_draws_what_the_whole_rows_sums_draw():
    """The CPU path sums only a row's nonzero entries: the same draws, to the id, as the float64 cumulative sums of
    the whole row searched for the first sum above u (rows with zeros, a probability too small to move the sum, and
    a row that sums to less than 1)."""
    for trial in range(60):
        gen = torch.Generator().manual_seed(trial)
        x = (torch.randn(3, 5000, generator=gen) * 4).softmax(-1)
        x = x * (x > 1e-4 * (trial % 5))
        x[1] = 0.0
        x[1, trial] = 1e-30
        x[1, 4000] = 0.25
        cdf = x.double().cumsum(-1)
        total = cdf[:, -1:]
        got, ref = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        for _ in range(20):
            u = torch.rand(total.shape, generator=ref, dtype=torch.float64) * total
            u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
            assert torch.equal(sample(x, got), torch.searchsorted(cdf, u, right=True).squeeze(-1))


@pytest.mark.parametrize("n", [1, 5, 64, 1024])
def test_top_n_is_torch_topk_with_ties_to_the_lower_id(n):
    """The numpy path (vocabularies of 8192 and more) gives torch.topk's values, largest first, and ids that hold them,
    distinct, the lower id first among equal values: rows with ties (probabilities rounded to 1e-3; a nucleus' zeros)
    and without."""
    gen = torch.Generator().manual_seed(n)
    for vocab in (8192, 49152, 151936 + 7):
        probs = (torch.randn(3, vocab, generator=gen) * 3).softmax(-1)
        nucleus_like = probs * (probs >= probs.topk(3, dim=-1).values[..., -1:])  # 3 tokens, tens of thousands of zeros
        for x in (probs, torch.round(probs * 1e3) / 1e3, nucleus_like):
            values, ids = top_n(x, n)
            assert torch.equal(values, torch.topk(x, n, dim=-1).values)
            assert torch.equal(x.gather(-1, ids), values)
            for row, row_values, row_ids in zip(x, values.tolist(), ids.tolist()):
                assert len(set(row_ids)) == n
                last = (row == row_values[-1]).nonzero().flatten().tolist()  # ids holding the n-th value: the lowest taken
                assert sorted(i for i in row_ids if row[i] == row_values[-1]) == last[: sum(v == row_values[-1] for v in row_values)]
                assert all(a > b or (a == b and i < j) for a, b, i, j in zip(row_values, row_values[1:], row_ids, row_ids[1:]))
