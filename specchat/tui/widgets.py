"""The chat's widgets: coloured replies, the conversation, the statistics panel, the token inspector."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.binding import Binding
from textual.color import Color
from textual.containers import VerticalScroll
from textual.content import Content
from textual.message import Message
from textual.style import Style
from textual.widget import Widget
from textual.widgets import Static

from specchat.engine.drafters import MODES
from specchat.engine.events import RoundRecord, TokenEvent
from specchat.engine.metrics import Stats, measured_speedup
from specchat.fmt import fixed as fmt
from specchat.fmt import pct
from specchat.session import Snapshot
from specchat.tui.themes import TOKEN_KINDS as KINDS

KIND_HELP = {
    "accepted": "a draft token the target accepted",
    "resampled": "drawn from the residual max(0, p - q) after a rejection",
    "bonus": "the extra target token after a fully accepted block",
    "target": "plain decoding: one target step",
    "rejected": "a draft token the target rejected",
}
MODE_KEYS = {mode: f"F{i}" for i, mode in enumerate(MODES, start=2)}

TOKEN_CSS = "\n".join(
    f"{{owner}} > .token--{kind} {{{{ color: $token-{kind}; text-style: $token-{kind}-style; }}}}" for kind in KINDS
)


def token_css(owner: str) -> str:
    return TOKEN_CSS.format(owner=owner)


def visible(text: str) -> str:
    """A token's text with its whitespace made visible, for the inspector."""
    return repr(text)


