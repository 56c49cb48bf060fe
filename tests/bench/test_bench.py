"""`specchat bench`: end to end on a tiny model, the predicted-speedup formula, and bad input."""

import json
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from specchat.bench import runner
from specchat.cli.main import main
from specchat.engine.events import RoundRecord
from specchat.engine.metrics import Stats, expected_tokens_per_round
from support.models import tiny_model_dir
from support.broken import BonusFromPreviousPosition

CONFIG_FIELDS = {
    "config", "mode", "k", "temperature", "accept", "exact", "peer", "generations", "new_tokens", "tokens_per_s",
    "e2e_tokens_per_s", "time_to_first_token_s", "memory_mb", "speedup", "e2e_speedup", "drafter_memory_mb",
}
ENGINE_FIELDS = {
    "acceptance_rate", "mean_accepted_length", "target_calls_per_token", "draft_calls_per_token",
    "per_position_acceptance", "draft_ms_per_round", "verify_ms_per_round", "overhead_ms_per_round",
    "plain_step_ms", "draft_cost", "verify_cost", "predicted_speedup", "measured_over_predicted",
}
RUN_FIELDS = {"config", "mode", "k", "temperature", "prompt", "repeat", "tokens", "new_tokens", "e2e_s",
              "e2e_tokens_per_s", "tokens_per_s", "time_to_first_token_s", "memory_mb", "text"}
MACHINE_FIELDS = {"cpu", "cores", "memory_gb", "gpu", "torch", "transformers", "device", "dtype", "torch_threads", "threads_adaptive"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps({"name": "hello", "kind": "chat", "prompt": "hello world"}) + "\n"
        + json.dumps({"name": "code", "prompt": "write python code to sort a list"}) + "\n"
    )
    return path


def invoke(*args):
    return CliRunner().invoke(main, ["bench", *map(str, args)])


# ---------------------------------------------------------------- end to end


def test_bench_end_to_end(model_dir, prompts_file, tmp_path):
    out = tmp_path / "out"
    result = invoke(
        "--target", model_dir, "--draft", model_dir, "--device", "cpu", "--dtype", "float32",
        "--modes", "off,draft", "--draft-len", "2", "--temperature", "0,0.7", "--prompts", prompts_file,
        "--max-new-tokens", "6", "--repeat", "1", "--peers", "--verify-samples", "20", "--out", out,
    )
    assert result.exit_code == 0, result.output
    assert "| config |" in result.output and "## Hugging Face peers" in result.output
    assert (out / "report.md").read_text().startswith("# specchat bench")
    data = json.loads((out / "results.json").read_text())

    assert MACHINE_FIELDS <= data["machine"].keys()
    assert data["settings"]["draft_lens"] == [2] and data["settings"]["temperatures"] == [0.0, 0.7]
    labels = {c["config"] for c in data["configs"]}
    assert labels == {"off T=0", "draft K=2 T=0", "off T=0.7", "draft K=2 T=0.7", "hf-generate T=0", "hf-assisted K=2 T=0",
                      "hf-generate T=0.7", "hf-assisted K=2 T=0.7"}
    for row in data["configs"]:
        assert CONFIG_FIELDS <= row.keys(), row["config"]
        if not row["peer"]:
            assert ENGINE_FIELDS <= row.keys(), row["config"]
        assert row["tokens_per_s" if not row["peer"] else "e2e_tokens_per_s"]["median"] > 0
    draft = next(c for c in data["configs"] if c["config"] == "draft K=2 T=0")
    assert draft["predicted_speedup"] > 0 and draft["acceptance_rate"] is not None
    assert next(c for c in data["configs"] if c["config"] == "off T=0")["speedup"] == 1.0
    for row in data["configs"]:  # statistics cover the measured runs only, not the warm-ups
        runs = [r for r in data["runs"] if r["config"] == row["config"]]
        assert row["new_tokens"] == sum(r["new_tokens"] for r in runs)
        if not row["peer"]:
            assert row["rounds"] == sum(r["stats"]["rounds"] for r in runs)

    assert len(data["runs"]) == 8 * 2  # every configuration on every prompt, once
    for run in data["runs"]:
        assert RUN_FIELDS <= run.keys()
        if not run["config"].startswith("hf-"):  # every round of a run, in order
            assert len(run["rounds"]) == run["stats"]["rounds"]
            assert sum(r["emitted"] for r in run["rounds"]) == run["new_tokens"]
            assert {r["mode"] for r in run["rounds"]} == {run["mode"]}
    pairs = {p["peer"]: p for p in data["peers"]}
    assert pairs["hf-generate T=0"]["specchat"] == "off T=0" and pairs["hf-generate T=0"]["ratio"] > 0
    assert pairs["hf-assisted K=2 T=0"]["specchat"] == "draft K=2 T=0"

    checks = data["checks"]
    # the draft is the target itself: exact, so identical (two prompts, one repeat)
    assert checks["greedy_identity"] == {"verdict": "pass", "compared": 2, "failures": []}
    assert [v["config"] for v in checks["distribution"]] == ["draft K=2 T=0.7"]
    assert checks["distribution"][0]["verdict"] == "pass"
    assert checks["hf_greedy"]["compared"] == 2
    assert (out / "speedup.png").exists() or "pip install" in result.output


