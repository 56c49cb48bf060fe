"""Which drafts pay against the lean runner reading a GGUF file in place (issue 52, item 3): plain decoding, suffix,
and a draft model read in place too, against llama.cpp's plain decoding of the same target file (weights repacked and
not: repacking faults on some CPUs, see repack_probe.py), greedy, on the held-out prompts; configurations
interleaved per prompt.

    python benchmarks/gguf_drafts.py TARGET.gguf DRAFT.gguf --tokenizer FOLDER [--k 3,4] [--tokens 64]

Decode tokens/s exclude the prompt's prefill (each round's wall time, less round 0's prefill). Also: acceptance, and
whether each drafting configuration gave plain greedy's tokens on the same runner.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from specchat import threads

threads.prepare_process()
threads.prepare_for_gguf()  # the GGUF engines' longer spin, as specchat runs them

import torch  # noqa: E402

from specchat.engine import smallbatch  # noqa: E402
from specchat.engine.drafters import build_drafter  # noqa: E402
from specchat.engine.drafters.model import ModelDrafter  # noqa: E402
from specchat.engine.gguf_model import load_runner  # noqa: E402
from specchat.engine.llamacpp import GGUFModel, target_state  # noqa: E402
from specchat.engine.loop import Controls, generate  # noqa: E402
from specchat.engine.sampling import SamplingParams  # noqa: E402
from specchat.engine.target import TargetState  # noqa: E402
from specchat.store import cache_dir  # noqa: E402

PROMPTS = Path(__file__).with_name("heldout-prompts.jsonl")


def decode(state, prompt, drafter, k, tokens, eos):
    records = list(generate(state, prompt, Controls(drafter, k=k, sampling=SamplingParams(0.0)), max_new_tokens=tokens,
                            eos_ids=eos, generator=torch.Generator().manual_seed(0)))
    ids = [t.id for r in records for t in r.tokens]
    seconds = sum(r.wall_s for r in records) - records[0].prefill_s
    return ids, len(ids) / seconds, sum(r.drafted for r in records), sum(r.accepted for r in records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target")
    ap.add_argument("draft")
    ap.add_argument("--tokenizer", required=True, help="a transformers tokenizer folder for the target's vocabulary")
    ap.add_argument("--k", default="3,4")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    assert smallbatch.load(cache_dir() / "kernels")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    eos = {tokenizer.eos_token_id} | {tokenizer.convert_tokens_to_ids("<|im_end|>")} - {None}
    target, draft = load_runner(args.target), load_runner(args.draft)
    llamas = {"llama.cpp off": GGUFModel(args.target, repack=False), "llama.cpp off, AMX/repack": GGUFModel(args.target, repack=True)}
    ks = [int(k) for k in args.k.split(",")]
    configs = [*llamas, "lean off", "lean suffix"] + [f"lean draft K={k}" for k in ks]
    rates, counts, same = {c: [] for c in configs}, {c: [0, 0] for c in configs}, {c: 0 for c in configs}
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    print(f"{Path(args.target).name} + {Path(args.draft).name}, {args.threads} threads, load {os.getloadavg()[0]:.2f}", flush=True)
    with torch.inference_mode():
        for text in prompts:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
            prompt = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            plain = None
            for c in configs:
                if c in llamas:
                    state, drafter, k = target_state(llamas[c]), build_drafter("off", llamas[c]), 1
                else:
                    state = TargetState.on_runner(target, context_len=32768)
                    mode = c.split()[1]
                    k = int(c.split("=")[1]) if "K=" in c else 4
                    drafter = ModelDrafter.on_runner(draft) if mode == "draft" else build_drafter(mode, None)
                ids, rate, drafted, accepted = decode(state, prompt, drafter, k, args.tokens, eos)
                rates[c].append(rate)
                counts[c][0] += drafted
                counts[c][1] += accepted
                if c == "lean off":
                    plain = ids
                elif c.startswith("lean"):
                    same[c] += ids == plain
    print(f"load after {os.getloadavg()[0]:.2f}")
    base = statistics.median(rates["llama.cpp off"])
    print("| configuration | decode tok/s (median) | x llama.cpp off | acceptance | greedy = lean off |")
    print("|---|---|---|---|---|")
    for c in configs:
        med = statistics.median(rates[c])
        drafted, accepted = counts[c]
        acc = f"{accepted / drafted:.2f}" if drafted else "-"
        print(f"| {c} | {med:.1f} | {med / base:.2f} | {acc} | {same[c] if c.startswith('lean') and c != 'lean off' else '-'}"
              f"{'/' + str(len(prompts)) if c.startswith('lean') and c != 'lean off' else ''} |")


if __name__ == "__main__":
    main()
