"""A conversation over several turns in every mode: the target cache is reused across turns (earlyexit even
writes into it), and every turn's reply is what a fresh session gives for the same ids."""

import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from support.models import tiny_model_dir
from support.fakes import FakeDrafter, FakeSession, REPLY, VOCAB
from specchat.conversation import PromptTooLong
from specchat.engine.drafters.baseline import InBandBaseline
from specchat.engine.sampling import SamplingParams
from specchat.models import load_model
from specchat.modes import MODES as MODE_NAMES
from specchat.session import Session, auto_setup

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
    # an arm measured in one round only weighs under one round once any time has passed (Rate.remembered): forgotten
    learnt = {arm: r for arm, r in first.controls.drafter.rates.items() if r.live >= 2}
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


def test_the_measured_k_keeps_what_it_learnt_for_the_next_session(tiny, monkeypatch, tmp_path):
    """-k auto: after a turn the measured K's acceptance and verify costs are in the state folder under this setup,
    and the next session's K starts from them; earlier_sessions=False neither reads nor writes."""
    monkeypatch.setenv("SPECCHAT_STATE_DIR", str(tmp_path))
    first = Session(tiny, tiny, mode="draft", sampling=SamplingParams(0), max_new_tokens=40)
    first.measure_k(3)
    list(first.reply("the cat and the dog"))
    [saved] = (tmp_path / "draft_length").glob("*.json")
    learnt = first.controls.adaptive
    second = Session(tiny, tiny, mode="draft", sampling=SamplingParams(0), max_new_tokens=40)
    second.measure_k(3)
    measured = second.controls.adaptive
    assert measured.memory.path == saved and measured.verify.seconds == pytest.approx(learnt.verify.seconds)
    assert measured.settings["greedy"]["draft"].reached == pytest.approx(learnt.settings["greedy"]["draft"].reached)
    assert measured.k("draft") == learnt.choose("draft")  # at once: no rounds at the start K first
    unlearnt = Session(tiny, tiny, mode="draft", sampling=SamplingParams(0), max_new_tokens=16, earlier_sessions=False)
    unlearnt.measure_k(3)
    assert unlearnt.controls.adaptive.memory is None and unlearnt.controls.adaptive.settings == {}
    list(unlearnt.reply("hello"))
    assert list((tmp_path / "draft_length").glob("*.json")) == [saved]


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


# ---------------------------------------------------------------- what the user said and got, whatever happens


def test_a_prompt_too_long_is_refused_before_the_conversation_changes():
    """A message that would not fit raises PromptTooLong, saying why, before it is added: the conversation stays as
    it was (no dangling user message, no empty turn). A prompt of exactly the context fits nothing: refused too."""
    session = FakeSession(context_len=5)  # FakeSession's prompt: 3 + words per message
    list(session.reply("a"))  # 4 tokens: fits
    before, turns = list(session.messages), list(session.turns)
    size = len(session.chat_prompt([*before, {"role": "user", "content": "b c"}]))
    for check in (session.check_message, lambda text: list(session.reply(text))):
        with pytest.raises(PromptTooLong, match=rf"^the prompt is {size} tokens; fake-target has a context of 5$"):
            check("b c")
        assert session.messages == before and session.turns == turns
    session.messages, session.turns = [], []
    with pytest.raises(PromptTooLong, match="the prompt is 5 tokens"):
        session.check_message("b c")  # exactly the context
    session.check_message("b")
    session.state.context_len = None  # no known limit: nothing is refused
    session.check_fits([0] * 10_000)


def test_a_completion_is_recorded_as_a_turn_without_a_user_message():
    """`complete` (raw prompt ids) records its turn with an empty user text and the prompt's length, and leaves the
    chat's messages alone, also when it is stopped."""
    session = FakeSession()
    rounds = session.complete([5, 6, 7])
    next(rounds)
    rounds.close()
    [turn] = session.turns
    assert (turn.user, turn.prompt_tokens, session.messages) == ("", 3, [])
    assert turn.reply and turn.reply_ids == REPLY[: len(turn.reply_ids)]


