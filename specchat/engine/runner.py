"""The lean target runner: a plain-function forward over a loaded HF model's own weights (gpt-fast's style).

For the decoder families users run here -- Llama (SmolLM2, Llama 3.x), Qwen2/2.5 (q/k/v biases), Qwen3
(per-head q/k RMSNorm), Mistral without a sliding window -- one forward is: embed, per layer RMSNorm ->
one fused QKV matmul -> RoPE from precomputed tables -> write K/V in place into a KVCache
(engine/cache.py) -> SDPA -> o_proj -> RMSNorm -> one fused gate/up matmul -> act * up -> down_proj,
then the final norm and the LM head on the positions asked for only. Every other model (and any
config this file does not reproduce exactly: sliding windows, dynamic/longrope RoPE, unusual modules)
keeps HF's forward: `lean_runner` returns None and TargetState takes the HF path.

No weight is copied: the QKV and gate/up matrices are fused once into one tensor per layer and the HF
modules' parameters are replaced by row views into it (rows of a contiguous matrix are contiguous),
so the HF forward, Decoder and every drafter built from the target's modules read the same memory.
`model.to(...)` or loading new weights afterwards replaces those parameters; build a new runner then
(a runner found already fused reuses the fused tensors).

RoPE cos/sin come from the model's own rotary embedding module (so every static rope type --
default, linear, llama3, yarn -- and its attention scaling match HF exactly), evaluated once for a
table of positions that grows with the cache.

Where the fused kernel is loaded, a layer over at most 16 rows of float32 runs as one C call instead of ~20 eager
ops (smallbatch.layer: the same arithmetic, rows independent of each other; within float32 rounding of the
PyTorch layer, which runs everything else: longer prompts, bfloat16, other activations, batched rows).

Per-layer entry points (`embed`, `run` over any subset of layers at a given past length, `logits`)
serve the self-speculative drafters (layerskip, earlyexit) and tune; they have Decoder's signatures.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F

from specchat.engine import smallbatch
from specchat.engine.cache import CHUNK, KVCache
from specchat.engine.smallbatch import MAX_ROWS, draft_weights, linear

FAMILIES = {"llama", "qwen2", "qwen3", "mistral"}
STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # inv_freq fixed at init (dynamic and longrope change with length)
EMBEDDED_FLOATS = 4_000_000  # a GGUF embedding's rows kept dequantised: 16 MB at most


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalise in float32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE, HF's rotate_half convention: x * cos + cat(-x2, x1) * sin, written as x * cos + cat(x2, x1) *
    cat(-sin1, sin2) (the same products, bit for bit). x [B, S, H, hd]; cos, sin_signed [1 or B, S, 1, hd]."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def unsupported(model) -> str | None:
    """Why the lean runner cannot reproduce this model's forward exactly, or None when it can."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        return f"{type(model).__name__} ({kind}) is not a Llama/Qwen2/Qwen3/Mistral decoder"
    inner = getattr(model, "model", None)
    parts = [getattr(inner, name, None) for name in ("embed_tokens", "layers", "norm", "rotary_emb")]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if any(p is None for p in parts) or type(head) is not torch.nn.Linear or head.bias is not None:
        return "unexpected module layout"
    if "sliding_attention" in (getattr(config, "layer_types", None) or []) or (kind == "mistral" and getattr(config, "sliding_window", None)):
        return "sliding-window attention"
    rope_type = getattr(parts[3], "rope_type", None)
    if not isinstance(rope_type, str) or rope_type not in STATIC_ROPE:  # a dict: per-layer-type rope
        return f"rope type {rope_type!r}"
    if not parts[0].weight.is_floating_point():
        return "non-floating-point weights"
    for layer in parts[1]:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(m) is not torch.nn.Linear for m in linears):  # quantized or patched layers keep HF's path
            return "non-standard linear layers"
        if len({m.bias is None for m in linears[:3]}) > 1 or len({m.bias is None for m in linears[4:6]}) > 1:
            return "mixed biases"
        if getattr(attn, "sliding_window", None):
            return "sliding-window attention"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, *(getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n))):
            if not hasattr(norm, "variance_epsilon") or getattr(norm, "weight", None) is None:
                return "unexpected norm layers"
    return None


