"""The sampling settings, without torch: the remote engine and the screen read them too."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def setting_key(params: SamplingParams | None) -> str:
    """The sampling setting a measured acceptance belongs to (it depends on it), as saved between sessions."""
    if params is None or params.greedy:
        return "greedy"
    return f"T={params.temperature:g} top_k={params.top_k} top_p={params.top_p:g}"
