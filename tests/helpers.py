"""Shared by the tests (never import one test module from another): tiny models, the exact-distribution
machinery with its broken-rule control, and a scripted Session for fast UI tests."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specchat.engine.acceptance import ExactRule, Verdict, draft_token_probs, draw_next, first_rejection
from specchat.engine.cache import forward_logits, new_cache
from specchat.engine.drafters import Drafter, ModeUnavailable
from specchat.engine.drafters.head import DraftHead, head_spec
from specchat.engine.drafters.model import ModelDrafter
from specchat.engine.events import RoundRecord, TokenEvent
from specchat.engine.info import EngineInfo
from specchat.engine.llamacpp import target_state
from specchat.engine.loop import Controls, generate
from specchat.engine.runner import lean_runner
from specchat.engine.sampling import SamplingParams
from specchat.engine.sampling import logits_to_probs
from specchat.modes import MODES
from specchat.session import Session
from specchat.verify import TargetConditionals, conditional_tests, sample_continuations

REPO = Path(__file__).resolve().parent.parent


def run_env(**extra) -> dict:
    """The environment for a fresh specchat process: this repository importable, no thread settings inherited."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return {**env, **extra}

# ---------------------------------------------------------------- tiny models

TINY_VOCAB = 12


def tiny_llama(seed: int, layers: int = 1, vocab: int = TINY_VOCAB, sharpen: float = 4.0, **overrides):
    """A randomly initialised Llama small enough for thousands of draws; `sharpen` scales the LM head
    so its distributions are peaked like a real model's (near-uniform ones would hide a bias)."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{
        "vocab_size": vocab, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": layers, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 128, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": None, "tie_word_embeddings": False, **overrides,
    })
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model


HEAD_LEFT_OUT = [2, 7]  # tokens a random head cannot draft (the target can still emit them)


def random_head(target, seed: int = 5, left_out=HEAD_LEFT_OUT, norm_std: float | None = None) -> DraftHead:
    """An untrained head with peaked, arbitrary distributions over all tokens but `left_out`; with `norm_std` its
    1-D parameters (norm weights, biases) are drawn from N(1, norm_std) too, else they keep their initial values."""
    runner = lean_runner(target)
    vocab = [t for t in range(runner.vocab_size) if t not in left_out]
    head = DraftHead(head_spec(runner, target.config), len(vocab))
    head.vocab.copy_(torch.tensor(vocab))
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5)
            elif norm_std is not None:
                p.normal_(1, norm_std)
    return head.requires_grad_(False)


SPECIALS = ["<unk>", "<eos>", "<user>", "<assistant>", "<system>"]
WORDS = (
    "the a an and or of to in on is are was it this that for with as be by at from not you i we they "
    "hello world rain cat dog code python def return print list sort write story short text summary "
    ". , ! ? : ( ) = + - 0 1 2 3"
).split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Whitespace-split words; anything else is <unk>. Decoding joins tokens with spaces."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_model_dir(path: Path, *, seed: int = 0, layers: int = 2, hidden: int = 32, sharpen: float = 4.0) -> Path:
    """Save a randomly initialised tiny Llama and its tokenizer to `path` (created) and return it. `sharpen`
    scales the LM head (larger: more peaked next-token distributions, where a wrong rule shows sooner)."""
    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)  # peaked distributions, like a real model's
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ---------------------------------------------------------------- running the loop, exact distributions

PROMPT = [1, 2, 3]
ALPHA = 1e-3  # with fixed seeds the outcome is deterministic; alpha bounds the chance a correct rule fails


def run(target, drafter, prompt, *, k, params, max_new_tokens, seed=0, rule=None, state=None):
    state = state or target_state(target)
    controls = Controls(drafter, k=k, sampling=params, **({"rule": rule} if rule else {}))
    generator = torch.Generator().manual_seed(seed)
    records = list(generate(state, prompt, controls, max_new_tokens=max_new_tokens, eos_ids=set(), generator=generator))
    return [t.id for r in records for t in r.tokens], records


class ResampleFromP(ExactRule):
    """Deliberately broken: the right acceptance test, but a rejection resamples from p, not the residual."""

    exact = False

    def __call__(self, draft_ids, q, p, generator, greedy) -> Verdict:
        px, qx = draft_token_probs(draft_ids, q, p)
        accept_probs = (px / qx).clamp(max=1.0)
        n = first_rejection(torch.rand(accept_probs.shape, generator=generator) < accept_probs)
        return Verdict(n, draw_next(n, q, p, generator, greedy, residual=False), accept_probs)


class ResampleFromPFrom(ExactRule):
    """Deliberately broken from draft position `position` on: a rejection there resamples from p instead of p
    with the rejected draft removed (earlier positions are right). Invisible unless position `position` is drafted."""

    exact = False

    def __init__(self, position: int) -> None:
        self.position = position

    def __call__(self, draft_ids, q, p, generator, greedy) -> Verdict:
        px, qx = draft_token_probs(draft_ids, q, p)
        accept_probs = (px / qx).clamp(max=1.0)
        n = first_rejection(torch.rand(accept_probs.shape, generator=generator) < accept_probs)
        return Verdict(n, draw_next(n, q, p, generator, greedy, residual=n + 1 < self.position), accept_probs)


def exact_joint(target, prompt, params, length):
    """Enumerate the target's exact distribution over its first `length` tokens: {tuple: prob}."""
    dist = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for prefix, mass in dist.items():
            logits = forward_logits(target, new_cache(target), prompt + list(prefix), keep=1)[-1]
            for tok, p in enumerate(logits_to_probs(logits, params).tolist()):
                if p > 0:
                    nxt[prefix + (tok,)] = mass * p
        dist = nxt
    return dist


