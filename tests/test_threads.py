"""torch's thread count follows the cores other work leaves free, at start and while generating; OpenMP's wait
is set before torch loads."""

import os
import subprocess
import sys
import pytest
import torch

from support.process import run_env
from specchat import threads


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    threads._governor = None


def test_one_thread_fewer_per_busy_core():
    for cores, busy, expected in ((2, 0.0, 2), (2, 0.3, 2), (2, 0.6, 1), (2, 1.0, 1), (2, 5.0, 1), (8, 2.2, 6), (1, 0.0, 1)):
        assert threads.threads_for(cores, busy) == expected, (cores, busy)


def test_others_busy_leaves_out_this_process(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    # 10 s of wall time; the machine was idle 25% of its 2000 ticks (1.5 cores busy); this process used 8 CPU s (0.8)
    before, after = (100.0, 1000, 10_000, 50.0), (110.0, 1500, 12_000, 58.0)
    assert threads.others_busy(before, after) == pytest.approx(0.7)
    assert threads.others_busy(before, (110.0, 1500, 12_000, 70.0)) == 0.0  # never negative
    assert threads.others_busy(None, after) is None and threads.others_busy(before, before) is None


def test_the_governor_drops_a_thread_when_other_work_appears_and_takes_it_back(monkeypatch, keep_threads):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    samples = iter([
        (0.0, 0, 0, 0.0),          # when the governor starts
        (1.5, 0, 300, 2.9),        # machine all busy for 1.5 s, this process 1.93 cores of it: others 0.07
        (3.0, 0, 600, 4.4),        # all busy, this process 1.0 core: others 1.0 -> one thread
        (4.5, 150, 900, 5.9),      # half idle, this process 1.0 core: others 0 -> two threads
    ])
    clock = iter([0.5, 1.5, 2.0, 3.0, 4.5])  # time.monotonic() at each poll (0.5 and 2.0: too soon to look)
    monkeypatch.setattr(threads, "_sample", lambda: next(samples))
    monkeypatch.setattr(threads.time, "monotonic", lambda: next(clock))
    torch.set_num_threads(2)
    governor = threads.Governor(cores=2, every_s=1.0)
    seen = []
    for _ in range(5):
        governor.poll()
        seen.append(torch.get_num_threads())
    assert seen == [2, 2, 2, 1, 2] and governor.changes == 2


def test_adapt_acts_only_when_specchat_chose_the_threads(monkeypatch, keep_threads):
    polls = []

    def poll(self):
        self.polled = True
        polls.append(self)

    monkeypatch.setattr(threads.Governor, "poll", poll)
    monkeypatch.setattr(threads, "_owns_process", True)
    monkeypatch.setattr(threads, "busy_cores", lambda window=0.2: 0.0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads.set_threads(1)  # --threads
    threads.adapt()
    assert not polls and not threads.adaptive()
    threads.set_threads(None)
    assert not threads.adaptive()  # not until a reply or training asks
    threads.adapt()
    assert len(polls) == 1 and threads.adaptive()
    monkeypatch.setattr(threads, "_owns_process", False)  # inside a host program (a notebook, this test run)
    threads.set_threads(None)
    threads.adapt()
    assert len(polls) == 1 and not threads.adaptive()


def test_a_session_reply_lets_the_governor_look_between_rounds(monkeypatch, tmp_path):
    from support.models import tiny_model_dir
    from specchat.engine.sampling import SamplingParams
    from specchat.models import load_model
    from specchat.session import Session

    calls = []
    monkeypatch.setattr(threads, "adapt", lambda: calls.append(1))
    model = load_model(str(tiny_model_dir(tmp_path, layers=2)), torch.device("cpu"), torch.float32)
    session = Session(model, mode="off", sampling=SamplingParams(0), max_new_tokens=5)
    session.eos_ids = set()
    rounds = list(session.reply("hello"))
    assert len(calls) == len(rounds) == 5


def run_fresh(code: str, **env_extra) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=run_env(**env_extra))
    assert r.returncode == 0 and "libgomp" not in r.stderr, r.stderr
    return r.stdout


PROBE = ("import os; from specchat.cli import options; from specchat import threads; options.prepare_process(); "
         "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), threads.set_threads(None), "
         "threads.physical_cores(), threads._governor is not None)")


def test_a_specchat_process_sets_a_short_spin_and_adaptive_threads():
    policy, spin, n, cores, adaptive = run_fresh(PROBE).split()
    if sys.platform.startswith("linux"):
        assert (policy, spin) == ("None", threads.SPIN_COUNT)
    else:
        assert (policy, spin) == ("PASSIVE", "None")
    assert 1 <= int(n) <= int(cores) and adaptive == "True"


def test_the_users_wait_policy_and_thread_count_are_kept():
    policy, spin, *_ = run_fresh(PROBE, OMP_WAIT_POLICY="ACTIVE").split()
    assert (policy, spin) == ("ACTIVE", "None")
    *_, n, _, adaptive = run_fresh(PROBE, OMP_NUM_THREADS="1").split()
    assert (n, adaptive) == ("1", "False")


LLAMA_PROBE = ("import os; from specchat.cli import options; from specchat import threads; options.prepare_process(); "
               "models = options.ModelOptions(engine='{engine}', target=None, draft=None, device='auto'); "
               "threads.prepare_for_gguf() if options.likely_gguf_engine(models) else None; "
               "import torch; print(os.environ.get('GOMP_SPINCOUNT'))")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GOMP_SPINCOUNT is libgomp's (Linux)")
def test_the_gguf_engines_get_the_longer_spin_torch_the_short_one_and_the_users_is_kept():
    """What load_models does before torch loads: the default model on engine auto runs on llama.cpp or lean."""
    assert run_fresh(LLAMA_PROBE.format(engine="auto")).strip() == threads.GGUF_SPIN_COUNT
    assert run_fresh(LLAMA_PROBE.format(engine="lean")).strip() == threads.GGUF_SPIN_COUNT
    assert run_fresh(LLAMA_PROBE.format(engine="torch")).strip() == threads.SPIN_COUNT
    assert run_fresh(LLAMA_PROBE.format(engine="auto"), GOMP_SPINCOUNT="77").strip() == "77"


def test_a_spare_core_is_one_the_forwards_threads_leave(keep_threads, monkeypatch):
    """The chat redraws less often where the forward's threads take every core (tui/app.py)."""
    monkeypatch.setattr(threads, "physical_cores", lambda: 4)
    torch.set_num_threads(4)
    assert not threads.spare_core()
    torch.set_num_threads(3)
    assert threads.spare_core()
