"""Draft sources, one file each, behind one interface (base.Drafter). DRAFTERS maps each mode to its class; the
modes' names and descriptions, torch-free, are specchat.modes.MODES (same order)."""

from specchat.engine.drafters.auto import AutoDrafter
from specchat.engine.drafters.base import Drafter, ModeUnavailable, Proposal
from specchat.engine.drafters.earlyexit import EarlyExitDrafter
from specchat.engine.drafters.head import HeadDrafter
from specchat.engine.drafters.layerskip import LayerSkipDrafter
from specchat.engine.drafters.lookup import LookupDrafter
from specchat.engine.drafters.lowrank import LowRankDrafter
from specchat.engine.drafters.model import ModelDrafter
from specchat.engine.drafters.plain import PlainDecoding
from specchat.engine.drafters.quant import QuantDrafter

# mode -> drafter class; each has `build(target, draft, **options)`
DRAFTERS: dict[str, type[Drafter]] = {
    "off": PlainDecoding,
    "draft": ModelDrafter,
    "layerskip": LayerSkipDrafter,
    "earlyexit": EarlyExitDrafter,
    "lowrank": LowRankDrafter,
    "quant": QuantDrafter,
    "lookup": LookupDrafter,
    "head": HeadDrafter,
    "auto": AutoDrafter,
}


def build_drafter(mode: str, target, draft=None, **options) -> Drafter:
    """The drafter for `mode`. `target`/`draft` are transformers models (draft may be None).

    `options` carries mode settings (skip_layers, exit_layer, rank, factor_store, ...); each drafter's
    `build` takes the ones it understands and raises ModeUnavailable when it cannot run with these
    models on this device.
    """
    if mode not in DRAFTERS:
        raise ModeUnavailable(f"unknown mode {mode!r}; choose one of {', '.join(DRAFTERS)}")
    if mode == "auto":  # built from the other modes' drafters
        options["build_candidate"] = build_drafter
    return DRAFTERS[mode].build(target, draft, **options)


__all__ = ["DRAFTERS", "Drafter", "ModeUnavailable", "Proposal", "build_drafter"]
