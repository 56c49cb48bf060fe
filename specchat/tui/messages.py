"""The messages the app's worker threads post to the UI thread.

post_message is thread-safe and never blocks, so the decoder hands its rounds over and goes on; everything
a message carries is already computed. (The panel's snapshot holds the session's lock for a moment, on the UI
thread, at most every few tenths of a second.)
"""

from __future__ import annotations

import threading

from textual.message import Message

from specchat.engine.events import RoundRecord


class RoundQueue:
    """The rounds the generation thread made that the reply has not drawn yet. One RoundsDone is posted until the
    reply takes them, on its redraw timer: a message per round (hundreds a second in plain decoding) took the UI
    thread's time, and on a small CPU that time is the decoder's (benchmarks/chat_speed.py)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[RoundRecord] = []
        self._posted = False

    def put(self, record: RoundRecord) -> bool:
        """Queue a round; True when the caller must post RoundsDone (none is on its way)."""
        with self._lock:
            self._records.append(record)
            post, self._posted = not self._posted, True
            return post

    def take(self) -> list[RoundRecord]:
        """Every queued round, oldest first; the next put posts again."""
        with self._lock:
            records, self._records, self._posted = self._records, [], False
            return records


class RoundsDone(Message):
    """Posted by the generation thread when rounds begin to wait in the app's RoundQueue."""


class PrefillProgress(Message):
    """Posted by the generation thread as a long prompt is read (engine.target.PREFILL_CHUNK positions at a time)."""

    def __init__(self, done: int, total: int) -> None:
        super().__init__()
        self.done, self.total = done, total


class ReplyFinished(Message):
    """The reply ended (finished, stopped or failed) and the conversation was saved, or `save_error` says why not."""

    def __init__(self, stopped: bool, error: str | None = None, save_error: str | None = None) -> None:
        super().__init__()
        self.stopped, self.error, self.save_error = stopped, error, save_error


class ModeReady(Message):
    """A drafter was built (or could not be) in a thread: building one may take seconds."""

    def __init__(self, mode: str, error: str | None = None) -> None:
        super().__init__()
        self.mode, self.error = mode, error


class LogLine(Message):
    """A log record from any thread, for the log view (F12)."""

    def __init__(self, text: str, level: str = "info") -> None:
        super().__init__()
        self.text, self.level = text, level


class LoadStage(Message):
    """The loading thread began a stage (`seconds` None) or finished one, in `seconds`."""

    def __init__(self, text: str, seconds: float | None = None) -> None:
        super().__init__()
        self.text, self.seconds = text, seconds


class SessionLoaded(Message):
    """The loading thread is done: the session, or the exception that stopped it (the app exits with it)."""

    def __init__(self, session=None, error: BaseException | None = None) -> None:
        super().__init__()
        self.session, self.error = session, error
