"""Group commit into provider_callback_inbox on real PostgreSQL: one INSERT per batch, per-row
outcomes (new / duplicate / error), batch failure fails every waiter, drain on close, retention."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

import pytest

from aivedio.config import DatabaseConfig
from aivedio.db.pool import Database
from aivedio.errors import DatabaseUnavailable
from aivedio.ingest import group_commit
from aivedio.ingest.group_commit import BATCH_SIZE, GroupCommitConfig, InboxWriter
from aivedio.ingest.inbox_batch import expire_processed_payloads
from aivedio.ingest.inbox_row import InboxClosed, InboxError, InboxFull, InboxRow, Outcome
from tests.integration.test_api_database_down import via
from tests.proxy import TcpProxy
from tests.waiting import eventually


def row(key: str, provider: str = "sandbox", payload: object = None) -> InboxRow:
    body = json.dumps(payload if payload is not None else {"k": key})
    return InboxRow(
        provider=provider,
        dedup_key=key,
        payload_hash=hashlib.sha256(body.encode()).digest(),
        payload_json=body,
        received_at=datetime.now(UTC),
        provider_event_id=key,
        provider_task_id="gen_1",
        event_type="generation.updated",
        signature_key_version="v1",
        trace_id="trc_test",
    )


async def count_rows(db: Database) -> int:
    async with db.connection() as conn:
        return int(await conn.fetchval("SELECT count(*) FROM provider_callback_inbox"))


def batches_observed() -> float:
    for metric in BATCH_SIZE.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count"):
                return sample.value
    return 0.0


async def test_one_batch_gives_each_row_its_own_outcome(db: Database) -> None:
    async with db.connection() as conn:
        await conn.execute(
            """INSERT INTO provider_callback_inbox (provider, dedup_key, payload_hash)
               VALUES ('sandbox', 'stored-before', '\\x00')"""
        )
    # A long linger and a big batch: every submit below lands in the same batch.
    writer = InboxWriter(db, GroupCommitConfig(linger_s=0.2, max_batch=100))
    writer.start()
    before = batches_observed()
    try:
        outcomes = await asyncio.gather(
            writer.submit(row("a")),
            writer.submit(row("b")),
            writer.submit(row("a")),  # the same key twice inside one batch
            writer.submit(row("stored-before")),  # already committed earlier
            writer.submit(row("a", provider="other")),  # same key, other provider: new
        )
    finally:
        await writer.close()
    assert batches_observed() == before + 1
    assert list(outcomes) == [
        Outcome.NEW,
        Outcome.NEW,
        Outcome.DUPLICATE,
        Outcome.DUPLICATE,
        Outcome.NEW,
    ]
    async with db.connection() as conn:
        stored = await conn.fetch(
            "SELECT provider, dedup_key, payload, event_type, payload_authenticated"
            " FROM provider_callback_inbox ORDER BY id"
        )
    assert [(r["provider"], r["dedup_key"]) for r in stored] == [
        ("sandbox", "stored-before"),
        ("other", "a"),
        ("sandbox", "a"),
        ("sandbox", "b"),
    ]  # inserted in (provider, dedup_key) order: concurrent batches cannot deadlock
    assert stored[2]["payload"] == {"k": "a"}
    assert stored[2]["event_type"] == "generation.updated"
    assert stored[2]["payload_authenticated"] is True


async def test_a_refused_row_fails_alone_and_the_rest_of_its_batch_commits(db: Database) -> None:
    writer = InboxWriter(db, GroupCommitConfig(linger_s=0.2))
    writer.start()
    bad = row("bad")
    poisoned = replace(bad, payload_json='{"x": "\\u0000"}')  # jsonb refuses the escape
    try:
        results = await asyncio.gather(
            writer.submit(row("ok-1")),
            writer.submit(poisoned),
            writer.submit(row("ok-2")),
            return_exceptions=True,
        )
    finally:
        await writer.close()
    assert results[0] == Outcome.NEW
    assert isinstance(results[1], InboxError)
    assert results[2] == Outcome.NEW
    assert await count_rows(db) == 2


async def test_enqueue_calls_done_once_after_the_commit(db: Database) -> None:
    """The lean HTTP path's entry: ``done`` runs after the batch committed (the row is visible
    from another connection by then), once per row, with the row's own outcome."""
    writer = InboxWriter(db, GroupCommitConfig(linger_s=0.1, max_batch=100))
    writer.start()
    seen: list[tuple[str, Outcome | BaseException, int]] = []
    visible: list[asyncio.Task[int]] = []
    finished = asyncio.Event()

    def done_for(key: str) -> Callable[[Outcome | BaseException], None]:
        def done(outcome: Outcome | BaseException) -> None:
            seen.append((key, outcome, len(seen)))
            visible.append(asyncio.ensure_future(count_rows(db)))
            if len(seen) == 3:
                finished.set()

        return done

    try:
        writer.enqueue(row("e1"), done_for("e1"))
        writer.enqueue(row("e2"), done_for("e2"))
        writer.enqueue(row("e1"), done_for("e1-again"))
        assert seen == []  # nothing is told before the commit
        await asyncio.wait_for(finished.wait(), 10)
        await asyncio.sleep(0.05)
    finally:
        await writer.close()
    outcomes = {key: outcome for key, outcome, _ in seen}
    assert outcomes == {"e1": Outcome.NEW, "e2": Outcome.NEW, "e1-again": Outcome.DUPLICATE}
    assert len(seen) == 3  # exactly once each
    assert [await task for task in visible] == [2, 2, 2]  # committed before anyone was told


