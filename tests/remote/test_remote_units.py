"""The remote engine's pure parts, unit by unit, with hand-worked chunks and recorded server answers: no server, no
sockets (where a call would reach the network, `_open`, `_get_json`, `urlopen` or `stream_chunks` is replaced by a
scripted stand-in that records what it was asked). The whole file runs in well under a second."""

from __future__ import annotations

import io
import json
import math
import socket
import ssl
import types
import urllib.error
import urllib.request

import pytest

from support.remote_standin import VLLM, chunk, finish_chunk
from specchat.engine import remote

LLAMA = remote.Server("box", "http://h:1", "llama-server", "m.gguf", "draft-simple", "b1")
VLLM_SERVER = remote.Server("v", "http://h:2", "vllm", "smol", "K=3", "0.32.0", 3)


def fields(event):
    """A token event's fields, p as 'nan' (NaN never equals itself)."""
    p = "nan" if math.isnan(event.p) else event.p
    return (event.id, event.text, event.kind, event.round, event.position, p, event.q, event.accept_prob)


def nan(x):
    return isinstance(x, float) and math.isnan(x)


# ---------------------------------------------------------------- Server, headers


def test_server_label_and_defaults():
    assert remote.Server("a", "u", "llama-server", "m.gguf", None).label == "llama-server m.gguf (no speculation)"
    assert remote.Server("a", "u", "vllm", "smol", "K=3").label == "vllm smol (K=3)"
    plain = remote.Server("a", "u", "vllm", "smol", None)
    assert plain.version == "" and plain.k is None


def test_headers_with_and_without_the_api_key(monkeypatch):
    monkeypatch.delenv("SPECCHAT_API_KEY", raising=False)
    base = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    assert remote._headers() == base
    monkeypatch.setenv("SPECCHAT_API_KEY", "")  # set but empty: no header
    assert remote._headers() == base
    monkeypatch.setenv("SPECCHAT_API_KEY", "k1")
    assert remote._headers() == {**base, "Authorization": "Bearer k1"}


def test_the_module_constants():
    assert remote.API_KEY_ENV == "SPECCHAT_API_KEY" and remote.CONNECT_TIMEOUT_S == 10.0 and remote.UNKNOWN_ID == -1
    assert nan(remote.UNKNOWN)


# ---------------------------------------------------------------- _open and the server's error message


class Seen:
    def __init__(self):
        self.calls = []


_CONTEXT = []


def default_context():
    """ssl.create_default_context(), made once (loading the CA store takes ~0.3 s a time)."""
    if not _CONTEXT:
        _CONTEXT.append(ssl.create_default_context())
    return _CONTEXT[0]


def fake_urlopen(monkeypatch, result=None, error=None):
    seen = Seen()
    monkeypatch.setattr(remote, "ssl", types.SimpleNamespace(create_default_context=default_context))

    def urlopen(request, timeout=None, context=None):
        seen.calls.append((request, timeout, context))
        if error is not None:
            raise error
        return result

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    return seen


def test_open_posts_json_with_the_headers_and_a_verifying_tls_context(monkeypatch):
    monkeypatch.setenv("SPECCHAT_API_KEY", "k2")
    seen = fake_urlopen(monkeypatch, result="RESPONSE")
    assert remote._open("https://h/x", {"a": 1}, timeout=2.5) == "RESPONSE"
    request, timeout, context = seen.calls[0]
    assert request.full_url == "https://h/x" and request.get_method() == "POST" and json.loads(request.data) == {"a": 1}
    assert dict(request.header_items()) == {"Content-type": "application/json", "Accept": "application/json, text/event-stream",
                                            "Authorization": "Bearer k2"}
    assert timeout == 2.5
    assert isinstance(context, ssl.SSLContext) and context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


def test_open_without_a_body_is_a_get(monkeypatch):
    seen = fake_urlopen(monkeypatch, result="R")
    remote._open("http://h/props", timeout=3)
    request, timeout, _ = seen.calls[0]
    assert request.get_method() == "GET" and request.data is None and timeout == 3


def http_error(code, reason, body: bytes | None):
    fp = io.BytesIO(body) if body is not None else None
    return urllib.error.HTTPError("http://h/x", code, reason, {}, fp)


@pytest.mark.parametrize("body, message", [
    (b'{"error": {"code": 400, "message": "too   long\\n prompt"}}', ": too long prompt"),  # whitespace collapsed
    (b'{"error": "plain words"}', ": plain words"),
    (b'{"error": {"code": 7}}', ": {'code': 7}"),  # an error without a message: the whole error
    (b'{"detail": "Not Found"}', ': {"detail": "Not Found"}'),  # no error key: the body
    (b"[1, 2]", ": [1, 2]"),  # JSON, not an object: the body
    (b"oops, not json", ": oops, not json"),
    (b"", ""),  # nothing said
    (b"bad \xff byte", ": bad \ufffd byte"),  # undecodable bytes replaced, not an exception
])
def test_an_http_error_carries_what_the_server_said(monkeypatch, body, message):
    fake_urlopen(monkeypatch, error=http_error(400, "Bad Request", body))
    with pytest.raises(remote.RemoteError) as e:
        remote._open("http://h/x", {}, timeout=1)
    assert str(e.value) == f"http://h/x: HTTP 400 Bad Request{message}"


def test_the_server_message_is_cut_at_300_characters():
    assert remote._server_message(http_error(500, "E", b"a" * 300)) == ": " + "a" * 300
    assert remote._server_message(http_error(500, "E", b"b" * 301)) == ": " + "b" * 300


def test_only_the_first_4096_bytes_of_an_error_body_are_read():
    def body(size):
        text = json.dumps({"error": "e", "pad": ""})
        return json.dumps({"error": "e", "pad": "p" * (size - len(text))}).encode()

    assert len(body(4096)) == 4096 and len(body(4097)) == 4097
    assert remote._server_message(http_error(500, "E", body(4096))) == ": e"
    # a body one byte longer is cut mid-JSON: the raw text (its first 300 characters) is the message
    assert remote._server_message(http_error(500, "E", body(4097))).startswith(': {"error": "e", "pad": "ppp')