class CharTokenizer:
    """Encodes character by character (chat headers <s> <u> <a> are special tokens), but its vocabulary also holds
    the whole words of support.fakes.VOCAB (ids 0-27) that FakeSession's replies are made of: as with BPE, re-encoding a
    reply's text does not give back the ids the model generated. Decoding cleans up " ." unless told not to, as
    many Hugging Face tokenizers do; encoding prepends <bos> unless add_special_tokens=False."""

    SPECIAL = {"<s>": 900, "<u>": 901, "<a>": 902, "<bos>": 903, "<unk>": 904}

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        text = "".join(f"<{m['role'][0]}>{m['content']}" for m in messages) + ("<a>" if add_generation_prompt else "")
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text

    def __call__(self, text, add_special_tokens=True):
        ids = [self.SPECIAL["<bos>"]] if add_special_tokens else []
        for part in re.split("(<[sua]>)", text):
            ids += [self.SPECIAL[part]] if part in self.SPECIAL else [1000 + ord(c) if c.isascii() else 904 for c in part]
        return {"input_ids": ids}

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None):
        names = {v: k for k, v in self.SPECIAL.items()}
        text = "".join(("" if skip_special_tokens else names[i]) if i in names else VOCAB[i] if i < 1000 else chr(i - 1000)
                       for i in ids)
        return text if clean_up_tokenization_spaces is False else text.replace(" .", ".")


class TokenizingSession(FakeSession):
    """FakeSession with the real prompt building (Session's `_continue_conversation`) over CharTokenizer."""

    _continue_conversation = Session._continue_conversation

    def __init__(self):
        super().__init__()
        self.target.tokenizer, self.prompts = CharTokenizer(), []

    def chat_prompt(self, messages):
        return self.target.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def _rounds(self, prompt):
        self.prompts.append(list(prompt))
        return super()._rounds(prompt)


def test_the_next_turn_continues_the_exact_ids_the_conversation_ran_as():
    """The second turn's prompt is the first turn's prompt and reply ids exactly as generated, then the new user
    message and the assistant header (so the cache is reused whole and the model answers, rather than continuing
    the user's text). When the continuation would not decode to the conversation's text (here a character the
    tokenizer cannot encode), or after the messages were replaced, the conversation is encoded afresh."""
    session = TokenizingSession()
    encode = lambda text: session.target.tokenizer(text, add_special_tokens=False)["input_ids"]
    list(session.reply("hi ."))
    assert session.prompts[0] == encode("<u>hi .<a>")
    list(session.reply("more"))
    assert session.prompts[1] == encode("<u>hi .<a>") + REPLY + encode("<u>more<a>")
    list(session.reply("caf\u00e9"))  # é encodes as <unk>: the ids would not decode to the text
    assert session.prompts[2] == session.chat_prompt(session.messages[:-1])
    session.restore(session.messages)
    list(session.reply("again"))
    assert session.prompts[3] == session.chat_prompt(session.messages[:-1])


def test_a_reply_is_recorded_without_special_tokens(tiny):
    """The reply's text (what the messages and the saved conversation keep) leaves out the EOS that ended it."""
    session = Session(tiny, sampling=SamplingParams(0), max_new_tokens=64)
    list(session.reply("rain"))  # this tiny model answers "for", then EOS
    turn = session.turns[-1]
    assert (turn.stop_reason, turn.reply_ids[-1], turn.reply) == ("eos", 1, "for")
    assert session.messages[-1] == {"role": "assistant", "content": "for"}


# ---------------------------------------------------------------- settings, seeds, setup


def test_a_session_has_its_documented_defaults_and_labels(tiny):
    session = Session(tiny)
    assert (session.mode, session.controls.k, session.max_new_tokens) == ("off", 4, 256)
    assert session.modes is MODE_NAMES and (session.info.device, session.info.engine) == ("cpu", "torch")
    assert Session(tiny, k=3).controls.k == 3


