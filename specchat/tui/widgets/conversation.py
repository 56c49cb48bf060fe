"""The scrolling chat, and the keyboard's way through its tokens."""

from __future__ import annotations

from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.geometry import Region, Spacing
from textual.message import Message
from textual.reactive import var

from specchat.engine.events import TokenEvent
from specchat.tui.widgets.reply import ReplyView


class Conversation(VerticalScroll, can_focus=True):
    """The scrolling chat. When focused, the arrow keys walk the tokens of the replies for the inspector."""

    DEFAULT_CSS = """
    Conversation { height: 1fr; padding: 0 1; }
    Conversation:focus { border-left: thick $accent; }
    """
    BINDINGS = [
        Binding("left", "step(-1)", "prev token", show=False, id="inspect.prev"),
        Binding("right", "step(1)", "next token", show=False, id="inspect.next"),
        Binding("up", "line(-1)", "line up", show=False, id="inspect.line_up"),
        Binding("down", "line(1)", "line down", show=False, id="inspect.line_down"),
        Binding("home", "edge(0)", "first token", show=False, id="inspect.first"),
        Binding("end", "edge(-1)", "last token", show=False, id="inspect.last"),
        Binding("escape", "clear_selection", "close inspector", id="inspect.close"),
    ]

    # true while a reply streams: Esc then stops the reply instead of closing the inspector
    streaming = var(False, bindings=True)
    selection: var[tuple[ReplyView, int] | None] = var(None, init=False, bindings=True)

    class TokenSelected(Message):
        """A token was selected (reply and token are None when the selection is cleared)."""

        def __init__(self, reply: ReplyView | None, token: TokenEvent | None) -> None:
            super().__init__()
            self.reply, self.token = reply, token

    @property
    def replies(self) -> list[ReplyView]:
        return list(self.query(ReplyView))

    def select(self, reply: ReplyView, token: int) -> None:
        if 0 <= token < len(reply.tokens):
            self.selection = (reply, token)

    def watch_selection(self, old: tuple[ReplyView, int] | None, new: tuple[ReplyView, int] | None) -> None:
        """Move the highlight between replies and tell the app, which shows the token in the inspector."""
        if old is not None and (new is None or old[0] is not new[0]):
            old[0].selected = None
        if new is None:
            self.post_message(self.TokenSelected(None, None))
            return
        reply, token = new
        reply.selected = token
        self.post_message(self.TokenSelected(reply, reply.tokens[token]))
        self.call_after_refresh(self.reveal_selection)  # after the inspector has taken its place below the chat

    def reveal_selection(self) -> None:
        """Scroll the selected token's line into view (the inspector describes a token the user can see), with a
        line of context around it; a long reply scrolls to the token, not to the reply's top."""
        if self.selection is None:
            return
        reply, token = self.selection
        row = reply.token_row(token)
        if row is None:
            return
        where = reply.virtual_region
        self.scroll_to_region(Region(where.x, where.y + row, where.width, 1), spacing=Spacing(1, 0, 1, 0), animate=False)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "clear_selection":  # while streaming Esc goes on to the app (stop the reply)
            return not self.streaming
        return True

    def action_clear_selection(self) -> None:
        """Close the inspector; the app then gives the focus back to the message input."""
        if self.selection is None:
            self.post_message(self.TokenSelected(None, None))
        self.selection = None

    def on_reply_view_selected(self, message: ReplyView.Selected) -> None:
        message.stop()
        self.select(message.reply, message.token)

    def _visible_tokens(self, reply: ReplyView) -> list[int]:
        return [i for i, t in enumerate(reply.tokens) if t.text]

    def action_step(self, delta: int) -> None:
        replies = [r for r in self.replies if self._visible_tokens(r)]
        if not replies:
            return
        if self.selection is None or self.selection[0] not in replies:
            reply = replies[-1]
            self.select(reply, self._visible_tokens(reply)[-1 if delta < 0 else 0])
            return
        reply, token = self.selection
        order = [(r, i) for r in replies for i in self._visible_tokens(r)]
        here = next((n for n, (r, i) in enumerate(order) if r is reply and i >= token), 0)
        target = order[max(0, min(len(order) - 1, here + delta))]
        self.select(*target)

    def action_line(self, delta: int) -> None:
        """The token on the line above or below, nearest the same column; across replies at their edges."""
        replies = [r for r in self.replies if self._visible_tokens(r)]
        if self.selection is None or self.selection[0] not in replies:
            self.action_step(delta)
            return
        reply, token = self.selection
        lines = reply.token_lines()
        row = next((i for i, line in enumerate(lines) if any(t == token for _, t in line)), None)
        if row is None:
            return
        x = next(x for x, t in lines[row] if t == token)
        if 0 <= row + delta < len(lines):
            target = lines[row + delta]
        else:
            index = replies.index(reply) + delta
            if not 0 <= index < len(replies):
                return
            reply = replies[index]
            lines = reply.token_lines()
            if not lines:
                return
            target = lines[0] if delta > 0 else lines[-1]
        nearest = min(target, key=lambda xt: (abs(xt[0] - x), xt[0]))
        self.select(reply, nearest[1])

    def action_edge(self, which: int) -> None:
        reply = self.selection[0] if self.selection else (self.replies or [None])[-1]
        if reply is not None and self._visible_tokens(reply):
            self.select(reply, self._visible_tokens(reply)[which])