def fuse_rows(linears: list[torch.nn.Linear], name: str) -> torch.Tensor | None:
    """One tensor holding the modules' `name` ("weight" or "bias") stacked along dim 0, the modules'
    parameters becoming views into it. Already fused (adjacent views of one storage): reused as is."""
    with torch.inference_mode(False), torch.no_grad():  # parameters must stay ordinary tensors
        return _fuse_rows(linears, name)


def _fuse_rows(linears: list[torch.nn.Linear], name: str) -> torch.Tensor | None:
    params = [getattr(m, name) for m in linears]
    if params[0] is None:
        return None
    first, rows = params[0], sum(p.shape[0] for p in params)
    shape = (rows, *first.shape[1:])
    offset, adjacent = first.storage_offset(), True
    for p in params:
        adjacent &= p.is_contiguous() and p.dtype == first.dtype and p.device == first.device
        adjacent &= p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and p.storage_offset() == offset
        offset += p.numel()
    if adjacent:
        return first.as_strided(shape, first.stride(), first.storage_offset())
    fused = torch.cat([p.detach() for p in params])  # the one new allocation; the old parameters are freed below
    start = 0
    for m, p in zip(linears, params):
        setattr(m, name, torch.nn.Parameter(fused[start : start + p.shape[0]], requires_grad=p.requires_grad))
        start += p.shape[0]
    return fused


@dataclass
class Block:
    """One decoder layer's tensors (views of the HF parameters) and constants."""

    ln1: torch.Tensor  # [D]
    ln2: torch.Tensor  # [D]
    eps: float
    qkv_w: torch.Tensor  # [(H + 2 H_kv) hd, D]
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None  # [hd] (Qwen3)
    k_norm: torch.Tensor | None
    qk_eps: float
    o_w: torch.Tensor  # [D, H hd]
    o_b: torch.Tensor | None
    gate_up_w: torch.Tensor  # [2 I, D]
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor  # [D, I]
    down_b: torch.Tensor | None
    act: object  # the MLP's own activation module
    mlp: object = None  # when set, a module that replaces gate/up/down (a low-rank draft's MLP, drafters/lowrank.py)


