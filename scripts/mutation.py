"""A mutation score for one source file, in bounded time: mutmut mutates the file, runs the tests that cover
each mutant, and this prints the score and the surviving mutants.

    pip install mutmut   # 3.8.1 measured; not a dependency of specchat
    python scripts/mutation.py specchat/engine/remote.py tests/remote/test_remote.py [--timeout 1800] [--children 2]

Not part of the test suite (it runs the chosen tests once per mutant). mutmut works in ./mutants (a copy of the
tree) and reads its settings from setup.cfg, which this script writes for the run and removes after. Score:
killed / (killed + survived + timed out); a survivor is either a missing test or an equivalent mutant, to be
written down as such (benchmarks/RESULTS.md, section 11).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = """[mutmut]
source_paths={source}
pytest_add_cli_args=
    -n
    0
    -p
    no:cacheprovider
pytest_add_cli_args_test_selection=
{tests}
also_copy=
    specchat/
    tests/
    scripts/
"""


# tests/conftest.py runs code under test while pytest loads it (it builds and loads the fused kernel): with a
# mutant active there, mutmut's forced-fail check fails inside conftest and every mutant goes unchecked. This
# plugin runs the conftests unmutated; a mutant then reaches only the tests that call the code themselves.
GUARD = """import os
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_load_initial_conftests(early_config, parser, args):
    saved = os.environ.get("MUTANT_UNDER_TEST")
    os.environ["MUTANT_UNDER_TEST"] = ""  # no mutant matches: every trampoline runs the original
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("MUTANT_UNDER_TEST", None)
        else:
            os.environ["MUTANT_UNDER_TEST"] = saved
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source", help="the file to mutate, e.g. specchat/engine/remote.py")
    ap.add_argument("tests", nargs="+", help="the test files that cover it")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run (what is done is reported)")
    ap.add_argument("--children", type=int, default=2, help="mutants tested at once")
    args = ap.parse_args()
    mutmut = shutil.which("mutmut") or str(Path(sys.executable).with_name("mutmut"))
    config = ROOT / "setup.cfg"
    if config.exists():
        sys.exit(f"mutation: {config} exists; this script writes its own and removes it after")
    config.write_text(CONFIG.format(source=args.source, tests="\n".join(f"    {t}" for t in args.tests)))
    guard = Path(tempfile.mkdtemp(prefix="mutation-guard-"))
    (guard / "unmutated_conftest.py").write_text(GUARD)
    try:
        shutil.rmtree(ROOT / "mutants", ignore_errors=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(guard), os.environ.get("PYTHONPATH")])),
               "PYTEST_ADDOPTS": " ".join(filter(None, [os.environ.get("PYTEST_ADDOPTS"), "-p unmutated_conftest"]))}
        run = subprocess.Popen([mutmut, "run", "--max-children", str(args.children)], cwd=ROOT, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        try:
            run.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)  # mutmut and the test runs it started
            run.wait()
            print(f"mutation: stopped after {args.timeout:g} s; the counts are of the mutants tested by then")
        results = subprocess.run([mutmut, "results", "--all", "true"], cwd=ROOT, capture_output=True, text=True).stdout
    finally:
        config.unlink()
        shutil.rmtree(guard, ignore_errors=True)
    status = {}
    for line in results.splitlines():
        name, _, state = line.strip().rpartition(": ")
        if name:
            status[name] = state
    counts = Counter(status.values())
    judged = counts["killed"] + counts["survived"] + counts["timeout"]
    print(f"{args.source}: {len(status)} mutants; " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if judged:
        print(f"score (killed / judged): {counts['killed'] / judged:.1%}")
    survivors = sorted(n for n, s in status.items() if s == "survived")
    out = ROOT / "mutants" / "survivors.txt"
    out.write_text("\n".join(survivors) + "\n")
    print(f"survivors: {out} (show one with `mutmut show NAME`)")


if __name__ == "__main__":
    main()
