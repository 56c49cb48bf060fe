"""The engine's error for a mode that cannot run, without torch: the chat catches it on every engine."""


class ModeUnavailable(Exception):
    """A mode that cannot run with the loaded models (or on this server); the message says why, in one line."""
