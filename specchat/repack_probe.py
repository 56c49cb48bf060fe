"""Whether llama.cpp's weight repacking (its "extra buffer types": AMX tiles, interleaved rows) is safe on this
CPU and llama.cpp build, decided once in a child process and remembered in the user cache.

A fault in llama.cpp's native kernels kills the whole process, so it must happen somewhere else first. Seen: a
llama.cpp built by GCC 11-12 on a CPU with AMX dies (SIGILL or SIGSEGV) on every decode of 2 or more positions (the
compiler drops the tile configuration; the README's install works around it with scripts/amx_tilecfg_fix.h). The child
writes a tiny llama GGUF, quantises it to types llama.cpp repacks, decodes 1, 2 and 9 positions with repacking
on and off and compares the logits; specchat repacks only where the child lived and agreed.

    python -m specchat.repack_probe DIR     # the child: prints a JSON line per step and its result, or dies
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

PROBE_VERSION = 1  # bump when the child's checks change: cached verdicts are then made again
TYPES = ("Q4_0", "Q4_K_M")  # a legacy type and k-quants (Q4_K, Q6_K): each takes its own repacked kernel
FEEDS = (1, 2, 9)  # positions per decode: a plain step, the smallest batch, a verify of K = 8
TOLERANCE = 0.05  # largest |logit difference| / largest |logit|: other kernels round differently, not this much
TIMEOUT_S = 120


@dataclass(frozen=True)
class Verdict:
    repack: bool  # load models with llama.cpp's extra buffer types
    reason: str  # what the probe saw, for the log and exports

    @property
    def notice(self) -> str | None:
        """The one line the user sees where repacking is off; nothing where it is on."""
        if self.repack:
            return None
        return f"llama.cpp's {repacker()} {self.reason}: weight repacking off (slower, safe)"


def keep_tiles_for_llama_cpp() -> None:
    """Before torch loads in a process that will run llama.cpp: keep oneDNN (torch's bfloat16 matmuls) off AMX.
    oneDNN releases the tile configuration after each AMX kernel, while llama.cpp configures a thread's tiles once
    and keeps them: a torch bfloat16 matmul, then a llama.cpp decode of several positions on the same thread, dies
    of SIGILL. oneDNN's AVX-512 kernels stay (torch's float32 matmuls never used AMX)."""
    if "torch" not in sys.modules and "amx_tile" in cpu_flags().split():
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")


def repacker() -> str:
    """What llama.cpp's repacking runs on this CPU, in the words a user would search for."""
    return "AMX path" if "amx_int8" in cpu_flags().split() else "weight repacking"


def cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def library_files() -> list[Path]:
    """llama-cpp-python's native libraries: a rebuilt or upgraded llama.cpp is probed again."""
    for folder in sys.path:
        lib = Path(folder or ".") / "llama_cpp" / "lib"
        if lib.is_dir():
            return sorted(p for p in lib.glob("*.so*") if p.is_file())
    return []


def probe_key() -> str:
    parts = [str(PROBE_VERSION), platform.machine(), cpu_flags()]
    for p in library_files():
        st = p.stat()
        parts.append(f"{p.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def verdict_path() -> Path:
    from specchat.store import cache_dir

    return cache_dir() / "llama.cpp" / f"repack-{probe_key()}.json"


@functools.cache
def verdict() -> Verdict:
    """This machine's verdict: LLAMA_ARG_REPACK=0/1 (llama-server's own switch) decides; else the cached probe."""
    forced = os.environ.get("LLAMA_ARG_REPACK")
    if forced in ("0", "1"):
        return Verdict(forced == "1", f"is set {'on' if forced == '1' else 'off'} by LLAMA_ARG_REPACK={forced}")
    path = verdict_path()
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        return Verdict(**json.loads(path.read_text()))
    found = run_probe(child_command)
    from specchat.store import write_atomic

    with contextlib.suppress(OSError):  # a read-only cache probes again next time: slower, never wrong
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(asdict(found)) + "\n")
    return found


def known() -> bool:
    """Whether verdict() answers without running the probe (the caller may want to say that it runs)."""
    return verdict.cache_info().currsize > 0 or os.environ.get("LLAMA_ARG_REPACK") in ("0", "1") or verdict_path().is_file()


def child_command(workdir: Path) -> list[str]:
    return [sys.executable, "-m", "specchat.repack_probe", str(workdir)]


