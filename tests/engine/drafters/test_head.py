"""Mode head (engine/drafters/head.py) and `specchat train-head` (train/head.py).

Exactness on a tiny random Llama with a random head drafting over a restricted vocabulary: each of the first
K+1 tokens against the target's exact conditionals with K = 3 really drafted, a negative control (a head that
reports the wrong q from position 3) that the same test rejects, greedy identity with plain decoding while modes
switch every round. Then: a head trained for other weights is refused, training lowers the loss, the command
rejects bad input in one line, and a head it trains is found and used by `generate`.
"""

import json
import random
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from support.models import HEAD_LEFT_OUT, random_head, tiny_llama, tiny_model_dir
from support.exact import ALPHA, assert_drafted_up_to, PROMPT, run, sample_and_fit, SAMPLING_CASES
from support.broken import ReportsWrongQ
from specchat.cli.main import main
from specchat.engine.drafters import ModeUnavailable, build_drafter
from specchat.engine.drafters.earlyexit import EarlyExitDrafter
from specchat.engine.drafters.head import HeadDrafter, fingerprint, load_head
from specchat.engine.drafters.lookup import LookupDrafter
from specchat.engine.drafters.plain import PlainDecoding
from specchat.engine.loop import Controls, generate
from specchat.engine.runner import lean_runner
from specchat.engine.sampling import SamplingParams
from specchat.engine.target import TargetState
from specchat.engine.cache import KVCache
from specchat.train.head import Data, Recipe, Trainer, identity, save_head, target_features, training_time_mask, training_seconds

LEFT_OUT = HEAD_LEFT_OUT


@pytest.fixture(scope="module")
def head(tiny_target):
    return random_head(tiny_target)


@pytest.mark.parametrize("case", ["t1", "t0.7-topk5", "topp0.8"])
@pytest.mark.slow
def test_head_samples_the_target_distribution(tiny_target, head, case):
    """K = 3 with draws of K+1 tokens: every draft position and the bonus, each against the exact conditionals."""
    fit, stats = sample_and_fit(tiny_target, HeadDrafter(head, tiny_target), SAMPLING_CASES[case], k=3, draws=1000)
    assert_drafted_up_to(stats, 3)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts both accepted and rejected
    assert fit.passed(ALPHA), fit


@pytest.fixture(scope="module")
def trained_head(tiny_target):
    """A head trained briefly on the tiny target (its drafts are often accepted, so position 3 is often judged)."""
    runner = lean_runner(tiny_target)
    gen = torch.Generator().manual_seed(1)
    sequences = [PROMPT + torch.randint(0, runner.vocab_size, (40,), generator=gen).tolist() for _ in range(16)]
    trainer = Trainer(SimpleNamespace(model=tiny_target), Recipe(lr=1e-2, noise=0.0), torch.arange(runner.vocab_size), 1.0)
    data = [(s, target_features(runner, s)) for s in sequences]
    for step in range(200):
        trainer.train_step(data[step % 4 * 4 : step % 4 * 4 + 4], 200)
    return trainer.head.requires_grad_(False)


@pytest.mark.slow
def test_a_trained_head_samples_the_target_distribution(tiny_target, trained_head):
    fit, stats = sample_and_fit(tiny_target, HeadDrafter(trained_head, tiny_target), SAMPLING_CASES["t1"], k=3, draws=1000)
    assert_drafted_up_to(stats, 3)
    assert fit.passed(ALPHA), fit


@pytest.mark.slow
def test_the_distribution_test_rejects_a_head_reporting_the_wrong_q(tiny_target, trained_head):
    """Control: the same test fails a head that samples right but reports q at another temperature from position 3."""
    drafter = ReportsWrongQ(HeadDrafter(trained_head, tiny_target), position=3, factor=0.25)
    fit, stats = sample_and_fit(tiny_target, drafter, SAMPLING_CASES["t1"], k=3, draws=1000)
    assert stats.num_accepted_tokens_per_pos[1] > 0.4 * stats.num_draft_tokens_per_pos[1]  # position 3 is often reached
    assert_drafted_up_to(stats, 3)
    assert fit.p_value < 1e-6 and fit.worst_position == 3, fit


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
    data = Data(sequences, [target_features(runner, s) for s in sequences], [-1] * 6, [0] * 6)
    trainer = Trainer(SimpleNamespace(model=tiny_target), Recipe(lr=1e-2, noise=0.0), torch.arange(runner.vocab_size), 1.0)

    def loss_and_agreement() -> tuple[float, float]:
        with torch.no_grad():
            loss = sum(float(trainer.loss(s, f, noise=False)[0]) for s, f in zip(data.sequences, data.features)) / 6
        return loss, trainer.evaluate(data, runner.head_w.detach())["first_draft_greedy_agreement"]

    loss_before, agreement_before = loss_and_agreement()
    for step in range(60):
        trainer.train_step(list(zip(data.sequences, data.features))[step % 2 * 3 : step % 2 * 3 + 3], 60)
    loss_after, agreement_after = loss_and_agreement()
    # the cross-entropy has the target's entropy as its floor, so the loss falls little; agreement shows the learning
    assert loss_after < loss_before and agreement_after > agreement_before + 0.3, (loss_before, loss_after, agreement_before, agreement_after)


