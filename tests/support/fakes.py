"""A scripted Session for fast UI tests: the real Session with only what needs a model replaced."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from specchat.engine.drafters import Drafter, ModeUnavailable
from specchat.engine.events import RoundRecord, TokenEvent
from specchat.engine.info import EngineInfo
from specchat.engine.loop import Controls
from specchat.engine.sampling import SamplingParams
from specchat.modes import MODES
from specchat.session import Session


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
