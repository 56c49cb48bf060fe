"""engine/runner.py one function at a time, against HF's own modules as the reference: rms_norm and rotate against
LlamaRMSNorm and rotate_half, the RoPE tables against the model's rotary embedding, every reason `unsupported`
gives, fuse_rows' views and reuse, and the forward (every attention branch: prefill, one-token steps, verifies
after a past, with and without GQA, without a cache, rows of a batch) against HF's logits on two-layer models of
a few thousand weights. The whole file runs in a few seconds."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm, rotate_half

from specchat.engine import smallbatch
from specchat.engine.cache import CHUNK, KVCache
from specchat.engine.runner import Runner, Shape, decoder_layer, fuse_rows, lean_runner, rms_norm, rotate, unsupported

V = 12
CLOSE = dict(rtol=1e-5, atol=1e-5)
KINDS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def tiny(kind: str = "llama", seed: int = 0, **overrides):
    """Two layers, D 16, 4 query heads over 2 KV heads (GQA) of 4 dims, unless overridden."""
    config_cls, model_cls = KINDS[kind]
    torch.manual_seed(seed)
    settings = dict(vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
                    pad_token_id=None, tie_word_embeddings=False, initializer_range=0.3)
    model = model_cls(config_cls(**{**settings, **overrides})).eval().requires_grad_(False)
    with torch.no_grad():  # random biases and norm weights (HF initialises them to 0 and 1): every one is exercised
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.3)
            if hasattr(module, "variance_epsilon"):
                module.weight.uniform_(0.5, 1.5)
    return model


def full(model, ids: list[int]) -> torch.Tensor:
    """HF's logits for every position of ids, no cache: [S, V]."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


# ---------------------------------------------------------------- rms_norm, rotate, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_rms_norm_is_hfs(dtype, eps):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 3, 8, generator=g) * 0.7).to(dtype)
    norm = LlamaRMSNorm(8, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(8, generator=g) + 0.5)
    norm = norm.to(dtype)
    got, want = rms_norm(x, norm.weight, eps), norm(x)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got, want)  # normalised in float32, cast back, then scaled: bit for bit


def test_rms_norm_by_hand():
    x, w = torch.tensor([[3.0, 4.0]]), torch.tensor([1.0, 2.0])  # mean square 12.5
    for dtype in (torch.float32, torch.bfloat16):
        got = rms_norm(x.to(dtype), w.to(dtype), 2.5).float()  # rsqrt(12.5 + 2.5) = 1 / sqrt(15)
        torch.testing.assert_close(got, torch.tensor([[3.0, 8.0]]) / 15**0.5, rtol=1e-2, atol=0)


def test_rotate_is_hfs_rotate_half():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 4, 8, generator=g)  # [B, S, H, hd]
    cos, sin = torch.randn(1, 3, 1, 8, generator=g), torch.randn(1, 3, 1, 8, generator=g)
    sin_signed = torch.cat([-sin[..., :4], sin[..., 4:]], dim=-1)
    torch.testing.assert_close(rotate(x, cos, sin_signed), x * cos + rotate_half(x) * sin, rtol=0, atol=1e-6)
    # by hand: hd 2, x = (1, 2), cos = (c, c), sin = (s, s): (c - 2 s, 2 c + s)
    c, s = 0.5, 0.25
    out = rotate(torch.tensor([[[[1.0, 2.0]]]]), torch.full((1, 1, 1, 2), c), torch.tensor([[[[-s, s]]]]))
    torch.testing.assert_close(out, torch.tensor([[[[c - 2 * s, 2 * c + s]]]]))


@pytest.mark.parametrize("q_len, past", [(1, 0), (3, 0), (1, 4), (3, 2)])
def test_mask_lets_each_query_see_the_past_and_itself(q_len, past):
    mask = Runner.mask(q_len, past, torch.device("cpu"))
    want = torch.tensor([[j <= past + i for j in range(past + q_len)] for i in range(q_len)])
    assert mask.dtype == torch.bool and torch.equal(mask, want)


