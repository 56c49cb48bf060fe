"""The engines side by side on one GGUF file: llama.cpp's own plain decoding, specchat on the llama.cpp engine (off,
auto, draft), on the lean engine (--lean-modes: the file read in place by specchat's kernel), on the torch engine (off,
or --torch-modes), and optionally llama.cpp's `llama-bench` and `llama-speculative`.
One process, every configuration interleaved per prompt and repetition, greedy unless --temperature says otherwise.

    python benchmarks/engines.py [--target FILE.gguf] [--draft FILE.gguf] [--prompts benchmarks/heldout-prompts.jsonl]
        [--tokens 64] [--reps 3] [--threads N] [--temperature 0,0.7] [--no-torch | --torch-modes off,quant,auto]
        [--lean-modes off,auto,draft] [--measured-k]
        [--llama-bench PATH] [--llama-speculative PATH]

"llama.cpp plain" is the reference every ratio is taken against: a Python loop that feeds one token per llama_decode
and takes the argmax of its logits (what llama-bench's tg does, plus the argmax and the ctypes call). Every
figure is decode tokens per second (the prefill left out), median over prompts and repetitions; ratios are
per-prompt paired ratios against llama.cpp plain of the same prompt and repetition, then the median. The load
average is printed before and after: on the 2-core machine a busy neighbour halves everything. Greedy outputs
are compared token for token with llama.cpp plain (a prompt prefilled whole) and with specchat's mode off on
llama.cpp (which, like every session here, reuses the cached prefix of the previous prompt: a prefill split
differently rounds differently, so only the second comparison isolates what speculation changes); the lean engine's
modes are compared with its own mode off (another model: its kernel rounds as llama.cpp's does not). Sessions run
with a fixed K (--k); --measured-k adds each lean mode with K measured (MeasuredK, -k auto, as the chat runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from specchat import heap, threads  # noqa: E402

threads.prepare_process()  # OpenMP waits as specchat's own commands wait when llama.cpp runs the models
heap.keep_freed_pages()  # and the heap keeps freed pages, as in the specchat command
threads.prepare_for_gguf()  # (the torch row runs with that spin too: 12% slower than torch's own, section 9)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from specchat.engine.draft_length import MeasuredK  # noqa: E402
from specchat.engine.sampling import SamplingParams  # noqa: E402
from specchat.models import default_gguf, load_model  # noqa: E402
from specchat.session import Session  # noqa: E402


def llama_cpp_plain(model, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """llama.cpp's own greedy decoding: one token per llama_decode, argmax in numpy. (ids, decode seconds)."""
    ctx = model.context(len(prompt) + tokens + 8)
    logits = ctx.decode(prompt, 0, keep=1)[-1].numpy()
    out = [int(np.argmax(logits))]
    t0 = time.perf_counter()
    while len(out) < tokens:
        logits = ctx.decode([out[-1]], len(prompt) + len(out) - 1, keep=1)[-1].numpy()
        out.append(int(np.argmax(logits)))
    return out, time.perf_counter() - t0


def specchat_run(session: Session, prompt: list[int], tokens: int) -> tuple[list[int], float, dict, list[float]]:
    """One generation through the session (the chat's path): (ids, decode tokens per second, rounds by mode, [rounds,
    drafted, accepted, draft seconds, verify seconds]). Round 0's first token came with the prefill: the rate counts
    the tokens of the rounds after it, over their time."""
    session.max_new_tokens = tokens
    records = list(session.complete(prompt))
    ids = [t.id for r in records for t in r.tokens]
    made = sum(len(r.tokens) for r in records[1:])
    modes: dict[str, int] = {}
    for r in records[1:]:
        modes[r.mode] = modes.get(r.mode, 0) + 1
    totals = [len(records) - 1, *(sum(getattr(r, f) for r in records[1:]) for f in ("drafted", "accepted", "draft_s", "verify_s"))]
    return ids, made / sum(r.wall_s for r in records[1:]), modes, totals


