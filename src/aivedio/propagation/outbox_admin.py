"""Dead outbox rows for operators: ``aivedio outbox dead-letters`` and ``aivedio outbox replay ID``.

A row becomes ``dead`` when the broker *rejected* it ``max_rejections`` times (an outage never
kills a row; see :mod:`aivedio.propagation.relay`). It then no longer blocks its task's later
events. Replaying it puts it back to ``pending`` with a fresh try budget: the relay publishes it
on its next round (it is its task's oldest pending row, so it goes first and holds back any
newer pending row of that task until it is acked). Consumers see it *after* the task's later
versions: the dispatcher drops it as stale (the browser already has the newer state, or repairs
the gap from PostgreSQL), media and billing act on it by business key, once.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from aivedio.db.pool import Database

__all__ = ["dead_letters_command", "list_dead_letters", "replay", "replay_command"]

PAYLOAD_PREVIEW = 2000  # characters of a dead row's payload shown in a listing

DEAD_LETTERS = """
SELECT id, aggregate_type, aggregate_id, aggregate_version, event_type, retry_count,
       created_at, next_retry_at AS last_failed_at, payload::text AS payload
FROM outbox_events
WHERE publish_status = 'dead'
ORDER BY id DESC
LIMIT $1
"""

# next_retry_at of a dead row is when its last rejection was handled plus a backoff; a replayed
# row is due at once. A row that is not dead (pending, published, or replayed by someone else
# already) is left alone.
REPLAY = """
UPDATE outbox_events
SET publish_status = 'pending', retry_count = 0, next_retry_at = NULL
WHERE id = $1 AND publish_status = 'dead'
RETURNING id
"""


def _as_dict(row: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, datetime):
            value = value.isoformat()
        elif key == "aggregate_id":
            value = str(value)
        out[key] = value
    payload = out.pop("payload")
    out["payload"] = payload[:PAYLOAD_PREVIEW]
    out["truncated"] = len(payload) > PAYLOAD_PREVIEW
    return out


async def list_dead_letters(db: Database, limit: int = 50) -> list[dict[str, Any]]:
    """The newest ``limit`` dead outbox rows as JSON-ready dicts (id, aggregate, version, event
    type, tries, created_at, last_failed_at, payload preview)."""
    async with db.connection() as conn:
        rows = await conn.fetch(DEAD_LETTERS, limit)
    return [_as_dict(r) for r in rows]


async def replay(db: Database, outbox_id: int) -> bool:
    """Put one dead row back to ``pending`` (due now, fresh try budget). False when there is no
    such row or it is not dead."""
    async with db.connection() as conn:
        return await conn.fetchval(REPLAY, outbox_id) is not None


async def dead_letters_command(db: Database, limit: int = 50) -> int:
    """Print one JSON line per dead row, then ``{"count": ...}``."""
    rows = await list_dead_letters(db, limit)
    for row in rows:
        print(json.dumps(row), flush=True)
    print(json.dumps({"count": len(rows)}), flush=True)
    return 0


async def replay_command(db: Database, outbox_id: int) -> int:
    """Replay one dead row; print ``{"id": ..., "requeued": ...}``; 1 if it was not dead."""
    ok = await replay(db, outbox_id)
    print(json.dumps({"id": outbox_id, "requeued": ok}), flush=True)
    return 0 if ok else 1