def sample_joint(target, drafter, params, *, k, draws, length, rule=None, seed=0, generated=None, stats=None, adaptive=None,
                 prompt=PROMPT):
    """`draws` independent generations of `generated` tokens (default `length`) from `prompt` (the prefix cache is
    reused); the counts of their first `length` tokens. `stats` (a Stats) collects every round.

    The loop never drafts past the token budget, so a draw of `length` tokens drafts at most length-1: a test
    of draft position K needs `generated` >= K+1 (then the first round drafts all K)."""
    controls = Controls(drafter, k=k, sampling=params, **({"rule": rule} if rule else {}), adaptive=adaptive)
    generator = torch.Generator().manual_seed(seed)
    drawn = sample_continuations(target_state(target), prompt, controls, draws=draws, length=max(length, generated or 0),
                                 eos_ids=set(), generator=generator, stats=stats)
    counts = Counter()
    for seq, count in drawn.items():
        counts[seq[:length]] += count
    return counts


@dataclass
class PositionFit:
    """The first `depth` tokens of the draws against the target's exact conditionals (specchat.verify's test,
    position by position): per position the chi-square over every prefix and the likelihood score test,
    combined as verify combines them; `p_value` is the smallest of them times the number of positions
    (Bonferroni: the level stays alpha, and a bug at one position is not diluted by the others)."""

    positions: list[dict]
    p_value: float

    def passed(self, alpha: float) -> bool:
        return self.p_value >= alpha

    @property
    def per_position(self) -> list[float]:
        return [p["combined_p"] for p in self.positions]

    @property
    def worst_position(self) -> int:
        return min(self.positions, key=lambda p: p["combined_p"])["position"]

    def __repr__(self) -> str:
        return f"PositionFit(p={self.p_value:.3g}, per position {[f'{p:.3g}' for p in self.per_position]})"


def fit_to_target(target, counts: Counter, params, depth: int, prompt=PROMPT) -> PositionFit:
    positions, _, _ = conditional_tests(counts, TargetConditionals(target, prompt, params), depth)
    return PositionFit(positions, min(1.0, depth * min(p["combined_p"] for p in positions)))


def sample_and_fit(target, drafter, params, *, k, draws, rule=None, seed=0, adaptive=None, depth=None, prompt=PROMPT):
    """Draws from `prompt` that generate K+1 tokens (more with `depth`), their first `depth` (default K+1) tokens
    tested with `fit_to_target`; also the Stats of every round, to check which draft positions were really used."""
    from specchat.engine.metrics import Stats

    depth = depth or k + 1
    stats = Stats()
    counts = sample_joint(target, drafter, params, k=k, draws=draws, length=depth, generated=k + 1, rule=rule, seed=seed,
                          stats=stats, adaptive=adaptive, prompt=prompt)
    return fit_to_target(target, counts, params, depth, prompt), stats


