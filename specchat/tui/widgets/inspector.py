"""The token inspector: how the selected token was produced and what else the models considered."""

from __future__ import annotations

import math
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
        head.append(f"id {token.id}\n" if token.id >= 0 else "id not sent\n", style="dim")
        head.append(f"{token.kind}", style="bold")
        head.append(f" — {KIND_HELP[token.kind]}\n", style="dim")
        head.append(f"round {token.round}  position {token.position}\n")
        if math.isnan(token.p):  # a serving engine's token: the kind comes from its step counters, nothing more
            head.append("p, q, the alternatives and the rejected drafts: the server does not send them", style="dim")
            self.update(head)
            return
        head.append(f"p(x) {token.p:.4f}   q(x) {fmt(token.q, '.4f')}   accept {fmt(token.accept_prob, '.3f')}")
        if token.p_raw is not None:  # greedy makes p one-hot: what the model itself thought
            head.append(f"\nmodel at T=1: p(x) {token.p_raw:.4f}", style="dim")
        # the alternatives under the model's own distribution when the events carry it (warped p is one-hot
        # when greedy), never zero-probability fillers
        target_alts, target_title = (token.top_raw, "target at T=1") if token.top_raw else (token.top_p, "top under p")
        columns = [(target_title, [a for a in target_alts if a[1] > 0]), ("top under q", [a for a in token.top_q if a[1] > 0])]
        table = Table(box=None, padding=(0, 1), show_edge=False)
        for title, _ in columns:
            table.add_column(title, no_wrap=True, overflow="ellipsis")
            table.add_column("", justify="right", no_wrap=True)
        for i in range(max(len(alts) for _, alts in columns)):
            cells = []
            for _, alts in columns:
                if i < len(alts):
                    tid, prob = alts[i]
                    mark = "bold" if tid == token.id else ""
                    cells += [Text(visible(decode(tid)), style=mark), f"{prob:.4f}"]
                else:
                    cells += ["", ""]
            table.add_row(*cells)
        if not token.top_q:
            table.columns[2].header = "q: no draft here"
        self.update(Group(head, table))
