"""The role-loop supervisor: restart after a failure, count it, report health; stop on shutdown."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import REGISTRY

from aivedio.errors import ConfigError
from aivedio.process import health
from aivedio.process.health import Health, LoopHealth, LoopState
from aivedio.process.restart import RestartPolicy
from aivedio.process.supervisor import supervise
from tests.waiting import eventually

FAST = RestartPolicy(first_s=0.001, cap_s=0.002, healthy_s=3600.0)
DEADLINE_S = 10.0  # only to fail instead of hanging


def restarts(role: str, loop: str) -> float:
    value = REGISTRY.get_sample_value("aivedio_role_restarts_total", {"role": role, "loop": loop})
    return value or 0.0


def role_up(role: str, loop: str) -> float | None:
    return REGISTRY.get_sample_value("aivedio_role_up", {"role": role, "loop": loop})


async def test_a_failing_loop_is_logged_counted_and_restarted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    unit = Health().unit("t-fail", "worker")
    stopping = asyncio.Event()
    runs = 0

    async def loop(stop: asyncio.Event) -> None:
        nonlocal runs
        runs += 1
        if runs <= 3:
            raise ConnectionResetError("boom")
        await stop.wait()

    with caplog.at_level(logging.ERROR, logger="aivedio.process"):
        job = asyncio.create_task(supervise(unit, loop, stopping, FAST))
        await eventually(lambda: runs == 4, "the fourth run", DEADLINE_S, interval=0.001)
    assert unit.state is LoopState.RUNNING
    assert unit.restarts == 3
    assert unit.error == "ConnectionResetError"
    assert restarts("t-fail", "worker") == 3
    assert role_up("t-fail", "worker") == 1
    failures = [r for r in caplog.records if r.getMessage() == "role loop failed; restarting"]
    assert len(failures) == 3
    fields = failures[0].fields  # type: ignore[attr-defined]
    assert fields["role"] == "t-fail" and fields["loop"] == "worker"
    assert "boom" in fields["error"]
    assert [f.fields["failures"] for f in failures] == [1, 2, 3]  # type: ignore[attr-defined]
    stopping.set()
    await asyncio.wait_for(job, DEADLINE_S)
    assert unit.state is LoopState.STOPPED
    assert restarts("t-fail", "worker") == 3  # stopping is not a restart


async def test_a_loop_that_ends_by_itself_is_restarted() -> None:
    unit = Health().unit("t-ends", "worker")
    stopping = asyncio.Event()
    runs = 0

    async def loop(stop: asyncio.Event) -> None:
        nonlocal runs
        runs += 1
        if runs >= 3:
            await stop.wait()

    job = asyncio.create_task(supervise(unit, loop, stopping, FAST))
    await eventually(lambda: runs == 3, "the third run", DEADLINE_S, interval=0.001)
    assert unit.restarts == 2 and unit.error == "ended by itself"
    stopping.set()
    await asyncio.wait_for(job, DEADLINE_S)


async def test_while_it_waits_to_restart_the_role_is_down() -> None:
    registry = Health()
    unit = registry.unit("t-down", "worker")
    other = registry.unit("t-fine", "worker")
    stopping = asyncio.Event()
    failed = asyncio.Event()
    slow = RestartPolicy(first_s=3600.0, cap_s=3600.0)

    async def loop(stop: asyncio.Event) -> None:
        failed.set()
        raise RuntimeError("bug")

    job = asyncio.create_task(supervise(unit, loop, stopping, slow))
    await asyncio.wait_for(failed.wait(), DEADLINE_S)
    await eventually(
        lambda: unit.state is LoopState.RESTARTING, "restarting", DEADLINE_S, interval=0.001
    )
    assert registry.roles_down() == ["t-down"]
    assert [u.loop for u in registry.down()] == ["worker"]
    assert other.state is LoopState.RUNNING
    assert role_up("t-down", "worker") == 0
    stopping.set()  # a signal during the backoff ends it at once
    await asyncio.wait_for(job, DEADLINE_S)
    assert registry.roles_down() == []


async def test_a_configuration_error_is_not_restarted_but_raised() -> None:
    unit = Health().unit("t-config", "worker")

    async def loop(stop: asyncio.Event) -> None:
        raise ConfigError("AIVEDIO_SOMETHING is half set")

    with pytest.raises(ConfigError):
        await asyncio.wait_for(supervise(unit, loop, asyncio.Event(), FAST), DEADLINE_S)
    assert restarts("t-config", "worker") == 0


async def test_an_error_while_stopping_is_not_a_restart() -> None:
    unit = Health().unit("t-closing", "worker")
    stopping = asyncio.Event()
    started = asyncio.Event()

    async def loop(stop: asyncio.Event) -> None:
        started.set()
        await stop.wait()
        raise ConnectionResetError("closed on the way out")

    job = asyncio.create_task(supervise(unit, loop, stopping, FAST))
    await asyncio.wait_for(started.wait(), DEADLINE_S)
    stopping.set()
    await asyncio.wait_for(job, DEADLINE_S)
    assert restarts("t-closing", "worker") == 0


async def test_cancellation_passes_through() -> None:
    unit = Health().unit("t-cancel", "worker")
    started = asyncio.Event()

    async def loop(stop: asyncio.Event) -> None:
        started.set()
        await asyncio.Event().wait()

    job = asyncio.create_task(supervise(unit, loop, asyncio.Event(), FAST))
    await asyncio.wait_for(started.wait(), DEADLINE_S)
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await job
    assert unit.state is LoopState.STOPPED


async def test_the_backoff_grows_in_a_crash_loop_and_resets_after_a_healthy_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With a fake clock: runs of 0 s grow the count, a run of ``healthy_s`` resets it."""
    unit = Health().unit("t-reset", "worker")
    stopping = asyncio.Event()
    now = 0.0
    lengths = iter([0.0, 0.0, 0.0, 100.0, 0.0])
    runs = 0

    def clock() -> float:
        return now

    async def loop(stop: asyncio.Event) -> None:
        nonlocal now, runs
        runs += 1
        length = next(lengths, None)
        if length is None:
            await stop.wait()
            return
        now += length
        raise RuntimeError("again")

    policy = RestartPolicy(first_s=0.001, cap_s=0.004, healthy_s=50.0, jitter=0.0)
    with caplog.at_level(logging.ERROR, logger="aivedio.process"):
        job = asyncio.create_task(supervise(unit, loop, stopping, policy, clock=clock))
        await eventually(lambda: runs == 6, "the sixth run", DEADLINE_S, interval=0.001)
    stopping.set()
    await asyncio.wait_for(job, DEADLINE_S)
    logged = [
        (r.fields["failures"], r.fields["restart_in_s"])  # type: ignore[attr-defined]
        for r in caplog.records
        if r.getMessage() == "role loop failed; restarting"
    ]
    assert logged == [(1, 0.001), (2, 0.002), (3, 0.004), (1, 0.001), (2, 0.002)]


