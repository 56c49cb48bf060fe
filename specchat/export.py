"""Session export: JSON (configuration, every turn, round and token, per-mode summaries), CSV (one row per round)
and the conversation as Markdown (to read or share).

The three files are written in full beside their targets before any replaces its predecessor, then renamed as a set
(store.atomic_files): a full disk, a failed write or a refused rename leaves the previous export as it was, never a
half-written file nor a new JSON beside an old CSV; only a crash between two renames (microseconds) can leave a mix.
Without a path they go to the user data folder (store.exports_dir).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections import Counter
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from specchat.machine import client_info, hardware_info
from specchat.store import atomic_files, exports_dir, write_file

FORMAT = "specchat-session/1"

CSV_COLUMNS = [
    "turn", "round", "mode", "draft_len", "drafted", "accepted", "emitted", "draft_calls",
    "draft_ms", "verify_ms", "wall_ms", "prefill_ms", "exact", "stop_reason",
    "temperature", "top_k", "top_p", "text",
]


def _token(t) -> dict:
    return {
        "id": t.id, "text": t.text, "kind": t.kind, "position": t.position, "p": t.p, "q": t.q,
        "accept_prob": t.accept_prob, "top_p": [list(a) for a in t.top_p], "top_q": [list(a) for a in t.top_q],
    }


def _round(r, sampling) -> dict:
    return {
        "index": r.index, "mode": r.mode, "draft_len": r.draft_len, "drafted": r.drafted,
        "accepted": r.accepted, "emitted": r.emitted, "draft_calls": r.draft_calls,
        "draft_s": r.draft_s, "verify_s": r.verify_s, "wall_s": r.wall_s, "prefill_s": r.prefill_s,
        "exact": r.exact, "stop_reason": r.stop_reason,
        "sampling": asdict(sampling) if sampling is not None else None,
        "rejected": list(r.rejected),
        "tokens": [_token(t) for t in r.tokens],
    }


def mode_summary(snapshot, mode: str) -> dict:
    """A mode's statistics and, beside them, the predicted speedup over plain decoding (metrics.SpeedupModel)."""
    model = snapshot.speedup(mode)
    return {**snapshot.stats[mode].summary(), "speedup_model": model.as_dict() if model else None}


def session_data(session) -> dict:
    """Everything an export holds, read under the session's lock so a streaming reply cannot tear it."""
    info = session.info
    with session.lock:
        snapshot = session.snapshot()
        turns = [(t, list(t.rounds), list(t.sampling)) for t in session.turns]
        turn_dicts = []
        for i, (turn, rounds, sampling) in enumerate(turns):
            sampling += [None] * (len(rounds) - len(sampling))
            turn_dicts.append({
                "index": i, "user": turn.user, "reply": turn.reply, "prompt_tokens": turn.prompt_tokens,
                "new_tokens": len(turn.reply_ids),
                "stop_reason": turn.stop_reason or ("stopped" if rounds else "stopped before the first round"),
                "rounds": [_round(r, s) for r, s in zip(rounds, sampling)],
            })
    all_rounds = [r for _, rounds, _ in turns for r in rounds]
    sampling_used = []
    for _, _, sampling in turns:
        for s in sampling:
            if s is not None and asdict(s) not in sampling_used:
                sampling_used.append(asdict(s))
    config = {
        "target": session.target.name,
        "draft": session.draft.name if session.draft is not None else None,
        "engine": info.engine,  # what runs the models: "torch", "llama.cpp" or a serving engine
        "device": info.device,
        "dtype": info.dtype,
        "runner": info.runner,  # the target's forward: "lean" (engine/runner.py), "hf" or "llama.cpp"
        "kernel": info.kernel,  # its matmuls: "fused" (engine/smallbatch.py) or "torch"
        # a serving engine's client knows its own machine only; the server's configuration is its own key
        "hardware": client_info() if info.remote else hardware_info(info.device, info.dtype),
        "server": asdict(info.server) if info.remote else None,
        "mode": snapshot.mode,  # the mode selected at export time; what ran is rounds_by_mode
        "draft_len": "auto" if snapshot.k_measured else snapshot.k,  # what each round asked for: draft_lengths
        "sampling": asdict(snapshot.sampling),
        "acceptance_rule": snapshot.rule,
        "exact": all(r.exact for r in all_rounds) if all_rounds else snapshot.exact,
        "seed": session.seed,
        "max_new_tokens": session.max_new_tokens,
        "modes_used": list(dict.fromkeys(r.mode for r in all_rounds)),
        "rounds_by_mode": dict(Counter(r.mode for r in all_rounds)),  # in the order they first ran (mode auto runs several)
        "draft_lengths": sorted({r.draft_len for r in all_rounds}),
        "sampling_used": sampling_used,
    }
    return {
        "format": FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": config,
        "summary": {"total": snapshot.total.summary(), "modes": {m: mode_summary(snapshot, m) for m in snapshot.stats}},
        "turns": turn_dicts,
    }