def assert_drafted_up_to(stats, k: int) -> None:
    """Every draft position 1..K was proposed in some round, and none beyond K."""
    per_pos = stats.num_draft_tokens_per_pos
    assert len(per_pos) == k and min(per_pos) > 0, f"draft positions used: {per_pos}, wanted 1..{k}"


SAMPLING_CASES = {
    "t1": SamplingParams(1.0),
    "t0.7-topk5": SamplingParams(0.7, top_k=5),
    "topp0.8": SamplingParams(1.0, top_p=0.8),
}


def chat_ids(loaded, text):
    return loaded.chat_ids([{"role": "user", "content": text}])


SMOL_PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a list."]


# ---------------------------------------------------------------- a scripted Session for UI tests

VOCAB = ["", " The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".", " It",
         " was", " a", " sunny", " day", " and", " everyone", " smiled", "\n", " Then", " rain", " came", "!",
         " maybe", " perhaps", " cat", " slow"]
EOS = 0
REPLY = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 19, 11, 12, 13, 14, 15, 16, 17, 18, 10, 20, 21, 22, 23]
WRONG = [24, 25, 26, 27]  # what the fake draft proposes where the target disagrees
ACCEPT_PATTERN = [4, 2, 0, 3, 1, 4]  # drafts accepted per round, cycling (clipped to K)


class FakeDrafter(Drafter):
    def __init__(self, name: str) -> None:
        self.name = name

    def propose(self, *args):  # never called: FakeSession scripts whole rounds
        raise AssertionError("FakeSession does not run the loop")


class FakeSession(Session):
    """Subclasses the real Session and replaces only what needs a model (the chat template, the tokenizer
    and the engine's rounds), so turns, per-mode statistics, snapshots and the lock are the real code."""

    def __init__(self, *, mode="lookup", k=4, available=("off", "lookup"), draft_name=None, context_len=4096,
                 reply=REPLY, gated=False, delay=0.0, fail_at=None, slow_modes=()) -> None:
        self.target = SimpleNamespace(name="fake-target", model=None, tokenizer=None)
        self.draft = SimpleNamespace(name=draft_name, model=None) if draft_name else None
        self.available = set(available) | ({"draft"} if draft_name else set())
        self.mode_options = {}
        self.seed, self.max_new_tokens = 0, 64
        self.state = SimpleNamespace(context_len=context_len)
        self._drafters = {}
        self.slow_modes, self.build_gate = set(slow_modes), threading.Event()  # slow drafters wait for build_gate
        self.controls = Controls(self.drafter(mode), k=k, sampling=SamplingParams(temperature=0.0))
        self.messages, self.turns, self.stats, self.plain_for = [], [], {}, {}
        self.notices, self.warnings, self.modes = [], [], MODES
        self._history = None
        self.lock = threading.RLock()
        self.eos_ids = {EOS}
        self.info = EngineInfo("torch", "hf", "torch", "cpu", "float32")
        self.script = list(reply)
        self.gate = threading.Semaphore(0) if gated else None
        self.delay, self.fail_at = delay, fail_at
        self.rounds_made = 0

    def drafter(self, mode):
        if mode not in self.available:
            raise ModeUnavailable(f"mode {mode!r} is not available yet")
        if mode in self.slow_modes and mode not in self._drafters:
            assert self.build_gate.wait(timeout=10), "the test never let the slow drafter finish"
        return self._drafters.setdefault(mode, FakeDrafter(mode))

    def chat_prompt(self, messages):
        return [1] * sum(3 + len(m["content"].split()) for m in messages)

    def _continue_conversation(self, messages):
        return None  # no tokenizer: always the plain chat_prompt

    def token_text(self, token_id):
        return VOCAB[token_id]

    def release(self, rounds=1):
        """Let `rounds` more rounds run (gated sessions only)."""
        for _ in range(rounds):
            self.gate.release()

    def _wait_for_gate(self) -> bool:
        from textual.worker import get_current_worker

        while not self.gate.acquire(timeout=0.02):
            try:
                if get_current_worker().is_cancelled:
                    return False
            except Exception:
                pass
        return True

    def _rounds(self, prompt):
        script, done, index = self.script, 0, 0
        while done < len(script):
            if self.gate is not None and not self._wait_for_gate():
                return
            if self.delay:
                time.sleep(self.delay)
            if self.fail_at is not None and index == self.fail_at:
                raise RuntimeError("scripted failure")
            mode = self.controls.mode
            k = 0 if mode == "off" else min(self.controls.k, len(script) - done - 1)
            n = min(ACCEPT_PATTERN[index % len(ACCEPT_PATTERN)], k)
            ids = script[done : done + n + 1]
            rejected = WRONG[: k - n] if n < k else []
            tokens = []
            for i, tok in enumerate(ids):
                kind = "target" if k == 0 else "accepted" if i < n else ("resampled" if n < k else "bonus")
                drafted = k > 0 and i < k
                tokens.append(TokenEvent(
                    id=tok, text=VOCAB[tok], kind=kind, round=index, position=i + 1,
                    p=0.9 if kind == "accepted" else 0.6, q=0.8 if drafted else None,
                    accept_prob=1.0 if kind == "accepted" else None,
                    top_p=((tok, 0.6), (WRONG[0], 0.3)), top_q=((WRONG[0], 0.5), (tok, 0.4)) if drafted else (),
                ))
            done += len(ids)
            draft_s, verify_s = 0.002 * k, 0.030 + 0.002 * k
            record = RoundRecord(
                index=index, mode=mode, draft_len=k, drafted=k, accepted=n, draft_calls=1 if k else 0,
                draft_s=draft_s, verify_s=verify_s, wall_s=draft_s + verify_s + 0.001,
                prefill_s=0.05 if index == 0 else 0.0, tokens=tokens, rejected=list(rejected),
                stop_reason="eos" if done >= len(script) else None,
            )
            index += 1
            self.rounds_made += 1
            yield record


