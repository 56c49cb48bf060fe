"""The small drafter modules at unit level: the interface (base), plain decoding, the shared copy a derived draft
starts from (copydraft), the llama.cpp draft (gguf, on a scripted stand-in for a llama.cpp model and context) and
build_drafter's dispatch and refusals. (Written for the mutation score of specchat/engine/drafters/.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import specchat.engine.drafters.gguf as gguf_module
from support.models import tiny_llama
from specchat.engine.drafters import DRAFTERS, TORCH_ONLY, build_drafter
from specchat.engine.drafters.auto import AutoDrafter
from specchat.engine.drafters.base import Drafter, Proposal
from specchat.engine.drafters.copydraft import CopyDrafter, shared_copy
from specchat.engine.drafters.gguf import GGUFDrafter
from specchat.engine.drafters.lookup import LookupDrafter
from specchat.engine.drafters.plain import PlainDecoding
from specchat.engine.errors import ModeUnavailable
from specchat.engine.llamacpp import EngineError
from specchat.engine.sampling import SamplingParams

CPU = torch.device("cpu")
GREEDY = SamplingParams(0)


class State:
    device = CPU

    def __init__(self, tokens, vocab_size: int = 12) -> None:
        self.tokens, self.vocab_size = list(tokens), vocab_size


# ---------------------------------------------------------------- base


def test_an_empty_proposal():
    p = Proposal.empty(CPU)
    assert p.ids.numel() == 0 and p.ids.dtype == torch.long and p.q is None and p.calls == 0
    assert Proposal.empty(CPU, calls=3).calls == 3 and Proposal.empty(CPU, 2).calls == 2


def test_the_drafter_interfaces_defaults():
    d = Drafter()
    with pytest.raises(NotImplementedError):
        d.propose(State([1]), 1, GREEDY, None)
    assert d.for_round(State([1]), GREEDY) is d and d.observe(object()) is None and d.reset() is None
    assert d.p_min == 0.0
    verified = []
    target = SimpleNamespace(verify=lambda ids: verified.append(ids) or torch.ones(len(ids) + 1, 4))
    assert d.verify(target, [5, 6]).shape == (3, 4) and verified == [[5, 6]]


# ---------------------------------------------------------------- plain decoding


def test_plain_decoding_proposes_nothing():
    d = PlainDecoding.build(None, None, k=4)
    assert isinstance(d, PlainDecoding) and d.name == "off"
    p = d.propose(State([1, 2, 1, 2]), 4, GREEDY, None)
    assert p.ids.numel() == 0 and p.ids.dtype == torch.long and p.q is None and p.calls == 0


# ---------------------------------------------------------------- copydraft


def test_a_shared_copy_shares_every_tensor_and_nothing_else():
    model = tiny_llama(seed=0, layers=2)
    model.register_buffer("scale", torch.ones(3))
    copy = shared_copy(model)
    assert copy is not model and copy.model.layers[0] is not model.model.layers[0]
    assert [id(p) for p in copy.parameters()] == [id(p) for p in model.parameters()]
    assert [id(b) for b in copy.buffers()] == [id(b) for b in model.buffers()]
    copy.model.layers[0].mlp = torch.nn.Identity()  # replacing a module of the copy leaves the target's
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"


def test_a_copy_drafters_extra_bytes_are_its_weights_and_its_cache():
    d = CopyDrafter(tiny_llama(seed=0, layers=2))
    assert d.extra_bytes == 0  # no weights of its own, an empty cache
    d.weight_bytes = 100
    d.propose(State([1, 2, 3]), 1, GREEDY, None)
    # 3 positions fed: 2 layers x (K, V) x 1 KV head x 3 positions x 8 dims x 4 bytes = 384
    assert d.extra_bytes == 100 + 384


# ---------------------------------------------------------------- gguf (a scripted llama.cpp model)


class FakeContext:
    """After token t the next-token logits are 5 at (t + 1) % V, 0 elsewhere; every call is recorded."""

    def __init__(self, vocab: int, n_ctx: int) -> None:
        self.vocab, self.n_ctx, self.decodes, self.crops = vocab, n_ctx, [], []

    def decode(self, feed, past, keep):
        self.decodes.append((list(feed), past, keep))
        rows = torch.zeros(len(feed), self.vocab)
        for i, t in enumerate(feed):
            rows[i, (t + 1) % self.vocab] = 5.0
        return rows[-keep:]

    def crop(self, length):
        self.crops.append(length)


class FakeGGUF:
    engine = "llama.cpp"

    def __init__(self, path="draft.gguf", vocab=10, eos=(), context_len=64, can_rollback=True, repack=False) -> None:
        self.path, self.vocab_size, self.eos_ids, self.repack = Path(path), vocab, set(eos), repack
        self.context_len, self.can_rollback, self.contexts = context_len, can_rollback, []

    def context(self, n_ctx):
        self.contexts.append(FakeContext(self.vocab_size, n_ctx))
        return self.contexts[-1]


def test_a_gguf_drafter_keeps_its_own_context_of_the_targets_window():
    model = FakeGGUF(eos=(9, 7), context_len=64)
    d = GGUFDrafter(model, name="quant", n_ctx=200)
    assert (d.name, d.n_ctx, d.lean, d.vocab_ids, d.embed_size, d.stand_in) == ("quant", 200, None, None, 10, 7)
    assert d.cache is model.contexts[-1] and d.cache.n_ctx == 200 and d.cached == []
    plain = GGUFDrafter(FakeGGUF(context_len=64))
    assert (plain.name, plain.n_ctx, plain.stand_in) == ("draft", 64, 0)  # no window given: the model's; no EOS: 0
    d.reset()
    assert d.cache is model.contexts[-1] and len(model.contexts) == 2 and d.cached == []
    d.crop(5)
    assert d.cache.crops == [5]


def test_a_gguf_drafter_drafts_from_its_context_and_resyncs_it():
    d = GGUFDrafter(FakeGGUF(vocab=10, eos=(8,)), n_ctx=100)
    p = d.propose(State([1, 2], vocab_size=12), 3, GREEDY, None)
    assert p.ids.tolist() == [3, 4, 5] and p.calls == 3 and p.q.shape == (3, 12)
    assert d.cache.decodes == [([1, 2], 0, 1), ([3], 2, 1), ([4], 3, 1)]
    # the target's ids 10 and 11 are beyond the draft's table: fed as its EOS 8 (the stand-in); never proposed
    p = d.propose(State([1, 2, 3, 10, 11]), 1, GREEDY, None)
    assert d.cache.crops[-1] == 3 and d.cache.decodes[-1] == ([8, 8], 3, 1) and p.ids.tolist() == [9]
    logits = d.next_logits([9], 12)
    assert logits.shape == (12,) and torch.isinf(logits[10:]).all() and logits[0] == 5.0  # (9 + 1) % 10
    assert d.next_logits([10], 8).shape == (8,)  # a target vocabulary smaller than the draft's: cut


def test_gguf_build_for_mode_draft():
    target = SimpleNamespace(context_len=333)
    draft = FakeGGUF()
    d = GGUFDrafter.build("draft", target, draft)
    assert (d.name, d.n_ctx, d.model) == ("draft", 333, draft)
    with pytest.raises(ModeUnavailable, match=r"^mode 'draft' needs a draft model: pass --draft MODEL$"):
        GGUFDrafter.build("draft", target, None)
    with pytest.raises(ModeUnavailable, match=r"^target and draft must run on the same engine: both \.gguf files on "
                                              r"llama\.cpp, or --engine torch$"):
        GGUFDrafter.build("draft", target, tiny_llama(seed=0))
    with pytest.raises(ModeUnavailable, match=r"^--draft-vocab needs the torch engine's lean runner \(--engine torch\)$"):
        GGUFDrafter.build("draft", target, draft, draft_vocab=100)


def test_gguf_build_for_mode_quant(monkeypatch):
    target = SimpleNamespace(context_len=333, repack=True)
    with pytest.raises(ModeUnavailable, match=r"^mode 'quant' on llama\.cpp needs a smaller quantisation of the "
                                              r"target's file; none was made$"):
        GGUFDrafter.build("quant", target, None)
    opened = []

    def fake_model(path, repack):
        opened.append(path)
        if path == "bad.gguf":
            raise EngineError("cannot load bad.gguf")
        return FakeGGUF(path, repack=repack)

    monkeypatch.setattr(gguf_module, "GGUFModel", fake_model)
    d = GGUFDrafter.build("quant", target, FakeGGUF(), quant_gguf="q4.gguf")
    assert (d.name, d.n_ctx, d.model.path, opened) == ("quant", 333, Path("q4.gguf"), ["q4.gguf"])
    assert d.model.repack is True  # the target's file was safe to repack: so is its requantised copy
    with pytest.raises(ModeUnavailable, match=r"^mode 'quant': cannot load bad\.gguf$"):
        GGUFDrafter.build("quant", target, None, quant_gguf="bad.gguf")


# ---------------------------------------------------------------- build_drafter


def test_an_unknown_mode_is_refused_with_the_list():
    with pytest.raises(ModeUnavailable, match=r"^unknown mode 'fast'; choose one of off, draft, layerskip, earlyexit, "
                                              r"lowrank, quant, lookup, head, auto, suffix$"):
        build_drafter("fast", None)


def test_build_drafter_passes_the_options_to_the_modes_build():
    d = build_drafter("lookup", None, None, max_ngram=5, min_ngram=4)
    assert isinstance(d, LookupDrafter) and (d.max_ngram, d.min_ngram) == (5, 4)
    assert isinstance(build_drafter("off", tiny_llama(seed=0)), PlainDecoding)
    assert set(DRAFTERS) >= set(TORCH_ONLY)


def test_a_recurrent_gguf_target_runs_only_plain_decoding():
    target = FakeGGUF("/models/rwkv.gguf", can_rollback=False)
    for mode in ("lookup", "suffix", "draft", "quant", "head"):
        with pytest.raises(ModeUnavailable, match=rf"^mode '{mode}': rwkv\.gguf is a recurrent model, whose state "
                                                  r"llama\.cpp cannot roll back$"):
            build_drafter(mode, target, FakeGGUF())
    assert isinstance(build_drafter("off", target), PlainDecoding)
    auto = build_drafter("auto", target, FakeGGUF())
    assert isinstance(auto, AutoDrafter) and list(auto.candidates) == ["off"]


@pytest.mark.parametrize("mode", sorted(TORCH_ONLY))
def test_torch_only_modes_are_refused_on_llama_cpp(mode):
    with pytest.raises(ModeUnavailable, match=rf"^mode '{mode}' needs the torch engine \(--engine torch\): it "
                                              rf"{TORCH_ONLY[mode]}$"):
        build_drafter(mode, FakeGGUF("target.gguf"), FakeGGUF())


def test_draft_and_quant_on_llama_cpp_are_gguf_drafters():
    target = FakeGGUF("target.gguf", context_len=128)
    d = build_drafter("draft", target, FakeGGUF())
    assert isinstance(d, GGUFDrafter) and d.name == "draft" and d.n_ctx == 128
    with pytest.raises(ModeUnavailable, match="^mode 'quant' on llama.cpp needs a smaller quantisation"):
        build_drafter("quant", target, None)
    assert isinstance(build_drafter("lookup", target), LookupDrafter)  # a mode without a model runs on either engine


def test_a_torch_target_with_a_gguf_draft_is_refused():
    with pytest.raises(ModeUnavailable, match=r"^target and draft must run on the same engine: both \.gguf files on "
                                              r"llama\.cpp, or --engine torch$"):
        build_drafter("draft", tiny_llama(seed=0), FakeGGUF())


def test_auto_is_built_from_the_other_modes_drafters():
    target = FakeGGUF("target.gguf", context_len=128)
    auto = build_drafter("auto", target, FakeGGUF())
    # on llama.cpp: no head (torch only), no quant (no requantised file made); a GGUF draft model
    assert list(auto.candidates) == ["off", "suffix", "draft"]
    assert isinstance(auto.candidates["draft"], GGUFDrafter)


def test_build_drafter_passes_the_options_to_the_gguf_drafter(monkeypatch):
    target = FakeGGUF("target.gguf", context_len=128, repack=True)
    with pytest.raises(ModeUnavailable, match=r"^--draft-vocab needs the torch engine's lean runner"):
        build_drafter("draft", target, FakeGGUF(), draft_vocab=100)
    monkeypatch.setattr(gguf_module, "GGUFModel", FakeGGUF)
    d = build_drafter("quant", target, None, quant_gguf="q4.gguf")
    assert isinstance(d, GGUFDrafter) and d.name == "quant" and d.model.path == Path("q4.gguf") and d.n_ctx == 128
    assert d.model.repack is True


def test_empty_proposals_are_on_the_states_device():
    """The "meta" device stands in for an accelerator: an empty proposal lives where the target runs."""
    meta = torch.device("meta")
    assert Proposal.empty(meta).ids.device == meta
    state = State([1, 2])
    state.device = meta
    assert PlainDecoding().propose(state, 3, GREEDY, None).ids.device == meta
