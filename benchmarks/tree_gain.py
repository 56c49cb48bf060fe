"""Would a second candidate per position pay at T > 0? The exact gain of a 2-way branch, from real rounds.

A draft model's rejected token x1 at position j could be followed, in the same verify, by a second candidate x2
drawn from q_j without replacement; recursive rejection sampling (Jeon et al. 2024, "Recursive Speculative
Decoding") accepts it with probability min(1, p1(x2) / q1(x2)), where p1 = norm(max(0, p_j - q_j)) is the
residual after x1's rejection and q1 = q_j without x1, renormalised; the output stays exactly p_j. When x2 is
accepted the round gains one token (x2, then the target's token after it, instead of one resample). Its chance
given a rejection is

    beta_j = sum over x1 with q > p of (q(x1) - p(x1)) / (1 - alpha_j) * sum_x min(p1(x), q(x) / (1 - q(x1))),

computed here exactly from each round's p and q rows (the loop's on_probs hook) at the position where the round's
first rejection happened. A branch costs verify positions, not draft passes (x2 comes from the row q_j already
drafted): one more for a branch at the first position only (K + 2 positions), K more for a branch at every
position (2K + 1). The predictions take each variant's tokens per round over the measured cost per round plus
the verify curve's increment; the curve is measured in this run (a verify of n positions against a plain step,
the lean runner, interleaved).

The suffix drafter's drafts are deterministic (q one-hot), so its second candidate is not drawn from q: it is the
continuation seen second most often after the same matched context (`second_continuations`, free to draft). For
deterministic candidates the exact rule is sampling without replacement from p (SpecInfer's rule for deterministic
drafts): after x1's rejection, x2 is accepted with probability p_j(x2) / (1 - p_j(x1)), the residual's mass on x2;
greedy, when x2 is the target's argmax. `--conversations` runs the multi-turn chats of multiturn.py, where suffix
matches are longest.

    python benchmarks/tree_gain.py --modes quant,head --temperature 0.7 --top-p 0.9
    python benchmarks/tree_gain.py --modes suffix --temperature 0,0.7 --conversations
    python benchmarks/tree_gain.py --check    # beta() against a brute force and a simulation of the rule
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specchat.engine.metrics import Stats, speedup_model
from specchat.engine.sampling import SamplingParams
from specchat.models import load_model
from specchat.session import Session

HERE = Path(__file__).parent


def beta(p: torch.Tensor, q: torch.Tensor) -> tuple[float, float]:
    """(alpha, beta) of one position: the chance its draft is accepted, and the chance a second candidate drawn
    without replacement is accepted once the first was rejected (0 where a rejection cannot happen)."""
    p, q = p.double(), q.double()
    alpha = float(torch.minimum(p, q).sum())
    excess = (q - p).clamp(min=0)  # [V]: where a rejected x1 comes from, unnormalised
    z = float(excess.sum())
    if z <= 1e-12:
        return alpha, 0.0
    p1 = (p - q).clamp(min=0)
    p1 = p1 / p1.sum()  # the residual after any rejection (it does not depend on which x1)
    x1s = (excess > 0).nonzero().squeeze(1)
    scale = 1.0 / (1.0 - q[x1s]).clamp(min=1e-12)  # [S]: q without x1, renormalised (x1's own term is 0: p1(x1) = 0)
    # sum_x min(p1(x), s q(x)) for every s at once: s q(x) where p1/q >= s, else p1(x); sorted by p1/q, two
    # cumulative sums answer each s (a [S, V] matrix at T = 0.7 without top-p would be tens of GB)
    support = q > 0
    ratio, order = torch.sort(p1[support] / q[support])
    p1_below = torch.cat([ratio.new_zeros(1), torch.cumsum(p1[support][order], 0)])  # [n + 1]: p1 of the first i
    q_from = torch.cat([torch.cumsum(q[support][order].flip(0), 0).flip(0), ratio.new_zeros(1)])  # [n + 1]: q from i on
    i = torch.searchsorted(ratio, scale)  # [S]: how many have p1/q < s
    accept = p1_below[i] + scale * q_from[i]  # [S]
    return alpha, float((excess[x1s] / z * accept).sum())


def check_beta(trials: int = 5, draws: int = 20000) -> None:
    """beta() against a brute force over x1 and a simulation of the rule itself (whose output must be p)."""
    g = torch.Generator().manual_seed(0)
    for trial in range(trials):
        v = 7
        p = torch.rand(v, generator=g).double() ** 2
        q = torch.rand(v, generator=g).double() ** 2
        q[trial] = 0  # a token the draft never proposes
        p, q = p / p.sum(), q / q.sum()
        alpha, b = beta(p, q)
        p1 = (p - q).clamp(min=0) / (p - q).clamp(min=0).sum()
        q_without = [torch.where(torch.arange(v) == x, 0.0, q) / (1 - q[x]) for x in range(v)]
        brute = sum(float((q[x] - p[x]) / (1 - alpha) * torch.minimum(p1, q_without[x]).sum()) for x in range(v) if q[x] > p[x])
        out, rejected, second = torch.zeros(v), 0, 0
        for _ in range(draws):
            x1 = int(torch.multinomial(q, 1, generator=g))
            if float(torch.rand(1, generator=g)) < min(1.0, float(p[x1] / q[x1])):
                out[x1] += 1
                continue
            rejected += 1
            q1 = q_without[x1]
            x2 = int(torch.multinomial(q1, 1, generator=g))
            if float(torch.rand(1, generator=g)) < min(1.0, float(p1[x2] / q1[x2])):
                second += 1
                out[x2] += 1
            else:
                p2 = (p1 - q1).clamp(min=0)
                out[int(torch.multinomial(p2 / p2.sum(), 1, generator=g))] += 1
        tv = 0.5 * float((out / draws - p).abs().sum())
        print(f"beta {b:.4f}  brute force {brute:.4f}  simulated {second / max(rejected, 1):.4f}  "
              f"(alpha {alpha:.3f}; total variation of the simulated output from p: {tv:.4f})")


def second_continuations(drafter, tokens: list[int], ids: list[int]) -> list[int | None]:
    """For each of the suffix drafter's drafts `ids` after `tokens`: the continuation seen second most often (ties:
    the latest) after the context the draft was taken from, or None where there is no other."""
    match = drafter.match(tokens)
    if match is None:
        return [None] * len(ids)
    automaton, state, _ = match
    seconds = []
    for token in ids:
        others = [(automaton.count[child], automaton.recent[child], t) for t, child in automaton.next[state].items()
                  if t >= 0 and t != token]
        seconds.append(max(others)[2] if others else None)
        state = automaton.next[state][token]
    return seconds


def verify_curve(session: Session, sizes: list[int], reps: int = 50) -> dict[int, float]:
    """The cost of verifying n positions in plain steps (n = 1), on the session's target, interleaved."""
    state = session.state
    prompt = session.target.chat_ids([{"role": "user", "content": "Tell me about the sea."}])
    state.start(prompt[:-1])
    state.commit(prompt[-1:])  # the cache holds all but the pending token: each verify below runs a forward
    times = {n: [] for n in [1, *sizes]}
    for _ in range(reps):
        for n in times:
            t = time.perf_counter()
            state.verify([state.tokens[-1]] * (n - 1))
            times[n].append(time.perf_counter() - t)
            state.commit([])  # keep the context as it was
    step = statistics.median(times[1])
    return {n: statistics.median(v) / step for n, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=Path, default=HERE / "heldout-prompts.jsonl")
    ap.add_argument("--modes", default="quant,head")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--temperature", default="0.7", help="one or more, comma-separated")
    ap.add_argument("--conversations", action="store_true", help="the multi-turn chats of multiturn.py instead of --prompts")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--check", action="store_true", help="check beta() by brute force and by simulating the rule, then stop")
    args = ap.parse_args()
    if args.check:
        check_beta()
        return
    target = load_model(None, torch.device("cpu"), torch.float32)
    if args.conversations:
        from multiturn import CONVERSATIONS

        chats = list(CONVERSATIONS.values())
    else:
        chats = [[json.loads(line)["prompt"]] for line in args.prompts.read_text().splitlines() if line.strip()]
    for temperature in (float(t) for t in args.temperature.split(",")):
        measure(target, chats, SamplingParams(temperature, 0, args.top_p), args)


