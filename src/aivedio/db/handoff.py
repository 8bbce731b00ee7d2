"""Rows stored already leased to a consumer of the same process, handed over in memory.

The callbacks' group commit and the inbox processor of one process (``aivedio run --role all``)
used to meet only in the table: the INSERT committed the callback, the processor's claim found
it with a scan, wrote a lease on it (a second row version and its index entries) and read it
back, one more round trip and one more turn of the processor's loop before the state machine saw
it. With a handoff the INSERT itself writes the processor's lease (``lease_token``,
``lease_until``) and, once committed, the writer puts the stored rows here; the processor takes
them from memory, with that token, as if its own claim had returned them.

Nothing about durability changes: a callback is answered only after its row committed, as
before. The lease is the safety net, as for a claimed row: if the process dies with rows still
here, or a consumer detaches before taking them, they become claimable by any processor when
their lease runs out (and the one that detaches gives its leases back at once,
:meth:`Handoff.detach`). The fence is the token: the processor's take of a row matches it, so a
row another processor took over after the lease ran out is never applied twice.

A producer leases rows only while a consumer is attached and keeping up: fewer than
``max_rows`` waiting, none for longer than ``max_wait_s``. A consumer that falls behind (a busy
event loop, an outage) sends new rows the table's way, where any processor's claim finds them.
The producer says so once they committed (:meth:`Handoff.stored_in_table`), and the consumer's
next round claims (:meth:`Handoff.claim_wanted`) instead of waiting for its next look at the
table: busy with handed rows, it looked only every ``poll_s`` (0.5 s), and in ``bench e2e``
with two ``--role all`` processes the rows that went to the table while it was behind made a
p99 of 500-540 ms at 500 webhooks/s.
The bound on the wait matters beyond latency: rows handed to one process are out of reach of
the others, so a process that lags would apply a task's callback after a later one that another
process already applied (measured: with an unbounded queue and one process seconds behind under
load, ``bench e2e`` saw a tenth of its progress events audited as stale instead of applied).
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from typing import Any

__all__ = ["HandedRow", "Handoff"]

HandedRow = dict[str, Any]
"""One stored row, with the columns the consumer's claim would have returned."""


class Handoff:
    """The in-memory queue between one producer role and one consumer role of a process."""

    def __init__(self, max_rows: int = 256, max_wait_s: float = 0.05) -> None:
        self.max_rows = max_rows
        self.max_wait_s = max_wait_s
        self._token: uuid.UUID | None = None
        self._lease_s = 0.0
        self._rows: deque[HandedRow] = deque()
        self._since: deque[float] = deque()  # when each row was put (monotonic)
        self._in_table = False  # rows of this process went to the table since the last claim

    def attach(self, lease_s: float) -> uuid.UUID:
        """A consumer starts taking rows; the lease token the producer writes from now on."""
        self._token = uuid.uuid4()
        self._lease_s = lease_s
        self._rows.clear()
        self._since.clear()
        return self._token

    def detach(self) -> tuple[uuid.UUID | None, list[HandedRow]]:
        """The consumer stops: its token and the rows it never took (to give their leases back)."""
        token, self._token = self._token, None
        rows = list(self._rows)
        self._rows.clear()
        self._since.clear()
        return token, rows

    def lease(self) -> tuple[uuid.UUID, float] | None:
        """The ``(token, seconds)`` lease for the producer's next rows, or None: no consumer in
        this process, or it is behind (``max_rows`` waiting, or one for ``max_wait_s``): the rows
        then go to the table unleased."""
        if self._token is None or len(self._rows) >= self.max_rows:
            return None
        if self._since and time.monotonic() - self._since[0] > self.max_wait_s:
            return None
        return self._token, self._lease_s

    def put(self, token: uuid.UUID, rows: list[HandedRow]) -> None:
        """Rows committed with lease ``token``. Dropped when that consumer has gone: their lease
        runs out and a claim finds them."""
        if token == self._token:
            self._rows.extend(rows)
            self._since.extend([time.monotonic()] * len(rows))

    def stored_in_table(self) -> None:
        """The producer committed rows without a lease (the consumer was behind, or none was
        attached): the consumer's next round should claim them from the table."""
        self._in_table = True

    def claim_wanted(self) -> bool:
        """Did rows go to the table since the last call? (Reading it clears it.)"""
        wanted, self._in_table = self._in_table, False
        return wanted

    def take(self, limit: int) -> tuple[uuid.UUID | None, list[HandedRow]]:
        """Up to ``limit`` rows, oldest first, with the token they are leased to."""
        rows, since = self._rows, self._since
        count = min(limit, len(rows))
        for _ in range(count):
            since.popleft()
        return self._token, [rows.popleft() for _ in range(count)]

    def __len__(self) -> int:
        return len(self._rows)