async def test_a_receiver_that_raises_does_not_fail_the_rest_of_its_batch(db: Database) -> None:
    writer = InboxWriter(db, GroupCommitConfig(linger_s=0.1, max_batch=100))
    writer.start()
    told: list[Outcome | BaseException] = []

    def broken(outcome: Outcome | BaseException) -> None:
        raise RuntimeError("a bug in the receiver")

    try:
        writer.enqueue(row("r1"), broken)
        writer.enqueue(row("r2"), told.append)
        assert await writer.submit(row("r3")) == Outcome.NEW
    finally:
        await writer.close()
    assert told == [Outcome.NEW]  # told once, not failed again for the other's bug
    assert await count_rows(db) == 3


async def test_enqueue_refuses_at_once_when_closed_or_full(db: Database) -> None:
    writer = InboxWriter(db, GroupCommitConfig(max_queue=1, linger_s=0.2, max_batch=100))
    told: list[Outcome | BaseException] = []
    with pytest.raises(InboxClosed):  # not started
        writer.enqueue(row("x"), told.append)
    writer.start()
    with pytest.raises(InboxError):  # text PostgreSQL cannot store: refused alone
        writer.enqueue(row("nul\x00"), told.append)
    writer.enqueue(row("y"), told.append)
    with pytest.raises(InboxFull):
        writer.enqueue(row("z"), told.append)
    await writer.close()
    assert told == [Outcome.NEW]
    with pytest.raises(InboxClosed):
        writer.enqueue(row("late"), told.append)


async def test_unencodable_text_is_refused_before_it_reaches_a_batch(db: Database) -> None:
    writer = InboxWriter(db)
    writer.start()
    try:
        with pytest.raises(InboxError):
            await writer.submit(row("nul\x00key"))
        assert await writer.submit(row("fine")) == Outcome.NEW
    finally:
        await writer.close()


async def test_a_batch_that_loses_the_database_fails_every_waiter(
    database_url: str, db: Database
) -> None:
    target = urlsplit(database_url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 5432)
    await proxy.start()
    cut_db = await Database.connect(
        DatabaseConfig(url=via(database_url, proxy.port), min_size=1, max_size=2,
                       acquire_timeout_s=1.0)
    )  # fmt: skip
    writer = InboxWriter(cut_db, GroupCommitConfig(linger_s=0.3))
    writer.start()
    try:
        assert await writer.submit(row("before")) == Outcome.NEW
        pending = [asyncio.create_task(writer.submit(row(f"k{i}"))) for i in range(20)]
        await asyncio.sleep(0.05)  # queued, lingering
        await proxy.cut()
        results = await asyncio.gather(*pending, return_exceptions=True)
        assert all(isinstance(r, DatabaseUnavailable) for r in results), results
        # the writer survives the outage: once the database is back, rows commit again
        await proxy.start()

        async def recovered() -> bool:
            assert await writer.submit(row("after")) in (Outcome.NEW, Outcome.DUPLICATE)
            return True

        await eventually(
            recovered, "the writer to recover", 5, interval=0.1, ignoring=(DatabaseUnavailable,)
        )
    finally:
        await writer.close()
        await proxy.cut()
        await cut_db.close()
    async with db.connection() as conn:
        keys = {
            r["dedup_key"]
            for r in await conn.fetch("SELECT dedup_key FROM provider_callback_inbox")
        }
    assert keys == {"before", "after"}  # fmt: skip


async def test_full_queue_fails_fast_and_close_drains_what_is_queued(db: Database) -> None:
    writer = InboxWriter(db, GroupCommitConfig(max_queue=5, linger_s=0.2, max_batch=100))
    writer.start()
    queued = [asyncio.create_task(writer.submit(row(f"q{i}"))) for i in range(5)]
    await asyncio.sleep(0)  # all five are in the queue
    with pytest.raises(InboxFull):
        await writer.submit(row("one-too-many"))
    await writer.close()  # commits the five before it returns
    assert [t.result() for t in queued] == [Outcome.NEW] * 5
    assert await count_rows(db) == 5
    with pytest.raises(InboxClosed):
        await writer.submit(row("late"))


