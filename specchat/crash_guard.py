"""The chat on a terminal runs in a child process, watched by a parent that outlives a native crash.

A fault in native code (llama.cpp, torch, the fused kernel) ends the process on the spot: no Python runs after it,
and the terminal stays in the app's modes (alternate screen, mouse reporting, hidden cursor, raw input). The parent
imports nothing heavy and waits; if the child dies of a fatal signal it restores the terminal and says what
happened, where the native traceback is (faulthandler, in the child) and how to resume. Every finished turn is on
disk already (history.py saves after each reply), so a crash loses at most the reply in progress.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import subprocess
import sys
from pathlib import Path

CHILD = "SPECCHAT_CRASH_LOG"  # set in the child: where its native traceback goes
FATAL = (signal.SIGSEGV, signal.SIGILL, signal.SIGBUS, signal.SIGFPE, signal.SIGABRT)
FORWARDED = (signal.SIGTERM, signal.SIGHUP)  # a `kill` of the parent reaches the app, which saves and exits
# what a full-screen Textual app turns on, turned off: alternate screen, mouse reporting (all modes), bracketed paste,
# focus events, the kitty keyboard protocol, a hidden cursor
RESET_TERMINAL = ("\x1b[?1049l\x1b[?1000l\x1b[?1002l\x1b[?1003l\x1b[?1006l\x1b[?1015l\x1b[?2004l\x1b[?1004l"
                  "\x1b[<u\x1b[?25h\r\n")

# the environment the user started specchat with, taken at import, before the command sets OpenMP's spin and the hub's
# variables: the child makes those choices again as its own (a spin it inherited would count as the user's)
USER_ENVIRONMENT = dict(os.environ)
_crash_log = None  # the child's open traceback file: faulthandler writes to it from a signal handler


def crash_log_path() -> Path:
    from specchat.store import state_dir

    return state_dir() / "crash.log"


def supervised() -> bool:
    """Whether to run the chat under a parent: on a terminal (where a crash would leave it broken), once."""
    return CHILD not in os.environ and sys.stdin.isatty() and sys.stdout.isatty()


def run_supervised(command: list[str]) -> int:
    """Run `command` (the chat) as a child on this terminal; its exit status, after a fatal signal restoring the
    terminal and saying what happened in one line on stderr."""
    log = crash_log_path()
    with contextlib.suppress(OSError):  # unwritable: the chat runs all the same, without a traceback file
        log.parent.mkdir(parents=True, exist_ok=True)
    saved_tty = tty_attributes()
    child = subprocess.Popen(command, env={**USER_ENVIRONMENT, CHILD: str(log)})
    for sig in FORWARDED:
        signal.signal(sig, lambda sig, frame: child.send_signal(sig))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the child has the terminal's Ctrl+C and says what it did
    status = child.wait()
    if status >= 0:
        return status
    sig = signal.Signals(-status)
    if sig in FATAL:
        restore_terminal(saved_tty)
        from specchat.history import conversations_dir

        print(f"specchat: the chat crashed in native code ({sig.name}); finished turns are saved in {conversations_dir()} "
              f"(`specchat --continue` resumes the latest), the reply in progress is lost; traceback: {log}",
              file=sys.stderr)
    return 128 + sig


def in_child() -> None:
    """In the supervised child: native faults write every thread's Python traceback to the parent's crash log."""
    global _crash_log
    path = os.environ.get(CHILD)
    if path:
        with contextlib.suppress(OSError):
            _crash_log = open(path, "w")
            faulthandler.enable(file=_crash_log, all_threads=True)


def tty_attributes():
    with contextlib.suppress(ImportError, OSError, ValueError):
        import termios

        return termios.tcgetattr(sys.stdin.fileno())
    return None


def restore_terminal(saved) -> None:
    """The terminal as it was before the child started: modes off, then the line discipline's settings."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.write(RESET_TERMINAL)
        sys.stdout.flush()
    if saved is not None:
        with contextlib.suppress(ImportError, OSError, ValueError):
            import termios

            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, saved)
