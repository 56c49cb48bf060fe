"""`specchat generate`: one reply, streamed with every token coloured by how it was produced, then a summary."""

from __future__ import annotations

import json
import sys
from collections import Counter

import click

from specchat.cli.options import (INTERRUPTED, BadOption, Options, UserError, config_summary, generation_options,
                                  load_session, model_options, server_options, system_option, user_errors)
from specchat.fmt import num

KIND_LEGEND = {
    "accepted": "draft accepted",
    "resampled": "resampled (after a rejection)",
    "bonus": "bonus (after a full block)",
    "target": "plain target step",
}


@click.command()
@click.option("--prompt", required=True, help="The user message (or raw text with --raw).")
@click.option("--raw", is_flag=True, help="Tokenise the prompt as it is, without the chat template.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@model_options
@server_options
@generation_options("generate")
@system_option
def generate(prompt, raw, fmt, **shared):
    """Generate one reply headlessly, colour-coded by how each token was produced."""
    if not prompt.strip():
        raise UserError("the prompt is empty")
    options = Options.from_click("generate")
    if raw and options.system:
        raise BadOption("--system needs the chat template: leave out --raw")
    session = load_session(options, quiet=fmt == "json")
    session.controls.on_prefill = print_prefill_json if fmt == "json" else print_prefill
    interrupted, broken = False, None
    with user_errors():
        ids = session.raw_prompt(prompt) if raw else session.chat_prompt([*session.messages, {"role": "user", "content": prompt}])
        session.check_fits(ids)  # now: a prompt too long is one line, before the stream's legend
        rounds = session.complete(ids)
        try:
            if fmt == "json":
                for record in rounds:
                    for t in record.tokens:
                        print(json.dumps({"type": "token", "id": t.id, "text": t.text, "kind": t.kind, "round": t.round}), flush=True)
            else:
                print_stream(rounds)
        except KeyboardInterrupt:  # Ctrl+C: the summary of what was generated, then exit status 130
            if not session.turns:
                raise
            interrupted = True
            if fmt != "json":
                print()
        except Exception as e:  # a server's stream that broke mid-reply: what came is summarised, then one line
            from specchat.engine.remote import RemoteError

            if not isinstance(e, RemoteError) or not session.turns:
                raise
            broken = e
            if fmt != "json":
                print()
    turn = session.turns[-1]
    summary = {
        **config_summary(session),
        "runner": session.info.runner,  # the target's forward: "lean" (engine/runner.py), "hf" or "llama.cpp"
        "kernel": session.info.kernel,  # its matmuls: "fused" (engine/smallbatch.py) or "torch"
        "exact": turn.stats.exact,
        "prompt_tokens": turn.prompt_tokens,
        "stop_reason": "interrupted" if interrupted else turn.stop_reason,
        "rounds_by_mode": dict(Counter(r.mode for r in turn.rounds).most_common()),  # mode auto runs several
        **turn.stats.summary(),
    }
    summary["notices"] = list(session.notices)  # what loading had to say (llama.cpp's repacking off, ...)
    if session.info.remote:  # the server's counters against the reconstructed steps
        summary["reconciled"] = not session.warnings
        summary["warnings"] = list(session.warnings)
    if fmt == "json":
        print(json.dumps({"type": "summary", **summary}), flush=True)
    else:
        print_summary(summary)
    if interrupted:
        sys.exit(INTERRUPTED)
    if broken is not None:
        raise UserError(f"{broken} (the partial reply is above)")


def print_prefill(done: int, total: int) -> None:
    """A long prompt's reading, on one line of stderr that the stream then replaces (on a terminal only)."""
    if sys.stderr.isatty():
        line = f"reading the prompt: {done:,} of {total:,} tokens…" if done < total else ""
        print(f"\r\x1b[2K{line}", end="", file=sys.stderr, flush=True)


def print_prefill_json(done: int, total: int) -> None:
    if done < total:  # (the first token follows the last chunk)
        print(json.dumps({"type": "prefill", "done": done, "total": total}), flush=True)


def print_stream(rounds) -> None:
    from rich.console import Console
    from rich.text import Text

    from specchat.tui.themes import rich_token_styles

    styles = rich_token_styles()  # the chat's default theme: the kinds look the same in both
    console = Console(highlight=False)
    console.soft_wrap = not console.is_terminal  # piped: the model's text as it is, no line breaks added
    legend = Text("  ").join(Text(f"■ {label}", style=styles[kind]) for kind, label in KIND_LEGEND.items())
    console.print(legend)
    console.rule(style="dim")
    for record in rounds:
        console.print(Text.assemble(*((t.text, styles[t.kind]) for t in record.tokens)), end="")
    console.print()
    console.rule(style="dim")


def summary_lines(s: dict) -> list[list[str]]:
    """The summary as lines of phrases (Rich markup). K only for a drafting mode, the seed only when sampling."""
    from rich.markup import escape

    sampling = "greedy" if s["temperature"] == 0 else f"T={s['temperature']:g} top-k={s['top_k']} top-p={s['top_p']:g} seed={s['seed']}"
    if "server" in s:  # a serving engine: what the client measures and the server's counters tell, nothing else
        k = f" K={s['draft_len']}" if s["draft_len"] is not None and s["mode"] != "off" else ""
        check = "steps match the server's counters" if s["reconciled"] else "[b red]steps do not match the server's counters[/]"
        return [
            [f"[b]{s['mode']}[/b]{k}", f"{s['engine']} {s['server']}", f"model={s['target']}",
             f"speculation: {s['speculative'] or 'none'}", sampling],
            [f"tokens {s['new_tokens']} (prompt {s['prompt_tokens']}, stop: {s['stop_reason'] or 'stopped'})",
             f"{num(s['tokens_per_s'])} tok/s", f"{num(s['ms_per_token'])} ms/token", f"first token {num(s['time_to_first_token_s'])} s",
             "(measured here)"],
            [f"acceptance {num(s['acceptance_rate'])}", f"mean accepted length {num(s['mean_accepted_length'])}",
             f"target calls/token {num(s['target_calls_per_token'])}", f"per-position acceptance {num(s['per_position_acceptance'])}"],
            [f"from the server's counters: {check}", *s["warnings"]],
            *([f"[yellow]{escape(notice)}[/]"] for notice in s.get("notices", [])),
        ]
    return [
        [f"[b]{s['mode']}[/b]" + (f" K={s['draft_len']}" if s["mode"] != "off" else ""), f"target={s['target']}",
         *([f"draft={s['draft']}"] if s["draft"] else []), f"{s['device']}/{s['dtype']} {s['threads']} thread{'s' if s['threads'] != 1 else ''}"
         + (f" runner {s['runner']}" + (" (fused kernel)" if s.get("kernel") == "fused" else "") if "runner" in s else ""), sampling,
         *([] if s["exact"] else ["[b red]APPROXIMATE (exact: false)[/]"])],
        *([[f"rounds by mode: {', '.join(f'{m} {n}' for m, n in s['rounds_by_mode'].items())}"]] if s["mode"] == "auto" else []),
        [f"tokens {s['new_tokens']} (prompt {s['prompt_tokens']}, stop: {s['stop_reason'] or 'stopped'})",
         f"{num(s['tokens_per_s'])} tok/s", f"{num(s['ms_per_token'])} ms/token", f"first token {num(s['time_to_first_token_s'])} s"],
        [f"acceptance {num(s['acceptance_rate'])}", f"mean accepted length {num(s['mean_accepted_length'])}",
         f"target calls/token {num(s['target_calls_per_token'])}", f"draft calls/token {num(s['draft_calls_per_token'])}"],
        [f"per-position acceptance {num(s['per_position_acceptance'])}", f"draft {num(s['draft_ms_per_round'])} ms/round",
         f"verify {num(s['verify_ms_per_round'])} ms/round"],
        *([f"[yellow]{escape(notice)}[/]"] for notice in s.get("notices", [])),
    ]


def print_summary(s: dict) -> None:
    """On a terminal, a line breaks between phrases when it is wider than the window; piped, never."""
    from rich.console import Console
    from rich.text import Text

    console = Console(highlight=False, soft_wrap=True)
    width = console.width if console.is_terminal else None
    for phrases in summary_lines(s):
        line = ""
        for phrase in phrases:
            joined = f"{line}  {phrase}" if line else phrase
            if line and width and Text.from_markup(joined).cell_len > width:
                console.print(line)
                joined = phrase
            line = joined
        console.print(line)
