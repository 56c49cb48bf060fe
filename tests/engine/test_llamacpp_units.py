"""engine/llamacpp.py on a scripted stand-in for llama-cpp-python's C API: what it asks llama.cpp for, checked
against a fake that behaves as llama.cpp does where it matters (typed parameter structs, one KV cache per
sequence that must grow by consecutive positions, a sequence's share of the context, a batch of at most n_batch
tokens, output rows in batch order, a recurrent model's refused rollback, a failed decode that keeps what came
before, logging to stderr unless a callback is set). The fake's "model" is a known function of the prefix, so
every row decode returns is worked out independently. No model file is read; the whole file takes about a second.
"""

from __future__ import annotations

import ctypes
import gc
import operator
import sys

import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp")  # the real parameter structs and log-callback type

from specchat.engine import llamacpp  # noqa: E402
from specchat.engine.llamacpp import (  # noqa: E402
    EngineError,
    EngineUnavailable,
    GGUFModel,
    LlamaTargetState,
    N_BATCH,
    on_llama_cpp,
    quantize,
    target_state,
)
from specchat.engine.target import CachedTarget, Target, TargetState  # noqa: E402

V = 6  # the fake model's vocabulary


def logits_after(prefix: list[int]) -> list[float]:
    """The fake model's next-token logits after `prefix`: depends on every token and where it stands."""
    h = sum((j + 1) * (t + 3) for j, t in enumerate(prefix))
    return [float((h * (v + 1)) % 13) - 0.5 * v + 0.01 * len(prefix) for v in range(V)]


def rows_after(tokens: list[int], first: int) -> torch.Tensor:
    """Expected logits for positions first.. of `tokens` (row i: after tokens[: i + 1])."""
    return torch.tensor([logits_after(tokens[: i + 1]) for i in range(first, len(tokens))], dtype=torch.float32)


# ---------------------------------------------------------------- the stand-in


class Vocab:
    def __init__(self, spec):
        self.spec = spec


class ModelPtr:
    def __init__(self, path, spec):
        self.path, self.spec, self.vocab, self.freed = path, spec, Vocab(spec), False


class Memory:
    def __init__(self, ctx):
        self.ctx = ctx


class CtxPtr:
    def __init__(self, model, params):
        self.model, self.freed = model, False
        self.n_ctx, self.n_batch, self.n_seq_max = params.n_ctx, params.n_batch, params.n_seq_max
        self.n_ctx_seq = self.n_ctx // self.n_seq_max  # llama.cpp's KV cache: each sequence its share
        self.threads = (params.n_threads, params.n_threads_batch)
        self.seqs = {s: [] for s in range(self.n_seq_max)}  # per sequence: [(pos, token)]
        self.memory = Memory(self)
        self.out = (ctypes.c_float * (self.n_batch * V))()


class Batch(ctypes.Structure):
    """llama_batch: n_tokens typed as in C, the arrays typed as ctypes arrays of the sizes llama_batch_init gives."""

    _fields_ = [("n_tokens", ctypes.c_int32)]


