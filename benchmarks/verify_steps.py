"""What a verify of S positions costs in plain steps on the lean engine, the sizes interleaved.

    python benchmarks/verify_steps.py --sizes 1,2,5,9 --rounds 200 [--target model.gguf] [--context 1500]

A session's target state after a held-out prompt; each round feeds every size in turn (S - 1 drafts after the pending
token, through `verify`, the call the loop makes) and then commits one token, so the context grows as a reply's
does and a slow moment of a shared machine falls on every size alike. Prints each size's median milliseconds and
its ratio to the first size's (1: a plain step). --context N starts after N positions instead (the prompt, then
any ids: a long chat's cost, where attention's share grows). Default model; 2 threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

PROMPTS = Path(__file__).with_name("heldout-prompts.jsonl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None)
    ap.add_argument("--sizes", default="1,2,5,9")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--context", type=int, default=0, help="positions before the first round (default: the prompt's)")
    args = ap.parse_args()

    from specchat import threads

    threads.prepare_process()
    threads.prepare_for_gguf()  # the GGUF engines' longer spin, as specchat runs them
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from specchat.engine.llamacpp import target_state
    from specchat.models import load_model

    threads.set_threads(2)
    model = load_model(args.target, torch.device("cpu"), torch.float32, engine="lean")
    state = target_state(model.model)
    prompt = json.loads(PROMPTS.read_text().splitlines()[0])["prompt"]
    ids = model.chat_ids([{"role": "user", "content": prompt}])
    state.start(ids + list(range(2000, 2000 + args.context - len(ids))))  # any ids: the cost does not depend on them
    sizes = [int(s) for s in args.sizes.split(",")]
    seconds: dict[int, list[float]] = {s: [] for s in sizes}
    drafts = list(range(1000, 1000 + max(sizes)))  # any ids: the cost does not depend on them
    for _ in range(args.rounds):
        for size in sizes:
            t0 = time.perf_counter()
            state.verify(drafts[: size - 1])
            seconds[size].append(time.perf_counter() - t0)
        state.commit([drafts[0]])
    step = statistics.median(seconds[sizes[0]])
    print(f"load {os.getloadavg()[0]:.2f}, context {len(state.tokens)} at the end")
    for size in sizes:
        ms = statistics.median(seconds[size])
        print(f"{size:3d} positions: {ms * 1e3:6.2f} ms, {ms / step:.2f} steps")


if __name__ == "__main__":
    main()
