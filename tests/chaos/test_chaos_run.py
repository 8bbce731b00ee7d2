"""The CI-sized ``aivedio chaos`` run: every fault kind once or more, every invariant at zero.

The run brings its own embedded PostgreSQL, Valkey and NATS (it kills and restarts them), so it
ignores the AIVEDIO_*_URL servers of the test session.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile


def test_a_ci_sized_chaos_run_keeps_every_invariant() -> None:
    # Not under tmp_path: a pytest session that starts meanwhile makes /tmp/pytest-of-<user> 0700,
    # and the embedded PostgreSQL (another OS user when we are root) could not restart there.
    folder = tempfile.mkdtemp(prefix="aivedio-chaos-test-")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("AIVEDIO_") or k.startswith("AIVEDIO_BUS_")
    }
    out = subprocess.run(
        [
            sys.executable, "-m", "aivedio", "chaos",
            "--seed", "3", "--tasks", "14", "--projects", "2", "--replicas", "2",
            "--window-s", "36", "--interval-s", "5",
            "--data-dir", folder,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0 and report["ok"], out.stdout + out.stderr[-4000:]
    shutil.rmtree(folder, ignore_errors=True)  # kept for a failed run: the processes' logs
    kinds = {fault.split(":")[0] for fault in report["faults"]}
    assert kinds == {
        "kill_process", "stop_process", "restart_postgres", "restart_redis", "restart_nats",
        "cut_connections",
    }  # fmt: skip
    assert report["tasks"] == 14
    assert all(c["frames"] > 0 for c in report["clients"])
