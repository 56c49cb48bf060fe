"""The llama.cpp engine: GGUF models run by llama.cpp in-process (llama-cpp-python's C bindings), under specchat's
own loop.

llama.cpp is the fastest CPU engine there is for GGUF files; specchat does not rewrite it. It asks llama.cpp for
what the loop needs and nothing else: logits of the K+1 positions a verify feeds (a batch whose every position
is marked for output), one forward for a prompt that keeps only the last position's logits, and KV rollback
(`llama_memory_seq_rm`, a crop). Everything above that, the exact rule, p and q per token, the modes, stays
specchat's.

A `GGUFModel` is the weights, loaded once; each `Context` made from it is one KV cache (the target's, a
draft's, another engine's for verify's parallel draws). `LlamaTargetState` is TargetState over a Context.

p on this engine is what llama.cpp computes for the positions of a batch. A batch of K+1 positions may round
differently from a one-token decode (ggml takes other matmul paths for several rows), so greedy output with
speculation can differ from llama.cpp's own one-token-at-a-time greedy decoding where two tokens are within
rounding of each other (README, Engines, counts how often). The rule is exact for the p it is given.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from specchat.engine.target import TargetState

N_BATCH = 512  # positions per llama_decode call (longer prompts go in chunks)
MAX_CONTEXT = 32768  # a context window beyond this (Qwen2.5's 128k) would reserve a KV cache of many GB


def on_llama_cpp(model) -> bool:
    """Whether `model` is a GGUFModel (this engine's) rather than a torch module."""
    return getattr(model, "engine", "torch") == "llama.cpp"


class EngineUnavailable(Exception):
    """llama-cpp-python is not installed or cannot load; the message says so in one line."""


def bindings():
    """llama-cpp-python's C bindings, the backend initialised once, llama.cpp's own logging off."""
    global _lib, _quiet
    if _lib is None:
        try:
            import llama_cpp
        except Exception as e:  # ImportError, or a library built for another CPU (OSError)
            raise EngineUnavailable(f"the llama.cpp engine needs llama-cpp-python ({type(e).__name__}: {e})") from e
        _quiet = llama_cpp.llama_log_callback(lambda level, text, data: None)  # kept referenced: ctypes must not free it
        llama_cpp.llama_log_set(_quiet, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _lib = llama_cpp
    return _lib


def available() -> bool:
    try:
        bindings()
    except EngineUnavailable:
        return False
    return True


_lib = None
_quiet = None  # llama.cpp's log callback


class GGUFModel:
    """A GGUF file's weights in llama.cpp (memory-mapped, shared by every Context made from it)."""

    engine = "llama.cpp"

    def __init__(self, path: str | Path) -> None:
        lib = bindings()
        self.path = Path(path)
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0  # this engine is the CPU's; CUDA targets run on torch
        self.ptr = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.ptr:
            raise ValueError(f"llama.cpp cannot load {self.path}")
        self._lib = lib  # __del__ may run after the module's globals are gone
        vocab = lib.llama_model_get_vocab(self.ptr)
        self.vocab_size = int(lib.llama_vocab_n_tokens(vocab))
        self.context_len = min(int(lib.llama_model_n_ctx_train(self.ptr)), MAX_CONTEXT)
        self.eos_ids = {int(t) for t in (lib.llama_vocab_eos(vocab), lib.llama_vocab_eot(vocab)) if t >= 0}
        self.device = torch.device("cpu")
        self.file_type = self.meta("general.file_type")

    def meta(self, key: str) -> str | None:
        """A metadata value of the file as text (None when absent)."""
        buf = ctypes.create_string_buffer(256)
        n = self._lib.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode(errors="replace") if n >= 0 else None

    @property
    def dtype(self) -> str:
        """The file's quantisation (Q4_1, Q8_0, F32, ...): what its weights are stored and multiplied as."""
        try:
            from gguf import LlamaFileType

            return LlamaFileType(int(self.file_type)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except (TypeError, ValueError, ImportError):
            return "gguf"

    def context(self, n_ctx: int | None = None) -> "Context":
        return Context(self, n_ctx or self.context_len)

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self._lib.llama_model_free(self.ptr)
            self.ptr = None


class Context:
    """One llama.cpp context: a KV cache of one sequence and the batch it is fed through.

    `decode(ids, past, keep)` drops whatever the cache holds from position `past` on, feeds `ids` there and
    returns the logits of the last `keep` positions, copied out of llama.cpp's buffer (the next decode
    overwrites it; a copy of K+1 rows is ~0.1 ms against a step of ~10 ms).
    Threads follow torch's count (threads.py re-chooses it on a busy machine), passed to llama.cpp per call.
    """

    def __init__(self, model: GGUFModel, n_ctx: int) -> None:
        lib = self._lib = model._lib
        self.model, self.n_ctx = model, n_ctx
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, N_BATCH, N_BATCH, 1
        params.no_perf = True
        self.threads = torch.get_num_threads()
        params.n_threads = params.n_threads_batch = self.threads
        self.ptr = lib.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise ValueError(f"llama.cpp cannot make a context of {n_ctx} positions for {model.path}")
        self.memory = lib.llama_get_memory(self.ptr)
        self.batch = lib.llama_batch_init(N_BATCH, 0, 1)
        self.length = 0  # positions the cache holds

    def crop(self, length: int) -> None:
        """Keep positions 0..length-1."""
        if length < self.length:
            self._lib.llama_memory_seq_rm(self.memory, 0, length, -1)
            self.length = length

    def decode(self, ids: list[int], past: int, keep: int) -> torch.Tensor:
        """[keep, V] float32 logits of the last `keep` of `ids`, fed at positions past.. (keep <= len(ids))."""
        lib, batch = self._lib, self.batch
        if past > self.length:
            raise ValueError(f"the cache holds {self.length} positions; cannot feed at {past}")
        if past + len(ids) > self.n_ctx:
            raise ValueError(f"{past + len(ids)} positions do not fit the context of {self.n_ctx}")
        self.crop(past)
        n = torch.get_num_threads()
        if n != self.threads:
            lib.llama_set_n_threads(self.ptr, n, n)
            self.threads = n
        rows = []
        first_kept = len(ids) - keep
        for start in range(0, len(ids), N_BATCH):
            chunk = ids[start : start + N_BATCH]
            batch.n_tokens = len(chunk)
            for i, tok in enumerate(chunk):
                batch.token[i] = tok
                batch.pos[i] = past + start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = start + i >= first_kept
            status = lib.llama_decode(self.ptr, batch)
            if status != 0:
                self.length = past + start  # llama.cpp left the cache as it was before this chunk
                lib.llama_memory_seq_rm(self.memory, 0, self.length, -1)
                raise RuntimeError(f"llama_decode failed with status {status}")
            self.length = past + start + len(chunk)
            outputs = sum(1 for i in range(len(chunk)) if start + i >= first_kept)
            if outputs:
                logits = lib.llama_get_logits(self.ptr)
                rows.append(torch.from_numpy(np.ctypeslib.as_array(logits, shape=(outputs, self.model.vocab_size)).copy()))
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self._lib.llama_batch_free(self.batch)
            self._lib.llama_free(self.ptr)
            self.ptr = None


class LlamaTargetState(TargetState):
    """TargetState on llama.cpp: the same invariant, start/verify/commit, over a Context instead of torch's KV cache.

    There is no lean runner and no per-layer entry point here, and the last layer's features are not kept: the
    modes that need them (layerskip, earlyexit, lowrank, head) run on the torch engine only.
    """

    runner = "llama.cpp"
    lean = None

    def __init__(self, model: GGUFModel, runner: str = "auto") -> None:  # noqa: super().__init__ is torch's
        self.model = model
        self.cache = model.context()
        self.tokens: list[int] = []
        self.head: torch.Tensor | None = None
        self.features = None
        self.known = 0
        self.vocab_size = model.vocab_size
        self.context_len = model.context_len

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def kernel(self) -> str:
        return "llama.cpp"

    def forward(self, ids: list[int], past: int, keep: int) -> torch.Tensor:
        return self.cache.decode(ids, past, keep)

    def record(self, hidden, past) -> None:
        raise NotImplementedError("llama.cpp keeps no per-position features")

    def _crop(self, length: int) -> None:
        self.cache.crop(length)


def quantize(source: Path, dest: Path, file_type: str) -> None:
    """Write `source` requantised to `file_type` (a llama.cpp type name: Q4_0, Q8_0, Q2_K...) at `dest`, with
    llama.cpp's own quantizer (k-quants fall back to a legacy type for matrices whose rows they cannot split)."""
    lib = bindings()
    from gguf import LlamaFileType

    params = lib.llama_model_quantize_default_params()
    params.ftype = int(LlamaFileType["ALL_F32" if file_type == "F32" else f"MOSTLY_{file_type}"])
    params.allow_requantize = True
    params.nthread = torch.get_num_threads()
    status = lib.llama_model_quantize(str(source).encode(), str(dest).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama.cpp could not quantise {source} to {file_type} (status {status})")
