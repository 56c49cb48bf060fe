"""The speculative loop: draft K, verify in one target forward, accept, roll back. Plain decoding is K=0."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from specchat.engine.acceptance import EXACT, AcceptRule, Verdict, draw_next
from specchat.engine.draft_length import MeasuredK
from specchat.engine.drafters.base import Drafter, Proposal
from specchat.engine.events import RoundRecord, TokenEvent
from specchat.engine.sampling import SamplingParams, Tops, logits_to_probs, top_n, tops_of
from specchat.engine.target import Target

TOP_ALTERNATIVES = 5
UNWARPED = SamplingParams(1.0, 0, 1.0)  # p is then the model's own distribution


class AdaptiveK:
    """HF's heuristic draft-length schedule, kept per mode: K += 2 after a fully accepted block, K -= 1
    after a rejection, within [k_min, k_max]. Long blocks where the draft agrees, short where it does not.

    `p_min` > 0 also stops a model draft early when its top probability falls below it (llama.cpp's
    p-min); the loop sets `Drafter.p_min` from it each round (drafters without a model ignore it).
    """

    def __init__(self, start: int = 4, k_min: int = 1, k_max: int = 16, p_min: float = 0.0) -> None:
        self.start, self.k_min, self.k_max, self.p_min = start, k_min, k_max, p_min
        self.ks: dict[str, int] = {}  # mode -> current K

    def k(self, mode: str, _params: SamplingParams | None = None) -> int:  # (one K per mode whatever the setting)
        return self.ks.get(mode, self.start)

    def observe(self, record, _params: SamplingParams | None = None) -> None:
        self.update(record.mode, record.drafted, record.accepted)

    def update(self, mode: str, drafted: int, accepted: int) -> None:
        if drafted:  # a round without drafts (no lookup match, plain mode) says nothing about K
            step = 2 if accepted == drafted else -1
            self.ks[mode] = max(self.k_min, min(self.k_max, self.k(mode) + step))


@dataclass
class Controls:
    """Read at the start of every round, so another thread (the UI) may change them mid-reply."""

    drafter: Drafter
    k: int = 4
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rule: AcceptRule = EXACT
    adaptive: AdaptiveK | MeasuredK | None = None  # when set, it chooses K each round instead of `k`
    # called every round with (emitted ids, p [K+1, V], q [K, V]): verify's draft-direction test reads the full
    # distributions there; None for everyone else (the loop then spends nothing on it)
    on_probs: Callable[[list[int], torch.Tensor, torch.Tensor], None] | None = None
    # called as a long prompt is read, (positions fed, positions to feed): the front ends show the prefill's progress
    on_prefill: Callable[[int, int], None] | None = None

    @property
    def mode(self) -> str:
        return self.drafter.name


def clock(device: torch.device) -> float:
    """Wall time after the device has finished its queued work (CUDA launches are asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def one_hot(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[K] ids -> [K, V] float32: the q of a deterministic drafter."""
    if ids.numel() == 0:  # a plain round (scatter_ costs more than the empty tensor)
        return torch.zeros(0, vocab_size, device=ids.device)
    return torch.zeros(ids.numel(), vocab_size, device=ids.device).scatter_(1, ids[:, None], 1.0)


def top_alternatives(probs: torch.Tensor) -> list[tuple[tuple[int, float], ...]]:
    """[N, V] -> per row, the most likely (id, prob) pairs, for the token inspector."""
    values, ids = top_n(probs, min(TOP_ALTERNATIVES, probs.shape[-1]))
    return [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


def warped_alternatives(p: torch.Tensor, tops: Tops, rows: int) -> list[tuple[tuple[int, float], ...]]:
    """The first `rows` rows of p [>= rows, V]: their most likely (id, prob) pairs, from the top list of the logits p
    was warped from. Temperature, top-k and top-p keep the logits' order, so p's most likely tokens are the logits'
    (those it keeps: a token warping dropped has p = 0 and is left out)."""
    ids = tops.ids[:rows]  # [rows, n]
    values = p[:rows].gather(1, ids)  # [rows, n]
    return [tuple((i, v) for i, v in zip(row_ids, row_values) if v > 0)
            for row_ids, row_values in zip(ids.tolist(), values.tolist())]


def unwarped_alternatives(logits: torch.Tensor, ids: list[int], tops: Tops | None = None) -> tuple[list[float], list[tuple[tuple[int, float], ...]]]:
    """[E, V] logits, E ids -> the model's own probability of each id and its most likely (id, prob) pairs, for the
    inspector: the softmax's normaliser and the top logits (`tops` of at least these rows) give them without writing
    the softmax's rows."""
    if tops is None:
        tops = tops_of(logits, min(TOP_ALTERNATIVES, logits.shape[-1]))
    log_z = tops.log_z[: len(ids)]  # [E]
    at = _at(logits, ids)  # [E]
    probs = [math.exp(x - z) for x, z in zip(at, log_z)]
    alternatives = [
        tuple((i, math.exp(v - z)) for i, v in zip(row_ids, row_values))
        for row_ids, row_values, z in zip(tops.ids[: len(ids)].tolist(), tops.values[: len(ids)].tolist(), log_z)
    ]
    return probs, alternatives


def generate(
    state: Target,
    prompt: list[int],
    controls: Controls,
    *,
    max_new_tokens: int,
    eos_ids: set[int],
    generator: torch.Generator | None = None,
    decode: Callable[[int], str] = lambda _id: "",
) -> Iterator[RoundRecord]:
    """Yield one RoundRecord per target forward until EOS, `max_new_tokens` or the context limit.

    Stop iterating to cancel: the state stays consistent after every round.
    """
    t_prefill = clock(state.device)
    state.start(prompt, controls.on_prefill)
    prefill_s = clock(state.device) - t_prefill
    limit = max_new_tokens
    if state.context_len is not None:
        limit = min(limit, state.context_len - len(prompt))
    produced = 0
    round_index = 0
    # a round's wall time runs from the previous round's end: what the caller does between rounds (the chat
    # posting each one) slows the reply too, and tokens/s must say so
    t_last = time.perf_counter()
    while produced < limit:
        chooser, params, rule, adaptive = controls.drafter, controls.sampling, controls.rule, controls.adaptive
        # mode auto: the mode it picked (a drafting mode priced by K measured where K is); the chat's baseline: a plain round
        drafter = chooser.for_round(state, params, adaptive if isinstance(adaptive, MeasuredK) else None)
        want = drafter.draft_len(adaptive.k(drafter.name, params) if adaptive else controls.k)
        drafter.p_min = adaptive.p_min if adaptive else 0.0
        # never draft past the token budget (the last token needs no draft); the budget already keeps the verify
        # inside the context window: state.tokens is the prompt and the `produced` tokens after it
        k = max(min(want, limit - produced - 1), 0)

        t0 = clock(state.device)
        proposal = drafter.propose(state, k, params, generator) if k > 0 else Proposal.empty(state.device)
        t1 = clock(state.device)
        draft_ids = proposal.ids  # [K]
        n_drafted = draft_ids.numel()
        draft_list = draft_ids.tolist()
        logits = drafter.verify(state, draft_list).float()  # [K+1, V]
        # greedy's argmax and the inspector's model's own top list (unwarped p is that distribution itself)
        tops = tops_of(logits, min(TOP_ALTERNATIVES, logits.shape[-1])) if params != UNWARPED else None
        p = logits_to_probs(logits, params, tops)  # [K+1, V]
        q = proposal.q if proposal.q is not None else one_hot(draft_ids, state.vocab_size)  # [K, V]
        if n_drafted:
            verdict = rule(draft_ids, q, p, generator, params.greedy)
        else:  # a plain step under every rule: the token is drawn from p[0] (the same draw the rule would make);
            # greedy's p[0] is the one-hot at the top id it was made from (no pass over the row)
            token = int(tops.ids[0, 0]) if params.greedy and tops is not None else draw_next(0, q, p, generator, params.greedy)
            verdict = Verdict(0, token, p.new_empty(0))
        n = verdict.accepted
        new = [*draft_list[:n], verdict.next_token]

        stop_reason = None
        for i, tok in enumerate(new):
            if tok in eos_ids:
                new, stop_reason = new[: i + 1], "eos"
                break
        # drafts after an accepted EOS are dropped unjudged: they count as neither drafted nor accepted
        judged = len(new) if len(new) <= n else n_drafted
        if produced + len(new) >= limit:
            new = new[: limit - produced]
            stop_reason = stop_reason or ("max_new_tokens" if limit == max_new_tokens else "context")
        state.commit(new)
        t2 = clock(state.device)
        if controls.on_probs is not None:
            controls.on_probs(new, p, q)

        record = RoundRecord(
            index=round_index,
            mode=drafter.name,
            draft_len=k,
            drafted=judged,
            accepted=min(n, len(new)),
            draft_calls=proposal.calls,
            draft_s=t1 - t0,
            verify_s=t2 - t1,
            rejected=draft_list[n:],
            exact=rule.exact,
            stop_reason=stop_reason,
            prefill_s=prefill_s if round_index == 0 else 0.0,
            expected_tokens=1.0 + float(torch.cumprod(verdict.accept_probs[:judged].float(), 0).sum()) if judged else 1.0,
        )
        raw = None if params == UNWARPED else (logits, tops)  # the inspector's model's own distribution
        record.tokens = _token_events(new, n, p, q, raw, verdict.accept_probs, round_index, decode, params.greedy,
                                      draft_list if proposal.q is None else None)
        now = time.perf_counter()
        record.wall_s, t_last = now - t_last, now
        chooser.observe(record)
        if adaptive:
            adaptive.observe(record, params)
        produced += len(new)
        round_index += 1
        yield record
        if stop_reason is not None:
            return


def _at(x: torch.Tensor, ids: list[int]) -> list[float]:
    """[N, V] -> x[i, ids[i]] for each i < len(ids): element by element through numpy on the CPU, where torch's
    indexing (and numpy's fancy indexing) costs several times more and a round gathers three times."""
    if not ids:  # a plain round's q
        return []
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not x.requires_grad:
        rows = x.numpy()
        return [float(rows[i, t]) for i, t in enumerate(ids)]
    return x[torch.arange(len(ids), device=x.device), torch.tensor(ids, device=x.device)].tolist()


def _token_events(new, n, p, q, raw, accept_probs, round_index, decode, greedy, one_hot_q=None) -> list[TokenEvent]:
    """Label the round's tokens: drafts 1..n accepted, then a replacement (resampled) or a bonus. `one_hot_q`: the
    drafts, where q is one-hot at each (a deterministic drafter's)."""
    k = q.shape[0]
    p_x = _at(p, new)
    drafted = min(len(new), k)  # emitted positions that had a draft
    q_x = _at(q, new[:drafted])
    # a one-hot row's alternatives are its one token: no top-n over the vocabulary (each a pass over caches the
    # forward has just swept)
    if greedy:
        top_p = [((tok, 1.0),) for tok in new]
    elif raw is not None:
        top_p = warped_alternatives(p, raw[1], len(new))
    else:
        top_p = top_alternatives(p[: len(new)])
    if one_hot_q is not None:
        top_q = [((tok, 1.0),) for tok in one_hot_q[:drafted]]
    else:
        top_q = top_alternatives(q[:drafted]) if drafted else []
    # raw: the model's own logits [>= E, V] and their Tops, or None when p is them unwarped
    raw_x, top_raw = (p_x, top_p) if raw is None else unwarped_alternatives(raw[0], new, raw[1])
    acc = accept_probs.tolist()
    events = []
    for i, tok in enumerate(new):
        if k == 0:
            kind = "target"
        elif i < n:
            kind = "accepted"
        else:
            kind = "resampled" if n < k else "bonus"
        events.append(
            TokenEvent(
                id=tok,
                text=decode(tok),
                kind=kind,
                round=round_index,
                position=i + 1,
                p=p_x[i],
                q=q_x[i] if i < drafted else None,
                accept_prob=acc[i] if kind == "accepted" else None,
                top_p=top_p[i],
                top_q=top_q[i] if i < drafted else (),
                p_raw=raw_x[i],
                top_raw=top_raw[i],
            )
        )
    return events
