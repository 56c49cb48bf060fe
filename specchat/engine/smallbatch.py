"""The fused small-batch linear (kernels/smallbatch.c) for the lean runner's float32 forwards on the CPU.

A verify feeds K+1 positions; PyTorch's GEMM reads the weights at 1.6-2.5x the cost of a one-row step for
4-16 rows, the kernel reads them once for all of up to 16 rows (see its header). `load(folder)` compiles it once per
machine with the system's C compiler (`cc -O3 -march=native -fopenmp`: 33 s with GCC 12 on the reference Xeon) into `folder` (the user
cache: models.load_model passes it, the engine knows no folders) and loads it with ctypes, which releases the
GIL during the call (the parallel engines of `specchat verify` run side by side). Until it is loaded, and
where it cannot be built (no compiler, a failed compile) or SPECCHAT_KERNEL=torch, `linear` is F.linear.

`layer` runs a whole decoder layer of the lean runner for up to 16 rows in the same library (smallbatch_layer):
its ~20 small eager ops (RMSNorms, RoPE, SDPA, adds) cost about 9 ms of a default-model step on the reference CPU,
the C code microseconds.

`gguf_linear` multiplies a GGUF file's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K,
Q6_K), read in place, for 1-16 positions (x rounded to int8 per block of 32, as llama.cpp does): the weights a
quantised model streams, with no float32 copy. `GGUFWeights.packed` interleaves 16 rows once at load time (about the
file's size: its scales stay as compact as the file's), so that one VNNI instruction multiplies 16 rows and a verify's
extra positions cost a fraction of a step (the kernel's comment says why).

Drafts may keep their matrices in bfloat16 (`draft_weights`) or int8 with a scale per output row
(`Int8Weights`, mode quant): the kernel widens each weight to float32 as it streams it, so a draft's matmuls
read a half or a quarter of the bytes and compute in float32 as before.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

MAX_ROWS = 16
SOURCE = Path(__file__).with_name("kernels") / "smallbatch.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]

enabled = os.environ.get("SPECCHAT_KERNEL", "fused") != "torch"  # benchmarks flip it to compare in one process
layers_enabled = True  # whether `layer` runs (benchmarks flip it to compare the C layer with PyTorch's)
rows_enabled = True  # whether sampling takes the row kernels (tests flip it to compare them with numpy's and torch's)
_lib: ctypes.CDLL | None = None
_fn = None  # its smallbatch_linear
_fn_bf16 = None  # and smallbatch_linear_bf16 (bfloat16 weights)
_fn_int8 = None  # and smallbatch_linear_int8 (Int8Weights)
_fn_layer = None  # and smallbatch_layer (a whole decoder layer)
_fn_layers = None  # and smallbatch_layers (several in one call)
_fn_logits = None  # and smallbatch_logits (the final norm and LM head)
_fn_forward = None  # and smallbatch_forward (embedding rows to logits in one call)
_fn_gguf = None  # and gguf_linear (GGUFWeights: a GGUF file's own blocks)
_fn_pack = None  # and gguf_pack, gguf_packed_bytes (GGUFWeights.packed)
rows: "RowKernels | None" = None  # and the passes over a row of the vocabulary (sampling.py)
_lock = threading.Lock()


def _cpu_key() -> str:
    """What -march=native compiles for: the CPU's model and flags where Linux tells them."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        return "\n".join([line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2])
    except OSError:
        return platform.processor() or platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def buildable() -> bool:
    """Whether load() can build the kernel here (it needs a C compiler: the build is keyed by it)."""
    return _fn is not None or _compiler() is not None


def _built_path(folder: Path, cc: str) -> Path:
    """Where the kernel compiled by `cc` for this CPU and source lies in `folder`."""
    key = hashlib.sha1(SOURCE.read_bytes() + " ".join([cc, *FLAGS]).encode() + _cpu_key().encode()).hexdigest()[:12]
    return folder / f"smallbatch-{key}.so"


def needs_build(folder: Path) -> bool:
    """Whether load(folder) will compile first (a first start on this machine: tens of seconds, so the caller says so)."""
    cc = _compiler()
    return _fn is None and cc is not None and not _built_path(Path(folder), cc).is_file()


