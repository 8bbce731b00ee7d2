"""The wait helper: it returns the first truthy result, and a timeout fails with a name (the
state reached, when ``what`` is a callable)."""

from __future__ import annotations

import pytest

from tests.waiting import eventually, eventually_sync


async def test_eventually_returns_the_first_truthy_result() -> None:
    calls: list[int] = []

    async def third() -> list[int] | None:
        calls.append(len(calls))
        return calls if len(calls) == 3 else None

    assert await eventually(third, "the third call", interval=0) == [0, 1, 2]


async def test_a_timeout_names_the_state_reached() -> None:
    seen = [1, 2]
    with pytest.raises(AssertionError, match=r"timed out waiting for 3 items \(got \[1, 2\]\)"):
        await eventually(lambda: False, lambda: f"3 items (got {seen})", 0, interval=0)


def test_eventually_sync_counts_ignored_errors_as_not_yet() -> None:
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionRefusedError
        return "up"

    assert eventually_sync(flaky, "up", interval=0, ignoring=(ConnectionRefusedError,)) == "up"
    with pytest.raises(AssertionError, match="timed out waiting for never"):
        eventually_sync(lambda: None, "never", 0, interval=0)
