"""Mode auto replayed on recorded rounds: its choices measured without the noise of live runs (issue 25).

Live, auto's ratio to the best single mode moves by ±10-30% between two runs of the same prompts (RESULTS
section 17), so a change to its rules worth a few percent cannot be seen. Greedy decoding emits the target's
greedy tokens whatever mode runs, so what a round of any mode gives at a position of a reply is fixed:

- `record` decodes each prompt's greedy reply once (plain decoding), then walks along it on the real target state
  and drafters: at every position it times each model drafter's K drafts (quant's int8 copy, a draft model, the
  head), times target verifies of 1..16 positions, and the catching-up of a drafter with a cache of its own after
  8-64 missed tokens. One JSON file per model pair, engine (--engine torch, lean or llama.cpp) and prompt set.
- `replay` runs the real AutoDrafter (its module, or another version of it with --auto-module) on that: a round's
  tokens are the drafts that match the reply, plus one; its seconds the draft time recorded at that position (plus
  the catching-up for the tokens the drafter missed) and a verify time drawn from those recorded for its length.
  With --measured-k START, K is measured as the chat's -k auto measures it (from START up to the recorded K: a
  round drafts the first K recorded at that position, their time pro rata), in auto and in each single mode alike.
  Each single mode is replayed the same way. One replay is a session asked every prompt in turn, --reps times,
  as benchmarks/auto_pairs.py does live, in an order drawn anew for each replay (so every prompt is the first,
  cold-start reply of some replays); many replays (--draws) average the timing noise out, and the acceptance
  has none. auto's rate on each reply is set against each mode's on the same reply and replay. With --learnt,
  auto starts each replay from the rates a session on another recording saved (the same models, other prompts),
  as a session on a setup seen before does.

    python benchmarks/auto_replay.py record --target q1.5b.gguf --draft q0.5b.gguf \
        --prompts specchat/bench/prompts.jsonl --max-new-tokens 64 --out /tmp/qwen-tuning.json
    python benchmarks/auto_replay.py replay /tmp/qwen-tuning.json --draws 200
    python benchmarks/auto_replay.py record --engine lean --target ... --draft ... --modes draft --k 8 --out /tmp/k8.json
    python benchmarks/auto_replay.py replay /tmp/k8.json --measured-k 4 --draws 60

What a replay leaves out, so read its figures as auto's rules on these rounds, not as a live speedup: greedy only
(at T > 0 the tokens depend on the draws); rounds' times are drawn independently (a load spike lasting several
rounds is not replayed); the suffix drafter's lookups are timed as they run in the replay (microseconds); on
llama.cpp a batched verify may round a near-tie differently from plain decoding (`record` counts those positions;
the replay follows plain decoding's tokens).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
import os
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MAX_POSITIONS = 16  # longest verify timed: suffix drafts up to 15 (drafters/suffix.py MAX_SPEC)
GAPS = (8, 16, 32, 64)  # missed tokens a drafter with a cache of its own is timed catching up on


# ---------------------------------------------------------------------------------------------------- record


def record(args) -> None:
    from specchat import threads

    threads.prepare_process()
    if args.engine in ("llama.cpp", "lean"):  # the GGUF engines' longer spin, as specchat runs them
        threads.prepare_for_gguf()
    threads.set_threads(args.threads)
    import torch

    from specchat.engine.drafters import build_drafter
    from specchat.engine.drafters.plain import PlainDecoding
    from specchat.engine.errors import ModeUnavailable
    from specchat.engine.loop import Controls, generate
    from specchat.engine.sampling import SamplingParams
    from specchat.engine.llamacpp import target_state
    from specchat.models import load_model
    from specchat.session import drafter_options

    device = torch.device("cpu")
    target = load_model(args.target, device, torch.float32, engine=args.engine)
    draft = load_model(args.draft, device, torch.float32, engine=args.engine) if args.draft else None
    state = target_state(target.model)
    greedy = SamplingParams(0.0)
    drafters = {}
    for mode in [m for m in args.modes.split(",") if m]:
        options = {"quant_backend": "int8"} if mode == "quant" else {}  # auto's form of quant (drafters/auto.py ONLY)
        try:
            options = drafter_options(target.model, mode, options)  # the shipped head, as a session finds it
            drafters[mode] = build_drafter(mode, target.model, draft.model if draft else None, **options)
        except ModeUnavailable as e:
            print(f"not recorded: {e}", file=sys.stderr)
    prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    k = args.k
    out = {"target": args.target or "default", "draft": args.draft, "engine": args.engine, "k": k,
           "max_new_tokens": args.max_new_tokens,
           "prompts_file": args.prompts, "load_before": os.getloadavg(),
           "modes": {m: {"catches_up": d.catches_up} for m, d in drafters.items()},
           "verify_s": defaultdict(list),  # positions -> seconds of each timed verify
           "catch_up_s": defaultdict(lambda: defaultdict(list)),  # mode -> missed tokens -> seconds of its K drafts
           "replies": []}
    rotation = [n for n in range(2, MAX_POSITIONS + 1) if n != k + 1]  # besides K + 1 and 1 at every position
    turn = flips = 0
    torch.set_grad_enabled(False)
    for item in prompts:
        prompt = target.chat_ids([{"role": "user", "content": item["prompt"]}])
        records = list(generate(state, prompt, Controls(drafter=PlainDecoding(), sampling=greedy),
                                max_new_tokens=args.max_new_tokens, eos_ids=target.eos_ids))
        reply = [e.id for r in records for e in r.tokens]
        ended = records[-1].stop_reason == "eos"
        drafts = {m: [] for m in drafters}
        draft_s = {m: [] for m in drafters}
        for d in drafters.values():  # each reply starts as a new conversation: the caches learn nothing from the last
            d.reset()
        state.start(prompt)
        for j in range(len(reply)):
            for mode, d in drafters.items():
                t0 = time.perf_counter()
                ids = d.propose(state, k, greedy, None).ids.tolist()
                draft_s[mode].append(time.perf_counter() - t0)  # at j = 0: with the catching-up on the prompt
                drafts[mode].append(ids)
                if j % 4 == 2 and d.catches_up and hasattr(d, "cached"):  # time catching up on a gap, then resync
                    gap = GAPS[(j // 4) % len(GAPS)]
                    if gap < len(state.tokens) - 1:
                        keep = len(state.tokens) - 1 - gap
                        d.cached = d.cached[:keep]
                        t0 = time.perf_counter()
                        d.propose(state, k, greedy, None)
                        out["catch_up_s"][mode][gap].append(time.perf_counter() - t0)
            if j == 0:  # (the prefill's logits are pending, a verify feeds the drafts only: not timed; it overwrites
                logits = state.verify([])  # the positions quant's copy drafted on in the target's cache, as every verify does)
            else:
                for n in (k + 1, 1, rotation[turn % len(rotation)]):
                    t0 = time.perf_counter()
                    logits = state.verify(reply[j : j + n - 1] + [reply[-1]] * max(j + n - 1 - len(reply), 0))
                    out["verify_s"][n].append(time.perf_counter() - t0)
                turn += 1
            if int(logits[0].argmax()) != reply[j]:
                if args.engine == "torch":
                    raise SystemExit(f"a verify's greedy token differs from plain decoding's at position {j}")
                flips += 1  # llama.cpp rounds a batch differently from one position (benchmarks/llamacpp_greedy.py)
            state.commit([reply[j]])
        out["replies"].append({"name": item.get("name", ""), "prompt": prompt, "reply": reply, "eos": ended,
                               "drafts": drafts, "draft_s": draft_s})
        matched = {m: statistics.fmean(_matched(drafts[m][j], reply[j:]) for j in range(len(reply))) for m in drafts}
        print(f"  {item.get('name', '')}: {len(reply)} tokens; drafts matched per position "
              + ", ".join(f"{m} {v:.2f}" for m, v in matched.items()), file=sys.stderr, flush=True)
    if flips:
        print(f"{flips} positions where a verify's argmax differed from plain decoding's (the replay follows plain "
              "decoding's tokens)", file=sys.stderr)
    out["load_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(out))
    print(f"load average {out['load_before'][0]:.2f} -> {out['load_after'][0]:.2f}; wrote {args.out}", file=sys.stderr)


def _matched(drafts: list[int], truth: list[int]) -> int:
    n = 0
    while n < min(len(drafts), len(truth)) and drafts[n] == truth[n]:
        n += 1
    return n


# ---------------------------------------------------------------------------------------------------- replay


class Recorded:
    """A model drafter in a replay: auto asks it for its name, draft length and whether it catches up."""

    def __init__(self, name: str, catches_up: bool) -> None:
        self.name, self.catches_up, self.max_draft = name, catches_up, None
        self.cached: list[int] = []  # tokens it has fed (its cache), for the catching-up of the next round

    def draft_len(self, k: int) -> int:
        return k

    def reset(self) -> None:
        self.cached = []


class Trace:
    def __init__(self, path: str) -> None:
        data = json.loads(Path(path).read_text())
        self.k, self.limit, self.replies = data["k"], data["max_new_tokens"], data["replies"]
        self.modes = data["modes"]
        self.verify_s = {int(n): v for n, v in data["verify_s"].items()}
        self.longest = max(self.verify_s)
        # a drafter's extra seconds to catch up on `gap` missed tokens: the timed catch-ups (K drafts and the
        # gap fed) less its median round (K drafts and 1-2 tokens fed), interpolated between gaps
        self.usual = {m: statistics.median(s for r in self.replies for s in r["draft_s"][m][1:]) for m in self.modes}
        self.catch_up = {m: sorted((int(g), max(statistics.median(v) - self.usual[m], 0.0)) for g, v in by_gap.items())
                         for m, by_gap in data["catch_up_s"].items()}
        self.load = (data["load_before"][0], data["load_after"][0])
        self.name = f"{Path(data['target']).name}" + (f" + {Path(data['draft']).name}" if data["draft"] else "")

    def verify(self, positions: int, rng: random.Random) -> float:
        return rng.choice(self.verify_s[min(positions, self.longest)])

    def extra(self, mode: str, gap: int) -> float:
        """Seconds beyond a usual round that catching up on `gap` tokens costs (linear between timed gaps)."""
        points = self.catch_up.get(mode)
        if not points or gap <= 2:
            return 0.0
        if gap <= points[0][0] or len(points) == 1:  # (one timed gap: proportional to it)
            return points[0][1] * gap / points[0][0]
        for (g0, s0), (g1, s1) in zip(points, points[1:]):
            if gap <= g1:
                return s0 + (s1 - s0) * (gap - g0) / (g1 - g0)
        (g0, s0), (g1, s1) = points[-2], points[-1]
        return s1 + (s1 - s0) * (gap - g1) / (g1 - g0)


def load_auto(path: str | None, overrides: list[str]):
    """drafters/auto.py, or another version of it (a file), with module constants overridden (NAME=value)."""
    if path is None:
        from specchat.engine.drafters import auto as module
    else:
        spec = importlib.util.spec_from_file_location("auto_variant", path)
        module = sys.modules["auto_variant"] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up)
        spec.loader.exec_module(module)
    for item in overrides:
        name, _, value = item.partition("=")
        setattr(module, name, type(getattr(module, name))(float(value) if "." in value else int(value)))
    return module


class Memory:
    """store.LearntRates in memory: what one replayed session saves, the next one loads."""

    def __init__(self) -> None:
        self.rates: dict = {}

    def load(self) -> dict:
        return json.loads(json.dumps(self.rates))

    def save(self, rates: dict) -> None:
        self.rates = json.loads(json.dumps(rates))


def replay_session(trace: Trace, mode: str, auto_module, order: list[int], reps: int, rng: random.Random,
                   memory: Memory | None = None, measured_k: int = 0, k_memory: Memory | None = None):
    """One session asked the replies' prompts in `order`, `reps` times: per reply (pass, index), decode tokens/s
    (every token but the prefill's over every round's time, as auto_pairs.py counts) and the rounds by mode. auto starts from what `memory` holds
    and saves its rates there after every reply, as a session does. `measured_k` > 0: K measured (`-k auto`) from
    that start K, up to the recorded K (a round's drafts are the first K of those recorded, their time pro rata),
    starting from and saving to `k_memory`."""
    from specchat.engine.cache import common_prefix
    from specchat.engine.draft_length import MeasuredK
    from specchat.engine.drafters.suffix import SuffixDrafter
    from specchat.engine.events import RoundRecord
    from specchat.engine.sampling import SamplingParams

    greedy = SamplingParams(0.0)
    recorded = {m: Recorded(m, info["catches_up"]) for m, info in trace.modes.items()}
    suffix = SuffixDrafter()
    off = Recorded("off", False)
    candidates = {"off": off, "suffix": suffix, **recorded}
    chooser = None
    if mode == "auto":
        chooser = auto_module.AutoDrafter({m: candidates[m] for m in auto_module.CANDIDATES if m in candidates}, memory)
    k, limit = trace.k, trace.limit
    sizing = MeasuredK(start=min(measured_k, k), k_max=k, memory=k_memory) if measured_k else None
    # (a version of auto from before it priced a drafting mode by K measured takes no `sizing`)
    priced = chooser is not None and "sizing" in inspect.signature(chooser.for_round).parameters
    rates, rounds = {}, Counter()
    for rep in range(reps):
        for index in order:
            r = trace.replies[index]
            reply, tokens = r["reply"], list(r["prompt"])
            state = SimpleNamespace(tokens=tokens, head=None)  # (no reset between replies: a session keeps its drafters)
            j, round_index, decode_tokens, decode_s = 0, 0, 0, 0.0
            while j < len(reply):
                if chooser is None:
                    drafter = candidates[mode]
                else:
                    drafter = chooser.for_round(state, greedy, sizing) if priced else chooser.for_round(state, greedy)
                name = drafter.name
                want = max(min(drafter.draft_len(sizing.k(name, greedy) if sizing else k), k if name != "suffix" else limit, limit - j - 1), 0)
                draft_s = 0.0
                if name == "off" or want == 0:
                    drafts = []
                elif name == "suffix":
                    t0 = time.perf_counter()
                    drafts, _ = suffix.drafts(tokens, want)
                    draft_s = time.perf_counter() - t0
                else:
                    drafts = r["drafts"][name][j][:want]
                    # the time recorded at this position for K drafts (a catching-up drafter's at j = 0 fed the whole
                    # prompt: its usual round's instead, and below what it missed, from the common prefix as it syncs)
                    recorded_s = trace.usual[name] if drafter.catches_up and j == 0 else r["draft_s"][name][j]
                    draft_s = recorded_s * len(drafts) / max(len(r["drafts"][name][j]), 1)
                    if drafter.catches_up:
                        draft_s += trace.extra(name, len(tokens) - common_prefix(drafter.cached, tokens))
                        drafter.cached = tokens + drafts[:-1]  # it feeds every draft but the last
                matched = _matched(drafts, reply[j:])
                new = reply[j : j + matched + 1]
                verify_s = trace.verify(len(drafts) + 1, rng) if j else (trace.verify(len(drafts), rng) if drafts else 0.0)
                stop = "eos" if (r["eos"] and j + len(new) == len(reply)) else "max_new_tokens" if j + len(new) >= limit else None
                record = RoundRecord(index=round_index, mode=name, draft_len=want, drafted=len(drafts), accepted=matched,
                                     draft_calls=len(drafts), draft_s=draft_s, verify_s=verify_s,
                                     tokens=[SimpleNamespace(id=t) for t in new], stop_reason=stop,
                                     expected_tokens=float(len(new)))
                if chooser is not None:
                    chooser.observe(record)
                if sizing is not None:
                    sizing.observe(record, greedy)
                decode_tokens += len(new) - (round_index == 0)  # (the first token is the prefill's)
                decode_s += draft_s + verify_s
                rounds[name] += 1
                tokens.extend(new)
                j += len(new)
                round_index += 1
            rates[rep, index] = decode_tokens / decode_s if decode_s else float("nan")
            if chooser is not None:
                chooser.save()
            if sizing is not None:
                sizing.save()
    return rates, rounds


def replay(args) -> None:
    trace = Trace(args.trace)
    learnt = Trace(args.learnt) if args.learnt else None
    auto_module = load_auto(args.auto_module, args.set or [])
    modes = [m for m in ("off", *trace.modes) if m in args.modes.split(",") or args.modes == "all"]
    ratios = {m: defaultdict(list) for m in modes}  # mode -> (rep, reply) -> auto ÷ mode, one per draw
    first = {m: defaultdict(list) for m in modes}  # mode -> reply -> auto ÷ mode where it was a session's first
    rounds = Counter()
    for draw in range(args.draws):
        seeds = {m: random.Random(f"{draw}-{m}") for m in ("auto", *modes)}
        order = list(range(len(trace.replies)))
        random.Random(f"{draw}-order").shuffle(order)  # each draw's session meets another prompt first
        memory = k_memory = None
        if learnt is not None:  # an earlier session on other prompts, one pass, its rates kept
            memory, k_memory = Memory(), Memory() if args.measured_k else None
            replay_session(learnt, "auto", auto_module, list(range(len(learnt.replies))), 1, seeds["auto"], memory,
                           args.measured_k, k_memory)
        auto_rates, auto_rounds = replay_session(trace, "auto", auto_module, order, args.reps, seeds["auto"], memory,
                                                 args.measured_k, k_memory)
        rounds += auto_rounds
        for m in modes:
            mode_rates, _ = replay_session(trace, m, auto_module, order, args.reps, seeds[m], measured_k=args.measured_k)
            for key, rate in auto_rates.items():
                ratios[m][key].append(rate / mode_rates[key])
            first[m][order[0]].append(auto_rates[0, order[0]] / mode_rates[0, order[0]])
    print(f"\n{trace.name}: {len(trace.replies)} replies, K={trace.k}, {trace.limit} tokens at most, {args.reps} passes, "
          f"{args.draws} draws (recorded under load {trace.load[0]:.2f} -> {trace.load[1]:.2f})"
          + (f"; K measured from {args.measured_k}" if args.measured_k else "")
          + (f"; auto from {args.auto_module}" if args.auto_module else "") + (f"; {' '.join(args.set)}" if args.set else "")
          + (f"; auto starts from the rates of a session on {Path(args.learnt).name}" if learnt else ""))
    print("\n| auto ÷ | geometric mean (all replies) | ± (95%, over draws) | by pass | a session's first reply | "
          "lowest reply (its mean over draws) |")
    print("|---|---|---|---|---|---|")

    def geo(values):
        return math.exp(statistics.fmean(math.log(v) for v in values))

    for m in modes:
        every = [v for values in ratios[m].values() for v in values]
        per_draw = [geo([values[d] for values in ratios[m].values()]) for d in range(args.draws)]
        half = 1.96 * statistics.stdev(per_draw) / math.sqrt(args.draws) if args.draws > 1 else float("nan")
        by_pass = [geo([v for (rep, _), values in ratios[m].items() if rep == p for v in values]) for p in range(args.reps)]
        lowest = min(ratios[m], key=lambda key: geo(ratios[m][key]))
        firsts = [v for values in first[m].values() for v in values]
        print(f"| {m} | {geo(every):.3f} | {half:.3f} | {' / '.join(f'{v:.3f}' for v in by_pass)} | {geo(firsts):.3f} | "
              f"{trace.replies[lowest[1]]['name']} pass {lowest[0]}: {geo(ratios[m][lowest]):.3f} |")
    print("\nA session's first reply, by prompt (the replays that asked it first): "
          + "; ".join(f"auto ÷ {m} " + ", ".join(f"{trace.replies[i]['name']} {geo(v):.3f}" for i, v in sorted(first[m].items()))
                      for m in modes))
    total = sum(rounds.values())
    print("\nauto's rounds by mode: " + ", ".join(f"{m} {n / total:.1%}" for m, n in rounds.most_common()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="decode the replies and time every drafter at every position")
    rec.add_argument("--prompts", default="benchmarks/heldout-prompts.jsonl", help="JSON lines with a 'prompt' field")
    rec.add_argument("--target", default=None, help="default: the embedded default model (torch engine)")
    rec.add_argument("--draft", default=None, help="a draft model (mode draft)")
    rec.add_argument("--engine", default="torch", choices=["llama.cpp", "lean", "torch"])
    rec.add_argument("--max-new-tokens", type=int, default=96)
    rec.add_argument("--k", type=int, default=4)
    rec.add_argument("--modes", default="quant,head,draft",
                     help="the model drafters recorded where they can run (auto's candidates; '' for none)")
    rec.add_argument("--threads", type=int, default=None)
    rec.add_argument("--out", required=True)
    rep = sub.add_parser("replay", help="replay auto and every single mode on a recording")
    rep.add_argument("trace")
    rep.add_argument("--modes", default="all", help="the single modes auto is set against (comma-separated)")
    rep.add_argument("--reps", type=int, default=2, help="passes over the prompts in one session")
    rep.add_argument("--draws", type=int, default=100)
    rep.add_argument("--learnt", default=None, help="a recording (other prompts, same models) an earlier session ran: "
                     "auto starts from the rates it saved")
    rep.add_argument("--measured-k", type=int, default=0, help="K measured (-k auto) in every session, from this start "
                     "K (the chat's: 4) up to the recorded K; 0: the recorded K throughout")
    rep.add_argument("--auto-module", default=None, help="another version of drafters/auto.py to replay")
    rep.add_argument("--set", nargs="*", help="auto's constants overridden, e.g. SPREAD=0.3 MIN_ROUNDS=1")
    args = ap.parse_args()
    record(args) if args.command == "record" else replay(args)


if __name__ == "__main__":
    main()
