"""A draft whose embedding table is smaller than the target's (models sharing a tokenizer, padded differently)."""

import torch

from helpers import exact_joint, run, sample_joint, tiny_llama
from specchat.engine import SamplingParams
from specchat.engine.drafters.model import ModelDrafter
from specchat.verify import goodness_of_fit

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


def test_output_still_follows_the_target_distribution():
    target, draft = pair()
    params = SamplingParams(1.0)
    counts = sample_joint(target, ModelDrafter(draft), params, k=2, draws=3000, length=3, seed=5)
    exact = exact_joint(target, PROMPT, params, 3)
    assert sum(p for ids, p in exact.items() if any(t >= 36 for t in ids)) > 0.05  # the beyond-table ids matter
    assert goodness_of_fit(counts, exact).passed(1e-3)


def test_a_larger_draft_table_is_cut_to_the_target_vocabulary():
    target, draft = tiny_llama(seed=0, layers=2, vocab=36), tiny_llama(seed=1, layers=1, vocab=40)
    out, records = run(target, ModelDrafter(draft), PROMPT, k=3, params=SamplingParams(1.0), max_new_tokens=60)
    assert len(out) == 60 and max(out) < 36
    assert all(r.drafted == 0 or max(i for i in [t.id for t in r.tokens] + r.rejected) < 36 for r in records)
    ref = target.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=30, min_new_tokens=30)
    greedy, _ = run(target, ModelDrafter(draft), PROMPT, k=3, params=SamplingParams(0), max_new_tokens=30)
    assert greedy == ref[0, len(PROMPT):].tolist()
