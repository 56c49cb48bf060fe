"""Training a draft head (engine/drafters/head.py) for a target on this machine, by self-distillation.

1. Data: the target's own replies to a prompt set (train/prompts.txt, never the bench's or the tests'
   prompts; or the user's JSONL): a greedy pass over every prompt, then sampled passes at temperature 0.8 for
   diversity, 128 prompts at a time through HF `generate`, whose final-norm input a hook records: the
   target's features f_t for every position at no extra forward. Lines with "text" instead of "prompt" are
   taken as they are (teacher-forced, one lean forward each), and so are the Python standard library's
   docstrings, read for the rest of the data time (`text_share` of it; they are on every machine).
2. Vocabulary (FR-Spec): the N tokens the data predicts most often, the tokenizer's special tokens, and, if
   the data holds fewer than N distinct tokens, the lowest remaining ids (BPE ids rise with merge order,
   i.e. roughly fall in frequency).
3. Training (EAGLE): teacher-forced over whole sequences, the head reads (f_t + noise, e(x_{t+1})) and predicts
   f_{t+1}; loss = smooth-L1 of (prediction - f_{t+1}) in units of the features' RMS + cross-entropy between the
   target's next-token distribution and the head's, both over the N tokens (LM head rows of the N tokens after
   the final norm). EAGLE weighs raw features 1 and the cross-entropy 0.1; on SmolLM2 (feature RMS ~36, single
   values up to ~4400, so the raw regression swamps the rest) this scaling raised held-out greedy agreement
   after 150 steps from 0.28 to 0.32. AdamW with warm-up and cosine decay over a fixed number of steps.
4. Evaluation on the held-out prompts' replies (teacher-forced, first draft only): the expected acceptance at
   temperature 1 (sum min(p, q) with the full target p) and greedy agreement. Acceptance in the loop, at every
   draft position, is what `specchat bench --modes off,head` measures.

Deterministic for a seed and a step count; `minutes` picks the step count from the measured speed of the first
steps and prints it, so a run can be repeated with `steps`. Everything lands in a work folder first (data, a
checkpoint every minute): an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import ast
import json
import math
import random
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specchat.engine.drafters.head import FORMAT, DraftHead, fingerprint, head_spec
from specchat.engine.runner import lean_runner, rms_norm, unsupported
from specchat.store import atomic_path, write_atomic

PROMPTS = Path(__file__).with_name("prompts.txt")
HELD_OUT = 0.05  # share of prompts (with all their replies) kept for evaluation
SAMPLED = 2  # sampled replies per prompt, after the greedy one


class TrainError(ValueError):
    """Bad input to train-head (one line for the user)."""


@dataclass
class Recipe:
    minutes: float = 15.0  # the whole run: data (data_share of it) and training
    steps: int | None = None  # optimizer steps; None: chosen from `minutes` and the measured step speed
    vocab: int = 8192  # N: the head drafts among this many tokens
    seed: int = 0
    data_share: float = 0.5
    text_share: float = 0.4  # of the data time: teacher-forced text (the Python standard library's docstrings)
    max_new_tokens: int = 160
    batch: int = 128  # replies generated together (CPU, SmolLM2: 32 -> 128 rows raised generate's tokens/s ~2.4x)
    temperature: float = 0.8  # for the sampled half of the replies
    seqs_per_step: int = 4  # sequences per optimizer step (gradient accumulation)
    max_len: int = 384
    lr: float = 1e-3
    cls_weight: float = 1.0
    noise: float = 0.05  # feature noise, relative to the features' RMS (EAGLE's robustness to its own errors)
    data_file: str | None = None

    def text_key(self) -> dict:
        return {"v": 1, "source": "stdlib docstrings", "max_len": self.max_len, "seed": self.seed}

    def data_key(self) -> dict:
        return {"v": 2, **{k: getattr(self, k) for k in ("seed", "max_new_tokens", "batch", "temperature", "max_len", "data_file")}}


@dataclass
class Data:
    sequences: list[list[int]] = field(default_factory=list)
    features: list[torch.Tensor] = field(default_factory=list)  # per sequence [S, D], the target's last-layer output
    groups: list[int] = field(default_factory=list)  # per sequence: the prompt it answers

    def extend(self, other: "Data") -> None:
        for seq, feats, group in zip(other.sequences, other.features, other.groups):
            self.add(seq, feats, group)

    def add(self, tokens: list[int], features: torch.Tensor, group: int) -> None:
        self.sequences.append(tokens)
        self.features.append(features)
        self.groups.append(group)

    def split(self, share: float) -> tuple["Data", "Data"]:
        """(train, held out): about `share` of the prompts, with every reply to them, are held out."""
        groups = sorted({g for g in self.groups if g >= 0})  # prompts; teacher-forced text (groups < 0) always trains
        held = set(groups[: max(1, round(len(groups) * share))]) if len(groups) > 1 else set()
        parts = Data(), Data()
        for s, f, g in zip(self.sequences, self.features, self.groups):
            parts[g in held].add(s, f, g)
        return parts if parts[1].sequences else (self, self)

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    def save(self, path: Path, key: dict) -> None:
        tensors = {f"f{i}": f.contiguous() for i, f in enumerate(self.features)}
        tensors |= {f"t{i}": torch.tensor(s, dtype=torch.int32) for i, s in enumerate(self.sequences)}
        tensors["groups"] = torch.tensor(self.groups, dtype=torch.int64)
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={"key": json.dumps(key, sort_keys=True)})

    @staticmethod
    def load(path: Path, key: dict) -> "Data | None":
        if not path.is_file():
            return None
        from safetensors import safe_open

        try:
            with safe_open(str(path), "pt") as f:
                if (f.metadata() or {}).get("key") != json.dumps(key, sort_keys=True):
                    return None
            tensors = load_file(path)
        except Exception:
            return None
        n = sum(k.startswith("t") for k in tensors)  # t0.., f0.. and groups
        return Data([tensors[f"t{i}"].tolist() for i in range(n)], [tensors[f"f{i}"] for i in range(n)], tensors["groups"].tolist())


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


def generate_with_features(model, prompts: list[list[int]], pad: int, eos: set[int], greedy: bool, recipe: Recipe) -> list[tuple[list[int], torch.Tensor]]:
    """One batch of replies through HF `generate` (left-padded), with the target's features captured on the way:
    a hook on the final norm records its input (the last layer's output) in the prefill and in every step.
    Returns (tokens, features [S, D]) per prompt: the prompt, the reply up to its EOS, features for each."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)  # [B, L]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    seen: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_pre_hook(lambda module, args: seen.append(args[0].float()))
    try:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=recipe.max_new_tokens, do_sample=not greedy,
                                 temperature=None if greedy else recipe.temperature, top_p=None, top_k=None, pad_token_id=pad)
    finally:
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