# ---------------------------------------------------------------- unsupported, lean_runner


def test_the_supported_families_need_nothing_changed():
    for model in (tiny("llama"), tiny("qwen2"), tiny("qwen3", head_dim=8), tiny("llama", mlp_bias=True),
                  tiny("llama", tie_word_embeddings=True)):
        assert unsupported(model) is None
        runner = lean_runner(model)
        assert isinstance(runner, Runner)


def test_a_llama_with_a_sliding_window_setting_is_still_supported():
    """Only Mistral reads `sliding_window` from the config; Llama has no such attention."""
    model = tiny("llama")
    model.config.sliding_window = 16
    assert unsupported(model) is None


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3", "yarn"])
def test_every_static_rope_type_is_supported(rope_type):
    model = tiny("llama")
    model.model.rotary_emb.rope_type = rope_type
    assert unsupported(model) is None


class NotQuiteLinear(torch.nn.Linear):
    pass


def breaks(change) -> str | None:
    model = tiny("qwen3", head_dim=8)
    change(model)
    return unsupported(model)


def swap(module, name, new):
    setattr(module, name, new)


BREAKS = [  # (a change to a supported Qwen3, the reason unsupported gives)
    (lambda m: swap(m.config, "model_type", "gpt2"), "Qwen3ForCausalLM (gpt2) is not a Llama/Qwen2/Qwen3/Mistral decoder"),
    (lambda m: swap(m, "config", None), "Qwen3ForCausalLM (None) is not a Llama/Qwen2/Qwen3/Mistral decoder"),
    (lambda m: swap(m.model, "embed_tokens", None), "unexpected module layout"),
    (lambda m: swap(m.model, "layers", None), "unexpected module layout"),
    (lambda m: swap(m.model, "norm", None), "unexpected module layout"),
    (lambda m: swap(m.model, "rotary_emb", None), "unexpected module layout"),
    (lambda m: swap(m, "lm_head", NotQuiteLinear(16, V, bias=False)), "unexpected module layout"),
    (lambda m: swap(m, "lm_head", torch.nn.Linear(16, V, bias=True)), "unexpected module layout"),
    (lambda m: swap(m.config, "layer_types", ["full_attention", "sliding_attention"]), "sliding-window attention"),
    (lambda m: swap(m.model.rotary_emb, "rope_type", "dynamic"), "rope type 'dynamic'"),
    (lambda m: swap(m.model.rotary_emb, "rope_type", "longrope"), "rope type 'longrope'"),
    (lambda m: swap(m.model.rotary_emb, "rope_type", {"full_attention": "default"}), "rope type {'full_attention': 'default'}"),
    (lambda m: swap(m.model.rotary_emb, "rope_type", None), "rope type None"),
    (lambda m: swap(m.model.embed_tokens, "weight", torch.nn.Parameter(torch.zeros(V, 16, dtype=torch.int8), requires_grad=False)),
     "non-floating-point weights"),
    (lambda m: swap(m.model.layers[1].self_attn, "q_proj", NotQuiteLinear(16, 32, bias=False)), "non-standard linear layers"),
    (lambda m: swap(m.model.layers[0].self_attn, "o_proj", NotQuiteLinear(32, 16, bias=False)), "non-standard linear layers"),
    (lambda m: swap(m.model.layers[0].mlp, "down_proj", NotQuiteLinear(24, 16, bias=False)), "non-standard linear layers"),
    (lambda m: swap(m.model.layers[1], "mlp", None), "non-standard linear layers"),
    (lambda m: swap(m.model.layers[1].self_attn.v_proj, "bias", torch.nn.Parameter(torch.zeros(16))), "mixed biases"),
    (lambda m: swap(m.model.layers[1].self_attn.q_proj, "bias", torch.nn.Parameter(torch.zeros(32))), "mixed biases"),
    (lambda m: swap(m.model.layers[0].mlp.gate_proj, "bias", torch.nn.Parameter(torch.zeros(24))), "mixed biases"),
    (lambda m: swap(m.model.layers[0].mlp.up_proj, "bias", torch.nn.Parameter(torch.zeros(24))), "mixed biases"),
    (lambda m: swap(m.model.layers[1].self_attn, "sliding_window", 8), "sliding-window attention"),
    (lambda m: swap(m.model.layers[1], "input_layernorm", torch.nn.LayerNorm(16)), "unexpected norm layers"),
    (lambda m: swap(m.model.layers[0], "post_attention_layernorm", torch.nn.LayerNorm(16)), "unexpected norm layers"),
    (lambda m: swap(m.model.layers[0].self_attn, "q_norm", torch.nn.LayerNorm(8)), "unexpected norm layers"),
    (lambda m: swap(m.model.layers[0].self_attn, "k_norm", torch.nn.LayerNorm(8)), "unexpected norm layers"),
    (lambda m: swap(m.model.layers[1].post_attention_layernorm, "weight", None), "unexpected norm layers"),
]


