"""One component class per token kind, styled from the theme's token variables.

Replies and the legend draw with the same classes, so the legend always shows the colours the tokens have.
"""

from __future__ import annotations

from specchat.tui.themes import TOKEN_KINDS as KINDS

TOKEN_CSS = "\n".join(
    f"{{owner}} > .token--{kind} {{{{ color: $token-{kind}; text-style: $token-{kind}-style; }}}}" for kind in KINDS
)


def token_css(owner: str) -> str:
    return TOKEN_CSS.format(owner=owner)
