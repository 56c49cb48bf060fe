"""Hugging Face transformers' own implementations, run with the same models, prompts, K and sampling.

Each peer is one `model.generate` call; a stopping criterion (called once per target forward) records
the time to the first token and counts target calls, so the peers report what specchat reports.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from specchat.engine.loop import clock
from specchat.machine import memory_mb, reset_peak


class TargetCallTimer(StoppingCriteria):
    """Never stops generation; notes when the first token exists and how many target forwards ran."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.calls = 0
        self.first: float | None = None

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        if self.first is None:
            self.first = clock(self.device)
        self.calls += 1
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@contextlib.contextmanager
def fixed_draft_length(model, k: int):
    """HF assistants read K from their own generation_config and by default adapt it (schedule
    'heuristic', confidence threshold 0.4). Fix it to K for the duration, as specchat uses a fixed K."""
    saved = copy.deepcopy(model.generation_config)
    model.generation_config.num_assistant_tokens = k
    model.generation_config.num_assistant_tokens_schedule = "constant"
    model.generation_config.assistant_confidence_threshold = 0.0
    try:
        yield
    finally:
        model.generation_config = saved


def generation_config(ctx, temperature: float, max_new_tokens: int) -> GenerationConfig:
    """The same settings specchat uses: greedy or plain temperature sampling, no top-k/top-p/penalties."""
    eos = sorted(ctx.eos_ids)
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else 1.0,
        top_k=0,
        top_p=1.0,
        repetition_penalty=1.0,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
    )


def peer_kwargs(ctx, mode: str, k: int) -> tuple[dict, object | None]:
    """generate() arguments for a peer, and the model whose generation_config holds its K (if any)."""
    target = ctx.target.model
    if mode == "hf-generate":
        return {}, None
    if mode == "hf-assisted":
        return {"assistant_model": ctx.draft.model}, ctx.draft.model
    if mode == "hf-lookup":
        return {"prompt_lookup_num_tokens": k}, None
    if mode == "hf-earlyexit":
        return {"assistant_early_exit": early_exit_layer(ctx)}, target  # the target drafts for itself
    raise ValueError(f"unknown peer {mode!r}")


def early_exit_layer(ctx) -> int:
    """Same layer as specchat's earlyexit drafter when it is loaded; else --exit-layer; else half the layers."""
    drafter = ctx.drafters.get("earlyexit")
    layer = getattr(drafter, "exit_layer", None) or ctx.exit_layer
    return int(layer or max(1, ctx.target.model.config.num_hidden_layers // 2))


@torch.inference_mode()
def run_peer(ctx, cfg, ids: list[int], seed: int, max_new_tokens: int) -> dict:
    model = ctx.target.model
    kwargs, k_holder = peer_kwargs(ctx, cfg.mode, cfg.k)
    input_ids = torch.tensor([ids], device=model.device)  # [1, S]
    timer = TargetCallTimer(ctx.device)
    torch.manual_seed(seed)
    reset_peak(ctx.device)
    with fixed_draft_length(k_holder, cfg.k) if k_holder is not None else contextlib.nullcontext():
        t0 = clock(ctx.device)
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=generation_config(ctx, cfg.temperature, max_new_tokens),
            stopping_criteria=StoppingCriteriaList([timer]),
            **kwargs,
        )
        elapsed = clock(ctx.device) - t0
    tokens = out[0, len(ids) :].tolist()
    return {
        "tokens": tokens,
        "new_tokens": len(tokens),
        "e2e_s": elapsed,
        "e2e_tokens_per_s": len(tokens) / elapsed if elapsed else None,
        "tokens_per_s": None,  # HF does not separate the prefill from the first step
        "time_to_first_token_s": (timer.first - t0) if timer.first is not None else None,
        "target_calls": timer.calls,
        "stop_reason": None,
        "memory_mb": memory_mb(ctx.device),
        "peer_settings": {k: v for k, v in kwargs.items() if k != "assistant_model"} | ({"num_assistant_tokens": cfg.k} if k_holder is not None else {}),
    }
