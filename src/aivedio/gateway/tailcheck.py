"""The tail check: a lost LAST event still arrives.

Gap repair needs a later event to notice a gap; when the lost message is the last one (the
completion event of seed 004), nothing later comes. Every ``tailcheck_s`` (and right after every
Redis (re)subscribe) the heads of all of this node's active streams are read in ONE query and
every stream behind its head is repaired from PostgreSQL. A head seen ahead on a periodic check
is repaired only if still ahead after a short grace, so messages in flight are not re-read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aivedio.gateway.config import GatewayConfig
from aivedio.gateway.hub import Hub
from aivedio.gateway.store import EventStore
from aivedio.logs import log

logger = logging.getLogger("aivedio.gateway")


class TailCheck:
    def __init__(self, hub: Hub, store: EventStore, config: GatewayConfig) -> None:
        self.hub = hub
        self.store = store
        self.config = config
        self._now = asyncio.Event()

    def wake(self) -> None:
        """Check now, without grace (after a Redis reconnect)."""
        self._now.set()

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._now.wait(), self.config.tailcheck_s)
            urgent = self._now.is_set()
            self._now.clear()
            try:
                await self.check(0.0 if urgent else self.config.tailcheck_grace_s)
            except Exception as exc:
                log(logger, logging.WARNING, "tail check failed", error=repr(exc))

    async def check(self, grace: float) -> int:
        """Compare every ready stream with its head; returns how many were behind."""
        streams = [
            s for s in self.hub.streams.values() if s.ready.done() and not s.ready.exception()
        ]
        if not streams:
            return 0
        positions = await self.store.positions([s.project_id for s in streams])
        loop = asyncio.get_running_loop()
        behind = 0
        for stream in streams:
            position = positions.get(stream.project_id)
            if position is None:
                continue
            if position.epoch != stream.epoch:
                stream.rebase(position)
            elif position.head > stream.last:
                behind += 1
                if grace <= 0:
                    stream.repair_if_behind(position.head)
                else:
                    loop.call_later(grace, stream.repair_if_behind, position.head)
        return behind