async def test_a_loop_reports_its_outage_and_recovery_from_any_task_it_starts() -> None:
    registry = Health()
    unit = registry.unit("t-outage", "worker")
    stopping = asyncio.Event()
    steps = [asyncio.Event() for _ in range(3)]
    seen: list[LoopState] = []

    async def child() -> None:
        health.outage("database", ConnectionRefusedError())

    async def loop(stop: asyncio.Event) -> None:
        await asyncio.create_task(child())  # a task started here reports for this loop
        seen.append(unit.state)
        steps[0].set()
        await steps[1].wait()
        health.recovered()
        seen.append(unit.state)
        steps[2].set()
        await stop.wait()

    job = asyncio.create_task(supervise(unit, loop, stopping, FAST))
    await asyncio.wait_for(steps[0].wait(), DEADLINE_S)
    assert registry.roles_down() == ["t-outage"]
    assert unit.dependency == "database"
    assert unit.as_dict()["state"] == "outage"
    steps[1].set()
    await asyncio.wait_for(steps[2].wait(), DEADLINE_S)
    assert seen == [LoopState.OUTAGE, LoopState.RUNNING]
    assert registry.roles_down() == [] and unit.restarts == 0
    stopping.set()
    await asyncio.wait_for(job, DEADLINE_S)


def test_outside_a_supervised_loop_reports_do_nothing() -> None:
    health.outage("database", "x")
    health.recovered()


def test_the_reported_error_names_types_never_messages() -> None:
    unit = LoopHealth("t-describe", "worker")
    try:
        try:
            raise OSError("nats://user:secret@host")
        except OSError as inner:
            raise ValueError("postgresql://u:secret@db") from inner
    except ValueError as exc:
        unit.outage("bus", exc)
    assert unit.error == "ValueError (OSError)"
    assert "secret" not in str(unit.as_dict())


def test_a_recovery_of_one_dependency_does_not_clear_an_outage_of_another() -> None:
    unit = LoopHealth("t-deps", "worker")
    unit.outage("bus", "BusUnavailable")
    unit.recovered("database")  # the database answered: says nothing about the bus
    assert unit.state is LoopState.OUTAGE and unit.dependency == "bus"
    unit.recovered("bus")
    assert unit.state is LoopState.RUNNING and unit.dependency is None
    unit.outage("database", "DatabaseUnavailable")
    unit.recovered()  # any
    assert unit.state is LoopState.RUNNING