class FakeLlama:
    """The llama_cpp module as the engine calls it."""

    llama_log_callback = llama_cpp.llama_log_callback  # the real CFUNCTYPE

    def __init__(self, files: dict | None = None, max_ctx: int = 1 << 20) -> None:
        self.files = dict(files or {})  # path -> spec
        self.max_ctx = max_ctx  # a larger context "runs out of memory"
        self.log_cb = None
        self.backend_inits = 0
        self.freed: list[tuple[str, object]] = []  # in order
        self.load_params = []
        self.fail = {}  # decode call number -> status
        self.decodes = 0
        self.quantized = []

    # logging and start-up
    def log(self, text: str) -> None:
        if self.log_cb:
            self.log_cb(2, text.encode(), None)
        else:
            sys.stderr.write(text)  # llama.cpp's default: everything on stderr

    def llama_log_set(self, cb, data) -> None:
        self.log_cb = cb

    def llama_backend_init(self) -> None:
        self.backend_inits += 1
        self.log("llama_backend_init: ggml ready\n")

    # models
    llama_model_default_params = staticmethod(llama_cpp.llama_model_default_params)

    def llama_model_load_from_file(self, path: bytes, params):
        assert isinstance(params, llama_cpp.llama_model_params)
        self.log(f"llama_model_loader: loading {path!r}\n")
        spec = self.files.get(path.decode())
        if spec is None:
            return None
        self.load_params.append(params.n_gpu_layers)
        return ModelPtr(path.decode(), spec)

    def _model(self, ptr) -> ModelPtr:
        assert isinstance(ptr, ModelPtr) and not ptr.freed, ptr
        return ptr

    def llama_model_free(self, ptr) -> None:
        self._model(ptr).freed = True
        self.freed.append(("model", ptr))

    def llama_model_get_vocab(self, ptr):
        return self._model(ptr).vocab

    def llama_vocab_n_tokens(self, vocab) -> int:
        assert isinstance(vocab, Vocab)
        return vocab.spec["vocab"]

    def llama_vocab_is_eog(self, vocab, t) -> bool:
        assert isinstance(vocab, Vocab)
        return operator.index(t) in vocab.spec.get("eog", ())

    def llama_model_n_ctx_train(self, ptr) -> int:
        return self._model(ptr).spec["n_ctx_train"]

    def llama_model_is_recurrent(self, ptr) -> bool:
        return self._model(ptr).spec.get("recurrent", False)

    def llama_model_is_hybrid(self, ptr) -> bool:
        return self._model(ptr).spec.get("hybrid", False)

    def llama_model_meta_val_str(self, ptr, key: bytes, buf, size) -> int:
        """As in C: -1 when absent, else the value's full length, at most size - 1 bytes of it and a NUL written."""
        meta = self._model(ptr).spec.get("meta", {})
        assert isinstance(key, bytes) and isinstance(buf, ctypes.Array)
        size = operator.index(size)
        value = meta.get(key.decode())
        if value is None:
            buf[0] = b"\0"
            return -1
        data = value if isinstance(value, bytes) else value.encode()
        n = min(len(data), size - 1)
        ctypes.memmove(buf, data, n)
        buf[n] = b"\0"
        return len(data)

    # contexts
    llama_context_default_params = staticmethod(llama_cpp.llama_context_default_params)

    def llama_init_from_model(self, model, params):
        self._model(model)
        assert isinstance(params, llama_cpp.llama_context_params)
        if params.n_ctx > self.max_ctx:
            return None
        return CtxPtr(model, params)

    def _ctx(self, ctx) -> CtxPtr:
        assert isinstance(ctx, CtxPtr) and not ctx.freed and not ctx.model.freed, ctx
        return ctx

    def llama_get_memory(self, ctx):
        return self._ctx(ctx).memory

    def llama_free(self, ctx) -> None:
        self._ctx(ctx).freed = True  # (a context freed after its model fails here: a use after free)
        self.freed.append(("context", ctx))

    def llama_set_n_threads(self, ctx, n, n_batch) -> None:
        self._ctx(ctx).threads = (operator.index(n), operator.index(n_batch))

    def llama_batch_init(self, n_tokens, embd, n_seq_max) -> Batch:
        n, embd, n_seq_max = operator.index(n_tokens), operator.index(embd), operator.index(n_seq_max)
        b = Batch()
        b.token = None if embd else (ctypes.c_int32 * n)()  # llama.cpp allocates one or the other
        b.embd = (ctypes.c_float * (n * embd))() if embd else None
        b.pos, b.n_seq_id, b.logits = (ctypes.c_int32 * n)(), (ctypes.c_int32 * n)(), (ctypes.c_int8 * n)()
        b.seq_id = [(ctypes.c_int32 * n_seq_max)() for _ in range(n)]
        b.freed = False
        return b

    def llama_batch_free(self, batch) -> None:
        assert isinstance(batch, Batch) and not batch.freed
        batch.freed = True
        self.freed.append(("batch", batch))

    def llama_memory_seq_rm(self, memory, seq, p0, p1) -> bool:
        assert isinstance(memory, Memory)
        ctx = self._ctx(memory.ctx)
        seq, p0, p1 = operator.index(seq), operator.index(p0), operator.index(p1)
        if seq not in ctx.seqs:
            return False
        p1 = sys.maxsize if p1 < 0 else p1
        cells = ctx.seqs[seq]
        if ctx.model.spec.get("recurrent") or ctx.model.spec.get("hybrid"):
            if any(p0 <= pos < p1 for pos, _ in cells):
                return False  # a recurrent state cannot be cut back
            return True
        ctx.seqs[seq] = [(pos, t) for pos, t in cells if not p0 <= pos < p1]
        return True

    def llama_decode(self, ctx, batch) -> int:
        ctx = self._ctx(ctx)
        assert isinstance(batch, Batch)
        self.decodes += 1
        if self.decodes in self.fail:
            return self.fail[self.decodes]  # nothing of this batch kept
        n = batch.n_tokens
        if n <= 0 or n > ctx.n_batch:
            return -1
        seqs = {s: list(c) for s, c in ctx.seqs.items()}
        outputs = []
        for i in range(n):
            tok, pos = batch.token[i], batch.pos[i]
            if not 0 <= tok < ctx.model.spec["vocab"] or batch.n_seq_id[i] < 1:
                return -1
            try:
                ids = [batch.seq_id[i][j] for j in range(batch.n_seq_id[i])]
            except IndexError:
                return -1
            for s in ids:
                if s not in seqs:
                    return -1  # seq_id >= n_seq_max
                last = seqs[s][-1][0] if seqs[s] else -1
                if pos != last + 1:
                    return -1  # "it is required that Y = X + 1"
                if len(seqs[s]) >= ctx.n_ctx_seq:
                    return 1  # no KV slot
                seqs[s].append((pos, tok))
            if batch.logits[i]:
                outputs.append(logits_after([t for _, t in seqs[ids[0]]]))
        ctx.seqs = seqs
        flat = [x for row in outputs for x in row]
        flat += [float("nan")] * (len(ctx.out) - len(flat))  # the rest of llama.cpp's buffer: not this batch's
        ctx.out[:] = flat
        return 0

    def llama_get_logits(self, ctx):
        return ctypes.cast(self._ctx(ctx).out, ctypes.POINTER(ctypes.c_float))

    # quantisation
    llama_model_quantize_default_params = staticmethod(llama_cpp.llama_model_quantize_default_params)

    def llama_model_quantize(self, src: bytes, dst: bytes, params_ref) -> int:
        params = params_ref._obj
        assert isinstance(params, llama_cpp.llama_model_quantize_params)
        spec = self.files.get(src.decode())
        if spec is None:
            return 1
        source_type = int(spec.get("meta", {}).get("general.file_type", 0))
        if source_type not in (0, 1, 32) and not params.allow_requantize:  # F32, F16, BF16 only
            return 1
        self.quantized.append((src.decode(), dst.decode(), params.ftype, params.nthread))
        self.files[dst.decode()] = {**spec, "meta": {**spec.get("meta", {}), "general.file_type": str(params.ftype)}}
        return 0


