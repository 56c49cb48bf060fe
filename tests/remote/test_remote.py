"""The remote engine's reconstruction of llama-server's steps, from hand-written chunks shaped as llama-server sends
them (tools/server/server-context.cpp of the pinned llama.cpp): fast, no server. The real servers are in
tests/remote/test_remote_llama_server.py."""

from __future__ import annotations

import socket

import pytest

from support.remote_standin import chunk, finish_chunk
from specchat.engine import remote
from specchat.remote_session import RemoteSession


def run(chunks):
    steps = remote.LlamaServerSteps("server", 0.0)
    records = []
    for i, c in enumerate(chunks, start=1):
        records += steps.feed(float(i), c)
    records += steps.finish(float(len(chunks) + 1))
    return steps, records


def kinds(records):
    return [[t.kind for t in r.tokens] for r in records]


def test_a_hand_worked_stream():
    """The first token plain (prefill); a step drafting 3 and accepting 1 (accepted, resampled); a plain step;
    a step accepting all 2 of 2 (accepted, accepted, bonus); the end token in the usage chunk, after the finish."""
    steps, records = run([
        chunk(1),  # the prefill's token
        chunk(2, 3, 1), chunk(3, 3, 1),  # 3 drafted, 1 accepted: 2 tokens
        chunk(4, 3, 1),  # no counter moved: a plain step
        chunk(5, 5, 3), chunk(6, 5, 3), chunk(7, 5, 3, text=""),  # 2 drafted, 2 accepted: 3 tokens, the last one no text
        finish_chunk(), chunk(7, 5, 3, usage=7),
    ])
    assert kinds(records) == [["target"], ["accepted", "resampled"], ["target"], ["accepted", "accepted", "bonus"]]
    assert [(r.drafted, r.accepted) for r in records] == [(0, 0), (3, 1), (0, 0), (2, 2)]
    assert [t.position for t in records[3].tokens] == [1, 2, 3]
    rec = steps.reconciliation()
    assert rec.ok, rec.problems
    assert (rec.tokens, rec.drafted, rec.accepted) == (7, 5, 3) == (rec.server_tokens, rec.server_drafted, rec.server_accepted)
    assert records[0].prefill_s == 1.0 and records[0].wall_s == 0.0  # the first token: time to first token
    assert records[1].wall_s == pytest.approx(2.0)  # from the first token (t=1) to the step's last (t=3)
    assert steps.finish_reason == "stop"


def test_the_end_token_arrives_with_the_final_counters():
    """llama-server sends no content for an end token: it shows only as predicted_n in the usage chunk."""
    steps, records = run([chunk(1), chunk(2, 2, 2), chunk(3, 2, 2), finish_chunk(), chunk(4, 2, 2, usage=4)])
    assert kinds(records) == [["target"], ["accepted", "accepted", "bonus"]]
    assert records[1].tokens[-1].text == ""
    assert steps.reconciliation().ok


def test_a_step_cut_short_by_the_end_token():
    """4 drafted and accepted, but the 2nd accepted draft is the end token: the server stops there."""
    steps, records = run([chunk(1), chunk(2, 4, 4), chunk(3, 4, 4, text=""), finish_chunk(), chunk(3, 4, 4, usage=3)])
    assert kinds(records) == [["target"], ["accepted", "accepted"]]
    assert steps.reconciliation().ok


def test_a_character_split_over_two_tokens_spans_a_step_boundary():
    """A token ending inside a multi-byte character sends no chunk: the next chunk counts both tokens, the first
    of them the last of the previous step, and the text goes with the second."""
    steps, records = run([
        chunk(1),
        chunk(2, 2, 1, text="a"),  # step 1: 2 drafted, 1 accepted -> tokens 2, 3; token 3 ends mid-character
        chunk(4, 4, 2, text="é"),  # token 3 (no chunk of its own) closes step 1; token 4 opens step 2 (2 drafted, 1 accepted)
        chunk(5, 4, 2, text="b"),
        finish_chunk(), chunk(5, 4, 2, usage=5),
    ])
    assert kinds(records) == [["target"], ["accepted", "resampled"], ["accepted", "resampled"]]
    assert [t.text for t in records[1].tokens] == ["a", ""]
    assert [t.text for t in records[2].tokens] == ["é", "b"]
    assert steps.reconciliation().ok


