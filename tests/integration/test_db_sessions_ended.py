"""A session the server ended while the connection sat idle: unavailable, discarded, never reused.

When PostgreSQL goes away (a restart, a killed postmaster) each backend sends FATAL 57P01 and
closes. The ErrorResponse can reach asyncpg a moment before the close, while the connection is
idle in the pool: its protocol then sits in an error state, and the next statement on it fails
with ``InternalClientError: cannot switch to state 15; another operation (2) is in progress``.
That error escaped the ``DatabaseUnavailable`` translation and stopped the outbox relay (and with
it the whole process) in the field. The proxy here makes that moment last: it delivers the FATAL
to every open connection and then passes nothing more on them, with the sockets left open.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import asyncpg
import pytest

from aivedio.config import DatabaseConfig
from aivedio.db.pool import Database
from aivedio.errors import DatabaseUnavailable
from aivedio.process.health import Health, LoopHealth, LoopState
from aivedio.process.restart import RestartPolicy
from aivedio.process.supervisor import supervise
from aivedio.propagation.relay import OutboxRelay, RelayConfig
from tests.integration.helpers import make_project, make_task, store
from tests.integration.propagation import outbox_counts, private_bus
from tests.integration.test_api_database_down import via
from tests.proxy import TcpProxy
from tests.waiting import eventually as wait_until


def fatal(
    code: str = "57P01", message: str = "terminating connection due to administrator command"
) -> bytes:
    """A backend's FATAL ErrorResponse, as PostgreSQL sends it before it closes a session."""
    fields = b"".join(
        kind + value.encode() + b"\0"
        for kind, value in ((b"S", "FATAL"), (b"V", "FATAL"), (b"C", code), (b"M", message))
    )
    body = fields + b"\0"
    return b"E" + struct.pack("!i", len(body) + 4) + body


@pytest.fixture
async def proxy(database_url: str) -> AsyncIterator[TcpProxy]:
    target = urlsplit(database_url)
    started = TcpProxy(target.hostname or "127.0.0.1", target.port or 5432)
    await started.start()
    yield started
    await started.cut()


@pytest.fixture
async def proxied(database_url: str, proxy: TcpProxy) -> AsyncIterator[Database]:
    db = await Database.connect(
        DatabaseConfig(
            url=via(database_url, proxy.port),
            min_size=3,
            max_size=3,
            acquire_timeout_s=2.0,
            command_timeout_s=2.0,
        )
    )
    yield db
    await db.close()


async def hold_all(db: Database, count: int) -> None:
    """Make the pool open ``count`` connections (all in use at once, then all idle)."""
    entered = asyncio.Barrier(count + 1)

    async def one() -> None:
        async with db.connection() as conn:
            await conn.fetchval("SELECT 1")
            await entered.wait()

    jobs = [asyncio.create_task(one()) for _ in range(count)]
    await entered.wait()
    await asyncio.gather(*jobs)


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT 1",  # an extended-protocol statement (prepare: state 11)
        "BEGIN; SET LOCAL synchronous_commit = off; COMMIT",  # a simple query (state 15)
    ],
)
async def test_each_ended_session_fails_once_as_unavailable_then_is_replaced(
    proxied: Database, proxy: TcpProxy, statement: str
) -> None:
    await hold_all(proxied, 3)
    assert await proxy.say_and_go_silent(fatal()) == 3
    await asyncio.sleep(0.05)  # let asyncpg read the FATAL: every idle connection is now broken

    causes: list[type[BaseException]] = []
    for _ in range(3):  # each broken connection fails once, as DatabaseUnavailable
        with pytest.raises(DatabaseUnavailable) as raised:
            async with proxied.connection() as conn:
                await conn.execute(statement)
        assert raised.value.__cause__ is not None
        causes.append(type(raised.value.__cause__))
    assert asyncpg.exceptions.InternalClientError in causes, causes
    # Discarded, not given back: the pool opens new connections, which work.
    for _ in range(6):
        async with proxied.connection() as conn:
            assert await conn.fetchval("SELECT 2") == 2


async def test_a_transaction_on_an_ended_session_is_unavailable(
    proxied: Database, proxy: TcpProxy
) -> None:
    await hold_all(proxied, 3)
    await proxy.say_and_go_silent(fatal())
    await asyncio.sleep(0.05)
    failures = 0
    while True:
        try:
            async with proxied.transaction() as conn:
                await conn.execute("SELECT 1")
            break
        except DatabaseUnavailable:
            failures += 1
            assert failures <= 3, "a broken connection was handed out twice"
    assert failures >= 1


async def test_a_kept_connection_of_acquire_is_discarded(
    proxied: Database, proxy: TcpProxy
) -> None:
    conn = await proxied.acquire()
    underlying = conn._con  # type: ignore[attr-defined]  # the pool's proxy hides it after release
    await proxy.say_and_go_silent(fatal())
    await asyncio.sleep(0.05)
    with pytest.raises(asyncpg.exceptions.InternalClientError):
        await conn.fetchval("SELECT 1")
    await proxied.discard(conn)
    assert underlying.is_closed()
    await answers_again(proxied, broken=2)  # the pool's two other connections heard it too


async def answers_again(db: Database, broken: int) -> None:
    """Each of the ``broken`` idle connections fails once (unavailable); then it answers."""
    for _ in range(broken):
        try:
            async with db.connection() as conn:
                await conn.fetchval("SELECT 1")
        except DatabaseUnavailable:
            continue
    async with db.connection() as conn:
        assert await conn.fetchval("SELECT 3") == 3


async def test_the_relay_and_its_listen_connection_ride_out_ended_sessions(
    database_url: str,
    proxied: Database,
    proxy: TcpProxy,
    nats_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The field failure: the relay's pooled connections and its LISTEN connection all hear the
    FATAL. The relay reports an outage, is never restarted, and publishes what comes next."""
    direct = await Database.connect(DatabaseConfig(url=database_url, min_size=1, max_size=2))
    unit = Health().unit("relay", "relay")
    stopping = asyncio.Event()
    never = RestartPolicy(first_s=3600.0, cap_s=3600.0)  # a restart would stall the test
    try:
        project = await make_project(direct)
        async with private_bus(nats_url) as bus:
            relay = OutboxRelay(proxied, bus, RelayConfig(poll_interval_s=0.2))
            job = asyncio.create_task(supervise(unit, relay.run, stopping, never))
            try:
                await make_task(store(direct), project)
                await wait_until(lambda: _published(direct, 1), what="the first event")
                await wait_until(lambda: _listening(relay), what="the relay asleep on LISTEN")

                with caplog.at_level(logging.INFO, logger="aivedio.process"):
                    assert await proxy.say_and_go_silent(fatal()) >= 2  # pool + listener
                    await make_task(store(direct), project)
                    await wait_until(lambda: _published(direct, 2), what="the event after it")
                    await wait_until(lambda: _running(unit), what="the relay running again")
                messages = [r.getMessage() for r in caplog.records]
                assert "role paused by an outage" in messages
                assert "role recovered from an outage" in messages
                assert unit.restarts == 0 and not job.done()
            finally:
                stopping.set()
                await asyncio.wait_for(job, 20)
    finally:
        await direct.close()


async def _published(db: Database, n: int) -> bool:
    return (await outbox_counts(db)).get("published", 0) >= n


async def _listening(relay: OutboxRelay) -> bool:
    listener = relay.idle._listener
    return listener is not None and not listener.is_closed()


async def _running(unit: LoopHealth) -> bool:
    return unit.state is LoopState.RUNNING
