"""Mode `head`: a small draft head trained on the target's own features (EAGLE), drafting over the target's most
frequent tokens (FR-Spec).

The head is one decoder layer of the target's family over fc([f_t ; e(x_{t+1})]), where f_t is the target's
last-layer output at position t (before its final norm) and e is the target's token embedding. Its output
is a prediction of f_{t+1}; the target's final norm and its LM head restricted to N frequent tokens turn it
into q(x_{t+2}). After the first draft the head feeds its own predicted features. Head position j therefore
reads (f_j, x_{j+1}) and proposes x_{j+2}; the head keeps a one-layer KV cache of its own.

The target's features cost nothing extra: on the lean runner every target forward keeps them
(TargetState.features), so the verify that checks one round's drafts supplies the features the next round
starts from. The rule stays exact: q is exactly the distribution each draft was sampled from, the restricted
softmax scattered into the full vocabulary (zero elsewhere).

Files: `<name>.safetensors` (the head's tensors; `vocab` is the restricted token list) and `<name>.json`
(format, the target it was trained for, its shape, the training recipe and measured acceptance). A head
trained for other weights is refused: the JSON's target fingerprint must match this target's.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers.activations import ACT2FN

from specchat.engine.cache import KVCache, common_prefix
from specchat.engine.drafters.base import Drafter, Proposal
from specchat.engine.errors import ModeUnavailable
from specchat.engine.runner import Block, Shape, Runner, decoder_layer, rms_norm, unsupported
from specchat.engine.sampling import argmax, logits_to_probs, sample
from specchat.engine.smallbatch import draft_weights, linear

FORMAT = "specchat-draft-head/1"


def fingerprint(model) -> str:
    """The target's weights, not its path: config shape plus a strided sample of three weight matrices, rounded to
    bf16 so float32 and bfloat16 loads of the same weights agree."""
    c = model.config
    digest = hashlib.sha256(f"{c.model_type}:{c.num_hidden_layers}:{c.hidden_size}:{c.vocab_size}".encode())
    weights = (model.get_input_embeddings().weight, model.model.layers[-1].mlp.down_proj.weight, model.get_output_embeddings().weight)
    for w in weights:
        flat = w.detach().reshape(-1)
        sample_ = flat[:: max(1, flat.numel() // 4096)][:4096].to(torch.bfloat16).float().cpu()
        digest.update(sample_.numpy().tobytes())
    return digest.hexdigest()[:16]


def head_spec(runner: Runner, config) -> dict:
    """The head's shape for a target: the target's layer dimensions (read from its lean runner)."""
    b = runner.blocks[0]
    return {
        "hidden_size": runner.embed_w.shape[1],
        "num_attention_heads": runner.n_heads,
        "num_key_value_heads": runner.n_kv_heads,
        "head_dim": runner.head_dim,
        "scale": runner.scale,
        "intermediate_size": b.down_w.shape[1],
        "rms_norm_eps": b.eps,
        "hidden_act": config.hidden_act,
        "attention_bias": b.qkv_b is not None,
        "qk_norm": b.q_norm is not None,
    }


class DraftHead(torch.nn.Module):
    """fc over [feature ; embedding] and one decoder layer with fused QKV and gate/up (runner.decoder_layer)."""

    def __init__(self, spec: dict, vocab_size: int) -> None:
        super().__init__()
        D, H, Hkv, hd, inter = (spec[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"))
        self.spec = spec
        self.fc = torch.nn.Linear(2 * D, D, bias=True)
        self.ln1 = torch.nn.Parameter(torch.ones(D))
        self.ln2 = torch.nn.Parameter(torch.ones(D))
        self.qkv = torch.nn.Linear(D, (H + 2 * Hkv) * hd, bias=spec["attention_bias"])
        self.o = torch.nn.Linear(H * hd, D, bias=False)
        self.gate_up = torch.nn.Linear(D, 2 * inter, bias=False)
        self.down = torch.nn.Linear(inter, D, bias=False)
        self.q_norm = torch.nn.Parameter(torch.ones(hd)) if spec["qk_norm"] else None
        self.k_norm = torch.nn.Parameter(torch.ones(hd)) if spec["qk_norm"] else None
        self.register_buffer("vocab", torch.zeros(vocab_size, dtype=torch.long))  # [N] target ids the head drafts
        self.shape = Shape(H, Hkv, hd, spec["scale"])
        self.act = ACT2FN[spec["hidden_act"]]
        for layer in (self.fc, self.qkv, self.o, self.gate_up, self.down):
            torch.nn.init.normal_(layer.weight, std=0.02)
            if layer.bias is not None:
                torch.nn.init.zeros_(layer.bias)

    def block(self) -> Block:
        eps = self.spec["rms_norm_eps"]
        return Block(ln1=self.ln1, ln2=self.ln2, eps=eps, qkv_w=self.qkv.weight, qkv_b=self.qkv.bias, q_norm=self.q_norm,
                     k_norm=self.k_norm, qk_eps=eps, o_w=self.o.weight, o_b=None, gate_up_w=self.gate_up.weight, gate_up_b=None,
                     down_w=self.down.weight, down_b=None, act=self.act)

    def streamed(self) -> "DraftHead":
        """A copy for drafting, its matrices as `linear` streams them fastest (bfloat16 on the CPU: half the bytes,
        and the shipped head's weights are bfloat16 to begin with)."""
        other = copy.deepcopy(self)
        for layer in (other.fc, other.qkv, other.o, other.gate_up, other.down):
            layer.weight = torch.nn.Parameter(draft_weights(layer.weight.detach()), requires_grad=False)
        return other

    def forward(self, features, embeddings, cache, past, cos, sin, mask=None) -> torch.Tensor:
        """features, embeddings [B, S, D] at head positions past..past+S-1 -> predicted next features [B, S, D] (B = 1
        drafting; B sequences in a training step)."""
        x = linear(torch.cat([features, embeddings], dim=-1), self.fc.weight, self.fc.bias)  # [B, S, D]
        return decoder_layer(self.block(), self.shape, x, cache, 0, past, cos, sin, mask)


def read_meta(path: Path) -> dict:
    """The JSON beside a head's tensors; ModeUnavailable (one line) when missing or unreadable."""
    meta_path = Path(path).with_suffix(".json")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise ModeUnavailable(f"cannot read the draft head's description {meta_path}: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ModeUnavailable(f"{meta_path} is not a specchat draft head ({FORMAT})")
    return meta


def load_head(path: Path, target) -> tuple[DraftHead, dict]:
    """The head stored at `path` (.safetensors, its .json beside it) for `target`, in the target's dtype and device."""
    path = Path(path).with_suffix(".safetensors")
    meta = read_meta(path)
    mine, theirs = fingerprint(target), meta.get("target", {}).get("fingerprint")
    if mine != theirs:
        raise ModeUnavailable(f"the draft head {path.name} was trained for {meta.get('target', {}).get('name', 'another model')} "
                              f"(weights {theirs}), not this target (weights {mine})")
    try:
        tensors = load_file(path)
    except Exception as e:  # a truncated or foreign file
        raise ModeUnavailable(f"cannot read the draft head {path}: {type(e).__name__}: {e}") from None
    head = DraftHead(meta["spec"], int(tensors["vocab"].shape[0]))
    try:
        head.load_state_dict(tensors)
    except RuntimeError as e:
        raise ModeUnavailable(f"the draft head {path.name} does not fit this target: {str(e).splitlines()[0]}") from None
    emb = target.get_input_embeddings().weight
    return head.to(device=emb.device, dtype=emb.dtype).requires_grad_(False).eval(), meta


class HeadDrafter(Drafter):
    name = "head"
    catches_up = True  # its cache of head positions, from the target's features

    @classmethod
    def build(cls, target, draft=None, *, head_file=None, **options) -> "HeadDrafter":
        why = unsupported(target)
        if why is not None:
            raise ModeUnavailable(f"mode head needs the lean runner: {why}")
        if head_file is None:
            raise ModeUnavailable("no draft head for this target: train one with `specchat train-head`")
        head, meta = load_head(head_file, target)
        return cls(head, target, meta)

    def __init__(self, head: DraftHead, target, meta: dict | None = None) -> None:
        self.head, self.meta = head.streamed(), meta or {}
        # a head whose later draft positions are rarely accepted records the most it should draft per round
        # (the shipped one's second position is accepted 3-6% of the time): K above it is capped
        self.max_draft = int(self.meta.get("max_draft") or 0) or None
        inner = target.model
        self.norm_w, self.norm_eps = inner.norm.weight, inner.norm.variance_epsilon
        self.vocab = self.head.vocab  # [N]
        self.head_w = draft_weights(target.get_output_embeddings().weight[self.vocab].contiguous())  # [N, D]: the LM head's frequent rows
        self.reset()

    def reset(self) -> None:
        self.cache: KVCache | None = None
        self.cached: list[int] = []  # the head cache holds head positions 0..len(cached)-2, all from the target's features

    @property
    def extra_bytes(self) -> int:
        weights = sum(p.numel() * p.element_size() for p in self.head.parameters())
        return weights + self.head_w.numel() * self.head_w.element_size()

    def q_of(self, hidden: torch.Tensor, vocab_size: int, params) -> tuple[torch.Tensor, torch.Tensor]:
        """Predicted feature [1, 1, D] -> (q [V] float32, zero outside the head's vocabulary; restricted logits [N])."""
        logits = linear(rms_norm(hidden, self.norm_w, self.norm_eps), self.head_w)[0, -1]  # [N]
        probs = logits_to_probs(logits, params)  # [N]: top-k/top-p over N equal them over V with -inf elsewhere
        return torch.zeros(vocab_size, device=probs.device).index_copy_(0, self.vocab, probs), logits

    @torch.inference_mode()
    def propose(self, state, k, params, generator) -> Proposal:
        lean, n, calls = state.lean, len(state.tokens), 0
        k = min(k, self.max_draft or k)
        if lean is None or n < 2:  # no features on the HF path; a one-token context has no feature before it
            return Proposal.empty(state.device)
        if self.cache is None:
            self.cache = KVCache(1, lean.n_kv_heads, lean.head_dim, lean.dtype, lean.device)
        if state.known < n - 1:  # features missing (another path computed those positions): recompute them once
            state.forward(state.tokens[state.known : n - 1], state.known, keep=1)
            calls += 1
        # head positions valid so far: their tokens are still the state's (a rollback or a new turn drops the rest)
        # (position n-2 is always fed again: its output, the predicted f_{n-1}, starts the draft)
        past = min(max(min(len(self.cached), common_prefix(self.cached, state.tokens)) - 1, 0), n - 2)
        self.cache.crop(past)
        feed = n - 1 - past  # head positions past..n-2, the last one reading (f_{n-2}, x_{n-1})
        mask = lean.mask(feed, past, state.device).repeat(lean.n_rep, 1) if feed > 1 and past > 0 else None
        hidden = self.head(state.features[past : n - 1][None], lean.embed(state.tokens[past + 1 : n]), self.cache, past,
                           *lean.rope(past, feed), mask)[:, -1:]  # [1, 1, D]: predicted f_{n-1}
        self.cached = state.tokens[:n]
        ids, qs = [], []
        for i in range(k):
            calls += 1
            q, logits = self.q_of(hidden, state.vocab_size, params)  # [V], [N]
            if self.p_min > 0 and float((torch.softmax(logits.float(), -1) if params.greedy else q).max()) < self.p_min:
                break
            token = int(argmax(q)) if params.greedy else int(sample(q[None], generator))
            ids.append(token)
            qs.append(q)
            if i + 1 < k:  # head position n-1+i reads (its own predicted feature, the token just drafted)
                hidden = self.head(hidden, lean.embed([token]), self.cache, n - 1 + i, *lean.rope(n - 1 + i, 1))
        if not ids:
            return Proposal.empty(state.device, calls)
        return Proposal(torch.tensor(ids, device=state.device), torch.stack(qs), calls)  # [K'], [K', V]
