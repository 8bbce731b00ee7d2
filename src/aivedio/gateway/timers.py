"""Shared timers: one heartbeat wheel for all connections instead of a timer per connection.

The wheel has one slot per second of the heartbeat period; each tick visits one slot, so every
connection is visited once per period (ping, session cap, stalled-socket check) and a tick touches
only 1/period of the connections. The ping frame is encoded once per tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from aivedio.gateway.frames import ping_frame
from aivedio.gateway.session import Session


class Wheel:
    def __init__(self, period_s: float, tick_s: float = 1.0) -> None:
        self.tick_s = tick_s
        self.slots: list[set[Session]] = [set() for _ in range(max(1, round(period_s / tick_s)))]

    def _slot(self, session: Session) -> set[Session]:
        return self.slots[hash(session) % len(self.slots)]

    def add(self, session: Session) -> None:
        self._slot(session).add(session)

    def remove(self, session: Session) -> None:
        self._slot(session).discard(session)

    def __len__(self) -> int:
        return sum(len(s) for s in self.slots)

    def tick(self, index: int) -> None:
        now = time.monotonic()
        ping = ping_frame(int(time.time()))
        for session in tuple(self.slots[index % len(self.slots)]):
            session.tick(now, ping)

    async def run(self, stopping: asyncio.Event) -> None:
        index = 0
        deadline = time.monotonic()
        while not stopping.is_set():
            deadline += self.tick_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), max(0.0, deadline - time.monotonic()))
            self.tick(index)
            index += 1
