"""One declared engine interface (issue 53): the Target contract both local engines implement side by side, the
EngineInfo every front end reads, and one session interface for a local model and a serving engine alike, so that
no front end asks a session which engine it holds."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from support.models import tiny_model_dir
from specchat.conversation import ChatSession
from specchat.engine import remote
from specchat.engine.info import EngineInfo
from specchat.engine.target import CachedTarget, Target, TargetState
from specchat.models import load_model
from specchat.remote_session import RemoteSession
from specchat.session import Session

PACKAGE = Path(__file__).resolve().parents[2] / "specchat"
SPEC = remote.Server("spec", "http://h:1", "llama-server", "m.gguf", "draft-simple", "b1")
PLAIN = remote.Server("plain", "http://h:2", "vllm", "smol", None, "0.32.0")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(tiny_model_dir(tmp_path_factory.mktemp("tiny"), layers=2)), torch.device("cpu"), torch.float32)


# ---------------------------------------------------------------- Target


class ListTarget(CachedTarget):
    """The shared bookkeeping over the smallest cache there is: a list of the token ids it holds. Logits are one-hot
    at the id after the one fed, so each row says which position it came from."""

    runner = kernel = "list"

    def __init__(self) -> None:
        super().__init__(vocab_size=32, context_len=None, device=torch.device("cpu"))
        self.held: list[int] = []
        self.fed: list[tuple[list[int], int, int]] = []

    def forward(self, ids, past, keep):
        self._crop(past)
        assert len(self.held) == past
        self.held += ids
        self.fed.append((list(ids), past, keep))
        return torch.nn.functional.one_hot(torch.tensor(ids[-keep:]) + 1, 32).float()

    def _crop(self, length):
        del self.held[length:]


def test_a_cached_target_keeps_the_invariant_with_two_engine_operations():
    """An engine supplies forward and crop; start (prefill, reused prefix), verify, commit and rewind are shared."""
    t = ListTarget()
    assert isinstance(t, Target) and t.past == 0
    assert t.start([1, 2, 3]) == 3 and t.held == [1, 2, 3] and t.past == 3 and t.head.argmax().item() == 4
    assert t.verify([4, 5]).argmax(-1).tolist() == [4, 5, 6] and t.fed[-1] == ([4, 5], 3, 2)  # the drafts only
    t.commit([4, 9])  # one draft kept, then a replacement
    assert t.held == [1, 2, 3, 4] and t.tokens == [1, 2, 3, 4, 9] and t.past == 4 and t.head is None
    assert t.verify([]).argmax(-1).tolist() == [10] and t.fed[-1] == ([9], 4, 1)  # the pending token
    assert t.start([1, 2, 7, 8]) == 2 and t.held == [1, 2, 7, 8] and t.fed[-1] == ([7, 8], 2, 1)  # [1, 2] reused
    t.rewind()
    assert t.held == [1, 2, 7] and t.head is None and t.past == 3


def test_an_engine_that_leaves_out_an_operation_cannot_be_made():
    class NoCrop(CachedTarget):
        runner = kernel = "x"

        def forward(self, ids, past, keep):
            return torch.zeros(keep, 2)

    with pytest.raises(TypeError, match="_crop"):
        NoCrop(2, None, torch.device("cpu"))


def test_torch_s_state_is_a_target(tiny):
    state = TargetState(tiny.model)
    assert isinstance(state, Target) and isinstance(state, CachedTarget) and state.runner == "lean"


# ---------------------------------------------------------------- EngineInfo and the session interface


def test_a_local_session_says_what_runs_its_models(tiny):
    session = Session(tiny)
    assert isinstance(session, ChatSession)
    assert session.info == EngineInfo("torch", session.state.runner, session.state.kernel, "cpu", "float32")
    assert not session.info.remote and session.info.server is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        session.info.device = "cuda"


def test_a_remote_session_says_its_server_runs_the_models_and_follows_the_mode():
    session = RemoteSession([SPEC, PLAIN])
    assert isinstance(session, ChatSession)
    assert session.info == EngineInfo("llama-server", "llama-server", "llama-server", "server", "", server=SPEC)
    assert session.info.remote and session.preparing("plain") is None and session.mode_drafter is None
    session.set_mode("plain")
    assert session.info.server is PLAIN and (session.info.engine, session.info.kernel) == ("vllm", "vllm")
    snapshot = session.snapshot()  # the panel's drafter figures: none, without a local drafter
    assert (snapshot.mode, snapshot.max_draft, snapshot.draft_len, snapshot.choice, snapshot.standings) == ("plain", None, None, None, ())
    assert session.warnings == [] and session.notices == ["plain (http://h:2) does not speculate: every token is a plain target step"]


SNIFF = re.compile(r"^(self\.)?(session|app\.session)\b")  # a session, or its state
ENGINE_NAMES = {"engine", "engine_label", "servers", "server", "state", "runner", "kernel", "device_label", "dtype_label"}


def sniffs(call: ast.Call) -> bool:
    """getattr/hasattr on a session, or for a name that says which engine runs the models; isinstance against a
    session class."""
    if not isinstance(call.func, ast.Name) or not call.args:
        return False
    if call.func.id in ("getattr", "hasattr"):
        name = call.args[1].value if len(call.args) > 1 and isinstance(call.args[1], ast.Constant) else None
        return bool(SNIFF.match(ast.unparse(call.args[0]))) or name in ENGINE_NAMES
    return call.func.id == "isinstance" and len(call.args) == 2 and "Session" in ast.unparse(call.args[1])


def test_no_front_end_asks_a_session_which_engine_it_has():
    """The front ends read `session.info` (and the ChatSession members): no getattr or hasattr on a session or its
    state, no isinstance against a session class."""
    front_ends = [*(PACKAGE / "tui").rglob("*.py"), *(PACKAGE / "cli").rglob("*.py"), *(PACKAGE / "bench").rglob("*.py"),
                  PACKAGE / "export.py", PACKAGE / "history.py", PACKAGE / "verify.py"]
    found = [f"{path.relative_to(PACKAGE)}: {ast.unparse(node)}" for path in front_ends
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call) and sniffs(node)]
    assert found == []


@pytest.mark.parametrize("line, caught", [
    ('getattr(session.state, "kernel", "torch")', True),  # what export.py and generate.py read before
    ('getattr(session, "servers", None) is not None', True),  # app.py, export.py, generate.py, options.py
    ('hasattr(self.session, "preparing")', True),
    ('getattr(s, "server", None)', True),  # bench/remote.py
    ('getattr(model, "engine", "torch")', True),
    ('isinstance(session, RemoteSession)', True),
    ('getattr(drafter, "why", None)', False),  # a drafter's optional figure is not the engine
    ('getattr(sessions, "x", None)', False),
])
def test_the_sniffing_check_catches_what_the_front_ends_did(line, caught):
    """The broken controls: the lines the front ends used to read the engine with are caught."""
    assert any(sniffs(node) for node in ast.walk(ast.parse(line)) if isinstance(node, ast.Call)) is caught
