"""A conversation with one target model: chat template, prefix-cache reuse, mode switching, statistics."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import random
from pathlib import Path
from typing import Iterator

import torch

from specchat import machine, models, store, threads
from specchat.conversation import Conversation, PromptTooLong, Turn
from specchat.engine.detokenize import IncrementalDecoder
from specchat.engine.draft_length import MeasuredK
from specchat.engine.drafters import Drafter, build_drafter
from specchat.engine.drafters.auto import CANDIDATES as AUTO_CANDIDATES
from specchat.engine.drafters.baseline import InBandBaseline
from specchat.engine.drafters.head import fingerprint
from specchat.engine.events import RoundRecord
from specchat.engine.gguf_model import on_lean
from specchat.engine.info import EngineInfo
from specchat import repack_probe
from specchat.engine.llamacpp import EngineError, on_llama_cpp, target_state
from specchat.engine.loop import Controls, generate
from specchat.engine.sampling import SamplingParams
from specchat.engine.target import CachedTarget
from specchat.models import LoadedModel
from specchat.modes import MODES, TUNABLE

log = logging.getLogger("specchat")

BASELINE_EVERY = 32  # measure_baseline(): one plain round after this many rounds of another mode
# what building a drafter makes that takes seconds, said while it is made (Session.preparing)
SLOW_BUILDS = {"quant": "an int8 copy of the target", "lowrank": "low-rank factors of the target's weights"}


def drafter_options(model, mode: str, options: dict) -> dict:
    """The options a mode's drafter is built with: the user's, else the setting `specchat tune` saved for
    this model; low-rank factors are kept in the user cache."""
    out = dict(options)
    if on_llama_cpp(model):  # a GGUF target on llama.cpp: quant drafts with a smaller quantisation of its file
        # auto tries quant only on a 16- or 32-bit file: a 4-bit copy of an 8-bit or 4-bit file costs 0.8-1.0 of
        # its step, so with a verify of 5 positions at 2.3-3.9 steps it can only lose
        wide = model.dtype in ("F32", "F16", "BF16")
        draft_type = models.QUANT_DRAFT.get(model.dtype, models.QUANT_DRAFT_DEFAULT)
        if (mode == "quant" or (mode == "auto" and wide)) and out.get("quant_gguf") is None and draft_type != model.dtype:
            try:
                out["quant_gguf"] = str(models.quantized_gguf(model.path, draft_type))
            except EngineError as e:  # the drafter's build then says quant is unavailable (auto: not a candidate)
                log.warning("no %s copy of %s for mode quant: %s", draft_type, model.path.name, e)
        return out
    if on_lean(model):  # a GGUF file on the lean runner: no settings saved (layerskip and earlyexit take their built-in or given ones)
        return out
    setting = TUNABLE.get(mode)
    if setting is not None and out.get(setting) is None:
        tuned = store.load_tuned(model, mode)
        if tuned and setting in tuned:
            out[setting] = tuned[setting]
    if mode == "auto":  # every candidate's options together (each drafter takes the ones it understands)
        for candidate in AUTO_CANDIDATES:
            out.update(drafter_options(model, candidate, options))
        return out
    if mode == "lowrank":
        out.setdefault("factor_store", store.TensorStore(store.cache_dir() / "lowrank"))
    if mode == "head" and out.get("head_file") is None:
        out["head_file"] = store.find_head(fingerprint(model))
    return out


def auto_setup(target: LoadedModel, draft: LoadedModel | None, device, options: dict) -> dict:
    """What auto's measurements depend on besides the prompt: another of these is another setup, learnt afresh."""
    head = Path(options["head_file"]) if options.get("head_file") else None
    return {"target": models.weights_id(target.model), "draft": models.weights_id(draft.model) if draft else None,
            "engine": target.engine, "device": str(device), "dtype": target.dtype_name,
            "head": f"{head.name}:{head.stat().st_size}" if head is not None and head.is_file() else None,
            "threads": threads.setting(), "cpu": machine.cpu_name(), "cores": os.cpu_count()}


