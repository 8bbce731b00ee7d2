"""The health of a process's role loops, as ``/readyz`` and ``aivedio_role_up`` show it.

Every supervised loop has a :class:`LoopHealth` (its role, its name, its state) in the process's
:class:`Health`. The supervisor sets ``restarting`` while a failed loop waits out its backoff.
A loop reports an outage itself, from where it pauses because a server it needs is away::

    except DatabaseUnavailable as exc:
        health.outage("database", exc)  # paused: wait and retry
    ...
    health.recovered()  # after a round that worked

The two module functions find the loop they run in through a context variable that the supervisor
sets, so the loop code needs no handle (asyncio tasks copy the context: a task a loop starts
reports for that loop). Outside a supervised loop they do nothing. ``recovered`` is one context
variable read and one comparison when there is nothing to recover from.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from prometheus_client import Gauge

from aivedio.logs import log

__all__ = ["Health", "LoopHealth", "LoopState", "outage", "recovered", "reporting_to"]

logger = logging.getLogger("aivedio.process")

ROLE_UP = Gauge(
    "aivedio_role_up",
    "1 while a role loop runs; 0 while it is paused by an outage or waits to be restarted",
    ["role", "loop"],
)


class LoopState(StrEnum):
    RUNNING = "running"
    OUTAGE = "outage"  # paused: a server it needs is away; it waits and retries by itself
    RESTARTING = "restarting"  # failed (or ended by itself); restarted after its backoff
    STOPPED = "stopped"  # the process is stopping


DOWN = frozenset({LoopState.OUTAGE, LoopState.RESTARTING})


@dataclass(eq=False, slots=True)
class LoopHealth:
    """One role loop. Mutated only from the event loop's thread."""

    role: str
    loop: str
    state: LoopState = LoopState.RUNNING
    since: float = field(default_factory=time.time)
    """Unix time of the last change of ``state``."""
    dependency: str | None = None
    """What is away during an outage: ``database``, ``redis`` or ``bus``."""
    error: str | None = None
    """The last failure or outage: exception type names, never a message."""
    restarts: int = 0

    def __post_init__(self) -> None:
        ROLE_UP.labels(self.role, self.loop).set(1)

    @property
    def down(self) -> bool:
        return self.state in DOWN

    def outage(self, dependency: str, error: BaseException | str) -> None:
        """The loop is paused because ``dependency`` is away (it retries by itself)."""
        if self.state is LoopState.OUTAGE and self.dependency == dependency:
            return
        self.error = _describe(error)
        if self.state is not LoopState.OUTAGE:
            log(
                logger,
                logging.WARNING,
                "role paused by an outage",
                role=self.role,
                loop=self.loop,
                dependency=dependency,
                error=self.error,
            )
        self.dependency = dependency
        self._set(LoopState.OUTAGE)

    def recovered(self, dependency: str | None = None) -> None:
        """A round worked again after an outage (of ``dependency`` only, when given: a round
        that shows the database answers says nothing about the bus)."""
        if self.state is not LoopState.OUTAGE:
            return
        if dependency is not None and dependency != self.dependency:
            return
        log(
            logger,
            logging.INFO,
            "role recovered from an outage",
            role=self.role,
            loop=self.loop,
            dependency=self.dependency,
            after_s=round(time.time() - self.since, 3),
        )
        self.dependency = None
        self._set(LoopState.RUNNING)

    def restarting(self, error: BaseException | str) -> None:
        self.restarts += 1
        self.error = _describe(error)
        self.dependency = None
        self._set(LoopState.RESTARTING)

    def running(self) -> None:
        if self.state is not LoopState.RUNNING:
            self.dependency = None
            self._set(LoopState.RUNNING)

    def stopped(self) -> None:
        self._set(LoopState.STOPPED)

    def _set(self, state: LoopState) -> None:
        if state is not self.state:
            self.state = state
            self.since = time.time()
        ROLE_UP.labels(self.role, self.loop).set(0 if state in DOWN else 1)

    def as_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "loop": self.loop,
            "state": str(self.state),
            "dependency": self.dependency,
            "error": self.error,
            "restarts": self.restarts,
            "for_s": round(max(0.0, time.time() - self.since), 3),
        }


class Health:
    """Every supervised loop of one process, by (role, loop)."""

    def __init__(self) -> None:
        self._units: dict[tuple[str, str], LoopHealth] = {}

    def unit(self, role: str, loop: str) -> LoopHealth:
        """The health of one loop, registered on first use."""
        key = (role, loop)
        unit = self._units.get(key)
        if unit is None:
            unit = self._units[key] = LoopHealth(role, loop)
        return unit

    def units(self) -> list[LoopHealth]:
        return list(self._units.values())

    def down(self) -> list[LoopHealth]:
        return [u for u in self._units.values() if u.down]

    def roles_down(self) -> list[str]:
        """The roles with at least one loop down, in the order they were registered."""
        return list(dict.fromkeys(u.role for u in self._units.values() if u.down))


_current: contextvars.ContextVar[LoopHealth | None] = contextvars.ContextVar(
    "aivedio_loop_health", default=None
)


@contextmanager
def reporting_to(unit: LoopHealth) -> Iterator[None]:
    """Within this block (and the tasks started in it), ``outage`` and ``recovered`` report
    for ``unit``."""
    token = _current.set(unit)
    try:
        yield
    finally:
        _current.reset(token)


def outage(dependency: str, error: BaseException | str) -> None:
    """The loop this runs in is paused because ``dependency`` is away."""
    unit = _current.get()
    if unit is not None:
        unit.outage(dependency, error)


def recovered(dependency: str | None = None) -> None:
    """The loop this runs in did a round that worked: clears its outage (only an outage of
    ``dependency``, when given)."""
    unit = _current.get()
    if unit is not None and unit.state is LoopState.OUTAGE:
        unit.recovered(dependency)


def _describe(error: BaseException | str) -> str:
    """Type names only (``DatabaseUnavailable (ConnectionDoesNotExistError)``): ``/readyz`` shows
    this, and messages may carry URLs with credentials. The logs have the whole error."""
    if isinstance(error, str):
        return error[:200]
    name = type(error).__name__
    cause = error.__cause__ or error.__context__
    return f"{name} ({type(cause).__name__})" if cause is not None else name
