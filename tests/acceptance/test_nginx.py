"""The shipped nginx configuration (docs/deploy/nginx/aivedio.conf) with Debian's nginx in front of
real aivedio processes: SSE frames pass one by one, resume by Last-Event-ID works through it,
WebSocket upgrades, and a killed upstream is survived by reconnecting."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from aivedio.client import Client
from tests.acceptance.test_cli import aivedio, free_port, wait_ready
from tests.waiting import eventually, eventually_sync

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "docs" / "deploy" / "nginx" / "aivedio.conf"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


@dataclass
class Stack:
    base: str  # nginx
    project: dict[str, Any]
    upstreams: list[subprocess.Popen[str]]

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.project['api_key']}"}

    def create_task(self, n: int) -> str:
        r = httpx.post(
            f"{self.base}/v1/projects/{self.project['project_id']}/tasks",
            headers=self.auth | {"Idempotency-Key": f"nginx-{n}-{time.monotonic_ns()}"},
            json={"provider": "sandbox", "model": "m", "prompt": f"p{n}", "params": {}},
            timeout=10,
        )
        assert r.status_code == 202, r.text
        return str(r.json()["task"]["id"])

    def cursor(self) -> str:
        r = httpx.get(
            f"{self.base}/v1/projects/{self.project['project_id']}/tasks",
            headers=self.auth,
            timeout=10,
        )
        return str(r.json()["cursor"])


def nginx_config(folder: Path, port: int, upstreams: list[int], backup: bool) -> Path:
    """The shipped file with our ports, wrapped in a main config that lives in ``folder``."""
    site = SHIPPED.read_text()
    servers = [f"    server 127.0.0.1:{upstreams[0]} max_fails=1 fail_timeout=2s;"]
    servers += [
        f"    server 127.0.0.1:{p} max_fails=1 fail_timeout=2s{' backup' if backup else ''};"
        for p in upstreams[1:]
    ]
    site, count = re.subn(r"(?m)^    server 127\.0\.0\.1:\d+ [^\n]*\n", "", site)
    assert count == 2, "the shipped upstream block changed: update this test"
    site = site.replace("    keepalive 64;", "\n".join(servers) + "\n    keepalive 64;", 1)
    site = site.replace("listen 8080;", f"listen 127.0.0.1:{port};", 1)
    (folder / "aivedio.conf").write_text(site)
    temp = {name: folder / name for name in ("body", "proxy", "fastcgi", "uwsgi", "scgi")}
    main = f"""
