"""A duplicate older than the dedup window: its key is gone, it is stored again, and it changes
no task and writes no event (terminal absorption, sequence checks)."""

from __future__ import annotations

from aivedio.retention.config import RetentionConfig
from aivedio.retention.maintenance import Maintenance
from tests.integration.test_inbox_processor import Env, drain, env, generation

__all__ = ["env"]


async def test_a_very_old_duplicate_changes_nothing(env: Env) -> None:
    task_id, _, _ = await env.task(provider_task_id="gen_old")
    await env.post_sandbox(generation("gen_old", "running", 2), msg_id="msg_old_2")
    await env.post_sandbox(
        generation("gen_old", "failed", 3, error={"code": "x", "message": "m"}), msg_id="msg_old_3"
    )
    assert await drain(env.processor()) == 2
    assert await env.status(task_id) == "failed"

    async def facts() -> tuple[object, ...]:
        async with env.db.connection() as conn:
            task = await conn.fetchrow(
                "SELECT status, version, last_event_id, updated_at FROM generation_tasks"
                " WHERE id = $1",
                task_id,
            )
            events = await conn.fetchval("SELECT count(*) FROM task_events")
            outbox = await conn.fetchval("SELECT count(*) FROM outbox_events")
            head = await conn.fetchval("SELECT head FROM event_streams")
        return tuple(task.values()), events, outbox, head

    before = await facts()
    async with env.db.connection() as conn:  # eight days pass
        await conn.execute(
            "UPDATE provider_callback_inbox SET received_at = received_at - interval '8 days'"
        )
    result = await Maintenance(env.db, RetentionConfig()).run_once()
    assert result.inbox_deleted == 2
    assert await env.inbox() == []

    # The provider replays both, long after the window: stored again as new callbacks...
    assert (
        await env.post_sandbox(generation("gen_old", "running", 2), msg_id="msg_old_2")
    ).status_code == 204
    assert (
        await env.post_sandbox(
            generation("gen_old", "failed", 3, error={"code": "x", "message": "m"}),
            msg_id="msg_old_3",
        )
    ).status_code == 204
    assert await drain(env.processor()) == 2
    assert [r["process_status"] for r in await env.inbox()] == ["processed", "processed"]
    # ... and absorbed: no task change, no event, no outbox row, the same head.
    assert await facts() == before
