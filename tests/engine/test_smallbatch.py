"""The fused small-batch linear (engine/smallbatch.py): F.linear's result, the same for a row whatever the
batch, and F.linear itself wherever the kernel does not apply or cannot be built."""

import platform
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from specchat.engine import smallbatch

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


@needs_compiler
def test_the_kernel_builds_where_there_is_a_compiler():
    """conftest loads it for the whole suite, as load_model does for every model on a CPU."""
    assert smallbatch.kernel_name() == "fused"


@needs_compiler
@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump")
def test_every_function_with_the_int8_products_prefetches_its_weights():
    """GCC takes a prefetch for an instruction without effects: in a helper it leaves out of line, the calls are
    dropped, and no result changes (81bf899 lost every prefetch of the interleaved-row kernels so, unseen until a
    step was timed against one without arithmetic: RESULTS 49). So the built library is read back: each function
    with the SIMD int8 products (AVX2's vpmaddubsw, VNNI's vpdpbusd) must prefetch."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", smallbatch._lib._name], capture_output=True, text=True,
                             check=True).stdout
    functions = re.split(r"\n(?=[0-9a-f]+ <)", listing)
    products = [f for f in functions if re.search(r"\b(vpmaddubsw|vpdpbusd)\b", f)]
    if not products:
        pytest.skip("this build has no SIMD int8 products (a CPU without AVX2)")
    assert not [f.split(">:")[0].split("<")[-1] for f in products if "prefetch" not in f]


@needs_compiler
@pytest.mark.parametrize("n, d", [(3072, 576), (576, 1536), (100, 37), (7, 16)], ids=["gate-up", "down", "odd sizes", "tiny"])
def test_matches_f_linear(n, d):
    g = torch.Generator().manual_seed(n + d)
    w, b = torch.randn(n, d, generator=g), torch.randn(n, generator=g)
    with torch.inference_mode():
        for rows in range(1, smallbatch.MAX_ROWS + 1):
            x = torch.randn(1, rows, d, generator=g)
            for bias in (None, b):
                assert smallbatch.usable(x, w)
                got, want = smallbatch.linear(x, w, bias), F.linear(x, w, bias)
                assert got.shape == want.shape
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@needs_compiler
def test_a_row_does_not_depend_on_the_batch_or_the_threads():
    """Summed in one order whatever S: a position's matmul outputs in a verify are bit for bit those of plain
    decoding (attention may still round differently between one and several positions)."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(1000, 576, generator=g), torch.randn(1, smallbatch.MAX_ROWS, 576, generator=g)
    threads = torch.get_num_threads()
    with torch.inference_mode():
        full = smallbatch.linear(x, w)
        assert all(torch.equal(smallbatch.linear(x[:, i : i + 1], w)[0, 0], full[0, i]) for i in range(x.shape[1]))
        assert all(torch.equal(smallbatch.linear(x[:, :s], w), full[:, :s]) for s in range(1, x.shape[1]))
        torch.set_num_threads(2)
        try:
            assert torch.equal(smallbatch.linear(x, w), full)
        finally:
            torch.set_num_threads(threads)


@needs_compiler
def test_bfloat16_draft_weights_stream_at_half_the_bytes_and_multiply_in_float32():
    """A draft's matrices in bfloat16 (draft_weights): each weight widened exactly, so the result is the float32
    product with the rounded weights, summed in the float32 kernel's order (bit-identical to it where D is a
    multiple of the vector width); more rows than the kernel takes go through it MAX_ROWS at a time."""
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(960, 576, generator=g), torch.randn(960, generator=g)
    w16 = smallbatch.draft_weights(w)
    assert w16.dtype == torch.bfloat16 and w16.is_contiguous()
    wide = w16.float()
    with torch.inference_mode():
        for rows in (1, 5, smallbatch.MAX_ROWS):
            x = torch.randn(1, rows, 576, generator=g)
            assert smallbatch.usable(x, w16)
            for bias in (None, b):
                assert torch.equal(smallbatch.linear(x, w16, bias), smallbatch.linear(x, wide, bias))
                torch.testing.assert_close(smallbatch.linear(x, w16, bias), F.linear(x, wide, bias), rtol=1e-5, atol=1e-4)
        x = torch.randn(1, 2 * smallbatch.MAX_ROWS + 3, 576, generator=g)
        chunked = torch.cat([smallbatch.linear(x[:, i : i + smallbatch.MAX_ROWS], w16, b) for i in range(0, x.shape[1], smallbatch.MAX_ROWS)], 1)
        assert not smallbatch.usable(x, w16) and torch.equal(smallbatch.linear(x, w16, b), chunked)
        torch.testing.assert_close(chunked, F.linear(x, wide, b), rtol=1e-5, atol=1e-4)
        odd, xo = torch.randn(100, 37, generator=g), torch.randn(1, 3, 37, generator=g)
        torch.testing.assert_close(smallbatch.linear(xo, smallbatch.draft_weights(odd)), F.linear(xo, odd.bfloat16().float()),
                                   rtol=1e-5, atol=1e-5)
        strided = w16[:, ::2]  # not the kernel's layout: F.linear on its widening
        x = torch.randn(1, 3, 288, generator=g)
        assert torch.equal(smallbatch.linear(x, strided), F.linear(x, strided.float()))