def run_probe(command=child_command) -> Verdict:
    """Run the child and read its verdict; a child that dies or hangs means repacking is not safe."""
    with tempfile.TemporaryDirectory(prefix="specchat-repack-probe-") as tmp:
        try:
            done = subprocess.run(command(Path(tmp)), capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return Verdict(False, f"did not finish a test decode on this CPU in {TIMEOUT_S} s")
        except OSError as e:
            return Verdict(False, f"could not be tested ({e})")
    lines = done.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, ValueError):
        result = {}
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name if -done.returncode in signal.valid_signals() else str(-done.returncode)
        return Verdict(False, f"faults ({name}) on this CPU" + (f" on a decode of {result['step']}" if "step" in result else ""))
    if "worst" not in result and "error" not in result:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return Verdict(False, f"could not be tested (probe exit status {done.returncode}: {tail})")
    if result.get("error"):
        return Verdict(False, f"could not be tested ({result['error']})")
    if result["worst"] > TOLERANCE:
        return Verdict(False, f"gives logits {result['worst']:.2f} of their range away from unrepacked ones on this CPU ({result['where']})")
    return Verdict(True, f"matches unrepacked logits to {result['worst']:.1e} of their range on {', '.join(TYPES)}")


# ---------------------------------------------------------------- the child


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A float32 llama GGUF with random weights, its matrices shaped so every type's repacked kernel takes them
    (rows of 256, a multiple of every block; 64 output rows per tile pair)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    hidden, ffn, vocab, heads = 256, 512, 512, 4

    def w(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab)
    writer.add_token_merges(["t1 t2"])  # llama.cpp requires the key; the probe feeds ids
    writer.add_tensor("token_embd.weight", w(vocab, hidden) * 8)
    ones = np.ones(hidden, dtype=np.float32)
    for name, tensor in (("attn_norm", ones), ("attn_q", w(hidden, hidden)), ("attn_k", w(hidden, hidden)),
                         ("attn_v", w(hidden, hidden)), ("attn_output", w(hidden, hidden)), ("ffn_norm", ones),
                         ("ffn_gate", w(ffn, hidden)), ("ffn_up", w(ffn, hidden)), ("ffn_down", w(hidden, ffn))):
        writer.add_tensor(f"blk.0.{name}.weight", tensor)
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", w(vocab, hidden) * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def decode_logits(lib, path: Path, repack: bool, n: int):
    """[n, V] logits of one decode of n positions (ids 1..n) on a fresh context, 2 threads."""
    import numpy as np

    params = lib.llama_model_default_params()
    params.n_gpu_layers, params.use_extra_bufts = 0, repack
    model = lib.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp cannot load {path.name}")
    cparams = lib.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_threads, cparams.n_threads_batch = 64, 16, 16, 2, 2
    ctx = lib.llama_init_from_model(model, cparams)
    batch = lib.llama_batch_init(16, 0, 1)
    try:
        batch.n_tokens = n
        for i in range(n):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = 1 + i, i, 1, True
            batch.seq_id[i][0] = 0
        if lib.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        return np.ctypeslib.as_array(lib.llama_get_logits(ctx), shape=(n, vocab)).astype(np.float64)
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
        lib.llama_model_free(model)


def child(workdir: Path) -> dict:
    """Decode with repacking on and off; the worst disagreement relative to the logits' range."""
    import llama_cpp as lib
    import numpy as np

    quiet = lib.llama_log_callback(lambda level, text, data: None)
    lib.llama_log_set(quiet, ctypes.c_void_p(0))
    lib.llama_backend_init()
    from gguf import LlamaFileType

    source = write_tiny_gguf(workdir / "tiny-f32.gguf")
    worst, where = 0.0, ""
    for file_type in TYPES:
        path = workdir / f"tiny-{file_type}.gguf"
        qparams = lib.llama_model_quantize_default_params()
        qparams.ftype = int(LlamaFileType[f"MOSTLY_{file_type}"])
        if lib.llama_model_quantize(str(source).encode(), str(path).encode(), ctypes.byref(qparams)) != 0:
            raise RuntimeError(f"llama.cpp could not quantise the probe's model to {file_type}")
        for n in FEEDS:
            step = f"{n} position{'s' * (n > 1)} of {file_type}"
            print(json.dumps({"step": step}), flush=True)  # the parent's clue if we die
            repacked, plain = decode_logits(lib, path, True, n), decode_logits(lib, path, False, n)
            gap = float(np.abs(repacked - plain).max() / max(np.abs(plain).max(), 1e-9))
            if gap >= worst:
                worst, where = gap, step
    return {"worst": worst, "where": where}


if __name__ == "__main__":
    try:
        out = child(Path(sys.argv[1]))
    except Exception as e:  # a Python-level failure is an answer too; a native fault kills the child before this
        out = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)