async def test_many_concurrent_submitters_are_grouped(db: Database) -> None:
    writer = InboxWriter(db, GroupCommitConfig(max_batch=64))
    writer.start()
    before = batches_observed()
    try:
        outcomes = await asyncio.gather(*(writer.submit(row(f"c{i % 300}")) for i in range(600)))
    finally:
        await writer.close()
    assert outcomes.count(Outcome.NEW) == 300
    assert outcomes.count(Outcome.DUPLICATE) == 300
    assert await count_rows(db) == 300
    assert batches_observed() - before < 600 / 8  # far fewer statements than rows


async def test_expire_processed_payloads_keeps_rows_and_drops_old_payloads(db: Database) -> None:
    now = datetime.now(UTC)
    async with db.connection() as conn:
        for key, status, processed_at in [
            ("old-processed", "processed", now - timedelta(days=10)),
            ("new-processed", "processed", now - timedelta(hours=1)),
            ("old-dead", "dead", now - timedelta(days=10)),
            ("pending", "pending", None),
        ]:
            await conn.execute(
                """INSERT INTO provider_callback_inbox
                   (provider, dedup_key, payload_hash, payload, process_status, processed_at)
                   VALUES ('sandbox', $1, '\\x00', '{"a": 1}', $2, $3)""",
                key,
                status,
                processed_at,
            )
    assert await expire_processed_payloads(db, timedelta(days=7)) == 1
    assert await expire_processed_payloads(db, timedelta(days=7)) == 0  # idempotent
    async with db.connection() as conn:
        rows = {
            r["dedup_key"]: r["payload"]
            for r in await conn.fetch("SELECT dedup_key, payload FROM provider_callback_inbox")
        }
    assert rows == {
        "old-processed": None,
        "new-processed": {"a": 1},
        "old-dead": {"a": 1},
        "pending": {"a": 1},
    }


async def test_a_batch_stuck_on_a_lock_does_not_hold_up_the_next_one(db: Database) -> None:
    """max_inflight=2: while one batch waits (here on a row another transaction is inserting),
    the next batch commits and its callers get their answers."""
    writer = InboxWriter(db, GroupCommitConfig(max_inflight=2, linger_s=0.01))
    writer.start()
    async with db.connection() as blocker:
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute(
            """INSERT INTO provider_callback_inbox (provider, dedup_key, payload_hash)
               VALUES ('sandbox', 'locked', '\\x00')"""
        )
        try:
            stuck = asyncio.create_task(writer.submit(row("locked")))
            await asyncio.sleep(0.2)  # its batch is in flight, waiting on the unique index
            assert not stuck.done()
            assert await asyncio.wait_for(writer.submit(row("free")), 5) is Outcome.NEW
            assert not stuck.done()
        finally:
            await tx.commit()
        assert await asyncio.wait_for(stuck, 5) is Outcome.DUPLICATE  # the blocker's row won
    await writer.close()
    assert await count_rows(db) == 2


async def test_a_slot_keeps_its_connection_while_busy_and_gives_it_back_when_idle(
    database_config: DatabaseConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(group_commit, "_HOLD_IDLE_S", 0.3)
    one = await Database.connect(replace(database_config, min_size=1, max_size=1))
    writer = InboxWriter(one, GroupCommitConfig(max_inflight=1))
    writer.start()
    try:
        assert await writer.submit(row("h1")) == Outcome.NEW
        backend = await held_backend(writer)
        assert await writer.submit(row("h2")) == Outcome.NEW
        assert await held_backend(writer) == backend  # the same session, not acquired again
        assert one.pool.get_idle_size() == 0
        async with asyncio.timeout(5):  # idle: back in the pool, usable by anyone
            async with one.connection() as conn:
                assert await conn.fetchval("SELECT pg_backend_pid()") == backend
    finally:
        await writer.close()
        await one.close()


async def test_a_held_connection_that_died_is_replaced_and_the_batch_commits(
    db: Database,
) -> None:
    writer = InboxWriter(db, GroupCommitConfig(max_inflight=1))
    writer.start()
    try:
        assert await writer.submit(row("d1")) == Outcome.NEW
        backend = await held_backend(writer)
        async with db.connection() as conn:  # as a server restart would end it
            assert await conn.fetchval("SELECT pg_terminate_backend($1)", backend)
        assert await writer.submit(row("d2")) == Outcome.NEW  # once more, on a new session
        assert await held_backend(writer) != backend
    finally:
        await writer.close()
    assert await count_rows(db) == 2


async def held_backend(writer: InboxWriter) -> int:
    """The backend pid of the connection the writer's slot holds now."""
    conns = [held.conn for held in writer._held if held.conn is not None]
    assert len(conns) == 1
    return int(conns[0].get_server_pid())
