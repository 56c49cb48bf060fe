"""The self-speculative drafters unit by unit on tiny models: layers.py (Decoder, the byte counts, which layer
path), layerskip.py, earlyexit.py and lowrank.py. References are independent of the code under test: HF's own
forward on a copy of the target whose skipped (or later) layers are replaced by the identity, hand-worked masks,
byte counts and ranks, the optimal low-rank error from singular values. No sampling loop runs; the whole file
takes a few seconds."""

from __future__ import annotations

import copy

import pytest
import torch

from support.models import tiny_llama
from specchat.engine.cache import KVCache, new_cache
from specchat.engine.drafters import ModeUnavailable, build_drafter
from specchat.engine.drafters import lowrank
from specchat.engine.drafters.earlyexit import EarlyExitDrafter, builtin_exit
from specchat.engine.drafters.layers import Decoder, cache_bytes, layer_runner, weight_bytes
from specchat.engine.drafters.layerskip import LayerSkipDrafter, builtin_skip, check_skip
from specchat.engine.runner import Runner
from specchat.engine.sampling import SamplingParams
from specchat.engine.target import TargetState

PROMPT = [3, 1, 4, 1, 5]
T1 = SamplingParams(1.0)


@pytest.fixture(scope="module")
def target():
    """Four layers with a larger init, so that every layer changes the logits."""
    return tiny_llama(seed=0, layers=4, initializer_range=0.2).requires_grad_(False)


class Identity(torch.nn.Module):
    def forward(self, hidden, *args, **kwargs):
        return hidden


def without_layers(model, dropped):
    """`model` with the layers in `dropped` replaced by the identity (an independent reference for a skip)."""
    ref = copy.deepcopy(model)
    for i in dropped:
        ref.model.layers[i] = Identity()
    return ref


def ref_logits(model, ids) -> torch.Tensor:
    """HF's forward over the whole sequence, no cache: logits of the last position [V]."""
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0, -1]


def other_family(kind, **extra):
    from transformers import (MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
                             "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[kind]
    torch.manual_seed(0)
    options = dict(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=False)
    if kind == "mistral":
        options["sliding_window"] = None
    return model_cls(config_cls(**{**options, **extra})).eval().requires_grad_(False)


def hf_only(model):
    """A copy the lean runner refuses (a Linear subclass in its MLP) but Decoder takes."""
    class Patched(torch.nn.Linear):
        pass

    other = copy.deepcopy(model)
    for layer in other.model.layers:
        old = layer.mlp.gate_proj
        new = Patched(old.in_features, old.out_features, bias=False)
        new.weight = old.weight
        layer.mlp.gate_proj = new
    return other


# ================================================================ layers.py


def test_decoder_takes_the_four_families_and_their_parts(target):
    for model in (target, other_family("qwen2"), other_family("mistral"), other_family("qwen3")):
        dec = Decoder(model)
        assert dec.model is model and dec.n_layers == len(model.model.layers)
        assert dec.embed_tokens is model.model.embed_tokens and dec.layers is model.model.layers
        assert dec.norm is model.model.norm and dec.rotary_emb is model.model.rotary_emb
        assert dec.lm_head is model.lm_head and dec.device == torch.device("cpu")


def test_decoder_refuses_other_models_and_missing_parts(target):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=12, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ModeUnavailable) as e:
        Decoder(gpt2)
    assert str(e.value) == ("self-speculative modes need a Llama/Qwen2/Mistral-style decoder (model.model.layers); "
                            "GPT2LMHeadModel (gpt2) is not supported")
    for part in ("embed_tokens", "layers", "norm", "rotary_emb"):
        model = copy.deepcopy(target)
        setattr(model.model, part, None)
        with pytest.raises(ModeUnavailable, match="LlamaForCausalLM \\(llama\\) is not supported"):
            Decoder(model)
    model = copy.deepcopy(target)
    model.lm_head = None
    with pytest.raises(ModeUnavailable, match="not supported"):
        Decoder(model)


