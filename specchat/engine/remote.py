"""A serving engine as the target: llama-server or vLLM over HTTP (OpenAI-compatible streaming), its
speculation reconstructed from the step information it streams. No torch: this is the whole engine on this path.

What a server tells a client, and so all this module knows (docs/ARCHITECTURE.md, *Remote engines*):
- llama-server, with `timings_per_token`: every chunk carries the running `timings.predicted_n` (tokens so far),
  `draft_n` (draft tokens proposed) and `draft_n_accepted`. Its counters move when a verify step's first token
  is sent; the step's tokens follow one chunk each (a token that ends inside a multi-byte character arrives with
  the next one). So a jump of d drafted and a accepted means the next a + 1 tokens are one step: a accepted,
  then a replacement if a < d or a bonus if a = d. A token that moves no counter is a plain target step.
- vLLM (V1) sends each engine step's tokens in one chunk (`return_token_ids` gives their ids): a chunk of m > 1
  tokens is a step that accepted m - 1 drafts; its last token is a bonus if m - 1 = K (read from the server's
  Prometheus counters, one per draft position), else a replacement. A one-token chunk is a plain step or a step
  whose drafts were all rejected: the stream cannot tell, so it is shown plain until the reply's per-request
  metrics (`--per-request-spec-decode-metrics detailed`: per_step_drafted/per_step_accepted) say which, and
  the reply is relabelled from them where they determine it.
- Neither engine sends the rejected drafts, p or q (nor, llama-server's chat endpoint, token ids): the events
  say so (id -1, p NaN, q None) and the screen says the server does not send them; nothing is invented.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import ssl
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Iterator

from specchat.engine.events import RoundRecord, TokenEvent

API_KEY_ENV = "SPECCHAT_API_KEY"  # sent as a bearer token when set; never printed, logged or exported
CONNECT_TIMEOUT_S = 10.0
UNKNOWN_ID = -1  # llama-server's chat endpoint sends text, not token ids
# a server does not say how long it drafted or verified: a round's draft_s and verify_s are NaN (exported as null),
# its wall_s is what the client measured (the time from the previous step's last token to this step's)
UNKNOWN = math.nan


class RemoteError(Exception):
    """One line for the user: what failed, where, and what the server said."""


@dataclass(frozen=True)
class Server:
    """One serving configuration: an endpoint and what it reported about itself."""

    name: str  # the configuration's name in the chat (NAME=URL, else the engine's)
    url: str  # base URL, without /v1 and without a trailing slash
    engine: str  # "llama-server" or "vllm"
    model: str  # the model as the server names it
    speculative: str | None  # the server's speculative method ("draft", "ngram-simple", ...); None: it does not speculate
    version: str = ""  # the engine's build or version string
    k: int | None = None  # vLLM: draft tokens per step (num_speculative_tokens), from its counters per position

    @property
    def label(self) -> str:
        spec = self.speculative or "no speculation"
        return f"{self.engine} {self.model} ({spec})"


# ---------------------------------------------------------------- HTTP


def _headers() -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    key = os.environ.get(API_KEY_ENV)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return headers


def _open(url: str, body: dict | None = None, *, timeout: float):
    """An HTTP response (TLS verified), or RemoteError with the server's own message."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=_headers(), method="POST" if data is not None else "GET")
    try:
        return urllib.request.urlopen(request, timeout=timeout, context=ssl.create_default_context())
    except urllib.error.HTTPError as e:
        raise RemoteError(f"{url}: HTTP {e.code} {e.reason}{_server_message(e)}") from None
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, (socket.timeout, TimeoutError)):
            raise RemoteError(f"{url}: no answer within {timeout:g} s") from None
        text = getattr(reason, "strerror", None) or str(reason)
        raise RemoteError(f"cannot reach {url}: {text}") from None
    except (socket.timeout, TimeoutError):
        raise RemoteError(f"{url}: no answer within {timeout:g} s") from None
    except (ConnectionError, OSError) as e:
        raise RemoteError(f"cannot reach {url}: {e.strerror or e}") from None


def _server_message(e: urllib.error.HTTPError) -> str:
    try:
        body = e.read(4096).decode(errors="replace")
    except OSError:
        return ""
    try:
        error = json.loads(body).get("error", body)
        message = error.get("message", error) if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = body
    message = " ".join(str(message).split())[:300]
    return f": {message}" if message else ""


