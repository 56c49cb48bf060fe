"""Distribution checks: does a speculative mode sample from the target's distribution?

`specchat verify` (and `bench`) call `run_verify`. Its default test is one-sample: the target gives the exact
probability of the next token after any prefix (one forward), so the speculative draws are compared with
the target's own conditionals, with no noisy plain-sampling reference. The joint of the first m tokens is
decomposed into conditionals. At position j (1..m), every prefix of length j-1 drawn often enough for its own
test gets a Pearson chi-square goodness of fit of its next-token counts against n_prefix * p(. | prefix),
cells pooled (rarest first) so every expected count is at least 5; the draws after all rarer prefixes are
tested together, each token placed in a cell by its rank under its own p(. | prefix) (a generalised Pearson
statistic; see `pooled_rank_test`). Given the prefixes these tests are independent, so their statistics and
degrees of freedom add up to one chi-square test; the per-position sums say where a failure comes from.

A chi-square test of many degrees of freedom dilutes a change that shows in one direction only, so two
one-degree tests look in the directions a wrong rule usually takes. The likelihood score: the sum over every
tested token of log p(x) - E_p[log p], divided by its standard deviation under the target (a sum of independent
terms given the prefixes: ~N(0, 1) when the mode is exact). The draft direction (`Coverage.add_probs`): a rule
that lets too much of the draft through moves the output towards the tokens where q exceeds p; the sum over
every drafted token of every round (not only the first m) of f(x) - E_p[f], f = q / (p + q), computed from the
loop's own p and q, is a martingale when the rule is exact, so its z is ~N(0, 1) there. The verdict uses a
weighted Bonferroni combination of the three p-values (`combined_p`: the chi-square at 1/2 of alpha, each z
test at 1/4), so its level stays at most alpha.

m defaults to K+1 and every draw generates at least K+1 tokens, so the first round can draft all K
positions and earn the bonus: a bug at any draft position or in the bonus shows.

The two-sample homogeneity test (speculative vs plain sampling) is kept as `test="homogeneity"`; the tests
of the engine itself use `goodness_of_fit` against a joint enumerated from a tiny target.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch

MIN_EXPECTED = 5.0
DEFAULT_SAMPLES = 100  # draws (see docs/commands.md, verify: power on tiny models and seconds per mode on the default model)
DEFAULT_ALPHA = 0.01
TESTS = ("target", "homogeneity")

# The default prompts, per mode. A model draft is tested after an open question: the target's next-token
# distributions are broad there, and that is where a wrong rule changes the output most (resampling from p
# instead of the residual barely matters when p is nearly one token: the residual is then nearly p too).
# Lookup drafts only from repeated text, so it gets a conversation whose next reply repeats an earlier one:
# it drafts from the first round on (the previous "<|im_start|>assistant\n" is followed by the sentence).
DEFAULT_PROMPT = "Tell me a short story about a robot."
DEFAULT_SENTENCE = "The cat sat on the mat and looked at the rain."
REPEAT_CONVERSATION = (
    {"role": "user", "content": f"Repeat this sentence exactly: {DEFAULT_SENTENCE}"},
    {"role": "assistant", "content": DEFAULT_SENTENCE},
    {"role": "user", "content": "Repeat it once more."},
)
REPEAT_RAW_PROMPT = f"{DEFAULT_SENTENCE}\n{DEFAULT_SENTENCE}\n{DEFAULT_SENTENCE}\n"
REPEATING_MODES = {"lookup"}  # modes that draft only from repeated text


def default_messages(mode: str) -> list[dict]:
    """The chat `specchat verify` tests a mode on when no --prompt is given."""
    if mode in REPEATING_MODES:
        return [dict(m) for m in REPEAT_CONVERSATION]
    return [{"role": "user", "content": DEFAULT_PROMPT}]


def default_raw_prompt(mode: str) -> str:
    """The same with --raw (no chat template)."""
    return REPEAT_RAW_PROMPT if mode in REPEATING_MODES else DEFAULT_PROMPT


@dataclass(frozen=True)
class ChiSquare:
    statistic: float
    dof: int
    p_value: float
    cells: int  # cells after pooling

    def passed(self, alpha: float) -> bool:
        return self.p_value >= alpha


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square(dof): the regularised upper incomplete gamma Q(dof/2, x/2)."""
    if dof <= 0:
        return 1.0
    if math.isinf(x):
        return 0.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)))


