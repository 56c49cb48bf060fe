"""What the user cache holds (`specchat cache`): its entries, where each converted model came from, and their removal.

No torch here: listing answers in a fraction of a second. An entry is one thing in the cache that can be removed
on its own:

- in models/ (store.models_dir): a GGUF's torch conversion (`<stem>-<key>`, a folder for from_pretrained), its
  tokenizer alone (`<stem>-<key>-tokenizer`, for llama.cpp), a requantised copy (`<stem>-<key>.<TYPE>.gguf`, mode
  quant's draft), and what a crash left half-written (`.<name>.*.tmp`). `<key>` is the first 12 hex digits of the
  source file's SHA-256 (content_key); `<stem>-<key>.source.json` beside them records the paths it was read from.
- the other folders specchat writes there (SPECIAL): compiled kernels, llama.cpp's probe verdicts, a llama-server
  build, low-rank factors, draft heads, tuned settings. One entry each.

Nothing else is listed, and nothing else is ever removed: a cache folder set to a wrong place (SPECCHAT_CACHE_DIR=~)
loses nothing but what specchat itself would have written there.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from specchat.store import cache_dir, models_dir, write_atomic

# the folders specchat keeps directly in the cache, and what they hold
SPECIAL = {
    "kernels": "compiled small-batch kernel (cc, once per CPU)",
    "llama.cpp": "llama.cpp repacking verdicts (once per CPU)",
    "llama-server": "llama-server build (scripts/build_llama_server.py)",
    "lowrank": "low-rank factors (mode lowrank)",
    "heads": "draft heads trained here (specchat train-head)",
    "tuned": "tuned mode settings (specchat tune)",
}
KEYS = ".keys"  # models/.keys: content keys remembered per path, size and mtime (content_key)
SOURCE_SUFFIX = ".source.json"
# <stem>-<key>, its tokenizer, or a requantised copy; the stem may hold dots and dashes (SmolLM2-135M-Instruct.Q4_1)
MODEL_NAME = re.compile(r"^(?P<base>.+-[0-9a-f]{8,64})(?:(?P<tokenizer>-tokenizer)|\.(?P<ftype>[A-Za-z0-9_]+)\.gguf)?$")
UNFINISHED = re.compile(r"^\.(?P<name>.+)\.[^.]+\.tmp$")  # store._beside's folder: .<name>.<random>.tmp
UNFINISHED_STALE_S = 3600  # one untouched for an hour is no conversion running now: a crash left it


# ---------------------------------------------------------------- content keys and source records


def content_key(path: Path) -> str:
    """SHA-256 of the file's bytes, read once per path, size and modification time and remembered in the user cache.

    A key of the path alone made every new virtual environment convert the default model again (a fresh pip
    install is a new path and a new mtime): 540 MB of float32 each time, and the test suite's first run in a new
    environment converted in two processes at once (~30 s each). Hashing reads the file once (the default model's 100 MB: a fraction of a
    second; a 5 GB model: seconds, where its conversion takes minutes)."""
    stat = path.stat()
    seen = models_dir() / KEYS / hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    try:
        return seen.read_text().strip()
    except OSError:
        pass
    with open(path, "rb") as f:
        key = hashlib.file_digest(f, "sha256").hexdigest()
    try:
        write_atomic(seen, key)
    except OSError:  # a read-only cache: hash again next time
        pass
    return key


def source_record(base: str) -> Path:
    """Where the sources of `<stem>-<key>` (and of its tokenizer and requantised copies) are recorded."""
    return models_dir() / f"{base}{SOURCE_SUFFIX}"


def read_sources(base: str) -> dict | None:
    """{"sha256": key, "sources": [{"path", "size", "mtime_ns"}, ...]}, or None where none was recorded (made before
    specchat recorded them, or unreadable)."""
    try:
        data = json.loads(source_record(base).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and isinstance(data.get("sha256"), str) and isinstance(data.get("sources"), list)
    return data if ok else None


def record_source(base: str, path: Path) -> None:
    """Remember that the cache's `base` entries were made from (or are used for) the file at `path`. Called at each
    conversion and each use of one, so a copy in a new virtual environment counts as a source too (--stale keeps an
    entry while any recorded path still holds its content). Never fails a load: a read-only cache records nothing."""
    try:
        path = Path(path).resolve()
        stat = path.stat()
        data = read_sources(base) or {"sha256": content_key(path), "sources": []}
        entry = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        if entry in data["sources"]:
            return
        data["sources"] = [s for s in data["sources"] if isinstance(s, dict) and s.get("path") != str(path)] + [entry]
        write_atomic(source_record(base), json.dumps(data, indent=1) + "\n")
    except OSError:
        pass


def source_holds(source: dict, sha256: str) -> bool:
    """Whether the file at a recorded source path still holds the content the entry was made from: unchanged size and
    mtime say so without reading it; a changed mtime is hashed (once: content_key remembers it)."""
    path = Path(str(source.get("path", "")))
    try:
        stat = path.stat()
    except OSError:
        return False
    if not path.is_file() or stat.st_size != source.get("size"):
        return False
    if stat.st_mtime_ns == source.get("mtime_ns"):
        return True
    try:
        return content_key(path) == sha256
    except OSError:
        return False


# ---------------------------------------------------------------- entries


@dataclass
class Entry:
    name: str  # what `specchat cache --remove` takes
    path: Path
    kind: str
    size: int  # bytes
    last_used: float  # the latest access or modification time of its files (seconds since the epoch)
    sources: list[str] | None  # the recorded source files; None: not recorded (or not a model entry)
    source_state: str  # "present", "missing" (no recorded path holds its content), "unknown", or "" (not a model's)
    stale: bool  # what --stale removes

    @property
    def base(self) -> str | None:
        return _base_of(self.path) if self.path.parent == models_dir() else None


def _measure(path: Path) -> tuple[int, float]:
    """Bytes held and the latest access or modification time, of a file or everything under a folder (links not
    followed)."""
    size, last = 0, 0.0
    stack = [path]
    while stack:
        p = stack.pop()
        try:
            st = p.lstat()
        except OSError:
            continue
        last = max(last, st.st_atime, st.st_mtime)
        if p.is_dir() and not p.is_symlink():
            try:
                stack.extend(p.iterdir())
            except OSError:
                pass
        else:
            size += st.st_size
    return size, last


def _model_kind(path: Path, m: re.Match) -> str:
    if m["tokenizer"]:
        return "GGUF tokenizer (llama.cpp engine)"
    if m["ftype"]:
        return f"{m['ftype']} requantised copy (mode quant)"
    return "torch conversion (dequantised GGUF)" if (path / "config.json").is_file() else "torch conversion (incomplete)"


def entries() -> list[Entry]:
    """Everything `specchat cache` lists, models first (by name), then the other folders."""
    out = []
    models = models_dir()
    now = time.time()
    try:
        items = sorted(models.iterdir()) if models.is_dir() else []
    except OSError:
        items = []
    states: dict[str, tuple[list[str] | None, str]] = {}
    for path in items:
        name = path.name
        unfinished = UNFINISHED.match(name)
        if unfinished:
            size, last = _measure(path)
            stale = now - last > UNFINISHED_STALE_S
            out.append(Entry(name, path, "unfinished write (a crashed conversion, or one running now)", size, last, None,
                             "", stale))
            continue
        m = MODEL_NAME.match(name)
        if name.startswith(".") or name.endswith(SOURCE_SUFFIX) or m is None:
            continue  # .keys and the source records go with their entries; what specchat did not write stays
        base = m["base"]
        if base not in states:
            record = read_sources(base)
            if record is None:
                states[base] = (None, "unknown")
            else:
                paths = [str(s.get("path")) for s in record["sources"] if isinstance(s, dict)]
                held = any(source_holds(s, record["sha256"]) for s in record["sources"] if isinstance(s, dict))
                states[base] = (paths, "present" if held else "missing")
        sources, state = states[base]
        size, last = _measure(path)
        out.append(Entry(name, path, _model_kind(path, m), size, last, sources, state, state == "missing"))
    root = cache_dir()
    for name, kind in SPECIAL.items():
        path = root / name
        if path.exists() and not path.is_symlink():
            size, last = _measure(path)
            out.append(Entry(name, path, kind, size, last, None, "", False))
    return out


# ---------------------------------------------------------------- removal


class UnknownEntry(ValueError):
    """A name `specchat cache` does not list: nothing is removed."""


def _inside(path: Path, folder: Path) -> bool:
    """Whether `path` itself (not what a link points at) lies in `folder` (followed, as the cache may be a link)."""
    try:
        folder = folder.resolve()
        return Path(os.path.realpath(path.parent)).is_relative_to(folder) and path.name not in ("", ".", "..")
    except OSError:
        return False


def remove(entry: Entry) -> None:
    """Delete one listed entry: a file or a link is unlinked, a folder removed with what it holds (links inside are
    unlinked, never followed). The source record goes with the last entry made from it."""
    root = cache_dir()
    if not _inside(entry.path, root):
        raise UnknownEntry(f"{entry.path} is not inside the cache folder {root}")
    if entry.path.is_dir() and not entry.path.is_symlink():
        shutil.rmtree(entry.path)
    else:
        entry.path.unlink(missing_ok=True)
    base = entry.base
    if base is not None and not any(_base_of(p) == base for p in models_dir().iterdir()):
        source_record(base).unlink(missing_ok=True)


def _base_of(path: Path) -> str | None:
    """The `<stem>-<key>` a model entry of models/ was made from (None for anything else)."""
    m = MODEL_NAME.match(path.name)
    return m["base"] if m and not path.name.startswith(".") and not path.name.endswith(SOURCE_SUFFIX) else None


def find(name: str) -> Entry:
    """The listed entry called `name` (exactly as `specchat cache` shows it); UnknownEntry for anything else, a path
    included."""
    if not name or name != Path(name).name or name in (".", ".."):
        raise UnknownEntry(f"{name!r} is not an entry of the cache: give a name `specchat cache` lists, not a path")
    for entry in entries():
        if entry.name == name:
            return entry
    raise UnknownEntry(f"no entry {name!r} in the cache {cache_dir()}: `specchat cache` lists them")


def remove_all() -> list[Entry]:
    """Every listed entry, then what only they used (the content keys and the source records)."""
    gone = entries()
    for entry in gone:
        remove(entry)
    models = models_dir()
    shutil.rmtree(models / KEYS, ignore_errors=True)
    for record in models.glob(f"*{SOURCE_SUFFIX}") if models.is_dir() else []:
        record.unlink(missing_ok=True)
    return gone


def remove_stale() -> list[Entry]:
    gone = [e for e in entries() if e.stale]
    for entry in gone:
        remove(entry)
    return gone
