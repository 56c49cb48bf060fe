"""Training a draft head (engine/drafters/head.py) for a target on this machine, by self-distillation.

1. Data: the target's own replies to a prompt set (train/prompts.txt, topics in templates, and tasks built from
   the Python standard library: docstrings to summarise, functions to explain or write; never the bench's or the
   tests' prompts; or the user's JSONL), 128 prompts at a time (every third row greedy, the others sampled at
   temperature 0.8) through a batched generation loop on the lean runner (train/generate.py; HF `generate` for
   other architectures, a hook on its final norm), which keeps the last layer's output: the target's features
   f_t for every position at no extra forward. Lines with "text" instead of "prompt" are taken as they are
   (teacher-forced, one lean forward each), and so are the standard library's docstrings, read for the rest of
   the data time (`text_share` of it). Where bfloat16 matmuls are fast (AMX) a bfloat16 copy of the target
   generates the data and the training steps run under bfloat16 autocast (`use_bfloat16`).
2. Vocabulary (FR-Spec): the N tokens the data predicts most often, the tokenizer's special tokens, and, if
   the data holds fewer than N distinct tokens, the lowest remaining ids (BPE ids rise with merge order,
   i.e. roughly fall in frequency).
3. Training (EAGLE): teacher-forced over whole sequences, the head reads (f_t + noise, e(x_{t+1})) and predicts
   f_{t+1}; loss = smooth-L1 of (prediction - f_{t+1}) in units of the features' RMS + cross-entropy between the
   target's next-token distribution and the head's, both over the N tokens (LM head rows of the N tokens after
   the final norm). EAGLE weighs raw features 1 and the cross-entropy 0.1; on SmolLM2 (feature RMS ~36, single
   values up to ~4400, so the raw regression swamps the rest) this scaling raised held-out greedy agreement
   after 150 steps from 0.28 to 0.32. The head's layer starts as a copy of the target's last layer. AdamW with
   warm-up and cosine decay over a fixed number of steps.
4. Evaluation on the held-out prompts' replies (teacher-forced, first draft only): the expected acceptance at
   temperature 1 (sum min(p, q) with the full target p) and greedy agreement. Acceptance in the loop, at every
   draft position, is what `specchat bench --modes off,head` measures.

Deterministic for a seed and a step count; `minutes` picks the step count from the measured speed of the first
steps and prints it, so a run can be repeated with `steps`. `minutes` is the machine time of data and training
together, data made by earlier runs of the same recipe included (training keeps at least its share).
Everything lands in a work folder first: the data a shard at a time (a batch of replies, TEXT_SHARD chunks of
text) and a checkpoint every minute, so an interrupted run resumes where it stopped and a run given more minutes
adds data to what earlier runs made.
"""

from __future__ import annotations

import ast
import copy
import functools
import json
import math
import random
import sysconfig
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LogitsProcessor, LogitsProcessorList

from specchat import threads
from specchat.engine.drafters.head import FORMAT, DraftHead, fingerprint, head_spec
from specchat.engine.runner import lean_runner, rms_norm, unsupported
from specchat.store import atomic_path, write_atomic
from specchat.train.generate import draw, generate_with_features

PROMPTS = Path(__file__).with_name("prompts.txt")
HELD_OUT = 0.05  # share of prompts (with all their replies) kept for evaluation
ROWS_BUCKET = 32  # training rows are padded to a multiple of this (Trainer.loss)
PASSES = 3  # replies per prompt at most (every third row greedy, the others sampled)
TEXT_SHARD = 32  # teacher-forced chunks per saved shard


class TrainError(ValueError):
    """Bad input to train-head (one line for the user)."""


@dataclass
class Recipe:
    minutes: float = 15.0  # the whole run: data (data_share of it) and training
    steps: int | None = None  # optimizer steps; None: chosen from `minutes` and the measured step speed
    vocab: int = 8192  # N: the head drafts among this many tokens
    seed: int = 0
    data_share: float = 0.55  # the shipped head's split: in 20 minutes, a head that drafts as well as one trained longer
    text_share: float = 0.15  # of the data time: teacher-forced text (the Python standard library's docstrings)
    max_new_tokens: int = 160
    batch: int = 128  # replies generated together (CPU, SmolLM2: 32 -> 128 rows raised generate's tokens/s ~2.4x)
    temperature: float = 0.8  # for the sampled two thirds of the replies
    seqs_per_step: int = 4  # sequences per optimizer step (gradient accumulation)
    max_len: int = 384
    lr: float = 3e-3  # peak; with cls_weight 0.3: +0.027 held-out acceptance over 1e-3 and 1.0, paired over three seeds
    cls_weight: float = 0.3  # the cross-entropy's weight beside the feature regression's 1 (see lr)
    noise: float = 0.05  # feature noise, relative to the features' RMS (EAGLE's robustness to its own errors)
    depth: int = 1  # draft positions trained: 2+ adds EAGLE-3's training-time test (Trainer.batch_loss)
    data_file: str | None = None
    bfloat16: str = "auto"  # data and training in bfloat16: auto (where its matmuls measure faster, see use_bfloat16), yes, no

    def text_key(self) -> dict:
        return {"v": 2, "source": "stdlib docstrings", "max_len": self.max_len, "seed": self.seed, "bfloat16": self.bfloat16}

    def data_key(self) -> dict:
        return {"v": 4, **{k: getattr(self, k) for k in ("seed", "max_new_tokens", "batch", "temperature", "max_len", "data_file", "bfloat16")}}


