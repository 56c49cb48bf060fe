"""A stand-in llama-server for fast tests: its chunks are shaped as the pinned llama-server sends them
(tools/server/server-context.cpp: one chunk per token with the running counters, the finish reason in a chunk of
its own, the final counters with the usage)."""

from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path

VLLM = Path(__file__).parent.parent / "remote" / "fixtures" / "vllm-0.32.0"  # a real vLLM 0.32.0 (CPU) recording: its README says how


def chunk(n, drafted=0, accepted=0, text="x", finish=None, usage=None):
    """One streamed chunk: llama-server leaves draft_n out until the first draft."""
    timings = {"predicted_n": n}
    if drafted:
        timings.update(draft_n=drafted, draft_n_accepted=accepted)
    out = {"choices": [{"delta": {"content": text}, "finish_reason": finish}], "timings": timings}
    if usage is not None:
        out = {"choices": [], "usage": {"completion_tokens": usage}, "timings": timings}
    return out


def finish_chunk(reason="stop"):
    return {"choices": [{"delta": {}, "finish_reason": reason}]}


class Handler(http.server.BaseHTTPRequestHandler):
    """A stand-in llama-server: /props and /slots as llama-server answers them; the chat endpoint streams
    `self.server.script` (a list of chunks), then [DONE] unless `cut` is set (the stream breaks)."""

    def log_message(self, *args):
        pass

    def _json(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _file(self, path: Path, kind="application/json"):
        body = path.read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.server.seen_auth.append(self.headers.get("Authorization"))
        if self.server.engine == "vllm":  # what vLLM answers (recorded)
            files = {"/version": "version.json", "/v1/models": "models.json", "/metrics": "metrics-spec-lines.prom"}
            if self.path in files:
                self._file(VLLM / files[self.path], "text/plain" if self.path == "/metrics" else "application/json")
            else:
                self._json(404, {"detail": "Not Found"})
            return
        if self.path == "/props":
            self._json(200, {"default_generation_settings": {"params": {}}, "model_path": "/m/model.gguf", "build_info": "b1"})
        elif self.path == "/slots":
            self._json(200, [{"speculative": self.server.slots_speculative, "params": {"speculative.types": "none,draft-simple"}}])
        else:
            self._json(404, {"error": {"message": "File Not Found"}})

    def do_POST(self):
        length = int(self.headers.get("Content-Length", 0))
        self.server.bodies.append(json.loads(self.rfile.read(length)))
        if self.server.status != 200:
            self._json(self.server.status, {"error": {"code": self.server.status, "message": "the request exceeds the available context size"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if self.server.engine == "vllm":  # the recorded stream, byte for byte
            self.wfile.write((VLLM / "chat_stream_token_ids.sse").read_bytes())
            return
        for c in self.server.script:
            self.wfile.write(b"data: " + json.dumps(c).encode() + b"\n\n")
            self.wfile.flush()
            time.sleep(self.server.pause_s)
        if not self.server.cut:
            self.wfile.write(b"data: [DONE]\n\n")


def start() -> http.server.ThreadingHTTPServer:
    """A running stand-in on a free port (`url`); set `script`, `cut`, `status`, `pause_s`, `engine`; shutdown()
    when done."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.script, server.cut, server.status, server.bodies, server.seen_auth = [], False, 200, [], []
    server.pause_s = 0.0  # between chunks (a test that presses keys mid-reply sets it)
    server.slots_speculative = True  # what /slots says
    server.engine = "llama-server"  # or "vllm": answer as the recorded vLLM
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    return server