def measure(target, chats: list[list[str]], sampling: SamplingParams, args) -> None:
    plain = Session(target, mode="off", k=args.k, sampling=sampling, seed=0, earlier_sessions=False)
    k = args.k
    curve = verify_curve(plain, [k + 1, k + 2, 2 * k + 1])
    print(f"T={sampling.temperature:g}, top-p {sampling.top_p:g}; verify curve (plain steps): "
          + ", ".join(f"v({n})={v:.2f}" for n, v in curve.items()))
    for mode in args.modes.split(","):
        stats, gain_first, gain_all, rounds, rejections = Stats(), 0.0, 0.0, 0, 0
        alphas, betas = [], []
        for seed in range(args.seeds):
            for turns in chats:
                session = Session(target, mode=mode, k=k, sampling=sampling, seed=seed, max_new_tokens=args.max_new_tokens,
                                  earlier_sessions=False)
                seconds: list[int | None] = []
                if mode == "suffix":  # record each round's second continuations as it drafts
                    drafter = session.controls.drafter
                    propose = drafter.propose

                    def propose_and_record(state, k, params, generator, drafter=drafter, propose=propose):
                        proposal = propose(state, k, params, generator)
                        seconds[:] = second_continuations(drafter, state.tokens, proposal.ids.tolist())
                        return proposal

                    drafter.propose = propose_and_record

                def on_probs(new, p, q):
                    nonlocal gain_first, gain_all, rounds, rejections
                    drafted = q.shape[0] if q is not None else 0
                    n = len(new) - 1  # accepted drafts (a round cut by EOS or the budget counts as judged so far)
                    if not drafted:
                        return
                    rounds += 1
                    if n < drafted:  # the round's first rejection, at position n
                        if mode == "suffix":
                            x1, x2 = int(q[n].argmax()), seconds[n]
                            a = float(p[n, x1])
                            b = 0.0 if x2 is None or a >= 1 else float(p[n, x2]) / (1 - a)
                        else:
                            a, b = beta(p[n], q[n])
                        alphas.append(a)
                        betas.append(b)
                        rejections += 1
                        gain_all += b
                        gain_first += b if n == 0 else 0.0

                session.controls.on_probs = on_probs
                for text in turns:
                    list(session.reply(text))
                for turn in session.turns:
                    for r in turn.rounds:
                        stats.add(r)
        model = speedup_model(stats, plain_step(target, sampling, k))
        t, c = model.tokens_per_round, model.round_cost
        v = curve[k + 1]
        chain = t / c
        first = (t + gain_first / rounds) / (c + curve[k + 2] - v)
        every = (t + gain_all / rounds) / (c + curve[2 * k + 1] - v)
        print(f"{mode}: {rounds} drafting rounds, {rejections} with a rejection; beta at the rejected position "
              f"mean {statistics.mean(betas):.3f} (alpha there {statistics.mean(alphas):.3f}); tokens/round {t:.3f}, "
              f"+{gain_first / rounds:.3f} with a branch at position 1, +{gain_all / rounds:.3f} at every position; "
              f"round cost {c:.2f} steps")
        print(f"    predicted speedup: chain {chain:.3f}x, branch at position 1 {first:.3f}x ({first / chain - 1:+.1%}), "
              f"branch at every position {every:.3f}x ({every / chain - 1:+.1%})")


def plain_step(target, sampling: SamplingParams, k: int) -> float:
    """One plain round's verify time in seconds on this target (the speedup model's unit), measured now."""
    session = Session(target, mode="off", k=k, sampling=sampling, seed=0, max_new_tokens=48, earlier_sessions=False)
    stats = Stats()
    for turn_prompt in ("Name three colours.", "Count to five."):
        list(session.reply(turn_prompt))
    for turn in session.turns:
        for r in turn.rounds:
            stats.add(r)
    return stats.plain_step_s


if __name__ == "__main__":
    main()
