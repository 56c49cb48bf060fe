"""The chat's decoding speed against the same reply headless: what drawing the reply costs the decoder.

    python benchmarks/chat_speed.py [--prompts 4] [--reps 2] [--tokens 256] [-- SPECCHAT OPTIONS...]

Each held-out prompt is answered twice, alternately first: by the chat (`specchat`, in a pseudo-terminal of 160 x 45
that this script reads as fast as a terminal would; the message typed once the app says "Ready.", ctrl+q once the
turn is saved) and by `specchat generate`, both greedy in mode off unless the options after `--` say otherwise. Both
write the rounds' times (the chat's --export, generate's summary): prints each reply's decode tokens/s, the mean
verify (forward) ms a round, the share of a core the chat's UI thread took during the reply (/proc, Linux), the same
tokens or not, and chat over headless. A fresh data folder per run keeps the user's conversations out.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import select
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

PROMPTS = Path(__file__).with_name("heldout-prompts.jsonl")
COLUMNS, LINES = 160, 45
TIMEOUT_S = 300


def drain(fd: int, seconds: float, seen: bytearray | None = None) -> bool:
    """Read the terminal's output for up to `seconds` (into `seen`); False once the child closed it."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if select.select([fd], [], [], left)[0]:
            try:
                data = os.read(fd, 1 << 16)
            except OSError:  # EIO: the child is gone
                return False
            if not data:
                return False
            if seen is not None:
                seen += data
    return True


def cpu_ticks(pid: int) -> int:
    """User and system time so far of the app's UI thread (its main thread: the process's own id), in clock ticks."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def app_process(supervisor: int) -> int:
    """The chat runs in a child of the process started (crash_guard.py): its id."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == supervisor:
                return int(stat.parent.name)
        except (OSError, ValueError, IndexError):
            continue
    return supervisor


def chat(prompt: str, options: list[str], env: dict) -> dict:
    """One reply in the terminal app, typed once the app says it is ready; its export's rounds, and the share of a core
    its UI thread took meanwhile."""
    with tempfile.TemporaryDirectory() as folder:
        export = Path(folder, "session.json")
        env = {**env, "SPECCHAT_DATA_DIR": folder, "TERM": "xterm-256color"}
        pid, fd = pty.fork()
        if pid == 0:
            os.execvpe(sys.executable, [sys.executable, "-m", "specchat", *options, "--export", str(export)], env)
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", LINES, COLUMNS, 0, 0))
        saved = Path(folder, "conversations")
        deadline = time.monotonic() + TIMEOUT_S
        seen = bytearray()
        while b"Ready." not in seen and time.monotonic() < deadline:  # the app's notice once the model is loaded
            drain(fd, 0.1, seen)
        app = app_process(pid)
        ticks, start = cpu_ticks(app), time.monotonic()
        os.write(fd, prompt.encode() + b"\r")
        while not any(saved.glob("*.json*")) and time.monotonic() < deadline:  # the turn is saved when it ends
            drain(fd, 0.05)
        ui = (cpu_ticks(app) - ticks) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - start)
        drain(fd, 0.5)
        os.write(fd, b"\x11")  # ctrl+q
        while drain(fd, 1.0) and time.monotonic() < deadline:
            pass
        _, status = os.waitpid(pid, 0)
        os.close(fd)
        if status != 0 or not export.exists():
            raise SystemExit(f"the chat ended with status {status} and no export: run it by hand to see why")
        rounds = json.loads(export.read_text())["turns"][-1]["rounds"]
        return {"ids": [t["id"] for r in rounds for t in r["tokens"]], "decode_s": sum(r["wall_s"] for r in rounds),
                "verify_s": sum(r["verify_s"] for r in rounds), "rounds": len(rounds), "ui": ui}


def headless(prompt: str, options: list[str], env: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "specchat", "generate", "--prompt", prompt, "--format", "json", *options],
                         env=env, capture_output=True, text=True, check=True).stdout.splitlines()
    lines = [json.loads(line) for line in out if line.strip()]
    summary = lines[-1]
    return {"ids": [t["id"] for t in lines if t.get("type") == "token"], "decode_s": summary["decode_s"],
            "verify_s": summary["verify_s"], "rounds": summary["rounds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("options", nargs="*", help="specchat options for both (default: --mode off --temperature 0)")
    args = ap.parse_args()
    options = args.options or ["--mode", "off", "--temperature", "0"]
    options = [*options, "--max-new-tokens", str(args.tokens), "--seed", "0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()][: args.prompts]
    print(f"options: {' '.join(options)}; load {os.getloadavg()[0]:.2f}")
    ratios, forward, uis = [], [], []
    for rep in range(args.reps):
        for i, prompt in enumerate(prompts):
            runs = {}
            for kind in (("chat", "headless") if (rep + i) % 2 == 0 else ("headless", "chat")):
                runs[kind] = (chat if kind == "chat" else headless)(prompt, options, env)
            c, h = runs["chat"], runs["headless"]
            speed = {k: len(r["ids"]) / r["decode_s"] for k, r in runs.items()}
            ms = {k: 1000 * r["verify_s"] / r["rounds"] for k, r in runs.items()}
            ratios.append(speed["chat"] / speed["headless"])
            forward.append(ms["chat"] / ms["headless"])
            uis.append(c["ui"])
            print(f"prompt {i}: chat {speed['chat']:6.1f} tok/s ({ms['chat']:.2f} ms a forward; UI thread "
                  f"{c['ui']:.0%} of a core), headless {speed['headless']:6.1f} ({ms['headless']:.2f}); "
                  f"chat/headless {ratios[-1]:.2f}; same tokens: {c['ids'] == h['ids']}")
    print(f"load {os.getloadavg()[0]:.2f}; chat/headless: median {statistics.median(ratios):.2f} "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f}); forward chat/headless median "
          f"{statistics.median(forward):.2f}; UI thread median {statistics.median(uis):.0%} of a core")


if __name__ == "__main__":
    main()