def _build(folder: Path) -> Path | None:
    cc = _compiler()
    if cc is None:
        return None
    path = _built_path(folder, cc)
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".smallbatch-", suffix=".so")
        os.close(fd)
        try:
            subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE)], check=True, capture_output=True, timeout=120)
            os.replace(tmp, path)  # another process building the same file at once replaces it with the same bytes
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def load(folder: Path) -> bool:
    """Build the kernel into `folder` (once per machine and source) and load it; False where it cannot be."""
    global _lib, _fn, _fn_bf16, _fn_int8, _fn_layer, _fn_layers, _fn_logits, _fn_forward, _fn_gguf, _fn_pack, rows
    with _lock:
        if _fn is None:
            try:
                path = _build(Path(folder))
            except (OSError, subprocess.SubprocessError):
                path = None
            if path is None:
                return False
            lib = ctypes.CDLL(str(path))
            fns = lib.smallbatch_linear, lib.smallbatch_linear_bf16, lib.smallbatch_linear_int8
            for fn in fns:
                fn.restype = ctypes.c_int
                pointers = 5 if fn is fns[2] else 4  # x, w, (scale,) b, y
                fn.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_long] * 3 + [ctypes.c_int]
            layer = lib.smallbatch_layer
            layer.restype = ctypes.c_int
            ptr, long = ctypes.c_void_p, ctypes.c_long  # L, h, S, cos, sin, keys, values, capacity, past, threads, kv kind
            layer.argtypes = [ctypes.POINTER(LayerWeights), ptr, long, ptr, ptr, ptr, ptr, long, long, ctypes.c_int, ctypes.c_int]
            layers = lib.smallbatch_layers
            layers.restype = ctypes.c_int  # L[], n, h, S, cos, sin, keys[], values[], capacity[], past, threads, kv kind
            layers.argtypes = [ptr, ctypes.c_int, ptr, long, ptr, ptr, ptr, ptr, ptr, long, ctypes.c_int, ctypes.c_int]
            logits = lib.smallbatch_logits
            logits.restype = ctypes.c_int  # head, h, S, N, y, threads
            logits.argtypes = [ctypes.POINTER(LayerWeights), ptr, long, long, ptr, ctypes.c_int]
            forward = lib.smallbatch_forward
            forward.restype = ctypes.c_int  # L[], n, rows[], h, S, cos, sin, keys[], values[], capacity[], past, head, N, keep, logits, threads, kv kind
            forward.argtypes = [ptr, ctypes.c_int, ptr, ptr, long, ptr, ptr, ptr, ptr, ptr, long, ctypes.POINTER(LayerWeights),
                                long, long, ptr, ctypes.c_int, ctypes.c_int]
            gguf = lib.gguf_linear
            gguf.restype = ctypes.c_int  # x, w, type, y, S, N, D, threads, reference
            gguf.argtypes = [ptr, ptr, ctypes.c_int, ptr, long, long, long, ctypes.c_int, ctypes.c_int]
            pack, packed_bytes = lib.gguf_pack, lib.gguf_packed_bytes
            pack.restype, packed_bytes.restype = ctypes.c_int, long  # w, type, N, D, out, threads; type, N, D
            pack.argtypes = [ptr, ctypes.c_int, long, long, ptr, ctypes.c_int]
            packed_bytes.argtypes = [ctypes.c_int, long, long]
            _lib, (_fn, _fn_bf16, _fn_int8), _fn_layer, _fn_layers = lib, fns, layer, layers
            _fn_logits, _fn_forward = logits, forward
            _fn_gguf, _fn_pack = gguf, (pack, packed_bytes)
            rows = RowKernels.of(lib)
    return True


