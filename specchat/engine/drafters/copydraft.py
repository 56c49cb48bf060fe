"""A draft model derived from the target (int8 copy, low-rank copy).

It runs ModelDrafter's loop (on the target's KV cache where it shares it, else on its own re-synced to
`state.tokens`; confidence stop at `p_min`, which matters most here: each draft step of a copy costs a sizeable
fraction of a target step) and reports the memory it adds.
"""

from __future__ import annotations

import copy

import torch

from specchat.engine.drafters.layers import cache_bytes
from specchat.engine.drafters.model import ModelDrafter


def shared_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A structural copy whose parameters and buffers are the target's own tensors (no weight is duplicated):
    replace some modules of the copy and the rest stays shared."""
    return copy.deepcopy(model, memo={id(t): t for t in (*model.parameters(), *model.buffers())})


class CopyDrafter(ModelDrafter):
    weight_bytes: int = 0  # weights this draft holds beyond the target's

    @property
    def extra_bytes(self) -> int:
        return self.weight_bytes + (0 if self.sharing else cache_bytes(self.cache))
