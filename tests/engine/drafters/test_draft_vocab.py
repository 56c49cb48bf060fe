"""A draft whose embedding table is smaller than the target's (models sharing a tokenizer, padded differently)."""

import copy

import pytest
import torch

from support.models import tiny_llama
from support.exact import assert_verdict, fit_to_target, run, sample_and_fit, sample_joint
from support.broken import ReportsWrongQ
from specchat.engine.drafters.model import ModelDrafter
from specchat.engine.metrics import Stats
from specchat.engine.runner import lean_runner
from specchat.engine.sampling import SamplingParams
from specchat.engine.target import TargetState

PROMPT = [1, 2, 3]


def pair():
    """Target vocabulary 40, draft 36: the target can emit ids 36..39, which the draft cannot embed."""
    return tiny_llama(seed=0, layers=2, vocab=40, sharpen=1.0), tiny_llama(seed=1, layers=1, vocab=36, sharpen=1.0)


def test_target_ids_beyond_the_draft_table_do_not_crash_and_are_never_proposed():
    target, draft = pair()
    out, records = run(target, ModelDrafter(draft), PROMPT, k=4, params=SamplingParams(1.0), max_new_tokens=120)  # the context holds 128
    assert len(out) == 120
    assert any(t >= 36 for t in out)  # the case that used to raise IndexError in the draft's embedding
    proposed = [t.id for r in records for t in r.tokens if t.kind == "accepted"] + [i for r in records for i in r.rejected]
    assert proposed and max(proposed) < 36


def padded_pair():
    """The target (vocabulary 40) and the same model with its embedding and LM head cut to 36 rows, as a model
    padded differently: the draft agrees with the target (~0.7-0.9 per draft position), so draft position K is
    reached and judged often, except that it never proposes ids 36..39 and is fed a stand-in for them. (The
    random pair above is nearly uniform over 40 ids: no wrong q could show there.)"""
    target = tiny_llama(seed=0, layers=2, vocab=40)
    draft = copy.deepcopy(target)
    draft.resize_token_embeddings(36)
    assert draft.get_input_embeddings().num_embeddings == 36 and draft.lm_head.out_features == 36
    return target.requires_grad_(False), draft.requires_grad_(False)


@pytest.mark.parametrize("bug", [None, "q at the wrong temperature from position 3"])
@pytest.mark.slow
def test_output_still_follows_the_target_distribution(record_property, bug):
    """K=3 with draws of K+1 tokens, position by position; the control must fail at the same settings (measured
    p = 1.4e-18 at 1500 draws, 1.9e-13 at 1000, at position 3). The draft runs on the lean runner, as mode draft
    runs it (through HF's forward the draws took 1.6x as long; test_exactness.py tests that path)."""
    target, draft = padded_pair()
    params = SamplingParams(1.0)
    drafter = ModelDrafter(draft, lean=lean_runner(draft))
    if bug:
        drafter = ReportsWrongQ(drafter, position=3, factor=0.25)
    stats = Stats()
    counts = sample_joint(target, drafter, params, k=3, draws=1000, length=4, generated=4, seed=5, stats=stats)
    # ids the draft cannot embed come up before the last token in many draws: the next round feeds the stand-in
    assert sum(c for seq, c in counts.items() if any(t >= 36 for t in seq[:3])) > 0.05 * 1000
    assert_verdict(fit_to_target(target, counts, params, 4), stats, 3, bug, record_property)


def test_a_larger_draft_table_is_cut_to_the_target_vocabulary():
    target, draft = tiny_llama(seed=0, layers=2, vocab=36), tiny_llama(seed=1, layers=1, vocab=40)
    out, records = run(target, ModelDrafter(draft), PROMPT, k=3, params=SamplingParams(1.0), max_new_tokens=60)
    assert len(out) == 60 and max(out) < 36
    assert all(r.drafted == 0 or max(i for i in [t.id for t in r.tokens] + r.rejected) < 36 for r in records)
    ref = target.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=30, min_new_tokens=30)
    greedy, _ = run(target, ModelDrafter(draft), PROMPT, k=3, params=SamplingParams(0), max_new_tokens=30)
    assert greedy == ref[0, len(PROMPT):].tolist()