def spec(**overrides) -> dict:
    return {"vocab": V, "n_ctx_train": 64, "eog": {5}, "meta": {"general.file_type": "0"}, **overrides}


@pytest.fixture
def fake(monkeypatch):
    """The stand-in, as bindings() would return it, with one float32 model file "m.gguf"."""
    lib = FakeLlama({"m.gguf": spec()})
    monkeypatch.setattr(llamacpp, "_lib", lib)
    monkeypatch.setattr(llamacpp, "_quiet", "the log callback")
    return lib


# ---------------------------------------------------------------- bindings


def test_bindings_load_once_and_silence_llama_cpps_log(monkeypatch, capfd):
    lib = FakeLlama()
    monkeypatch.setattr(llamacpp, "_lib", None)
    monkeypatch.setattr(llamacpp, "_quiet", None)
    monkeypatch.setitem(sys.modules, "llama_cpp", lib)
    assert llamacpp.bindings() is lib and llamacpp.available()
    assert llamacpp.bindings() is lib and lib.backend_inits == 1  # initialised once
    assert lib.log_cb and lib.log_cb is llamacpp._quiet  # a real callback, kept referenced by the module
    lib.log("a later message\n")
    assert capfd.readouterr().err == ""  # llama.cpp's logging goes nowhere


def test_without_llama_cpp_python_the_engine_is_unavailable_and_says_why(monkeypatch):
    monkeypatch.setattr(llamacpp, "_lib", None)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import raises ImportError
    with pytest.raises(EngineUnavailable, match=r"^the llama.cpp engine needs llama-cpp-python \(ModuleNotFoundError: "):
        llamacpp.bindings()
    assert llamacpp.available() is False