def collect(target, recipe: Recipe, seconds: float, progress: Callable[[str, float], None]) -> Data:
    """The target's replies to the prompts and their features, for `seconds` or until every prompt has had a greedy
    reply and `SAMPLED` sampled ones: first the greedy pass over all prompts, then sampled passes. Each sequence's
    group is its prompt, so held-out prompts stay out of training."""
    model, tokenizer = target.model, target.tokenizer
    runner = lean_runner(model)
    items = read_prompts(recipe.data_file)
    random.Random(recipe.seed).shuffle(items)
    data, start = Data(), time.monotonic()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(target.eos_ids))
    for group, item in enumerate(items):  # teacher-forced text: taken as it is
        if "text" in item and "prompt" not in item:
            ids = target.raw_ids(item["text"])[: recipe.max_len]
            if len(ids) >= 2:
                data.add(ids, target_features(runner, ids), group)
    prompts = [(g, target.chat_ids([{"role": "user", "content": it["prompt"]}])) for g, it in enumerate(items) if "prompt" in it]
    batches = [(n, prompts[i : i + recipe.batch]) for n in range(1 + SAMPLED) for i in range(0, len(prompts), recipe.batch)]
    for b, (n, chunk) in enumerate(batches):
        if time.monotonic() - start > seconds:
            break
        torch.manual_seed(recipe.seed * 100003 + b)
        replies = generate_with_features(model, [p for _, p in chunk], pad, target.eos_ids, n == 0, recipe)
        for (group, _), (tokens, feats) in zip(chunk, replies):
            if len(tokens) >= 2:
                data.add(tokens, feats, group)
        progress(f"data: {len(data.sequences)} sequences, {data.tokens} tokens", min(1.0, (time.monotonic() - start) / seconds))
    if not data.sequences:
        raise TrainError("no training data: the time budget ended before the first batch of replies")
    return data


