"""Shared by the layerskip / earlyexit / tune tests: tiny multi-layer targets, one thread, the default model."""

import pytest
import torch

from conftest import tiny_llama


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models are ~25x faster on one thread on this shared 2-core machine (OpenMP spin-waits)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def deep_target():
    """Four layers, so there is something to skip and somewhere to exit. With the default init each layer
    changes little, so drafts mostly agree (greedy: full blocks and bonuses as well as rejections)."""
    return tiny_llama(seed=0, layers=4).requires_grad_(False)  # as load_model leaves a model


@pytest.fixture(scope="module")
def rough_target():
    """Four layers with a 5x larger init: each layer matters, drafts disagree (sampled acceptance ~0.25-0.6),
    so the distribution tests see many residual draws and the broken-rule control fails clearly."""
    return tiny_llama(seed=0, layers=4, initializer_range=0.1).requires_grad_(False)


@pytest.fixture(scope="module")
def smol():
    from specchat.models import load_model

    return load_model(None, torch.device("cpu"), torch.float32)


def chat_ids(smol, text):
    return list(smol.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False))


SMOL_PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a list."]
