"""Mode `draft`: a separate, smaller model that shares the target's tokenizer."""

from __future__ import annotations

import torch

from specchat.engine.cache import KVCache, common_prefix, crop_to, forward_logits, new_cache
from specchat.engine.drafters.base import Drafter, Proposal
from specchat.engine.errors import ModeUnavailable
from specchat.engine.runner import Runner, lean_runner, unsupported
from specchat.engine.sampling import argmax, logits_to_probs, sample
from specchat.engine.smallbatch import head_rows


def align_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., V_draft] -> [..., V_target]: models that share a tokenizer may pad their embeddings differently.

    Extra draft rows are cut (the target cannot emit them); missing rows get -inf, so q is still
    exactly the distribution the draft token is drawn from.
    """
    extra = vocab_size - logits.shape[-1]
    if extra < 0:
        return logits[..., :vocab_size]
    if extra > 0:
        return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
    return logits


class ModelDrafter(Drafter):
    """Also the base of every drafter that runs a model of its own with its own KV cache
    (quant, lowrank, layerskip): they differ only in `next_logits`.

    Mode draft runs the draft model on the lean runner where it can (the families the target's runner
    supports; HF's forward otherwise), its matrices in bfloat16 on the CPU (Runner.streamed), and with
    `vocab=N` its LM head only over the N lowest token ids plus its
    end-of-sequence ids (FR-Spec's restriction, with BPE merge order standing in for frequency: byte-level BPE
    gives its most frequent merges the lowest ids). A draft's LM head is a large part of a small model (a
    0.5B Qwen2.5's 152k rows are ~27% of its weights). q is the softmax over those ids, zero elsewhere: exactly
    what each draft is drawn from, so the rule stays exact."""

    name = "draft"
    # A draft derived from the target with the target's own cache layout (quant's int8 copy, lowrank on the lean
    # runner) may draft on the target's KV cache instead of a cache of its own: it reads the target's keys and values
    # for every committed position and writes its own only at the positions the next verify overwrites (the pending
    # token's and the drafts'), so the target never reads a draft's entry and the rule stays exact. Nothing to catch
    # up on after a prompt or another mode's rounds, and no cache of its own.
    shares_target_cache: bool = False
    sharing: bool = False

    @classmethod
    def build(cls, target, draft=None, *, draft_vocab: int | None = None, **options) -> "ModelDrafter":
        if draft is None:
            raise ModeUnavailable("mode 'draft' needs a draft model: pass --draft MODEL")
        lean = lean_runner(draft)
        if lean is not None:
            lean = lean.streamed()  # its matrices in bfloat16 on the CPU: a draft step reads half the bytes
        if draft_vocab is not None and lean is None:
            raise ModeUnavailable(f"--draft-vocab needs a draft the lean runner supports ({unsupported(draft)})")
        return cls(draft, lean=lean, vocab=draft_vocab)

    def __init__(self, model, *, lean: Runner | None = None, vocab: int | None = None) -> None:
        self.model, self.lean = model, lean
        # ids the target may emit beyond the draft's embedding table (a target padded larger) are fed as a
        # token the draft knows: that changes the draft's context, never exactness (q stays what was sampled)
        self.embed_size = model.get_input_embeddings().num_embeddings
        config = model.config
        known = [i for i in (config.pad_token_id, config.eos_token_id, 0) if isinstance(i, int) and 0 <= i < self.embed_size]
        self.stand_in = known[0]
        self.vocab_ids: torch.Tensor | None = None  # [N] the ids the restricted LM head scores
        if vocab is not None:
            if lean is None:
                raise ValueError("a restricted draft vocabulary needs the lean runner")
            self.restrict(vocab, {config.eos_token_id} | set(_as_list(getattr(model.generation_config, "eos_token_id", None))))
        self.reset()

    @classmethod
    def on_runner(cls, lean: Runner, stand_in: int = 0, vocab: int | None = None, eos: set[int] = frozenset()) -> "ModelDrafter":
        """A draft model on a runner with no HF model behind it (a GGUF file read in place, engine/gguf_model.py);
        `stand_in` is fed for target ids beyond its embedding table; `vocab`, `eos`: as `restrict`'s."""
        drafter = cls.__new__(cls)
        drafter.model, drafter.lean, drafter.vocab_ids = None, lean, None
        drafter.embed_size, drafter.stand_in = lean.embed_w.shape[0], stand_in
        if vocab is not None:
            drafter.restrict(vocab, eos)
        drafter.reset()
        return drafter

    def restrict(self, vocab: int, eos: set) -> None:
        """Score only the ids below `vocab` and the end ids `eos` above them: the runner's LM head becomes those rows
        (smallbatch.head_rows: on a GGUF file's blocks the first `vocab` rows are a view, not a copy)."""
        lean = self.lean
        if not 0 < vocab < lean.vocab_size:
            raise ModeUnavailable(f"--draft-vocab {vocab}: the draft has {lean.vocab_size} tokens; choose 1..{lean.vocab_size - 1}")
        ends = sorted(i for i in eos if isinstance(i, int) and vocab <= i < lean.vocab_size)
        self.vocab_ids = torch.cat([torch.arange(vocab), torch.tensor(ends, dtype=torch.long)]).to(lean.device)  # [N]
        try:
            head = head_rows(lean.head_w, vocab, ends)
        except ValueError as e:
            raise ModeUnavailable(f"--draft-vocab {vocab}: {e}") from None
        self.lean = lean.with_matrices(lean.blocks, head)
        self.head_w = self.lean.head_w  # [N, D]

    def reset(self) -> None:
        self.cache = self.lean.new_cache() if self.lean is not None else new_cache(self.model)
        self.cached: list[int] = []  # tokens whose KV the draft cache holds
        self.sharing = False  # the last proposal drafted on the target's cache (self.cache is the target's)

    @property
    def catches_up(self) -> bool:
        """Its first round after a prompt or another mode's rounds feeds every position it missed (a draft on the
        lean runner that shares the target's cache has nothing to feed; an HF-path draft keeps a cache of its own)."""
        return not (self.shares_target_cache and self.lean is not None)

    def use_target_cache(self, state) -> None:
        """Draft on the target's cache when this drafter shares it and the target runs on the lean runner; the
        cache then holds `state.tokens[:-1]`, every entry the target's."""
        share = self.shares_target_cache and self.lean is not None and isinstance(state.cache, KVCache)
        if share:
            state.rewind()  # right after a prefill the cache holds the pending token too: this pass writes its position
            self.cache, self.cached = state.cache, state.tokens[:-1]
        elif self.sharing:  # the cache was a target's: one of its own from here
            self.reset()
        self.sharing = share

    def crop(self, length: int) -> None:
        """Keep the draft cache's first `length` positions."""
        crop_to(self.cache, length)

    def next_logits(self, feed: list[int], vocab_size: int) -> torch.Tensor:
        """Feed `feed` after the cached tokens; the draft's logits for the next token, [V_target]."""
        feed = [t if t < self.embed_size else self.stand_in for t in feed]
        if self.lean is None:
            return align_vocab(forward_logits(self.model, self.cache, feed, keep=1)[-1], vocab_size)
        # the whole step in one C call where it runs (the last layer's output not kept)
        rows = torch.empty(len(feed), self.lean.norm_w.shape[0], dtype=self.lean.dtype, device=self.lean.device)
        scores = self.lean.forward_into(feed, self.cache, len(self.cached), 1, rows)  # [1, N] or None
        if scores is None:
            hidden = self.lean.run(self.lean.embed(feed), range(self.lean.n_layers), self.cache, len(self.cached))[:, -1:]  # [1, 1, D]
            scores = self.lean.logits(hidden)
        if self.vocab_ids is None:
            return align_vocab(scores[-1], vocab_size)
        scores = scores[-1]  # [N]: the restricted head's rows, in vocab_ids' order
        logits = torch.full((vocab_size,), float("-inf"), dtype=scores.dtype, device=scores.device)  # [V_target]
        keep = self.vocab_ids < vocab_size  # ids the target cannot emit are never proposed
        return logits.index_put_((self.vocab_ids[keep],), scores[keep])

    def propose(self, state, k, params, generator) -> Proposal:
        self.use_target_cache(state)
        # re-sync: keep the common prefix, feed the rest (after a full accept that includes the K-th draft)
        keep = min(common_prefix(self.cached, state.tokens), len(state.tokens) - 1)
        self.crop(keep)
        self.cached = self.cached[:keep]
        feed = state.tokens[keep:]
        ids, qs, calls = [], [], 0
        for _ in range(k):
            logits = self.next_logits(feed, state.vocab_size)  # [V]
            self.cached.extend(feed)
            calls += 1
            q = logits_to_probs(logits, params).to(state.device)  # [V] float32: exactly what the token is drawn from
            # confidence: q's top probability (a greedy q is one-hot, so use the softmax of the logits)
            if self.p_min > 0 and float((torch.softmax(logits.float(), -1) if params.greedy else q).max()) < self.p_min:
                break
            token = int(argmax(q)) if params.greedy else int(sample(q[None], generator))
            ids.append(token)
            qs.append(q)
            feed = [token]
        if not ids:
            return Proposal(torch.empty(0, dtype=torch.long, device=state.device), None, calls)
        return Proposal(torch.tensor(ids, device=state.device), torch.stack(qs), calls)  # [K'], [K', V]


def _as_list(x) -> list:
    return x if isinstance(x, list) else [] if x is None else [x]
