"""Mode `draft` (ModelDrafter) at unit level on tiny models: every q it reports against the draft model's own
forward over the whole context (no cache), its cache re-sync after rewinds, the stand-in for ids it cannot embed,
the restricted vocabulary, the confidence stop and the vocabulary alignment. (Written for the mutation score of
drafters/model.py; each test runs in milliseconds.)"""

from __future__ import annotations


import pytest
import torch

from support.models import TableLM, tiny_llama
from specchat.engine.drafters.model import ModelDrafter, _as_list, align_vocab
from specchat.engine.errors import ModeUnavailable
from specchat.engine.runner import lean_runner
from specchat.engine.sampling import SamplingParams

T1, GREEDY = SamplingParams(1.0), SamplingParams(0)
V = 12  # tiny_llama's vocabulary


class State:
    """What ModelDrafter.propose reads of a TargetState."""

    device = torch.device("cpu")

    def __init__(self, tokens, vocab_size: int = V) -> None:
        self.tokens, self.vocab_size = list(tokens), vocab_size


@pytest.fixture(scope="module")
def draft():
    return tiny_llama(seed=1, layers=2, sharpen=1.0).requires_grad_(False)  # fairly flat: every id has mass


@torch.inference_mode()
def full_logits(model, tokens) -> torch.Tensor:
    """The model's next-token logits after `tokens`, from one forward over all of them (no cache)."""
    return model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


def drafters(model):
    return {"hf": ModelDrafter(model), "lean": ModelDrafter(model, lean=lean_runner(model))}


class Feeds(ModelDrafter):
    """Records what each draft step feeds."""

    def next_logits(self, feed, vocab_size):
        self.feeds.append(list(feed))
        return super().next_logits(feed, vocab_size)


# ---------------------------------------------------------------- align_vocab


def test_align_vocab_cuts_pads_with_minus_infinity_or_keeps():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert torch.equal(align_vocab(x, 2), torch.tensor([[1.0, 2.0], [4.0, 5.0]]))
    inf = float("-inf")
    assert torch.equal(align_vocab(x, 5), torch.tensor([[1.0, 2.0, 3.0, inf, inf], [4.0, 5.0, 6.0, inf, inf]]))
    assert torch.equal(align_vocab(x, 4), torch.tensor([[1.0, 2.0, 3.0, inf], [4.0, 5.0, 6.0, inf]]))  # one missing
    assert torch.equal(align_vocab(x, 3), x)
    assert torch.softmax(align_vocab(x, 5), -1)[:, 3:].eq(0).all()  # missing ids get probability 0


def test_as_list():
    assert _as_list(None) == [] and _as_list(3) == [3] and _as_list([1, 2]) == [1, 2]


# ---------------------------------------------------------------- build


def test_build_needs_a_draft_model():
    with pytest.raises(ModeUnavailable, match=r"^mode 'draft' needs a draft model: pass --draft MODEL$"):
        ModelDrafter.build(tiny_llama(seed=0), None)


def test_build_streams_a_lean_draft_and_passes_the_vocabulary(draft):
    built = ModelDrafter.build(None, draft)
    assert built.lean is not None and built.vocab_ids is None and built.model is draft
    assert built.lean.head_w.dtype == torch.bfloat16 and built.lean.blocks[0].qkv_w.dtype == torch.bfloat16
    assert draft.lm_head.weight.dtype == torch.float32  # the model's own weights untouched
    restricted = ModelDrafter.build(None, draft, draft_vocab=5, unrelated_option=1)
    assert restricted.vocab_ids.tolist() == [0, 1, 2, 3, 4]


def test_build_refuses_a_restricted_vocabulary_without_the_lean_runner():
    table = TableLM(torch.zeros(V, V), tiny_llama(seed=0).config)  # no HF module layout: HF's forward only
    assert ModelDrafter.build(None, table).lean is None
    with pytest.raises(ModeUnavailable, match=r"^--draft-vocab needs a draft the lean runner supports \(unexpected module layout\)$"):
        ModelDrafter.build(None, table, draft_vocab=5)
    with pytest.raises(ValueError, match="^a restricted draft vocabulary needs the lean runner$"):
        ModelDrafter(table, vocab=5)


# ---------------------------------------------------------------- the stand-in token


