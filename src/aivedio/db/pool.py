"""The asyncpg pool and the translation of driver errors at this edge."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import asyncpg

from aivedio.config import DatabaseConfig
from aivedio.errors import DatabaseUnavailable

# Errors that mean "the database is not there right now": the caller answers 503 / retries.
#
# InternalClientError is asyncpg's word for a connection whose protocol state is broken. When the
# server ends a session (a restart, a killed postmaster: FATAL 57P01 / "unexpected postmaster
# exit"), the ErrorResponse can arrive while the connection is idle in the pool, a moment before
# the socket closes; the protocol then sits in its error state and the next statement on that
# connection fails with "cannot switch to state 15; another operation (2) is in progress" (an
# InternalClientError, which is neither an InterfaceError nor a PostgresError). That error used
# to escape every translation below and stop the outbox relay, and with it the whole process.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncio.TimeoutError,
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.InsufficientResourcesError,
    asyncpg.exceptions.CannotConnectNowError,
)


def unavailable(exc: BaseException) -> DatabaseUnavailable:
    """The translation of a driver error of ``UNAVAILABLE_ERRORS`` (raise it ``from exc``)."""
    return DatabaseUnavailable(f"PostgreSQL unavailable: {type(exc).__name__}")


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")
    await conn.set_type_codec("json", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Release without asyncpg's reset query (RESET ALL, UNLISTEN *, advisory unlock): one
    round trip less per transaction (-27 % CPU per applied observation, measured by
    ``aivedio bench transitions``). asyncpg still rolls back an open transaction on release.

    The rule that makes it safe: pooled connections never change session state. Session
    settings, LISTEN and session-level advisory locks use a connection of their own.
    """


async def create_pool(config: DatabaseConfig) -> asyncpg.Pool:
    """Open the pool; raises ``DatabaseUnavailable`` when the server cannot be reached."""
    try:
        pool = await asyncpg.create_pool(
            config.url,
            min_size=config.min_size,
            max_size=config.max_size,
            command_timeout=config.command_timeout_s,
            timeout=config.acquire_timeout_s,
            init=_init_connection,
            reset=_keep_session,
        )
    except UNAVAILABLE_ERRORS as exc:
        raise DatabaseUnavailable(f"cannot connect to PostgreSQL: {type(exc).__name__}") from exc
    assert pool is not None
    return pool


class Database:
    """A pool plus the acquire timeout; every caller goes through ``connection()``.

    The rule at this edge: a driver error that means the database is away (``UNAVAILABLE_ERRORS``)
    leaves as :class:`DatabaseUnavailable`, and the connection it happened on is discarded, never
    handed to the next caller (its session or its protocol state may be gone).
    """

    def __init__(self, pool: asyncpg.Pool, config: DatabaseConfig) -> None:
        self.pool = pool
        self.config = config

    @classmethod
    async def connect(cls, config: DatabaseConfig) -> Database:
        return cls(await create_pool(config), config)

    async def close(self) -> None:
        """Close every connection gracefully, within ``command_timeout_s``; then terminate what
        is left (a server that went silent never answers the goodbye)."""
        try:
            await asyncio.wait_for(self.pool.close(), self.config.command_timeout_s)
        except TimeoutError:
            self.pool.terminate()

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection; unavailability becomes ``DatabaseUnavailable``, and a connection
        that failed so is terminated before it goes back to the pool."""
        conn = await self.acquire()
        try:
            yield conn
        except UNAVAILABLE_ERRORS as exc:
            await self.discard(conn)
            raise unavailable(exc) from exc
        except DatabaseUnavailable:
            await self.discard(conn)
            raise
        except BaseException:
            await self.release(conn)
            raise
        await self.release(conn)

    async def acquire(self) -> asyncpg.Connection:
        """A pooled connection to keep across several statements; give it back with
        :meth:`release` (or :meth:`discard` once it failed). For a hot loop where
        ``connection()`` per statement costs too much."""
        try:
            conn = await self.pool.acquire(timeout=self.config.acquire_timeout_s)
        except UNAVAILABLE_ERRORS as exc:
            raise unavailable(exc) from exc
        return cast(asyncpg.Connection, conn)

    async def release(self, conn: asyncpg.Connection) -> None:
        """Give back a connection of :meth:`acquire` (a closed one is replaced by the pool). Never
        raises but for cancellation: a connection the pool cannot reset is terminated."""
        try:
            await self.pool.release(cast(Any, conn), timeout=self.config.acquire_timeout_s)
        except Exception:  # the pool terminated it already when its reset failed
            _terminate(conn)

    async def discard(self, conn: asyncpg.Connection) -> None:
        """Give back a connection of :meth:`acquire` that failed: it is terminated, and the pool
        opens a new one when it next needs one."""
        _terminate(conn)
        await self.release(conn)

    async def session(self) -> asyncpg.Connection:
        """A connection of its own, outside the pool, for session state (LISTEN, session
        settings, session advisory locks); the caller closes it. Same codecs and timeouts as
        the pool's; unavailability becomes ``DatabaseUnavailable``."""
        cfg = self.config
        try:
            conn = await asyncpg.connect(
                cfg.url, timeout=cfg.acquire_timeout_s, command_timeout=cfg.command_timeout_s
            )
        except UNAVAILABLE_ERRORS as exc:
            raise DatabaseUnavailable(
                f"cannot connect to PostgreSQL: {type(exc).__name__}"
            ) from exc
        try:
            await _init_connection(conn)
        except BaseException as exc:
            conn.terminate()
            if isinstance(exc, UNAVAILABLE_ERRORS):
                raise unavailable(exc) from exc
            raise
        return conn

    @asynccontextmanager
    async def transaction(
        self, isolation: str = "read_committed", readonly: bool = False
    ) -> AsyncIterator[asyncpg.Connection]:
        async with (
            self.connection() as conn,
            conn.transaction(
                isolation=isolation,  # type: ignore[arg-type]
                readonly=readonly,
            ),
        ):
            yield conn


def _terminate(conn: asyncpg.Connection) -> None:
    with contextlib.suppress(Exception):  # already released or closed: nothing left to end
        conn.terminate()


def record_dict(record: asyncpg.Record | None) -> dict[str, Any] | None:
    return dict(record.items()) if record is not None else None
