"""The engine: pure torch, no UI. Consumers iterate `RoundRecord`s, each carrying its `TokenEvent`s."""

from specchat.decoding.events import RoundRecord, TokenEvent
from specchat.decoding.loop import Controls, TargetState, generate
from specchat.decoding.sampling import SamplingParams

__all__ = ["Controls", "RoundRecord", "SamplingParams", "TargetState", "TokenEvent", "generate"]