def test_decoder_refuses_sliding_window_attention():
    sliding = other_family("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert "sliding_attention" in sliding.config.layer_types
    with pytest.raises(ModeUnavailable) as e:
        Decoder(sliding)
    assert str(e.value) == "self-speculative modes do not support sliding-window attention (Qwen2ForCausalLM)"
    with pytest.raises(ModeUnavailable, match=r"sliding-window attention \(MistralForCausalLM\)"):
        Decoder(other_family("mistral", sliding_window=16))
    Decoder(other_family("mistral"))  # no window: fine
    llama = tiny_llama(seed=0, layers=1)
    llama.config.sliding_window = 16  # only Mistral's config means a window by it
    Decoder(llama)


def test_decoder_mask_is_hand_worked(target):
    dec = Decoder(target)
    assert dec.mask(1, 5, torch.float32, torch.device("cpu")) is None
    m = dec.mask(3, 2, torch.float32, torch.device("cpu"))
    low = torch.finfo(torch.float32).min
    want = torch.tensor([[0, 0, 0, low, low], [0, 0, 0, 0, low], [0, 0, 0, 0, 0]], dtype=torch.float32)
    assert m.shape == (1, 1, 3, 5) and m.dtype == torch.float32 and torch.equal(m[0, 0], want)
    m16 = dec.mask(2, 0, torch.bfloat16, torch.device("cpu"))
    assert m16.dtype == torch.bfloat16 and torch.equal(m16[0, 0], torch.tensor([[0, torch.finfo(torch.bfloat16).min], [0, 0]], dtype=torch.bfloat16))


def test_decoder_embed_step_and_forward_are_the_models_own(target):
    dec = Decoder(target)
    emb = dec.embed([3, 1, 4])
    assert emb.shape == (1, 3, 16) and torch.equal(emb[0], target.model.embed_tokens.weight[[3, 1, 4]])
    cache = dec.new_cache()
    assert type(cache).__name__ == "DynamicCache" and cache.get_seq_length() == 0
    with torch.no_grad():
        full = target(torch.tensor([PROMPT + [9, 2]]), use_cache=False).logits[0]  # [7, V]
    torch.testing.assert_close(dec.step(PROMPT, cache, 0, keep=2), full[3:5], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(dec.step([9, 2], cache, 5, keep=1), full[6:7], atol=1e-5, rtol=1e-4)
    cache = dec.new_cache()
    torch.testing.assert_close(dec.forward(PROMPT, range(4), cache, 0, keep=3), full[2:5], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(dec.forward([9, 2], range(4), cache, 5, keep=2), full[5:7], atol=1e-5, rtol=1e-4)


def test_weight_and_cache_bytes_are_hand_worked(target):
    assert weight_bytes([torch.nn.Linear(4, 3)]) == (12 + 3) * 4
    assert weight_bytes([torch.nn.Linear(4, 3, bias=False), torch.nn.LayerNorm(4)]) == (12 + 8) * 4
    assert weight_bytes([torch.nn.Linear(4, 3, bias=False).to(torch.bfloat16)]) == 12 * 2
    assert weight_bytes([]) == 0
    one = tiny_llama(seed=0, layers=2)
    cache = new_cache(one)
    assert cache_bytes(cache) == 0
    Decoder(one).step([3, 1, 4], cache, 0, keep=1)
    assert cache_bytes(cache) == 2 * 2 * (1 * 1 * 3 * 8) * 4  # 2 layers x (K, V) x [1 row, 1 KV head, 3, 8] float32
    # a cache layer that has no keys (or no values) attribute at all counts what it has
    from types import SimpleNamespace

    partial = SimpleNamespace(layers=[SimpleNamespace(keys=torch.zeros(2, 3)), SimpleNamespace(values=torch.zeros(5, dtype=torch.float16)),
                                      SimpleNamespace(keys=None, values=None)])
    assert cache_bytes(partial) == 2 * 3 * 4 + 5 * 2
    kv = KVCache(2, 1, 8, torch.float32, torch.device("cpu"))
    assert cache_bytes(kv) == kv.nbytes() == 0
    kv.write(0, torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, 8), 0)
    assert cache_bytes(kv) == kv.nbytes() > 0


def test_layer_runner_is_the_lean_runner_where_it_runs(target):
    assert isinstance(layer_runner(target), Runner)
    patched = hf_only(target)
    assert isinstance(layer_runner(patched), Decoder)
    with pytest.raises(ModeUnavailable):
        layer_runner(other_family("mistral", sliding_window=16))


# ================================================================ layerskip.py


def test_builtin_skip_is_one_layer_a_little_past_the_middle():
    assert [builtin_skip(n) for n in (0, 1, 2)] == [[], [], []]
    assert builtin_skip(3) == [1] and builtin_skip(4) == [2] and builtin_skip(5) == [2]
    assert builtin_skip(7) == [4] and builtin_skip(30) == [17]  # SmolLM2-135M: tune's best


def test_check_skip_sorts_dedups_and_refuses():
    assert check_skip([2, 0, 2], 4) == [0, 2]
    assert check_skip([0, 3], 4) == [0, 3] and check_skip([], 4) == []
    assert check_skip([0, 1, 2, 1], 4) == [0, 1, 2]  # three of four distinct: allowed
    with pytest.raises(ModeUnavailable) as e:
        check_skip([1, 4, -1], 4)
    assert str(e.value) == "--skip-layers [4, -1] out of range: the model has layers 0..3"
    with pytest.raises(ModeUnavailable) as e:
        check_skip([3, 2, 1, 0, 0], 4)
    assert str(e.value) == "--skip-layers would skip every layer"


def test_layerskip_build_defaults_and_options(target):
    d = LayerSkipDrafter.build(target)
    assert d.skip_layers == [2] and d.layer_ids == [0, 1, 3] and d.name == "layerskip"
    d = LayerSkipDrafter.build(target, skip_layers=(3, 0, 3))
    assert d.skip_layers == [0, 3] and d.layer_ids == [1, 2]
    assert isinstance(d.lean, Runner) and d.model is target and isinstance(d.decoder, Decoder)
    assert LayerSkipDrafter.build(target, skip_layers=[]).layer_ids == [0, 1, 2, 3]
    with pytest.raises(ModeUnavailable, match="out of range"):
        LayerSkipDrafter.build(target, skip_layers=[4])
    hf = LayerSkipDrafter.build(hf_only(target), skip_layers=[1])
    assert hf.lean is None


@pytest.mark.parametrize("path", ["lean", "hf"])
def test_layerskip_drafts_are_the_model_without_those_layers(target, path):
    """Each draft's q against HF's forward of a copy whose skipped layers are the identity, round after round (the
    draft cache re-synced after rejections and foreign tokens); the target cache holds every layer."""
    model = target if path == "lean" else hf_only(target)
    ref = without_layers(model, [1, 2])
    drafter = build_drafter("layerskip", model, skip_layers=[1, 2])
    assert (drafter.lean is None) == (path == "hf")
    state = TargetState(model)
    state.start(PROMPT)
    gen = torch.Generator().manual_seed(0)
    for round_ in range(4):
        proposal = drafter.propose(state, 3, T1, gen)
        assert proposal.calls == 3
        seq = list(state.tokens)
        for j in range(3):
            torch.testing.assert_close(proposal.q[j], torch.softmax(ref_logits(ref, seq), -1), atol=1e-5, rtol=1e-4)
            seq.append(int(proposal.ids[j]))
        # the verify: all layers, the target's cache, the pending token first
        logits = drafter.verify(state, proposal.ids.tolist())
        with torch.no_grad():
            full = model(torch.tensor([seq]), use_cache=False).logits[0, len(state.tokens) - 1 :]
        torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)
        accepted = proposal.ids[: round_ % 3].tolist()
        state.commit(accepted + [(round_ * 5 + 2) % 12])
    assert drafter.extra_bytes == cache_bytes(drafter.cache) > 0


def test_layerskip_verify_on_the_hf_path_after_a_prefill_is_the_states(target):
    model = hf_only(target)
    drafter = build_drafter("layerskip", model, skip_layers=[1])
    state = TargetState(model)
    state.start(PROMPT)  # the prefill leaves `head` set: the state's own verify feeds the drafts only
    assert state.head is not None
    logits = drafter.verify(state, [7, 8])
    with torch.no_grad():
        full = model(torch.tensor([PROMPT + [7, 8]]), use_cache=False).logits[0, 4:]
    torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)
    assert state.cache.get_seq_length() == 7
    state.commit([7, 6])  # the HF path without head: this drafter's own forward of every layer
    logits = drafter.verify(state, [1])
    with torch.no_grad():
        full = model(torch.tensor([PROMPT + [7, 6, 1]]), use_cache=False).logits[0, 6:]
    torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)
    assert state.cache.get_seq_length() == 8


