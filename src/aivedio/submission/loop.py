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
) -> None:
    """Call ``one_round`` until ``stopping``; sleep ``idle_s`` after a round that did nothing.

    A database outage or a bug in one round is logged and retried after the idle sleep: a
    background role never ends by itself (that would stop the whole process)."""
    while not stopping.is_set():
        try:
            done = await one_round()
        except DatabaseUnavailable as exc:
            log(logger, logging.WARNING, f"{name}: database unavailable", error=str(exc))
            done = 0
        except Exception:
            logger.exception(f"{name}: round failed")
            done = 0
        if done == 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), idle_s)
