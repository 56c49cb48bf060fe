"""`specchat train-head`: the command around specchat.train.head (which holds the recipe and explains it)."""

from __future__ import annotations

import time
from pathlib import Path

import click

from specchat.cli.options import DEFAULTS, BadOption, Options, UserError, load_session, target_options, user_errors


class Progress:
    """A Rich bar on a terminal; piped or logged, a plain line at most every 10 seconds (and each phase)."""

    def __init__(self, bar, console) -> None:
        self.bar, self.console = bar, console
        self.task = bar.add_task("train-head", total=1.0)
        self.phase, self.last = "", 0.0

    def __call__(self, text: str, fraction: float) -> None:
        phase = text.split(":")[0].split(" ")[0]
        self.bar.update(self.task, description=text, completed=fraction)
        if not self.console.is_terminal and (phase != self.phase or time.monotonic() - self.last > 10):
            self.console.print(f"train-head: {text}", highlight=False, soft_wrap=True)
            self.phase, self.last = phase, time.monotonic()


@click.command("train-head")
@click.option("--data", "data_file", type=click.Path(dir_okay=False), default=None,
              help='JSONL of {"prompt": ...} (the target replies) or {"text": ...} (taken as it is). Default: the shipped prompt set.')
@click.option("--minutes", type=click.FloatRange(min=0, min_open=True), default=15.0, show_default=True, help="Time budget for data and training.")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Optimizer steps (default: as many as fit --minutes; printed, for a repeatable run).")
@click.option("--vocab", type=click.IntRange(min=1), default=8192, show_default=True, help="Tokens the head drafts among (the most frequent in the data).")
@click.option("--seed", type=int, default=DEFAULTS["train-head"].seed, show_default=True)
@click.option("--depth", type=click.IntRange(min=1, max=8), default=1, show_default=True,
              help="Draft positions trained: 2 or more also trains the head on its own predictions (EAGLE-3's training-time test).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write NAME.safetensors and NAME.json (default: the user cache, where mode head finds it).")
@target_options
def train_head(data_file, minutes, steps, vocab, seed, depth, out, **shared):
    """Train a small draft head (mode head) for the target on this machine, from the target's own replies."""
    from rich.console import Console
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar

    from specchat import store
    from specchat.train.head import Recipe, TrainError, read_prompts, train_head as run

    if data_file is not None and not Path(data_file).expanduser().is_file():
        raise BadOption(f"--data {data_file}: no such file")
    try:
        read_prompts(data_file)  # a malformed file fails now, in one line, not after the model loaded
    except TrainError as e:
        raise BadOption(str(e)) from None
    console = Console(stderr=True)
    session = load_session(Options.from_click("train-head"))  # a plain greedy session on torch
    target = session.target
    from specchat.engine.drafters.head import fingerprint

    key = fingerprint(target.model)
    out = out.expanduser() if out is not None else store.heads_dir() / key
    recipe = Recipe(minutes=minutes, steps=steps, vocab=vocab, seed=seed, data_file=data_file, depth=depth)
    with user_errors(), Bar(TextColumn("[b]{task.description}"), BarColumn(), TimeElapsedColumn(), console=console, transient=True) as bar:
        try:
            meta = run(target, recipe, out, store.heads_dir() / f"{key}.work", Progress(bar, console))
        except TrainError as e:
            raise UserError(str(e)) from None
    r = meta["results"]
    click.echo(
        f"trained in {r['data_s'] + r['train_s']:.0f} s ({meta['data']['tokens']} tokens of data, {meta['recipe']['steps']} steps, "
        f"vocabulary {meta['vocab_size']}); held out: first-draft acceptance {r['first_draft_acceptance_t1']:.3f} at temperature 1, "
        f"greedy agreement {r['first_draft_greedy_agreement']:.3f}"
    )
    click.echo(f"saved {meta['path']} (mode head finds it for this target)" if out.parent == store.heads_dir() else f"saved {meta['path']}")