@dataclass(frozen=True)
class RowKernels:
    """The library's passes over one row of a vocabulary, for sampling.py (see their comments in the source)."""

    top: ctypes._CFuncPtr  # (x, V, n, ids, vals) -> how many found: the n largest, ties to the lower id
    exp_sum: ctypes._CFuncPtr  # (x, V, m, t, e) -> sum of e^((x - m) / t) in float64, the terms into e (or NULL)
    probs: ctypes._CFuncPtr  # (x, V, t, top_p, p) -> nonzero count, -1 without mass: softmax(x / t), then the nucleus
    draw: ctypes._CFuncPtr  # (p, V, u) -> the id u in [0, 1) draws by float64 cumulative sums, -1 without mass
    summary: ctypes._CFuncPtr  # (x, R, V, n, ids, vals, log_z, threads) -> fewest found: top lists and log sum e^x, rows [R, V]

    @staticmethod
    def of(lib: ctypes.CDLL) -> "RowKernels":
        ptr, long, f32, f64 = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_double
        signatures = {
            "row_top": (ctypes.c_int, [ptr, long, ctypes.c_int, ptr, ptr]),
            "row_exp_sum": (f64, [ptr, long, f32, f32, ptr]),
            "row_probs": (long, [ptr, long, f32, f32, ptr]),
            "row_draw": (long, [ptr, long, f64]),
            "rows_summary": (ctypes.c_int, [ptr, long, long, ctypes.c_int, ptr, ptr, ptr, ctypes.c_int]),
        }
        fns = []
        for name, (restype, argtypes) in signatures.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
            fns.append(fn)
        return RowKernels(*fns)


def row_kernels(x: torch.Tensor) -> RowKernels | None:
    """The row kernels, where they take x: float32 rows on the CPU, contiguous, without autograd."""
    if rows is None or not rows_enabled or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    return rows if x.is_contiguous() and not x.requires_grad else None


def kernel_name() -> str:
    """What the lean runner's float32 CPU forwards multiply with: "fused" or "torch"."""
    return "fused" if enabled and _fn is not None else "torch"


@dataclass(frozen=True)
class Int8Weights:
    """A draft's matrix w [N, D] as int8 with one float32 scale per output row: w ~ q * scale[:, None]
    (round to nearest, |q| <= 127). `linear` multiplies by it in the kernel, or widens it for F.linear."""

    q: torch.Tensor  # [N, D] int8
    scale: torch.Tensor  # [N] float32

    @staticmethod
    def of(w: torch.Tensor, rows: int = 256) -> "Int8Weights":
        """Rounded `rows` rows at a time: whole-matrix float32 temporaries left ~250 MB more resident after building
        the default model's copy (the allocator keeps the freed pieces), for 129 MB of int8 weights."""
        w = w.detach()
        q = torch.empty(w.shape, dtype=torch.int8, device=w.device)  # [N, D]
        scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)  # [N]
        for i in range(0, w.shape[0], rows):
            chunk = w[i : i + rows].float()  # [rows, D]
            s = (chunk.abs().amax(1) / 127).clamp_min_(torch.finfo(torch.float32).tiny)  # an all-zero row stays 0
            scale[i : i + rows] = s
            q[i : i + rows] = (chunk / s[:, None]).round_().clamp_(-127, 127)
        return Int8Weights(q, scale)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel()

    def float(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]  # [N, D]