def test_the_training_time_mask_by_hand():
    """Depth 2 (d=1): row j sees depth 1's rows up to j-1 and its own depth-2 key; depth 3: up to j-2, then depth 2's
    row j-1, then itself."""
    T, F_ = True, False
    assert training_time_mask(3, 0).tolist() == [[T, F_, F_], [T, T, F_], [T, T, T]]
    assert training_time_mask(3, 1).tolist() == [[F_, F_, F_, T, F_, F_], [T, F_, F_, F_, T, F_], [T, T, F_, F_, F_, T]]
    assert training_time_mask(4, 2)[3].tolist() == [T, T, F_, F_] + [F_, F_, T, F_] + [F_, F_, F_, T]


def tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(3)
    config = Qwen3Config(vocab_size=12, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    return Qwen3ForCausalLM(config).eval()


@pytest.mark.parametrize("family", ["gqa", "mha", "qwen3"])
def test_the_training_time_test_computes_what_the_drafter_computes(family):
    """Depth d+1's row j in one batched forward = drafting position d+1 a position at a time, the head's cache holding
    the rows before (HeadDrafter.propose's calls), the drafts being the true tokens. Grouped query heads (the packed
    attention path), one KV head per query head (the other path), Qwen3's q/k norms."""
    target = {"gqa": lambda: tiny_llama(seed=3, layers=2), "mha": lambda: tiny_llama(seed=3, layers=2, num_key_value_heads=2),
              "qwen3": tiny_qwen3}[family]()
    runner = lean_runner(target)
    seq = torch.randint(0, runner.vocab_size, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    feats = target_features(runner, seq)  # [12, D]
    trainer = Trainer(SimpleNamespace(model=target), Recipe(depth=3, noise=0.0), torch.arange(runner.vocab_size), 1.0)
    head = trainer.head.requires_grad_(False)
    n = len(seq) - 1
    f_in, emb = feats[:-1][None], torch.nn.functional.embedding(torch.tensor([seq[1:]]), trainer.embed_w)  # [1, n, D] x 2
    cos, sin = trainer.rope(n)
    with torch.no_grad():
        preds = trainer.predict(f_in, emb, cos, sin)  # 3 x [1, n, D]
        for j in range(2, n):
            cache = KVCache(1, head.shape.n_kv_heads, head.shape.head_dim, torch.float32, torch.device("cpu"))
            h = head(f_in[:, : j - 1], emb[:, : j - 1], cache, 0, cos[:, : j - 1], sin[:, : j - 1])[:, -1:]  # row j-2
            torch.testing.assert_close(h[0, 0], preds[0][0, j - 2], rtol=1e-4, atol=1e-5)
            for d in (1, 2):  # draft position d+1 at row j-2+d, fed the prediction and the true token
                row = j - 2 + d
                h = head(h, emb[:, row : row + 1], cache, row, cos[:, row : row + 1], sin[:, row : row + 1])
                torch.testing.assert_close(h[0, 0], preds[d][0, row], rtol=1e-4, atol=1e-5)


def test_training_time_test_lowers_the_second_positions_loss(tiny_target):
    """Depth 2 trained, the head's second draft (fed its own first prediction) agrees with the target more."""
    runner = lean_runner(tiny_target)
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, runner.vocab_size, (30,), generator=gen).tolist() for _ in range(6)]
    batch = [(s, target_features(runner, s)) for s in sequences]
    trainer = Trainer(SimpleNamespace(model=tiny_target), Recipe(lr=1e-2, noise=0.0, depth=2), torch.arange(runner.vocab_size), 1.0)

    def second_agreement() -> float:
        agree = total = 0
        with torch.no_grad():
            for seq, feats in batch:
                emb = torch.nn.functional.embedding(torch.tensor([seq[1:]]), trainer.embed_w)
                pred = trainer.predict(feats[:-1][None], emb, *trainer.rope(len(seq) - 1))[1][0, 1:]  # rows 1.. [n-1, D]
                agree += int((trainer.logits(pred).argmax(-1) == trainer.logits(feats[2:]).argmax(-1)).sum())
                total += len(pred)
        return agree / total

    before = second_agreement()
    for step in range(60):
        trainer.train_step(batch[step % 2 * 3 : step % 2 * 3 + 3], 60)
    assert second_agreement() > before + 0.3, before


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
    base = ["--vocab", "20"] if "--vocab" not in args else []
    result = CliRunner().invoke(main, ["train-head", "--target", str(model_dir), "--minutes", "0.05", *base, *args])
    assert result.exit_code in (1, 2), result.output
    assert message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output


