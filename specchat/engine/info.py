"""What runs a session's models, in one value every front end reads (the header, summaries, exports, bench), so none
of them asks a session which engine it has. No torch: a remote session makes one too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specchat.engine.remote import Server


@dataclass(frozen=True)
class EngineInfo:
    engine: str  # "torch", "llama.cpp", or a serving engine: "llama-server", "vllm"
    runner: str  # the target's forward: "lean" (engine/runner.py), "hf", "llama.cpp", or the serving engine
    kernel: str  # its matmuls: "fused" (engine/smallbatch.py), "torch", "llama.cpp", or the serving engine
    device: str  # "cpu", "cuda:0", ...; "server" where a server runs the models
    dtype: str  # what the weights are multiplied as: float32, bfloat16, a GGUF file's type (Q4_1); "" on a server
    server: Server | None = None  # the serving configuration that runs the models (None: they run in this process)

    @property
    def remote(self) -> bool:
        """Whether a server runs the models: this client knows its own machine only, and the server's settings."""
        return self.server is not None
