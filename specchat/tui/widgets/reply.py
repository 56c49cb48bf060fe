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

    @property
    def ends_line(self) -> bool:
        """A shown token ending in a newline: where a chunk may end (a rejected draft's newline is drawn as ↵)."""
        return self.kind != "rejected" and self.text.endswith("\n")


# A reply is drawn in chunks of whole lines: the last one grows with each round and re-renders; once it holds this many
# spans it closes at its last line end (a new chunk after it) and never re-renders as the reply goes on.
CHUNK_SPANS = 48


class ReplyView(Widget):
    """One assistant reply: spans of (text, kind), each token clickable for the inspector.

    Rounds are appended as they arrive and drawn on the app's timer, only in the reply's last chunk: redrawing a whole
    long reply on every frame took the CPU the decoder's threads need (benchmarks/chat_speed.py).
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

    show_rejected = reactive(False)  # rejected drafts inline (ctrl+r): every chunk redraws
    selected: reactive[int | None] = reactive(None)  # the token the inspector shows
    status = reactive("")  # why the reply ended early, after its text

    class Selected(Message):
        def __init__(self, reply: "ReplyView", token: int) -> None:
            super().__init__()
            self.reply, self.token = reply, token

    def __init__(self, turn: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.turn = turn
        self.tokens: list[TokenEvent] = []
        self.spans: list[Span] = []
        self._click: list[Style] = []  # per token: the style that makes it clickable

    def compose(self):
        yield ReplyChunk(self, 0)

    @property
    def chunks(self) -> list["ReplyChunk"]:
        return list(self.query_children(ReplyChunk))

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
        first, *rest = self.chunks
        for chunk in rest:
            chunk.remove()
        first.end = None  # a finished reply: one chunk holds it
        for record in rounds:
            self.add_round(record, [])
        first.redraw()

    def redraw(self) -> None:
        """Draw the rounds added since the last call: the last chunk redraws (closing at a line end once it is long,
        a new chunk after it), and a layout pass (costly: the whole screen) runs only where its height changed."""
        last = self.chunks[-1]
        if len(self.spans) - last.start >= CHUNK_SPANS:
            end = next((i + 1 for i in range(len(self.spans) - 1, last.start, -1) if self.spans[i].ends_line), None)
            if end is not None:
                last.end = end
                last.refresh(layout=True)
                last = ReplyChunk(self, end)
                self.mount(last)
        last.redraw()

    def refresh_chunks(self, layout: bool = False) -> None:
        for chunk in self.chunks:
            chunk.refresh(layout=layout)

    def watch_show_rejected(self) -> None:
        self.refresh_chunks(layout=True)

    def watch_selected(self) -> None:
        self.refresh_chunks()

    def watch_status(self) -> None:
        chunks = self.chunks
        if chunks:
            chunks[-1].refresh(layout=True)

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)

    def content(self, start: int = 0, end: int | None = None) -> Content:
        """Spans [start, end) styled, as a chunk draws them: without the newline a closed chunk ends with (the edge
        between chunks), and the reply's end (end None) with its status. content() is the whole reply."""
        styles = {kind: Style.from_rich_style(self.get_component_rich_style(f"token--{kind}", partial=True)) for kind in KINDS}
        selected = Style.from_rich_style(self.get_component_rich_style("token--selected", partial=True))
        parts: list[tuple[str, Style]] = []
        for span in self.spans[start:end]:
            if span.kind == "rejected":
                if self.show_rejected and span.text:
                    parts.append((span.text.replace("\n", "↵"), styles["rejected"]))
                continue
            style = styles[span.kind] + self._click[span.token]
            if span.token == self.selected:
                style = style + selected
            parts.append((span.text, style))
        if end is not None:
            text, style = parts[-1]
            parts[-1] = (text[:-1], style)
        elif start == 0 and not parts:
            parts.append(("…", Style(dim=True)))
        if end is None and self.status:
            status = Style.from_rich_style(self.get_component_rich_style("reply--status", partial=True))
            parts.append((f"  [{self.status}]", status))
        return Content.assemble(*parts)

    def token_lines(self) -> list[list[tuple[int, int]]]:
        """Per line on screen, (x, token index) of each token drawn there, read from the rendered lines' click
        metadata: wrapping is Textual's, so up/down follow what the user sees."""
        lines = []
        for chunk in self.chunks:
            for strip in chunk.render_lines(Region(0, 0, chunk.size.width, chunk.size.height)):
                x, line = 0, []
                for segment in strip:
                    token = clicked_token(segment)
                    if token is not None and (not line or line[-1][1] != token):
                        line.append((x, token))
                    x += segment.cell_length
                if line:
                    lines.append(line)
        return lines

    def token_row(self, token: int) -> int | None:
        """The line on screen (from the reply's top) where `token` is drawn."""
        top = self.styles.padding.top
        for chunk in self.chunks:
            for row, strip in enumerate(chunk.render_lines(Region(0, 0, chunk.size.width, chunk.size.height))):
                if any(clicked_token(segment) == token for segment in strip):
                    return top + row
            top += chunk.size.height
        return None

    def action_select_token(self, token: int) -> None:
        self.post_message(self.Selected(self, token))


def clicked_token(segment) -> int | None:
    """The token a rendered segment belongs to, from its click metadata (None: not a token)."""
    click = (segment.style.meta.get("@click", "") if segment.style else "") or ""
    return int(click[len("select_token("):-1]) if click.startswith("select_token(") else None


class ReplyChunk(Widget):
    """Spans [start, end) of a reply (end None: the growing last chunk), drawn as one Content. A closed chunk ends at a
    line end, so its lines are the ones the whole reply would wrap to, and it never redraws as the reply grows."""

    DEFAULT_CSS = "ReplyChunk { height: auto; }"

    def __init__(self, reply: ReplyView, start: int) -> None:
        super().__init__()
        self.auto_links = False  # tokens are clickable, but should not look like links
        self.reply, self.start = reply, start
        self.end: int | None = None
        self._height: int | None = None

    def render(self) -> Content:
        return self.reply.content(self.start, self.end)

    def redraw(self) -> None:
        """Redraw after new rounds; a layout pass only when the height changed."""
        width = self.content_region.width or self.size.width
        height = self.render().get_height(self.styles, width) if width > 0 else None
        grew = height is None or height != self._height
        self._height = height
        self.refresh(layout=grew)

    def action_select_token(self, token: int) -> None:
        """A click on a token (its segments' metadata name this widget's action)."""
        self.reply.action_select_token(token)


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