def test_counters_that_do_not_add_up_are_reported():
    """The negative control: a step that promises 3 tokens (2 accepted) but is followed by plain tokens at once,
    and a usage count that disagrees, are both named."""
    steps, records = run([chunk(1), chunk(2, 2, 2), chunk(3, 4, 2), finish_chunk(), chunk(3, 4, 2, usage=9)])
    rec = steps.reconciliation()
    assert not rec.ok
    assert any("before the previous step's tokens all came" in p for p in rec.problems)
    assert any("completion_tokens" in p for p in rec.problems)


def test_text_without_timings_is_reported():
    steps, _ = run([{"choices": [{"delta": {"content": "hi"}}]}, finish_chunk(), chunk(1, usage=1)])
    assert any("timings" in p for p in steps.reconciliation().problems)


# ---------------------------------------------------------------- HTTP behaviour against a local stand-in


def session_for(url, **kw):
    return RemoteSession([remote.connect(url)], **kw)


def test_connect_reads_what_llama_server_reports(standin):
    server = remote.connect(standin.url + "/v1/")
    assert (server.engine, server.model, server.speculative, server.url) == ("llama-server", "model.gguf", "draft-simple", standin.url)


def test_a_reply_is_recorded_with_the_server_counters_checked(standin):
    standin.script = [chunk(1, text="Hel"), chunk(2, 1, 1, text="lo"), chunk(3, 1, 1, text="!"), finish_chunk(), chunk(3, 1, 1, usage=3)]
    session = session_for(standin.url)
    records = list(session.reply("hi"))
    assert "".join(t.text for r in records for t in r.tokens) == "Hello!"
    assert session.messages[-1] == {"role": "assistant", "content": "Hello!"}
    assert session.turns[-1].stop_reason == "eos" and session.warnings == []
    body = standin.bodies[-1]
    assert body["timings_per_token"] is True and body["stream"] is True and body["messages"][-1]["content"] == "hi"
    snap = session.snapshot()
    assert snap.stats["llama-server"].num_accepted_tokens == 1 and snap.server.startswith("llama-server model.gguf")


def test_a_mismatch_is_a_visible_warning(standin):
    standin.script = [chunk(1), chunk(2), finish_chunk(), chunk(2, usage=5)]
    session = session_for(standin.url)
    list(session.reply("hi"))
    assert session.warnings and "completion_tokens" in session.warnings[0]
    assert session.snapshot().warnings == tuple(session.warnings)


def test_a_broken_stream_keeps_the_partial_reply(standin):
    standin.script, standin.cut = [chunk(1, text="Hel"), chunk(2, text="lo")], True
    session = session_for(standin.url)
    got = []
    with pytest.raises(remote.RemoteError, match="ended before the reply did"):
        for r in session.reply("hi"):
            got += r.tokens
    assert "".join(t.text for t in got) == "Hello"
    assert session.turns[-1].reply == "Hello" and session.turns[-1].stop_reason == "interrupted"
    assert session.messages[-1] == {"role": "assistant", "content": "Hello"}


def test_an_http_error_carries_the_server_message(standin):
    standin.status = 400
    session = session_for(standin.url)
    with pytest.raises(remote.RemoteError, match="HTTP 400.*exceeds the available context size"):
        list(session.reply("hi"))


def test_the_api_key_is_sent_and_never_shown(standin, monkeypatch):
    monkeypatch.setenv(remote.API_KEY_ENV, "sk-secret-123")
    standin.script = [chunk(1), finish_chunk(), chunk(1, usage=1)]
    session = session_for(standin.url)
    list(session.reply("hi"))
    assert standin.seen_auth[0] == "Bearer sk-secret-123"
    assert "sk-secret" not in repr(session.snapshot()) and "sk-secret" not in repr(session.server)


def test_unreachable_and_wrong_urls_are_one_line():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(remote.RemoteError, match="cannot reach"):
        remote.connect(f"http://127.0.0.1:{port}")
    with pytest.raises(remote.RemoteError, match="not an http"):
        remote.connect("localhost:8080")


def test_a_wrong_path_is_told_apart(standin):
    with pytest.raises(remote.RemoteError, match="not as llama-server"):
        remote.connect(standin.url + "/nothing")


def test_a_server_that_never_answers_times_out():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # accepts the connection (the kernel does) and never answers
    try:
        with pytest.raises(remote.RemoteError, match="no answer within 0.5 s"):
            remote.connect(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=0.5)
    finally:
        listener.close()


# ---------------------------------------------------------------- vLLM: a real recorded stream, and the alignment


