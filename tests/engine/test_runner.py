"""The lean target runner (engine/runner.py): the same logits as HF's forward for every family it covers
(prefill, one-token steps, multi-token verifies after rollbacks), greedy identity with HF generate through
the loop, no second copy of the weights, the one-forward prefill, and the HF fallback for the rest."""

import platform
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from support.models import counting, tiny_llama
from specchat.engine import smallbatch
from specchat.engine.cache import KVCache, forward_logits, new_cache
from specchat.engine.drafters import build_drafter
from specchat.engine.drafters.model import ModelDrafter
from specchat.engine.drafters.plain import PlainDecoding
from specchat.engine.loop import Controls, generate
from specchat.engine.runner import lean_runner, unsupported
from specchat.engine.sampling import SamplingParams
from specchat.engine.smallbatch import Int8Weights, draft_weights
from specchat.engine.target import TargetState

VOCAB = 32
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "llama3-rope": (LlamaConfig, LlamaForCausalLM, {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # q/k/v biases
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),  # q/k norms, head_dim != hidden / heads
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}
CASES = [(f, tie) for f in FAMILIES for tie in (False, True)]


def tiny(family: str, tie: bool, seed: int = 0, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    settings = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
                    pad_token_id=None, tie_word_embeddings=tie, initializer_range=0.1)
    config = config_cls(**{**settings, **extra, **overrides})
    model = model_cls(config).eval().requires_grad_(False)
    if family == "qwen2":
        with torch.no_grad():  # random biases (HF initialises them to zero), so they are really exercised
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    return model


def hf_logits(model, ids, keep):
    return forward_logits(model, new_cache(model), ids, keep=keep)


@pytest.mark.parametrize("family,tie", CASES)
def test_runner_matches_hf_forward_through_rollbacks(family, tie):
    model = tiny(family, tie)
    assert unsupported(model) is None
    runner = lean_runner(model)
    cache = runner.new_cache()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(VOCAB, (20,), generator=g).tolist()
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runner.step(ids, cache, 0, keep=20), hf_logits(model, ids, 20), **close)  # prefill, every position
    for _ in range(6):  # one-token steps
        t = int(torch.randint(VOCAB, (1,), generator=g))
        torch.testing.assert_close(runner.step([t], cache, len(ids), keep=1), hf_logits(model, ids + [t], 1), **close)
        ids.append(t)
    rng = random.Random(0)
    for _ in range(12):  # roll back to a shorter length, then feed K+1 different tokens
        keep_len = rng.randrange(len(ids) - 8, len(ids) + 1)
        cache.crop(keep_len)
        new = [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 7))]
        ids = ids[:keep_len] + new
        assert cache.get_seq_length() == keep_len
        torch.testing.assert_close(runner.step(new, cache, keep_len, keep=len(new)), hf_logits(model, ids, len(new)), **close)
        assert {layer.get_seq_length() for layer in cache.layers} == {len(ids)}


@pytest.mark.parametrize("family,tie", CASES)
def test_target_state_verifies_like_the_hf_path(family, tie):
    """Random rounds of drafts, accepted prefixes and rollbacks: the lean state's verify logits equal the HF state's."""
    model = tiny(family, tie)
    lean, hf = TargetState(model), TargetState(model, runner="hf")
    assert (lean.runner, hf.runner) == ("lean", "hf")
    rng = random.Random(1)
    prompt = [rng.randrange(VOCAB) for _ in range(9)]
    lean.start(prompt)
    hf.start(prompt)
    while len(lean.tokens) < 120:
        drafts = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 6))]
        a, b = lean.verify(drafts), hf.verify(drafts)
        assert a.shape == (len(drafts) + 1, VOCAB)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        new = drafts[: rng.randrange(len(drafts) + 1)] + [rng.randrange(VOCAB)]
        lean.commit(new)
        hf.commit(new)
        assert lean.cache.get_seq_length() == len(lean.tokens) - 1
    torch.testing.assert_close(lean.verify([])[-1], hf_logits(model, lean.tokens, 1)[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_identity_with_hf_generate_over_150_tokens(family):
    # a larger init than the default keeps a random model's greedy reply from collapsing into one repeated token
    model = tiny(family, tie=family == "qwen3", initializer_range=1.0 if family == "qwen3" else 0.5)
    draft = tiny("llama", tie=False, seed=5)  # a different random model: it disagrees often
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=160, min_new_tokens=160)[0, len(prompt) :].tolist()
    assert len(set(ref[-60:])) > 5  # a varied reply, not a loop
    for drafter, k in ((ModelDrafter(draft), 4), (PlainDecoding(), 1)):
        state = TargetState(model)
        assert state.runner == "lean"
        records = list(generate(state, prompt, Controls(drafter, k=k, sampling=SamplingParams(0)), max_new_tokens=160, eos_ids=set()))
        assert [t.id for r in records for t in r.tokens] == ref
        if k > 1:
            assert sum(r.drafted - r.accepted for r in records) > 0  # rejections and rollbacks happened


@pytest.mark.parametrize("family,runner", [("qwen2", "auto"), ("qwen3", "auto"), ("llama", "hf")])
def test_self_speculative_modes_on_either_path(family, runner):
    """earlyexit and layerskip run the runner's entry points on a lean state, HF's modules (Decoder) on an HF one."""
    model = tiny(family, tie=False, num_hidden_layers=4)
    prompt = [3, 1, 4, 1, 5]
    ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=60, min_new_tokens=60)[0, len(prompt) :].tolist()
    for mode, options in (("earlyexit", {"exit_layer": 2}), ("layerskip", {"skip_layers": [1]})):
        drafter = build_drafter(mode, model, **options)
        state = TargetState(model, runner=runner)
        records = list(generate(state, prompt, Controls(drafter, k=3, sampling=SamplingParams(0)), max_new_tokens=60, eos_ids=set()))
        assert [t.id for r in records for t in r.tokens] == ref, mode
        assert {layer.get_seq_length() for layer in state.cache.layers} == {len(state.tokens) - 1}
        assert isinstance(state.cache, KVCache) == (runner == "auto")


