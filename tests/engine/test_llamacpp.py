"""The llama.cpp engine (engine/llamacpp.py) on tiny GGUF files written from tiny torch Llamas: logits, KV rollback,
greedy identity, the distribution tests with their negative controls, the modes it runs and refuses."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from support.exact import ALPHA, assert_drafted_up_to, PROMPT, run, sample_and_fit, SAMPLING_CASES
from support.broken import ResampleFromP
from support.gguf import write_gguf
from specchat.engine.drafters import ModeUnavailable, TORCH_ONLY, build_drafter
from specchat.engine.drafters.gguf import GGUFDrafter
from specchat.engine.drafters.lookup import LookupDrafter
from specchat.engine.drafters.plain import PlainDecoding
from specchat.engine.llamacpp import GGUFModel, LlamaTargetState, quantize
from specchat.engine.sampling import SamplingParams

VOCAB = 12


def llama(seed: int, *, hidden: int = 32, layers: int = 2, sharpen: float = 4.0, vocab: int = VOCAB) -> LlamaForCausalLM:
    """A random Llama whose matrices have rows of 32 (llama.cpp's quantisation blocks), peaked like a real model."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model


@pytest.fixture(scope="module")
def torch_target():
    return llama(0)


@pytest.fixture(scope="module")
def gguf_target(torch_target, tmp_path_factory):
    return GGUFModel(write_gguf(torch_target, tmp_path_factory.mktemp("gguf") / "target.gguf"))


@pytest.fixture(scope="module")
def gguf_rough_draft(torch_target, tmp_path_factory):
    """The target over-confident (its LM head doubled): it agrees often enough to reach every draft position, and
    its q differs from p, so a rejection's residual differs from p (resampling from p shows)."""
    draft = llama(0)
    with torch.no_grad():
        draft.lm_head.weight.mul_(2.0)
    return GGUFModel(write_gguf(draft, tmp_path_factory.mktemp("gguf") / "rough.gguf"))


@pytest.fixture(scope="module")
def gguf_other_draft(tmp_path_factory):
    """Another random model: it disagrees with the target often."""
    return GGUFModel(write_gguf(llama(1), tmp_path_factory.mktemp("gguf") / "other.gguf"))


def torch_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]  # [S, V]


# ---------------------------------------------------------------- the TargetState


def test_logits_match_the_torch_model_the_file_was_written_from(torch_target, gguf_target):
    """The GGUF writer and the engine agree with transformers: prefill's last position and a verify's K+1 rows."""
    state = LlamaTargetState(gguf_target)
    prompt, drafts = [3, 1, 4, 1, 5], [9, 2, 6]
    assert state.start(prompt) == len(prompt)
    logits = state.verify(drafts)  # [K+1, V]
    ref = torch_logits(torch_target, prompt + drafts)[len(prompt) - 1 :]
    assert logits.shape == (4, VOCAB)
    torch.testing.assert_close(logits, ref, atol=2e-3, rtol=1e-3)


def test_commit_rolls_the_kv_cache_back(torch_target, gguf_target):
    """After a rejection the cache holds exactly tokens[:-1]; the next verify sees only the kept tokens."""
    state = LlamaTargetState(gguf_target)
    state.start([3, 1, 4])
    state.verify([7, 7, 7, 7])  # the cache now holds 3 + 4 positions
    state.commit([7, 2])  # one draft kept, then a replacement
    assert state.cache.length == len(state.tokens) - 1 == 4
    logits = state.verify([5])
    ref = torch_logits(torch_target, [3, 1, 4, 7, 2, 5])[-2:]
    torch.testing.assert_close(logits, ref, atol=2e-3, rtol=1e-3)


def test_start_reuses_the_cached_prefix(torch_target, gguf_target):
    state = LlamaTargetState(gguf_target)
    assert state.start([1, 2, 3, 4]) == 4
    state.commit([5])
    assert state.start([1, 2, 3, 4, 5, 6, 7]) == 3  # 1-4 cached: 5 (pending), 6 and 7 fed
    assert state.start([1, 2, 9]) == 0  # crops back to the common prefix [1, 2]; 9 stays pending for the first verify
    torch.testing.assert_close(state.verify([])[-1], torch_logits(torch_target, [1, 2, 9])[-1], atol=2e-3, rtol=1e-3)


def test_threads_follow_torch_per_call(gguf_target):
    state = LlamaTargetState(gguf_target)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        state.start([1, 2, 3])
        assert state.cache.threads == 2
        torch.set_num_threads(1)
        state.verify([4])
        assert state.cache.threads == 1
    finally:
        torch.set_num_threads(before)


