"""The target model's state between rounds, on any engine: the contract the loop and the drafters use (`Target`),
the bookkeeping both local engines share (`CachedTarget`), and torch's implementation (`TargetState`);
llama.cpp's is llamacpp.LlamaTargetState."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Protocol, runtime_checkable

import torch

from specchat.engine.cache import CHUNK, common_prefix, crop_to, forward_logits, new_cache
from specchat.engine import smallbatch
from specchat.engine.runner import Runner, lean_runner


PREFILL_CHUNK = 256  # positions a prefill feeds per forward (progress between them; a chunk's activations in memory)


@runtime_checkable
class Target(Protocol):
    """What the loop and every drafter need of a target model, whatever runs it: the tokens its cache covers and four
    operations. One forward contract for every engine (torch's TargetState, llama.cpp's LlamaTargetState).

    Invariant between rounds: the cache holds `tokens[:-1]`; the last token is pending and is fed as the first
    position of the next verify. Right after a `start` that prefilled, the cache also holds the last token and
    `head` [1, V] keeps that position's logits: the first verify then feeds only the drafts.
    """

    tokens: list[int]
    head: torch.Tensor | None  # [1, V]: the last token's logits when the prefill computed them, else None
    vocab_size: int
    context_len: int | None  # the model's context window in positions (None: not known)
    device: torch.device  # where the logits come back

    @property
    def past(self) -> int:
        """Positions the cache holds."""

    def start(self, tokens: list[int], progress: Callable[[int, int], None] | None = None) -> int:
        """Cover `tokens`, reusing the cached prefix; returns the positions prefilled."""

    def verify(self, draft_ids: list[int]) -> torch.Tensor:
        """Target logits for the pending token followed by the drafts: [K+1, V]."""

    def commit(self, new_tokens: list[int]) -> None:
        """Append the round's tokens; the cache drops the rejected drafts (back to the invariant)."""

    def rewind(self) -> None:
        """Back to the invariant, dropping `head`: for a drafter that feeds the pending token itself."""


class CachedTarget(ABC):
    """The Target contract over a KV cache of positions, as both local engines keep one: which tokens it covers, a
    chunked prefill that reuses the cached prefix, verify, commit and rewind. An engine supplies the two operations
    that touch its cache, `forward` and `_crop`, and says what runs it (`runner`, `kernel`: EngineInfo's).

    `past` is the number of positions the cache holds: len(tokens) - 1 between rounds, len(tokens) after a prefill
    (while `head` is set); `commit` and `rewind` return to the invariant. Keeping the tokens across generations lets
    a chat reuse the cache of the conversation prefix.
    """

    runner: str  # the forward that runs the target: "lean", "hf" or "llama.cpp"

    def __init__(self, vocab_size: int, context_len: int | None, device: torch.device) -> None:
        self.tokens: list[int] = []
        self.head: torch.Tensor | None = None  # [1, V]: logits of tokens[-1] when the cache holds it too
        self.vocab_size, self.context_len = vocab_size, context_len
        self.device = device

    @property
    @abstractmethod
    def kernel(self) -> str:
        """What the target's forwards multiply with."""

    @abstractmethod
    def forward(self, ids: list[int], past: int, keep: int) -> torch.Tensor:
        """Feed `ids` at positions past.. (anything cached beyond `past` is dropped first); logits [keep, V]."""

    @abstractmethod
    def _crop(self, length: int) -> None:
        """Keep the cache's positions 0..length-1."""

    @property
    def past(self) -> int:
        """Positions the cache holds: len(tokens) - 1 between rounds, len(tokens) after a prefill."""
        return max(len(self.tokens) - (0 if self.head is not None else 1), 0)

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


class TargetState(CachedTarget):
    """The target model on torch: its KV cache, and on the lean path the target's own features.

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
        vocab_size = model.get_output_embeddings().weight.shape[0]
        # the device is read once: HF's `model.device` walks the modules (~40 us), and a round asks it about ten times
        super().__init__(vocab_size, getattr(model.config, "max_position_embeddings", None), model.device)
        lean = lean_runner(model) if runner != "hf" else None
        if runner == "lean" and lean is None:
            raise ValueError(f"the lean runner does not support {type(model).__name__}")
        self._run_on(model, lean)

    @classmethod
    def on_runner(cls, lean: Runner, context_len: int | None) -> "TargetState":
        """The lean path with no HF model behind it: a runner on a GGUF file's own blocks (engine/gguf_model.py)."""
        state = cls.__new__(cls)
        CachedTarget.__init__(state, lean.vocab_size, context_len, lean.device)
        state._run_on(None, lean)
        return state

    def _run_on(self, model, lean: Runner | None) -> None:
        self.model, self.lean = model, lean
        self.runner = "lean" if lean is not None else "hf"
        self.cache = lean.new_cache() if lean is not None else new_cache(model)
        self.features: torch.Tensor | None = None  # [capacity, D], grown CHUNK rows at a time (lean path only)
        self.known = 0  # features[:known] are the target's for tokens[:known]

    @property
    def kernel(self) -> str:
        """What the target's forwards multiply with: "fused" (engine/smallbatch.py: the lean runner in float32 on
        a CPU, up to 16 positions at a time), "blocks" (a GGUF file's own, smallbatch.gguf_linear) or "torch"."""
        if self.lean is not None and self.model is None:
            return "blocks"
        if self.lean is None or self.device.type != "cpu" or self.lean.dtype != torch.float32:
            return "torch"
        return smallbatch.kernel_name()

    def forward(self, ids: list[int], past: int, keep: int) -> torch.Tensor:
        """Feed `ids` at positions past.. (anything cached beyond `past` is dropped first); logits [keep, V]."""
        self._crop(past)
        if self.lean is not None:
            end, width = past + len(ids), self.lean.norm_w.shape[0]
            kept = past <= self.known  # else a gap: no features (see record), the outputs go to rows of their own
            rows = (self._feature_rows(past, end) if kept
                    else torch.empty(len(ids), width, dtype=self.lean.dtype, device=self.lean.device))
            logits = self.lean.forward_into(ids, self.cache, past, keep, rows)  # the features written in place
            if logits is not None:
                if kept:
                    self.known = end
                return logits
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
        self._feature_rows(past, end)[:] = hidden[0]
        self.known = end

    def _feature_rows(self, past: int, end: int) -> torch.Tensor:
        """features[past:end] [end - past, D], grown CHUNK rows at a time keeping features[:past]."""
        if self.features is None or self.features.shape[0] < end:
            lean = self.lean
            grown = torch.empty(-(-end // CHUNK) * CHUNK, lean.norm_w.shape[0], dtype=lean.dtype, device=lean.device)
            if self.features is not None:
                grown[:past] = self.features[:past]
            self.features = grown
        return self.features[past:end]

    def _crop(self, length: int) -> None:
        crop_to(self.cache, length)
        self.known = min(self.known, length)
