"""The engine: pure torch, no UI. Consumers iterate `RoundRecord`s, each carrying its `TokenEvent`s."""

from specchat.engine.events import RoundRecord, TokenEvent
from specchat.engine.loop import AdaptiveK, Controls, generate
from specchat.engine.sampling import SamplingParams
from specchat.engine.target import TargetState

__all__ = ["AdaptiveK", "Controls", "RoundRecord", "SamplingParams", "TargetState", "TokenEvent", "generate"]
