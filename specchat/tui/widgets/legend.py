"""What the token colours mean."""

from __future__ import annotations

from textual.content import Content
from textual.reactive import reactive
from textual.style import Style
from textual.widget import Widget

from specchat.tui.keys import ACTION_KEYS, key_label
from specchat.tui.widgets.tokens import KINDS, token_css


class Legend(Widget):
    """What the colours mean, drawn with the same styles as the tokens."""

    COMPONENT_CLASSES = {f"token--{kind}" for kind in KINDS}
    DEFAULT_CSS = "Legend { height: auto; padding: 0 1; color: $text-muted; }\n" + token_css("Legend")

    show_rejected = reactive(False)  # bound to the app's ctrl+r toggle

    def render(self) -> Content:
        parts: list = []
        for kind in KINDS:
            if kind == "rejected" and not self.show_rejected:
                parts.append(f"{key_label(ACTION_KEYS['toggle_rejected'][0])}: rejected drafts  ")
                continue
            style = Style.from_rich_style(self.get_component_rich_style(f"token--{kind}", partial=True))
            parts += [("■ " if kind != "rejected" else "", style), (kind, style), "  "]
        parts.append("· click a token to inspect")
        return Content.assemble(*parts)
