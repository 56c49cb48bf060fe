"""Where does a plain decode step go? Bare model forward vs specchat's loop (mode off) vs HF generate().

Explains the `off` vs `hf-generate` row of `specchat bench`: same model, dtype, prompt and greedy
decoding, interleaved, per-token milliseconds. Usage:
    python benchmarks/step_overhead.py [--target X] [--dtype bfloat16] [--tokens 48] [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specchat.engine.cache import forward_logits, new_cache
from specchat.engine.drafters.plain import PlainDecoding
from specchat.engine.loop import Controls, generate
from specchat.engine.sampling import SamplingParams
from specchat.engine.target import TargetState
from specchat.models import load_model, pick_device, pick_dtype


def bare(model, prompt, n):
    """The floor: one forward per token with the same cache helper the engine uses, argmax, nothing else."""
    cache = new_cache(model)
    forward_logits(model, cache, prompt[:-1], keep=1)
    tok, t0 = prompt[-1], time.perf_counter()
    for _ in range(n):
        tok = int(forward_logits(model, cache, [tok], keep=1)[-1].argmax())
    return (time.perf_counter() - t0) / n


def engine(model, prompt, n):
    state = TargetState(model)
    controls = Controls(PlainDecoding(), k=0, sampling=SamplingParams(0.0))
    rounds = list(generate(state, prompt, controls, max_new_tokens=n, eos_ids=set()))
    return sum(r.wall_s for r in rounds) / len(rounds), statistics.fmean(r.verify_s for r in rounds)


def hf(model, prompt, n):
    ids = torch.tensor([prompt])
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)  # prefill cost, subtracted below
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return (time.perf_counter() - t0 - one) / (n - 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device("cpu")
    loaded = load_model(args.target, device, pick_dtype(args.dtype, device))
    model = loaded.model
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about rain."}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = list(prompt)
    res = {"bare forward": [], "engine round (wall)": [], "engine verify timer": [], "HF generate step": []}
    with torch.inference_mode():
        for i in range(args.rounds + 1):  # the first pass warms up
            b = bare(model, prompt, args.tokens)
            e, v = engine(model, prompt, args.tokens)
            h = hf(model, prompt, args.tokens)
            if i:
                for key, val in zip(res, (b, e, v, h)):
                    res[key].append(1000 * val)
    print(f"{loaded.name}, {args.dtype}, {torch.get_num_threads()} threads, {args.tokens} tokens, {args.rounds} interleaved rounds")
    base = statistics.median(res["bare forward"])
    for key, vals in res.items():
        med = statistics.median(vals)
        print(f"  {key:22s} {med:8.2f} ms/token  (min {min(vals):.2f}, max {max(vals):.2f})  {med / base:.3f}x bare")


if __name__ == "__main__":
    main()