@pytest.mark.parametrize("change, reason", BREAKS, ids=[f"{i}-{reason}" for i, (_, reason) in enumerate(BREAKS)])
def test_unsupported_says_why(change, reason):
    assert breaks(change) == reason
    model = tiny("qwen3", head_dim=8)
    change(model)
    assert lean_runner(model) is None


def test_biases_on_o_proj_or_down_proj_alone_are_not_mixed():
    """Only q/k/v (one fused matmul) and gate/up (another) must agree; o and down have their own."""
    model = tiny("llama")
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.bias = torch.nn.Parameter(torch.randn(16) * 0.3)
        model.model.layers[1].mlp.down_proj.bias = torch.nn.Parameter(torch.randn(16) * 0.3)
    qwen2 = tiny("qwen2")  # biased q/k/v, unbiased o
    with torch.no_grad():
        qwen2.model.layers[1].mlp.gate_proj.bias = torch.nn.Parameter(torch.randn(24) * 0.3)
        qwen2.model.layers[1].mlp.up_proj.bias = torch.nn.Parameter(torch.randn(24) * 0.3)
    for m in (model, qwen2):
        assert unsupported(m) is None
        ids = [3, 1, 4, 1, 5]
        torch.testing.assert_close(lean_runner(m).step(ids, lean_runner(m).new_cache(), 0, keep=5), full(m, ids), **CLOSE)


