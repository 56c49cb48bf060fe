"""The `specchat bench` command: options, input checks (before any model loads), model loading, outputs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import click

from specchat.cli import UserError, load_models, mode_options, model_options, user_errors
from specchat.decoding.drafters import DRAFTER_CLASSES, MODES

BUILTIN_PROMPTS = Path(__file__).with_name("prompts.jsonl")


def parse_list(text: str, convert, what: str, check=lambda v: True, hint: str = "") -> list:
    """'2,4,8' -> [2, 4, 8], with a one-line error naming the option."""
    values = []
    for item in (x.strip() for x in text.split(",")):
        try:
            value = convert(item)
        except ValueError:
            raise UserError(f"{what}: {item!r} is not valid{hint}") from None
        if not check(value):
            raise UserError(f"{what}: {item!r} is not valid{hint}")
        if value not in values:
            values.append(value)
    if not values:
        raise UserError(f"{what} is empty")
    return values


def mode_built(mode: str) -> bool:
    """Whether the mode's drafter module exists (other modes are being built): checked without loading models."""
    return importlib.util.find_spec(f"specchat.decoding.drafters.{DRAFTER_CLASSES[mode][0]}") is not None


def choose_modes(spec: str | None, has_draft: bool) -> tuple[list[str], dict[str, str]]:
    """Requested modes (errors for unknown/unusable ones), or by default every built mode; returns (modes, skipped)."""
    if spec is None:
        skipped = {m: "needs --draft" for m in MODES if m == "draft" and not has_draft}
        skipped |= {m: "not available yet" for m in MODES if m not in skipped and not mode_built(m)}
        return [m for m in MODES if m not in skipped], skipped
    modes = parse_list(spec, str, "--modes")
    for m in modes:
        if m not in MODES:
            raise UserError(f"unknown mode {m!r} in --modes; choose from {', '.join(MODES)}")
        if m == "draft" and not has_draft:
            raise UserError("mode 'draft' needs a draft model: pass --draft MODEL")
        if not mode_built(m):
            raise UserError(f"mode {m!r} is not available yet")
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


