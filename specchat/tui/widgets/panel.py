"""The statistics panel, drawn from a session Snapshot the app passes in (the UI never reads the session's lock)."""

from __future__ import annotations

import time

from rich.table import Table
from rich.text import Text
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Static

from specchat.conversation import Snapshot
from specchat.engine.metrics import Stats, enough, measured_speedup
from specchat.fmt import fixed as fmt
from specchat.fmt import pct, rate
from specchat.modes import MODES
from specchat.tui.keys import key_label, mode_keys

MODE_KEYS = {mode: key_label(key) for mode, key in mode_keys(MODES).items()}  # as shown: "F2"
# what a client cannot measure of a server's steps: the panel leaves these rows out for a remote session
SERVER_HIDDEN = ("draft calls/tok", "draft ms/round", "verify ms/round")


def estimate_speedup(snapshot: Snapshot, mode: str) -> tuple[float | None, str]:
    """The predicted speedup (engine.metrics.SpeedupModel) of `mode`, or why there is none yet."""
    step = snapshot.plain_step_s
    if step is None:
        return None, "no plain step measured yet: the next reply runs one plain round in-band"
    if mode == "off":
        return 1.0, f"plain decoding is the baseline ({1000 * step:.1f} ms/step)"
    model = snapshot.speedup(mode)
    if model is None:
        return None, f"no drafted rounds in {mode} yet"
    return model.predicted, (
        f"{model.tokens_per_round:.2f} tokens/round at {model.round_cost:.2f} plain steps ({1000 * step:.1f} ms) each; "
        f"a={model.acceptance:.2f} K={model.k:.3g}, i.i.d. acceptance would give {model.iid:.2f}×"
    )


def auto_story(snapshot: Snapshot) -> str:
    """Mode auto's choice in words: what it measured (tok/s of engine time), what a round must give to pay on this
    machine, and, where plain decoding wins, what would change that. Suffix drafts only where the text repeats: its
    arms (by match length) are not rivals of plain decoding elsewhere, so they are named apart."""
    arms, choice, why = snapshot.standings, snapshot.choice, snapshot.why or ""
    if not arms:
        return "Measuring each mode for a few rounds first."
    leader = arms[0].per_s

    def figures(keep) -> str:
        return ", ".join(f"{a.arm} {rate(a.per_s)}" + (f" (max {rate(a.ceiling)})" if a.ceiling is not None and a.ceiling < leader else "")
                         for a in arms if keep(a.arm))

    plain = next((a.per_s for a in arms if a.arm == "off"), None)
    chosen = next((a.per_s for a in arms if a.arm.startswith(choice or "-")), None)  # (suffix's arms: suffix2, ...)
    if why.startswith(("measuring", "re-measuring")):
        return f"{why[0].upper()}{why[1:]}. Tok/s so far: {figures(lambda arm: True)}."
    if choice != "off":
        times = f": {chosen / plain:.2f}× plain decoding ({rate(chosen)} vs {rate(plain)} tok/s)" if chosen and plain else ""
        return f"{choice} is fastest so far{times}."
    others = figures(lambda arm: arm != "off" and not arm.startswith("suffix"))
    repeats = [a.per_s for a in arms if a.arm.startswith("suffix")]
    story = (f"Plain decoding is fastest here: {rate(plain)} tok/s" + (f"; {others}" if others else "")
             + (f"; suffix {rate(max(repeats))} where the text repeats" if repeats else "") + ".")
    steps = snapshot.verify_steps
    if steps is not None and steps > 1.2:
        story += f" A {snapshot.k + 1}-position verify costs {steps:.1f} steps: a round must give {steps:.1f}+ tokens."
    return story + " Repeated text or a cheaper draft would change it."


def ago(seconds: float) -> str:
    """How old a measurement is, coarsely (the panel redraws every 0.3-1 s at most)."""
    if seconds < 60:
        return f"{seconds:.0f} s ago"
    return f"{seconds / 60:.0f} min ago" if seconds < 3600 else f"{seconds / 3600:.1f} h ago"


def baseline_text(snapshot: Snapshot, now: float | None = None) -> Text:
    """What the speedups compare against, and how old it is."""
    b = snapshot.baseline
    if b is None:
        return Text("")
    age = ago(max(0.0, (time.monotonic() if now is None else now) - b.measured_at))
    return Text(f"vs plain: {1000 * b.step_s:.1f} ms/step, {age}", style="dim")


def sampling_text(snapshot: Snapshot) -> str:
    sampling = snapshot.sampling
    how = "greedy" if sampling.greedy else f"T={sampling.temperature:g}"
    if not sampling.greedy and sampling.top_k:
        how += f" top-k {sampling.top_k}"
    if not sampling.greedy and sampling.top_p < 1:
        how += f" top-p {sampling.top_p:g}"
    return how