# ---------------------------------------------------------------- broken rules that claim to be exact (verify's power)


class ResampleFromPClaimingExact(ResampleFromP):
    """ResampleFromP marked exact, as a silent bug would be: `verify` must say FAIL, not "approximate"."""

    exact = True


class BonusFromPreviousPosition(ExactRule):
    """Deliberately broken: after a fully accepted block the bonus is drawn from p[K-1] instead of p[K]."""

    def __call__(self, draft_ids, q, p, generator, greedy) -> Verdict:
        px, qx = draft_token_probs(draft_ids, q, p)
        accept_probs = (px / qx).clamp(max=1.0)
        n = first_rejection(torch.rand(accept_probs.shape, generator=generator) < accept_probs)
        k = draft_ids.numel()
        if n == k and k > 0:
            return Verdict(n, draw_next(n - 1, q, p, generator, greedy, residual=False), accept_probs)  # p[K-1]
        return Verdict(n, draw_next(n, q, p, generator, greedy), accept_probs)


class QWithoutTopK(ModelDrafter):
    """Deliberately broken drafter: it samples its drafts with the session's top-k but reports the q computed
    without top-k (reverse=True: samples without top-k, reports the top-k-filtered q)."""

    name = "draft"

    def __init__(self, model, reverse: bool = False) -> None:
        super().__init__(model)
        self.reverse = reverse
        self.logits: list[torch.Tensor] = []

    def next_logits(self, feed, vocab_size):
        logits = super().next_logits(feed, vocab_size)
        self.logits.append(logits)
        return logits

    def propose(self, state, k, params, generator):
        no_top_k = SamplingParams(params.temperature, 0, params.top_p)
        drawn_with, reported = (no_top_k, params) if self.reverse else (params, no_top_k)
        self.logits = []
        proposal = super().propose(state, k, drawn_with, generator)
        if proposal.q is not None:
            proposal.q = logits_to_probs(torch.stack(self.logits[: proposal.ids.numel()]), reported)
        return proposal


class TableLM(torch.nn.Module):
    """A bigram language model that ModelDrafter can run: the next-token logits depend only on the last token
    (a [V, V] table) and it keeps no KV cache. A draft costs a table look-up instead of a transformer forward,
    so a test can afford thousands of draws per run."""

    def __init__(self, table: torch.Tensor, config) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table.float(), requires_grad=False)  # [V, V]
        self.config = config  # the target's: new_cache() builds an (unused) cache from it
        self.embed = torch.nn.Embedding(table.shape[0], 1)  # ModelDrafter reads only num_embeddings

    @property
    def device(self) -> torch.device:
        return self.table.device

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, logits_to_keep: int = 1, **kwargs):
        return SimpleNamespace(logits=self.table[input_ids[:, -logits_to_keep:]])  # [1, keep, V]


