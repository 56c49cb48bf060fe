"""The log view (ctrl+l or F12) and what feeds it: nothing is written over the chat screen.

Log records and Python warnings reach the app as LogLine messages (posted, so any thread may log);
transformers' own stderr handler is swapped for propagation to the root logger while the app runs.
"""

from __future__ import annotations

import logging
import sys

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import RichLog

from specchat.tui.messages import LogLine


class LogScreen(ModalScreen):
    """Warnings, captured prints and log records, as they were when the view opened."""

    DEFAULT_CSS = """
    LogScreen { align: center middle; }
    LogScreen > RichLog { width: 90%; height: 80%; border: round $primary; background: $surface; }
    """
    BINDINGS = [Binding("escape,f12,ctrl+l", "dismiss", "close log", id="log.close")]

    def __init__(self, lines: list[tuple[str, str]]) -> None:
        super().__init__()
        self.lines = lines

    def compose(self) -> ComposeResult:
        log = RichLog(wrap=True, markup=False, highlight=False)
        log.border_title = "log (Esc to close)"
        yield log

    def on_mount(self) -> None:
        log = self.query_one(RichLog)
        if not self.lines:
            log.write(Text("nothing logged yet", style="dim"))
        for text, level in self.lines:
            log.write(Text(text, style={"warning": "yellow", "error": "bold red"}.get(level, "")))


class LogHandler(logging.Handler):
    """Routes log records (and, through logging.captureWarnings, Python warnings) to the app as LogLine."""

    def __init__(self, app: App) -> None:
        super().__init__(logging.WARNING)
        self.app = app

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.app.post_message(LogLine(self.format(record), record.levelname.lower()))
        except Exception:  # never let logging break generation
            pass


def route_transformers_logging(to_root: bool) -> None:
    """transformers' handler holds the real stderr and would write over the screen: send its records to
    the root logger (and so to the log view) while the app runs. Only if the models loaded it: a remote session
    never imports transformers (importing it here took 0.7 s of the chat's start)."""
    if "transformers" not in sys.modules:
        return
    from transformers.utils import logging as hf_logging

    if to_root:
        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()
    else:
        hf_logging.disable_propagation()
        hf_logging.enable_default_handler()
