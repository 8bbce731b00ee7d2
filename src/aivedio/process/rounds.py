"""What the submitter, the cancel worker and the reconciler share: a round loop and a backoff."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from datetime import timedelta

from aivedio.errors import DatabaseUnavailable
from aivedio.logs import log
from aivedio.process import health


def backoff(
    tries: int, base_s: float, cap_s: float, rand: Callable[[float, float], float] = random.uniform
) -> timedelta:
    """``min(cap, base * 2^(tries-1)) * uniform(0.8, 1.2)`` (seed §12.8.3); tries counts from 1."""
    exponent = max(0, min(tries - 1, 30))
    return timedelta(seconds=min(cap_s, base_s * 2**exponent) * rand(0.8, 1.2))


async def run_rounds(
    stopping: asyncio.Event,
    one_round: Callable[[], Awaitable[int]],
    idle_s: float,
    logger: logging.Logger,
    name: str,
    outage_s: float = 1.0,
) -> None:
    """Call ``one_round`` until ``stopping``; sleep ``idle_s`` after a round that did nothing.

    A database outage pauses the loop (reported, retried every ``outage_s`` at most, so a loop
    with a long ``idle_s`` notices the database is back soon); a bug in one round is logged and
    retried after the idle sleep: a background role never ends by itself."""
    while not stopping.is_set():
        pause = idle_s
        try:
            done = await one_round()
            health.recovered()
        except DatabaseUnavailable as exc:
            log(logger, logging.WARNING, f"{name}: database unavailable", error=str(exc))
            health.outage("database", exc)
            done, pause = 0, min(idle_s, outage_s)
        except Exception:
            logger.exception(f"{name}: round failed")
            done = 0
        if done == 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), pause)
