"""``bench e2e``: the deployment under test, started as the README tells users to run it, and
the CPU of every process read from ``/proc``.

- ``run_bus``: the run's own stream and subject prefix (``AIVEDIO_BUS_STREAM``,
  ``AIVEDIO_BUS_SUBJECT_PREFIX``), on a NATS server of the run's own (the embedded
  ``nats-server`` in a temporary data directory, so that NATS's CPU is the run's alone), or with
  ``bus=configured`` on ``AIVEDIO_NATS_URL``, where the streams are deleted afterwards: the run
  neither leaves messages in another deployment's stream nor shares its durable groups. With
  ``bus_adapter=redis-streams`` (``AIVEDIO_BUS``) the bus is Redis Streams on
  ``AIVEDIO_REDIS_URL`` instead, its keys under the run's own prefix, deleted afterwards (no NATS
  is started).
- ``Deployment``: the sandbox provider (``aivedio sandbox-provider``) and the aivedio processes,
  ``aivedio run --role all --reuse-port`` once per core by default, or one process per role
  (``split``); each with its log in the run's directory.
- ``CpuMeter``: user + system CPU seconds per process group (the deployment, PostgreSQL's
  backends of the run's database, NATS, Redis/Valkey, the sandbox, the load generator, the SSE
  clients), between two snapshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import httpx
import redis.asyncio as aioredis

from aivedio.config import ServicesConfig
from aivedio.services import embedded
from aivedio.services.embedded import ServiceUrls

TICKS = os.sysconf("SC_CLK_TCK")
BACKGROUND_ROLES = (
    "inbox",
    "submitter",
    "poller",
    "relay",
    "dispatcher",
    "media",
    "billing",
    "reconciler",
)


@dataclass(frozen=True, slots=True)
class RunBus:
    url: str  # the NATS URL (unused by the Redis Streams adapter)
    stream: str
    subject_prefix: str
    adapter: str = "jetstream"  # AIVEDIO_BUS

    def env(self) -> dict[str, str]:
        return {
            "AIVEDIO_BUS": self.adapter,
            "AIVEDIO_NATS_URL": self.url,
            "AIVEDIO_BUS_STREAM": self.stream,
            "AIVEDIO_BUS_SUBJECT_PREFIX": self.subject_prefix,
        }


@contextlib.asynccontextmanager
async def run_bus(
    urls: ServiceUrls, data_dir: Path, private: bool, tag: str, adapter: str = "jetstream"
) -> AsyncIterator[RunBus]:
    """The run's bus: its own stream and prefix, on a private embedded NATS (stopped
    afterwards) or on the configured one (its streams deleted afterwards); with the
    ``redis-streams`` adapter, its own key prefix on the configured Redis (deleted afterwards)."""
    if adapter == "redis-streams":
        bus = RunBus(urls.nats_url, f"BENCH_E2E_{tag}", f"bench-e2e-{tag}", adapter)
        try:
            yield bus
        finally:
            await _delete_keys(urls.redis_url, bus.subject_prefix)
        return
    if not private:
        bus = RunBus(urls.nats_url, f"BENCH_E2E_{tag}", f"bench-e2e-{tag}")
        try:
            yield bus
        finally:
            await _delete_streams(bus)
        return
    cfg = ServicesConfig(
        data_dir=data_dir, database_url=urls.database_url, redis_url=urls.redis_url, nats_url=None
    )
    started = await asyncio.to_thread(embedded.up, cfg)
    try:
        yield RunBus(started.nats_url, f"BENCH_E2E_{tag}", f"bench-e2e-{tag}")
    finally:
        await asyncio.to_thread(embedded.down, cfg)


async def _delete_keys(redis_url: str, prefix: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        keys = [k async for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
        for start in range(0, len(keys), 1000):
            await client.delete(*keys[start : start + 1000])
    finally:
        await client.aclose()


async def _delete_streams(bus: RunBus) -> None:
    import nats
    import nats.js.errors

    nc = await nats.connect(bus.url)
    try:
        js = nc.jetstream()
        for name in (bus.stream, f"{bus.stream}_DLQ"):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await js.delete_stream(name)
    finally:
        await nc.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# -- CPU from /proc ----------------------------------------------------------------------------


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of ``pid`` (its threads included), in clock ticks; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def descendants(pids: Sequence[int]) -> list[int]:
    """``pids`` and every process below them."""
    parents: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                ppid = int(stat.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(name))
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(parents.get(pid, ()))
    return out


def listening_pid(url: str) -> int | None:
    """The local process listening on the URL's port (None for another host, or when /proc
    does not tell: another user's process without privileges)."""
    where = urlsplit(url)
    if where.hostname not in ("127.0.0.1", "localhost", "::1") or where.port is None:
        return None
    inodes: set[bytes] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table, "rb") as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                port = int(parts[1].rsplit(b":", 1)[1], 16)
                if port == where.port and parts[3] == b"0A":  # LISTEN
                    inodes.add(parts[9])
    if not inodes:
        return None
    wanted = {b"socket:[" + inode + b"]" for inode in inodes}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{name}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{name}/fd/{fd}").encode() in wanted:
                        return int(name)
    return None


