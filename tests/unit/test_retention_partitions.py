"""Which partitions a maintenance round may drop (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from aivedio.retention.partitions import Partition, droppable, ident

DAY = timedelta(days=1)
T0 = datetime(2026, 12, 1, tzinfo=UTC)


def days(n: int) -> list[Partition]:
    return [
        Partition(f"task_events_p{(T0 + i * DAY):%Y%m%d}", T0 + (i + 1) * DAY, False)
        for i in range(n)
    ]


def test_only_partitions_wholly_older_than_the_cutoff_go_oldest_first() -> None:
    parts = days(10)
    assert [p.name for p in droppable(parts, T0 + 3 * DAY)] == [p.name for p in parts[:3]]
    assert droppable(parts, T0 + DAY - timedelta(seconds=1)) == []


def test_the_newest_partition_is_never_dropped() -> None:
    parts = days(3)
    assert [p.name for p in droppable(parts, T0 + 30 * DAY)] == [p.name for p in parts[:2]]


def test_an_unbounded_partition_is_never_dropped() -> None:
    forever = Partition("task_events_legacy", None, False)
    assert droppable([forever, *days(2)], T0 + 30 * DAY) == days(2)[:1]


def test_only_partition_names_become_identifiers() -> None:
    assert ident("task_events_p20261201") == '"task_events_p20261201"'
    with pytest.raises(ValueError, match="not a task_events partition"):
        ident('task_events"; DROP TABLE tenants; --')
