"""`specchat tune`: the command around specchat.tune.search (which holds the search and explains it)."""

from __future__ import annotations

import click

from specchat.cli.options import load_session, model_options, user_errors
from specchat.engine.drafters import TUNABLE
from specchat.tune.search import CALIBRATION, LOWRANK_RANKS, Candidate, measure_speed, tune_model


def _setting_text(setting: dict) -> str:
    if "skip_layers" in setting:
        return ",".join(map(str, setting["skip_layers"])) or "-"
    return str(next(iter(setting.values())))


@click.command()
@click.option("--mode", "tune_mode", type=click.Choice(list(TUNABLE)), required=True, help="Which self-speculative mode to tune.")
@click.option("--budget", type=click.IntRange(min=1), default=None, help="layerskip: skip sets to score (default 80); lowrank: ranks to try.")
@click.option("--tokens", type=click.IntRange(min=8), default=48, show_default=True, help="Greedy reply length per calibration prompt.")
@click.option("--confirm/--no-confirm", default=True, show_default=True, help="Measure the chosen setting's real speed against plain decoding.")
@click.option("--save/--no-save", default=True, show_default=True, help="Store the result as this model's default.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the search (the result is deterministic for a seed, given the measured costs).")
@model_options
def tune(tune_mode, budget, tokens, confirm, save, seed, **opts):
    """Find the best setting of a self-speculative mode for this model and save it as the default."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from specchat.store import save_tuned

    console = Console(stderr=True)
    # plain greedy settings for the session (tune has its own --mode; --skip-layers etc. do not apply)
    opts.update(mode="off", draft_len=4, temperature=0.0, top_k=0, top_p=1.0, seed=seed, max_new_tokens=tokens,
                skip_layers=None, exit_layer=None, rank=None, adaptive=False, accept_rule="exact")
    session = load_session(opts)
    model = session.target.model
    prompts = [session.chat_prompt([{"role": "user", "content": p}]) for p in CALIBRATION]
    n = model.config.num_hidden_layers
    total = {"layerskip": budget or 80, "earlyexit": n - 1, "lowrank": min(budget or len(LOWRANK_RANKS), len(LOWRANK_RANKS))}[tune_mode]
    best: list[Candidate] = []
    with user_errors(), Progress(
        TextColumn("[b]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[best]}"), console=console, transient=True,
    ) as bar:
        task = bar.add_task(f"tune {tune_mode}", total=total, best="")

        def progress(msg, cand):
            if cand is None:
                bar.update(task, description=msg)
                return
            if not best or cand.predicted_speedup > best[0].predicted_speedup:
                best[:] = [cand]
            b = best[0]
            bar.update(task, description=f"tune {tune_mode}", advance=1,
                       best=f"best {_setting_text(b.setting)} K={b.k} a={b.acceptance:.2f} x{b.predicted_speedup:.2f}")

        result = tune_model(model, prompts, tune_mode, seed=seed, budget=budget or 80, max_new_tokens=tokens, progress=progress)
    c = result.costs
    if c is not None:
        console.print(
            f"costs vs one plain step: layer {c.layer:.3f}, head {c.head:.3f}, "
            f"verify K=4 {c.verify.get(4, float('nan')):.2f}, K=8 {c.verify.get(8, float('nan')):.2f}   "
            f"calibration: {len(prompts)} prompts, {result.calibration_tokens} greedy tokens, seed {seed}"
        )
    table = Table(title=f"{tune_mode}: best settings on {session.target.name} ({session.device_label}/{session.dtype_label})")
    # costs are relative to one plain target step; the speedup is predicted from the replayed greedy rounds
    for col in ("setting", "K", "accept", "tok/round", "draft", "verify", "speedup"):
        table.add_column(col, justify="right")
    for cand in result.candidates[:10]:
        table.add_row(_setting_text(cand.setting), str(cand.k), f"{cand.acceptance:.3f}", f"{cand.mean_accepted_length:.2f}",
                      f"{cand.draft_cost:.3f}", f"{cand.verify_cost:.2f}", f"{cand.predicted_speedup:.3f}")
    Console().print(table)
    if confirm:
        with user_errors(), console.status("measuring the chosen setting against plain decoding..."):
            session.configure_mode(tune_mode, **result.best.setting)
            result.extra = measure_speed(session, tune_mode, prompts[:2], result.best.k, tokens)
        e = result.extra
        Console().print(
            f"measured: {e['tokens_per_s']:.1f} tok/s vs {e['tokens_per_s_off']:.1f} plain -> x{e['measured_speedup']:.2f} "
            f"(acceptance {e['measured_acceptance']:.2f}, K={result.best.k})"
        )
    if save:
        path = save_tuned(model, tune_mode, result.saved_entry())
        Console().print(f"saved as the default for {session.target.name}: {path}")
