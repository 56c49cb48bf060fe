"""A user's message and the assistant's coloured reply."""

from __future__ import annotations

from dataclasses import dataclass

from textual.content import Content
from textual.geometry import Region
from textual.message import Message
from textual.reactive import reactive
from textual.style import Style
from textual.widget import Widget
from textual.widgets import Markdown

from specchat.engine.events import RoundRecord, TokenEvent
from specchat.tui.widgets.tokens import KINDS, token_css


@dataclass
class Span:
    text: str
    kind: str
    token: int | None  # index into ReplyView.tokens; None for a rejected draft


class ReplyView(Widget):
    """One assistant reply: spans of (text, kind), each token clickable for the inspector.

    Rounds are appended as they arrive; only this reply re-renders, never the whole conversation.
    """

    COMPONENT_CLASSES = {f"token--{kind}" for kind in KINDS} | {"token--selected", "reply--status"}
    DEFAULT_CSS = (
        """
    ReplyView { height: auto; padding: 0 1 1 1; }
    ReplyView > .token--selected { text-style: reverse; }
    ReplyView > .reply--status { color: $text-muted; text-style: italic; }
    """
        + token_css("ReplyView")
    )

    show_rejected = reactive(False, layout=True)  # rejected drafts inline (ctrl+r): the height changes
    selected: reactive[int | None] = reactive(None)  # the token the inspector shows
    status = reactive("", layout=True)  # why the reply ended early, after its text

    class Selected(Message):
        def __init__(self, reply: "ReplyView", token: int) -> None:
            super().__init__()
            self.reply, self.token = reply, token

    def __init__(self, turn: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.auto_links = False  # tokens are clickable, but should not look like links
        self.turn = turn
        self.tokens: list[TokenEvent] = []
        self.spans: list[Span] = []
        self._click: list[Style] = []  # per token: the style that makes it clickable
        self._parts: list[tuple[str, Style]] = []
        self._parts_done = 0
        self._parts_key: tuple | None = None
        self._height: int | None = None

    def add_round(self, record: RoundRecord, rejected_texts: list[str]) -> None:
        """Append a round's tokens; its rejected drafts go where the target disagreed (after the accepted ones)."""
        cut = min(record.accepted, len(record.tokens))
        for i, token in enumerate(record.tokens):
            if i == cut:
                self.spans += [Span(text, "rejected", None) for text in rejected_texts]
            self.tokens.append(token)
            self._click.append(Style.from_meta({"@click": f"select_token({len(self.tokens) - 1})"}))
            self.spans.append(Span(token.text, token.kind, len(self.tokens) - 1))
        if cut >= len(record.tokens):
            self.spans += [Span(text, "rejected", None) for text in rejected_texts]
        # no refresh here: the app redraws replies on a short timer, so fast rounds cost one redraw

    def replace_rounds(self, rounds: list[RoundRecord]) -> None:
        """Show these rounds instead (a serving engine's steps, relabelled once its final metrics came)."""
        self.tokens, self.spans, self._click = [], [], []
        self._parts, self._parts_done, self._parts_key = [], 0, None
        for record in rounds:
            self.add_round(record, [])
        self.redraw()

    def redraw(self) -> None:
        """Redraw after new rounds; a layout pass (costly: the whole screen) only when the height changed."""
        width = self.content_region.width or self.size.width
        height = self.render().get_height(self.styles, width) if width > 0 else None
        grew = height is None or height != self._height
        self._height = height
        self.refresh(layout=grew)

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)

    def render(self) -> Content:
        """Styled parts are built once per span and kept: a round only converts its own spans.

        They are rebuilt only when what they depend on changes (theme, selection, ctrl+r).
        """
        styles = {kind: Style.from_rich_style(self.get_component_rich_style(f"token--{kind}", partial=True)) for kind in KINDS}
        selected = Style.from_rich_style(self.get_component_rich_style("token--selected", partial=True))
        key = (tuple(styles.values()), selected, self.selected, self.show_rejected)
        if key != self._parts_key:
            self._parts_key, self._parts, self._parts_done = key, [], 0
        for span in self.spans[self._parts_done :]:
            if span.kind == "rejected":
                if self.show_rejected and span.text:
                    self._parts.append((span.text.replace("\n", "↵"), styles["rejected"]))
                continue
            style = styles[span.kind] + self._click[span.token]
            if span.token == self.selected:
                style = style + selected
            self._parts.append((span.text, style))
        self._parts_done = len(self.spans)
        parts: list = list(self._parts) or [("…", Style(dim=True))]
        if self.status:
            status = Style.from_rich_style(self.get_component_rich_style("reply--status", partial=True))
            parts.append((f"  [{self.status}]", status))
        return Content.assemble(*parts)

    def token_lines(self) -> list[list[tuple[int, int]]]:
        """Per line on screen, (x, token index) of each token drawn there, read from the rendered lines' click
        metadata: wrapping is Textual's, so up/down follow what the user sees."""
        lines = []
        for strip in self.render_lines(Region(0, 0, self.size.width, self.size.height)):
            x, line = 0, []
            for segment in strip:
                click = (segment.style.meta.get("@click", "") if segment.style else "") or ""
                if click.startswith("select_token("):
                    token = int(click[len("select_token("):-1])
                    if not line or line[-1][1] != token:
                        line.append((x, token))
                x += segment.cell_length
            if line:
                lines.append(line)
        return lines

    def token_row(self, token: int) -> int | None:
        """The line on screen (from the widget's top) where `token` is drawn."""
        for row, strip in enumerate(self.render_lines(Region(0, 0, self.size.width, self.size.height))):
            for segment in strip:
                if segment.style and (segment.style.meta.get("@click") or "") == f"select_token({token})":
                    return row
        return None

    def action_select_token(self, token: int) -> None:
        self.post_message(self.Selected(self, token))