async def backends(conn: asyncpg.Connection) -> list[tuple[int, int | None]]:
    """PostgreSQL processes working for this database (client backends, autovacuum) with their
    client's port, but for ``conn``'s own, when the server runs on this machine."""
    rows = await conn.fetch(
        "SELECT pid, client_port FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid()"
    )
    return [(r["pid"], r["client_port"]) for r in rows if b"postgres" in _cmdline(r["pid"])]


def socket_owners(groups: Mapping[str, Sequence[int]]) -> dict[int, str]:
    """Local TCP port -> the group whose process holds that socket (for attributing each
    PostgreSQL backend to the process it serves, by its ``client_port``)."""
    by_inode: dict[bytes, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table, "rb") as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                by_inode[b"socket:[" + parts[9] + b"]"] = int(parts[1].rsplit(b":", 1)[1], 16)
    owners: dict[int, str] = {}
    for name, pids in groups.items():
        for pid in pids:
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    with contextlib.suppress(OSError):
                        port = by_inode.get(os.readlink(f"/proc/{pid}/fd/{fd}").encode())
                        if port is not None:
                            owners[port] = name
    return owners


@dataclass
class CpuMeter:
    """Process groups (name -> pids); ``pg`` is asked for PostgreSQL's backends each time."""

    groups: dict[str, list[int]] = field(default_factory=dict)
    pg: asyncpg.Connection | None = None

    async def snapshot(self) -> dict[str, dict[int, int]]:
        """CPU ticks per pid per group; PostgreSQL's backends go to ``pg:<group>`` of the
        process they serve (by their client's port), the others to ``postgres``."""
        snap: dict[str, dict[int, int]] = {}
        for name, pids in self.groups.items():
            snap[name] = {p: t for p in pids if (t := cpu_ticks(p)) is not None}
        if self.pg is not None:
            snap["postgres"] = {}
            owners = socket_owners(self.groups)
            for pid, port in await backends(self.pg):
                ticks = cpu_ticks(pid)
                if ticks is not None:
                    owner = owners.get(port) if port is not None else None
                    snap.setdefault(f"pg:{owner}" if owner else "postgres", {})[pid] = ticks
        return snap

    @staticmethod
    def seconds(
        before: Mapping[str, Mapping[int, int]], after: Mapping[str, Mapping[int, int]]
    ) -> dict[str, float]:
        """CPU seconds per group between two snapshots (a process born meanwhile counts from
        zero; one that ended meanwhile is missing)."""
        out: dict[str, float] = {}
        for name, now in after.items():
            then = before.get(name, {})
            out[name] = sum(t - then.get(p, 0) for p, t in now.items()) / TICKS
        return out


# -- the deployment ----------------------------------------------------------------------------


