"""The `specchat` command: the chat app (no subcommand) and the headless commands, each in its own module."""

from __future__ import annotations

from pathlib import Path

import click

from specchat import __version__
from specchat.cli.bench import bench
from specchat.cli.generate import generate
from specchat.cli.options import generation_options, load_session, model_options
from specchat.cli.tune import tune
from specchat.cli.verify import verify


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="specchat")
@model_options
@generation_options
@click.option("--theme", default=None, help="Theme name (dark, light, colorblind, or a file in the user theme folder).")
@click.option("--export", "export_path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the session statistics here on exit (.json; a .csv of rounds beside it).")
@click.pass_context
def main(ctx: click.Context, theme, export_path, **opts) -> None:
    """Chat with a local model and watch speculative decoding work, token by token."""
    if ctx.invoked_subcommand is not None:
        return
    from specchat.tui.app import run_chat

    session = load_session(opts)
    run_chat(session, theme=theme, export_path=export_path)


for command in (generate, verify, tune, bench):
    main.add_command(command)
