"""What the chat shows while the models load in the background: one line per stage, the running one with a
spinner and its seconds, so a first start that converts or quantises for a minute is never a blank screen."""

from __future__ import annotations

import time

from rich.text import Text
from textual.widgets import Static

SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


class StartupView(Static):
    """The stages of loading, as load_session reports them (LoadStage messages), in the conversation's place."""

    DEFAULT_CSS = "StartupView { height: auto; padding: 1 1 0 1; color: $text-muted; }"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.done: list[tuple[str, float]] = []  # finished stages and their seconds
        self.running: tuple[str, float] | None = None  # the stage in progress and when it began
        self._frame = 0

    def on_mount(self) -> None:
        self.set_interval(0.1, self.tick)
        self.tick()

    def begin(self, text: str) -> None:
        self.running = (text, time.perf_counter())
        self.tick()

    def end(self, text: str, seconds: float) -> None:
        self.done.append((text, seconds))
        if self.running is not None and self.running[0] == text:
            self.running = None
        self.tick()

    def tick(self) -> None:
        self._frame += 1
        out = Text()
        for text, seconds in self.done:
            out.append("✓ ", style="green").append(text.rstrip(".…")).append(f"  {seconds:.1f} s\n", style="dim")
        if self.running is not None:
            text, start = self.running
            out.append(f"{SPINNER[self._frame % len(SPINNER)]} ", style="bold").append(text, style="bold")
            out.append(f"  {time.perf_counter() - start:.0f} s", style="dim")
        else:
            out.append(f"{SPINNER[self._frame % len(SPINNER)]} starting…", style="bold")
        out.append("\n\nYou can type your first message now; it is sent once the model is ready.", style="dim italic")
        self.update(out)
