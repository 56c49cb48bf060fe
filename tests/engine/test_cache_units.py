"""engine/cache.py one function at a time: the lean KVCache (chunked growth, in-place writes, crops that move a
pointer, dropped rows), crop_to on both cache kinds, common_prefix, and forward_logits against a plain forward.
Hand-made tensors and one tiny Llama; the whole file runs in about a second."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM

from support.models import tiny_llama
from specchat.engine.cache import CHUNK, KVCache, common_prefix, crop_to, forward_logits, new_cache

H_KV, HD = 2, 3


def kv(start: float, n: int, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [rows, H_KV, n, HD] numbered start, start+1, ... (values the same, negated): every entry is telling."""
    k = torch.arange(rows * H_KV * n * HD, dtype=torch.float32).reshape(rows, H_KV, n, HD) + start
    return k, -k


def cache(n_layers: int = 2, rows: int = 1, dtype=torch.float32) -> KVCache:
    return KVCache(n_layers, H_KV, HD, dtype, torch.device("cpu"), rows)


# ---------------------------------------------------------------- KVCache


def test_a_new_cache_holds_nothing_and_allocates_nothing():
    c = cache(n_layers=3)
    assert c.lengths == [0, 0, 0] and c.keys == [None] * 3 and c.values == [None] * 3
    assert [layer.get_seq_length() for layer in c.layers] == [0, 0, 0] and len(c.layers) == 3
    assert c.nbytes() == 0
    assert (c.n_kv_heads, c.head_dim, c.dtype, c.rows) == (H_KV, HD, torch.float32, 1)


def test_one_row_unless_told_otherwise():
    c = KVCache(1, H_KV, HD, torch.float32, torch.device("cpu"))
    assert c.rows == 1
    c.write(0, *kv(0, 1), past=0)
    assert c.keys[0].shape == c.values[0].shape == (1, H_KV, CHUNK, HD)


def test_write_returns_every_position_so_far_and_stores_them_in_place():
    c = cache()
    k1, v1 = kv(0, 4)
    keys, values = c.write(0, k1, v1, past=0)
    assert keys.shape == values.shape == (1, H_KV, 4, HD)
    assert torch.equal(keys, k1) and torch.equal(values, v1)
    assert c.lengths == [4, 0] and c.get_seq_length() == 4 and c.get_seq_length(1) == 0
    k2, v2 = kv(1000, 2)
    keys, values = c.write(0, k2, v2, past=4)
    assert keys.shape == (1, H_KV, 6, HD)
    assert torch.equal(keys, torch.cat([k1, k2], dim=2)) and torch.equal(values, torch.cat([v1, v2], dim=2))
    assert c.lengths == [6, 0]
    # the returned tensors are views of the cache's own storage, not copies
    assert keys.data_ptr() == c.keys[0].data_ptr() and values.data_ptr() == c.values[0].data_ptr()


def test_write_over_a_cropped_tail_replaces_it():
    c = cache(n_layers=1)
    k1, v1 = kv(0, 5)
    c.write(0, k1, v1, past=0)
    c.crop(2)
    k2, v2 = kv(500, 1)
    keys, values = c.write(0, k2, v2, past=2)
    assert c.lengths == [3]
    assert torch.equal(keys, torch.cat([k1[:, :, :2], k2], dim=2))
    assert torch.equal(values, torch.cat([v1[:, :, :2], v2], dim=2))


def test_write_beyond_what_a_layer_holds_is_refused_but_at_its_end_is_fine():
    c = cache()
    k, v = kv(0, 1)
    with pytest.raises(ValueError, match="layer 0 holds 0 positions; cannot write at 1"):
        c.write(0, k, v, past=1)
    c.write(0, k, v, past=0)  # exactly at the end: allowed
    c.write(0, k, v, past=1)
    with pytest.raises(ValueError, match="layer 1 holds 0"):
        c.write(1, k, v, past=2)
    c.write(0, k, v, past=0)  # rewriting inside what it holds: allowed, and the length drops to the write's end
    assert c.lengths == [1, 0]