@needs_compiler
def test_int8_weights_multiply_as_their_float32_widening():
    """Int8Weights (mode quant): round to nearest per row, the kernel's result is x @ (q * scale)^T in float32,
    the same for a row whatever the batch, MAX_ROWS at a time for more rows."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(960, 576, generator=g), torch.randn(960, generator=g)
    w[5] = 0.0  # an all-zero row stays zero
    int8 = smallbatch.Int8Weights.of(w)
    assert int8.q.dtype == torch.int8 and int8.shape == w.shape and int8.nbytes == 960 * 576 + 4 * 960
    assert ((int8.float() - w).abs() <= int8.scale[:, None] / 2 + 1e-6).all() and not int8.float()[5].any()
    wide = int8.float()
    with torch.inference_mode():
        x = torch.randn(1, smallbatch.MAX_ROWS, 576, generator=g)
        full = smallbatch.linear(x, int8, b)
        torch.testing.assert_close(full, F.linear(x, wide, b), rtol=1e-5, atol=1e-4)
        assert all(torch.equal(smallbatch.linear(x[:, i : i + 1], int8, b)[0, 0], full[0, i]) for i in range(x.shape[1]))
        many = torch.randn(1, 3 * smallbatch.MAX_ROWS, 576, generator=g)
        torch.testing.assert_close(smallbatch.linear(many, int8, b), F.linear(many, wide, b), rtol=1e-5, atol=1e-4)
        assert torch.equal(smallbatch.linear(many, int8, b)[0, -1], smallbatch.linear(many[:, -1:], int8, b)[0, 0])
        odd, xo = torch.randn(100, 37, generator=g), torch.randn(1, 3, 37, generator=g)
        torch.testing.assert_close(smallbatch.linear(xo, smallbatch.Int8Weights.of(odd)), F.linear(xo, smallbatch.Int8Weights.of(odd).float()),
                                   rtol=1e-5, atol=1e-5)


def test_draft_weights_stay_float32_without_the_kernel(monkeypatch):
    w = torch.randn(8, 16)
    monkeypatch.setattr(smallbatch, "enabled", False)
    assert smallbatch.draft_weights(w) is w


def test_elsewhere_it_is_f_linear(monkeypatch):
    """More rows than the kernel takes, another dtype, autograd (the draft head trains through the runner's
    layers) or switched off: F.linear, exactly."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 32, generator=g)
    with torch.inference_mode():
        x = torch.randn(1, smallbatch.MAX_ROWS + 1, 32, generator=g)
        assert not smallbatch.usable(x, w) and torch.equal(smallbatch.linear(x, w), F.linear(x, w))
        x16, w16 = torch.randn(1, 3, 32, generator=g).bfloat16(), w.bfloat16()
        assert not smallbatch.usable(x16, w16) and torch.equal(smallbatch.linear(x16, w16), F.linear(x16, w16))
    x = torch.randn(1, 3, 32, generator=g)
    wg = w.clone().requires_grad_(True)
    y = smallbatch.linear(x, wg)
    assert not smallbatch.usable(x, wg) and y.requires_grad  # differentiable: F.linear
    monkeypatch.setattr(smallbatch, "enabled", False)
    with torch.inference_mode():
        assert smallbatch.kernel_name() == "torch" and torch.equal(smallbatch.linear(x, w), F.linear(x, w))