def test_a_recorded_vllm_stream_is_rebuilt_and_checked(standin):
    """vLLM 0.32.0 on the CPU, n-gram drafts (K=3), 64 tokens: 1 + 40 one-token chunks, then 4 4 4 4 2 1 1 1 1 2;
    its per-step metrics say 6 drafting steps accepting 3 3 3 3 1 3 (the last cut to 2 tokens by max_tokens)."""
    standin.engine = "vllm"
    server = remote.connect(standin.url)
    assert (server.engine, server.model, server.k, server.speculative, server.version) == ("vllm", "smollm2-135m-instruct", 3, "K=3", "0.32.0")
    session = RemoteSession([server], max_new_tokens=64)
    records = list(session.reply("Repeat this list exactly twice: apple, banana, cherry, date, elderberry, fig, grape"))
    assert standin.bodies[-1]["return_token_ids"] is True
    assert session.warnings == []
    turn = session.turns[-1]
    drafting = [(r.drafted, r.accepted) for r in turn.rounds if r.drafted]
    assert drafting == [(3, 3), (3, 3), (3, 3), (3, 3), (3, 1), (3, 3)]
    assert sum(len(r.tokens) for r in turn.rounds) == 64 == turn.stats.new_tokens
    assert (turn.stats.num_draft_tokens, turn.stats.num_accepted_tokens) == (18, 16)
    kinds = [[t.kind for t in r.tokens] for r in turn.rounds if r.drafted]
    assert kinds[0] == ["accepted", "accepted", "accepted", "bonus"] and kinds[4] == ["accepted", "resampled"]
    assert kinds[5] == ["accepted", "accepted"]  # cut by max_tokens after two of its three accepted drafts
    assert turn.rounds[-1].tokens[-1].id == 457 and turn.stop_reason == "max_new_tokens"
    assert "".join(t.text for r in records for t in r.tokens) == turn.reply and turn.reply.startswith("I'm here")


@pytest.mark.parametrize("sizes, entries, expected", [
    ([1, 1, 4, 1, 2], [(3, 3), (3, 1)], [(0, 0), (0, 0), (3, 3), (0, 0), (3, 1)]),  # no-draft steps are left out
    ([1, 4], [(3, 0), (3, 3)], [(3, 0), (3, 3)]),  # a one-token step that drafted: all 3 rejected
    ([4, 2], [(3, 3), (3, 3)], [(3, 3), (3, 3)]),  # the last step cut by max_tokens
    ([4, 1], [(3, 3), (3, 2)], [(3, 3), (3, 2)]),  # ... to one token
    ([4, 1, 1, 2], [(3, 3), (3, 0), (3, 0), (3, 1)], [(3, 3), (3, 0), (3, 0), (3, 1)]),  # two rejected in a row, after a step
    ([1, 4, 1, 1], [(3, 3)], [(0, 0), (3, 3), (0, 0), (0, 0)]),  # plain steps after the last drafting one
    ([4, 1, 4, 1, 1, 3], [(3, 3), (3, 0), (3, 3), (3, 2)], [(3, 3), (3, 0), (3, 3), (0, 0), (0, 0), (3, 2)]),
    ([1, 1, 4], [(3, 0), (3, 3)], None),  # one of two one-token steps drafted: which, the stream does not say
    ([4], [(3, 2)], None),  # 4 tokens cannot be 2 accepted
    ([2, 2], [(3, 1)], None),  # an entry missing
])
def test_align_hand_worked(sizes, entries, expected):
    assert remote.align(sizes, entries) == expected


# ---------------------------------------------------------------- the command line


def run_cli(*args):
    from click.testing import CliRunner

    from specchat.cli.main import main

    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_generate_through_a_server_prints_the_reply_and_the_check(standin):
    standin.script = [chunk(1, text="Hel"), chunk(2, 2, 2, text="lo"), chunk(3, 2, 2, text="!"), finish_chunk(), chunk(4, 2, 2, usage=4)]
    result = run_cli("generate", "--server", standin.url, "--prompt", "hi")
    assert result.exit_code == 0, result.output
    assert "Hello!" in result.output and "steps match the server's counters" in result.output
    assert "acceptance 1" in result.output and "draft calls" not in result.output


def test_a_broken_stream_in_generate_is_summarised_then_one_line(standin):
    standin.script, standin.cut = [chunk(1, text="Hel"), chunk(2, text="lo")], True
    result = run_cli("generate", "--server", standin.url, "--prompt", "hi")
    assert result.exit_code == 1
    assert "Hello" in result.output and "stop: interrupted" in result.output
    assert result.output.strip().splitlines()[-1].startswith("Error:") and "Traceback" not in result.output


