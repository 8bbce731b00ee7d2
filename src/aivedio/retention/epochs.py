"""``aivedio admin bump-epoch``: a new epoch for some streams or all of them.

After a restore from a backup (or a stream that lost events) the seqs a client saw may be
handed out again with other events. A new epoch makes every cursor issued before it a cursor of
another epoch: the gateway answers ``event: reset`` and the client re-reads its snapshot instead
of skipping or repeating events (docs/how-to/backup-and-restore.md).
"""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg

from aivedio.db.queries import q


async def bump_epoch(
    conn: asyncpg.Connection, projects: list[uuid.UUID] | None
) -> list[dict[str, Any]]:
    """New epochs for ``projects`` (``None``: every stream); the streams as they are now."""
    rows = await conn.fetch(q("bump_epoch"), projects)
    return [
        {"project_id": str(r["project_id"]), "epoch": r["epoch"], "head": r["head"]} for r in rows
    ]
