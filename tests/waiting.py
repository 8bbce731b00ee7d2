"""The one way a test waits for something to happen: :func:`eventually` (and
:func:`eventually_sync`, the same for a test without an event loop).

A test asserts on conditions, never on how long something took (benchmarks measure time). The
timeout only turns a hang into a failure with a name; it is generous on purpose, and a slow,
shared machine makes a test slower, not red.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

__all__ = ["eventually", "eventually_sync"]

What = str | Callable[[], str]


def _timed_out(what: What) -> AssertionError:
    return AssertionError(f"timed out waiting for {what if isinstance(what, str) else what()}")


async def eventually(
    check: Callable[[], Any],
    what: What = "condition",
    timeout: float = 30.0,
    *,
    interval: float = 0.02,
    ignoring: tuple[type[BaseException], ...] = (),
) -> Any:
    """Call ``check`` (plain or async) until it returns something truthy, and return that.

    An exception of a type in ``ignoring`` counts as "not yet" (a server still starting refuses
    connections, a state file is not written yet); any other propagates at once.
    Raises ``AssertionError("timed out waiting for <what>")`` after ``timeout`` seconds; ``what``
    may be a callable, called then, to name the state that was reached (what came so far)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if inspect.isawaitable(result):
                result = await result
        except ignoring:
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise _timed_out(what)
        await asyncio.sleep(interval)


def eventually_sync(
    check: Callable[[], Any],
    what: What = "condition",
    timeout: float = 30.0,
    *,
    interval: float = 0.02,
    ignoring: tuple[type[BaseException], ...] = (),
) -> Any:
    """:func:`eventually` for a synchronous test (one that drives subprocesses and blocks):
    ``check`` is a plain callable, and the wait sleeps between calls."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
        except ignoring:
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise _timed_out(what)
        time.sleep(interval)
