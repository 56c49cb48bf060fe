"""Command line: `specchat` (the chat app), `generate`, `verify`, `tune`, `bench`."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from pathlib import Path

import click

from specchat.decoding.drafters import MODES

KIND_STYLES = {"accepted": "green", "resampled": "bold dark_orange", "bonus": "bold cyan", "target": "default"}
KIND_LEGEND = {
    "accepted": "draft accepted",
    "resampled": "resampled (after a rejection)",
    "bonus": "bonus (after a full block)",
    "target": "plain target step",
}


class UserError(click.ClickException):
    """One clear line, exit status 1, never a traceback."""


@contextlib.contextmanager
def user_errors():
    """Turn the errors a user can cause into one-line messages."""
    from specchat.decoding.drafters import ModeUnavailable
    from specchat.models import ModelError
    from specchat.session import PromptTooLong

    try:
        yield
    except (ModelError, ModeUnavailable, PromptTooLong) as e:
        raise UserError(str(e)) from None


def model_options(f):
    """--target/--draft and where they run."""
    options = [
        click.option("--target", metavar="MODEL", help="HF model id (local cache), directory, or .gguf file. Default: embedded SmolLM2-135M-Instruct."),
        click.option("--draft", metavar="MODEL", help="Draft model for mode 'draft' (must share the target's tokenizer)."),
        click.option("--device", default="auto", show_default=True, help="auto (cuda > mps > cpu), cpu, cuda, cuda:1, mps."),
        click.option("--dtype", default="auto", show_default=True, help="auto (cuda: bf16, cpu: float32), float32, bfloat16, float16."),
        click.option("--device-map", default=None, metavar="MAP", help="'auto' spreads a large target over GPUs and CPU memory (accelerate)."),
        click.option("--trust-remote-code", is_flag=True, help="Allow model repositories to run their own code (off by default)."),
    ]
    return functools.reduce(lambda g, opt: opt(g), reversed(options), f)


def generation_options(f):
    """Decoding settings shared by the chat and the headless commands."""
    options = [
        click.option("--mode", type=click.Choice(list(MODES)), default=None, help="Draft mode (default: draft if --draft is given, else off)."),
        click.option("-k", "--draft-len", type=click.IntRange(min=1), default=4, show_default=True, help="Draft tokens per round (K)."),
        click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True, help="0 is greedy."),
        click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 disables."),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True),
        click.option("--seed", type=int, default=None, help="Makes sampling reproducible."),
        click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True),
        click.option("--skip-layers", metavar="LIST", help="layerskip: layers to skip, e.g. 3,5,7 (default: tuned or built-in)."),
        click.option("--exit-layer", type=click.IntRange(min=1), default=None, help="earlyexit: layers run by the draft pass."),
        click.option("--rank", metavar="R", default=None, help="lowrank: rank as a fraction (0.25) or an integer."),
        click.option("--adaptive", is_flag=True, help="Adjust K from recent acceptance."),
        click.option("--accept", "accept_rule", default="exact", show_default=True, help="exact, or an approximate rule approx:<param> (labelled exact: false)."),
    ]
    return functools.reduce(lambda g, opt: opt(g), reversed(options), f)


def mode_options(opts: dict) -> dict:
    """Options each drafter may read (see drafters.build_drafter)."""
    out = {}
    if opts.get("skip_layers"):
        try:
            out["skip_layers"] = [int(x) for x in opts["skip_layers"].split(",") if x.strip()]
        except ValueError:
            raise UserError(f"--skip-layers must be comma-separated layer numbers, got {opts['skip_layers']!r}") from None
    if opts.get("exit_layer") is not None:
        out["exit_layer"] = opts["exit_layer"]
    if opts.get("rank") is not None:
        try:
            rank = float(opts["rank"])
        except ValueError:
            raise UserError(f"--rank must be a fraction or an integer, got {opts['rank']!r}") from None
        out["rank"] = int(rank) if rank >= 1 else rank
    return out


def load_models(opts: dict, console):
    """Target and draft (or None) from the model options, with a progress display: (target, draft, device, dtype)."""
    from specchat.models import check_same_tokenizer, load_model, pick_device, pick_dtype

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    device = pick_device(opts["device"])
    dtype = pick_dtype(opts["dtype"], device)
    kwargs = dict(device_map=opts["device_map"], trust_remote_code=opts["trust_remote_code"])
    with console.status(f"Loading target {opts['target'] or 'SmolLM2-135M-Instruct (default)'} on {device} ({dtype})..."):
        target = load_model(opts["target"], device, dtype, **kwargs)
    draft = None
    if opts["draft"]:
        with console.status(f"Loading draft {opts['draft']}..."):
            draft = load_model(opts["draft"], device, dtype, **kwargs)
        check_same_tokenizer(target, draft)
    return target, draft, device, dtype


def load_session(opts: dict, *, quiet: bool = False):
    """Load models with a progress display on stderr and build a Session."""
    from rich.console import Console

    from specchat.decoding.sampling import SamplingParams
    from specchat.session import Session

    mode = opts["mode"] or ("draft" if opts["draft"] else "off")
    if mode == "draft" and not opts["draft"]:
        raise UserError("--mode draft needs a draft model: pass --draft MODEL")
    with user_errors():
        target, draft, device, dtype = load_models(opts, Console(stderr=True, quiet=quiet))
        sampling = SamplingParams(opts["temperature"], opts["top_k"], opts["top_p"])
        session = Session(
            target,
            draft,
            mode=mode,
            k=opts["draft_len"],
            sampling=sampling,
            seed=opts["seed"],
            max_new_tokens=opts["max_new_tokens"],
            mode_options=mode_options(opts),
        )
        configure_controls(session, opts)
    session.device_label, session.dtype_label = str(device), str(dtype).removeprefix("torch.")
    return session


def configure_controls(session, opts: dict) -> None:
    """Acceptance rule and adaptive K."""
    from specchat.decoding.acceptance import parse_rule

    try:
        session.controls.rule = parse_rule(opts["accept_rule"])
    except ValueError as e:
        raise UserError(str(e)) from None
    if opts["adaptive"]:
        from specchat.decoding.loop import AdaptiveK

        # -k is the starting length; the schedule moves it within [1, max(16, 2K)]; model drafts (quant,
        # lowrank) also stop when their top probability is below 0.7 (measured: benchmarks/RESULTS-modes-b.md)
        session.controls.adaptive = AdaptiveK(start=opts["draft_len"], k_max=max(16, 2 * opts["draft_len"]), p_min=0.7)


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@model_options
@generation_options
@click.option("--theme", default=None, help="Theme name (dark, light, colorblind, or a file in the user theme folder).")
@click.option("--export", "export_path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the session statistics here on exit (.json; a .csv of rounds beside it).")
@click.pass_context
def main(ctx: click.Context, theme, export_path, **opts) -> None:
    """Chat with a local model and watch speculative decoding work, token by token."""
    if ctx.invoked_subcommand is not None:
        return
    try:
        from specchat.tui.app import run_chat
    except ImportError:
        raise UserError("the chat app is not built yet; use `specchat generate --prompt TEXT`") from None
    session = load_session(opts)
    run_chat(session, theme=theme, export_path=export_path, device_label=session.device_label, dtype_label=session.dtype_label)


def config_summary(session, opts: dict) -> dict:
    sampling = session.controls.sampling
    return {
        "target": session.target.name,
        "draft": session.draft.name if session.draft else None,
        "mode": session.mode,
        "draft_len": session.controls.k,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "seed": session.seed,
        "device": session.device_label,
        "dtype": session.dtype_label,
        "accept": session.controls.rule.name,
    }


@main.command()
@click.option("--prompt", required=True, help="The user message (or raw text with --raw).")
@click.option("--raw", is_flag=True, help="Tokenise the prompt as it is, without the chat template.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@model_options
@generation_options
def generate(prompt, raw, fmt, **opts):
    """Generate one reply headlessly, colour-coded by how each token was produced."""
    if not prompt.strip():
        raise UserError("the prompt is empty")
    session = load_session(opts, quiet=fmt == "json")
    with user_errors():
        ids = session.raw_prompt(prompt) if raw else session.chat_prompt([{"role": "user", "content": prompt}])
        rounds = session.complete(ids)
        if fmt == "json":
            for record in rounds:
                for t in record.tokens:
                    print(json.dumps({"type": "token", "id": t.id, "text": t.text, "kind": t.kind, "round": t.round}), flush=True)
        else:
            print_stream(rounds)
    turn = session.turns[-1]
    summary = {
        **config_summary(session, opts),
        "exact": session.total.exact,
        "prompt_tokens": turn.prompt_tokens,
        "stop_reason": turn.stop_reason,
        **session.total.summary(),
    }
    if fmt == "json":
        print(json.dumps({"type": "summary", **summary}), flush=True)
    else:
        print_summary(summary)


def print_stream(rounds) -> None:
    from rich.console import Console
    from rich.text import Text

    console = Console(highlight=False)
    legend = Text("  ").join(Text(f"■ {label}", style=KIND_STYLES[kind]) for kind, label in KIND_LEGEND.items())
    console.print(legend)
    console.rule(style="dim")
    for record in rounds:
        console.print(Text.assemble(*((t.text, KIND_STYLES[t.kind]) for t in record.tokens)), end="")
    console.print()
    console.rule(style="dim")


def fmt_value(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list):
        return " ".join(fmt_value(x) for x in v) or "-"
    return str(v)


def print_summary(summary: dict) -> None:
    from rich.console import Console

    s = summary
    lines = [
        f"[b]{s['mode']}[/b] K={s['draft_len']}  target={s['target']}" + (f"  draft={s['draft']}" if s["draft"] else "")
        + f"  {s['device']}/{s['dtype']}  T={s['temperature']} top-k={s['top_k']} top-p={s['top_p']} seed={s['seed']}"
        + ("" if s["exact"] else "  [b red]APPROXIMATE (exact: false)[/]"),
        f"tokens {s['new_tokens']} (prompt {s['prompt_tokens']}, stop: {s['stop_reason'] or 'stopped'})  "
        f"{fmt_value(s['tokens_per_s'])} tok/s  {fmt_value(s['ms_per_token'])} ms/token  "
        f"first token {fmt_value(s['time_to_first_token_s'])} s",
        f"acceptance {fmt_value(s['acceptance_rate'])}  mean accepted length {fmt_value(s['mean_accepted_length'])}  "
        f"target calls/token {fmt_value(s['target_calls_per_token'])}  draft calls/token {fmt_value(s['draft_calls_per_token'])}",
        f"per-position acceptance {fmt_value(s['per_position_acceptance'])}  "
        f"draft {fmt_value(s['draft_ms_per_round'])} ms/round  verify {fmt_value(s['verify_ms_per_round'])} ms/round",
    ]
    Console(highlight=False).print("\n".join(lines))


@main.command()
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
    report = {**config_summary(session, opts), **report}
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
        f"empirical total variation {r['total_variation']:.3f}; acceptance {fmt_value(r['acceptance_rate'])}"
    )
    if r["verdict"] == "approximate":
        console.print(f"[b yellow]APPROXIMATE rule[/]: measured total-variation distance from plain sampling {r['total_variation']:.3f}")
    elif r["verdict"] == "pass":
        console.print(f"[b green]PASS[/]: no evidence that the outputs differ from the target's (p >= {r['alpha']})")
    else:
        console.print(f"[b red]FAIL[/]: the speculative outputs differ from plain sampling (p < {r['alpha']})")


def register_commands() -> None:
    """`tune` and `bench` live in their own modules (which import the option decorators above)."""
    import importlib

    for module, name in (("specchat.tune", "tune"), ("specchat.bench", "bench")):
        try:
            main.add_command(getattr(importlib.import_module(module), name))
        except ModuleNotFoundError as e:
            if e.name != module:
                raise


register_commands()