# ---------------------------------------------------------------- mode draft on the lean runner, --draft-vocab


def test_the_lean_draft_proposes_what_hf_s_forward_does():
    """On the lean runner with the draft's own float32 weights: HF's forward. Mode draft's own build streams
    bfloat16 copies of the matrices on the CPU (Runner.streamed): q moves by their rounding only."""
    target, draft = tiny_llama(seed=0, layers=2, vocab=40), tiny_llama(seed=1, layers=2, vocab=40)
    lean, hf, built = ModelDrafter(draft, lean=lean_runner(draft)), ModelDrafter(draft), ModelDrafter.build(target, draft)
    assert lean.lean is not None and hf.lean is None
    assert built.lean.blocks[0].gate_up_w.dtype == torch.bfloat16 and built.lean.head_w.dtype == torch.bfloat16
    assert lean.lean.blocks[0].gate_up_w.dtype == torch.float32  # the model's own weights are untouched
    state = TargetState(target)
    state.start(PROMPT + [7, 8, 9])
    a = lean.propose(state, 4, SamplingParams(1.0), torch.Generator().manual_seed(0))
    b = hf.propose(state, 4, SamplingParams(1.0), torch.Generator().manual_seed(0))
    assert a.ids.tolist() == b.ids.tolist()
    torch.testing.assert_close(a.q, b.q, rtol=1e-4, atol=1e-6)
    first = built.propose(state, 1, SamplingParams(1.0), torch.Generator().manual_seed(0))
    assert not torch.equal(first.q[0], a.q[0])
    torch.testing.assert_close(first.q[0], a.q[0], rtol=0, atol=0.02)


def restricted_pair(vocab: int = 30):
    """The target (vocabulary 40) drafted by itself with its LM head restricted to ids < `vocab`: it agrees
    wherever the target's choice lies there."""
    target = tiny_llama(seed=0, layers=2, vocab=40).requires_grad_(False)
    return target, ModelDrafter.build(target, copy.deepcopy(target), draft_vocab=vocab)


def test_a_restricted_draft_vocabulary_is_what_q_says():
    target, drafter = restricted_pair()
    allowed = set(drafter.vocab_ids.tolist())
    assert set(range(30)) <= allowed and drafter.head_w.shape[0] == len(allowed) < 40
    out, records = run(target, drafter, PROMPT, k=4, params=SamplingParams(1.0), max_new_tokens=100)
    proposed = [t.id for r in records for t in r.tokens if t.kind == "accepted"] + [i for r in records for i in r.rejected]
    assert proposed and set(proposed) <= allowed
    assert any(t not in allowed for t in out)  # the target still emits every id (from the residual or the bonus)
    state = TargetState(target)
    state.start(PROMPT)
    q = drafter.propose(state, 3, SamplingParams(1.0), torch.Generator().manual_seed(0)).q  # [3, 40]
    outside = torch.tensor([i not in allowed for i in range(40)])
    assert (q[:, outside] == 0).all() and torch.allclose(q.sum(-1), torch.ones(3))
    greedy, _ = run(target, drafter, PROMPT, k=4, params=SamplingParams(0), max_new_tokens=60)
    plain = target.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=60, min_new_tokens=60)
    assert greedy == plain[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("bug", [None, "q at the wrong temperature from position 3"])
@pytest.mark.slow
def test_a_restricted_draft_keeps_the_target_distribution(record_property, bug):
    """K=3 with draws of K+1 tokens, position by position; the control must fail at the same settings (measured
    p = 4.6e-11 at 1000 draws, at position 3)."""
    target, drafter = restricted_pair()
    if bug:
        drafter = ReportsWrongQ(drafter, position=3, factor=0.25)
    fit, stats = sample_and_fit(target, drafter, SamplingParams(1.0), k=3, draws=1000, seed=5)
    assert_verdict(fit, stats, 3, bug, record_property)


def test_draft_vocab_out_of_range_is_refused():
    from specchat.engine.drafters import ModeUnavailable

    target = tiny_llama(seed=0, layers=2, vocab=40)
    with pytest.raises(ModeUnavailable, match="choose 1..39"):
        ModelDrafter.build(target, copy.deepcopy(target), draft_vocab=40)