@pytest.mark.parametrize("needed, capacity", [(1, CHUNK), (CHUNK - 1, CHUNK), (CHUNK, CHUNK), (CHUNK + 1, 2 * CHUNK), (3 * CHUNK, 3 * CHUNK)])
def test_storage_is_allocated_in_whole_chunks(needed, capacity):
    c = cache(n_layers=1, rows=2)
    k, v = kv(0, needed, rows=2)
    c.write(0, k, v, past=0)
    assert c.keys[0].shape == c.values[0].shape == (2, H_KV, capacity, HD)
    assert c.keys[0].dtype == torch.float32 and c.keys[0].device.type == "cpu"
    assert c.nbytes() == 2 * (2 * H_KV * capacity * HD) * 4  # keys and values, float32


def test_writes_within_capacity_never_reallocate_and_growth_keeps_what_was_held():
    c = cache(n_layers=1)
    first_k, first_v = kv(0, CHUNK - 3)
    c.write(0, first_k, first_v, past=0)
    storage = c.keys[0].data_ptr(), c.values[0].data_ptr()
    k, v = kv(7000, 3)
    c.write(0, k, v, past=CHUNK - 3)  # fills the chunk exactly
    assert (c.keys[0].data_ptr(), c.values[0].data_ptr()) == storage
    assert c.keys[0].shape[2] == CHUNK
    more_k, more_v = kv(9000, 2)
    keys, values = c.write(0, more_k, more_v, past=CHUNK)  # one past the chunk: grows, copying the old entries
    assert c.keys[0].shape[2] == 2 * CHUNK and c.keys[0].data_ptr() != storage[0]
    assert torch.equal(keys, torch.cat([first_k, k, more_k], dim=2))
    assert torch.equal(values, torch.cat([first_v, v, more_v], dim=2))


def test_growth_copies_only_the_positions_held_after_a_crop():
    c = cache(n_layers=1)
    k, v = kv(0, 10)
    c.write(0, k, v, past=0)
    c.crop(4)
    big_k, big_v = kv(100, CHUNK)
    keys, values = c.write(0, big_k, big_v, past=4)
    assert c.lengths == [CHUNK + 4] and c.keys[0].shape[2] == 2 * CHUNK
    assert torch.equal(keys[:, :, :4], k[:, :, :4]) and torch.equal(values[:, :, :4], v[:, :, :4])
    assert torch.equal(keys[:, :, 4:], big_k) and torch.equal(values[:, :, 4:], big_v)


def test_reserve_all_grows_every_layer_that_needs_it_and_says_when_storage_moved():
    """What a whole-model forward in C relies on: every layer has room and holds past + n, and `version` changes
    exactly when some layer's storage was replaced (the C code's pointers into it are then rebuilt)."""
    c = cache(n_layers=3)
    c.reserve_all(0, 5)
    assert c.lengths == [5, 5, 5] and all(k.shape[2] == CHUNK for k in c.keys)
    version, storage = c.version, [k.data_ptr() for k in c.keys]
    c.crop(2)
    c.reserve_all(2, CHUNK - 2)  # fills the chunk exactly: nothing moves
    assert c.lengths == [CHUNK] * 3 and c.version == version and [k.data_ptr() for k in c.keys] == storage
    k, v = kv(0, CHUNK + 1)
    c.write(1, k[:, :, -2:], v[:, :, -2:], past=CHUNK - 1)  # layer 1 alone grows (a self-speculative pass's write)
    version = c.version
    c.reserve_all(CHUNK, 1)
    assert c.version > version and all(k.shape[2] == 2 * CHUNK for k in c.keys) and c.lengths == [CHUNK + 1] * 3
    version = c.version
    c.reserve_all(CHUNK + 1, 3)
    assert c.version == version
    c.crop(4)
    c.lengths[2] = 3
    with pytest.raises(ValueError):  # layer 2 holds 3 positions: nothing at 4 for it to attend to
        c.reserve_all(4, 1)