def _pool(keys: list, weight: dict, min_weight: float) -> list[list]:
    """Group keys (rarest first) so every group's weight is at least min_weight.

    Ties are broken by the key itself, never by insertion order: in a two-sample test insertion
    order tells which sample an outcome came from, and grouping by it would fake a difference.
    """
    groups, current, acc = [], [], 0.0
    for key in sorted(keys, key=lambda k: (weight[k], repr(k))):
        current.append(key)
        acc += weight[key]
        if acc >= min_weight:
            groups.append(current)
            current, acc = [], 0.0
    if current:  # leftover too light on its own: merge into the last group
        if groups:
            groups[-1].extend(current)
        else:
            groups.append(current)
    return groups


def goodness_of_fit(observed: Counter, probs: dict) -> ChiSquare:
    """Observed outcome counts against exact outcome probabilities (which must sum to ~1)."""
    n = sum(observed.values())
    expected = {k: n * v for k, v in probs.items()}
    for k in observed:  # an outcome with probability 0 that still occurred
        expected.setdefault(k, 0.0)
    groups = _pool(list(expected), expected, MIN_EXPECTED)
    stat = 0.0
    for g in groups:
        e = sum(expected[k] for k in g)
        o = sum(observed.get(k, 0) for k in g)
        stat += (o - e) ** 2 / e if e > 0 else (float("inf") if o else 0.0)
    return ChiSquare(stat, len(groups) - 1, chi2_sf(stat, len(groups) - 1), len(groups))


def fit_next_token(observed: Counter, probs: torch.Tensor, minimum: float = MIN_EXPECTED) -> ChiSquare:
    """`goodness_of_fit` of next-token counts against a [V] probability vector, pooled the same way.

    Same groups as `_pool` (rarest first, each closed once its expected count reaches MIN_EXPECTED, a light
    leftover merged into the last group; ties broken by token id), found with a cumulative sum instead of a
    Python loop over the vocabulary: on a 49k-token vocabulary `goodness_of_fit` takes ~0.1 s per prefix.
    """
    n = sum(observed.values())
    expected = probs.double().cpu() * n  # [V]
    order = torch.sort(expected, stable=True).indices  # ascending; equal values keep id order
    cum = expected[order].cumsum(0)  # [V]
    ends, reached = [], 0.0  # ends: exclusive end (in sorted order) of every closed group
    while True:
        i = int(torch.searchsorted(cum, torch.tensor([reached + minimum], dtype=cum.dtype)))
        if i >= cum.numel():
            break
        ends.append(i + 1)
        reached = float(cum[i])
    if not ends or ends[-1] < cum.numel():  # leftover: into the last group (or the only one)
        ends = [*ends[:-1], cum.numel()]
    bounds = torch.tensor(ends)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    obs = torch.zeros(len(ends), dtype=torch.float64)
    for token, count in observed.items():
        obs[int(torch.searchsorted(bounds, rank[token], right=True))] += count
    exp = torch.diff(cum[bounds - 1], prepend=torch.zeros(1, dtype=cum.dtype))
    terms = torch.where(exp > 0, (obs - exp) ** 2 / exp.clamp_min(1e-300), torch.where(obs > 0, math.inf, 0.0))
    stat = float(terms.sum())
    return ChiSquare(stat, len(ends) - 1, chi2_sf(stat, len(ends) - 1), len(ends))


def homogeneity(a: Counter, b: Counter) -> ChiSquare:
    """Two samples of outcomes: were they drawn from the same distribution? (2 x C contingency table)"""
    na, nb = sum(a.values()), sum(b.values())
    total = Counter(a) + Counter(b)
    # pool by combined count so the smaller sample's expected count per cell is >= MIN_EXPECTED
    groups = _pool(list(total), total, MIN_EXPECTED * (na + nb) / min(na, nb))
    stat = 0.0
    for g in groups:
        t = sum(total[k] for k in g)
        for sample, n in ((a, na), (b, nb)):
            e = t * n / (na + nb)
            o = sum(sample.get(k, 0) for k in g)
            stat += (o - e) ** 2 / e
    dof = len(groups) - 1
    return ChiSquare(stat, dof, chi2_sf(stat, dof), len(groups))


