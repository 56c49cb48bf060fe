"""The real default model (SmolLM2-135M-Instruct from the embedded GGUF): greedy identity, rollback, EOS."""

import copy

import pytest
import torch

from specchat.engine.cache import forward_logits, new_cache
from specchat.engine.drafters.model import ModelDrafter
from specchat.engine.loop import Controls, generate
from specchat.engine.sampling import SamplingParams
from specchat.engine.target import TargetState
from specchat.models import load_model

PROMPTS = ["Write a haiku about rain", "What is the capital of France?", "Write a Python function that reverses a list."]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def noisy_draft(smol):
    """The target's first 8 of 30 layers with noise on their weights: a smaller draft sharing the tokenizer that
    disagrees often, so rejections and rollbacks happen (with the whole noisy model the 40-token tests took 1.4x
    as long)."""
    draft = copy.deepcopy(smol.model)
    draft.model.layers = draft.model.layers[:8]
    draft.config.num_hidden_layers = 8
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3 * p.std())
    return draft


def chat_ids(smol, text):
    return list(smol.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False))


def eos_ids(smol):
    return {smol.model.generation_config.eos_token_id}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_draft_mode_matches_hf_generate(smol, smol_greedy, noisy_draft, prompt):
    ids = chat_ids(smol, prompt)
    ref = smol_greedy(ids, 40)
    state = TargetState(smol.model)
    controls = Controls(ModelDrafter.build(smol.model, noisy_draft), k=4, sampling=SamplingParams(0))  # mode draft's path: lean
    records = list(generate(state, ids, controls, max_new_tokens=40, eos_ids=eos_ids(smol)))
    assert [t.id for r in records for t in r.tokens] == ref
    assert any(r.accepted < r.drafted for r in records)  # the noisy draft was rejected somewhere


def test_bf16_draft_of_fp32_target(smol, smol_greedy):
    draft = load_model(None, torch.device("cpu"), torch.bfloat16).model
    ids = chat_ids(smol, PROMPTS[0])
    ref = smol_greedy(ids, 32)
    records = list(generate(TargetState(smol.model), ids, Controls(ModelDrafter(draft), k=6, sampling=SamplingParams(0)), max_new_tokens=32, eos_ids=eos_ids(smol)))
    assert [t.id for r in records for t in r.tokens] == ref
    assert sum(r.accepted for r in records) > 0.5 * sum(r.drafted for r in records)  # measured 26 of 34 at K=6


def test_cache_rollback_after_sampled_rejections(smol, noisy_draft):
    state = TargetState(smol.model)
    controls = Controls(ModelDrafter.build(smol.model, noisy_draft), k=5, sampling=SamplingParams(1.0, top_p=0.9))
    records = list(generate(state, chat_ids(smol, PROMPTS[1]), controls, max_new_tokens=30, eos_ids=set(), generator=torch.Generator().manual_seed(0)))
    assert sum(r.drafted - r.accepted for r in records) > 5
    assert state.cache.get_seq_length() == len(state.tokens) - 1
    cached = state.verify([])[-1]
    fresh = forward_logits(smol.model, new_cache(smol.model), state.tokens, keep=1)[-1]
    torch.testing.assert_close(cached, fresh, rtol=1e-3, atol=1e-3)


def test_eos_ends_generation_like_hf(smol, noisy_draft):
    ids = chat_ids(smol, "Say just the word: hello")
    ref = smol.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64)[0, len(ids) :].tolist()
    assert ref[-1] in eos_ids(smol) and len(ref) < 64  # the reference stopped at EOS
    records = list(generate(TargetState(smol.model), ids, Controls(ModelDrafter(noisy_draft), k=4, sampling=SamplingParams(0)), max_new_tokens=64, eos_ids=eos_ids(smol)))
    assert [t.id for r in records for t in r.tokens] == ref
    assert records[-1].stop_reason == "eos"