# ================================================================ earlyexit.py


def test_builtin_exit_and_the_exit_layer_range(target):
    assert [builtin_exit(n) for n in (1, 2, 4, 30)] == [1, 1, 3, 29]
    assert EarlyExitDrafter.build(target).exit_layer == 3
    assert EarlyExitDrafter.build(target, exit_layer=1).exit_layer == 1
    for bad in (0, 4, -1):
        with pytest.raises(ModeUnavailable) as e:
            EarlyExitDrafter.build(target, exit_layer=bad)
        assert str(e.value) == f"--exit-layer must be in 1..3 for this model, got {bad}"
    d = EarlyExitDrafter.build(target, exit_layer=2)
    assert d.pending is None and d.extra_bytes == 0 and isinstance(d.decoder, Decoder) and d.name == "earlyexit"


@pytest.mark.parametrize("path", ["lean", "hf"])
def test_earlyexit_drafts_are_the_first_layers_and_the_verify_is_the_full_model(target, path):
    model = target if path == "lean" else hf_only(target)
    ref = without_layers(model, [2, 3])  # exit after layer 1: layers 0, 1, the final norm, the LM head
    drafter = EarlyExitDrafter.build(model, exit_layer=2)
    state = TargetState(model)
    assert (state.lean is None) == (path == "hf")
    state.start(PROMPT)
    gen = torch.Generator().manual_seed(0)
    for round_ in range(4):
        proposal = drafter.propose(state, 3, T1, gen)
        assert proposal.calls == 3 and len(proposal.ids) == 3
        seq = list(state.tokens)
        for j in range(3):
            torch.testing.assert_close(proposal.q[j], torch.softmax(ref_logits(ref, seq), -1), atol=1e-5, rtol=1e-4)
            seq.append(int(proposal.ids[j]))
        assert drafter.pending.state is state and drafter.pending.past == len(state.tokens) - 1
        logits = drafter.verify(state, proposal.ids.tolist())
        assert drafter.pending is None
        with torch.no_grad():
            full = model(torch.tensor([seq]), use_cache=False).logits[0, len(state.tokens) - 1 :]
        torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)
        if path == "lean":  # the target's features recorded for the draft head
            with torch.no_grad():
                feats = model.model(torch.tensor([seq]), use_cache=False).last_hidden_state[0]
            assert state.known == len(seq)
            normed = state.features[: len(seq)]
            torch.testing.assert_close(model.model.norm(normed), feats, atol=1e-4, rtol=1e-4)
        accepted = proposal.ids[: round_ % 4].tolist()
        state.commit(accepted + [(round_ * 5 + 2) % 12])


