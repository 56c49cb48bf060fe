"""Tokens/s of train-head's reply generation: the batched loop on the lean runner (train/generate.py) against HF
`generate` (train/head.py's hf_generate_with_features), interleaved, on the same batches of the shipped prompts.

    python benchmarks/data_generation.py [--rows 128] [--rounds 2] [--tokens 160] [--threads N]

Both run as train-head runs them: a bfloat16 copy of the target where `use_bfloat16` says so, every third row
greedy and the rest at T=0.8. Reply tokens are counted up to each row's EOS (both make the same number for the same
batch up to sampling).
"""

from __future__ import annotations

import argparse
import os
import random
import time

from specchat import threads  # noqa: E402

threads.prepare_process()  # OpenMP waits as specchat's own commands wait (OMP_WAIT_POLICY=PASSIVE: as before that changed)

import torch  # noqa: E402

from specchat.engine.runner import lean_runner  # noqa: E402
from specchat.models import load_model  # noqa: E402
from specchat.train import head as train  # noqa: E402
from specchat.train.generate import generate_with_features  # noqa: E402


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(None, torch.device("cpu"), torch.float32)
    recipe = train.Recipe(max_new_tokens=args.tokens)
    bfloat16 = train.use_bfloat16(target.model, recipe)
    model = train.data_model(target.model, bfloat16)
    runner = lean_runner(model)
    items = [it for it in train.read_prompts(None)]
    random.Random(0).shuffle(items)
    pad = target.tokenizer.pad_token_id
    print(f"bfloat16: {bfloat16}; {args.rows} rows, {args.tokens} new tokens at most; load average {load_average()}")
    rates: dict[str, list[float]] = {"lean": [], "hf": []}
    for r in range(args.rounds):
        chunk = items[r * args.rows : (r + 1) * args.rows]
        prompts = sorted((target.chat_ids([{"role": "user", "content": it["prompt"]}]) for it in chunk), key=len)
        temps = [0.0 if i % 3 == 0 else recipe.temperature for i in range(len(prompts))]
        for name in ("hf", "lean") if r % 2 == 0 else ("lean", "hf"):
            began = time.perf_counter()
            if name == "hf":
                out = train.hf_generate_with_features(model, prompts, pad, target.eos_ids, temps, recipe, seed=r)
            else:
                out = generate_with_features(runner, prompts, pad, target.eos_ids, temps, args.tokens, recipe.max_len, seed=r)
            seconds = time.perf_counter() - began
            tokens = sum(len(t) - len(p) for (t, _), p in zip(out, prompts))
            rates[name].append(tokens / seconds)
            print(f"round {r} {name:4s} {seconds:6.1f} s  {tokens} reply tokens  {tokens / seconds:6.0f} tok/s", flush=True)
    ratios = [a / b for a, b in zip(rates["lean"], rates["hf"])]
    print(f"lean / hf per round: {', '.join(f'{x:.2f}' for x in ratios)}; load average {load_average()}")


if __name__ == "__main__":
    main()
