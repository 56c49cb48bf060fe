"""Numbers as the front ends print them: "-" for a value not measured yet."""

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