def test_earlyexit_verify_reuses_only_its_own_pending_drafts(target):
    """A verify of other drafts than proposed, of none, after a reset, or of another state's drafts: full logits."""
    drafter = EarlyExitDrafter.build(target, exit_layer=2)
    gen = torch.Generator().manual_seed(0)

    def check(state, drafts):
        logits = drafter.verify(state, drafts)
        with torch.no_grad():
            full = target(torch.tensor([state.tokens + drafts]), use_cache=False).logits[0, len(state.tokens) - 1 :]
        torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)
        assert state.cache.lengths[0] == len(state.tokens) + len(drafts)
        state.commit(drafts[:1] + [6])

    state = TargetState(target)
    state.start(PROMPT)
    p = drafter.propose(state, 3, T1, gen).ids.tolist()
    check(state, [p[0], p[1], (p[2] + 1) % 12])  # the last draft differs from the proposed one
    p = drafter.propose(state, 3, T1, gen).ids.tolist()
    check(state, [])  # K = 0 after a propose
    drafter.propose(state, 3, T1, gen)
    drafter.reset()
    assert drafter.pending is None
    check(state, [1, 2])  # nothing pending: layers < E rerun on the chunk, the cache cropped first
    other = TargetState(target)
    other.start(PROMPT + [0])
    other.verify([])
    other.commit([9])
    p = drafter.propose(other, 2, T1, gen).ids.tolist()
    drafter.propose(state, 2, T1, gen)  # now pending is for `state`
    check(other, p)  # not other's pending: recomputed
    drafter.propose(state, 2, T1, gen)
    same = drafter.pending.ids
    shorter = TargetState(target)
    shorter.start(state.tokens[:-1])
    shorter.verify([])
    shorter.commit([])
    check(shorter, list(same))  # same drafts, another state at another past


