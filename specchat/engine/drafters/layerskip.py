"""Mode `layerskip`: the target's own weights with chosen layers skipped as the draft; all layers verify.

The draft pass keeps its own KV cache: once a layer is skipped, every later layer sees a different
residual stream than in the full model, so its keys and values differ from the target's and must
not be mixed into the target cache. Skipped layers' cache slots
stay empty. Extra memory: that cache (K/V of the kept layers), no weights.

Drafting on the target's cache instead (reading the target's keys and values for the context and writing only the
positions the verify overwrites, as quant and lowrank do: ModelDrafter.shares_target_cache) raises greedy
acceptance from 0.60 to 0.72 on the default model, but tune's teacher-forced replay
(tune/search.py), which predicts this loop exactly, assumes a cache of the draft's own; it stays so until the
replay models the shared one.

Where the target runs on the lean runner (engine/runner.py) the draft pass runs the kept layers through
its entry points on a KVCache of its own, and the verify is the state's own (the lean forward of all
layers); a GGUF file read in place (--engine lean) has no HF model behind it: the draft runs on the target's
own runner. On the HF path the draft pass and the verify run HF's layer modules one by one (Decoder): the
same modules and arithmetic as HF's forward, without its per-call mask and output bookkeeping
(~1.2x cheaper per step in fp32 on CPU).
"""

from __future__ import annotations

import torch

from specchat.engine.errors import ModeUnavailable
from specchat.engine.drafters.layers import Decoder, cache_bytes
from specchat.engine.drafters.model import ModelDrafter
from specchat.engine.gguf_model import draft_runner, on_lean
from specchat.engine.runner import lean_runner


def builtin_skip(n_layers: int) -> list[int]:
    """Without a tuned set: one layer a little past the middle (SmolLM2-135M: layer 17 of 30, tune's best,
    greedy agreement 0.89; skipping more layers there costs more acceptance than it saves)."""
    if n_layers < 3:
        return []
    return [min(n_layers - 2, (4 * n_layers) // 7)]


def check_skip(skip: list[int], n_layers: int) -> list[int]:
    bad = [i for i in skip if not 0 <= i < n_layers]
    if bad:
        raise ModeUnavailable(f"--skip-layers {bad} out of range: the model has layers 0..{n_layers - 1}")
    if len(set(skip)) >= n_layers:
        raise ModeUnavailable("--skip-layers would skip every layer")
    return sorted(set(skip))


class LayerSkipDrafter(ModelDrafter):
    name = "layerskip"

    @classmethod
    def build(cls, target, draft=None, *, skip_layers=None, **options) -> "LayerSkipDrafter":
        if on_lean(target):  # the file's runner itself, the kept layers on a cache of the drafter's own
            runner = target.runner
            drafter = cls.on_runner(draft_runner(runner))
            drafter.decoder = None
            drafter.set_skip(check_skip(list(builtin_skip(runner.n_layers) if skip_layers is None else skip_layers),
                                        runner.n_layers), runner.n_layers)
            return drafter
        decoder = Decoder(target)  # raises ModeUnavailable for unsupported architectures
        if skip_layers is None:
            skip_layers = builtin_skip(decoder.n_layers)
        return cls(decoder, check_skip(list(skip_layers), decoder.n_layers))

    def __init__(self, decoder: Decoder, skip_layers: list[int]) -> None:
        self.decoder = decoder
        self.set_skip(skip_layers, decoder.n_layers)
        super().__init__(decoder.model, lean=lean_runner(decoder.model))  # lean None: the draft runs HF's modules (Decoder)

    def set_skip(self, skip_layers: list[int], n_layers: int) -> None:
        self.skip_layers = skip_layers
        self.layer_ids = [i for i in range(n_layers) if i not in set(skip_layers)]

    @property
    def extra_bytes(self) -> int:
        return cache_bytes(self.cache)

    def next_logits(self, feed: list[int], vocab_size: int) -> torch.Tensor:
        """The draft pass: only the kept layers, on this drafter's own cache. [V]"""
        return (self.lean or self.decoder).forward(feed, self.layer_ids, self.cache, past=len(self.cached))[-1]

    def verify(self, state, draft_ids: list[int]) -> torch.Tensor:
        """Target logits [K+1, V] for the pending token and the drafts: every layer, the target's cache."""
        if state.lean is not None or state.head is not None:  # the lean forward, or the drafts after a prefill
            return state.verify(draft_ids)
        ids = [state.tokens[-1], *draft_ids]
        return self.decoder.forward(ids, range(self.decoder.n_layers), state.cache, len(state.tokens) - 1, keep=len(ids))
