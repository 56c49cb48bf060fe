"""Per-model settings found by `specchat tune`, kept in the user cache as one JSON file per model.

Drafters read their default from here (layerskip: skip_layers, earlyexit: exit_layer, lowrank: rank),
so the engine needs no CLI import: `load_tuned(model, "layerskip")` -> {"skip_layers": [...], ...} or None.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import platformdirs


def tuned_dir() -> Path:
    """platformdirs' user cache (SPECCHAT_CACHE_DIR overrides, as for converted models) / tuned."""
    return Path(os.environ.get("SPECCHAT_CACHE_DIR") or platformdirs.user_cache_path("specchat")) / "tuned"


def model_key(model) -> str:
    """A file name for this model: its directory name plus a hash of its path and shape."""
    config = model.config
    source = str(getattr(model, "name_or_path", "") or getattr(config, "_name_or_path", ""))
    shape = f"{config.model_type}:{config.num_hidden_layers}:{config.hidden_size}:{config.vocab_size}"
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(source).name) or config.model_type
    return f"{stem}-{hashlib.sha1(f'{source}|{shape}'.encode()).hexdigest()[:10]}"


def tuned_path(model) -> Path:
    return tuned_dir() / f"{model_key(model)}.json"


def load_all(model) -> dict:
    try:
        return json.loads(tuned_path(model).read_text())
    except (OSError, ValueError):
        return {}


def load_tuned(model, mode: str) -> dict | None:
    """The saved result of `specchat tune --mode <mode>` for this model, or None."""
    entry = load_all(model).get(mode)
    return entry if isinstance(entry, dict) else None


def save_tuned(model, mode: str, result: dict) -> Path:
    """Store one mode's result beside the others for this model (atomic replace)."""
    path = tuned_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = load_all(model)
    data[mode] = result
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path
