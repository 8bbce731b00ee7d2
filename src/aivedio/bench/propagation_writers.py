"""The writers of phase (b) of ``aivedio bench propagation``: processes applying observations at
a steady rate, each stamping both ends of its own COMMIT."""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.synchronize
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from aivedio.bench.propagation_options import Options
from aivedio.config import DatabaseConfig, Settings, StateConfig
from aivedio.db.pool import Database
from aivedio.domain.observation import ProviderObservation, ProviderStatus, Source
from aivedio.domain.transitions import Outcome
from aivedio.state.service import StateService


@dataclass(frozen=True, slots=True)
class WriterSpec:
    database_url: str
    state: StateConfig
    attempts: list[uuid.UUID]  # this writer's tasks (each task has one writer: its order holds)
    total: int  # observations to apply
    interval: float  # seconds between this writer's starts
    offset: float  # its first start after the common start time
    workers: int  # concurrent applies (its pool size)
    batch: int = 1  # observations per transaction


async def _writers(
    url: str,
    settings: Settings,
    attempts: list[uuid.UUID],
    opts: Options,
    acked: dict[tuple[str, int], tuple[float, float]],
    cpu: dict[str, float],
) -> tuple[int, list[float], float]:
    """``opts.rate`` applies/s for ``opts.seconds`` from ``opts.writers`` processes (one process
    could not offer 1,000/s: StateService.apply costs ~0.7 ms of CPU), interleaved in time."""
    n = min(opts.writers, len(attempts))
    total = int(opts.rate * opts.seconds)
    specs = [
        WriterSpec(
            database_url=url,
            state=settings.state,
            attempts=attempts[w::n],
            total=total // n + (w < total % n),
            interval=n / opts.rate,
            offset=w / opts.rate,
            workers=max(2, opts.workers // n),
            batch=opts.writer_batch,
        )
        for w in range(n)
    ]
    ctx = multiprocessing.get_context("spawn")
    start_at = ctx.Value("d", 0.0)
    results = ctx.Queue()
    procs = []
    readies = []
    for spec in specs:
        ready = ctx.Event()
        proc = ctx.Process(target=_writer, args=(spec, ready, start_at, results), daemon=True)
        proc.start()
        procs.append(proc)
        readies.append(ready)
    try:
        for proc, ready in zip(procs, readies, strict=True):
            while not ready.is_set():
                if not proc.is_alive():
                    raise RuntimeError("a writer process failed to start")
                await asyncio.sleep(0.02)
        start_at.value = time.time() + 0.2
        lag: list[float] = []
        ended = 0.0
        for _ in procs:
            keys, lags, seconds, end = await asyncio.to_thread(
                results.get, True, opts.seconds + 120
            )
            ended = max(ended, end)
            acked.update(keys)
            lag += lags
            cpu["writers"] = cpu.get("writers", 0.0) + seconds
    finally:
        for proc in procs:
            await asyncio.to_thread(proc.join, 20)
            if proc.is_alive():
                proc.kill()
    return total, lag, ended - start_at.value


def _writer(spec: WriterSpec, ready: Any, start_at: Any, results: Any) -> None:
    import uvloop

    results.put(uvloop.run(_writer_main(spec, ready, start_at)))


Stamped = tuple[tuple[str, int], tuple[float, float]]  # (task, version), (COMMIT sent, returned)


async def _writer_main(
    spec: WriterSpec, ready: Any, start_at: Any
) -> tuple[list[Stamped], list[float], float, float]:
    db = await Database.connect(
        DatabaseConfig(
            url=spec.database_url,
            min_size=spec.workers,
            max_size=spec.workers,
            acquire_timeout_s=30,
        )
    )
    try:
        state = StateService(db, spec.state)
        ready.set()
        while not start_at.value:  # noqa: ASYNC110 - a multiprocessing value
            await asyncio.sleep(0.005)
        cpu = time.process_time()
        committed, lag = await _steady(state, spec, start_at.value)
        return committed, lag, time.process_time() - cpu, time.time()
    finally:
        await db.close()


async def _steady(
    state: StateService, spec: WriterSpec, start_at: float
) -> tuple[list[Stamped], list[float]]:
    """Start ``spec.total`` applies, one every ``spec.interval`` s (round robin over its tasks);
    each transaction is the writer's own, so both ends of its COMMIT are stamped."""
    step = max(1, state.policy.min_points)
    attempts = spec.attempts
    progress = [0] * len(attempts)
    sequence = [0] * len(attempts)
    sem = asyncio.Semaphore(spec.workers)
    lag: list[float] = []
    committed: list[Stamped] = []
    jobs: list[asyncio.Task[None]] = []

    def observation(i: int) -> ProviderObservation:
        k = i % len(attempts)
        progress[k] = min(99, progress[k] + step)
        sequence[k] += 1
        return ProviderObservation(
            provider="sandbox",
            attempt_id=attempts[k],
            status=ProviderStatus.RUNNING,
            source=Source.POLL,
            provider_sequence=sequence[k],
            provider_occurred_at=datetime.now(UTC),
            progress=progress[k],
        )

    async def apply(first_i: int, count: int) -> None:
        batch = [observation(i) for i in range(first_i, first_i + count)]
        async with sem:
            async with state.db.transaction() as conn:
                if len(batch) == 1:
                    results = [await state.apply_in(conn, batch[0])]
                else:
                    results = await state.apply_many_in(conn, batch)
                sent = time.time()
            done = time.time()
        for result in results:
            if result.outcome is Outcome.APPLIED and result.task_id and result.task_version:
                committed.append(((str(result.task_id), result.task_version), (sent, done)))

    first = start_at + spec.offset
    size = max(1, spec.batch)
    for i in range(0, spec.total, size):
        # A batch leaves when its last observation is due: none is applied before its time.
        count = min(size, spec.total - i)
        delay = first + (i + count - 1) * spec.interval - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            lag.append(-delay * 1000)
        jobs.append(asyncio.create_task(apply(i, count)))
    await asyncio.gather(*jobs)
    return committed, lag
