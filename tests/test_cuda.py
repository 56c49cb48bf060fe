"""The CUDA path (skipped without a CUDA device; benchmarks/gpu_check.sh runs it on a GPU machine): the lean
runner and mode head on CUDA give plain greedy decoding's tokens, in float32 and bfloat16, and HF generate's in
float32; sampling with a CUDA generator is reproducible."""

import pytest
import torch

from support.models import tiny_llama
from specchat.engine.drafters.head import HeadDrafter
from specchat.engine.drafters.model import ModelDrafter
from specchat.engine.drafters.plain import PlainDecoding
from specchat.engine.loop import Controls, generate
from specchat.engine.sampling import SamplingParams
from specchat.engine.target import TargetState
from support.models import random_head

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def tokens(target, drafter, params, n=100, seed=0):
    state = TargetState(target)
    generator = torch.Generator(device=state.device).manual_seed(seed)
    controls = Controls(drafter, k=4, sampling=params)
    records = list(generate(state, PROMPT, controls, max_new_tokens=n, eos_ids=set(), generator=generator))
    assert state.runner == "lean"
    return [t.id for r in records for t in r.tokens]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_identity_on_cuda(dtype):
    target = tiny_llama(seed=0, layers=2).to("cuda", dtype)
    draft = tiny_llama(seed=1, layers=1).to("cuda", dtype)
    plain = tokens(target, PlainDecoding(), SamplingParams(0))
    assert tokens(target, ModelDrafter(draft), SamplingParams(0)) == plain
    head = random_head(target).to("cuda", dtype)
    assert tokens(target, HeadDrafter(head, target), SamplingParams(0)) == plain
    if dtype == torch.float32:
        ref = target.generate(torch.tensor([PROMPT], device="cuda"), do_sample=False, max_new_tokens=100, min_new_tokens=100)
        assert plain == ref[0, len(PROMPT):].tolist()


def test_sampling_on_cuda_is_reproducible():
    target = tiny_llama(seed=0, layers=2).to("cuda")
    head = random_head(target).to("cuda")
    a = tokens(target, HeadDrafter(head, target), SamplingParams(1.0), seed=7)
    assert a == tokens(target, HeadDrafter(head, target), SamplingParams(1.0), seed=7)
