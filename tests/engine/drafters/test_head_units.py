"""Mode `head` (engine/drafters/head.py) unit by unit on tiny models with a randomly initialised head: the target
fingerprint, the head's shape read from the target, its layer against the target's own layer, the refusals of a
head file, what a propose drafts against a cache-free recomputation of the EAGLE recurrence, and the confidence
stop. No sampling loop runs; the whole file takes a few seconds."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import support.models
from support.models import HEAD_LEFT_OUT, tiny_llama
from specchat.engine.cache import KVCache
from specchat.engine.drafters import ModeUnavailable, build_drafter
from specchat.engine.drafters.head import FORMAT, DraftHead, HeadDrafter, fingerprint, head_spec, load_head, read_meta
from specchat.engine.runner import lean_runner
from specchat.engine.sampling import SamplingParams
from specchat.engine.smallbatch import draft_weights
from specchat.engine.target import TargetState
from specchat.train.head import save_head

LEFT_OUT = HEAD_LEFT_OUT


def random_head(target, seed: int = 5) -> DraftHead:
    """support.models.random_head with its norms and biases drawn too, so a dropped norm or bias shows."""
    return support.models.random_head(target, seed, norm_std=0.2)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, layers=2, initializer_range=0.1).requires_grad_(False)


@pytest.fixture(scope="module")
def head(target):
    return random_head(target)


def patterned(model):
    """Every weight set from its index (no RNG: the same on every machine and torch version)."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.sin(torch.arange(p.numel(), dtype=torch.float64) * 0.37 + i).reshape(p.shape).to(p.dtype))
    return model


# ---------------------------------------------------------------- fingerprint


def test_fingerprint_is_a_stable_file_format():
    """Saved heads carry it in their JSON: the same weights must give the same 16 hex digits forever."""
    model = patterned(tiny_llama(seed=0, layers=2))
    assert fingerprint(model) == PINNED_FINGERPRINT
    big = patterned(tiny_llama(seed=0, layers=1, vocab=600))  # 9600 embedding weights: a strided sample of them
    assert fingerprint(big) == PINNED_FINGERPRINT_BIG
    even = patterned(tiny_llama(seed=0, layers=1, vocab=512))  # 8192 embedding weights: every second one sampled
    assert fingerprint(even) == PINNED_FINGERPRINT_EVEN


PINNED_FINGERPRINT = "129c9d020c6e43a8"
PINNED_FINGERPRINT_BIG = "000eeb069202e5a6"
PINNED_FINGERPRINT_EVEN = "5f42d843e9c0802c"


def test_fingerprint_reads_the_weights_and_shape_not_the_dtype(target):
    model = tiny_llama(seed=0, layers=3)
    base = fingerprint(model)
    assert len(base) == 16 and int(base, 16) >= 0
    assert fingerprint(tiny_llama(seed=0, layers=3)) == base
    assert fingerprint(tiny_llama(seed=0, layers=3).to(torch.bfloat16)) == base  # rounded to bf16 first
    for weight in (model.model.embed_tokens.weight, model.model.layers[2].mlp.down_proj.weight, model.lm_head.weight):
        with torch.no_grad():
            old = weight.view(-1)[1].clone()
            weight.view(-1)[1] += 1.0  # an odd index: every element of a small matrix is sampled
            assert fingerprint(model) != base
            weight.view(-1)[1] = old
    assert fingerprint(model) == base
    for key, value in (("model_type", "mistral"), ("num_hidden_layers", 4), ("hidden_size", 17), ("vocab_size", 13)):
        saved = getattr(model.config, key)
        setattr(model.config, key, value)
        assert fingerprint(model) != base, key
        setattr(model.config, key, saved)


# ---------------------------------------------------------------- the head's shape


