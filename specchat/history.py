"""Saved conversations: one JSON file per conversation in `<data>/conversations/`, rewritten after every turn.

Each file holds the messages (the system message included), and per turn the settings it ran with (model,
mode, K, sampling) and its statistics summary. The file is replaced atomically (store.write_atomic) after
every finished or stopped turn, so a crash or a kill never loses a finished turn. `specchat --continue`
resumes the latest one, `specchat history` lists them.

Importing this does not import torch (store, which does, is imported when a file is read or written), so
`specchat history --help` stays fast.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from specchat.export import json_safe

FORMAT = "specchat-conversation/1"


def conversations_dir() -> Path:
    from specchat.store import data_dir

    return data_dir() / "conversations"


def _now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def turn_record(session, turn, finished: str) -> dict:
    """One turn as saved: what was said, the settings in force when it ended and its statistics."""
    sampling = turn.sampling[-1] if turn.sampling else session.controls.sampling
    return {
        "user": turn.user,
        "reply": turn.reply,
        "finished": finished,
        "stop_reason": turn.stop_reason or "stopped",
        "model": session.target.name,
        "draft": session.draft.name if session.draft is not None else None,
        "mode": turn.rounds[-1].mode if turn.rounds else session.mode,
        "k": turn.k if turn.k is not None else session.controls.k,
        "sampling": asdict(sampling),
        "prompt_tokens": turn.prompt_tokens,
        "stats": turn.stats.summary(),
    }


class ConversationLog:
    """The file of one conversation: the turns read from it (--continue) followed by this run's turns."""

    def __init__(self, path: Path | None = None, data: dict | None = None) -> None:
        data = data or {}
        self.path = Path(path) if path else conversations_dir() / f"{datetime.now():%Y%m%d-%H%M%S-%f}.json"
        self.created: str = data.get("created") or _now()
        self.earlier: list[dict] = list(data.get("turns", []))
        self.messages: list[dict] = list(data.get("messages", []))  # what a resumed session starts from
        self._finished: list[str] = []  # when each of this run's turns was first saved
        # the session's turns before this one: a conversation opened mid-session (palette) saves only its own
        self.first_turn = 0

    @classmethod
    def open(cls, path: Path) -> "ConversationLog":
        """A saved conversation, to continue it (ValueError if the file is not one)."""
        return cls(path, load(path))

    @property
    def system(self) -> str | None:
        first = self.messages[0] if self.messages else None
        return first["content"] if first and first.get("role") == "system" else None

    def data(self, session) -> dict:
        """The whole file's content, read under the session's lock (a reply may be streaming)."""
        with session.lock:
            turns = list(session.turns[self.first_turn:])
            self._finished += [_now()] * (len(turns) - len(self._finished))
            records = [turn_record(session, t, when) for t, when in zip(turns, self._finished)]
            messages = [dict(m) for m in session.messages]
        return {
            "format": FORMAT,
            "created": self.created,
            "updated": _now(),
            "model": session.target.name,
            "messages": messages,
            "turns": self.earlier + records,
        }

    def save(self, session) -> Path:
        """Replace the file atomically with the conversation so far (nothing is written before the first turn)."""
        from specchat.store import write_atomic

        data = self.data(session)
        if data["turns"]:
            write_atomic(self.path, json.dumps(json_safe(data), indent=1, ensure_ascii=False, default=str) + "\n")
        return self.path


def load(path: Path) -> dict:
    """A conversation file's content; ValueError if it is unreadable or not a conversation."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the conversation ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a specchat conversation")
    return data


@dataclass(frozen=True)
class Summary:
    """One line of `specchat history`."""

    path: Path
    updated: str
    model: str
    turns: int
    first_message: str

    @property
    def date(self) -> str:
        try:
            return datetime.fromisoformat(self.updated).strftime("%Y-%m-%d %H:%M")
        except ValueError:
            return self.updated


def conversations(folder: Path | None = None) -> list[Summary]:
    """Every saved conversation, the most recently updated first; files that are not one are skipped."""
    folder = folder or conversations_dir()
    out = []
    for path in folder.glob("*.json") if folder.is_dir() else ():
        try:
            data = load(path)
        except ValueError:
            continue
        first = next((m["content"] for m in data.get("messages", []) if m.get("role") == "user"), "")
        out.append(Summary(path, str(data.get("updated", "")), str(data.get("model", "?")), len(data.get("turns", [])), first))
    # the saved time has whole seconds: the file's own time orders two saved within one
    return sorted(out, key=lambda s: (_instant(s.updated), s.path.stat().st_mtime_ns), reverse=True)


def _instant(updated: str) -> float:
    """The saved time as an instant: as strings, 01:10+00:00 after a daylight-saving change sorts before 01:50+01:00.
    A time without an offset is local; one that is not a time sorts last."""
    try:
        return datetime.fromisoformat(updated).timestamp()
    except ValueError:
        return float("-inf")


def latest(folder: Path | None = None) -> Path | None:
    found = conversations(folder)
    return found[0].path if found else None
