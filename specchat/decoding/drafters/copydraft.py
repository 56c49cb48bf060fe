"""A draft model derived from the target (int8 copy, low-rank copy), with a confidence stop.

Like ModelDrafter it keeps its own KV cache re-synced to `state.tokens`. It also stops drafting when
its own confidence (the top probability of its next-token distribution) falls below `p_min`, as
llama.cpp's --draft-p-min does: a draft that is unsure is usually rejected, and each draft step costs
a sizeable fraction of a target step. The stop depends only on the draft's own distribution for the
prefix, so the exact rule stays exact. The loop sets `p_min` from --adaptive (0 = never stop early).
"""

from __future__ import annotations

import torch

from specchat.decoding.cache import common_prefix, crop_to, forward_logits
from specchat.decoding.drafters.base import Proposal
from specchat.decoding.drafters.layers import cache_bytes
from specchat.decoding.drafters.model import ModelDrafter, align_vocab
from specchat.decoding.sampling import logits_to_probs, sample


class CopyDrafter(ModelDrafter):
    p_min: float = 0.0  # stop drafting when the draft's top probability is below this
    weight_bytes: int = 0  # weights this draft holds beyond the target's

    @property
    def extra_bytes(self) -> int:
        return self.weight_bytes + cache_bytes(self.cache)

    def propose(self, state, k, params, generator) -> Proposal:
        keep = min(common_prefix(self.cached, state.tokens), len(state.tokens) - 1)
        crop_to(self.cache, keep)
        self.cached = self.cached[:keep]
        feed = state.tokens[keep:]
        ids, qs, calls = [], [], 0
        for _ in range(k):
            logits = align_vocab(forward_logits(self.model, self.cache, feed, keep=1)[-1], state.vocab_size)  # [V]
            self.cached.extend(feed)
            calls += 1
            q = logits_to_probs(logits, params).to(state.device)  # [V] float32
            # confidence: q's top probability (greedy q is one-hot, so use the softmax of the logits)
            if self.p_min > 0 and float((torch.softmax(logits.float(), -1) if params.greedy else q).max()) < self.p_min:
                break
            token = int(q.argmax()) if params.greedy else int(sample(q[None], generator))
            ids.append(token)
            qs.append(q)
            feed = [token]
        if not ids:
            return Proposal(torch.empty(0, dtype=torch.long, device=state.device), None, calls)
        return Proposal(torch.tensor(ids, device=state.device), torch.stack(qs), calls)  # [K'], [K', V]