def test_an_unreadable_error_body_is_no_message(monkeypatch):
    class Broken(io.RawIOBase):
        def read(self, n=-1):
            raise OSError("reset")

    error = urllib.error.HTTPError("http://h/x", 502, "Bad Gateway", {}, Broken())
    fake_urlopen(monkeypatch, error=error)
    with pytest.raises(remote.RemoteError) as e:
        remote._open("http://h/x", timeout=1)
    assert str(e.value) == "http://h/x: HTTP 502 Bad Gateway"


@pytest.mark.parametrize("error, message", [
    (urllib.error.URLError(socket.timeout("timed out")), "http://h/x: no answer within 2.5 s"),
    (urllib.error.URLError(ConnectionRefusedError(111, "Connection refused")), "cannot reach http://h/x: Connection refused"),
    (urllib.error.URLError("no such host"), "cannot reach http://h/x: no such host"),
    (urllib.error.URLError(OSError("odd")), "cannot reach http://h/x: odd"),  # no strerror: the error itself
    (TimeoutError("timed out"), "http://h/x: no answer within 2.5 s"),
    (ConnectionResetError(104, "Connection reset by peer"), "cannot reach http://h/x: Connection reset by peer"),
    (OSError("weird"), "cannot reach http://h/x: weird"),
])
def test_failures_to_reach_a_server_are_one_line(monkeypatch, error, message):
    fake_urlopen(monkeypatch, error=error)
    with pytest.raises(remote.RemoteError) as e:
        remote._open("http://h/x", timeout=2.5)
    assert str(e.value) == message
    assert e.value.__suppress_context__  # one line: no chained traceback


# ---------------------------------------------------------------- _get_json, connect and what the servers report


class Answers:
    """A scripted `_open`: a URL's answer is a dict/list (JSON), bytes (raw), or an int (that HTTP status)."""

    def __init__(self, answers):
        self.answers = answers
        self.calls = []

    def __call__(self, url, body=None, *, timeout):
        self.calls.append((url, timeout))
        answer = self.answers.get(url, 404)
        if isinstance(answer, int):
            raise remote.RemoteError(f"{url}: HTTP {answer} {'Not Found' if answer == 404 else 'Error'}")
        if isinstance(answer, Exception):
            raise answer
        return io.BytesIO(answer if isinstance(answer, bytes) else json.dumps(answer).encode())


def answers(monkeypatch, table):
    fake = Answers(table)
    monkeypatch.setattr(remote, "_open", fake)
    return fake


def test_get_json(monkeypatch):
    fake = answers(monkeypatch, {"u/a": {"x": 1}, "u/bad": b"not json", "u/500": 500})
    assert remote._get_json("u/a", 4.0) == {"x": 1}
    assert remote._get_json("u/none", 4.0) is None  # 404: an endpoint this engine does not have
    assert remote._get_json("u/bad", 4.0) is None
    with pytest.raises(remote.RemoteError, match="HTTP 500"):
        remote._get_json("u/500", 4.0)
    assert [t for _, t in fake.calls] == [4.0] * 4


LLAMA_PROPS = {"default_generation_settings": {}, "model_path": "/models/q/m.gguf", "model_alias": "alias", "build_info": "b7"}
SLOTS = [{"speculative": True, "params": {"speculative.types": "none,draft-simple"}}]


def test_connect_to_a_llama_server(monkeypatch):
    fake = answers(monkeypatch, {"http://h:1/props": LLAMA_PROPS, "http://h:1/slots": SLOTS})
    server = remote.connect("http://h:1/v1/")
    assert server == remote.Server("llama-server", "http://h:1", "llama-server", "m.gguf", "draft-simple", "b7", None)
    assert fake.calls == [("http://h:1/props", 10.0), ("http://h:1/slots", 10.0)]  # the default timeout everywhere
    server = remote.connect("http://h:1", "mine", timeout=3.0)
    assert (server.name, server.url) == ("mine", "http://h:1")
    assert fake.calls[2:] == [("http://h:1/props", 3.0), ("http://h:1/slots", 3.0)]


def test_connect_names_the_model_from_the_path_the_alias_or_v1_models(monkeypatch):
    props = {"default_generation_settings": {}, "model_path": "", "model_alias": "the-alias"}
    answers(monkeypatch, {"http://h/props": props, "http://h/slots": SLOTS})
    server = remote.connect("http://h")
    assert (server.model, server.version) == ("the-alias", "")
    props = {"default_generation_settings": {}}
    fake = answers(monkeypatch, {"http://h/props": props, "http://h/slots": SLOTS, "http://h/v1/models": {"data": [{"id": "listed"}]}})
    assert remote.connect("http://h", timeout=2.0).model == "listed"
    assert sorted(fake.calls) == [("http://h/props", 2.0), ("http://h/slots", 2.0), ("http://h/v1/models", 2.0)]


def test_connect_url_checks(monkeypatch):
    fake = answers(monkeypatch, {"https://h/props": LLAMA_PROPS, "https://h/slots": SLOTS})
    assert remote.connect("https://h/v1").url == "https://h"
    assert fake.calls[0][0] == "https://h/props"
    answers(monkeypatch, {"http://HOSTX/props": LLAMA_PROPS, "http://HOSTX/slots": SLOTS})
    assert remote.connect("http://HOSTX/").url == "http://HOSTX"  # only slashes are stripped
    with pytest.raises(remote.RemoteError) as e:
        remote.connect("ftp://h")
    assert str(e.value) == "--server ftp://h: not an http:// or https:// URL"


