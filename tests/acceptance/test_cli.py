"""The operator contract through the real ``aivedio`` command, as separate processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.waiting import eventually_sync


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
    def ready() -> bool:
        assert proc.poll() is None, f"exited with {proc.returncode}"
        return httpx.get(url, timeout=1).status_code == 200

    eventually_sync(ready, f"{url} ready", timeout=30, interval=0.2, ignoring=(httpx.HTTPError,))


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


def test_run_reuse_port_shares_one_port_between_processes(
    env: dict[str, str], started: list[subprocess.Popen[str]]
) -> None:
    """``--reuse-port`` (or AIVEDIO_REUSE_PORT=1): a second process serves the same port instead
    of failing; a process without it still fails to bind there."""
    port = free_port()
    base = [sys.executable, "-m", "aivedio", "run", "--role", "api", "--port", str(port)]
    for command, extra in (([*base, "--reuse-port"], {}), (base, {"AIVEDIO_REUSE_PORT": "1"})):
        proc = subprocess.Popen(
            command, env=env | extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        started.append(proc)
        wait_ready(f"http://127.0.0.1:{port}/readyz", proc)
    time.sleep(0.5)  # the second one is bound and serving too, not exiting
    assert all(p.poll() is None for p in started)
    plain = subprocess.run(base, env=env, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 2  # a configuration error, after a clean stop of its roles
    assert f"configuration error: cannot serve HTTP on 127.0.0.1:{port}" in plain.stderr
    assert "Traceback" not in plain.stderr
    for proc in started:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aivedio", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_operator_commands_answer_in_json_lines(env: dict[str, str]) -> None:
    dead = run_cli(env, "inbox", "dead-letters")
    assert dead.returncode == 0
    assert json.loads(dead.stdout.splitlines()[-1]) == {"count": 0}
    assert run_cli(env, "reconcile", "list", "--state", "all").stdout == ""
    missing = run_cli(env, "tasks", "resubmit", str(uuid.uuid4()), "--reason", "test")
    assert missing.returncode == 1
    assert json.loads(missing.stdout.splitlines()[-1])["error"] == "NotFound"
    replay = run_cli(env, "inbox", "replay", "123456")
    assert replay.returncode == 1
    assert json.loads(replay.stdout.splitlines()[-1]) == {"id": 123456, "requeued": False}
    rounds = run_cli(env, "admin", "maintenance")
    assert rounds.returncode == 0, rounds.stderr
    assert json.loads(rounds.stdout.splitlines()[-1])["skipped"] is False
    nobody = run_cli(env, "admin", "bump-epoch", "--project", str(uuid.uuid4()))
    assert nobody.returncode == 1
    assert json.loads(nobody.stdout.splitlines()[-1]) == {"bumped": 0}
    assert run_cli(env, "admin", "bump-epoch").returncode == 2  # --project ID or --all


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


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("AIVEDIO_CALLBACK_MAX_INFLIGHT", "0"),
        ("AIVEDIO_PORT", "eighty"),
        ("AIVEDIO_CALLBACK_DEDUP_WINDOW", "48h"),  # shorter than a provider's retries
        ("AIVEDIO_EVENT_RETENTION", "6h"),  # less than one day partition
    ],
)
def test_a_bad_setting_is_named_without_a_traceback(
    env: dict[str, str], variable: str, value: str
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "aivedio", "run", "--role", "callbacks"],
        env=env | {variable: value},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert f"configuration error: {variable}:" in out.stderr
    assert "Traceback" not in out.stderr and value not in out.stderr


def read_events_until_ready(url: str, headers: dict[str, str], task_id: list[str]) -> list[dict]:
    """Read the project's SSE stream until the task (id filled in by the caller) is ready."""
    seen: list[dict] = []
    with httpx.stream("GET", url, headers=headers, timeout=httpx.Timeout(5, read=60)) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                seen.append(event)
                if task_id and event["task_id"] == task_id[0] and event["status"] == "ready":
                    return seen
    raise AssertionError("the stream ended before the task was ready")


@pytest.mark.parametrize("fanout", ["broadcast", "node"])
def test_demo_runs_a_task_from_create_to_ready_on_the_stream(
    env: dict[str, str], started: list[subprocess.Popen[str]], tmp_path: Path, fanout: str
) -> None:
    """The whole chain in the demo process: API -> submitter -> sandbox provider -> webhook ->
    inbox -> state -> outbox -> JetStream -> dispatcher -> Redis -> SSE, media and billing; with
    the dispatcher broadcasting, and with node-directed fan-out (AIVEDIO_FANOUT=node)."""
    import threading

    port, sandbox_port = free_port(), free_port()
    demo_env = env | {
        "AIVEDIO_PORT": str(port),
        "AIVEDIO_SANDBOX_URL": f"http://127.0.0.1:{sandbox_port}",
        "AIVEDIO_FANOUT": fanout,
    }
    log_path = tmp_path / "demo.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aivedio", "demo"],
            env=demo_env,
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
        )
    started.append(proc)
    assert proc.stdout is not None
    first = json.loads(proc.stdout.readline())
    base = f"http://127.0.0.1:{port}"
    wait_ready(f"{base}/readyz", proc)
    wait_ready(f"http://127.0.0.1:{sandbox_port}/healthz", proc)
    headers = {"Authorization": f"Bearer {first['api_key']}"}
    project = first["project_id"]

    # subscribe first (seed 004), then create
    task_id: list[str] = []
    events: list[dict] = []
    reader = threading.Thread(
        target=lambda: events.extend(
            read_events_until_ready(f"{base}/v1/projects/{project}/events", headers, task_id)
        ),
        daemon=True,
    )
    reader.start()
    time.sleep(1)
    r = httpx.post(
        f"{base}/v1/projects/{project}/tasks",
        headers=headers | {"Idempotency-Key": "demo-1"},
        json={
            "provider": "sandbox",
            "model": "m",
            "prompt": "p",
            "params": {"sandbox": {"duration_s": 0.5, "steps": 2}},
        },
    )
    assert r.status_code == 202
    task_id.append(r.json()["task"]["id"])
    reader.join(timeout=60)
    snapshot = httpx.get(f"{base}/v1/projects/{project}/tasks/{task_id[0]}", headers=headers)
    assert not reader.is_alive(), f"no ready event within 60 s: {events} {snapshot.text}"
    mine = [e for e in events if e["task_id"] == task_id[0]]
    versions = [e["task_version"] for e in mine]
    assert versions == sorted(set(versions))
    assert mine[-1]["status"] == "ready"
    assert mine[-1]["asset_id"] is not None
    snapshot = httpx.get(f"{base}/v1/projects/{project}/tasks/{task_id[0]}", headers=headers)
    task = snapshot.json()["task"]
    assert task["status"] == "ready"
    # the playback path re-checks the caller, then hands out a short-lived link to a real file
    link = httpx.get(base + task["asset"]["playback_url"], headers=headers).json()
    video = httpx.get(link["url"])
    assert video.status_code == 200
    assert video.content[4:8] == b"ftyp"  # an MP4
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    # the run fetched a signed output link and took webhooks: none of it reaches the logs
    logs = log_path.read_text()
    assert "media operation created" in logs
    assert "sig=" not in logs
    assert "token=" not in logs
    assert first["api_key"] not in logs
    assert link["url"].split("?")[1] not in logs
