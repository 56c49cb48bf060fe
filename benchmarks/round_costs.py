"""Where a round of the chat's session goes, outside the forward: timers around the loop's parts, in the session.

    python benchmarks/round_costs.py --temperature 0.7

The default model on the lean engine, mode off, the held-out prompts (96 tokens each, 2 threads). Prints the
milliseconds of a round and, per part, its microseconds a call and a round. The parts are timed where the loop
calls them, so they pay what they pay there: the forward has just streamed the weights through the caches, and the
same calls in a warm loop cost half or less.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

PROMPTS = Path(__file__).with_name("heldout-prompts.jsonl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()

    from specchat import heap, threads

    threads.prepare_process()
    threads.prepare_for_gguf()  # the GGUF engines' longer spin, as specchat runs them
    heap.keep_freed_pages()  # as the specchat command does
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from specchat.engine import loop, target
    from specchat.engine.sampling import SamplingParams
    from specchat.models import load_model
    from specchat.session import Session

    threads.set_threads(2)
    model = load_model(None, torch.device("cpu"), torch.float32, engine="lean")
    seconds, calls = collections.Counter(), collections.Counter()

    def timed(owner, name: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                seconds[name] += time.perf_counter() - t0
                calls[name] += 1

        setattr(owner, name, wrapper)

    for name in ("tops_of", "logits_to_probs", "one_hot", "draw_next", "_token_events"):
        timed(loop, name)
    timed(target.TargetState, "forward")
    t = args.temperature
    session = Session(model, None, mode="off", sampling=SamplingParams(t, 0, 0.9 if t > 0 else 1.0), seed=0,
                      earlier_sessions=False)
    session.max_new_tokens = args.tokens
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    list(session.complete(model.chat_ids([{"role": "user", "content": prompts[0]}])))  # first calls
    seconds.clear(), calls.clear()
    t0, rounds = time.perf_counter(), 0
    for prompt in prompts:
        rounds += len(list(session.complete(model.chat_ids([{"role": "user", "content": prompt}])))) - 1
    wall = time.perf_counter() - t0
    print(f"T={t:g}: {rounds} rounds, {wall / rounds * 1e3:.2f} ms a round (prefills included), load {os.getloadavg()[0]:.2f}")
    for name in seconds:
        print(f"  {name}: {seconds[name] / calls[name] * 1e6:.0f} us a call, {seconds[name] / rounds * 1e6:.0f} us a round")


if __name__ == "__main__":
    main()