def test_a_mistral_with_a_sliding_window_and_one_without():
    from transformers import MistralConfig, MistralForCausalLM

    config = dict(vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    assert unsupported(MistralForCausalLM(MistralConfig(**config, sliding_window=8))) == "sliding-window attention"
    assert unsupported(MistralForCausalLM(MistralConfig(**config, sliding_window=None))) is None


def test_a_model_without_get_output_embeddings_has_an_unexpected_layout():
    class Bare:
        def __init__(self, model):
            self.config, self.model = model.config, model.model

    assert unsupported(Bare(tiny("llama"))) == "unexpected module layout"


# ---------------------------------------------------------------- fuse_rows


def linears(*rows: int, bias: bool = True, requires_grad: bool = False) -> list[torch.nn.Linear]:
    torch.manual_seed(sum(rows))
    return [torch.nn.Linear(5, n, bias=bias).requires_grad_(requires_grad) for n in rows]


@pytest.mark.parametrize("requires_grad", [False, True])
def test_fuse_rows_stacks_the_rows_and_makes_the_parameters_views(requires_grad):
    ms = linears(3, 2, 4, requires_grad=requires_grad)
    weights, biases = [m.weight.detach().clone() for m in ms], [m.bias.detach().clone() for m in ms]
    w = fuse_rows(ms, "weight")
    b = fuse_rows(ms, "bias")
    assert torch.equal(w, torch.cat(weights)) and torch.equal(b, torch.cat(biases))
    assert w.shape == (9, 5) and b.shape == (9,)
    for m, start, want_w, want_b in zip(ms, (0, 3, 5), weights, biases):
        assert isinstance(m.weight, torch.nn.Parameter) and m.weight.requires_grad == requires_grad
        assert torch.equal(m.weight, want_w) and torch.equal(m.bias, want_b)
        assert m.weight.data_ptr() == w.data_ptr() + start * 5 * 4
        assert m.bias.data_ptr() == b.data_ptr() + start * 4
    with torch.no_grad():
        w[3, 0] = 42.0  # one memory: the module sees it
    assert ms[1].weight[0, 0] == 42.0


def test_fuse_rows_of_fused_modules_reuses_their_tensor():
    ms = linears(3, 2, 4)
    w = fuse_rows(ms, "weight")
    again = fuse_rows(ms, "weight")
    assert again.data_ptr() == w.data_ptr() and again.shape == (9, 5) and torch.equal(again, w)
    assert ms[1].weight.data_ptr() == w.data_ptr() + 3 * 5 * 4  # the parameters were left alone


def test_fuse_rows_of_views_out_of_order_copies():
    ms = linears(3, 2, 4)
    fuse_rows(ms, "weight")
    swapped = [ms[1], ms[0], ms[2]]  # each a view of one storage, but not adjacent in this order
    want = torch.cat([ms[1].weight, ms[0].weight, ms[2].weight]).clone()
    w = fuse_rows(swapped, "weight")
    assert torch.equal(w, want) and w.shape == (9, 5)
    assert ms[1].weight.data_ptr() == w.data_ptr()


def test_fuse_rows_of_a_strided_view_copies():
    base = torch.randn(2, 5)
    a, b = torch.nn.Linear(5, 2, bias=False), torch.nn.Linear(5, 2, bias=False)
    with torch.no_grad():
        a.weight = torch.nn.Parameter(base.t().contiguous().t(), requires_grad=False)  # the same values, column-major
    assert not a.weight.is_contiguous()
    want = torch.cat([a.weight, b.weight]).clone()
    w = fuse_rows([a, b], "weight")
    assert torch.equal(w, want) and w.is_contiguous() and a.weight.is_contiguous()


def test_fuse_rows_without_biases_is_none():
    ms = linears(3, 2, bias=False)
    assert fuse_rows(ms, "bias") is None


def test_fuse_rows_under_inference_mode_leaves_ordinary_parameters():
    ms = linears(3, 2, requires_grad=True)
    with torch.inference_mode():
        fuse_rows(ms, "weight")
    assert not any(m.weight.is_inference() for m in ms)
    (ms[0].weight.sum() + ms[1].weight.sum()).backward()  # still trainable
    assert ms[0].weight.grad is not None


def test_a_runner_built_in_inference_mode_leaves_the_model_trainable():
    model = tiny("llama").requires_grad_(True)
    with torch.inference_mode():
        lean_runner(model)
    assert not any(p.is_inference() for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())


# ---------------------------------------------------------------- the Runner's constants and tables


def test_the_runner_reads_the_shape_from_the_model():
    model = tiny("qwen3", head_dim=8, num_attention_heads=6, num_key_value_heads=2)
    runner = lean_runner(model)
    assert (runner.head_dim, runner.n_heads, runner.n_kv_heads, runner.n_rep) == (8, 6, 2, 3)
    assert runner.scale == pytest.approx(8**-0.5) and runner.shape == Shape(6, 2, 8, 8**-0.5) and runner.shape.n_rep == 3
    assert runner.n_layers == 2 and len(runner.blocks) == 2 and runner.vocab_size == V
    assert runner.dtype == torch.float32 and runner.device == torch.device("cpu")
    assert runner.cos.shape == runner.sin.shape == (0, 8)
    assert runner.embed_w is model.model.embed_tokens.weight and runner.head_w is model.lm_head.weight
    assert runner.norm_w is model.model.norm.weight and runner.norm_eps == model.config.rms_norm_eps
    c = runner.new_cache(rows=3)
    assert isinstance(c, KVCache) and (c.n_kv_heads, c.head_dim, c.dtype, c.rows, len(c.lengths)) == (2, 8, torch.float32, 3, 2)
    assert runner.new_cache().rows == 1
    b = runner.blocks[1]
    layer = model.model.layers[1]
    assert b.ln1 is layer.input_layernorm.weight and b.ln2 is layer.post_attention_layernorm.weight
    assert b.q_norm is layer.self_attn.q_norm.weight and b.k_norm is layer.self_attn.k_norm.weight
    assert b.o_w is layer.self_attn.o_proj.weight and b.down_w is layer.mlp.down_proj.weight and b.act is layer.mlp.act_fn
    assert b.qkv_b is None and b.gate_up_b is None and b.o_b is None and b.down_b is None and b.mlp is None


def test_rope_tables_are_the_models_own_grown_in_chunks():
    model = tiny("llama", rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    runner = lean_runner(model)
    positions = torch.arange(2 * CHUNK)[None]
    cos_ref, sin_ref = model.model.rotary_emb(torch.zeros(1, 1, 16), position_ids=positions)  # [1, P, hd]
    cos, sin = runner.rope(3, 5)
    assert cos.shape == sin.shape == (1, 5, 1, 4) and runner.cos.shape == (CHUNK, 4)
    torch.testing.assert_close(cos[0, :, 0], cos_ref[0, 3:8], rtol=0, atol=0)
    torch.testing.assert_close(sin[0, :, 0], torch.cat([-sin_ref[0, 3:8, :2], sin_ref[0, 3:8, 2:]], dim=-1), rtol=0, atol=0)
    table = runner.cos
    cos, sin = runner.rope(CHUNK - 5, 5)  # up to the end of the first chunk: the same table, not recomputed
    assert runner.cos is table and cos.shape == (1, 5, 1, 4)
    cos, sin = runner.rope(CHUNK - 2, 4)  # past it: the table grows by a chunk
    assert runner.cos.shape == runner.sin.shape == (2 * CHUNK, 4)
    torch.testing.assert_close(cos[0, :, 0], cos_ref[0, CHUNK - 2 : CHUNK + 2], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[0, :, 0, 2:], sin_ref[0, CHUNK - 2 : CHUNK + 2, 2:], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[0, :, 0, :2], -sin_ref[0, CHUNK - 2 : CHUNK + 2, :2], rtol=0, atol=1e-6)


def test_embed_and_logits():
    model = tiny("llama")
    runner = lean_runner(model)
    hidden = runner.embed([3, 0, 3])
    assert hidden.shape == (1, 3, 16) and torch.equal(hidden[0], model.model.embed_tokens.weight[[3, 0, 3]])
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 4, 16, generator=g)
    with torch.no_grad():
        want = model.lm_head(model.model.norm(h))[0]
    got = runner.logits(h)
    assert got.shape == (4, V)
    torch.testing.assert_close(got, want, **CLOSE)


# ---------------------------------------------------------------- the forward against HF


CONFIGS = {
    "llama-gqa": ("llama", {}),
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "llama-mqa-eps": ("llama", {"num_key_value_heads": 1, "rms_norm_eps": 0.3}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 8, "rms_norm_eps": 0.2}),
    "qwen3-mha": ("qwen3", {"head_dim": 8, "num_key_value_heads": 4}),
    "llama-mlp-bias-tied": ("llama", {"mlp_bias": True, "attention_bias": True, "tie_word_embeddings": True}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_steps_and_verifies_match_hf(name):
    kind, overrides = CONFIGS[name]
    model = tiny(kind, **overrides)
    runner = lean_runner(model)
    ids = [3, 1, 4, 1, 5, 9 % V, 2, 6]
    ref = full(model, ids + [7, 0, 11, 8, 2, 2])
    cache = runner.new_cache()
    out = runner.step(ids[:5], cache, 0, keep=5)  # a prefill: plain causal attention
    assert out.shape == (5, V)
    torch.testing.assert_close(out, ref[:5], **CLOSE)
    torch.testing.assert_close(runner.step(ids[5:6], cache, 5, keep=1), ref[5:6], **CLOSE)  # one token
    torch.testing.assert_close(runner.step(ids[6:8], cache, 6, keep=2), ref[6:8], **CLOSE)  # a verify after a past
    out = runner.step([7, 0, 11, 8], cache, 8, keep=3)
    assert out.shape == (3, V)
    torch.testing.assert_close(out, ref[9:12], **CLOSE)
    cache.crop(10)  # a rollback: 8 and 2 replaced by 5, 5
    torch.testing.assert_close(runner.step([5, 5], cache, 10, keep=2), full(model, ids + [7, 0, 5, 5])[-2:], **CLOSE)
    assert cache.lengths == [12, 12]


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3"])
def test_run_without_a_cache_is_a_plain_causal_forward(name):
    kind, overrides = CONFIGS[name]
    model = tiny(kind, **overrides)
    runner = lean_runner(model)
    ids = [1, 2, 3, 4, 5, 6]
    hidden = runner.run(runner.embed(ids), range(runner.n_layers), None, 0)
    torch.testing.assert_close(runner.logits(hidden), full(model, ids), **CLOSE)
    torch.testing.assert_close(runner.forward(ids, range(2), None, 0, keep=2), full(model, ids)[-2:], **CLOSE)
    torch.testing.assert_close(runner.forward([4], range(2), None, 0), full(model, [4]), **CLOSE)
    with pytest.raises(ValueError, match="without a cache there is no past"):
        runner.run(runner.embed(ids), range(2), None, 3)


def test_run_over_a_subset_of_layers_writes_only_those():
    model = tiny("llama", num_hidden_layers=3)
    runner = lean_runner(model)
    cache = runner.new_cache()
    ids = [2, 7, 1, 8]
    hidden = runner.run(runner.embed(ids), [0, 2], cache, 0)
    assert cache.lengths == [4, 0, 4]
    # the reference: HF's layers 0 and 2 only
    with torch.no_grad():
        pos = torch.arange(4)[None]
        cos, sin = model.model.rotary_emb(torch.zeros(1, 1, 16), position_ids=pos)
        h = model.model.embed_tokens(torch.tensor([ids]))
        for i in (0, 2):
            h = model.model.layers[i](h, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
            h = h[0] if isinstance(h, tuple) else h
    torch.testing.assert_close(hidden, h, **CLOSE)


def test_with_mlps_replaces_the_given_layers_mlps_only():
    model = tiny("llama")
    runner = lean_runner(model)

    class Half(torch.nn.Module):
        def forward(self, x):
            return 0.5 * x

    half = Half()
    other = runner.with_mlps({1: half})
    assert other.blocks[1].mlp is half and other.blocks[0].mlp is None and runner.blocks[1].mlp is None
    assert other.blocks[0] is runner.blocks[0] and other.cos is runner.cos
    ids = [5, 3, 1, 2]
    original = model.model.layers[1].mlp
    model.model.layers[1].mlp = half
    try:
        want = full(model, ids)
    finally:
        model.model.layers[1].mlp = original
    torch.testing.assert_close(other.step(ids, other.new_cache(), 0, keep=4), want, **CLOSE)
    torch.testing.assert_close(runner.step(ids, runner.new_cache(), 0, keep=4), full(model, ids), **CLOSE)  # unchanged


def test_with_weights_converts_every_matrix_and_shares_the_rest():
    model = tiny("qwen2")
    runner = lean_runner(model)
    converted = {}

    def convert(w):
        out = w * 2
        converted[id(out)] = w
        return out

    other = runner.with_weights(convert)
    for new, old in zip(other.blocks, runner.blocks):
        for name in ("qkv_w", "o_w", "gate_up_w", "down_w"):
            assert converted[id(getattr(new, name))] is getattr(old, name)
        for name in ("ln1", "ln2", "qkv_b", "q_norm", "o_b", "gate_up_b", "down_b"):
            assert getattr(new, name) is getattr(old, name)
    assert converted[id(other.head_w)] is runner.head_w
    assert other.embed_w is runner.embed_w and other.norm_w is runner.norm_w
    assert len(converted) == 4 * 2 + 1
    torch.testing.assert_close(runner.step([1, 2], runner.new_cache(), 0, keep=2), full(model, [1, 2]), **CLOSE)  # unchanged


@pytest.mark.skipif(smallbatch.kernel_name() != "fused", reason="the fused kernel is not built here")
def test_streamed_keeps_the_matrices_in_bfloat16():
    model = tiny("llama")
    runner = lean_runner(model)
    draft = runner.streamed()
    assert draft.head_w.dtype == torch.bfloat16 and all(b.qkv_w.dtype == torch.bfloat16 for b in draft.blocks)
    assert draft.embed_w.dtype == torch.float32 and runner.head_w.dtype == torch.float32
    ids = [4, 4, 2, 9]
    torch.testing.assert_close(draft.step(ids, draft.new_cache(), 0, keep=4), full(model, ids), rtol=0.05, atol=0.05)


def test_rows_of_a_batch_match_each_row_alone():
    """B = 2 with per-row RoPE and masks (train/generate.py's layout): each row as its own single-row forward."""
    for name in ("llama-gqa", "llama-mha"):
        kind, overrides = CONFIGS[name]
        model = tiny(kind, **overrides)
        runner = lean_runner(model)
        rows = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2]]
        step = [[6], [8]]
        cache = runner.new_cache(rows=2)
        runner.rope(0, 8)
        positions = torch.arange(5)[None].repeat(2, 1)
        cos, sin = runner.cos[positions][:, :, None], runner.sin[positions][:, :, None]
        mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None].repeat(2, 1, runner.n_rep, 1)  # [B, 1, n_rep S, S]
        h = torch.nn.functional.embedding(torch.tensor(rows), runner.embed_w)
        for i in range(runner.n_layers):
            h = runner.layer(i, h, cache, 0, cos, sin, mask)
        torch.testing.assert_close(runner.logits(h[:1]), full(model, rows[0]), **CLOSE)
        torch.testing.assert_close(runner.logits(h[1:]), full(model, rows[1]), **CLOSE)
        h = torch.nn.functional.embedding(torch.tensor(step), runner.embed_w)  # one more token each, at position 5
        cos, sin = runner.cos[5:6][None, :, None].repeat(2, 1, 1, 1), runner.sin[5:6][None, :, None].repeat(2, 1, 1, 1)
        mask = torch.ones(2, 1, runner.n_rep, 6, dtype=torch.bool)
        for i in range(runner.n_layers):
            h = runner.layer(i, h, cache, 5, cos, sin, mask)
        torch.testing.assert_close(runner.logits(h[:1]), full(model, rows[0] + [6])[-1:], **CLOSE)
        torch.testing.assert_close(runner.logits(h[1:]), full(model, rows[1] + [8])[-1:], **CLOSE)


