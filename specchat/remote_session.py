"""A conversation with a serving engine (llama-server, vLLM): the same turns, rounds and statistics as a
local session, built from what the server streams (engine/remote.py), behind the same session interface
(conversation.ChatSession), so the chat, `generate` and the exports work on top unchanged. No torch on this path.

Modes are the server configurations (`--server NAME=URL`, one each; a server without drafting is the plain
baseline). The draft length is each server's own: the pinned llama-server ignores a request's speculative.n_max.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterator

from specchat.conversation import Conversation, Turn
from specchat.engine import remote
from specchat.engine.errors import ModeUnavailable
from specchat.engine.events import RoundRecord
from specchat.engine.info import EngineInfo
from specchat.engine.metrics import Stats
from specchat.engine.sampling_params import SamplingParams

log = logging.getLogger("specchat")

DEFAULT_TIMEOUT_S = 120.0  # the longest wait for the next chunk (a large prompt's prefill comes first)


@dataclass(frozen=True)
class ServerRule:
    """The server's own acceptance rule: llama-server and vLLM verify losslessly by design; specchat cannot see
    p or q from here to check it, and says so (the rule is named "server", not "exact")."""

    name: str = "server"
    exact: bool = True


@dataclass
class RemoteControls:
    """What the chat can change between requests (the server reads the settings once per request)."""

    mode: str
    k: int | None  # None: the draft length is the server's own setting (not reported to clients)
    sampling: SamplingParams
    rule: ServerRule = ServerRule()
    adaptive = None


class RemoteUnavailable(ModeUnavailable):
    """What a remote session cannot do (a mode it does not have, a raw prompt)."""


class RemoteSession(Conversation):
    """Serving engines behind the session interface: a mode is a server configuration."""

    def __init__(
        self,
        servers: list[remote.Server],
        *,
        sampling: SamplingParams = SamplingParams(),
        seed: int | None = None,
        max_new_tokens: int = 256,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(max_new_tokens)
        self.servers = {s.name: s for s in servers}
        self.server = servers[0]  # the configuration requests go to ("off" runs on it without drafting)
        self.modes = {s.name: f"{s.engine} at {s.url}: {s.model}, speculation: {s.speculative or 'none'}" for s in servers}
        self.controls = RemoteControls(self.server.name, None, sampling)
        self.seed, self.timeout = seed, timeout
        self.draft = None
        self.reconstructions: list = []  # per generation: its LlamaServerSteps or VllmSteps
        for s in servers:
            if s.speculative is None:
                self.notices.append(f"{s.name} ({s.url}) does not speculate: every token is a plain target step")

    @property
    def info(self) -> EngineInfo:
        """The current configuration's server runs the models; its engine stands for the runner and the kernel."""
        engine = self.server.engine
        return EngineInfo(engine, engine, engine, device="server", dtype="", server=self.server)

    @property
    def mode_drafter(self) -> None:
        """No local drafter: the server drafts."""
        return None

    @property
    def target(self):
        """What the front ends name as the target: the model the current server runs."""
        return SimpleNamespace(name=f"{self.server.model} @ {self.server.url}")

    # -- modes
    def drafter(self, mode: str) -> None:
        """Check that `mode` exists here (the chat builds a local mode's drafter at this point)."""
        if mode not in self.modes:
            raise RemoteUnavailable(f"not a configuration of this session (these are: {', '.join(self.modes)})")

    def preparing(self, mode: str) -> None:
        """Nothing to build: a configuration is a server that runs already."""
        return None

    def set_mode(self, mode: str) -> None:
        """From the next request (a server reads its settings once per request)."""
        self.drafter(mode)
        self.server = self.servers[mode]
        self.controls.mode = mode

    def measure_baseline(self, every: int = 0) -> None:
        """A server decides its own steps: no plain rounds can be interleaved (mode off is a request of its own)."""

    # -- prompts: the server applies its own chat template
    def chat_prompt(self, messages: list[dict]) -> list[dict]:
        return list(messages)

    def raw_prompt(self, text: str):
        raise RemoteUnavailable("--raw needs a local model: a server takes chat messages (its own template)")

    def check_message(self, text: str) -> None:
        """The server knows its context length; a prompt too long comes back as its error."""

    def check_fits(self, prompt) -> None:
        """As check_message: the server's to say."""

    def token_text(self, token_id: int) -> str:
        return "" if token_id == remote.UNKNOWN_ID else f"<{token_id}>"

    # -- generation
    def reply(self, text: str) -> Iterator[RoundRecord]:
        """One chat turn; the turn (and the partial reply, if the stream breaks or the caller stops) is kept."""
        messages = [*self.messages, {"role": "user", "content": text}]
        self.messages = messages
        turn = Turn(user=text, prompt_tokens=0)
        self.turns.append(turn)
        try:
            yield from self._run(messages, turn)
        finally:
            self.messages.append({"role": "assistant", "content": turn.reply})

    def complete(self, messages: list[dict]) -> Iterator[RoundRecord]:
        """One generation from these messages, without adding them to the conversation (`specchat generate`)."""
        turn = Turn(user=messages[-1]["content"] if messages else "", prompt_tokens=0)
        self.turns.append(turn)
        yield from self._run(messages, turn)

    def _run(self, messages: list[dict], turn: Turn) -> Iterator[RoundRecord]:
        steps: list = []
        try:
            yield from self._record(self._rounds(messages, steps), turn)
        except remote.RemoteError:
            turn.stop_reason = "interrupted"
            raise
        finally:
            if steps:
                self._check(steps[0], turn)

    def _rounds(self, messages: list[dict], steps_out: list) -> Iterator[RoundRecord]:
        """The server's rounds for one generation (a test double replaces only this)."""
        c = self.controls
        request = remote.Request(messages, self.max_new_tokens, c.sampling.temperature, c.sampling.top_k, c.sampling.top_p,
                                 seed=self.seed)
        return remote.generate(self.server, request, mode=c.mode, timeout=self.timeout, steps_out=steps_out)

    def _check(self, steps, turn: Turn) -> None:
        """Compare the reconstruction with the server's final counters (vLLM: first relabel the steps from them);
        a mismatch is a visible warning."""
        self.reconstructions.append(steps)
        if steps.usage:
            turn.prompt_tokens = int(steps.usage.get("prompt_tokens", 0))
        if turn.stop_reason == "interrupted" or steps.finish_reason is None:
            return  # a broken or stopped stream has no final counters to compare with
        if self.server.engine == "llama-server" and self.server.speculative == "on":  # its slot lists the types now
            self._refresh_speculation()
        if isinstance(steps, remote.VllmSteps) and steps.relabel():  # the per-step metrics settle the one-token steps
            with self.lock:
                turn.stats = Stats.of(turn.rounds)
                self.stats = {}
                for t in self.turns:
                    for r in t.rounds:
                        self.stats.setdefault(r.mode, Stats()).add(r)
        rec = steps.reconciliation()
        if not rec.ok:
            message = f"turn {len(self.turns)}: the reconstructed steps do not match the server's counters: " + "; ".join(rec.problems)
            log.warning(message)
            with self.lock:
                self.warnings.append(message)
        if turn.rounds and turn.rounds[-1].stop_reason:
            turn.stop_reason = turn.rounds[-1].stop_reason

    def _refresh_speculation(self) -> None:
        try:
            spec = remote.llama_server_speculation(self.server.url)
        except remote.RemoteError:
            return
        if spec not in ("on", "unknown"):
            with self.lock:
                self.server = self.servers[self.server.name] = dataclasses.replace(self.server, speculative=spec)

    def _snapshot_extra(self) -> dict:
        return {"server": self.server.label, "warnings": tuple(self.warnings)}