def test_train_head_then_generate_finds_and_uses_it(model_dir, tmp_path):
    from specchat import store
    from specchat.models import load_model

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["the quick fox", "a lazy dog", "it was a sunny day"] * 4))
    work = store.heads_dir() / f"{fingerprint(load_model(str(model_dir), torch.device('cpu'), torch.float32).model)}.work"
    work.mkdir(parents=True, exist_ok=True)
    (work / "data.safetensors").write_bytes(b"data kept the way older versions kept it")
    result = CliRunner().invoke(main, ["train-head", "--target", str(model_dir), "--data", str(data), "--minutes", "0.1", "--steps", "20", "--vocab", "20"])
    assert result.exit_code == 0, result.output
    assert not (work / "data.safetensors").exists() and list(work.glob("replies-*.safetensors"))  # stale file gone, shards kept
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


def test_max_draft_caps_k(tiny_target, head):
    drafter = HeadDrafter(head, tiny_target, {"max_draft": 2})
    _, records = run(tiny_target, drafter, PROMPT, k=5, params=SamplingParams(1.0), max_new_tokens=30)
    assert max(r.drafted for r in records) == 2


@pytest.mark.slow
def test_the_shipped_head_is_found_for_the_default_model_and_drafts_exactly(smol):
    from specchat import store

    path = store.find_head(fingerprint(smol.model))
    assert path is not None and path.parent == store.SHIPPED_HEADS
    drafter = build_drafter("head", smol.model, head_file=path)
    prompt = smol.chat_ids([{"role": "user", "content": "Name three rivers in Europe."}])
    plain, _ = run(smol.model, PlainDecoding(), prompt, k=1, params=SamplingParams(0), max_new_tokens=48)
    out, records = run(smol.model, drafter, prompt, k=4, params=SamplingParams(0), max_new_tokens=48)
    assert out == plain
    assert max(r.drafted for r in records) == 1 and sum(r.accepted for r in records) > 0  # max_draft 1, and it helps


def test_the_data_sampler_draws_softmax_over_t_and_greedy_rows_take_the_argmax():
    """InverseCDF (train/head.py) samples the training replies: row 0 at T = 0.7 must follow softmax(scores / 0.7)
    (chi-square over 4000 draws), row 1 at T = 0 the argmax; a sampler ignoring the temperature fails the same test."""
    from specchat.train.head import InverseCDF
    from specchat.verify import chi2_sf

    scores = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]] * 2)  # [B=2, V=6]
    expected = torch.softmax(scores[0] / 0.7, -1) * 4000

    def counts(temperature: float) -> torch.Tensor:
        sampler = InverseCDF([temperature, 0.0], torch.Generator().manual_seed(1))
        picks = [sampler(None, scores).argmax(-1) for _ in range(4000)]  # the chosen token keeps score 0, the rest -inf
        assert all(int(p[1]) == 5 for p in picks)
        return torch.bincount(torch.stack([p[0] for p in picks]), minlength=6).double()

    def p_value(observed: torch.Tensor) -> float:
        return chi2_sf(float(((observed - expected) ** 2 / expected).sum()), 5)

    assert p_value(counts(0.7)) > ALPHA
    assert p_value(counts(1.0)) < ALPHA  # T = 1 instead of 0.7: rejected


