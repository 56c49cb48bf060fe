"""A fresh specchat process for the tests that run one."""

from __future__ import annotations

import os
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]


def run_env(**extra) -> dict:
    """The environment for a fresh specchat process: this repository importable, no thread settings inherited."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return {**env, **extra}
