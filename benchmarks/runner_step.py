"""The lean runner (specchat/engine/runner.py) against HF's forward on the default model, interleaved in one process.

1. One step (one token after a 64-token context) and verifies of K+1 = 2-16 positions on three paths:
   HF's forward, the lean runner with torch's matmuls, and the lean runner with the fused small-batch kernel
   (engine/smallbatch.py; float32 only, up to 16 rows); v = verify time / that path's one-step time (the v of
   the speedup model).
2. End to end, greedy, 64 new tokens: HF generate(), specchat plain decoding on the HF path, and on the
   lean runner with either matmul; time to first token and ms/token, with the token ids checked identical to HF's.

Every repetition runs every case once (interleaved), so load from other processes hits all alike;
medians are printed with the machine, the thread count and the load average before and after.
Measure on an idle machine (1-minute load average well below 1). Usage:
    python benchmarks/runner_step.py [--reps 15] [--e2e-reps 3] [--threads N] [--no-bf16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers.generation.streamers import BaseStreamer

from specchat.engine import smallbatch
from specchat.engine.cache import crop_to, forward_logits, new_cache
from specchat.engine.drafters.plain import PlainDecoding
from specchat.engine.loop import Controls, generate
from specchat.engine.sampling import SamplingParams
from specchat.engine.target import TargetState
from specchat.machine import cpu_name
from specchat.models import load_model

CONTEXT = 64
VERIFY = [2, 3, 5, 8, 9, 12, 16]
PATHS = ("hf", "torch", "fused")  # HF's forward; the lean runner with torch's matmuls; with the fused kernel  # K+1 positions
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def step_times(model, reps: int) -> dict[tuple[str, int], float]:
    """Median ms per forward of n positions after CONTEXT cached ones: (path, n) -> ms."""
    vocab = model.get_output_embeddings().weight.shape[0]
    context = [(7 * i + 3) % vocab for i in range(CONTEXT)]
    hf_cache = new_cache(model)
    forward_logits(model, hf_cache, context, keep=1)
    lean = TargetState(model, runner="lean").lean
    lean_cache = lean.new_cache()
    lean.step(context, lean_cache, 0, keep=1)
    cases = [(path, n) for n in [1, *VERIFY] for path in PATHS]
    times: dict = {case: [] for case in cases}
    for rep in range(reps + 1):
        for path, n in cases:
            ids = [(11 * j + rep) % vocab for j in range(n)]
            smallbatch.enabled = path == "fused"
            t = time.perf_counter()
            if path == "hf":
                forward_logits(model, hf_cache, ids, keep=n)
            else:
                lean.step(ids, lean_cache, CONTEXT, keep=n)
            if rep:  # the first repetition warms up
                times[(path, n)].append(1000 * (time.perf_counter() - t))
            crop_to(hf_cache, CONTEXT)
            crop_to(lean_cache, CONTEXT)
    smallbatch.enabled = True
    return {case: statistics.median(ts) for case, ts in times.items()}


class Clock(BaseStreamer):
    """Records when generate() emits: the first put is the prompt, the second the first new token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate(model, prompt, n):
    clock = Clock()
    t0 = time.perf_counter()
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n, streamer=clock, pad_token_id=0)
    total = time.perf_counter() - t0
    return out[0, len(prompt) :].tolist(), clock.stamps[1] - t0, (total - (clock.stamps[1] - t0)) / (n - 1)


def specchat_generate(model, prompt, n, runner, fused=True):
    smallbatch.enabled = fused
    state = TargetState(model, runner=runner)
    controls = Controls(PlainDecoding(), k=1, sampling=SamplingParams(0))
    t0 = time.perf_counter()
    tokens, first = [], None
    for record in generate(state, prompt, controls, max_new_tokens=n, eos_ids=set()):
        tokens += [t.id for t in record.tokens]
        first = first or time.perf_counter() - t0
    total = time.perf_counter() - t0
    smallbatch.enabled = True
    return tokens, first, (total - first) / (n - 1)


def e2e(model, prompt, n, reps):
    runs = {"HF generate()": lambda: hf_generate(model, prompt, n),
            "specchat off, HF forward": lambda: specchat_generate(model, prompt, n, "hf"),
            "specchat off, lean, torch": lambda: specchat_generate(model, prompt, n, "lean", fused=False),
            "specchat off, lean, fused": lambda: specchat_generate(model, prompt, n, "lean")}
    results = {name: [] for name in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            results[name].append(fn())
    ref = results["HF generate()"][0][0]
    rows = []
    for name, rs in results.items():
        same = all(r[0] == ref for r in rs)
        rows.append((name, statistics.median(r[1] for r in rs), statistics.median(r[2] for r in rs), same))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--e2e-reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 step timings")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    before = load()
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"load average (1/5/15 min) before: {before}")
    for dtype in [torch.float32] + ([] if args.no_bf16 else [torch.bfloat16]):
        loaded = load_model(None, torch.device("cpu"), dtype)
        model = loaded.model
        times = step_times(model, args.reps)
        print(f"\n{str(dtype).removeprefix('torch.')}: ms per forward after a {CONTEXT}-token context, medians of {args.reps} interleaved reps")
        print(f"kernel: {smallbatch.kernel_name()} (float32 only)")
        print(f"{'positions':>9} | {'HF ms':>7} {'v':>5} | {'torch ms':>8} {'v':>5} | {'fused ms':>8} {'v':>5} | {'HF/fused':>8} {'torch/fused':>11}")
        for n in [1, *VERIFY]:
            hf, lean, fused = times[("hf", n)], times[("torch", n)], times[("fused", n)]
            print(f"{n:>9} | {hf:7.2f} {hf / times[('hf', 1)]:5.2f} | {lean:8.2f} {lean / times[('torch', 1)]:5.2f} | "
                  f"{fused:8.2f} {fused / times[('fused', 1)]:5.2f} | {hf / fused:8.2f} {lean / fused:11.2f}")
        if dtype == torch.float32:
            prompt = loaded.chat_ids([{"role": "user", "content": PROMPT}])
            print(f"\nend to end, greedy, {args.tokens} new tokens, {len(prompt)}-token prompt, medians of {args.e2e_reps} interleaved runs")
            print(f"{'':>27} | {'first token s':>13} | {'ms/token after':>14} | same tokens as HF")
            for name, ttft, ms, same in e2e(model, prompt, args.tokens, args.e2e_reps):
                print(f"{name:>27} | {ttft:13.3f} | {1000 * ms:14.2f} | {'yes' if same else 'NO'}")
        del loaded, model
    print(f"\nload average (1/5/15 min) after: {load()}")


if __name__ == "__main__":
    main()