def test_no_second_copy_of_the_weights():
    """QKV and gate/up are fused into one tensor per layer; HF's parameters become views into it."""
    model = tiny("qwen2", tie=True)
    before = sum(p.numel() for p in model.parameters())
    ref = hf_logits(model, [1, 2, 3, 4], 4)
    runner = lean_runner(model)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    fused = runner.blocks[0].qkv_w
    assert attn.q_proj.weight.data_ptr() == fused.data_ptr()
    assert attn.k_proj.weight.data_ptr() == fused.data_ptr() + attn.q_proj.weight.numel() * fused.element_size()
    assert attn.v_proj.bias.untyped_storage().data_ptr() == runner.blocks[0].qkv_b.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == runner.blocks[0].gate_up_w.untyped_storage().data_ptr()
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert sum(storages.values()) == before * 4  # every parameter byte held once
    assert lean_runner(model).blocks[0].qkv_w.data_ptr() == fused.data_ptr()  # a second runner reuses the fusion
    torch.testing.assert_close(hf_logits(model, [1, 2, 3, 4], 4), ref, rtol=0, atol=0)  # the HF path reads the same weights


def test_one_forward_prefill():
    """The prefill feeds the whole prompt and keeps its last logits: plain decoding's first token needs no
    forward, and the first verify of K drafts feeds K positions only."""
    model = tiny("llama", tie=False)
    state = TargetState(model)
    fed = counting(state)
    prompt = [5, 6, 7, 8, 9]
    assert state.start(prompt) == 5 and fed == [5] and state.past == 5
    torch.testing.assert_close(state.verify([]), hf_logits(model, prompt, 1), rtol=1e-5, atol=1e-5)
    assert fed == [5]  # no forward for the first plain step
    torch.testing.assert_close(state.verify([1, 2, 3]), hf_logits(model, prompt + [1, 2, 3], 4), rtol=1e-5, atol=1e-5)
    assert fed == [5, 3]
    state.commit([1, 4])
    assert state.head is None and state.cache.get_seq_length() == len(state.tokens) - 1 == 6
    # a second turn reuses the cached prefix and prefills the rest in one forward
    assert state.start(state.tokens + [2, 2]) == 3 and fed[-1] == 3
    # a prompt the cache already covers but its last token: nothing runs, that token stays pending
    state.commit([4])
    n_forwards = len(fed)
    assert state.start(list(state.tokens)) == 0 and state.head is None and len(fed) == n_forwards
    torch.testing.assert_close(state.verify([]), hf_logits(model, state.tokens, 1), rtol=1e-5, atol=1e-5)


def test_cache_grows_in_chunks_without_copies_per_step():
    model = tiny("llama", tie=False)
    runner = lean_runner(model)
    cache = runner.new_cache()
    runner.step([1] * 10, cache, 0, keep=1)
    storage = cache.keys[0].data_ptr()
    for i in range(100):
        runner.step([2], cache, 10 + i, keep=1)
    assert cache.keys[0].data_ptr() == storage  # same allocation: written in place
    cache.crop(3)
    assert cache.get_seq_length() == 3 and cache.keys[0].data_ptr() == storage
    with pytest.raises(ValueError):
        cache.write(0, cache.keys[0][:, :, :1], cache.values[0][:, :, :1], 7)  # a gap would leave garbage