@pytest.mark.parametrize("pad, eos, expected", [
    (None, None, 0),
    (3, 5, 3),
    (None, 5, 5),
    (V, 7, 7),  # pad beyond the table
    (-1, 7, 7),  # negative
    (11, 2, 11),  # the table's last id is fine
    (None, [4, 6], 0),  # a list is not an id
    (0, 9, 0),
])
def test_the_stand_in_is_the_first_valid_of_pad_eos_and_zero(pad, eos, expected):
    model = tiny_llama(seed=2)
    model.config.pad_token_id, model.config.eos_token_id = pad, eos
    assert ModelDrafter(model).stand_in == expected and ModelDrafter(model).embed_size == V


@pytest.mark.parametrize("path", ["hf", "lean"])
def test_an_id_beyond_the_draft_table_is_fed_as_the_stand_in(path):
    model = tiny_llama(seed=2, layers=1).requires_grad_(False)
    model.config.pad_token_id = 4
    d = drafters(model)[path]
    q = d.propose(State([1, 2, V, V + 3], vocab_size=V + 5), 1, T1, torch.Generator().manual_seed(0)).q[0]
    expected = torch.softmax(full_logits(model, [1, 2, 4, 4]), -1)
    assert q.shape == (V + 5,) and (q[V:] == 0).all()  # the target's extra ids: never proposed
    torch.testing.assert_close(q[:V], expected, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- proposals against the uncached forward


@pytest.mark.parametrize("path", ["hf", "lean"])
def test_greedy_drafts_follow_the_draft_models_argmax_chain(draft, path):
    d = drafters(draft)[path]
    tokens = [1, 2, 3, 4]
    p = d.propose(State(tokens), 4, GREEDY, None)
    chain = list(tokens)
    for _ in range(4):
        chain.append(int(full_logits(draft, chain).argmax()))
    assert p.ids.tolist() == chain[4:] and p.calls == 4
    assert p.q.shape == (4, V) and torch.equal(p.q, torch.nn.functional.one_hot(p.ids, V).float())
    assert d.cached == chain[:-1]  # the last draft is not fed yet


@pytest.mark.parametrize("path", ["hf", "lean"])
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.6, top_k=4)])
def test_sampled_drafts_are_drawn_from_the_q_they_report_with_the_runs_generator(draft, path, params):
    """Each q is the draft's distribution after the context and the drafts before it; each draft is the inverse
    CDF of q at one float64 uniform of the run's generator (sampling.sample's contract)."""
    d = drafters(draft)[path]
    tokens = [5, 1, 7]
    p = d.propose(State(tokens), 5, params, torch.Generator().manual_seed(11))
    uniforms = torch.Generator().manual_seed(11)
    context = list(tokens)
    assert p.calls == 5 and len(p.ids) == 5 and p.q.dtype == torch.float32
    for j, token in enumerate(p.ids.tolist()):
        logits = full_logits(draft, context) / params.temperature
        if params.top_k:
            logits[logits < logits.topk(params.top_k).values[-1]] = float("-inf")
        q = torch.softmax(logits, -1)
        torch.testing.assert_close(p.q[j], q, rtol=1e-4, atol=1e-6)
        u = float(torch.rand(1, generator=uniforms, dtype=torch.float64))
        assert token == int((q.double().cumsum(-1) <= u * float(q.sum())).sum())
        context.append(token)