@dataclass
class Deployment:
    """The sandbox provider and the aivedio processes of one run."""

    port: int
    sandbox_port: int
    env: dict[str, str]
    log_dir: Path
    procs: list[tuple[str, asyncio.subprocess.Process]] = field(default_factory=list)
    sandbox: asyncio.subprocess.Process | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pids(self) -> list[int]:
        return [p.pid for _, p in self.procs]

    def layout(self, processes: int, split: bool) -> list[list[str]]:
        """Role lists, one per process: ``all`` per core, or the HTTP roles per core and one
        process per background role."""
        if not split:
            return [["all"]] * processes
        return [["api", "callbacks", "gateway"]] * processes + [[r] for r in BACKGROUND_ROLES]

    async def _spawn(self, name: str, args: Sequence[str]) -> asyncio.subprocess.Process:
        log = (self.log_dir / f"{name}.log").open("wb")
        try:
            return await asyncio.create_subprocess_exec(
                sys.executable, "-m", "aivedio", *args,
                env=self.env, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
            )  # fmt: skip
        finally:
            log.close()

    async def start_sandbox(self) -> None:
        self.sandbox = await self._spawn(
            "sandbox", ["sandbox-provider", "--host", "127.0.0.1", "--port", str(self.sandbox_port)]
        )
        await wait_http(f"http://127.0.0.1:{self.sandbox_port}/healthz", self.sandbox, 60)

    async def start(self, processes: int, split: bool) -> None:
        for i, roles in enumerate(self.layout(processes, split)):
            name = f"aivedio-{i}-{'+'.join(roles)}"
            args = ["run", "--role", ",".join(roles), "--reuse-port", "--port", str(self.port)]
            self.procs.append((name, await self._spawn(name, args)))
        deadline = time.monotonic() + 120
        for name, proc in self.procs:
            log = self.log_dir / f"{name}.log"
            while b"roles running" not in log.read_bytes():
                if proc.returncode is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}); see {log}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} did not start; see {log}")
                await asyncio.sleep(0.1)
        await wait_http(f"{self.base}/readyz", self.procs[0][1], 60)

    def role_pids(self) -> dict[str, list[int]]:
        """The deployment's processes (and anything they started), by their role list."""
        return {name: descendants([proc.pid]) for name, proc in self.procs}

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after 20 s; the sandbox last."""
        everything = [p for _, p in self.procs] + ([self.sandbox] if self.sandbox else [])
        for proc in everything:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        for proc in everything:
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        self.procs = []
        self.sandbox = None


async def wait_http(url: str, proc: asyncio.subprocess.Process, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                raise RuntimeError(f"{url}: its process exited ({proc.returncode})")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url)).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:g} s")


async def create_tasks(
    base: str,
    projects: Sequence[tuple[str, str]],
    count: int,
    concurrency: int,
) -> tuple[list[str], int]:
    """``count`` tasks through the API (``POST /v1/projects/{id}/tasks``, an ``Idempotency-Key``
    each), round robin over ``projects`` ((project id, API key)); their generations hold still
    at the sandbox (``params.sandbox.hold``). Returns the task ids in creation order, and how
    many requests were sent again.

    As any client of the API should, a request is sent again with its key after a 429, a 5xx or
    a connection that failed before the answer: a keep-alive connection the server closed (its
    5 s idle timeout) just as the request was written to it gives a reset, and the key makes
    the second send return the task the first one may have created."""
    body = {"provider": "sandbox", "model": "bench-e2e", "prompt": "a bench of cats",
            "params": {"sandbox": {"hold": True}}}  # fmt: skip
    ids: list[str | None] = [None] * count
    resent = 0
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits, trust_env=False) as c:

        async def one(i: int) -> None:
            nonlocal resent
            project, key = projects[i % len(projects)]
            headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": f"e2e-{project}-{i}"}
            failure = ""
            async with sem:
                for attempt in range(5):
                    if attempt:
                        resent += 1
                        await asyncio.sleep(0.2 * 2 ** (attempt - 1))
                    url = f"/v1/projects/{project}/tasks"
                    try:
                        r = await c.post(url, json=body, headers=headers)
                    except httpx.TransportError as exc:
                        failure = repr(exc)
                        continue
                    if r.status_code == 202:
                        ids[i] = str(r.json()["task"]["id"])
                        return
                    if r.status_code < 500 and r.status_code != 429:
                        raise RuntimeError(f"task create: {r.status_code} {r.text[:200]}")
                    failure = str(r.status_code)
                raise RuntimeError(f"task create kept failing: {failure}")

        await asyncio.gather(*(one(i) for i in range(count)))
    return [i for i in ids if i is not None], resent


SUBMITTED = """
SELECT t.id::text AS task_id, t.project_id::text AS project_id, a.id::text AS attempt_id,
       a.client_request_id, a.provider_task_id
FROM generation_tasks t JOIN task_attempts a ON a.id = t.current_attempt_id
WHERE t.id = ANY($1::uuid[]) AND a.provider_task_id IS NOT NULL
"""


async def wait_submitted(
    conn: asyncpg.Connection, task_ids: Sequence[str], timeout_s: float
) -> dict[str, asyncpg.Record]:
    """Wait until the submitter has every task's generation; task id -> its attempt row."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = await conn.fetch(SUBMITTED, list(task_ids))
        if len(rows) == len(task_ids):
            return {r["task_id"]: r for r in rows}
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(rows)} of {len(task_ids)} tasks submitted")
        await asyncio.sleep(0.25)


async def chain_backlog(conn: asyncpg.Connection) -> tuple[int, int]:
    """Inbox rows not yet processed, outbox rows not yet published."""
    inbox = await conn.fetchval(
        "SELECT count(*) FROM provider_callback_inbox WHERE process_status <> 'processed'"
        " AND process_status <> 'dead'"
    )
    outbox = await conn.fetchval(
        "SELECT count(*) FROM outbox_events WHERE publish_status = 'pending'"
    )
    return int(inbox), int(outbox)


async def wait_polled(
    conn: asyncpg.Connection, task_ids: Sequence[str], timeout_s: float
) -> tuple[int, float]:
    """Wait until the poller has seen every task once (none is still ``submitted``: its first
    poll found the generation queued). Returns (tasks still submitted, seconds waited).

    Its first poll of a task is a state change (an event through the whole chain); later polls
    of a held generation change nothing. Starting the ramp after that wave keeps the poller's
    events out of the steps' figures."""
    started = time.monotonic()
    left = len(task_ids)
    while time.monotonic() - started < timeout_s:
        left = int(
            await conn.fetchval(
                "SELECT count(*) FROM generation_tasks WHERE id = ANY($1::uuid[])"
                " AND status = 'submitted'",
                list(task_ids),
            )
        )
        if left == 0:
            break
        await asyncio.sleep(0.5)
    return left, time.monotonic() - started
