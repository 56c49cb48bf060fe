"""KV-cache helpers shared by the target and by model-based drafters, and the lean runner's KV cache."""

from __future__ import annotations

import torch
from transformers import DynamicCache

CHUNK = 256  # positions a KVCache layer grows by


class KVCache:
    """The lean runner's KV cache (engine/runner.py): per layer, keys and values [B, H_kv, capacity, head_dim]
    (B = `rows`: 1, except for batched generation of training data).

    A layer's storage is allocated at its first write and grown CHUNK positions at a time (never a
    torch.cat per step); entries are written in place. `lengths[i]` says how many positions layer i
    holds: writing S positions at `past` sets it to past + S, and cropping only lowers it, so a
    rollback moves a pointer and copies nothing. Layers have their own lengths because a
    self-speculative pass runs a subset of them (a skipped layer never gets entries).
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, rows: int = 1) -> None:
        self.n_kv_heads, self.head_dim, self.dtype, self.device, self.rows = n_kv_heads, head_dim, dtype, device, rows
        self.keys: list[torch.Tensor | None] = [None] * n_layers  # [B, H_kv, capacity, hd]
        self.values: list[torch.Tensor | None] = [None] * n_layers
        self.lengths = [0] * n_layers
        self.version = 0  # bumped whenever a layer's storage is replaced (C code holds pointers into it)
        self._all_capacity = 0  # positions every layer's storage has room for (a lower bound)

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor, past: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, H_kv, S, hd] at positions past..past+S-1 of layer i; return the layer's keys and
        values for positions 0..past+S-1 (views, [B, H_kv, past + S, hd])."""
        end = past + k.shape[2]
        keys, values = self.reserve(i, past, k.shape[2])
        keys[:, :, past:end].copy_(k)
        values[:, :, past:end].copy_(v)
        return keys[:, :, :end], values[:, :, :end]

    def reserve(self, i: int, past: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's whole storage, keys and values [B, H_kv, capacity, hd], with room for positions past..past+n-1,
        which the layer now holds: the caller fills them (`write`, or the fused C layer in place)."""
        if past > self.lengths[i]:
            raise ValueError(f"layer {i} holds {self.lengths[i]} positions; cannot write at {past}")
        end = past + n
        if self.keys[i] is None or self.keys[i].shape[2] < end:
            self._grow(i, end)
        self.lengths[i] = end
        return self.keys[i], self.values[i]

    def reserve_all(self, past: int, n: int) -> None:
        """`reserve` for every layer at once (a whole-model forward), without a call per layer."""
        end = past + n
        if past > min(self.lengths):
            raise ValueError(f"a layer holds {min(self.lengths)} positions; cannot write at {past}")
        if end > self._all_capacity:
            for i, keys in enumerate(self.keys):
                if keys is None or keys.shape[2] < end:
                    self._grow(i, end)
            self._all_capacity = min(k.shape[2] for k in self.keys)
        self.lengths = [end] * len(self.lengths)

    def _grow(self, i: int, needed: int) -> None:
        capacity = -(-needed // CHUNK) * CHUNK
        shape = (self.rows, self.n_kv_heads, capacity, self.head_dim)
        keys = torch.empty(shape, dtype=self.dtype, device=self.device)
        values = torch.empty(shape, dtype=self.dtype, device=self.device)
        n = self.lengths[i]
        if n:
            keys[:, :, :n].copy_(self.keys[i][:, :, :n])
            values[:, :, :n].copy_(self.values[i][:, :, :n])
        self.keys[i], self.values[i] = keys, values
        self.version += 1

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows `index` [B'] of every layer (batched generation drops the rows that finished)."""
        self.keys = [k.index_select(0, index) if k is not None else None for k in self.keys]
        self.values = [v.index_select(0, index) if v is not None else None for v in self.values]
        self.rows = len(index)
        self.version += 1

    def crop(self, length: int) -> None:
        """Every layer back to at most `length` positions (a pointer move)."""
        self.lengths = [min(n, length) for n in self.lengths]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths[layer_idx]

    @property
    def layers(self) -> list["_LayerView"]:
        return [_LayerView(self, i) for i in range(len(self.lengths))]

    def nbytes(self) -> int:
        """Bytes allocated for keys and values (capacity, not only the positions in use)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)


class _LayerView:
    """One layer of a KVCache, with the `get_seq_length()` a DynamicCache layer has."""

    def __init__(self, cache: KVCache, i: int) -> None:
        self.cache, self.i = cache, i

    def get_seq_length(self) -> int:
        return self.cache.lengths[self.i]


def new_cache(model) -> DynamicCache:
    """A cache laid out by the config. Sliding-window layers record what falls out of the window: a rejected
    draft past the window is rolled back by a crop, which they refuse otherwise."""
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    return cache


def crop_to(cache, length: int) -> None:
    """Cut every layer back to `length` positions (a DynamicCache or a KVCache).

    Layers are cut one by one because a self-speculative pass that skips layers leaves them with
    different lengths. transformers 5.x `crop` takes a negative count of positions to remove.
    """
    if isinstance(cache, KVCache):
        cache.crop(length)
        return
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
