"""The chat's keys in one place, computed from the list of modes, so a test can check that none clash.

Modes take F2..F11 in MODES order (ten at most; F11, which some terminals keep for full screen, is the last
mode's, suffix; every mode is in the palette too); every other action is on F1, Esc or a ctrl key that
terminals deliver and that Textual does not already use (ctrl+c copies, ctrl+p opens the palette, ctrl+q
quits), so adding a mode never moves or shadows another action's key.
"""

from __future__ import annotations

from typing import Iterable

MAX_MODES = 10  # F2..F11

# action -> (keys as Textual names them, comma-separated aliases; the footer's label; what the help says)
ACTION_KEYS: dict[str, tuple[str, str, str]] = {
    "help": ("f1", "help", "this list of keys"),
    "stop": ("escape", "stop", "stop the streaming reply (queued messages are kept)"),
    "export": ("ctrl+s", "export", "export the session as JSON, CSV and Markdown"),
    "toggle_rejected": ("ctrl+r", "rejected", "show / hide the drafts the target rejected"),
    "toggle_panel": ("ctrl+t", "panel", "show / hide the statistics panel (narrow terminals: switch chat and panel)"),
    "show_log": ("ctrl+l,f12", "log", "the log: warnings and messages from the models"),
    "copy_reply": ("ctrl+y", "copy", "copy the selected reply, else the last one"),
    "toggle_markdown": ("ctrl+o", "markdown", "show finished replies as Markdown / as coloured tokens"),
    "quit": ("ctrl+q", "quit", "quit"),
}

# in the help and the palette but not the footer, which must fit 80 columns
NOT_IN_FOOTER = {"quit", "copy_reply", "toggle_markdown"}

# keys Textual itself binds on the app, the screen or the message input
TEXTUAL_KEYS = ("ctrl+c", "ctrl+p", "tab", "shift+tab", "ctrl+a", "ctrl+e", "ctrl+d", "ctrl+w", "ctrl+u", "ctrl+k",
                "ctrl+x", "ctrl+v", "enter")


def mode_keys(modes: Iterable[str]) -> dict[str, str]:
    """mode -> its key (Textual's name, e.g. "f2"), in order; more than MAX_MODES modes would reach F11."""
    modes = list(modes)
    if len(modes) > MAX_MODES:
        raise ValueError(f"{len(modes)} modes, but only F2..F11 ({MAX_MODES}) are mode keys")
    return {mode: f"f{i}" for i, mode in enumerate(modes, start=2)}


def all_keys(modes: Iterable[str]) -> list[str]:
    """Every key the app binds for these modes, aliases split, Textual's own included (duplicates mean a clash)."""
    keys = list(mode_keys(modes).values())
    for spec, _, _ in ACTION_KEYS.values():
        keys += spec.split(",")
    return keys + list(TEXTUAL_KEYS)


def key_label(key: str) -> str:
    """How the panel, the help and the palette write a key: F2, Esc, ^s."""
    key = key.split(",")[0]
    if key.startswith("ctrl+"):
        return "^" + key.removeprefix("ctrl+")
    return "Esc" if key == "escape" else key.upper() if key.startswith("f") else key
