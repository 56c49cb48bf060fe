"""The README's picture: the real chat on the embedded default model, mid-conversation, saved as SVG by Textual.

    python scripts/screenshot.py [--out docs/images/chat.svg] [--size 132x40] [--mode auto]

It loads the default model as `specchat` does (offline), sends two messages, waits for each reply and saves the screen. The replies are sampled as in the chat (T=0.7, top-p 0.9) and mode auto starts from what earlier
sessions on this machine learnt, so each run draws its own; the panel's figures are this machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

PROMPTS = ["Write a haiku about the sea.", "Repeat your haiku exactly, then add one more line."]


async def shoot(out: Path, size: tuple[int, int], mode: str) -> None:
    from textual.widgets import Input

    from specchat.cli.options import Options, load_session
    from specchat.tui.app import SpecChatApp

    from specchat.cli.main import main as cli

    options = Options.from_click("chat", cli.make_context("specchat", ["--mode", mode, "--seed", "0"]))  # the chat's defaults
    session = load_session(options, quiet=True)
    app = SpecChatApp(session, theme="dark")
    async with app.run_test(size=size) as pilot:
        prompt = app.query_one("#prompt", Input)
        prompt.cursor_blink = False
        for text in PROMPTS:
            prompt.value = text
            await pilot.press("enter")
            await pilot.pause(0.2)
            deadline = time.monotonic() + 120
            while app.generating and time.monotonic() < deadline:
                await pilot.pause(0.1)
        app.refresh_panel()
        app.clear_notifications()
        await pilot.pause(0.3)
        out.parent.mkdir(parents=True, exist_ok=True)
        app.save_screenshot(filename=out.name, path=str(out.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/images/chat.svg")
    parser.add_argument("--size", default="132x40")
    parser.add_argument("--mode", default="auto")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    width, height = (int(v) for v in args.size.split("x"))
    asyncio.run(shoot(Path(args.out), (width, height), args.mode))
    print(args.out)


if __name__ == "__main__":
    main()
