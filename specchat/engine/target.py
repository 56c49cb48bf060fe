"""The target model's state between rounds: its KV cache and the tokens the cache covers."""

from __future__ import annotations

from typing import Callable

import torch

from specchat.engine.cache import CHUNK, common_prefix, crop_to, forward_logits, new_cache
from specchat.engine import smallbatch
from specchat.engine.runner import Runner, lean_runner


PREFILL_CHUNK = 256  # positions a prefill feeds per forward (progress between them; a chunk's activations in memory)


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

    On the lean path every forward also keeps the last layer's output (before the final norm) of each
    position it fed: `features[:known]` [known, D], the target's own features that the draft head
    (drafters/head.py) drafts from, at no extra target pass.
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
        self.features: torch.Tensor | None = None  # [capacity, D], grown CHUNK rows at a time (lean path only)
        self.known = 0  # features[:known] are the target's for tokens[:known]
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.context_len: int | None = getattr(model.config, "max_position_embeddings", None)
        # read once: HF's `model.device` walks the modules (~40 us), and a round asks it about ten times
        self.device: torch.device = model.device

    @property
    def kernel(self) -> str:
        """What the target's forwards multiply with: "fused" (engine/smallbatch.py: the lean runner in float32 on
        a CPU, up to 16 positions at a time) or "torch"."""
        if self.lean is None or self.device.type != "cpu" or self.lean.dtype != torch.float32:
            return "torch"
        return smallbatch.kernel_name()

    @property
    def past(self) -> int:
        """Positions the cache holds: len(tokens) - 1 between rounds, len(tokens) after a prefill."""
        return max(len(self.tokens) - (0 if self.head is not None else 1), 0)

    def forward(self, ids: list[int], past: int, keep: int) -> torch.Tensor:
        """Feed `ids` at positions past.. (anything cached beyond `past` is dropped first); logits [keep, V]."""
        self._crop(past)
        if self.lean is not None:
            hidden = self.lean.run(self.lean.embed(ids), range(self.lean.n_layers), self.cache, past)  # [1, S, D]
            self.record(hidden, past)
            return self.lean.logits(hidden[:, -keep:])
        return forward_logits(self.model, self.cache, ids, keep=keep)

    def record(self, hidden: torch.Tensor, past: int) -> None:
        """Keep the last layer's output [1, S, D] for positions past..past+S-1 (a forward that computed it itself,
        like earlyexit's verify, calls this too). Positions beyond are dropped: they belonged to other tokens."""
        if past > self.known:  # a gap: those positions were computed without features (the HF path)
            return
        end = past + hidden.shape[1]
        if self.features is None or self.features.shape[0] < end:
            grown = torch.empty(-(-end // CHUNK) * CHUNK, hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
            if self.features is not None:
                grown[:past] = self.features[:past]
            self.features = grown
        self.features[past:end] = hidden[0]
        self.known = end

    def _crop(self, length: int) -> None:
        crop_to(self.cache, length)
        self.known = min(self.known, length)

    def start(self, tokens: list[int], progress: Callable[[int, int], None] | None = None) -> int:
        """Make the state cover `tokens`, reusing the cached common prefix; returns positions prefilled (the prompt
        after the reused prefix, its last token included). When only the last token is missing (a prompt the cache
        already covers) nothing runs: it stays pending. A long prompt is fed PREFILL_CHUNK positions at a time, each
        followed by `progress(positions fed, positions to feed)`: a 20,000-character message reads for seconds."""
        if self.head is not None and tokens == self.tokens:
            return 0
        keep = max(min(common_prefix(self.tokens, tokens), len(tokens) - 1, self.past), 0)
        self.tokens = list(tokens)
        self.head = None
        self._crop(keep)
        if keep >= len(tokens) - 1:  # all cached but the last token: leave it pending, the first verify feeds it
            return 0
        try:
            for begin in range(keep, len(tokens), PREFILL_CHUNK):
                end = min(begin + PREFILL_CHUNK, len(tokens))
                self.head = self.forward(self.tokens[begin:end], begin, keep=1)  # [1, V]: the last chunk's is kept
                if progress is not None:
                    progress(end - keep, len(tokens) - keep)
        except BaseException:  # a failed or interrupted prefill: back to what the cache surely holds, tokens[:keep]
            self.tokens = self.tokens[: keep + 1]
            self._crop(keep)
            raise
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
        self._crop(max(len(self.tokens) - 1, 0))

    def commit(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        self.head = None
        self._crop(len(self.tokens) - 1)
