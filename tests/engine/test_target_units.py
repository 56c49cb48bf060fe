"""engine/target.py one method at a time on a tiny two-layer Llama: TargetState's choice of runner, its past and
kernel, start's reuse of the cached prefix (and its clean-up after a failed prefill), verify, commit, rewind, and
the features it records for the draft head. Logits are checked against the model's own uncached forward; the
features against one lean prefill of the same tokens. The whole file runs in a couple of seconds."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM

from support.models import counting, tiny_llama, TINY_VOCAB
from specchat.engine import smallbatch
from specchat.engine.cache import CHUNK, KVCache
from specchat.engine import target
from specchat.engine.target import TargetState

CLOSE = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=7, layers=2).requires_grad_(False)


@pytest.fixture(scope="module")
def sliding():
    """A model the lean runner does not take (a sliding window): always the HF path."""
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=TINY_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, sliding_window=64, max_position_embeddings=96, bos_token_id=None,
                           eos_token_id=None, pad_token_id=None)
    return MistralForCausalLM(config).eval().requires_grad_(False)


def full(model, ids: list[int]) -> torch.Tensor:
    """The model's own logits for every position of ids, no cache: [S, V]."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def features_of(state: TargetState, ids: list[int]) -> torch.Tensor:
    """The last layer's output (before the final norm) of every position of ids, from one fresh prefill: [S, D]."""
    lean = state.lean
    return lean.run(lean.embed(ids), range(lean.n_layers), lean.new_cache(), 0)[0]


def lengths(state: TargetState) -> set[int]:
    return {layer.get_seq_length() for layer in state.cache.layers}


# ---------------------------------------------------------------- construction


def test_auto_and_lean_take_the_lean_runner_for_a_llama(model):
    for runner in ("auto", "lean"):
        state = TargetState(model, runner=runner)
        assert state.runner == "lean" and state.lean is not None and isinstance(state.cache, KVCache)
        assert state.cache.n_kv_heads == 1 and len(state.cache.lengths) == 2
    state = TargetState(model)  # the default is auto
    assert state.runner == "lean" and isinstance(state.cache, KVCache)
    assert state.tokens == [] and state.head is None and state.features is None and state.known == 0
    assert state.vocab_size == TINY_VOCAB and state.context_len == 128 and state.past == 0
    assert state.device == torch.device("cpu") and state.model is model


def test_hf_takes_the_models_own_forward(model):
    state = TargetState(model, runner="hf")
    assert state.runner == "hf" and state.lean is None and isinstance(state.cache, DynamicCache)
    assert state.kernel == "torch"


def test_an_unsupported_model_falls_back_unless_lean_is_demanded(sliding):
    state = TargetState(sliding)
    assert state.runner == "hf" and state.lean is None and isinstance(state.cache, DynamicCache)
    assert state.context_len == 96 and state.vocab_size == TINY_VOCAB and state.kernel == "torch"
    with pytest.raises(ValueError, match="^the lean runner does not support MistralForCausalLM$"):
        TargetState(sliding, runner="lean")


def test_an_unknown_runner_is_refused(model):
    with pytest.raises(ValueError, match="^runner must be auto, lean or hf, not 'fast'$"):
        TargetState(model, runner="fast")


def test_a_config_without_a_context_length_gives_none(model):
    class Bare:  # only what TargetState reads on the HF path
        config = type("Config", (), {"get_text_config": lambda self, decoder=True: model.config})()
        device = torch.device("cpu")

        @staticmethod
        def get_output_embeddings():
            return model.get_output_embeddings()

    state = TargetState(Bare(), runner="hf")
    assert state.context_len is None and state.vocab_size == TINY_VOCAB


@pytest.mark.skipif(smallbatch.kernel_name() != "fused", reason="the fused kernel is not built here")
def test_kernel_is_fused_only_for_the_lean_runner_in_float32_on_the_cpu(model):
    assert TargetState(model).kernel == "fused"
    assert TargetState(model, runner="hf").kernel == "torch"
    bf16 = tiny_llama(seed=7, layers=1).to(torch.bfloat16)
    state = TargetState(bf16)
    assert state.runner == "lean" and state.kernel == "torch"