def test_bench_reports_where_autos_time_went(model_dir, prompts_file, tmp_path):
    out = tmp_path / "auto"
    result = invoke(
        "--target", model_dir, "--device", "cpu", "--dtype", "float32", "--modes", "off,auto", "--draft-len", "2",
        "--temperature", "0", "--prompts", prompts_file, "--max-new-tokens", "8", "--repeat", "1", "--verify-samples", "0",
        "--out", out,
    )
    assert result.exit_code == 0, result.output
    data = json.loads((out / "results.json").read_text())
    auto = next(c for c in data["configs"] if c["mode"] == "auto")
    assert sum(auto["time_by_mode"].values()) == pytest.approx(1.0)
    runs = [r for r in data["runs"] if r["mode"] == "auto"]
    assert set(auto["time_by_mode"]) == {r["mode"] for run in runs for r in run["rounds"][1:]}
    assert all(isinstance(r["reason"], str) and r["reason"] for run in runs for r in run["rounds"])
    assert auto["vs_best"]["config"] == "off T=0" and set(auto["vs_best"]["by_prompt"]) == {r["prompt"] for r in runs}
    assert "auto K=2 T=0's decode time by the mode it ran: " in result.output
    assert "against the fastest single mode, `off T=0`" in result.output and "; by prompt: " in result.output


def test_bench_measures_k_as_the_chat_does_over_all_of_a_configurations_runs(model_dir, prompts_file, tmp_path):
    """--draft-len 2,auto: beside K=2, a configuration with K measured (the chat's -k auto, from its start K), one
    measurement carried from run to run: 3 counted rounds a run, so only a carried one reaches MeasuredK's 4 rounds
    before it chooses. Exact: its greedy replies are plain decoding's."""
    out = tmp_path / "measured"
    result = invoke(
        "--target", model_dir, "--draft", model_dir, "--device", "cpu", "--dtype", "float32", "--modes", "off,draft",
        "--draft-len", "2,auto", "--temperature", "0", "--prompts", prompts_file, "--max-new-tokens", "16", "--repeat", "2",
        "--verify-samples", "0", "--out", out,
    )
    assert result.exit_code == 0, result.output
    data = json.loads((out / "results.json").read_text())
    assert data["settings"]["draft_lens"] == [2] and data["settings"]["measured_k"] is True
    assert {c["config"] for c in data["configs"]} == {"off T=0", "draft K=2 T=0", "draft K=auto T=0"}
    measured = next(c for c in data["configs"] if c["config"] == "draft K=auto T=0")
    assert measured["k_measured"] is True and measured["k"] == 4
    assert set(measured["k_chosen"]) == {"draft"} and 1 <= measured["k_chosen"]["draft"] <= 12
    assert not next(c for c in data["configs"] if c["config"] == "draft K=2 T=0")["k_measured"]
    assert data["checks"]["greedy_identity"] == {"verdict": "pass", "compared": 8, "failures": []}
    assert "draft K=auto T=0: K measured per mode as the chat's `-k auto` (from 4)" in result.output
    assert (out / "speedup.png").exists() or "pip install" in result.output