def test_bfloat16_storage_keeps_its_dtype():
    c = cache(n_layers=1, dtype=torch.bfloat16)
    k, v = kv(0, 2)
    keys, values = c.write(0, k.bfloat16(), v.bfloat16(), past=0)
    assert c.keys[0].dtype == c.values[0].dtype == keys.dtype == torch.bfloat16
    assert c.nbytes() == 2 * (H_KV * CHUNK * HD) * 2


def test_crop_only_lowers_each_layers_length():
    c = cache(n_layers=3)
    for i, n in enumerate((7, 3, 0)):
        if n:
            c.write(i, *kv(0, n), past=0)
    storage = c.keys[0].data_ptr()
    c.crop(5)
    assert c.lengths == [5, 3, 0]
    assert [layer.get_seq_length() for layer in c.layers] == [5, 3, 0]
    assert c.get_seq_length() == 5 and c.get_seq_length(1) == 3 and c.get_seq_length(2) == 0
    assert c.keys[0].data_ptr() == storage  # a pointer move
    c.crop(100)
    assert c.lengths == [5, 3, 0]
    c.crop(0)
    assert c.lengths == [0, 0, 0]


def test_layer_views_follow_later_writes():
    c = cache(n_layers=2)
    views = c.layers
    c.write(1, *kv(0, 4), past=0)
    assert [view.get_seq_length() for view in views] == [0, 4]


def test_keep_rows_drops_rows_and_later_growth_has_the_new_row_count():
    c = cache(n_layers=2, rows=3)
    k, v = kv(0, 5, rows=3)
    c.write(0, k, v, past=0)  # layer 1 never written
    c.keep_rows(torch.tensor([2, 0]))
    assert c.rows == 2 and c.values[1] is None and c.keys[1] is None
    assert c.keys[0].shape == (2, H_KV, CHUNK, HD)
    assert torch.equal(c.keys[0][:, :, :5], k[[2, 0]]) and torch.equal(c.values[0][:, :, :5], v[[2, 0]])
    k2, v2 = kv(-50, CHUNK, rows=2)
    keys, values = c.write(0, k2, v2, past=5)  # grows: the new storage has 2 rows
    assert keys.shape == (2, H_KV, CHUNK + 5, HD)
    assert torch.equal(keys[:, :, :5], k[[2, 0]]) and torch.equal(values[:, :, 5:], v2)
    keys, _ = c.write(1, *kv(0, 1, rows=2), past=0)
    assert keys.shape == (2, H_KV, 1, HD)


def test_nbytes_counts_both_keys_and_values_of_every_allocated_layer():
    c = cache(n_layers=3)
    c.write(0, *kv(0, 1), past=0)
    c.write(2, *kv(0, CHUNK + 1), past=0)
    assert c.nbytes() == (H_KV * HD * 4) * 2 * (CHUNK + 2 * CHUNK)


# ---------------------------------------------------------------- crop_to


def test_crop_to_a_kvcache_moves_its_pointers():
    c = cache(n_layers=2)
    c.write(0, *kv(0, 6), past=0)
    c.write(1, *kv(0, 2), past=0)
    crop_to(c, 4)
    assert c.lengths == [4, 2]


def dynamic(lengths: list[int]) -> DynamicCache:
    d = DynamicCache()
    for i, n in enumerate(lengths):
        k, v = kv(10 * i, n)
        d.update(k, v, i)
    return d


@pytest.mark.parametrize("length", [0, 2, 3, 4, 5, 9])
def test_crop_to_a_dynamic_cache_cuts_each_layer_to_at_most_length(length):
    d = dynamic([5, 3, 4])
    crop_to(d, length)
    assert [layer.get_seq_length() for layer in d.layers] == [min(n, length) for n in (5, 3, 4)]
    for i, n in enumerate((5, 3, 4)):
        k, v = kv(10 * i, n)
        kept = min(n, length)
        assert torch.equal(d.layers[i].keys, k[:, :, :kept]) and torch.equal(d.layers[i].values, v[:, :, :kept])


