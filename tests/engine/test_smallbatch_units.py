"""engine/smallbatch.py's Python side: where the kernel is built and under which name, when it is (re)built, how it
is loaded, and which calls take it. The build runs a stand-in compiler (a script that copies the kernel conftest
already built), so nothing is compiled here; the whole file takes about a second."""

from __future__ import annotations

import os
import pathlib
import platform
import re
import stat

import pytest
import torch
import torch.nn.functional as F

from specchat.engine import smallbatch

BUILT = smallbatch._lib._name if smallbatch._lib is not None else None  # the kernel conftest loaded
needs_kernel = pytest.mark.skipif(BUILT is None, reason="the kernel was not built (no C compiler)")


def fake_cc(folder: pathlib.Path, *, fails: bool = False) -> pathlib.Path:
    """A compiler that logs its arguments and "compiles" by copying the kernel already built (or fails loudly)."""
    script = folder / ("failing-cc" if fails else "fake-cc")
    log = folder / "cc.log"
    if fails:
        body = f'echo "$@" >> "{log}"\necho "smallbatch.c:1: error: no" >&2\nexit 1\n'
    else:
        body = (f'echo "$@" >> "{log}"\nwhile [ $# -gt 0 ]; do if [ "$1" = -o ]; then out="$2"; fi; shift; done\n'
                f'cp "{BUILT}" "$out"\n')
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def cc_calls(folder: pathlib.Path) -> list[list[str]]:
    log = folder / "cc.log"
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def unloaded(monkeypatch):
    """The module as before any load (restored after)."""
    for name in ("_lib", "_fn", "_fn_bf16", "_fn_int8"):
        monkeypatch.setattr(smallbatch, name, None)
    monkeypatch.setattr(smallbatch, "enabled", True)


# ---------------------------------------------------------------- the compiler and the kernel's name


def test_the_compiler_is_cc_from_the_environment_else_cc_else_gcc(monkeypatch):
    found = {"cc": "/usr/bin/cc", "gcc": "/usr/bin/gcc"}
    monkeypatch.setattr(smallbatch.shutil, "which", lambda name: found.get(name))
    monkeypatch.setenv("CC", "/opt/clang")
    assert smallbatch._compiler() == "/opt/clang"
    monkeypatch.delenv("CC")
    assert smallbatch._compiler() == "/usr/bin/cc"
    del found["cc"]
    assert smallbatch._compiler() == "/usr/bin/gcc"
    del found["gcc"]
    assert smallbatch._compiler() is None


CPUINFO = """processor\t: {n}
vendor_id\t: GenuineIntel
model name\t: {model}
cpu MHz\t\t: {mhz}
flags\t\t: {flags}
"""


def cpuinfo(model="Intel(R) Xeon(R) CPU @ 2.20GHz", flags="fpu sse2 avx2 avx512f", mhz=(2200.0, 2201.5)) -> str:
    return "\n".join(CPUINFO.format(n=i, model=model, flags=flags, mhz=m) for i, m in enumerate(mhz))


@pytest.fixture
def proc_cpuinfo(monkeypatch):
    """Script what /proc/cpuinfo reads (text, or an exception to raise)."""
    script = {"text": cpuinfo()}

    class ScriptedPath(type(pathlib.Path())):
        def read_text(self, *a, **k):
            if str(self) == "/proc/cpuinfo":
                if isinstance(script["text"], BaseException):
                    raise script["text"]
                return script["text"]
            return super().read_text(*a, **k)

    monkeypatch.setattr(smallbatch, "Path", ScriptedPath)
    return script


def test_the_cpu_key_is_the_model_and_flags(proc_cpuinfo):
    key = smallbatch._cpu_key()
    assert "Intel(R) Xeon(R) CPU @ 2.20GHz" in key and "avx512f" in key and "MHz" not in key and "GenuineIntel" not in key
    proc_cpuinfo["text"] = cpuinfo(mhz=(1800.25, 3000.0))  # the clock moves between starts: the same kernel
    assert smallbatch._cpu_key() == key
    proc_cpuinfo["text"] = cpuinfo(mhz=(2200.0, 2201.5, 2199.9, 2200.1))  # more cores of the same CPU: the same kernel
    assert smallbatch._cpu_key() == key
    proc_cpuinfo["text"] = cpuinfo(mhz=(2200.0,))
    assert smallbatch._cpu_key() == key
    proc_cpuinfo["text"] = cpuinfo(flags="fpu sse2 avx2")  # no AVX-512 here: -march=native differs
    assert smallbatch._cpu_key() != key
    proc_cpuinfo["text"] = cpuinfo(model="AMD EPYC 7B12")
    assert smallbatch._cpu_key() != key