# ---------------------------------------------------------------- which engine


def test_only_a_model_that_says_llama_cpp_is_on_llama_cpp(fake, tiny_target):
    assert on_llama_cpp(GGUFModel("m.gguf")) is True
    assert on_llama_cpp(tiny_target) is False  # a torch module has no `engine`
    assert on_llama_cpp(type("Other", (), {"engine": "torch"})()) is False


def test_target_state_is_llama_cpps_for_a_gguf_and_torchs_with_its_runner_otherwise(fake, tiny_target):
    model = GGUFModel("m.gguf")
    state = target_state(model)
    assert isinstance(state, LlamaTargetState) and state.model is model
    torch_state = target_state(tiny_target)  # the default runner: auto
    assert type(torch_state) is TargetState and torch_state.model is tiny_target and torch_state.runner == "lean"
    hf = target_state(tiny_target, "hf")
    assert hf.model is tiny_target and hf.runner == "hf"


# ---------------------------------------------------------------- GGUFModel


def test_a_model_reads_its_vocabulary_context_ends_and_type_from_the_file(fake):
    fake.files["q8.gguf"] = spec(vocab=V, n_ctx_train=48, eog={2, 5}, meta={"general.file_type": "7"})
    model = GGUFModel("q8.gguf")
    assert model.path == llamacpp.Path("q8.gguf") and model.engine == "llama.cpp"
    assert model.vocab_size == V and model.context_len == 48 and model.eos_ids == {2, 5}
    assert model.can_rollback is True and model.device == torch.device("cpu")
    assert model.file_type == "7" and model.dtype == "Q8_0"
    assert fake.load_params == [0]  # no layer offloaded: this engine is the CPU's


def test_a_long_trained_context_is_capped(fake):
    fake.files["long.gguf"] = spec(n_ctx_train=131072)
    assert GGUFModel("long.gguf").context_len == llamacpp.MAX_CONTEXT == 8192


@pytest.mark.parametrize("recurrent, hybrid", [(True, False), (False, True), (True, True)])
def test_a_recurrent_or_hybrid_model_cannot_roll_back(fake, recurrent, hybrid):
    fake.files["rnn.gguf"] = spec(recurrent=recurrent, hybrid=hybrid)
    assert GGUFModel("rnn.gguf").can_rollback is False


def test_a_file_llama_cpp_cannot_load_is_an_engine_error_naming_it(fake):
    with pytest.raises(EngineError, match=r"^llama.cpp cannot load missing\.gguf$"):
        GGUFModel("missing.gguf")


def test_metadata_values_absent_empty_long_and_not_utf8(fake):
    fake.files["meta.gguf"] = spec(meta={"general.file_type": "1", "general.name": "", "general.bytes": b"Q\xff8",
                                          "general.long": "x" * 300})
    model = GGUFModel("meta.gguf")
    assert model.meta("general.missing") is None
    assert model.meta("general.name") == ""  # present but empty is not absent
    assert model.meta("general.bytes") == "Q\ufffd8"  # replaced, not an error
    long = model.meta("general.long")
    assert 0 < len(long) < 300 and long == "x" * len(long)  # cut to the buffer, never read past it
    assert model.dtype == "F16"


