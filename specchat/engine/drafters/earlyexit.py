"""Mode `earlyexit`: the draft is the target's first E layers, its final norm and LM head; all layers verify.

The draft shares the target's KV cache. Layers 0..E-1 see exactly the same inputs in the draft pass
as in the full model, so the keys and values the draft writes there are the target's own. The
verify forward (this drafter's `verify`, called by the loop instead of `state.verify`) therefore
only runs the pending K-th draft through layers 0..E-1 and then layers E..N-1 over the hidden
states the draft already computed. A round costs K draft steps of E layers plus a verify of N-E
layers, instead of plus a verify of N layers (HF's `assistant_early_exit` keeps a second cache and
recomputes). After acceptance `state.commit` crops every layer to the accepted length.

The layers run through the state's own path: the lean runner's entry points when the target runs on
it (`state.lean`, whose KVCache is `state.cache`; a GGUF file read in place has nothing else), else Decoder over
HF's modules and DynamicCache.
After a prefill (`state.head` set, the cache already holding the last prompt token) propose first
rewinds the state: it feeds that token through layers < E itself.

Extra memory: K hidden states of one row each; no cache, no weights.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specchat.engine.cache import crop_to
from specchat.engine.drafters.base import Drafter, Proposal
from specchat.engine.errors import ModeUnavailable
from specchat.engine.drafters.layers import Decoder
from specchat.engine.gguf_model import on_lean
from specchat.engine.sampling import argmax, logits_to_probs, sample


def builtin_exit(n_layers: int) -> int:
    """Without a tuned E: all but the last layer. On SmolLM2-135M (not trained for early exit) agreement is
    0.61 at E=29 of 30 and falls fast below it; tune picked 29."""
    return max(1, n_layers - 1)


class Pending(NamedTuple):
    """What a propose leaves for the verify that follows it."""

    state: object  # the TargetState it drafted for
    past: int  # positions that state's cache held before the draft
    ids: list[int]  # the drafts d1..dK
    hidden: list[torch.Tensor]  # K x [1, 1, D]: after layer E-1, for tokens[-1], d1..d(K-1)


class EarlyExitDrafter(Drafter):
    name = "earlyexit"

    @classmethod
    def build(cls, target, draft=None, *, exit_layer=None, **options) -> "EarlyExitDrafter":
        # a GGUF file read in place runs on its runner alone; else Decoder, which raises ModeUnavailable for
        # unsupported architectures (the lean runner covers a subset)
        decoder = None if on_lean(target) else Decoder(target)
        n_layers = target.runner.n_layers if decoder is None else decoder.n_layers
        if exit_layer is None:
            exit_layer = builtin_exit(n_layers)
        if not 1 <= exit_layer < n_layers:
            raise ModeUnavailable(f"--exit-layer must be in 1..{n_layers - 1} for this model, got {exit_layer}")
        return cls(decoder, exit_layer, n_layers)

    def __init__(self, decoder: Decoder | None, exit_layer: int, n_layers: int) -> None:
        self.decoder = decoder
        self.exit_layer, self.n_layers = exit_layer, n_layers
        self.reset()

    def reset(self) -> None:
        self.pending: Pending | None = None

    extra_bytes = 0  # hidden states only (K x D), freed each round

    def layers(self, state):
        """The state's layer-by-layer path: its lean runner, or Decoder on the HF path."""
        return state.lean if state.lean is not None else self.decoder

    def propose(self, state, k, params, generator) -> Proposal:
        dec = self.layers(state)
        past = len(state.tokens) - 1
        state.rewind()  # the cache holds tokens[:-1]: a no-op unless after a prefill or an interrupted round
        feed = state.tokens[-1]
        ids, qs, hidden = [], [], []
        for i in range(k):
            # layers 0..E-1 write the target's own KV entries for `feed`
            h = dec.run(dec.embed([feed]), range(self.exit_layer), state.cache, past + i)  # [1, 1, D]
            q = logits_to_probs(dec.logits(h)[-1], params)  # [V] float32: exactly what the token is drawn from
            token = int(argmax(q)) if params.greedy else int(sample(q[None], generator))
            ids.append(token)
            qs.append(q)
            hidden.append(h)
            feed = token
        self.pending = Pending(state, past, ids, hidden)
        return Proposal(torch.tensor(ids, device=state.device), torch.stack(qs) if qs else None, calls=k)  # [K], [K, V]

    def verify(self, state, draft_ids: list[int]) -> torch.Tensor:
        """Target logits [K+1, V] for the pending token and the drafts, reusing the draft's layers 0..E-1."""
        past = len(state.tokens) - 1
        pending, self.pending = self.pending, None
        dec = self.layers(state)
        E, n = self.exit_layer, self.n_layers
        if state.head is not None:  # right after a prefill and no propose of ours (it rewinds): the state's own verify
            return state.verify(draft_ids)
        if draft_ids and pending is not None and (pending.state, pending.past, pending.ids) == (state, past, draft_ids):
            # the draft fed tokens[-1], d1..d(K-1) through layers < E; only dK is missing there
            h_last = dec.run(dec.embed(draft_ids[-1:]), range(E), state.cache, past + len(draft_ids))
            hidden = torch.cat([*pending.hidden, h_last], dim=1)  # [1, K+1, D]
        else:  # nothing reusable (K = 0, or another drafter proposed): run layers < E on the whole chunk
            crop_to(state.cache, past)
            hidden = dec.run(dec.embed([state.tokens[-1], *draft_ids]), range(E), state.cache, past)
        hidden = dec.run(hidden, range(E, n), state.cache, past)  # [1, K+1, D]
        state.record(hidden, past)  # the target's features, for the draft head
        return dec.logits(hidden)  # [K+1, V]
