"""Would a 2-3-bit self-draft made from the target's own file pay (issue 52, item 3)? Its acceptance, before any kernel.

    python benchmarks/lowbit_agreement.py [--target model.gguf] [--bits 2,3] [--tokens 64]

The target (the lean runner on the file's blocks) answers the held-out prompts greedily; each self-draft is the same
runner with every layer matrix requantised from the file's dequantised weights to `bits` bits, affine per block of 32
(min and step rounded to float16, as a file would keep them), in float32 here (PyTorch's GEMM): the embedding and the
LM head stay the file's. Teacher-forced over each prompt and reply, it prints per draft: greedy agreement, the tokens
a greedy round of K = 1..4 drafts would emit (exact for greedy: a draft sees the target's tokens up to its first
miss), the expected first-draft acceptance at T=0.7 top-p 0.9 (sum of min(p, q)), and the bytes its matrices would
stream a step against the file's (what a bandwidth-bound step costs; a model the L3 holds pays in compute too).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

PROMPTS = Path(__file__).with_name("heldout-prompts.jsonl")


def requantised(w, bits: int):
    """[N, D] float32 -> the same weights rounded to 2^bits levels per block of 32 (min and step in float16)."""
    import torch

    blocks = w.reshape(w.shape[0], -1, 32)  # [N, D / 32, 32]
    lo = blocks.amin(-1, keepdim=True).half().float()
    step = ((blocks.amax(-1, keepdim=True) - lo) / (2**bits - 1)).half().float()
    q = torch.where(step > 0, ((blocks - lo) / step.clamp_min(1e-30)).round().clamp(0, 2**bits - 1), 0.0)
    return (lo + q * step).reshape(w.shape)


def tokens_per_round(agree: list[bool], k: int) -> float:
    """Greedy rounds of k drafts over a reply whose positions the draft agrees with (`agree`): each round emits the
    drafts up to the first miss and the target's token."""
    i = rounds = 0
    while i < len(agree):
        run = 0
        while run < k and i + run < len(agree) and agree[i + run]:
            run += 1
        i += run + 1
        rounds += 1
    return len(agree) / rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="a GGUF file (default: the embedded default model's)")
    ap.add_argument("--bits", default="2,3")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()

    from specchat import threads

    threads.prepare_process()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gguf
    import torch

    from specchat.engine import gguf_header, smallbatch
    from specchat.engine.sampling import SamplingParams, logits_to_probs
    from specchat.models import load_model
    from specchat.session import Session

    threads.set_threads(2)
    model = load_model(args.target, torch.device("cpu"), torch.float32, engine="lean")
    runner = model.model.runner
    session = Session(model, None, mode="off", sampling=SamplingParams(0.0), seed=0, earlier_sessions=False)
    session.max_new_tokens = args.tokens
    pairs = []  # (prompt ids, reply ids)
    for line in PROMPTS.read_text().splitlines():
        if line.strip():
            prompt = model.chat_ids([{"role": "user", "content": json.loads(line)["prompt"]}])
            reply = [t.id for r in session.complete(prompt) for t in r.tokens]
            pairs.append((prompt, reply))

    def logits_of(r) -> list[torch.Tensor]:
        """Per pair, [len(reply), V]: row i is the logits that predict reply[i]."""
        with torch.inference_mode():
            return [r.step(prompt + reply[:-1], r.new_cache(), 0, keep=len(reply)) for prompt, reply in pairs]

    target = logits_of(runner)
    sampled = SamplingParams(0.7, 0, 0.9)
    matrices = [t for name, t in gguf_header.read(model.model.path).tensors.items() if name.startswith("blk.") and len(t.shape) == 2]
    weights = sum(t.shape[0] * t.shape[1] for t in matrices)
    file_bytes = sum(t.shape[0] * t.shape[1] // gguf.GGML_QUANT_SIZES[t.type][0] * gguf.GGML_QUANT_SIZES[t.type][1] for t in matrices)
    print(f"{len(pairs)} replies, {sum(len(r) for _, r in pairs)} tokens; the file's layer matrices {file_bytes / 1e6:.0f} MB "
          f"({8 * file_bytes / weights:.2f} bits a weight); load {os.getloadavg()[0]:.2f}")
    for bits in [int(b) for b in args.bits.split(",")]:
        def convert(w):
            dense = w.float() if isinstance(w, (smallbatch.GGUFWeights, smallbatch.GGUFStack)) else w
            return requantised(dense, bits)

        blocks = [dataclasses.replace(b, qkv_w=convert(b.qkv_w), o_w=convert(b.o_w), gate_up_w=convert(b.gate_up_w),
                                      down_w=convert(b.down_w)) for b in runner.blocks]
        draft = runner.with_matrices(blocks, runner.head_w)
        drafted = logits_of(draft)
        agree, overlap = [], []
        for t, d in zip(target, drafted):
            agree.append((t.argmax(-1) == d.argmax(-1)).tolist())
            overlap += torch.minimum(logits_to_probs(t, sampled), logits_to_probs(d, sampled)).sum(-1).tolist()
        flat = [a for reply in agree for a in reply]
        rounds = ", ".join(f"K={k} {sum(tokens_per_round(a, k) * len(a) for a in agree) / len(flat):.2f}" for k in range(1, 5))
        print(f"{bits}-bit self-draft: greedy agreement {sum(flat) / len(flat):.3f}; tokens a greedy round: {rounds}; "
              f"T=0.7 first-draft acceptance {sum(overlap) / len(overlap):.3f}; its matrices' bytes "
              f"{(bits + 1) / (8 * file_bytes / weights):.2f}x the file's")
        del draft, blocks, drafted


if __name__ == "__main__":
    main()
