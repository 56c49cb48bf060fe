"""A tiny Llama + word-level tokenizer saved as a model directory, so the CLI can load it like a real model.

Used by CLI tests (bench, generate, ...) that need `--target DIR` to run end to end in seconds.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<unk>", "<eos>", "<user>", "<assistant>", "<system>"]
WORDS = (
    "the a an and or of to in on is are was it this that for with as be by at from not you i we they "
    "hello world rain cat dog code python def return print list sort write story short text summary "
    ". , ! ? : ( ) = + - 0 1 2 3"
).split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Whitespace-split words; anything else is <unk>. Decoding joins tokens with spaces."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_model_dir(path: Path, *, seed: int = 0, layers: int = 2, hidden: int = 32) -> Path:
    """Save a randomly initialised tiny Llama and its tokenizer to `path` (created) and return it."""
    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peaked distributions, like a real model's
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