# ---------------------------------------------------------------- common_prefix


@pytest.mark.parametrize("a, b, n", [
    ([], [], 0), ([], [1], 0), ([1], [], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2), ([1, 2], [1, 2, 3], 2),
    ([1, 2, 3], [1, 5, 3], 1), ([4, 2], [1, 2], 0), ([1, 2, 3, 4], [1, 2, 3, 5], 3),
])
def test_common_prefix(a, b, n):
    assert common_prefix(a, b) == n


# ---------------------------------------------------------------- new_cache, forward_logits


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3, layers=2).requires_grad_(False)


def test_new_cache_is_an_empty_dynamic_cache_laid_out_by_the_config():
    sliding = MistralForCausalLM(MistralConfig(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                               num_attention_heads=2, num_key_value_heads=1, sliding_window=4,
                                               max_position_embeddings=64)).eval()
    c = new_cache(sliding)
    assert isinstance(c, DynamicCache) and c.get_seq_length() == 0
    assert len(c.layers) == 2  # from the config, not grown lazily
    assert all(getattr(layer, "sliding_window", None) == 4 for layer in c.layers)
    crop_to(c, 0)  # nothing to cut: a layer that holds nothing is left alone (cropping it by 0 would raise)
    forward_logits(sliding, c, [1, 2, 3], keep=1)
    crop_to(c, 3)
    assert [layer.get_seq_length() for layer in c.layers] == [3, 3]
    crop_to(c, 2)
    assert [layer.get_seq_length() for layer in c.layers] == [2, 2]


def test_forward_logits_equals_the_plain_forward_and_fills_the_cache(model):
    ids = [3, 1, 4, 1, 5, 9, 2]
    full = model(input_ids=torch.tensor([ids])).logits[0]  # [7, V]
    c = new_cache(model)
    out = forward_logits(model, c, ids[:4], keep=2)
    assert out.shape == (2, model.config.vocab_size)
    torch.testing.assert_close(out, full[2:4], rtol=1e-5, atol=1e-5)
    assert c.get_seq_length() == 4
    out = forward_logits(model, c, ids[4:], keep=3)  # after what the cache holds
    torch.testing.assert_close(out, full[4:7], rtol=1e-5, atol=1e-5)
    assert c.get_seq_length() == 7
    crop_to(c, 5)
    torch.testing.assert_close(forward_logits(model, c, ids[5:], keep=1), full[6:7], rtol=1e-5, atol=1e-5)


def test_speculation_past_a_sliding_window_rolls_back_and_matches_plain_greedy():
    """transformers' sliding-window layers refuse a crop once the window is full unless they record the past:
    the HF path (every model the lean runner refuses) failed at the first rejected draft past the window. A window
    of 8 and 40 new tokens, drafted by another model (rejections throughout), greedy: token for token HF's own."""
    from support.exact import run
    from specchat.engine.drafters.model import ModelDrafter
    from specchat.engine.sampling import SamplingParams

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, sliding_window=8, max_position_embeddings=128, bos_token_id=None,
                           eos_token_id=None, pad_token_id=None, initializer_range=0.1)
    torch.manual_seed(0)
    target = MistralForCausalLM(config).eval().requires_grad_(False)
    draft = tiny_llama(seed=1, layers=1, vocab=64).requires_grad_(False)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    ref = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40, min_new_tokens=40)[0, len(prompt):].tolist()
    out, records = run(target, ModelDrafter(draft), prompt, k=3, params=SamplingParams(0), max_new_tokens=40)
    assert out == ref
    assert sum(r.drafted - r.accepted for r in records) > 0  # rejections, so crops, past the window
