"""`specchat bench`: parse and check the options (before any model loads), load, run, write the report."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import click

from specchat.cli.options import (DEFAULTS, BadOption, Options, UserError, load_models, mode_setting_options, bench_model_options, preflight,
                                  server_options, user_errors)
from specchat.modes import MODES

BUILTIN_PROMPTS = Path(__file__).resolve().parent.parent / "bench" / "prompts.jsonl"


def parse_list(text: str, convert, what: str, check=lambda v: True, hint: str = "") -> list:
    """'2,4,8' -> [2, 4, 8], with a one-line error naming the option (exit status 2, as click's own value errors)."""
    values = []
    for item in (x.strip() for x in text.split(",")):
        try:
            value = convert(item)
        except ValueError:
            raise BadOption(f"{what}: {item!r} is not valid{hint}") from None
        if not check(value):
            raise BadOption(f"{what}: {item!r} is not valid{hint}")
        if value not in values:
            values.append(value)
    if not values:
        raise BadOption(f"{what} is empty")
    return values


def draft_lengths(text: str) -> dict:
    """'2,4,8,auto' -> fixed K 2, 4 and 8, and K measured from the chat's starting K (Plan's ks, measured_from)."""
    items = parse_list(text, lambda item: item if item == "auto" else int(item), "--draft-len",
                       lambda k: k == "auto" or k >= 1, " (positive integers or auto)")
    return {"ks": [k for k in items if k != "auto"], "measured_from": DEFAULTS["chat"].draft_lens[0] if "auto" in items else None}


def choose_modes(spec: str | None, has_draft: bool) -> tuple[list[str], dict[str, str]]:
    """Requested modes (errors for unknown/unusable ones), or by default every mode; returns (modes, skipped)."""
    if spec is None:
        skipped = {} if has_draft else {"draft": "needs --draft"}
        return [m for m in MODES if m not in skipped], skipped
    modes = parse_list(spec, str, "--modes")
    for m in modes:
        if m not in MODES:
            raise BadOption(f"unknown mode {m!r} in --modes; choose from {', '.join(MODES)}")
        if m == "draft" and not has_draft:
            raise BadOption("mode 'draft' needs a draft model: pass --draft MODEL")
    return (["off"] if "off" not in modes else []) + modes, {}


def read_prompts(spec: str) -> list[dict]:
    """builtin, or a JSONL file of {"prompt": ..., optional "name", "kind", "raw"} objects."""
    path = BUILTIN_PROMPTS if spec == "builtin" else Path(spec).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read prompts file {spec}: {getattr(e, 'strerror', None) or e}") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{spec} line {n}: not JSON ({e.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
            raise UserError(f'{spec} line {n}: expected an object with a non-empty "prompt" string')
        prompts.append({"name": str(item.get("name", f"prompt{n}")), "kind": str(item.get("kind", "")),
                        "prompt": item["prompt"], "raw": bool(item.get("raw", False))})
    if not prompts:
        raise UserError(f"{spec} holds no prompts")
    return prompts


@dataclass
class Plan:
    """Everything `bench` will measure, checked before any model loads."""

    modes: list[str]
    skipped: dict[str, str]  # mode -> why it is not measured
    explicit_modes: bool  # --modes given: a mode that cannot run is an error, not a skip
    ks: list[int]  # fixed draft lengths
    measured_from: int | None  # "auto" in --draft-len: also K measured (the chat's -k auto), from this K
    temperatures: list[float]
    rules: list[str]
    prompts: list[dict]
    settings: dict  # skip_layers / exit_layer / rank
    out_dir: Path
    prompts_spec: str  # builtin or the file, as given (results.json says which)
    repeat: int  # passes over the prompts
    peers: bool  # HF transformers' own implementations too
    verify_samples: int  # per side of the distribution test (0: none)
    learnt: bool = False  # mode auto starts from (and adds to) the rates earlier sessions on this setup saved


def make_plan(options: Options, params: dict) -> Plan:
    """From the shared options and bench's own parameters (its lists of modes, K, temperatures and rules)."""
    from specchat.engine.acceptance import parse_rule
    from specchat.store import bench_dir

    modes, skipped = choose_modes(params["modes"], bool(options.models.draft))
    rules = parse_list(params["accepts"], str, "--accept")
    for rule in rules:
        try:
            parse_rule(rule)
        except ValueError as e:
            raise BadOption(str(e)) from None
    if params["verify_samples"] and params["verify_samples"] < 20:
        raise BadOption("--verify-samples must be 0 (skip) or at least 20")
    out_dir = params["out_dir"] or bench_dir() / datetime.now().strftime("%Y%m%d-%H%M%S")
    if out_dir.exists() and not out_dir.is_dir():
        raise BadOption(f"--out {out_dir} exists and is not a directory")
    return Plan(
        modes=modes, skipped=skipped, explicit_modes=params["modes"] is not None,
        **draft_lengths(params["draft_lens"]),
        temperatures=parse_list(params["temperatures"], float, "--temperature", lambda t: t >= 0, " (numbers >= 0)"),
        rules=rules, prompts=read_prompts(params["prompts_spec"]), settings=options.settings.drafter_options(), out_dir=out_dir,
        learnt=params["learnt"], prompts_spec=params["prompts_spec"], repeat=params["repeat"], peers=params["peers"],
        verify_samples=params["verify_samples"],
    )


def resident_target(model) -> None:
    """Bring the target's weights into memory before drafters are measured: safetensors weights are a file mapping
    whose pages count as resident only once read, and the lean runner fuses some matrices into new memory on first
    use. Otherwise the first drafter that reads the target (quant's int8 copy reads every matrix) is charged for
    the target's own weights: 991 MB for quant's 129 MB on the default model."""
    import torch

    from specchat.engine.runner import lean_runner

    if not isinstance(model, torch.nn.Module):  # a llama.cpp model: nothing of it is measured here
        return
    lean_runner(model)
    with torch.no_grad():
        for p in model.parameters():
            p.sum()


def build_drafters(plan: Plan, target, draft, device) -> tuple[dict, dict]:
    """Every mode's drafter now, so a mode that cannot run fails before the long run: (drafters, MB each added)."""
    from specchat.engine.drafters import ModeUnavailable, build_drafter
    from specchat.machine import memory_mb
    from specchat.session import auto_setup, drafter_options
    from specchat.store import LearntRates

    drafters, added_mb = {}, {}
    resident_target(target.model)
    for mode in plan.modes:
        before = memory_mb(device)
        try:
            options = drafter_options(target.model, mode, plan.settings)
            if mode == "auto" and plan.learnt:
                options["memory"] = LearntRates(auto_setup(target, draft, target.model.device, options))
            drafters[mode] = build_drafter(mode, target.model, draft.model if draft else None, **options)
        except ModeUnavailable as e:
            if plan.explicit_modes:
                raise
            plan.skipped[mode] = str(e)
            continue
        added_mb[mode] = memory_mb(device) - before
    return drafters, added_mb


def tokenise_prompts(plan: Plan, target) -> list:
    from specchat.bench.runner import Prompt

    prompts = []
    for item in plan.prompts:
        ids = target.raw_ids(item["prompt"]) if item["raw"] else target.chat_ids([{"role": "user", "content": item["prompt"]}])
        if target.context_len and len(ids) >= target.context_len:
            raise UserError(f"prompt {item['name']!r} is {len(ids)} tokens; {target.name} has a context of {target.context_len}")
        prompts.append(Prompt(item["name"], item["kind"], item["prompt"], ids))
    return prompts


class Steps:
    """A Rich progress bar on stderr; each call starts the next step. Without a terminal (a log file),
    one plain line per step instead, so a long background run still shows where it is."""

    def __init__(self, progress, total: int) -> None:
        self.progress, self.task, self.done, self.total = progress, progress.add_task("", total=total), 0, total

    def __call__(self, message: str) -> None:
        if self.done:
            self.progress.advance(self.task)
        self.done += 1
        self.progress.update(self.task, description=message)
        if not self.progress.console.is_terminal:
            self.progress.console.print(f"[{self.done}/{self.total}] {message}", highlight=False)


def show_report(text: str) -> None:
    """The report on stdout: rendered (tables, headings) on a terminal, the Markdown itself when piped."""
    from rich.console import Console

    console = Console()
    if console.is_terminal:
        from rich.markdown import Markdown

        console.print(Markdown(text))
    else:
        click.echo(text, nl=False)


@click.command()
@bench_model_options
@server_options
@click.option("--modes", default=None, metavar="LIST", help=f"Comma-separated, from: {', '.join(MODES)}. Default: every mode that can run (draft with --draft). off always runs.")
@click.option("--draft-len", "draft_lens", default=",".join([*map(str, DEFAULTS["bench"].draft_lens), *(["auto"] if DEFAULTS["bench"].measured_k else [])]), show_default=True, metavar="LIST",
              help=f"Draft lengths K to measure; auto: K measured per mode as the chat's -k auto does (from {DEFAULTS['chat'].draft_lens[0]}), over all of a configuration's runs.")
@click.option("--temperature", "temperatures", default=f"{DEFAULTS['bench'].temperature:g}", show_default=True, metavar="LIST", help="Temperatures, e.g. 0,0.7 (0 is greedy).")
@click.option("--accept", "accepts", default="exact", show_default=True, metavar="LIST", help="Acceptance rules (exact, or approx:<param>).")
@click.option("--prompts", "prompts_spec", default="builtin", show_default=True, metavar="builtin|FILE.jsonl")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=DEFAULTS["bench"].max_new_tokens, show_default=True)
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True, help="Passes over the prompts.")
@click.option("--peers", is_flag=True, help="Also run HF transformers' own implementation of each requested mode: generate() for off, assistant_model for draft, prompt_lookup_num_tokens for lookup, assistant_early_exit for earlyexit.")
@click.option("--verify-samples", type=int, default=100, show_default=True, help="Samples per side of the distribution test for sampled exact modes (0 skips; else >= 20).")
@click.option("--seed", type=int, default=DEFAULTS["bench"].seed, show_default=True)
@click.option("--learnt", is_flag=True, help="Mode auto starts from the rates earlier sessions on this setup learnt, as the chat's does, and saves what it measures after every reply (the state folder; $SPECCHAT_STATE_DIR for a copy). Default: a first session, nothing learnt or saved.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None, help="Report folder (default: a new timestamped folder under the user data folder's bench/).")
@mode_setting_options
def bench(**params):
    """Measure every mode against plain decoding on the same prompts, with quality checks. With --server: each
    serving configuration (and, with --target, the local modes of --modes on the same model), side by side."""
    options = Options.from_click("bench")
    if options.servers:
        bench_servers(options, params)
        return
    plan = make_plan(options, params)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specchat.bench import report, runner

    console = Console(stderr=True)
    if options.models.engine in ("llama.cpp", "lean"):  # its quality checks score the target's outputs with torch
        raise BadOption(f"bench runs on the torch engine; benchmarks/engines.py measures the {options.models.engine} engine's modes")
    options = replace(options, models=replace(options.models, engine="torch"))
    preflight(options)
    with user_errors():
        target, draft, device, dtype = load_models(options.models, console)
        drafters, drafter_mb = build_drafters(plan, target, draft, device)
        prompts = tokenise_prompts(plan, target)

    ctx = runner.Context(target, draft, device, drafters, target.eos_ids, options.max_new_tokens, options.seed, options.settings.exit_layer)
    configs = runner.build_configs([m for m in plan.modes if m in drafters], plan.ks, plan.temperatures, plan.rules, peers=plan.peers,
                                   measured_from=plan.measured_from)
    verify_samples = plan.verify_samples
    n_verify = len({(c.mode, c.temperature) for c in configs if not c.is_peer and c.mode != "off" and c.temperature > 0 and c.exact})
    total = len(configs) * (1 + len(prompts) * plan.repeat) + (n_verify if verify_samples else 0)

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with user_errors(), Progress(*columns, console=console, transient=True) as progress:
        steps = Steps(progress, total)
        runs = runner.run_all(ctx, configs, prompts, plan.repeat, steps)
        rows = runner.summarise(ctx, configs, runs)
        checks = {
            "greedy_identity": runner.greedy_identity(configs, runs),
            "distribution": runner.distribution_checks(ctx, configs, prompts[0], verify_samples, steps) if verify_samples else [],
            "approximate": runner.approximate_quality(ctx, configs, runs, prompts),
            "hf_greedy": runner.hf_greedy_match(runs),
        }

    for r in rows:
        r["drafter_memory_mb"] = drafter_mb.get(r["mode"])
    for run in runs:
        run["text"] = target.tokenizer.decode(run["tokens"], skip_special_tokens=True)
    results = runner.results(ctx, plan, configs, prompts, rows, checks, runs, dtype)
    text, note = report.write(results, plan.out_dir)
    show_report(text)
    click.echo(f"wrote {plan.out_dir / 'report.md'}, {plan.out_dir / 'results.json'}"
               + ("" if note else f", {plan.out_dir / 'speedup.png'}"), err=True)
    if note:
        click.echo(note, err=True)
    if checks["greedy_identity"]["verdict"] == "fail" or any(v["verdict"] == "fail" for v in checks["distribution"]):
        click.echo("bench: quality check FAILED (see Checks in the report)", err=True)
        sys.exit(1)


def bench_servers(options: Options, params: dict) -> None:
    """bench --server: specchat/bench/remote.py. Local modes run on the --target (a GGUF: on llama.cpp, as the
    server runs it), each in a session of its own, between the servers' runs."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specchat.bench import remote as bench_remote
    from specchat.engine.remote import RemoteError, connect
    from specchat.engine.sampling_params import SamplingParams
    from specchat.remote_session import RemoteSession
    from specchat.store import bench_dir

    temperatures = parse_list(params["temperatures"], float, "--temperature", lambda t: t >= 0, " (numbers >= 0)")
    if len(temperatures) > 1:
        raise BadOption("--server: one --temperature per run")
    lengths = draft_lengths(params["draft_lens"])  # the local modes'
    sampling = SamplingParams(temperatures[0], 0, 1.0)
    if params["modes"] and not options.models.target:
        raise BadOption("--server with --modes: the local modes need --target (the server's model file)")
    modes = parse_list(params["modes"] or "off", str, "--modes")
    if unknown := [m for m in modes if m not in MODES]:  # before a server is asked or the target loads
        raise BadOption(f"unknown mode {unknown[0]!r} in --modes; choose from {', '.join(MODES)}")
    prompts = read_prompts(params["prompts_spec"])
    out_dir = params["out_dir"] or bench_dir() / datetime.now().strftime("%Y%m%d-%H%M%S-servers")
    console = Console(stderr=True)
    configs = {}
    try:
        for name, url in options.servers:
            server = connect(url, name, timeout=min(options.timeout, 10.0))
            configs[server.name] = RemoteSession([server], sampling=sampling, seed=options.seed,
                                                 max_new_tokens=options.max_new_tokens, timeout=options.timeout)
    except RemoteError as e:
        raise UserError(str(e)) from None
    if options.models.target:
        from specchat.session import Session

        with user_errors():
            target, draft, _, _ = load_models(options.models, console)
            for mode in modes:  # at the first fixed K listed; K measured where only auto is
                session = Session(target, draft, mode=mode, k=(lengths["ks"] or [lengths["measured_from"]])[0], sampling=sampling,
                                  seed=options.seed, max_new_tokens=options.max_new_tokens, mode_options=options.settings.drafter_options(),
                                  earlier_sessions=False)  # as the local bench: nothing learnt or saved before counts
                if not lengths["ks"]:
                    session.measure_k(lengths["measured_from"])
                configs[f"local-{mode}"] = session
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with user_errors(), Progress(*columns, console=console, transient=True) as progress:
        steps = Steps(progress, len(configs) * len(prompts) * params["repeat"])
        runs = bench_remote.run_all(configs, prompts, params["repeat"], steps)
    summary = bench_remote.summarise(configs, runs)
    how = "greedy" if sampling.greedy else f"T={sampling.temperature:g}"
    meta = bench_remote.meta_for(prompts, how, repeat=params["repeat"], max_new_tokens=options.max_new_tokens,
                                 servers=list(params["servers"]), target=options.models.target, modes=params["modes"])
    text = bench_remote.write(out_dir, summary, meta, runs)
    show_report(text)
    click.echo(f"wrote {out_dir / 'report.md'}, {out_dir / 'results.json'}", err=True)
    if any(r["runs_reconciled"] < r["runs"] for r in summary["rows"]):
        click.echo("bench: some servers' steps did not match their counters (see the report)", err=True)
        sys.exit(1)
