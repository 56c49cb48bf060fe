"""`specchat tune`: the command around specchat.tune.search (which holds the search and explains it)."""

from __future__ import annotations

import click

from specchat.cli.options import DEFAULTS, Options, load_session, target_options, user_errors
from specchat.modes import TUNABLE

WINS_ABOVE = 1.0  # a setting is worth saving only if it beats plain decoding (speedup > 1)


def _setting_text(setting: dict) -> str:
    if "skip_layers" in setting:
        return ",".join(map(str, setting["skip_layers"])) or "-"
    return str(next(iter(setting.values())))


def verdict(result, confirmed: bool) -> tuple[bool, str]:
    """(does the best setting beat plain decoding, how much): predicted, and measured when --confirm ran."""
    best = result.best
    how = f"predicted x{best.predicted_speedup:.2f}"
    wins = best.predicted_speedup > WINS_ABOVE
    if confirmed:
        measured = result.extra["measured_speedup"]
        how += f", measured x{measured:.2f}"
        wins = wins and measured > WINS_ABOVE
    return wins, how


def saved_entry(result, wins: bool, how: str) -> dict:
    """What `--save` stores for the mode. A winning setting becomes the mode's default (session.drafter_options
    reads the setting's key, e.g. skip_layers). When nothing beats plain decoding the entry says so and keeps
    the best setting found under `best_found` only, so the mode's default stays the built-in one."""
    entry = result.saved_entry()
    if wins:
        return {"recommendation": result.mode, **entry}
    return {
        "recommendation": "off",
        "note": f"no {result.mode} setting beat plain decoding when tuned ({how} for the best); use mode off; "
                f"{result.mode} keeps its built-in default",
        "best_found": entry,
        "tuned_at": entry["tuned_at"],
    }


