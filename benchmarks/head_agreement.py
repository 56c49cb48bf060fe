"""Greedy acceptance of draft heads at K=1, measured without timing, on enough prompts to tell heads apart.

With greedy decoding a head drafts from the target's features of the tokens before the draft, which do not
depend on the head, so one plain greedy generation per prompt (the engine, lean runner) serves every head: the
head then runs over the whole reply at once (teacher-forced). Two numbers per head: its agreement with the
target at every reply position, and its acceptance in the loop at K=1, replayed exactly: a round drafts one
token; accepted, the target's bonus token takes the next position and the round after drafts the one beyond;
rejected, the next round drafts the position after the replacement. The bench's 4 prompts give ~560 drafting
rounds a temperature (binomial error ~0.02 near 0.4); the default prompts here (the bench's 4 and
benchmarks/head-prompts.jsonl, none of them in train/prompts.txt) give ~2300 positions in a few minutes on the
2-core reference CPU.

With `--k K` each head also drafts K tokens a round in the real loop (greedy, its recorded `max_draft` ignored),
and the script prints how often each draft position was accepted: later positions draft from the head's own
predicted features, which is what EAGLE-3's training-time test (`train/head.py`, Recipe.depth) trains.

With `--gguf` the target is the default model's GGUF file on the lean runner (its Q4_1 blocks, x rounded to int8:
the features a head would read on `--engine lean`, which it was not trained on), the head's own weights as built
for the float32 model; with `--k`, also a draft token's seconds against a round's verify.

    python benchmarks/head_agreement.py HEAD.safetensors [HEAD2.safetensors ...] [--prompts FILE.jsonl ...]
        [--tokens 160] [--threads N] [--k K] [--gguf]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specchat import threads  # noqa: E402

threads.prepare_process()  # OpenMP waits as specchat's own commands wait (OMP_WAIT_POLICY=PASSIVE: as before that changed)

import torch  # noqa: E402

from specchat.engine.drafters.head import HeadDrafter  # noqa: E402
from specchat.engine.drafters.plain import PlainDecoding  # noqa: E402
from specchat.engine.loop import Controls, generate
from specchat.engine.runner import rms_norm  # noqa: E402
from specchat.engine.sampling import SamplingParams
from specchat.engine.smallbatch import linear  # noqa: E402
from specchat.engine.target import TargetState  # noqa: E402
from specchat.models import load_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [str(ROOT / "specchat" / "bench" / "prompts.jsonl"), str(ROOT / "benchmarks" / "head-prompts.jsonl")]


def greedy_reply(target, state: TargetState, prompt: list[int], tokens: int) -> tuple[list[int], torch.Tensor]:
    """The target's greedy reply (plain decoding) and the features of every token but the last: [S-1, D]."""
    state.tokens, state.head = [], None  # a fresh context for each prompt
    controls = Controls(drafter=PlainDecoding(), k=0, sampling=SamplingParams(0.0, 0, 1.0))
    for _ in generate(state, prompt, controls, max_new_tokens=tokens, eos_ids=target.eos_ids):
        pass
    n = len(state.tokens) - 1
    if state.known < n:  # the last round's features may lag (the pending token is not fed yet)
        state.forward(state.tokens[state.known : n], state.known, keep=1)
    return list(state.tokens), state.features[:n].clone()


@torch.inference_mode()
def head_drafts(drafter: HeadDrafter, state: TargetState, tokens: list[int], features: torch.Tensor) -> torch.Tensor:
    """Teacher-forced greedy drafts: row j reads (f_j, x_{j+1}) and drafts x_{j+2}; [S-1] token ids (one forward
    over the reply does what the drafter does a position at a time with its cache)."""
    lean, n = state.lean, features.shape[0]
    hidden = drafter.head(features[None], lean.embed(tokens[1 : n + 1]), None, 0, *lean.rope(0, n))  # [1, S-1, D]
    logits = linear(rms_norm(hidden, drafter.norm_w, drafter.norm_eps), drafter.head_w)[0]  # [S-1, N]: as the drafter multiplies
    return drafter.vocab[logits.argmax(-1)]


