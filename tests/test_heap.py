"""heap.py: glibc's thresholds fixed so a decode loop's freed vocabulary-wide blocks stay mapped."""

import subprocess
import sys

import pytest

from specchat import heap

# In a fresh process (a heap with free chunks already in it would serve the blocks without asking the system either
# way): page faults while 1 MB blocks, a vocabulary's logits for a few positions, are allocated, written and freed,
# from glibc's starting thresholds (128 kB: every such block mapped and unmapped) and after keep_freed_pages.
CHILD = """
import ctypes, resource
import numpy as np
from specchat import heap

def faults(rounds=50):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        block = np.empty(1 << 18, dtype=np.float32)
        block.fill(1.0)
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

mallopt = ctypes.CDLL(None).mallopt
mallopt(heap.M_MMAP_THRESHOLD, 128 << 10), mallopt(heap.M_TRIM_THRESHOLD, 128 << 10)
start = faults()
assert heap.keep_freed_pages()
faults(5)  # the first block maps its pages once
print(start, faults())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_stay_mapped_once_the_thresholds_are_set():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
    before, after = map(int, out.stdout.split())
    assert before > 50 * 200 and after < 50, (before, after)  # a block's 256 pages each round, then none


def test_the_user_s_own_malloc_settings_are_kept(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000")
    assert not heap.keep_freed_pages()
