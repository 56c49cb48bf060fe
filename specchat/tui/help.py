"""The key list (F1): every key and palette command in one place, built from keys.py so it never drifts."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from specchat.modes import MODES
from specchat.tui.keys import ACTION_KEYS, key_label, mode_keys

INSPECTOR_KEYS = [
    ("Tab", "focus the conversation to inspect tokens (or click a token)"),
    ("← →", "previous / next token"),
    ("↑ ↓", "the token a line up / down"),
    ("Home End", "first / last token of the reply"),
    ("Esc", "close the inspector and go back to typing"),
]
PALETTE_ONLY = "draft length K ±1, temperature ±0.1, greedy / sampling, themes"


def keys_table(modes: dict[str, str] = MODES) -> Group:
    """One titled table per section; the key column as narrow as its keys, so 80 columns leave room to read.
    `modes`: the session's (a remote session's are its server configurations)."""
    sections: list[tuple[str, list[tuple[str, str]]]] = [
        ("chat", [
            ("Enter", "send; while a reply streams, queue the message (sent when it finishes)"),
            *((" ".join(key_label(k) for k in keys.split(",")), what) for keys, _, what in ACTION_KEYS.values()),
            (key_label("ctrl+p"), f"command palette: every action, and {PALETTE_ONLY}"),
        ]),
        ("modes (from the next round, also mid-reply)",
         [(key_label(key), f"{mode}: {modes[mode]}") for mode, key in mode_keys(modes).items()]),
        ("token inspector", INSPECTOR_KEYS),
    ]
    width = max(len(key) for _, rows in sections for key, _ in rows)
    parts: list = []
    for title, rows in sections:
        table = Table(box=None, padding=(0, 1), show_header=False, expand=True)
        table.add_column(style="bold", no_wrap=True, width=width)
        table.add_column(ratio=1)
        for row in rows:
            table.add_row(*row)
        parts += [Text(title, style="bold underline"), table, Text("")]
    return Group(*parts[:-1])


class HelpScreen(ModalScreen):
    """The keys, scrollable (arrow keys, PgUp/PgDn) so the list fits any terminal."""

    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90%; max-width: 110; height: 90%; border: round $primary; background: $surface; }
    """
    BINDINGS = [Binding("escape,f1", "dismiss", "close", id="help.close")]

    def __init__(self, modes: dict[str, str] = MODES) -> None:
        super().__init__()
        self.modes = modes

    def compose(self) -> ComposeResult:
        scroll = VerticalScroll(Static(keys_table(self.modes)))
        scroll.border_title = "keys (Esc to close)"
        yield scroll

    def on_mount(self) -> None:
        self.query_one(VerticalScroll).focus()
