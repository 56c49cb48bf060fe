"""The chat's own CPU while a reply streams: what the UI thread takes from the decoder, with no model to add noise.

    python benchmarks/ui_cost.py [--replies 3] [--turns 1] [--tokens 2400] [--delay 0.01] [--size 160x45] [--hide-panel]

The real app (headless, Textual's test driver) answers with the tests' scripted session (tests/support/fakes.py): a
round every `--delay` seconds, each of 1-5 tokens, lines of about 24 tokens. Prints, per reply, the UI thread's CPU
seconds per second of the reply (time.thread_time: the decoder's thread sleeps, so this is the UI alone), the screen
updates a second and their mean CPU ms. On 2 cores that share is what the forward's threads lose
(benchmarks/chat_speed.py measures the loss itself, with the real model, more noisily).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.fakes import REPLY, FakeSession  # noqa: E402
from textual.screen import Screen  # noqa: E402
from textual.widgets import Input  # noqa: E402

from specchat.tui.app import SpecChatApp  # noqa: E402

updates = [0, 0.0]  # screen updates and their CPU seconds


def count_updates() -> None:
    """Count the screen's updates (layout and compositor) and their CPU time."""
    update = Screen._on_timer_update

    def counted(self):
        start = time.thread_time()
        try:
            return update(self)
        finally:
            updates[0] += 1
            updates[1] += time.thread_time() - start

    Screen._on_timer_update = counted


async def replies(turns: int, tokens: int, delay: float, size: tuple[int, int], hide_panel: bool) -> list[dict]:
    """`turns` replies of `tokens` tokens in one chat, each measured."""
    reps = max(1, tokens // len(REPLY))
    session = FakeSession(reply=REPLY * reps, delay=delay, context_len=1 << 20)
    session.max_new_tokens = len(REPLY) * reps
    app = SpecChatApp(session)
    measured = []
    async with app.run_test(size=size) as pilot:
        if hide_panel:
            app.action_toggle_panel()
        for _ in range(turns):
            await pilot.pause()
            prompt = app.query_one("#prompt", Input)
            prompt.value = "go"
            prompt.focus()
            await pilot.press("enter")
            while not app.generating:
                await asyncio.sleep(0.01)
            before, cpu, start = list(updates), time.thread_time(), time.monotonic()
            while app.generating:  # polled cheaply: a Pilot.pause() would add screen updates of its own
                await asyncio.sleep(0.05)
            cpu, wall = time.thread_time() - cpu, time.monotonic() - start
            n = updates[0] - before[0]
            measured.append({"share": cpu / wall, "tok_s": len(REPLY) * reps / wall, "updates_s": n / wall,
                             "update_ms": 1000 * (updates[1] - before[1]) / max(n, 1), "interval": app.reply_interval})
    return measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replies", type=int, default=3, help="chats, each started afresh")
    ap.add_argument("--turns", type=int, default=1, help="replies in each chat, one after the other")
    ap.add_argument("--tokens", type=int, default=2400)
    ap.add_argument("--delay", type=float, default=0.01, help="seconds between rounds (0.01: about 250 tokens/s)")
    ap.add_argument("--size", default="160x45")
    ap.add_argument("--hide-panel", action="store_true")
    args = ap.parse_args()
    size = tuple(int(x) for x in args.size.split("x"))
    count_updates()
    shares = []
    for _ in range(args.replies):
        for turn, r in enumerate(asyncio.run(replies(args.turns, args.tokens, args.delay, size, args.hide_panel))):
            shares.append(r["share"])
            print(f"reply {turn + 1}: UI thread {r['share']:.1%} of a core at {r['tok_s']:.0f} tok/s; {r['updates_s']:.1f} "
                  f"screen updates/s, {r['update_ms']:.1f} ms each; reply redrawn every {r['interval']} s", flush=True)
    print(f"median {statistics.median(shares):.1%} of a core")


if __name__ == "__main__":
    main()
