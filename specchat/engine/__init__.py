"""The engines: the speculative loop over torch or llama.cpp (loop.py), and a serving engine over HTTP (remote.py).
No UI. Consumers iterate `RoundRecord`s (events.py), each carrying its `TokenEvent`s.

This file imports nothing, so the torch-free parts (events, metrics, sampling_params, info, remote) load without torch.
"""