def test_bench_learnt_starts_auto_from_earlier_sessions_and_saves_its_own(model_dir, prompts_file, tmp_path, monkeypatch):
    """--learnt: auto loads and saves the state folder's rates, as the chat does; without it a bench learns nothing."""
    monkeypatch.setenv("SPECCHAT_STATE_DIR", str(tmp_path / "state"))
    args = ("--target", model_dir, "--device", "cpu", "--dtype", "float32", "--modes", "off,auto", "--draft-len", "2",
            "--temperature", "0", "--prompts", prompts_file, "--max-new-tokens", "8", "--repeat", "1", "--verify-samples", "0")

    def rounds_saved():
        saved = list((tmp_path / "state" / "auto").glob("*.json"))
        assert len(saved) == 1
        return sum(arm["rounds"] for arm in json.loads(saved[0].read_text())["rates"]["greedy"].values())

    result = invoke(*args, "--out", tmp_path / "fresh")
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "state").exists() and "--learnt" not in result.output
    assert not json.loads((tmp_path / "fresh" / "results.json").read_text())["settings"]["learnt"]
    saved = []
    for out in ("first", "second"):
        result = invoke(*args, "--learnt", "--out", tmp_path / out)
        assert result.exit_code == 0, result.output
        saved.append(rounds_saved())
    assert 0 < saved[0] < saved[1]  # the second bench added its rounds to the first's
    assert "started from the rates earlier sessions on this setup learnt (--learnt)" in result.output


def test_bench_approximate_rule_gets_quality_metrics(model_dir, prompts_file, tmp_path):
    out = tmp_path / "approx"
    result = invoke(
        "--target", model_dir, "--draft", model_dir, "--device", "cpu", "--dtype", "float32", "--modes", "draft",
        "--draft-len", "2", "--accept", "exact,approx:0.5", "--prompts", prompts_file, "--max-new-tokens", "6",
        "--repeat", "1", "--out", out,
    )
    assert result.exit_code == 0, result.output
    data = json.loads((out / "results.json").read_text())
    approx = data["checks"]["approximate"]
    assert [a["config"] for a in approx] == ["draft K=2 T=0 approx:0.5"]
    # at T=0 a lenient rule still keeps only the target's argmax (p and q are one-hot): the same text as plain
    # greedy, so full agreement and the same mean log-prob as plain decoding's output
    assert approx[0]["greedy_agreement"] == 1.0
    assert approx[0]["mean_logprob"] == pytest.approx(approx[0]["plain_mean_logprob"]) and approx[0]["mean_logprob"] < 0
    assert next(c for c in data["configs"] if c["accept"] != "exact")["exact"] is False
    assert "approx: agree" in result.output


def test_bench_reports_fail_and_exits_1_on_a_broken_rule(tmp_path, prompts_file, monkeypatch):
    """A rule that claims to be exact but draws the bonus from p[K-1]: greedy identity and the distribution check
    both fail, the report says so, and the command exits 1."""
    sharp = tiny_model_dir(tmp_path / "sharp", sharpen=20.0)  # peaked distributions: the wrong bonus shows
    monkeypatch.setattr(runner, "parse_rule", lambda spec: BonusFromPreviousPosition())
    out = tmp_path / "broken"
    result = invoke(
        "--target", sharp, "--draft", sharp, "--device", "cpu", "--dtype", "float32", "--modes", "off,draft",
        "--draft-len", "2", "--temperature", "0,1", "--prompts", prompts_file, "--max-new-tokens", "6", "--repeat", "1",
        "--verify-samples", "100", "--out", out,
    )
    assert result.exit_code == 1, result.output
    assert "bench: quality check FAILED" in result.output
    checks = json.loads((out / "results.json").read_text())["checks"]
    assert checks["greedy_identity"]["verdict"] == "fail" and checks["greedy_identity"]["compared"] == 2
    assert len(checks["distribution"]) == 1 and checks["distribution"][0]["verdict"] == "fail"
    assert checks["distribution"][0]["p_value"] < 1e-6


# ---------------------------------------------------------------- predicted speedup


def test_expected_tokens_per_round_by_hand():
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert expected_tokens_per_round(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)  # 3.3616
    assert expected_tokens_per_round(0.8, 4) == pytest.approx(3.3616)
    assert expected_tokens_per_round(0.0, 4) == 1.0  # every round still emits the replacement
    assert expected_tokens_per_round(1.0, 4) == 5.0  # all accepted plus the bonus


def _stats(rounds, drafted, accepted, draft_s, verify_s):
    stats = Stats()
    for i in range(rounds):
        rec = RoundRecord(index=i, mode="m", draft_len=drafted, drafted=drafted, accepted=accepted,
                          draft_calls=drafted, draft_s=draft_s, verify_s=verify_s)
        rec.tokens = [None] * (accepted + 1)  # Stats only counts them: accepted drafts + replacement
        stats.add(rec)
    return stats


