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



class ModeUnavailable(Exception):
    """A mode that cannot run with the loaded models (or is not built yet); the message says why."""


def build_drafter(mode: str, target, draft=None, **options) -> Drafter:
    """The drafter for `mode`. `target`/`draft` are transformers models (draft may be None).

    `options` carries mode settings from the command line (skip layers, exit layer, rank, ...);
    each drafter takes the ones it understands.
    """
    if mode not in MODES:
        raise ModeUnavailable(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "off":
        from specchat.decoding.drafters.plain import PlainDecoding

        return PlainDecoding()
    if mode == "draft":
        if draft is None:
            raise ModeUnavailable("mode 'draft' needs a draft model: pass --draft MODEL")
        from specchat.decoding.drafters.model import ModelDrafter

        return ModelDrafter(draft)
    raise ModeUnavailable(f"mode {mode!r} is not available yet")


__all__ = ["MODES", "Drafter", "ModeUnavailable", "Proposal", "build_drafter"]