worker_processes 1;
daemon off;
pid {folder}/nginx.pid;
error_log {folder}/error.log info;
events {{ worker_connections 512; }}
http {{
    access_log off;
    client_body_temp_path {temp["body"]};
    proxy_temp_path {temp["proxy"]};
    fastcgi_temp_path {temp["fastcgi"]};
    uwsgi_temp_path {temp["uwsgi"]};
    scgi_temp_path {temp["scgi"]};
    include {folder}/aivedio.conf;
}}
"""
    path = folder / "nginx.conf"
    path.write_text(main)
    return path


def wait_port(port: int, proc: subprocess.Popen[Any]) -> None:
    def listening() -> bool:
        assert proc.poll() is None, f"exited with {proc.returncode}"
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    eventually_sync(listening, f"a listener on {port}", timeout=20, interval=0.1)


@pytest.fixture
def stack_factory(
    database_url: str, redis_url: str, nats_url: str, tmp_path: Path
) -> Iterator[Any]:
    procs: list[subprocess.Popen[Any]] = []
    env = os.environ | {
        "AIVEDIO_DATABASE_URL": database_url,
        "AIVEDIO_REDIS_URL": redis_url,
        "AIVEDIO_NATS_URL": nats_url,
        "AIVEDIO_DATA_DIR": str(tmp_path / "data"),
        "AIVEDIO_GATEWAY_TAILCHECK_S": "1",
    }

    def start(backup: bool) -> Stack:
        def run(roles: str, port: int) -> subprocess.Popen[str]:
            with (tmp_path / f"{port}.log").open("w") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "aivedio", "run", "--role", roles, "--port", str(port)],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                    text=True,
                )
            procs.append(proc)
            wait_ready(f"http://127.0.0.1:{port}/readyz", proc)
            return proc

        run("relay,dispatcher,api", free_port())  # the events' way to the gateways
        ports = [free_port(), free_port()]
        upstreams = [run("api,callbacks,gateway", p) for p in ports]
        folder = tmp_path / "nginx"
        folder.mkdir()
        port = free_port()
        conf = nginx_config(folder, port, ports, backup)
        with (folder / "stderr.log").open("w") as log:
            nginx = subprocess.Popen(
                [NGINX, "-p", str(folder), "-c", str(conf)],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        procs.append(nginx)
        wait_port(port, nginx)
        project = aivedio(env, "admin", "create-project", "--tenant", "t", "--project", "p")
        return Stack(f"http://127.0.0.1:{port}", project, upstreams)

    yield start
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_sse_frames_pass_one_by_one_and_resume_by_last_event_id(stack_factory: Any) -> None:
    stack = stack_factory(backup=False)
    start = stack.cursor()
    url = f"{stack.base}/v1/projects/{stack.project['project_id']}/events"
    seen: list[tuple[str, str]] = []  # (cursor, task id)
    with httpx.stream(
        "GET",
        url,
        headers=stack.auth | {"Last-Event-ID": start},
        timeout=httpx.Timeout(10, read=15),
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        for n in range(4):
            # One task at a time: the next is created only once this one's frame came through,
            # which a buffering proxy would hold back (the read would time out).
            task_id = stack.create_task(n)
            frame_id = None
            for line in lines:
                if line.startswith("id: "):
                    frame_id = line[4:]
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    assert data["task_id"] == task_id
                    assert frame_id is not None
                    seen.append((frame_id, task_id))
                    break
    assert len({t for _, t in seen}) == 4
    # resume from the second frame's id: exactly the last two, through nginx
    resumed: list[str] = []
    with httpx.stream(
        "GET", url, headers=stack.auth | {"Last-Event-ID": seen[1][0]}, timeout=15
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                resumed.append(json.loads(line[6:])["task_id"])
                if len(resumed) == 2:
                    break
    assert resumed == [seen[2][1], seen[3][1]]


def test_websocket_upgrades_through_nginx(stack_factory: Any) -> None:
    stack = stack_factory(backup=False)

    async def scenario() -> list[str]:
        client = Client(
            stack.base,
            stack.project["api_key"],
            stack.project["project_id"],
            transport="ws",
            origin=stack.base,
        )
        try:
            await client.snapshot()
            got: list[str] = []

            async def read() -> None:
                # closed here, not left to the loop's finalizer (an unclosed stream otherwise)
                async with contextlib.aclosing(client.events()) as frames:
                    async for frame in frames:
                        if frame.event == "task.status":
                            got.append(str(frame.data["task_id"]))
                            if len(got) == 2:
                                return

            reader = asyncio.create_task(read())
            await asyncio.sleep(0)
            created = [await asyncio.to_thread(stack.create_task, n) for n in range(2)]
            await asyncio.wait_for(reader, 30)
            assert got == created
            return got
        finally:
            await client.aclose()

    assert len(asyncio.run(scenario())) == 2


def test_a_killed_upstream_is_survived_by_reconnecting(stack_factory: Any) -> None:
    """The first upstream serves while it lives (the second is nginx's backup); SIGKILL it: the
    client reconnects through nginx to the second with its cursor and misses nothing."""
    stack = stack_factory(backup=True)

    async def scenario() -> None:
        client = Client(
            stack.base, stack.project["api_key"], stack.project["project_id"], backoff_max_s=1
        )
        try:
            await client.snapshot()
            start = client.view.last_seq
            got: list[str] = []
            wanted = 6

            async def read() -> None:
                # Closed here: a generator left open at the break is finalized by asyncio.run's
                # shutdown in a task that is destroyed pending, and its stream's socket is
                # reported unclosed (ResourceWarning, an error under -W error): a flaky failure.
                async with contextlib.aclosing(client.events()) as frames:
                    async for frame in frames:
                        if frame.event == "task.status":
                            got.append(str(frame.data["task_id"]))
                            if len(got) == wanted:
                                return

            reader = asyncio.create_task(read())
            created = []
            for n in range(3):
                created.append(await asyncio.to_thread(stack.create_task, n))
            await eventually(lambda: len(got) >= 3, "three task.status frames", 30, interval=0.05)
            stack.upstreams[0].send_signal(signal.SIGKILL)
            stack.upstreams[0].wait()
            for n in range(3, wanted):
                created.append(await asyncio.to_thread(stack.create_task, n))
            await asyncio.wait_for(reader, 60)
            assert got == created
            seqs = [f.seq for f in client.frames if f.event == "task.status"]
            assert seqs == list(range(start + 1, start + wanted + 1))  # no gap, no duplicate
            assert client.connects == 2
        finally:
            await client.aclose()

    asyncio.run(scenario())