def test_earlyexit_verify_runs_only_the_last_draft_through_the_early_layers(target):
    """The point of the mode: after its own propose, the verify feeds layers < E one position (the K-th draft) and
    layers >= E the K+1 positions; without a pending propose, layers < E take the whole chunk."""
    drafter = EarlyExitDrafter.build(target, exit_layer=2)
    state = TargetState(target)
    state.start(PROMPT)
    calls = []
    real = state.lean.run  # (the C layers of one run are one call: which layers a run asks for, and how many positions)
    state.lean.run = lambda h, ids, *rest: calls.extend((i, h.shape[1]) for i in ids) or real(h, ids, *rest)
    drafts = drafter.propose(state, 3, T1, torch.Generator().manual_seed(0)).ids.tolist()
    assert calls == [(0, 1), (1, 1)] * 3  # three draft steps of layers 0, 1
    calls.clear()
    drafter.verify(state, drafts)
    assert calls == [(0, 1), (1, 1), (2, 4), (3, 4)]
    state.commit(drafts[:1] + [6])
    calls.clear()
    drafter.verify(state, [1, 2])  # nothing pending
    assert calls == [(0, 3), (1, 3), (2, 3), (3, 3)]


def test_earlyexit_samples_its_drafts_from_q_with_the_runs_generator(target):
    """Sampled drafts are draws from q (not its argmax), from the generator the run passes, whatever the global RNG."""
    drafter = EarlyExitDrafter.build(target, exit_layer=1)
    state = TargetState(target)
    state.start(PROMPT)
    gen = torch.Generator().manual_seed(0)
    q = drafter.propose(state, 1, T1, gen).q[0]
    draws = [int(drafter.propose(state, 1, T1, gen).ids[0]) for _ in range(300)]
    counts = torch.bincount(torch.tensor(draws), minlength=12).float() / 300
    assert len(set(draws)) >= 3 and float((counts - q).abs().max()) < 0.1, (counts, q)

    def drafts(global_seed):
        torch.manual_seed(global_seed)
        g = torch.Generator().manual_seed(7)
        return [drafter.propose(state, 3, T1, g).ids.tolist() for _ in range(10)]

    assert drafts(0) == drafts(1)


def test_earlyexit_after_a_prefill_and_for_another_drafters_round(target):
    drafter = EarlyExitDrafter.build(target, exit_layer=3)
    state = TargetState(target)
    state.start(PROMPT)
    assert state.head is not None
    logits = drafter.verify(state, [7])  # no propose of ours after the prefill: the state's own verify
    with torch.no_grad():
        full = target(torch.tensor([PROMPT + [7]]), use_cache=False).logits[0, 4:]
    torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)
    state.commit([7, 2])
    ref = without_layers(target, [3])
    p = drafter.propose(state, 2, SamplingParams(0), None)
    want = int(torch.argmax(ref_logits(ref, state.tokens)))
    assert p.ids[0] == want and torch.equal(p.q[0], torch.nn.functional.one_hot(torch.tensor(want), 12).float())
    empty = drafter.propose(state, 0, SamplingParams(0), None)
    assert len(empty.ids) == 0 and empty.q is None and empty.calls == 0


# ================================================================ lowrank.py


def test_low_rank_linear_is_two_thin_matmuls():
    a = torch.tensor([[1.0, 0.0], [2.0, 1.0], [0.0, -1.0]])  # [3, 2]
    b = torch.tensor([[1.0, 2.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0]])  # [2, 4]
    bias = torch.tensor([0.5, 0.0, -1.0])
    layer = lowrank.LowRankLinear(a, b, bias)
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 2.0]])
    # x B^T = [[4, 2], [4, 1]]; then A: [[4, 10, -2], [4, 9, -1]]; plus the bias
    assert torch.equal(layer(x), torch.tensor([[4.5, 10.0, -3.0], [4.5, 9.0, -2.0]]))
    assert torch.equal(lowrank.LowRankLinear(a, b, None)(x), torch.tensor([[4.0, 10.0, -2.0], [4.0, 9.0, -1.0]]))
    assert not layer.a.requires_grad and not layer.b.requires_grad and layer.bias is bias