def test_connect_to_a_vllm_from_its_recorded_answers(monkeypatch):
    metrics = (VLLM / "metrics-spec-lines.prom").read_bytes()
    table = {"http://h/version": json.loads((VLLM / "version.json").read_text()),
             "http://h/v1/models": json.loads((VLLM / "models.json").read_text()), "http://h/metrics": metrics,
             "http://h/props": {"detail": "Not Found"}}  # a JSON answer that is not llama-server's
    fake = answers(monkeypatch, table)
    server = remote.connect("http://h/", timeout=5.0)
    assert server == remote.Server("vllm", "http://h", "vllm", "smollm2-135m-instruct", "K=3", "0.32.0", 3)
    assert sorted(fake.calls) == sorted((u, 5.0) for u in ["http://h/props", "http://h/version", "http://h/metrics", "http://h/v1/models"])
    assert remote.connect("http://h", "named").name == "named"


def test_connect_to_something_else(monkeypatch):
    answers(monkeypatch, {"http://h/version": {"name": "x"}})
    with pytest.raises(remote.RemoteError) as e:
        remote.connect("http://h")
    assert str(e.value) == "http://h answers, but not as llama-server (/props) or vLLM (/version): is this the right URL?"


@pytest.mark.parametrize("slots, expected", [
    (SLOTS, "draft-simple"),
    ([{"speculative": True, "params": {"speculative.types": "ngram-mod,draft-simple"}}], "ngram-mod,draft-simple"),
    ([{"speculative": True, "params": {"speculative.types": "none"}}], "on"),  # no slot has served a request yet
    ([{"speculative": True, "params": {}}], "on"),
    ([{"speculative": True}], "on"),
    ([{"speculative": False, "params": {"speculative.types": "draft-simple"}}], None),
    ([{"speculative": True, "params": {"speculative.types": "ngram-mod"}}, {"speculative": False}], "ngram-mod"),  # slot 0
    ([{"speculative": False}, {"speculative": True}], None),
    ([], "unknown"),
    ([{"id": 0}], "unknown"),  # a slot that does not say
    ({"speculative": True}, "unknown"),  # not a list
    (404, "unknown"),  # --no-slots
    (501, "unknown"),  # any other failure
])
def test_llama_server_speculation(monkeypatch, slots, expected):
    fake = answers(monkeypatch, {"http://h/slots": slots})
    assert remote.llama_server_speculation("http://h", 7.0) == expected
    assert fake.calls == [("http://h/slots", 7.0)]
    assert remote.llama_server_speculation("http://h") == expected and fake.calls[-1] == ("http://h/slots", 10.0)


@pytest.mark.parametrize("text, expected", [
    (b'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="2"} 5.0\n'
     b'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 9.0\n'
     b'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 7.0\n', ("K=3", 3)),  # not in order
    (b'# HELP x\nvllm:spec_decode_num_accepted_tokens_per_pos_total{position="4",engine="0"} 1.0\n', ("K=5", 5)),
    (b'# \xff\nvllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 1.0\n', ("K=1", 1)),  # bad bytes
    (b"vllm:spec_decode_num_drafts_total 0.0\n", ("on", None)),
    (b"vllm:num_requests_running 0.0\n", (None, None)),
    (b'x vllm:spec_decode_num_accepted_tokens_per_pos_total{position="3"} 1.0\n', ("on", None)),  # not a line start
    (404, ("unknown", None)),
])
def test_vllm_speculation(monkeypatch, text, expected):
    fake = answers(monkeypatch, {"http://h/metrics": text})
    assert remote.vllm_speculation("http://h", 6.0) == expected
    assert fake.calls == [("http://h/metrics", 6.0)]
    remote.vllm_speculation("http://h")
    assert fake.calls[-1] == ("http://h/metrics", 10.0)


def test_vllm_speculation_from_the_recording(monkeypatch):
    answers(monkeypatch, {"http://h/metrics": (VLLM / "metrics-spec-lines.prom").read_bytes()})
    assert remote.vllm_speculation("http://h") == ("K=3", 3)


@pytest.mark.parametrize("models, expected", [
    ({"data": [{"id": "a"}, {"id": "b"}]}, "a"),
    ({"data": []}, "unknown"),
    ({"data": [{"object": "model"}]}, "unknown"),
    ({}, "unknown"),
    (404, "unknown"),
])
def test_first_model(monkeypatch, models, expected):
    fake = answers(monkeypatch, {"http://h/v1/models": models})
    assert remote._first_model("http://h", 8.0) == expected
    assert fake.calls == [("http://h/v1/models", 8.0)]


# ---------------------------------------------------------------- the request


def test_request_body_for_each_engine():
    messages = [{"role": "user", "content": "hi"}]
    request = remote.Request(messages, 32, 0.7, 40, 0.9)
    assert request.seed is None
    common = {"model": "m.gguf", "messages": messages, "stream": True, "max_tokens": 32, "temperature": 0.7, "top_p": 0.9,
              "stream_options": {"include_usage": True}}
    assert request.body(LLAMA) == {**common, "timings_per_token": True, "top_k": 40, "min_p": 0.0}
    assert remote.Request(messages, 32, 0.7, 40, 0.9, seed=0).body(LLAMA) == {**common, "seed": 0, "timings_per_token": True,
                                                                             "top_k": 40, "min_p": 0.0}
    common["model"] = "smol"
    assert request.body(VLLM_SERVER) == {**common, "return_token_ids": True, "top_k": 40}
    assert remote.Request(messages, 32, 0.7, 0, 0.9, 5).body(VLLM_SERVER) == {**common, "seed": 5, "return_token_ids": True,
                                                                             "top_k": -1}  # vLLM's "no top-k"


# ---------------------------------------------------------------- stream_chunks


class Response:
    def __init__(self, lines):
        self.lines = list(lines)
        self.read = 0
        self.closed = False

    def readline(self):
        self.read += 1
        line = self.lines.pop(0) if self.lines else b""
        if isinstance(line, Exception):
            raise line
        return line

    def close(self):
        self.closed = True


