"""Tiny models for the tests: random Llamas small enough for thousands of draws, a random draft head, a word-level
tokenizer and a saved model folder, and a bigram table a ModelDrafter can run."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specchat.engine.cache import forward_logits, new_cache
from specchat.engine.drafters.head import DraftHead, head_spec
from specchat.engine.runner import lean_runner


TINY_VOCAB = 12


def tiny_llama(seed: int, layers: int = 1, vocab: int = TINY_VOCAB, sharpen: float = 4.0, **overrides):
    """A randomly initialised Llama small enough for thousands of draws; `sharpen` scales the LM head
    so its distributions are peaked like a real model's (near-uniform ones would hide a bias)."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{
        "vocab_size": vocab, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": layers, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 128, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": None, "tie_word_embeddings": False, **overrides,
    })
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model


HEAD_LEFT_OUT = [2, 7]  # tokens a random head cannot draft (the target can still emit them)


def random_head(target, seed: int = 5, left_out=HEAD_LEFT_OUT, norm_std: float | None = None) -> DraftHead:
    """An untrained head with peaked, arbitrary distributions over all tokens but `left_out`; with `norm_std` its
    1-D parameters (norm weights, biases) are drawn from N(1, norm_std) too, else they keep their initial values."""
    runner = lean_runner(target)
    vocab = [t for t in range(runner.vocab_size) if t not in left_out]
    head = DraftHead(head_spec(runner, target.config), len(vocab))
    head.vocab.copy_(torch.tensor(vocab))
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5)
            elif norm_std is not None:
                p.normal_(1, norm_std)
    return head.requires_grad_(False)


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


def tiny_model_dir(path: Path, *, seed: int = 0, layers: int = 2, hidden: int = 32, sharpen: float = 4.0) -> Path:
    """Save a randomly initialised tiny Llama and its tokenizer to `path` (created) and return it. `sharpen`
    scales the LM head (larger: more peaked next-token distributions, where a wrong rule shows sooner)."""
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
        model.lm_head.weight.mul_(sharpen)  # peaked distributions, like a real model's
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class TableLM(torch.nn.Module):
    """A bigram language model that ModelDrafter can run: the next-token logits depend only on the last token
    (a [V, V] table) and it keeps no KV cache. A draft costs a table look-up instead of a transformer forward,
    so a test can afford thousands of draws per run."""

    def __init__(self, table: torch.Tensor, config) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table.float(), requires_grad=False)  # [V, V]
        self.config = config  # the target's: new_cache() builds an (unused) cache from it
        self.embed = torch.nn.Embedding(table.shape[0], 1)  # ModelDrafter reads only num_embeddings

    @property
    def device(self) -> torch.device:
        return self.table.device

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, logits_to_keep: int = 1, **kwargs):
        return SimpleNamespace(logits=self.table[input_ids[:, -logits_to_keep:]])  # [1, keep, V]


def bigram_draft(target, scale: float = 0.5) -> TableLM:
    """A draft that agrees with `target` only roughly: the target's logits after each single token (the rest
    of the context ignored), times `scale` (< 1: a less confident draft, as small drafts are)."""
    vocab = target.config.vocab_size
    table = torch.stack([forward_logits(target, new_cache(target), [t], keep=1)[-1] for t in range(vocab)])  # [V, V]
    return TableLM(table * scale, target.config)


def counting(state) -> list[int]:
    """Record how many positions each lean forward of a TargetState feeds (through `run`, or in one C call:
    forward_into)."""
    fed, run, forward_into = [], state.lean.run, state.lean.forward_into
    state.lean.run = lambda hidden, layers, cache, past: fed.append(hidden.shape[1]) or run(hidden, layers, cache, past)

    def counted(ids, *args):
        logits = forward_into(ids, *args)
        fed.extend([len(ids)] if logits is not None else [])
        return logits

    state.lean.forward_into = counted
    return fed
