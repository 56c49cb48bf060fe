"""Mode head (engine/drafters/head.py) and `specchat train-head` (train/head.py).

Exactness on a tiny random Llama with a random head drafting over a restricted vocabulary: the joint of the
first three tokens against the exact enumerated distribution with K = 3 really drafted, a negative control
(a head that reports the wrong q) that the same test rejects, greedy identity with plain decoding while modes
switch every round. Then: a head trained for other weights is refused, training lowers the loss, the command
rejects bad input in one line, and a head it trains is found and used by `generate`.
"""

import json
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from helpers import ALPHA, PROMPT, SAMPLING_CASES, exact_joint, run, tiny_llama, tiny_model_dir
from specchat.cli.main import main
from specchat.engine import Controls, SamplingParams, TargetState, generate
from specchat.engine.drafters import ModeUnavailable, Proposal, build_drafter
from specchat.engine.drafters.earlyexit import EarlyExitDrafter
from specchat.engine.drafters.head import DraftHead, HeadDrafter, fingerprint, head_spec, load_head
from specchat.engine.drafters.lookup import LookupDrafter
from specchat.engine.drafters.plain import PlainDecoding
from specchat.engine.metrics import Stats
from specchat.engine.runner import lean_runner
from specchat.train.head import Data, Recipe, Trainer, identity, save_head, target_features
from specchat.verify import goodness_of_fit, sample_continuations

LEFT_OUT = [2, 7]  # tokens the tiny head cannot draft (the target can still emit them)


def random_head(target, seed: int = 5) -> DraftHead:
    """An untrained head with peaked, arbitrary distributions over all tokens but LEFT_OUT."""
    runner = lean_runner(target)
    vocab = [t for t in range(runner.vocab_size) if t not in LEFT_OUT]
    head = DraftHead(head_spec(runner, target.config), len(vocab))
    head.vocab.copy_(torch.tensor(vocab))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5)
    return head.requires_grad_(False)


@pytest.fixture(scope="module")
def head(tiny_target):
    return random_head(tiny_target)


class WrongQ(HeadDrafter):
    """Deliberately broken: samples from q but reports q flattened over the drafted positions >= 2 (q ** 0.25,
    renormalised): a bug that only shows once K >= 2 is drafted."""

    def propose(self, state, k, params, generator) -> Proposal:
        p = super().propose(state, k, params, generator)
        if p.q is None or len(p.ids) < 2:
            return p
        flat = p.q[1:] ** 0.25
        return Proposal(p.ids, torch.cat([p.q[:1], flat / flat.sum(-1, keepdim=True)]), p.calls)


def first_tokens(counts: Counter, n: int) -> Counter:
    out: Counter = Counter()
    for outcome, c in counts.items():
        out[outcome[:n]] += c
    return out


def head_joint(target, drafter, params, *, draws=3000, seed=0):
    """Joint counts of the first 3 tokens of 5-token generations with K = 3 (budget > K, so round one drafts 3),
    and the rounds' statistics."""
    stats = Stats()
    controls = Controls(drafter, k=3, sampling=params)
    counts = sample_continuations(TargetState(target), PROMPT, controls, draws=draws, length=5, eos_ids=set(),
                                  generator=torch.Generator().manual_seed(seed), stats=stats)
    return first_tokens(counts, 3), stats


@pytest.mark.parametrize("case", ["t1", "t0.7-topk5", "topp0.8"])
def test_head_samples_the_target_distribution(tiny_target, head, case):
    params = SAMPLING_CASES[case]
    counts, stats = head_joint(tiny_target, HeadDrafter(head, tiny_target), params)
    assert len(stats.num_draft_tokens_per_pos) == 3 and min(stats.num_draft_tokens_per_pos) > 0  # K = 3 really drafted
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts both accepted and rejected
    result = goodness_of_fit(counts, exact_joint(tiny_target, PROMPT, params, 3))
    assert result.passed(ALPHA), result


def test_the_distribution_test_rejects_a_head_reporting_the_wrong_q(tiny_target, head):
    params = SAMPLING_CASES["t1"]
    counts, _ = head_joint(tiny_target, WrongQ(head, tiny_target), params)
    result = goodness_of_fit(counts, exact_joint(tiny_target, PROMPT, params, 3))
    assert not result.passed(ALPHA), result


def test_head_drafts_only_its_vocabulary_and_q_is_zero_elsewhere(tiny_target, head):
    state = TargetState(tiny_target)
    state.start([1, 2, 3, 4])
    proposal = HeadDrafter(head, tiny_target).propose(state, 4, SamplingParams(1.0), torch.Generator().manual_seed(0))
    assert len(proposal.ids) == 4 and not set(proposal.ids.tolist()) & set(LEFT_OUT)
    assert torch.all(proposal.q[:, LEFT_OUT] == 0)
    torch.testing.assert_close(proposal.q.sum(-1), torch.ones(4))