def tool_tok_s(cmd: list[str]) -> float | None:
    """Tokens per second a llama.cpp tool reports (llama-bench -o json; llama-speculative's 'decoded ... speed')."""
    out = subprocess.run(cmd, capture_output=True, text=True)
    if "llama-bench" in cmd[0]:
        rows = json.loads(out.stdout)
        return float(rows[-1]["avg_ts"])
    for line in (out.stdout + out.stderr).splitlines():
        if "decoded" in line and "speed:" in line:
            return float(line.split("speed:")[1].split()[0])
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompts", default="benchmarks/heldout-prompts.jsonl")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--temperature", default="0")
    ap.add_argument("--modes", default="off,auto")
    ap.add_argument("--no-torch", action="store_true", help="leave out specchat on the torch engine")
    ap.add_argument("--torch-modes", default="off", help="the modes specchat runs on the torch engine too (greedy)")
    ap.add_argument("--lean-modes", default="", help="the modes specchat runs on the lean engine too (every temperature)")
    ap.add_argument("--measured-k", action="store_true", help="each lean mode also with K measured (-k auto, from --k)")
    ap.add_argument("--llama-bench", default=None, help="path of llama.cpp's llama-bench binary")
    ap.add_argument("--llama-speculative", default=None, help="path of llama.cpp's llama-speculative binary (needs --draft)")
    args = ap.parse_args()
    n_threads = threads.set_threads(args.threads)
    path = Path(args.target) if args.target else default_gguf()
    print(f"load average before: {os.getloadavg()}; threads {n_threads}; target {path.name}"
          + (f"; draft {Path(args.draft).name}" if args.draft else ""), flush=True)

    cpu = torch.device("cpu")
    target = load_model(args.target, cpu, torch.float32, engine="llama.cpp")
    draft = load_model(args.draft, cpu, torch.float32, engine="llama.cpp") if args.draft else None
    prompts = [json.loads(line) for line in open(args.prompts) if line.strip()]
    ids = {p["name"]: target.chat_ids([{"role": "user", "content": p["prompt"]}]) for p in prompts}
    # llama-speculative takes text: the same chat-templated prompt
    text = {p["name"]: target.tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True,
                                                            tokenize=False) for p in prompts}

    if args.lean_modes:  # the same files read in place by specchat's kernel (interleaved once at load)
        lean_target = load_model(args.target, cpu, torch.float32, engine="lean")
        lean_draft = load_model(args.draft, cpu, torch.float32, engine="lean") if args.draft else None
    temperatures = [float(t) for t in args.temperature.split(",")]
    sessions: dict[str, Session] = {}
    # nothing learnt or saved by earlier runs counts (as in `specchat bench`): auto's rows start from their own rounds
    fresh = dict(k=args.k, seed=0, earlier_sessions=False)
    for t in temperatures:
        params = SamplingParams(t, 0, 0.9 if t > 0 else 1.0)
        for mode in args.modes.split(","):
            if mode == "draft" and draft is None:
                continue
            sessions[f"llama.cpp {mode} T={t:g}"] = Session(target, draft, mode=mode, sampling=params, **fresh)
        if args.lean_modes:
            for mode in args.lean_modes.split(","):
                if mode == "draft" and lean_draft is None:
                    continue
                sessions[f"lean {mode} T={t:g}"] = Session(lean_target, lean_draft, mode=mode, sampling=params, **fresh)
                if args.measured_k and mode != "off":
                    measured = sessions[f"lean {mode} K=auto T={t:g}"] = Session(lean_target, lean_draft, mode=mode, sampling=params, **fresh)
                    measured.controls.adaptive = MeasuredK(start=args.k)  # one for all its replies, as a chat keeps it
        if not args.no_torch and t == 0:
            torch_target = load_model(args.target, cpu, torch.float32)
            for mode in args.torch_modes.split(","):
                sessions[f"torch {mode} T=0"] = Session(torch_target, None, mode=mode, sampling=params, **fresh)
    names = ["llama.cpp plain", *sessions]
    if args.llama_bench:
        names.append("llama-bench tg")
    if args.llama_speculative and args.draft:
        names.append("llama-speculative")

    tok_s: dict[str, list[float]] = {n: [] for n in names}
    ratio: dict[str, list[float]] = {n: [] for n in names}
    used: dict[str, dict] = {n: {} for n in sessions}
    totals: dict[str, list[float]] = {n: [0.0] * 5 for n in sessions}  # rounds, drafted, accepted, draft s, verify s
    same: dict[str, list[bool]] = {n: [] for n in sessions}  # greedy output = llama.cpp's own plain loop's
    same_off: dict[str, list[bool]] = {n: [] for n in sessions}  # = specchat's mode off on llama.cpp (same cache reuse)
    for rep in range(args.reps):
        for p in prompts:
            prompt = ids[p["name"]]
            plain_ids, plain_s = llama_cpp_plain(target.model, prompt, args.tokens)
            base = (args.tokens - 1) / plain_s
            tok_s["llama.cpp plain"].append(base)
            ratio["llama.cpp plain"].append(1.0)
            order = list(sessions)
            if rep % 2:
                order.reverse()  # neither side always runs first
            outputs = {}
            for name in order:
                out, rate, modes, counts = specchat_run(sessions[name], prompt, args.tokens)
                totals[name] = [a + b for a, b in zip(totals[name], counts)]
                tok_s[name].append(rate)
                ratio[name].append(rate / base)
                for m, n in modes.items():
                    used[name][m] = used[name].get(m, 0) + n
                outputs[name] = out
                if name.endswith("T=0"):
                    same[name].append(out == plain_ids[: len(out)])
            for name in sessions:
                off = "lean off T=0" if name.startswith("lean") else "llama.cpp off T=0"
                if name.endswith("T=0") and off in outputs:
                    same_off[name].append(outputs[name] == outputs[off])
            if args.llama_bench:
                rate = tool_tok_s([args.llama_bench, "-m", str(path), "-t", str(n_threads), "-p", "0", "-n", str(args.tokens),
                                   "-r", "1", "-o", "json"])
                tok_s["llama-bench tg"].append(rate)
                ratio["llama-bench tg"].append(rate / base)
            if args.llama_speculative and args.draft:
                rate = tool_tok_s([args.llama_speculative, "-m", str(path), "-md", args.draft, "-t", str(n_threads),
                                   "-p", text[p["name"]], "-n", str(args.tokens), "--temp", "0", "--spec-draft-n-max", str(args.k)])
                if rate is not None:
                    tok_s["llama-speculative"].append(rate)
                    ratio["llama-speculative"].append(rate / base)
            print(f"rep {rep + 1} {p['name']}: " + ", ".join(f"{n} {tok_s[n][-1]:.1f}" for n in names if tok_s[n]), flush=True)

    print(f"\nload average after: {os.getloadavg()}")
    print(f"{'configuration':26} {'tok/s (median)':>15} {'x llama.cpp plain (median, range)':>34}  "
          f"greedy = plain, = off   rounds by mode")
    for n in names:
        if not tok_s[n]:
            continue
        r = ratio[n]
        identical = f"{sum(same[n])}/{len(same[n])}" if same.get(n) else ""
        identical_off = f"{sum(same_off[n])}/{len(same_off[n])}" if same_off.get(n) else ""
        print(f"{n:26} {statistics.median(tok_s[n]):15.1f} {statistics.median(r):14.2f}x ({min(r):.2f}-{max(r):.2f})"
              f"     {identical:>6} {identical_off:>6}   {used.get(n, '')}")
    print("\nper drafting configuration: acceptance (accepted / drafted), a draft token's cost and a verify's, in plain steps "
          "(the same engine's mode off at that temperature: its verify time a round)")
    for n, (rounds, drafted, accepted, draft_s, verify_s) in totals.items():
        off = n.split()[0] + " off " + n.split()[-1]
        if not drafted or off not in totals or not totals[off][0]:
            continue
        step = totals[off][4] / totals[off][0]
        print(f"{n:26} acceptance {accepted / drafted:.2f} ({int(drafted)} drafted in {int(rounds)} rounds); "
              f"a draft token {draft_s / drafted / step:.2f} steps; a verify {verify_s / rounds / step:.2f} steps")


if __name__ == "__main__":
    sys.exit(main())
