"""`specchat verify`: does a mode sample from the target's distribution on the loaded models?"""

from __future__ import annotations

import json
import sys

import click

from specchat.cli.options import UserError, config_summary, generation_options, load_session, model_options, user_errors
from specchat.fmt import num


@click.command()
@click.option("--prompt", default="Tell me a short story about a robot.", show_default=True)
@click.option("--raw", is_flag=True, help="Tokenise the prompt as it is, without the chat template.")
@click.option("-n", "--samples", type=click.IntRange(min=20), default=300, show_default=True, help="Continuations per side.")
@click.option("--tokens", type=click.IntRange(min=1, max=4), default=2, show_default=True, help="Length of each continuation.")
@click.option("--alpha", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.01, show_default=True)
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@model_options
@generation_options
def verify(prompt, raw, samples, tokens, alpha, fmt, **opts):
    """Check that a mode samples from the target's distribution on the loaded models."""
    from specchat.verify import run_verify

    if not prompt.strip():
        raise UserError("the prompt is empty")
    if opts["temperature"] == 0:
        opts["temperature"] = 1.0  # greedy output is deterministic: there is no distribution to compare
    if (opts["mode"] or ("draft" if opts["draft"] else "off")) == "off":
        raise UserError("verify compares a speculative mode with plain sampling: choose --mode (or pass --draft)")
    session = load_session(opts, quiet=fmt == "json")
    with user_errors():
        ids = session.raw_prompt(prompt) if raw else session.chat_prompt([{"role": "user", "content": prompt}])
        session.check_fits(ids)
        progress = None if fmt == "json" else lambda msg: click.echo(msg, err=True)
        report = run_verify(session, ids, samples=samples, length=tokens, alpha=alpha, progress=progress)
    report = {**config_summary(session), **report}
    if fmt == "json":
        print(json.dumps(report))
    else:
        print_verify(report)
    if report["verdict"] == "fail":
        sys.exit(1)


def print_verify(r: dict) -> None:
    from rich.console import Console

    console = Console(highlight=False)
    console.print(
        f"mode {r['mode']} K={r['draft_len']}  T={r['temperature']} top-k={r['top_k']} top-p={r['top_p']}  "
        f"{r['samples']} speculative vs {r['samples']} plain continuations of {r['tokens']} tokens"
    )
    console.print(
        f"chi-square homogeneity test on the joint distribution of the first {r['tokens']} tokens "
        f"({r['cells']} cells after pooling): X2={r['statistic']:.2f}, dof={r['dof']}, p={r['p_value']:.4g}; "
        f"empirical total variation {r['total_variation']:.3f}; acceptance {num(r['acceptance_rate'])}"
    )
    if r["verdict"] == "approximate":
        console.print(f"[b yellow]APPROXIMATE rule[/]: measured total-variation distance from plain sampling {r['total_variation']:.3f}")
    elif r["verdict"] == "pass":
        console.print(f"[b green]PASS[/]: no evidence that the outputs differ from the target's (p >= {r['alpha']})")
    else:
        console.print(f"[b red]FAIL[/]: the speculative outputs differ from plain sampling (p < {r['alpha']})")