def test_a_prompt_longer_than_one_batch_is_fed_in_chunks(tmp_path):
    """llama_decode takes N_BATCH positions at a time; the prefill's last logits still match one forward."""
    from specchat.engine import llamacpp

    model = llama(2, vocab=VOCAB)
    model.config.max_position_embeddings = 2048
    gguf = GGUFModel(write_gguf(model, tmp_path / "long.gguf"))
    prompt = [i % VOCAB for i in range(llamacpp.N_BATCH + 40)]
    state = LlamaTargetState(gguf)
    state.start(prompt)
    torch.testing.assert_close(state.head[0], torch_logits(model, prompt)[-1], atol=2e-3, rtol=1e-3)


# ---------------------------------------------------------------- greedy identity


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_greedy_speculation_matches_plain_greedy_on_llama_cpp(torch_target, gguf_target, gguf_other_draft, k):
    """Against llama.cpp's own plain greedy decoding and against transformers' generate on the same weights."""
    prompt = [3, 1, 4, 1, 5]
    plain, _ = run(gguf_target, PlainDecoding(), prompt, k=k, params=SamplingParams(0), max_new_tokens=48)
    out, records = run(gguf_target, GGUFDrafter(gguf_other_draft), prompt, k=k, params=SamplingParams(0), max_new_tokens=48)
    ref = torch_target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=48, min_new_tokens=48)
    assert out == plain == ref[0, len(prompt) :].tolist()
    assert sum(r.drafted - r.accepted for r in records) > 0  # the draft really disagreed sometimes


def test_greedy_self_draft_accepts_everything(gguf_target):
    out, records = run(gguf_target, GGUFDrafter(gguf_target), PROMPT, k=4, params=SamplingParams(0), max_new_tokens=30)
    plain, _ = run(gguf_target, PlainDecoding(), PROMPT, k=4, params=SamplingParams(0), max_new_tokens=30)
    assert out == plain
    full = [r for r in records if r.drafted == 4]
    assert full and all(r.accepted == 4 and r.tokens[-1].kind == "bonus" for r in full)


def test_self_draft_at_temperature_accepts_with_probability_one(gguf_target):
    """The target drafting for itself at T=0.7: q = p at every position, so every acceptance probability is 1
    (a q warped at another temperature would still be exact, but would waste drafts)."""
    _, records = run(gguf_target, GGUFDrafter(gguf_target), PROMPT, k=4, params=SamplingParams(0.7), max_new_tokens=30, seed=1)
    probs = [t.accept_prob for r in records for t in r.tokens if t.kind == "accepted"]
    assert len(probs) >= 20 and min(probs) > 0.999, probs


# ---------------------------------------------------------------- distributions

DRAWS = 1000


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
@pytest.mark.slow
def test_sampled_output_matches_the_target_distribution(gguf_target, gguf_rough_draft, case):
    """K=3, draws of K+1 tokens, position by position against llama.cpp's own exact conditionals."""
    fit, stats = sample_and_fit(gguf_target, GGUFDrafter(gguf_rough_draft), SAMPLING_CASES[case], k=3, draws=DRAWS)
    assert_drafted_up_to(stats, 3)
    assert len(fit.positions) == 4 and fit.passed(ALPHA), fit


@pytest.mark.slow
def test_the_distribution_test_fails_on_a_broken_rule(gguf_target, gguf_rough_draft):
    """The negative control on this engine: resampling from p instead of the residual is caught by far."""
    fit, stats = sample_and_fit(gguf_target, GGUFDrafter(gguf_rough_draft), SAMPLING_CASES["t0.7-topk5"], k=3, draws=DRAWS,
                                rule=ResampleFromP())
    assert_drafted_up_to(stats, 3)
    assert fit.p_value < 1e-6, fit


@pytest.mark.slow
def test_lookup_is_exact_on_llama_cpp(gguf_target):
    """A deterministic drafter (one-hot q): with 1-token matches it drafts whenever a token repeats one of the prompt."""
    from support.exact import fit_to_target, sample_joint
    from specchat.engine.metrics import Stats

    params, stats = SamplingParams(1.0), Stats()
    counts = sample_joint(gguf_target, LookupDrafter(min_ngram=1, max_ngram=1), params, k=2, draws=DRAWS, length=4, stats=stats)
    fit = fit_to_target(gguf_target, counts, params, 4)
    assert stats.num_draft_tokens > 200 and stats.num_accepted_tokens > 0, stats.summary()
    assert fit.passed(ALPHA), fit


# ---------------------------------------------------------------- modes