def test_resolve_rank():
    assert lowrank.resolve_rank(0.5, (4, 6)) == 2 and lowrank.resolve_rank(0.7, (20, 10)) == 7
    assert lowrank.resolve_rank(0.5, (5, 9)) == 2  # round half to even: 2.5 -> 2
    assert lowrank.resolve_rank(0.9, (5, 9)) == 4 and lowrank.resolve_rank(0.99, (5, 9)) == 5
    assert lowrank.resolve_rank(1.0, (4, 6)) == 1  # a float >= 1 is an absolute rank
    assert lowrank.resolve_rank(3.0, (4, 6)) == 3 and lowrank.resolve_rank(3, (4, 6)) == 3
    assert lowrank.resolve_rank(4, (4, 6)) == 4 and lowrank.resolve_rank(9, (6, 4)) == 4
    assert lowrank.resolve_rank(0.01, (4, 6)) == 1 and lowrank.resolve_rank(0, (4, 6)) == 1


def test_layer_ranks():
    assert lowrank.layer_ranks(0.5, 2) == [0.5, 0.5]
    assert lowrank.layer_ranks({"1": 4, 2: 0.5}, 4) == [None, 4, 0.5, None]
    assert lowrank.layer_ranks([1, None, 3], 3) == [1, None, 3] and lowrank.layer_ranks((1, 2), 2) == [1, 2]
    with pytest.raises(ValueError) as e:
        lowrank.layer_ranks([1, 2], 3)
    assert str(e.value) == "a per-layer rank list needs 3 entries, got 2"


def test_chosen_linears(target):
    chosen = lowrank.chosen_linears(target, {0: 4, 2: 0.5}, lowrank.DEFAULT_TARGETS)
    assert sorted(chosen) == ["model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
                              "model.layers.2.mlp.down_proj", "model.layers.2.mlp.gate_proj", "model.layers.2.mlp.up_proj"]
    assert chosen["model.layers.0.mlp.gate_proj"] == (target.model.layers[0].mlp.gate_proj, 4)
    assert chosen["model.layers.2.mlp.down_proj"][1] == 8  # half of min(16, 32)
    attn = lowrank.chosen_linears(target, 4, ("q_proj", "v_proj"))
    assert sorted(attn) == [f"model.layers.{i}.self_attn.{p}" for i in range(4) for p in ("q_proj", "v_proj")]
    # a rank at full rank keeps the layer: 16 is full for gate (32x16) and down (16x32)
    assert lowrank.chosen_linears(target, 16, lowrank.DEFAULT_TARGETS) == {}
    assert sorted(lowrank.chosen_linears(target, 15, ("down_proj",))) == [f"model.layers.{i}.mlp.down_proj" for i in range(4)]


def test_chosen_linears_match_the_last_name_at_any_depth():
    """A linear is chosen by its own attribute name, whether it sits in the layer itself or deeper."""
    layer = torch.nn.Module()
    layer.gate_proj = torch.nn.Linear(16, 32, bias=False)  # a direct child: name "gate_proj"
    layer.block = torch.nn.Module()
    layer.block.inner = torch.nn.Module()
    layer.block.inner.up_proj = torch.nn.Linear(16, 32, bias=False)  # "block.inner.up_proj"
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([layer])
    chosen = lowrank.chosen_linears(model, 4, ("gate_proj", "up_proj"))
    assert chosen == {"model.layers.0.gate_proj": (layer.gate_proj, 4), "model.layers.0.block.inner.up_proj": (layer.block.inner.up_proj, 4)}


