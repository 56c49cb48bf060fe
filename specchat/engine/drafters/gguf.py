"""A draft that runs on llama.cpp: a second GGUF file (mode draft) or a smaller quantisation of the target's own
file (mode quant), on a llama.cpp context of its own.

This is what llama.cpp's `llama-speculative` does, except that the loop's exact rule judges the drafts (at any
temperature, with q exactly what each draft was sampled from) instead of greedy matching.
"""

from __future__ import annotations

from specchat.engine.errors import ModeUnavailable
from specchat.engine.drafters.model import ModelDrafter, align_vocab
from specchat.engine.llamacpp import EngineError, GGUFModel, on_llama_cpp


class GGUFDrafter(ModelDrafter):
    """ModelDrafter's proposal loop over a llama.cpp Context: its own KV cache, re-synced to `state.tokens`."""

    @classmethod
    def build(cls, mode: str, target, draft=None, *, quant_gguf: str | None = None, draft_vocab: int | None = None,
              **options) -> "GGUFDrafter":
        """Mode draft with a GGUF draft model, or mode quant with `quant_gguf` (the requantised target the session made)."""
        if mode == "quant":
            if quant_gguf is None:
                raise ModeUnavailable("mode 'quant' on llama.cpp needs a smaller quantisation of the target's file; none was made")
            try:
                return cls(GGUFModel(quant_gguf, repack=target.repack), name="quant", n_ctx=target.context_len)
            except EngineError as e:
                raise ModeUnavailable(f"mode 'quant': {e}") from None
        if draft is None:
            raise ModeUnavailable("mode 'draft' needs a draft model: pass --draft MODEL")
        if not on_llama_cpp(draft):
            raise ModeUnavailable("target and draft must run on the same engine: both .gguf files on llama.cpp, or --engine torch")
        if draft_vocab is not None:
            raise ModeUnavailable("--draft-vocab needs the torch engine's lean runner (--engine torch)")
        return cls(draft, name="draft", n_ctx=target.context_len)

    def __init__(self, model: GGUFModel, name: str = "draft", n_ctx: int | None = None) -> None:
        self.model, self.name = model, name
        self.n_ctx = n_ctx or model.context_len  # the target's window: a draft trained on a shorter one still follows it
        self.lean, self.vocab_ids = None, None
        self.embed_size = model.vocab_size
        self.stand_in = min(model.eos_ids) if model.eos_ids else 0  # fed for a target id beyond the draft's table
        self.reset()

    def reset(self) -> None:
        self.cache = self.model.context(self.n_ctx)
        self.cached: list[int] = []

    def crop(self, length: int) -> None:
        self.cache.crop(length)

    def next_logits(self, feed: list[int], vocab_size: int):
        feed = [t if t < self.embed_size else self.stand_in for t in feed]
        return align_vocab(self.cache.decode(feed, len(self.cached), keep=1)[-1], vocab_size)  # [V_target]
