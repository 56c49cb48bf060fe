"""KV-cache helpers shared by the target and by model-based drafters."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def crop_to(cache: DynamicCache, length: int) -> None:
    """Cut every layer back to `length` positions.

    Layers are cut one by one because a self-speculative pass that skips layers leaves them with
    different lengths. transformers 5.x `crop` takes a negative count of positions to remove.
    """
    for layer in cache.layers:
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@torch.inference_mode()
def forward_logits(model, cache: DynamicCache, ids: list[int], keep: int, **kwargs) -> torch.Tensor:
    """Feed `ids` after what `cache` holds; return the logits of the last `keep` positions: [keep, V]."""
    input_ids = torch.tensor([ids], dtype=torch.long, device=model.device)  # [1, S]
    out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=keep, **kwargs)
    return out.logits[0]  # [keep, V]