def test_decoder_layer_is_differentiable_outside_inference_mode():
    model = tiny("llama").requires_grad_(True)
    runner = lean_runner(model)
    b = runner.blocks[0]
    h = runner.embed([1, 2, 3]).clone().requires_grad_(True)
    cos, sin = runner.rope(0, 3)
    out = decoder_layer(b, runner.shape, h, None, 0, 0, cos, sin, None)
    out.sum().backward()
    assert h.grad is not None and model.model.layers[0].mlp.down_proj.weight.grad is not None


def test_bfloat16_matches_hf():
    model = tiny("qwen3", head_dim=8).to(torch.bfloat16)
    runner = lean_runner(model)
    assert runner.dtype == torch.bfloat16
    ids = [5, 3, 9, 1, 4, 1]
    cache = runner.new_cache()
    assert cache.dtype == torch.bfloat16
    out = runner.step(ids, cache, 0, keep=6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, full(model, ids), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(runner.step([7, 8], cache, 6, keep=2), full(model, ids + [7, 8])[-2:], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["llama-gqa", "llama-mha"])
def test_the_attention_scale_is_the_models_own(name):
    """The runner takes the scale from the model's attention (head_dim ** -0.5 in every family here, which SDPA
    would also default to): one set otherwise is followed in every attention branch, as HF's forward follows it."""
    kind, overrides = CONFIGS[name]
    model = tiny(kind, **overrides)
    for layer in model.model.layers:
        layer.self_attn.scaling = 0.9
    runner = lean_runner(model)
    assert runner.scale == 0.9
    ids = [3, 1, 4, 1, 5, 9 % V, 2]
    ref = full(model, ids)
    cache = runner.new_cache()
    torch.testing.assert_close(runner.step(ids[:4], cache, 0, keep=4), ref[:4], **CLOSE)  # prefill: plain causal
    torch.testing.assert_close(runner.step(ids[4:5], cache, 4, keep=1), ref[4:5], **CLOSE)  # one token
    torch.testing.assert_close(runner.step(ids[5:], cache, 5, keep=2), ref[5:], **CLOSE)  # a verify after a past


def test_fuse_rows_after_one_module_got_new_weights_copies_again():
    """Loading new weights into one module after a fusion replaces its parameter: a new fusion must read it,
    not the old tensor the others still view."""
    ms = linears(3, 2, 4)
    old = fuse_rows(ms, "weight")
    fresh = torch.nn.Parameter(torch.full((2, 5), 7.0), requires_grad=False)
    ms[1].weight = fresh  # the same shape and numel as the view it replaces
    want = torch.cat([ms[0].weight, fresh, ms[2].weight]).clone()
    w = fuse_rows(ms, "weight")
    assert torch.equal(w, want) and w.data_ptr() != old.data_ptr()
    assert torch.equal(ms[1].weight, torch.full((2, 5), 7.0))


def test_fuse_rows_of_adjacent_but_strided_parameters_copies():
    """Two [2, 2] parameters over elements 0..3 and 4..7 of one storage, the second column-major: adjacent in
    memory, but only a copy stacks their rows correctly."""
    storage = torch.arange(8.0)
    a, b = torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False)
    a.weight = torch.nn.Parameter(storage.as_strided((2, 2), (2, 1), 0), requires_grad=False)
    b.weight = torch.nn.Parameter(storage.as_strided((2, 2), (1, 2), 4), requires_grad=False)  # [[4, 6], [5, 7]]
    w = fuse_rows([a, b], "weight")
    assert torch.equal(w, torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, 6.0], [5.0, 7.0]]))


