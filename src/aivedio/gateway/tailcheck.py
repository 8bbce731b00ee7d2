"""The tail check: a lost LAST event still arrives.

Gap repair needs a later event to notice a gap; when the lost message is the last one (the
completion event of seed 004), nothing later comes. Every ``tailcheck_s`` (and right after every
Redis (re)subscribe) the heads of all of this node's active streams are read in ONE query and
every stream behind its head is repaired from PostgreSQL. A head seen ahead on a periodic check
is repaired only if still ahead after a short grace, so messages in flight are not re-read.

``soon(projects, delay)``: an early check of some projects only, shortly after this node
registered its route for them (node fan-out: an event published before the dispatcher learned
the route is recovered after ``delay``, not after a whole period). Early requests made within one
delay share one timer and one query.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from asyncio import FIRST_COMPLETED
from collections.abc import Iterable

from aivedio.errors import DatabaseUnavailable
from aivedio.gateway.config import GatewayConfig
from aivedio.gateway.hub import Hub
from aivedio.gateway.store import EventStore
from aivedio.logs import log
from aivedio.process import health

logger = logging.getLogger("aivedio.gateway")


class TailCheck:
    def __init__(self, hub: Hub, store: EventStore, config: GatewayConfig) -> None:
        self.hub = hub
        self.store = store
        self.config = config
        self._now = asyncio.Event()
        self._soon: set[uuid.UUID] = set()
        self._soon_timer: asyncio.TimerHandle | None = None
        self._soon_jobs: set[asyncio.Task[BaseException | None]] = set()

    def wake(self) -> None:
        """Check now, without grace (after a Redis reconnect)."""
        self._now.set()

    def soon(self, project_ids: Iterable[uuid.UUID], delay: float) -> None:
        """Check these projects in about ``delay`` seconds (with the usual grace)."""
        self._soon.update(project_ids)
        if self._soon_timer is None and self._soon:
            self._soon_timer = asyncio.get_running_loop().call_later(delay, self._check_soon)

    def _check_soon(self) -> None:
        self._soon_timer = None
        projects, self._soon = self._soon, set()
        job = asyncio.create_task(self._run_check(self.config.tailcheck_grace_s, projects))
        self._soon_jobs.add(job)
        job.add_done_callback(self._soon_jobs.discard)

    async def _run_check(
        self, grace: float, only: set[uuid.UUID] | None = None
    ) -> BaseException | None:
        """One check; the error (logged) if it failed. The next one tries again."""
        try:
            await self.check(grace, only)
        except Exception as exc:
            log(logger, logging.WARNING, "tail check failed", error=repr(exc))
            return exc
        return None

    async def run(self, stopping: asyncio.Event) -> None:
        try:
            while not stopping.is_set():
                waits = [asyncio.ensure_future(e.wait()) for e in (self._now, stopping)]
                try:
                    await asyncio.wait(
                        waits, timeout=self.config.tailcheck_s, return_when=FIRST_COMPLETED
                    )
                finally:
                    for w in waits:
                        w.cancel()
                if stopping.is_set():
                    break
                urgent = self._now.is_set()
                self._now.clear()
                error = await self._run_check(0.0 if urgent else self.config.tailcheck_grace_s)
                if error is None:
                    health.recovered()
                elif isinstance(error, DatabaseUnavailable):
                    health.outage("database", error)
        finally:
            if self._soon_timer is not None:
                self._soon_timer.cancel()
                self._soon_timer = None
            for job in list(self._soon_jobs):
                job.cancel()

    async def check(self, grace: float, only: set[uuid.UUID] | None = None) -> int:
        """Compare every ready stream (of ``only``, if given) with its head; returns how many
        were behind."""
        streams = [
            s
            for s in self.hub.streams.values()
            if s.ready.done() and not s.ready.exception() and (only is None or s.project_id in only)
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
