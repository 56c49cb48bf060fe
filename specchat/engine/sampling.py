"""Logits -> probabilities, applied identically to the target's p and the draft's q (a q that differs from what the
draft sampled from, or a p without the same warpers, silently biases the output)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from specchat.engine import smallbatch
from specchat.engine.sampling_params import SamplingParams  # noqa: F401 (re-exported: most callers import it from here)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] the index of the largest value (the first one on ties, as torch.argmax). On a CPU through
    numpy: over a 49k vocabulary torch's took 87 us on the reference CPU and numpy's 6, and a plain round of a
    ~10 ms llama.cpp step takes two."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad:
        return torch.from_numpy(np.asarray(np.argmax(x.numpy(), axis=-1)))
    return x.argmax(-1)


def top_n(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, n, dim=-1): values [..., n] largest first (ties: the lower id first) and their ids. On a CPU by the
    row kernel for n <= TOP_IN_C, else (or where the library does not build) through numpy: the row's n largest are all at least the n-th largest of 4n (512 or more) group maxima (each of the n best
    groups holds one), so only the few values above it are sorted. torch's topk took 120-180 us over a 49k vocabulary
    on the reference CPU (a round of a ~4 ms step takes one to three), this a half to a third of that; the top
    1024, 500 us against 100."""
    vocab = x.shape[-1]
    kernels = smallbatch.row_kernels(x)
    if kernels is not None and n <= TOP_IN_C and vocab >= n:
        found = _top_in_c(kernels, x, n)
        if found is not None:
            return found
    if vocab < max(8192, 8 * n):  # a stable sort, for the order of ties (torch.topk's is its own)
        values, ids = torch.sort(x, dim=-1, descending=True, stable=True)
        return values[..., :n], ids[..., :n]
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.requires_grad:
        return torch.topk(x, n, dim=-1)
    rows = x.detach().reshape(-1, vocab).numpy()
    groups = max(4 * n, 512)  # group j: ids j, j + groups, j + 2 groups, ... (an elementwise max of slices: fast)
    blocks = rows[:, : vocab // groups * groups].reshape(len(rows), -1, groups).max(1)  # [R, groups]
    cut = np.partition(blocks, blocks.shape[1] - n, axis=-1)[:, blocks.shape[1] - n]  # [R]
    ids = np.empty((len(rows), n), dtype=np.int64)
    for r, row in enumerate(rows):
        above = np.flatnonzero(row > cut[r])  # fewer than n: the rest are values equal to the cut, lowest ids first
        if len(above) < n:  # (a nucleus' probabilities: tens of thousands of zeros, none of them sorted)
            above = np.concatenate([above, _first_equal(row, cut[r], n - len(above))])
        ids[r] = above[np.lexsort((above, -row[above]))[:n]]
    values = np.take_along_axis(rows, ids, axis=-1)
    shape = (*x.shape[:-1], n)
    return torch.from_numpy(values).reshape(shape), torch.from_numpy(ids).reshape(shape)


TOP_IN_C = 64  # the largest n the row kernel takes: it keeps its list sorted by insertion, n steps at worst each


def _top_in_c(kernels, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """top_n by the row kernel: one pass a row, a vector of values looked at only when one beats the n-th so far.
    NaN never enters its list; None when a row has fewer than n other values (the library paths take it)."""
    vocab = x.shape[-1]
    rows = x.reshape(-1, vocab)  # [R, V]
    values, ids = torch.empty(len(rows), n), torch.empty(len(rows), n, dtype=torch.int64)  # [R, n]
    for r in range(len(rows)):
        at = 4 * vocab * r
        if kernels.top(rows.data_ptr() + at, vocab, n, ids.data_ptr() + 8 * n * r, values.data_ptr() + 4 * n * r) < n:
            return None
    shape = (*x.shape[:-1], n)
    return values.view(shape), ids.view(shape)


def _first_equal(row: np.ndarray, value: float, n: int) -> np.ndarray:
    """The n lowest ids of `row` that hold `value` (it holds at least n), from a prefix that grows 4x until it has
    them: a nucleus' zeros start near id 0, and listing all of them cost more than the rest of top_n."""
    end = 4 * n
    while True:
        found = np.flatnonzero(row[:end] == value)
        if len(found) >= n or end >= len(row):
            return found[:n]
        end *= 4


@dataclass(frozen=True)
class Tops:
    """What greedy decoding and the token inspector read of rows of logits [R, V]: each row's n largest (largest first,
    ties to the lower id) and log sum_i e^x_i (the model's own softmax at id i is e^(x_i - log_z))."""

    values: torch.Tensor  # [R, n]
    ids: torch.Tensor  # [R, n] int64
    log_z: list[float]  # [R]


def tops_of(logits: torch.Tensor, n: int) -> Tops:
    """Tops of logits [R, V] (n <= V). On the CPU one call of the row kernel for every row: the threads each read back
    the part of a row the LM head's loop had them write, from their own caches, instead of three passes of one thread
    over rows the other had written."""
    kernels = smallbatch.row_kernels(logits)
    if kernels is not None and logits.dim() == 2 and 1 <= n <= TOP_IN_C:
        R, V = logits.shape
        ids, values = torch.empty(R, n, dtype=torch.int64), torch.empty(R, n)  # [R, n]
        log_z = torch.empty(R, dtype=torch.float64)
        found = kernels.summary(logits.data_ptr(), R, V, n, ids.data_ptr(), values.data_ptr(), log_z.data_ptr(),
                                torch.get_num_threads())
        if found == n:
            return Tops(values, ids, log_z.tolist())
    values, ids = top_n(logits, n)
    return Tops(values, ids, log_normaliser(logits, maxima=values[:, 0].tolist()).tolist())


def logits_to_probs(logits: torch.Tensor, params: SamplingParams, tops: Tops | None = None) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k and top-p.

    Greedy is a one-hot at the argmax, so the exact acceptance rule reduces to argmax matching
    with no division by a temperature near 0; `tops` (of these logits, where the caller has them) give it.
    """
    logits = logits.float()
    if params.greedy:
        best = tops.ids[:, :1] if tops is not None else argmax(logits).unsqueeze(-1)  # [..., 1]
        return torch.zeros_like(logits).scatter_(-1, best, 1.0)
    if 0 < params.top_k < logits.shape[-1]:
        kth = top_n(logits, params.top_k)[0][..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logits = logits.contiguous()
    kernels = smallbatch.row_kernels(logits)
    if kernels is not None:
        return _probs_in_c(kernels, logits, params)
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        probs = nucleus(probs, params.top_p)
    return probs


def _probs_in_c(kernels, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits_to_probs by the row kernel, a call a row: softmax(x / t) over e^((x - max) / t), and the nucleus sorting
    only the entries above a cut that falls until their mass reaches top_p (its float64 sums in the sorted order)."""
    vocab = logits.shape[-1]
    rows = logits.reshape(-1, vocab)  # [R, V]
    out = torch.empty_like(rows)  # [R, V]
    for r in range(len(rows)):
        at = 4 * vocab * r
        if kernels.probs(rows.data_ptr() + at, vocab, params.temperature, params.top_p, out.data_ptr() + at) < 0:
            raise ValueError("a row of logits without probability mass")
    return out.view(logits.shape)


def log_normaliser(logits: torch.Tensor, maxima: list[float] | None = None) -> torch.Tensor:
    """[R, V] -> [R] float64 log sum_i e^x_i: the model's own softmax at any id is e^(x - this), without writing it.
    `maxima`, each row's largest logit where the caller has it (a top list), saves the row kernel a pass."""
    kernels = smallbatch.row_kernels(logits)
    if kernels is None:
        return torch.logsumexp(logits.double(), dim=-1)
    if maxima is None:
        maxima = top_n(logits, 1)[0][:, 0].tolist()
    vocab = logits.shape[-1]
    out = []
    for r, m in enumerate(maxima):
        at = logits.data_ptr() + 4 * vocab * r
        total = kernels.exp_sum(at, vocab, m, 1.0, None)
        out.append(m + math.log(total) if total > 0 else -math.inf)
    return torch.tensor(out, dtype=torch.float64)


NUCLEUS_SIZES = (64, 1024)  # the top-n tried before sorting the whole vocabulary


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] -> [..., V]: only the most likely tokens whose mass before them is below top_p (the first always stays),
    renormalised. Only the top n are sorted, for the smallest n tried whose mass reaches top_p in every row: the
    tokens beyond them have at least that much mass before them, so all are dropped. Sorting all 49k ids took 3.6
    ms on the reference CPU, the top 64 a tenth of that."""
    vocab = probs.shape[-1]
    for n in (*[n for n in NUCLEUS_SIZES if n < vocab], vocab):
        kept, order = top_n(probs, n)  # [..., n], most likely first
        mass = kept.cumsum(-1)  # [..., n]
        if n == vocab or bool((mass[..., -1] >= top_p).all()):
            break
    drop = (mass - kept) >= top_p  # the mass strictly before the token already reaches top_p
    kept = kept.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, kept / kept.sum(-1, keepdim=True))  # renormalised over the n only


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[N, V] probabilities (a row need not sum to 1) -> [N] token ids, drawn with the run's seeded generator: one
    uniform a row through the row's cumulative sum, in float64. torch.multinomial takes ~1 ms for one draw over a
    49k vocabulary on the reference CPU, this ~0.05 ms, and a round draws up to K + 1 times. A token of
    probability 0 is never drawn: u < the row's total, and the first cumulative sum above u is a step up."""
    kernels = smallbatch.row_kernels(probs)
    if kernels is not None:
        return _sample_in_c(kernels, probs, generator)
    if probs.device.type == "cpu" and probs.dtype == torch.float32 and not probs.requires_grad:
        return _sample_support(probs, generator)
    cdf = probs.double().cumsum(-1)  # [N, V]
    total = cdf[:, -1:]  # [N, 1]
    if not bool((total > 0).all()):
        raise ValueError("cannot sample from a row without probability mass")
    u = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=cdf.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u * total may round up to total
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


def _sample_support(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """`sample` over each row's nonzero entries only, the same draws to the bit: a zero adds nothing to a float64 sum,
    so the cumulative sums at the support are the whole row's, and the first above u is at the support. A nucleus
    keeps a few tokens of a 49k vocabulary, and the whole row's float64 sums were most of a draw's cost."""
    rows = probs.detach().reshape(-1, probs.shape[-1]).numpy()  # [N, V]
    support = [np.flatnonzero(row != 0) for row in rows]  # (numpy's nonzero is much faster on a bool array)
    cdfs = [np.cumsum(row[ids], dtype=np.float64) for row, ids in zip(rows, support)]
    total = np.array([cdf[-1] if len(cdf) else 0.0 for cdf in cdfs])  # [N] float64
    if not (total > 0).all():
        raise ValueError("cannot sample from a row without probability mass")
    u = torch.rand((len(rows), 1), generator=generator, dtype=torch.float64).numpy()[:, 0] * total
    u = np.minimum(u, np.nextafter(total, 0.0))  # u * total may round up to total
    return torch.tensor([ids[np.searchsorted(cdf, x, side="right")] for ids, cdf, x in zip(support, cdfs, u)])


def _sample_in_c(kernels, probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """`sample` by the row kernel: the same uniforms and float64 sums in id order, so the same draws to the bit, with
    the vectors of zeros around a nucleus skipped."""
    vocab = probs.shape[-1]
    rows = probs.reshape(-1, vocab)  # [N, V]
    u = torch.rand((len(rows), 1), generator=generator, dtype=torch.float64)[:, 0].tolist()
    ids = [kernels.draw(rows.data_ptr() + 4 * vocab * r, vocab, u[r]) for r in range(len(rows))]
    if min(ids) < 0:
        raise ValueError("cannot sample from a row without probability mass")
    return torch.tensor(ids)
