"""Mode `lookup`: n-gram drafts from the conversation, one-hot q. Greedy identity, exact sampling, broken-rule control."""

import pytest
import torch

from helpers import tiny_llama
from specchat.engine import Controls, SamplingParams, TargetState
from specchat.engine.drafters import build_drafter
from specchat.engine.drafters.lookup import LookupDrafter
from specchat.verify import goodness_of_fit, sample_continuations
from helpers import ALPHA, ResampleFromP, exact_joint, run

# "1 2" occurs earlier, followed by "3 1 2 ...": lookup drafts from the first round on
REPEATING = [1, 2, 3, 1, 2]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, layers=2).requires_grad_(False)


class Tokens:
    def __init__(self, tokens):
        self.tokens, self.device = tokens, torch.device("cpu")


def test_proposes_the_continuation_of_the_latest_longest_match():
    d = LookupDrafter(max_ngram=3, min_ngram=1)
    # "5 6" occurs twice; the latest occurrence (followed by 9) wins; a 3-gram "4 5 6" beats both
    assert d.propose(Tokens([5, 6, 7, 5, 6, 9, 8, 5, 6]), 3, None, None).ids.tolist() == [9, 8, 5]
    assert d.propose(Tokens([4, 5, 6, 1, 5, 6, 9, 4, 5, 6]), 2, None, None).ids.tolist() == [1, 5]
    assert d.propose(Tokens([1, 2, 3]), 4, None, None).ids.numel() == 0  # no match: no drafts
    assert d.propose(Tokens([7, 1, 7]), 4, None, None).ids.tolist() == [1, 7]  # fewer than K near the end
    # the conversation was rewound (a new chat): the index is rebuilt, never stale
    assert d.propose(Tokens([2, 8, 2]), 4, None, None).ids.tolist() == [8, 2]
    assert LookupDrafter(max_ngram=2, min_ngram=2).propose(Tokens([7, 1, 7]), 4, None, None).ids.numel() == 0


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_matches_hf_generate(target, k):
    ref = target.generate(torch.tensor([REPEATING]), do_sample=False, max_new_tokens=40, min_new_tokens=40)
    out, records = run(target, build_drafter("lookup", target), REPEATING, k=k, params=SamplingParams(0), max_new_tokens=40)
    assert out == ref[0, len(REPEATING):].tolist()
    assert sum(r.accepted for r in records) > 0
    assert k == 1 or sum(r.drafted - r.accepted for r in records) > 0  # and some drafts were rejected
    assert all(r.draft_calls == 0 for r in records)  # no model


def sample_lookup(target, params, *, rule=None, draws=1500, length=2, k=3):
    controls = Controls(LookupDrafter(), k=k, sampling=params, **({"rule": rule} if rule else {}))
    g = torch.Generator().manual_seed(0)
    return sample_continuations(TargetState(target), REPEATING, controls, draws=draws, length=length, eos_ids=set(), generator=g)


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=5)], ids=["t1", "t0.7-topk5"])
def test_sampled_output_matches_target_distribution(target, params):
    result = goodness_of_fit(sample_lookup(target, params, draws=1000), exact_joint(target, REPEATING, params, 2))
    assert result.passed(ALPHA), result


def test_distribution_test_catches_a_broken_rule_with_one_hot_q(target):
    """Resampling from p (not p with the draft removed) after a rejected one-hot draft must fail."""
    params = SamplingParams(1.0)
    result = goodness_of_fit(sample_lookup(target, params, rule=ResampleFromP()), exact_joint(target, REPEATING, params, 2))
    assert not result.passed(ALPHA), result


@pytest.mark.slow
def test_default_model_greedy_matches_hf_generate():
    from helpers import SMOL_PROMPTS, chat_ids
    from specchat.engine import generate
    from specchat.models import load_model

    smol = load_model(None, torch.device("cpu"), torch.float32)
    eos = smol.model.generation_config.eos_token_id
    accepted = 0
    for text in [*SMOL_PROMPTS, "Repeat after me: the quick brown fox jumps over the lazy dog."]:
        prompt = chat_ids(smol, text)
        ref = smol.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32)  # stops at EOS
        controls = Controls(build_drafter("lookup", smol.model), k=4, sampling=SamplingParams(0))
        records = list(generate(TargetState(smol.model), prompt, controls, max_new_tokens=32, eos_ids={eos}))
        assert [t.id for r in records for t in r.tokens] == ref[0, len(prompt):].tolist(), text
        accepted += sum(r.accepted for r in records)
    assert accepted > 0
