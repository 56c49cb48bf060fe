"""The lean runner's step on a GGUF file's own blocks (gguf_model.with_file_blocks) against the same runner on the float32
conversion, for 1..16 positions, interleaved, medians: what a plain step and a verify cost when the matrices are
the file's 4-bit blocks (x rounded to int8 per block) instead of float32 copies.

    python benchmarks/gguf_runner_step.py [--reps 9] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from specchat import models
from specchat.engine import smallbatch
from specchat.engine.gguf_model import with_file_blocks
from specchat.engine.runner import lean_runner
from specchat.store import cache_dir


def step_s(runner, prompt: list[int], positions: int) -> float:
    """Seconds of one forward of `positions` positions after the prompt (the prompt's cache made first, not timed)."""
    cache = runner.new_cache()
    runner.forward(prompt, range(runner.n_layers), cache, 0)
    ids = prompt[-positions:]
    t = time.perf_counter()
    runner.forward(ids, range(runner.n_layers), cache, len(prompt), keep=positions)
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--positions", default="1,2,5,8,16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    smallbatch.load(cache_dir() / "kernels")
    model = models.load_model(None, torch.device("cpu"), torch.float32)
    runners = {"float32": lean_runner(model.model)}
    runners["blocks"] = with_file_blocks(runners["float32"], models.default_gguf())
    prompt = model.raw_ids("The quick brown fox jumps over the lazy dog. " * 8)
    positions = [int(p) for p in args.positions.split(",")]
    times = {(name, p): [] for name in runners for p in positions}
    print(f"default model, {args.threads} threads, kernel {smallbatch.kernel_name()}, load {os.getloadavg()[0]:.2f}")
    with torch.inference_mode():
        for _ in range(args.reps):
            for p in positions:
                for name, runner in runners.items():
                    times[name, p].append(step_s(runner, prompt, p))
    print(f"load after {os.getloadavg()[0]:.2f}")
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    print("| positions | float32 ms | x its step | blocks ms | x its step | blocks / float32 |")
    print("|---|---|---|---|---|---|")
    for p in positions:
        f, b = med["float32", p], med["blocks", p]
        print(f"| {p} | {f:.2f} | {f / med['float32', 1]:.2f} | {b:.2f} | {b / med['blocks', 1]:.2f} | {b / f:.2f} |")


if __name__ == "__main__":
    main()
