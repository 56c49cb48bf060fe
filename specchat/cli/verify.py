"""`specchat verify`: does a mode sample from the target's distribution on the loaded models?"""

from __future__ import annotations

import json
import sys

import click

from specchat.cli.options import BadOption, Options, UserError, config_summary, generation_options, load_session, model_options, user_errors
from specchat.fmt import num

# specchat.verify's defaults, repeated here because importing it imports torch (this module must not:
# `specchat --help` answers before torch loads); tests/test_verify.py checks that they agree.
DEFAULT_SAMPLES = 100
DEFAULT_ALPHA = 0.01
DEFAULT_PROMPT = "Tell me a short story about a robot."
TESTS = ("target", "homogeneity")


@click.command()
@click.option("--prompt", default=None, help=f"Default: {DEFAULT_PROMPT!r}; for lookup, a conversation whose next reply repeats an earlier one.")
@click.option("--raw", is_flag=True, help="Tokenise the prompt as it is, without the chat template.")
@click.option("-n", "--samples", type=click.IntRange(min=20), default=DEFAULT_SAMPLES, show_default=True, help="Speculative draws.")
@click.option("--tokens", type=click.IntRange(min=1, max=64), default=None, help="Leading tokens tested per draw. Default: K+1 (every draft position and the bonus).")
@click.option("--test", "test", type=click.Choice(TESTS), default="target", show_default=True,
              help="target: one-sample against the target's exact probabilities; homogeneity: two-sample against as many plain draws.")
@click.option("--alpha", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=DEFAULT_ALPHA, show_default=True)
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@model_options
@generation_options("verify")
def verify(prompt, raw, samples, tokens, test, alpha, fmt, **shared):
    """Check that a mode samples from the target's distribution on the loaded models."""
    from specchat.verify import default_messages, default_raw_prompt, parallel_engines, run_verify

    if prompt is not None and not prompt.strip():
        raise UserError("the prompt is empty")
    options = Options.from_click("verify")  # temperature 0 taken as 1 (options.DEFAULTS)
    if options.mode == "off":
        raise BadOption("verify tests a speculative mode against the target: choose --mode (or pass --draft)")
    session = load_session(options, quiet=fmt == "json")
    with user_errors():
        if raw:
            ids = session.raw_prompt(prompt if prompt is not None else default_raw_prompt(session.mode))
        else:
            messages = [{"role": "user", "content": prompt}] if prompt is not None else default_messages(session.mode)
            ids = session.chat_prompt(messages)
        session.check_fits(ids)
        progress = None if fmt == "json" else lambda msg: click.echo(msg, err=True)
        report = run_verify(session, ids, samples=samples, length=tokens, alpha=alpha, test=test,
                            engines=parallel_engines(session), progress=progress)
    report = {**config_summary(session), "prompt": prompt, **report}  # prompt None: the mode's default
    if fmt == "json":
        print(json.dumps(report))
    else:
        print_verify(report)
    if report["verdict"] in ("fail", "untested"):
        sys.exit(1)


def print_verify(r: dict) -> None:
    from rich.console import Console

    console = Console(highlight=False)
    console.print(
        f"mode {r['mode']} K={r['draft_len']}  T={r['temperature']} top-k={r['top_k']} top-p={r['top_p']}  accept {r['accept']}  "
        f"{r['samples']} draws of {r['generated']} tokens, first {r['tokens']} tested"
    )
    drafted = r["drafted_per_position"]
    console.print(
        f"drafted: largest K {r['max_drafted']}; rounds per draft position {' '.join(f'{i + 1}:{c}' for i, c in enumerate(drafted))}; "
        f"acceptance {num(r['acceptance_rate'])}"
    )
    if r["test_kind"] == "target":
        console.print(
            f"against the target's exact probabilities: chi-square X2={r['statistic']:.2f}, dof={r['dof']}, p={r['chi2_p_value']:.4g}; "
            f"likelihood score z={r['likelihood_z']:.2f}, p={r['likelihood_p']:.4g}; draft direction z={r['direction_z']:.2f} "
            f"({r['direction_tokens']} drafted tokens), p={r['direction_p']:.4g}; combined p={r['p_value']:.4g}"
        )
        cells = "  ".join(
            f"{p['position']}: p={p['combined_p']:.3g} (dof {p['dof']}, z {p['likelihood_z']:.1f}, {p['draws'] + p['pooled_draws']} draws)"
            for p in r["positions"]
        )
        console.print(f"per position: {cells}")
    else:
        console.print(f"{r['test']}: X2={r['statistic']:.2f}, dof={r['dof']}, p={r['p_value']:.4g}")
    if r["verdict"] == "untested":
        console.print(f"[b red]UNTESTED[/]: {r['reason']}")
    elif r["verdict"] == "approximate":
        significant = "detectably differs from" if r["p_value"] < r["alpha"] else "was not told apart from"
        console.print(f"[b yellow]APPROXIMATE rule[/] (lossy, not distribution-preserving): the output {significant} the target's "
                      f"(p={r['p_value']:.3g}, alpha {r['alpha']}); empirical total variation {r['total_variation']:.3f}")
    elif r["verdict"] == "pass":
        console.print(f"[b green]PASS[/]: no evidence that the outputs differ from the target's (p >= {r['alpha']})")
    else:
        where = f"; the largest contribution is at token {r['worst_position']}" if r.get("worst_position") else ""
        console.print(f"[b red]FAIL[/]: the speculative outputs differ from the target's (p < {r['alpha']}){where}")
