"""A decode step with the K/V cache in float32 against float16 on the lean engine, after a long context: two target
states on the same runner and prompt, one per cache dtype, their steps alternating call by call (the same position
each time: a verify of the pending token, nothing committed), medians of 300 each.

    python benchmarks/kv_dtype.py [--depths 128,512,1024,1536] [--target model.gguf]
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

from specchat.engine.cache import KVCache  # noqa: E402
from specchat.engine.llamacpp import target_state  # noqa: E402
from specchat.models import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", default="128,512,1024,1536")
    ap.add_argument("--target", default=None)
    args = ap.parse_args()
    threads.set_threads(2)
    model = load_model(args.target, torch.device("cpu"), torch.float32, engine="lean")
    print(f"load {os.getloadavg()[0]:.2f}")
    for depth in [int(d) for d in args.depths.split(",")]:
        states = {}
        for dtype in (torch.float32, torch.float16):
            state = target_state(model.model)
            r = state.lean
            state.cache = KVCache(r.n_layers, r.n_kv_heads, r.head_dim, dtype, r.device)
            state.start(list(range(1000, 1000 + depth + 1)))  # any ids: the cost does not depend on them
            state.verify([])
            state.commit([5])
            states[dtype] = state
        seconds = {dtype: [] for dtype in states}
        for i in range(300):
            for dtype in (states if i % 2 else reversed(list(states))):
                t0 = time.perf_counter()
                states[dtype].verify([])
                seconds[dtype].append(time.perf_counter() - t0)
        full, half = statistics.median(seconds[torch.float32]), statistics.median(seconds[torch.float16])
        print(f"depth {depth}: float32 {full * 1e3:.2f} ms, float16 {half * 1e3:.2f} ms a step: float16 {full / half:.3f}x")


if __name__ == "__main__":
    main()
