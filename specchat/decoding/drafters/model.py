"""Mode `draft`: a separate, smaller model that shares the target's tokenizer."""

from __future__ import annotations

import torch

from specchat.decoding.cache import common_prefix, crop_to, forward_logits, new_cache
from specchat.decoding.drafters.base import Proposal
from specchat.decoding.sampling import logits_to_probs, sample


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


class ModelDrafter:
    name = "draft"

    @classmethod
    def build(cls, target, draft=None, **options) -> "ModelDrafter":
        from specchat.decoding.drafters import ModeUnavailable

        if draft is None:
            raise ModeUnavailable("mode 'draft' needs a draft model: pass --draft MODEL")
        return cls(draft)

    def __init__(self, model) -> None:
        self.model = model
        self.reset()

    def reset(self) -> None:
        self.cache = new_cache(self.model)
        self.cached: list[int] = []  # tokens whose KV the draft cache holds

    def propose(self, state, k, params, generator) -> Proposal:
        # re-sync: keep the common prefix, feed the rest (after a full accept that includes the K-th draft)
        keep = min(common_prefix(self.cached, state.tokens), len(state.tokens) - 1)
        crop_to(self.cache, keep)
        self.cached = self.cached[:keep]
        feed = state.tokens[keep:]
        ids, qs = [], []
        for _ in range(k):
            logits = align_vocab(forward_logits(self.model, self.cache, feed, keep=1)[-1], state.vocab_size)  # [V]
            self.cached.extend(feed)
            q = logits_to_probs(logits, params).to(state.device)  # [V]
            token = int(q.argmax()) if params.greedy else int(sample(q[None], generator))
            ids.append(token)
            qs.append(q)
            feed = [token]
        q_all = torch.stack(qs)  # [K, V]
        return Proposal(torch.tensor(ids, device=state.device), q_all, calls=k)