@dataclass
class Data:
    sequences: list[list[int]] = field(default_factory=list)
    features: list[torch.Tensor] = field(default_factory=list)  # per sequence [S, D], the target's last-layer output
    groups: list[int] = field(default_factory=list)  # per sequence: the prompt it answers
    starts: list[int] = field(default_factory=list)  # per sequence: where the reply starts (0: text)
    seconds: float = 0.0  # machine time it took to make

    def extend(self, other: "Data") -> None:
        for seq, feats, group, start in zip(other.sequences, other.features, other.groups, other.starts):
            self.keep(seq, feats, group, start)
        self.seconds += other.seconds

    def add(self, tokens: list[int], features: torch.Tensor, group: int, start: int = 0) -> None:
        """A sequence the target just made, its features rounded as the shards keep them (save), so a run trains on
        the same features whether it made its data or loaded it: unrounded, a fresh run and its rerun would train two
        different heads."""
        self.keep(tokens, features.to(torch.bfloat16).float(), group, start)

    def keep(self, tokens: list[int], features: torch.Tensor, group: int, start: int = 0) -> None:
        """A sequence already in another Data (extend, split): its features as they are, shared, not copied."""
        self.sequences.append(tokens)
        self.features.append(features)
        self.groups.append(group)
        self.starts.append(start)

    def split(self, share: float) -> tuple["Data", "Data"]:
        """(train, held out): about `share` of the prompts, with every reply to them, are held out."""
        groups = sorted({g for g in self.groups if g >= 0})  # prompts; teacher-forced text (groups < 0) always trains
        held = set(groups[: max(1, round(len(groups) * share))]) if len(groups) > 1 else set()
        parts = Data(), Data()
        for s, f, g, start in zip(self.sequences, self.features, self.groups, self.starts):
            parts[g in held].keep(s, f, g, start)
        return parts if parts[1].sequences else (self, self)

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    def save(self, path: Path, key: dict) -> None:
        tensors = {f"f{i}": f.to(torch.bfloat16).contiguous() for i, f in enumerate(self.features)}  # half the disk; noise is added anyway
        tensors |= {f"t{i}": torch.tensor(s, dtype=torch.int32) for i, s in enumerate(self.sequences)}
        tensors["groups"] = torch.tensor(self.groups, dtype=torch.int64)
        tensors["starts"] = torch.tensor(self.starts, dtype=torch.int64)
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={"key": json.dumps(key, sort_keys=True), "seconds": repr(self.seconds)})

    @staticmethod
    def load(path: Path, key: dict) -> "Data | None":
        if not path.is_file():
            return None
        from safetensors import safe_open

        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                if meta.get("key") != json.dumps(key, sort_keys=True):
                    return None
            tensors = load_file(path)
        except Exception:
            return None
        n = sum(k.startswith("t") for k in tensors)  # t0.., f0.., groups and starts
        return Data([tensors[f"t{i}"].tolist() for i in range(n)], [tensors[f"f{i}"].float() for i in range(n)], tensors["groups"].tolist(),
                    tensors["starts"].tolist(), float(meta.get("seconds", 0.0)))


def load_shards(work: Path, kind: str, key: dict) -> tuple[Data, int]:
    """The shards `kind`-00000, -00001, ... an earlier run with the same recipe left in `work`, in order: (their
    data, how many). Data is saved a shard at a time, so a run that stopped keeps what it made and a run with more
    minutes carries on after it."""
    data, n = Data(), 0
    while (part := Data.load(work / f"{kind}-{n:05d}.safetensors", key)) is not None:
        data.extend(part)
        n += 1
    return data, n


