"""The lean runner reading a GGUF file in place (engine/gguf_model.py): the same logits as the runner built from the
converted model with the file's blocks swapped in, K-quant files whose Q, K and V differ in type, float32 files,
and a one-line refusal for what it does not read."""

from __future__ import annotations

import platform
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from specchat.engine import smallbatch
from specchat.engine.gguf_model import Unreadable, load_runner, with_file_blocks
from specchat.engine.smallbatch import GGUFStack, GGUFWeights
from specchat.models import default_gguf


@pytest.fixture(scope="module", autouse=True)
def kernel(tmp_path_factory):
    if not smallbatch.load(tmp_path_factory.mktemp("kernels")):
        pytest.skip("no C compiler")


def logits(runner, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return runner.forward(ids, range(runner.n_layers), runner.new_cache(), 0, keep=len(ids))  # [S, V]


@pytest.mark.slow
def test_the_default_model_read_in_place_is_the_converted_model_on_its_blocks_to_the_bit(smol):
    """Config, norms, RoPE tables, the embedding looked up in the file and every matrix's blocks: the runner built
    from the file alone gives the logits of the converted model's runner with the same blocks swapped in."""
    from specchat.engine.runner import lean_runner

    native = load_runner(default_gguf())
    swapped = with_file_blocks(lean_runner(smol.model), default_gguf())
    assert native.model is None and isinstance(native.embed_w, GGUFWeights)
    ids = smol.raw_ids("The quick brown fox jumps over the lazy dog. The capital of France is")
    assert torch.equal(logits(native, ids), logits(swapped, ids))


def test_a_float32_llama_file_gives_the_torch_model_s_logits(tmp_path):
    """F32 matrices are read as float32 views and llama's Q/K rows put back from llama.cpp's order: the file's
    runner is the model's own runner, bit for bit."""
    from support.models import tiny_llama
    from support.gguf import write_gguf
    from specchat.engine.runner import lean_runner

    model = tiny_llama(seed=5, layers=2, hidden_size=64, intermediate_size=96).requires_grad_(False)
    native = load_runner(write_gguf(model, tmp_path / "tiny.gguf"))
    ids = [1, 7, 3, 9, 4, 2, 8]
    assert torch.equal(logits(native, ids), logits(lean_runner(model), ids))


def write_k_quant_qwen2(path, *, tied: bool, seed: int = 0, embed_type: str = "Q8_0", head_again: str | None = None,
                        embed_scale: float = 1.0) -> None:
    """A tiny Qwen2 (q/k/v biases) whose matrices are random K-quant super-blocks as a Q4_K_M file mixes them: Q and
    K in Q4_K, V and down in Q6_K, the rest Q4_K; an untied head in Q6_K, or the embedding (`embed_type`) as the head;
    `head_again`: the embedding's matrix written a second time as output.weight in that type (a tied model as
    llama.cpp's quantiser writes one, its head at a higher precision); `embed_scale` 0.1: a tied head's next-token
    distributions spread over several tokens instead of one."""
    rng = np.random.default_rng(seed)
    D, I, H, Hkv, hd, V, layers = 256, 512, 4, 2, 64, 96, 2
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for key, value in (("context_length", 512), ("embedding_length", D), ("block_count", layers), ("feed_forward_length", I),
                       ("attention.head_count", H), ("attention.head_count_kv", Hkv)):
        writer.add_uint32(f"qwen2.{key}", value)
    writer.add_float32("qwen2.rope.freq_base", 1e6)
    writer.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-6)

    def blocks(kind: str, n: int, d: int):
        size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
        data = rng.integers(0, 256, (n, d // 256, size), dtype=np.uint8)
        low = {"Q4_K": 1e-4, "Q6_K": 1e-5}[kind]  # weights of ~0.02: activations that neither vanish nor explode
        for at in {"Q4_K": (0, 2), "Q6_K": (208,)}[kind]:
            data[:, :, at : at + 2] = rng.uniform(low, 3 * low, (n, d // 256)).astype(np.float16)[..., None].view(np.uint8)
        writer.add_tensor(name, data.reshape(n, -1), raw_dtype=gguf.GGMLQuantizationType[kind])  # (its shape in bytes)

    def vector(n: int, scale: float = 1.0, offset: float = 0.0):
        writer.add_tensor(name, (offset + scale * rng.standard_normal(n)).astype(np.float32))

    name = "token_embd.weight"
    embed = (embed_scale * rng.standard_normal((V, D))).astype(np.float32)
    writer.add_tensor(name, gguf.quants.quantize(embed, gguf.GGMLQuantizationType[embed_type]), raw_dtype=gguf.GGMLQuantizationType[embed_type])
    for i in range(layers):
        for part, kind, n, d in (("attn_q", "Q4_K", H * hd, D), ("attn_k", "Q4_K", Hkv * hd, D), ("attn_v", "Q6_K", Hkv * hd, D),
                                 ("attn_output", "Q4_K", D, H * hd), ("ffn_gate", "Q4_K", I, D), ("ffn_up", "Q4_K", I, D),
                                 ("ffn_down", "Q6_K", D, I)):
            name = f"blk.{i}.{part}.weight"
            blocks(kind, n, d)
        for part, n in (("attn_q", H * hd), ("attn_k", Hkv * hd), ("attn_v", Hkv * hd)):
            name = f"blk.{i}.{part}.bias"
            vector(n, 0.1)
        for part in ("attn_norm", "ffn_norm"):
            name = f"blk.{i}.{part}.weight"
            vector(D, 0.1, 1.0)
    name = "output_norm.weight"
    vector(D, 0.1, 1.0)
    if head_again:
        kind = gguf.GGMLQuantizationType[head_again]
        writer.add_tensor("output.weight", gguf.quants.quantize(embed, kind), raw_dtype=kind)
    elif not tied:
        name = "output.weight"
        blocks("Q6_K", V, D)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tied", [False, True], ids=["Q6_K head", "tied Q8_0 embedding"])
def test_a_k_quant_file_whose_v_differs_in_type_runs_in_c_as_in_pytorch(tmp_path, tied):
    """Q4_K Q and K beside a Q6_K V: one stacked matrix read where the file keeps it (no fused copy). The C layer
    gives PyTorch's layer within float32 rounding (the same gguf_linear products), and both are the dequantised
    float32 model within the rounding of x to int8."""
    write_k_quant_qwen2(tmp_path / "k.gguf", tied=tied)
    runner = load_runner(tmp_path / "k.gguf")
    qkv = runner.blocks[0].qkv_w
    assert isinstance(qkv, GGUFStack) and [p.type for p in qkv.parts] == ["Q4_K", "Q4_K", "Q6_K"]
    assert runner.head_w.type == ("Q8_0" if tied else "Q6_K")
    ids = [3, 17, 42, 5, 88, 1, 60, 9]
    in_c = logits(runner, ids)
    assert runner._fused is not None and all(L is not None for L in runner._fused)
    smallbatch.layers_enabled = False
    try:
        in_pytorch = logits(runner, ids)
    finally:
        smallbatch.layers_enabled = True
    scale = in_c.abs().max()
    assert (in_c - in_pytorch).abs().max() <= 1e-4 * scale
    dense = runner.with_weights(lambda w: w.float())
    assert (in_c - logits(dense, ids)).abs().max() <= 0.05 * scale  # seen: ~1% (x rounded to 8 bits, 2 layers)


@pytest.mark.parametrize("tied", [False, True], ids=["Q6_K head", "tied Q8_0 embedding"])
def test_a_forward_in_one_c_call_gives_the_step_s_logits_and_features_to_the_bit(tmp_path, tied):
    """forward_into (embedding rows to logits in one call) against embed, run and logits called one by one: the same
    logits (of the last `keep` positions), last-layer outputs and cache entries, for a prompt and then 1-16 positions after
    it."""
    write_k_quant_qwen2(tmp_path / "k.gguf", tied=tied)
    runner = load_runner(tmp_path / "k.gguf")
    one_call, by_parts = runner.new_cache(), runner.new_cache()
    ids = [3, 17, 42, 5, 88, 1, 60, 9, 4, 11, 23, 2, 71, 6, 30, 8]
    past = 0
    for n in [7, 1, 2, 5, 16]:
        feed = ids[:n]
        hidden = torch.full((n, runner.norm_w.shape[0]), float("nan"))
        keep = max(n // 2, 1)
        got = runner.forward_into(feed, one_call, past, keep, hidden)
        with torch.inference_mode():
            want_hidden = runner.run(runner.embed(feed), range(runner.n_layers), by_parts, past)  # [1, n, D]
            want = runner.logits(want_hidden[:, -keep:])
        assert got is not None and torch.equal(got, want) and torch.equal(hidden, want_hidden[0])
        assert torch.equal(runner.forward_into(feed[:1], runner.new_cache(), 0, 1, hidden[:1].clone()),
                           runner.forward(feed[:1], range(runner.n_layers), runner.new_cache(), 0))
        past += n
        assert one_call.lengths == by_parts.lengths == [past] * runner.n_layers
        for i in range(runner.n_layers):
            assert torch.equal(one_call.keys[i][:, :, :past], by_parts.keys[i][:, :, :past])
            assert torch.equal(one_call.values[i][:, :, :past], by_parts.values[i][:, :, :past])
    assert runner.forward_into(ids[:2], one_call, past, 1, torch.empty(runner.norm_w.shape[0], 2).t()) is None  # strided rows


def test_a_file_s_runner_keeps_k_and_v_in_float16_rounded_as_torch_rounds_them(tmp_path):
    """On a file's blocks the cache is float16: the C layer writes each key and value rounded to nearest even (layer
    0's entries are the float32 cache's, converted by torch, to the bit) and attention reads them back widened, the
    position's own included. The logits move by what any perturbation moves them: x's rounding to int8 turns a change
    in the last bit into a change of an int8 step."""
    from specchat.engine.cache import KVCache

    write_k_quant_qwen2(tmp_path / "k.gguf", tied=True)
    runner = load_runner(tmp_path / "k.gguf")
    half = runner.new_cache()
    full = KVCache(runner.n_layers, runner.n_kv_heads, runner.head_dim, torch.float32, runner.device)
    assert half.dtype == torch.float16
    ids = [3, 17, 42, 5, 88, 1, 60, 9, 4, 11]
    with torch.inference_mode():
        got = runner.step(ids, half, 0, keep=len(ids))
        want = runner.step(ids, full, 0, keep=len(ids))
    n = len(ids)
    assert torch.equal(half.keys[0][:, :, :n], full.keys[0][:, :, :n].to(torch.float16))
    assert torch.equal(half.values[0][:, :, :n], full.values[0][:, :, :n].to(torch.float16))
    scale = want.abs().max()
    assert 0 < (got - want).abs().max() <= 0.1 * scale
    smallbatch.layers_enabled = False  # PyTorch's layers read the same cache the same way
    try:
        with torch.inference_mode():
            in_pytorch = runner.step(ids, runner.new_cache(), 0, keep=n)
    finally:
        smallbatch.layers_enabled = True
    assert (got - in_pytorch).abs().max() <= 0.1 * scale


F16_WITHOUT_F16C = """
import pathlib, sys, torch
sys.path[:0] = [sys.argv[2], str(pathlib.Path(sys.argv[2]).parent)]  # the test's folder and tests/ (support)
from specchat.engine import smallbatch
smallbatch.FLAGS[1] = "-march=x86-64"  # no F16C: the C code's own rounding to float16
assert smallbatch.load(pathlib.Path(sys.argv[1]))
from test_gguf_model import write_k_quant_qwen2
from specchat.engine.cache import KVCache
from specchat.engine.gguf_model import load_runner
write_k_quant_qwen2(pathlib.Path(sys.argv[1]) / "k.gguf", tied=True)
runner = load_runner(pathlib.Path(sys.argv[1]) / "k.gguf")
half = runner.new_cache()
full = KVCache(runner.n_layers, runner.n_kv_heads, runner.head_dim, torch.float32, runner.device)
with torch.inference_mode():
    runner.step(list(range(5, 45)), half, 0, keep=1)
    runner.step(list(range(5, 45)), full, 0, keep=1)
k, v = full.keys[0][:, :, :40], full.values[0][:, :, :40]
assert torch.equal(half.keys[0][:, :, :40], k.to(torch.float16)) and torch.equal(half.values[0][:, :, :40], v.to(torch.float16))
print("ok")
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64", reason="a build without F16C is an x86 build")
def test_a_build_without_f16c_rounds_k_and_v_to_float16_as_torch_does(tmp_path):
    """The C code's own rounding to float16 (CPUs without F16C) gives torch's bits on a layer's keys and values."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", F16_WITHOUT_F16C, str(tmp_path), str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_a_decode_step_s_embedding_row_is_the_file_s_dequantised_once_and_the_caller_s_to_change(tmp_path, monkeypatch):
    """Up to 16 ids (a decode step, a verify) the rows come from the runner's own dequantised copies: the gguf
    package's rows to the bit, a fresh tensor each call, and the copies dropped past EMBEDDED_FLOATS; longer inputs
    (a prompt) take the package's call, with the same rows."""
    from specchat.engine import runner as runner_module

    write_k_quant_qwen2(tmp_path / "k.gguf", tied=True)
    runner = load_runner(tmp_path / "k.gguf")
    want = runner.embed_w.rows(torch.tensor([7]))[None]  # [1, 1, D]
    with torch.inference_mode():
        runner.embed([7]).fill_(0.0)
    assert torch.equal(runner.embed([7]), want) and torch.equal(runner.embed([3, 7])[:, 1:], want)
    monkeypatch.setattr(runner_module, "EMBEDDED_FLOATS", 2 * runner.embed_w.shape[1])
    for i in range(5):
        assert torch.equal(runner.embed([i]), runner.embed_w.rows(torch.tensor([i]))[None])
    assert len(runner._embedded) <= 2
    with torch.inference_mode():
        runner.embed([7, 3]).fill_(0.0)
    ids = [3, 7, 7, 1, 9]
    assert torch.equal(runner.embed(ids), runner.embed_w.rows(torch.tensor([ids]))[None])
    long = list(range(20))
    assert torch.equal(runner.embed(long), torch.cat([runner.embed([i]) for i in long], dim=1))
    assert len(runner._embedded) <= 2


def test_a_file_the_runner_does_not_read_is_refused_in_one_line(tmp_path):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(Unreadable, match="gpt2 model; the lean runner reads llama, qwen2, qwen3"):
        load_runner(path)
    write_k_quant_qwen2(tmp_path / "k.gguf", tied=True)
    data = bytearray((tmp_path / "k.gguf").read_bytes())
    from specchat.engine import gguf_header

    info = gguf_header.read(tmp_path / "k.gguf")
    at = data.find(b"blk.0.ffn_up.weight")  # its tensor info: name, dims, shape, then the type
    type_at = at + len(b"blk.0.ffn_up.weight") + 4 + 8 * len(info.tensors["blk.0.ffn_up.weight"].shape)
    data[type_at : type_at + 4] = (11).to_bytes(4, "little")  # Q3_K, a type the kernel does not take
    (tmp_path / "q3.gguf").write_bytes(bytes(data))
    with pytest.raises(Unreadable, match="ffn_up.weight is Q3_K; the lean runner reads"):
        load_runner(tmp_path / "q3.gguf")


# ---------------------------------------------------------------- exactness on a runner read in place


def test_greedy_drafting_on_a_k_quant_file_gives_plain_greedy_decoding_s_tokens(tmp_path):
    """The target with no HF model behind it (TargetState.on_runner): suffix drafts of a repeated sequence, and a draft
    model read in place (ModelDrafter.on_runner; here the file itself, so every draft is the target's own choice),
    verified in batches of up to 5 positions, give the tokens of plain greedy decoding, one position at a time."""
    from support.exact import run
    from specchat.engine.drafters import build_drafter
    from specchat.engine.drafters.model import ModelDrafter
    from specchat.engine.sampling import SamplingParams
    from specchat.engine.target import TargetState

    write_k_quant_qwen2(tmp_path / "k.gguf", tied=False)
    runner = load_runner(tmp_path / "k.gguf")
    prompt = [5, 9, 14, 3, 27, 5, 9, 14, 3, 27, 5, 9, 14]
    replies = {}
    for mode in ("off", "suffix", "draft"):
        state = TargetState.on_runner(runner, context_len=512)
        assert state.runner == "lean" and state.kernel == "blocks"
        drafter = ModelDrafter.on_runner(load_runner(tmp_path / "k.gguf")) if mode == "draft" else build_drafter(mode, None)
        replies[mode], records = run(None, drafter, prompt, k=4, params=SamplingParams(0.0), max_new_tokens=40, state=state)
        if mode != "off":
            assert sum(r.drafted for r in records) > 0
        if mode == "draft":
            assert sum(r.accepted for r in records) == sum(r.drafted for r in records)
    assert replies["suffix"] == replies["off"] == replies["draft"]


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "q at the wrong temperature from position 3 (control)"])
@pytest.mark.slow
def test_sampled_output_on_a_file_read_in_place_follows_its_own_distribution(tmp_path, broken):
    """A tiny Llama written with Q5_0 matrices and read in place, drafted by a bigram table with a q of its own (K=3,
    draws of K+1 tokens), position by position against the file's runner's exact conditionals: the exact rule
    passes; a q reported at the wrong temperature from draft position 3 fails there."""
    from support.gguf import write_gguf
    from support.models import tiny_llama
    from specchat.engine.target import TargetState
    from test_gguf_kernel import assert_follows_the_runner

    model = tiny_llama(seed=3, layers=2, hidden_size=64, intermediate_size=64, sharpen=2.0).requires_grad_(False)
    runner = load_runner(write_gguf(model, tmp_path / "q5.gguf", matrices="Q5_0"))
    assert isinstance(runner.blocks[0].qkv_w, GGUFStack) and runner.head_w.type == "Q5_0"
    state = TargetState.on_runner(runner, context_len=model.config.max_position_embeddings)
    assert_follows_the_runner(state, runner, model, broken)


@pytest.mark.parametrize("embed_type, head, lighter", [
    ("Q4_0", "Q8_0", True), ("Q8_0", "Q4_0", False), ("Q4_0", "random Q6_K", False), ("Q8_0", "tied", False),
], ids=["the matrix twice, the embedding smaller", "the matrix twice, the head smaller", "two matrices", "tied"])
def test_a_draft_reads_its_lm_head_from_the_embedding_where_the_file_holds_that_matrix_twice_in_fewer_bytes(
        tmp_path, embed_type, head, lighter):
    """A Q4_K_M file of a tied model holds the embedding twice (token_embd and a higher-precision output.weight): a
    draft step streams the smaller (Qwen2.5 0.5B: Q5_0 instead of Q8_0); the target keeps the file's head, and an
    embedding only looked up is not interleaved (no copy). Two different matrices, or a smaller head, change nothing."""
    from specchat.engine.gguf_model import draft_runner

    again = head.split()[0] if head.startswith("Q") else None
    write_k_quant_qwen2(tmp_path / "k.gguf", tied=head == "tied", embed_type=embed_type, head_again=again)
    runner = load_runner(tmp_path / "k.gguf")
    assert runner.head_w.type == {"tied": embed_type, "random Q6_K": "Q6_K"}.get(head, head)
    assert (runner.embed_w.interleaved is None) == (head != "tied")  # looked up only: the file's blocks, no copy
    draft = draft_runner(runner)
    assert draft_runner(runner) is draft  # the embedding interleaved once a runner
    if not lighter:
        assert draft is runner
        return
    assert draft.head_w.type == embed_type and draft.head_w.interleaved is not None and draft.blocks is runner.blocks
    ids = [3, 17, 42, 5, 88, 1, 60, 9]
    target, drafted = logits(runner, ids), logits(draft, ids)
    assert not torch.equal(target, drafted)  # another model...
    assert (target - drafted).abs().max() <= 0.1 * target.abs().max()  # ...of one matrix (seen: ~3%)


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "q at the wrong temperature from position 3 (control)"])
@pytest.mark.slow
def test_a_draft_on_its_embedding_as_head_gives_greedy_tokens_and_follows_the_target_s_distribution(tmp_path, broken):
    """Mode draft with a file that holds its embedding twice as its own draft (so the draft reads the Q4_0 embedding
    as its head, the target the Q8_0 output.weight): greedy tokens of plain decoding, with rejections; sampled
    draws of 4 tokens follow the target's conditionals; the control (a q reported at the wrong temperature) fails."""
    from types import SimpleNamespace

    from test_gguf_kernel import assert_follows_the_runner
    from support.exact import run
    from specchat.engine.drafters import build_drafter
    from specchat.engine.sampling import SamplingParams
    from specchat.engine.target import TargetState

    write_k_quant_qwen2(tmp_path / "k.gguf", tied=True, embed_type="Q4_0", head_again="Q8_0", embed_scale=0.1)
    runner = load_runner(tmp_path / "k.gguf")
    target = SimpleNamespace(engine="lean", runner=runner)
    drafter = build_drafter("draft", target, SimpleNamespace(engine="lean", runner=load_runner(tmp_path / "k.gguf")))
    assert drafter.lean.head_w.type == "Q4_0" and runner.head_w.type == "Q8_0"
    if not broken:
        replies = {}
        for mode, source in (("off", build_drafter("off", target)), ("draft", drafter)):
            replies[mode], records = run(None, source, [1, 2, 3], k=3, params=SamplingParams(0.0), max_new_tokens=40,
                                         state=TargetState.on_runner(runner, None))
        assert replies["draft"] == replies["off"]
        kinds = {t.kind for r in records for t in r.tokens}
        assert {"accepted", "resampled"} <= kinds  # drafts kept and drafts rejected: the two heads differ
    drafter.reset()
    assert_follows_the_runner(TargetState.on_runner(runner, None), runner, None, broken, drafter=drafter)


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "q at the wrong temperature from position 3 (control)"])
@pytest.mark.slow
def test_a_draft_file_s_restricted_vocabulary_scores_its_lowest_ids_and_end_ids_as_the_whole_head_does(tmp_path, broken):
    """`--draft-vocab 61` on a draft read in place: its LM head is the file's first 61 rows (a view of the interleaved
    copy, its last group of 16 rows only partly asked for) and the end id 90 (a copy): those logits are the full
    head's to the bit, the others -inf; greedy gives plain decoding's tokens, sampled draws of 4 tokens follow the
    target's conditionals; the control (a q reported at the wrong temperature) fails."""
    from types import SimpleNamespace

    from test_gguf_kernel import assert_follows_the_runner
    from support.exact import run
    from specchat.engine.drafters import build_drafter
    from specchat.engine.sampling import SamplingParams
    from specchat.engine.target import TargetState

    write_k_quant_qwen2(tmp_path / "k.gguf", tied=True, embed_type="Q4_0", embed_scale=0.1)
    runner = load_runner(tmp_path / "k.gguf")
    target = SimpleNamespace(engine="lean", runner=runner)
    draft = SimpleNamespace(engine="lean", runner=load_runner(tmp_path / "k.gguf"), eos_ids={90, 5})
    drafter = build_drafter("draft", target, draft, draft_vocab=61)
    assert drafter.vocab_ids.tolist() == [*range(61), 90]  # 5 is among the lowest ids already
    head = drafter.lean.head_w
    assert isinstance(head, GGUFStack) and head.parts[0].interleaved.data_ptr() == draft.runner.head_w.interleaved.data_ptr()
    if not broken:
        whole = build_drafter("draft", target, draft)
        feed = [3, 17, 42, 5, 88]
        full, part = whole.next_logits(feed, 96), drafter.next_logits(feed, 96)
        outside = torch.ones(96, dtype=torch.bool).index_fill_(0, drafter.vocab_ids, False)
        assert torch.equal(part[drafter.vocab_ids], full[drafter.vocab_ids]) and (part[outside] == -torch.inf).all()
        drafter.reset()
        replies = {}
        for mode, source in (("off", build_drafter("off", target)), ("draft", drafter)):
            replies[mode], records = run(None, source, [1, 2, 3], k=3, params=SamplingParams(0.0), max_new_tokens=40,
                                         state=TargetState.on_runner(runner, None))
        assert replies["draft"] == replies["off"] and sum(r.accepted for r in records) > 0
        drafter.reset()
    assert_follows_the_runner(TargetState.on_runner(runner, None), runner, None, broken, drafter=drafter)
