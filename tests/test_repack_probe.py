"""llama.cpp's weight repacking is used only where a child process decoded with it and lived: a native fault in the
probe turns repacking off with one line for the user, never kills specchat (repack_probe.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specchat import repack_probe
from specchat.engine import llamacpp
from specchat.repack_probe import Verdict

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python is not installed")


def child_that(code: str):
    """A probe command running `code` in a fresh Python instead of the real child."""
    return lambda workdir: [sys.executable, "-c", code]


DIES_AT_TWO = ("import json, os, signal; print(json.dumps({'step': '1 position of Q4_0'})); "
               "print(json.dumps({'step': '2 positions of Q4_0'}), flush=True); os.kill(os.getpid(), signal.SIGILL)")


@pytest.fixture
def fresh_verdict(monkeypatch, tmp_path):
    """verdict() as on a machine that has never probed: an empty cache, nothing remembered in this process."""
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("LLAMA_ARG_REPACK", raising=False)
    repack_probe.verdict.cache_clear()
    yield
    repack_probe.verdict.cache_clear()


def test_a_child_killed_by_a_signal_turns_repacking_off_and_says_where():
    v = repack_probe.run_probe(child_that(DIES_AT_TWO))
    assert v == Verdict(False, "faults (SIGILL) on this CPU on a decode of 2 positions of Q4_0")
    assert v.notice == f"llama.cpp's {repack_probe.repacker()} faults (SIGILL) on this CPU on a decode of 2 positions of Q4_0: " \
        "weight repacking off (slower, safe)"


def test_logits_far_from_unrepacked_ones_turn_repacking_off():
    v = repack_probe.run_probe(child_that("print('{\"worst\": 0.4, \"where\": \"Q4_K, 9 positions\"}')"))
    assert not v.repack and "0.40 of their range" in v.reason and "Q4_K, 9 positions" in v.reason


def test_a_child_that_hangs_or_fails_turns_repacking_off(monkeypatch):
    monkeypatch.setattr(repack_probe, "TIMEOUT_S", 1)
    assert repack_probe.run_probe(child_that("import time; time.sleep(30)")) == Verdict(False, "did not finish a test decode on this CPU in 1 s")
    failed = repack_probe.run_probe(child_that("import sys; sys.exit('no gguf package')"))
    assert not failed.repack and "no gguf package" in failed.reason


def test_agreeing_logits_keep_repacking_on():
    v = repack_probe.run_probe(child_that("print('{\"worst\": 0.001, \"where\": \"Q4_0, 2 positions\"}')"))
    assert v.repack and v.notice is None


def test_the_probe_runs_once_per_machine_and_is_remembered(fresh_verdict, monkeypatch, tmp_path):
    runs = tmp_path / "runs"
    monkeypatch.setattr(repack_probe, "child_command",
                        child_that(f"open({str(runs)!r}, 'a').write('x'); " + DIES_AT_TWO))
    assert not repack_probe.known()
    first = repack_probe.verdict()
    repack_probe.verdict.cache_clear()  # a new process: reads the cache file
    assert repack_probe.known() and repack_probe.verdict() == first and not first.repack
    assert runs.read_text() == "x"
    assert repack_probe.verdict_path().is_relative_to(tmp_path / "cache")


def test_llama_arg_repack_decides_without_a_probe(fresh_verdict, monkeypatch):
    monkeypatch.setattr(repack_probe, "child_command", child_that("raise SystemExit('the probe must not run')"))
    monkeypatch.setenv("LLAMA_ARG_REPACK", "0")
    assert repack_probe.known() and repack_probe.verdict() == Verdict(False, "is set off by LLAMA_ARG_REPACK=0")


@pytest.mark.parametrize("child", [DIES_AT_TWO, "print('{\"worst\": 0.0, \"where\": \"Q4_0, 2 positions\"}')"])
def test_models_load_repacked_only_where_the_probe_lived(fresh_verdict, monkeypatch, tmp_path, child):
    from specchat.models import load_gguf

    monkeypatch.setattr(repack_probe, "child_command", child_that(child))
    path = repack_probe.write_tiny_gguf(tmp_path / "tiny.gguf")
    model = load_gguf(str(path), tokenizer="ids only").model
    assert model.repack is (child != DIES_AT_TWO)
    if model.repack and not repack_probe.run_probe().repack:
        return  # this machine's own repacking faults: the decode below would too
    logits = model.context(64).decode(list(range(1, 10)), 0, 9)  # several positions: what faulted in the probe
    assert logits.shape == (9, 512) and logits.isfinite().all()


def test_the_real_probe_gives_a_verdict_this_process_can_run(tmp_path):
    """The real child on this machine; where it says repacking is safe, a repacked decode of several positions
    matches an unrepacked one here too (a wrong verdict would kill this test's worker: one failing test)."""
    v = repack_probe.run_probe()
    assert v.reason
    if v.repack:
        lib = llamacpp.bindings()
        path = repack_probe.write_tiny_gguf(tmp_path / "tiny.gguf")
        repacked, plain = (repack_probe.decode_logits(lib, path, repack, 9) for repack in (True, False))
        assert abs(repacked - plain).max() <= repack_probe.TOLERANCE * abs(plain).max()


GGML_TILE_CONFIG = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>
struct tile_config_t { uint8_t palette_id, start_row, reserved_0[14]; uint16_t colsb[16]; uint8_t rows[16]; };
__attribute__((noinline)) static void config(void) {  /* ggml's ggml_tile_config_init, in C */
    _Alignas(64) struct tile_config_t tc = {0};
    tc.palette_id = 1;
    for (int i = 0; i < 8; i++) { tc.rows[i] = 16; tc.colsb[i] = 64; }
    _tile_loadconfig(&tc);
}
int main(void) {
    syscall(SYS_arch_prctl, 0x1023, 18);  /* ARCH_REQ_XCOMP_PERM for XTILEDATA, as ggml asks */
    config();
    _tile_zero(4);
    puts("ok");
    return 0;
}
"""


def amx_cpu() -> bool:
    return "amx_tile" in repack_probe.cpu_flags().split()


@pytest.mark.skipif(shutil.which("gcc") is None or not amx_cpu(), reason="needs gcc and a CPU with AMX")
@pytest.mark.parametrize("fixed", [True, False])
def test_the_install_header_keeps_ggmls_tile_configuration(tmp_path, fixed):
    """scripts/amx_tilecfg_fix.h, force-included into llama.cpp's build: ggml's tile configuration survives -O2. Without
    it, GCC 11-12 drop the configuration's stores and the first tile instruction faults (the control)."""
    version = int(subprocess.run(["gcc", "-dumpversion"], capture_output=True, text=True).stdout.split(".")[0])
    if not fixed and version >= 13:
        pytest.skip(f"gcc {version} has a correct _tile_loadconfig: nothing to show")
    (tmp_path / "tilecfg.c").write_text(GGML_TILE_CONFIG)
    include = ["-include", str(ROOT / "scripts" / "amx_tilecfg_fix.h")] if fixed else []
    subprocess.run(["gcc", "-O2", "-mamx-tile", *include, "tilecfg.c", "-o", "tilecfg"], cwd=tmp_path, check=True)
    ran = subprocess.run([str(tmp_path / "tilecfg")], capture_output=True, text=True)
    if fixed:
        assert ran.returncode == 0 and ran.stdout == "ok\n"
    else:
        assert ran.returncode < 0  # SIGSEGV or SIGILL: the tiles were never configured


TORCH_THEN_LLAMA_CPP = """
import sys
from pathlib import Path
from specchat import repack_probe
if sys.argv[2] == "capped":
    repack_probe.keep_tiles_for_llama_cpp()
import torch
from specchat.engine import llamacpp
work = Path(sys.argv[1])
llamacpp.quantize(repack_probe.write_tiny_gguf(work / "f32.gguf"), work / "q4_0.gguf", "Q4_0")
context = llamacpp.GGUFModel(work / "q4_0.gguf", repack=True).context(64)
context.decode([1, 2, 3], 0, 3)  # llama.cpp's threads configure their tiles
a = torch.randn(64, 256, dtype=torch.bfloat16)
(a @ a.T).sum()  # oneDNN: AMX kernels where it may use them, which release the tiles
context.decode([4, 5, 6], 3, 3)
print("lived")
"""


@pytest.mark.skipif(not amx_cpu(), reason="needs a CPU with AMX")
@pytest.mark.parametrize("capped", [True, False])
def test_torch_bfloat16_matmuls_leave_llama_cpps_amx_tiles_alone(tmp_path, capped):
    """Where llama.cpp's AMX path runs, a process that will run llama.cpp keeps oneDNN off AMX (threads.py calls
    keep_tiles_for_llama_cpp before torch loads); without that (the control) the next decode faults."""
    if not repack_probe.verdict().repack:
        pytest.skip("llama.cpp's repacking is off on this machine: its AMX path never runs")
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    ran = subprocess.run([sys.executable, "-c", TORCH_THEN_LLAMA_CPP, str(tmp_path), "capped" if capped else "not"],
                         capture_output=True, text=True, env=env, timeout=300)
    if capped:
        assert ran.returncode == 0 and ran.stdout.strip() == "lived", ran.stderr
    else:
        assert ran.returncode < 0


@pytest.mark.slow
def test_generate_says_in_its_summary_that_repacking_is_off():
    """The default model on llama.cpp (auto may measure the lean engine faster), with repacking off as the probe would
    turn it off: one line."""
    from support.process import run_env

    env = run_env(LLAMA_ARG_REPACK="0")
    ran = subprocess.run([sys.executable, "-m", "specchat", "generate", "--prompt", "Hi", "--max-new-tokens", "3", "--format", "json",
                          "--engine", "llama.cpp"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert ran.returncode == 0, ran.stderr
    summary = [json.loads(line) for line in ran.stdout.splitlines()][-1]
    assert summary["type"] == "summary" and summary["engine"] == "llama.cpp"
    assert summary["notices"] == [f"llama.cpp's {repack_probe.repacker()} is set off by LLAMA_ARG_REPACK=0: weight repacking "
                                  f"off (slower, safe)"]
