import gc
import os
import tempfile

import platformdirs

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# Never the user's own folders: a cache of the tests' own (the default model is converted into it once per
# machine, then reused), and fresh data, config and state folders per run (exports, bench reports, user themes).
os.environ["SPECCHAT_CACHE_DIR"] = str(platformdirs.user_cache_path("specchat-tests"))
_scratch = tempfile.mkdtemp(prefix="specchat-tests-")
os.environ["SPECCHAT_DATA_DIR"] = os.path.join(_scratch, "data")
os.environ["SPECCHAT_CONFIG_DIR"] = os.path.join(_scratch, "config")
os.environ["SPECCHAT_STATE_DIR"] = os.path.join(_scratch, "state")  # auto's learnt rates: every run starts unlearnt

# a worker runs torch's bfloat16 tests and llama.cpp's on the same threads, as specchat never does (repack_probe.py)
from specchat.repack_probe import keep_tiles_for_llama_cpp  # noqa: E402

keep_tiles_for_llama_cpp()

import pytest  # noqa: E402
import torch  # noqa: E402

from support import remote_standin
from support.models import tiny_llama

# One intra-op thread: the tiny models gain nothing from two, and on a machine shared with other work
# two OpenMP threads spin-wait for each other (measured: a SmolLM2 step 20x slower under load).
torch.set_num_threads(1)

# The lean runner's float32 matmuls run through the fused kernel wherever it builds, in every test (as they do
# for every model load_model returns), not only in the tests that load a model from disk.
from specchat.engine import smallbatch  # noqa: E402
from specchat.store import cache_dir  # noqa: E402

smallbatch.load(cache_dir() / "kernels")


@pytest.fixture(autouse=True)
def unfreeze_after_test():
    """load_session freezes what is loaded for the process's life (a program loads once); a test process loads
    many sessions, so each test hands its objects back to the collector."""
    yield
    gc.unfreeze()


@pytest.fixture
def standin():
    """A stand-in llama-server on 127.0.0.1 (tests/support/remote_standin.py)."""
    server = remote_standin.start()
    yield server
    server.shutdown()


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_llama(seed=0, layers=2)


@pytest.fixture(scope="session")
def tiny_draft():
    """A different random model over the same vocabulary: it disagrees with the target often."""
    return tiny_llama(seed=1, layers=1)


@pytest.fixture(scope="session")
def deep_target():
    """Four layers, so there is something to skip and somewhere to exit. With the default init each layer
    changes little, so drafts mostly agree (greedy: full blocks and bonuses as well as rejections)."""
    return tiny_llama(seed=0, layers=4).requires_grad_(False)  # as load_model leaves a model


@pytest.fixture(scope="session")
def rough_target():
    """Four layers with a 5x larger init: each layer matters, drafts disagree (sampled acceptance ~0.25-0.6),
    so the distribution tests see many residual draws and the broken-rule control fails clearly."""
    return tiny_llama(seed=0, layers=4, initializer_range=0.1).requires_grad_(False)


@pytest.fixture(scope="session")
def smol():
    """The real default model (SmolLM2-135M-Instruct), loaded once for the whole run."""
    from specchat.models import load_model

    return load_model(None, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def smol_greedy(smol):
    """hf_greedy(ids, n): HF generate's greedy reply (up to n tokens, EOS included) to `ids` on the default model,
    the reference of every mode's greedy-identity test. Computed once per prompt and process, at least 40 tokens
    (the most those tests ask but one): a greedy reply of n tokens is the first n of a longer one, and the modes
    share two prompts, so each test no longer pays ~2-3 s for the same reference."""
    replies: dict[tuple[int, ...], list[int]] = {}
    longest: dict[tuple[int, ...], int] = {}

    def hf_greedy(ids: list[int], n: int) -> list[int]:
        key = tuple(ids)
        if longest.get(key, 0) < n and len(replies.get(key, ())) == longest.get(key, 0):  # not yet ended by EOS
            longest[key] = max(n, 40)
            out = smol.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=longest[key])
            replies[key] = out[0, len(ids):].tolist()
        return replies[key][:n]

    return hf_greedy


@pytest.fixture
def keep_threads():
    """Commands run in this process may set torch's threads (--threads): put the tests' setting back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