def _get_json(url: str, timeout: float) -> dict | None:
    """GET url as JSON; None when the server answers 404 (an endpoint this engine does not have)."""
    try:
        with _open(url, timeout=timeout) as response:
            return json.loads(response.read())
    except RemoteError as e:
        if "HTTP 404" in str(e):
            return None
        raise
    except ValueError:
        return None


def connect(url: str, name: str | None = None, *, timeout: float = CONNECT_TIMEOUT_S) -> Server:
    """Ask the endpoint what it is: llama-server answers /props, vLLM /version; both /v1/models."""
    base = url.rstrip("/").removesuffix("/v1")
    if not base.startswith(("http://", "https://")):
        raise RemoteError(f"--server {url}: not an http:// or https:// URL")
    props = _get_json(f"{base}/props", timeout)
    if props is not None and "default_generation_settings" in props:
        model = os.path.basename(props.get("model_path") or "") or props.get("model_alias") or _first_model(base, timeout)
        return Server(name or "llama-server", base, "llama-server", model, llama_server_speculation(base, timeout),
                      str(props.get("build_info", "")))
    version = _get_json(f"{base}/version", timeout)
    if version is not None and "version" in version:
        spec, k = vllm_speculation(base, timeout)
        return Server(name or "vllm", base, "vllm", _first_model(base, timeout), spec, str(version["version"]), k)
    raise RemoteError(f"{base} answers, but not as llama-server (/props) or vLLM (/version): is this the right URL?")


def llama_server_speculation(base: str, timeout: float = CONNECT_TIMEOUT_S) -> str | None:
    """The speculative types of llama-server's slots ("draft-simple", "ngram-mod", ...); "on" before a slot has
    served a request (only then does it list its types); None if it does not speculate; "unknown" if /slots is
    off (--no-slots). /props does not say."""
    try:
        slots = _get_json(f"{base}/slots", timeout)
    except RemoteError:
        slots = None
    if not isinstance(slots, list) or not slots or "speculative" not in slots[0]:
        return "unknown"
    if not slots[0]["speculative"]:
        return None
    types = [t for t in str(slots[0].get("params", {}).get("speculative.types", "")).split(",") if t and t != "none"]
    return ",".join(types) or "on"


def vllm_speculation(base: str, timeout: float = CONNECT_TIMEOUT_S) -> tuple[str | None, int | None]:
    """vLLM names its speculative method nowhere a client can read; its Prometheus counters show whether it
    speculates and K (one accepted-tokens counter per draft position). ("unknown", None) without /metrics."""
    try:
        with _open(f"{base}/metrics", timeout=timeout) as response:
            text = response.read().decode(errors="replace")
    except RemoteError:
        return "unknown", None
    positions = re.findall(r'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="(\d+)"', text, re.M)
    if positions:
        k = max(int(p) for p in positions) + 1
        return f"K={k}", k
    return ("on", None) if "vllm:spec_decode" in text else (None, None)


def _first_model(base: str, timeout: float) -> str:
    models = _get_json(f"{base}/v1/models", timeout) or {}
    data = models.get("data") or [{}]
    return str(data[0].get("id", "unknown"))


# ---------------------------------------------------------------- streaming


@dataclass(frozen=True)
class Request:
    messages: list[dict]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None = None
    # No draft length: the pinned llama-server ignores a request's speculative.n_max/n_min/p_min (server-schema.cpp
    # compiles them out, "disable speculative parameter adjustments for now"), and vLLM fixes it at start. The
    # server's own setting applies; a configuration without drafting is a server of its own.

    def body(self, server: Server) -> dict:
        body = {
            "model": server.model, "messages": self.messages, "stream": True, "max_tokens": self.max_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "stream_options": {"include_usage": True},
        }
        if self.seed is not None:
            body["seed"] = self.seed
        if server.engine == "llama-server":
            # only the samplers specchat shows: llama-server's chain also has min-p, penalties... off by default here
            body.update({"timings_per_token": True, "top_k": self.top_k, "min_p": 0.0})
        else:  # vLLM: the token ids say how many tokens each step's chunk holds
            body.update({"return_token_ids": True, "top_k": self.top_k or -1})
        return body