def test_the_seed_alone_decides_a_sampled_reply(tiny, monkeypatch):
    """Two sessions with the same seed sample the same reply whatever torch's global generator holds; without a
    seed one is drawn from 2**31 values (not a handful, which would repeat replies across sessions)."""
    replies = []
    for global_seed in (0, 1):
        session = Session(tiny, sampling=SamplingParams(1.0), seed=7, max_new_tokens=12)
        session.eos_ids = set()
        torch.manual_seed(global_seed)
        list(session.reply("hello world"))
        replies.append(session.turns[-1].reply_ids)
        assert session.seed == 7
    assert replies[0] == replies[1]
    other = Session(tiny, sampling=SamplingParams(1.0), seed=8, max_new_tokens=12)
    other.eos_ids = set()
    list(other.reply("hello world"))
    assert other.turns[-1].reply_ids != replies[0]  # and another seed another reply: the seed is used
    bounds = []

    class Drawn:
        def randrange(self, n):
            bounds.append(n)
            return n - 1

    monkeypatch.setattr("random.SystemRandom", Drawn)
    assert Session(tiny).seed == bounds[0] - 1 and bounds[0] >= 2**31


def test_auto_s_setup_names_the_weights_engine_machine_and_head(tiny, tmp_path):
    """What auto's learnt rates are kept under: every key, and the head file by name and size (None when missing)."""
    from specchat import machine, models, threads

    head = tmp_path / "h.safetensors"
    head.write_bytes(b"12345")
    common = {"engine": "torch", "device": "cpu", "dtype": tiny.dtype_name, "threads": threads.setting(),
              "cpu": machine.cpu_name(), "cores": os.cpu_count()}
    weights = models.weights_id(tiny.model)
    cpu = torch.device("cpu")
    assert auto_setup(tiny, tiny, cpu, {"head_file": str(head)}) == {"target": weights, "draft": weights, "head": "h.safetensors:5", **common}
    assert auto_setup(tiny, None, cpu, {"head_file": str(tmp_path / "gone")}) == {"target": weights, "draft": None, "head": None, **common}
    assert auto_setup(tiny, None, cpu, {})["head"] is None


def test_drafter_options_on_llama_cpp_ask_for_a_smaller_quantisation(monkeypatch, caplog):
    """A GGUF target: mode quant (and auto, on a 16- or 32-bit file only) drafts with a smaller quantisation of
    the file; none when it would be the same type, when the user gave one, or when it cannot be made (said why)."""
    from specchat.engine.llamacpp import EngineError
    from specchat.session import drafter_options

    monkeypatch.setattr("specchat.models.quantized_gguf", lambda path, kind: Path(f"{path}.{kind}"))
    monkeypatch.setattr("specchat.store.load_tuned", lambda model, mode: {"skip_layers": [1]})
    gguf = lambda dtype: SimpleNamespace(engine="llama.cpp", dtype=dtype, path=Path("/m/x.gguf"))
    for mode, dtype, want in [("quant", "F16", "Q4_0"), ("quant", "Q8_0", "Q4_0"), ("quant", "Q6_K", "Q3_K_M"),
                              ("quant", "Q4_K_M", "Q2_K"), ("quant", "Q2_K", None), ("auto", "F32", "Q4_0"),
                              ("auto", "F16", "Q4_0"), ("auto", "BF16", "Q4_0"), ("auto", "Q8_0", None),
                              ("off", "F16", None), ("layerskip", "F16", None)]:
        expected = {"quant_gguf": f"/m/x.gguf.{want}"} if want else {}
        assert drafter_options(gguf(dtype), mode, {}) == expected, (mode, dtype)
    assert drafter_options(gguf("F16"), "quant", {"quant_gguf": "mine.gguf"}) == {"quant_gguf": "mine.gguf"}

    def fails(path, kind):
        raise EngineError("no quantizer")

    monkeypatch.setattr("specchat.models.quantized_gguf", fails)
    with caplog.at_level("WARNING", logger="specchat"):
        assert drafter_options(gguf("F16"), "quant", {"k": 1}) == {"k": 1}
    assert caplog.messages == ["no Q4_0 copy of x.gguf for mode quant: no quantizer"]


