"""The token inspector: how the selected token was produced and what else the models considered."""

from __future__ import annotations

from typing import Callable

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from specchat.engine.events import TokenEvent
from specchat.fmt import fixed as fmt

KIND_HELP = {
    "accepted": "a draft token the target accepted",
    "resampled": "drawn from the residual max(0, p - q) after a rejection",
    "bonus": "the extra target token after a fully accepted block",
    "target": "plain decoding: one target step",
    "rejected": "a draft token the target rejected",
}


def visible(text: str) -> str:
    """A token's text with its whitespace made visible."""
    return repr(text)


class Inspector(Static):
    """Details of the selected token; hidden while nothing is selected."""

    DEFAULT_CSS = """
    Inspector { height: auto; max-height: 14; padding: 0 1; margin: 0 1; border: round $primary; display: none; }
    Inspector.-shown { display: block; }
    """

    def show_token(self, token: TokenEvent | None, decode: Callable[[int], str]) -> None:
        """`decode` turns the alternatives' ids into text (the session's tokenizer, passed in by the app)."""
        self.set_class(token is not None, "-shown")
        if token is None:
            self.update("")
            return
        self.border_title = "token inspector"
        head = Text()
        head.append(visible(token.text) + "  ", style="bold")
        head.append(f"id {token.id}\n", style="dim")
        head.append(f"{token.kind}", style="bold")
        head.append(f" — {KIND_HELP[token.kind]}\n", style="dim")
        head.append(f"round {token.round}  position {token.position}\n")
        head.append(f"p(x) {token.p:.4f}   q(x) {fmt(token.q, '.4f')}   accept {fmt(token.accept_prob, '.3f')}")
        table = Table(box=None, padding=(0, 1), show_edge=False)
        table.add_column("top under p", no_wrap=True, overflow="ellipsis")
        table.add_column("", justify="right", no_wrap=True)
        table.add_column("top under q", no_wrap=True, overflow="ellipsis")
        table.add_column("", justify="right", no_wrap=True)
        rows = max(len(token.top_p), len(token.top_q))
        for i in range(rows):
            cells = []
            for alts in (token.top_p, token.top_q):
                if i < len(alts):
                    tid, prob = alts[i]
                    mark = "bold" if tid == token.id else ""
                    cells += [Text(visible(decode(tid)), style=mark), f"{prob:.3f}"]
                else:
                    cells += ["", ""]
            table.add_row(*cells)
        if not token.top_q:
            table.columns[2].header = "q: no draft here"
        self.update(Group(head, table))
