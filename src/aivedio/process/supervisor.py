"""Run a role loop under supervision: a loop that fails is restarted, never the process.

``supervise(unit, loop, stopping)`` runs ``loop(stopping)`` until ``stopping`` is set. When the
loop raises (anything but cancellation and :class:`~aivedio.errors.ConfigError`) or returns while
the process is not stopping, the failure is logged with the role, the loop and the error, counted
in ``aivedio_role_restarts_total{role, loop}``, the loop's health says ``restarting`` (``/readyz``
names its role), and the loop starts again after the backoff of
:mod:`aivedio.process.restart`. A :class:`ConfigError` is not something a restart fixes: it
leaves ``supervise``, and the process stops (exit code 2).

A lost connection is not a failure: loops catch it where it happens, report an outage
(:func:`aivedio.process.health.outage`), wait and retry. The supervisor is the net under the
errors nobody foresaw.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable

from prometheus_client import Counter

from aivedio.errors import ConfigError
from aivedio.logs import log
from aivedio.process.health import LoopHealth, reporting_to
from aivedio.process.parts import Loop
from aivedio.process.restart import RestartPolicy, consecutive_failures, restart_delay

__all__ = ["RESTARTS", "supervise"]

logger = logging.getLogger("aivedio.process")

RESTARTS = Counter(
    "aivedio_role_restarts_total",
    "Role loops restarted by their process after they failed or ended by themselves",
    ["role", "loop"],
)


async def supervise(
    unit: LoopHealth,
    loop: Loop,
    stopping: asyncio.Event,
    policy: RestartPolicy | None = None,
    *,
    rand: Callable[[], float] = random.random,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Run ``loop`` until ``stopping``, restarting it after every failure (see the module doc).
    Raises only ``ConfigError`` (and cancellation, and ``BaseException`` other than
    ``Exception``)."""
    policy = policy or RestartPolicy()
    failures = 0
    with reporting_to(unit):
        try:
            while not stopping.is_set():
                unit.running()
                started = clock()
                error = await _run_once(unit, loop, stopping)
                if error is None:
                    return
                failures = consecutive_failures(failures, clock() - started, policy)
                delay = restart_delay(failures, policy, rand())
                _restarting(unit, error, failures, delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), delay)
        finally:
            unit.stopped()


async def _run_once(
    unit: LoopHealth, loop: Loop, stopping: asyncio.Event
) -> BaseException | str | None:
    """One run of ``loop``: why it has to be restarted, or None when it is done (it ended, or
    failed, on the way out). A ``ConfigError`` is logged and raised: no restart mends it."""
    try:
        await loop(stopping)
    except ConfigError as exc:
        log(
            logger,
            logging.ERROR,
            "role loop stopped by a configuration error",
            role=unit.role,
            loop=unit.loop,
            error=str(exc),
        )
        raise
    except Exception as exc:
        if stopping.is_set():  # an error on the way out (a closed client): done
            log(
                logger,
                logging.DEBUG,
                "role loop ended with an error while stopping",
                role=unit.role,
                loop=unit.loop,
                error=repr(exc),
            )
            return None
        return exc
    return None if stopping.is_set() else "ended by itself"


def _restarting(unit: LoopHealth, error: BaseException | str, failures: int, delay: float) -> None:
    RESTARTS.labels(unit.role, unit.loop).inc()
    unit.restarting(error)
    logger.error(
        "role loop failed; restarting",
        exc_info=error if isinstance(error, BaseException) else None,
        extra={
            "fields": {
                "role": unit.role,
                "loop": unit.loop,
                "error": repr(error) if isinstance(error, BaseException) else error,
                "failures": failures,
                "restart_in_s": round(delay, 3),
            }
        },
    )