def test_drafter_options_add_the_tuned_setting_the_factor_store_and_the_head(monkeypatch, tmp_path):
    """A torch target: a tunable mode gets the setting `specchat tune` saved unless the user gave one; lowrank its
    factor store in the user cache; head (and auto, for its head candidate) the head file found for the weights."""
    from specchat import store
    from specchat.session import drafter_options

    tuned = {"layerskip": {"skip_layers": [1, 2]}, "earlyexit": {"other": 3}, "lowrank": {"rank": 8}}
    monkeypatch.setattr("specchat.store.load_tuned", lambda model, mode: tuned.get(mode))
    monkeypatch.setattr("specchat.session.fingerprint", lambda model: "fp")
    monkeypatch.setattr("specchat.store.find_head", lambda fp: Path(f"/heads/{fp}.safetensors"))
    model = SimpleNamespace(engine="torch")
    assert drafter_options(model, "layerskip", {}) == {"skip_layers": [1, 2]}
    assert drafter_options(model, "layerskip", {"skip_layers": [3]}) == {"skip_layers": [3]}
    assert drafter_options(model, "earlyexit", {}) == {}
    assert drafter_options(model, "off", {"k": 1}) == {"k": 1}
    lowrank = drafter_options(model, "lowrank", {})
    assert lowrank.pop("rank") == 8 and lowrank.pop("factor_store").folder == store.cache_dir() / "lowrank" and not lowrank
    mine = store.TensorStore(tmp_path)
    assert drafter_options(model, "lowrank", {"factor_store": mine, "rank": 2}) == {"factor_store": mine, "rank": 2}
    assert drafter_options(model, "head", {}) == {"head_file": Path("/heads/fp.safetensors")}
    assert drafter_options(model, "head", {"head_file": "mine"}) == {"head_file": "mine"}
    assert drafter_options(model, "auto", {}) == {"head_file": Path("/heads/fp.safetensors")}


def test_each_mode_s_drafter_is_built_with_its_own_options_and_auto_with_the_saved_conversations(tiny, monkeypatch):
    """The options a drafter is built with are its mode's; auto (like suffix) also gets the saved conversations and
    the rates earlier sessions learnt."""
    built = []
    monkeypatch.setattr("specchat.session.build_drafter", lambda mode, target, draft, **options: built.append((mode, options)) or FakeDrafter(mode))
    monkeypatch.setattr("specchat.store.load_tuned", lambda model, mode: {"skip_layers": [1]} if mode == "layerskip" else None)
    session = Session(tiny, mode="layerskip")
    assert built[-1] == ("layerskip", {"skip_layers": [1]})
    session.set_mode("auto")
    assert built[-1][0] == "auto" and built[-1][1]["references"] == [] and built[-1][1]["memory"] is not None


def test_saved_conversations_are_read_most_recent_last_within_the_budget(tiny, monkeypatch, tmp_path):
    """Suffix's corpus: each saved conversation's chat messages (other entries dropped; none saved: no tokens) as
    token ids, the most recent last, stopping once `budget` tokens are read in all; one the template refuses is
    skipped, not the end of it."""
    import json

    from specchat import history

    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(tmp_path))
    folder = history.conversations_dir()
    folder.mkdir(parents=True)
    said = {"e": [{"role": "user", "content": "rain"}],
            "a": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}, {"role": "tool", "content": "x"},
                  {"role": "user", "content": 5}, "junk"],
            "b": [{"role": "user", "content": "refused"}], "c": None, "d": [{"role": "user", "content": "the cat"}]}
    for i, (name, messages) in enumerate(said.items()):  # d is the most recent
        data = {"format": history.FORMAT, "updated": f"2026-01-0{i + 1}T00:00:00+00:00"}
        (folder / f"{name}.json").write_text(json.dumps(data if messages is None else {**data, "messages": messages}))
    ids = {name: tiny.chat_ids(said[name][:2]) for name in ("e", "a", "d")}
    real = tiny.chat_ids
    monkeypatch.setattr(tiny, "chat_ids", lambda m: 1 / 0 if m[0]["content"] == "refused" else real(m))
    session = Session(tiny, max_new_tokens=8)
    assert session.saved_conversations() == [ids["e"], ids["a"], [], ids["d"]]
    assert session.saved_conversations(budget=len(ids["d"])) == [ids["d"]]
    assert session.saved_conversations(budget=len(ids["d"]) + 1) == [ids["a"], [], ids["d"]]
    assert session.saved_conversations(budget=len(ids["d"]) + len(ids["a"])) == [ids["a"], [], ids["d"]]