def stream_chunks(server: Server, request: Request, *, timeout: float) -> Iterator[tuple[float, dict]]:
    """(arrival time, chunk) for every server-sent event until [DONE]; RemoteError if the stream breaks first."""
    response = _open(f"{server.url}/v1/chat/completions", request.body(server), timeout=timeout)
    done = False
    try:
        while True:
            try:
                line = response.readline()
            except (socket.timeout, TimeoutError):
                raise RemoteError(f"{server.url}: the stream stalled (nothing for {timeout:g} s)") from None
            except (ConnectionError, OSError) as e:
                raise RemoteError(f"{server.url}: the stream broke: {e}") from None
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            try:
                chunk = json.loads(data)
            except ValueError:
                raise RemoteError(f"{server.url}: not a JSON event: {data[:80]!r}") from None
            if "error" in chunk:  # an error reported inside the stream
                error = chunk["error"]
                raise RemoteError(f"{server.url}: {error.get('message', error) if isinstance(error, dict) else error}")
            yield time.perf_counter(), chunk
    finally:
        response.close()
    if not done:
        raise RemoteError(f"{server.url}: the stream ended before the reply did (the server closed the connection)")


# ---------------------------------------------------------------- llama-server: the steps behind the counters


@dataclass
class _Step:
    drafted: int
    accepted: int
    tokens: list[TokenEvent] = field(default_factory=list)

    @property
    def size(self) -> int:  # the tokens it emits: the accepted drafts and one replacement or bonus
        return self.accepted + 1


def step_kind(drafted: int, accepted: int, i: int) -> str:
    """The kind of a step's i-th token: plain if it drafted nothing, else its accepted drafts, then a bonus (all
    accepted) or the replacement of the first rejected draft."""
    if drafted == 0:
        return "target"
    if i < accepted:
        return "accepted"
    return "bonus" if accepted == drafted else "resampled"


@dataclass
class Reconciliation:
    """The reconstructed steps against the server's own final counters (they must add up)."""

    tokens: int
    drafted: int
    accepted: int
    server_tokens: int | None
    server_drafted: int | None
    server_accepted: int | None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def compare(self, *more: tuple[str, int, int | None]) -> "Reconciliation":
        """Add a problem for every count of the steps that differs from the server's (None: the server sent none)."""
        for name, ours, theirs in (("tokens", self.tokens, self.server_tokens), ("drafted", self.drafted, self.server_drafted),
                                   ("accepted", self.accepted, self.server_accepted), *more):
            if theirs is not None and ours != theirs:
                self.problems.append(f"{name}: the steps give {ours}, the server counted {theirs}")
        return self