# ---------------------------------------------------------------- start, verify, commit, rewind


@pytest.mark.parametrize("runner", ["lean", "hf"])
def test_start_prefills_the_whole_prompt_and_keeps_its_last_logits(model, runner):
    state = TargetState(model, runner=runner)
    prompt = [5, 6, 7, 8, 9]
    caller = list(prompt)
    assert state.start(caller) == 5
    caller.append(1)  # the state keeps its own copy
    assert state.tokens == prompt and state.past == 5 and lengths(state) == {5}
    assert state.head.shape == (1, TINY_VOCAB)
    torch.testing.assert_close(state.head, full(model, prompt)[-1:], **CLOSE)
    torch.testing.assert_close(state.verify([]), full(model, prompt)[-1:], **CLOSE)  # the head itself, no forward
    logits = state.verify([1, 2, 3])
    assert logits.shape == (4, TINY_VOCAB)
    torch.testing.assert_close(logits, full(model, prompt + [1, 2, 3])[-4:], **CLOSE)


@pytest.mark.parametrize("runner", ["lean", "hf"])
def test_a_long_prompt_is_fed_in_chunks_with_progress_and_the_same_logits(model, runner, monkeypatch):
    monkeypatch.setattr(target, "PREFILL_CHUNK", 5)
    state = TargetState(model, runner=runner)
    prompt = [(7 * i) % TINY_VOCAB for i in range(12)]
    state.start(prompt[:3])  # a cached prefix: the progress counts only what is fed after it
    seen = []
    fed = counting(state) if runner == "lean" else None
    assert state.start(prompt, lambda done, total: seen.append((done, total))) == 9
    assert seen == [(5, 9), (9, 9)] and (fed is None or fed == [5, 4])
    torch.testing.assert_close(state.head, full(model, prompt)[-1:], **CLOSE)
    torch.testing.assert_close(state.verify([1, 2]), full(model, prompt + [1, 2])[-3:], **CLOSE)


@pytest.mark.parametrize("runner", ["lean", "hf"])
def test_rounds_of_verify_and_commit_keep_the_invariant(model, runner):
    state = TargetState(model, runner=runner)
    state.start([1, 2, 3])
    state.verify([4, 5])
    state.commit([4, 0])  # one draft accepted, then the target's own token
    assert state.tokens == [1, 2, 3, 4, 0] and state.head is None
    assert state.past == 4 and lengths(state) == {4}
    logits = state.verify([7, 7, 2])
    assert logits.shape == (4, TINY_VOCAB)
    torch.testing.assert_close(logits, full(model, [1, 2, 3, 4, 0, 7, 7, 2])[-4:], **CLOSE)
    state.commit([7, 7, 2, 9])  # all accepted and a bonus
    assert state.past == 8 and lengths(state) == {8}
    one = state.verify([])
    assert one.shape == (1, TINY_VOCAB)
    torch.testing.assert_close(one, full(model, state.tokens)[-1:], **CLOSE)
    state.commit([3])
    torch.testing.assert_close(state.verify([6]), full(model, state.tokens + [6])[-2:], **CLOSE)


def test_commit_right_after_the_prefill_drops_the_head(model):
    state = TargetState(model)
    state.start([4, 4, 4])
    state.commit([2])
    assert state.head is None and state.past == 3 and lengths(state) == {3}
    torch.testing.assert_close(state.verify([5]), full(model, [4, 4, 4, 2, 5])[-2:], **CLOSE)


