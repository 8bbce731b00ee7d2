"""``aivedio cluster`` as an operator runs it: supervised processes, restarts, a NATS cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.acceptance.test_cli import aivedio, free_port

DEADLINE_S = 60.0


class RunningCluster:
    def __init__(self, proc: subprocess.Popen[str], info: dict[str, Any], env: dict[str, str]):
        self.proc = proc
        self.info = info
        self.env = env
        self.state_file = Path(info["data_dir"]) / "cluster" / "cluster.json"

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = json.loads(self.state_file.read_text())
        return state

    def member(self, name: str) -> dict[str, Any]:
        return next(p for p in self.state()["processes"] if p["name"] == name)

    def pids(self) -> list[int]:
        return [p["pid"] for p in self.state()["processes"] if p["pid"]]


def wait_until(check: Any, what: str, seconds: float = DEADLINE_S) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            value = check()
        except (httpx.HTTPError, OSError, KeyError, StopIteration, ValueError):
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


@pytest.fixture
def start_cluster(database_url: str, redis_url: str, tmp_path: Path) -> Iterator[Any]:
    running: list[RunningCluster] = []

    def start(*args: str, nats_url: str | None) -> RunningCluster:
        env = os.environ | {"AIVEDIO_DATABASE_URL": database_url, "AIVEDIO_REDIS_URL": redis_url}
        env.pop("AIVEDIO_NATS_URL", None)
        if nats_url is not None:
            env["AIVEDIO_NATS_URL"] = nats_url
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "aivedio", "cluster", "--port", str(port), *args],
            env=env | {"AIVEDIO_DATA_DIR": str(tmp_path / "data")},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else "no output"
        cluster = RunningCluster(proc, json.loads(line), env)
        running.append(cluster)
        wait_until(
            lambda: httpx.get(f"{cluster.info['api']}/readyz", timeout=1).status_code == 200,
            "/readyz",
        )
        return cluster

    yield start
    for cluster in running:
        if cluster.proc.poll() is None:
            cluster.proc.send_signal(signal.SIGTERM)
            try:
                cluster.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                cluster.proc.kill()
                cluster.proc.wait()
        for stream in (cluster.proc.stdout, cluster.proc.stderr):
            if stream is not None:
                stream.close()


def task_reaches_ready(cluster: RunningCluster, project: dict[str, Any]) -> None:
    base = cluster.info["api"]
    headers = {"Authorization": f"Bearer {project['api_key']}"}
    created = httpx.post(
        f"{base}/v1/projects/{project['project_id']}/tasks",
        headers=headers | {"Idempotency-Key": uuid.uuid4().hex},
        json={
            "provider": "sandbox",
            "model": "m",
            "prompt": "p",
            "params": {"sandbox": {"duration_s": 0.3, "steps": 2}},
        },
        timeout=10,
    )
    assert created.status_code == 202, created.text
    task = created.json()["task"]
    url = f"{base}/v1/projects/{project['project_id']}/tasks/{task['id']}"
    wait_until(
        lambda: httpx.get(url, headers=headers, timeout=5).json()["task"]["status"] == "ready",
        f"task {task['id']} ready",
    )


def test_cluster_restarts_a_killed_process_and_stops_everything_on_sigterm(
    start_cluster: Any, nats_url: str
) -> None:
    cluster = start_cluster("--replicas", "2", "--sandbox", nats_url=nats_url)
    names = [p["name"] for p in cluster.info["processes"]]
    assert names == ["all-1", "all-2", "sandbox"]
    project = aivedio(cluster.env, "admin", "create-project", "--tenant", "t", "--project", "p")
    task_reaches_ready(cluster, project)

    victim = cluster.member("all-1")
    os.kill(victim["pid"], signal.SIGKILL)
    restarted = wait_until(
        lambda: (m := cluster.member("all-1"))["restarts"] == 1 and m["pid"] and m,
        "all-1 restarted",
    )
    assert restarted["pid"] != victim["pid"]
    task_reaches_ready(cluster, project)

    pids = cluster.pids()
    cluster.proc.send_signal(signal.SIGTERM)
    assert cluster.proc.wait(timeout=60) == 0
    assert [pid for pid in pids if alive(pid)] == []


def test_a_three_node_nats_cluster_loses_nothing_when_a_node_dies(start_cluster: Any) -> None:
    cluster = start_cluster("--replicas", "1", "--nats-cluster", "3", "--sandbox", nats_url=None)
    assert len(cluster.info["nats_nodes"]) == 3
    assert cluster.info["nats_url"] == ",".join(cluster.info["nats_nodes"])
    project = aivedio(cluster.env, "admin", "create-project", "--tenant", "t", "--project", "p")
    task_reaches_ready(cluster, project)
    assert stream_replicas(cluster.info["nats_url"]) == 3

    node = cluster.member("nats-n1")
    os.kill(node["pid"], signal.SIGKILL)
    task_reaches_ready(cluster, project)  # while the node is down or coming back
    wait_until(lambda: cluster.member("nats-n1")["restarts"] == 1, "nats-n1 restarted")
    task_reaches_ready(cluster, project)


def stream_replicas(url: str) -> int:
    import asyncio

    import nats

    async def replicas() -> int:
        nc = await nats.connect(servers=url.split(","))
        try:
            info = await nc.jetstream().stream_info(os.environ.get("AIVEDIO_BUS_STREAM", "AIVEDIO"))
            return int(info.config.num_replicas or 0)
        finally:
            await nc.close()

    return asyncio.run(replicas())
