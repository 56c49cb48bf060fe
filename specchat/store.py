"""Where specchat keeps things on disk, and how it writes them: atomically, so a crash never leaves half a file.

- cache (`SPECCHAT_CACHE_DIR`, else platformdirs' user cache): converted GGUF models, tuned settings,
  low-rank factors; everything there can be recomputed.
- data (`SPECCHAT_DATA_DIR`, else platformdirs' user data folder): what the user made: session exports
  (ctrl+s), bench reports.
- config (`SPECCHAT_CONFIG_DIR`, else platformdirs' user config folder): user themes.
- state (`SPECCHAT_STATE_DIR`, else platformdirs' user state folder): what mode auto learnt about this machine
  (LearntRates). Not the cache: the tests share one cache between runs, and learnt rates must start fresh there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import platformdirs

if TYPE_CHECKING:  # torch loads only when tensors are stored or read: `specchat history` never needs it
    import torch


def cache_dir() -> Path:
    return Path(os.environ.get("SPECCHAT_CACHE_DIR") or platformdirs.user_cache_path("specchat"))


def data_dir() -> Path:
    return Path(os.environ.get("SPECCHAT_DATA_DIR") or platformdirs.user_data_path("specchat"))


def config_dir() -> Path:
    return Path(os.environ.get("SPECCHAT_CONFIG_DIR") or platformdirs.user_config_path("specchat"))


def state_dir() -> Path:
    return Path(os.environ.get("SPECCHAT_STATE_DIR") or platformdirs.user_state_path("specchat"))


def models_dir() -> Path:
    """Converted (dequantised GGUF) models."""
    return cache_dir() / "models"


def exports_dir() -> Path:
    """Session exports written without --export."""
    return data_dir() / "exports"


def bench_dir() -> Path:
    """`specchat bench` reports written without --out."""
    return data_dir() / "bench"


def user_themes_dir() -> Path:
    return config_dir() / "themes"


# ---------------------------------------------------------------- atomic writes


@contextlib.contextmanager
def _beside(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` (the same file system, so a rename publishes it), in a folder removed afterwards."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")) / path.name
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


def _keep_mode(tmp: Path, path: Path) -> None:
    """A file replacing another takes its mode. A new one keeps the mode its writer's open() gave it (the umask's):
    reading the umask means setting it, process-wide, and a file another thread created meanwhile would get 0666."""
    if tmp.is_file() and path.is_file():
        os.chmod(tmp, path.stat().st_mode & 0o777)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path` (file or directory) to write; on success it replaces `path`.

    A directory cannot replace a non-empty one: when another process wrote `path` first (two first starts
    converting the same model at once), its copy is kept and this one dropped: both hold the same content."""
    path = Path(path)
    with _beside(path) as tmp:
        yield tmp
        _keep_mode(tmp, path)
        try:
            os.replace(tmp, path)
        except OSError:
            if not (tmp.is_dir() and path.is_dir() and any(path.iterdir())):
                raise


@contextlib.contextmanager
def atomic_files(paths: list[Path]) -> Iterator[list[Path]]:
    """Yield temporary paths beside `paths` (files) to write; on success they replace `paths` one by one, in order.

    Should a rename fail, those already done are undone (the previous file put back, or the new one removed where
    there was none), so a failed write or rename leaves the set as it was; only a crash between two renames can
    leave some new and some old."""
    paths = [Path(p) for p in paths]
    with contextlib.ExitStack() as stack:
        tmps = [stack.enter_context(_beside(p)) for p in paths]
        yield tmps
        done = []
        try:
            for tmp, path in zip(tmps, paths):
                old = tmp.with_name(f"{tmp.name}.old")  # the previous file, kept until the whole set is in place
                if path.is_file():
                    try:
                        os.link(path, old)
                    except OSError:  # a file system without hard links
                        shutil.copy2(path, old)
                _keep_mode(tmp, path)
                os.replace(tmp, path)
                done.append((path, old))
        except BaseException:
            for path, old in reversed(done):
                if old.exists():
                    os.replace(old, path)
                else:
                    path.unlink(missing_ok=True)
            raise


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, flush it to disk, then rename it over `path`."""
    with atomic_path(path) as tmp:
        write_file(tmp, text)


def write_file(path: Path, text: str) -> None:
    """`text` to `path`, flushed to disk (the content an atomic rename then publishes)."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------- per-model settings found by `specchat tune`


