"""A running API for the contract tests: ``aivedio run --role api --role callbacks --role
gateway`` as a process of its own, on a database of its own, with two tenants' projects, a task
and an asset of the first one."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.conftest import with_database
from tests.waiting import eventually_sync

BODY = {"provider": "sandbox", "model": "m1", "prompt": "a cat on a skateboard", "params": {}}


@dataclass(frozen=True)
class Tenant:
    tenant_id: str
    project_id: str
    api_key: str

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


@dataclass(frozen=True)
class ApiServer:
    base: str
    database_url: str
    owner: Tenant  # its project has a task and an asset
    other: Tenant  # another tenant
    task_id: str
    asset_id: str
    log: Path

    def url(self, path: str) -> str:
        return self.base + path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sql(url: str, sql: str, *args: Any) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(sql, *args)
        finally:
            await conn.close()

    asyncio.run(run())


def _cli(env: dict[str, str], *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "aivedio", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _tenant(env: dict[str, str], name: str) -> Tenant:
    made = _cli(env, "admin", "create-project", "--tenant", name, "--project", "web")
    return Tenant(str(made["tenant_id"]), str(made["project_id"]), str(made["api_key"]))


def _wait_ready(base: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    def ready() -> bool:
        assert proc.poll() is None, "the server exited"
        return httpx.get(base + "/readyz", timeout=1).status_code == 200

    try:
        eventually_sync(ready, "/readyz", timeout=60, interval=0.2, ignoring=(httpx.HTTPError,))
    except AssertionError as exc:
        raise AssertionError(f"{exc}; its log:\n{log.read_text()[-4000:]}") from None


def _seed(server_db: str, base: str, owner: Tenant) -> tuple[str, str]:
    """A task of the owner's project (through the API) and an asset row for it."""
    created = httpx.post(
        f"{base}/v1/projects/{owner.project_id}/tasks",
        json=BODY,
        headers=owner.auth | {"Idempotency-Key": "seed-1"},
    )
    assert created.status_code == 202, created.text
    task_id = created.json()["task"]["id"]
    asset_id = str(uuid.uuid4())
    _sql(
        server_db,
        "INSERT INTO assets (id, task_id, attempt_id, project_id, tenant_id, storage_key,"
        " content_type, size_bytes, codec)"
        " SELECT $1, t.id, t.current_attempt_id, t.project_id, t.tenant_id, 'missing.mp4',"
        " 'video/mp4', 0, 'h264' FROM generation_tasks t WHERE t.id = $2",
        uuid.UUID(asset_id),
        uuid.UUID(task_id),
    )
    return task_id, asset_id


@pytest.fixture(scope="module")
def api_server(
    admin_database_url: str,
    template_database: str,
    redis_url: str,
    nats_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ApiServer]:
    name = f"aivedio_api_{uuid.uuid4().hex[:12]}"
    _sql(admin_database_url, f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"')
    database_url = with_database(admin_database_url, name)
    workdir = tmp_path_factory.mktemp("api-server")
    env = os.environ | {
        "AIVEDIO_DATABASE_URL": database_url,
        "AIVEDIO_REDIS_URL": redis_url,
        "AIVEDIO_NATS_URL": nats_url,
        "AIVEDIO_DATA_DIR": str(workdir / "data"),
        "AIVEDIO_LOG_LEVEL": "WARNING",
    }
    owner, other = _tenant(env, "owner"), _tenant(env, "other")
    port = free_port()
    log = workdir / "server.log"
    args = ["run", "--role", "api", "--role", "callbacks", "--role", "gateway", "--port", str(port)]
    with log.open("ab") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aivedio", *args], env=env, stdout=sink, stderr=subprocess.STDOUT
        )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, proc, log)
        task_id, asset_id = _seed(database_url, base, owner)
        yield ApiServer(base, database_url, owner, other, task_id, asset_id, log)
        assert proc.poll() is None, f"the server died:\n{log.read_text()[-4000:]}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        _sql(admin_database_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def build_request(
    server: ApiServer,
    path: str,
    method: str,
    op: dict[str, Any],
    project_id: str | None = None,
    headers: dict[str, str] | None = None,
) -> httpx.Request:
    """The documented operation with every required input and no credential (unless
    ``headers`` bring one): the owner's project (or ``project_id``), task and asset."""
    project = project_id or server.owner.project_id
    values = {"project_id": project, "task_id": server.task_id, "asset_id": server.asset_id}
    url = server.url(path.format(**{k: v for k, v in values.items() if "{" + k in path}))
    sent = {"Origin": server.base}  # a browser's own origin (the WebSocket checks it first)
    for param in op.get("parameters", []):
        if param["in"] == "header" and param["required"]:
            sent[param["name"]] = {
                "Idempotency-Key": uuid.uuid4().hex,
                "Upgrade": "websocket",
                "Sec-WebSocket-Key": base64.b64encode(b"0123456789abcdef").decode(),
            }[param["name"]]
    if "Upgrade" in sent:
        sent |= {"Connection": "Upgrade", "Sec-WebSocket-Version": "13"}
    body: dict[str, Any] | None = None
    if "requestBody" in op:
        body = BODY if path.endswith("/tasks") else {"project_id": project}
    return httpx.Request(method.upper(), url, headers=sent | (headers or {}), json=body)