def test_a_second_start_reuses_the_common_prefix(model):
    state = TargetState(model)
    fed = counting(state)
    state.start([1, 2, 3, 4])
    state.verify([5])
    state.commit([5, 6])  # tokens 1..6, the cache holds 1..5
    assert state.start([1, 2, 3, 4, 5, 6, 7, 8]) == 3 and fed[-1] == 3  # 6 was pending: it is fed with 7 and 8
    assert state.past == 8 and lengths(state) == {8}
    torch.testing.assert_close(state.head, full(model, [1, 2, 3, 4, 5, 6, 7, 8])[-1:], **CLOSE)
    # a prompt that differs at position 2: everything from there is fed again
    assert state.start([1, 2, 9, 9]) == 2 and fed[-1] == 2 and state.tokens == [1, 2, 9, 9]
    torch.testing.assert_close(state.verify([0]), full(model, [1, 2, 9, 9, 0])[-2:], **CLOSE)


def test_start_with_the_prompt_it_was_just_started_with_runs_nothing(model):
    state = TargetState(model)
    fed = counting(state)
    assert state.start([3, 1, 4]) == 3
    head = state.head
    assert state.start([3, 1, 4]) == 0 and fed == [3] and state.head is head and state.past == 3


def test_start_on_a_prompt_the_cache_covers_but_its_last_token_leaves_it_pending(model):
    state = TargetState(model)
    fed = counting(state)
    state.start([3, 1, 4])
    state.commit([1])  # tokens 3 1 4 1, the cache holds 3 1 4
    assert state.start([3, 1, 4, 1]) == 0 and fed == [3] and state.head is None and state.past == 3
    # a shorter prompt inside the cached one: the cache is cut back to all but its last token
    assert state.start([3, 1]) == 0 and fed == [3] and state.head is None
    assert state.past == 1 and lengths(state) == {1} and state.tokens == [3, 1]
    torch.testing.assert_close(state.verify([4]), full(model, [3, 1, 4])[-2:], **CLOSE)


def test_start_after_a_prefill_with_one_more_token_leaves_that_token_pending(model):
    """After a prefill the cache holds the whole prompt: a prompt one token longer needs no forward, its new last
    token is pending (the cache keeps the prompt, whose logits the next verify recomputes with it)."""
    state = TargetState(model)
    fed = counting(state)
    state.start([2, 7, 1])
    assert state.start([2, 7, 1, 8]) == 0 and fed == [3] and state.head is None and state.past == 3
    torch.testing.assert_close(state.verify([]), full(model, [2, 7, 1, 8])[-1:], **CLOSE)
    assert fed == [3, 1]


def test_start_from_nothing_on_a_single_token_leaves_it_pending(model):
    state = TargetState(model)
    fed = counting(state)
    assert state.start([5]) == 0 and state.past == 0 and fed == [] and state.tokens == [5]
    torch.testing.assert_close(state.verify([]), full(model, [5]), **CLOSE)
    assert TargetState(model).start([5, 3]) == 2  # two tokens: both fed


def test_a_failed_prefill_leaves_what_the_cache_surely_holds(model):
    state = TargetState(model)
    state.start([1, 2, 3])
    state.commit([4])  # the cache holds 1 2 3
    run, forward_into, calls = state.lean.run, state.lean.forward_into, []

    def failing(hidden, layer_ids, cache, past):
        calls.append(list(layer_ids))
        run(hidden, [0], cache, past)  # layer 0 writes its entries for the new positions, then the run is interrupted
        raise KeyboardInterrupt

    state.lean.run = failing
    state.lean.forward_into = lambda ids, cache, past, *rest: failing(state.lean.embed(ids), range(2), cache, past)
    with pytest.raises(KeyboardInterrupt):
        state.start([1, 2, 9, 9, 9])
    assert calls == [[0, 1]]
    assert state.tokens == [1, 2, 9] and state.head is None and state.past == 2
    assert lengths(state) == {2} and state.known == 2
    state.lean.run, state.lean.forward_into = run, forward_into
    torch.testing.assert_close(state.verify([5]), full(model, [1, 2, 9, 5])[-2:], **CLOSE)


def test_rewind_returns_to_the_invariant_after_a_prefill(model):
    state = TargetState(model)
    state.start([6, 5, 4])
    state.rewind()
    assert state.head is None and state.past == 2 and lengths(state) == {2} and state.known == 2
    torch.testing.assert_close(state.verify([3]), full(model, [6, 5, 4, 3])[-2:], **CLOSE)
    empty = TargetState(model)
    empty.rewind()  # nothing to rewind: still nothing
    assert empty.past == 0 and lengths(empty) == {0}


