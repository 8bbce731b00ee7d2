"""The field report of issue 12, as a user runs it: ``aivedio run --role all`` on a private
embedded PostgreSQL that is SIGKILLed and started again. The process stays up, ``/readyz`` goes
503 naming the roles that are down and back to 200, and a task created after the restart is
processed all the way to ``ready`` (the sandbox provider calling back)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.acceptance.test_cli import free_port, wait_ready
from tests.chaos.outages import PrivateServers, fresh_database, private_servers
from tests.waiting import eventually_sync

DEADLINE_S = 90.0  # only to fail instead of hanging


@pytest.fixture(scope="module")
def servers() -> Iterator[PrivateServers]:
    with private_servers() as started:
        yield started


def wait_for(condition: Callable[[], bool], what: str, proc: subprocess.Popen[str]) -> None:
    def met() -> bool:
        if condition():
            return True
        assert proc.poll() is None, f"the process exited with {proc.returncode} waiting for {what}"
        return False

    eventually_sync(met, what, timeout=DEADLINE_S, interval=0.2)


def get(url: str, **kwargs: object) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=5, **kwargs)  # type: ignore[arg-type]
    except httpx.HTTPError:
        return None


def test_run_all_stays_up_through_a_postgres_restart(
    servers: PrivateServers, tmp_path: Path
) -> None:
    database_url = asyncio.run(fresh_database(servers.urls.database_url))
    port, sandbox_port = free_port(), free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AIVEDIO_")},
        "AIVEDIO_DATABASE_URL": database_url,
        "AIVEDIO_REDIS_URL": servers.urls.redis_url,
        "AIVEDIO_NATS_URL": servers.urls.nats_url,
        "AIVEDIO_DATA_DIR": str(tmp_path / "data"),
        "AIVEDIO_SECRET_KEY": "k" * 32,
        "AIVEDIO_PORT": str(port),
        "AIVEDIO_SANDBOX_URL": f"http://127.0.0.1:{sandbox_port}",
        "AIVEDIO_DB_ACQUIRE_TIMEOUT_S": "1",
    }
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "aivedio",
            "admin",
            "create-project",
            "--tenant",
            "t",
            "--project",
            "p",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    project = json.loads(made.stdout.strip().splitlines()[-1])
    headers = {"Authorization": f"Bearer {project['api_key']}"}
    base = f"http://127.0.0.1:{port}"
    tasks_url = f"{base}/v1/projects/{project['project_id']}/tasks"
    log_path = tmp_path / "run.log"
    procs: list[subprocess.Popen[str]] = []
    with log_path.open("w") as log:
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "aivedio", "sandbox-provider", "--port", str(sandbox_port)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        )
        run = subprocess.Popen(
            [sys.executable, "-m", "aivedio", "run", "--role", "all"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
            text=True,
        )
        procs.append(run)
    try:
        wait_ready(f"http://127.0.0.1:{sandbox_port}/healthz", procs[0])
        wait_ready(f"{base}/readyz", run)

        def create() -> str:
            body = {
                "provider": "sandbox",
                "model": "m",
                "prompt": "p",
                "params": {"sandbox": {"queue_s": 0.05, "duration_s": 0.3, "steps": 2}},
            }
            key = uuid.uuid4().hex
            created: list[str] = []

            def accepted() -> bool:
                try:
                    r = httpx.post(
                        tasks_url, json=body, headers=headers | {"Idempotency-Key": key}, timeout=5
                    )
                except httpx.HTTPError:
                    return False
                if r.status_code == 202:
                    created.append(r.json()["task"]["id"])
                return bool(created)

            wait_for(accepted, "a task accepted", run)
            return created[0]

        def ready(task_id: str) -> Callable[[], bool]:
            def check() -> bool:
                r = get(f"{tasks_url}/{task_id}", headers=headers)
                return (
                    r is not None and r.status_code == 200 and r.json()["task"]["status"] == "ready"
                )

            return check

        before = create()
        wait_for(ready(before), "the task before the fault to be ready", run)

        servers.kill("postgres")
        seen_down: list[dict[str, object]] = []

        def names_roles() -> bool:
            r = get(f"{base}/readyz")
            if r is None or r.status_code != 503:
                return False
            body = r.json()
            if {"inbox", "relay", "submitter"} <= set(body["roles_down"]):
                seen_down.append(body)
                return True
            return False

        wait_for(names_roles, "/readyz 503 naming the roles that are down", run)
        assert seen_down[-1]["database"] == "unavailable"
        servers.restart("postgres")

        def ready_again() -> bool:
            r = get(f"{base}/readyz")
            return r is not None and r.status_code == 200

        wait_for(ready_again, "/readyz back to 200", run)
        after = create()
        wait_for(ready(after), "a task created after the restart to be ready", run)
        assert run.poll() is None
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=30) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    messages = [line["msg"] for line in lines]
    assert "role paused by an outage" in messages
    assert "role recovered from an outage" in messages
    assert "role loop failed; restarting" not in messages, [
        line for line in lines if line["msg"] == "role loop failed; restarting"
    ]
