"""What every session shares, local (session.py) or on a serving engine (remote_session.py): the interface the front
ends hold (ChatSession), the conversation, its turns and their statistics, and the snapshot the front ends read. No
torch: a remote session runs without it."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, runtime_checkable

from specchat.engine.draft_length import MeasuredK
from specchat.engine.events import RoundRecord
from specchat.engine.info import EngineInfo
from specchat.engine.metrics import Baseline, SpeedupModel, Stats, speedup_model
from specchat.engine.sampling_params import SamplingParams

RECENT_ROUNDS = 200  # drafting rounds kept in a snapshot for the panel's sparkline
BASELINE_ROUNDS = 16  # the latest plain rounds the baseline is measured from


class PromptTooLong(ValueError):
    pass


@dataclass
class Turn:
    user: str
    prompt_tokens: int
    reply: str = ""
    reply_ids: list[int] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)
    stop_reason: str | None = None  # "eos", "max_new_tokens", "context", or None when stopped early
    sampling: list[SamplingParams] = field(default_factory=list)  # per round: the settings in force when it ended
    k: int | str | None = None  # the K in force when its latest round ended ("auto": measured each round)
    stats: Stats = field(default_factory=Stats)  # this turn's rounds, every mode together


@dataclass(frozen=True)
class Snapshot:
    """A consistent copy of what the front ends show (panel, export, summaries), taken under the session's lock."""

    mode: str
    k: int  # measured: what it chose for the mode running (auto's choice), the start before it has
    sampling: SamplingParams
    rule: str  # "exact" or "approx:<lambda>"
    exact: bool  # the current rule's
    stats: dict[str, Stats]  # per mode, this session
    reply: Stats  # the latest turn
    recent: list[float]  # acceptance (accepted / drafted) of the latest drafting rounds, oldest first
    k_measured: bool = False  # -k auto: K is chosen each round from measured costs
    baseline: Baseline | None = None  # plain decoding as the latest plain rounds measured it
    max_draft: int | None = None  # the current drafter drafts at most this many per round, whatever K (mode head's file)
    draft_len: int | None = None  # it asks for this many where its match allows, K or more (mode suffix)
    choice: str | None = None  # mode auto: the mode of its latest round
    why: str | None = None  # and why (the rates it compared)
    standings: tuple = ()  # mode auto: its arms' rates (drafters.auto.Standing), fastest first
    verify_steps: float | None = None  # mode auto: a verify of k + 1 positions (the `k` above) in plain steps (what a round must give)
    # per mode, the plain rounds run in-band among its rounds: its speedup compares with these (same window, same
    # load, same context lengths), not with plain rounds from another time
    plain_for: dict[str, Stats] = field(default_factory=dict)
    server: str | None = None  # a remote session: the engine, model and speculative method the server reported
    warnings: tuple[str, ...] = ()  # a remote session: where the reconstructed steps did not add up to the server's counters

    @property
    def total(self) -> Stats:
        total = Stats()
        for s in self.stats.values():
            total = total.merge(s)
        return total

    @property
    def plain_step_s(self) -> float | None:
        """The recent baseline's plain step; without one (a snapshot built by hand), mode off's over the session."""
        if self.baseline is not None:
            return self.baseline.step_s
        plain = self.stats.get("off")
        return plain.plain_step_s if plain else None

    def speedup(self, mode: str) -> SpeedupModel | None:
        """The predicted speedup of `mode` over plain decoding, from this session's measurements."""
        return speedup_model(self.stats.get(mode), self.plain_step_s)


@runtime_checkable
class ChatSession(Protocol):
    """What the front ends (the chat, generate, export, history, bench --server) use of a session, a local model's
    (session.Session) or a serving engine's (remote_session.RemoteSession) alike: `info` says what runs the models,
    so no front end asks which kind it holds. Conversation implements the bookkeeping half."""

    info: EngineInfo
    modes: dict[str, str]  # the modes (a server's: its configurations), name -> what it is, in key order
    target: Any  # `.name`: what the front ends call the target
    draft: Any  # `.name`, or None without a draft model
    controls: Any  # mode, k, sampling, rule; `on_prefill`, which the front ends set (loop.Controls, RemoteControls)
    notices: list[str]  # said once at start
    warnings: list[str]  # a server's reconstructed steps that did not add up (none locally)
    messages: list[dict]
    turns: list[Turn]
    lock: Any
    seed: int | None
    max_new_tokens: int

    @property
    def mode(self) -> str: ...

    @property
    def system(self) -> str | None: ...

    def snapshot(self) -> Snapshot: ...

    def drafter(self, mode: str) -> object:
        """Make `mode` ready to run (raises ModeUnavailable)."""

    def preparing(self, mode: str) -> str | None:
        """What making `mode` ready will build that takes seconds, or None."""

    def set_mode(self, mode: str) -> None: ...

    def measure_baseline(self, every: int = ...) -> None: ...

    def set_system(self, text: str | None) -> None: ...

    def restore(self, messages: list[dict]) -> None: ...

    def chat_prompt(self, messages: list[dict]) -> Any:
        """The prompt `complete` takes for these messages: token ids, or the messages for a server."""

    def raw_prompt(self, text: str) -> Any: ...

    def check_message(self, text: str) -> None: ...

    def check_fits(self, prompt) -> None: ...

    def token_text(self, token_id: int) -> str: ...

    def reply(self, text: str) -> Iterator[RoundRecord]: ...

    def complete(self, prompt) -> Iterator[RoundRecord]: ...