def fake_stream(monkeypatch, lines):
    response = Response(lines)
    calls = []

    def _open(url, body=None, *, timeout):
        calls.append((url, body, timeout))
        return response

    monkeypatch.setattr(remote, "_open", _open)
    monkeypatch.setattr(remote, "time", types.SimpleNamespace(perf_counter=lambda: 42.0))
    return response, calls


REQUEST = remote.Request([{"role": "user", "content": "hi"}], 8, 0.0, 0, 1.0)


def test_stream_chunks_reads_events_until_done(monkeypatch):
    response, calls = fake_stream(monkeypatch, [
        b": keep-alive\n", b"\n", b"event: ping\n", b'data: {"a": 1}\n', b"\n", b'data:{"b": 2}\r\n', b"  data: {\"c\": 3}  \n",
        b"data: [DONE]\n", b'data: {"after": 1}\n',
    ])
    got = list(remote.stream_chunks(LLAMA, REQUEST, timeout=9.0))
    assert got == [(42.0, {"a": 1}), (42.0, {"b": 2}), (42.0, {"c": 3})]
    assert calls == [("http://h:1/v1/chat/completions", REQUEST.body(LLAMA), 9.0)]
    assert response.closed and response.lines == [b'data: {"after": 1}\n']  # nothing read after [DONE]


def test_stream_chunks_done_without_a_space(monkeypatch):
    fake_stream(monkeypatch, [b'data: {"a": 1}\n', b"data:[DONE]\n"])
    assert [c for _, c in remote.stream_chunks(LLAMA, REQUEST, timeout=1.0)] == [{"a": 1}]


def collect(gen):
    got = []
    with pytest.raises(remote.RemoteError) as e:
        for item in gen:
            got.append(item[1])
    return got, str(e.value)


@pytest.mark.parametrize("lines, message", [
    ([b'data: {"a": 1}\n'], "http://h:1: the stream ended before the reply did (the server closed the connection)"),
    ([b'data: {"a": 1}\n', b"data: {not json" + b"x" * 100 + b"\n"],
     "http://h:1: not a JSON event: b'{not json" + "x" * 71 + "'"),
    ([b'data: {"a": 1}\n', b'data: {"error": {"message": "out of memory", "code": 500}}\n'], "http://h:1: out of memory"),
    ([b'data: {"a": 1}\n', b'data: {"error": {"code": 500}}\n'], "http://h:1: {'code': 500}"),
    ([b'data: {"a": 1}\n', b'data: {"error": "overloaded"}\n'], "http://h:1: overloaded"),
    ([b'data: {"a": 1}\n', socket.timeout("timed out")], "http://h:1: the stream stalled (nothing for 1.5 s)"),
    ([b'data: {"a": 1}\n', ConnectionResetError(104, "reset")], "http://h:1: the stream broke: [Errno 104] reset"),
])
def test_stream_chunks_failures(monkeypatch, lines, message):
    response, _ = fake_stream(monkeypatch, lines)
    got, error = collect(remote.stream_chunks(LLAMA, REQUEST, timeout=1.5))
    assert got == [{"a": 1}] and error == message
    assert response.closed


# ---------------------------------------------------------------- steps, kinds, reconciliation


@pytest.mark.parametrize("drafted, accepted, kinds", [
    (0, 0, ["target"]),
    (3, 0, ["resampled"]),
    (3, 1, ["accepted", "resampled"]),
    (3, 3, ["accepted", "accepted", "accepted", "bonus"]),
    (1, 1, ["accepted", "bonus"]),
])
def test_step_kind(drafted, accepted, kinds):
    assert [remote.step_kind(drafted, accepted, i) for i in range(accepted + 1)] == kinds
    assert remote._Step(drafted, accepted).size == len(kinds)


def test_reconciliation_compare():
    rec = remote.Reconciliation(5, 3, 2, 5, None, 1)
    assert rec.ok and rec.problems == []
    assert rec.compare() is rec
    assert rec.problems == ["accepted: the steps give 2, the server counted 1"] and not rec.ok
    rec = remote.Reconciliation(5, 3, 2, 6, 4, 2).compare(("usage", 5, 5), ("extra", 1, None), ("more", 1, 2))
    assert rec.problems == ["tokens: the steps give 5, the server counted 6", "drafted: the steps give 3, the server counted 4",
                            "more: the steps give 1, the server counted 2"]
    assert remote.Reconciliation(1, 0, 0, None, None, None).compare().ok


def test_a_server_count_of_zero_against_steps_that_drafted_is_flagged():
    """0 is a count the server sent, not a missing one: a truthiness test in place of `is not None` let a server that
    reported 0 drafted or 0 completion tokens pass against steps that drafted and emitted."""
    rec = remote.Reconciliation(5, 3, 2, 0, 0, 0).compare(("completion_tokens", 5, 0))
    assert rec.problems == ["tokens: the steps give 5, the server counted 0", "drafted: the steps give 3, the server counted 0",
                            "accepted: the steps give 2, the server counted 0", "completion_tokens: the steps give 5, the server counted 0"]
    steps = remote.LlamaServerSteps("m", 0.0)  # llama-server: a drafting step, then final counters that say 0 drafted
    feed_all(steps, [chunk(1), chunk(2, 2, 1), chunk(3, 2, 1), finish_chunk(),
                     {"choices": [], "usage": {"completion_tokens": 0}, "timings": {"predicted_n": 3, "draft_n": 0, "draft_n_accepted": 0}}])
    rec = steps.reconciliation()
    assert rec.drafted == 2 and not rec.ok
    assert "drafted: the steps give 2, the server counted 0" in rec.problems
    assert "completion_tokens: the steps give 3, the server counted 0" in rec.problems
    steps = remote.VllmSteps("m", 0.0, 3)  # vLLM: a step of 4 tokens, then a usage chunk that counts none
    steps.feed(1.0, vchunk([1]))
    steps.feed(2.0, vchunk([2, 3, 4, 5], "t", finish="stop"))
    steps.feed(3.0, {"choices": [], "usage": {"completion_tokens": 0}})
    steps.finish(4.0)
    rec = steps.reconciliation()
    assert "tokens: the steps give 5, the server counted 0" in rec.problems and not rec.ok