def bigram_draft(target, scale: float = 0.5) -> TableLM:
    """A draft that agrees with `target` only roughly: the target's logits after each single token (the rest
    of the context ignored), times `scale` (< 1: a less confident draft, as small drafts are)."""
    vocab = target.config.vocab_size
    table = torch.stack([forward_logits(target, new_cache(target), [t], keep=1)[-1] for t in range(vocab)])  # [V, V]
    return TableLM(table * scale, target.config)


class WrongTemperatureFrom(ModelDrafter):
    """Deliberately broken drafter, the bug the independent check used: from draft position `position` on it
    samples its drafts at temperature T * `factor` but reports q at the session's T (positions before are
    right). A test that only ever drafts K < `position` cannot see it."""

    def __init__(self, model, position: int = 3, factor: float = 0.5) -> None:
        super().__init__(model)
        self.position, self.factor = position, factor
        self.true_logits: list[torch.Tensor] = []

    def next_logits(self, feed, vocab_size):
        logits = super().next_logits(feed, vocab_size)  # one call per draft position, in order
        self.true_logits.append(logits)
        return logits / self.factor if len(self.true_logits) >= self.position else logits

    def propose(self, state, k, params, generator):
        self.true_logits = []
        proposal = super().propose(state, k, params, generator)
        n = proposal.ids.numel()
        if proposal.q is not None and n >= self.position:
            reported = logits_to_probs(torch.stack(self.true_logits[self.position - 1 : n]), params)
            proposal.q = torch.cat([proposal.q[: self.position - 1], reported.to(proposal.q.device)])
        return proposal


class ReportsWrongQ(Drafter):
    """Deliberately broken wrapper around any drafter with a q: the drafts are sampled from the right q, but from
    draft position `position` on the q it reports is that q at another temperature (q ** (1 / factor),
    renormalised; the zeros of top-k / top-p stay zeros). For drafts that nearly always agree with the target
    (quant) resampling from p instead of the residual hardly shows, a wrong q does."""

    def __init__(self, inner: Drafter, position: int = 3, factor: float = 2.0) -> None:
        self.inner, self.position, self.factor = inner, position, factor
        self.name = inner.name

    def propose(self, state, k, params, generator):
        self.inner.p_min = self.p_min
        proposal = self.inner.propose(state, k, params, generator)
        if proposal.q is not None and proposal.ids.numel() >= self.position:
            q = proposal.q.clone()
            wrong = q[self.position - 1 :] ** (1.0 / self.factor)
            q[self.position - 1 :] = wrong / wrong.sum(-1, keepdim=True)
            proposal.q = q
        return proposal

    def verify(self, state, draft_ids):
        return self.inner.verify(state, draft_ids)

    def reset(self) -> None:
        self.inner.reset()


# ---------------------------------------------------------------- one mode's distribution test and its controls

CONTROLS = {  # name: (wrap the drafter, make the rule): deliberately broken variants that must fail
    "resample from p": (lambda d: d, ResampleFromP),
    "q at the wrong temperature from position 3": (lambda d: ReportsWrongQ(d, position=3, factor=0.25), lambda: None),
}


def check_mode_distribution(target, drafter, case: str, bug: str | None, *, draws: int, record_property=None) -> None:
    """K=3 with draws of K+1 tokens, position by position against the exact conditionals: the exact drafter passes;
    with `bug` (a CONTROLS name) the same settings must fail, a wrong q from position 3 exactly there."""
    rule = None
    if bug:
        wrap, make_rule = CONTROLS[bug]
        drafter, rule = wrap(drafter), make_rule()
    fit, stats = sample_and_fit(target, drafter, SAMPLING_CASES[case], k=3, draws=draws, rule=rule)
    assert_verdict(fit, stats, 3, bug, record_property)


