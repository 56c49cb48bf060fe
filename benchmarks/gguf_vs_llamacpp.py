"""The lean runner reading a GGUF file in place (engine/gguf_model.py) against llama.cpp on the same file: what a
forward of 1, 2, 5, 9 and 16 positions costs on each (the plain step, and verifies of K = 1, 4, 8, 15), in ms and in
each engine's own plain steps.

    python benchmarks/gguf_vs_llamacpp.py [FILE.gguf] [--threads 2] [--reps 5] [--repack both] [--file-layout]

Protocol as benchmarks/llamacpp_step.py: a 100-token prefill, then decodes at position 100 keeping logits for every
fed position (as a verify does), the median of 8 per repetition, the median over repetitions; engines interleaved
within each repetition. `--repack both` runs llama.cpp with its weight repacking (AMX where the CPU has it) and
without, whatever the probe decided (where repacking faults, that run dies).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from specchat import threads

threads.prepare_process()
threads.prepare_for_gguf()  # the GGUF engines' longer spin, as specchat runs them

import torch  # noqa: E402

from specchat import repack_probe  # noqa: E402
from specchat.engine import smallbatch  # noqa: E402
from specchat.engine.gguf_model import load_runner  # noqa: E402
from specchat.engine.llamacpp import GGUFModel  # noqa: E402
from specchat.models import default_gguf  # noqa: E402
from specchat.store import cache_dir  # noqa: E402

SIZES = (1, 2, 5, 9, 16)
PROMPT = list(range(1000, 1100))


class Lean:
    def __init__(self, path: Path, interleaved: bool = True) -> None:
        self.runner = load_runner(path, interleaved)

    def decodes(self, s: int) -> list[float]:
        cache = self.runner.new_cache()
        self.runner.step(PROMPT, cache, 0, keep=1)
        times = []
        for _ in range(8):
            t0 = time.perf_counter()
            self.runner.step(list(range(2000, 2000 + s)), cache, len(PROMPT), keep=s)
            times.append(time.perf_counter() - t0)
        return times


class LlamaCpp:
    def __init__(self, path: Path, repack: bool) -> None:
        self.model = GGUFModel(path, repack=repack)

    def decodes(self, s: int) -> list[float]:
        ctx = self.model.context(512)
        ctx.decode(PROMPT, 0, keep=1)
        times = []
        for _ in range(8):
            t0 = time.perf_counter()
            ctx.decode(list(range(2000, 2000 + s)), len(PROMPT), keep=s)
            times.append(time.perf_counter() - t0)
        return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", nargs="?", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--repack", choices=["probe", "on", "off", "both"], default="probe")
    ap.add_argument("--file-layout", action="store_true", help="also the lean runner on the file's layout (no copy)")
    args = ap.parse_args()
    path = Path(args.file) if args.file else default_gguf()
    torch.set_num_threads(args.threads)
    assert smallbatch.load(cache_dir() / "kernels"), "the kernel cannot be built here"
    repacks = {"probe": [repack_probe.verdict().repack], "on": [True], "off": [False], "both": [True, False]}[args.repack]
    lean = {"lean (interleaved)": Lean(path)}
    if args.file_layout:
        lean["lean (file layout)"] = Lean(path, interleaved=False)
    engines = {**lean, **{f"llama.cpp repack {'on' if r else 'off'}": LlamaCpp(path, r) for r in repacks}}
    print(f"{path.name}, {args.threads} threads, load average before {os.getloadavg()[0]:.2f}", flush=True)
    ms: dict[tuple, list[float]] = {}
    with torch.inference_mode():
        for _ in range(args.reps):
            for s in SIZES:
                for name, engine in engines.items():
                    ms.setdefault((name, s), []).append(1000 * statistics.median(engine.decodes(s)))
    print(f"load average after {os.getloadavg()[0]:.2f}")
    med = {k: statistics.median(v) for k, v in ms.items()}
    names = list(engines)
    print("| positions | " + " | ".join(f"{n} ms | x its step" for n in names) + " |")
    print("|---|" + "---|---|" * len(names))
    for s in SIZES:
        print(f"| {s} | " + " | ".join(f"{med[n, s]:.1f} | {med[n, s] / med[n, 1]:.2f}" for n in names) + " |")
    base = names[1] if len(names) > 1 else names[0]
    print(f"lean step / {base} step: {med[names[0], 1] / med[base, 1]:.2f}; "
          f"lean verify of 5 / {base} step: {med[names[0], 5] / med[base, 1]:.2f}")


if __name__ == "__main__":
    main()
