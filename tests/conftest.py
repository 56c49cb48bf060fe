import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import pytest
import torch

# One intra-op thread: the tiny models gain nothing from two, and on a machine shared with other work
# two OpenMP threads spin-wait for each other (measured: a SmolLM2 step 20x slower under load).
torch.set_num_threads(1)
from transformers import LlamaConfig, LlamaForCausalLM

TINY_VOCAB = 12


def tiny_llama(seed: int, layers: int = 1, vocab: int = TINY_VOCAB, sharpen: float = 4.0, **overrides):
    """A randomly initialised Llama small enough for thousands of draws; `sharpen` scales the LM head
    so its distributions are peaked like a real model's (near-uniform ones would hide a bias)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        **overrides,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_llama(seed=0, layers=2)


@pytest.fixture(scope="session")
def tiny_draft():
    """A different random model over the same vocabulary: it disagrees with the target often."""
    return tiny_llama(seed=1, layers=1)