def test_modes_that_need_torch_say_why(gguf_target):
    for mode in TORCH_ONLY:
        with pytest.raises(ModeUnavailable, match="needs the torch engine"):
            build_drafter(mode, gguf_target)


def test_draft_mode_needs_both_models_on_llama_cpp(gguf_target, gguf_other_draft, torch_target):
    assert isinstance(build_drafter("draft", gguf_target, gguf_other_draft), GGUFDrafter)
    with pytest.raises(ModeUnavailable, match="same engine"):
        build_drafter("draft", gguf_target, torch_target)


def test_quant_drafts_with_a_smaller_quantisation_of_the_target(tmp_path, torch_target, gguf_target):
    """llama.cpp's quantizer writes a Q8_0 copy of the float32 target; greedy drafts from it stay exact."""
    small = tmp_path / "target.Q8_0.gguf"
    quantize(gguf_target.path, small, "Q8_0")
    assert GGUFModel(small).dtype == "Q8_0"
    drafter = build_drafter("quant", gguf_target, quant_gguf=str(small))
    assert drafter.name == "quant"
    out, records = run(gguf_target, drafter, PROMPT, k=4, params=SamplingParams(0), max_new_tokens=40)
    plain, _ = run(gguf_target, PlainDecoding(), PROMPT, k=4, params=SamplingParams(0), max_new_tokens=40)
    assert out == plain
    assert sum(r.accepted for r in records) / sum(r.drafted for r in records) > 0.9  # a close copy agrees


def test_auto_on_llama_cpp_chooses_among_the_modes_it_can_run(gguf_target, gguf_other_draft):
    auto = build_drafter("auto", gguf_target, gguf_other_draft)
    assert set(auto.candidates) == {"off", "suffix", "draft"}
    out, records = run(gguf_target, auto, PROMPT, k=3, params=SamplingParams(0), max_new_tokens=60)
    plain, _ = run(gguf_target, PlainDecoding(), PROMPT, k=3, params=SamplingParams(0), max_new_tokens=60)
    assert out == plain
    assert {r.mode for r in records} >= {"off", "draft"}


# ---------------------------------------------------------------- a session on llama.cpp


@pytest.fixture(scope="module")
def gguf_loaded(tmp_path_factory):
    """A tiny GGUF with the tests' word-level tokenizer, as models.load_model returns it for the llama.cpp engine."""
    from support.models import tiny_tokenizer
    from specchat.models import LoadedModel

    tokenizer = tiny_tokenizer()
    path = write_gguf(llama(3, vocab=len(tokenizer)), tmp_path_factory.mktemp("gguf") / "chat.gguf", eos_id=tokenizer.eos_token_id)
    return LoadedModel(GGUFModel(path), tokenizer, "chat.gguf")


def test_a_session_runs_auto_on_llama_cpp_and_says_which_engine(gguf_loaded):
    from specchat.engine.drafters.auto import AutoDrafter
    from specchat.export import session_data
    from specchat.session import Session

    session = Session(gguf_loaded, mode="auto", sampling=SamplingParams(0.7), seed=1, max_new_tokens=24)
    assert isinstance(session.state, LlamaTargetState) and session.info.engine == "llama.cpp" and session.info.dtype == "F32"
    auto = session.controls.drafter
    assert isinstance(auto, AutoDrafter) and {"off", "suffix", "quant"} <= set(auto.candidates)  # quant: a Q4_0 copy of an F32 file
    rounds = list(session.reply("hello world hello world"))
    assert rounds and session.turns[-1].reply_ids == [t.id for r in rounds for t in r.tokens]
    assert session.eos_ids == {gguf_loaded.tokenizer.eos_token_id}
    with pytest.raises(ModeUnavailable, match="needs the torch engine"):
        session.set_mode("layerskip")
    assert session_data(session)["config"]["engine"] == "llama.cpp"


def test_auto_leaves_quant_out_for_a_file_of_4_bits_or_fewer(tmp_path, gguf_target):
    """Mode quant by hand still runs (a Q2_K copy); auto does not try it (README, Engines: it cannot pay)."""
    from specchat.session import drafter_options

    small = tmp_path / "q4.gguf"
    quantize(gguf_target.path, small, "Q4_0")
    q4 = GGUFModel(small)
    assert "quant_gguf" not in drafter_options(q4, "auto", {})
    by_hand = drafter_options(q4, "quant", {})["quant_gguf"]
    assert GGUFModel(by_hand).dtype in ("Q2_K", "Q4_0", "Q5_0", "Q8_0", "F16")  # k-quants fall back for narrow rows