def test_padding_the_training_rows_changes_no_loss_or_logit(tiny_target, monkeypatch):
    """Trainer.loss pads rows to a multiple of ROWS_BUCKET (one matmul shape for many lengths); causal attention
    must keep the padding out of the real rows."""
    import specchat.train.head as train

    runner = lean_runner(tiny_target)
    seq = torch.randint(0, runner.vocab_size, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    feats = target_features(runner, seq)
    trainer = Trainer(SimpleNamespace(model=tiny_target), Recipe(noise=0.0), torch.arange(runner.vocab_size), 1.0)
    with torch.no_grad():
        padded = trainer.loss(seq, feats, noise=False)
        monkeypatch.setattr(train, "ROWS_BUCKET", 1)
        plain = trainer.loss(seq, feats, noise=False)
    assert padded[1].shape == plain[1].shape == (20, runner.vocab_size)
    torch.testing.assert_close(padded[1], plain[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded[0], plain[0], rtol=1e-5, atol=1e-5)


def test_a_batch_of_sequences_gives_each_sequence_its_own_loss_and_logits(tiny_target):
    """Trainer.batch_loss feeds a step's sequences padded into one batch: the loss must be the mean of the
    sequences' own losses and each one's logits its own, whatever the others' lengths."""
    runner = lean_runner(tiny_target)
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist() for n in (9, 40, 23)]
    batch = [(seq, target_features(runner, seq)) for seq in seqs]
    trainer = Trainer(SimpleNamespace(model=tiny_target), Recipe(noise=0.0), torch.arange(runner.vocab_size), 1.0)
    with torch.no_grad():
        total, logits = trainer.batch_loss(batch, noise=False)
        alone = [trainer.loss(seq, feats, noise=False) for seq, feats in batch]
    torch.testing.assert_close(total, sum(loss for loss, _ in alone) / 3, rtol=1e-5, atol=1e-5)
    for mine, (_, own) in zip(logits, alone):
        torch.testing.assert_close(mine, own, rtol=1e-5, atol=1e-5)


def test_each_step_takes_sequences_of_similar_length_and_every_sequence_once_an_epoch():
    from specchat.train.head import epoch_order

    lengths = [random.Random(i).randint(10, 400) for i in range(203)]
    order = epoch_order(random.Random(0), lengths, 4)
    assert sorted(order) == list(range(203))
    steps = [order[::-1][i : i + 4] for i in range(0, 200, 4)]  # read from the end, 4 at a time

    def padded_share(steps) -> float:
        return 1 - sum(lengths[j] for s in steps for j in s) / sum(4 * max(lengths[j] for j in s) for s in steps)

    shuffled = random.Random(1).sample(range(203), 203)
    assert padded_share(steps) < 0.5 * padded_share([shuffled[i : i + 4] for i in range(0, 200, 4)])
    assert order != epoch_order(random.Random(1), lengths, 4)  # the steps' order is random


def test_data_is_saved_in_shards_and_a_longer_run_carries_on(model_dir, tmp_path, monkeypatch):
    """A run with a tiny budget makes one batch of replies (and no text) and saves it; a run with a larger budget
    loads it and adds the rest, and ends with what one long run makes."""
    from specchat.models import load_model
    from specchat.train import head as train
    from specchat.train.head import collect, collect_text

    monkeypatch.setattr(train, "stdlib_docstrings", lambda seed: [f"doc {i} " * 9 for i in range(8)])
    monkeypatch.setattr(train, "TEXT_SHARD", 2)

    target = load_model(str(model_dir), torch.device("cpu"), torch.float32)
    data_file = tmp_path / "data.jsonl"
    data_file.write_text("".join(json.dumps({"prompt": f"item {i} is"}) + "\n" for i in range(6)))
    recipe = Recipe(data_file=str(data_file), batch=4, max_new_tokens=6, max_len=24, bfloat16="no")
    said: list[str] = []

    def both(work, seconds):
        said.clear()
        progress = lambda text, fraction: said.append(text)  # noqa: E731
        return (collect(target, lambda: target.model, recipe, seconds, work, progress),
                collect_text(target, lambda: target.model, recipe, seconds, work, progress))

    short = both(tmp_path / "w", 1e-9)  # the first batch always runs; the text loop stops at once
    assert len(list((tmp_path / "w").glob("replies-*"))) == 1 and short[0].sequences and not short[1].sequences
    assert short[0].seconds > 0
    resumed = both(tmp_path / "w", 1e9)  # every pass of every prompt
    assert any(text.startswith(f"data from earlier runs: {len(short[0].sequences)} replies") for text in said), said
    fresh = both(tmp_path / "fresh", 1e9)
    assert not any("earlier runs" in text for text in said), said
    assert len(list((tmp_path / "w").glob("replies-*"))) == 6  # 6 prompts, 4 a batch, 3 passes
    assert len(list((tmp_path / "w").glob("text-*"))) >= 3

    def same(runs, fresh):
        for a, b in zip(runs, fresh):
            assert a.sequences == b.sequences and a.groups == b.groups and a.starts == b.starts and a.tokens > 0
            assert all(torch.equal(x, y) for x, y in zip(a.features, b.features))  # made or loaded: the same features

    same(resumed, fresh)
    for shard in [*(tmp_path / "w").glob("replies-0000[3-9]*"), *(tmp_path / "w").glob("text-0000[1-9]*")]:
        shard.unlink()  # as if stopped there
    same(both(tmp_path / "w", 1e9), fresh)
    assert any(text.startswith("text from earlier runs: 2 chunks") for text in said), said
    same(both(tmp_path / "w", 1e9), fresh)  # nothing left to make: all loaded


def test_training_keeps_its_share_when_earlier_runs_made_more_data():
    recipe = Recipe(minutes=10, data_share=0.45)
    assert training_seconds(recipe, 200.0) == 400.0  # this run's data left 400 of 600 s
    assert training_seconds(recipe, 0.45 * 1800) == 0.55 * 600  # data from a 30-minute run: training still gets 330 s