def test_another_engine_shares_the_weights_not_the_cache_drafter_or_baseline(tiny):
    """`engine()` (verify's parallel draws): its own KV cache on the same runner, its own drafter of this session's
    mode, the same K, sampling and rule, its own copy of adaptive K, and no in-band baseline."""
    from specchat.engine.loop import AdaptiveK

    session = Session(tiny, tiny, mode="draft", k=3, sampling=SamplingParams(0.5))
    session.controls.adaptive = AdaptiveK(start=5)
    session.measure_baseline(4)
    state, controls = session.engine()
    assert state is not session.state and state.runner == session.state.runner and state.tokens == []
    assert controls.drafter is not session.controls.drafter and controls.mode == "draft"
    assert (controls.k, controls.sampling, controls.rule) == (3, SamplingParams(0.5), session.controls.rule)
    assert controls.adaptive is not session.controls.adaptive and controls.adaptive.start == 5
    assert isinstance(session.controls.drafter, InBandBaseline) and not isinstance(controls.drafter, InBandBaseline)


def test_measure_baseline_runs_plain_rounds_every_n_and_the_first_at_once(tiny):
    """The in-band baseline is a drafter around the mode's (the loop's one hook); a mode switch keeps its count."""
    session = Session(tiny, tiny, mode="draft")
    session.measure_baseline(8)
    c, draft = session.controls, session.drafter("draft")
    b = c.drafter
    assert (b.plain.name, b.plain is session.drafter("off"), b.every, b.since) == ("off", True, 8, 7)
    assert b.drafter is draft and session.mode_drafter is draft and session.mode == "draft"
    session.set_mode("lookup")
    assert c.drafter is b and b.drafter is session.drafter("lookup") is session.mode_drafter and session.mode == "lookup"
    session.measure_baseline(0)
    assert c.drafter is session.drafter("lookup") and session.mode == "lookup"


def test_configure_mode_rebuilds_only_that_mode_and_token_text_keeps_specials(tiny):
    session = Session(tiny, tiny, mode="draft", mode_options={"calibration": 16})
    draft, off = session.drafter("draft"), session.drafter("off")
    session.configure_mode("draft", k_hint=2)
    assert session.mode_options == {"calibration": 16, "k_hint": 2}
    assert session.drafter("off") is off and session.drafter("draft") is not draft
    assert session.token_text(1) == "<eos>" and session.token_text(30) == tiny.tokenizer.convert_ids_to_tokens(30)
    assert session.raw_prompt("the cat") == tiny.raw_ids("the cat")


def test_another_engine_builds_its_drafter_like_the_session_s(tiny, monkeypatch):
    """The other engine's drafter: this mode, these weights, the mode's options (tuned setting included), with or
    without a draft model; its own adaptive K schedule; its cache on the session's runner."""
    from specchat.engine.llamacpp import target_state
    from specchat.engine.loop import AdaptiveK

    built = []
    monkeypatch.setattr("specchat.session.build_drafter", lambda *args, **options: built.append((args, options)) or FakeDrafter(args[0]))
    monkeypatch.setattr("specchat.store.load_tuned", lambda model, mode: {"skip_layers": [2]} if (model, mode) == (tiny.model, "layerskip") else None)
    session = Session(tiny, mode="layerskip", mode_options={"calibration": 16})
    session.controls.adaptive = AdaptiveK()
    session.state = target_state(tiny.model, "hf")
    state, controls = session.engine()
    assert built[-1] == (("layerskip", tiny.model, None), {"calibration": 16, "skip_layers": [2]})
    assert state.runner == "hf"
    controls.adaptive.update("layerskip", 4, 4)
    assert session.controls.adaptive.ks == {}


def test_configure_mode_of_a_mode_not_built_yet_only_stores_its_settings(tiny):
    session = Session(tiny)
    session.configure_mode("layerskip", skip_layers=[1])
    assert session.mode_options == {"skip_layers": [1]} and "layerskip" not in session._drafters


def test_check_message_measures_the_message_as_the_user_s_next_turn():
    session = TokenizingSession()
    session.state.context_len = len(session.chat_prompt([{"role": "user", "content": "hi"}])) + 1
    session.check_message("hi")
    session.state.context_len -= 1
    with pytest.raises(PromptTooLong):
        session.check_message("hi")
