"""Batched generation of training data on the lean runner (train/generate.py), against HF `generate` and against
a fresh forward of every row alone."""

import torch
from support.models import tiny_llama

from specchat.engine.cache import KVCache
from specchat.engine.runner import lean_runner
from specchat.train.generate import generate_with_features
from specchat.train.head import Recipe, hf_generate_with_features, target_features

PAD = 0


def prompts_of_many_lengths(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (3, 9, 5, 12, 1, 7)]


def test_greedy_rows_match_hf_generate_token_for_token():
    model = tiny_llama(seed=11, layers=2)
    prompts = prompts_of_many_lengths(model.config.vocab_size)
    recipe = Recipe(max_new_tokens=40, max_len=48)
    hf = hf_generate_with_features(model, prompts, PAD, set(), [0.0] * len(prompts), recipe)
    lean = generate_with_features(lean_runner(model), prompts, PAD, set(), [0.0] * len(prompts), 40, 48)
    for (tokens, feats), (hf_tokens, hf_feats) in zip(lean, hf):
        assert tokens == hf_tokens
        torch.testing.assert_close(feats, hf_feats, rtol=1e-4, atol=1e-4)
    assert [len(t) for t, _ in lean] == [min(len(p) + 39, 48) for p in prompts]  # the last token drawn is not fed


def test_every_row_stops_at_its_eos_and_its_features_are_a_fresh_forward(monkeypatch):
    """Sampled rows ending at different steps (token 3 counts as EOS), so finished rows are dropped from
    the batch and the cache on the way: every row's features must still be the target's own for its tokens."""
    model = tiny_llama(seed=12, layers=2)
    runner = lean_runner(model)
    compactions = []
    keep_rows = KVCache.keep_rows
    monkeypatch.setattr(KVCache, "keep_rows", lambda self, index: (compactions.append(len(index)), keep_rows(self, index)))
    prompts = prompts_of_many_lengths(model.config.vocab_size) * 3
    eos = {3}
    out = generate_with_features(runner, prompts, PAD, eos, [1.0] * len(prompts), 30, 40, seed=3)
    assert compactions and compactions[-1] < len(prompts)
    ended_early = 0
    for prompt, (tokens, feats) in zip(prompts, out):
        assert tokens[: len(prompt)] == prompt and feats.shape == (len(tokens), model.config.hidden_size)
        reply = tokens[len(prompt) :]
        if any(t in eos for t in reply):
            assert reply[-1] in eos and not any(t in eos for t in reply[:-1])  # up to and including the first EOS
            ended_early += 1
        else:
            assert len(tokens) == min(len(prompt) + 29, 40)
        torch.testing.assert_close(feats, target_features(runner, tokens), rtol=1e-4, atol=1e-4)
    assert 0 < ended_early < len(prompts)


def test_a_seed_gives_the_same_replies():
    model = tiny_llama(seed=13, layers=1)
    runner, prompts = lean_runner(model), prompts_of_many_lengths(model.config.vocab_size)
    runs = [generate_with_features(runner, prompts, PAD, {5}, [1.0, 0.0] * 3, 20, 40, seed=s) for s in (7, 7, 8)]
    assert [t for t, _ in runs[0]] == [t for t, _ in runs[1]] != [t for t, _ in runs[2]]