# ---------------------------------------------------------------- llama-server: the counters, chunk by chunk


def feed_all(steps, chunks, t0=11.0):
    out = []
    for i, c in enumerate(chunks):
        out.append(steps.feed(t0 + i, c))
    return out


def record_fields(r):
    return (r.index, r.mode, r.draft_len, r.drafted, r.accepted, r.draft_calls, nan(r.draft_s), nan(r.verify_s), r.wall_s,
            r.prefill_s)


def test_llama_server_steps_hand_worked():
    """t_start 10; chunks at t = 11, 12, ...: a plain first token; 3 drafted 1 accepted (2 tokens); 2 drafted 2 accepted
    whose first two tokens come in one chunk (text with the second) and whose bonus comes with the usage."""
    steps = remote.LlamaServerSteps("srv", 10.0)
    out = feed_all(steps, [
        chunk(1, text="A"),  # t 11
        chunk(2, 3, 1, text="B"),  # t 12
        chunk(3, 3, 1, text="C"),  # t 13
        chunk(5, 5, 3, text="DE"),  # t 14
        finish_chunk("length"),  # t 15
        {"choices": [{"delta": None, "finish_reason": None}], "timings": {"predicted_n": 5, "draft_n": 5, "draft_n_accepted": 3}},  # t 16
        chunk(6, 5, 3, usage=6),  # t 17
    ])
    assert [len(o) for o in out] == [1, 0, 1, 0, 0, 0, 1]
    r0, r1, r2 = out[0][0], out[2][0], out[6][0]
    assert record_fields(r0) == (0, "srv", 0, 0, 0, 0, True, True, 0.0, 1.0)
    assert record_fields(r1) == (1, "srv", 3, 3, 1, 0, True, True, 2.0, 0.0)
    assert record_fields(r2) == (2, "srv", 2, 2, 2, 0, True, True, 4.0, 0.0)
    assert [fields(t) for t in r0.tokens] == [(-1, "A", "target", 0, 1, "nan", None, None)]
    assert [fields(t) for t in r1.tokens] == [(-1, "B", "accepted", 1, 1, "nan", None, None),
                                              (-1, "C", "resampled", 1, 2, "nan", None, None)]
    assert [fields(t) for t in r2.tokens] == [(-1, "", "accepted", 2, 1, "nan", None, None),
                                              (-1, "DE", "accepted", 2, 2, "nan", None, None),
                                              (-1, "", "bonus", 2, 3, "nan", None, None)]
    assert steps.finish(18.0) == []
    assert steps.finish_reason == "length" and steps.usage == {"completion_tokens": 6}
    assert steps.problems == []
    rec = steps.reconciliation()
    assert (rec.tokens, rec.drafted, rec.accepted, rec.server_tokens, rec.server_drafted, rec.server_accepted) == (6, 5, 3, 6, 5, 3)
    assert rec.ok


def test_llama_server_plain_steps_each_their_own_round():
    steps = remote.LlamaServerSteps("m", 0.0)
    out = feed_all(steps, [chunk(1, text="a"), chunk(3, text="bc"), finish_chunk(), chunk(3, usage=3)], t0=1.0)
    records = [r for o in out for r in o]
    assert [(r.index, [t.text for t in r.tokens], r.wall_s, r.prefill_s) for r in records] == [
        (0, ["a"], 0.0, 1.0), (1, [""], 1.0, 0.0), (2, ["bc"], 0.0, 0.0)]
    assert [[t.round for t in r.tokens] for r in records] == [[0], [1], [2]]
    rec = steps.reconciliation()
    assert rec.ok and (rec.server_drafted, rec.server_accepted) == (0, 0)  # counters without draft_n: none drafted


def test_a_step_cut_by_the_end_of_the_stream_is_flushed_at_finish():
    steps = remote.LlamaServerSteps("m", 0.0)
    feed_all(steps, [chunk(1), chunk(2, 4, 4, text="b")], t0=1.0)
    last = steps.finish(5.0)
    assert [(r.index, r.drafted, r.accepted, r.wall_s, [t.kind for t in r.tokens]) for r in last] == [(1, 4, 4, 4.0, ["accepted"])]
    assert steps.problems == []  # only the last step may end early
    assert steps.finish(6.0) == []


def test_llama_server_problems_are_named():
    steps = remote.LlamaServerSteps("m", 0.0)
    feed_all(steps, [chunk(1), chunk(1, 2, 1)])
    assert steps.problems == ["at token 1: a step's counters moved before the previous step's tokens all came"]
    feed_all(steps, [chunk(1, 4, 2)])
    assert steps.problems[1:] == ["two steps began before the tokens of the first arrived (at token 1)",
                                  "at token 1: a step's counters moved before the previous step's tokens all came"]
    assert steps.finish(9.0) == []
    assert steps.problems[-1] == "a step's counters moved but none of its tokens came"


def test_a_step_that_drafted_one_and_accepted_it():
    steps = remote.LlamaServerSteps("m", 0.0)
    out = feed_all(steps, [chunk(1), chunk(2, 1, 1), chunk(3, 1, 1), chunk(4, 1, 1), finish_chunk(), chunk(4, 1, 1, usage=4)])
    records = [r for o in out for r in o] + steps.finish(20.0)
    assert [[t.kind for t in r.tokens] for r in records] == [["target"], ["accepted", "bonus"], ["target"]]
    assert steps.problems == [] and steps.reconciliation().ok


def test_counters_without_predicted_n_count_no_token():
    steps = remote.LlamaServerSteps("m", 0.0)
    assert steps.feed(1.0, {"choices": [{"delta": {"content": ""}}], "timings": {"prompt_n": 3}}) == []
    (record,) = steps.feed(2.0, chunk(1, text="a"))
    assert [t.text for t in record.tokens] == ["a"]


