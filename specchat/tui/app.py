"""The specchat chat app: a thin App whose actions delegate to the session and the widgets.

Generation runs in a thread worker that queues each round and posts a RoundsDone message when none is on its way
(messages.py: post_message is thread-safe and never blocks the decoder); the UI thread only draws.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
import traceback
from contextlib import closing, contextmanager
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterable

from textual import events, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import var
from textual.screen import Screen
from textual.widgets import Footer, Header, Input
from textual.worker import get_current_worker

from specchat import threads
from specchat.conversation import ChatSession, PromptTooLong
from specchat.engine.errors import ModeUnavailable
from specchat.export import default_export_path, markdown_path, save_export, write_export
from specchat.fmt import shorten
from specchat.history import ConversationLog, conversations, conversations_dir
from specchat.modes import MODES
from specchat.tui.consent import ConsentScreen
from specchat.tui.conversations import ConversationsScreen
from specchat.tui.help import HelpScreen
from specchat.tui.keys import ACTION_KEYS, MAX_MODES, NOT_IN_FOOTER, key_label, mode_keys
from specchat.tui.log import LogHandler, LogScreen, route_transformers_logging
from specchat.tui.messages import LoadStage, LogLine, ModeReady, PrefillProgress, ReplyFinished, RoundQueue, RoundsDone, SessionLoaded
from specchat.tui.system import SystemPromptScreen
from specchat.tui.themes import DEFAULT_THEME, FALLBACK_THEME, load_themes, token_defaults
from specchat.tui.widgets import (Conversation, Inspector, Legend, MarkdownReply, ReplyView, SavedReply, StartupView, StatsPanel,
                                  UserView)

# While a reply streams, the reply and the panel redraw on timers, not per round: a redraw takes the UI
# thread milliseconds, and at tens of rounds per second that would slow the decoder it measures. Where the
# forward's threads take every core, the UI thread's time is theirs: the reply and the panel (its tables cost
# as much to draw as the reply) redraw less often (benchmarks/ui_cost.py).
REPLY_INTERVAL_S = 0.1
SHARED_REPLY_INTERVAL_S = 0.3
PANEL_INTERVAL_S = 0.3
SHARED_PANEL_INTERVAL_S = 1.0
K_RANGE = (1, 16)
WHILE_LOADING = {"help", "show_log", "toggle_panel", "toggle_markdown", "quit"}  # the actions that need no session
QUIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
SIGNAL_SAVE_WAIT_S = 5.0  # how long a signal's exit waits for the reply's round to end and its turn to be saved
TEMPERATURE_STEP = 0.1


class LoadProgress:
    """load_session's progress display inside the app, with a Rich Console's interface: each stage is posted as it
    begins and ends (post_message is thread-safe)."""

    def __init__(self, app: App) -> None:
        self.app = app

    @contextmanager
    def status(self, text: str):
        self.app.post_message(LoadStage(text))
        start = time.perf_counter()
        yield
        self.app.post_message(LoadStage(text, time.perf_counter() - start))

    def confirm(self, question: str) -> bool:
        """Ask in a dialog (ConsentScreen) and wait for the answer, from the loading thread: a first start that would
        write gigabytes into the cache (cli/options.ask_before_writing). ctrl+q quits meanwhile, as while loading."""
        answered, answer = threading.Event(), []

        def done(yes: bool | None) -> None:
            answer.append(bool(yes))
            answered.set()

        self.app.call_from_thread(self.app.push_screen, ConsentScreen(question), done)
        answered.wait()
        return answer[0]


def fit_names(names: list[str], width: int) -> str:
    """One or two names joined, each cut in the middle to fit `width` together: the second (a draft model) gets at
    most a third and what the first leaves; where the first would keep less than 16 characters, the second is just
    "draft"."""
    joiner = " + "
    if len(joiner.join(names)) <= width:
        return joiner.join(names)
    if len(names) == 1:
        return shorten(names[0], max(width, 8))
    first = width - len(joiner) - min(len(names[1]), max(12, (width - len(joiner)) // 3))
    if first < 16:
        return shorten(names[0], max(8, width - len(joiner) - len("draft"))) + joiner + "draft"
    second = width - len(joiner) - min(first, len(names[0]))
    return shorten(names[0], first) + joiner + shorten(names[1], second)


class SpecChatApp(App):
    """Chat with speculative decoding shown live."""

    TITLE = "specchat"
    CSS_PATH = Path(__file__).with_name("app.tcss")  # absolute, so subclasses in other folders (the tests') find it
    # keys.py: modes on F2..F11 (listed in the panel, the help and the palette, not the footer, which must fit
    # 80 columns), every other action on F1, Esc or a ctrl key
    BINDINGS = [
        # F2..F11: the session's modes in order (MODES locally, the server configurations on a remote session)
        *(Binding(f"f{i + 2}", f"mode_key({i})", f"mode {i + 1}", show=False, id=f"mode.{i + 1}") for i in range(MAX_MODES)),
        *(Binding(keys, action, label, id=f"app.{action}", show=action not in NOT_IN_FOOTER, priority=action == "quit")
          for action, (keys, label, _) in ACTION_KEYS.items()),
    ]
    # below 100 columns the chat and the panel do not fit side by side: ctrl+t switches between them
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]

    # Widgets are data-bound to these (Conversation.streaming, Legend/ReplyView.show_rejected), so they never
    # read the app; bindings=True redraws the footer, where Esc (stop) shows only while a reply streams.
    generating = var(False, init=False, bindings=True)
    show_rejected = var(False, init=False)  # ctrl+r: rejected drafts inline
    panel_toggled = var(False, init=False)  # ctrl+t: wide terminals hide the panel, narrow ones show it instead of the chat
    show_markdown = var(False, init=False)  # ctrl+o: finished replies as Markdown instead of coloured tokens
    quitting = False  # a signal asked the app to end: no queued message is sent any more

    def __init__(
        self,
        session: ChatSession | None = None,
        *,
        load: Callable[[object], ChatSession] | None = None,
        theme: str | None = None,
        export_path: Path | None = None,
        theme_dirs: list[Path] | None = None,
        conversation: ConversationLog | None = None,
    ) -> None:
        """A loaded `session`, or `load(progress)`, which builds one in a background thread while the app is already
        on screen (progress.status(text) is a context manager around each stage, as a Rich Console's)."""
        super().__init__()
        if (session is None) == (load is None):
            raise ValueError("give a session or a function that loads one")
        self.session: ChatSession | None = None  # None while `load` runs: the actions that need it wait (check_action)
        self.load = load
        self.load_error: BaseException | None = None  # what stopped the loading (run_chat raises it after the app ends)
        self.loader: threading.Thread | None = None
        self.conversation = conversation  # where every finished turn is saved (run_chat always gives one)
        self.export_path = Path(export_path) if export_path else None
        self.reply_view: ReplyView | None = None
        self.snapshot = None  # what the panel shows: the session's statistics when it was last drawn
        self.rounds = RoundQueue()  # rounds from the generation thread, not drawn yet
        self.reply_interval, self.panel_interval = REPLY_INTERVAL_S, PANEL_INTERVAL_S
        self.modes: dict[str, str] = session.modes if session is not None else MODES  # name -> what it is, in key order
        self.mode_keys = {mode: key_label(key) for mode, key in mode_keys(self.modes).items()}  # as shown: "F2"
        self.remote = False  # a server runs the models (take_session reads the session's EngineInfo)
        self.unavailable: dict[str, str] = {}
        self.pending_mode: str | None = None
        self.queued: list[tuple[str, UserView]] = []  # messages sent while a reply streamed (or the model loaded), oldest first
        self._panel_timer = None
        self._reply_timer = None
        self.log_lines: list[tuple[str, str]] = []
        self.startup_notices: list[str] = []  # what loading the models had to say
        self._log_handler: LogHandler | None = None
        self._last_temperature = 0.7  # where "Greedy / sampling" goes back to
        self._setup_themes(theme, theme_dirs)
        if session is not None:
            self.take_session(session)
        else:
            self.sub_title = "loading the model…"

    def take_session(self, session: ChatSession) -> None:
        """What the app derives from its session (once it is loaded)."""
        self.session = session
        self.remote = session.info.remote
        if session.draft is None and "draft" in self.modes:
            self.unavailable["draft"] = "needs a separate draft model: start specchat with --draft MODEL"
        if session.info.engine == "llama.cpp":  # known before anyone presses the key
            from specchat.engine.drafters import TORCH_ONLY

            self.unavailable.update({mode: f"needs the torch engine (--engine torch): it {why}" for mode, why in TORCH_ONLY.items()})
        if session.info.engine == "lean":
            from specchat.engine.errors import NOT_ON_LEAN

            self.unavailable.update({mode: "builds on transformers' modules: --engine torch (or llama.cpp) runs it" for mode in NOT_ON_LEAN})
        try:  # the panel's speedups compare against plain rounds measured in-band, under the same load
            session.measure_baseline()
        except ModeUnavailable:
            pass
        self.snapshot = session.snapshot()
        # a long prompt reads for seconds before the first token: the reply says how far (posted from its thread)
        session.controls.on_prefill = lambda done, total: self.post_message(PrefillProgress(done, total))
        self.startup_notices += list(session.notices)
        self.sub_title = self.title_line()

    def title_line(self, width: int | None = None) -> str:
        """The header's second line: what runs the reply (the server configuration of a remote session), and how
        it samples. The settings always show; the names are cut in the middle to the width that is left (`width`:
        the terminal's, default the app's size)."""
        session, info = self.session, self.session.info
        s = session.controls.sampling
        sampling = "greedy" if s.greedy else f"T={s.temperature:g}" + (f" top-k {s.top_k}" if s.top_k else "") + (
            f" top-p {s.top_p:g}" if s.top_p < 1 else "")
        # the header shows "title — subtitle" between its icon (8 columns) and the space on its right (10)
        room = max(width or self.size.width, 40) - 18 - len(f"{self.title} — ")
        if info.remote:
            label = info.server.label
            return f"{label} · {shorten(info.server.url, max(12, room - len(label) - len(sampling) - 6))} · {sampling}"
        kernel = {"fused": "fused kernel", "llama.cpp": "llama.cpp", "blocks": "lean"}.get(info.kernel)
        # a GGUF file's name without its suffix: the type (Q4_K_M) says it
        names = [Path(m.name).name.removesuffix(".gguf") for m in (session.target, session.draft) if m is not None]
        where = " ".join(x for x in (info.device, info.dtype, kernel) if x)
        if len(" + ".join(names)) + len(where) + len(sampling) + 6 > room:  # narrow: the weights' type alone
            where = info.dtype
        settings = " · ".join(x for x in (where, sampling) if x)
        return f"{fit_names(names, room - len(settings) - 3)} · {settings}"

    def on_resize(self, event: events.Resize) -> None:
        if self.session is not None:  # the event's size: the app's own may not have followed yet
            self.sub_title = self.title_line(event.size.width)

    # ------------------------------------------------------------------ setup
    def _setup_themes(self, name: str | None, dirs: list[Path] | None) -> None:
        loaded = load_themes(dirs)
        for theme in loaded.themes.values():
            self.register_theme(theme)
        self.startup_notices += loaded.problems
        wanted = name or DEFAULT_THEME
        if wanted not in self.available_themes:
            fallback = DEFAULT_THEME if DEFAULT_THEME in self.available_themes else FALLBACK_THEME
            if name is not None or wanted != DEFAULT_THEME:
                self.startup_notices.append(f"theme {wanted!r} is not available; using {fallback!r}")
            wanted = fallback
        self.theme = wanted

    def get_theme_variable_defaults(self) -> dict[str, str]:
        return token_defaults(self.current_theme)

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="◆")
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield Conversation(id="conversation").data_bind(streaming=SpecChatApp.generating)
                yield Inspector(id="inspector")
                yield Legend(id="legend").data_bind(SpecChatApp.show_rejected)
                # select_on_focus off: coming back to the input must not select the draft, or the next key replaces it
                yield Input(placeholder="Message  (Enter sends · F1: keys)", id="prompt", select_on_focus=False)
            with Vertical(id="side"):
                yield StatsPanel(self.modes, id="stats-panel")
        yield Footer()

    def on_mount(self) -> None:
        self.show_earlier_messages()
        self.query_one(Conversation).anchor()
        self.query_one("#prompt", Input).focus()
        self.theme_changed_signal.subscribe(self, lambda _theme: self.refresh_panel())
        self.begin_capture_print(self, stdout=True, stderr=True)  # what loading prints (tqdm bars) goes to the log
        self._log_handler = LogHandler(self)
        logging.getLogger().addHandler(self._log_handler)
        logging.captureWarnings(True)
        route_transformers_logging(to_root=True)
        if self.session is not None:
            self.session_ready()
        else:
            self.query_one(Conversation).mount(StartupView(id="startup"))
            self.query_one(StatsPanel).show_loading()
            # a daemon thread, not a worker: quitting mid-load must not wait for a model to finish loading (run_chat)
            self.loader = threading.Thread(target=self.load_session, name="specchat-load", daemon=True)
            self.loader.start()
        loop = asyncio.get_running_loop()
        for sig in QUIT_SIGNALS:  # a terminal closed or a `kill`: end as ctrl+q does, saving the reply in progress
            loop.add_signal_handler(sig, lambda sig=sig: self.run_worker(self.quit_on_signal(sig), group="signal"))

    def session_ready(self) -> None:
        self.query_one(Inspector).show_token(None, self.session.token_text)
        self.refresh_panel()
        for notice in self.startup_notices:
            self.warn(notice)
        self.startup_notices = []

    # ------------------------------------------------------------------ loading in the background
    def load_session(self) -> None:
        """The loading thread: build the session, reporting each stage; what stops it ends the app (run_chat says why)."""
        try:
            session = self.load(LoadProgress(self))
        except BaseException as e:  # a one-line UserError, Ctrl+C, or a bug: run_chat raises it once the app is gone
            self.post_message(SessionLoaded(error=e))
            return
        self.post_message(SessionLoaded(session))

    def on_load_stage(self, message: LoadStage) -> None:
        for view in self.query(StartupView):
            if message.seconds is None:
                view.begin(message.text)
            else:
                view.end(message.text, message.seconds)
                self.log_line(f"{message.text.rstrip('.…')}: {message.seconds:.1f} s")
        self.query_one(StatsPanel).show_loading(message.text if message.seconds is None else None)

    async def on_session_loaded(self, message: SessionLoaded) -> None:
        if message.error is not None:
            self.load_error = message.error
            self.exit(return_code=1)
            return
        self.take_session(message.session)
        for view in self.query(StartupView):
            await view.remove()
        self.log_line(f"ready: {self.sub_title}")
        self.session_ready()
        if self.queued:
            self.send_queued()
        else:
            self.notify("Ready.", timeout=2)

    async def quit_on_signal(self, sig: int) -> None:
        """Stop the reply (the decoder's thread saves the turn with its partial reply, as Esc does), wait for that
        save, then exit normally, which restores the terminal; exit status 128 + the signal, as shells report it."""
        self.quitting = True
        if self.generating:
            self.workers.cancel_group(self, "reply")
            deadline = asyncio.get_running_loop().time() + SIGNAL_SAVE_WAIT_S
            while self.generating and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
        self.exit(return_code=128 + sig)

    def on_unmount(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in QUIT_SIGNALS:
            loop.remove_signal_handler(sig)
        if self._log_handler is not None:
            logging.getLogger().removeHandler(self._log_handler)
            logging.captureWarnings(False)
            route_transformers_logging(to_root=False)

    # ------------------------------------------------------------------ notices and log
    def log_line(self, text: str, level: str = "info") -> None:
        self.log_lines.append((f"{datetime.now():%H:%M:%S} {text}", level))

    def warn(self, text: str, severity: str = "warning") -> None:
        """A notice the user sees now, also kept in the log view (F12)."""
        self.log_line(text, severity)
        self.notify(text, severity=severity, timeout=6)

    def on_print(self, event: events.Print) -> None:
        if event.text.strip():
            self.log_line(event.text.rstrip(), "error" if event.stderr else "info")

    def on_log_line(self, message: LogLine) -> None:
        self.log_line(message.text, message.level)

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            self.screen.dismiss()
        else:
            self.push_screen(HelpScreen(self.modes))

    def action_show_log(self) -> None:
        if isinstance(self.screen, LogScreen):
            self.screen.dismiss()
        else:
            self.push_screen(LogScreen(list(self.log_lines)))

    # ------------------------------------------------------------------ layout and focus
    def action_toggle_panel(self) -> None:
        self.panel_toggled = not self.panel_toggled

    def watch_panel_toggled(self, toggled: bool) -> None:
        """app.tcss shows or hides the chat and the panel from the -panel class and the width's breakpoint."""
        self.query_one("#main").set_class(toggled, "-panel")
        panel = self.query_one(StatsPanel)
        # the panel alone on screen takes the focus, so the arrow keys and PgUp/PgDn scroll it
        panel.can_focus = toggled and self.screen.has_class("-narrow")
        if panel.can_focus:
            panel.focus()
        else:
            self.query_one("#prompt", Input).focus()

    def on_key(self, event: events.Key) -> None:
        """Typing while the conversation has the focus goes to the message input: typed text never vanishes."""
        if not isinstance(self.focused, Conversation) or not (event.is_printable or event.key == "enter"):
            return
        prompt = self.query_one("#prompt", Input)
        prompt.focus()
        if event.is_printable and event.character:
            prompt.insert_text_at_cursor(event.character)
        event.stop()

    # ------------------------------------------------------------------ chat
    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            self.notify("Type a message first.", severity="information", timeout=3)
            return
        if self.generating or self.session is None:  # queued, shown as such, sent when the reply ends (or the model is ready)
            event.input.value = ""
            view = UserView(text, queued=True)
            if self.session is None:
                view.status = "queued: sent once the model is ready"
            self.queued.append((text, view))
            conversation = self.query_one(Conversation)
            conversation.mount(view)
            conversation.anchor()
            return
        try:
            self.session.check_message(text)
        except PromptTooLong as e:
            self.warn(f"Message not sent: {e}. The conversation is kept; shorten the message.", "error")
            return
        event.input.value = ""
        self.send(text)

    def send(self, text: str, view: UserView | None = None) -> None:
        """Start a reply to `text`; `view` is its queued message, already in the conversation."""
        conversation = self.query_one(Conversation)
        if view is None:
            view = UserView(text)
            conversation.mount(view)
        view.queued, view.status = False, ""
        self.reply_view = ReplyView(len(self.session.turns)).data_bind(SpecChatApp.show_rejected)
        earlier = len(self.session.messages) - (self.session.system is not None)
        if earlier and not self.session.turns:  # a resumed conversation: its first reply encodes all of it first
            self.reply_view.status = f"reading the {earlier} earlier messages first…"
        conversation.mount(self.reply_view, after=view)  # before any message queued after this one
        conversation.anchor()
        spare = self.remote or threads.spare_core()  # (a server decodes elsewhere)
        self.reply_interval = REPLY_INTERVAL_S if spare else SHARED_REPLY_INTERVAL_S
        self.panel_interval = PANEL_INTERVAL_S if spare else SHARED_PANEL_INTERVAL_S
        self.generating = True
        self.generate_reply(text)

    def send_queued(self) -> None:
        """After a reply: send the oldest queued message (one that no longer fits is marked and skipped)."""
        while self.queued and not self.generating and not self.quitting:
            text, view = self.queued.pop(0)
            try:
                self.session.check_message(text)
            except PromptTooLong as e:
                view.status = "not sent: too long"
                self.warn(f"Queued message not sent: {e}.", "error")
                continue
            self.send(text, view)

    @work(thread=True, exclusive=True, group="reply")
    def generate_reply(self, text: str) -> None:
        """The decoder's thread: iterate the session's rounds, post each one, stop when cancelled."""
        worker = get_current_worker()
        error = None
        try:
            # closing(): stopping early runs the session's finally block here, so the turn is recorded
            with closing(self.session.reply(text)) as rounds:
                for record in rounds:
                    if self.rounds.put(record):
                        self.post_message(RoundsDone())
                    if worker.is_cancelled:
                        break
        except PromptTooLong as e:
            error = f"Message not sent: {e}"
        except Exception as e:  # a failed reply must not take the app (and the conversation) down
            logging.getLogger("specchat").error("generation failed:\n%s", traceback.format_exc())
            error = f"Generation failed: {type(e).__name__}: {e} (details in the log, F12)"
        self.post_message(ReplyFinished(worker.is_cancelled, error, self.save_conversation()))

    def save_conversation(self) -> str | None:
        """Save the conversation after a turn (finished, stopped or failed), from the decoder's thread, before
        the UI hears of it: a crash or a kill afterwards cannot lose the turn. Returns why saving failed."""
        if self.conversation is None:
            return None
        try:
            self.conversation.save(self.session)
        except Exception as e:  # a full disk must not end the chat
            logging.getLogger("specchat").error("saving the conversation failed:\n%s", traceback.format_exc())
            return f"The conversation could not be saved to {self.conversation.path}: {e}"
        return None

    def on_rounds_done(self, message: RoundsDone) -> None:
        """Rounds are queued: the reply takes them when it redraws (at most one message per redraw)."""
        if self._reply_timer is None:
            self._reply_timer = self.set_timer(self.reply_interval, self.redraw_reply)
        if self._panel_timer is None:
            self._panel_timer = self.set_timer(self.panel_interval, self.refresh_panel)

    def on_prefill_progress(self, message: PrefillProgress) -> None:
        if self.reply_view is not None and self.generating and message.done < message.total:
            self.reply_view.status = f"reading the prompt: {message.done:,} of {message.total:,} tokens…"

    def redraw_reply(self) -> None:
        """Draw the rounds queued since the last redraw."""
        self._reply_timer = None
        records = self.rounds.take()
        if self.reply_view is not None:
            for record in records:
                if record.index == 0 and self.reply_view.status:
                    self.reply_view.status = ""  # the earlier messages are read
                self.reply_view.add_round(record, [self.session.token_text(t) for t in record.rejected])
            self.reply_view.redraw()

    def on_reply_finished(self, message: ReplyFinished) -> None:
        self.generating = False
        if self._reply_timer is not None:
            self._reply_timer.stop()
        self.redraw_reply()
        if self.reply_view is not None:
            turn = self.session.turns[-1] if self.session.turns else None
            if self.remote and turn is not None and not message.stopped:  # vLLM's steps may have been relabelled
                self.reply_view.replace_rounds(turn.rounds)
            if message.error:
                self.reply_view.status = "error"
            elif message.stopped:
                self.reply_view.status = f"stopped · {len(self.reply_view.tokens)} tokens kept"
            elif turn is not None and turn.stop_reason not in (None, "eos"):
                self.reply_view.status = f"stopped at {turn.stop_reason.replace('_', ' ')}"
        if message.error:
            self.warn(message.error, "error")
        if message.save_error:
            self.warn(message.save_error, "error")
        if self.show_markdown and self.reply_view is not None:
            self.show_as_markdown(self.reply_view, True)
        self.refresh_panel()
        self.send_queued()

    def refresh_panel(self, *, retake: bool = True) -> None:
        """Redraw the panel from a fresh snapshot (a moment under the session's lock, at most every panel_interval
        while a reply streams), or from `self.snapshot` as it is (retake False)."""
        if self._panel_timer is not None:
            self._panel_timer.stop()
            self._panel_timer = None
        if self.session is None:  # still loading: the panel says so (on_load_stage)
            return
        if retake:
            self.snapshot = self.session.snapshot()
        for panel in self.query(StatsPanel):  # none while the app shuts down
            panel.show(self.snapshot, unavailable=self.unavailable, pending=self.pending_mode)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            return self.generating  # Esc appears in the footer only while a reply streams
        if self.session is None and action not in WHILE_LOADING:
            return None  # shown disabled until the model is ready
        return True

    def action_stop(self) -> None:
        if self.generating:
            self.workers.cancel_group(self, "reply")
            self.notify("Stopping after this round; the partial reply is kept.", timeout=3)

    # ------------------------------------------------------------------ modes
    def action_mode_key(self, index: int) -> None:
        """F2..F11: the session's index-th mode (a key past the last mode says so)."""
        modes = list(self.modes)
        if index >= len(modes):
            self.notify(f"F{index + 2}: no mode on this key ({len(modes)} modes: F2..F{len(modes) + 1})", timeout=3)
            return
        self.action_mode(modes[index])

    def action_mode(self, mode: str) -> None:
        if mode not in self.modes:
            self.warn(f"unknown mode {mode!r}")
            return
        if mode in self.unavailable:
            self.warn(f"{self.mode_keys[mode]} {mode}: {self.unavailable[mode]}")
            return
        if mode == self.session.mode and self.pending_mode is None:
            self.notify(f"Already in mode {mode}.", timeout=2)
            return
        self.pending_mode = mode
        self.refresh_panel()
        making = self.session.preparing(mode)
        if making:  # seconds of work: say what, also where the panel is hidden (narrow terminals)
            self.notify(f"Preparing mode {mode}: making {making}…", timeout=8)
        self.build_mode(mode)

    @work(thread=True, exclusive=True, group="mode")
    def build_mode(self, mode: str) -> None:
        """Build the drafter off the UI thread (a quantised or low-rank copy can take seconds)."""
        try:
            self.session.drafter(mode)
        except ModeUnavailable as e:
            self.post_message(ModeReady(mode, str(e)))
            return
        except Exception as e:
            logging.getLogger("specchat").error("building mode %s failed:\n%s", mode, traceback.format_exc())
            self.post_message(ModeReady(mode, f"building it failed: {type(e).__name__}: {e}"))
            return
        if not get_current_worker().is_cancelled:
            self.post_message(ModeReady(mode))

    def on_mode_ready(self, message: ModeReady) -> None:
        if message.mode != self.pending_mode:
            return  # the user pressed another mode key meanwhile
        self.pending_mode = None
        if message.error:
            self.unavailable[message.mode] = message.error
            self.warn(f"{self.mode_keys[message.mode]} {message.mode} is unavailable: {message.error}")
        else:
            self.session.set_mode(message.mode)  # cheap now: the drafter is built; the next round uses it
            when = (" from the next reply" if self.remote else " from the next round") if self.generating else ""
            self.notify(f"Mode {message.mode}{when}: {self.modes[message.mode]}", timeout=3)
            self.sub_title = self.title_line()
        self.refresh_panel()

    # ------------------------------------------------------------------ settings
    def action_draft_length(self, delta: int) -> None:
        controls = self.session.controls
        if controls.k is None:  # a server's draft length is its own setting
            self.warn("The draft length is the server's setting (llama-server: --spec-draft-n-max; it ignores a "
                      "request's); start another server for another K and switch to it")
            return
        measured = self.session.snapshot()
        if measured.k_measured:  # from the K it measured, fixed from now on
            controls.adaptive = None
        controls.k = max(K_RANGE[0], min(K_RANGE[1], measured.k + delta))
        self.notify(f"Draft length K = {controls.k}" + (" (fixed from now: it was measured)" if measured.k_measured else ""), timeout=2)
        self.refresh_panel()

    def set_sampling(self, **changes) -> None:
        """SamplingParams is frozen: swap in a new one; the loop reads it at the next round."""
        controls = self.session.controls
        try:
            controls.sampling = replace(controls.sampling, **changes)
        except ValueError as e:
            self.warn(str(e))
            return
        s = controls.sampling
        self.notify("Greedy decoding" if s.greedy else f"Sampling at temperature {s.temperature:g}", timeout=2)
        self.sub_title = self.title_line()
        self.refresh_panel()

    def action_temperature(self, delta: float) -> None:
        t = round(max(0.0, self.session.controls.sampling.temperature + delta), 2)
        self.set_sampling(temperature=t)

    def action_toggle_greedy(self) -> None:
        s = self.session.controls.sampling
        if s.greedy:
            self.set_sampling(temperature=self._last_temperature)
        else:
            self._last_temperature = s.temperature
            self.set_sampling(temperature=0.0)

    def action_toggle_rejected(self) -> None:
        if self.remote:
            self.notify("The server does not send the drafts it rejected (nor p or q): only how many it accepted", timeout=4)
            return
        self.show_rejected = not self.show_rejected
        self.notify("Showing rejected drafts inline" if self.show_rejected else "Hiding rejected drafts", timeout=2)

    def action_set_theme(self, name: str) -> None:
        self.theme = name

    # ------------------------------------------------------------------ conversation: earlier turns, system prompt, copy, Markdown
    def show_earlier_messages(self) -> None:
        """A resumed conversation (--continue, or opened from the palette) shows its earlier turns, also while the
        model loads; their token kinds were not saved."""
        if self.session is not None:
            messages = self.session.messages
        else:
            messages = self.conversation.messages if self.conversation is not None else []
        shown = [UserView(m["content"]) if m["role"] == "user" else SavedReply(m["content"])
                 for m in messages if m["role"] in ("user", "assistant")]
        if shown:
            self.query_one(Conversation).mount_all(shown)
            if self.show_markdown:
                for reply in shown:
                    if isinstance(reply, SavedReply):
                        self.show_as_markdown(reply, True)
            turns = sum(isinstance(w, UserView) for w in shown)
            self.notify(f"Continuing a conversation of {turns} turn{'s' if turns != 1 else ''}.", timeout=4)

    def action_open_conversation(self) -> None:
        """Palette: list the saved conversations, newest first, to replace this one with the chosen one."""
        if self.generating:
            self.notify("A reply is streaming: stop it (Esc) or wait, then open another conversation.",
                        severity="warning", timeout=4)
            return
        found = conversations()
        if not found:
            self.notify(f"No saved conversation in {conversations_dir()}.", severity="information", timeout=4)
            return
        current = self.conversation.path if self.conversation is not None else None
        self.push_screen(ConversationsScreen(found, current), self.open_conversation)

    async def open_conversation(self, path: Path | None) -> None:
        """Replace the conversation: the session continues the chosen one's messages, the view shows its turns,
        and the next turns are saved to its file. This one was saved after its last turn: nothing is lost."""
        if path is None:
            return
        if self.generating:
            self.notify("A reply is streaming: the conversation was not changed.", severity="warning", timeout=4)
            return
        if self.conversation is not None and path == self.conversation.path:
            self.notify("That is the conversation already open.", timeout=3)
            return
        try:
            log = ConversationLog.open(path)
        except ValueError as e:
            self.warn(str(e), "error")
            return
        log.first_turn = len(self.session.turns)  # the session's earlier turns belong to the previous conversation
        self.session.restore(log.messages)
        self.conversation = log
        self.reply_view = None
        conversation = self.query_one(Conversation)
        conversation.selection = None
        await conversation.remove_children()
        self.show_earlier_messages()
        conversation.anchor()
        self.log_line(f"opened the conversation {path}")
        self.refresh_panel()

    def action_edit_system(self) -> None:
        self.push_screen(SystemPromptScreen(self.session.system), self.set_system_prompt)

    def set_system_prompt(self, text: str | None) -> None:
        """None: the dialog was cancelled. A change re-encodes the conversation at the next turn: say so."""
        if text is None or text == (self.session.system or ""):
            return
        self.session.set_system(text or None)
        what = "System prompt set" if text else "System prompt removed"
        again = "; the next turn re-encodes the conversation (its prefix changed)" if self.session.turns else ""
        self.log_line(f"system prompt: {text!r}")
        self.notify(f"{what}{again}.", timeout=5)

    def reply_to_copy(self) -> str | None:
        """The reply whose token is selected (inspector), else the last finished reply."""
        selection = self.query_one(Conversation).selection
        if selection is not None:
            return selection[0].text
        replies = [m["content"] for m in self.session.messages if m["role"] == "assistant"]
        return replies[-1] if replies else None

    def action_copy_reply(self) -> None:
        text = self.reply_to_copy()
        if not text:
            self.notify("No reply to copy yet.", severity="information", timeout=3)
            return
        self.copy_to_clipboard(text)
        self.notify(f"Copied the reply ({len(text)} characters) to the clipboard.", timeout=3)

    def action_toggle_markdown(self) -> None:
        self.show_markdown = not self.show_markdown
        self.notify("Finished replies as Markdown" if self.show_markdown else "Replies as coloured tokens", timeout=2)

    def watch_show_markdown(self, on: bool) -> None:
        streaming = self.reply_view if self.generating else None
        for reply in [*self.query(ReplyView), *self.query(SavedReply)]:
            if reply is not streaming:  # a streaming reply keeps its tokens; it turns to Markdown when it ends
                self.show_as_markdown(reply, on)

    def show_as_markdown(self, reply: ReplyView | SavedReply, on: bool) -> None:
        """Swap a reply and its Markdown twin (made the first time); the token view stays, hidden, one key away."""
        twin = next((m for m in self.query(MarkdownReply) if m.reply is reply), None)
        if on and twin is None:
            twin = MarkdownReply(reply)
            self.query_one(Conversation).mount(twin, after=reply)
        if twin is not None:
            twin.display = on
        reply.display = not on

    # ------------------------------------------------------------------ export
    def action_export(self) -> None:
        path = self.export_path or default_export_path()
        try:
            json_path, csv_path = write_export(self.session, path)
        except OSError as e:
            self.warn(f"Export failed: {e}", "error")
            return
        md_path = markdown_path(json_path)
        self.log_line(f"exported {json_path}, {csv_path} and {md_path}")
        self.notify(f"Exported {json_path.name}, {csv_path.name} and {md_path.name} to {json_path.parent}", timeout=5)

    # ------------------------------------------------------------------ inspector
    def on_conversation_token_selected(self, message: Conversation.TokenSelected) -> None:
        self.query_one(Inspector).show_token(message.token, self.session.token_text)
        if message.token is None:  # the inspector closed (Esc): back to typing
            self.query_one("#prompt", Input).focus()

    # ------------------------------------------------------------------ command palette
    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        def key(action: str) -> str:
            return key_label(ACTION_KEYS[action][0])

        if self.session is None:  # loading: only what needs no model
            yield SystemCommand(f"Keys ({key('help')})", "Every key and command", self.action_help)
            yield SystemCommand(f"Show log ({key('show_log')})", "Loading stages, warnings and messages from the models", self.action_show_log)
            yield from self.textual_commands(screen)
            return
        for mode, mode_key in self.mode_keys.items():
            note = f" (unavailable: {self.unavailable[mode]})" if mode in self.unavailable else ""
            yield SystemCommand(f"Mode: {mode} ({mode_key})", self.modes[mode] + note, lambda m=mode: self.action_mode(m))
        yield SystemCommand(f"Keys ({key('help')})", "Every key and command", self.action_help)
        yield SystemCommand(f"Stop reply ({key('stop')})", "Stop the streaming reply; keep what was generated",
                            self.action_stop)
        yield SystemCommand(f"Export session ({key('export')})", "Write the session as JSON, CSV and Markdown", self.action_export)
        yield SystemCommand(f"Copy reply ({key('copy_reply')})", "Copy the selected reply, else the last one, to the clipboard",
                            self.action_copy_reply)
        yield SystemCommand(f"Toggle Markdown ({key('toggle_markdown')})",
                            "Show finished replies as Markdown, or as coloured tokens", self.action_toggle_markdown)
        yield SystemCommand("Open an earlier conversation…", "Continue a saved conversation (newest first) instead of this one",
                            self.action_open_conversation)
        system = self.session.system
        yield SystemCommand("System prompt", f"Edit it (now: {system!r})" if system else "Set a system message (none now)",
                            self.action_edit_system)
        yield SystemCommand(f"Toggle rejected drafts ({key('toggle_rejected')})",
                            "Show or hide draft tokens the target rejected", self.action_toggle_rejected)
        yield SystemCommand(f"Toggle panel ({key('toggle_panel')})",
                            "Show or hide the statistics (narrow terminals: switch chat and panel)", self.action_toggle_panel)
        yield SystemCommand(f"Show log ({key('show_log')})", "Warnings and messages from the models", self.action_show_log)
        yield SystemCommand("Draft length up", "K + 1 from the next round", lambda: self.action_draft_length(1))
        yield SystemCommand("Draft length down", "K - 1 from the next round", lambda: self.action_draft_length(-1))
        yield SystemCommand("Temperature up", f"+{TEMPERATURE_STEP} from the next round",
                            lambda: self.action_temperature(TEMPERATURE_STEP))
        yield SystemCommand("Temperature down", f"-{TEMPERATURE_STEP} from the next round (0 is greedy)",
                            lambda: self.action_temperature(-TEMPERATURE_STEP))
        yield SystemCommand("Greedy / sampling", "Toggle greedy decoding and sampling", self.action_toggle_greedy)
        for name in ("dark", "light", "colorblind"):
            if name in self.available_themes:
                yield SystemCommand(f"Theme: {name}", f"Switch to the {name} theme", lambda n=name: self.action_set_theme(n))
        yield from self.textual_commands(screen)

    def textual_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """Textual's own commands but its "Keys" panel: ours ("Keys (F1)") lists every key and command."""
        return (command for command in super().get_system_commands(screen) if command.title != "Keys")


def run_chat(session: ChatSession | None = None, *, load: Callable[[object], ChatSession] | None = None, theme: str | None = None,
             export_path: Path | None = None, conversation: ConversationLog | None = None) -> None:
    """Run the chat app on a session, or on one `load` builds while the app is on screen, saving every turn (in a
    new conversation file unless one is given); on exit (also after a crash) write the export if asked."""
    app = SpecChatApp(session, load=load, theme=theme, export_path=export_path, conversation=conversation or ConversationLog())
    saved = True
    try:
        app.run()
    finally:
        if export_path is not None and app.session is not None:  # written even after a crash; an unwritable path falls back to the data folder
            line, saved = save_export(app.session, Path(export_path))
            print(f"specchat: {line}", file=sys.stdout if saved else sys.stderr)
    if app.load_error is not None:  # the one line of a UserError (or Ctrl+C's), now that the terminal is back
        raise app.load_error
    if export_path is not None and app.session is None:
        print("specchat: no export: the chat ended before the model was ready", file=sys.stderr)
    if app.loader is not None and app.loader.is_alive():  # quit mid-load: nothing was said yet, nothing to save
        end_now(app.return_code or 0)
    if not saved:  # neither the path nor the fallback took the export: not a success
        raise SystemExit(1)
    if app.return_code:  # ended by SIGTERM or SIGHUP (after saving): 128 + the signal
        raise SystemExit(app.return_code)


def end_now(code: int) -> None:
    """Exit at once, leaving the loading thread where it is: at interpreter shutdown a thread inside torch's import
    or a model load can hang the exit or crash it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
