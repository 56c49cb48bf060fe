"""Session export: JSON (configuration, every turn, round and token, per-mode summaries) and CSV (one row per round).

Both files are written atomically (a temporary file in the same directory, then os.replace), so an
export interrupted by a crash never leaves a half-written file where a good one was.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import platform
import tempfile
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch

FORMAT = "specchat-session/1"

CSV_COLUMNS = [
    "turn", "round", "mode", "draft_len", "drafted", "accepted", "emitted", "draft_calls",
    "draft_ms", "verify_ms", "wall_ms", "prefill_ms", "exact", "stop_reason",
    "temperature", "top_k", "top_p", "text",
]


def hardware_info(device_label: str = "") -> dict:
    """What the numbers were measured on: every reported result must carry the hardware."""
    info = {
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "system": f"{platform.system()} {platform.release()}",
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover - a dependency, always present in practice
        pass
    if torch.cuda.is_available() and (device_label.startswith("cuda") or not device_label):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _model_device_dtype(session) -> tuple[str, str]:
    model = getattr(session.target, "model", None)
    try:
        return str(model.device), str(model.dtype).removeprefix("torch.")
    except AttributeError:
        return "", ""


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


def session_data(session, *, device_label: str = "", dtype_label: str = "") -> dict:
    """Everything an export holds, read under the session's lock so a streaming reply cannot tear it."""
    with session.lock:
        turns = [(t, list(t.rounds), list(t.sampling)) for t in session.turns]
        stats = {mode: s.summary() for mode, s in session.stats.items()}
        total = session.total.summary()
        controls = session.controls
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
    device, dtype = _model_device_dtype(session)
    sampling_used = []
    for _, _, sampling in turns:
        for s in sampling:
            if s is not None and asdict(s) not in sampling_used:
                sampling_used.append(asdict(s))
    config = {
        "target": session.target.name,
        "draft": session.draft.name if session.draft is not None else None,
        "device": device_label or device,
        "dtype": dtype_label or dtype,
        "hardware": hardware_info(device_label or device),
        "mode": controls.mode,
        "draft_len": controls.k,
        "sampling": asdict(controls.sampling),
        "acceptance_rule": getattr(controls.rule, "name", str(controls.rule)),
        "exact": all(r.exact for r in all_rounds) if all_rounds else bool(getattr(controls.rule, "exact", True)),
        "seed": session.seed,
        "max_new_tokens": session.max_new_tokens,
        "modes_used": list(dict.fromkeys(r.mode for r in all_rounds)),
        "draft_lengths": sorted({r.draft_len for r in all_rounds}),
        "sampling_used": sampling_used,
    }
    return {
        "format": FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": config,
        "summary": {"total": total, "modes": stats},
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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file beside `path`, flush it to disk, then rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _finite(obj):
    """NaN and infinity are not JSON: write them as null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_export(session, path: Path, *, device_label: str = "", dtype_label: str = "") -> tuple[Path, Path]:
    """Write the session as JSON and CSV; returns both paths."""
    data = session_data(session, device_label=device_label, dtype_label=dtype_label)
    json_path, csv_path = export_paths(path)
    write_atomic(json_path, json.dumps(_finite(data), indent=1, ensure_ascii=False, allow_nan=False, default=str) + "\n")
    write_atomic(csv_path, rounds_csv(data))
    return json_path, csv_path


def default_export_path() -> Path:
    """F9 without --export: a timestamped file in the current directory."""
    return Path.cwd() / f"specchat-session-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