# ---------------------------------------------------------------- features


def test_every_forward_records_the_features_of_the_positions_it_fed(model):
    state = TargetState(model)
    state.start([1, 2, 3, 4])
    assert state.known == 4 and state.features.shape == (CHUNK, 16)
    torch.testing.assert_close(state.features[:4], features_of(state, [1, 2, 3, 4]), **CLOSE)
    state.verify([5, 6])
    assert state.known == 6
    state.commit([5, 0])  # 6 rejected: its features are cut with the cache
    assert state.known == 5
    state.verify([8])  # feeds 0 and 8 at positions 5, 6
    assert state.known == 7
    torch.testing.assert_close(state.features[:7], features_of(state, [1, 2, 3, 4, 5, 0, 8]), **CLOSE)


def test_forward_returns_the_last_keep_positions_and_drops_what_was_beyond(model):
    for runner in ("lean", "hf"):
        state = TargetState(model, runner=runner)
        torch.testing.assert_close(state.forward([1, 2, 3, 4, 5], 0, keep=2), full(model, [1, 2, 3, 4, 5])[-2:], **CLOSE)
        torch.testing.assert_close(state.forward([7, 7], 2, keep=2), full(model, [1, 2, 7, 7])[-2:], **CLOSE)
        assert lengths(state) == {4}


def test_features_grow_in_chunks_and_keep_what_they_held(model):
    state = TargetState(model)
    lean = state.lean
    g = torch.Generator().manual_seed(0)
    first = torch.randn(1, CHUNK - 2, 16, generator=g)
    state.record(first, 0)
    storage = state.features.data_ptr()
    second = torch.randn(1, 2, 16, generator=g)
    state.record(second, CHUNK - 2)  # exactly fills the chunk: no new allocation
    assert state.features.data_ptr() == storage and state.features.shape == (CHUNK, 16) and state.known == CHUNK
    third = torch.randn(1, 3, 16, generator=g)
    state.record(third, CHUNK - 1)  # overwrites the last position and grows
    assert state.features.shape == (2 * CHUNK, 16) and state.known == CHUNK + 2
    assert state.features.dtype == lean.dtype and state.features.device.type == "cpu"
    assert torch.equal(state.features[: CHUNK - 2], first[0])
    assert torch.equal(state.features[CHUNK - 2 : CHUNK - 1], second[0, :1])
    assert torch.equal(state.features[CHUNK - 1 : CHUNK + 2], third[0])


def test_record_after_a_gap_keeps_nothing(model):
    state = TargetState(model)
    state.record(torch.ones(1, 3, 16), 0)
    state.record(torch.full((1, 2, 16), 2.0), 4)  # position 3 was never recorded: a gap
    assert state.known == 3 and torch.equal(state.features[:3], torch.ones(3, 16))
    state.record(torch.full((1, 2, 16), 5.0), 3)  # right at the end: kept
    assert state.known == 5 and torch.equal(state.features[3:5], torch.full((2, 16), 5.0))
    state.record(torch.full((1, 1, 16), 9.0), 1)  # before the end: kept, and what was beyond is dropped
    assert state.known == 2 and torch.equal(state.features[:2], torch.tensor([[1.0] * 16, [9.0] * 16]))


def test_the_hf_path_records_no_features(model):
    state = TargetState(model, runner="hf")
    state.start([1, 2, 3])
    state.verify([4])
    assert state.features is None and state.known == 0


def test_features_keep_the_models_dtype():
    bf16 = tiny_llama(seed=7, layers=1).to(torch.bfloat16)
    state = TargetState(bf16)
    state.start([1, 2, 3])
    assert state.features.dtype == torch.bfloat16 and state.features.shape == (CHUNK, 16)
    torch.testing.assert_close(state.features[:3], features_of(state, [1, 2, 3]), rtol=0, atol=0)