class Runner:
    """Embed / layers / head of a supported causal LM as plain functions over its weights."""

    def __init__(self, model) -> None:
        config, inner = model.config, model.model
        attn0 = inner.layers[0].self_attn
        shape = Shape(config.num_attention_heads, config.num_key_value_heads, attn0.head_dim, attn0.scaling)
        embed_w = inner.embed_tokens.weight  # [V, D]
        self._setup(inner.rotary_emb, embed_w, inner.norm.weight, inner.norm.variance_epsilon,
                    model.get_output_embeddings().weight, [self._block(layer) for layer in inner.layers], shape,
                    embed_w.dtype, embed_w.device)
        self.model = model

    @classmethod
    def of_weights(cls, rotary_emb, embed_w, norm_w, norm_eps: float, head_w, blocks: list[Block], shape: "Shape") -> "Runner":
        """A runner on weights that no HF model holds (a GGUF file read in place, engine/gguf_model.py): float32 on
        the CPU; `model` is None."""
        runner = cls.__new__(cls)
        runner._setup(rotary_emb, embed_w, norm_w, norm_eps, head_w, blocks, shape, torch.float32, torch.device("cpu"))
        runner.model = None
        return runner

    def _setup(self, rotary_emb, embed_w, norm_w, norm_eps, head_w, blocks, shape, dtype, device) -> None:
        self.rotary_emb = rotary_emb
        self.embed_w = embed_w  # [V, D], or a GGUF file's blocks (rows looked up as needed)
        self.norm_w, self.norm_eps = norm_w, norm_eps
        self.head_w = head_w  # [V, D]; the same tensor as embed_w when tied
        self.shape = shape
        self.head_dim, self.n_heads, self.n_kv_heads = shape.head_dim, shape.n_heads, shape.n_kv_heads
        self.n_rep, self.scale = shape.n_rep, shape.scale
        self.dtype, self.device = dtype, device
        self.blocks = blocks
        self.n_layers = len(blocks)
        self.cos = self.sin = torch.empty(0, self.head_dim, dtype=dtype, device=device)  # [P, hd]
        self._fused, self._fused_for = None, None  # the C layers' weights, and the blocks they were built for
        self._layer_args: dict[tuple, smallbatch.LayerArgs] = {}  # their pointers, by the layers a forward runs
        self._head, self._head_for = None, None  # the C final norm and LM head, and the head matrix they were built for
        self._embedded: dict[int, torch.Tensor] = {}  # rows of a file's embedding, dequantised: [1, 1, D] by id

    @staticmethod
    def _block(layer) -> Block:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        return Block(
            ln1=layer.input_layernorm.weight,
            ln2=layer.post_attention_layernorm.weight,
            eps=layer.input_layernorm.variance_epsilon,
            qkv_w=fuse_rows(qkv, "weight"),
            qkv_b=fuse_rows(qkv, "bias"),
            q_norm=q_norm.weight if q_norm is not None else None,
            k_norm=k_norm.weight if k_norm is not None else None,
            qk_eps=q_norm.variance_epsilon if q_norm is not None else 0.0,
            o_w=attn.o_proj.weight,
            o_b=attn.o_proj.bias,
            gate_up_w=fuse_rows(gate_up, "weight"),
            gate_up_b=fuse_rows(gate_up, "bias"),
            down_w=mlp.down_proj.weight,
            down_b=mlp.down_proj.bias,
            act=mlp.act_fn,
        )

    def with_mlps(self, mlps: dict[int, torch.nn.Module]) -> "Runner":
        """This runner with layer i's MLP replaced by mlps[i] (a module over [1, S, D]); every other weight, and the
        RoPE tables, shared. A low-rank draft runs this way instead of through HF's forward."""
        other = copy.copy(self)
        other.blocks = [dataclasses.replace(b, mlp=mlps[i]) if i in mlps else b for i, b in enumerate(self.blocks)]
        other._layer_args = {}
        return other

    def with_weights(self, convert) -> "Runner":
        """This runner with every matrix (QKV, o, gate/up, down, LM head) replaced by convert(matrix) and everything
        else shared (embedding, norms, biases, RoPE tables): the target's own weights at a lower precision, for a
        draft (`streamed`, mode quant). The model's own weights stay as they are."""
        blocks = [dataclasses.replace(b, qkv_w=convert(b.qkv_w), o_w=convert(b.o_w), gate_up_w=convert(b.gate_up_w),
                                      down_w=convert(b.down_w)) for b in self.blocks]
        return self.with_matrices(blocks, convert(self.head_w))

    def with_matrices(self, blocks: list[Block], head_w) -> "Runner":
        """This runner with these blocks and LM head, everything else shared (the C layers' weights built anew)."""
        other = copy.copy(self)
        other.blocks, other.head_w = blocks, head_w
        other._fused = other._fused_for = None
        other._head = other._head_for = None
        other._layer_args = {}
        return other

    def streamed(self) -> "Runner":
        """This runner for a draft model: its matrices as `linear` streams them fastest (bfloat16 copies on the CPU,
        smallbatch.draft_weights: half the bytes a draft step reads; the copies add half the model's size)."""
        return self.with_weights(draft_weights)

    # ------------------------------------------------------------ state
    def new_cache(self, rows: int = 1) -> KVCache:
        """A KV cache for this runner: float16 on a GGUF file's blocks (a step after a long context re-reads every
        key and value, evicted by the weights' stream: half the bytes, as llama.cpp keeps them), else the model's
        dtype."""
        dtype = torch.float16 if self.reads_blocks else self.dtype
        return KVCache(self.n_layers, self.n_kv_heads, self.head_dim, dtype, self.device, rows)

    @property
    def vocab_size(self) -> int:
        return self.head_w.shape[0]

    def rope(self, past: int, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed [1, S, 1, hd] for positions past..past+S-1 (see `rotate`), from tables the model's own
        rotary embedding fills CHUNK positions at a time."""
        end = past + q_len
        if self.cos.shape[0] < end:
            positions = torch.arange(-(-end // CHUNK) * CHUNK, device=self.device)[None]  # [1, P]
            carrier = torch.zeros(1, 1, 1, dtype=self.dtype, device=self.device)  # (the module reads its dtype and device)
            cos, sin = self.rotary_emb(carrier, position_ids=positions)  # each [1, P, hd], model dtype
            half = self.head_dim // 2
            self.cos, self.sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        return self.cos[past:end][None, :, None], self.sin[past:end][None, :, None]

    @staticmethod
    def mask(q_len: int, past: int, device: torch.device) -> torch.Tensor:
        """[S, past + S] bool, True where query past+i may attend key j (j <= past + i)."""
        q_pos = torch.arange(past, past + q_len, device=device)[:, None]  # [S, 1]
        k_pos = torch.arange(past + q_len, device=device)[None, :]  # [1, past + S]
        return k_pos <= q_pos

    # ------------------------------------------------------------ entry points
    @torch.inference_mode()
    def embed(self, ids: list[int]) -> torch.Tensor:
        """[S] ids -> [1, S, D]."""
        if isinstance(self.embed_w, smallbatch.GGUFWeights):
            if 0 < len(ids) <= MAX_ROWS:  # a decode step or a verify: each id's row dequantised once (the gguf package's call is slow)
                return torch.cat(self._embedded_rows(ids), dim=1)  # [1, S, D], the caller's to change
            return self.embed_w.rows(torch.tensor([ids]))[None]
        return F.embedding(torch.tensor([ids], dtype=torch.long, device=self.device), self.embed_w)

    def _embedded_rows(self, ids: list[int]) -> list[torch.Tensor]:
        """[1, 1, D] each: the tokens' embedding rows from the file's blocks, kept (up to EMBEDDED_FLOATS floats in
        all); the rows not kept yet dequantised in one call (the gguf package's call costs more than its rows)."""
        missing = [i for i in dict.fromkeys(ids) if i not in self._embedded]
        if missing and (len(self._embedded) + len(missing)) * self.embed_w.shape[1] > EMBEDDED_FLOATS:
            self._embedded.clear()
            missing = list(dict.fromkeys(ids))
        if missing:
            rows = self.embed_w.rows(torch.tensor(missing))  # [M, D]
            self._embedded.update((i, rows[j : j + 1][None]) for j, i in enumerate(missing))  # [1, 1, D] each
        return [self._embedded[i] for i in ids]

    @torch.inference_mode()
    def run(self, hidden: torch.Tensor, layer_ids: Iterable[int], cache: KVCache | None, past: int) -> torch.Tensor:
        """[1, S, D] -> [1, S, D] through `layer_ids`, each writing its K/V at positions past..past+S-1 of
        `cache` (which must hold at least `past` positions in those layers). cache=None: no past, nothing kept."""
        q_len = hidden.shape[1]
        if cache is None and past:
            raise ValueError("without a cache there is no past to attend to")
        if q_len > MAX_ROWS and self.reads_blocks and self._fused_layers(hidden[:, :1], cache) is not None:
            # a prompt on a file's blocks: MAX_ROWS positions at a time through the C layers, so each gets the bits
            # it gets fed alone (PyTorch's layers round differently, and x's rounding to int8 makes that visible: a
            # mode that feeds the prompt's last token again, earlyexit, decoded other replies than plain decoding);
            # also faster than PyTorch's layers on blocks. On float32 weights PyTorch's GEMM is faster: it keeps those.
            layer_ids = list(layer_ids)
            return torch.cat([self.run(hidden[:, s : s + MAX_ROWS], layer_ids, cache, past + s)
                              for s in range(0, q_len, MAX_ROWS)], dim=1)
        cos, sin = self.rope(past, q_len)
        fused = self._fused_layers(hidden, cache)
        mask = None
        if q_len > 1 and past > 0 and (fused is None or None in fused):  # an offset causal mask, shared by the packed GQA rows
            mask = self.mask(q_len, past, hidden.device).repeat(self.n_rep, 1)  # [n_rep S, past + S]
        if fused is not None:
            hidden = hidden.clone(memory_format=torch.contiguous_format)  # the C layers update it in place; the caller's stays
            ids = list(layer_ids)
            if all(fused[i] is not None for i in ids):  # every layer in C: one call
                kv = [cache.reserve(i, past, q_len) for i in ids]  # [1, H_kv, capacity, hd] each
                args = self._layer_args.setdefault(tuple(ids), smallbatch.LayerArgs())
                smallbatch.layers([fused[i] for i in ids], hidden, cos[0, :, 0], sin[0, :, 0], kv, past, args)
                return hidden
            layer_ids = ids
        for i in layer_ids:
            hidden = self.layer(i, hidden, cache, past, cos, sin, mask, fused)
        return hidden

    @property
    def reads_blocks(self) -> bool:
        """Whether the matrices are a GGUF file's blocks (smallbatch.GGUFWeights), read as llama.cpp does."""
        return isinstance(self.blocks[0].qkv_w, (smallbatch.GGUFWeights, smallbatch.GGUFStack)) if self.blocks else False

    def _fused_layers(self, hidden: torch.Tensor, cache) -> "list | None":
        """Per layer, the C layer's weights (None: that layer runs in PyTorch), or None when no layer runs in C for
        this call: the kernel not loaded, not float32 on the CPU, batched rows, more than MAX_ROWS rows, no KVCache."""
        if not (
            smallbatch.layer_usable() and isinstance(cache, KVCache) and cache.rows == 1 and cache.dtype in smallbatch.KV_KINDS
            and hidden.dtype == torch.float32 and hidden.device.type == "cpu" and hidden.shape[0] == 1
            and 1 <= hidden.shape[1] <= MAX_ROWS and not torch.is_grad_enabled()
        ):
            return None
        if self._fused_for is not self.blocks:  # built once per set of blocks (with_weights/with_mlps copies have their own)
            self._fused = [smallbatch.layer_weights(b, self.shape) for b in self.blocks]
            self._fused_for = self.blocks
        return self._fused

    def _head_weights(self) -> "smallbatch.LayerWeights | None":
        """The final norm and LM head as the C code reads them, or None where it does not (see smallbatch.head_weights)."""
        if self._head_for is not self.head_w:
            self._head = smallbatch.head_weights(self.norm_w, self.norm_eps, self.head_w)
            self._head_for = self.head_w
        return self._head if smallbatch.layer_usable() else None

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[1, S, D] -> [S, V]: final norm and LM head. In C where the C layers run (every position on its own: the
        same bits as forward_into's), else in PyTorch; on float32 weights PyTorch's GEMM keeps more than MAX_ROWS."""
        head = self._head_weights()
        if (head is not None and hidden.dtype == torch.float32 and hidden.device.type == "cpu" and hidden.shape[0] == 1
                and (hidden.shape[1] <= MAX_ROWS or self.reads_blocks) and not torch.is_grad_enabled()):
            return smallbatch.logits(head, hidden[0].contiguous(), self.vocab_size)
        return linear(rms_norm(hidden, self.norm_w, self.norm_eps), self.head_w)[0]

    @torch.inference_mode()
    def forward_into(self, ids: list[int], cache: KVCache, past: int, keep: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """`step` in one C call (smallbatch.forward), the last layer's output left in hidden [S, D] (float32,
        contiguous): logits [keep, V], the same bits as `step`'s; None (nothing run) where `run` or `logits` would not
        run wholly in C. A decode step from Python was ~20 library calls, each finding its code and data evicted by
        the weights' stream."""
        S = len(ids)
        fused = self._fused_layers(hidden[None], cache)
        head = self._head_weights() if fused is not None and None not in fused else None
        rows = self._rows(ids) if head is not None and S <= MAX_ROWS and hidden.is_contiguous() else None
        if rows is None or not fused:
            return None
        if self.cos.shape[0] < past + S:
            self.rope(past, S)
        if not (self.cos.is_contiguous() and self.sin.is_contiguous()):
            return None
        cache.reserve_all(past, S)
        args = self._layer_args.setdefault((), smallbatch.LayerArgs())
        return smallbatch.forward(fused, rows, hidden, self.cos, self.sin, cache, past, head, self.vocab_size, keep, args)

    def _rows(self, ids: list[int]) -> list[torch.Tensor] | None:
        """The embedding's rows of `ids`, [D] float32 each (views or kept rows: not to be written), or None."""
        if isinstance(self.embed_w, smallbatch.GGUFWeights):
            return [row[0, 0] for row in self._embedded_rows(ids)]
        w = self.embed_w
        if w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous():
            return None
        return [w[i] for i in ids]

    @torch.inference_mode()
    def forward(self, ids: list[int], layer_ids: Iterable[int], cache: KVCache | None, past: int, keep: int = 1) -> torch.Tensor:
        """Logits [keep, V] of the last `keep` of `ids`, fed after `past` cached positions through `layer_ids`."""
        return self.logits(self.run(self.embed(ids), layer_ids, cache, past)[:, -keep:])

    def step(self, ids: list[int], cache: KVCache, past: int, keep: int) -> torch.Tensor:
        """The whole model: logits [keep, V] of the last `keep` of `ids` fed after `past` positions."""
        return self.forward(ids, range(self.n_layers), cache, past, keep)

    # ------------------------------------------------------------ one layer
    def layer(self, i, h, cache, past, cos, sin, mask, fused=None) -> torch.Tensor:
        """Layer i on h [1, S, D]: in C where `fused` (from _fused_layers) has its weights, updating h in place."""
        if fused is not None and fused[i] is not None:
            keys, values = cache.reserve(i, past, h.shape[1])  # [1, H_kv, capacity, hd] each
            smallbatch.layer(fused[i], h, cos[0, :, 0], sin[0, :, 0], keys, values, past)
            return h
        return decoder_layer(self.blocks[i], self.shape, h, cache, i, past, cos, sin, mask)


@dataclass(frozen=True)
class Shape:
    """Attention shape constants of a decoder layer."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float

    @property
    def n_rep(self) -> int:
        return self.n_heads // self.n_kv_heads


def decoder_layer(b: Block, s: Shape, h, cache, i, past, cos, sin, mask) -> torch.Tensor:
    """One pre-norm decoder layer, [B, S, D] -> [B, S, D], writing its K/V as layer i of `cache` (None: no cache,
    plain causal attention). Differentiable outside inference mode: the draft head (drafters/head.py) trains
    through it. B > 1 (batched generation of training data, train/generate.py) takes cos/sin [B, S, 1, hd] and a
    mask [B, 1, n_rep S, past + S] of its own."""
    B, S, _ = h.shape  # [B, S, D]
    H, Hkv, hd = s.n_heads, s.n_kv_heads, s.head_dim
    x = rms_norm(h, b.ln1, b.eps)
    qkv = linear(x, b.qkv_w, b.qkv_b).view(B, S, H + 2 * Hkv, hd)  # [B, S, H + 2 H_kv, hd]
    qk, v = qkv[:, :, : H + Hkv], qkv[:, :, H + Hkv :]  # [B, S, H + H_kv, hd], [B, S, H_kv, hd]
    if b.q_norm is not None:  # Qwen3: RMSNorm over each head's vector, before RoPE
        qk = torch.cat([rms_norm(qk[:, :, :H], b.q_norm, b.qk_eps), rms_norm(qk[:, :, H:], b.k_norm, b.qk_eps)], dim=2)
    qk = rotate(qk, cos, sin)  # q and k heads in one go: they share cos/sin
    q, k, v = qk[:, :, :H], qk[:, :, H:].transpose(1, 2), v.transpose(1, 2)  # [B, S, H, hd], [B, H_kv, S, hd] x 2
    if cache is not None:
        k, v = cache.write(i, k, v, past)  # [B, H_kv, past + S, hd]
        k, v = k.to(q.dtype), v.to(q.dtype)  # a cache in another dtype (float16 on a file's blocks): read as the C layer reads it
    q = q.transpose(1, 2)  # [B, H, S, hd]
    if S == 1 or (mask is not None and s.n_rep > 1):
        # GQA packed: the n_rep query heads sharing a KV head become rows of one query block
        out = F.scaled_dot_product_attention(q.reshape(B, Hkv, s.n_rep * S, hd), k, v, attn_mask=mask, scale=s.scale)
    elif mask is not None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=s.scale)
    else:  # a chunk with no past: plain causal
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s.scale, enable_gqa=s.n_rep > 1)
    out = out.reshape(B, H, S, hd).transpose(1, 2).reshape(B, S, H * hd)  # [B, S, H hd]
    h = h + linear(out, b.o_w, b.o_b)
    x = rms_norm(h, b.ln2, b.eps)
    if b.mlp is not None:
        return h + b.mlp(x)
    gate, up = linear(x, b.gate_up_w, b.gate_up_b).chunk(2, dim=-1)  # [B, S, I] x 2
    return h + linear(b.act(gate) * up, b.down_w, b.down_b)


def lean_runner(model) -> Runner | None:
    """A Runner for `model`, or None when it keeps HF's forward (see `unsupported`)."""
    if unsupported(model) is not None:
        return None
    return Runner(model)