def test_accepted_moving_without_drafted_is_named():
    steps = remote.LlamaServerSteps("m", 0.0)
    feed_all(steps, [chunk(1), chunk(2, 2, 1), chunk(3, 2, 1), chunk(4, 2, 2)])
    assert steps.problems == ["draft_n_accepted moved (1 -> 2) without draft_n"]


def test_text_without_timings_and_no_timings_at_all():
    steps = remote.LlamaServerSteps("m", 0.0)
    assert steps.feed(1.0, {"choices": [{"delta": {"content": "hi"}}]}) == []
    assert steps.feed(2.0, {"choices": [{"delta": {"content": ""}}]}) == []
    assert steps.feed(3.0, {"choices": [{"delta": {}, "finish_reason": "stop"}]}) == []
    assert steps.feed(4.0, {"choices": [], "usage": {"completion_tokens": 2}}) == []
    assert steps.problems == ["a chunk with text but no timings (does this llama-server know timings_per_token?)"]
    rec = steps.reconciliation()
    assert (rec.server_tokens, rec.server_drafted, rec.server_accepted) == (2, None, None)
    assert rec.problems == ["a chunk with text but no timings (does this llama-server know timings_per_token?)",
                            "no chunk carried the server's counters", "tokens: the steps give 0, the server counted 2",
                            "completion_tokens: the steps give 0, the server counted 2"]
    assert steps.problems == ["a chunk with text but no timings (does this llama-server know timings_per_token?)"]  # a copy


def test_the_server_counts_are_the_last_chunks():
    steps = remote.LlamaServerSteps("m", 0.0)
    feed_all(steps, [chunk(1), chunk(2, 2, 0), finish_chunk(), {"choices": [], "timings": {"predicted_n": 2, "draft_n": 2}}])
    rec = steps.reconciliation()
    assert (rec.server_tokens, rec.server_drafted, rec.server_accepted) == (2, 2, 0) and rec.ok
    steps = remote.LlamaServerSteps("m", 0.0)
    feed_all(steps, [chunk(1), finish_chunk(), {"choices": [], "usage": {"completion_tokens": 1}, "timings": {"prompt_n": 5}}])
    rec = steps.reconciliation()  # counters without predicted_n: the usage's count
    assert (rec.server_tokens, rec.server_drafted, rec.server_accepted) == (1, 0, 0)


# ---------------------------------------------------------------- vLLM: one chunk per step


def vchunk(ids, text="", finish=None):
    return {"choices": [{"delta": {"content": text}, "finish_reason": finish, "token_ids": ids}]}


def usage_chunk(tokens, metrics):
    out = {"choices": [], "usage": {"completion_tokens": tokens}}
    if metrics is not None:
        out["metrics"] = metrics
    return out


def test_vllm_steps_hand_worked():
    steps = remote.VllmSteps("srv", 10.0, 3)
    out = feed_all(steps, [
        vchunk([5, 6], "ab"),  # t 11: the first step is the prefill's, whatever its size
        vchunk([7], "c"),  # t 12
        vchunk([8, 9, 10, 11], "defg"),  # t 13: 3 accepted of K = 3: a bonus
        vchunk([12, 13], "hi"),  # t 14: 1 accepted: a replacement
        vchunk([], "", "length"),  # t 15
        vchunk(None, ""),  # t 16
        usage_chunk(9, {"speculative_decoding": {"per_step_drafted": [3, 3, 3], "per_step_accepted": [0, 3, 1],
                                                 "num_draft_tokens": 9, "num_accepted_draft_tokens": 4}}),  # t 17
    ])
    assert [len(o) for o in out] == [1, 1, 1, 1, 0, 0, 0]
    records = [o[0] for o in out[:4]]
    assert [record_fields(r) for r in records] == [
        (0, "srv", 0, 0, 0, 0, True, True, 0.0, 1.0), (1, "srv", 0, 0, 0, 0, True, True, 1.0, 0.0),
        (2, "srv", 3, 3, 3, 0, True, True, 1.0, 0.0), (3, "srv", 3, 3, 1, 0, True, True, 1.0, 0.0)]
    assert [fields(t) for t in records[0].tokens] == [(5, "", "target", 0, 1, "nan", None, None), (6, "ab", "target", 0, 2, "nan", None, None)]
    assert [t.kind for t in records[2].tokens] == ["accepted", "accepted", "accepted", "bonus"]
    assert [(t.id, t.text, t.position, t.round) for t in records[2].tokens] == [(8, "", 1, 2), (9, "", 2, 2), (10, "", 3, 2), (11, "defg", 4, 2)]
    assert [t.kind for t in records[3].tokens] == ["accepted", "resampled"]
    assert steps.finish(18.0) == [] and steps.finish_reason == "length" and steps.problems == []
    assert steps.relabel() is True
    assert [(r.drafted, r.accepted, r.draft_len) for r in records] == [(0, 0, 0), (3, 0, 3), (3, 3, 3), (3, 1, 3)]
    assert [fields(t) for t in records[1].tokens] == [(7, "c", "resampled", 1, 1, "nan", None, None)]  # all 3 rejected
    assert [fields(t) for t in records[0].tokens][1] == (6, "ab", "target", 0, 2, "nan", None, None)  # the first step kept
    assert [(t.id, t.text, t.kind) for t in records[2].tokens][3] == (11, "defg", "bonus")  # texts kept per token
    rec = steps.reconciliation()
    assert (rec.tokens, rec.drafted, rec.accepted, rec.server_tokens, rec.server_drafted, rec.server_accepted) == (9, 9, 4, 9, 9, 4)
    assert rec.ok


