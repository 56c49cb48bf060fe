"""The target model's state between rounds: its KV cache and the tokens the cache covers."""

from __future__ import annotations

import torch

from specchat.engine.cache import common_prefix, crop_to, forward_logits, new_cache


class TargetState:
    """The target model, its KV cache and the tokens the cache covers.

    Invariant between rounds: the cache holds `tokens[:-1]`; the last token is pending and is fed as
    the first position of the next verify forward. Keeping it across generations lets a chat reuse
    the cache of the conversation prefix.
    """

    def __init__(self, model) -> None:
        self.model = model
        self.cache = new_cache(model)
        self.tokens: list[int] = []
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.context_len: int | None = getattr(model.config, "max_position_embeddings", None)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def start(self, tokens: list[int]) -> int:
        """Make the state cover `tokens`, reusing the cached common prefix; returns positions prefilled."""
        cached = max(len(self.tokens) - 1, 0)  # the pending last token is not in the cache
        keep = min(common_prefix(self.tokens, tokens), len(tokens) - 1, cached)
        crop_to(self.cache, keep)
        self.tokens = list(tokens)
        todo = self.tokens[keep:-1]
        if todo:
            forward_logits(self.model, self.cache, todo, keep=1)
        return len(todo)

    def verify(self, draft_ids: list[int]) -> torch.Tensor:
        """Target logits for the pending token followed by the drafts: [K+1, V]."""
        return forward_logits(self.model, self.cache, [self.tokens[-1], *draft_ids], keep=len(draft_ids) + 1)

    def commit(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        crop_to(self.cache, len(self.tokens) - 1)