def int8_usable() -> bool:
    """Whether `linear` multiplies by Int8Weights in the kernel (else it widens them for F.linear, slowly)."""
    return enabled and _fn_int8 is not None


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `linear` takes the kernel for x [..., S, D] float32 (at most MAX_ROWS rows in all) and w [N, D]
    (float32, or bfloat16 draft weights)."""
    return _rows_fit(x) and w.dtype in (torch.float32, torch.bfloat16) and w.is_contiguous()


def _rows_fit(x: torch.Tensor) -> bool:
    return (
        enabled and _fn is not None and x.device.type == "cpu" and x.dtype == torch.float32
        and 1 <= x.numel() // x.shape[-1] <= MAX_ROWS and not torch.is_grad_enabled()
    )


def draft_weights(w: torch.Tensor) -> torch.Tensor:
    """A draft's matrix as `linear` streams it fastest: bfloat16 where the kernel multiplies float32 on the CPU
    (half the bytes; the draft's output changes by bfloat16's rounding of its weights), else `w` itself."""
    if enabled and _fn_bf16 is not None and w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2:
        return w.to(torch.bfloat16).contiguous()
    return w


def linear(x: torch.Tensor, w: "torch.Tensor | Int8Weights", b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear: the fused kernel when `usable` (b, if any, float32 [N]), else F.linear itself. A draft's bfloat16
    or int8 weights (x float32) take the kernel MAX_ROWS rows at a time whatever the rows: every pass streams the
    narrow weights, which costs less than widening them all to float32 for one GEMM (a draft catching up on a
    prompt)."""
    if isinstance(w, (GGUFWeights, GGUFStack)):
        x2 = x.reshape(-1, x.shape[-1])  # [S, D]
        y = torch.cat([gguf_linear(x2, part) for part in w.parts], dim=-1) if isinstance(w, GGUFStack) else gguf_linear(x2, w)
        y = y.view(*x.shape[:-1], w.shape[0])  # [..., S, N]
        return y + b if b is not None else y
    if isinstance(w, Int8Weights) or (w.dtype == torch.bfloat16 and x.dtype == torch.float32):
        return _draft_linear(x, w, b)
    if not usable(x, w) or (b is not None and b.dtype != torch.float32):
        return F.linear(x, w, b)
    return _kernel(_fn, x, w, b)


def _draft_linear(x: torch.Tensor, w: "torch.Tensor | Int8Weights", b: torch.Tensor | None) -> torch.Tensor:
    fn = _fn_int8 if isinstance(w, Int8Weights) else _fn_bf16
    x2 = x.reshape(-1, x.shape[-1])  # [S, D]
    strided = not isinstance(w, Int8Weights) and not w.is_contiguous()  # (Int8Weights.of makes contiguous copies)
    if fn is None or strided or not _rows_fit(x2[:1]) or (b is not None and b.dtype != torch.float32):
        return F.linear(x, w.float(), b)
    y = torch.cat([_kernel(fn, rows, w, b) for rows in x2.split(MAX_ROWS)])  # [S, N]
    return y.view(*x.shape[:-1], y.shape[-1])