def model_key(model) -> str:
    """A file name for this model: its directory name plus a hash of its path and shape."""
    config = model.config
    source = str(getattr(model, "name_or_path", "") or getattr(config, "_name_or_path", ""))
    shape = f"{config.model_type}:{config.num_hidden_layers}:{config.hidden_size}:{config.vocab_size}"
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(source).name) or config.model_type
    return f"{stem}-{hashlib.sha1(f'{source}|{shape}'.encode()).hexdigest()[:10]}"


def tuned_path(model) -> Path:
    return cache_dir() / "tuned" / f"{model_key(model)}.json"


def load_all_tuned(model) -> dict:
    try:
        return json.loads(tuned_path(model).read_text())
    except (OSError, ValueError):
        return {}


def load_tuned(model, mode: str) -> dict | None:
    """The saved result of `specchat tune --mode <mode>` for this model, or None."""
    entry = load_all_tuned(model).get(mode)
    return entry if isinstance(entry, dict) else None


def save_tuned(model, mode: str, result: dict) -> Path:
    """Store one mode's result beside the others for this model."""
    path = tuned_path(model)
    data = load_all_tuned(model)
    data[mode] = result
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


class LearntRates:
    """Mode auto's rates for one setup (the target's and draft's weights, engine, device, dtype, threads, the
    machine), kept between sessions: a first reply starts from what earlier sessions measured (drafters/auto.py).
    `kind` "draft_length": the measured K's costs and acceptance instead (engine/draft_length.py)."""

    def __init__(self, setup: dict, kind: str = "auto") -> None:
        self.setup = setup
        key = hashlib.sha1(json.dumps(setup, sort_keys=True).encode()).hexdigest()[:16]
        self.path = state_dir() / kind / f"{key}.json"

    def load(self) -> dict:
        """{sampling setting: {arm: {tokens, seconds, rounds, at}}}; {} for a setup never seen or an unreadable file."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        rates = data.get("rates") if isinstance(data, dict) and data.get("setup") == self.setup else None
        return rates if isinstance(rates, dict) else {}

    def save(self, rates: dict) -> None:
        try:
            write_atomic(self.path, json.dumps({"setup": self.setup, "rates": rates}, indent=1, sort_keys=True) + "\n")
        except OSError:  # a read-only or full disk: auto measures afresh next time, nothing the user made is lost
            pass


class TensorStore:
    """Named tensor files (safetensors) in one folder: computed once, loaded afterwards (low-rank factors)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def load(self, key: str) -> dict[str, torch.Tensor] | None:
        path = self.folder / f"{key}.safetensors"
        if not path.is_file():
            return None
        from safetensors.torch import load_file

        try:
            return load_file(path)
        except Exception:  # a truncated or foreign file: the caller recomputes
            return None

    def save(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        with atomic_path(self.folder / f"{key}.safetensors") as tmp:
            save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp))


# ---------------------------------------------------------------- draft heads (mode head, `specchat train-head`)

SHIPPED_HEADS = Path(__file__).with_name("heads")  # package data: heads trained for the embedded default model


def heads_dir() -> Path:
    return cache_dir() / "heads"


def find_head(fingerprint: str) -> Path | None:
    """The draft head for the target with these weights: one the user trained (user cache) first, else a shipped one."""
    mine = heads_dir() / f"{fingerprint}.safetensors"
    if mine.is_file():
        return mine
    for meta in sorted(SHIPPED_HEADS.glob("*.json")):
        try:
            if json.loads(meta.read_text())["target"]["fingerprint"] == fingerprint and meta.with_suffix(".safetensors").is_file():
                return meta.with_suffix(".safetensors")
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None
