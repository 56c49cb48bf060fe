"""`specchat history`: the saved conversations, newest first, one line each (`specchat --continue` resumes the first)."""

from __future__ import annotations

import shutil
from pathlib import Path

import click

from specchat.fmt import shorten

MODEL_WIDTH = 28  # the most of a model's name shown (less on a narrow terminal); the first message gets the rest
MESSAGE_WIDTH = 26  # the least of the first message shown, however narrow the terminal


@click.command()
@click.option("-n", "--limit", type=click.IntRange(min=1), default=None, help="Show only the newest N.")
@click.option("--paths", is_flag=True, help="Add each conversation's file.")
def history(limit, paths):
    """List saved conversations: date, model, turns, the first user message."""
    from specchat.history import conversations, conversations_dir

    found = conversations()[:limit]
    if not found:
        click.echo(f"no saved conversations yet (they are kept in {conversations_dir()})")
        return
    width = shutil.get_terminal_size((100, 24)).columns
    # a model given as a path shows its file name, cut in the middle so the first message keeps most of the line
    fits = max(12, min(MODEL_WIDTH, width - 1 - MESSAGE_WIDTH - len("2026-01-01 00:00    999 turns  ")))
    models = {c.path: shorten(Path(c.model).name.removesuffix(".gguf"), fits) for c in found}
    model_width = max(len(m) for m in models.values())
    for c in found:
        head = f"{c.date}  {models[c.path]:<{model_width}}  {c.turns:>3} turn{'s' if c.turns != 1 else ' '}  "
        message = " ".join(c.first_message.split())  # one line, whatever the message held
        room = max(MESSAGE_WIDTH, width - len(head) - 1)
        line = head + (message if len(message) <= room else message[: room - 1] + "…")
        click.echo(line + (f"\n    {c.path}" if paths else ""))