def test_factorize_does_not_depend_on_the_scale_of_the_inputs():
    """Inputs 100x larger or smaller give the same factors' product: the damping is relative to the gram's own size."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(12, 10, generator=g)
    x = torch.randn(30, 10, generator=g) * torch.logspace(-1.0, 0.5, 10)
    gram = x.T @ x / 30
    a, b = lowrank.factorize(w, 3, gram)
    for scale in (1e-4, 1e4):
        a2, b2 = lowrank.factorize(w, 3, gram * scale)
        torch.testing.assert_close(a2 @ b2, a @ b, atol=1e-3, rtol=1e-3)


def test_a_lowrank_drafter_made_directly_has_no_factors(target):
    d = lowrank.LowRankDrafter(target, rank=0.5)
    assert d.n_factored == 0 and d.weight_bytes == 0 and d.rank == 0.5 and d.lean is None


def test_factorize_reaches_the_optimal_error_on_the_inputs():
    """||(W - AB) X^T||^2 / n is the sum of the squared singular values of W X^T / sqrt(n) past the rank (the best
    any rank-r matrix can do on these inputs), with the default damping within a few percent of it."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(12, 10, generator=g)
    x = torch.randn(400, 10, generator=g) * torch.logspace(-1.0, 0.5, 10)
    n = x.shape[0]
    gram = x.T @ x / n
    s = torch.linalg.svdvals((w @ x.T).double()) / n ** 0.5
    for r in (1, 3, 6):
        optimum = float(s[r:].pow(2).sum())
        a, b = lowrank.factorize(w, r, gram, damp=0.0)
        assert a.shape == (12, r) and b.shape == (r, 10) and a.is_contiguous() and b.is_contiguous()
        err = float(((w - a @ b).double() @ x.T.double()).pow(2).sum() / n)
        assert err == pytest.approx(optimum, rel=1e-3)
        a, b = lowrank.factorize(w, r, gram)  # damp 1e-2
        err = float(((w - a @ b).double() @ x.T.double()).pow(2).sum() / n)
        assert optimum <= err * (1 + 1e-6) and err < 1.05 * optimum
    a, b = lowrank.factorize(w, 3, torch.zeros(10, 10))  # no calibration signal at all: still finite
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    a, b = lowrank.factorize(w.to(torch.bfloat16), 10, gram.double(), damp=0.0)  # any dtype in, float32 out
    assert a.dtype == b.dtype == torch.float32
    torch.testing.assert_close(a @ b, w.to(torch.bfloat16).float(), atol=1e-3, rtol=1e-3)


def test_fingerprint_and_factors_key(target):
    base = lowrank.fingerprint(target)
    assert len(base) == 8 and int(base, 16) >= 0 and lowrank.fingerprint(copy.deepcopy(target)) == base
    for pick in (lambda m: m.model.layers[0].mlp.up_proj.weight, lambda m: m.model.layers[0].input_layernorm.weight,
                 lambda m: m.lm_head.weight):
        other = copy.deepcopy(target)
        with torch.no_grad():
            pick(other).view(-1)[0] += 0.5
        assert lowrank.fingerprint(other) != base
    chosen = lowrank.chosen_linears(target, 4, lowrank.DEFAULT_TARGETS)
    key = lowrank.factors_key(target, chosen, 256)
    prefix, digest = key.rsplit("-", 1)
    assert prefix == "llama-4x16" and len(digest) == 12 and int(digest, 16) >= 0
    assert lowrank.factors_key(copy.deepcopy(target), chosen, 256) == key
    assert lowrank.factors_key(target, chosen, 128) != key
    assert lowrank.factors_key(target, lowrank.chosen_linears(target, 3, lowrank.DEFAULT_TARGETS), 256) != key
    assert lowrank.factors_key(target, lowrank.chosen_linears(target, {0: 4}, lowrank.DEFAULT_TARGETS), 256) != key
    other = copy.deepcopy(target)
    with torch.no_grad():
        other.lm_head.weight.mul_(2)
    assert lowrank.factors_key(other, chosen, 256) != key


class MemoryStore:
    def __init__(self):
        self.saved, self.loads = {}, []

    def load(self, key):
        self.loads.append(key)
        return self.saved.get(key)

    def save(self, key, tensors):
        self.saved[key] = tensors


