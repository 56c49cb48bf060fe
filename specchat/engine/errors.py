"""Why a mode cannot run, without torch: the engine's error (the chat catches it on every engine) and the modes
llama.cpp cannot run (the start-up checks refuse them before a model loads)."""


class ModeUnavailable(Exception):
    """A mode that cannot run with the loaded models (or on this server); the message says why, in one line."""


# the modes a GGUF target on llama.cpp cannot run, and why (off, lookup, suffix, draft, quant and auto can)
TORCH_ONLY = {
    "layerskip": "runs a subset of the target's layers, which llama.cpp does not expose",
    "earlyexit": "runs the target's first layers alone, which llama.cpp does not expose",
    "lowrank": "factors the target's matrices in torch, which llama.cpp's quantised weights are not",
    "head": "drafts from the target's last-layer features before the final norm; llama.cpp hands out only the normed output",
}

# the modes a GGUF file on the lean engine (--engine lean) cannot run yet: they build on transformers' modules
NOT_ON_LEAN = ("lowrank", "quant", "head")
