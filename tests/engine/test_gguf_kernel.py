"""The kernel that multiplies a GGUF file's own blocks (smallbatch.gguf_linear, issue 52), in the file's layout and
with 16 rows interleaved (GGUFWeights.packed): against a float64 reference built from the gguf package's own
dequantisation, within the bound that rounding x to int8 allows; bit for bit the same whatever positions are fed with a
row, however many threads, and in the SIMD path as in plain C."""

from __future__ import annotations

import platform
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from specchat.engine import smallbatch
from specchat.engine.smallbatch import GGUFWeights, gguf_linear
from specchat.models import default_gguf

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
PACKED = TYPES  # the types interleaved
LAYOUTS = ["file", "interleaved"]
SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # where a K-quant super-block keeps its float16 scales


@pytest.fixture(scope="module", autouse=True)
def kernel(tmp_path_factory):
    if not smallbatch.load(tmp_path_factory.mktemp("kernels")):
        pytest.skip("no C compiler")


def in_layout(w: GGUFWeights, layout: str) -> GGUFWeights:
    if layout == "file":
        return w
    packed = w.packed()
    assert (packed.interleaved is not None) == (w.type in PACKED)
    return packed


def quantised(kind: str, n: int = 40, d: int = 96, seed: int = 0) -> GGUFWeights:
    """Rows of `kind` blocks: Gaussian weights quantised by the gguf package, or, for the K-quants (which it can only
    dequantise), random super-blocks with scales of a sensible size (every bit pattern of the rest is a valid one).
    The K-quants take rows of 256: d is rounded up to that."""
    rng = np.random.default_rng(seed)
    if kind not in SCALES:
        w = rng.standard_normal((n, d)).astype(np.float32)
        return GGUFWeights(torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])), kind, (n, d))
    d = -(-d // 256) * 256
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
    blocks = rng.integers(0, 256, (n, d // 256, size), dtype=np.uint8)
    for at in SCALES[kind]:
        blocks[:, :, at : at + 2] = rng.uniform(0.002, 0.02, (n, d // 256)).astype(np.float16)[..., None].view(np.uint8)
    return GGUFWeights(torch.from_numpy(blocks.reshape(n, -1)), kind, (n, d))


FLOAT16_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), **SCALES}  # a block's scales


def saturated(kind: str, n: int = 48, d: int = 96) -> GGUFWeights:
    """Every bit of every block set but its float16 scales (0.01): each type's largest integers. With x at +-1
    everywhere (it rounds to +-127), a unit's integer sums are as large as they get: where the AVX2 path adds
    products in 16 bits before widening them, an overflow shows here."""
    w = quantised(kind, n, d)
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
    blocks = np.full((n, w.blocks.shape[1] // size, size), 0xFF, dtype=np.uint8)
    for at in FLOAT16_AT[kind]:
        blocks[:, :, at : at + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    return GGUFWeights(torch.from_numpy(blocks.reshape(n, -1)), kind, w.shape)


def saturating_x(d: int) -> torch.Tensor:
    """[4, d]: all +1, all -1, and alternating signs a block of 32 apart"""
    block_signs = torch.tensor([1.0, -1.0]).repeat(d // 64 + 1)[: d // 32].repeat_interleave(32)
    return torch.stack([torch.ones(d), -torch.ones(d), block_signs, -block_signs])


def rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|y - x @ w^T| at most: x is rounded to int8 per block of 32 with step amax / 127, so each x moves by at most
    half a step; each output moves by at most sum_j |w_j| * half the step of x_j's block. [S, N] float64."""
    x, w = x.double(), w.double()
    half_step = x.reshape(x.shape[0], -1, 32).abs().amax(-1) / 127 / 2  # [S, D/32]
    per_block = w.abs().reshape(w.shape[0], -1, 32).sum(-1)  # [N, D/32]
    return half_step @ per_block.T


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", TYPES)
def test_the_product_is_the_dequantised_weights_times_x_within_the_rounding_of_x(kind, layout):
    w = quantised(kind)
    x = torch.randn(7, w.shape[1], generator=torch.Generator().manual_seed(1))
    exact = x.double() @ w.float().double().T  # [S, N]: the gguf package's own dequantisation, float64
    error = (gguf_linear(x, in_layout(w, layout)).double() - exact).abs()
    assert (error <= rounding_bound(x, w.float()) + 1e-4).all()
    assert error.max() > 0  # x really was rounded: the bound is what holds, not equality


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", TYPES)
def test_a_row_is_the_same_bits_whatever_positions_come_with_it(kind, layout):
    w = in_layout(quantised(kind, n=64, d=128), layout)
    x = torch.randn(16, w.shape[1], generator=torch.Generator().manual_seed(2))
    together = gguf_linear(x, w)
    for s in (1, 2, 5, 8, 9, 12, 13, 16):  # AVX-512: one pass up to 12 positions, then two; AVX2: Q8_0 8 at a time
        assert torch.equal(gguf_linear(x[:s], w), together[:s])
    assert torch.equal(torch.cat([gguf_linear(x[i : i + 1], w) for i in range(16)]), together)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("d", [96, 512])  # an odd number of blocks too: the 512-bit path's last block goes alone
@pytest.mark.parametrize("kind", TYPES)
def test_the_simd_path_gives_the_plain_c_path_s_bits_and_threads_change_nothing(kind, d, layout, monkeypatch):
    w = in_layout(quantised(kind, n=100, d=d, seed=3), layout)  # 100 rows: the last group of 16 is 4
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(3)) * 4
    simd = gguf_linear(x, w)
    assert torch.equal(simd, gguf_linear(x, w, reference=True))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert torch.equal(gguf_linear(x, w), simd)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", TYPES)
def test_the_largest_integers_give_the_plain_c_path_s_bits(kind, layout):
    w = in_layout(saturated(kind), layout)
    x = saturating_x(w.shape[1])
    simd = gguf_linear(x, w)
    assert torch.equal(simd, gguf_linear(x, w, reference=True))
    assert (simd[0] != 0).all()  # the weights really are large: x @ w is far from 0 in every row


def test_more_than_sixteen_positions_go_sixteen_at_a_time():
    w = quantised("Q4_1")
    x = torch.randn(20, 96, generator=torch.Generator().manual_seed(4))
    assert torch.equal(gguf_linear(x, w), torch.cat([gguf_linear(x[:16], w), gguf_linear(x[16:], w)]))


def test_the_default_model_s_own_matrices_read_in_place_from_its_file():
    """A Q4_1 layer matrix and the Q8_0 embedding (the tied LM head) of the embedded model, memory-mapped."""
    reader = gguf.GGUFReader(str(default_gguf()))
    tensors = {t.name: t for t in reader.tensors}
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(5))
    for name, kind in (("blk.0.ffn_up.weight", "Q4_1"), ("token_embd.weight", "Q8_0")):
        w = GGUFWeights.of(tensors[name])
        assert w.type == kind and w.blocks.shape[1] == 576 // 32 * {"Q4_1": 20, "Q8_0": 34}[kind]
        dense = w.float()
        error = (gguf_linear(x, w).double() - x.double() @ dense.double().T).abs()
        assert (error <= rounding_bound(x, dense) + 1e-3).all(), name


def test_a_type_it_does_not_take_is_refused():
    w = quantised("Q4_1")
    with pytest.raises(ValueError):
        gguf_linear(torch.randn(1, 96), GGUFWeights(w.blocks, "Q3_K", w.shape))
    with pytest.raises(ValueError):
        gguf_linear(torch.randn(1, 40), GGUFWeights(w.blocks, "Q4_1", (96, 40)))
    with pytest.raises(ValueError):  # a K-quant row is whole super-blocks of 256
        gguf_linear(torch.randn(1, 96), GGUFWeights(w.blocks, "Q6_K", w.shape))


@pytest.mark.slow
def test_the_avx2_path_compiled_for_a_cpu_without_avx512_gives_its_plain_c_bits(tmp_path):
    """This machine may take the AVX-512 path; the AVX2 one (AMD CPUs here) is compiled for Haswell and run too."""
    import ctypes
    import subprocess

    flags = open("/proc/cpuinfo").read() if Path("/proc/cpuinfo").exists() else ""
    cc = smallbatch._compiler()
    if cc is None or " avx2 " not in f" {flags} ".replace("\n", " "):
        pytest.skip("no C compiler or no AVX2")
    lib_path = tmp_path / "haswell.so"
    subprocess.run([cc, "-O3", "-march=haswell", "-fopenmp", "-shared", "-fPIC", "-o", str(lib_path), str(smallbatch.SOURCE)],
                   check=True, capture_output=True, timeout=120)
    fn = ctypes.CDLL(str(lib_path)).gguf_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p] + [ctypes.c_long] * 3 + [ctypes.c_int] * 2
    def products(x, w, rows, reference):
        data, code = w.kernel_operand()
        y = torch.empty(rows, 48)
        assert fn(x.data_ptr(), data.data_ptr(), code, y.data_ptr(), rows, 48, w.shape[1], 2, reference) == 0
        return y

    for kind, layout in [(k, layout) for k in TYPES for layout in LAYOUTS]:
        big = in_layout(saturated(kind), layout)  # the largest integers (its 16-bit sums), 4 positions
        x = saturating_x(big.shape[1])
        assert torch.equal(products(x, big, 4, 0), products(x, big, 4, 1)), kind
        w = in_layout(quantised(kind, n=48, d=96, seed=6), layout)
        D = w.shape[1]
        x = torch.randn(5, D, generator=torch.Generator().manual_seed(6))
        out = {(reference, rows): products(x, w, rows, reference) for reference in (0, 1) for rows in (5, 1)}
        assert torch.equal(out[0, 5], out[1, 5]) and torch.equal(out[0, 5][:1], out[0, 1])
        error = (out[0, 5].double() - x.double() @ w.float().double().T).abs()
        assert (error <= rounding_bound(x, w.float()) + 1e-4).all()
        if w.interleaved is not None:  # one float operation after another, row by row: the same bits on any CPU
            assert torch.equal(out[0, 5], gguf_linear(x, w)), kind


@pytest.mark.slow
def test_a_build_without_simd_packs_the_same_bytes_and_multiplies_them_to_the_same_bits(tmp_path):
    """The plain-C build (a CPU with neither AVX2 nor AVX-512, an ARM Mac): its gguf_pack decodes block by block in
    C, this machine's with SIMD; the interleaved layout and its products must not depend on which."""
    import ctypes
    import subprocess

    cc = smallbatch._compiler()
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("no C compiler, or not an x86 machine")
    lib_path = tmp_path / "plain.so"
    subprocess.run([cc, "-O3", "-march=x86-64", "-fopenmp", "-shared", "-fPIC", "-o", str(lib_path), str(smallbatch.SOURCE)],
                   check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(lib_path))
    lib.gguf_pack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
    lib.gguf_linear.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p] + [ctypes.c_long] * 3 + [ctypes.c_int] * 2
    for kind in PACKED:
        w = quantised(kind, n=40, d=512, seed=7)
        native = w.packed()
        plain = torch.empty_like(native.interleaved)
        assert lib.gguf_pack(w.blocks.data_ptr(), smallbatch.GGUF_TYPES[kind], 40, w.shape[1], plain.data_ptr(), 2) == 0
        assert torch.equal(plain, native.interleaved), kind
        x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(7))
        y = torch.empty(5, 40)
        _, code = native.kernel_operand()
        assert lib.gguf_linear(x.data_ptr(), plain.data_ptr(), code, y.data_ptr(), 5, 40, w.shape[1], 2, 0) == 0
        assert torch.equal(y, gguf_linear(x, native)), kind


# ---------------------------------------------------------------- the lean runner on the file's own blocks


@pytest.fixture(scope="module")
def block_runners(smol):
    from specchat.engine.gguf_model import with_file_blocks
    from specchat.engine.runner import lean_runner

    runner = lean_runner(smol.model)
    return runner, with_file_blocks(runner, default_gguf())


@pytest.mark.slow
def test_the_runner_on_the_file_s_blocks_is_the_float32_model_within_x_s_rounding(smol, block_runners):
    """Every matrix of the default model as its Q4_1 / Q8_0 blocks (Q and K rows put back from llama.cpp's RoPE
    order): the same next tokens as the float32 conversion on a sentence, logits within 4 of it (seen: 1.69 of ~31;
    the int8 rounding of x compounds over 30 layers); the C layer runs it (kind GGUF). Where the two differ in their
    next token it is a near tie of the float32 model (rounding x to int8 in every layer is a discrete step: a change
    in the last bit of one layer's output can move the next layer's x by a whole step)."""
    runner, blocks = block_runners
    qkv = blocks.blocks[0].qkv_w  # q, k and v read where the file keeps them
    assert isinstance(qkv, smallbatch.GGUFStack) and [p.type for p in qkv.parts] == ["Q4_1"] * 3
    assert isinstance(blocks.head_w, GGUFWeights) and blocks.head_w.type == "Q8_0"  # tied: the embedding's blocks
    ids = smol.raw_ids("The quick brown fox jumps over the lazy dog. The capital of France is")
    with torch.inference_mode():
        dense = runner.forward(ids, range(runner.n_layers), runner.new_cache(), 0, keep=len(ids))  # [S, V]
        quantised = blocks.forward(ids, range(blocks.n_layers), blocks.new_cache(), 0, keep=len(ids))
    assert blocks._fused is not None and all(L is not None for L in blocks._fused)
    agree = dense.argmax(-1) == quantised.argmax(-1)
    gap = dense.amax(-1) - dense.gather(-1, quantised.argmax(-1, keepdim=True)).squeeze(-1)  # [S]: 0 where they agree
    assert agree.sum() >= len(ids) - 2 and (gap < 0.5).all(), (agree, gap)
    assert 0 < (dense - quantised).abs().max() < 4


@pytest.mark.slow
def test_on_the_blocks_a_position_s_logits_are_the_same_bits_fed_alone_or_with_others(smol, block_runners):
    """Also past 16 positions (a prompt): the runner feeds them through the C layers 16 at a time."""
    _, blocks = block_runners
    ids = smol.raw_ids("One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, thirteen, fourteen, "
                       "fifteen, sixteen, seventeen")
    assert len(ids) > 2 * smallbatch.MAX_ROWS
    with torch.inference_mode():
        together = blocks.forward(ids, range(blocks.n_layers), blocks.new_cache(), 0, keep=len(ids))
        cache, alone = blocks.new_cache(), []
        for i in range(len(ids)):
            alone.append(blocks.forward(ids[i : i + 1], range(blocks.n_layers), cache, i, keep=1))
    assert torch.equal(torch.cat(alone), together)


@pytest.mark.slow
def test_drafting_on_the_blocks_gives_plain_greedy_decoding_s_tokens(smol, block_runners):
    """Greedy identity on this runner: suffix drafts (a repeated sentence) verified in batches give the tokens of one
    position at a time."""
    from specchat.engine.drafters import build_drafter
    from specchat.engine.sampling import SamplingParams
    from specchat.engine.target import TargetState
    from support.exact import run

    _, blocks = block_runners
    prompt = smol.chat_ids([{"role": "user", "content": "Repeat exactly: the sea is calm, the sea is deep, the sea is calm."}])
    replies = {}
    for mode in ("off", "suffix"):
        state = TargetState(smol.model)
        state.lean = blocks
        ids, records = run(smol.model, build_drafter(mode, smol.model), prompt, k=4, params=SamplingParams(0.0),
                           max_new_tokens=32, state=state)
        replies[mode] = ids
        if mode == "suffix":
            assert sum(r.drafted for r in records) > 0  # it drafted, and the verifies fed several positions
    assert replies["suffix"] == replies["off"]


class BlocksConditionals:
    """p(. | prompt + prefix) from a runner on blocks, for specchat.verify's tests: the runner's own distribution
    (a position's logits do not depend on the positions fed with it, so one forward gives every prefix's)."""

    def __init__(self, runner, prompt, params) -> None:
        self.runner, self.prompt, self.params = runner, list(prompt), params

    def many(self, sequences):
        from specchat.engine.sampling import logits_to_probs

        for seq in (s for s in sequences if s):
            with torch.inference_mode():
                ids = self.prompt + list(seq[:-1])
                logits = self.runner.forward(ids, range(self.runner.n_layers), self.runner.new_cache(), 0, keep=len(seq))
            yield seq, logits_to_probs(logits, self.params)


def q4_1_blocks(layers: int, seed: int = 3):
    """A tiny Llama whose every matrix is Q4_1 blocks (dims of 64: whole blocks): (the model, a runner on the blocks)."""
    from support.models import tiny_llama
    from specchat.engine.runner import lean_runner

    model = tiny_llama(seed=seed, layers=layers, hidden_size=64, intermediate_size=64, sharpen=2.0).requires_grad_(False)

    def q4_1(w: torch.Tensor) -> GGUFWeights:
        blocks = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType.Q4_1)
        return GGUFWeights(torch.from_numpy(blocks), "Q4_1", tuple(w.shape))

    blocks = lean_runner(model).with_weights(q4_1)
    assert isinstance(blocks.blocks[0].qkv_w, GGUFWeights)
    return model, blocks


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "q at the wrong temperature from position 3 (control)"])
@pytest.mark.slow
def test_sampled_output_on_blocks_follows_the_blocks_model_s_distribution(broken):
    """A tiny Llama on Q4_1 blocks drafted by a bigram table with a q of its own, K=3 and draws of K+1 tokens, position
    by position against the blocks model's exact conditionals: the exact rule passes; a q reported at the wrong
    temperature from draft position 3 fails there."""
    from specchat.engine.target import TargetState

    model, blocks = q4_1_blocks(layers=2)
    state = TargetState(model)
    state.lean = blocks
    assert_follows_the_runner(state, blocks, model, broken)


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "q at the wrong temperature from position 3 (control)"])
@pytest.mark.parametrize("mode, options", [("layerskip", {"skip_layers": [1]}), ("earlyexit", {"exit_layer": 3})])
@pytest.mark.slow
def test_self_speculation_on_a_file_read_in_place_follows_its_distribution(mode, options, broken):
    """layerskip and earlyexit built for a GGUF file read in place (no HF model: the file's runner alone, as --engine
    lean loads it) on a 4-layer tiny Llama's Q4_1 blocks: the same test, the mode's own drafts."""
    from types import SimpleNamespace

    from specchat.engine.drafters import build_drafter
    from specchat.engine.target import TargetState

    model, blocks = q4_1_blocks(layers=4)
    state = TargetState.on_runner(blocks, None)
    drafter = build_drafter(mode, SimpleNamespace(engine="lean", runner=blocks), **options)
    assert drafter.decoder is None  # nothing of an HF model
    assert_follows_the_runner(state, blocks, model, broken, drafter=drafter)


