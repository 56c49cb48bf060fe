"""torch's CPU threads: how many, and how they wait.

Two measurements on the 2-core reference machine (docs/threads.md) decide this:
- OpenMP threads that spin briefly while they wait make decoding 1.2-1.5x faster than threads that sleep at once:
  a forward has ~120 parallel regions, and waking a sleeping thread for each costs more than the region.
- Two spinning threads beside a CPU-bound process collapse (0.16-0.39 of their quiet speed): every parallel
  region waits for the thread that shares its core with the other process.

So specchat lets waiting threads spin a little (GOMP_SPINCOUNT, set before torch loads) and runs one thread
fewer for each core that other work keeps busy: chosen when it starts and, while it generates, re-chosen about
once a second (`adapt`) from what /proc/stat says the rest of the machine did meanwhile.

Nothing here imports torch at module level: `prepare_process` must run before torch starts its threads.
"""

from __future__ import annotations

import logging
import os
import sys
import time

log = logging.getLogger("specchat")

SPIN_COUNT = "10000"  # libgomp's spin iterations before a waiting thread sleeps (its default is 300000)
# the GGUF engines' threads (llama.cpp's, and the lean engine's: one parallel region a forward) wait in the same
# libgomp (one per process) between forwards, while the loop does ~1 ms of work of its own: with the brief spin they
# would fall asleep, and pay a wake-up, at every forward
GGUF_SPIN_COUNT = "300000"
ADAPT_EVERY_S = 1.0

_owns_process = False  # set by prepare_process: specchat started this process and torch is not loaded yet
_our_spin = False  # GOMP_SPINCOUNT is specchat's choice, not the user's
_governor: Governor | None = None


def prepare_process() -> None:
    """Set how OpenMP threads wait, before torch loads. Inside another program that already loaded torch (a test
    run, a notebook) its thread settings are left alone unless --threads is given. An OMP_WAIT_POLICY or
    GOMP_SPINCOUNT of the user's is kept. Off Linux (where torch does not ship libgomp, and where this was not
    measured) waiting threads sleep at once, which never collapses."""
    global _owns_process, _our_spin
    if "torch" in sys.modules:
        return
    _owns_process = True
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    if sys.platform.startswith("linux"):
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
        _our_spin = True
    else:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def prepare_for_gguf() -> None:
    """llama.cpp or the lean engine will run the models: let waiting threads spin longer (GGUF_SPIN_COUNT), if
    specchat chose the spin and OpenMP has not started yet. Both run a forward as one parallel region with the
    loop's Python between forwards; on the torch engine, ~120 regions a forward, the same spin made the quiet
    machine slower, so torch keeps the brief one (docs/threads.md). Also keeps torch's oneDNN off the AMX tiles
    llama.cpp configures once per thread (repack_probe.keep_tiles_for_llama_cpp)."""
    if _our_spin and "torch" not in sys.modules:
        os.environ["GOMP_SPINCOUNT"] = GGUF_SPIN_COUNT
    from specchat.repack_probe import keep_tiles_for_llama_cpp

    keep_tiles_for_llama_cpp()


def physical_cores() -> int:
    """Cores this process may run on, counting each physical core once (hyper-threads share one)."""
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f if line.startswith(("siblings", "cpu cores")))
        per_core = int(info["siblings"]) // int(info["cpu cores"])
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        per_core = 1
    return max(1, logical // max(per_core, 1))


def spare_core() -> bool:
    """Whether a physical core is left beside the forward's threads (torch's, as llama.cpp's follow the same
    count): the chat's UI thread then draws without taking the decoder's CPU."""
    if "torch" not in sys.modules:  # no local model in this process
        return True
    import torch

    return torch.get_num_threads() < physical_cores()


def _machine_ticks() -> tuple[int, int]:
    """(idle, total) clock ticks of every CPU since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return values[3] + values[4], sum(values)


def _sample() -> tuple[float, int, int, float] | None:
    """(wall time, machine idle ticks, machine total ticks, this process's CPU seconds), or None off Linux."""
    try:
        idle, total = _machine_ticks()
    except (OSError, ValueError, IndexError):
        return None
    return time.monotonic(), idle, total, time.process_time()


def others_busy(before, after) -> float | None:
    """Cores that other processes kept busy between two `_sample`s: the machine's busy cores less this
    process's (its own threads, spinning ones included, count as its own)."""
    if before is None or after is None or after[2] <= before[2] or after[0] <= before[0]:
        return None
    busy = (os.cpu_count() or 1) * (1 - (after[1] - before[1]) / (after[2] - before[2]))
    own = (after[3] - before[3]) / (after[0] - before[0])
    return max(0.0, busy - own)


def busy_cores(window: float = 0.2) -> float:
    """Cores other processes kept busy over `window` seconds (this process sleeps meanwhile); 0 where /proc/stat
    cannot be read."""
    before = _sample()
    time.sleep(window)
    return others_busy(before, _sample()) or 0.0


def threads_for(cores: int, busy: float) -> int:
    """One thread per physical core, less one per core other work keeps busy, at least one: a thread sharing a core
    with a busy process makes every parallel region wait for it."""
    return max(1, min(cores, int(cores - busy + 0.5)))


class Governor:
    """Re-chooses torch's threads while specchat generates. `poll` is cheap (a clock read) except about once a
    second, when it reads /proc/stat and, if the free cores changed, calls torch.set_num_threads. It must be called
    from the thread that runs the forwards: OpenMP keeps the thread count per calling thread (torch copies its
    latest setting into threads that start later)."""

    def __init__(self, cores: int, every_s: float = ADAPT_EVERY_S) -> None:
        self.cores, self.every_s = cores, every_s
        self.mark = _sample()
        self.changes = 0
        self.polled = False  # whether a long job has asked it yet (bench, tune and verify never do)

    def poll(self) -> None:
        self.polled = True
        if self.mark is not None and time.monotonic() - self.mark[0] < self.every_s:
            return
        now = _sample()
        busy = others_busy(self.mark, now)
        self.mark = now
        if busy is None:
            return
        import torch

        n, before = threads_for(self.cores, busy), torch.get_num_threads()
        if n != before:
            torch.set_num_threads(n)
            self.changes += 1
            log.info("threads %d -> %d: other work kept %.1f of %d cores busy", before, n, busy, self.cores)


def set_threads(requested: int | None) -> int:
    """torch's CPU threads for this run: --threads, else, when specchat owns the process and OMP_NUM_THREADS is not
    set, the physical cores other work leaves free now, re-chosen while generating (`adapt`); otherwise what the
    host chose. Returns the number in force."""
    import torch

    global _governor
    n = requested
    _governor = None
    if n is None and _owns_process and not os.environ.get("OMP_NUM_THREADS"):
        cores = physical_cores()
        n = threads_for(cores, busy_cores())
        _governor = Governor(cores)
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)
    return torch.get_num_threads()


def setting() -> str:
    """The thread policy in force, as a setup is keyed by (mode auto's learnt rates): "follows the load" or a count."""
    import torch

    return "follows the load" if _governor is not None else str(torch.get_num_threads())


def adaptive() -> bool:
    """Whether the thread count has followed the machine's load in this run: no --threads, no OMP_NUM_THREADS,
    specchat's own process, and a reply or training asked (`adapt`)."""
    return _governor is not None and _governor.polled


def adapt() -> None:
    """Between forwards of a long job (a reply, training): follow other work's load. A no-op unless `set_threads`
    chose the default."""
    if _governor is not None:
        _governor.poll()