def rounds_csv(data: dict) -> str:
    """One row per round of every turn, with the sampling settings it ran under."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for turn in data["turns"]:
        for r in turn["rounds"]:
            s = r["sampling"] or {}
            writer.writerow([
                turn["index"], r["index"], r["mode"], r["draft_len"], r["drafted"], r["accepted"], r["emitted"],
                r["draft_calls"], f"{1000 * r['draft_s']:.3f}", f"{1000 * r['verify_s']:.3f}",
                f"{1000 * r['wall_s']:.3f}", f"{1000 * r['prefill_s']:.3f}", r["exact"], r["stop_reason"] or "",
                s.get("temperature", ""), s.get("top_k", ""), s.get("top_p", ""),
                "".join(t["text"] for t in r["tokens"]),
            ])
    return out.getvalue()


def export_paths(path: Path) -> tuple[Path, Path]:
    """PATH -> (JSON path, CSV path): the CSV sits beside the JSON with the same stem."""
    path = Path(path).expanduser()
    if path.suffix.lower() in (".json", ".csv"):
        return path.with_suffix(".json"), path.with_suffix(".csv")
    return path.with_name(path.name + ".json"), path.with_name(path.name + ".csv")


def json_safe(obj):
    """NaN and infinity (a statistic with nothing to divide by) are not JSON: write them as null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def markdown_path(json_path: Path) -> Path:
    """The Markdown export sits beside the JSON with the same stem."""
    return Path(json_path).with_suffix(".md")


def conversation_markdown(session, data: dict) -> str:
    """The conversation as Markdown: the settings on one line, the system message, then each message.

    From the session's messages, so a resumed conversation (--continue) is exported whole; replies are
    kept as the model wrote them (they are usually Markdown already)."""
    config, temperature = data["config"], data["config"]["sampling"]["temperature"]
    draft = f" + {config['draft']}" if config["draft"] else ""
    sampling = "greedy" if temperature == 0 else f"T={temperature:g}"
    ran = config["rounds_by_mode"]
    modes = ", ".join(f"{mode} {n} round{'s' if n != 1 else ''}" for mode, n in ran.items()) if ran else f"mode {config['mode']}"
    lines = [f"# specchat conversation, {data['created']}", "",
             f"*{config['target']}{draft} · {modes} · K={config['draft_len']} · {sampling}*", ""]
    titles = {"system": "System", "user": "User", "assistant": "Assistant"}
    with session.lock:
        messages = list(session.messages)
    # this run's turns end the conversation, one reply each (earlier ones came from --continue), but for a reply still
    # streaming (its message comes when it ends): say where one stopped
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    turns = data["turns"][:-1] if messages and messages[-1]["role"] == "user" else data["turns"]
    ended = {i: t["stop_reason"] for i, t in zip(replies[::-1], turns[::-1]) if messages[i]["content"] == t["reply"]}
    for i, message in enumerate(messages):
        lines += [f"## {titles.get(message['role'], message['role'].title())}", "", message["content"].strip(), ""]
        if ended.get(i, "eos") != "eos":
            lines += [f"*({_ENDED.get(ended[i], ended[i])})*", ""]
    return "\n".join(lines)


# why a reply ended before the model ended it, as the chat's status line says it (session_data's stop_reason)
_ENDED = {"stopped": "stopped", "stopped before the first round": "stopped before the first token",
          "max_new_tokens": "stopped at max new tokens", "context": "stopped at the context length"}


def write_export(session, path: Path) -> tuple[Path, Path]:
    """Write the session as JSON and CSV, and the conversation as Markdown beside them (markdown_path);
    returns the JSON and CSV paths."""
    data = session_data(session)
    json_path, csv_path = export_paths(path)
    texts = {csv_path: rounds_csv(data), markdown_path(json_path): conversation_markdown(session, data),
             json_path: json.dumps(json_safe(data), indent=1, ensure_ascii=False, allow_nan=False, default=str) + "\n"}
    # every file written in full beside its target before any replaces one, then renamed as a set, the JSON last: a
    # full disk, a failed write or a refused rename leaves the previous export as it was (store.atomic_files)
    with atomic_files(list(texts)) as tmps:
        for tmp, text in zip(tmps, texts.values()):
            write_file(tmp, text)
    return json_path, csv_path


def default_export_path() -> Path:
    """ctrl+s without --export: a timestamped file in the user data folder (never the source tree)."""
    return exports_dir() / f"specchat-session-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"


def save_export(session, path: Path) -> tuple[str, bool]:
    """Write the export to `path`; return one line saying where it went, and whether the session was saved. Should
    that fail (the folder went away, the disk is full), the session goes to a new file in the user data folder
    (store.exports_dir) instead, and the line says so: a session is not lost to a bad path."""
    try:
        json_path, csv_path = write_export(session, path)
        return f"session exported to {json_path}, {csv_path} and {markdown_path(json_path)}", True
    except Exception as e:  # OSError mostly; whatever it was, the fallback below still saves the session
        why = _why(e)
    fallback = default_export_path()
    try:
        json_path, csv_path = write_export(session, fallback)
    except Exception as e:
        return f"could not write the export to {path} ({why}) nor to {fallback} ({_why(e)}): the session was not saved", False
    return (f"could not write the export to {path} ({why}); saved the session to {json_path}, {csv_path} and "
            f"{markdown_path(json_path)} instead"), True


def _why(e: Exception) -> str:
    return e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
