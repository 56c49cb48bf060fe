"""Mode `layerskip`: greedy identity with HF generate, the distribution test (with its broken-rule control),
tuned defaults, unsupported models, and the default model."""

import pytest
import torch

from support.exact import chat_ids, SMOL_PROMPTS
from specchat.engine.drafters import ModeUnavailable, build_drafter
from specchat.engine.drafters.layerskip import LayerSkipDrafter, builtin_skip
from specchat.engine.loop import Controls, generate
from specchat.engine.sampling import SamplingParams
from specchat.engine.target import TargetState
from specchat.session import drafter_options
from specchat.store import save_tuned
from support.exact import check_mode_distribution, PROMPT, run


@pytest.mark.parametrize("skip", [[1], [0, 2], [3]])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_matches_hf_generate(deep_target, skip, k):
    prompt = [3, 1, 4, 1, 5]
    ref = deep_target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40, min_new_tokens=40)
    drafter = build_drafter("layerskip", deep_target, skip_layers=skip)
    out, records = run(deep_target, drafter, prompt, k=k, params=SamplingParams(0), max_new_tokens=40)
    assert out == ref[0, len(prompt) :].tolist()
    assert sum(r.drafted for r in records) > 0


def test_draft_cache_stays_in_sync(deep_target):
    """The draft cache covers what it fed itself; the target cache (filled by this drafter's verify) holds tokens[:-1]."""
    drafter = LayerSkipDrafter.build(deep_target, skip_layers=[1])
    state = TargetState(deep_target)
    controls = Controls(drafter, k=4, sampling=SamplingParams(1.0))
    gen = torch.Generator().manual_seed(0)
    for _ in generate(state, PROMPT, controls, max_new_tokens=30, eos_ids=set(), generator=gen):
        assert drafter.cache.layers[0].get_seq_length() == len(drafter.cached)
        assert drafter.cache.layers[1].get_seq_length() == 0  # the skipped layer never gets entries
        assert {layer.get_seq_length() for layer in state.cache.layers} == {len(state.tokens) - 1}  # its verify's cache
    assert drafter.extra_bytes > 0


# Each setting draws K+1 = 4 tokens per sample, so the first round drafts positions 1..3 and may earn the bonus,
# and is tested position by position against the target's exact conditionals. The rough target's drafts disagree
# often (many residual draws: resampling from p shows); the deep target's agree more (~0.7-0.8 per position), so
# draft position 3 is reached and judged often enough that a q wrong only from position 3 on shows.
SETTINGS = {  # name: (target fixture, sampling case, skipped layers)
    "rough, t0.7-topk5": ("rough_target", "t0.7-topk5", [1, 2]),
    "deep, t0.7-topk5": ("deep_target", "t0.7-topk5", [1, 2]),
}


DRAWS = {"rough, t0.7-topk5": 600, "deep, t0.7-topk5": 1000}  # the fewest at which the control fails far below 1e-6


@pytest.mark.parametrize("setting, bug", [
    ("rough, t0.7-topk5", None),
    ("rough, t0.7-topk5", "resample from p"),  # control; measured p = 1.7e-34 at 1000 draws, 2.1e-16 at 600
    ("deep, t0.7-topk5", None),
    ("deep, t0.7-topk5", "q at the wrong temperature from position 3"),  # control; p = 4.9e-12 at 1000, 2.6e-6 at 600
])
@pytest.mark.slow
def test_sampled_output_matches_target_distribution(request, record_property, setting, bug):
    """K=3 with draws of K+1 tokens; each broken control must fail at the same settings as its exact run."""
    fixture, case, skip = SETTINGS[setting]
    target = request.getfixturevalue(fixture)
    drafter = build_drafter("layerskip", target, skip_layers=skip)
    check_mode_distribution(target, drafter, case, bug, draws=DRAWS[setting], record_property=record_property)


def test_default_skip_set_tuned_then_builtin(deep_target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    def build(**options):
        return LayerSkipDrafter.build(deep_target, **drafter_options(deep_target, "layerskip", options))

    assert build().skip_layers == builtin_skip(4)
    save_tuned(deep_target, "layerskip", {"skip_layers": [0, 3], "k": 3})
    assert build().skip_layers == [0, 3]
    assert build(skip_layers=[2]).skip_layers == [2]  # --skip-layers wins


def test_unavailable_cases(deep_target):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=12, n_embd=16, n_layer=2, n_head=2))
    with pytest.raises(ModeUnavailable, match="not supported"):
        build_drafter("layerskip", gpt2)
    with pytest.raises(ModeUnavailable, match="out of range"):
        build_drafter("layerskip", deep_target, skip_layers=[7])
    with pytest.raises(ModeUnavailable, match="every layer"):
        build_drafter("layerskip", deep_target, skip_layers=[0, 1, 2, 3])


@pytest.mark.slow
@pytest.mark.parametrize("prompt", SMOL_PROMPTS)
def test_default_model_greedy_matches_hf_generate(smol, smol_greedy, prompt):  # noqa: F811
    ids = chat_ids(smol, prompt)
    ref = smol_greedy(ids, 24)
    drafter = build_drafter("layerskip", smol.model, skip_layers=[12, 20])
    state = TargetState(smol.model)
    records = list(generate(state, ids, Controls(drafter, k=4, sampling=SamplingParams(0)), max_new_tokens=24,
                            eos_ids={smol.model.generation_config.eos_token_id}))
    assert [t.id for r in records for t in r.tokens] == ref
    assert sum(r.accepted for r in records) > 0


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_architectures_greedy_matches_hf_generate(arch):
    """Qwen2 (attention biases) and Mistral run through the same layer-by-layer path; a sliding window does not."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM)}[arch]
    torch.manual_seed(0)
    config = config_cls(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                        num_key_value_heads=1, max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
                        pad_token_id=None, tie_word_embeddings=False, sliding_window=None)
    model = model_cls(config).eval().requires_grad_(False)
    prompt = [3, 1, 4, 1, 5]
    ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=30, min_new_tokens=30)[0, len(prompt) :].tolist()
    for mode, opts in (("layerskip", {"skip_layers": [1]}), ("earlyexit", {"exit_layer": 2})):
        out, _ = run(model, build_drafter(mode, model, **opts), prompt, k=3, params=SamplingParams(0), max_new_tokens=30)
        assert out == ref, (arch, mode)
    if arch == "mistral":
        config.sliding_window = 16
        with pytest.raises(ModeUnavailable, match="sliding-window"):
            build_drafter("layerskip", model_cls(config))