def test_dtype_of_a_file_without_a_known_type_is_gguf(fake):
    fake.files["odd.gguf"] = spec(meta={})
    assert GGUFModel("odd.gguf").file_type is None and GGUFModel("odd.gguf").dtype == "gguf"


def test_a_model_is_freed_when_it_goes(fake):
    model = GGUFModel("m.gguf")
    ptr = model.ptr
    del model
    gc.collect()
    assert fake.freed == [("model", ptr)]


# ---------------------------------------------------------------- Context


def test_a_context_has_the_size_asked_or_the_models(fake):
    model = GGUFModel("m.gguf")
    assert model.context(40).n_ctx == 40 and model.context(40).ptr.n_ctx == 40
    assert model.context().n_ctx == model.context_len == 64
    ctx = model.context(40)
    assert ctx.model is model and ctx.length == 0 and ctx.ptr.threads == (torch.get_num_threads(),) * 2


def test_a_context_llama_cpp_cannot_make_is_an_engine_error(fake):
    fake.max_ctx = 32
    with pytest.raises(EngineError, match=r"^llama.cpp cannot make a context of 40 positions for m\.gguf \(out of memory\?\)$"):
        GGUFModel("m.gguf").context(40)


def test_decode_returns_the_last_keep_rows_and_holds_what_it_fed(fake):
    ctx = GGUFModel("m.gguf").context(40)
    ids = [1, 4, 0, 3, 2]
    torch.testing.assert_close(ctx.decode(ids, 0, 1), rows_after(ids, 4), rtol=0, atol=0)
    assert ctx.length == 5
    more = [5, 1, 1]
    out = ctx.decode(more, 5, 3)  # every position fed: a verify of K + 1
    assert out.shape == (3, V) and out.dtype == torch.float32
    torch.testing.assert_close(out, rows_after(ids + more, 5), rtol=0, atol=0)
    assert ctx.length == 8 and [t for _, t in ctx.ptr.seqs[0]] == ids + more
    ctx.decode([0, 0], 8, 1)  # the next call overwrites llama.cpp's buffer: what was returned is a copy
    torch.testing.assert_close(out, rows_after(ids + more, 5), rtol=0, atol=0)


def test_decode_at_an_earlier_position_drops_what_came_after(fake):
    ctx = GGUFModel("m.gguf").context(40)
    ctx.decode([1, 2, 3, 4, 5], 0, 1)
    out = ctx.decode([0, 0], 2, 2)  # keep 1, 2; then 0, 0
    torch.testing.assert_close(out, rows_after([1, 2, 0, 0], 2), rtol=0, atol=0)
    assert ctx.length == 4 and [t for _, t in ctx.ptr.seqs[0]] == [1, 2, 0, 0]
    ctx.decode([3], 0, 1)  # from the start again
    assert ctx.length == 1 and ctx.ptr.seqs[0] == [(0, 3)]


def test_a_fresh_context_cannot_be_fed_past_what_it_holds(fake):
    ctx = GGUFModel("m.gguf").context(40)
    with pytest.raises(ValueError, match=r"^the cache holds 0 positions; cannot feed at 1$"):
        ctx.decode([1], 1, 1)
    ctx.decode([1, 2], 0, 1)
    with pytest.raises(ValueError, match="holds 2 positions; cannot feed at 3"):
        ctx.decode([1], 3, 1)


def test_a_context_takes_exactly_its_size(fake):
    ctx = GGUFModel("m.gguf").context(40)
    ctx.decode(list(range(V)) * 5, 0, 1)  # 30
    torch.testing.assert_close(ctx.decode([1] * 10, 30, 1), rows_after(list(range(V)) * 5 + [1] * 10, 39), rtol=0, atol=0)
    assert ctx.length == 40
    with pytest.raises(EngineError, match=r"^41 positions do not fit llama.cpp's context of 40$"):
        ctx.decode([2, 3], 39, 1)
    assert ctx.length == 40  # refused before anything was dropped
    with pytest.raises(EngineError, match=r"^45 positions do not fit"):
        ctx.decode([2] * 15, 30, 1)


