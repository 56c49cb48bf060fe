"""A conversation over several turns in every mode: the target cache is reused across turns (earlyexit even
writes into it), and every turn's reply is what a fresh session gives for the same ids."""

import pytest
import torch

from helpers import tiny_model_dir
from specchat.engine.sampling import SamplingParams
from specchat.models import load_model
from specchat.session import Session

MODES = ["off", "draft", "layerskip", "earlyexit", "lowrank", "quant", "lookup"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(tiny_model_dir(tmp_path_factory.mktemp("tiny"), layers=4)), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("mode", MODES)
def test_turns_reuse_the_cache_and_match_a_fresh_session(tiny, mode):
    session = Session(tiny, tiny, mode=mode, k=3, sampling=SamplingParams(0), max_new_tokens=16,
                      mode_options={"calibration": 16})
    session.eos_ids = set()  # fixed-length replies: every turn runs 16 tokens
    for text in ("hello world", "the cat and the dog", "write a short story"):
        before = list(session.state.tokens)
        list(session.reply(text))
        turn = session.turns[-1]
        prompt = session.state.tokens[: turn.prompt_tokens]
        assert prompt[: len(before)] == before  # the new prompt extends what the cache held
        fresh = Session(tiny, mode="off", sampling=SamplingParams(0), max_new_tokens=16)
        fresh.eos_ids = set()
        list(fresh.complete(prompt))
        assert fresh.turns[0].reply_ids == turn.reply_ids, f"turn {len(session.turns)}"
    assert session.stats[mode].new_tokens == 48
    if mode != "off":
        assert session.stats[mode].num_draft_tokens > 0  # the mode really drafted


def test_auto_keeps_what_it_learnt_for_the_next_session(tiny, monkeypatch, tmp_path):
    """After a turn, auto's rates are in the state folder under this setup; the next session on the same weights
    starts from them; another thread setting is another setup, and earlier_sessions=False neither reads nor writes."""
    monkeypatch.setenv("SPECCHAT_STATE_DIR", str(tmp_path))
    first = Session(tiny, tiny, mode="auto", k=3, sampling=SamplingParams(0), max_new_tokens=16)
    list(first.reply("the cat and the dog"))
    [saved] = (tmp_path / "auto").glob("*.json")
    learnt = first.controls.drafter.rates
    second = Session(tiny, tiny, mode="auto", k=3, sampling=SamplingParams(0), max_new_tokens=16)
    auto = second.controls.drafter
    assert auto.memory.path == saved and sum(r.earlier for r in auto.rates.values()) == sum(r.live for r in learnt.values()) > 0
    assert {arm: r.per_s for arm, r in auto.rates.items() if r.earlier} == {arm: r.per_s for arm, r in learnt.items() if r.live}
    unlearnt = Session(tiny, tiny, mode="auto", k=3, sampling=SamplingParams(0), max_new_tokens=16, earlier_sessions=False)
    assert unlearnt.controls.drafter.memory is None and all(r.earlier == 0 for r in unlearnt.controls.drafter.rates.values())
    list(unlearnt.reply("hello"))
    assert list((tmp_path / "auto").glob("*.json")) == [saved]
    monkeypatch.setattr("specchat.threads.setting", lambda: "7")
    other = Session(tiny, tiny, mode="auto", k=3, sampling=SamplingParams(0), max_new_tokens=16)
    assert other.controls.drafter.memory.path != saved and not other.controls.drafter.known