def test_sliding_window_and_other_architectures_fall_back_to_hf():
    mistral = tiny("mistral", tie=False, sliding_window=64)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=128)).eval()
    prompt = [3, 1, 4, 1, 5]
    for model in (mistral, gpt2):
        assert unsupported(model) is not None and lean_runner(model) is None
        ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40, min_new_tokens=40)[0, len(prompt) :].tolist()
        state = TargetState(model)
        assert state.runner == "hf"
        draft = ModelDrafter(tiny_llama(seed=1, vocab=VOCAB))
        records = list(generate(state, prompt, Controls(draft, k=3, sampling=SamplingParams(0)), max_new_tokens=40, eos_ids=set()))
        assert [t.id for r in records for t in r.tokens] == ref
    with pytest.raises(ValueError, match="lean runner"):
        TargetState(gpt2, runner="lean")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_bf16_matches_hf_forward(family):
    """HF normalises in float32 and casts back; the runner does the same (measured bit-identical here)."""
    model = tiny(family, tie=False).to(torch.bfloat16)
    runner = lean_runner(model)
    cache = runner.new_cache()
    ids = [5, 3, 9, 1, 4, 1, 5, 9, 2, 6]
    out = runner.step(ids, cache, 0, keep=len(ids))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, hf_logits(model, ids, len(ids)), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(runner.step([7, 8], cache, len(ids), keep=2), hf_logits(model, ids + [7, 8], 2), rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------- the C decoder layer (smallbatch.layer)

needs_c_layer = pytest.mark.skipif(not smallbatch.layer_usable(), reason="the fused kernel is not built here")
WEIGHTS = {"float32": lambda w: w, "bfloat16": draft_weights, "int8": Int8Weights.of}


def run_both(monkeypatch, runner, ids, past, rows):
    """(logits, keys, values) of `rows` positions fed after `past`, with the C layer and with PyTorch's."""
    out = {}
    for fused in (True, False):
        monkeypatch.setattr(smallbatch, "layers_enabled", fused)
        cache = runner.new_cache()
        if past:
            runner.step(ids[:past], cache, 0, keep=1)
        logits = runner.step(ids[past : past + rows], cache, past, keep=rows)
        end = past + rows
        out[fused] = logits, [k[:, :, :end] for k in cache.keys], [v[:, :, :end] for v in cache.values]
    return out[True], out[False]


@needs_c_layer
@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("family", [*FAMILIES, "qwen3-hd64"])
def test_the_c_layer_computes_what_pytorchs_layer_does(monkeypatch, family, weights):
    """Logits and the K/V written, for 1, 3 and 16 rows after no past, after 37 positions (a prefill PyTorch runs:
    more than 16 rows) and 1 or 5 rows after 150 (a longer context, as a chat's later turns have), within float32
    rounding, for every family (biases, q/k norms, a head_dim of its own) and every kind of weight a draft keeps. The
    tiny models' heads (8 or 16 wide) take the C code's scalar tails; heads of 64, like the default model's, take its
    vector loops."""
    model = tiny("qwen3", tie=False, head_dim=64) if family == "qwen3-hd64" else tiny(family, tie=False)
    runner = lean_runner(model)
    runner = runner.with_weights(WEIGHTS[weights]) if weights != "float32" else runner
    with torch.inference_mode():
        assert all(runner._fused_layers(torch.zeros(1, 1, 32), runner.new_cache()))  # every layer runs in C
    rng = random.Random(3)
    ids = [rng.randrange(VOCAB) for _ in range(170)]
    for past, rows in ((0, 1), (0, 16), (37, 1), (37, 3), (37, 16), (150, 1), (150, 5)):
        fused, torch_layer = run_both(monkeypatch, runner, ids, past, rows)
        for a, b in zip(fused, torch_layer):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@needs_c_layer
@pytest.mark.parametrize("head_dim", [16, 24, 64])
def test_a_c_layer_row_does_not_depend_on_the_rows_fed_with_it_or_the_threads(head_dim):
    """Bit for bit: a verify's row is what a one-position step gives (greedy identity rests on it), though a verify's
    positions share their passes over the keys and values; heads of 16 take the values' scalar tails, 24 (not a
    multiple of AVX-512's 16 lanes) a dot product a key, 64 the vector loops."""
    runner = lean_runner(tiny("qwen3", tie=False, head_dim=head_dim))
    rng = random.Random(4)
    ids = [rng.randrange(VOCAB) for _ in range(140)]
    cache = runner.new_cache()
    runner.step(ids[:120], cache, 0, keep=1)  # a longer context than one vector loop's keys
    many = runner.step(ids[120:136], cache, 120, keep=16)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            cache.crop(120)
            one = torch.cat([runner.step([ids[j]], cache, j, keep=1) for j in range(120, 136)])
            assert torch.equal(many, one)
    finally:
        torch.set_num_threads(threads)


@needs_c_layer
def test_pytorch_runs_what_the_c_layer_does_not_take(monkeypatch):
    """More than 16 rows, a batch of rows, or a layer whose MLP a draft replaced (lowrank) runs PyTorch's layer."""
    runner = lean_runner(tiny("llama", tie=False))
    calls = []
    monkeypatch.setattr(smallbatch, "layer", lambda *args: calls.append(args))
    monkeypatch.setattr(smallbatch, "layers", lambda *args: calls.append(args))
    cache = runner.new_cache()
    runner.step(list(range(17)), cache, 0, keep=1)
    assert calls == []
    other = runner.with_mlps({1: torch.nn.Identity()})
    with torch.inference_mode():
        assert runner._fused_layers(torch.zeros(2, 1, 32), runner.new_cache(rows=2)) is None
        assert [L is None for L in other._fused_layers(torch.zeros(1, 1, 32), other.new_cache())] == [False, True, False]
    assert runner._fused_layers(torch.zeros(1, 1, 32), runner.new_cache()) is None  # training: autograd needs PyTorch


LAYER_BUILT_FOR = """
import pathlib, random, sys, torch
sys.path[:0] = [sys.argv[3], str(pathlib.Path(sys.argv[3]).parent)]  # the test's folder and tests/ (support)
from specchat.engine import smallbatch
smallbatch.FLAGS[1] = sys.argv[1]
assert smallbatch.load(pathlib.Path(sys.argv[2])) and smallbatch.layer_usable()
from test_runner import VOCAB, WEIGHTS, tiny
from specchat.engine.runner import lean_runner
rng = random.Random(3)
ids = [rng.randrange(VOCAB) for _ in range(170)]
with torch.inference_mode():
    for kind, convert in WEIGHTS.items():
        runner = lean_runner(tiny("qwen3", tie=False, head_dim=64)).with_weights(convert)
        for past, rows in ((0, 16), (37, 1), (37, 3), (37, 16), (150, 5)):
            out = {}
            for fused in (True, False):
                smallbatch.layers_enabled = fused
                cache = runner.new_cache()
                if past:
                    runner.step(ids[:past], cache, 0, keep=1)
                out[fused] = runner.step(ids[past : past + rows], cache, past, keep=rows)
            torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-5)
        smallbatch.layers_enabled = True
        cache = runner.new_cache()
        runner.step(ids[:120], cache, 0, keep=1)
        many = runner.step(ids[120:136], cache, 120, keep=16)
        cache.crop(120)
        assert torch.equal(many, torch.cat([runner.step([ids[j]], cache, j, keep=1) for j in range(120, 136)])), kind
        cache.crop(120)
        hidden = torch.empty(16, runner.norm_w.shape[0])
        assert torch.equal(runner.forward_into(ids[120:136], cache, 120, 16, hidden), many), kind  # all in one C call
from specchat.engine.sampling import tops_of
x = torch.round(torch.randn(3, 49157, generator=torch.Generator().manual_seed(3)) * 4)  # ties across the threads' parts
tops = tops_of(x, 5)
order = torch.sort(x, dim=-1, descending=True, stable=True)
assert torch.equal(tops.ids, order.indices[:, :5]) and torch.equal(tops.values, order.values[:, :5])
assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(tops.log_z, torch.logsumexp(x.double(), -1).tolist()))
print("ok")
"""


@needs_c_layer
@pytest.mark.skipif(platform.machine() != "x86_64", reason="AVX2 without AVX-512 is an x86 build")
@pytest.mark.slow
def test_the_c_layer_built_for_avx2_only(tmp_path):
    """The same checks on a build for a CPU with AVX2 and no AVX-512 (-march=znver2, as an AMD machine builds it:
    8 lanes, the generic lane sum), which this machine's own build never takes; and its top lists of a round."""
    run = subprocess.run([sys.executable, "-c", LAYER_BUILT_FOR, "-march=znver2", str(tmp_path), str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
