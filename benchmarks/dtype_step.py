"""Which dtype decodes faster on this machine? One-token decode steps of the default model, fp32 vs bf16,
interleaved in one run (a shared machine is noisy: compare the ratio, not the absolute times).

    python benchmarks/dtype_step.py [--steps 64] [--rounds 5]
"""

import argparse
import statistics
import time

import torch

from specchat.engine.cache import forward_logits, new_cache
from specchat.models import load_model


def step_ms(model, steps: int) -> float:
    cache = new_cache(model)
    forward_logits(model, cache, list(range(1, 65)), keep=1)  # a 64-token context
    start = time.perf_counter()
    for i in range(steps):
        forward_logits(model, cache, [100 + i], keep=1)
    return 1000 * (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    models = {name: load_model(None, torch.device("cpu"), dtype).model for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    for model in models.values():
        step_ms(model, 8)  # warm-up
    times = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            times[name].append(step_ms(model, args.steps))
    for name, t in times.items():
        print(f"{name:9s} median {statistics.median(t):6.1f} ms/step  (min {min(t):.1f}, max {max(t):.1f})")
    ratio = statistics.median(times["float32"]) / statistics.median(times["bfloat16"])
    print(f"fp32 / bf16 step time: {ratio:.2f}x  (torch {torch.__version__}, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
