"""A conversation with one target model: chat template, prefix-cache reuse, mode switching, statistics."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Iterator

import torch

from specchat.decoding import Controls, RoundRecord, SamplingParams, TargetState, generate
from specchat.decoding.drafters import Drafter, build_drafter
from specchat.decoding.stats import Stats
from specchat.decoding.text import IncrementalDecoder
from specchat.models import LoadedModel


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


class Session:
    """Owns the target state (whose KV cache is reused across turns) and one drafter per mode used."""

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None = None,
        *,
        mode: str = "off",
        k: int = 4,
        sampling: SamplingParams = SamplingParams(),
        seed: int | None = None,
        max_new_tokens: int = 256,
        mode_options: dict | None = None,
    ) -> None:
        self.target, self.draft = target, draft
        self.mode_options = mode_options or {}
        self.state = TargetState(target.model)
        self.seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
        self.generator = torch.Generator(device=self.state.device).manual_seed(self.seed)
        self.max_new_tokens = max_new_tokens
        self._drafters: dict[str, Drafter] = {}
        self.controls = Controls(self.drafter(mode), k=k, sampling=sampling)
        self.messages: list[dict] = []
        self._history: tuple[list[dict], list[int]] | None = None  # messages so far and the exact ids they ran as
        self.turns: list[Turn] = []
        self.stats: dict[str, Stats] = {}  # per mode
        self.total = Stats()
        # held while a round is recorded, so another thread (the UI, an export) reads a consistent snapshot
        self.lock = threading.Lock()
        config = target.model.generation_config
        eos = config.eos_token_id if config is not None else None
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if target.tokenizer.eos_token_id is not None:
            self.eos_ids.add(target.tokenizer.eos_token_id)

    # -- modes
    def drafter(self, mode: str) -> Drafter:
        """Build a mode's drafter once and keep it (raises ModeUnavailable)."""
        if mode not in self._drafters:
            draft_model = self.draft.model if self.draft else None
            self._drafters[mode] = build_drafter(mode, self.target.model, draft_model, **self.mode_options)
        return self._drafters[mode]

    def set_mode(self, mode: str) -> None:
        """Takes effect at the next round, also in the middle of a reply."""
        self.controls.drafter = self.drafter(mode)

    @property
    def mode(self) -> str:
        return self.controls.mode

    # -- prompts
    def chat_prompt(self, messages: list[dict]) -> list[int]:
        ids = self.target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids)

    def raw_prompt(self, text: str) -> list[int]:
        return list(self.target.tokenizer(text)["input_ids"])

    def check_message(self, text: str) -> None:
        """Raise PromptTooLong now if `text` as the next user turn would not fit (reply() checks lazily)."""
        self.check_fits(self.prompt_for([*self.messages, {"role": "user", "content": text}]))

    def token_text(self, token_id: int) -> str:
        """One token on its own, for showing rejected drafts and top alternatives."""
        return self.target.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def prompt_for(self, messages: list[dict]) -> list[int]:
        """Token ids for the next turn: the conversation's exact ids so far plus the new part, when possible.

        Re-tokenising the whole conversation would not always give back the ids the model generated
        (BPE does not round-trip), and every token after the first difference would be prefilled
        again; continuing the exact ids keeps the whole cached prefix reusable.
        """
        ids = self._continue_conversation(messages)
        return ids if ids is not None else self.chat_prompt(messages)

    def _continue_conversation(self, messages: list[dict]) -> list[int] | None:
        if self._history is None or messages[:-1] != self._history[0]:
            return None
        tokenizer, done = self.target.tokenizer, self._history[1]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        done_text = tokenizer.decode(done, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if not text.startswith(done_text):
            return None  # the template rewrites earlier turns (e.g. strips them): use the plain re-tokenisation
        ids = done + list(tokenizer(text[len(done_text):], add_special_tokens=False)["input_ids"])
        same = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text
        return ids if same else None

    def check_fits(self, prompt: list[int]) -> None:
        limit = self.state.context_len
        if limit is not None and len(prompt) >= limit:
            raise PromptTooLong(f"the prompt is {len(prompt)} tokens; {self.target.name} has a context of {limit}")

    # -- generation
    def reply(self, text: str) -> Iterator[RoundRecord]:
        """One chat turn. The turn is recorded even if the caller stops early (Esc): nothing is lost."""
        messages = [*self.messages, {"role": "user", "content": text}]
        prompt = self.prompt_for(messages)
        self.check_fits(prompt)
        self.messages = messages
        turn = Turn(user=text, prompt_tokens=len(prompt))
        self.turns.append(turn)
        try:
            yield from self._run(prompt, turn)
        finally:
            self.messages.append({"role": "assistant", "content": turn.reply})
            self._history = (list(self.messages), prompt + turn.reply_ids)

    def complete(self, prompt: list[int]) -> Iterator[RoundRecord]:
        """One generation from explicit prompt ids (no chat template)."""
        self.check_fits(prompt)
        turn = Turn(user="", prompt_tokens=len(prompt))
        self.turns.append(turn)
        yield from self._run(prompt, turn)

    def _run(self, prompt: list[int], turn: Turn) -> Iterator[RoundRecord]:
        for record in self._rounds(prompt):
            with self.lock:
                turn.rounds.append(record)
                turn.sampling.append(self.controls.sampling)
                turn.reply_ids += [t.id for t in record.tokens]
                turn.reply += "".join(t.text for t in record.tokens)
                turn.stop_reason = record.stop_reason
                self.stats.setdefault(record.mode, Stats()).add(record)
                self.total.add(record)
            yield record

    def _rounds(self, prompt: list[int]) -> Iterator[RoundRecord]:
        """The engine's rounds for one generation (a test double replaces only this)."""
        decoder = IncrementalDecoder(self.target.tokenizer, skip_special_tokens=True)
        return generate(
            self.state,
            prompt,
            self.controls,
            max_new_tokens=self.max_new_tokens,
            eos_ids=self.eos_ids,
            generator=self.generator,
            decode=decoder.push,
        )