def test_without_proc_cpuinfo_the_key_is_the_processor(proc_cpuinfo, monkeypatch):
    proc_cpuinfo["text"] = FileNotFoundError("/proc/cpuinfo")  # macOS
    monkeypatch.setattr(platform, "processor", lambda: "arm")
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    assert smallbatch._cpu_key() == "arm"
    monkeypatch.setattr(platform, "processor", lambda: "")  # where Python cannot tell
    assert smallbatch._cpu_key() == "arm64"


def test_the_built_file_is_named_by_compiler_flags_source_and_cpu(tmp_path, proc_cpuinfo, monkeypatch):
    path = smallbatch._built_path(tmp_path, "/usr/bin/cc")
    assert path.parent == tmp_path and re.fullmatch(r"smallbatch-[0-9a-f]{12}\.so", path.name)
    assert smallbatch._built_path(tmp_path, "/usr/bin/cc") == path
    assert smallbatch._built_path(tmp_path, "/usr/bin/gcc") != path
    proc_cpuinfo["text"] = cpuinfo(flags="fpu sse2")
    assert smallbatch._built_path(tmp_path, "/usr/bin/cc") != path
    proc_cpuinfo["text"] = cpuinfo()
    monkeypatch.setattr(smallbatch, "FLAGS", [*smallbatch.FLAGS[:1], "-march=znver2", *smallbatch.FLAGS[2:]])
    assert smallbatch._built_path(tmp_path, "/usr/bin/cc") != path


# ---------------------------------------------------------------- building and loading