def test_head_spec_of_a_llama_a_qwen2_and_a_qwen3():
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    llama = tiny_llama(seed=0, layers=1, rms_norm_eps=1e-5, hidden_act="gelu")
    assert head_spec(lean_runner(llama), llama.config) == {
        "hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "scale": 8 ** -0.5,
        "intermediate_size": 32, "rms_norm_eps": 1e-5, "hidden_act": "gelu", "attention_bias": False, "qk_norm": False,
    }
    common = dict(vocab_size=12, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False)
    qwen2 = Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    spec = head_spec(lean_runner(qwen2), qwen2.config)
    assert (spec["attention_bias"], spec["qk_norm"], spec["head_dim"], spec["intermediate_size"]) == (True, False, 8, 48)
    assert (spec["num_attention_heads"], spec["num_key_value_heads"], spec["hidden_size"]) == (4, 2, 32)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16)).eval()
    spec = head_spec(lean_runner(qwen3), qwen3.config)
    assert (spec["attention_bias"], spec["qk_norm"], spec["head_dim"], spec["scale"]) == (False, True, 16, 0.25)


def test_draft_head_shapes_and_initialisation():
    spec = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "scale": 0.25,
            "intermediate_size": 96, "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": True, "qk_norm": True}
    head = DraftHead(spec, 7)
    assert head.fc.weight.shape == (64, 128) and head.fc.bias.shape == (64,)
    assert head.qkv.weight.shape == ((4 + 2 * 2) * 16, 64) and head.qkv.bias.shape == (128,)
    assert head.o.weight.shape == (64, 64) and head.o.bias is None
    assert head.gate_up.weight.shape == (192, 64) and head.gate_up.bias is None
    assert head.down.weight.shape == (64, 96) and head.down.bias is None
    assert torch.equal(head.ln1, torch.ones(64)) and torch.equal(head.ln2, torch.ones(64))
    assert torch.equal(head.q_norm, torch.ones(16)) and torch.equal(head.k_norm, torch.ones(16))
    assert head.vocab.dtype == torch.long and torch.equal(head.vocab, torch.zeros(7, dtype=torch.long))
    assert "vocab" in dict(head.named_buffers()) and "vocab" not in dict(head.named_parameters())
    assert (head.shape.n_heads, head.shape.n_kv_heads, head.shape.head_dim, head.shape.scale) == (4, 2, 16, 0.25)
    x = torch.linspace(-3, 3, 7)
    torch.testing.assert_close(head.act(x), x * torch.sigmoid(x))
    for layer in (head.fc, head.qkv, head.o, head.gate_up, head.down):
        assert 0.015 < float(layer.weight.detach().std()) < 0.025 and abs(float(layer.weight.detach().mean())) < 0.005
    assert torch.equal(head.fc.bias, torch.zeros(64)) and torch.equal(head.qkv.bias, torch.zeros(128))
    plain = DraftHead({**spec, "attention_bias": False, "qk_norm": False, "hidden_act": "gelu"}, 3)
    assert plain.qkv.bias is None and plain.q_norm is None and plain.k_norm is None
    torch.testing.assert_close(plain.act(x), torch.nn.functional.gelu(x))
    block = plain.block()
    assert block.q_norm is None and block.k_norm is None and block.qkv_b is None