def assert_verdict(fit, stats, k: int, bug: str | None, record_property=None) -> None:
    """A distribution test's verdict: draft positions 1..K were all used; the exact drafter passes; with `bug`
    (a control) the same settings fail by far, a q wrong from position 3 exactly there."""
    if record_property is not None:
        record_property("p_value", fit.p_value)
    assert_drafted_up_to(stats, k)
    if bug is None:
        assert fit.passed(ALPHA), fit
    else:
        assert fit.p_value < 1e-6, fit
        if bug.startswith("q at the wrong temperature"):  # the bug is where it is: drafts 1 and 2 are right
            assert fit.worst_position == 3 and min(fit.per_position[:2]) > ALPHA, fit


# ---------------------------------------------------------------- tiny GGUF models (the llama.cpp engine)


def _hf_rope_to_gguf(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF stores Llama's q/k rows for rotate-half RoPE; GGUF's llama architecture wants them interleaved
    (llama.cpp's convert_hf_to_gguf.py permutes them the same way)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: Path, *, eos_id: int | None = None, readable: bool = False, matrices: str = "F32") -> Path:
    """Write a transformers Llama (tiny_llama) as a float32 GGUF file llama.cpp loads, with a vocabulary of one
    placeholder string per id (the tests feed ids, never text). llama.cpp's logits for it match the torch model's.
    `readable`: a vocabulary transformers' GGUF reader also takes (letters and one merge of two of them), so the
    file converts for torch (models.convert_gguf) in a fraction of a second. `matrices`: the layers' matrices and
    the LM head quantised by the gguf package to that type (Q4_0, Q5_0, Q8_0...; rows of whole blocks)."""
    import gguf

    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"] if getattr(c, "rope_parameters", None) else c.rope_theta)
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    letters = [chr(ord("a") + i) for i in range(c.vocab_size - 1)] + ["ab"]
    writer.add_token_list(letters if readable else [f"t{i}" for i in range(c.vocab_size)])
    writer.add_token_types([gguf.TokenType.NORMAL] * c.vocab_size)
    writer.add_token_merges(["a b"] if readable else ["t1 t2"])  # llama.cpp requires the key; the tests never tokenise text
    if eos_id is not None:
        writer.add_eos_token_id(eos_id)
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])

    def add_matrix(name: str, w) -> None:
        if matrices == "F32" or w.ndim != 2:
            return writer.add_tensor(name, w)
        kind = gguf.GGMLQuantizationType[matrices]
        writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)

    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        q = _hf_rope_to_gguf(torch.from_numpy(sd[p + "self_attn.q_proj.weight"]), c.num_attention_heads).numpy()
        k = _hf_rope_to_gguf(torch.from_numpy(sd[p + "self_attn.k_proj.weight"]), c.num_key_value_heads).numpy()
        for name, w in (("attn_norm", sd[p + "input_layernorm.weight"]), ("attn_q", q), ("attn_k", k),
                        ("attn_v", sd[p + "self_attn.v_proj.weight"]), ("attn_output", sd[p + "self_attn.o_proj.weight"]),
                        ("ffn_norm", sd[p + "post_attention_layernorm.weight"]), ("ffn_gate", sd[p + "mlp.gate_proj.weight"]),
                        ("ffn_up", sd[p + "mlp.up_proj.weight"]), ("ffn_down", sd[p + "mlp.down_proj.weight"])):
            add_matrix(f"blk.{i}.{name}.weight", w)
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    add_matrix("output.weight", sd["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_greedy_rounds(records) -> None:
    """Each greedy round as its tokens tell it: the accepted drafts first (accepted with probability 1: p and q are
    one-hot at the same token), then the target's own token, a bonus only after all drafts were accepted; the
    first rejected draft is not the token the target put in its place (greedy rejects only a non-argmax draft)."""
    for r in records:
        kinds, n = [t.kind for t in r.tokens], r.accepted
        if r.drafted == 0:
            assert kinds == ["target"] * len(kinds) and len(kinds) == 1, (r.index, kinds)
            continue
        assert kinds[:n] == ["accepted"] * n and all(t.accept_prob == 1.0 for t in r.tokens[:n]), (r.index, kinds)
        if len(r.tokens) > n:
            assert kinds[n] == ("bonus" if n == r.drafted else "resampled"), (r.index, kinds)
            if r.rejected:
                assert r.rejected[0] != r.tokens[n].id, r.index