@click.command()
@model_options
@click.option("--modes", default=None, metavar="LIST", help=f"Comma-separated, from: {', '.join(MODES)}. Default: every available mode (draft with --draft). off always runs.")
@click.option("--draft-len", "draft_lens", default="2,4,8", show_default=True, metavar="LIST", help="Draft lengths K to measure.")
@click.option("--temperature", "temperatures", default="0", show_default=True, metavar="LIST", help="Temperatures, e.g. 0,0.7 (0 is greedy).")
@click.option("--accept", "accepts", default="exact", show_default=True, metavar="LIST", help="Acceptance rules (exact, or approx:<param>).")
@click.option("--prompts", "prompts_spec", default="builtin", show_default=True, metavar="builtin|FILE.jsonl")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True, help="Passes over the prompts.")
@click.option("--peers", is_flag=True, help="Also run HF transformers' own implementation of each requested mode: generate() for off, assistant_model for draft, prompt_lookup_num_tokens for lookup, assistant_early_exit for earlyexit.")
@click.option("--verify-samples", type=int, default=100, show_default=True, help="Samples per side of the distribution test for sampled exact modes (0 skips; else >= 20).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch CPU threads (default: torch's choice). Fewer than cores can be faster on a shared machine.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("bench-results"), show_default=True)
@click.option("--skip-layers", metavar="LIST", help="layerskip: layers to skip.")
@click.option("--exit-layer", type=click.IntRange(min=1), default=None, help="earlyexit (and the HF early-exit peer): layers run by the draft pass.")
@click.option("--rank", metavar="R", default=None, help="lowrank: rank as a fraction (0.25) or an integer.")
def bench(modes, draft_lens, temperatures, accepts, prompts_spec, max_new_tokens, repeat, peers, verify_samples, seed, threads, out_dir, **opts):
    """Measure every mode against plain decoding on the same prompts, with quality checks."""
    from specchat.decoding.acceptance import parse_rule

    # -- everything the user can get wrong, before any model loads
    mode_list, skipped = choose_modes(modes, bool(opts["draft"]))
    ks = parse_list(draft_lens, int, "--draft-len", lambda k: k >= 1, " (positive integers)")
    temps = parse_list(temperatures, float, "--temperature", lambda t: t >= 0, " (numbers >= 0)")
    rules = parse_list(accepts, str, "--accept")
    for rule in rules:
        try:
            parse_rule(rule)
        except ValueError as e:
            raise UserError(str(e)) from None
    if verify_samples and verify_samples < 20:
        raise UserError("--verify-samples must be 0 (skip) or at least 20")
    prompt_items = read_prompts(prompts_spec)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir} exists and is not a directory")
    settings_modes = mode_options(opts)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specchat.bench import report, runner
    from specchat.decoding.drafters import ModeUnavailable, build_drafter

    if threads:
        import torch

        torch.set_num_threads(threads)
    console = Console(stderr=True)
    with user_errors():
        target, draft, device, dtype = load_models(opts, console)

        # -- drafters: a mode that cannot run with these models fails now, not after the long run
        drafters, drafter_mb = {}, {}
        for mode in mode_list:
            before = runner.memory_mb(device)
            try:
                drafters[mode] = build_drafter(mode, target.model, draft.model if draft else None, **settings_modes)
            except ModeUnavailable as e:
                if modes is not None:
                    raise
                skipped[mode] = str(e)
                continue
            drafter_mb[mode] = runner.memory_mb(device) - before
        prompts = []
        for item in prompt_items:
            tok = target.tokenizer
            ids = tok(item["prompt"])["input_ids"] if item["raw"] else tok.apply_chat_template(
                [{"role": "user", "content": item["prompt"]}], add_generation_prompt=True, tokenize=True, return_dict=False)
            ids = list(ids)
            if target.context_len and len(ids) >= target.context_len:
                raise UserError(f"prompt {item['name']!r} is {len(ids)} tokens; {target.name} has a context of {target.context_len}")
            prompts.append(runner.Prompt(item["name"], item["kind"], item["prompt"], ids))

    config = target.model.generation_config
    eos = config.eos_token_id if config is not None else None
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if target.tokenizer.eos_token_id is not None:
        eos_ids.add(target.tokenizer.eos_token_id)
    ctx = runner.Context(target, draft, device, drafters, eos_ids, max_new_tokens, seed, opts["exit_layer"])
    configs = runner.build_configs([m for m in mode_list if m in drafters], ks, temps, rules, peers=peers)
    n_verify = len({(c.mode, c.temperature) for c in configs if not c.is_peer and c.mode != "off" and c.temperature > 0 and c.exact})
    total = len(configs) * (1 + len(prompts) * repeat) + (n_verify if verify_samples else 0)

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with user_errors(), Progress(*columns, console=console, transient=True) as progress:
        steps = Steps(progress, total)
        runs = runner.run_all(ctx, configs, prompts, repeat, steps)
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
    results = {
        "settings": {
            "target": target.name, "draft": draft.name if draft else None, "modes": [m for m in mode_list if m in drafters],
            "draft_lens": ks, "temperatures": temps, "top_k": 0, "top_p": 1.0, "accept": rules, "prompts": prompts_spec,
            "max_new_tokens": max_new_tokens, "repeat": repeat, "peers": peers, "seed": seed,
            "verify_samples": verify_samples, "mode_options": settings_modes,
            "hf_early_exit_layer": runner_exit_layer(ctx) if peers else None,
        },
        "machine": runner.machine_info(device, dtype),
        "prompts": [{"name": p.name, "kind": p.kind, "text": p.text, "prompt_tokens": len(p.ids)} for p in prompts],
        "configs": rows,
        "peers": report.peer_pairs(rows),
        "checks": checks,
        "skipped_modes": skipped,
        "runs": runs,
    }
    text, note = report.write(results, out_dir)
    click.echo(text)
    click.echo(f"wrote {out_dir / 'report.md'}, {out_dir / 'results.json'}" + ("" if note else f", {out_dir / 'speedup.png'}"), err=True)
    if note:
        click.echo(note, err=True)
    failed = checks["greedy_identity"] or any(v["verdict"] == "fail" for v in checks["distribution"])
    if failed:
        click.echo("bench: quality check FAILED (see Checks in the report)", err=True)
        sys.exit(1)


def runner_exit_layer(ctx) -> int:
    from specchat.bench.peers import early_exit_layer

    return early_exit_layer(ctx)