class NoWeightNorm(torch.nn.Module):
    """Has a variance_epsilon but no weight attribute at all."""

    variance_epsilon = 1e-6


def delete(obj, name):
    delattr(obj, name)


MISSING = [  # (an attribute removed from a supported Llama, the reason unsupported gives): no AttributeError
    (lambda m: delete(m.model, "norm"), "unexpected module layout"),
    (lambda m: delete(m.model, "rotary_emb"), "unexpected module layout"),
    (lambda m: delete(m.model.rotary_emb, "rope_type"), "rope type None"),
    (lambda m: delete(m.model.layers[1], "self_attn"), "non-standard linear layers"),
    (lambda m: delete(m.model.layers[1], "mlp"), "non-standard linear layers"),
    (lambda m: delete(m.model.layers[0].self_attn, "q_proj"), "non-standard linear layers"),
    (lambda m: swap(m.model.layers[0], "input_layernorm", NoWeightNorm()), "unexpected norm layers"),
]


@pytest.mark.parametrize("change, reason", MISSING, ids=[f"{i}-{reason}" for i, (_, reason) in enumerate(MISSING)])
def test_unsupported_says_why_when_an_attribute_is_missing(change, reason):
    model = tiny("llama")
    change(model)
    assert unsupported(model) == reason


def test_unsupported_of_objects_that_are_not_models():
    assert unsupported(object()) == "object (None) is not a Llama/Qwen2/Qwen3/Mistral decoder"

    class ConfigOnly:  # a llama config, no modules at all
        config = LlamaConfig()

    assert unsupported(ConfigOnly()) == "unexpected module layout"


def test_a_mistral_config_without_a_sliding_window_field_is_supported():
    model = tiny("llama")
    model.config.model_type = "mistral"  # a LlamaConfig has no sliding_window attribute
    assert not hasattr(model.config, "sliding_window")
    assert unsupported(model) is None
