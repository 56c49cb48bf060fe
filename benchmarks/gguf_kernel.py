"""A step's matrix products on a GGUF file's own blocks (smallbatch.gguf_linear) against the fused float32 kernel
on their dequantised copy (what the torch engine's lean runner multiplies today), for S = 1..16 positions.

Every Q4_0/Q4_1/Q8_0 matrix of the file (the default model: 210 Q4_1 layer matrices and the Q8_0 embedding, its
tied LM head) multiplied once by S random rows, each configuration in turn within every repetition (interleaved),
median over repetitions. What it says: the cost of S positions over one (decode-once: a verify of 5 positions
should cost little more than a step) and each kernel's time. What it leaves out: the layer's other work (norms,
attention, RoPE) and llama.cpp's own step (`benchmarks/llamacpp_step.py` measures that).

    python benchmarks/gguf_kernel.py [--model FILE.gguf] [--reps 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import gguf
import torch

from specchat.engine import smallbatch
from specchat.models import default_gguf
from specchat.store import cache_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--positions", default="1,2,5,8,16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert smallbatch.load(cache_dir() / "kernels"), "the kernel cannot be built here"
    reader = gguf.GGUFReader(str(args.model or default_gguf()))
    blocks = [smallbatch.GGUFWeights.of(t) for t in reader.tensors if t.tensor_type.name in smallbatch.GGUF_TYPES]
    dense = [w.float() for w in blocks]  # [N, D] float32 each
    positions = [int(p) for p in args.positions.split(",")]
    file_mb = sum(w.blocks.numel() for w in blocks) / 1e6
    dense_mb = sum(w.numel() * 4 for w in dense) / 1e6
    print(f"{len(blocks)} matrices: {file_mb:.0f} MB of blocks, {dense_mb:.0f} MB as float32; {args.threads} threads, "
          f"load {os.getloadavg()[0]:.2f}")
    times = {(kind, s): [] for kind in ("blocks", "float32") for s in positions}
    xs = {s: {w.shape[1]: torch.randn(s, w.shape[1]) for w in blocks} for s in positions}
    with torch.inference_mode():
        for _ in range(args.reps):
            for s in positions:
                t = time.perf_counter()
                for w in blocks:
                    smallbatch.gguf_linear(xs[s][w.shape[1]], w)
                times["blocks", s].append(time.perf_counter() - t)
                t = time.perf_counter()
                for w in dense:
                    smallbatch.linear(xs[s][w.shape[1]], w)
                times["float32", s].append(time.perf_counter() - t)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    print("| positions | blocks ms | x one position | float32 kernel ms | x one position | blocks / float32 |")
    print("|---|---|---|---|---|---|")
    med = {key: statistics.median(v) * 1000 for key, v in times.items()}
    for s in positions:
        b, f = med["blocks", s], med["float32", s]
        print(f"| {s} | {b:.2f} | {b / med['blocks', 1]:.2f} | {f:.2f} | {f / med['float32', 1]:.2f} | {b / f:.2f} |")


if __name__ == "__main__":
    main()
