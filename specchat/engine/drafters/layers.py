"""Run a Llama-style decoder layer by layer, so a self-speculative pass can skip layers or stop early.

Where the target runs on the lean runner (engine/runner.py) the drafters use its entry points instead,
which have the same signatures (`layer_runner` picks); this class is the path for the HF fallback.

HF's `model(...)` always runs every layer and sizes its mask from cache layer 0, which a pass that
skips layer 0 leaves empty. This module owns the few lines that matter instead: embed, rotary
embedding, an explicit causal mask from the position the chunk starts at, the chosen layers, final
norm and LM head. It calls the model's own layer modules, so the arithmetic is the target's.
"""

from __future__ import annotations

from typing import Iterable

import torch

from specchat.engine.cache import KVCache, forward_logits, new_cache
from specchat.engine.errors import ModeUnavailable
from specchat.engine.runner import Runner, lean_runner

# architectures whose decoder is embed -> layers -> norm -> lm_head with a model-level rotary embedding
SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}


class Decoder:
    """The pieces of a causal LM (`model.model.{embed_tokens, layers, norm, rotary_emb}`, `lm_head`)."""

    def __init__(self, model) -> None:
        config = model.config
        inner = getattr(model, "model", None)
        parts = [getattr(inner, name, None) for name in ("embed_tokens", "layers", "norm", "rotary_emb")]
        if config.model_type not in SUPPORTED or any(p is None for p in parts) or model.get_output_embeddings() is None:
            raise ModeUnavailable(
                f"self-speculative modes need a Llama/Qwen2/Mistral-style decoder (model.model.layers); "
                f"{type(model).__name__} ({config.model_type}) is not supported"
            )
        sliding = "sliding_attention" in (getattr(config, "layer_types", None) or [])
        if sliding or (config.model_type == "mistral" and getattr(config, "sliding_window", None)):
            # a sliding-window cache drops old entries, so it can neither be rolled back nor masked from positions
            raise ModeUnavailable(f"self-speculative modes do not support sliding-window attention ({type(model).__name__})")
        self.model = model
        self.embed_tokens, self.layers, self.norm, self.rotary_emb = parts
        self.lm_head = model.get_output_embeddings()
        self.n_layers = len(self.layers)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def new_cache(self):
        return new_cache(self.model)

    def step(self, ids: list[int], cache, past: int, keep: int) -> torch.Tensor:
        """The whole model as the HF path runs it (HF's forward): logits [keep, V]; `cache` holds `past`."""
        return forward_logits(self.model, cache, ids, keep=keep)

    def embed(self, ids: list[int]) -> torch.Tensor:
        """[S] ids -> [1, S, D] hidden states."""
        return self.embed_tokens(torch.tensor([ids], dtype=torch.long, device=self.embed_tokens.weight.device))

    def mask(self, q_len: int, past: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """Additive causal mask [1, 1, S, past + S] for a chunk starting after `past` cached positions.

        None for a single query: it attends to everything (and SDPA takes its fast path).
        """
        if q_len == 1:
            return None
        q_pos = torch.arange(past, past + q_len, device=device)[:, None]  # [S, 1]
        k_pos = torch.arange(past + q_len, device=device)[None, :]  # [1, past + S]
        mask = torch.zeros(q_len, past + q_len, dtype=dtype, device=device)
        return mask.masked_fill(k_pos > q_pos, torch.finfo(dtype).min)[None, None]

    @torch.inference_mode()
    def run(self, hidden: torch.Tensor, layer_ids: Iterable[int], cache, past: int) -> torch.Tensor:
        """[1, S, D] -> [1, S, D] through `layer_ids`, whose cache layers hold `past` positions each."""
        q_len = hidden.shape[1]
        position_ids = torch.arange(past, past + q_len, device=hidden.device)[None]  # [1, S]
        rope = self.rotary_emb(hidden, position_ids=position_ids)  # (cos, sin), each [1, S, head_dim]
        mask = self.mask(q_len, past, hidden.dtype, hidden.device)
        for i in layer_ids:
            hidden = self.layers[i](
                hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=rope, cache=cache, use_cache=True
            )
        return hidden

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[1, S, D] -> [S, V]: final norm and LM head."""
        return self.lm_head(self.norm(hidden))[0]

    @torch.inference_mode()
    def forward(self, ids: list[int], layer_ids: Iterable[int], cache, past: int, keep: int = 1) -> torch.Tensor:
        """Logits [keep, V] of the last `keep` of `ids`, fed after `past` cached positions through `layer_ids` only."""
        return self.logits(self.run(self.embed(ids), layer_ids, cache, past)[:, -keep:])


def weight_bytes(modules: Iterable[torch.nn.Module]) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def cache_bytes(cache) -> int:
    """Bytes held by a cache's keys and values (a KVCache: its allocated capacity)."""
    if isinstance(cache, KVCache):
        return cache.nbytes()
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def layer_runner(model) -> "Runner | Decoder":
    """The layer-by-layer path for `model`: the lean runner where it supports the model, else Decoder
    (which raises ModeUnavailable for unsupported architectures). Both have the same entry points."""
    lean = lean_runner(model)
    return lean if lean is not None else Decoder(model)