def test_greedy_identity_while_modes_switch_every_round(tiny_target, head):
    """head after off, earlyexit and lookup rounds (its features and cache catch up), against plain greedy."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref, _ = run(tiny_target, PlainDecoding(), prompt, k=1, params=SamplingParams(0), max_new_tokens=160)
    head_drafter = HeadDrafter(head, tiny_target)
    cycle = [head_drafter, PlainDecoding(), head_drafter, EarlyExitDrafter.build(tiny_target, exit_layer=1), head_drafter, LookupDrafter()]
    state = TargetState(tiny_target)
    controls = Controls(cycle[0], k=4, sampling=SamplingParams(0))
    out, head_rounds, rejected = [], 0, 0
    for i, record in enumerate(generate(state, prompt, controls, max_new_tokens=160, eos_ids=set())):
        out += [t.id for t in record.tokens]
        if controls.drafter is head_drafter:
            head_rounds += 1
            rejected += record.drafted - record.accepted
        controls.drafter = cycle[(i + 1) % len(cycle)]
        assert state.known == len(state.tokens) - 1  # the target's features cover every cached position
    assert out == ref
    assert head_rounds > 20 and rejected > 0


def test_features_match_a_fresh_forward(tiny_target, head):
    """The features the state keeps after rollbacks are the target's own for those tokens."""
    state = TargetState(tiny_target)
    run(tiny_target, HeadDrafter(head, tiny_target), PROMPT, k=4, params=SamplingParams(1.0), max_new_tokens=40, state=state)
    fresh = target_features(lean_runner(tiny_target), state.tokens[:-1])
    torch.testing.assert_close(state.features[: state.known], fresh, rtol=1e-4, atol=1e-5)


def test_a_head_for_other_weights_is_refused(tmp_path, tiny_target, head):
    other = tiny_llama(seed=3, layers=2)
    meta = {"format": "specchat-draft-head/1", "target": {"name": "other", "fingerprint": fingerprint(other)}, "spec": head.spec}
    path = save_head(SimpleNamespace(head=head), tmp_path / "h", meta)
    with pytest.raises(ModeUnavailable, match="trained for other") as e:
        build_drafter("head", tiny_target, head_file=path)
    assert "\n" not in str(e.value)
    assert isinstance(build_drafter("head", other, head_file=path), HeadDrafter)  # the right target takes it
    loaded, _ = load_head(path, other)
    assert torch.equal(loaded.vocab, head.vocab)
    with pytest.raises(ModeUnavailable, match="no draft head"):
        build_drafter("head", tiny_target, head_file=None)


def test_training_lowers_the_loss(tiny_target):
    runner = lean_runner(tiny_target)
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, runner.vocab_size, (30,), generator=gen).tolist() for _ in range(6)]
    data = Data(sequences, [target_features(runner, s) for s in sequences])
    trainer = Trainer(SimpleNamespace(model=tiny_target), Recipe(lr=1e-2, noise=0.0), torch.arange(runner.vocab_size), 1.0)

    def mean_loss() -> float:
        with torch.no_grad():
            return sum(float(trainer.loss(s, f, noise=False)[0]) for s, f in zip(data.sequences, data.features)) / 6

    before = mean_loss()
    for _ in range(40):
        trainer.train_step(list(zip(data.sequences, data.features))[:4], 40)
    assert mean_loss() < 0.7 * before


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.parametrize("args, message", [
    (["--data", "/nonexistent/data.jsonl"], "no such file"),
    (["--data", "BADJSON"], "line 1 is not JSON"),
    (["--minutes", "0"], "--minutes"),
    (["--vocab", "100000"], "--vocab must be in 1.."),
])
def test_train_head_bad_input_is_one_line(model_dir, tmp_path, args, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    args = [str(bad) if a == "BADJSON" else a for a in args]
    result = CliRunner().invoke(main, ["train-head", "--target", str(model_dir), "--minutes", "0.05", *args])
    assert result.exit_code in (1, 2), result.output
    assert message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output


def test_train_head_then_generate_finds_and_uses_it(model_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["the quick fox", "a lazy dog", "it was a sunny day"] * 4))
    result = CliRunner().invoke(main, ["train-head", "--target", str(model_dir), "--data", str(data), "--minutes", "0.1", "--steps", "20", "--vocab", "20"])
    assert result.exit_code == 0, result.output
    assert "saved" in result.output and "mode head finds it" in result.output

    def tokens(mode):
        out = CliRunner().invoke(main, ["generate", "--target", str(model_dir), "--mode", mode, "--prompt", "the quick", "--max-new-tokens", "40", "--format", "json"])
        assert out.exit_code == 0, out.output
        lines = [json.loads(line) for line in out.output.splitlines() if line.startswith("{")]
        return [e["id"] for e in lines if e["type"] == "token"], lines[-1]

    head_ids, summary = tokens("head")
    assert summary["mode"] == "head" and summary["num_draft_tokens"] > 0
    assert head_ids == tokens("off")[0]


def test_identity_names_the_target(tiny_target):
    ident = identity(SimpleNamespace(name="tiny", model=tiny_target))
    assert ident["fingerprint"] == fingerprint(tiny_target) != fingerprint(tiny_llama(seed=4, layers=2))
