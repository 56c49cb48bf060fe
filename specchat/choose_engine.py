"""Which engine runs a GGUF file on this CPU (--engine auto): llama.cpp or the lean engine, measured once per file,
machine and build in a child process and remembered in the user cache.

Both read the file as it is and both are exact; they differ in speed, and how much depends on the CPU (llama.cpp's
AMX tiles, the lean kernel's cheap verify) and on the file. The child loads the target on each engine, reads a
64-token prompt, then times a plain step and a forward of 5 positions (a verify of K = 4), engines interleaved,
medians of 7: auto takes the engine whose step + verify is smaller, since a session runs both kinds of round.
A child, because loading both engines at once doubles the memory for seconds, and llama.cpp faults where its
kernels do (repack_probe.py).

    python -m specchat.choose_engine TARGET.gguf THREADS    # the child: prints one JSON line
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

CHOICE_VERSION = 1  # bump when the measurement changes: remembered choices are then made again
TIMEOUT_S = 600
PROMPT, REPS = 64, 7


@dataclass(frozen=True)
class Choice:
    engine: str  # "lean" or "llama.cpp"
    reason: str  # one line for the user: what was measured
    measured: bool = True  # False: the child failed (remembered for this process only, tried again next start)


def choice_key(path: Path, threads: str) -> str:
    """The file's content, this CPU, the thread setting, both builds and whether llama.cpp repacks: another of any is
    measured again."""
    from specchat import repack_probe
    from specchat.engine import smallbatch
    from specchat.usercache import content_key

    parts = [str(CHOICE_VERSION), content_key(path), threads, repack_probe.probe_key(), str(repack_probe.verdict().repack),
             hashlib.sha256(smallbatch.SOURCE.read_bytes()).hexdigest()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def choice_path(path: Path, threads: str) -> Path:
    from specchat.store import cache_dir

    return cache_dir() / "engine-choice" / f"{choice_key(path, threads)}.json"


def known(path: Path, threads: str) -> bool:
    """Whether choose() answers without measuring (the caller says that it measures)."""
    return choice_path(path, threads).is_file()


_made: dict[Path, Choice] = {}  # what choose() answered in this process, by file


def made(path: Path) -> Choice | None:
    """The choice choose() made for `path` in this process (the session's notice says it), if it was asked."""
    return _made.get(path)


@functools.cache
def choose(path: Path, threads: str) -> Choice:
    """This machine's engine for `path` at `threads` (a count, or threads.setting()'s "follows the load"), measured
    once. Where the child fails the answer is llama.cpp, as before there was a choice, with the reason."""
    _made[path] = found = remembered_choice(path, threads) or measure_in_child(path, threads)
    from specchat.store import write_atomic

    with contextlib.suppress(OSError):  # a read-only cache measures again next time: slower, never wrong
        remembered = choice_path(path, threads)
        if found.measured and not remembered.is_file():
            remembered.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(remembered, json.dumps(asdict(found)) + "\n")
    return found


def remembered_choice(path: Path, threads: str) -> Choice | None:
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        return Choice(**json.loads(choice_path(path, threads).read_text()))
    return None


def measure_in_child(path: Path, threads: str) -> Choice:
    count = threads if threads.isdigit() else "0"  # 0: the child lets specchat choose, as the session will
    try:
        done = subprocess.run([sys.executable, "-m", "specchat.choose_engine", str(path), count], capture_output=True,
                              text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Choice("llama.cpp", f"the engines could not be compared in {TIMEOUT_S} s; llama.cpp runs it", measured=False)
    try:
        ms = json.loads(done.stdout.strip().splitlines()[-1])
        return decide(ms)
    except (IndexError, ValueError, KeyError, TypeError):
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return Choice("llama.cpp", f"the engines could not be compared ({tail[:120]}); llama.cpp runs it", measured=False)


def decide(ms: dict) -> Choice:
    """ms: {"lean": [step, verify of 5], "llama.cpp": [step, verify of 5]} in milliseconds."""
    cost = {engine: sum(times) for engine, times in ms.items()}
    engine = min(cost, key=cost.get)
    other = "llama.cpp" if engine == "lean" else "lean"
    return Choice(engine, f"{engine} engine: a step {ms[engine][0]:.1f} ms and a verify of 5 positions {ms[engine][1]:.1f} ms on this "
                          f"CPU, {other} {ms[other][0]:.1f} / {ms[other][1]:.1f} (measured once; --engine chooses)")


# ---------------------------------------------------------------- the child


def main(path: Path, threads: int) -> dict:
    import statistics
    import time

    from specchat import repack_probe, threads as thread_policy

    thread_policy.prepare_process()
    thread_policy.prepare_for_gguf()
    import torch

    from specchat.engine import smallbatch
    from specchat.engine.gguf_model import load_runner
    from specchat.engine.llamacpp import GGUFModel
    from specchat.store import cache_dir

    thread_policy.set_threads(threads or None)
    if not smallbatch.load(cache_dir() / "kernels"):
        raise RuntimeError("the lean kernel cannot be built here")
    lean, llama = load_runner(path), GGUFModel(path, repack=repack_probe.verdict().repack)
    prompt = list(range(1000, 1000 + PROMPT))
    with torch.inference_mode():
        cache = lean.new_cache()
        lean.step(prompt, cache, 0, keep=1)
        ctx = llama.context(PROMPT + 16)
        ctx.decode(prompt, 0, keep=1)

        def lean_run(s):
            lean.step(list(range(2000, 2000 + s)), cache, PROMPT, keep=s)

        def llama_run(s):
            ctx.decode(list(range(2000, 2000 + s)), PROMPT, keep=s)

        times: dict[tuple[str, int], list[float]] = {}
        for _ in range(REPS):
            for name, run in (("lean", lean_run), ("llama.cpp", llama_run)):
                for s in (1, 5):
                    t0 = time.perf_counter()
                    run(s)
                    times.setdefault((name, s), []).append(1000 * (time.perf_counter() - t0))
    return {name: [statistics.median(times[name, 1]), statistics.median(times[name, 5])] for name in ("lean", "llama.cpp")}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), int(sys.argv[2]))))
