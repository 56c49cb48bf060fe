"""Mode `lowrank`: the target with chosen linear layers replaced by truncated-SVD factors; full weights verify.

A weight W [out, in] becomes A [out, r] @ B [r, in], so a draft step streams r * (out + in) numbers
instead of out * in. The factorisation is activation-aware: it minimises the error on the inputs the
layer actually sees on a calibration text (whitened SVD, as in SVD-LLM), not the error on W itself.
The calibration text is one the target writes itself from its BOS token (no data set needed). Factors are
computed once per model and rank; given a `factor_store` (the session passes one backed by the user cache)
they are kept across runs.

The draft model is a structural copy of the target that shares every parameter except the
replaced layers. Where the target runs on the lean runner and only MLP projections are factored (the default),
the draft runs on that runner with the copy's MLP modules swapped in (`Runner.with_mlps`, `lean_draft`) instead of
HF's forward, on the target's own KV cache (ModelDrafter.shares_target_cache: greedy acceptance 0.23 on the
default model, against 0.10 on a cache of its own). Otherwise it keeps its own KV cache
re-synced to `state.tokens`. Extra memory: the factors, and that cache where it keeps one.
"""

from __future__ import annotations

import hashlib
import json
from typing import Protocol

import torch
import torch.nn.functional as F
from specchat.engine.errors import ModeUnavailable
from specchat.engine.drafters.copydraft import CopyDrafter, shared_copy
from specchat.engine.runner import Runner, lean_runner

FORMAT = 2  # bump when the factorisation changes: old cache files are then ignored
DEFAULT_RANK = 0.7  # when nothing is tuned; on SmolLM2-135M lower ranks keep almost no greedy agreement
DEFAULT_TARGETS = ("gate_proj", "up_proj", "down_proj")  # the MLP holds ~3/4 of a layer's weights
CALIBRATION_TOKENS = 256