def loop_positions(drafter: HeadDrafter, target, state: TargetState, replies, k: int) -> str:
    """The real loop at K = k, greedy, over every prompt: per draft position the share of rounds that drafted it
    whose draft was accepted, and tokens per target forward. Each reply must equal plain decoding's."""
    from specchat.engine.metrics import Stats

    drafter.max_draft = None
    stats = Stats()
    for _, n_prompt, tokens, _ in replies:
        state.tokens, state.head = [], None
        drafter.reset()
        controls = Controls(drafter=drafter, k=k, sampling=SamplingParams(0.0, 0, 1.0))
        prompt = tokens[:n_prompt]
        out = list(prompt)
        for record in generate(state, prompt, controls, max_new_tokens=len(tokens) - n_prompt, eos_ids=target.eos_ids):
            stats.add(record)
            out += [t.id for t in record.tokens]
        assert out == tokens, "the head's loop left plain greedy decoding"
    drafted, accepted = stats.num_draft_tokens_per_pos, stats.num_accepted_tokens_per_pos
    positions = ", ".join(f"{i + 1}: {a / d:.3f} of {d}" for i, (a, d) in enumerate(zip(accepted, drafted)) if d)
    return (f"K={k}: accepted per position ({positions}); {stats.new_tokens / stats.rounds:.3f} tokens per target forward; "
            f"a draft token {1e3 * stats.draft_s / max(sum(drafted), 1):.2f} ms, a round's verify "
            f"{1e3 * stats.verify_s / stats.rounds:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("heads", nargs="+")
    parser.add_argument("--target", default=None, help="default: the embedded default model")
    parser.add_argument("--prompts", nargs="+", default=PROMPTS)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--k", type=int, default=None, help="also run the loop at this K and report each draft position")
    parser.add_argument("--gguf", action="store_true", help="the target: the default model's GGUF file on the lean runner")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model(args.target, torch.device("cpu"), torch.float32)
    state = TargetState(target.model, runner="lean")
    if args.gguf:
        from specchat.engine.gguf_model import load_runner
        from specchat.models import default_gguf

        state = TargetState.on_runner(load_runner(default_gguf()), state.context_len)
    items = [json.loads(line) for path in args.prompts for line in Path(path).read_text().splitlines() if line.strip()]
    replies = []
    for item in items:
        prompt = target.chat_ids([{"role": "user", "content": item["prompt"]}])
        replies.append((item.get("name", "?"), len(prompt), *greedy_reply(target, state, prompt, args.tokens)))
    print(f"{len(items)} prompts, {args.tokens} new tokens at most, {torch.get_num_threads()} threads")
    for path in args.heads:
        drafter = HeadDrafter.build(target.model, head_file=Path(path))
        hits = total = accepted = rounds = 0
        per = []
        for name, n_prompt, tokens, features in replies:
            drafts = head_drafts(drafter, state, tokens, features).tolist()  # drafts[j] is a draft of tokens[j + 2]
            first = n_prompt - 2  # the first round drafts the reply's first token (checked against the prefill's logits)
            agree = [drafts[j] == tokens[j + 2] for j in range(first, len(tokens) - 2)]
            hits, total = hits + sum(agree), total + len(agree)
            # the loop: row j drafts tokens[j + 2]; a reply cut by the token budget has its last token undrafted
            end = len(tokens) if tokens[-1] in target.eos_ids else len(tokens) - 1
            j = first
            while j + 2 < end:
                ok = drafts[j] == tokens[j + 2]
                accepted, rounds, j = accepted + ok, rounds + 1, j + (2 if ok else 1)
            per.append(f"{name} {sum(agree) / max(len(agree), 1):.2f}")
        print(f"{path}: acceptance in the loop {accepted / rounds:.3f} over {rounds} rounds; agreement {hits / total:.3f} over {total} "
              f"positions ({', '.join(per)})")
        if args.k:
            print(f"  {loop_positions(drafter, target, state, replies, args.k)}", flush=True)


if __name__ == "__main__":
    main()