def test_a_seeded_generator_reproduces_the_drafts_and_another_seed_does_not(draft):
    runs = [ModelDrafter(draft).propose(State([3, 4]), 8, T1, torch.Generator().manual_seed(s)).ids.tolist() for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


# ---------------------------------------------------------------- re-sync


@pytest.mark.parametrize("path", ["hf", "lean"])
def test_re_sync_keeps_the_common_prefix_and_feeds_only_the_rest(draft, path):
    d = Feeds(draft, lean=lean_runner(draft) if path == "lean" else None)
    d.feeds = []
    d.propose(State([1, 2, 3]), 3, GREEDY, None)
    assert d.feeds[0] == [1, 2, 3] and [len(f) for f in d.feeds[1:]] == [1, 1] and len(d.cached) == 5
    drafted = d.cached[3:]
    # the first draft accepted, the second replaced by 9: the cache keeps [1, 2, 3, d1] and is fed 9
    d.feeds = []
    p = d.propose(State([1, 2, 3, drafted[0], 9]), 1, T1, torch.Generator().manual_seed(0))
    assert d.feeds == [[9]] and d.cached == [1, 2, 3, drafted[0], 9]
    torch.testing.assert_close(p.q[0], torch.softmax(full_logits(draft, [1, 2, 3, drafted[0], 9]), -1), rtol=1e-4, atol=1e-6)
    # the same context again: everything is cached, but the last token's logits are needed: it is fed again
    d.feeds = []
    p = d.propose(State([1, 2, 3, drafted[0], 9]), 1, T1, torch.Generator().manual_seed(0))
    assert d.feeds == [[9]]
    torch.testing.assert_close(p.q[0], torch.softmax(full_logits(draft, [1, 2, 3, drafted[0], 9]), -1), rtol=1e-4, atol=1e-6)
    # rewound to a new conversation that shares only the first token
    d.feeds = []
    p = d.propose(State([1, 8, 8]), 2, T1, torch.Generator().manual_seed(0))
    assert d.feeds == [[8, 8], [int(p.ids[0])]] and d.cached == [1, 8, 8, int(p.ids[0])]
    torch.testing.assert_close(p.q[0], torch.softmax(full_logits(draft, [1, 8, 8]), -1), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(p.q[1], torch.softmax(full_logits(draft, [1, 8, 8, int(p.ids[0])]), -1), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("path", ["hf", "lean"])
def test_reset_empties_the_cache(draft, path):
    d = Feeds(draft, lean=lean_runner(draft) if path == "lean" else None)
    d.feeds = []
    d.propose(State([1, 2, 3]), 2, GREEDY, None)
    d.reset()
    assert d.cached == []
    d.feeds = []
    p = d.propose(State([1, 2, 3, 4]), 1, T1, torch.Generator().manual_seed(0))
    assert d.feeds == [[1, 2, 3, 4]]
    torch.testing.assert_close(p.q[0], torch.softmax(full_logits(draft, [1, 2, 3, 4]), -1), rtol=1e-4, atol=1e-6)


def test_crop_cuts_the_cache_to_a_length(draft):
    for d in drafters(draft).values():
        d.propose(State([1, 2, 3, 4, 5]), 1, GREEDY, None)
        d.crop(2)
        length = d.cache.layers[0].get_seq_length() if d.lean is None else d.cache.lengths[0]
        assert length == 2


# ---------------------------------------------------------------- confidence stop (p_min)


def test_p_min_stops_before_a_draft_less_likely_than_it(draft):
    tokens = [2, 4, 6]
    free = ModelDrafter(draft).propose(State(tokens), 4, T1, torch.Generator().manual_seed(3))
    tops = [float(q.max()) for q in free.q]
    d = ModelDrafter(draft)
    d.p_min = tops[0]  # exactly the first draft's top probability: not below it, kept
    kept = d.propose(State(tokens), 4, T1, torch.Generator().manual_seed(3))
    n = next((i for i, t in enumerate(tops) if t < tops[0]), 4)  # the first position below it stops the block
    assert kept.ids.tolist() == free.ids.tolist()[:n] and kept.calls == min(n + 1, 4)
    d.p_min = 1.0  # nothing is that sure: no drafts, one forward spent
    none = d.propose(State(tokens), 4, T1, torch.Generator().manual_seed(3))
    assert none.ids.numel() == 0 and none.ids.dtype == torch.long and none.q is None and none.calls == 1


def test_sampled_p_min_judges_q_after_temperature_and_top_k(draft):
    """At T = 0.5 and top-k 3 q is sharper than the softmax of the raw logits: p_min between the two keeps the
    draft (it is drawn from q, and q is that sure of its top token)."""
    params = SamplingParams(0.5, top_k=3)
    logits = full_logits(draft, [2, 4, 6])
    raw, warped = float(torch.softmax(logits, -1).max()), float(torch.softmax((logits / 0.5).topk(3).values, -1).max())
    assert raw + 0.05 < warped
    d = ModelDrafter(draft)
    d.p_min = (raw + warped) / 2
    assert d.propose(State([2, 4, 6]), 1, params, torch.Generator().manual_seed(0)).ids.numel() == 1
    d.p_min = warped + 0.01
    assert d.propose(State([2, 4, 6]), 1, params, torch.Generator().manual_seed(0)).ids.numel() == 0


def test_greedy_p_min_judges_the_softmax_not_the_one_hot(draft):
    top = float(torch.softmax(full_logits(draft, [2, 4, 6]), -1).max())
    assert top < 0.9  # a flat draft
    d = ModelDrafter(draft)
    d.p_min = 0.9
    assert d.propose(State([2, 4, 6]), 3, GREEDY, None).ids.numel() == 0
    d.p_min = top / 2
    assert d.propose(State([2, 4, 6]), 1, GREEDY, None).ids.numel() == 1


# ---------------------------------------------------------------- a restricted vocabulary (--draft-vocab)


def restricted_model():
    model = tiny_llama(seed=3, layers=1, sharpen=1.0).requires_grad_(False)
    model.config.eos_token_id = 10
    model.generation_config.eos_token_id = [11, 12, 5, 3, 10]
    return model


def test_the_restricted_ids_are_the_lowest_n_and_the_end_ids_above_them():
    model = restricted_model()
    d = ModelDrafter(model, lean=lean_runner(model), vocab=5)
    # 3 is already among the lowest 5; 5 (= N) is added; 12 is beyond the draft's table
    assert d.vocab_ids.tolist() == [0, 1, 2, 3, 4, 5, 10, 11]
    assert torch.equal(d.head_w, model.lm_head.weight[[0, 1, 2, 3, 4, 5, 10, 11]])
    model.generation_config.eos_token_id = None
    assert ModelDrafter(model, lean=lean_runner(model), vocab=5).vocab_ids.tolist() == [0, 1, 2, 3, 4, 10]
    model.generation_config.eos_token_id = 7
    assert ModelDrafter(model, lean=lean_runner(model), vocab=5).vocab_ids.tolist() == [0, 1, 2, 3, 4, 7, 10]


def test_a_generation_config_without_end_ids():
    model = restricted_model()
    model.generation_config = type("Bare", (), {})()  # no eos_token_id attribute at all
    assert ModelDrafter(model, lean=lean_runner(model), vocab=5).vocab_ids.tolist() == [0, 1, 2, 3, 4, 10]


@pytest.mark.parametrize("vocab, ok", [(0, False), (1, True), (V - 1, True), (V, False), (-3, False)])
def test_the_restricted_vocabulary_must_leave_something_out(vocab, ok):
    model = tiny_llama(seed=3, layers=1)
    if ok:
        assert len(ModelDrafter(model, lean=lean_runner(model), vocab=vocab).vocab_ids) == vocab
    else:
        with pytest.raises(ModeUnavailable, match=rf"^--draft-vocab {vocab}: the draft has {V} tokens; choose 1..{V - 1}$"):
            ModelDrafter(model, lean=lean_runner(model), vocab=vocab)


def test_a_restricted_q_is_the_softmax_over_its_ids_and_zero_elsewhere():
    model = restricted_model()
    d = ModelDrafter(model, lean=lean_runner(model), vocab=5)
    p = d.propose(State([1, 2, 3]), 2, T1, torch.Generator().manual_seed(0))
    allowed = [0, 1, 2, 3, 4, 5, 10, 11]
    context = [1, 2, 3]
    for j, token in enumerate(p.ids.tolist()):
        logits = full_logits(model, context)
        expected = torch.zeros(V)
        expected[allowed] = torch.softmax(logits[allowed], -1)
        torch.testing.assert_close(p.q[j], expected, rtol=1e-4, atol=1e-6)
        assert token in allowed
        context.append(token)


def test_a_restricted_id_the_target_cannot_emit_is_never_proposed():
    """A target vocabulary of 10: the end ids 10 and 11 are dropped from the restricted head's scores."""
    model = restricted_model()
    d = ModelDrafter(model, lean=lean_runner(model), vocab=5)
    logits = d.next_logits([1, 2, 3], 10)
    assert logits.shape == (10,)
    allowed = [0, 1, 2, 3, 4, 5]
    torch.testing.assert_close(logits[allowed], full_logits(model, [1, 2, 3])[allowed], rtol=1e-4, atol=1e-5)
    assert torch.isinf(logits[[6, 7, 8, 9]]).all() and (logits[[6, 7, 8, 9]] < 0).all()


def test_a_larger_draft_table_is_cut_to_the_target_vocabulary(draft):
    for d in drafters(draft).values():
        p = d.propose(State([1, 2, 3], vocab_size=8), 3, T1, torch.Generator().manual_seed(0))
        assert p.q.shape == (3, 8) and p.ids.max() < 8
        full = torch.softmax(full_logits(draft, [1, 2, 3])[:8], -1)
        torch.testing.assert_close(p.q[0], full, rtol=1e-4, atol=1e-6)


def test_a_head_the_restriction_cannot_take_is_refused_in_one_line():
    from specchat.engine.smallbatch import Int8Weights

    model = tiny_llama(seed=3, layers=1)
    lean = lean_runner(model)
    int8 = lean.with_matrices(lean.blocks, Int8Weights.of(lean.head_w))
    with pytest.raises(ModeUnavailable, match=r"^--draft-vocab 5: an LM head of Int8Weights cannot be restricted$"):
        ModelDrafter(model, lean=int8, vocab=5)
