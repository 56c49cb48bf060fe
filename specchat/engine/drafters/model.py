"""Mode `draft`: a separate, smaller model that shares the target's tokenizer."""

from __future__ import annotations

import torch

from specchat.engine.cache import common_prefix, crop_to, forward_logits, new_cache
from specchat.engine.drafters.base import Drafter, ModeUnavailable, Proposal
from specchat.engine.sampling import logits_to_probs, sample


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
    (quant, lowrank, layerskip): they differ only in `next_logits`."""

    name = "draft"

    @classmethod
    def build(cls, target, draft=None, **options) -> "ModelDrafter":
        if draft is None:
            raise ModeUnavailable("mode 'draft' needs a draft model: pass --draft MODEL")
        return cls(draft)

    def __init__(self, model) -> None:
        self.model = model
        # ids the target may emit beyond the draft's embedding table (a target padded larger) are fed as a
        # token the draft knows: that changes the draft's context, never exactness (q stays what was sampled)
        self.embed_size = model.get_input_embeddings().num_embeddings
        config = model.config
        known = [i for i in (config.pad_token_id, config.eos_token_id, 0) if isinstance(i, int) and 0 <= i < self.embed_size]
        self.stand_in = known[0]
        self.reset()

    def reset(self) -> None:
        self.cache = new_cache(self.model)
        self.cached: list[int] = []  # tokens whose KV the draft cache holds

    def next_logits(self, feed: list[int], vocab_size: int) -> torch.Tensor:
        """Feed `feed` after the cached tokens; the draft's logits for the next token, [V_target]."""
        feed = [t if t < self.embed_size else self.stand_in for t in feed]
        return align_vocab(forward_logits(self.model, self.cache, feed, keep=1)[-1], vocab_size)

    def propose(self, state, k, params, generator) -> Proposal:
        # re-sync: keep the common prefix, feed the rest (after a full accept that includes the K-th draft)
        keep = min(common_prefix(self.cached, state.tokens), len(state.tokens) - 1)
        crop_to(self.cache, keep)
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
            token = int(q.argmax()) if params.greedy else int(sample(q[None], generator))
            ids.append(token)
            qs.append(q)
            feed = [token]
        if not ids:
            return Proposal(torch.empty(0, dtype=torch.long, device=state.device), None, calls)
        return Proposal(torch.tensor(ids, device=state.device), torch.stack(qs), calls)  # [K'], [K', V]