class Session(Conversation):
    """A local model behind the front ends' session interface (conversation.ChatSession): owns the target state
    (whose KV cache is reused across turns) and one drafter per mode used."""

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
        earlier_sessions: bool = True,
    ) -> None:
        self.target, self.draft = target, draft
        self.mode_options = mode_options or {}
        # what earlier sessions left is used: auto starts from (and saves) the rates they measured (store.LearntRates),
        # and mode suffix drafts from the saved conversations too; False: a first session, reproducible (benchmarks)
        self.earlier_sessions = earlier_sessions
        self.state = target_state(target.model)
        self.seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
        self.generator = torch.Generator(device=self.state.device).manual_seed(self.seed)
        super().__init__(max_new_tokens)
        self._drafters: dict[str, Drafter] = {}
        self.controls = Controls(self.drafter(mode), k=k, sampling=sampling)
        self._history: tuple[list[dict], list[int]] | None = None  # messages so far and the exact ids they ran as
        self.modes = MODES
        self.eos_ids = target.eos_ids
        # what runs the models, for the front ends (load_session names the device and dtype it chose)
        self.info = EngineInfo(target.engine, self.state.runner, self.state.kernel, str(self.state.device), target.dtype_name)
        if self.info.engine == "llama.cpp" and repack_probe.verdict().notice:
            self.notices.append(repack_probe.verdict().notice)

    # -- modes
    def measure_baseline(self, every: int = BASELINE_EVERY) -> None:
        """Interleave one plain round (mode off: ordinary decoding, so replies stay exact) after every `every`
        rounds of another mode, the first one early, so the baseline is re-measured under the conditions of
        what it is compared with; 0 stops it. The rounds are chosen by a drafter around the mode's
        (drafters/baseline.py), through the loop's drafter hook."""
        drafter = self.mode_drafter
        # round 1 runs plain (round 0's token came with the prefill)
        self.controls.drafter = InBandBaseline(drafter, self.drafter("off"), every, since=every - 1) if every else drafter

    @property
    def mode_drafter(self) -> Drafter:
        """The current mode's drafter, also while the in-band baseline runs around it."""
        drafter = self.controls.drafter
        return drafter.drafter if isinstance(drafter, InBandBaseline) else drafter

    def drafter(self, mode: str) -> Drafter:
        """Build a mode's drafter once and keep it (raises ModeUnavailable)."""
        if mode not in self._drafters:
            draft_model = self.draft.model if self.draft else None
            options = drafter_options(self.target.model, mode, self.mode_options)
            if mode == "auto" and self.earlier_sessions:
                options["memory"] = store.LearntRates(auto_setup(self.target, self.draft, self.state.device, options))
            if mode in ("suffix", "auto") and self.earlier_sessions:
                options["references"] = self.saved_conversations()
            self._drafters[mode] = build_drafter(mode, self.target.model, draft_model, **options)
        return self._drafters[mode]

    def preparing(self, mode: str) -> str | None:
        """What building `mode`'s drafter will make that takes seconds, for the front ends to say while it runs;
        None when it is built already or quick."""
        if mode in self._drafters:
            return None
        if mode == "quant" and on_llama_cpp(self.target.model):
            kind = models.QUANT_DRAFT.get(self.target.model.dtype, models.QUANT_DRAFT_DEFAULT)
            return f"a {kind} copy of the target's file (llama.cpp's quantizer, the first time; then from the user cache)"
        return SLOW_BUILDS.get(mode)

    def saved_conversations(self, budget: int = 100_000) -> list[list[int]]:
        """The user's saved conversations as this target's token ids (chat template applied), the most recent last,
        about `budget` tokens in all: what mode suffix drafts from besides this conversation."""
        from specchat import history

        out, total = [], 0
        for summary in history.conversations():  # the most recent first
            try:
                messages = [m for m in history.load(summary.path).get("messages", [])
                            if isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str)]
                ids = self.target.chat_ids(messages) if messages else []
            except Exception:  # a file another version wrote, messages a chat template refuses: skipped
                continue
            out.append(ids)
            total += len(ids)
            if total >= budget:
                break
        return out[::-1]

    def measure_k(self, start: int) -> None:
        """-k auto: K chosen each round from measured costs (MeasuredK), from what earlier sessions of this setup
        measured."""
        setup = auto_setup(self.target, self.draft, self.state.device, self.mode_options)
        self.controls.adaptive = MeasuredK(start=start, memory=store.LearntRates(setup, "draft_length") if self.earlier_sessions else None)

    def save_learnt(self) -> None:
        """Keep what auto and the measured K learnt this session for the next one (after every turn: a killed session
        loses little)."""
        auto = self._drafters.get("auto")
        if auto is not None and self.earlier_sessions:
            auto.save()
        if isinstance(self.controls.adaptive, MeasuredK):
            self.controls.adaptive.save()

    def engine(self) -> tuple[CachedTarget, Controls]:
        """Another engine over the same weights: its own KV cache and drafter, this session's mode and settings.
        Draws that run in parallel threads (`specchat verify`) each need one; a drafter keeps per-sequence state."""
        mode = self.mode
        draft_model = self.draft.model if self.draft else None
        drafter = build_drafter(mode, self.target.model, draft_model, **drafter_options(self.target.model, mode, self.mode_options))
        controls = dataclasses.replace(self.controls, drafter=drafter, adaptive=copy.deepcopy(self.controls.adaptive))
        return target_state(self.target.model, self.state.runner), controls

    def configure_mode(self, mode: str, **settings) -> None:
        """Change a mode's settings (e.g. the skip set `tune` found): its drafter is rebuilt when next used."""
        self.mode_options = {**self.mode_options, **settings}
        self._drafters.pop(mode, None)

    def set_mode(self, mode: str) -> None:
        """Takes effect at the next round, also in the middle of a reply (the in-band baseline keeps its count)."""
        drafter = self.drafter(mode)
        if isinstance(self.controls.drafter, InBandBaseline):
            self.controls.drafter.drafter = drafter
        else:
            self.controls.drafter = drafter

    # -- prompts
    def chat_prompt(self, messages: list[dict]) -> list[int]:
        return self.target.chat_ids(messages)

    def raw_prompt(self, text: str) -> list[int]:
        return self.target.raw_ids(text)

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
            yield from self._record(self._rounds(prompt), turn)
        finally:
            self.messages.append({"role": "assistant", "content": turn.reply})
            self._history = (list(self.messages), prompt + turn.reply_ids)
            self.save_learnt()

    def complete(self, prompt: list[int]) -> Iterator[RoundRecord]:
        """One generation from explicit prompt ids (no chat template)."""
        self.check_fits(prompt)
        turn = Turn(user="", prompt_tokens=len(prompt))
        self.turns.append(turn)
        try:
            yield from self._record(self._rounds(prompt), turn)
        finally:
            self.save_learnt()

    def _after_round(self) -> None:
        threads.adapt()  # here, in the thread that runs the forwards

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
