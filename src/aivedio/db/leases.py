"""Leases a worker gives back once the database is back, instead of letting them run out.

Every leased queue here (inbox rows, submit intents, poll leases, media operations) survives a
worker that dies: its lease runs out and another claim takes the row. A worker that is alive but
lost the database in the middle of a run is a different case: it knows its run is over and
wrote nothing, but the lease it holds would keep the row from everyone, itself included, for the
rest of its length (a minute or two) after the database is back. So it notes the lease here and
its next round, the first one the database answers, ends those leases at once: the row is then
claimed exactly as if its lease had run out (the same path, just without the wait). Ending is
fenced by the lease token, so a lease another worker took over meanwhile is left alone.
"""

from __future__ import annotations

import uuid
from typing import Any

from aivedio.db.pool import Database
from aivedio.db.queries import q


class LeftLeases:
    """The leases of runs the database interrupted; ``sql`` (a named query) ends them, taking
    ``$1`` the row ids and ``$2`` their lease tokens, one array each."""

    def __init__(self, query: str) -> None:
        self._sql = q(query)
        self._left: dict[Any, uuid.UUID] = {}

    def __len__(self) -> int:
        return len(self._left)

    def add(self, row_id: Any, token: uuid.UUID) -> None:
        self._left[row_id] = token

    async def give_back(self, db: Database) -> int:
        """End the noted leases; how many there were. Raises ``DatabaseUnavailable`` (keeping
        them noted) while the database is still away."""
        if not self._left:
            return 0
        left = dict(self._left)
        async with db.connection() as conn:
            await conn.execute(self._sql, list(left), list(left.values()))
        for row_id, token in left.items():
            if self._left.get(row_id) == token:
                del self._left[row_id]
        return len(left)