class LlamaServerSteps:
    """Turns llama-server's running counters into RoundRecords, one per target step, as the tokens arrive."""

    def __init__(self, mode: str, t_start: float) -> None:
        self.mode = mode
        self.t_last = t_start  # the end of the previous step (the request's start for the first)
        self.t_start = t_start
        self.n = self.drafted = self.accepted = 0  # the counters as last seen
        self.current: _Step | None = None  # the verify step whose tokens are arriving
        self.queued: _Step | None = None  # a step whose counters moved before the current one's tokens all came
        self.index = 0
        self.steps: list[_Step] = []
        self.problems: list[str] = []
        self.final: dict | None = None  # the latest counters (the last chunk's are the server's totals)
        self.usage: dict | None = None
        self.finish_reason: str | None = None

    def feed(self, t: float, chunk: dict) -> list[RoundRecord]:
        """One chunk in; the steps it completed out. The finish reason comes in a chunk of its own, and the
        final counters (with a last token that has no text, such as the end token) in the usage chunk after it."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        choice = (chunk.get("choices") or [{}])[0]
        text = (choice.get("delta") or {}).get("content") or ""
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        timings = chunk.get("timings")
        if timings is None:
            if text:
                self.problems.append("a chunk with text but no timings (does this llama-server know timings_per_token?)")
            return []
        self.final = timings
        n, drafted, accepted = timings.get("predicted_n", 0), timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)
        if drafted > self.drafted:
            if self.queued is not None:
                self.problems.append(f"two steps began before the tokens of the first arrived (at token {self.n})")
            self.queued = _Step(drafted - self.drafted, accepted - self.accepted)
        elif accepted != self.accepted:
            self.problems.append(f"draft_n_accepted moved ({self.accepted} -> {accepted}) without draft_n")
        self.drafted, self.accepted = drafted, accepted
        new = n - self.n
        self.n = n
        out: list[RoundRecord] = []
        for i in range(new):
            piece = text if i == new - 1 else ""  # the chunk's text goes with its last token
            if self.current is None:  # (a step is flushed as soon as its last token comes)
                self.current, self.queued = (self.queued, None) if self.queued is not None else (_Step(0, 0), None)
            step = self.current
            step.tokens.append(self._event(step, len(step.tokens), piece))
            if step.drafted == 0 or len(step.tokens) == step.size:
                out += self._flush_current(t)
        if self.queued is not None:  # llama-server moves a step's counters with its first token, never earlier
            self.problems.append(f"at token {n}: a step's counters moved before the previous step's tokens all came")
        return out

    def _event(self, step: _Step, i: int, text: str) -> TokenEvent:
        return TokenEvent(id=UNKNOWN_ID, text=text, kind=step_kind(step.drafted, step.accepted, i), round=self.index,
                          position=i + 1, p=math.nan, q=None, accept_prob=None)

    def _flush_current(self, t: float, final: bool = False) -> list[RoundRecord]:
        step, self.current = self.current, None
        if step is None or not step.tokens:
            return []
        if len(step.tokens) < step.size and not final:  # only the last step may end early (at the end token)
            self.problems.append(f"step {self.index}: {len(step.tokens)} tokens where {step.accepted} accepted drafts promise {step.size}")
        first = self.index == 0
        record = RoundRecord(
            index=self.index, mode=self.mode, draft_len=step.drafted,  # the server's K for this step is not sent
            drafted=step.drafted, accepted=step.accepted, draft_calls=0, draft_s=UNKNOWN, verify_s=UNKNOWN,
            wall_s=0.0 if first else t - self.t_last, prefill_s=t - self.t_start if first else 0.0, tokens=step.tokens,
        )
        self.steps.append(step)
        self.t_last = t
        self.index += 1
        return [record]

    def finish(self, t: float) -> list[RoundRecord]:
        """The stream ended: the last step, however many of its tokens came."""
        if self.queued is not None:
            self.problems.append("a step's counters moved but none of its tokens came")
        return self._flush_current(t, final=True)

    def reconciliation(self) -> Reconciliation:
        tokens = sum(len(s.tokens) for s in self.steps)
        drafted = sum(s.drafted for s in self.steps)
        accepted = sum(s.accepted for s in self.steps)
        final = self.final or {}
        usage_tokens = (self.usage or {}).get("completion_tokens")
        rec = Reconciliation(tokens, drafted, accepted, final.get("predicted_n", usage_tokens),
                             final.get("draft_n", 0) if final else None, final.get("draft_n_accepted", 0) if final else None,
                             list(self.problems))
        if not final:
            rec.problems.append("no chunk carried the server's counters")
        return rec.compare(("completion_tokens", tokens, usage_tokens))


# ---------------------------------------------------------------- vLLM: one chunk per step


class VllmSteps:
    """vLLM's chunks as RoundRecords, one per chunk (one engine step each), relabelled after the reply from its
    per-request metrics where they determine the steps (module docstring)."""

    def __init__(self, mode: str, t_start: float, k: int | None) -> None:
        self.mode, self.k = mode, k
        self.t_last = self.t_start = t_start
        self.records: list[RoundRecord] = []
        self.problems: list[str] = []
        self.usage: dict | None = None
        self.metrics: dict | None = None
        self.finish_reason: str | None = None

    def feed(self, t: float, chunk: dict) -> list[RoundRecord]:
        if chunk.get("usage"):
            self.usage, self.metrics = chunk["usage"], chunk.get("metrics")
        choice = (chunk.get("choices") or [{}])[0]
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        ids = choice.get("token_ids")
        text = (choice.get("delta") or {}).get("content") or ""
        if ids is None:
            if text:
                self.problems.append("chunks without token_ids (return_token_ids needs vLLM 0.10 or later)")
            return []
        if not ids:
            return []
        first = not self.records
        accepted = 0 if first or len(ids) == 1 else len(ids) - 1
        drafted = 0 if not accepted else (self.k if self.k and self.k >= accepted else accepted + 1)
        record = RoundRecord(
            index=len(self.records), mode=self.mode, draft_len=drafted, drafted=drafted, accepted=accepted, draft_calls=0,
            draft_s=UNKNOWN, verify_s=UNKNOWN, wall_s=0.0 if first else t - self.t_last,
            prefill_s=t - self.t_start if first else 0.0,
        )
        record.tokens = _label(record, ids, text)
        self.records.append(record)
        self.t_last = t
        return [record]

    def finish(self, t: float) -> list[RoundRecord]:
        return []

    def relabel(self) -> bool:
        """Set each step's drafted/accepted (and its tokens' kinds) from per_step_drafted/per_step_accepted;
        False (with the reason in `problems`) where the stream and the metrics do not determine them."""
        spec = (self.metrics or {}).get("speculative_decoding") or {}
        drafted, accepted = spec.get("per_step_drafted"), spec.get("per_step_accepted")
        if drafted is None or accepted is None:
            if self.metrics is None or spec or self.k:  # a speculating server that sent no per-step lists
                self.problems.append("no per-step metrics in the usage chunk (start vLLM with --per-request-spec-decode-"
                                     "metrics detailed): one-token steps are shown plain, some may have drafted")
            return False
        steps = align([len(r.tokens) for r in self.records[1:]], list(zip(drafted, accepted)))
        if steps is None:
            self.problems.append("the per-step metrics do not determine which one-token steps drafted")
            return False
        for record, (d, a) in zip(self.records[1:], steps):
            record.drafted, record.accepted, record.draft_len = d, a, d
            record.tokens = _label(record, [t.id for t in record.tokens], None, [t.text for t in record.tokens])
        return True

    def reconciliation(self) -> Reconciliation:
        tokens = sum(len(r.tokens) for r in self.records)
        drafted = sum(r.drafted for r in self.records)
        accepted = sum(r.accepted for r in self.records)
        spec = (self.metrics or {}).get("speculative_decoding") or {}
        rec = Reconciliation(tokens, drafted, accepted, (self.usage or {}).get("completion_tokens"),
                             spec.get("num_draft_tokens"), spec.get("num_accepted_draft_tokens"), list(self.problems))
        if rec.server_tokens is None:
            rec.problems.append("no usage chunk with the server's token count")
        return rec.compare()


def _label(record: RoundRecord, ids: list[int], text: str | None, texts: list[str] | None = None) -> list[TokenEvent]:
    """A step's token events: its accepted drafts, then a bonus (all K accepted) or a replacement; the chunk's text
    goes with the last token (the ids are exact, the split of the text between them is not sent)."""
    out = []
    for i, tok in enumerate(ids):
        piece = texts[i] if texts is not None else (text if i == len(ids) - 1 else "")
        out.append(TokenEvent(id=tok, text=piece, kind=step_kind(record.drafted, record.accepted, i), round=record.index,
                              position=i + 1, p=math.nan, q=None, accept_prob=None))
    return out


def align(sizes: list[int], entries: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """Each step's (drafted, accepted), from vLLM's per-step lists, which leave out the steps that drafted nothing.
    A step of m > 1 tokens is the next entry (accepted m - 1; the last step may be cut by max_tokens); a run of
    one-token steps holds as many entries with accepted 0 as come next: none (all plain) or one each (all
    rejected). Anything else (some of them, or lists that do not fit) is None: the stream does not tell."""
    out: list[tuple[int, int]] = []
    i = j = 0
    while i < len(sizes):
        end = i
        while end < len(sizes) and sizes[end] == 1:
            end += 1
        ones = end - i
        zeros = 0
        while j + zeros < len(entries) and entries[j + zeros][1] == 0:
            zeros += 1
        if ones:
            if zeros == ones:
                out += entries[j:j + zeros]
                j += zeros
            elif zeros == 0:
                out += [(0, 0)] * ones
            else:
                return None
        i = end
        if i < len(sizes):
            if j >= len(entries):
                return None
            d, a = entries[j]
            if a != sizes[i] - 1 and not (i == len(sizes) - 1 and a > sizes[i] - 1):
                return None
            out.append((d, a))
            i, j = i + 1, j + 1
    if j == len(entries) - 1 and sizes and sizes[-1] == 1 and out[-1] == (0, 0) and entries[j][1] > 0:
        out[-1], j = entries[j], j + 1  # the last step cut to one token by max_tokens
    return out if j == len(entries) else None


def generate(server: Server, request: Request, *, mode: str, timeout: float,
             steps_out: list | None = None) -> Iterator[RoundRecord]:
    """One reply from the server as RoundRecords, as the local engines yield them. `steps_out` receives the
    reconstruction (its Reconciliation says whether it matched the server's counters)."""
    t0 = time.perf_counter()
    steps = LlamaServerSteps(mode, t0) if server.engine == "llama-server" else VllmSteps(mode, t0, server.k)
    if steps_out is not None:
        steps_out.append(steps)
    t, last = t0, None
    try:
        for t, chunk in stream_chunks(server, request, timeout=timeout):
            for last in steps.feed(t, chunk):
                yield last
    except RemoteError:  # the tokens of a step the break cut short are kept too
        yield from steps.finish(time.perf_counter())
        raise
    for last in steps.finish(t):
        yield last
    if last is not None:  # known only now: the finish reason may come after the last token
        last.stop_reason = {"stop": "eos", "length": "max_new_tokens"}.get(steps.finish_reason, steps.finish_reason)
