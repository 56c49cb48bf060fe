"""`specchat history`: the saved conversations, newest first, one line each (`specchat --continue` resumes the first)."""

from __future__ import annotations

import shutil

import click


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
    model_width = max(len(c.model) for c in found)
    for c in found:
        head = f"{c.date}  {c.model:<{model_width}}  {c.turns:>3} turn{'s' if c.turns != 1 else ' '}  "
        message = " ".join(c.first_message.split())  # one line, whatever the message held
        room = max(20, width - len(head) - 1)
        line = head + (message if len(message) <= room else message[: room - 1] + "…")
        click.echo(line + (f"\n    {c.path}" if paths else ""))