class LowRankLinear(torch.nn.Module):
    """y = (x B^T) A^T + bias: [..., in] -> [..., r] -> [..., out], two thin matmuls instead of one wide one."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(a, requires_grad=False)  # [out, r]
        self.b = torch.nn.Parameter(b, requires_grad=False)  # [r, in]
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.b), self.a, self.bias)


def resolve_rank(rank: float | int, shape: tuple[int, int]) -> int:
    """A fraction (< 1) of full rank min(out, in), or an absolute rank; at least 1, at most full."""
    full = min(shape)
    r = round(rank * full) if isinstance(rank, float) and rank < 1 else int(rank)
    return max(1, min(r, full))


def layer_ranks(rank, n_layers: int) -> list:
    """rank: one value for every layer, a list (one per layer), or {layer: rank}; None/absent = full weights."""
    if isinstance(rank, dict):
        ranks = {int(i): r for i, r in rank.items()}
        return [ranks.get(i) for i in range(n_layers)]
    if isinstance(rank, (list, tuple)):
        if len(rank) != n_layers:
            raise ValueError(f"a per-layer rank list needs {n_layers} entries, got {len(rank)}")
        return list(rank)
    return [rank] * n_layers


def chosen_linears(model, rank, targets) -> dict[str, tuple[torch.nn.Linear, int]]:
    """{module name: (linear, rank)} for every linear to factor; a rank at or above full rank keeps the layer.

    A rank above out*in/(out+in) (0.73 of full rank for SmolLM2's MLP) streams more numbers than W itself:
    allowed, so that a search over ranks sees the whole curve, but it can only be slower.
    """
    layers = model.model.layers
    out = {}
    for i, r in enumerate(layer_ranks(rank, len(layers))):
        if r is None:
            continue
        for name, module in layers[i].named_modules():
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
                k = resolve_rank(r, tuple(module.weight.shape))
                if k < min(module.weight.shape):
                    out[f"model.layers.{i}.{name}"] = (module, k)
    return out


@torch.inference_mode()
def calibration_tokens(model, n: int = CALIBRATION_TOKENS, seed: int = 0) -> list[int]:
    """`n` tokens the target samples from its BOS token: in-distribution text without a data set."""
    from specchat.engine.cache import forward_logits, new_cache

    bos = model.config.bos_token_id
    bos = bos[0] if isinstance(bos, list) else bos
    tokens = [bos if bos is not None else 0]
    generator = torch.Generator(device=model.device).manual_seed(seed)
    cache, feed = new_cache(model), tokens
    for _ in range(n - 1):
        probs = torch.softmax(forward_logits(model, cache, feed, keep=1)[-1].float(), -1)  # [V]
        feed = [int(torch.multinomial(probs, 1, generator=generator))]
        tokens += feed
    return tokens


@torch.inference_mode()
def input_grams(model, modules: dict[str, torch.nn.Module], tokens: list[int]) -> dict[str, torch.Tensor]:
    """X^T X / n of each module's inputs over one forward of `tokens`: {name: [in, in]} float32."""
    grams, hooks = {}, []
    for name, module in modules.items():
        def hook(mod, args, name=name):
            x = args[0].float().reshape(-1, args[0].shape[-1])  # [S, in]
            grams[name] = x.T @ x / x.shape[0]
        hooks.append(module.register_forward_pre_hook(hook))
    try:
        model(input_ids=torch.tensor([tokens], device=model.device), use_cache=False, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    return grams


def factorize(weight: torch.Tensor, rank: int, gram: torch.Tensor, damp: float = 1e-2) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated SVD that minimises the error on the calibration inputs, W [out, in] ~ A [out, r] @ B [r, in].

    With X^T X = L L^T (damped: fewer calibration tokens than input features), the best rank-r
    approximation of W X is that of W L (SVD-LLM's whitening): W L = U S V^T, A = U_r S_r, B = V_r^T L^-1.
    A plain SVD of W spends the rank on directions the inputs never use: on SmolLM2-135M it keeps almost
    no greedy agreement at half rank (0.02, against 0.25 whitened).
    """
    gram = gram.float()
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    chol = torch.linalg.cholesky(gram + damp * gram.diagonal().mean().clamp_min(1e-8) * eye)  # [in, in] lower
    u, s, vh = torch.linalg.svd(weight.float() @ chol, full_matrices=False)  # [out, m], [m], [m, in]
    b = torch.linalg.solve_triangular(chol, vh[:rank], upper=False, left=False)  # [r, in] = V_r^T L^-1
    return (u[:, :rank] * s[:rank]).contiguous(), b.contiguous()


def fingerprint(model) -> str:
    """Cheap content hash: a few weight sums, so that retrained weights at the same path are not mistaken."""
    layer = model.model.layers[0]
    sums = [float(p.float().sum()) for p in (*layer.parameters(), model.get_output_embeddings().weight)]
    return hashlib.sha1(json.dumps(sums).encode()).hexdigest()[:8]


class FactorStore(Protocol):
    """Where computed factors are kept between runs (specchat.store.TensorStore on disk)."""

    def load(self, key: str) -> dict[str, torch.Tensor] | None: ...

    def save(self, key: str, tensors: dict[str, torch.Tensor]) -> None: ...


def factors_key(model, chosen: dict, calibration: int) -> str:
    """Names the factors of these weights, layers, ranks and calibration length."""
    config = model.config
    spec = json.dumps([FORMAT, calibration, sorted((n, r) for n, (_, r) in chosen.items()), fingerprint(model)])
    return f"{config.model_type}-{config.num_hidden_layers}x{config.hidden_size}-{hashlib.sha1(spec.encode()).hexdigest()[:12]}"


@torch.no_grad()
def load_or_compute_factors(model, chosen: dict, calibration: int = CALIBRATION_TOKENS, store: FactorStore | None = None) -> dict[str, torch.Tensor]:
    """{"<name>.a": [out, r], "<name>.b": [r, in]} float32, from `store` or computed (and saved there)."""
    key = factors_key(model, chosen, calibration)
    cached = store.load(key) if store is not None else None
    if cached is not None:
        return cached
    grams = input_grams(model, {n: m for n, (m, _) in chosen.items()}, calibration_tokens(model, calibration))
    factors = {}
    for name, (module, r) in chosen.items():
        factors[f"{name}.a"], factors[f"{name}.b"] = factorize(module.weight, r, grams.pop(name))
    if store is not None:
        store.save(key, factors)
    return factors


@torch.no_grad()
def low_rank_copy(model, chosen: dict, calibration: int = CALIBRATION_TOKENS, store: FactorStore | None = None):
    """(draft model, extra bytes): a copy of `model` sharing all weights except the `chosen` linears, factored."""
    factors = load_or_compute_factors(model, chosen, calibration, store)
    draft = shared_copy(model)
    dtype, device = model.get_output_embeddings().weight.dtype, model.device
    extra = 0
    for name, (module, _) in chosen.items():
        parent_name, attr = name.rsplit(".", 1)
        a, b = (factors[f"{name}.{x}"].to(device, dtype) for x in "ab")
        setattr(draft.get_submodule(parent_name), attr, LowRankLinear(a, b, module.bias))
        extra += (a.numel() + b.numel()) * a.element_size()
    return draft.eval(), extra


def lean_draft(target, draft, chosen) -> Runner | None:
    """The target's lean runner with the factored layers' MLPs taken from the draft copy, when only MLP projections
    are factored (the default) and the target runs lean; else None (the copy keeps HF's forward)."""
    runner = lean_runner(target)
    if runner is None or any(name.rsplit(".", 1)[-1] not in ("gate_proj", "up_proj", "down_proj") for name in chosen):
        return None
    layers = sorted({int(name.split(".")[2]) for name in chosen})  # "model.layers.<i>.mlp.<proj>"
    return runner.with_mlps({i: draft.model.layers[i].mlp for i in layers})


class LowRankDrafter(CopyDrafter):
    name = "lowrank"
    shares_target_cache = True  # where it runs on the lean runner

    @classmethod
    def build(
        cls, target, draft=None, *, rank=None, lowrank_targets=None, calibration: int = CALIBRATION_TOKENS,
        factor_store: FactorStore | None = None, **options,
    ) -> "LowRankDrafter":
        if not hasattr(getattr(target, "model", None), "layers"):
            raise ModeUnavailable(f"mode 'lowrank' needs a decoder with model.layers; {type(target).__name__} has none")
        if rank is None:
            rank = DEFAULT_RANK
        targets = tuple(lowrank_targets or DEFAULT_TARGETS)
        try:
            chosen = chosen_linears(target, rank, targets)
        except (TypeError, ValueError) as e:
            raise ModeUnavailable(f"--rank {rank!r}: {e}") from None
        if not chosen:
            raise ModeUnavailable(f"--rank {rank!r} factors no layer (at full rank every layer keeps its weights)")
        model, extra = low_rank_copy(target, chosen, calibration, factor_store)
        return cls(model, rank=rank, extra_bytes=extra, n_factored=len(chosen), lean=lean_draft(target, model, chosen))

    def __init__(self, model, *, rank, extra_bytes: int = 0, n_factored: int = 0, lean: Runner | None = None) -> None:
        super().__init__(model, lean=lean)
        self.rank, self.n_factored = rank, n_factored
        self.weight_bytes = extra_bytes

