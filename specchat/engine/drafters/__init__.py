"""Draft sources, one file each, behind one interface (base.Drafter). DRAFTERS maps each mode to its class; the
modes' names and descriptions, torch-free, are specchat.modes.MODES (same order)."""

from specchat.engine.drafters.auto import AutoDrafter
from specchat.engine.drafters.base import Drafter, Proposal
from specchat.engine.drafters.earlyexit import EarlyExitDrafter
from specchat.engine.drafters.gguf import GGUFDrafter
from specchat.engine.drafters.head import HeadDrafter
from specchat.engine.drafters.layerskip import LayerSkipDrafter
from specchat.engine.drafters.lookup import LookupDrafter
from specchat.engine.drafters.lowrank import LowRankDrafter
from specchat.engine.drafters.model import ModelDrafter
from specchat.engine.drafters.plain import PlainDecoding
from specchat.engine.drafters.quant import QuantDrafter
from specchat.engine.drafters.suffix import SuffixDrafter
from specchat.engine.errors import NOT_ON_LEAN, TORCH_ONLY, ModeUnavailable
from specchat.engine.gguf_model import draft_runner, on_lean
from specchat.engine.llamacpp import on_llama_cpp

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
    "suffix": SuffixDrafter,
}


def build_drafter(mode: str, target, draft=None, **options) -> Drafter:
    """The drafter for `mode`. `target`/`draft` are transformers models, or GGUFModels on the llama.cpp engine
    (draft may be None).

    `options` carries mode settings (skip_layers, exit_layer, rank, factor_store, ...); each drafter's
    `build` takes the ones it understands and raises ModeUnavailable when it cannot run with these
    models on this device.
    """
    if mode not in DRAFTERS:
        raise ModeUnavailable(f"unknown mode {mode!r}; choose one of {', '.join(DRAFTERS)}")
    if on_llama_cpp(target) and not target.can_rollback and mode not in ("off", "auto"):
        raise ModeUnavailable(f"mode {mode!r}: {target.path.name} is a recurrent model, whose state llama.cpp cannot roll back")
    if on_llama_cpp(target) and mode in TORCH_ONLY:
        raise ModeUnavailable(f"mode {mode!r} needs the torch engine (--engine torch): it {TORCH_ONLY[mode]}")
    if on_llama_cpp(target) and mode in ("draft", "quant"):  # a GGUF file on a llama.cpp context of its own
        return GGUFDrafter.build(mode, target, draft, **options)
    if on_lean(target) and mode in NOT_ON_LEAN:
        raise ModeUnavailable(f"mode {mode!r} builds on transformers' modules: it runs on --engine torch (or llama.cpp), "
                              f"not yet on --engine lean")
    if mode == "draft" and draft is not None and on_lean(target) != on_lean(draft):
        raise ModeUnavailable("target and draft must run on the same engine: both .gguf files on --engine lean")
    if mode == "draft" and draft is not None and on_lean(draft):  # a GGUF file read in place too
        vocab = options.get("draft_vocab")
        return ModelDrafter.on_runner(draft_runner(draft.runner), vocab=vocab, eos=draft.eos_ids if vocab else set())
    if mode == "draft" and draft is not None and on_llama_cpp(draft):
        raise ModeUnavailable("target and draft must run on the same engine: both .gguf files on llama.cpp, or --engine torch")
    if mode == "auto":  # built from the other modes' drafters
        options["build_candidate"] = build_drafter
    return DRAFTERS[mode].build(target, draft, **options)


__all__ = ["DRAFTERS", "TORCH_ONLY", "Drafter", "ModeUnavailable", "Proposal", "build_drafter"]