def total_variation(a: Counter, b: Counter) -> float:
    """Empirical total-variation distance between two samples of outcomes."""
    na, nb = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a.get(k, 0) / na - b.get(k, 0) / nb) for k in set(a) | set(b))


def sample_continuations(
    state, prompt: list[int], controls, *, draws: int, length: int, eos_ids: set[int], generator, stats=None, stop=None
) -> Counter:
    """Counts of the first `length` tokens over `draws` independent generations from one prompt.

    The target state is reused between draws, so the prompt is encoded once. `stop` (a threading.Event) ends
    the draws early when set.
    """
    from specchat.engine.loop import generate

    if isinstance(stats, Coverage):  # it also keeps the draft-direction score, from the loop's full p and q
        controls = dataclasses.replace(controls, on_probs=stats.add_probs)
    counts: Counter = Counter()
    for _ in range(draws):
        if stop is not None and stop.is_set():
            break
        tokens = []
        for record in generate(state, prompt, controls, max_new_tokens=length, eos_ids=eos_ids, generator=generator):
            tokens += [t.id for t in record.tokens]
            if stats is not None:
                stats.add(record)
        counts[tuple(tokens)] += 1
    return counts


def parallel_engines(session) -> int:
    """How many engines `run_verify` draws with: on a CPU with the lean runner or llama.cpp, one per torch thread,
    each single-threaded. Two single-threaded engines on the 2-core reference machine drew 1.7x the rounds per
    second of one engine on two threads (earlyexit, SmolLM2-135M, OpenMP's passive wait): a round is a chain
    of small operations, and every one of them makes two threads meet. On CUDA, and on the HF forward (whose
    modules may keep state between calls), one."""
    if session.state.device.type != "cpu" or session.info.runner not in ("lean", "llama.cpp"):
        return 1
    return max(1, torch.get_num_threads())


