"""The dialog that edits the system prompt (palette: "System prompt")."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label


class SystemPromptScreen(ModalScreen[str | None]):
    """Enter returns the new text ("" removes the system message), Esc returns None (nothing changes)."""

    DEFAULT_CSS = """
    SystemPromptScreen { align: center middle; }
    SystemPromptScreen > Vertical { width: 80%; max-width: 100; height: auto; padding: 1 2; background: $surface;
                                    border: thick $primary; }
    SystemPromptScreen Label { width: 1fr; color: $text-muted; }
    """
    BINDINGS = [Binding("escape", "dismiss(None)", "cancel", id="system.cancel")]

    def __init__(self, current: str | None) -> None:
        super().__init__()
        self.current = current or ""

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("System prompt · Enter applies (empty removes it) · Esc cancels")
            yield Input(value=self.current, placeholder="e.g. You are a concise assistant.", id="system-input")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()  # not the chat's message input
        self.dismiss(event.value.strip())
