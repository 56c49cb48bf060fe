"""A decode step's speed after a long context on the lean engine: plain greedy forwards only (no sampling, no
session), 64 steps after 0, 512 and 1536 positions, three repetitions alternating; compare with
`llama-bench -p 0 -n 64 -d 0,512,1536 -fa 0,1` on the same file.

    python benchmarks/depth_steps.py [--target model.gguf]
"""

import argparse
import os
import statistics
import time

from specchat import threads

threads.prepare_process()
threads.prepare_for_gguf()  # the GGUF engines' longer spin, as specchat runs them
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from specchat.engine.llamacpp import target_state  # noqa: E402
from specchat.models import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None)
    args = ap.parse_args()
    threads.set_threads(2)
    model = load_model(args.target, torch.device("cpu"), torch.float32, engine="lean")
    rates: dict[int, list[float]] = {}
    for _ in range(3):
        for depth in (0, 512, 1536):
            state = target_state(model.model)
            state.start(list(range(1000, 1000 + depth + 1)))  # any ids: the cost does not depend on them
            seconds = 0.0
            for _ in range(64):
                t0 = time.perf_counter()
                logits = state.verify([])
                seconds += time.perf_counter() - t0
                state.commit([int(logits[0].argmax())])
            rates.setdefault(depth, []).append(64 / seconds)
    print(f"load {os.getloadavg()[0]:.2f}")
    for depth, r in rates.items():
        print(f"depth {depth}: {statistics.median(r):.1f} tok/s (forwards only; {', '.join(f'{x:.1f}' for x in r)})")


if __name__ == "__main__":
    main()