def assert_follows_the_runner(state, runner, model, broken: bool, drafter=None) -> None:
    """Draws of K+1 = 4 tokens from `state` (a target on `runner`), drafted by `drafter` or else a bigram table of
    `model` with a q of its own (K=3), tested position by position against the runner's own conditionals: the exact
    rule passes; with `broken`, a q reported at the wrong temperature from draft position 3 fails there."""
    from support.broken import ReportsWrongQ
    from support.exact import ALPHA, PROMPT, assert_drafted_up_to
    from support.models import bigram_draft
    from specchat.engine.drafters.model import ModelDrafter
    from specchat.engine.loop import Controls
    from specchat.engine.metrics import Stats
    from specchat.engine.sampling import SamplingParams
    from specchat.verify import conditional_tests, sample_continuations

    params = SamplingParams(1.0)
    if drafter is None:
        drafter = ModelDrafter(bigram_draft(model, scale=2.0))  # agrees often enough to reach draft position 3
    if broken:
        drafter = ReportsWrongQ(drafter, position=3, factor=0.25)
    stats = Stats()
    counts = sample_continuations(state, PROMPT, Controls(drafter, k=3, sampling=params), draws=5000, length=4, eos_ids=set(),
                                  generator=torch.Generator().manual_seed(0), stats=stats)
    positions, _, _ = conditional_tests(counts, BlocksConditionals(runner, PROMPT, params), 4)
    p_value = min(1.0, 4 * min(p["combined_p"] for p in positions))
    assert_drafted_up_to(stats, 3)
    if broken:
        assert p_value < 1e-6 and min(positions, key=lambda p: p["combined_p"])["position"] == 3, positions
    else:
        assert p_value >= ALPHA, positions
