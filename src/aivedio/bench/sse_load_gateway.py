"""The gateway under test of the SSE load (``bench connections``, ``bench fanout``): its process,
with RSS and CPU time, and ``gateway_under_test`` (scratch database, project, API key, Redis
channel and key prefix; all removed afterwards, also on failure)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
import redis.asyncio as aioredis

from aivedio.admin import create_project_in
from aivedio.bench.common import database_url, scratch_database
from aivedio.config import Settings
from aivedio.propagation.dispatcher import broadcast_channel
from aivedio.runtime import resolve_urls

FDS_PER_PROCESS = 19_000  # open files are capped at 20,000 per process; keep some headroom
TICKS = os.sysconf("SC_CLK_TCK")


def raise_open_files() -> int:
    """RLIMIT_NOFILE soft limit up to the hard limit; returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


# -- the gateway process ---------------------------------------------------------------------


class GatewayProcess:
    """``python -m aivedio.bench.gateway_server`` with its port, pid, RSS and CPU time."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc = proc
        self.port = port
        self.pid = proc.pid

    @classmethod
    async def start(
        cls,
        database_url: str,
        redis_url: str,
        channel: str,
        key_prefix: str,
        heartbeat_s: float,
        loop: str = "asyncio",
        timeout_s: float = 30.0,
    ) -> GatewayProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "aivedio.bench.gateway_server",
            "--database-url",
            database_url,
            "--redis-url",
            redis_url,
            "--channel",
            channel,
            "--key-prefix",
            key_prefix,
            "--heartbeat-s",
            str(heartbeat_s),
            "--loop",
            loop,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
            if not line:
                raise RuntimeError(f"the gateway process exited ({await proc.wait()})")
            ready = json.loads(line)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        return cls(proc, int(ready["port"]))

    def rss_kib(self) -> int:
        with open(f"/proc/{self.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def cpu_s(self) -> float:
        with open(f"/proc/{self.pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime

    async def wait_idle(
        self, below_pct: float = 5.0, window_s: float = 0.5, timeout_s: float = 120.0
    ) -> float:
        """Wait until the process uses less than ``below_pct`` of a core over ``window_s`` (its
        backlog is written); returns the seconds waited."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            cpu = self.cpu_s()
            await asyncio.sleep(window_s)
            if (self.cpu_s() - cpu) / window_s * 100 < below_pct:
                break
        return time.monotonic() - started

    def open_files(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    async def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()


@dataclass(frozen=True, slots=True)
class Target:
    """The gateway under test, as the bench driver sees it."""

    database_url: str
    redis_url: str
    channel: str
    project_id: uuid.UUID
    tenant_id: uuid.UUID
    user_id: uuid.UUID
    api_key: str
    gateway: GatewayProcess


@contextlib.asynccontextmanager
async def gateway_under_test(
    settings: Settings, heartbeat_s: float, loop: str = "asyncio"
) -> AsyncIterator[Target]:
    urls = resolve_urls(settings)
    tag = uuid.uuid4().hex[:10]
    channel = broadcast_channel(f"bench{tag}")
    key_prefix = f"bench{tag}:gw"
    async with scratch_database(database_url(settings)) as url:
        conn = await asyncpg.connect(url)
        try:
            made = await create_project_in(conn, "bench", "sse")
        finally:
            await conn.close()
        gateway = await GatewayProcess.start(
            url, urls.redis_url, channel, key_prefix, heartbeat_s, loop
        )
        try:
            yield Target(
                url,
                urls.redis_url,
                channel,
                uuid.UUID(made["project_id"]),
                uuid.UUID(made["tenant_id"]),
                uuid.UUID(made["user_id"]),
                made["api_key"],
                gateway,
            )
        finally:
            await gateway.stop()
            await _delete_keys(urls.redis_url, f"{key_prefix}:*")


async def _delete_keys(redis_url: str, pattern: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        keys = [key async for key in client.scan_iter(match=pattern, count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()
