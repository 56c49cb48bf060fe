"""The lean engine (--engine lean): a GGUF file read in place by specchat's kernel (gguf_model.LeanModel) behind the
same session as the other engines: the modes it runs give plain greedy decoding's tokens, the others are refused in
one line, and the front ends are told which engine ran."""

from __future__ import annotations

import pytest
import torch

from specchat.engine import smallbatch
from specchat.engine.drafters import ModeUnavailable
from specchat.engine.sampling import SamplingParams
from specchat.models import load_model


@pytest.fixture(scope="module")
def lean():
    if smallbatch._compiler() is None:
        pytest.skip("no C compiler")
    return load_model(None, torch.device("cpu"), torch.float32, engine="lean")


def test_the_default_model_loads_on_the_lean_engine_with_what_a_session_reads(lean):
    assert lean.engine == "lean" and lean.dtype_name == "Q4_1" and lean.context_len == 8192
    assert lean.tokenizer.eos_token_id in lean.eos_ids and lean.model.runner.model is None
    assert all(p.interleaved is not None for p in lean.model.runner.blocks[0].qkv_w.parts)  # the kernel's layout


@pytest.mark.slow
def test_every_mode_it_runs_gives_plain_greedy_decoding_s_tokens(lean):
    """off, lookup, suffix, auto, draft with the file as its own draft (read in place a second time), and the
    self-speculative modes on the file's own runner (layerskip, earlyexit: their built-in settings)."""
    from specchat.session import Session

    draft = load_model(None, torch.device("cpu"), torch.float32, engine="lean")
    prompt = "Repeat exactly: the sea is calm, the sea is deep, the sea is calm, the sea is deep."
    replies = {}
    for mode in ("off", "lookup", "suffix", "auto", "draft", "layerskip", "earlyexit"):
        session = Session(lean, draft, mode=mode, k=3, sampling=SamplingParams(0.0), seed=0, max_new_tokens=40,
                          earlier_sessions=False)
        assert session.info.engine == "lean" and session.info.kernel == "blocks"
        rounds = list(session.reply(prompt))
        replies[mode] = [t.id for r in rounds for t in r.tokens]
        if mode in ("draft", "layerskip", "earlyexit"):
            assert any(t.kind == "accepted" for r in rounds for t in r.tokens), mode  # the draft really drafted
        if mode == "draft":  # the file drafting for itself: the same logits, position by position, so no rejection
            assert not any(t.kind == "resampled" for r in rounds for t in r.tokens)
    assert len(replies["off"]) >= 15  # a reply long enough to draft in (it ends at its EOS)
    for mode in ("lookup", "suffix", "auto", "draft", "layerskip", "earlyexit"):
        assert replies[mode] == replies["off"], mode


def test_the_modes_built_on_transformers_modules_are_refused_in_one_line(lean):
    from specchat.engine.drafters.auto import AutoDrafter
    from specchat.session import Session

    session = Session(lean, mode="auto", seed=0, earlier_sessions=False)
    assert isinstance(session.controls.drafter, AutoDrafter)
    assert set(session.controls.drafter.candidates) <= {"off", "suffix", "lookup", "draft"}
    for mode in ("quant", "lowrank", "head"):
        with pytest.raises(ModeUnavailable, match="not yet on --engine lean"):
            session.set_mode(mode)
