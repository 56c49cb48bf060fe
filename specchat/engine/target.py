"""The target model's state between rounds: its KV cache and the tokens the cache covers."""

from __future__ import annotations

import torch

from specchat.engine.cache import common_prefix, crop_to, forward_logits, new_cache
from specchat.engine.runner import Runner, lean_runner


class TargetState:
    """The target model, its KV cache and the tokens the cache covers.

    Invariant between rounds: the cache holds `tokens[:-1]`; the last token is pending and is fed as
    the first position of the next verify forward. Keeping it across generations lets a chat reuse
    the cache of the conversation prefix.

    One exception, right after a `start` that prefilled: the prefill fed the whole prompt, so the cache
    also holds the last token and `head` keeps that position's logits [1, V]. The first verify then feeds only the
    drafts and prepends `head` (plain decoding's first token costs no forward at all). `past` is the
    number of positions the cache holds either way; `commit` and `rewind` return to the invariant.

    `runner` says which forward runs the target: "lean" (engine/runner.py, for the Llama, Qwen2, Qwen3
    and Mistral families) or "hf" (the model's own forward, every other model). `lean` is the Runner
    (None on the HF path); self-speculative drafters that share `cache` run its per-layer entry points.
    """

    def __init__(self, model, runner: str = "auto") -> None:
        if runner not in ("auto", "lean", "hf"):
            raise ValueError(f"runner must be auto, lean or hf, not {runner!r}")
        self.model = model
        self.lean: Runner | None = lean_runner(model) if runner != "hf" else None
        if runner == "lean" and self.lean is None:
            raise ValueError(f"the lean runner does not support {type(model).__name__}")
        self.runner = "lean" if self.lean is not None else "hf"
        self.cache = self.lean.new_cache() if self.lean is not None else new_cache(model)
        self.tokens: list[int] = []
        self.head: torch.Tensor | None = None  # [1, V]: logits of tokens[-1] when the cache holds it too
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.context_len: int | None = getattr(model.config, "max_position_embeddings", None)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def past(self) -> int:
        """Positions the cache holds: len(tokens) - 1 between rounds, len(tokens) after a prefill."""
        return max(len(self.tokens) - (0 if self.head is not None else 1), 0)

    def forward(self, ids: list[int], past: int, keep: int) -> torch.Tensor:
        """Feed `ids` at positions past.. (anything cached beyond `past` is dropped first); logits [keep, V]."""
        crop_to(self.cache, past)
        if self.lean is not None:
            return self.lean.step(ids, self.cache, past, keep)
        return forward_logits(self.model, self.cache, ids, keep=keep)

    def start(self, tokens: list[int]) -> int:
        """Make the state cover `tokens` with one forward, reusing the cached common prefix; returns
        positions prefilled (the prompt after the reused prefix, its last token included). When only the
        last token is missing (a prompt the cache already covers) nothing runs: it stays pending."""
        if self.head is not None and tokens == self.tokens:
            return 0
        keep = max(min(common_prefix(self.tokens, tokens), len(tokens) - 1, self.past), 0)
        self.tokens = list(tokens)
        self.head = None
        crop_to(self.cache, keep)
        if keep >= len(tokens) - 1:  # all cached but the last token: leave it pending, the first verify feeds it
            return 0
        self.head = self.forward(self.tokens[keep:], keep, keep=1)  # [1, V]
        return len(tokens) - keep

    def verify(self, draft_ids: list[int]) -> torch.Tensor:
        """Target logits for the pending token followed by the drafts: [K+1, V]."""
        if self.head is not None:  # the last token's logits came with the prefill: feed the drafts only
            if not draft_ids:
                return self.head
            return torch.cat([self.head, self.forward(draft_ids, len(self.tokens), keep=len(draft_ids))])
        return self.forward([self.tokens[-1], *draft_ids], len(self.tokens) - 1, keep=len(draft_ids) + 1)

    def rewind(self) -> None:
        """Back to the between-rounds invariant (the cache holds tokens[:-1]), dropping `head`: for a
        drafter that feeds the pending token itself (earlyexit)."""
        self.head = None
        crop_to(self.cache, max(len(self.tokens) - 1, 0))

    def commit(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        self.head = None
        crop_to(self.cache, len(self.tokens) - 1)
