"""A conversation over several turns in every mode: the target cache is reused across turns (earlyexit even
writes into it), and every turn's reply is what a fresh session gives for the same ids."""

from types import SimpleNamespace

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


def test_suffix_drafts_from_the_saved_conversations(tiny, monkeypatch, tmp_path):
    """Mode suffix's corpus is the user's saved conversations, tokenised with this target's chat template: a new
    conversation that starts to repeat a saved reply gets that reply's continuation as drafts."""
    import json

    from specchat import history

    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(tmp_path))
    saved = [{"role": "user", "content": "name the planets"}, {"role": "assistant", "content": "mercury venus earth mars jupiter"}]
    folder = history.conversations_dir()
    folder.mkdir(parents=True)
    (folder / "a.json").write_text(json.dumps({"format": history.FORMAT, "updated": "2026-12-01T10:00:00+00:00",
                                               "model": "tiny", "turns": [], "messages": saved}))
    (folder / "junk.json").write_text("{not json")  # skipped
    session = Session(tiny, mode="suffix", sampling=SamplingParams(0), max_new_tokens=8)
    drafter = session.controls.drafter
    ids = tiny.chat_ids(saved)
    assert list(drafter.references) == [ids]
    cut = len(ids) - 4  # the conversation so far ends 4 tokens before the saved reply does
    proposal = drafter.propose(SimpleNamespace(tokens=[7, 7] + ids[:cut], device=torch.device("cpu")), 3, None, None)
    assert proposal.ids.tolist() == ids[cut : cut + 3]
    assert Session(tiny, mode="suffix", max_new_tokens=8, earlier_sessions=False).controls.drafter.corpus_tokens == 0
