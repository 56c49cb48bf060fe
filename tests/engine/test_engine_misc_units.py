"""Small engine modules on hand-worked cases: the incremental detokeniser (engine/detokenize.py) on two real
`tokenizers` tokenizers built in memory (byte-level BPE, which splits a character over several tokens, and a
SentencePiece-style word vocabulary, whose spaces depend on the token before), the sampling settings' checks
(engine/sampling_params.py) and a round's record (engine/events.py). No model; well under a second."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specchat.engine.detokenize import IncrementalDecoder
from specchat.engine.events import RoundRecord, TokenEvent
from specchat.engine.sampling_params import SamplingParams


def byte_level() -> PreTrainedTokenizerFast:
    """One token per byte, as GPT-2's tokenizer has before its merges: "é" is two tokens, "世" three."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    out.add_special_tokens({"eos_token": "<eos>"})
    return out


HELLO, WORLD, DOT, UNK, EOS = range(5)


def words() -> PreTrainedTokenizerFast:
    """SentencePiece-style: "▁world" decodes to " world" after a token and to "world" first; cleaning up the
    spaces (on by default here, as in many tokenizers' configs) would join " ." to the word before."""
    tok = Tokenizer(models.WordLevel(vocab={"▁hello": HELLO, "▁world": WORLD, "▁.": DOT, "<unk>": UNK, "<eos>": EOS},
                                     unk_token="<unk>"))
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=True)


def pieces(tokenizer, ids, **kwargs) -> list[str]:
    decoder = IncrementalDecoder(tokenizer, **kwargs)
    return [decoder.push(i) for i in ids]


# ---------------------------------------------------------------- detokenize


def test_a_character_split_over_tokens_comes_with_the_token_that_completes_it():
    tok = byte_level()
    ids = tok.encode("héllo 世界 .")
    assert len(ids) == 15  # é: 2 bytes, 世 and 界: 3 each
    assert pieces(tok, ids) == ["h", "", "é", "l", "l", "o", " ", "", "", "世", "", "", "界", " ", "."]


def test_spaces_come_from_the_token_before_and_are_not_cleaned_up():
    tok = words()
    assert pieces(tok, [HELLO, WORLD, DOT, WORLD]) == ["hello", " world", " .", " world"]
    assert "".join(pieces(tok, [HELLO, WORLD, DOT])) == tok.decode([HELLO, WORLD, DOT], clean_up_tokenization_spaces=False)


def test_special_tokens_are_shown_unless_skipped_and_a_skipped_one_keeps_the_context():
    tok = words()
    assert pieces(tok, [HELLO, EOS, WORLD]) == ["hello", "<eos>", " world"]
    assert pieces(tok, [HELLO, EOS, WORLD], skip_special_tokens=False) == ["hello", "<eos>", " world"]
    assert pieces(tok, [HELLO, EOS, WORLD], skip_special_tokens=True) == ["hello", "", " world"]
    assert pieces(tok, [EOS, HELLO, EOS, EOS, WORLD], skip_special_tokens=True) == ["", "hello", "", "", " world"]


def test_any_stream_joins_to_the_whole_decode_and_decodes_only_a_short_window():
    tok = byte_level()
    text = "naïve café — 東京 😀 ok" * 3
    ids = tok.encode(text)
    windows = []
    real = tok.decode

    def spy(ids, **kwargs):
        windows.append(len(ids))
        return real(ids, **kwargs)

    tok.decode = spy
    out = pieces(tok, ids)
    assert "".join(out) == text and not any("\ufffd" in p for p in out)
    assert max(windows) <= 8 < len(ids) / 4  # the last complete piece or two and the pending bytes, never the whole


# ---------------------------------------------------------------- sampling_params


@pytest.mark.parametrize("kwargs", [{}, {"temperature": 0}, {"temperature": 2.5, "top_k": 1, "top_p": 1e-6},
                                    {"top_k": 0, "top_p": 1}])
def test_valid_sampling_settings(kwargs):
    """The edges of each range are accepted and kept as given."""
    params = SamplingParams(**kwargs)
    assert all(getattr(params, name) == value for name, value in kwargs.items())


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.01}, r"^temperature must be >= 0, got -0\.01$"),
    ({"top_k": -1}, r"^top-k must be >= 0, got -1$"),
    ({"top_p": 0}, r"^top-p must be in \(0, 1\], got 0$"),
    ({"top_p": -0.5}, r"^top-p must be in \(0, 1\], got -0\.5$"),
    ({"top_p": 1.0001}, r"^top-p must be in \(0, 1\], got 1\.0001$"),
])
def test_invalid_sampling_settings_say_which_and_why(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_greedy_means_temperature_zero_and_the_defaults_sample_plainly():
    assert SamplingParams(0).greedy and not SamplingParams(1e-9).greedy
    assert SamplingParams() == SamplingParams(1.0, 0, 1.0) and not SamplingParams().greedy


# ---------------------------------------------------------------- events


def test_a_round_counts_its_tokens_and_starts_exact_and_empty():
    event = TokenEvent(id=3, text="x", kind="target", round=0, position=1, p=0.5, q=None, accept_prob=None)
    r = RoundRecord(index=0, mode="off", draft_len=0, drafted=0, accepted=0, draft_calls=0, draft_s=0.0, verify_s=0.1)
    assert r.emitted == 0 and r.tokens == [] and r.rejected == [] and r.exact and r.expected_tokens == 1.0
    r.tokens += [event, event]
    assert r.emitted == 2
    other = RoundRecord(index=1, mode="off", draft_len=0, drafted=0, accepted=0, draft_calls=0, draft_s=0.0, verify_s=0.1)
    assert other.tokens == [] and other.tokens is not r.tokens  # not shared between rounds
    assert (event.top_p, event.top_q, event.p_raw, event.top_raw) == ((), (), None, ())