@pytest.mark.parametrize("k, size, drafted, kinds", [
    (3, 4, 3, ["accepted", "accepted", "accepted", "bonus"]),  # K = accepted: all accepted
    (3, 2, 3, ["accepted", "resampled"]),
    (None, 3, 3, ["accepted", "accepted", "resampled"]),  # K unknown: at least one more drafted than accepted
    (2, 4, 4, ["accepted", "accepted", "accepted", "resampled"]),  # more accepted than K says: not K
    (0, 2, 2, ["accepted", "resampled"]),
    (3, 1, 0, ["target"]),  # one token: shown plain
])
def test_vllm_step_sizes(k, size, drafted, kinds):
    steps = remote.VllmSteps("m", 0.0, k)
    steps.feed(1.0, vchunk([1]))
    (record,) = steps.feed(2.0, vchunk(list(range(size)), "t"))
    assert (record.drafted, record.draft_len, record.accepted) == (drafted, drafted, size - 1 if size > 1 else 0)
    assert [t.kind for t in record.tokens] == kinds


def test_vllm_without_token_ids_is_named():
    steps = remote.VllmSteps("m", 0.0, 3)
    assert steps.feed(1.0, {"choices": [{"delta": {"content": "hi"}}]}) == []
    assert steps.feed(2.0, {"choices": [{"delta": None}]}) == []
    assert steps.feed(3.0, {"choices": [{"delta": {}, "finish_reason": "stop"}]}) == []
    assert steps.feed(4.0, {"choices": [{"delta": {}, "finish_reason": None}]}) == []
    assert steps.problems == ["chunks without token_ids (return_token_ids needs vLLM 0.10 or later)"]
    assert steps.finish_reason == "stop"
    rec = steps.reconciliation()
    assert rec.server_tokens is None and not rec.ok
    assert rec.problems == ["chunks without token_ids (return_token_ids needs vLLM 0.10 or later)",
                            "no usage chunk with the server's token count"]


NO_LISTS = ("no per-step metrics in the usage chunk (start vLLM with --per-request-spec-decode-metrics detailed): "
            "one-token steps are shown plain, some may have drafted")


@pytest.mark.parametrize("k, metrics, problems", [
    (None, None, [NO_LISTS]),  # no metrics at all
    (None, {}, []),  # metrics, nothing about speculation, no K: a server that does not speculate
    (None, {"speculative_decoding": {"num_draft_tokens": 3}}, [NO_LISTS]),
    (3, {}, [NO_LISTS]),
    (3, {"speculative_decoding": {"per_step_drafted": [3]}}, [NO_LISTS]),  # one list only
    (3, {"speculative_decoding": {"per_step_accepted": [3]}}, [NO_LISTS]),
])
def test_vllm_relabel_without_the_lists(k, metrics, problems):
    steps = remote.VllmSteps("m", 0.0, k)
    feed_all(steps, [vchunk([1]), vchunk([2, 3, 4, 5]), usage_chunk(5, metrics)])
    assert steps.relabel() is False and steps.problems == problems
    assert [r.drafted for r in steps.records] == [0, k or 4]  # unchanged


def test_vllm_relabel_without_a_usage_chunk():
    steps = remote.VllmSteps("m", 0.0, None)
    feed_all(steps, [vchunk([1]), vchunk([2, 3])])
    assert steps.relabel() is False and steps.problems == [NO_LISTS]


def test_vllm_relabel_that_the_lists_do_not_determine():
    steps = remote.VllmSteps("m", 0.0, 3)
    feed_all(steps, [vchunk([1]), vchunk([2]), vchunk([3]), vchunk([4, 5, 6, 7]),
                     usage_chunk(7, {"speculative_decoding": {"per_step_drafted": [3, 3], "per_step_accepted": [0, 3]}})])
    assert steps.relabel() is False
    assert steps.problems == ["the per-step metrics do not determine which one-token steps drafted"]
    assert [(r.drafted, r.accepted) for r in steps.records] == [(0, 0), (0, 0), (0, 0), (3, 3)]


def test_vllm_relabel_leaves_the_first_step_out():
    """The first step (the prefill's token) is never in the per-step lists, even when it is one token like the next."""
    steps = remote.VllmSteps("m", 0.0, 3)
    feed_all(steps, [vchunk([1], "a"), vchunk([2], "b"), vchunk([3, 4], "cd"),
                     usage_chunk(4, {"speculative_decoding": {"per_step_drafted": [3, 3], "per_step_accepted": [0, 1]}})])
    assert steps.relabel() is True
    assert [(r.drafted, r.accepted, [t.kind for t in r.tokens]) for r in steps.records] == [
        (0, 0, ["target"]), (3, 0, ["resampled"]), (3, 1, ["accepted", "resampled"])]
    assert [[t.text for t in r.tokens] for r in steps.records] == [["a"], ["b"], ["", "cd"]]


def test_label():
    record = remote.RoundRecord(index=4, mode="m", draft_len=3, drafted=3, accepted=1, draft_calls=0, draft_s=0.0, verify_s=0.0)
    assert [fields(t) for t in remote._label(record, [7, 8], "xy")] == [(7, "", "accepted", 4, 1, "nan", None, None),
                                                                          (8, "xy", "resampled", 4, 2, "nan", None, None)]
    assert [t.text for t in remote._label(record, [7, 8], None, ["x", "y"])] == ["x", "y"]


