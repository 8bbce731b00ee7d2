"""One loop over a heap of due callbacks: every simulated generation and every delayed webhook.

Thousands of in-flight generations cost one heap entry each (their next transition), not one
asyncio task each. Callbacks are plain synchronous functions; they must not block.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

Callback = Callable[[], None]

# Callbacks run per loop turn before yielding to the event loop, so a burst of due work never
# starves the HTTP handlers.
BATCH = 1000


class Scheduler:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._heap: list[tuple[float, int, Callback]] = []
        self._counter = itertools.count()
        self._wake = asyncio.Event()

    def __len__(self) -> int:
        return len(self._heap)

    def call_at(self, when: float, callback: Callback) -> None:
        entry = (when, next(self._counter), callback)
        heapq.heappush(self._heap, entry)
        if self._heap[0] is entry:
            self._wake.set()

    def call_later(self, delay: float, callback: Callback) -> None:
        self.call_at(self.clock() + max(0.0, delay), callback)

    def clear(self) -> None:
        self._heap.clear()

    def run_due(self, limit: int = BATCH) -> int:
        """Run up to ``limit`` due callbacks; how many ran."""
        ran = 0
        now = self.clock()
        while self._heap and self._heap[0][0] <= now and ran < limit:
            _, _, callback = heapq.heappop(self._heap)
            ran += 1
            try:
                callback()
            except Exception:
                log.exception("sandbox scheduler callback failed")
        return ran

    def _next_delay(self) -> float | None:
        if not self._heap:
            return None
        return max(0.0, self._heap[0][0] - self.clock())

    async def run(self) -> None:
        """Run due callbacks forever; cancel the task to stop."""
        while True:
            if self.run_due() >= BATCH:
                await asyncio.sleep(0)
                continue
            self._wake.clear()
            delay = self._next_delay()
            if delay == 0.0:
                await asyncio.sleep(0)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)