def _kernel(fn, x: torch.Tensor, w: "torch.Tensor | Int8Weights", b: torch.Tensor | None) -> torch.Tensor:
    """fn over x [..., S, D] (S <= MAX_ROWS rows in all) -> [..., S, N] float32."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [S, D]
    S, D = x2.shape
    N = w.shape[0]
    y = torch.empty(S, N, dtype=torch.float32)
    b = b.contiguous() if b is not None else None  # held until the call returns
    bias = b.data_ptr() if b is not None else None
    if isinstance(w, Int8Weights):
        fn(x2.data_ptr(), w.q.data_ptr(), w.scale.data_ptr(), bias, y.data_ptr(), S, N, D, torch.get_num_threads())
    else:
        fn(x2.data_ptr(), w.data_ptr(), bias, y.data_ptr(), S, N, D, torch.get_num_threads())
    return y.view(*x.shape[:-1], N)


# ---------------------------------------------------------------- a GGUF file's own blocks

GGUF_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}  # ggml's type ids
K_QUANTS = {"Q4_K", "Q5_K", "Q6_K"}  # super-blocks of 256 weights: a row's length a multiple of 256
GGUF_KIND = 100  # the C layer's weight kind for them: GGUF_KIND + the type id
PACKED = 100  # the kernel's type id for interleaved rows: PACKED + the type id


@dataclass(frozen=True)
class GGUFWeights:
    """A matrix w [N, D] as a GGUF file stores it: N rows of blocks (GGUF_TYPES), read in place (`blocks` may be a
    view of the memory-mapped file): no float32 copy, 4.5-8.5 bits a weight to stream."""

    blocks: torch.Tensor  # [N, D / 32 * block bytes] uint8
    type: str
    shape: tuple[int, int]  # (N, D)
    interleaved: torch.Tensor | None = None  # the same weights, 16 rows interleaved (packed()): what gguf_linear reads

    def packed(self) -> "GGUFWeights":
        """These weights with 16 rows interleaved for the kernel (its own model: a verify's extra positions cost about
        a third); themselves where the kernel is not loaded."""
        if self.interleaved is not None or not gguf_usable(self) or _fn_pack is None:
            return self
        pack, packed_bytes = _fn_pack
        size = packed_bytes(GGUF_TYPES[self.type], *self.shape)
        if size == 0:
            return self
        out = torch.empty(size, dtype=torch.uint8)
        blocks = self.blocks.contiguous()
        if pack(blocks.data_ptr(), GGUF_TYPES[self.type], *self.shape, out.data_ptr(), torch.get_num_threads()) != 0:
            raise ValueError(f"gguf_pack refused {self.type} {self.shape}")
        return GGUFWeights(self.blocks, self.type, self.shape, out)

    def kernel_operand(self) -> tuple[torch.Tensor, int]:
        """What the kernel reads and the type id it reads it as."""
        if self.interleaved is not None:
            return self.interleaved, PACKED + GGUF_TYPES[self.type]
        return self.blocks.contiguous(), GGUF_TYPES[self.type]

    @staticmethod
    def of(tensor) -> "GGUFWeights":
        """From a gguf.GGUFReader tensor (its data is [N, row bytes] uint8, memory-mapped)."""
        import numpy as np

        data = np.asarray(tensor.data)
        n, d = int(tensor.shape[1]), int(tensor.shape[0])  # GGUF lists a matrix's shape innermost first
        with warnings.catch_warnings():  # a read-only memory map: the kernel only reads it
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(data.reshape(n, -1))
        return GGUFWeights(blocks, tensor.tensor_type.name, (n, d))

    def float(self) -> torch.Tensor:
        """The weights dequantised by the gguf package (the reference the kernel is tested against): [N, D] float32."""
        import gguf

        data = self.blocks.numpy()
        return torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[self.type]).reshape(self.shape).copy())

    def first_rows(self, n: int) -> "GGUFWeights":
        """Rows 0..n-1, with no copy: views of the blocks and of the interleaved copy (its first groups of 16 rows hold
        them; the kernel writes only the rows asked for)."""
        interleaved = None
        if self.interleaved is not None:
            interleaved = self.interleaved[: _fn_pack[1](GGUF_TYPES[self.type], n, self.shape[1])]
        return GGUFWeights(self.blocks[:n], self.type, (n, self.shape[1]), interleaved)

    def selected(self, ids: list[int]) -> "GGUFWeights":
        """Rows `ids`, copied (and interleaved where these are)."""
        rows = GGUFWeights(self.blocks[ids].contiguous(), self.type, (len(ids), self.shape[1]))
        return rows.packed() if self.interleaved is not None else rows

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [S] dequantised by the gguf package: [S, D] float32 (an embedding looked up in the file)."""
        import gguf

        data = self.blocks[ids.reshape(-1).cpu()].numpy()  # [S, row bytes]
        return torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[self.type]).reshape(-1, self.shape[1]))