# --------------------------------------------------------------------------- replies


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
        self.show_rejected = False
        self.selected: int | None = None
        self.status = ""
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

    def redraw(self) -> None:
        """Redraw after new rounds; a layout pass (costly: the whole screen) only when the height changed."""
        width = self.content_region.width or self.size.width
        height = self.render().get_height(self.styles, width) if width > 0 else None
        grew = height is None or height != self._height
        self._height = height
        self.refresh(layout=grew)

    def set_status(self, status: str) -> None:
        self.status = status
        self.refresh(layout=True)

    def select(self, token: int | None) -> None:
        self.selected = token
        self.refresh()

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)

    def render(self) -> Content:
        """Styled parts are built once per span and kept: a round only converts its own spans.

        They are rebuilt only when what they depend on changes (theme, selection, F10).
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

    def action_select_token(self, token: int) -> None:
        self.post_message(self.Selected(self, token))


class UserView(Static):
    DEFAULT_CSS = """
    UserView { padding: 0 1; margin-bottom: 1; color: $text; background: $boost; border-left: thick $primary; }
    """


class Conversation(VerticalScroll, can_focus=True):
    """The scrolling chat. When focused, the arrow keys walk the tokens of the replies for the inspector."""

    DEFAULT_CSS = """
    Conversation { height: 1fr; padding: 0 1; }
    Conversation:focus { border-left: thick $accent; }
    """
    BINDINGS = [
        Binding("left", "step(-1)", "prev token", show=False, id="inspect.prev"),
        Binding("right", "step(1)", "next token", show=False, id="inspect.next"),
        Binding("up", "reply(-1)", "prev reply", show=False, id="inspect.prev_reply"),
        Binding("down", "reply(1)", "next reply", show=False, id="inspect.next_reply"),
        Binding("home", "edge(0)", "first token", show=False, id="inspect.first"),
        Binding("end", "edge(-1)", "last token", show=False, id="inspect.last"),
        Binding("escape", "clear_selection", "close inspector", id="inspect.close"),
    ]

    class TokenSelected(Message):
        """A token was selected (reply and token are None when the selection is cleared)."""

        def __init__(self, reply: ReplyView | None, token: TokenEvent | None) -> None:
            super().__init__()
            self.reply, self.token = reply, token

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.selection: tuple[ReplyView, int] | None = None

    @property
    def replies(self) -> list[ReplyView]:
        return list(self.query(ReplyView))

    def select(self, reply: ReplyView, token: int) -> None:
        if not 0 <= token < len(reply.tokens):
            return
        if self.selection and self.selection[0] is not reply:
            self.selection[0].select(None)
        self.selection = (reply, token)
        reply.select(token)
        self.refresh_bindings()
        self.post_message(self.TokenSelected(reply, reply.tokens[token]))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "clear_selection":  # otherwise Esc goes on to the app (stop the reply)
            return self.selection is not None and not getattr(self.app, "generating", False)
        return True

    def action_clear_selection(self) -> None:
        if self.selection is not None:
            self.selection[0].select(None)
            self.selection = None
            self.post_message(self.TokenSelected(None, None))
            self.refresh_bindings()

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
        target[0].scroll_visible()

    def action_reply(self, delta: int) -> None:
        replies = [r for r in self.replies if self._visible_tokens(r)]
        if not replies:
            return
        index = replies.index(self.selection[0]) + delta if self.selection and self.selection[0] in replies else len(replies) - 1
        reply = replies[max(0, min(len(replies) - 1, index))]
        self.select(reply, self._visible_tokens(reply)[0])
        reply.scroll_visible()

    def action_edge(self, which: int) -> None:
        reply = self.selection[0] if self.selection else (self.replies or [None])[-1]
        if reply is not None and self._visible_tokens(reply):
            self.select(reply, self._visible_tokens(reply)[which])


class Legend(Widget):
    """What the colours mean, drawn with the same styles as the tokens."""

    COMPONENT_CLASSES = {f"token--{kind}" for kind in KINDS}
    DEFAULT_CSS = "Legend { height: 1; padding: 0 1; color: $text-muted; }\n" + token_css("Legend")

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.show_rejected = False

    def render(self) -> Content:
        parts: list = []
        for kind in KINDS:
            if kind == "rejected" and not self.show_rejected:
                parts.append("F10: rejected drafts  ")
                continue
            style = Style.from_rich_style(self.get_component_rich_style(f"token--{kind}", partial=True))
            parts += [("■ " if kind != "rejected" else "", style), (kind, style), "  "]
        parts.append("· click a token to inspect")
        return Content.assemble(*parts)


# --------------------------------------------------------------------------- statistics


def estimate_speedup(snapshot: Snapshot, mode: str) -> tuple[float | None, str]:
    """The predicted speedup (engine.metrics.SpeedupModel) of `mode`, or why there is none yet."""
    step = snapshot.plain_step_s
    if step is None:
        return None, "no plain step measured yet: press F2 and send a message"
    if mode == "off":
        return 1.0, f"plain decoding is the baseline ({1000 * step:.1f} ms/step)"
    model = snapshot.speedup(mode)
    if model is None:
        return None, f"no drafted rounds in {mode} yet"
    return model.predicted, (
        f"a={model.acceptance:.2f} K={model.k:.3g}: draft {model.draft_cost:.2f}, "
        f"verify {model.verify_cost:.2f} plain steps ({1000 * step:.1f} ms)"
    )


def spark(values: list[float]) -> str:
    """Acceptance per round on an absolute 0..1 scale (a relative scale would exaggerate small changes)."""
    bars = "▁▂▃▄▅▆▇█"
    return "".join(bars[min(7, max(0, round(v * 7)))] for v in values)


def stats_table(reply: Stats, session: Stats, mode: str) -> Table:
    """This reply next to the whole session in the current mode (statistics are kept per mode)."""
    table = Table(box=None, padding=(0, 0, 0, 1), expand=True, show_edge=False)
    table.add_column("", style="dim", no_wrap=True, overflow="ellipsis")
    table.add_column("reply", justify="right", no_wrap=True, min_width=6)
    table.add_column(f"{mode} all", justify="right", no_wrap=True, overflow="ellipsis", min_width=6)
    rows = [
        ("acceptance", lambda s: pct(s.acceptance_rate)),
        ("mean acc. length", lambda s: fmt(s.mean_accepted_length)),
        ("target calls/tok", lambda s: fmt(s.target_calls_per_token)),
        ("draft calls/tok", lambda s: fmt(s.draft_calls_per_token)),
        ("tokens/s", lambda s: fmt(s.tokens_per_s, ".1f")),
        ("ms/token", lambda s: fmt(s.ms_per_token, ".1f")),
        ("1st token ms", lambda s: fmt(s.time_to_first_token_s and 1000 * s.time_to_first_token_s, ".0f")),
        ("draft ms/round", lambda s: fmt(s.draft_ms_per_round, ".1f")),
        ("verify ms/round", lambda s: fmt(s.verify_ms_per_round, ".1f")),
        ("tokens", lambda s: str(s.new_tokens)),
    ]
    for label, value in rows:
        table.add_row(label, value(reply), value(session))
    return table


def positions_text(stats: Stats | None, colour: str = "green", width: int = 16) -> Text:
    text = Text()
    rates = stats.per_position_acceptance if stats else []
    if not rates:
        return Text("no drafts proposed yet", style="dim")
    for i, (rate, n) in enumerate(zip(rates, stats.num_draft_tokens_per_pos), start=1):
        full = round(rate * width)
        text.append(f"{i:>2} ")
        text.append("━" * full, style=colour)
        text.append("─" * (width - full), style="dim")
        text.append(f" {100 * rate:3.0f}% ({n})\n")
    text.rstrip()
    return text


def modes_table(stats: dict[str, Stats], current: str, unavailable: dict[str, str], pending: str | None) -> Table:
    table = Table(box=None, padding=(0, 1), show_edge=False)
    for name, justify in (("", "left"), ("mode", "left"), ("acc", "right"), ("tok/s", "right"), ("×off", "right")):
        table.add_column(name, justify=justify, no_wrap=True)
    for mode in MODES:
        key = MODE_KEYS[mode]
        marker = "●" if mode == current else "…" if mode == pending else " "
        if mode in unavailable:
            table.add_row(Text(key, style="dim"), Text(f"{mode}", style="dim strike"),
                          Text("unavailable", style="dim"), "", "")
            continue
        s = stats.get(mode)
        style = "bold" if mode == current else ""
        table.add_row(
            Text(key, style="dim"),
            Text(f"{marker}{mode}", style=style),
            pct(s.acceptance_rate) if s else "",
            fmt(s.tokens_per_s, ".1f") if s else "",
            fmt(measured_speedup(s, stats.get("off")), ".2f") if s else "",
        )
    return table


class StatsPanel(VerticalScroll, can_focus=False):
    """Live statistics, drawn from the latest session Snapshot (redrawn on a timer while a reply streams)."""

    DEFAULT_CSS = """
    StatsPanel { height: 1fr; padding: 0 0 0 1; overflow-x: hidden; scrollbar-gutter: stable; scrollbar-size-vertical: 1; }
    StatsPanel > .section { color: $primary; text-style: bold; margin-top: 1; }
    StatsPanel > #mode-line { margin-top: 0; }
    /* fixed heights: updates need no layout pass (which would re-measure everything on screen) */
    StatsPanel > #mode-line { height: 2; }
    StatsPanel > #stats { height: 11; }
    StatsPanel > #spark { height: 1; }
    StatsPanel > #speedup { height: 3; }
    StatsPanel > #modes { height: 8; }
    StatsPanel > #spark { margin-top: 1; }
    """

    _position_lines = -1

    def compose(self):
        yield Static(id="mode-line")
        yield Static(id="stats")
        yield Static(id="spark")
        yield Static("acceptance by draft position", classes="section")
        yield Static(id="positions")
        yield Static("estimated speedup over plain", classes="section")
        yield Static(id="speedup")
        yield Static("modes this session", classes="section")
        yield Static(id="modes")

    def show(self, snapshot: Snapshot, *, unavailable: dict[str, str], pending: str | None) -> None:
        mode, stats, recent = snapshot.mode, snapshot.stats, snapshot.recent
        sampling = snapshot.sampling
        how = "greedy" if sampling.greedy else f"T={sampling.temperature:g}"
        if not sampling.greedy and sampling.top_k:
            how += f" top-k={sampling.top_k}"
        if not sampling.greedy and sampling.top_p < 1:
            how += f" top-p={sampling.top_p:g}"
        exact = "exact" if snapshot.exact else "APPROXIMATE"
        line = Text.assemble(("mode ", "dim"), (mode, "bold"), ("  K ", "dim"), (str(snapshot.k), "bold"),
                             ("  ", ""), (how, ""), ("  ", ""), (exact, "dim"))
        if pending:
            line.append(f"\nswitching to {pending}…", style="italic")
        self.query_one("#mode-line", Static).update(line, layout=False)
        self.query_one("#stats", Static).update(stats_table(snapshot.reply, stats.get(mode, Stats()), mode), layout=False)
        colour = rich_colour(self.app.theme_variables.get("token-accepted", ""), "green")
        label = "recent rounds "
        fits = max(1, (self.scrollable_content_region.width or 40) - len(label))  # the latest rounds that fit on the line
        recent_line = Text.assemble((label, "bold"), (spark(recent[-fits:]), colour) if recent else ("no drafts yet", "dim"))
        self.query_one("#spark", Static).update(recent_line, layout=False)
        positions = positions_text(stats.get(mode), colour)
        lines = len(positions.plain.splitlines())
        self.query_one("#positions", Static).update(positions, layout=lines != self._position_lines)
        self._position_lines = lines
        value, why = estimate_speedup(snapshot, mode)
        measured = measured_speedup(stats.get(mode), stats.get("off"))
        speed = Text()
        speed.append("–" if value is None else f"{value:.2f}×", style="bold")
        speed.append(" predicted")
        if measured is not None and mode != "off":
            speed.append(f"   {measured:.2f}×", style="bold")
            speed.append(" measured")
        speed.append(f"\n{why}", style="dim")
        self.query_one("#speedup", Static).update(speed, layout=False)
        self.query_one("#modes", Static).update(modes_table(stats, mode, unavailable, pending), layout=False)


def rich_colour(value: str, fallback: str) -> str:
    """A theme variable as a colour Rich understands (themes may write any CSS colour)."""
    try:
        return Color.parse(value).hex
    except Exception:
        return fallback


# --------------------------------------------------------------------------- inspector


class Inspector(Static):
    """Details of the selected token: how it was produced and what else the models considered."""

    DEFAULT_CSS = """
    Inspector { height: auto; max-height: 14; padding: 0 1; margin: 0 1; border: round $primary; display: none; }
    Inspector.-shown { display: block; }
    """

    def show_token(self, token: TokenEvent | None, decode) -> None:
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
