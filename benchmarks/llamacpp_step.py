"""What one llama.cpp decode costs for 1, 2, 5, 9 and 16 positions (the plain step and verifies of K = 1, 4, 8, 15), per
quantisation of one GGUF file: the v of the speedup model on this engine, and a quant draft's c.

    python benchmarks/llamacpp_step.py [FILE.gguf] [--types Q4_0,Q8_0,F32] [--threads 1,2] [--reps 3] [--repack both]

`--repack both` loads every file twice, with llama.cpp's weight repacking (AMX on CPUs that have it) and without,
whatever the probe decided (on a machine where repacking faults, that run dies). Requantised copies are made once into the user cache (models.quantized_gguf). Each figure: median over
repetitions of the median of 8 decodes at position 100 (after a 100-token prefill), keeping logits for every
fed position as a verify does. Types and thread counts are interleaved within each repetition.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from specchat import threads

threads.prepare_process()

import torch  # noqa: E402

from specchat import repack_probe  # noqa: E402
from specchat.engine.llamacpp import GGUFModel  # noqa: E402
from specchat.models import default_gguf, quantized_gguf  # noqa: E402

SIZES = (1, 2, 5, 9, 16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file", nargs="?", default=None)
    ap.add_argument("--types", default="Q4_0,Q8_0,F32")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--repack", choices=["probe", "on", "off", "both"], default="probe")
    args = ap.parse_args()
    path = Path(args.file) if args.file else default_gguf()
    repacks = {"probe": [repack_probe.verdict().repack], "on": [True], "off": [False], "both": [True, False]}[args.repack]
    files = {"file": path, **{t: quantized_gguf(path, t) for t in args.types.split(",") if t}}
    models = {(name, r): GGUFModel(p, repack=r) for name, p in files.items() for r in repacks}
    print(f"{path.name}; load average before {os.getloadavg()}", flush=True)
    prompt = list(range(1000, 1100))
    ms: dict[tuple, list[float]] = {}
    for _ in range(args.reps):
        for n in [int(x) for x in args.threads.split(",")]:
            torch.set_num_threads(n)
            for name, model in models.items():
                ctx = model.context(512)
                ctx.decode(prompt, 0, keep=1)
                for s in SIZES:
                    times = []
                    for _ in range(8):
                        t0 = time.perf_counter()
                        ctx.decode(list(range(2000, 2000 + s)), len(prompt), keep=s)
                        times.append(time.perf_counter() - t0)
                    ms.setdefault((name, n, s), []).append(1000 * statistics.median(times))
    print(f"load average after {os.getloadavg()}")
    print(f"{'weights':17} {'threads':>7} " + " ".join(f"{f'{s} pos. ms (x1)':>17}" for s in SIZES) + "   step / file's step")
    for n in [int(x) for x in args.threads.split(",")]:
        base = statistics.median(ms[(("file", repacks[-1]), n, 1)])
        for name, model in models.items():
            row = [statistics.median(ms[(name, n, s)]) for s in SIZES]
            cells = " ".join(f"{v:8.2f} ({v / row[0]:4.2f}x)" for v in row)
            label = model.dtype + ("" if args.repack == "probe" else " repack" if model.repack else " plain")
            print(f"{label:17} {n:7} {cells}   {row[0] / base:.2f}")


if __name__ == "__main__":
    main()
