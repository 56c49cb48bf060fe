"""The dialog a first start shows before it writes gigabytes into the user cache (a GGUF converted for torch): what
it will convert, how big, and yes or no (cli/options.ask_before_writing asks; --yes skips it)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label


class ConsentScreen(ModalScreen[bool]):
    """y or Enter on "Convert" returns True; n, Esc or "Quit" returns False (the chat then ends, nothing converted)."""

    DEFAULT_CSS = """
    ConsentScreen { align: center middle; }
    ConsentScreen > Vertical { width: 80%; max-width: 100; height: auto; padding: 1 2; background: $surface;
                               border: thick $warning; }
    ConsentScreen #consent-question { width: 1fr; margin-bottom: 1; }
    ConsentScreen .hint { width: 1fr; color: $text-muted; }
    ConsentScreen Horizontal { height: auto; align-horizontal: right; }
    ConsentScreen Button { margin-left: 2; }
    """
    BINDINGS = [
        Binding("y", "answer(True)", "convert", id="consent.yes"),
        Binding("n,escape", "answer(False)", "quit", id="consent.no"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question, id="consent-question", markup=False)  # a file name may hold [brackets]
            yield Label("y converts and starts · n or Esc quits, nothing written · --yes skips this question", classes="hint")
            with Horizontal():
                yield Button("Quit (n)", id="consent-no")
                yield Button("Convert (y)", id="consent-yes", variant="warning")

    def on_mount(self) -> None:
        self.query_one("#consent-no", Button).focus()  # Enter alone never writes gigabytes

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id == "consent-yes")