class Progress:
    """The search's progress on stderr: a Rich bar on a terminal; piped or logged, a plain line per phase and
    about every tenth candidate, so a run of minutes is never silent."""

    def __init__(self, bar, console, mode: str, total: int) -> None:
        self.bar, self.console, self.mode, self.total = bar, console, mode, total
        self.task = bar.add_task(f"tune {mode}", total=total, best="")
        self.best, self.done = None, 0
        self.every = max(1, total // 10)

    def line(self, text: str) -> None:
        if not self.console.is_terminal:
            self.console.print(f"tune {self.mode}: {text}", highlight=False, soft_wrap=True)

    def __call__(self, msg: str, cand) -> None:
        if cand is None:
            self.bar.update(self.task, description=msg)
            self.line(msg)
            return
        if self.best is None or cand.predicted_speedup > self.best.predicted_speedup:
            self.best = cand
        b, self.done = self.best, self.done + 1
        best = f"best {_setting_text(b.setting)} K={b.k} a={b.acceptance:.2f} x{b.predicted_speedup:.2f}"
        self.bar.update(self.task, description=f"tune {self.mode}", advance=1, best=best)
        if self.done % self.every == 0 or self.done == self.total:
            self.line(f"[{self.done}/{self.total}] {best}")


@click.command()
@click.option("--mode", "tune_mode", type=click.Choice(list(TUNABLE)), required=True, help="Which self-speculative mode to tune.")
@click.option("--budget", type=click.IntRange(min=1), default=None, help="layerskip: skip sets to score (default 80); lowrank: ranks to try.")
@click.option("--tokens", "max_new_tokens", type=click.IntRange(min=8), default=DEFAULTS["tune"].max_new_tokens, show_default=True,
              help="Greedy reply length per calibration prompt.")
@click.option("--confirm/--no-confirm", default=True, show_default=True, help="Measure the chosen setting's real speed against plain decoding.")
@click.option("--save/--no-save", default=True, show_default=True, help="Store the result for this model: the best setting as the mode's default if it beats plain decoding, else the advice to use mode off.")
@click.option("--seed", type=int, default=DEFAULTS["tune"].seed, show_default=True, help="Seeds the search (the result is deterministic for a seed, given the measured costs).")
@target_options
def tune(tune_mode, budget, confirm, save, **shared):
    """Find the best setting of a self-speculative mode for this model and save it as the default (if it beats plain decoding)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar
    from rich.table import Table

    from specchat.store import save_tuned
    from specchat.tune.search import CALIBRATION, LOWRANK_RANKS, measure_speed, tune_model

    console = Console(stderr=True)
    options = Options.from_click("tune")  # a plain greedy session on torch (tune's --mode is the mode it tunes)
    tokens, seed = options.max_new_tokens, options.seed
    session = load_session(options)
    model = session.target.model
    prompts = [session.chat_prompt([{"role": "user", "content": p}]) for p in CALIBRATION]
    n = model.config.num_hidden_layers
    total = {"layerskip": budget or 80, "earlyexit": n - 1, "lowrank": min(budget or len(LOWRANK_RANKS), len(LOWRANK_RANKS))}[tune_mode]
    with user_errors(), Bar(
        TextColumn("[b]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[best]}"), console=console, transient=True,
    ) as bar:
        progress = Progress(bar, console, tune_mode, total)
        result = tune_model(model, prompts, tune_mode, seed=seed, budget=budget or 80, max_new_tokens=tokens, progress=progress)
    c = result.costs
    if c is not None:
        console.print(
            f"costs vs one plain step: layer {c.layer:.3f}, head {c.head:.3f}, "
            f"verify K=4 {c.verify.get(4, float('nan')):.2f}, K=8 {c.verify.get(8, float('nan')):.2f}   "
            f"calibration: {len(prompts)} prompts, {result.calibration_tokens} greedy tokens, seed {seed}", soft_wrap=True
        )
    table = Table(title=f"{tune_mode}: best settings on {session.target.name} ({session.info.device}/{session.info.dtype})")
    # costs are relative to one plain target step; the speedup is predicted from the replayed greedy rounds
    for col in ("setting", "K", "accept", "tok/round", "draft", "verify", "speedup"):
        table.add_column(col, justify="right")
    for cand in result.candidates[:10]:
        table.add_row(_setting_text(cand.setting), str(cand.k), f"{cand.acceptance:.3f}", f"{cand.mean_accepted_length:.2f}",
                      f"{cand.draft_cost:.3f}", f"{cand.verify_cost:.2f}", f"{cand.predicted_speedup:.3f}")
    out = Console()
    out.print(table)
    if confirm:
        message = "measuring the chosen setting against plain decoding..."
        if not console.is_terminal:
            console.print(f"tune {tune_mode}: {message}", highlight=False)
        with user_errors(), console.status(message):
            session.configure_mode(tune_mode, **result.best.setting)
            result.extra = measure_speed(session, tune_mode, prompts[:2], result.best.k, tokens)
        e = result.extra
        out.print(
            f"measured: {e['tokens_per_s']:.1f} tok/s vs {e['tokens_per_s_off']:.1f} plain -> x{e['measured_speedup']:.2f} "
            f"(acceptance {e['measured_acceptance']:.2f}, K={result.best.k})"
        )
    wins, how = verdict(result, confirm)
    best = f"{_setting_text(result.best.setting)} K={result.best.k}"
    if wins:
        out.print(f"best {tune_mode} setting: {best} ({how})")
    else:
        out.print(f"[b]nothing beats plain decoding[/b]: the best {tune_mode} setting, {best}, is {how}. "
                  f"Use mode off (the default) for this model on this machine.", soft_wrap=True)
    if save:
        path = save_tuned(model, tune_mode, saved_entry(result, wins, how))
        if wins:
            out.print(f"saved as the default for {tune_mode} on {session.target.name}: {path}", soft_wrap=True)
        else:
            out.print(f"saved that advice (recommendation: off) to {path}; {tune_mode} keeps its built-in setting, "
                      f"not this one (recorded there under best_found)", soft_wrap=True)