def spark(values: list[float]) -> str:
    """Acceptance per round on an absolute 0..1 scale (a relative scale would exaggerate small changes)."""
    bars = "▁▂▃▄▅▆▇█"
    return "".join(bars[min(7, max(0, round(v * 7)))] for v in values)


def stats_table(reply: Stats, session: Stats, mode: str, remote: bool = False) -> Table:
    """This reply next to the whole session in the current mode (statistics are kept per mode). A remote
    session's rows are what the client measures and the server's counters tell, no more."""
    table = Table(box=None, padding=(0, 0, 0, 1), expand=True, show_edge=False)
    table.add_column("", style="dim", no_wrap=True, overflow="ellipsis")
    table.add_column("reply", justify="right", no_wrap=True, min_width=6)
    table.add_column(mode, justify="right", no_wrap=True, min_width=6)  # the whole session in this mode
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
        if not (remote and label in SERVER_HIDDEN):
            table.add_row(label, value(reply), value(session))
    return table


def positions_text(stats: Stats | None, colour: str = "green", width: int = 16) -> Text:
    text = Text()
    rates = stats.per_position_acceptance if stats else []
    if not rates:
        return Text("no drafts proposed yet", style="dim")
    for i, (accepted, n) in enumerate(zip(rates, stats.num_draft_tokens_per_pos), start=1):
        full = round(accepted * width)
        text.append(f"{i:>2} ")
        text.append("━" * full, style=colour)
        text.append("─" * (width - full), style="dim")
        text.append(f" {100 * accepted:3.0f}% ({n})\n")
    text.rstrip()
    return text


def remote_plain(snapshot: Snapshot) -> str | None:
    """A remote session's baseline: a configuration that ran and never drafted (a server without speculation)."""
    for mode, s in snapshot.stats.items():
        if s.new_tokens and not s.num_draft_tokens:
            return mode
    return None


def modes_table(snapshot: Snapshot, unavailable: dict[str, str], pending: str | None, modes=MODES) -> Table:
    """Every mode: its key, acceptance, speed, and speed over the plain baseline (measured, recent)."""
    stats, current = snapshot.stats, snapshot.mode
    remote = snapshot.server is not None
    table = Table(box=None, padding=(0, 1, 0, 0), show_edge=False)  # one space between columns: 80 columns fit
    for name, justify in (("", "left"), ("mode", "left"), ("acc", "right"), ("tok/s", "right"),
                          ("×plain" if remote else "×off", "right"), ("n", "right")):  # n: the rounds it rests on
        table.add_column(name, justify=justify, no_wrap=True)
    keys = {mode: key_label(key) for mode, key in mode_keys(modes).items()}
    for mode in modes:
        key = keys[mode]
        marker = "●" if mode in (current, snapshot.choice) else "…" if mode == pending else " "
        if mode in unavailable:
            table.add_row(Text(key, style="dim"), Text(f" {mode}", style="dim strike"), Text("n/a", style="dim"), "", "")
            continue
        s = stats.get(mode)
        style = "bold" if mode == current else ""
        ratio, plain = speedup_against_plain(snapshot, mode)
        few = "dim" if s is not None and not enough(s, plain) else ""  # a hint, not yet a measurement
        table.add_row(
            Text(key, style="dim"),
            Text(f"{marker}{mode}", style=style),
            Text(pct(s.acceptance_rate), style=few) if s else "",
            Text(fmt(s.tokens_per_s, ".1f"), style=few) if s else "",
            Text(fmt(ratio, ".2f"), style=few) if s else "",
            Text(str(s.rounds), style="dim") if s else "",
        )
    return table


def speedup_against_plain(snapshot: Snapshot, mode: str) -> tuple[float | None, Stats | None]:
    """A mode's measured speedup and the plain rounds it is measured against: the plain rounds of the same window
    (run in-band among its rounds; on a server, a configuration that does not draft). Plain decoding is 1.00 by
    definition. One definition for the table and the speedup line."""
    stats = snapshot.stats
    if snapshot.server is not None:
        name = remote_plain(snapshot)
        return (1.0 if mode == name else measured_speedup(stats.get(mode), stats.get(name))), stats.get(name)
    if mode == "off":
        return (1.0 if mode in stats else None), None
    plain = snapshot.plain_for.get(mode)
    return measured_speedup(stats.get(mode), plain), plain


