"""A GGUF on the torch engine is dequantised once (issue 27, item 3), into the smallest type that holds its weights
exactly, announced first by one line that says what, how big and roughly how long."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import shutil
import struct

import pytest
import torch
from safetensors import safe_open

from specchat import models
from specchat.cli.options import ModelOptions, load_models
from specchat.engine import smallbatch

pytestmark = pytest.mark.slow


def test_the_file_type_is_read_from_the_header():
    assert models.gguf_file_type(models.default_gguf()) == "Q4_1"
    assert models.gguf_bits_per_weight("Q4_1") == 5.0 and models.gguf_bits_per_weight("Q4_K_M") == 4.5
    assert models.gguf_bits_per_weight("F16") == 16 and models.gguf_bits_per_weight(None) is None


def test_a_file_that_is_not_gguf_has_no_file_type(tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 5))  # says five keys, has none
    assert models.gguf_file_type(text) is None and models.gguf_file_type(truncated) is None


def test_a_quantised_file_is_stored_as_float32_and_a_16_bit_file_as_its_own_type():
    """A Q4_1 weight is a float16 scale times a 4-bit integer plus a float16 offset: float16 cannot hold it (a
    float16 copy was another model: RESULTS section 13); F16 and BF16 files hold 16-bit values already."""
    folder = models.convert_gguf(models.default_gguf())
    shards = list(folder.glob("*.safetensors"))
    dtypes, params = set(), 0
    for shard in shards:
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                dtypes.add(f.get_slice(name).get_dtype())
                params += math.prod(f.get_slice(name).get_shape())
    assert dtypes == {"F32"} and sum(s.stat().st_size for s in shards) < params * 4.1
    assert models.conversion_plan(models.default_gguf()) is None  # done once: no plan the next time
    assert models.STORE_DTYPE == {"F16": torch.float16, "BF16": torch.bfloat16}


def test_a_copy_elsewhere_is_not_converted_again_and_is_hashed_once(tmp_path, monkeypatch):
    """A new virtual environment installs the default file at a new path with a new mtime: the same bytes, the same
    conversion. Its key is read once; later starts find it without reading the file."""
    default = models.default_gguf()
    models.convert_gguf(default)
    copy = tmp_path / default.name
    shutil.copyfile(default, copy)
    assert models.converted_dir(copy) == models.converted_dir(default) and models.conversion_plan(copy) is None
    with monkeypatch.context() as m:
        m.setattr(hashlib, "file_digest", lambda *a, **k: pytest.fail("the file was hashed again"))
        assert models.converted_dir(copy) == models.converted_dir(default)
    with open(copy, "r+b") as f:  # one byte of the weights changed: another model
        f.seek(copy.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    stat = copy.stat()  # a later write has a later mtime (a write within the same clock tick of the file system may not)
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert models.converted_dir(copy) != models.converted_dir(default)


def test_the_first_load_on_torch_says_what_it_converts_before_converting(tmp_path, monkeypatch):
    """The default file with other bytes is another file (another cache entry, not converted yet): its plan line
    comes, as a stage of its own, before the conversion starts; so does the kernel's compilation on a machine
    without it."""
    copy = tmp_path / "mine.gguf"
    shutil.copyfile(models.default_gguf(), copy)
    with open(copy, "ab") as f:
        f.write(f"{tmp_path}".encode())  # bytes no other run's copy has: never converted before
    plan = models.conversion_plan(copy)
    assert plan.startswith("Converting mine.gguf (0.1 GB, Q4_1) once for torch") and "32-bit safetensors" in plan
    assert "min on 2 cores" in plan

    stages, converted = [], []
    real = models.convert_gguf

    def convert(path):  # records when it was called; the conversion itself is the test above's
        converted.append((path, list(stages)))
        return real(models.default_gguf())

    class Progress:
        def status(self, text):
            stages.append(text)
            return contextlib.nullcontext()

    monkeypatch.setattr(models, "convert_gguf", convert)
    built = []
    monkeypatch.setattr(smallbatch, "needs_build", lambda folder: not built)  # as on a first start
    monkeypatch.setattr(smallbatch, "load", lambda folder: built.append(list(stages)) or True)
    load_models(ModelOptions(target=str(copy), device="cpu", engine="torch"), Progress())
    assert stages[0].startswith("Compiling specchat's small-batch kernel once") and built[0] == stages[:1]
    assert stages[1] == plan and converted[0] == (copy, stages[:2])  # announced, then done
    assert stages[2].startswith("Loading target") and "converting the GGUF tokenizers" not in stages[2]
