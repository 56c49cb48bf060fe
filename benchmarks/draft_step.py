"""A draft model's step against its target's on the lean engine, with the draft's LM head as the file keeps it
(output.weight) and read from its embedding (gguf_model.draft_runner, what mode draft runs): c, a draft token's cost
in target steps.

    python benchmarks/draft_step.py [--target FILE.gguf] [--draft FILE.gguf] [--steps 60]

After a 100-token prompt each runner takes one step in turn (the order alternating), `--steps` times; prints each
one's median ms, the draft's over the target's, and the two heads' ratio. Default: the Qwen2.5-Coder pair that
`../shared/models/fetch-qwen-coder-pair` puts in ~/.cache/specchat-bench-models.
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

from specchat.engine import smallbatch  # noqa: E402
from specchat.engine.gguf_model import draft_runner, load_runner  # noqa: E402
from specchat.store import cache_dir  # noqa: E402

PAIR = Path.home() / ".cache" / "specchat-bench-models"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(PAIR / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"))
    ap.add_argument("--draft", default=str(PAIR / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    smallbatch.load(cache_dir() / "kernels")
    file_head = load_runner(args.draft)
    own, mode = "draft, the file's head", "draft, as mode draft runs it"
    runners = {"target": load_runner(args.target), own: file_head, mode: draft_runner(file_head)}
    print(f"draft heads: {file_head.head_w.type} (the file's), {runners[mode].head_w.type} (mode draft's)")
    caches = {name: r.new_cache() for name, r in runners.items()}
    times: dict[str, list[float]] = {name: [] for name in runners}
    with torch.inference_mode():
        for name, r in runners.items():
            r.forward(list(range(1000, 1100)), range(r.n_layers), caches[name], 0, keep=1)
        for i in range(args.steps):
            for name in list(runners)[:: 1 if i % 2 == 0 else -1]:
                r = runners[name]
                start = time.perf_counter()
                r.forward([2000 + i], range(r.n_layers), caches[name], 100 + i, keep=1)
                times[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    for name, m in ms.items():
        print(f"{name:30s} {m:7.2f} ms   {m / ms['target']:.3f} target steps")
    print(f"mode draft's head over the file's: {ms[mode] / ms[own]:.3f}x the time; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