class StatsPanel(VerticalScroll, can_focus=False):
    """Live statistics, drawn from the latest session Snapshot (redrawn on a timer while a reply streams)."""

    # the bars take the accepted tokens' colour from the panel's own styles, so they follow the theme
    COMPONENT_CLASSES = {"token--accepted"}
    DEFAULT_CSS = """
    StatsPanel { height: 1fr; padding: 0 0 0 1; overflow-x: hidden; scrollbar-gutter: stable; scrollbar-size-vertical: 1; }
    StatsPanel > .token--accepted { color: $token-accepted; }
    StatsPanel > Vertical { height: auto; }
    StatsPanel .section { color: $primary; text-style: bold; margin-top: 1; }
    /* fixed heights: updates need no layout pass (which would re-measure everything on screen) */
    StatsPanel #mode-line { height: 2; text-wrap: nowrap; text-overflow: ellipsis; }
    StatsPanel #stats { height: 11; }
    StatsPanel #spark { height: 1; }
    StatsPanel #speedup { height: 6; }
    /* alone on a narrow screen it has two columns (app.tcss) */
    """

    _position_lines = -1
    _shown: tuple | None = None  # the latest show()'s arguments

    def __init__(self, modes: dict[str, str] = MODES, **kwargs) -> None:
        super().__init__(**kwargs)
        self.modes = modes  # the session's (a remote session's are its server configurations)

    def compose(self):
        with Vertical(id="panel-left"):
            yield Static(id="mode-line")
            yield Static(id="stats")
            yield Static(id="spark")
            yield Static("estimated speedup over plain", classes="section", id="speedup-title")
            yield Static(id="speedup")
        with Vertical(id="panel-right"):
            yield Static("acceptance by draft position", classes="section")
            yield Static(id="positions")
            yield Static("modes this session", classes="section", id="modes-title")
            yield Static(id="modes")

    def on_mount(self) -> None:
        self.query_one("#modes").styles.height = len(self.modes) + 1  # a header and a row per mode

    def on_resize(self) -> None:
        """Redraw what was shown for the new width (the sparkline's length depends on it)."""
        if self._shown is not None:
            self.show(*self._shown[:1], unavailable=self._shown[1], pending=self._shown[2])

    def show_loading(self, stage: str | None = None) -> None:
        """Before the session exists: say so, and which stage of loading runs."""
        line = Text.assemble(("loading the model…", "italic"), (f"\n{stage}" if stage else "", "dim"), no_wrap=True, overflow="ellipsis")
        self.query_one("#mode-line", Static).update(line, layout=False)

    def show(self, snapshot: Snapshot, *, unavailable: dict[str, str], pending: str | None) -> None:
        self._shown = (snapshot, unavailable, pending)
        if snapshot.server is not None:
            self.show_remote(snapshot, pending)
            return
        mode, stats, recent = snapshot.mode, snapshot.stats, snapshot.recent
        how = sampling_text(snapshot)
        exact = "exact" if snapshot.exact else "APPROXIMATE"
        capped = f" (drafts ≤{snapshot.max_draft})" if snapshot.max_draft and snapshot.max_draft < snapshot.k else ""
        if snapshot.draft_len and snapshot.draft_len > snapshot.k:
            capped = f" (≤{snapshot.draft_len} on a long match)"
        auto = mode == "auto"
        running = f"→{snapshot.choice}" if auto and snapshot.choice else ""
        # two short lines (38 columns at least): the mode and K (none while auto runs plain decoding: it drafts
        # nothing, and the K it would show is the start K), then the rule and sampling (or a switch under way)
        k = () if auto and snapshot.choice == "off" else (("  K ", "dim"), (str(snapshot.k), "bold"),
                                                           (" measured" if snapshot.k_measured else "", "dim"), (capped, "dim"))
        line = Text.assemble(("mode ", "dim"), (mode, "bold"), (running, "bold"), *k, "\n")
        line.append_text(Text.assemble((exact, "dim"), "  ", (f"switching to {pending}…", "italic") if pending else how))
        self.query_one("#mode-line", Static).update(line, layout=False)
        if running:  # the rest of the panel is about the mode auto runs now
            mode = snapshot.choice
        self.query_one("#stats", Static).update(stats_table(snapshot.reply, stats.get(mode, Stats()), mode), layout=False)
        accepted = self.get_component_rich_style("token--accepted", partial=True).color
        colour = accepted.name if accepted is not None else "green"
        label = "recent rounds "
        spark_line = self.query_one("#spark", Static)
        # the latest rounds that fit on the line's own width (the panel may have two columns); never wrapped,
        # or the bars, one long word, would wrap onto a hidden second line and leave the line blank
        fits = max(1, (spark_line.content_region.width or 40) - len(label))
        recent_line = Text.assemble((label, "bold"), (spark(recent[-fits:]), colour) if recent else ("no drafts yet", "dim"),
                                    no_wrap=True, overflow="crop")
        spark_line.update(recent_line, layout=False)
        positions = positions_text(stats.get(mode), colour)
        lines = len(positions.plain.splitlines())
        self.query_one("#positions", Static).update(positions, layout=lines != self._position_lines)
        self._position_lines = lines
        self.set_title("#speedup-title", f"why auto runs {'plain decoding' if mode in ('off', 'auto') else mode}" if auto
                       else "estimated speedup over plain")
        if auto and mode in ("off", "auto"):  # plain decoding's speedup is 1 by definition: say why it runs instead
            self.query_one("#speedup", Static).update(Text(auto_story(snapshot)), layout=False)
            self.query_one("#modes", Static).update(modes_table(snapshot, unavailable, pending, self.modes), layout=False)
            return
        value, why = estimate_speedup(snapshot, mode)
        measured, plain = speedup_against_plain(snapshot, mode)
        few = not enough(stats.get(mode), plain)
        speed = Text(f"{auto_story(snapshot)}\n") if auto else Text()
        speed.append("–" if value is None else f"{value:.2f}×", style="dim" if few else "bold")
        speed.append(" predicted", style="dim" if few else "")
        if measured is not None and mode != "off":
            speed.append(f"   {measured:.2f}×", style="dim" if few else "bold")
            speed.append(" measured", style="dim" if few else "")
        if mode != "off" and stats.get(mode) is not None:
            n = stats[mode].rounds
            counts = f"{n} round{'s' if n != 1 else ''}" + (f" vs {plain.rounds} plain among them" if plain else ", no plain round among them yet")
            speed.append(f" ({counts}{', too few to go by' if few else ''})", style="dim")
        if not auto:  # (auto's own line takes its place)
            speed.append(f"\n{why}", style="dim")
        if snapshot.baseline is not None:
            speed.append("\n").append_text(baseline_text(snapshot))
        self.query_one("#speedup", Static).update(speed, layout=False)
        self.query_one("#modes", Static).update(modes_table(snapshot, unavailable, pending, self.modes), layout=False)

    def set_title(self, selector: str, text: str) -> None:
        """A section's title, updated only when it changes: an update lays the whole screen out again."""
        title = self.query_one(selector, Static)
        if str(title.content) != text:
            title.update(text)

    def show_remote(self, snapshot: Snapshot, pending: str | None) -> None:
        """A serving engine: its configuration, the client's timings and the server's counters; in place of the
        speedup model (which needs draft and verify costs no server sends), the measured ratio to a configuration
        that does not draft, when one has run."""
        mode, stats = snapshot.mode, snapshot.stats
        self.set_title("#speedup-title", "measured speedup over plain")
        self.set_title("#modes-title", "server configurations")
        line = Text.assemble(("server ", "dim"), (mode, "bold"), ("  ", ""), (sampling_text(snapshot), ""),
                             (f"\n{snapshot.server}", "dim"))
        if pending:
            line = Text.assemble(line, (f"  switching to {pending}…", "italic"))
        self.query_one("#mode-line", Static).update(line, layout=False)
        self.query_one("#stats", Static).update(stats_table(snapshot.reply, stats.get(mode, Stats()), mode, remote=True), layout=False)
        accepted = self.get_component_rich_style("token--accepted", partial=True).color
        colour = accepted.name if accepted is not None else "green"
        spark_line = self.query_one("#spark", Static)
        fits = max(1, (spark_line.content_region.width or 40) - len("recent steps "))
        spark_line.update(Text.assemble(("recent steps ", "bold"), (spark(snapshot.recent[-fits:]), colour) if snapshot.recent
                                        else ("no drafts yet", "dim"), no_wrap=True, overflow="crop"), layout=False)
        positions = positions_text(stats.get(mode), colour)
        lines = len(positions.plain.splitlines())
        self.query_one("#positions", Static).update(positions, layout=lines != self._position_lines)
        self._position_lines = lines
        plain = remote_plain(snapshot)
        measured, _ = speedup_against_plain(snapshot, mode)
        speed = Text()
        if measured is not None and plain != mode:
            speed.append(f"{measured:.2f}×", style="bold").append(f" measured against {plain}")
        else:
            speed.append("–", style="bold").append(" no plain configuration has run: add one (--server NAME=URL of a server "
                                                   "without drafting) and switch to it for a reply", style="dim")
        speed.append("\nfigures: steps rebuilt from the server's counters; times measured here", style="dim")
        for warning in snapshot.warnings[-1:]:
            speed.append(f"\n{warning}", style="bold red")
        self.query_one("#speedup", Static).update(speed, layout=False)
        self.query_one("#modes", Static).update(modes_table(snapshot, {}, pending, self.modes), layout=False)
