"""A GGUF file read in place as the lean runner's weights (the lean engine, --engine lean): every matrix as the file's
own blocks, 16 rows interleaved at load (smallbatch.GGUFWeights.packed: the same integers and scales, about the
file's size; multiplied by gguf_linear with x rounded to int8 per block of 32, as llama.cpp does), norms and biases as
float32 views of the memory-mapped file, the embedding looked up row by row. Nothing is converted to float: a step
streams about the file's bytes, and a model that would take gigabytes as float32 starts in seconds.

Llama/SmolLM2, Qwen2/2.5 and Qwen3 files; anything else (another architecture, RoPE scaling, a tensor type the kernel
does not take) is refused in one line (`Unreadable`) and keeps the other engines.
"""

from __future__ import annotations

import dataclasses
import mmap
import warnings
import weakref
from pathlib import Path

import numpy as np
import torch

from specchat.engine import gguf_header
from specchat.engine import smallbatch
from specchat.engine.runner import Block, Runner, Shape

FAMILIES = {"llama", "qwen2", "qwen3"}  # GGUF's architecture names, transformers' model types
REQUIRED = ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
FLOATS = {0: np.float32, 1: np.float16}  # ggml's F32 and F16 (F16 matrices and vectors become float32 copies)


class Unreadable(ValueError):
    """Why the lean runner cannot read a file in place, in one line for the user."""


class GGUFFile:
    """A GGUF file's tensors as numpy views of its memory map, by name; `interleaved`: matrices with 16 rows
    interleaved for the kernel (GGUFWeights.packed: a copy made at load, about the file's size, whose extra positions
    in a verify cost a fraction of a step; the file's pages are then dropped)."""

    def __init__(self, path: str | Path, interleaved: bool = True) -> None:
        self.path = Path(path)
        self.interleaved = interleaved
        self.header = gguf_header.read(self.path)
        self.arch = self.header.metadata.get("general.architecture")
        with open(self.path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self.map, dtype=np.uint8)

    def release(self, offset: int, size: int) -> None:
        """Drop the file's pages in [offset, offset + size) from this process's memory (they stay in the page cache,
        and come back if read again)."""
        start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (offset + size) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start and hasattr(mmap, "MADV_DONTNEED"):
            self.map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def meta(self, key: str, default=None):
        """The architecture's own key (`block_count` -> `qwen2.block_count`)."""
        return self.header.metadata.get(f"{self.arch}.{key}", default)

    def has(self, name: str) -> bool:
        return name in self.header.tensors

    def vector(self, name: str) -> torch.Tensor | None:
        """A norm or bias [n] float32 (a view of the file for F32), or None where the file has none."""
        info = self.header.tensors.get(name)
        if info is None:
            return None
        if info.type not in FLOATS:
            raise Unreadable(f"{self.path.name}: {name} is {type_name(info.type)}, not a float vector")
        n = int(np.prod(info.shape))
        values = self.data[info.offset : info.offset + n * np.dtype(FLOATS[info.type]).itemsize].view(FLOATS[info.type])
        return _tensor(values) if info.type == 0 else torch.from_numpy(values.astype(np.float32))

    def matrix(self, name: str, heads: int | None = None, multiplied: bool = True) -> "smallbatch.GGUFWeights | torch.Tensor | None":
        """Matrix [N, D]: its blocks in place (a type gguf_linear takes), a float32 view (F32) or copy (F16), or None
        where the file has none. A llama file's Q/K rows (`heads` given) are put back from llama.cpp's interleaved
        RoPE order, as transformers' loader does (a copy of those rows). `multiplied=False`: a matrix only looked up
        (an embedding beside its own LM head) is not interleaved, so it costs no copy."""
        info = self.header.tensors.get(name)
        if info is None:
            return None
        if len(info.shape) != 2:
            raise Unreadable(f"{self.path.name}: {name} has shape {info.shape}, not a matrix")
        d, n = info.shape  # GGUF lists the innermost first
        kind = type_name(info.type)
        if info.type in FLOATS:
            size = np.dtype(FLOATS[info.type]).itemsize
            values = self.data[info.offset : info.offset + n * d * size].view(FLOATS[info.type]).reshape(n, d)
            w = _tensor(values) if info.type == 0 else torch.from_numpy(values.astype(np.float32))
        elif kind in smallbatch.GGUF_TYPES:
            block, nbytes = _quant_size(info.type)
            if d % block:
                raise Unreadable(f"{self.path.name}: {name}'s rows of {d} are not whole {kind} blocks")
            size = n * d // block * nbytes
            w = smallbatch.GGUFWeights(_tensor(self.data[info.offset : info.offset + size].reshape(n, -1)), kind, (n, d))
            if not smallbatch.gguf_usable(w):
                raise Unreadable(f"the C kernel that multiplies {kind} blocks is not loaded (no C compiler?)")
            if self.interleaved and multiplied:
                w = _unpermute(w, heads) if heads and self.arch == "llama" else w
                packed = w.packed()
                self.release(info.offset, size)  # the kernel reads the copy; an embedding lookup pages rows back in
                return packed
        else:
            raise Unreadable(f"{self.path.name}: {name} is {kind}; the lean runner reads {', '.join(smallbatch.GGUF_TYPES)}, F32 and F16")
        if heads and self.arch == "llama":
            w = _unpermute(w, heads)
        return w


