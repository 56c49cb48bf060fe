"""Mode `quant` (engine/drafters/quant.py) unit by unit on tiny models: which backend `auto` picks, every refusal's
message, the bytes each backend reports (hand-worked for a 1-layer tiny Llama), what the torch.ao copy shares and
converts, the torchao path with a stand-in torchao, and the int8 draft against a reference model whose weights are
the int8 copy's. No sampling runs; the whole file takes about a second."""

from __future__ import annotations

import copy
import sys
import types
import warnings

import pytest
import torch
from transformers import DynamicCache

from support.models import tiny_llama
from specchat.engine.drafters import ModeUnavailable, build_drafter
from specchat.engine.drafters import quant
from specchat.engine.drafters.quant import QuantDrafter, _module_bytes, cpu_int8_engine, torch_ao_int8_copy, torchao_int8_copy
from specchat.engine.sampling import SamplingParams
from specchat.engine.smallbatch import Int8Weights
from specchat.engine.target import TargetState

# tiny_llama: D = 16, 2 heads of 8, 1 KV head, MLP 32, V = 12. Per layer the linears are q 16x16, k 8x16, v 8x16,
# o 16x16, gate 32x16, up 32x16, down 16x32 (7 of them, 128 output rows, 2304 weights); the LM head 12x16.
LAYER_WEIGHTS, LAYER_ROWS = 256 + 128 + 128 + 256 + 512 + 512 + 512, 16 + 8 + 8 + 16 + 32 + 32 + 16
HEAD_WEIGHTS, HEAD_ROWS = 192, 12


@pytest.fixture(scope="module")
def one_layer():
    return tiny_llama(seed=0, layers=1, initializer_range=0.1).requires_grad_(False)


class FakeCuda:
    device = torch.device("cuda")
    dtype = torch.float32


# ---------------------------------------------------------------- bytes


def test_module_bytes_counts_int8_weights_a_scale_and_zero_point_per_row_and_the_bias():
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    def qlinear(bias):
        torch.manual_seed(0)
        lin = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=bias))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return quantize_dynamic(lin, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)[0]

    assert _module_bytes(qlinear(False)) == 12 + 3 * 16  # 12 int8 weights; float64 scale + int64 zero point per row
    assert _module_bytes(qlinear(True)) == 12 + 3 * 16 + 3 * 4  # and 3 float32 biases


def test_int8_backend_bytes_are_hand_worked(one_layer):
    two = tiny_llama(seed=0, layers=2)
    d1, d2 = QuantDrafter.build(one_layer), QuantDrafter.build(two)
    assert d1.backend == d2.backend == "int8"
    # int8 weights + a float32 scale per output row: per layer 2304 + 4 * 128 = 2816, the LM head 192 + 48 = 240
    assert d1.weight_bytes == 2816 + 240 == LAYER_WEIGHTS + 4 * LAYER_ROWS + HEAD_WEIGHTS + 4 * HEAD_ROWS
    assert d2.weight_bytes == 2 * 2816 + 240
    assert d1.extra_bytes == d1.weight_bytes  # no draft cache
    state = TargetState(one_layer)
    state.start([3, 1, 4])
    d1.propose(state, 2, SamplingParams(0), None)
    assert d1.sharing and d1.cache is state.cache  # it drafted on the target's cache: still no cache of its own
    assert d1.extra_bytes == d1.weight_bytes
    hf = TargetState(one_layer, runner="hf")  # a DynamicCache the int8 runner cannot write: a KV cache of its own
    hf.start([3, 1, 4])
    d1.propose(hf, 2, SamplingParams(0), None)
    assert not d1.sharing and d1.cache is not hf.cache and d1.extra_bytes > d1.weight_bytes


def test_torch_ao_bytes_are_hand_worked_and_a_bf16_target_adds_its_norms_in_float32(one_layer):
    model, extra = torch_ao_int8_copy(one_layer)
    assert extra == LAYER_WEIGHTS + 16 * LAYER_ROWS + HEAD_WEIGHTS + 16 * HEAD_ROWS
    bf16 = copy.deepcopy(one_layer).to(torch.bfloat16)
    model, extra = torch_ao_int8_copy(bf16)
    # three RMSNorms of 16 weights (input, post-attention, final) kept in float32: 192 bytes more
    assert extra == LAYER_WEIGHTS + 16 * LAYER_ROWS + HEAD_WEIGHTS + 16 * HEAD_ROWS + 3 * 16 * 4