class UserView(Widget):
    """A user's message; one sent while a reply streams says it is queued until it is sent."""

    DEFAULT_CSS = """
    UserView { height: auto; padding: 0 1; margin-bottom: 1; color: $text; background: $boost; border-left: thick $primary; }
    UserView.-queued { border-left: thick $secondary; }
    UserView > .user--status { color: $text-muted; text-style: italic; }
    """
    COMPONENT_CLASSES = {"user--status"}

    queued = reactive(False, layout=True)
    status = reactive("", layout=True)  # e.g. why a queued message was not sent

    def __init__(self, text: str, *, queued: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.text = text
        self.set_reactive(UserView.queued, queued)  # no watcher before mounting: set its class here
        self.set_class(queued, "-queued")

    def watch_queued(self, queued: bool) -> None:
        self.set_class(queued, "-queued")

    def render(self) -> Content:
        note = (self.status or "queued: sent when this reply finishes") if self.queued else self.status
        if not note:
            return Content(self.text)
        style = Style.from_rich_style(self.get_component_rich_style("user--status", partial=True))
        return Content.assemble(self.text, (f"  [{note}]", style))


class SavedReply(Widget):
    """A reply from a saved conversation (--continue): only its text was saved, not how each token was made."""

    DEFAULT_CSS = """
    SavedReply { height: auto; padding: 0 1 1 1; color: $text-muted; }
    """

    def __init__(self, text: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.text = text

    def render(self) -> Content:
        return Content(self.text or "…")


class MarkdownReply(Markdown):
    """A finished reply rendered as Markdown (code blocks highlighted), shown in place of its reply (ctrl+o)."""

    DEFAULT_CSS = """
    MarkdownReply { height: auto; margin: 0; padding: 0 1 1 1; background: transparent; }
    """

    def __init__(self, reply: Widget, **kwargs) -> None:
        super().__init__(reply.text, **kwargs)
        self.reply = reply
