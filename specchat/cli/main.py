"""The `specchat` command: the chat app (no subcommand) and the headless commands, each in its own module.

Importing this (and every command module) does not import torch: `specchat --help`, --version and argument
errors answer in a fraction of a second, and prepare_process() sets the environment before torch loads.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import click

from specchat import __version__, crash_guard
from specchat.cli.bench import bench
from specchat.cli.cache import cache
from specchat.cli.generate import generate
from specchat.cli.history import history
from specchat.cli.options import (INTERRUPTED, BadOption, Options, UserError, generation_options, load_session, model_options,
                                  preflight, prepare_process, server_options, system_option)
from specchat.cli.train_head import train_head
from specchat.cli.tune import tune
from specchat.cli.verify import verify


class SpecchatGroup(click.Group):
    """Bad option values are one line. Ctrl+C anywhere (loading, generating, writing a report) ends with one line and exit status 130, not a
    traceback or click's `Aborted!`. A command that has something to show first (generate's partial summary)
    catches KeyboardInterrupt itself and exits with INTERRUPTED."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("\nspecchat: interrupted", err=True)
            ctx.exit(INTERRUPTED)
        except click.UsageError as e:
            e.ctx = None  # a bad option value is one line ("Error: ..."), without click's usage banner
            raise

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as e:  # the group's own options (the chat's)
            e.ctx = None
            raise


def check_export_path(path: Path) -> None:
    """--export is checked at start-up, not at exit when the session is in it: the folder (or the nearest one
    that exists, the rest is created on writing) must take a new file."""
    folder = Path(path).expanduser().absolute().parent
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise BadOption(f"--export {path}: {existing} is not a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".specchat-check-"):
            pass
    except OSError as e:
        where = existing if existing == folder else f"{existing} (to create {folder})"
        raise BadOption(f"--export {path}: cannot write in {where}: {e.strerror or e}") from None


@click.group(cls=SpecchatGroup, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="specchat")
@model_options
@server_options
@generation_options("chat")
@system_option
@click.option("--continue", "resume", is_flag=True, help="Resume the latest saved conversation (see `specchat history`).")
@click.option("--theme", default=None, help="Theme name (dark, light, colorblind, or a file in the user theme folder).")
@click.option("--export", "export_path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the session statistics here on exit (.json; a .csv of rounds and a .md of the conversation beside it).")
@click.pass_context
def main(ctx: click.Context, theme, export_path, resume, **shared) -> None:
    """Chat with a local model and watch speculative decoding work, token by token.

    Every finished turn is saved in the user data folder (`specchat history` lists them)."""
    prepare_process()
    if ctx.invoked_subcommand is not None:
        return
    if export_path is not None:
        check_export_path(export_path)
    if theme is not None:
        check_theme(theme)
    conversation = resume_latest() if resume else None  # before the models load: a missing one fails fast
    options = Options.from_click("chat", ctx)  # the chat's defaults: mode auto, sampling (options.DEFAULTS)
    if not options.servers:
        preflight(options)  # what is wrong with the options is one line before the app shows
    if crash_guard.supervised():  # on a terminal: the app runs in a child, and a native crash cannot break the terminal
        raise SystemExit(crash_guard.run_supervised([sys.executable, "-m", "specchat", *sys.argv[1:]]))
    crash_guard.in_child()

    def load(progress=None):
        session = load_session(options, progress=progress)
        if conversation is not None:  # --system replaces the saved system message
            session.restore(conversation.messages)
            if options.system:
                session.set_system(options.system)
        return session

    from specchat.history import ConversationLog
    from specchat.tui.app import run_chat

    log = conversation or ConversationLog()
    if options.servers:  # a server answers in a second, and names the modes (its configurations) the app shows
        run_chat(load(), theme=theme, export_path=export_path, conversation=log)
    else:  # the app shows at once and loads the models in the background, with a line per stage
        run_chat(load=load, theme=theme, export_path=export_path, conversation=log)


def check_theme(name: str) -> None:
    """--theme is checked before any model loads, and a wrong name lists the ones there are."""
    from textual.theme import BUILTIN_THEMES

    from specchat.tui.themes import load_themes

    ours = list(load_themes().themes)
    if name not in ours and name not in BUILTIN_THEMES:
        raise BadOption(f"--theme {name}: no such theme; specchat's: {', '.join(ours)}; Textual's: {', '.join(BUILTIN_THEMES)}")


def resume_latest():
    """--continue: the latest saved conversation, or one line saying there is none."""
    from specchat.history import ConversationLog, conversations_dir, latest

    path = latest()
    if path is None:
        raise UserError(f"--continue: no saved conversation in {conversations_dir()}")
    try:
        return ConversationLog.open(path)
    except ValueError as e:
        raise UserError(f"--continue: {e}") from None


for command in (generate, verify, tune, bench, train_head, history, cache):
    main.add_command(command)
