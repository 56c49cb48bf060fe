"""Where greedy decoding with speculation parts from plain greedy decoding on the llama.cpp engine, and why.

A verify feeds K+1 positions in one llama_decode; llama.cpp's CPU kernels may round a batch differently from a
one-position decode, so where the target's two best tokens are within that rounding, the argmax can flip. This
runs each prompt greedily in mode off and in a speculative mode (fresh sessions, so both prefill the same way) and
reports, per prompt, the first position where they differ and how close the two best tokens were there under
plain decoding (probabilities at T=1).

    python benchmarks/llamacpp_greedy.py [--target FILE.gguf] [--draft FILE.gguf] [--mode draft|lookup|quant]
        [--prompts benchmarks/heldout-prompts.jsonl] [--tokens 64] [-k 4]
"""

from __future__ import annotations

import argparse
import json
import os

from specchat import threads

threads.prepare_process()
threads.prepare_for_gguf()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from specchat.engine.sampling import SamplingParams  # noqa: E402
from specchat.models import load_model  # noqa: E402
from specchat.session import Session  # noqa: E402


def reply(loaded, draft, mode: str, prompt: list[int], tokens: int, k: int):
    session = Session(loaded, draft, mode=mode, k=k, sampling=SamplingParams(0), seed=0, max_new_tokens=tokens)
    return [t for r in session.complete(prompt) for t in r.tokens]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--mode", default="draft")
    ap.add_argument("--prompts", default="benchmarks/heldout-prompts.jsonl")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=4)
    args = ap.parse_args()
    threads.set_threads(2)
    cpu = torch.device("cpu")
    target = load_model(args.target, cpu, torch.float32, engine="llama.cpp")
    draft = load_model(args.draft, cpu, torch.float32, engine="llama.cpp") if args.draft else None
    differ = 0
    prompts = [json.loads(line) for line in open(args.prompts) if line.strip()]
    for p in prompts:
        ids = target.chat_ids([{"role": "user", "content": p["prompt"]}])
        plain = reply(target, None, "off", ids, args.tokens, args.k)
        spec = reply(target, draft, args.mode, ids, args.tokens, args.k)
        first = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a.id != b.id), None)
        if first is None:
            print(f"{p['name']:10} identical over {min(len(plain), len(spec))} tokens")
            continue
        differ += 1
        (_, p1), (_, p2) = plain[first].top_raw[:2]
        print(f"{p['name']:10} first differs at token {first}: plain {plain[first].text!r} (p {p1:.4f}) vs {args.mode} "
              f"{spec[first].text!r}; the two best tokens under plain {p1:.4f} and {p2:.4f} (gap {p1 - p2:.4f})")
    print(f"{differ} of {len(prompts)} replies differ; load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
