"""The CI-sized ``aivedio chaos`` run: every fault kind once or more, every invariant at zero.

The run brings its own embedded PostgreSQL, Valkey and NATS (it kills and restarts them), so it
ignores the AIVEDIO_*_URL servers of the test session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_a_ci_sized_chaos_run_keeps_every_invariant(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIVEDIO_")}
    out = subprocess.run(
        [
            sys.executable, "-m", "aivedio", "chaos",
            "--seed", "3", "--tasks", "14", "--projects", "2", "--replicas", "2",
            "--window-s", "36", "--interval-s", "5",
            "--data-dir", str(tmp_path / "chaos"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0 and report["ok"], out.stdout + out.stderr[-4000:]
    kinds = {fault.split(":")[0] for fault in report["faults"]}
    assert kinds == {
        "kill_process", "stop_process", "restart_postgres", "restart_redis", "restart_nats",
        "cut_connections",
    }  # fmt: skip
    assert report["tasks"] == 14
    assert all(c["frames"] > 0 for c in report["clients"])