def test_a_prompt_longer_than_a_batch_goes_in_chunks_and_keeps_rows_across_them(fake):
    ctx = GGUFModel("m.gguf").context(2000)
    ids = [(i * 7) % V for i in range(N_BATCH + 20)]
    out = ctx.decode(ids, 0, 25)  # 5 rows from the first chunk, 20 from the second
    torch.testing.assert_close(out, rows_after(ids, len(ids) - 25), rtol=0, atol=0)
    assert ctx.length == len(ids) and fake.decodes == 2
    tail = [(i * 5) % V for i in range(2 * N_BATCH + 3)]  # three chunks, fed after position 100
    out = ctx.decode(tail, 100, 1)
    torch.testing.assert_close(out, rows_after(ids[:100] + tail, 100 + len(tail) - 1), rtol=0, atol=0)
    assert ctx.length == 100 + len(tail) and fake.decodes == 5
    assert [pos for pos, _ in ctx.ptr.seqs[0]] == list(range(ctx.length))
    exact = [1] * N_BATCH  # exactly one batch
    torch.testing.assert_close(ctx.decode(exact, 0, 2), rows_after(exact, N_BATCH - 2), rtol=0, atol=0)


def test_a_failed_decode_keeps_what_came_before_its_chunk(fake):
    ctx = GGUFModel("m.gguf").context(2000)
    ctx.decode([1, 2, 3], 0, 1)
    fake.fail = {fake.decodes + 2: 1}  # the second chunk of the next call
    ids = [4] * (N_BATCH + 10)
    with pytest.raises(EngineError, match=r"^llama_decode failed with status 1$"):
        ctx.decode(ids, 3, 1)
    assert ctx.length == 3 + N_BATCH == len(ctx.ptr.seqs[0])
    fake.fail = {fake.decodes + 1: -3}  # the first chunk
    with pytest.raises(EngineError, match="status -3"):
        ctx.decode([1, 1], 2, 1)
    assert ctx.length == 2 == len(ctx.ptr.seqs[0])  # the crop to 2 happened; nothing of the batch
    torch.testing.assert_close(ctx.decode([5], 2, 1), rows_after([1, 2, 5], 2), rtol=0, atol=0)


def test_threads_follow_torchs_count_per_call(fake):
    ctx = GGUFModel("m.gguf").context(40)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(before + 1)
        ctx.decode([1], 0, 1)
        assert ctx.ptr.threads == (before + 1, before + 1) and ctx.threads == before + 1
    finally:
        torch.set_num_threads(before)
    ctx.decode([2], 1, 1)
    assert ctx.ptr.threads == (before, before) and ctx.threads == before


def test_crop_keeps_a_prefix_and_a_recurrent_model_refuses(fake):
    ctx = GGUFModel("m.gguf").context(40)
    ctx.decode([1, 2, 3, 4], 0, 1)
    ctx.crop(6)  # longer than held: nothing
    assert ctx.length == 4
    ctx.crop(2)
    assert ctx.length == 2 and ctx.ptr.seqs[0] == [(0, 1), (1, 2)]
    ctx.crop(0)
    assert ctx.length == 0 and ctx.ptr.seqs[0] == []
    fake.files["rnn.gguf"] = spec(recurrent=True)
    rnn = GGUFModel("rnn.gguf").context(40)
    rnn.decode([1, 2, 3], 0, 1)
    rnn.crop(3)  # nothing to drop: fine
    with pytest.raises(EngineError, match=r"^llama.cpp cannot roll rnn\.gguf's cache back \(a recurrent model\): use --mode off$"):
        rnn.crop(1)
    assert rnn.length == 3


