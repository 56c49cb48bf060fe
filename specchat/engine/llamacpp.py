"""The llama.cpp engine: GGUF models run by llama.cpp in-process (llama-cpp-python's C bindings), under specchat's
own loop.

llama.cpp is the field's CPU engine for GGUF files; specchat does not rewrite it. It asks llama.cpp for
what the loop needs and nothing else: logits of the K+1 positions a verify feeds (a batch whose every position
is marked for output), one forward for a prompt that keeps only the last position's logits, and KV rollback
(`llama_memory_seq_rm`, a crop). Everything above that, the exact rule, p and q per token, the modes, stays
specchat's.

A `GGUFModel` is the weights, loaded once; each `Context` made from it is one KV cache (the target's, a
draft's, another engine's for verify's parallel draws). `LlamaTargetState` is the loop's Target over a Context.

p on this engine is what llama.cpp computes for the positions of a batch. A batch of K+1 positions may round
differently from a one-token decode (ggml takes other matmul paths for several rows), so greedy output with
speculation can differ from llama.cpp's own one-token-at-a-time greedy decoding where two tokens are within
rounding of each other (docs/engines.md counts how often). The rule is exact for the p it is given.
"""

from __future__ import annotations

import ctypes
import weakref
from pathlib import Path

import numpy as np
import torch

from specchat.engine.target import CachedTarget, TargetState

N_BATCH = 512  # positions per llama_decode call (longer prompts go in chunks)
# llama.cpp reserves a context's whole KV cache at once (a Llama-3-8B: 128 KiB a position); the torch engine grows
# its own as it goes. 8192 positions hold any chat here while a 1.5B Qwen's cache stays at 224 MiB
MAX_CONTEXT = 8192

_lib = None  # llama_cpp, once bindings() loaded it
_quiet = None  # llama.cpp's log callback


def on_llama_cpp(model) -> bool:
    """Whether `model` is a GGUFModel (this engine's) rather than a torch module."""
    return getattr(model, "engine", "torch") == "llama.cpp"


class EngineUnavailable(Exception):
    """llama-cpp-python is not installed or cannot load; the message says so in one line."""


class EngineError(Exception):
    """llama.cpp refused something (a file, a context, a decode, a rollback); the message is one line for the user."""


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


class GGUFModel:
    """A GGUF file's weights in llama.cpp (memory-mapped, shared by every Context made from it)."""

    engine = "llama.cpp"

    def __init__(self, path: str | Path, repack: bool = False) -> None:
        """`repack`: llama.cpp's weight repacking, faster where it is safe (models.load_gguf asks repack_probe.py)."""
        lib = bindings()
        self.path = Path(path)
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0  # this engine is the CPU's; CUDA targets run on torch
        self.repack = params.use_extra_bufts = repack
        self.ptr = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.ptr:
            raise EngineError(f"llama.cpp cannot load {self.path}")
        self._lib, self._log = lib, _quiet  # freed (and logging) after the module's globals may be gone
        # every Context holds its model, and finalizers run newest first at exit: contexts are freed before it
        self._free = weakref.finalize(self, lib.llama_model_free, self.ptr)
        vocab = lib.llama_model_get_vocab(self.ptr)
        self.vocab_size = int(lib.llama_vocab_n_tokens(vocab))
        self.context_len = min(int(lib.llama_model_n_ctx_train(self.ptr)), MAX_CONTEXT)
        # every id that ends generation in llama.cpp's own loop (eos, eot, <|im_end|>, ...)
        self.eos_ids = {t for t in range(self.vocab_size) if lib.llama_vocab_is_eog(vocab, t)}
        # a recurrent model's state cannot be cut back to an earlier position: it can decode, not speculate
        self.can_rollback = not (lib.llama_model_is_recurrent(self.ptr) or lib.llama_model_is_hybrid(self.ptr))
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


def _free_context(lib, ptr, batch, model) -> None:
    """Free one context (`model` is an argument so that the model outlives it)."""
    lib.llama_batch_free(batch)
    lib.llama_free(ptr)


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
            raise EngineError(f"llama.cpp cannot make a context of {n_ctx} positions for {model.path.name} (out of memory?)")
        self.memory = lib.llama_get_memory(self.ptr)
        self.batch = lib.llama_batch_init(N_BATCH, 0, 1)
        self._free = weakref.finalize(self, _free_context, lib, self.ptr, self.batch, model)
        self.length = 0  # positions the cache holds

    def crop(self, length: int) -> None:
        """Keep positions 0..length-1."""
        if length < self.length:
            if not self._lib.llama_memory_seq_rm(self.memory, 0, length, -1):
                raise EngineError(f"llama.cpp cannot roll {self.model.path.name}'s cache back (a recurrent model): use --mode off")
            self.length = length

    def decode(self, ids: list[int], past: int, keep: int) -> torch.Tensor:
        """[keep, V] float32 logits of the last `keep` of `ids`, fed at positions past.. (keep <= len(ids))."""
        lib, batch = self._lib, self.batch
        if past > self.length:
            raise ValueError(f"the cache holds {self.length} positions; cannot feed at {past}")
        if past + len(ids) > self.n_ctx:
            raise EngineError(f"{past + len(ids)} positions do not fit llama.cpp's context of {self.n_ctx}")
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
            if status != 0:  # llama.cpp has removed this chunk's positions again; the cache holds what came before
                self.length = past + start
                raise EngineError(f"llama_decode failed with status {status}")
            self.length = past + start + len(chunk)
            outputs = sum(1 for i in range(len(chunk)) if start + i >= first_kept)
            if outputs:
                logits = lib.llama_get_logits(self.ptr)  # [outputs, V], in batch order
                rows.append(torch.from_numpy(np.ctypeslib.as_array(logits, shape=(outputs, self.model.vocab_size)).copy()))
        return rows[0] if len(rows) == 1 else torch.cat(rows)


class LlamaTargetState(CachedTarget):
    """The Target contract on llama.cpp, beside torch's TargetState: the same bookkeeping (CachedTarget) over a
    Context instead of torch's KV cache (forward's crop happens inside Context.decode).

    There is no lean runner, no per-layer entry point and no record of the last layer's features here: the modes
    that need them (layerskip, earlyexit, lowrank, head) run on the torch engine only.
    """

    runner = "llama.cpp"
    kernel = "llama.cpp"

    def __init__(self, model: GGUFModel) -> None:
        super().__init__(model.vocab_size, model.context_len, model.device)
        self.model = model
        self.cache = model.context()

    def forward(self, ids: list[int], past: int, keep: int) -> torch.Tensor:
        return self.cache.decode(ids, past, keep)

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
        raise EngineError(f"llama.cpp could not quantise {source.name} to {file_type} (status {status})")


def target_state(model, runner: str = "auto") -> CachedTarget:
    """The Target for `model`: llama.cpp's for a GGUF model it loaded, the lean runner's for a GGUF file read in place
    (gguf_model.LeanModel), else torch's with `runner` (auto, lean or hf)."""
    if on_llama_cpp(model):
        return LlamaTargetState(model)
    if getattr(model, "engine", "torch") == "lean":
        return TargetState.on_runner(model.runner, model.context_len)
    return TargetState(model, runner)
