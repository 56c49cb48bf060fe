"""glibc's heap for a decode loop: each round allocates and frees a few vocabulary-wide tensors (0.2-3 MB: logits,
probabilities, their copies), and glibc's default thresholds (its mmap threshold following the largest block freed,
the heap's top handed back to the system past twice that) returned those pages and faulted them in again round after
round, a cost a small model's step notices. Fixed thresholds keep them mapped."""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20  # blocks below this come from the heap (a 152k-token vocabulary's logits for 5 rows: 3 MB)
TRIM_THRESHOLD = 128 << 20  # free memory at the heap's top kept for reuse, at most


def keep_freed_pages() -> bool:
    """Set glibc's thresholds, unless the user set them (MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_) or this is not
    glibc. Whether they were set."""
    if not sys.platform.startswith("linux") or any(k in os.environ for k in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # another C library (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
