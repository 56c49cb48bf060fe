"""Themes from TOML files: Textual colours plus one colour and text style per token kind.

Built-in themes live beside this file in `themes/` (package data). The user theme folder
(store.user_themes_dir) is read after them, so a user file may replace a built-in one.
A broken file is reported (the app shows a notice) and skipped: the app falls back to the default.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from textual.color import Color, ColorParseError
from textual.theme import Theme

from specchat.engine.events import TOKEN_KINDS as ENGINE_KINDS
from specchat.store import user_themes_dir

DEFAULT_THEME = "dark"
FALLBACK_THEME = "textual-dark"  # a Textual built-in, used only if no specchat theme file can be read

# what a reply shows: the engine's token kinds plus the draft tokens the target rejected (ctrl+r)
TOKEN_KINDS = (*ENGINE_KINDS, "rejected")
TEXT_STYLES = {"none", "bold", "dim", "italic", "underline", "strike", "reverse"}
THEME_COLORS = ("primary", "secondary", "accent", "foreground", "background", "surface", "panel", "boost",
                "warning", "error", "success")

# Used for any theme without token colours (Textual's own themes): every CSS variable must exist.
TOKEN_VARIABLE_DEFAULTS = {
    "token-accepted": "#57c7a4",
    "token-resampled": "#f47067",
    "token-bonus": "#e5c07b",
    "token-target": "#d8dee9",  # replaced by the theme's foreground (token_defaults)
    "token-rejected": "#6e7681",  # replaced by the foreground at half strength
    "token-accepted-style": "none",
    "token-resampled-style": "bold",
    "token-bonus-style": "underline",
    "token-target-style": "none",
    "token-rejected-style": "strike",
}


def token_defaults(theme: Theme) -> dict[str, str]:
    """Token variables for a theme that does not set them: plain and rejected tokens follow its foreground."""
    defaults = dict(TOKEN_VARIABLE_DEFAULTS)
    try:
        foreground = theme.to_color_system().generate()["foreground"]
    except Exception:  # a theme Textual accepted should always generate; never fail the stylesheet for it
        return defaults
    defaults["token-target"] = foreground
    defaults["token-rejected"] = f"{foreground} 45%"
    return defaults


class ThemeError(ValueError):
    """A theme file that cannot be used; the message says which file and why."""


@dataclass
class LoadedThemes:
    themes: dict[str, Theme] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # one line per broken file


BUILTIN_THEMES = Path(__file__).resolve().parent / "themes"


def _check_color(value, where: str) -> str:
    if not isinstance(value, str):
        raise ThemeError(f"{where} must be a colour string, got {value!r}")
    try:
        Color.parse(value)
    except ColorParseError as e:
        raise ThemeError(f"{where}: {value!r} is not a colour") from e
    return value


def _check_text_style(value, where: str) -> str:
    words = value.split() if isinstance(value, str) else None
    if not words or not set(words) <= TEXT_STYLES:
        raise ThemeError(f"{where}: {value!r} is not a text style (use {', '.join(sorted(TEXT_STYLES))})")
    return value


def theme_from_toml(text: str, default_name: str) -> Theme:
    """Parse and validate one theme file's text; raises ThemeError with a one-line reason."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ThemeError(f"not valid TOML ({e})") from e
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise ThemeError("name must be a non-empty string")
    colors = data.get("colors", {})
    if not isinstance(colors, dict) or "primary" not in colors:
        raise ThemeError("[colors] must set at least primary")
    unknown = set(colors) - set(THEME_COLORS)
    if unknown:
        raise ThemeError(f"[colors] has unknown keys: {', '.join(sorted(unknown))}")
    kwargs = {key: _check_color(value, f"colors.{key}") for key, value in colors.items()}
    variables = {}
    for kind, value in data.get("tokens", {}).items():
        if kind not in TOKEN_KINDS:
            raise ThemeError(f"[tokens] has unknown kind {kind!r} (kinds: {', '.join(TOKEN_KINDS)})")
        variables[f"token-{kind}"] = _check_color(value, f"tokens.{kind}")
    for kind, value in data.get("token-styles", {}).items():
        if kind not in TOKEN_KINDS:
            raise ThemeError(f"[token-styles] has unknown kind {kind!r}")
        variables[f"token-{kind}-style"] = _check_text_style(value, f"token-styles.{kind}")
    extra = data.get("variables", {})
    if not isinstance(extra, dict):
        raise ThemeError("[variables] must be a table")
    variables.update({str(k): str(v) for k, v in extra.items()})
    dark = data.get("dark", True)
    if not isinstance(dark, bool):
        raise ThemeError("dark must be true or false")
    theme = Theme(name=name, dark=dark, variables=variables, **kwargs)
    try:
        theme.to_color_system().generate()
    except Exception as e:  # Textual raises several kinds for a bad colour system
        raise ThemeError(f"Textual cannot build it ({e})") from e
    return theme


def rich_token_styles(name: str = DEFAULT_THEME) -> dict[str, str]:
    """A built-in theme's token kinds as Rich styles, for output outside the app (`generate`), so the kinds look the
    same there as in the chat. Plain target tokens keep the terminal's own colour."""
    data = tomllib.loads((BUILTIN_THEMES / f"{name}.toml").read_text(encoding="utf-8"))
    styles = {kind: f"{data['token-styles'].get(kind, 'none')} {colour}".removeprefix("none ")
              for kind, colour in data["tokens"].items()}
    return {**styles, "target": "default"}


def load_themes(dirs: list[Path] | None = None) -> LoadedThemes:
    """Read every *.toml in the built-in dirs, then the user dir; later files replace earlier names."""
    if dirs is None:
        dirs = [BUILTIN_THEMES, user_themes_dir()]
    loaded = LoadedThemes()
    for directory in dirs:
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob("*.toml")):
            try:
                theme = theme_from_toml(path.read_text(encoding="utf-8"), path.stem)
            except (OSError, UnicodeDecodeError, ThemeError) as e:
                loaded.problems.append(f"theme file {path} is broken: {e}")
                continue
            loaded.themes[theme.name] = theme
    return loaded