@needs_kernel
def test_a_first_load_builds_once_into_the_folder_and_loads_all_three_functions(unloaded, tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(fake_cc(tmp_path)))
    folder = tmp_path / "cache" / "kernels"  # not there yet
    assert smallbatch.needs_build(folder) and smallbatch.kernel_name() == "torch"
    assert smallbatch.load(folder) is True and smallbatch.kernel_name() == "fused" and smallbatch.int8_usable()
    (call,) = cc_calls(tmp_path)
    out = pathlib.Path(call[call.index("-o") + 1])
    assert call == [*smallbatch.FLAGS, "-o", str(out), str(smallbatch.SOURCE)]
    assert out.parent == folder and out.name.startswith(".")  # a hidden temporary beside it, then renamed: atomic
    assert [p.name for p in folder.iterdir()] == [smallbatch._built_path(folder, os.environ["CC"]).name]
    assert not smallbatch.needs_build(folder)
    monkeypatch.setattr(smallbatch, "_fn", None)  # a later process: the file is there, nothing compiles
    assert not smallbatch.needs_build(folder)
    assert smallbatch.load(folder) is True and len(cc_calls(tmp_path)) == 1
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(24, 40, generator=g), torch.randn(24, generator=g), torch.randn(2, 3, 40, generator=g)
    with torch.inference_mode():  # each function called through its declared signature
        torch.testing.assert_close(smallbatch.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        w16 = smallbatch.draft_weights(w)
        assert w16.dtype == torch.bfloat16
        torch.testing.assert_close(smallbatch.linear(x, w16, b), F.linear(x, w16.float(), b), rtol=1e-5, atol=1e-5)
        q = smallbatch.Int8Weights.of(w)
        torch.testing.assert_close(smallbatch.linear(x, q, b), F.linear(x, q.float(), b), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_failed_compile_means_torch_quietly_and_leaves_nothing(unloaded, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("CC", str(fake_cc(tmp_path, fails=True)))
    folder = tmp_path / "kernels"
    assert smallbatch.load(folder) is False and smallbatch.kernel_name() == "torch" and not smallbatch.int8_usable()
    assert len(cc_calls(tmp_path)) == 1 and list(folder.iterdir()) == []
    assert capfd.readouterr().err == ""  # the compiler's complaint is not the user's


def test_no_compiler_at_all_means_no_build(unloaded, tmp_path, monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(smallbatch.shutil, "which", lambda name: None)
    assert not smallbatch.needs_build(tmp_path)
    assert smallbatch._build(tmp_path) is None and smallbatch.load(tmp_path) is False
    assert list(tmp_path.iterdir()) == []


@needs_kernel
def test_a_loaded_kernel_needs_no_build(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(fake_cc(tmp_path)))
    assert not smallbatch.needs_build(tmp_path / "empty")  # this process has it already
    assert smallbatch.load(tmp_path / "empty") is True and cc_calls(tmp_path) == []


# ---------------------------------------------------------------- which calls take the kernel


@needs_kernel
@pytest.mark.parametrize("shape, fits", [((16, 8), True), ((17, 8), False), ((2, 8, 8), True), ((3, 6, 8), False),
                                          ((1, 1, 8), True), ((0, 8), False), ((1, 0, 8), False)])
def test_usable_for_one_to_sixteen_rows_in_all(shape, fits):
    w = torch.randn(4, 8)
    with torch.inference_mode():
        assert smallbatch.usable(torch.randn(shape), w) is fits
        assert smallbatch.usable(torch.randn(shape), w.bfloat16()) is fits


@needs_kernel
def test_usable_only_for_float32_x_on_the_cpu_without_grad_and_a_contiguous_float32_or_bfloat16_w(monkeypatch):
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    with torch.inference_mode():
        assert smallbatch.usable(x, w)
        assert not smallbatch.usable(x.double(), w) and not smallbatch.usable(x.half(), w)
        assert not smallbatch.usable(x, w.half()) and not smallbatch.usable(x, w.double())
        assert not smallbatch.usable(x, torch.randn(8, 4).t())  # not the kernel's layout
        assert not smallbatch.usable(x.to("meta"), w)
    assert not smallbatch.usable(x, w)  # autograd on: F.linear
    with torch.inference_mode():
        monkeypatch.setattr(smallbatch, "enabled", False)
        assert not smallbatch.usable(x, w)
        monkeypatch.setattr(smallbatch, "enabled", True)
        monkeypatch.setattr(smallbatch, "_fn", None)
        assert not smallbatch.usable(x, w)


@needs_kernel
def test_int8_in_the_kernel_only_where_it_is_loaded_and_on(monkeypatch):
    assert smallbatch.int8_usable()
    monkeypatch.setattr(smallbatch, "enabled", False)
    assert not smallbatch.int8_usable()
    monkeypatch.setattr(smallbatch, "enabled", True)
    monkeypatch.setattr(smallbatch, "_fn_int8", None)
    assert not smallbatch.int8_usable()


@needs_kernel
def test_draft_weights_are_bfloat16_only_for_a_float32_matrix_on_the_cpu(monkeypatch):
    w = torch.randn(8, 16)
    assert smallbatch.draft_weights(w).dtype == torch.bfloat16
    for other in (torch.randn(16), torch.randn(2, 8, 16), w.double(), w.to("meta")):
        assert smallbatch.draft_weights(other) is other
    monkeypatch.setattr(smallbatch, "_fn_bf16", None)
    assert smallbatch.draft_weights(w) is w


@needs_kernel
def test_a_bias_of_another_dtype_is_f_linears_business(monkeypatch):
    """The kernel reads a float32 bias; any other goes to F.linear, which refuses the mix as it always does."""
    x, w, b = torch.randn(1, 3, 8), torch.randn(4, 8), torch.randn(4)
    with torch.inference_mode():
        for weights in (w, smallbatch.draft_weights(w), smallbatch.Int8Weights.of(w)):
            with pytest.raises(RuntimeError):
                smallbatch.linear(x, weights, b.double())


@needs_kernel
def test_the_kernel_takes_the_float32_calls_and_counts_threads(monkeypatch):
    """Seen through a spy on the kernel functions: which calls reach them, with what sizes."""
    calls = []

    def spy(real):
        def fn(*args):
            calls.append(args[-4:])  # S, N, D, threads
            return real(*args)
        return fn

    for name in ("_fn", "_fn_bf16", "_fn_int8"):
        monkeypatch.setattr(smallbatch, name, spy(getattr(smallbatch, name)))
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(5, 8, generator=g), torch.randn(5, generator=g)
    with torch.inference_mode():
        x = torch.randn(2, 3, 8, generator=g)
        y = smallbatch.linear(x, w, b)
        assert y.shape == (2, 3, 5) and calls == [(6, 5, 8, torch.get_num_threads())]
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        calls.clear()
        many = torch.randn(1, 2 * smallbatch.MAX_ROWS + 1, 8, generator=g)
        for weights in (smallbatch.draft_weights(w), smallbatch.Int8Weights.of(w)):
            y = smallbatch.linear(many, weights, b)
            assert y.shape == (1, 33, 5)
            torch.testing.assert_close(y, F.linear(many, weights.float(), b), rtol=1e-5, atol=1e-5)
        assert [c[0] for c in calls] == [16, 16, 1, 16, 16, 1]
        calls.clear()
        assert torch.equal(smallbatch.linear(many, w, b), F.linear(many, w, b)) and calls == []  # too many rows
        strided = smallbatch.draft_weights(torch.randn(5, 16, generator=g))[:, ::2]
        assert torch.equal(smallbatch.linear(x, strided), F.linear(x, strided.float())) and calls == []
    y = smallbatch.linear(x, smallbatch.draft_weights(w))  # autograd on: widened for F.linear
    assert calls == [] and torch.equal(y, F.linear(x, smallbatch.draft_weights(w).float()))


def test_int8_weights_round_per_row_and_widen(monkeypatch):
    w = torch.tensor([[1.0, -0.3, 0.6], [0.0, 0.0, 0.0], [-254.0, 127.0, 1.0]])
    q = smallbatch.Int8Weights.of(w)
    assert q.q.tolist() == [[127, -38, 76], [0, 0, 0], [-127, 64, 0]]  # 63.5 and 0.5 round to even
    torch.testing.assert_close(q.scale, torch.tensor([1 / 127, torch.finfo(torch.float32).tiny, 2.0]))
    torch.testing.assert_close(q.float(), torch.tensor([[1.0, -38 / 127, 76 / 127], [0.0, 0.0, 0.0], [-254.0, 128.0, 0.0]]))
    assert q.shape == (3, 3) and q.nbytes == 9 + 12
    for rows in (1, 2):  # rounded a few rows at a time: the same numbers, the last chunk short
        chunked = smallbatch.Int8Weights.of(w, rows=rows)
        assert torch.equal(chunked.q, q.q) and torch.equal(chunked.scale, q.scale)
    half = smallbatch.Int8Weights.of(w.to(torch.bfloat16), rows=2)  # a bfloat16 matrix: its float32 values rounded
    assert torch.equal(half.q, q.q) and half.scale.dtype == torch.float32
    monkeypatch.setattr(smallbatch, "_fn_int8", None)  # no kernel: F.linear on the widening
    x = torch.randn(2, 3)
    with torch.inference_mode():
        assert torch.equal(smallbatch.linear(x, q), F.linear(x, q.float()))


def test_layer_args_are_built_again_only_for_other_weights_or_other_k_v_storage():
    """A forward's pointer arrays are reused while every layer's weights and K/V tensors are the same objects, and
    rebuilt, pointing at the new storage, once one of them is another (a cache that grew)."""
    Ls = [smallbatch.LayerWeights() for _ in range(3)]
    kv = [(torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4)) for _ in range(3)]
    args = smallbatch.LayerArgs()
    first = args.arrays(Ls, kv)
    assert args.arrays(list(Ls), list(kv)) is first
    grown = (torch.zeros(1, 2, 16, 4), kv[1][1])
    again = args.arrays(Ls, [kv[0], grown, kv[2]])
    assert again is not first and again[1][1] == grown[0].data_ptr() and list(again[3]) == [8, 16, 8]
    assert args.arrays(Ls[:2], kv[:2]) is not again  # another set of layers
    assert args.arrays([Ls[0], smallbatch.LayerWeights(), Ls[2]], kv)[0][1] != first[0][1]
