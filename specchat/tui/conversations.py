"""The dialog that lists the saved conversations (palette: "Open an earlier conversation…"), newest first."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from specchat.history import Summary

FIRST_MESSAGE_CHARS = 60


def describe(summary: Summary, current: bool = False) -> str:
    """One line: date, turns, the first message (on one line, shortened)."""
    first = " ".join(summary.first_message.split())
    if len(first) > FIRST_MESSAGE_CHARS:
        first = first[: FIRST_MESSAGE_CHARS - 1] + "…"
    turns = f"{summary.turns} turn{'s' if summary.turns != 1 else ''}"
    return f"{summary.date}  {turns:>9}  {first or '(no message)'}" + ("  (this one)" if current else "")


class ConversationsScreen(ModalScreen[Path | None]):
    """Enter (or a click) returns the chosen conversation's file, Esc returns None."""

    DEFAULT_CSS = """
    ConversationsScreen { align: center middle; }
    ConversationsScreen > Vertical { width: 90%; max-width: 110; height: auto; max-height: 80%; padding: 1 2;
                                     background: $surface; border: thick $primary; }
    ConversationsScreen Label { width: 1fr; color: $text-muted; }
    ConversationsScreen OptionList { height: auto; max-height: 20; }
    """
    BINDINGS = [Binding("escape", "dismiss(None)", "cancel", id="conversations.cancel")]

    def __init__(self, summaries: list[Summary], current: Path | None = None) -> None:
        super().__init__()
        self.summaries = summaries
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Open an earlier conversation · Enter opens · Esc cancels")
            yield OptionList(*(Option(describe(s, s.path == self.current), id=str(i)) for i, s in enumerate(self.summaries)),
                             id="conversations")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(self.summaries[int(event.option_id)].path)
