"""`specchat cache`: what the user cache holds (GGUF conversions for torch, tokenizers, requantised drafts, kernels,
...), with sizes and sources, and its removal: by name, the stale ones, or all (usercache.py; no torch)."""

from __future__ import annotations

import time

import click

from specchat.cli.options import BadOption
from specchat.fmt import size


def source_text(entry) -> str:
    """Where a model entry came from, as one phrase."""
    if entry.source_state == "unknown":
        return "source unknown (not recorded)"
    paths = entry.sources or []
    more = f" (and {len(paths) - 1} more)" if len(paths) > 1 else ""
    if entry.source_state == "missing":
        return f"stale: no longer at {paths[-1] if paths else '?'}{more}"
    return f"from {paths[-1]}{more}" if paths else ""


@click.command()
@click.option("--remove", "names", multiple=True, metavar="NAME", help="Remove this entry (a name the listing shows; repeat for several).")
@click.option("--stale", is_flag=True, help="Remove the models whose source file is gone or changed, and writes a crash left unfinished.")
@click.option("--all", "everything", is_flag=True, help="Remove every entry: the next start converts and compiles again.")
def cache(names, stale, everything):
    """List what the user cache holds (each entry's size, last use and source file), or remove entries. Only what
    specchat wrote there is listed or removed; nothing outside the cache folder is ever touched."""
    from specchat import usercache
    from specchat.store import cache_dir

    if sum((bool(names), stale, everything)) > 1:
        raise BadOption("give one of --remove, --stale and --all")
    if names:
        try:
            chosen = [usercache.find(name) for name in dict.fromkeys(names)]
        except usercache.UnknownEntry as e:  # nothing is removed unless every name is an entry
            raise BadOption(str(e)) from None
        removed = [remove(usercache, entry) for entry in chosen]
    elif stale:
        removed = [said(entry) for entry in usercache.remove_stale()]
    elif everything:
        removed = [said(entry) for entry in usercache.remove_all()]
    else:
        show(usercache.entries(), cache_dir())
        return
    if not removed:
        click.echo(f"nothing to remove in {cache_dir()}" + (" (no stale entries)" if stale else ""))
        return
    click.echo(f"freed {size(sum(e.size for e in removed))} in {cache_dir()}")


def remove(usercache, entry):
    try:
        usercache.remove(entry)
    except usercache.UnknownEntry as e:
        raise BadOption(str(e)) from None
    return said(entry)


def said(entry):
    click.echo(f"removed {entry.name} ({size(entry.size)})")
    return entry


def show(entries, root) -> None:
    if not entries:
        click.echo(f"the cache {root} holds nothing of specchat's")
        return
    width = max(len(e.name) for e in entries)
    click.echo(f"{root}: {len(entries)} entr{'ies' if len(entries) != 1 else 'y'}, {size(sum(e.size for e in entries))}")
    for e in entries:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used)) if e.last_used else "?"
        click.echo(f"  {e.name:<{width}}  {size(e.size):>9}  used {used}{'  STALE' if e.stale else ''}")
        click.echo(f"      {e.kind}" + (f", {source_text(e)}" if e.source_state else ""))
    stale = [e for e in entries if e.stale]
    hint = f"; --stale removes the {len(stale)} stale ({size(sum(e.size for e in stale))})" if stale else ""
    click.echo(f"remove one with `specchat cache --remove NAME`, all with --all{hint}")
