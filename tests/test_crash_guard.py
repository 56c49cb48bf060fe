"""A native crash in the chat (crash_guard.py): the terminal comes back usable, finished turns stay on disk, and one
line says what happened and where the traceback is. The chat runs for real on a pseudo-terminal."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from support.models import tiny_model_dir
from support.process import run_env
from specchat import crash_guard

SPECCHAT = [sys.executable, "-m", "specchat"]


def test_the_parent_returns_the_childs_status_and_restores_the_terminal_after_a_fatal_signal(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("SPECCHAT_STATE_DIR", str(tmp_path / "state"))
    assert crash_guard.run_supervised([sys.executable, "-c", "raise SystemExit(3)"]) == 3
    assert "crashed" not in capfd.readouterr().err
    crashed = crash_guard.run_supervised([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"])
    out, err = capfd.readouterr()
    assert crashed == 128 + signal.SIGILL
    assert out.endswith(crash_guard.RESET_TERMINAL) and "\x1b[?1049l" in out and "\x1b[?25h" in out
    assert err.count("\n") == 1 and "crashed in native code (SIGILL)" in err and str(tmp_path / "state" / "crash.log") in err


def test_the_child_starts_from_the_users_environment_not_the_settings_the_parent_made(tmp_path, monkeypatch, capfd):
    """prepare_process sets GOMP_SPINCOUNT in the parent; the child must choose it again (for llama.cpp, a longer
    spin), which it does only where the variable is not already set."""
    monkeypatch.setenv("SPECCHAT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")  # as the parent's prepare_process sets it, after import
    assert "GOMP_SPINCOUNT" not in crash_guard.USER_ENVIRONMENT or crash_guard.USER_ENVIRONMENT["GOMP_SPINCOUNT"] != "10000"
    code = "import os; print(os.environ.get('GOMP_SPINCOUNT'), os.environ['SPECCHAT_CRASH_LOG'] != '')"
    assert crash_guard.run_supervised([sys.executable, "-c", code]) == 0
    assert capfd.readouterr().out.split() == [crash_guard.USER_ENVIRONMENT.get("GOMP_SPINCOUNT", "None"), "True"]


class Terminal:
    """A pseudo-terminal of 120x40 with a process on it, its output drained as it comes."""

    def __init__(self, command: list[str], env: dict) -> None:
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.proc = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
        os.close(slave)
        self.output = b""
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                return
            if not chunk:
                return
            self.output += chunk

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def saved_turns(data: Path) -> list[dict]:
    turns = []
    for path in (data / "conversations").glob("*.json"):
        turns += json.loads(path.read_text()).get("turns", [])
    return turns


def chat_after_one_turn(tmp_path) -> Terminal:
    """`specchat` on a tiny model on a terminal, its first reply saved (in tmp_path/data)."""
    model = tiny_model_dir(tmp_path / "tiny")
    env = run_env(SPECCHAT_DATA_DIR=str(tmp_path / "data"), SPECCHAT_STATE_DIR=str(tmp_path / "state"), TERM="xterm-256color")
    term = Terminal([*SPECCHAT, "--target", str(model), "--dtype", "float32", "--mode", "off", "--temperature", "0",
                     "--max-new-tokens", "4", "--threads", "1"], env)
    try:
        wait_for(lambda: b"\x1b[?1049h" in term.output, 120, "the app to take the screen")
        time.sleep(1.0)  # the input mounted and focused (a message typed while the model loads is queued)
        term.type("hello world\r")
        wait_for(lambda: saved_turns(tmp_path / "data"), 240, "the first turn to be saved")
    except BaseException:
        term.proc.kill()
        raise
    return term


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the child in /proc")
def test_a_native_crash_in_the_chat_keeps_finished_turns_and_the_terminal(tmp_path):
    data, state = tmp_path / "data", tmp_path / "state"
    term = chat_after_one_turn(tmp_path)
    try:
        children = Path(f"/proc/{term.proc.pid}/task/{term.proc.pid}/children").read_text().split()
        assert len(children) == 1, children  # the chat runs in a child of the command the user started
        os.kill(int(children[0]), signal.SIGSEGV)  # as a fault in native code would
        assert term.proc.wait(timeout=60) == 128 + signal.SIGSEGV
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
    time.sleep(0.5)  # the last output drained
    after_crash = term.output.rsplit(b"\x1b[?1049h", 1)[-1].decode(errors="replace")
    assert crash_guard.RESET_TERMINAL.replace("\r\n", "") in after_crash
    assert "crashed in native code (SIGSEGV)" in after_crash and "specchat --continue" in after_crash
    assert "Segmentation fault" in (state / "crash.log").read_text()  # every thread's Python stack, from the child
    assert [t["user"] for t in saved_turns(data)] == ["hello world"]


def test_a_kill_of_the_command_the_user_started_reaches_the_chat_which_saves_and_exits_143(tmp_path):
    term = chat_after_one_turn(tmp_path)
    try:
        term.proc.send_signal(signal.SIGTERM)  # the parent: it passes the signal on
        assert term.proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
    time.sleep(0.5)
    assert b"\x1b[?1049l" in term.output.rsplit(b"\x1b[?1049h", 1)[-1]  # the app itself left the screen
    assert b"crashed" not in term.output
    assert [t["user"] for t in saved_turns(tmp_path / "data")] == ["hello world"]