def test_bench_predict_uses_measured_costs():
    """c = draft ms per drafted position / plain step ms; v = verify ms / plain step ms; the prediction is the
    rounds' tokens (3 each: 2 accepted + the replacement) over their cost ((8 + 26) / 20 = 1.7 plain steps)."""
    plain = _stats(10, 0, 0, 0.0, 0.020)  # plain step 20 ms
    spec = _stats(10, 4, 2, 0.008, 0.026)  # K=4, a=0.5, 8 ms drafting, 26 ms verifying per round
    out = runner.predict(runner.Config("draft", 4, 0.0), spec, plain, measured=1.0)
    assert out["plain_step_ms"] == pytest.approx(20.0)
    assert out["draft_cost"] == pytest.approx(0.1)  # 8 / (4 * 20)
    assert out["verify_cost"] == pytest.approx(1.3)
    expected = 3 / 1.7  # i.i.d. acceptance 0.5 would say (1 - 0.5**5) / 0.5 / 1.7 = 1.14: these rounds never accept 0
    assert out["predicted_speedup"] == pytest.approx(expected)
    assert out["measured_over_predicted"] == pytest.approx(1.0 / expected)


def test_peers_follow_the_requested_modes():
    configs = runner.build_configs(["off", "lookup", "earlyexit", "layerskip"], [2, 4], [0.0], ["exact"], peers=True)
    labels = [c.label for c in configs]
    assert "hf-generate T=0" in labels and "hf-lookup K=4 T=0" in labels and "hf-earlyexit K=2 T=0" in labels
    assert not any(c.mode == "hf-assisted" for c in configs)  # no draft mode requested
    assert len(configs) == 2 + 3 * 2 + 2 * 2  # off + hf-generate, 3 modes x 2 K, 2 peers x 2 K


def test_the_turn_order_rotates_from_prompt_to_prompt(monkeypatch):
    """Every configuration runs once per prompt and repeat, and takes every place in the turn order equally often:
    none always runs right after the same other one (a position effect would then fall on it alone)."""
    order = []
    monkeypatch.setattr(runner, "run_one", lambda ctx, cfg, ids, seed, n, warmup=False: order.append((cfg.mode, warmup)) or {})
    ctx = SimpleNamespace(seed=0, max_new_tokens=8)
    configs = [runner.Config(m, 4 if m != "off" else 0, 0.0) for m in ("off", "quant", "auto")]
    prompts = [runner.Prompt(f"p{i}", "chat", "", [1, 2]) for i in range(4)]
    runs = runner.run_all(ctx, configs, prompts, repeat=3)
    assert [m for m, warmup in order if warmup] == ["off", "quant", "auto"]
    measured = [m for m, warmup in order if not warmup]
    assert sorted((r["mode"], r["prompt"], r["repeat"]) for r in runs) == sorted(
        (c.mode, p.name, r) for c in configs for p in prompts for r in range(3))
    turns = [measured[i : i + 3] for i in range(0, len(measured), 3)]  # one prompt and repeat each
    for place in range(3):
        assert sorted(turn[place] for turn in turns) == sorted(["off", "quant", "auto"] * 4)


def test_paired_ratio_and_greedy_identity_failure():
    def run(config, prompt, tps, tokens):
        return {"config": config, "prompt": prompt, "repeat": 0, "tokens_per_s": tps, "tokens": tokens}

    runs = [run("off T=0", "a", 10.0, [1, 2, 3]), run("off T=0", "b", 20.0, [4, 5]),
            run("draft K=2 T=0", "a", 15.0, [1, 2, 3]), run("draft K=2 T=0", "b", 50.0, [4, 6])]
    assert runner.paired_ratio(runs, "draft K=2 T=0", "off T=0", "tokens_per_s") == pytest.approx((1.5 + 2.5) / 2)
    identity = runner.greedy_identity([runner.Config("off", 0, 0.0), runner.Config("draft", 2, 0.0)], runs)
    assert identity == {"verdict": "fail", "compared": 2,
                        "failures": [{"config": "draft K=2 T=0", "prompt": "b", "repeat": 0, "first_difference": 1}]}
    assert runner.greedy_identity([runner.Config("off", 0, 0.0)], runs)["verdict"] == "not run"


