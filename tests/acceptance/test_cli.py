"""The operator contract through the real ``aivedio`` command, as separate processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def env(database_url: str, redis_url: str, nats_url: str) -> dict[str, str]:
    return os.environ | {
        "AIVEDIO_DATABASE_URL": database_url,
        "AIVEDIO_REDIS_URL": redis_url,
        "AIVEDIO_NATS_URL": nats_url,
    }


def aivedio(env: dict[str, str], *args: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-m", "aivedio", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    result: dict[str, object] = json.loads(last)
    return result


def wait_ready(url: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode}"
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} never became ready")


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for stream in (p.stdout, p.stderr):
            if stream is not None:
                stream.close()


def test_migrate_create_project_and_run_api(
    env: dict[str, str], started: list[subprocess.Popen[str]]
) -> None:
    assert aivedio(env, "migrate")["applied"] == []  # the template is already migrated
    made = aivedio(env, "admin", "create-project", "--tenant", "t1", "--project", "p1")
    assert set(made) >= {"tenant_id", "project_id", "api_key"}
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "aivedio", "run", "--role", "api", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    started.append(proc)
    base = f"http://127.0.0.1:{port}"
    wait_ready(f"{base}/readyz", proc)
    r = httpx.post(
        f"{base}/v1/projects/{made['project_id']}/tasks",
        headers={"Authorization": f"Bearer {made['api_key']}", "Idempotency-Key": "cli-1"},
        json={"provider": "sandbox", "model": "m", "prompt": "p", "params": {}},
    )
    assert r.status_code == 202
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0


def test_unknown_role_is_refused(env: dict[str, str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "aivedio", "run", "--role", "nonsense"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "unknown role" in out.stderr


def test_demo_serves_the_api_and_the_sandbox_provider(
    env: dict[str, str], started: list[subprocess.Popen[str]]
) -> None:
    port, sandbox_port = free_port(), free_port()
    demo_env = env | {
        "AIVEDIO_PORT": str(port),
        "AIVEDIO_SANDBOX_URL": f"http://127.0.0.1:{sandbox_port}",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "aivedio", "demo"],
        env=demo_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    started.append(proc)
    assert proc.stdout is not None
    first = json.loads(proc.stdout.readline())
    wait_ready(f"http://127.0.0.1:{port}/readyz", proc)
    wait_ready(f"http://127.0.0.1:{sandbox_port}/healthz", proc)
    r = httpx.post(
        f"http://127.0.0.1:{port}/v1/projects/{first['project_id']}/tasks",
        headers={"Authorization": f"Bearer {first['api_key']}", "Idempotency-Key": "demo-1"},
        json={"provider": "sandbox", "model": "m", "prompt": "p", "params": {}},
    )
    assert r.status_code == 202
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