@pytest.mark.parametrize("args, message", [
    (["--server", "http://127.0.0.1:9", "--target", "x.gguf"], "leave out --target"),
    (["--server", "a=http://127.0.0.1:9", "--server", "http://127.0.0.1:8"], "name each of several servers"),
    (["--server", "a=http://127.0.0.1:9", "--server", "a=http://127.0.0.1:8"], "same name"),
    (["--server", "http://127.0.0.1:9", "-k", "3"], "-k is the server's setting"),
    (["--server", "=http://x"], "expected URL or NAME=URL"),
    ([arg for i in range(11) for arg in ("--server", f"s{i}=http://127.0.0.1:{9000 + i}")], "at most 10 configurations"),
])
def test_bad_server_options_are_one_line_before_any_connection(args, message):
    result = run_cli("generate", *args, "--prompt", "hi")
    assert result.exit_code == 2 and message in result.output, result.output


def test_an_unreachable_server_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run_cli("generate", "--server", f"http://127.0.0.1:{port}", "--prompt", "hi")
    assert result.exit_code == 1 and "cannot reach" in result.output and "Traceback" not in result.output


def test_bench_compares_configurations_side_by_side(standin, tmp_path):
    from support import remote_standin

    plain = remote_standin.start()
    try:
        standin.script = [chunk(1, text="A"), chunk(2, 2, 2, text="B"), chunk(3, 2, 2, text="C"), finish_chunk(), chunk(4, 2, 2, usage=4)]
        plain.script = [chunk(1, text="A"), chunk(2, text="B"), chunk(3, text="C"), finish_chunk(), chunk(4, usage=4)]
        plain.slots_speculative = False
        prompts = tmp_path / "p.jsonl"
        prompts.write_text('{"name": "one", "prompt": "hi"}\n{"name": "two", "prompt": "ho"}\n')
        result = run_cli("bench", "--server", f"spec={standin.url}", "--server", f"plain={plain.url}", "--prompts", str(prompts),
                         "--repeat", "2", "--out", str(tmp_path / "out"))
        assert result.exit_code == 0, result.output
        import json

        data = json.loads((tmp_path / "out" / "results.json").read_text())
        assert data["baseline"] == "plain" and len(data["runs"]) == 8
        rows = {r["config"]: r for r in data["rows"]}
        assert rows["spec"]["runs_reconciled"] == 4 and rows["spec"]["acceptance_rate"] == 1.0
        assert rows["plain"]["median_ratio_to_baseline"] == 1.0 and rows["spec"]["same_text_as_baseline"] == 4
        assert [r["config"] for r in data["runs"][:4]] == ["spec", "plain", "plain", "spec"]  # interleaved, rotated per prompt
    finally:
        plain.shutdown()


def test_an_export_of_a_remote_session_says_what_ran_and_nothing_invented(standin, tmp_path, monkeypatch):
    import json

    from specchat.export import write_export

    monkeypatch.setenv(remote.API_KEY_ENV, "sk-secret-456")
    standin.script = [chunk(1, text="A"), chunk(2, 2, 1, text="B"), chunk(3, 2, 1, text="C"), finish_chunk(), chunk(3, 2, 1, usage=3)]
    session = session_for(standin.url)
    list(session.reply("hi"))
    json_path, csv_path = write_export(session, tmp_path / "x.json")
    text = json_path.read_text()
    data = json.loads(text)
    assert data["config"]["server"]["url"] == standin.url and data["config"]["engine"] == "llama-server"
    step = data["turns"][0]["rounds"][1]
    assert (step["drafted"], step["accepted"], step["draft_s"], step["verify_s"]) == (2, 1, None, None)
    assert [t["kind"] for t in step["tokens"]] == ["accepted", "resampled"] and step["tokens"][0]["p"] is None
    assert "sk-secret" not in text and "sk-secret" not in csv_path.read_text()


def test_the_chat_connects_to_its_server_before_the_app_shows(standin, monkeypatch):
    """A local chat shows at once and loads in the background; a server names the modes the app is built with (its
    configurations), so the chat connects first (a second at most) and hands the app the connected session."""
    from click.testing import CliRunner

    from specchat.cli.main import main

    seen = {}
    monkeypatch.setattr("specchat.tui.app.run_chat", lambda session=None, load=None, **kw: seen.update(session=session, load=load))
    result = CliRunner().invoke(main, ["--server", standin.url])
    assert result.exit_code == 0, result.output
    assert seen["load"] is None and isinstance(seen["session"], RemoteSession) and seen["session"].server.url == standin.url
