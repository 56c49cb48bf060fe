"""What a measurement ran on, and how much memory it took: every reported number carries its hardware."""

from __future__ import annotations

import os
import platform
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: `specchat history` (through export) never loads torch
    import torch


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor() or platform.machine()


def client_info() -> dict:
    """The machine itself and its load, without torch: all a serving engine's client can say (the server's own
    hardware is not sent), and the common part of hardware_info()."""
    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "memory_gb": None, "load_average": None}
    try:
        info["memory_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except (ValueError, OSError, AttributeError):  # not on Linux/macOS
        pass
    return info


def hardware_info(device: torch.device | str, dtype: torch.dtype | str | None = None) -> dict:
    """The machine, the libraries and the load it was under (one set of keys for exports and bench reports)."""
    import torch
    import transformers

    from specchat import threads

    device = torch.device(device) if isinstance(device, str) and device else device
    return {
        **client_info(),
        "torch_threads": torch.get_num_threads(),
        "threads_adaptive": threads.adaptive(),  # the count followed the machine's load during the run (threads.py)
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device) if device else None,
        "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
        "gpu": torch.cuda.get_device_name(device) if isinstance(device, torch.device) and device.type == "cuda" else None,
    }


def memory_mb(device: torch.device) -> float:
    """Peak accelerator memory since the last reset on CUDA; the process's resident memory otherwise.

    torch's CPU allocations bypass tracemalloc, so the resident set size is what counts.
    """
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):  # ru_maxrss: the process-lifetime high-water mark, KiB on Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
