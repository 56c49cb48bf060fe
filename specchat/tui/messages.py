"""The messages the app's worker threads post to the UI thread.

post_message is thread-safe and never blocks, so the decoder hands each round over and goes on; everything
a message carries is already computed, so the UI never reads the session's lock.
"""

from __future__ import annotations

from textual.message import Message

from specchat.engine.events import RoundRecord
from specchat.conversation import Snapshot


class RoundDone(Message):
    """Posted by the generation thread after every round: the round for the reply view, and the session's
    statistics right after it for the panel."""

    def __init__(self, record: RoundRecord, snapshot: Snapshot) -> None:
        super().__init__()
        self.record, self.snapshot = record, snapshot


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