@pytest.mark.parametrize("sizes, entries, expected", [
    ([], [], []),
    ([], [(3, 1)], None),  # an entry and no step
    ([1], [(3, 2)], [(3, 2)]),  # the only step cut to one token by max_tokens
    ([1], [(3, 0)], [(3, 0)]),
    ([1, 1], [], [(0, 0), (0, 0)]),
    ([2], [], None),  # a two-token step must be an entry
    ([2, 4], [(3, 3), (3, 3)], None),  # only the last step may hold fewer tokens than accepted + 1
    ([4, 2], [(3, 3), (3, 1)], [(3, 3), (3, 1)]),
    ([4, 3], [(3, 3), (3, 1)], None),  # the last step's tokens cannot exceed accepted + 1
    ([1, 1, 1], [(3, 0), (3, 0), (3, 0)], [(3, 0), (3, 0), (3, 0)]),
    ([1, 2], [(3, 0), (3, 0), (3, 1)], None),  # more zeros than one-token steps
    ([4, 1], [(3, 3), (3, 2), (3, 1)], None),  # an entry left over
    ([1, 1], [(3, 2)], [(0, 0), (3, 2)]),  # a plain step, then the last one cut to one token
    ([1, 1], [(3, 2), (3, 0)], None),  # a cut step is the last one only
    ([1, 4, 1], [(3, 3), (3, 1)], [(0, 0), (3, 3), (3, 1)]),
    ([4, 1, 1], [(3, 3), (3, 1)], [(3, 3), (0, 0), (3, 1)]),
    ([4, 1], [(3, 3), (3, 0)], [(3, 3), (3, 0)]),  # a rejected one-token step after a drafting one
    ([4, 1, 1], [(3, 3), (3, 0), (3, 0)], [(3, 3), (3, 0), (3, 0)]),  # two of them
    ([4, 2], [(3, 3), (3, 3)], [(3, 3), (3, 3)]),  # the last step cut by max_tokens after one of its 3 accepted
    ([4, 1], [(3, 3), (3, 3)], [(3, 3), (3, 3)]),  # ... after none: one token
])
def test_align_more_cases(sizes, entries, expected):
    assert remote.align(sizes, entries) == expected


# ---------------------------------------------------------------- generate


def scripted(monkeypatch, chunks, error=None):
    seen = {}

    def stream_chunks(server, request, *, timeout):
        seen.update(server=server, request=request, timeout=timeout)
        for i, c in enumerate(chunks):
            yield 101.0 + i, c
        if error is not None:
            raise error

    monkeypatch.setattr(remote, "stream_chunks", stream_chunks)
    monkeypatch.setattr(remote, "time", types.SimpleNamespace(perf_counter=lambda: 100.0))
    return seen


@pytest.mark.parametrize("reason, stop", [("stop", "eos"), ("length", "max_new_tokens"), ("tool_calls", "tool_calls"), (None, None)])
def test_generate_llama_server(monkeypatch, reason, stop):
    chunks = [chunk(1, text="a"), chunk(2, 2, 2, text="b"), chunk(3, 2, 2, text="c"), finish_chunk(reason)]
    seen = scripted(monkeypatch, chunks + [chunk(4, 2, 2, usage=4)])
    out = []
    records = list(remote.generate(LLAMA, REQUEST, mode="srv", timeout=4.0, steps_out=out))
    assert seen == {"server": LLAMA, "request": REQUEST, "timeout": 4.0}
    assert [(r.mode, r.prefill_s, r.wall_s, [t.text for t in r.tokens]) for r in records] == [
        ("srv", 1.0, 0.0, ["a"]), ("srv", 0.0, 4.0, ["b", "c", ""])]  # the bonus (no text) with the usage, at t 105
    assert [r.stop_reason for r in records] == [None, stop]
    assert len(out) == 1 and isinstance(out[0], remote.LlamaServerSteps) and out[0].reconciliation().ok


def test_generate_vllm_and_a_step_flushed_at_the_end(monkeypatch):
    scripted(monkeypatch, [vchunk([1], "a"), vchunk([2, 3], "bc"), vchunk([], "", "length"), usage_chunk(3, None)])
    out = []
    records = list(remote.generate(VLLM_SERVER, REQUEST, mode="v", timeout=1.0, steps_out=out))
    assert isinstance(out[0], remote.VllmSteps) and out[0].k == 3
    assert [(r.mode, r.drafted, r.accepted, r.wall_s, r.stop_reason) for r in records] == [
        ("v", 0, 0, 0.0, None), ("v", 3, 1, 1.0, "max_new_tokens")]


def test_generate_without_a_finish_reason_sets_no_stop_reason(monkeypatch):
    scripted(monkeypatch, [vchunk([1], "a"), vchunk([2, 3], "bc")])
    records = list(remote.generate(VLLM_SERVER, REQUEST, mode="v", timeout=1.0))
    assert [r.stop_reason for r in records] == [None, None]


def test_generate_flushes_the_last_step_at_the_last_chunks_time(monkeypatch):
    """A step cut by the end token: its tokens are yielded at finish, timed at the last chunk (t 104), not later."""
    scripted(monkeypatch, [chunk(1), chunk(2, 3, 3, text="b"), finish_chunk(), chunk(2, 3, 3, usage=2)])
    records = list(remote.generate(LLAMA, REQUEST, mode="m", timeout=1.0))
    assert [(r.drafted, r.wall_s, len(r.tokens), r.stop_reason) for r in records] == [(0, 0.0, 1, None), (3, 3.0, 1, "eos")]


def test_generate_of_nothing(monkeypatch):
    scripted(monkeypatch, [finish_chunk(), {"choices": [], "usage": {"completion_tokens": 0}}])
    assert list(remote.generate(LLAMA, REQUEST, mode="m", timeout=1.0)) == []


def test_a_broken_stream_yields_the_cut_step_then_raises(monkeypatch):
    scripted(monkeypatch, [chunk(1, text="a"), chunk(2, 3, 2, text="b")], remote.RemoteError("broke"))
    got = []
    with pytest.raises(remote.RemoteError, match="broke"):
        for r in remote.generate(LLAMA, REQUEST, mode="m", timeout=1.0):
            got.append(r)
    # the cut step is flushed at the time of the break (the clock reads 100 here, the last chunk came at 102)
    assert [(r.index, r.drafted, r.accepted, r.wall_s, [t.text for t in r.tokens]) for r in got] == [
        (0, 0, 0, 0.0, ["a"]), (1, 3, 2, -1.0, ["b"])]
    assert [r.stop_reason for r in got] == [None, None]