def test_auto_is_paired_with_the_fastest_exact_single_mode_at_its_k_and_temperature():
    def row(config, mode, t, speedup, exact=True, peer=False):
        measured = "K=auto" in config
        k = 0 if mode == "off" else 4 if measured else int(config.split("K=")[1].split()[0])
        return {"config": config, "mode": mode, "k": k, "k_measured": measured, "temperature": t, "speedup": speedup,
                "exact": exact, "peer": peer}

    def run(config, prompt, tps):
        return {"config": config, "prompt": prompt, "repeat": 0, "tokens_per_s": tps}

    rows = [row("off T=0", "off", 0.0, 1.0), row("quant K=4 T=0", "quant", 0.0, 1.7), row("head K=4 T=0", "head", 0.0, 1.2),
            row("quant K=4 T=0 typical", "quant", 0.0, 2.5, exact=False), row("hf-assisted K=4 T=0", "hf-assisted", 0.0, 3.0, peer=True),
            row("suffix K=4 T=0.7", "suffix", 0.7, 9.0), row("quant K=8 T=0", "quant", 0.0, 1.9),
            row("quant K=auto T=0", "quant", 0.0, 2.2), row("auto K=4 T=0", "auto", 0.0, 1.6)]
    runs = [run("quant K=4 T=0", "a", 50.0), run("quant K=4 T=0", "b", 40.0),
            run("auto K=4 T=0", "a", 45.0), run("auto K=4 T=0", "b", 48.0)]
    # neither an approximate rule, a peer, another K (measured or not) nor another temperature is auto's rival; quant at
    # K=4 is, paired prompt by prompt
    assert runner.against_best(rows, rows[-1], runs) == {"config": "quant K=4 T=0", "ratio": pytest.approx((0.9 + 1.2) / 2),
                                                          "by_prompt": {"a": pytest.approx(0.9), "b": pytest.approx(1.2)}}
    assert runner.against_best([rows[-1]], rows[-1], runs) is None
    # auto with K measured races the modes with K measured (and plain decoding)
    measured_auto = row("auto K=auto T=0", "auto", 0.0, 1.6)
    runs += [run("quant K=auto T=0", "a", 60.0), run("auto K=auto T=0", "a", 54.0)]
    assert runner.against_best(rows[:-1] + [measured_auto], measured_auto, runs)["config"] == "quant K=auto T=0"


def test_autos_time_by_mode_counts_the_rounds_after_the_first():
    def run(config, *rounds):
        return {"config": config, "rounds": [{"mode": m, "wall_ms": ms} for m, ms in rounds]}

    runs = [run("auto K=4 T=0", ("off", 500.0), ("off", 100.0), ("quant", 300.0)),
            run("auto K=4 T=0", ("draft", 900.0), ("quant", 500.0), ("draft", 100.0)),
            run("quant K=4 T=0", ("quant", 50.0), ("quant", 70.0))]
    shares = runner.time_by_mode(runs, "auto K=4 T=0")
    assert shares == {"quant": pytest.approx(0.8), "off": pytest.approx(0.1), "draft": pytest.approx(0.1)}
    assert next(iter(shares)) == "quant"  # the largest share first
    assert runner.time_by_mode(runs, "head K=4 T=0") == {}


# ---------------------------------------------------------------- bad input, before any model loads


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr("specchat.models.load_model", refuse)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--modes", "off,turbo"], "unknown mode 'turbo'"),
        (["--modes", "draft"], "needs a draft model"),
        (["--prompts", "/nonexistent/prompts.jsonl"], "cannot read prompts file"),
        (["--draft-len", "2,zero"], "--draft-len"),
        (["--draft-len", "0"], "--draft-len"),
        (["--draft-len", "2,often"], "positive integers or auto"),
        (["--temperature", "-1"], "--temperature"),
        (["--accept", "sloppy"], "unknown acceptance rule"),
        (["--verify-samples", "5"], "--verify-samples"),
    ],
)
def test_bad_input_fails_before_loading(no_loading, args, message):
    result = invoke(*args)
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_bad_prompts_file(no_loading, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\nnot json\n')
    result = invoke("--prompts", bad)
    assert result.exit_code != 0 and "line 2: not JSON" in result.output
    bad.write_text('{"text": "no prompt field"}\n')
    assert 'non-empty "prompt"' in invoke("--prompts", bad).output


def test_builtin_prompts_cover_the_workload():
    from specchat.cli.bench import read_prompts

    kinds = {p["kind"] for p in read_prompts("builtin")}
    assert {"chat", "code", "summarise", "repetition"} <= kinds


def test_mode_options_are_json(tmp_path):
    """`bench --head FILE` wrote its options into results.json: a Path there made the report crash after the runs."""
    from specchat.cli.options import ModeSettings

    (tmp_path / "h.safetensors").write_bytes(b"")
    settings = ModeSettings.parse({"head_file": str(tmp_path / "h.safetensors"), "skip_layers": "3,4", "exit_layer": 2}).drafter_options()
    assert json.loads(json.dumps(settings))["head_file"] == str(tmp_path / "h.safetensors")