def test_no_compiler_means_torch(monkeypatch, tmp_path):
    """A machine without a working C compiler runs F.linear and says so; nothing is left in the folder."""
    monkeypatch.setattr(smallbatch, "_fn", None)
    monkeypatch.setattr(smallbatch, "_lib", None)
    monkeypatch.setenv("CC", "false")
    assert smallbatch.load(tmp_path / "kernels") is False and smallbatch.kernel_name() == "torch"
    x, w = torch.randn(1, 3, 16), torch.randn(8, 16)
    with torch.inference_mode():
        assert not smallbatch.usable(x, w) and torch.equal(smallbatch.linear(x, w), F.linear(x, w))
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


@needs_compiler
@pytest.mark.slow
def test_a_fresh_build_loads(monkeypatch, tmp_path):
    """Compiled into an empty folder (a first start), loaded, and used. Built with -Os instead of -O3 (6 s instead
    of 16 on the reference machine): what is tested is the first start's path, and every other test uses the -O3
    build; the loaded functions are put back after."""
    for name in ("_fn", "_fn_bf16", "_fn_int8", "_lib"):
        monkeypatch.setattr(smallbatch, name, None)
    monkeypatch.setattr(smallbatch, "FLAGS", ["-Os", *smallbatch.FLAGS[1:]])
    assert smallbatch.needs_build(tmp_path)  # what load_models announces as a stage of its own
    assert smallbatch.load(tmp_path) is True and smallbatch.kernel_name() == "fused"
    assert not smallbatch.needs_build(tmp_path)
    assert [p.suffix for p in tmp_path.iterdir()] == [".so"]  # no temporary file left
    x, w = torch.randn(1, 5, 40), torch.randn(24, 40)
    with torch.inference_mode():
        torch.testing.assert_close(smallbatch.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_a_row_does_not_depend_on_the_batch_at_an_odd_width(kind):
    """The kernel's header promises a position's result whatever the number of rows; where D is not a multiple of
    the vector width, the scalar tail must round the same way for every S too (an FMA contracted for some S and
    not others broke that for bfloat16 and int8)."""
    g = torch.Generator().manual_seed(4)
    for n, d in ((1, 9), (3, 17), (64, 37), (5, 577)):
        w, x = torch.randn(n, d, generator=g), torch.randn(1, smallbatch.MAX_ROWS, d, generator=g)
        weights = {"float32": w, "bfloat16": smallbatch.draft_weights(w), "int8": smallbatch.Int8Weights.of(w)}[kind]
        with torch.inference_mode():
            full = smallbatch.linear(x, weights)
            for s in range(1, smallbatch.MAX_ROWS + 1):
                assert torch.equal(smallbatch.linear(x[:, :s], weights), full[:, :s]), (n, d, s)


ODD_WIDTHS = """
import sys, pathlib, torch
from specchat.engine import smallbatch
smallbatch.FLAGS[1] = sys.argv[1]
assert smallbatch.load(pathlib.Path(sys.argv[2]))
torch.set_num_threads(1)
g, bad = torch.Generator().manual_seed(0), []
with torch.inference_mode():
    for n, d in ((3, 9), (64, 9), (5, 15), (3, 37), (64, 65)):
        w, x = torch.randn(n, d, generator=g), torch.randn(1, smallbatch.MAX_ROWS, d, generator=g)
        for kind, weights in (("float32", w), ("bfloat16", smallbatch.draft_weights(w)), ("int8", smallbatch.Int8Weights.of(w))):
            full = smallbatch.linear(x, weights)
            bad += [(n, d, kind, s) for s in range(1, smallbatch.MAX_ROWS) if not torch.equal(smallbatch.linear(x[:, :s], weights), full[:, :s])]
print(bad)
"""


@needs_compiler
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the AMD tuning is an x86 flag")
@pytest.mark.slow
def test_the_tail_rounds_alike_for_every_row_count_when_tuned_for_amd(tmp_path):
    """Built as an AMD machine builds it (-march=znver2), GCC contracted the scalar tail's multiply-add for some
    row counts and not others (bfloat16 and int8 at widths not a multiple of 8): the tail is an explicit FMA now."""
    out = subprocess.run([sys.executable, "-c", ODD_WIDTHS, "-march=znver2", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