# ---------------------------------------------------------------- the torch.ao copy


def test_torch_ao_copy_replaces_every_linear_and_shares_the_rest(one_layer):
    before = {n: p.clone() for n, p in one_layer.named_parameters()}
    model, _ = torch_ao_int8_copy(one_layer)
    names = sorted(n for n, m in one_layer.named_modules() if isinstance(m, torch.nn.Linear))
    assert len(names) == 8
    for name in names:
        q = model.get_submodule(name)
        assert type(q).__name__ == "Linear" and type(q).__module__.startswith("torch.ao.nn.quantized"), name
        weight, bias = q._packed_params._weight_bias()
        w = one_layer.get_submodule(name).weight
        assert weight.dtype == torch.qint8 and weight.shape == w.shape and bias is None
        # per-channel: every row within half of its own step of the float weight
        assert ((weight.dequantize() - w).abs() <= weight.q_per_channel_scales()[:, None].float() / 2 + 1e-6).all(), name
    assert not model.training
    assert model.get_input_embeddings().weight is one_layer.get_input_embeddings().weight  # shared, not copied
    assert model.model.norm.weight is one_layer.model.norm.weight
    for n, p in one_layer.named_parameters():  # the target keeps its own float linears
        assert torch.equal(p, before[n]), n
    assert all(type(m) is torch.nn.Linear for n, m in one_layer.named_modules() if n in names)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    torch.testing.assert_close(model(ids).logits, one_layer(ids).logits, atol=0.1, rtol=0)


def test_torch_ao_copy_keeps_the_biases():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        qwen.model.layers[0].self_attn.q_proj.bias.normal_()
    model, extra = torch_ao_int8_copy(qwen)
    _, bias = model.model.layers[0].self_attn.q_proj._packed_params._weight_bias()
    assert torch.equal(bias, qwen.model.layers[0].self_attn.q_proj.bias)
    assert extra == LAYER_WEIGHTS + 16 * LAYER_ROWS + HEAD_WEIGHTS + 16 * HEAD_ROWS + (16 + 8 + 8) * 4  # q, k, v biases


def test_torch_ao_copy_of_a_bf16_target_runs_in_float32_and_leaves_the_target_bf16(one_layer):
    bf16 = copy.deepcopy(one_layer).to(torch.bfloat16)
    model, _ = torch_ao_int8_copy(bf16)
    norms = [model.model.layers[0].input_layernorm, model.model.layers[0].post_attention_layernorm, model.model.norm]
    for norm in norms:
        assert norm.weight.dtype == torch.float32 and not norm.weight.requires_grad
    for p in bf16.parameters():
        assert p.dtype == torch.bfloat16
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    logits = model(ids).logits
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, one_layer(ids).logits, atol=0.15, rtol=0)


def test_torch_ao_copy_silences_torch_ao_deprecation_notices(one_layer):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch_ao_int8_copy(one_layer)
    assert not [w for w in caught if issubclass(w.category, (DeprecationWarning, UserWarning))], [str(w.message) for w in caught]


# ---------------------------------------------------------------- torchao (a stand-in module)


def fake_torchao(monkeypatch):
    """A stand-in `torchao.quantization`: quantize_ rounds every Linear's weight to 1/8 in place."""
    calls = []

    class Int8WeightOnlyConfig:
        pass

    def quantize_(model, config):
        calls.append((model, config))
        assert isinstance(config, Int8WeightOnlyConfig)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.copy_((m.weight * 8).round() / 8)

    package, sub = types.ModuleType("torchao"), types.ModuleType("torchao.quantization")
    sub.Int8WeightOnlyConfig, sub.quantize_ = Int8WeightOnlyConfig, quantize_
    package.quantization = sub
    monkeypatch.setitem(sys.modules, "torchao", package)
    monkeypatch.setitem(sys.modules, "torchao.quantization", sub)
    return calls


def test_torchao_copy_quantises_a_deep_copy_and_counts_its_bytes(monkeypatch, one_layer):
    calls = fake_torchao(monkeypatch)
    before = {n: p.clone() for n, p in one_layer.named_parameters()}
    model, extra = torchao_int8_copy(one_layer)
    assert len(calls) == 1 and calls[0][0] is model and model is not one_layer
    for n, p in one_layer.named_parameters():  # quantize_ worked on the copy's own weights
        assert torch.equal(p, before[n]), n
    assert not torch.equal(model.lm_head.weight, one_layer.lm_head.weight)
    assert not model.training
    # one byte per linear weight (7 linears + LM head), plus the float32 embedding (12x16) and three norms (3x16)
    assert extra == LAYER_WEIGHTS + HEAD_WEIGHTS + (12 * 16 + 3 * 16) * 4


