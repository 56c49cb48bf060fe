"""heap.py: glibc's thresholds fixed so a decode loop's freed vocabulary-wide blocks stay mapped."""

import ctypes
import resource
import sys

import numpy as np
import pytest

from specchat import heap


def faults_while_reallocating(rounds: int = 50) -> int:
    """Page faults while 1 MB blocks (a vocabulary's logits for a few positions) are allocated, written and freed."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        block = np.empty(1 << 18, dtype=np.float32)
        block.fill(1.0)
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_stay_mapped_once_the_thresholds_are_set():
    """From glibc's starting thresholds (128 kB: every block mapped and unmapped, 256 faults a round) to ours."""
    mallopt = ctypes.CDLL(None).mallopt
    mallopt(heap.M_MMAP_THRESHOLD, 128 << 10), mallopt(heap.M_TRIM_THRESHOLD, 128 << 10)
    assert faults_while_reallocating() > 50 * 200
    assert heap.keep_freed_pages()
    faults_while_reallocating(5)  # the first block maps its pages once
    assert faults_while_reallocating() < 50  # not a block's 256 pages again every round


def test_the_user_s_own_malloc_settings_are_kept(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000")
    assert not heap.keep_freed_pages()
