"""The engine: pure torch (and llama.cpp for GGUF targets), no UI. Consumers iterate `RoundRecord`s, each carrying
its `TokenEvent`s."""

from specchat.engine.events import RoundRecord, TokenEvent
from specchat.engine.loop import AdaptiveK, Controls, generate
from specchat.engine.sampling import SamplingParams
from specchat.engine.target import TargetState


def target_state(model, runner: str = "auto") -> TargetState:
    """The TargetState for `model`: llama.cpp's for a GGUF model it loaded (engine/llamacpp.py), else torch's."""
    if getattr(model, "engine", "torch") == "llama.cpp":
        from specchat.engine.llamacpp import LlamaTargetState

        return LlamaTargetState(model)
    return TargetState(model, runner)


__all__ = ["AdaptiveK", "Controls", "RoundRecord", "SamplingParams", "TargetState", "TokenEvent", "generate", "target_state"]