def test_build_defaults_refusals_and_what_it_keeps(target):
    store = MemoryStore()
    d = lowrank.LowRankDrafter.build(target, calibration=16, factor_store=store)
    assert d.rank == lowrank.DEFAULT_RANK == 0.7 and d.n_factored == 4 * 3 and d.name == "lowrank"
    # rank 0.7 of 16 -> 11: gate and up 11 x (32 + 16), down 11 x (16 + 32), float32, in each of 4 layers
    assert d.weight_bytes == 4 * 3 * 11 * 48 * 4
    assert isinstance(d.lean, Runner) and d.model is not target
    assert list(store.saved) == [lowrank.factors_key(target, lowrank.chosen_linears(target, 0.7, lowrank.DEFAULT_TARGETS), 16)]
    again = lowrank.LowRankDrafter.build(target, calibration=16, factor_store=store)  # from the store
    assert len(store.loads) == 2 and len(store.saved) == 1
    torch.testing.assert_close(again.model.model.layers[1].mlp.up_proj.a, d.model.model.layers[1].mlp.up_proj.a)
    attn = lowrank.LowRankDrafter.build(target, rank={1: 4}, lowrank_targets=["q_proj", "down_proj"], calibration=16)
    assert attn.lean is None and attn.n_factored == 2 and attn.rank == {1: 4}  # an attention projection: HF's forward
    assert isinstance(attn.model.model.layers[1].self_attn.q_proj, lowrank.LowRankLinear)
    assert type(attn.model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert attn.weight_bytes == (4 * (16 + 16) + 4 * (16 + 32)) * 4
    mlp = lowrank.LowRankDrafter.build(target, rank={2: 4}, lowrank_targets=("down_proj",), calibration=16)
    assert isinstance(mlp.lean, Runner) and mlp.lean.blocks[2].mlp is mlp.model.model.layers[2].mlp
    assert all(mlp.lean.blocks[i].mlp is None for i in (0, 1, 3))
    with pytest.raises(ModeUnavailable) as e:
        lowrank.LowRankDrafter.build(target, rank=[1, 2], calibration=16)
    assert str(e.value) == "--rank [1, 2]: a per-layer rank list needs 4 entries, got 2"
    with pytest.raises(ModeUnavailable, match=r"^--rank 'x': "):
        lowrank.LowRankDrafter.build(target, rank="x", calibration=16)
    with pytest.raises(ModeUnavailable) as e:
        lowrank.LowRankDrafter.build(target, rank=16, calibration=16)
    assert str(e.value) == "--rank 16 factors no layer (at full rank every layer keeps its weights)"
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ModeUnavailable) as e:
        lowrank.LowRankDrafter.build(GPT2LMHeadModel(GPT2Config(vocab_size=12, n_embd=16, n_layer=1, n_head=2)))
    assert str(e.value) == "mode 'lowrank' needs a decoder with model.layers; GPT2LMHeadModel has none"


def test_lowrank_drafts_are_the_factored_copys_own(target):
    """On the lean runner (MLPs factored) q is the softmax of the factored copy's HF logits over the target's own keys
    and values for the context (it drafts on the target's cache); on HF's forward (an attention projection factored)
    over its own cache, all of the copy's."""
    from transformers import DynamicCache

    for opts in ({"rank": 4}, {"rank": 4, "lowrank_targets": ("q_proj", "gate_proj")}):
        d = lowrank.LowRankDrafter.build(target, calibration=16, **opts)
        state = TargetState(target)
        state.start(PROMPT)
        proposal = d.propose(state, 3, T1, torch.Generator().manual_seed(0))
        assert d.sharing == (d.lean is not None) and d.sharing == ("lowrank_targets" not in opts)
        cache = DynamicCache(config=target.config)
        with torch.no_grad():
            (target if d.sharing else d.model)(torch.tensor([PROMPT[:-1]]), past_key_values=cache, use_cache=True)
            feed = PROMPT[-1:]
            for j in range(3):
                want = torch.softmax(d.model(torch.tensor([feed]), past_key_values=cache, use_cache=True).logits[0, -1], -1)
                torch.testing.assert_close(proposal.q[j], want, atol=1e-5, rtol=1e-4)
                feed = [int(proposal.ids[j])]
        assert (proposal.q[0] - torch.softmax(ref_logits(target, PROMPT), -1)).abs().max() > 1e-4  # not the target


def test_lean_draft(target):
    chosen = lowrank.chosen_linears(target, {1: 4, 3: 4}, ("gate_proj", "up_proj"))
    draft = copy.deepcopy(target)
    runner = lowrank.lean_draft(target, draft, chosen)
    assert [b.mlp is draft.model.layers[i].mlp if i in (1, 3) else b.mlp is None for i, b in enumerate(runner.blocks)] == [True] * 4
    assert lowrank.lean_draft(target, draft, lowrank.chosen_linears(target, 4, ("o_proj",))) is None
    assert lowrank.lean_draft(hf_only(target), draft, chosen) is None


def test_only_a_draft_on_the_targets_cache_has_nothing_to_catch_up_on(target):
    """auto skips the first round of a drafter that catches up (it feeds what it missed): a draft model, or lowrank on
    HF's forward; lowrank and quant on the lean runner draft on the target's cache."""
    assert not lowrank.LowRankDrafter.build(target, calibration=16, rank=4).catches_up
    assert lowrank.LowRankDrafter.build(target, calibration=16, rank=4, lowrank_targets=("q_proj",)).catches_up
    assert not build_drafter("quant", target, quant_backend="int8").catches_up
    assert build_drafter("quant", target, quant_backend="torch.ao").catches_up
    assert build_drafter("draft", target, tiny_llama(seed=1, layers=1)).catches_up