def test_a_context_is_freed_before_the_model_it_was_made_from(fake):
    model = GGUFModel("m.gguf")
    ctx = model.context(40)
    ptr, batch, mptr = ctx.ptr, ctx.batch, model.ptr
    ctx.me = ctx  # only the cycle collector frees it, with the model in the same garbage
    del model, ctx
    gc.collect()
    assert fake.freed == [("batch", batch), ("context", ptr), ("model", mptr)]


# ---------------------------------------------------------------- LlamaTargetState


def test_the_target_state_starts_as_a_fresh_torch_state_does(fake, tiny_target):
    model = GGUFModel("m.gguf")
    state, ref = LlamaTargetState(model), TargetState(tiny_target, "hf")
    assert (state.tokens, state.head, state.past) == (ref.tokens, ref.head, ref.past)
    assert state.model is model and state.vocab_size == V and state.context_len == 64 and state.cache.n_ctx == 64
    assert state.device == torch.device("cpu") and state.kernel == "llama.cpp" and state.runner == "llama.cpp"
    assert not hasattr(state, "lean")  # no lean runner: the modes that run the target's layers are torch's


def test_start_verify_commit_feed_the_right_positions(fake):
    state = LlamaTargetState(GGUFModel("m.gguf"))
    assert state.start([1, 2, 3]) == 3
    torch.testing.assert_close(state.head, rows_after([1, 2, 3], 2), rtol=0, atol=0)
    torch.testing.assert_close(state.verify([4, 5]), rows_after([1, 2, 3, 4, 5], 2), rtol=0, atol=0)
    state.commit([4, 0])  # one draft kept, then a replacement: the cache holds tokens[:-1]
    assert state.tokens == [1, 2, 3, 4, 0] and state.cache.length == 4
    torch.testing.assert_close(state.verify([2]), rows_after([1, 2, 3, 4, 0, 2], 4), rtol=0, atol=0)
    state.commit([2, 1])
    assert state.start([1, 2, 3, 4, 0, 2, 1, 5, 5]) == 3  # the cached prefix reused
    assert state.start([1, 2, 4]) == 0  # cropped to [1, 2]; 4 pending
    assert state.cache.length == 2
    torch.testing.assert_close(state.verify([]), rows_after([1, 2, 4], 2), rtol=0, atol=0)


def test_the_state_keeps_no_features(fake):
    """Torch's state and llama.cpp's implement the Target contract side by side: llama.cpp's has no features to
    record (a drafter that needs them is refused on this engine), not a method that refuses."""
    state = LlamaTargetState(GGUFModel("m.gguf"))
    assert not hasattr(state, "record") and not hasattr(state, "features") and not hasattr(state, "known")
    assert isinstance(state, Target) and isinstance(state, CachedTarget) and not isinstance(state, TargetState)


# ---------------------------------------------------------------- quantize


@pytest.mark.parametrize("file_type, number", [("Q8_0", 7), ("Q4_0", 2), ("F32", 0), ("F16", 1)])
def test_quantize_writes_the_type_asked(fake, tmp_path, file_type, number):
    fake.files["src.gguf"] = spec()
    quantize(llamacpp.Path("src.gguf"), llamacpp.Path("dst.gguf"), file_type)
    assert fake.quantized == [("src.gguf", "dst.gguf", number, torch.get_num_threads())]
    assert GGUFModel("dst.gguf").dtype == file_type


def test_quantize_requantises_an_already_quantised_file(fake):
    fake.files["q8.gguf"] = spec(meta={"general.file_type": "7"})
    quantize(llamacpp.Path("q8.gguf"), llamacpp.Path("q4.gguf"), "Q4_0")
    assert GGUFModel("q4.gguf").dtype == "Q4_0"


def test_a_failed_quantisation_is_an_engine_error(fake):
    with pytest.raises(EngineError, match=r"^llama.cpp could not quantise nope\.gguf to Q4_0 \(status 1\)$"):
        quantize(llamacpp.Path("/x/nope.gguf"), llamacpp.Path("out.gguf"), "Q4_0")