def read_prompts(data_file: str | None) -> list[dict]:
    """[{"prompt": ...} | {"text": ...}]: the shipped prompts, or the user's JSONL (one object per line)."""
    if data_file is None:
        return [{"prompt": line} for line in PROMPTS.read_text().splitlines() if line.strip()]
    path = Path(data_file).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TrainError(f"--data {data_file}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            raise TrainError(f"--data {data_file}: line {number} is not JSON") from None
        if not isinstance(item, dict) or not any(isinstance(item.get(k), str) and item[k].strip() for k in ("prompt", "text")):
            raise TrainError(f'--data {data_file}: line {number} needs a "prompt" or "text" string')
        items.append(item)
    if not items:
        raise TrainError(f"--data {data_file}: no prompts in it")
    return items


def target_features(runner, ids: list[int]) -> torch.Tensor:
    """The target's last-layer output (before the final norm) at every position of `ids`: [S, D], one forward."""
    hidden = runner.run(runner.embed(ids), range(runner.n_layers), None, 0)[0]
    return hidden.float().clone()  # a normal tensor (run's output is an inference tensor, which autograd cannot save)


def use_bfloat16(model, recipe: Recipe) -> bool:
    """Whether data and training run in bfloat16: where its matmuls measure at least 1.5x faster than float32's
    (CPUs with AMX; the reference VM: 5.4x for a matmul, 3.1x for a 384-token prefill, 1.7-2.4x for batched
    generation with InverseCDF, 1.6x for a training step; on AVX2-only CPUs bfloat16 is slower), always on CUDA.
    The data's features then differ from the float32 target's by bfloat16 rounding, inside the noise training adds to them; labels and the
    evaluation are computed in float32. 400 steps on the previous head's data, then greedy agreement on the replies
    to 12 prompts outside the training and bench sets: 0.252 under autocast and 0.252 without (0.178, 0.188, 0.235
    against 0.178, 0.188, 0.232 on the way)."""
    weight = model.get_output_embeddings().weight
    if recipe.bfloat16 != "auto":
        return recipe.bfloat16 == "yes"
    if weight.device.type == "cuda":
        return True
    return weight.dtype == torch.float32 and matmul_speedup() >= 1.5


def data_model(model, bfloat16: bool):
    """The model that generates the data: the target itself, or a bfloat16 copy of it."""
    return copy.deepcopy(model).to(torch.bfloat16) if bfloat16 and model.dtype != torch.bfloat16 else model


def matmul_speedup(rows: int = 256, d: int = 1024) -> float:
    """float32 time over bfloat16 time for a [rows, d] x [d, 4d] matmul on the CPU, best of 3 each: a property of
    the CPU (one shape for every model, so the choice does not flip on a small model's noisy timing)."""
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(rows, d, dtype=dtype), torch.randn(4 * d, d, dtype=dtype)
        F.linear(x, w)
        times = []
        for _ in range(3):
            began = time.perf_counter()
            F.linear(x, w)
            times.append(time.perf_counter() - began)
        best[dtype] = min(times)
    return best[torch.float32] / best[torch.bfloat16]


class InverseCDF(LogitsProcessor):
    """Sampling inside a greedy `generate`: each row's chosen token keeps score 0, every other -inf. A row at
    temperature 0 takes the argmax; the others draw one uniform through the CDF of softmax(scores / T). HF's own
    sampler draws an exponential per vocabulary entry (38% of a batched bfloat16 step on the reference VM)."""

    def __init__(self, temperatures: list[float], generator: torch.Generator) -> None:
        self.t = torch.tensor(temperatures)  # [B]
        self.generator = generator

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        chosen = draw(scores, self.t, self.generator)[:, None]  # [B, 1]
        return torch.full_like(scores, -math.inf).scatter_(1, chosen, 0.0)


def hf_generate_with_features(model, prompts: list[list[int]], pad: int, eos: set[int], temperatures: list[float], recipe: Recipe,
                              seed: int = 0) -> list[tuple[list[int], torch.Tensor]]:
    """One batch of replies through HF `generate` (left-padded; row i at temperatures[i], 0 = greedy), with the
    target's features captured on the way: a hook on the final norm records its input (the last layer's output)
    in the prefill and in every step. Returns (tokens, features [S, D] float32) per prompt: the prompt, the reply
    up to its EOS, features for each."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)  # [B, L]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    seen: list[torch.Tensor] = []
    hooks = [model.model.norm.register_forward_pre_hook(lambda module, args: seen.append(args[0].float())),
             # generate slices the last position before the LM head; given that non-contiguous [B, 1, D] input,
             # torch's bfloat16 linear copies the weight once per row (13 s per call on the reference VM)
             model.get_output_embeddings().register_forward_pre_hook(lambda module, args: (args[0].contiguous(),))]
    sampler = InverseCDF(temperatures, torch.Generator().manual_seed(seed))
    try:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=recipe.max_new_tokens, do_sample=False,
                                 temperature=None, top_p=None, top_k=None, pad_token_id=pad, logits_processor=LogitsProcessorList([sampler]))
    finally:
        for hook in hooks:
            hook.remove()
    feats = torch.cat(seen, dim=1)  # [B, positions fed, D]: every token but the last one generated
    if feats.shape[1] != out.shape[1] - 1:
        raise RuntimeError(f"generate fed {feats.shape[1]} positions for {out.shape[1]} tokens")
    batch = []
    for row, prompt in enumerate(prompts):
        start = width - len(prompt)
        tokens = out[row, start:].tolist()
        end = next((i + 1 for i in range(len(prompt), len(tokens)) if tokens[i] in eos), len(tokens) - 1)  # the EOS, or all fed
        end = min(end, len(tokens) - 1, recipe.max_len)  # the last token generated was never fed: no feature
        batch.append((tokens[:end], feats[row, start : start + end].clone()))  # clone: a normal tensor, not an inference one
    return batch


def collect(target, model: Callable[[], object], recipe: Recipe, seconds: float, work: Path,
            progress: Callable[[str, float], None]) -> Data:
    """The target's replies to the prompts and their features, for `seconds` of machine time (this run's and the
    earlier runs' shards together) or until every prompt has had `PASSES` replies: every third row greedy, the
    others sampled at the recipe's temperature (a prompt greedy in one pass is sampled in the next). Prompts of
    similar length share a batch (less padding). A batch that would overrun the time (by the mean batch so far)
    is not started. Each batch is saved as a shard (`load_shards`). Each sequence's group is its prompt, so
    held-out prompts stay out of training. `model()`: data_model's (made only if a batch runs)."""
    tokenizer, key, runner = target.tokenizer, recipe.data_key(), functools.cache(lambda: lean_runner(model()))
    items = read_prompts(recipe.data_file) + (stdlib_prompts(recipe.seed) if recipe.data_file is None else [])
    random.Random(recipe.seed).shuffle(items)
    data, began = Data(), time.monotonic()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(target.eos_ids))
    for group, item in enumerate(items):  # teacher-forced text: taken as it is
        if "text" in item and "prompt" not in item:
            ids = target.raw_ids(item["text"])[: recipe.max_len]
            if len(ids) >= 2:
                data.add(ids, target_features(runner(), ids), group)
    data.seconds = time.monotonic() - began
    earlier, done = load_shards(work, "replies", key)
    if done:
        progress(f"data from earlier runs: {len(earlier.sequences)} replies ({earlier.tokens} tokens, {earlier.seconds:.0f} s)", 0.0)
    data.extend(earlier)
    batches_s = earlier.seconds  # of the batches done so far: their mean predicts the next one
    prompts = [(g, target.chat_ids([{"role": "user", "content": it["prompt"]}])) for g, it in enumerate(items) if "prompt" in it]
    window = 8 * recipe.batch  # sorted by length within windows of 8 batches: each batch pads little, subjects stay mixed
    prompts = [p for i in range(0, len(prompts), window) for p in sorted(prompts[i : i + window], key=lambda p: len(p[1]))]
    batches = [(n, prompts[i : i + recipe.batch]) for n in range(PASSES) for i in range(0, len(prompts), recipe.batch)]
    for b, (n, chunk) in enumerate(batches[done:], start=done):
        if b and data.seconds + batches_s / b > seconds:  # the first batch always runs
            break
        began = time.monotonic()
        temperatures = [0.0 if (row + n) % 3 == 0 else recipe.temperature for row in range(len(chunk))]
        rows, seed = [p for _, p in chunk], recipe.seed * 100003 + b
        if runner() is not None:
            replies = generate_with_features(runner(), rows, pad, target.eos_ids, temperatures, recipe.max_new_tokens, recipe.max_len, seed)
        else:
            replies = hf_generate_with_features(model(), rows, pad, target.eos_ids, temperatures, recipe, seed)
        part = Data()
        for (group, prompt), (tokens, feats) in zip(chunk, replies):
            if len(tokens) > len(prompt) + 1:  # a reply the head can draft in (its first token comes from the prefill)
                part.add(tokens, feats, group, len(prompt))
        part.seconds = time.monotonic() - began
        part.save(work / f"replies-{b:05d}.safetensors", key)
        data.extend(part)
        batches_s += part.seconds
        progress(f"data: {len(data.sequences)} sequences, {data.tokens} tokens", min(1.0, data.seconds / seconds))
    if not data.sequences:
        raise TrainError("no training data: the time budget ended before the first batch of replies")
    return data


