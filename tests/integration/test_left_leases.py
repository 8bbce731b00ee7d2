"""Leases given back once the database is back (:mod:`aivedio.db.leases`): the inbox processor
and the poller end the leases of the rows an outage interrupted, fenced by each row's token, so
those rows are claimed at once instead of when their lease runs out. (The media worker and the
submitter: ``test_media`` and ``test_submitter``.)"""

from __future__ import annotations

import uuid

from aivedio.db.leases import LeftLeases
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.polling.claimed import POLLED_STATUSES
from tests.integration.helpers import make_project, make_task, store

MINE, THEIRS = uuid.uuid4(), uuid.uuid4()


async def test_inbox_rows_are_claimable_at_once_and_a_taken_over_one_is_left_alone(
    db: Database,
) -> None:
    async with db.connection() as conn:
        ids = [
            await conn.fetchval(
                """INSERT INTO provider_callback_inbox (provider, dedup_key, payload_hash,
                                                        lease_until, lease_token)
                   VALUES ('sandbox', $1, '\\x00', now() + interval '10 minutes', $2)
                   RETURNING id""",
                key,
                token,
            )
            for key, token in (("interrupted", MINE), ("taken-over", THEIRS))
        ]
    left = LeftLeases("inbox_end_leases")
    left.add(ids[0], MINE)
    left.add(ids[1], MINE)  # its lease is another processor's now: the token fences it
    assert await left.give_back(db) == 2
    assert len(left) == 0
    async with db.connection() as conn:
        claimed = await conn.fetch(q("inbox_claim"), 10, 60.0, uuid.uuid4())
    assert [r["id"] for r in claimed] == [ids[0]]


async def test_polls_are_due_at_once_and_a_taken_over_one_is_left_alone(db: Database) -> None:
    project = await make_project(db)
    attempts = [(await make_task(store(db), project))[1] for _ in range(2)]
    async with db.connection() as conn:
        for attempt, token in zip(attempts, (MINE, THEIRS), strict=True):
            await conn.execute(
                """UPDATE task_attempts SET provider_task_id = $2, next_poll_at = now(),
                          poll_lease_until = now() + interval '10 minutes', poll_lease_token = $3
                   WHERE id = $1""",
                attempt,
                f"gen_{token.hex[:8]}",
                token,
            )
    left = LeftLeases("poll_end_leases")
    for attempt in attempts:
        left.add(attempt, MINE)
    await left.give_back(db)
    async with db.connection() as conn:
        claimed = await conn.fetch(q("poll_claim"), list(POLLED_STATUSES), 10, 10, 30.0, [])
    assert [r["id"] for r in claimed] == [attempts[0]]
