"""``aivedio cluster`` as an operator runs it: supervised processes, restarts, a NATS cluster."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from tests.acceptance.test_cli import aivedio, free_port
from tests.waiting import eventually

DEADLINE_S = 60.0
INTERVAL_S = 0.2
# "Not yet" while processes start or restart: a port that refuses, a state file not yet written
# or naming the process not yet.
NOT_YET = (httpx.HTTPError, OSError, KeyError, StopIteration, ValueError)


async def wait_until(check: Callable[[], Any], what: str) -> Any:
    return await eventually(check, what, timeout=DEADLINE_S, interval=INTERVAL_S, ignoring=NOT_YET)


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


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


@pytest.fixture
async def start_cluster(database_url: str, redis_url: str, tmp_path: Path) -> AsyncIterator[Any]:
    running: list[RunningCluster] = []

    async def start(*args: str, nats_url: str | None) -> RunningCluster:
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
        line = await asyncio.to_thread(proc.stdout.readline)
        assert line, proc.stderr.read() if proc.stderr else "no output"
        cluster = RunningCluster(proc, json.loads(line), env)
        running.append(cluster)
        async with httpx.AsyncClient(timeout=1) as client:

            async def ready() -> bool:
                return (await client.get(f"{cluster.info['api']}/readyz")).status_code == 200

            await wait_until(ready, "/readyz")
        return cluster

    yield start
    for cluster in running:
        if cluster.proc.poll() is None:
            cluster.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(cluster.proc.wait, 60)
            except subprocess.TimeoutExpired:
                cluster.proc.kill()
                await asyncio.to_thread(cluster.proc.wait)
        for stream in (cluster.proc.stdout, cluster.proc.stderr):
            if stream is not None:
                stream.close()


async def create_project(cluster: RunningCluster) -> dict[str, Any]:
    args = ("admin", "create-project", "--tenant", "t", "--project", "p")
    return await asyncio.to_thread(aivedio, cluster.env, *args)


async def task_reaches_ready(cluster: RunningCluster, project: dict[str, Any]) -> None:
    base = cluster.info["api"]
    headers = {"Authorization": f"Bearer {project['api_key']}"}
    async with httpx.AsyncClient(headers=headers, timeout=10) as client:
        created = await client.post(
            f"{base}/v1/projects/{project['project_id']}/tasks",
            headers={"Idempotency-Key": uuid.uuid4().hex},
            json={
                "provider": "sandbox",
                "model": "m",
                "prompt": "p",
                "params": {"sandbox": {"duration_s": 0.3, "steps": 2}},
            },
        )
        assert created.status_code == 202, created.text
        task = created.json()["task"]
        url = f"{base}/v1/projects/{project['project_id']}/tasks/{task['id']}"

        async def ready() -> bool:
            status: str = (await client.get(url, timeout=5)).json()["task"]["status"]
            return status == "ready"

        await wait_until(ready, f"task {task['id']} ready")


async def test_cluster_restarts_a_killed_process_and_stops_everything_on_sigterm(
    start_cluster: Any, nats_url: str
) -> None:
    cluster = await start_cluster("--replicas", "2", "--sandbox", nats_url=nats_url)
    names = [p["name"] for p in cluster.info["processes"]]
    assert names == ["all-1", "all-2", "sandbox"]
    project = await create_project(cluster)
    await task_reaches_ready(cluster, project)

    victim = cluster.member("all-1")
    os.kill(victim["pid"], signal.SIGKILL)
    restarted = await wait_until(
        lambda: (m := cluster.member("all-1"))["restarts"] == 1 and m["pid"] and m,
        "all-1 restarted",
    )
    assert restarted["pid"] != victim["pid"]
    await task_reaches_ready(cluster, project)

    pids = cluster.pids()
    cluster.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(cluster.proc.wait, 60) == 0
    assert [pid for pid in pids if alive(pid)] == []


async def test_a_three_node_nats_cluster_loses_nothing_when_a_node_dies(
    start_cluster: Any,
) -> None:
    cluster = await start_cluster(
        "--replicas", "1", "--nats-cluster", "3", "--sandbox", nats_url=None
    )
    assert len(cluster.info["nats_nodes"]) == 3
    assert cluster.info["nats_url"] == ",".join(cluster.info["nats_nodes"])
    project = await create_project(cluster)
    await task_reaches_ready(cluster, project)
    assert await stream_replicas(cluster.info["nats_url"]) == 3

    node = cluster.member("nats-n1")
    os.kill(node["pid"], signal.SIGKILL)
    await task_reaches_ready(cluster, project)  # while the node is down or coming back
    await wait_until(lambda: cluster.member("nats-n1")["restarts"] == 1, "nats-n1 restarted")
    await task_reaches_ready(cluster, project)


async def stream_replicas(url: str) -> int:
    nc = await nats.connect(servers=url.split(","))
    try:
        info = await nc.jetstream().stream_info(os.environ.get("AIVEDIO_BUS_STREAM", "AIVEDIO"))
        return int(info.config.num_replicas or 0)
    finally:
        await nc.close()