def draw_in_parallel(session, prompt: list[int], engines: int, *, draws: int, length: int, coverage) -> Counter:
    """`sample_continuations` split over `engines` engines (`Session.engine`), one Python thread each, torch
    on one thread: torch releases the GIL inside its operations, so the engines run on separate cores.
    Engine i makes draws i, i + engines, ... with a generator seeded from the session's, so a seed and an
    engine count give the same draws. Every engine's rounds go into `coverage`."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    seeds = torch.randint(2**62, (engines,), generator=session.generator).tolist()
    work = []
    for i, seed in enumerate(seeds):
        state, controls = session.engine()
        generator = torch.Generator(device=state.device).manual_seed(seed)
        work.append((state, controls, generator, Coverage(coverage.tested), len(range(i, draws, engines))))
    stop = threading.Event()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(engines) as pool:
            futures = [
                pool.submit(sample_continuations, state, prompt, controls, draws=n, length=length, eos_ids=session.eos_ids,
                            generator=generator, stats=cov, stop=stop)
                for state, controls, generator, cov, n in work
            ]
            try:
                counts = sum((f.result() for f in futures), Counter())
            except BaseException:  # Ctrl+C or an engine's error: the others stop after their current draw
                stop.set()
                raise
    finally:
        torch.set_num_threads(threads)
    for *_, cov, _ in work:
        coverage.merge(cov)
    return counts


class Coverage:
    """Collects every round of the draws (a `stats=` for sample_continuations): the statistics, per draft
    position how many rounds drafted it where the drafted token lies within the first `tested` tokens, and the
    draft-direction score (`add_probs`)."""

    def __init__(self, tested: int) -> None:
        from specchat.engine.metrics import Stats

        self.stats, self.tested = Stats(), tested
        self.drafted: Counter = Counter()  # draft position i (1-based) -> rounds that drafted it
        self.max_drafted = 0  # the largest K a round drafted
        self._offset = 0  # tokens of the current draw before this round
        self.direction_score = 0.0  # sum over drafted emitted tokens of f(x) - E_p[f], f = q / (p + q)
        self.direction_variance = 0.0  # its variance under the target
        self.direction_tokens = 0

    def merge(self, other: "Coverage") -> None:
        self.stats = self.stats.merge(other.stats)
        self.drafted.update(other.drafted)
        self.max_drafted = max(self.max_drafted, other.max_drafted)
        self.direction_score += other.direction_score
        self.direction_variance += other.direction_variance
        self.direction_tokens += other.direction_tokens

    def add_probs(self, new: list[int], p: torch.Tensor, q: torch.Tensor) -> None:
        """One round's emitted tokens with the loop's own p [K+1, V] and q [K, V] (the draft-direction test).

        Every emitted token that had a draft (accepted or resampled; not the bonus) adds f(x) - E_p[f] with
        f = q / (p + q), a bounded, increasing function of q(x) / p(x). When the rule is exact each token follows
        p(. | everything before it) and f is fixed before it is drawn, so the sum is a martingale: mean 0,
        variance the sum of Var_p(f). A rule that lets too much of the draft through (lossy acceptance,
        resampling from p instead of the residual) moves every such token towards where q exceeds p, so this one
        direction adds up over every token of every round, not only the first few tested by the chi-square test.
        """
        m = min(len(new), q.shape[0])
        if m == 0:
            return
        pm, qm = p[:m].double(), q[:m].double()  # [m, V]
        total = pm + qm
        f = torch.where(total > 0, qm / total.clamp_min(torch.finfo(total.dtype).tiny), 0.5)  # [m, V]
        mean = (pm * f).sum(-1)  # [m]
        drawn = f[torch.arange(m, device=f.device), torch.tensor(new[:m], device=f.device)]  # [m]
        self.direction_score += float((drawn - mean).sum())
        self.direction_variance += float(((pm * f**2).sum(-1) - mean**2).clamp_min(0.0).sum())
        self.direction_tokens += m

    def add(self, record) -> None:
        self.stats.add(record)
        if record.index == 0:  # a new draw
            self._offset = 0
        within = max(0, min(record.drafted, self.tested - self._offset))
        for i in range(1, within + 1):
            self.drafted[i] += 1
        self.max_drafted = max(self.max_drafted, within)
        self._offset += len(record.tokens)


class TargetConditionals:
    """p(next token | prompt + prefix) from the target: its logits through `logits_to_probs` with the session's
    sampling parameters, in float32. The prompt is encoded once into a cache of its own (the session's is left
    alone); each sequence is then fed after a copy of it, so one forward gives the conditionals at all of the
    sequence's prefixes. Sequences go BATCH at a time (right-padded: causal attention keeps the padding out
    of the positions that matter); that is 3-5x faster on a CPU than one forward each, and differs from the
    loop's own forwards only by float rounding (~1e-5 of a logit in float32). On llama.cpp each sequence is one
    decode after the prompt on a context of its own (a batch of positions, as the loop's verifies are); on the lean
    engine one forward after the prompt in a cache of its own, each overwriting the last (the same arithmetic as
    the loop's verifies: a position's logits do not depend on what is fed with it)."""

    BATCH = 16

    def __init__(self, model, prompt: list[int], params) -> None:
        from specchat.engine.cache import forward_logits, new_cache
        from specchat.engine.llamacpp import on_llama_cpp
        from specchat.engine.runner import Runner

        self.model, self.prompt, self.params = model, list(prompt), params
        self.forwards = 0
        self.context = None  # llama.cpp: one context, the prompt prefilled once, each sequence fed after it
        self.lean = None  # the lean engine (`model` is its Runner): a cache of its own, likewise
        if isinstance(model, Runner):
            self.lean, self.cache = model, model.new_cache()
            if len(prompt) > 1:
                with torch.inference_mode():
                    self.lean.step(self.prompt[:-1], self.cache, 0, keep=1)
            return
        if on_llama_cpp(model):
            self.context = model.context()
            if len(prompt) > 1:
                self.context.decode(self.prompt[:-1], 0, keep=1)
            return
        self.cache = new_cache(model)  # prompt[:-1]; its last token is fed with every sequence
        if len(prompt) > 1:
            forward_logits(model, self.cache, self.prompt[:-1], keep=1)

    def many(self, sequences: list[tuple[int, ...]]):
        """Yield (seq, [len(seq), V]) for every non-empty sequence: row j is p(. | prompt + seq[:j])."""
        import copy

        from specchat.engine.cache import new_cache
        from specchat.engine.sampling import logits_to_probs

        sequences = [s for s in sequences if s]
        last = self.prompt[-1]
        if self.lean is not None:
            for seq in sequences:
                with torch.inference_mode():
                    logits = self.lean.step([last, *seq[:-1]], self.cache, len(self.prompt) - 1, keep=len(seq))  # [len(seq), V]
                self.forwards += 1
                yield seq, logits_to_probs(logits, self.params)
            return
        if self.context is not None:  # one sequence per decode (a llama.cpp batch of one sequence)
            for seq in sequences:
                logits = self.context.decode([last, *seq[:-1]], len(self.prompt) - 1, keep=len(seq))  # [len(seq), V]
                self.forwards += 1
                yield seq, logits_to_probs(logits, self.params)
            return
        for i in range(0, len(sequences), self.BATCH):
            chunk = sequences[i : i + self.BATCH]
            width = max(len(s) for s in chunk)
            cache = new_cache(self.model)
            if len(self.prompt) > 1:
                cache = copy.deepcopy(self.cache)
                cache.batch_repeat_interleave(len(chunk))
            ids = torch.tensor([[last, *s[:-1]] + [last] * (width - len(s)) for s in chunk], device=self.model.device)  # [B, W]
            with torch.inference_mode():
                logits = self.model(input_ids=ids, cache=cache, use_cache=True).logits  # [B, W, V]
            self.forwards += 1
            probs = logits_to_probs(logits, self.params)
            for seq, rows in zip(chunk, probs):
                yield seq, rows[: len(seq)]

    def along(self, seq: tuple[int, ...]) -> torch.Tensor:
        """[len(seq), V] for one sequence."""
        return next(self.many([seq]))[1]


def next_token_counts(sequences: Counter, depth: int) -> dict[tuple, Counter]:
    """prefix (shorter than `depth`) -> counts of the token that followed it, over the draws that reached it."""
    nxt: dict[tuple, Counter] = defaultdict(Counter)
    for seq, count in sequences.items():
        for j in range(min(len(seq), depth)):
            nxt[seq[:j]][seq[j]] += count
    return nxt


RANKS = 64  # rank cells of the pooled test: ranks 1..RANKS under p(. | prefix), then the rest


def rank_of(probs: torch.Tensor, token: int) -> int:
    """The token's rank (0 = most likely) under a [V] distribution; ties ordered by id."""
    p = probs[token]
    return int((probs > p).sum()) + int((probs[:token] == p).sum())


def pooled_rank_test(draws: list[tuple[int, torch.Tensor, int]], minimum: float = MIN_EXPECTED) -> ChiSquare:
    """Draws made after different prefixes, each too rare to be tested on its own, tested together.

    Each item is (count, [RANKS + 1] probabilities of ranks 1..RANKS and of the rest under that draw's
    p(. | prefix), the rank cell its token fell in). The cells are ranges of ranks pooled from the rarest end
    until each expected count is at least MIN_EXPECTED. The count of a cell is a sum of independent draws
    with different probabilities, so its covariance is sum_d (diag(pi_d) - pi_d pi_d^T) rather than the
    multinomial one: the statistic is (O - E)^T Cov^+ (O - E), chi-square with rank(Cov) degrees of freedom.
    With a single prefix it is exactly the Pearson statistic of `goodness_of_fit`.
    """
    if not draws:
        return ChiSquare(0.0, 0, 1.0, 0)
    weights = torch.tensor([float(c) for c, _, _ in draws], dtype=torch.float64)  # [D]
    probs = torch.stack([p for _, p, _ in draws]).double()  # [D, RANKS + 1]
    expected = weights @ probs  # [RANKS + 1]
    cells, current, acc = [], [], 0.0  # rank cells from the rarest end (the rest, then rank RANKS, ...)
    for r in range(probs.shape[1] - 1, -1, -1):
        current.append(r)
        acc += float(expected[r])
        if acc >= minimum:
            cells.append(current)
            current, acc = [], 0.0
    if current:
        if cells:
            cells[-1].extend(current)
        else:
            cells.append(current)
    if len(cells) < 2:
        return ChiSquare(0.0, 0, 1.0, len(cells))
    member = torch.zeros(probs.shape[1], len(cells), dtype=torch.float64)
    cell_of = {}
    for c, ranks in enumerate(cells):
        member[ranks, c] = 1.0
        cell_of.update(dict.fromkeys(ranks, c))
    pi = probs @ member  # [D, C]
    observed = torch.zeros(len(cells), dtype=torch.float64)
    for count, _, rank in draws:
        observed[cell_of[rank]] += count
    mean = weights @ pi  # [C]
    cov = torch.diag(mean) - torch.einsum("d,dc,de->ce", weights, pi, pi)  # [C, C]
    diff = (observed - mean)[:-1]  # one cell is determined by the others
    cov = cov[:-1, :-1]
    dof = int(torch.linalg.matrix_rank(cov))
    stat = float(diff @ torch.linalg.pinv(cov, hermitian=True) @ diff)
    return ChiSquare(stat, dof, chi2_sf(stat, dof), len(cells))


def likelihood_z(score: float, variance: float) -> float:
    """(sum of log p(x) - E_p[log p]) / its standard deviation under the target: ~N(0, 1) when exact."""
    if math.isinf(score):
        return score
    return score / math.sqrt(variance) if variance > 0 else 0.0


def normal_two_sided(z: float) -> float:
    return math.erfc(abs(z) / math.sqrt(2))


# Shares of alpha (a weighted Bonferroni combination, so the level stays at most alpha): the chi-square test is
# the broad one; the likelihood and draft-direction tests each look in one direction a wrong rule usually takes.
CHI2_SHARE, LIKELIHOOD_SHARE, DIRECTION_SHARE = 0.5, 0.25, 0.25


def combined_p(chi2_p: float, likelihood_p: float, direction_p: float = 1.0) -> float:
    """Reject at alpha when any test rejects at its share of alpha (they test the same draws, so their
    p-values are not combined as independent)."""
    return min(1.0, chi2_p / CHI2_SHARE, likelihood_p / LIKELIHOOD_SHARE, direction_p / DIRECTION_SHARE)


def conditional_tests(sequences: Counter, target: TargetConditionals, depth: int) -> tuple[list[dict], float, float]:
    """The chi-square tests of every position, and the empirical total variation.

    Position j: every prefix of length j-1 whose own test (`fit_next_token`) has a degree of freedom is tested
    on its own; the draws after every other prefix are tested together by rank (`pooled_rank_test`), so no
    draw is wasted when the continuations spread over many rare prefixes. Given the prefixes these tests are
    independent: their statistics and degrees of freedom add up.
    Total variation: sum over the observed sequences s (first `depth` tokens, or up to EOS) of
    max(0, freq(s) - P(s)), which includes sampling noise.
    """
    nxt = next_token_counts(sequences, depth)
    own: dict[tuple, ChiSquare] = {}
    pooled: dict[int, list] = defaultdict(list)  # position -> pooled draws
    n = sum(sequences.values())
    tv = 0.0
    score = torch.zeros(depth, dtype=torch.float64)  # per position: sum of log p(x) - E_p[log p]
    variance = torch.zeros(depth, dtype=torch.float64)  # and its variance under the target
    for seq, probs in target.many(list(sequences)):  # probs [len(seq), V]
        count = sequences[seq]
        rows = probs.double()
        logp = torch.where(rows > 0, rows.log(), 0.0)  # [len(seq), V]
        mean = (rows * logp).sum(-1)  # E_p[log p] = -entropy
        drawn = rows[torch.arange(len(seq)), torch.tensor(seq)].log()  # -inf for a token p cannot emit
        score[: len(seq)] += count * (drawn - mean)
        variance[: len(seq)] += count * ((rows * logp**2).sum(-1) - mean**2).clamp_min(0.0)
        for j in range(len(seq)):
            prefix = seq[:j]
            if prefix not in own:
                own[prefix] = fit_next_token(nxt[prefix], probs[j]) if sum(nxt[prefix].values()) >= 2 * MIN_EXPECTED else ChiSquare(0.0, 0, 1.0, 1)
            if own[prefix].dof == 0:
                top = torch.topk(probs[j], min(RANKS, probs.shape[-1])).values.double()
                top = torch.cat([top, torch.zeros(RANKS - top.numel(), dtype=top.dtype)])
                cells = torch.cat([top, (1.0 - top.sum()).clamp_min(0.0)[None]])  # [RANKS + 1]
                pooled[j + 1].append((count, cells, min(rank_of(probs[j], seq[j]), RANKS)))
        p_seq = float(probs[torch.arange(len(seq)), torch.tensor(seq)].double().prod())
        tv += max(0.0, count / n - p_seq)
    positions = []
    for j in range(1, depth + 1):
        at = [t for prefix, t in own.items() if len(prefix) == j - 1 and t.dof > 0]
        rest = pooled_rank_test(pooled[j])
        stat, dof = sum(t.statistic for t in at) + rest.statistic, sum(t.dof for t in at) + rest.dof
        positions.append({
            "position": j,
            "statistic": stat,
            "dof": dof,
            "p_value": chi2_sf(stat, dof),
            "cells": sum(t.cells for t in at) + (rest.cells if rest.dof else 0),
            "prefixes": len(at),  # tested on their own
            "draws": sum(sum(nxt[prefix].values()) for prefix, t in own.items() if len(prefix) == j - 1 and t.dof > 0),
            "pooled_draws": sum(c for c, _, _ in pooled[j]) if rest.dof else 0,
            "untested_draws": sum(c for c, _, _ in pooled[j]) if not rest.dof else 0,
            "likelihood_z": likelihood_z(float(score[j - 1]), float(variance[j - 1])),
        })
        p = positions[-1]
        p["likelihood_p"] = normal_two_sided(p["likelihood_z"])
        p["combined_p"] = combined_p(p["p_value"] if dof else 1.0, p["likelihood_p"])
    total_z = likelihood_z(float(score.sum()), float(variance.sum()))
    return positions, tv, total_z


def run_verify(
    session,
    prompt: list[int],
    *,
    samples: int = DEFAULT_SAMPLES,
    length: int | None = None,
    alpha: float = DEFAULT_ALPHA,
    test: str = "target",
    engines: int = 1,
    progress=None,
) -> dict:
    """`samples` draws with the session's mode from `prompt`, tested on their first `length` tokens.

    `session` needs `state`, `controls`, `eos_ids` and `generator`. `length` defaults to K+1 (every draft
    position and the bonus); every draw generates at least K+1 tokens so the first round can draft all K.
    test="target" (default): one sample against the target's exact conditionals (module doc); `p_value` combines
    the chi-square test (`chi2_p_value`) and the likelihood score test (`likelihood_p`), see `combined_p`.
    test="homogeneity": the two-sample test against as many plain-sampling draws.
    engines > 1: the speculative draws run on that many engines in parallel (`draw_in_parallel`; the session
    needs `engine()`, see `parallel_engines`).
    Verdicts: "pass" / "fail" at level `alpha` for an exact rule; "approximate" for a lossy rule (the p-value
    still says whether the distance is detectable); "untested" when no round drafted a tested position, or the
    draws gave no degree of freedom (nothing was tested, which is not a pass).
    """
    from specchat.engine.drafters.plain import PlainDecoding
    from specchat.engine.loop import Controls

    if test not in TESTS:
        raise ValueError(f"unknown test {test!r}; use one of {', '.join(TESTS)}")
    controls = session.controls
    k = controls.k
    depth = length or k + 1
    generated = max(depth, k + 1)
    coverage = Coverage(depth)
    common = {"draws": samples, "length": generated, "eos_ids": session.eos_ids, "generator": session.generator}
    if progress:
        on = f" on {engines} engines in parallel" if engines > 1 else ""
        progress(f"sampling {samples} continuations of {generated} tokens with mode {controls.mode} (K={k}){on}...")
    t0 = time.perf_counter()
    if engines > 1:
        drawn = draw_in_parallel(session, prompt, engines, draws=samples, length=generated, coverage=coverage)
    else:
        drawn = sample_continuations(session.state, prompt, controls, stats=coverage, **common)
    sequences = Counter()
    for seq, count in drawn.items():
        sequences[seq[:depth]] += count
    sampling_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    positions: list[dict] = []
    if test == "target":
        if progress:
            progress(f"target probabilities of {len(sequences)} distinct continuations...")
        state = session.state  # a target read in place (the lean engine) has its runner and no model
        target = TargetConditionals(state.model if state.model is not None else state.lean, prompt, controls.sampling)
        positions, tv, z = conditional_tests(sequences, target, depth)
        statistic, dof = sum(p["statistic"] for p in positions), sum(p["dof"] for p in positions)
        result = ChiSquare(statistic, dof, chi2_sf(statistic, dof), sum(p["cells"] for p in positions))
        dz = likelihood_z(coverage.direction_score, coverage.direction_variance)
        p_value = combined_p(result.p_value, normal_two_sided(z), normal_two_sided(dz)) if dof else 1.0
        description = (f"the first {depth} tokens against the target's exact conditionals: chi-square goodness of fit "
                       f"(per prefix, rarer prefixes pooled by rank; cells pooled to expected >= {MIN_EXPECTED:g}) and "
                       "likelihood score (z of sum log p(x) - E_p[log p]); every drafted token of every round: draft "
                       "direction (z of sum f(x) - E_p[f], f = q / (p + q)); combined: chi-square at 1/2 alpha, each z at 1/4")
        reference = {"chi2_p_value": result.p_value, "likelihood_z": z, "likelihood_p": normal_two_sided(z),
                     "direction_z": dz, "direction_p": normal_two_sided(dz), "direction_tokens": coverage.direction_tokens,
                     "prefixes_tested": sum(p["prefixes"] for p in positions), "target_forwards": target.forwards}
    else:
        if progress:
            progress(f"sampling {samples} continuations with plain decoding...")
        plain = Controls(PlainDecoding(), k=0, sampling=controls.sampling)
        plain_counts = Counter()
        for seq, count in sample_continuations(session.state, prompt, plain, **common).items():
            plain_counts[seq[:depth]] += count
        result = homogeneity(sequences, plain_counts)
        p_value = result.p_value
        tv = total_variation(sequences, plain_counts)
        description = f"chi-square homogeneity, speculative vs plain, joint of the first {depth} tokens (2 x C, cells pooled to expected >= 5)"
        reference = {"plain_samples": samples}
    reference_s = time.perf_counter() - t0

    exact = controls.rule.exact
    reason = None
    if coverage.max_drafted == 0:
        verdict, reason = "untested", "nothing drafted: nothing was tested"
    elif result.dof == 0:
        verdict, reason = "untested", "too few draws for a single degree of freedom: nothing was tested (raise -n)"
    elif not exact:
        verdict = "approximate"
    else:
        verdict = "pass" if p_value >= alpha else "fail"
    worst = min(positions, key=lambda p: p["combined_p"])["position"] if positions and verdict != "untested" else None
    return {
        "samples": samples,
        "tokens": depth,
        "generated": generated,
        "test": description,
        "test_kind": test,
        "statistic": result.statistic,
        "dof": result.dof,
        "p_value": p_value,
        "cells": result.cells,
        "alpha": alpha,
        "total_variation": tv,
        "acceptance_rate": coverage.stats.acceptance_rate,
        "exact": exact,
        "verdict": verdict,
        "reason": reason,
        "max_drafted": coverage.max_drafted,
        "drafted_per_position": [coverage.drafted[i] for i in range(1, max(k, coverage.max_drafted) + 1)],
        "positions": positions,
        "worst_position": worst,
        "distinct_continuations": len(sequences),
        "engines": engines,
        "sampling_s": sampling_s,
        "reference_s": reference_s,
        **reference,
    }