def stdlib_nodes(seed: int):
    """(source, node) for every module, class and function of the Python standard library (no tests, no IDLE),
    its files in a seeded order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = [p for p in sorted(root.rglob("*.py")) if not {"site-packages", "test", "tests", "idlelib"} & set(p.parts)]
    random.Random(seed).shuffle(paths)
    for path in paths:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                yield source, node


def stdlib_docstrings(seed: int) -> list[str]:
    """Every docstring of 200+ characters in the Python standard library, in a seeded order: English prose about
    code, on every machine that runs specchat, no download."""
    texts = [doc for _, node in stdlib_nodes(seed) if (doc := ast.get_docstring(node)) and len(doc) >= 200]
    random.Random(seed).shuffle(texts)
    return texts


PASSAGE_TASKS = ["Summarise the following text in {n} sentences.", "Explain this to a beginner in plain words.",
                 "What are the key points of this documentation? Answer as a short list.", "Rewrite the following more simply.",
                 "Write {n} questions a student might ask after reading this, with short answers.",
                 "Explain this in everyday language for someone who does not program."]
CODE_TASKS = ["Explain what this Python function does, step by step.", "Write unit tests for this function with pytest.",
              "Review this code: is there anything you would change, and why?", "Add type hints and a clear docstring to this function.",
              "Rewrite this function in a more readable way and explain the changes.", "What inputs could make this function fail?"]
WRITE_TASKS = ["Write a Python function `{name}{signature}` that should {what}", "Implement `{name}{signature}` in Python: it should {what}",
               "How would you write a function `{name}{signature}` that should {what} Show the code and an example call."]


def stdlib_prompts(seed: int, limit: int = 3000) -> list[dict]:
    """Prompts built from the standard library, on every machine, no download: a docstring to summarise, explain or
    rewrite; a short function to explain, test or review; a function to write from its name, arguments and the first
    line of its docstring. Beside the shipped prompts (topics in templates) they give the replies varied subjects
    and shapes, code among them: the head generalises to what users ask only as far as its data reaches."""
    rng, prompts = random.Random(seed), []
    for source, node in stdlib_nodes(seed):
        doc = ast.get_docstring(node) or ""
        is_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_")
        if 200 <= len(doc) <= 700:
            task = rng.choice(PASSAGE_TASKS).format(n=rng.choice(["two", "three"]))
            prompts.append(f"{task}\n\n{doc}")
        if is_function and 4 <= node.end_lineno - node.lineno <= 15:
            code = textwrap.dedent(ast.get_source_segment(source, node, padded=True) or "")
            prompts.append(f"{rng.choice(CODE_TASKS)}\n\n```python\n{code}\n```")
        first = doc.split("\n")[0].strip().rstrip(".")
        if is_function and 25 <= len(first) <= 120 and first[:1].isupper():
            args = ", ".join(a.arg for a in node.args.args if a.arg not in ("self", "cls"))
            what = first[0].lower() + first[1:] + "."
            prompts.append(rng.choice(WRITE_TASKS).format(name=node.name, signature=f"({args})", what=what))
    rng.shuffle(prompts)
    return [{"prompt": p} for p in prompts[:limit]]


def collect_text(target, model: Callable[[], object], recipe: Recipe, seconds: float, work: Path,
                 progress: Callable[[str, float], None]) -> Data:
    """Teacher-forced text for `seconds` of machine time (earlier runs' shards included): standard-library
    docstrings packed into max_len-token chunks (separated by EOS), one lean forward each for the features, saved
    TEXT_SHARD chunks to a shard. Groups are negative: text is never held out."""
    key, eos, runner = recipe.text_key(), min(target.eos_ids), functools.cache(lambda: lean_runner(model()))
    data, shards = load_shards(work, "text", key)
    if shards:
        progress(f"text from earlier runs: {len(data.sequences)} chunks ({data.tokens} tokens, {data.seconds:.0f} s)", 0.0)
    part, began, chunk, skip = Data(), time.monotonic(), [], len(data.sequences)

    def save() -> None:
        nonlocal part, began, shards
        part.seconds = time.monotonic() - began
        part.save(work / f"text-{shards:05d}.safetensors", key)
        data.extend(part)
        part, began, shards = Data(), time.monotonic(), shards + 1

    for text in stdlib_docstrings(recipe.seed):
        if data.seconds + time.monotonic() - began > seconds:
            break
        chunk += target.raw_ids(text) + [eos]
        while len(chunk) >= recipe.max_len:
            ids, chunk = chunk[: recipe.max_len], chunk[recipe.max_len :]
            if skip:  # made by an earlier run
                skip -= 1
                continue
            threads.adapt()
            part.add(ids, target_features(runner(), ids), -1 - len(data.sequences) - len(part.sequences))
            if len(part.sequences) == TEXT_SHARD:
                save()
                progress(f"text: {len(data.sequences)} chunks, {data.tokens} tokens", min(1.0, data.seconds / seconds))
    if part.sequences:
        save()
    return data


def choose_vocab(data: Data, n: int, vocab_size: int, special: set[int]) -> torch.Tensor:
    """FR-Spec: the N most frequent predicted tokens (special tokens always in), sorted; [N]."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in data.sequences:
        counts.index_add_(0, torch.tensor(seq[1:], dtype=torch.long), torch.ones(len(seq) - 1, dtype=torch.long))
    chosen = [t for t in sorted(special) if t < vocab_size]
    seen = [int(t) for t in torch.argsort(counts, descending=True, stable=True) if counts[t] > 0]
    for t in seen + list(range(vocab_size)):  # then the lowest ids: BPE ids rise with merge order
        if len(chosen) >= n:
            break
        if t not in special:
            chosen.append(t)
            special = special | {t}
    return torch.tensor(sorted(chosen), dtype=torch.long)


@torch.no_grad()
def start_from_layer(head: DraftHead, block) -> None:
    """The head's decoder layer starts as a copy of the target's last layer (fc stays random): the layer that
    turns the target's context into its last features is the nearest thing to what the head learns. 400 steps
    on the previous head's data, then greedy agreement on the replies to 12 prompts outside the training and bench
    sets: 0.252 against 0.225 from a random start."""
    pairs = [(head.ln1, block.ln1), (head.ln2, block.ln2), (head.qkv.weight, block.qkv_w), (head.o.weight, block.o_w),
             (head.gate_up.weight, block.gate_up_w), (head.down.weight, block.down_w), (head.qkv.bias, block.qkv_b),
             (head.q_norm, block.q_norm), (head.k_norm, block.k_norm)]
    for mine, theirs in pairs:
        if mine is not None and theirs is not None:
            mine.copy_(theirs.float())


DEPTH_DECAY = 0.8  # the loss weight of draft position d+1 relative to position d (EAGLE-3's training-time test)


class _Keys:
    """The keys and values of every depth so far, for the training-time test: decoder_layer writes a depth's
    [B, H_kv, L, hd] here and attends over all of them (with training_time_mask), differentiably."""

    def __init__(self) -> None:
        self.k = self.v = None

    def write(self, i, k, v, past):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


def training_time_mask(length: int, d: int, device: torch.device | None = None) -> torch.Tensor:
    """[L, (d+1) L] bool: what head row j sees at depth d+1 when drafting. The row stands at draft position d+1: its
    cache holds the rows before the draft, computed from the target's features (depth 1's keys up to row j-d), then
    one row per earlier draft position, each computed from the depth before (depth t+1's key of row j-d+t), then
    itself. Rows j < d have no such draft and are left out of the loss."""
    j = torch.arange(length, device=device)[:, None]  # [L, 1]
    c = torch.arange(length, device=device)[None]  # [1, L]
    return torch.cat([c <= j - d] + [c == j - d + t for t in range(1, d + 1)], dim=1)


class Trainer:
    """The head, its optimizer and the frozen target parts it trains against.

    With `recipe.depth` > 1 each step also runs EAGLE-3's training-time test: depth 2 feeds the head its own
    predictions from depth 1 (row j reads the predicted f_j with the true x_{j+1}), attending to depth 1's
    keys as the drafter attends to its cache, and so on; each depth's loss weighs DEPTH_DECAY times the one before.
    Trained teacher-forced only, the shipped head drafted its second token from its own features about as well as
    noise (accepted 3-6% of rounds)."""

    def __init__(self, target, recipe: Recipe, vocab: torch.Tensor, feature_rms: float, bfloat16: bool = False) -> None:
        model = target.model
        self.runner = lean_runner(model)
        self.recipe = recipe
        self.bfloat16 = bfloat16  # autocast the training steps (use_bfloat16)
        torch.manual_seed(recipe.seed)
        self.head = DraftHead(head_spec(self.runner, model.config), len(vocab)).float()
        self.head.vocab.copy_(vocab)
        start_from_layer(self.head, self.runner.blocks[-1])
        self.embed_w = self.runner.embed_w.detach().float()
        self.head_w = self.runner.head_w.detach()[vocab].float()  # [N, D]
        # autocast casts a frozen weight again at every use (it caches only trainable ones): cast it once
        self.head_w_bf16 = self.head_w.to(torch.bfloat16)
        self.norm_w, self.norm_eps = self.runner.norm_w.detach().float(), self.runner.norm_eps
        fused = self.embed_w.device.type in ("cpu", "cuda")  # one kernel for the update: 0.18 s a step against 0.19
        self.opt = torch.optim.AdamW(self.head.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=fused)
        self.rms = feature_rms
        self.noise = recipe.noise * feature_rms
        self.step = 0
        self.generator = torch.Generator().manual_seed(recipe.seed)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        head_w = self.head_w_bf16 if torch.is_autocast_enabled(features.device.type) else self.head_w
        return F.linear(rms_norm(features, self.norm_w, self.norm_eps), head_w)  # [..., N]

    def rope(self, length: int):
        with torch.no_grad():
            positions = torch.arange(length)[None]
            cos, sin = self.runner.rotary_emb(self.embed_w[:1][None], position_ids=positions)
            half = cos.shape[-1] // 2
            sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        return cos.float()[:, :, None].clone(), sin.float()[:, :, None].clone()  # [1, S, 1, hd]

    def loss(self, seq: list[int], feats: torch.Tensor, noise: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced loss over one sequence: (total, the head's logits [S-1, N])."""
        total, (logits,) = self.batch_loss([(seq, feats)], noise)
        return total, logits

    def batch_loss(self, batch: list[tuple[list[int], torch.Tensor]], noise: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Teacher-forced loss over sequences fed as one batch: (the mean of each sequence's loss, each one's logits
        [S-1, N]). One forward for the step instead of one per sequence, with the step's sequences of similar
        lengths (epoch_order): 0.18 s a step against 0.27 on the reference VM (OpenMP's passive wait, 4
        interleaved rounds of 25 steps over a 20-minute run's data). Rows are padded to a common length, a
        multiple of ROWS_BUCKET: oneDNN builds a bfloat16 matmul kernel per shape, and a new shape every step made
        a step cost 0.48 s instead of 0.24. The padding comes last, so causal attention keeps it out of the real
        rows; the loss ignores it."""
        ns = [len(seq) - 1 for seq, _ in batch]  # head rows: row j reads (f_j, x_{j+1}) and predicts f_{j+1}
        length = max(ns) + (-max(ns) % ROWS_BUCKET)
        f_in = torch.stack([F.pad(feats[:-1], (0, 0, 0, length - n)) for (_, feats), n in zip(batch, ns)])  # [B, L, D]: f_0..f_{n-1}, zeros
        if noise and self.noise > 0:
            f_in = f_in + self.noise * torch.randn(f_in.shape, generator=self.generator)
        ids = torch.tensor([seq[1:] + [0] * (length - n) for (seq, _), n in zip(batch, ns)])  # [B, L]: x_1..x_n, then token 0
        embeddings, (cos, sin) = F.embedding(ids, self.embed_w), self.rope(length)
        target = torch.stack([F.pad(feats[1:], (0, 0, 0, length - n)) for (_, feats), n in zip(batch, ns)])  # [B, L, D]
        with torch.no_grad():
            p = torch.softmax(self.logits(target), -1)  # [B, L, N]: the target's next-token distribution over N
        rows = torch.tensor(ns, device=f_in.device)
        position = torch.arange(length, device=f_in.device)[None]  # [1, L]
        total, weights = 0.0, 0.0
        for d, pred in enumerate(self.predict(f_in, embeddings, cos, sin)):  # depth d+1: rows j >= d have d drafts before them
            logits = self.logits(pred)  # [B, L, N]
            cls = -(p * torch.log_softmax(logits, -1)).sum(-1)  # [B, L]
            reg = F.smooth_l1_loss(pred / self.rms, target / self.rms, reduction="none").mean(-1)  # [B, L]
            real = (position >= d) & (position < rows[:, None])  # [B, L]
            per_sequence = ((reg + self.recipe.cls_weight * cls) * real).sum(-1) / real.sum(-1).clamp_min(1)  # [B]
            total, weights = total + DEPTH_DECAY**d * per_sequence.mean(), weights + DEPTH_DECAY**d
            if d == 0:
                first = [logits[i, :n] for i, n in enumerate(ns)]
        return total / weights, first

    def predict(self, f_in: torch.Tensor, embeddings: torch.Tensor, cos, sin) -> list[torch.Tensor]:
        """The head's predicted features [B, L, D] at each depth 1..recipe.depth: row j of depth 1 reads (f_j, x_{j+1});
        row j of depth d+1 reads depth d's prediction of f_j (row j-1) with x_{j+1}, as draft position d+1 does."""
        if self.recipe.depth == 1:
            return [self.head(f_in, embeddings, None, 0, cos, sin)]
        length, preds, keys, fed = f_in.shape[1], [], _Keys(), f_in
        for d in range(self.recipe.depth):
            mask = training_time_mask(length, d, f_in.device).repeat(self.head.shape.n_rep, 1)  # [n_rep L, (d+1) L]
            preds.append(self.head(fed, embeddings, keys, 0, cos, sin, mask))
            fed = torch.cat([f_in[:, :1], preds[-1][:, :-1]], dim=1)  # row j now reads the prediction of f_j
        return preds

    def train_step(self, batch: list[tuple[list[int], torch.Tensor]], total_steps: int) -> float:
        threads.adapt()
        warm = max(1, total_steps // 20)
        frac = self.step / max(total_steps, 1)
        lr = self.recipe.lr * (min(1.0, (self.step + 1) / warm)) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.zero_grad()
        with torch.autocast(self.embed_w.device.type, dtype=torch.bfloat16, enabled=self.bfloat16):
            loss, _ = self.batch_loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.opt.step()
        self.step += 1
        return float(loss.detach())

    @torch.no_grad()
    def evaluate(self, data: Data, full_head_w: torch.Tensor) -> dict:
        """First-draft quality on held-out replies, at the reply positions after the first (the loop drafts the first
        too, checked against the prefill's logits) and every position of text: expected acceptance at temperature 1
        (sum min(p, q) with the full target p), greedy agreement (argmax q = argmax p), and how often the target's
        argmax is in the vocabulary."""
        accept = agree = in_vocab = n = 0.0
        vocab = self.head.vocab
        for seq, feats, start in zip(data.sequences, data.features, data.starts):
            _, logits = self.loss(seq, feats, noise=False)
            first = max(start - 1, 0)  # row j reads (f_j, x_{j+1}) and drafts x_{j+2}
            q_small = torch.softmax(logits[first:], -1)  # [R, N]
            p = torch.softmax(F.linear(rms_norm(feats[first + 1 :], self.norm_w, self.norm_eps), full_head_w), -1)  # [R, V]
            accept += float(torch.minimum(p[:, vocab], q_small).sum())
            best = p.argmax(-1)
            agree += float((vocab[q_small.argmax(-1)] == best).sum())
            in_vocab += float(torch.isin(best, vocab).sum())
            n += len(p)
        return {"first_draft_acceptance_t1": accept / n, "first_draft_greedy_agreement": agree / n, "target_argmax_in_vocab": in_vocab / n,
                "held_out_positions": int(n)}

    def checkpoint(self, path: Path) -> None:
        with atomic_path(path) as tmp:
            torch.save({"head": self.head.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                        "generator": self.generator.get_state(), "torch": torch.get_rng_state()}, tmp)

    def resume(self, path: Path) -> bool:
        if not path.is_file():
            return False
        try:
            state = torch.load(path, weights_only=True)  # tensors and numbers only: nothing is unpickled
            self.head.load_state_dict(state["head"])
            self.opt.load_state_dict(state["opt"])
        except Exception:
            return False
        self.step = int(state["step"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch"])
        return True


def identity(target) -> dict:
    c = target.model.config
    return {"name": target.name, "fingerprint": fingerprint(target.model), "model_type": c.model_type,
            "num_hidden_layers": c.num_hidden_layers, "hidden_size": c.hidden_size, "vocab_size": c.vocab_size}


def save_head(trainer: Trainer, out: Path, meta: dict) -> Path:
    """`out`.safetensors (bf16 weights, the vocabulary as int64) and `out`.json."""
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in trainer.head.state_dict().items()}
    path = out.with_suffix(".safetensors")
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    write_atomic(out.with_suffix(".json"), json.dumps(meta, indent=2) + "\n")
    return path


def epoch_order(order: random.Random, lengths: list[int], per_step: int) -> list[int]:
    """A random order of the sequences, read from the end `per_step` at a time, in which a step's sequences have
    similar lengths: sorted within windows of 16 steps, the steps then shuffled. A step pads its sequences to the
    longest (Trainer.batch_loss); in random order 28% of its rows were padding, in this order 7% (a 20-minute
    run's data)."""
    picks = order.sample(range(len(lengths)), len(lengths))
    window = 16 * per_step
    steps = []
    for i in range(0, len(picks), window):
        part = sorted(picks[i : i + window], key=lambda j: lengths[j])
        steps += [part[k : k + per_step] for k in range(0, len(part), per_step)]
    order.shuffle(steps)
    steps.sort(key=lambda step: len(step) == per_step)  # a short last step goes first: read last, it keeps the rest aligned
    return [j for step in steps for j in step]


def training_seconds(recipe: Recipe, data_s: float) -> float:
    """What the budget leaves for training after `data_s` seconds of data, and never less than the training's
    share: data an earlier run with more minutes made is not charged to this one."""
    budget = recipe.minutes * 60
    return max(budget - data_s, budget * (1 - recipe.data_share))


def train_head(target, recipe: Recipe, out: Path, work: Path, progress: Callable[[str, float], None]) -> dict:
    """The whole run: data, vocabulary, training, evaluation, files. Returns the JSON written beside the weights."""
    model = target.model
    why = unsupported(model)
    if why is not None:
        raise TrainError(f"train-head needs the lean runner: {why}")
    vocab_size = model.get_output_embeddings().weight.shape[0]
    if not 1 <= recipe.vocab <= vocab_size:
        raise TrainError(f"--vocab must be in 1..{vocab_size} for this target, got {recipe.vocab}")
    work.mkdir(parents=True, exist_ok=True)
    for stale in ("data.safetensors", "text.safetensors"):  # data as specchat kept it before shards: never read now
        (work / stale).unlink(missing_ok=True)
    bfloat16 = use_bfloat16(model, recipe)
    source = functools.cache(lambda: data_model(model, bfloat16))
    data_budget = recipe.minutes * 60 * recipe.data_share
    progress("generating the target's replies", 0.0)
    data = collect(target, source, recipe, data_budget * (1 - recipe.text_share), work, progress)
    replies = data.tokens
    if recipe.text_share > 0:
        progress("reading teacher-forced text", 0.0)
        text = collect_text(target, source, recipe, data_budget * recipe.text_share, work, progress)
    else:
        text = Data()
    source.cache_clear()
    data.extend(text)
    data_s, began = data.seconds, time.monotonic()  # began: the training's share of the budget starts here
    train, held_out = data.split(HELD_OUT)
    special = set(getattr(target.tokenizer, "all_special_ids", [])) | set(target.eos_ids)
    vocab = choose_vocab(train, recipe.vocab, vocab_size, special)
    rms = float(torch.cat(train.features).pow(2).mean().sqrt())
    trainer = Trainer(target, recipe, vocab, rms, bfloat16)
    ckpt = work / f"checkpoint-seed{recipe.seed}-n{recipe.vocab}.pt"
    resumed = trainer.resume(ckpt)
    order = random.Random(recipe.seed)
    pool: list[int] = []

    def next_batch() -> list[tuple[list[int], torch.Tensor]]:
        picks = []
        for _ in range(recipe.seqs_per_step):
            if not pool:
                pool.extend(epoch_order(order, [len(seq) for seq in train.sequences], recipe.seqs_per_step))
            i = pool.pop()
            picks.append((train.sequences[i], train.features[i]))
        return picks

    for _ in range(trainer.step):  # a resumed run replays the batch order, not the work
        next_batch()
    steps = recipe.steps
    train_began, last_ckpt, losses = time.monotonic(), time.monotonic(), []
    if steps is None:  # measure steps after a warm-up, then fix the count that fits the budget
        for probe in range(20):  # the first steps build a matmul kernel per row count (ROWS_BUCKET): timed from step 10
            if probe == 10:
                probe_began = time.monotonic()
            losses.append(trainer.train_step(next_batch(), 1000))
        per_step = (time.monotonic() - probe_began) / 10
        left = training_seconds(recipe, data_s) - (time.monotonic() - began)
        steps = trainer.step + max(1, int(left / per_step * 0.9))
        progress(f"training {steps} steps (~{per_step:.2f} s each; repeat with --steps {steps})", 0.0)
    while trainer.step < steps:
        losses.append(trainer.train_step(next_batch(), steps))
        if time.monotonic() - last_ckpt > 60:
            trainer.checkpoint(ckpt)
            last_ckpt = time.monotonic()
        if trainer.step % 10 == 0 or trainer.step == steps:
            recent = sum(losses[-10:]) / len(losses[-10:])
            progress(f"step {trainer.step}/{steps}, loss {recent:.4f}", trainer.step / steps)
    train_s = time.monotonic() - train_began
    quality = trainer.evaluate(held_out, trainer.runner.head_w.detach().float())
    meta = {
        "format": FORMAT,
        "target": identity(target),
        "spec": trainer.head.spec,
        "vocab_size": len(vocab),
        "recipe": {**asdict(recipe), "steps": steps},
        "data": {"sequences": len(data.sequences), "tokens": data.tokens, "reply_tokens": replies, "text_tokens": text.tokens, "held_out_sequences": len(held_out.sequences) if held_out is not data else 0},
        "results": {**quality, "loss_first": losses[0] if losses else None, "loss_last": sum(losses[-10:]) / max(1, len(losses[-10:])),
                    "data_s": round(data_s, 1), "train_s": round(train_s, 1), "resumed": resumed, "bfloat16": bfloat16},
    }
    path = save_head(trainer, out, meta)
    ckpt.unlink(missing_ok=True)
    meta["path"] = str(path)
    return meta