def test_auto_on_cuda_takes_torchao(monkeypatch, one_layer):
    fake_torchao(monkeypatch)
    target, seen = FakeCuda(), []
    monkeypatch.setattr(quant, "torchao_int8_copy", lambda model: seen.append(model) or (one_layer, 123))
    drafter = QuantDrafter.build(target)
    assert seen == [target] and drafter.model is one_layer and drafter.lean is None
    assert (drafter.backend, drafter.weight_bytes) == ("torchao", 123)


# ---------------------------------------------------------------- backend choice and refusals


def test_cpu_int8_engine_prefers_x86_then_fbgemm_then_qnnpack(monkeypatch):
    assert cpu_int8_engine() in ("x86", "fbgemm", "qnnpack")
    for engines, want in ((["qnnpack", "fbgemm", "x86"], "x86"), (["qnnpack", "fbgemm"], "fbgemm"),
                          (["onednn", "qnnpack"], "qnnpack"), (["none", "onednn"], None), ([], None)):
        monkeypatch.setattr(torch.backends, "quantized", types.SimpleNamespace(supported_engines=engines))
        assert cpu_int8_engine() == want, engines


def test_auto_picks_int8_only_for_a_float32_lean_target_with_the_kernel(monkeypatch, one_layer):
    assert QuantDrafter.build(one_layer).backend == "int8"
    assert QuantDrafter.build(one_layer, quant_backend="auto").lean is not None
    assert QuantDrafter.build(copy.deepcopy(one_layer).to(torch.bfloat16)).backend == "torch.ao"
    monkeypatch.setattr(quant, "int8_usable", lambda: False)
    d = QuantDrafter.build(one_layer)
    assert d.backend == "torch.ao" and d.lean is None and d.model is not one_layer
    monkeypatch.setattr(quant, "int8_usable", lambda: True)
    monkeypatch.setattr(quant, "unsupported", lambda target: "no lean runner here")
    assert QuantDrafter.build(one_layer).backend == "torch.ao"


def test_int8_refusals_say_why(monkeypatch, one_layer):
    with pytest.raises(ModeUnavailable) as e:
        QuantDrafter.build(copy.deepcopy(one_layer).to(torch.bfloat16), quant_backend="int8")
    assert str(e.value) == "mode 'quant' with int8 kernels needs a float32 target on the CPU, not torch.bfloat16 on cpu"
    with pytest.raises(ModeUnavailable, match="not torch.float32 on cuda"):
        QuantDrafter.build(FakeCuda(), quant_backend="int8")
    monkeypatch.setattr(quant, "int8_usable", lambda: False)
    with pytest.raises(ModeUnavailable) as e:
        QuantDrafter.build(one_layer, quant_backend="int8")
    assert str(e.value) == ("mode 'quant' with int8 kernels needs the lean runner and its kernel: "
                            "the fused kernel is not built (no C compiler, or SPECCHAT_KERNEL=torch)")
    monkeypatch.setattr(quant, "int8_usable", lambda: True)
    monkeypatch.setattr(quant, "unsupported", lambda target: "a reason")
    with pytest.raises(ModeUnavailable) as e:
        QuantDrafter.build(one_layer, quant_backend="int8")
    assert str(e.value) == "mode 'quant' with int8 kernels needs the lean runner and its kernel: a reason"


def test_torch_ao_and_torchao_refusals_say_why(monkeypatch, one_layer):
    with pytest.raises(ModeUnavailable) as e:
        QuantDrafter.build(FakeCuda(), quant_backend="torch.ao")
    assert str(e.value) == "mode 'quant': torch.ao dynamic int8 runs on CPU only, the target is on cuda"
    monkeypatch.setattr(quant, "cpu_int8_engine", lambda: None)
    with pytest.raises(ModeUnavailable) as e:
        QuantDrafter.build(one_layer, quant_backend="torch.ao")
    assert str(e.value) == "mode 'quant': this PyTorch build has no int8 CPU engine (fbgemm/x86/qnnpack)"
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(ModeUnavailable) as e:
        QuantDrafter.build(FakeCuda())
    assert str(e.value) == "mode 'quant' on cuda needs torchao for int8 weights: pip install torchao"
    assert e.value.__cause__ is None and e.value.__suppress_context__
    with pytest.raises(ModeUnavailable) as e:
        QuantDrafter.build(one_layer, quant_backend="int4")
    assert str(e.value) == "unknown quant backend 'int4'; use auto, int8, torch.ao or torchao"