class Conversation:
    """The messages so far, every turn with its rounds, statistics per mode, and a lock that keeps them consistent
    for the threads that read them. A subclass sets `controls` (mode, k, sampling, rule, drafter) and produces
    the rounds."""

    controls = None

    def __init__(self, max_new_tokens: int) -> None:
        self.max_new_tokens = max_new_tokens
        self.messages: list[dict] = []
        self._history = None  # the subclass's record of what the conversation ran as (None: start afresh)
        self.turns: list[Turn] = []
        self.stats: dict[str, Stats] = {}  # per mode (and per turn in Turn.stats); the total is their sum
        # held while a round is recorded, so another thread (the UI, an export) reads a consistent snapshot
        self.lock = threading.RLock()
        self.notices: list[str] = []  # said once to the user at start (the chat shows them as warnings)
        self.warnings: list[str] = []  # a server's reconstructions that did not add up to its counters
        self.plain_for: dict[str, Stats] = {}  # mode -> the in-band plain rounds among its rounds (Snapshot.plain_for)

    _plain: deque | None = None  # (time, record) of the latest plain rounds, for the baseline
    _last_mode: str | None = None  # the mode of the latest round not run plain: in-band plain rounds after it are its baseline

    @property
    def mode(self) -> str:
        return self.controls.mode

    @property
    def mode_drafter(self):
        """The current mode's drafter, whose figures the panel shows (None where a server drafts)."""
        return self.controls.drafter

    @property
    def system(self) -> str | None:
        """The system message that opens the conversation, if any."""
        first = self.messages[0] if self.messages else None
        return first["content"] if first and first["role"] == "system" else None

    def set_system(self, text: str | None) -> None:
        """Put `text` (None or "": none) at the start of the conversation. It changes the prompt's prefix, so the
        next turn re-tokenises the conversation and the cache is reused only up to the first changed token."""
        with self.lock:
            rest = self.messages[1:] if self.system is not None else self.messages
            self.messages = ([{"role": "system", "content": text}] if text else []) + list(rest)
            self._history = None

    def restore(self, messages: list[dict]) -> None:
        """Continue a saved conversation: its messages are the prefix of the next turn (encoded then, in full)."""
        with self.lock:
            self.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
            self._history = None

    # -- generation
    def _record(self, rounds: Iterator[RoundRecord], turn: Turn) -> Iterator[RoundRecord]:
        """Record each round in `turn` and the session's statistics as it passes to the caller."""
        for record in rounds:
            with self.lock:
                turn.rounds.append(record)
                turn.sampling.append(self.controls.sampling)
                turn.k = "auto" if isinstance(self.controls.adaptive, MeasuredK) else self.controls.k
                turn.reply_ids += [t.id for t in record.tokens]
                turn.reply += "".join(t.text for t in record.tokens)
                turn.stop_reason = record.stop_reason
                turn.stats.add(record)
                self.stats.setdefault(record.mode, Stats()).add(record)
                if record.mode == "off" and record.index > 0:  # round 0's token came with the prefill: no step to time
                    if self._plain is None:
                        self._plain = deque(maxlen=BASELINE_ROUNDS)
                    self._plain.append((time.monotonic(), record))
                    if self.mode != "off" and self._last_mode is not None:  # in-band: the baseline of the mode around it
                        self.plain_for.setdefault(self._last_mode, Stats()).add(record)
                elif record.mode != "off":
                    self._last_mode = record.mode
            self._after_round()
            yield record

    # -- what the front ends show
    @property
    def total(self) -> Stats:
        """Every mode together."""
        return self.snapshot().total

    def snapshot(self) -> Snapshot:
        """Copies of the statistics and settings, consistent with each other (callable from any thread)."""
        with self.lock:
            controls, drafter = self.controls, self.mode_drafter
            latest = (r.accepted / r.drafted for t in reversed(self.turns) for r in reversed(t.rounds) if r.drafted)
            measured = controls.adaptive if isinstance(controls.adaptive, MeasuredK) else None
            running = getattr(drafter, "choice", None) or controls.mode
            k = measured.best.get(running, controls.k) if measured else controls.k
            return Snapshot(
                mode=controls.mode,
                k=k,
                k_measured=measured is not None,
                sampling=controls.sampling,
                rule=controls.rule.name,
                exact=controls.rule.exact,
                stats={mode: s.copy() for mode, s in self.stats.items()},
                reply=self.turns[-1].stats.copy() if self.turns else Stats(),
                recent=list(itertools.islice(latest, RECENT_ROUNDS))[::-1],
                baseline=Baseline.of(self._plain or ()),
                plain_for={mode: s.copy() for mode, s in self.plain_for.items()},
                max_draft=getattr(drafter, "max_draft", None),
                draft_len=drafter.draft_len(k) if hasattr(drafter, "draft_len") else None,  # at the K shown
                choice=getattr(drafter, "choice", None),
                why=getattr(drafter, "why", None),
                **({"standings": drafter.standings(), "verify_steps": drafter.verify_steps(k)}
                   if hasattr(drafter, "standings") else {}),
                **self._snapshot_extra(),
            )

    def _after_round(self) -> None:
        """Called after each round, in the thread that produced it."""

    def _snapshot_extra(self) -> dict:
        return {}
