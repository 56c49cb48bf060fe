"""Build llama.cpp's llama-server once per machine and keep it in the user cache; print its path.

    python scripts/build_llama_server.py        # 16 minutes on 2 busy cores the first time, then instant
    python scripts/build_llama_server.py --tool llama-bench   # another of its tools, the same way (the benchmarks')

The source is the llama.cpp tree vendored in the llama-cpp-python source distribution that specchat pins
(pyproject.toml), fetched from PyPI: the server speaks the same llama.cpp version as specchat's own engine, and
a package registry is all a fresh machine (CI) can reach. The build is for this CPU (GGML_NATIVE), without the
web UI, curl or OpenSSL, with scripts/amx_tilecfg_fix.h force-included as in the README's install (a
binary built by GCC 11-12 on a CPU with AMX otherwise dies on any decode of several positions; a server you build
yourself without it needs --no-repack there). The test suite calls build() (tests/remote/test_remote_llama_server.py) to start real servers.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # the version pinned in pyproject.toml: the same llama.cpp as the in-process engine
TILECFG_FIX = Path(__file__).resolve().parent / "amx_tilecfg_fix.h"  # as the README's install: GCC 11-12's AMX bug
CMAKE_FLAGS = [f"-DCMAKE_CXX_FLAGS=-include {TILECFG_FIX}",
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
]


def cache_root() -> Path:
    """specchat's user cache (SPECCHAT_CACHE_DIR when set, as the tests set it)."""
    if os.environ.get("SPECCHAT_CACHE_DIR"):
        return Path(os.environ["SPECCHAT_CACHE_DIR"])
    import platformdirs

    return platformdirs.user_cache_path("specchat")


def machine_key() -> str:
    """A native build runs only on CPUs with the same instruction set: the key holds the CPU's flags."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]


def binary_path(tool: str = "llama-server") -> Path:
    return cache_root() / "llama-server" / f"{LLAMA_CPP_PYTHON}-tilecfg-{machine_key()}" / tool


def fetch_source(into: Path) -> Path:
    """The llama.cpp tree from llama-cpp-python's sdist (pip's download cache makes a second fetch free)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(into)], check=True)
    sdist = next(into.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
        tar.extractall(into, members=members, filter="data")
    return next(into.glob("llama_cpp_python-*/vendor/llama.cpp"))


def build(log=sys.stderr, tool: str = "llama-server") -> Path:
    """The cached binary, built first if missing. Safe to call from several processes at once (a file lock).
    SPECCHAT_LLAMA_SERVER names a llama-server binary of your own to use instead (of the same llama.cpp version)."""
    if tool == "llama-server" and os.environ.get("SPECCHAT_LLAMA_SERVER"):
        return Path(os.environ["SPECCHAT_LLAMA_SERVER"])
    target = binary_path(tool)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait for it
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(prefix="llama-server-build-") as tmp:
            tmp = Path(tmp)
            print(f"building {tool} (llama.cpp of llama-cpp-python {LLAMA_CPP_PYTHON}) into {target}", file=log)
            source = fetch_source(tmp)
            build_dir = tmp / "build"
            run_log = target.parent / f"build-{tool}.log"
            with open(run_log, "w") as out:
                steps = [["cmake", "-S", str(source), "-B", str(build_dir), *CMAKE_FLAGS],
                         ["cmake", "--build", str(build_dir), "--target", tool, "-j", str(os.cpu_count() or 2)]]
                for step in steps:  # niced: the test suite calls this while its other tests run
                    if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(10)).returncode != 0:
                        tail = run_log.read_text(errors="replace").splitlines()[-20:]
                        raise RuntimeError(f"building {tool} failed ({' '.join(step[:2])}); the end of {run_log}:\n" + "\n".join(tail))
            built = build_dir / "bin" / tool
            partial = target.with_suffix(".partial")
            shutil.copy2(built, partial)
            partial.replace(target)  # atomic: a process never sees half a binary
    return target


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tool", default="llama-server", help="a llama.cpp tool's CMake target (default: llama-server)")
    args = parser.parse_args()
    if shutil.which("cmake") is None:
        sys.exit("build_llama_server: cmake is not installed (pip install cmake, or your system's package)")
    try:
        print(build(tool=args.tool))
    except (RuntimeError, subprocess.CalledProcessError) as e:
        sys.exit(f"build_llama_server: {e}")