def test_build_drafter_passes_the_backend_option(one_layer):
    assert build_drafter("quant", one_layer, quant_backend="torch.ao").backend == "torch.ao"
    d = build_drafter("quant", one_layer, quant_backend="torch.ao")
    assert d.lean is None and d.weight_bytes == LAYER_WEIGHTS + 16 * LAYER_ROWS + HEAD_WEIGHTS + 16 * HEAD_ROWS


# ---------------------------------------------------------------- the int8 draft is the target with int8 weights


def int8_reference(model):
    """The target with every linear's weight replaced by its int8 round trip (q * scale per row)."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(Int8Weights.of(m.weight).float())
    return ref


@pytest.mark.parametrize("runner", ["lean", "hf"])
def test_int8_draft_logits_are_those_of_the_int8_weights(one_layer, runner):
    """The draft's q is the softmax of a model whose weights are the int8 ones, position after position. On the lean
    runner it reads the target's float32 keys and values for the context (the target's cache, shared) and its own
    for the positions it drafts; on HF's path it keeps a cache of its own, all int8. The target is left as it was."""
    drafter = QuantDrafter.build(one_layer)
    assert drafter.model is one_layer  # the lean int8 runner drafts; the target verifies
    ref = int8_reference(one_layer)
    state = TargetState(one_layer, runner=runner)
    state.start([3, 1, 4, 1, 5])
    proposal = drafter.propose(state, 4, SamplingParams(1.0), torch.Generator().manual_seed(0))
    assert proposal.calls == 4 and len(proposal.ids) == 4 and drafter.sharing == (runner == "lean")
    cache = DynamicCache(config=one_layer.config)
    with torch.no_grad():  # the context's entries: the target's own (shared) or the int8 model's
        (one_layer if runner == "lean" else ref)(torch.tensor([[3, 1, 4, 1]]), past_key_values=cache, use_cache=True)
    feed = [5]
    for j in range(4):
        with torch.no_grad():
            want = torch.softmax(ref(torch.tensor([feed]), past_key_values=cache, use_cache=True).logits[0, -1], -1)
        torch.testing.assert_close(proposal.q[j], want, atol=2e-5, rtol=1e-4)
        feed = [int(proposal.ids[j])]
    # and not the float32 target's own (the int8 rounding is visible in q)
    with torch.no_grad():
        fp32 = torch.softmax(one_layer(torch.tensor([[3, 1, 4, 1, 5]])).logits[0, -1], -1)
    assert (proposal.q[0] - fp32).abs().max() > 1e-5


@pytest.mark.parametrize("after", ["prefill", "round"])
def test_drafting_on_the_target_cache_leaves_the_verify_unchanged(one_layer, after):
    """The int8 copy writes its keys and values into the target's cache, at the pending token's position and the
    drafts': the verify that follows must give bit for bit the logits a cache the draft never touched gives, right
    after a prefill (the cache then holds the pending token too) and between rounds."""
    drafter = QuantDrafter.build(one_layer)
    shared, clean = TargetState(one_layer), TargetState(one_layer)
    for state in (shared, clean):
        state.start([3, 1, 4, 1, 5])
        if after == "round":
            state.verify([])
            state.commit([9])
    context = shared.past if after == "round" else shared.past - 1  # the positions the draft must not write
    before = [(k[:, :, :context].clone(), v[:, :, :context].clone()) for k, v in zip(shared.cache.keys, shared.cache.values)]
    proposal = drafter.propose(shared, 3, SamplingParams(0), None)
    assert drafter.sharing and len(proposal.ids) == 3
    assert max(shared.cache.lengths) == context + 3  # it wrote the pending token's position and two drafts'
    for (k0, v0), k, v in zip(before, shared.cache.keys, shared.cache.values):
        assert torch.equal(k[:, :, :context], k0) and torch.equal(v[:, :, :context], v0)
    drafts = proposal.ids.tolist()
    if after == "prefill":
        assert shared.head is None  # the draft pass took the pending token's position: the verify feeds it again
        clean.rewind()
    assert torch.equal(shared.verify(drafts), clean.verify(drafts))
