"""Numbers and names as the front ends print them: "-" for a value not measured yet, long names cut in the middle."""

from __future__ import annotations

MISSING = "-"


def num(value, digits: int = 3, scale: float = 1.0) -> str:
    """Significant digits for floats (no decimals from 100 up), lists space-separated, anything else as str."""
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        value *= scale
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.{digits}g}"
    if isinstance(value, (list, tuple)):
        return " ".join(num(v, digits, scale) for v in value) or MISSING
    return str(value)


def fixed(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    """A fixed format (columns that must line up)."""
    return MISSING if value is None else f"{value:{spec}}{suffix}"


def pct(value: float | None) -> str:
    return MISSING if value is None else f"{100 * value:.0f}%"


def rate(value: float | None) -> str:
    """Tokens per second: whole above 10, one decimal below (a 1.5B model on 2 cores runs at 4-12 tok/s, where
    whole numbers made a 0.75x mode look level with plain decoding: "draft 4 vs off 4")."""
    return MISSING if value is None else f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def size(n: float) -> str:
    """Bytes as the cache's sizes are said (decimal units, as the plan lines' GB): 11.2 GB, 541.6 MB, 470 B."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def shorten(text: str, width: int) -> str:
    """`text` cut in the middle to at most `width` characters: a model file's name keeps its start and its
    quantisation at the end."""
    if len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    head = width // 2
    tail = width - head - 1
    return text[:head] + "…" + (text[-tail:] if tail else "")