def stdlib_docstrings(seed: int) -> list[str]:
    """Every docstring of 200+ characters in the Python standard library, in a seeded order: English prose about
    code, on every machine that runs specchat, no download."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:
                    texts.append(doc)
    random.Random(seed).shuffle(texts)
    return texts


def collect_text(target, recipe: Recipe, seconds: float, progress: Callable[[str, float], None]) -> Data:
    """Teacher-forced text for `seconds`: standard-library docstrings packed into max_len-token chunks (separated by
    EOS), one lean forward each for the features. Groups are negative: text is never held out."""
    runner, data, start = lean_runner(target.model), Data(), time.monotonic()
    eos = min(target.eos_ids)
    chunk: list[int] = []
    for text in stdlib_docstrings(recipe.seed):
        if time.monotonic() - start > seconds:
            break
        chunk += target.raw_ids(text) + [eos]
        while len(chunk) >= recipe.max_len:
            ids, chunk = chunk[: recipe.max_len], chunk[recipe.max_len :]
            data.add(ids, target_features(runner, ids), -1 - len(data.sequences))
            if len(data.sequences) % 20 == 0:
                progress(f"text: {len(data.sequences)} chunks, {data.tokens} tokens", min(1.0, (time.monotonic() - start) / seconds))
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


class Trainer:
    """The head, its optimizer and the frozen target parts it trains against."""

    def __init__(self, target, recipe: Recipe, vocab: torch.Tensor, feature_rms: float) -> None:
        model = target.model
        self.runner = lean_runner(model)
        self.recipe = recipe
        torch.manual_seed(recipe.seed)
        self.head = DraftHead(head_spec(self.runner, model.config), len(vocab)).float()
        self.head.vocab.copy_(vocab)
        self.embed_w = self.runner.embed_w.detach().float()
        self.head_w = self.runner.head_w.detach()[vocab].float()  # [N, D]
        self.norm_w, self.norm_eps = self.runner.norm_w.detach().float(), self.runner.norm_eps
        self.opt = torch.optim.AdamW(self.head.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.rms = feature_rms
        self.noise = recipe.noise * feature_rms
        self.step = 0
        self.generator = torch.Generator().manual_seed(recipe.seed)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(features, self.norm_w, self.norm_eps), self.head_w)  # [..., N]

    def rope(self, length: int):
        with torch.no_grad():
            positions = torch.arange(length)[None]
            cos, sin = self.runner.rotary_emb(self.embed_w[:1][None], position_ids=positions)
            half = cos.shape[-1] // 2
            sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        return cos.float()[:, :, None].clone(), sin.float()[:, :, None].clone()  # [1, S, 1, hd]

    def loss(self, seq: list[int], feats: torch.Tensor, noise: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced loss over one sequence: (total, the head's logits [S-1, N])."""
        S = len(seq)
        f_in = feats[:-1][None]  # [1, S-1, D]: f_0..f_{S-2}
        if noise and self.noise > 0:
            f_in = f_in + self.noise * torch.randn(f_in.shape, generator=self.generator)
        emb = F.embedding(torch.tensor([seq[1:]]), self.embed_w)  # [1, S-1, D]: x_1..x_{S-1}
        pred = self.head(f_in, emb, None, 0, *self.rope(S - 1))[0]  # [S-1, D]: predicted f_1..f_{S-1}
        target = feats[1:]
        with torch.no_grad():
            p = torch.softmax(self.logits(target), -1)  # [S-1, N]: the target's next-token distribution over N
        logits = self.logits(pred)
        cls = -(p * torch.log_softmax(logits, -1)).sum(-1).mean()
        reg = F.smooth_l1_loss(pred / self.rms, target / self.rms)
        return reg + self.recipe.cls_weight * cls, logits

    def train_step(self, batch: list[tuple[list[int], torch.Tensor]], total_steps: int) -> float:
        warm = max(1, total_steps // 20)
        frac = self.step / max(total_steps, 1)
        lr = self.recipe.lr * (min(1.0, (self.step + 1) / warm)) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.zero_grad()
        total = 0.0
        for seq, feats in batch:
            loss, _ = self.loss(seq, feats)
            (loss / len(batch)).backward()
            total += float(loss.detach()) / len(batch)
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.opt.step()
        self.step += 1
        return total

    @torch.no_grad()
    def evaluate(self, data: Data, full_head_w: torch.Tensor) -> dict:
        """First-draft quality on held-out sequences: expected acceptance at temperature 1 (sum min(p, q) with the full
        target p), greedy agreement (argmax q = argmax p), and how often the target's argmax is in the vocabulary."""
        accept = agree = in_vocab = n = 0.0
        vocab = self.head.vocab
        for seq, feats in zip(data.sequences, data.features):
            _, logits = self.loss(seq, feats, noise=False)
            q_small = torch.softmax(logits, -1)  # [S-1, N]
            p = torch.softmax(F.linear(rms_norm(feats[1:], self.norm_w, self.norm_eps), full_head_w), -1)  # [S-1, V]
            accept += float(torch.minimum(p[:, vocab], q_small).sum())
            best = p.argmax(-1)
            agree += float((vocab[q_small.argmax(-1)] == best).sum())
            in_vocab += float(torch.isin(best, vocab).sum())
            n += len(seq) - 1
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


def train_head(target, recipe: Recipe, out: Path, work: Path, progress: Callable[[str, float], None]) -> dict:
    """The whole run: data, vocabulary, training, evaluation, files. Returns the JSON written beside the weights."""
    model = target.model
    why = unsupported(model)
    if why is not None:
        raise TrainError(f"train-head needs the lean runner: {why}")
    vocab_size = model.get_output_embeddings().weight.shape[0]
    if not 1 <= recipe.vocab <= vocab_size:
        raise TrainError(f"--vocab must be in 1..{vocab_size} for this target, got {recipe.vocab}")
    budget, began = recipe.minutes * 60, time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    data_path, text_path = work / "data.safetensors", work / "text.safetensors"
    data = Data.load(data_path, recipe.data_key())
    if data is None:
        progress("generating the target's replies", 0.0)
        data = collect(target, recipe, budget * recipe.data_share * (1 - recipe.text_share), progress)
        data.save(data_path, recipe.data_key())
    replies = data.tokens
    text = Data.load(text_path, recipe.text_key()) if recipe.text_share > 0 else Data()
    if text is None:
        progress("reading teacher-forced text", 0.0)
        text = collect_text(target, recipe, max(budget * recipe.data_share - (time.monotonic() - began), 1.0), progress)
        text.save(text_path, recipe.text_key())
    data.extend(text)
    data_s = time.monotonic() - began
    train, held_out = data.split(HELD_OUT)
    special = set(getattr(target.tokenizer, "all_special_ids", [])) | set(target.eos_ids)
    vocab = choose_vocab(train, recipe.vocab, vocab_size, special)
    rms = float(torch.cat(train.features).pow(2).mean().sqrt())
    trainer = Trainer(target, recipe, vocab, rms)
    ckpt = work / f"checkpoint-seed{recipe.seed}-n{recipe.vocab}.pt"
    resumed = trainer.resume(ckpt)
    order = random.Random(recipe.seed)
    pool: list[int] = []

    def next_batch() -> list[tuple[list[int], torch.Tensor]]:
        picks = []
        for _ in range(recipe.seqs_per_step):
            if not pool:
                pool.extend(order.sample(range(len(train.sequences)), len(train.sequences)))
            i = pool.pop()
            picks.append((train.sequences[i], train.features[i]))
        return picks

    for _ in range(trainer.step):  # a resumed run replays the batch order, not the work
        next_batch()
    steps = recipe.steps
    train_began, last_ckpt, losses = time.monotonic(), time.monotonic(), []
    if steps is None:  # measure a few steps, then fix the count that fits the budget
        probe = 5
        for _ in range(probe):
            losses.append(trainer.train_step(next_batch(), 1000))
        per_step = (time.monotonic() - train_began) / probe
        left = budget - (time.monotonic() - began)
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
                    "data_s": round(data_s, 1), "train_s": round(train_s, 1), "resumed": resumed},
    }
    path = save_head(trainer, out, meta)
    ckpt.unlink(missing_ok=True)
    meta["path"] = str(path)
    return meta
