"""Draft sources, one file each. MODES lists every mode the app knows, built or not yet built."""

from specchat.decoding.drafters.base import Drafter, Proposal

# mode name -> one-line description; the order is the order of the TUI's keys (F2..F8)
MODES: dict[str, str] = {
    "off": "plain decoding of the target (the baseline)",
    "draft": "a separate draft model sharing the tokenizer",
    "layerskip": "the target with chosen layers skipped",
    "earlyexit": "the target's first layers, then its final norm and LM head",
    "lowrank": "the target with truncated-SVD low-rank linear layers",
    "quant": "an int8 weight copy of the target",
    "lookup": "prompt lookup: n-gram matches in the conversation, no model",
}

__all__ = ["MODES", "Drafter", "Proposal"]
