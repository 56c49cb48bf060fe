"""Draft sources, one file each. MODES lists every mode the app knows, built or not yet built."""

import importlib

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


# mode -> (module in this package, class); each class has `build(target, draft, **options)`
DRAFTER_CLASSES: dict[str, tuple[str, str]] = {
    "off": ("plain", "PlainDecoding"),
    "draft": ("model", "ModelDrafter"),
    "layerskip": ("layerskip", "LayerSkipDrafter"),
    "earlyexit": ("earlyexit", "EarlyExitDrafter"),
    "lowrank": ("lowrank", "LowRankDrafter"),
    "quant": ("quant", "QuantDrafter"),
    "lookup": ("lookup", "LookupDrafter"),
}


def build_drafter(mode: str, target, draft=None, **options) -> Drafter:
    """The drafter for `mode`. `target`/`draft` are transformers models (draft may be None).

    `options` carries mode settings from the command line (skip_layers, exit_layer, rank, ...);
    each drafter's `build` takes the ones it understands and raises ModeUnavailable when it
    cannot run with these models on this device.
    """
    if mode not in MODES:
        raise ModeUnavailable(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    module_name, class_name = DRAFTER_CLASSES[mode]
    try:
        module = importlib.import_module(f"specchat.decoding.drafters.{module_name}")
    except ModuleNotFoundError as e:
        if e.name != f"specchat.decoding.drafters.{module_name}":
            raise
        raise ModeUnavailable(f"mode {mode!r} is not available yet") from None
    return getattr(module, class_name).build(target, draft, **options)


__all__ = ["DRAFTER_CLASSES", "MODES", "Drafter", "ModeUnavailable", "Proposal", "build_drafter"]