def header_problem(path: str | Path) -> str | None:
    """Why load_runner would refuse `path`, from its header alone (no tensor read, no packing), or None: what auto
    asks before it measures the engines (choose_engine.py)."""
    try:
        header = gguf_header.read(Path(path))
    except (OSError, ValueError) as e:
        return str(e)
    arch = header.metadata.get("general.architecture")
    if arch not in FAMILIES:
        return f"a {arch} model"
    if header.metadata.get(f"{arch}.rope.scaling.type", "none") not in ("none", None) or "rope_freqs.weight" in header.tensors:
        return "RoPE scaling"
    if any(f"blk.0.{name}.weight" not in header.tensors for name in REQUIRED) or "token_embd.weight" not in header.tensors:
        return "not a decoder laid out as the lean runner reads it"
    if other := sorted({t.type for t in header.tensors.values()} - set(FLOATS) - set(smallbatch.GGUF_TYPES.values())):
        return f"tensor type {type_name(other[0])}"
    return None


def type_name(kind: int) -> str:
    import gguf

    return next((t.name for t in gguf.GGMLQuantizationType if t == kind), f"type {kind}")


def _quant_size(kind: int) -> tuple[int, int]:
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]  # (weights, bytes) a block


def _tensor(values: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only memory map: only ever read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(values)


def _unpermute(w, heads: int):
    """GGUF row j holds HF row order[j] (llama.cpp's convert interleaves each head's two RoPE halves)."""
    n = w.shape[0]
    order = torch.arange(n).reshape(heads, 2, -1).swapaxes(1, 2).reshape(-1)
    rows = torch.argsort(order)
    if isinstance(w, smallbatch.GGUFWeights):
        return smallbatch.GGUFWeights(w.blocks[rows], w.type, w.shape)
    return w[rows]


def stacked(parts: list):
    """[q; k; v] or [gate; up] as the C layer reads them: the file's blocks side by side, or one float32 matrix."""
    if all(isinstance(p, smallbatch.GGUFWeights) for p in parts):
        return smallbatch.GGUFStack(tuple(parts))
    return torch.cat([p.float() if isinstance(p, (smallbatch.GGUFWeights, smallbatch.GGUFStack)) else p for p in parts])


def rotary_embedding(file: GGUFFile, head_dim: int):
    """The family's own HF rotary module, built from the file's RoPE base (so the tables are HF's to the bit)."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    if file.meta("rope.scaling.type", "none") not in ("none", None) or file.has("rope_freqs.weight"):
        raise Unreadable(f"{file.path.name}: RoPE scaling is not read in place yet")
    config = AutoConfig.for_model(
        file.arch, hidden_size=file.meta("embedding_length"), num_attention_heads=file.meta("attention.head_count"),
        num_key_value_heads=file.meta("attention.head_count_kv"), head_dim=head_dim,
        rope_theta=float(file.meta("rope.freq_base", 10000.0)), max_position_embeddings=file.meta("context_length", 4096),
    )
    rotary = {"llama": LlamaRotaryEmbedding, "qwen2": Qwen2RotaryEmbedding, "qwen3": Qwen3RotaryEmbedding}[file.arch]
    return rotary(config=config)


def load_runner(path: str | Path, interleaved: bool = True) -> Runner:
    """The lean runner on the file's own blocks, read in place (Unreadable: why it cannot be); `interleaved=False`
    multiplies them in the file's layout (no copy; benchmarks compare the two)."""
    file = GGUFFile(path, interleaved)
    if file.arch not in FAMILIES:
        raise Unreadable(f"{file.path.name} is a {file.arch} model; the lean runner reads {', '.join(sorted(FAMILIES))}")
    needed = ["token_embd.weight", "output_norm.weight"] + [f"blk.0.{n}.weight" for n in REQUIRED]
    if missing := [n for n in needed if not file.has(n)]:
        raise Unreadable(f"{file.path.name} has no {missing[0]}: not a decoder laid out as the lean runner reads it")
    heads, kv_heads = int(file.meta("attention.head_count")), int(file.meta("attention.head_count_kv", file.meta("attention.head_count")))
    width = int(file.meta("embedding_length"))
    head_dim = int(file.meta("attention.key_length", 0) or file.meta("rope.dimension_count", 0) or width // heads)
    eps = float(file.meta("attention.layer_norm_rms_epsilon"))
    shape = Shape(heads, kv_heads, head_dim, head_dim**-0.5)
    act = torch.nn.SiLU()  # what these families' MLPs use
    blocks = []
    for i in range(int(file.meta("block_count"))):
        at = f"blk.{i}."
        qkv_b = [file.vector(at + f"attn_{x}.bias") for x in "qkv"]
        if file.arch == "llama" and qkv_b[0] is not None:
            qkv_b = [_unpermute(qkv_b[0], heads), _unpermute(qkv_b[1], kv_heads), qkv_b[2]]
        blocks.append(Block(
            ln1=file.vector(at + "attn_norm.weight"), ln2=file.vector(at + "ffn_norm.weight"), eps=eps,
            qkv_w=stacked([file.matrix(at + "attn_q.weight", heads), file.matrix(at + "attn_k.weight", kv_heads), file.matrix(at + "attn_v.weight")]),
            qkv_b=None if qkv_b[0] is None else torch.cat(qkv_b),
            q_norm=file.vector(at + "attn_q_norm.weight"), k_norm=file.vector(at + "attn_k_norm.weight"), qk_eps=eps,
            o_w=file.matrix(at + "attn_output.weight"), o_b=file.vector(at + "attn_output.bias"),
            gate_up_w=stacked([file.matrix(at + "ffn_gate.weight"), file.matrix(at + "ffn_up.weight")]), gate_up_b=None,
            down_w=file.matrix(at + "ffn_down.weight"), down_b=None, act=act,
        ))
    embed = file.matrix("token_embd.weight", multiplied=not file.has("output.weight"))
    head = file.matrix("output.weight") if file.has("output.weight") else embed  # tied: the embedding's own blocks
    return Runner.of_weights(rotary_embedding(file, head_dim), embed, file.vector("output_norm.weight"), eps, head, blocks, shape)


def draft_runner(runner: Runner) -> Runner:
    """`runner` for drafting: its LM head read from its embedding where the file holds one matrix twice (a tied model
    whose output.weight the quantiser kept at a higher precision, as Q4_K_M files do) and the embedding has the fewer
    bytes to stream. A draft is a model of its own and q what it computed, so the rule stays exact; the target keeps
    the file's head."""
    if runner not in _drafts:
        embed, head = runner.embed_w, runner.head_w
        lighter = (embed is not head and isinstance(embed, smallbatch.GGUFWeights) and isinstance(head, smallbatch.GGUFWeights)
                   and embed.shape == head.shape and embed.blocks.numel() < head.blocks.numel() and _same_matrix(embed, head))
        _drafts[runner] = runner.with_matrices(runner.blocks, embed.packed()) if lighter else None
    return _drafts[runner] or runner


# a runner's draft runner (None: itself), so the embedding is interleaved once; never the key itself (it would live on)
_drafts: "weakref.WeakKeyDictionary[Runner, Runner | None]" = weakref.WeakKeyDictionary()


def _same_matrix(a: "smallbatch.GGUFWeights", b: "smallbatch.GGUFWeights", rows: int = 64) -> bool:
    """Whether two quantisations hold one matrix: rows spread over it, dequantised, differ by under half their norm
    (two quantisations of one matrix: a few percent; two different matrices: ~1.4)."""
    ids = torch.linspace(0, a.shape[0] - 1, min(rows, a.shape[0])).long()
    x, y = a.rows(ids), b.rows(ids)  # [rows, D] each
    return bool((x - y).norm() < 0.5 * y.norm())


def with_file_blocks(runner: Runner, path: str | Path, interleaved: bool = True) -> Runner:
    """`runner` (a model converted from this file) with every matrix replaced by the file's own blocks where the kernel
    takes their type, the rest kept: the model llama.cpp runs from the file, on the converted model's norms,
    embedding and RoPE tables (the tests compare it with load_runner's)."""
    file = GGUFFile(path, interleaved)

    def rows(name: str, heads: int | None = None):
        try:
            w = file.matrix(name, heads)
        except Unreadable:
            return None
        return w if isinstance(w, smallbatch.GGUFWeights) else None

    def joined(parts):  # [q; k; v] or [gate; up], as the runner stacks the HF matrices
        return None if None in parts else smallbatch.GGUFStack(tuple(parts))

    blocks = []
    for i, b in enumerate(runner.blocks):
        at = f"blk.{i}."
        qkv = joined([rows(at + "attn_q.weight", runner.n_heads), rows(at + "attn_k.weight", runner.n_kv_heads), rows(at + "attn_v.weight")])
        gate_up = joined([rows(at + "ffn_gate.weight"), rows(at + "ffn_up.weight")])
        o, down = rows(at + "attn_output.weight"), rows(at + "ffn_down.weight")
        blocks.append(dataclasses.replace(b, qkv_w=qkv or b.qkv_w, o_w=o or b.o_w, gate_up_w=gate_up or b.gate_up_w,
                                          down_w=down or b.down_w))
    head = rows("output.weight") or rows("token_embd.weight") or runner.head_w  # tied: the embedding's blocks
    return runner.with_matrices(blocks, head)


class LeanModel:
    """A GGUF file on the lean runner (engine "lean"): the runner on its interleaved blocks and what the session
    reads of a model (the file's type, context length, end-of-generation ids); no HF model behind it."""

    engine = "lean"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.runner = load_runner(self.path)
        header = gguf_header.read(self.path)
        metadata = header.metadata
        self.arch = metadata.get("general.architecture")
        self.dtype = header.file_type or "GGUF"
        self.context_len = int(metadata.get(f"{self.arch}.context_length", 4096))
        self.eos_ids = {int(metadata[key]) for key in EOG_KEYS if key in metadata}
        self.vocab_size = self.runner.vocab_size
        self.device = torch.device("cpu")


def on_lean(model) -> bool:
    """Whether `model` is a LeanModel (a GGUF file on the lean runner) rather than a torch module."""
    return getattr(model, "engine", "torch") == "lean"


EOG_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
