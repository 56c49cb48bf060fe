"""Two builds of the C layer against each other on the lean (or torch) engine: a kernel change's speed, and its bits.

    git show BASE:specchat/engine/kernels/smallbatch.c > /tmp/base.c
    cc -O3 -march=native -fopenmp -shared -fPIC -o /tmp/base.so /tmp/base.c     # (and the same for the new source)
    python benchmarks/kernel_ab.py /tmp/base.so /tmp/new.so [--target model.gguf] [--sizes 1,2,5,9] [--rounds 100]
        [--engine torch]

Each build loads (and interleaves, with its own gguf_pack) a copy of the model, so a change to the packed layout is
measured too; both copies start from the same held-out prompt. Every round feeds each size to one copy and then the
other (which goes first alternates), then commits one token to both: a slow moment of a shared machine falls on both
alike. Prints each size's median milliseconds, new over old, and how many calls' logits differed (a change meant to
keep the arithmetic must say 0). Default model; 2 threads; memory: two copies of the model. `--engine torch` runs the
torch engine's runner instead (the float32 kernels on a Hugging Face model; default: the embedded model's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

PROMPTS = Path(__file__).with_name("heldout-prompts.jsonl")
LIBRARY = ["_lib", "_fn", "_fn_bf16", "_fn_int8", "_fn_layer", "_fn_layers", "_fn_logits", "_fn_forward", "_fn_gguf",
           "_fn_pack", "rows"]  # smallbatch's handles on its loaded library


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--target", default=None)
    ap.add_argument("--sizes", default="1,2,5,9")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--engine", choices=("lean", "torch"), default="lean")
    args = ap.parse_args()

    from specchat import threads

    threads.prepare_process()
    if args.engine == "lean":
        threads.prepare_for_gguf()  # the GGUF engines' longer spin, as specchat runs them
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from specchat.engine import smallbatch
    from specchat.engine.llamacpp import target_state
    from specchat.models import load_model

    def loaded(path: str) -> dict:
        """smallbatch's handles after loading the library at `path` (instead of building its own source)."""
        smallbatch._fn = None
        smallbatch._build = lambda folder: Path(path)
        if not smallbatch.load(Path(path).parent):
            raise SystemExit(f"cannot load {path}")
        return {name: getattr(smallbatch, name) for name in LIBRARY}

    def use(library: dict) -> None:
        for name, value in library.items():
            setattr(smallbatch, name, value)

    threads.set_threads(2)
    prompt = json.loads(PROMPTS.read_text().splitlines()[0])["prompt"]
    libraries, states = [], []
    for path in (args.old, args.new):
        libraries.append(loaded(path))
        model = load_model(args.target, torch.device("cpu"), torch.float32, engine=args.engine)
        state = target_state(model.model)
        state.start(model.chat_ids([{"role": "user", "content": prompt}]))
        states.append(state)
    sizes = [int(s) for s in args.sizes.split(",")]
    drafts = list(range(1000, 1000 + max(sizes)))  # any ids: the cost does not depend on them
    seconds: dict[tuple[int, int], list[float]] = {(i, s): [] for i in (0, 1) for s in sizes}
    differing = 0
    print(f"load {os.getloadavg()[0]:.2f}")
    for r in range(args.rounds):
        for size in sizes:
            logits = {}
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                use(libraries[i])
                t0 = time.perf_counter()
                logits[i] = states[i].verify(drafts[: size - 1]).clone()
                seconds[i, size].append(time.perf_counter() - t0)
            differing += not torch.equal(logits[0], logits[1])
        for i in (0, 1):
            use(libraries[i])
            states[i].commit([drafts[0]])
    print(f"load {os.getloadavg()[0]:.2f}; calls whose logits differ: {differing} of {args.rounds * len(sizes)}")
    for size in sizes:
        old, new = statistics.median(seconds[0, size]), statistics.median(seconds[1, size])
        print(f"{size:3d} positions: old {old * 1e3:7.2f} ms, new {new * 1e3:7.2f} ms, new / old {new / old:.3f}")


if __name__ == "__main__":
    main()
