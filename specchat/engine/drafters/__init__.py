"""Draft sources, one file each, behind one interface (base.Drafter). MODES is every mode the app knows."""

from specchat.engine.drafters.base import Drafter, ModeUnavailable, Proposal
from specchat.engine.drafters.earlyexit import EarlyExitDrafter
from specchat.engine.drafters.layerskip import LayerSkipDrafter
from specchat.engine.drafters.lookup import LookupDrafter
from specchat.engine.drafters.lowrank import LowRankDrafter
from specchat.engine.drafters.model import ModelDrafter
from specchat.engine.drafters.plain import PlainDecoding
from specchat.engine.drafters.quant import QuantDrafter

# mode name -> one-line description; the order is the order of the chat's keys (F2..F8)
MODES: dict[str, str] = {
    "off": "plain decoding of the target (the baseline)",
    "draft": "a separate draft model sharing the tokenizer",
    "layerskip": "the target with chosen layers skipped",
    "earlyexit": "the target's first layers, then its final norm and LM head",
    "lowrank": "the target with truncated-SVD low-rank linear layers",
    "quant": "an int8 weight copy of the target",
    "lookup": "prompt lookup: n-gram matches in the conversation, no model",
}

# mode -> drafter class; each has `build(target, draft, **options)`
DRAFTERS: dict[str, type[Drafter]] = {
    "off": PlainDecoding,
    "draft": ModelDrafter,
    "layerskip": LayerSkipDrafter,
    "earlyexit": EarlyExitDrafter,
    "lowrank": LowRankDrafter,
    "quant": QuantDrafter,
    "lookup": LookupDrafter,
}

# the self-speculative modes whose setting `specchat tune` searches, and the option each one takes
TUNABLE: dict[str, str] = {"layerskip": "skip_layers", "earlyexit": "exit_layer", "lowrank": "rank"}


def build_drafter(mode: str, target, draft=None, **options) -> Drafter:
    """The drafter for `mode`. `target`/`draft` are transformers models (draft may be None).

    `options` carries mode settings (skip_layers, exit_layer, rank, factor_store, ...); each drafter's
    `build` takes the ones it understands and raises ModeUnavailable when it cannot run with these
    models on this device.
    """
    if mode not in DRAFTERS:
        raise ModeUnavailable(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    return DRAFTERS[mode].build(target, draft, **options)


__all__ = ["DRAFTERS", "MODES", "TUNABLE", "Drafter", "ModeUnavailable", "Proposal", "build_drafter"]