@dataclass(frozen=True)
class GGUFStack:
    """A matrix stacked from GGUF matrices, each in its own type ([q; k; v], [gate; up]): read where the file keeps
    them, with no fused copy (a Q4_K_M file keeps V in Q6_K beside Q4_K Q and K)."""

    parts: tuple[GGUFWeights, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    def float(self) -> torch.Tensor:
        return torch.cat([p.float() for p in self.parts])  # [N, D]


def head_rows(w, n: int, extra: list[int]):
    """An LM head's rows 0..n-1 and then `extra` ([n + len(extra), D]; FR-Spec's restricted head): on a GGUF file's
    blocks the first n a view and `extra` a small copy, stacked for the kernel; a tensor's, gathered."""
    if isinstance(w, GGUFWeights):
        return GGUFStack((w.first_rows(n), w.selected(extra))) if extra else w.first_rows(n)
    if isinstance(w, torch.Tensor):
        return w[torch.cat([torch.arange(n), torch.tensor(extra, dtype=torch.long)]).to(w.device)]
    raise ValueError(f"an LM head of {type(w).__name__} cannot be restricted")


def gguf_usable(w: GGUFWeights) -> bool:
    return _fn_gguf is not None and w.type in GGUF_TYPES and w.shape[1] % (256 if w.type in K_QUANTS else 32) == 0


def gguf_linear(x: torch.Tensor, w: GGUFWeights, reference: bool = False) -> torch.Tensor:
    """x [S, D] float32 @ w^T -> [S, N] float32 in the kernel (x rounded to int8 per block of 32: llama.cpp's
    arithmetic), MAX_ROWS rows at a time; `reference`: the same arithmetic in plain C, for the tests."""
    if not gguf_usable(w):
        raise ValueError(f"gguf_linear takes {', '.join(GGUF_TYPES)} rows (a multiple of 32 weights, of 256 for the "
                         "K-quants) with the kernel loaded")
    x2 = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()  # [S, D]
    N, D = w.shape
    data, kind = w.kernel_operand()
    y = torch.empty(x2.shape[0], N, dtype=torch.float32)  # [S, N]
    for s in range(0, x2.shape[0], MAX_ROWS):
        rows = min(MAX_ROWS, x2.shape[0] - s)
        if _fn_gguf(x2[s].data_ptr(), data.data_ptr(), kind, y[s].data_ptr(), rows, N, D, torch.get_num_threads(),
                    int(reference)) != 0:
            raise ValueError(f"gguf_linear refused {w.type} [{N}, {D}] with {rows} rows")
    return y


# ---------------------------------------------------------------- a whole decoder layer

SILU = {"SiLU", "SiLUActivation"}  # torch's module, transformers' (both F.silu)
KINDS = {torch.float32: 4, torch.bfloat16: 2}  # the C code's weight kinds by bytes per weight; Int8Weights: 1
KV_KINDS = {torch.float32: 4, torch.float16: 3}  # and its K/V caches' (F32, F16)


class LayerWeights(ctypes.Structure):
    """kernels/smallbatch.c's `struct layer`: one decoder layer's weights as pointers, and its shape."""

    _fields_ = [
        ("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
        ("w", ctypes.c_void_p * 4), ("scale", ctypes.c_void_p * 4), ("bias", ctypes.c_void_p * 4), ("kind", ctypes.c_int * 4),
        ("D", ctypes.c_long), ("H", ctypes.c_long), ("Hkv", ctypes.c_long), ("hd", ctypes.c_long), ("I", ctypes.c_long),
        ("eps", ctypes.c_float), ("qk_eps", ctypes.c_float), ("attn_scale", ctypes.c_float),
        ("part_w", (ctypes.c_void_p * 3) * 4), ("part_rows", (ctypes.c_long * 3) * 4), ("part_type", (ctypes.c_int * 3) * 4),
    ]


def layer_weights(block, shape) -> "LayerWeights | None":
    """The C struct for a runner's Block (engine/runner.py) and Shape, or None where the C layer does not reproduce
    it: another activation than SiLU, a replaced MLP (lowrank), weights other than float32 / bfloat16 / Int8Weights /
    GGUFWeights / GGUFStack, norms or biases not float32. The struct keeps the tensors it points into alive (`tensors`)."""
    if not layer_usable() or block.mlp is not None or type(block.act).__name__ not in SILU:
        return None
    if shape.head_dim > 512 or shape.n_heads % shape.n_kv_heads:  # the C code's limits
        return None
    vectors = [block.ln1, block.ln2, block.q_norm, block.k_norm, block.qkv_b, block.o_b, block.gate_up_b, block.down_b]
    if any(t is not None and (t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()) for t in vectors):
        return None
    L = LayerWeights()
    L.tensors = [t for t in vectors if t is not None]
    for m, w in enumerate([block.qkv_w, block.o_w, block.gate_up_w, block.down_w]):
        if not _set_matrix(L, m, w):
            return None
    for m, b in enumerate(vectors[4:]):
        L.bias[m] = b.data_ptr() if b is not None else None
    L.ln1, L.ln2 = block.ln1.data_ptr(), block.ln2.data_ptr()
    L.q_norm = block.q_norm.data_ptr() if block.q_norm is not None else None
    L.k_norm = block.k_norm.data_ptr() if block.k_norm is not None else None
    L.D, L.H, L.Hkv, L.hd = block.ln1.shape[0], shape.n_heads, shape.n_kv_heads, shape.head_dim
    L.I = block.down_w.shape[1]
    L.eps, L.qk_eps, L.attn_scale = block.eps, block.qk_eps, shape.scale
    return L


def _set_matrix(L: LayerWeights, m: int, w) -> bool:
    """Point matrix m of L at w (keeping w alive in L.tensors); False for a matrix the C code does not take."""
    if isinstance(w, Int8Weights):
        L.w[m], L.scale[m], L.kind[m] = w.q.data_ptr(), w.scale.data_ptr(), 1
        L.tensors += [w.q, w.scale]
    elif isinstance(w, GGUFWeights) and gguf_usable(w) and w.blocks.is_contiguous():
        data, kind = w.kernel_operand()
        L.w[m], L.kind[m] = data.data_ptr(), GGUF_KIND + kind
        L.tensors.append(data)
    elif isinstance(w, GGUFStack) and len(w.parts) <= 3 and all(gguf_usable(p) and p.blocks.is_contiguous() for p in w.parts):
        for i, part in enumerate(w.parts):
            data, kind = part.kernel_operand()
            L.part_w[m][i], L.part_rows[m][i], L.part_type[m][i] = data.data_ptr(), part.shape[0], kind
            L.tensors.append(data)
    elif isinstance(w, torch.Tensor) and w.dtype in KINDS and w.device.type == "cpu" and w.is_contiguous():
        L.w[m], L.kind[m] = w.data_ptr(), KINDS[w.dtype]
        L.tensors.append(w)
    else:
        return False
    return True


def head_weights(norm_w: torch.Tensor, eps: float, head_w) -> "LayerWeights | None":
    """The final norm and LM head as the C code reads them (a struct layer: ln1 the norm, matrix 0 the head), or None
    where it does not take them."""
    if not layer_usable() or norm_w.dtype != torch.float32 or norm_w.device.type != "cpu" or not norm_w.is_contiguous():
        return None
    L = LayerWeights()
    L.tensors = [norm_w]
    if not _set_matrix(L, 0, head_w):
        return None
    L.ln1, L.eps, L.D = norm_w.data_ptr(), eps, norm_w.shape[0]
    return L


def layer_usable() -> bool:
    return enabled and layers_enabled and _fn_layer is not None


def layer(L: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, keys: torch.Tensor,
          values: torch.Tensor, past: int) -> None:
    """One decoder layer in C on h [1, S, D] in place (float32, contiguous, S <= MAX_ROWS), its K/V written at
    positions past..past+S-1 of keys, values [1, H_kv, capacity, hd] (float32 or float16, contiguous); cos, sin_signed
    [S, hd] contiguous (engine/runner.py's tables)."""
    S = h.shape[1]
    status = _fn_layer(ctypes.byref(L), h.data_ptr(), S, cos.data_ptr(), sin_signed.data_ptr(), keys.data_ptr(),
                       values.data_ptr(), keys.shape[2], past, torch.get_num_threads(), KV_KINDS[keys.dtype])
    if status != 0:
        raise MemoryError(f"the fused decoder layer could not run ({S} rows at position {past})")


class LayerArgs:
    """`layers`' arrays of pointers, kept from one call to the next and built again only when a layer's weights or
    K/V storage is another object (the storage grows CHUNK positions at a time): building them each step cost a
    visible share of a small model's step.
    What they point at is held with them (kept alive), all in one tuple (a thread sees the old or the new one)."""

    def __init__(self) -> None:
        self.last: tuple = ([], [], None)  # (Ls, kv or (cache, version), (structs, keys, values, capacity))

    def arrays(self, Ls: list[LayerWeights], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple:
        old_Ls, old_kv, arrays = self.last
        if (self._same(Ls, old_Ls) and isinstance(old_kv, list)
                and all(k is k0 and v is v0 for (k, v), (k0, v0) in zip(kv, old_kv))):
            return arrays
        self.last = (list(Ls), list(kv), self._built(Ls, kv))
        return self.last[2]

    def of_cache(self, Ls: list[LayerWeights], cache) -> tuple:
        """`arrays` for Ls over every layer of a KVCache, checked by the cache's `version` rather than layer by layer."""
        old_Ls, old_key, arrays = self.last
        if self._same(Ls, old_Ls) and old_key == (cache, cache.version):
            return arrays
        self.last = (list(Ls), (cache, cache.version), self._built(Ls, list(zip(cache.keys, cache.values))))
        return self.last[2]

    @staticmethod
    def _same(Ls: list[LayerWeights], old_Ls: list[LayerWeights]) -> bool:
        return len(Ls) == len(old_Ls) and all(a is b for a, b in zip(Ls, old_Ls))

    @staticmethod
    def _built(Ls: list[LayerWeights], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple:
        n = len(Ls)
        return ((ctypes.c_void_p * n)(*[ctypes.addressof(L) for L in Ls]),
                (ctypes.c_void_p * n)(*[k.data_ptr() for k, _ in kv]),
                (ctypes.c_void_p * n)(*[v.data_ptr() for _, v in kv]),
                (ctypes.c_long * n)(*[k.shape[2] for k, _ in kv]))


def layers(Ls: list[LayerWeights], h: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
           kv: list[tuple[torch.Tensor, torch.Tensor]], past: int, args: LayerArgs | None = None) -> None:
    """`layer` for each of Ls in turn, layer i's K/V in kv[i] = (keys, values): a forward in one call (a call from
    Python costs about a seventh of a small model's layer); `args`: the caller's arrays from its last call."""
    n, S = len(Ls), h.shape[1]
    structs, keys, values, capacity = (args or LayerArgs()).arrays(Ls, kv)
    status = _fn_layers(structs, n, h.data_ptr(), S, cos.data_ptr(), sin_signed.data_ptr(), keys, values, capacity, past,
                        torch.get_num_threads(), KV_KINDS[kv[0][0].dtype])
    if status != 0:
        raise MemoryError(f"the fused decoder layers could not run ({S} rows at position {past})")


def logits(head: LayerWeights, h: torch.Tensor, N: int) -> torch.Tensor:
    """The final norm and LM head in C: h [S, D] (float32, contiguous) -> logits [S, N], MAX_ROWS rows a call."""
    y = torch.empty(h.shape[0], N, dtype=torch.float32)  # [S, N]
    for s in range(0, h.shape[0], MAX_ROWS):
        rows = min(MAX_ROWS, h.shape[0] - s)
        if _fn_logits(ctypes.byref(head), h[s].data_ptr(), rows, N, y[s].data_ptr(), torch.get_num_threads()) != 0:
            raise MemoryError(f"the LM head could not run ({rows} rows)")
    return y


def forward(Ls: list[LayerWeights], rows: list[torch.Tensor], h: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
            cache, past: int, head: LayerWeights, N: int, keep: int, args: LayerArgs) -> torch.Tensor:
    """`layers` over every layer of `cache` (a KVCache whose layers hold positions up to past + S: reserve_all), the S
    embedding rows (float32 [D] each, contiguous) copied into h [S, D] first and left there as the last layer's output,
    then `logits` of its last `keep` rows: [keep, N]. cos, sin_signed: the whole tables [P, hd], P >= past + S."""
    S = h.shape[0]
    structs, keys, values, capacity = args.of_cache(Ls, cache)
    y = torch.empty(keep, N, dtype=torch.float32)  # [keep, N]
    pointers = (ctypes.c_void_p * S)(*[r.data_ptr() for r in rows])
    status = _fn_forward(structs, len(Ls), pointers, h.data_ptr(), S, cos.data_ptr(), sin_signed.data_ptr(), keys, values,
                         capacity, past, ctypes.byref(head), N, keep, y.data_ptr(), torch.get_num_threads(), KV_KINDS[cache.dtype])
    if status != 0:
        raise MemoryError(f"the fused forward could not run ({S} rows at position {past})")
    return y