def head_from_layer(model, fc_weight, fc_bias) -> DraftHead:
    """A head whose decoder layer is `model`'s layer 0 and whose fc is the given matrix [D, 2D]."""
    runner = lean_runner(model)
    layer = model.model.layers[0]
    head = DraftHead(head_spec(runner, model.config), 3)
    attn, mlp = layer.self_attn, layer.mlp
    with torch.no_grad():
        head.fc.weight.copy_(fc_weight)
        head.fc.bias.copy_(fc_bias)
        head.ln1.copy_(layer.input_layernorm.weight)
        head.ln2.copy_(layer.post_attention_layernorm.weight)
        head.qkv.weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        if head.qkv.bias is not None:
            head.qkv.bias.copy_(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
        head.o.weight.copy_(attn.o_proj.weight)
        head.gate_up.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        head.down.weight.copy_(mlp.down_proj.weight)
        if head.q_norm is not None:
            head.q_norm.copy_(attn.q_norm.weight)
            head.k_norm.copy_(attn.k_norm.weight)
    return head.requires_grad_(False)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_head_layer_is_the_targets_layer_over_fc_of_feature_and_embedding(family):
    """With the target's layer-0 weights, the head over fc([f ; e]) equals the target's (HF) layer 0 run on
    fc([f ; e]) itself: each of the head's tensors lands where the target's layer reads it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    if family == "llama":
        model = tiny_llama(seed=0, layers=1, initializer_range=0.3, rms_norm_eps=0.05)
    elif family == "qwen2":  # attention biases
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=0.05,
                                             tie_word_embeddings=False, initializer_range=0.3)).eval()
    else:
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, head_dim=8, rms_norm_eps=0.05,
                                             tie_word_embeddings=False, initializer_range=0.3)).eval()
    with torch.no_grad():  # norms that differ from each other and from ones
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.requires_grad_(False)
    D, S = 16, 5
    fc_w, fc_b = torch.randn(D, 2 * D) * 0.3, torch.randn(D) * 0.3
    head = head_from_layer(model, fc_w, fc_b)
    features, embeddings = torch.randn(1, S, D), torch.randn(1, S, D)
    x = features @ fc_w[:, :D].T + embeddings @ fc_w[:, D:].T + fc_b  # fc([f ; e]) by hand
    positions = torch.arange(S)[None]
    with torch.no_grad():
        rope = model.model.rotary_emb(x, position_ids=positions)
        mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
        want = model.model.layers[0](x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
        want = want[0] if isinstance(want, tuple) else want
    runner = lean_runner(model)
    with torch.no_grad():
        got = head(features, embeddings, None, 0, *runner.rope(0, S))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    # the same through a cache, one position at a time after the first three (the head's drafting path)
    cache = KVCache(1, runner.n_kv_heads, runner.head_dim, runner.dtype, runner.device)
    with torch.no_grad():
        first = head(features[:, :3], embeddings[:, :3], cache, 0, *runner.rope(0, 3))
        rest = [head(features[:, i : i + 1], embeddings[:, i : i + 1], cache, i, *runner.rope(i, 1)) for i in (3, 4)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), want, atol=1e-5, rtol=1e-4)


def test_streamed_converts_the_five_matrices_and_leaves_the_head_alone(head):
    before = {n: p.clone() for n, p in head.named_parameters()}
    other = head.streamed()
    want = draft_weights(torch.zeros(2, 2)).dtype  # bfloat16 where the kernel runs, else float32
    for name in ("fc", "qkv", "o", "gate_up", "down"):
        assert getattr(other, name).weight.dtype == want and not getattr(other, name).weight.requires_grad, name
        assert getattr(head, name).weight.dtype == torch.float32, name
        torch.testing.assert_close(getattr(other, name).weight.float(), getattr(head, name).weight, atol=0.02, rtol=0.01)
    assert other.fc.bias.dtype == torch.float32 and other.ln1.dtype == torch.float32
    for n, p in head.named_parameters():
        assert torch.equal(p, before[n]), n
    assert torch.equal(other.vocab, head.vocab)


# ---------------------------------------------------------------- head files


def saved(tmp_path, head, meta, name="h"):
    return save_head(SimpleNamespace(head=head), tmp_path / name, meta)


def test_read_meta_refuses_missing_unreadable_and_foreign_descriptions(tmp_path):
    path = tmp_path / "h.safetensors"
    with pytest.raises(ModeUnavailable, match=r"cannot read the draft head's description .*h\.json"):
        read_meta(path)
    (tmp_path / "h.json").write_text("{not json")
    with pytest.raises(ModeUnavailable, match="cannot read the draft head's description"):
        read_meta(path)
    for text in ("[1, 2]", json.dumps({"format": "specchat-draft-head/0"}), json.dumps({"spec": {}})):
        (tmp_path / "h.json").write_text(text)
        with pytest.raises(ModeUnavailable) as e:
            read_meta(path)
        assert str(e.value) == f"{tmp_path / 'h.json'} is not a specchat draft head (specchat-draft-head/1)"
    (tmp_path / "h.json").write_text(json.dumps({"format": FORMAT, "x": 1}))
    assert read_meta(tmp_path / "h") == {"format": FORMAT, "x": 1}  # the suffix is replaced, whatever it was


def test_load_head_checks_the_target_reads_the_file_and_returns_it_ready(tmp_path, target, head):
    meta = {"format": FORMAT, "target": {"name": "tiny", "fingerprint": fingerprint(target)}, "spec": head.spec}
    path = saved(tmp_path, head, meta)
    loaded, got_meta = load_head(path.with_suffix(".json"), target)
    assert got_meta == meta
    assert torch.equal(loaded.vocab, head.vocab) and not loaded.training
    assert all(not p.requires_grad and p.dtype == torch.float32 for p in loaded.parameters())
    torch.testing.assert_close(loaded.qkv.weight, head.qkv.weight.to(torch.bfloat16).float())  # saved as bf16
    bf16 = tiny_llama(seed=0, layers=2, initializer_range=0.1).to(torch.bfloat16)
    loaded16, _ = load_head(path, bf16)  # the same weights in bf16: same fingerprint; the head comes in bf16
    assert all(p.dtype == torch.bfloat16 for p in loaded16.parameters())

    other = tiny_llama(seed=3, layers=2)
    with pytest.raises(ModeUnavailable) as e:
        load_head(path, other)
    assert str(e.value) == (f"the draft head h.safetensors was trained for tiny (weights {fingerprint(target)}), "
                            f"not this target (weights {fingerprint(other)})")
    (tmp_path / "h.json").write_text(json.dumps({"format": FORMAT, "spec": head.spec}))
    with pytest.raises(ModeUnavailable) as e:
        load_head(path, target)
    assert str(e.value) == f"the draft head h.safetensors was trained for another model (weights None), not this target (weights {fingerprint(target)})"


def test_load_head_refuses_a_broken_file_and_a_head_of_another_shape(tmp_path, target, head):
    meta = {"format": FORMAT, "target": {"name": "tiny", "fingerprint": fingerprint(target)}, "spec": head.spec}
    path = saved(tmp_path, head, meta)
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(ModeUnavailable, match=r"^cannot read the draft head .*h\.safetensors: SafetensorError: "):
        load_head(path, target)
    saved(tmp_path, head, {**meta, "spec": {**head.spec, "intermediate_size": 48}})
    with pytest.raises(ModeUnavailable) as e:
        load_head(path, target)
    # the first line of load_state_dict's report (the size mismatches follow on lines of their own)
    assert str(e.value) == "the draft head h.safetensors does not fit this target: Error(s) in loading state_dict for DraftHead:"


def test_build_refuses_without_the_lean_runner_or_a_head_file(tmp_path, target, head):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=12, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ModeUnavailable, match=r"^mode head needs the lean runner: GPT2LMHeadModel \(gpt2\) is not"):
        HeadDrafter.build(gpt2, head_file=tmp_path / "h.safetensors")
    with pytest.raises(ModeUnavailable) as e:
        HeadDrafter.build(target)
    assert str(e.value) == "no draft head for this target: train one with `specchat train-head`"
    meta = {"format": FORMAT, "target": {"name": "tiny", "fingerprint": fingerprint(target)}, "spec": head.spec, "max_draft": 3}
    drafter = build_drafter("head", target, head_file=saved(tmp_path, head, meta))
    assert isinstance(drafter, HeadDrafter) and drafter.meta == meta and drafter.max_draft == 3


# ---------------------------------------------------------------- the drafter


def test_drafter_setup_max_draft_and_extra_bytes(target, head):
    assert HeadDrafter(head, target).max_draft is None
    assert HeadDrafter(head, target, {}).max_draft is None
    assert HeadDrafter(head, target, {"max_draft": 0}).max_draft is None
    assert HeadDrafter(head, target, {"max_draft": None}).max_draft is None
    assert HeadDrafter(head, target, {"max_draft": 2.0}).max_draft == 2
    d = HeadDrafter(head, target, {"max_draft": 1})
    assert d.max_draft == 1 and d.meta == {"max_draft": 1}
    assert d.norm_w is target.model.norm.weight and d.norm_eps == target.model.norm.variance_epsilon
    assert torch.equal(d.vocab, torch.tensor([0, 1, 3, 4, 5, 6, 8, 9, 10, 11]))
    torch.testing.assert_close(d.head_w.float(), target.lm_head.weight[d.vocab], atol=0.02, rtol=0.01)
    assert d.cache is None and d.cached == []
    e = draft_weights(torch.zeros(2, 2)).element_size()
    # the five matrices (fc 16x32, qkv 32x16, o 16x16, gate_up 64x16, down 16x32) streamed; fc bias and the two
    # norms (16 each) float32; the LM head's 10 vocabulary rows of 16
    assert d.extra_bytes == (512 + 512 + 256 + 1024 + 512) * e + 3 * 16 * 4 + 10 * 16 * e


def test_q_is_the_restricted_softmax_scattered_into_the_vocabulary(target, head):
    d = HeadDrafter(head, target)
    hidden = torch.randn(1, 1, 16)
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + target.model.norm.variance_epsilon) * target.model.norm.weight
    logits_ref = normed[0, 0] @ d.head_w.float().T  # [10]
    q, logits = d.q_of(hidden, 12, SamplingParams(1.0))
    torch.testing.assert_close(logits.float(), logits_ref, atol=1e-3, rtol=1e-3)
    assert q.shape == (12,) and q.dtype == torch.float32 and torch.all(q[LEFT_OUT] == 0)
    torch.testing.assert_close(q[d.vocab], torch.softmax(logits_ref, -1), atol=1e-4, rtol=1e-3)
    q3, _ = d.q_of(hidden, 12, SamplingParams(1.0, top_k=3))
    assert int((q3 > 0).sum()) == 3 and set(torch.topk(q3, 3).indices.tolist()) == set(d.vocab[torch.topk(logits_ref, 3).indices].tolist())


def test_q_uses_the_targets_final_norm_epsilon():
    big_eps = tiny_llama(seed=0, layers=2, initializer_range=0.1, rms_norm_eps=0.5).requires_grad_(False)
    d = HeadDrafter(random_head(big_eps), big_eps)
    hidden = torch.randn(1, 1, 16, generator=torch.Generator().manual_seed(2)) * 0.3  # small: the epsilon matters
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 0.5) * big_eps.model.norm.weight
    _, logits = d.q_of(hidden, 12, SamplingParams(1.0))
    torch.testing.assert_close(logits.float(), normed[0, 0] @ d.head_w.float().T, atol=1e-3, rtol=1e-3)


def reference_drafts(target, drafter, tokens, k, params, path=None):
    """The EAGLE recurrence recomputed from scratch for every draft, no head cache: head position j reads
    (f_j, x_{j+1}), j < n-1 from the target's features, then (its own prediction, the draft). Drafts are the
    argmax of q, or follow `path`; returns (ids, q [k, V])."""
    runner = lean_runner(target)
    n = len(tokens)
    with torch.no_grad():
        feats = runner.run(runner.embed(tokens), range(runner.n_layers), None, 0)[0, : n - 1]  # f_0..f_{n-2}
    fs, xs, ids, qs = list(feats), list(tokens[1:]), [], []
    for i in range(k):
        with torch.no_grad():
            out = drafter.head(torch.stack(fs)[None], runner.embed(xs), None, 0, *runner.rope(0, len(fs)))  # [1, S, D]
        q, _ = drafter.q_of(out[:, -1:], runner.vocab_size, params)
        token = int(torch.argmax(q)) if path is None else path[i]
        ids.append(token)
        qs.append(q)
        fs.append(out[0, -1])
        xs.append(token)
    return ids, torch.stack(qs)


def test_drafts_follow_the_recurrence_through_rounds_and_rollbacks(target, head):
    """Greedy drafts, and sampled drafts' q along the path drawn, against the cache-free recomputation, as the
    state moves on by accepted, rejected and foreign tokens and restarts from a shorter prefix."""
    drafter = HeadDrafter(head, target)
    state = TargetState(target)
    state.start([3, 1, 4, 1, 5])
    steps = [("accept", 2), ("accept", 0), ("foreign", [9, 8, 7]), ("restart", 4), ("accept", 3), ("foreign", [6]),
             ("accept", 1), ("restart", 2)]
    gen = torch.Generator().manual_seed(1)
    last = None
    for step in [None, *steps]:
        if step is not None:
            kind, arg = step
            if kind == "accept":
                state.verify(last.ids.tolist())
                state.commit(last.ids[:arg].tolist() + [11])
            elif kind == "foreign":
                state.verify([])
                state.commit(list(arg))
            else:  # a new turn that shares only a prefix
                state.start(state.tokens[:arg] + [10, 0, 6])
        missing = state.known < len(state.tokens) - 1  # foreign tokens committed without a forward: recomputed
        greedy = drafter.propose(state, 3, SamplingParams(0), None)
        assert greedy.ids.tolist() == reference_drafts(target, drafter, state.tokens, 3, SamplingParams(0))[0], step
        assert drafter.cached == state.tokens and greedy.calls == 3 + missing
        sampled = drafter.propose(state, 3, SamplingParams(1.0), gen)
        _, want_q = reference_drafts(target, drafter, state.tokens, 3, SamplingParams(1.0), path=sampled.ids.tolist())
        torch.testing.assert_close(sampled.q, want_q, atol=1e-5, rtol=1e-4)
        assert torch.all(sampled.q[:, LEFT_OUT] == 0)
        last = greedy


def test_missing_features_are_recomputed_once(target, head):
    state, other = TargetState(target), TargetState(target)
    for s in (state, other):
        s.start([3, 1, 4, 1, 5, 9])
        s.verify([2])
        s.commit([2, 6])  # tokens: 8; the cache holds 7 positions
    state.known = 2  # features after position 2 "computed elsewhere"
    got = HeadDrafter(head, target).propose(state, 2, SamplingParams(0), None)
    want = HeadDrafter(head, target).propose(other, 2, SamplingParams(0), None)
    assert got.calls == 3 and want.calls == 2  # one target forward to recover the features
    assert state.known == 7 and got.ids.tolist() == want.ids.tolist()
    torch.testing.assert_close(state.features[:7], other.features[:7])


def test_no_drafts_on_the_hf_path_or_from_one_token(target, head):
    d = HeadDrafter(head, target)
    hf = TargetState(target, runner="hf")
    hf.start([3, 1, 4])
    p = d.propose(hf, 3, SamplingParams(0), None)
    assert len(p.ids) == 0 and p.q is None and p.calls == 0
    one = TargetState(target)
    one.start([3])
    p = d.propose(one, 3, SamplingParams(0), None)
    assert len(p.ids) == 0 and p.calls == 0 and d.cache is None
    two = TargetState(target)
    two.start([3, 1])
    assert len(d.propose(two, 3, SamplingParams(0), None).ids) == 3


def test_max_draft_caps_k_and_a_smaller_k_stays(target, head):
    state = TargetState(target)
    state.start([3, 1, 4, 1, 5])
    d = HeadDrafter(head, target, {"max_draft": 2})
    assert len(d.propose(state, 4, SamplingParams(0), None).ids) == 2
    assert len(d.propose(state, 1, SamplingParams(0), None).ids) == 1


def test_confidence_stop_at_p_min(target, head):
    state = TargetState(target)
    state.start([3, 1, 4, 1, 5])
    d = HeadDrafter(head, target)
    sampled = d.propose(state, 3, SamplingParams(1.0), torch.Generator().manual_seed(0))
    top = [float(q.max()) for q in sampled.q]
    # greedy: the confidence is the softmax of the logits (not the one-hot q); the greedy path's first draft is
    # the same as the sampled path's first, so its top probability is top[0]
    for p_min, drafted in ((top[0] - 1e-4, None), (top[0] + 1e-4, 0)):
        d.p_min = p_min
        p = d.propose(state, 3, SamplingParams(0), None)
        if drafted == 0:
            assert len(p.ids) == 0 and p.q is None and p.calls == 1
        else:
            assert len(p.ids) >= 1
    d.p_min = 0.999
    p = d.propose(state, 3, SamplingParams(1.0), torch.Generator().manual_seed(0))
    assert len(p.ids) == 0 and p.calls == 1
