"""The pipeline of ``aivedio bench propagation`` in child processes: relays and a dispatcher, as
separate roles would run, started together and timed by their CPU."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.synchronize
import time
from dataclasses import dataclass, replace
from typing import Any

from aivedio.bench.propagation_options import Options
from aivedio.bus import BusConfig
from aivedio.config import DatabaseConfig
from aivedio.db.pool import Database
from aivedio.fanout.redis import RedisFanout
from aivedio.propagation.dispatcher import DispatcherConfig, NotificationDispatcher
from aivedio.propagation.relay import OutboxRelay, RelayConfig

# -- the pipeline in child processes ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChildSpec:
    database_url: str
    bus: BusConfig
    redis_url: str
    prefix: str
    relays: int
    dispatchers: int
    batch: int


def _child(spec: ChildSpec, ready: Any, go: Any, stop: Any, cpu: Any) -> None:
    """One pipeline process, on uvloop like ``aivedio run``; reports its CPU seconds."""
    import uvloop

    uvloop.run(_child_main(spec, ready, go, stop, cpu))


async def _child_main(spec: ChildSpec, ready: Any, go: Any, stop: Any, cpu: Any) -> None:
    from aivedio.bus.connect import connect

    db = await Database.connect(
        DatabaseConfig(url=spec.database_url, min_size=1, max_size=spec.relays + 2)
    )
    bus = await connect(spec.bus)
    fanout = RedisFanout.from_url(spec.redis_url)
    stopping = asyncio.Event()
    relay_cfg = RelayConfig(batch_size=spec.batch, stats_interval_s=3600)
    dispatch_cfg = DispatcherConfig(channel_prefix=spec.prefix, batch_size=spec.batch)
    loops = [OutboxRelay(db, bus, relay_cfg).run for _ in range(spec.relays)]
    loops += [
        NotificationDispatcher(bus, fanout, dispatch_cfg).run for _ in range(spec.dispatchers)
    ]
    ready.set()
    # Nobody starts before everybody is connected: the clock starts at ``go``, so a relay that
    # came up first cannot drain part of the backlog off the clock.
    while not go.is_set():  # noqa: ASYNC110 - a multiprocessing event, not an asyncio one
        await asyncio.sleep(0.001)
    jobs = [asyncio.create_task(loop(stopping)) for loop in loops]
    started = time.process_time()
    while not stop.is_set():  # noqa: ASYNC110 - a multiprocessing event, not an asyncio one
        await asyncio.sleep(0.05)
    cpu.value = time.process_time() - started  # the work, not the start-up and the shutdown
    stopping.set()
    await asyncio.gather(*jobs, return_exceptions=True)
    await fanout.close()
    await bus.close()
    await db.close()


@contextlib.asynccontextmanager
async def _pipeline(specs: list[ChildSpec], cpu: dict[str, float] | None = None) -> Any:
    """Run the children for the block; ``cpu`` gets their CPU seconds by role once they end."""
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    go = ctx.Event()
    children = []
    used = []
    for spec in specs:
        ready = ctx.Event()
        seconds = ctx.Value("d", 0.0)
        proc = ctx.Process(target=_child, args=(spec, ready, go, stop, seconds), daemon=True)
        proc.start()
        children.append((proc, ready))
        used.append(("relay" if spec.relays else "dispatcher", seconds))
    try:
        for proc, ready in children:
            while not ready.is_set():
                if not proc.is_alive():
                    raise RuntimeError("a pipeline process failed to start")
                await asyncio.sleep(0.02)
        go.set()
        yield
    finally:
        stop.set()
        for proc, _ in children:
            await asyncio.to_thread(proc.join, 20)
            if proc.is_alive():
                proc.kill()
        if cpu is not None:
            for role, seconds in used:
                cpu[role] = cpu.get(role, 0.0) + seconds.value


def _specs(url: str, bus: BusConfig, redis_url: str, prefix: str, opts: Options) -> list[ChildSpec]:
    base = ChildSpec(url, bus, redis_url, prefix, relays=1, dispatchers=0, batch=opts.batch)
    return [base for _ in range(opts.relays)] + [replace(base, relays=0, dispatchers=1)]


def _cpu_line(cpu: dict[str, float], events: int) -> str:
    """CPU per event by role: comparable across runs on a busy machine, unlike wall time."""
    return ", ".join(
        f"{role} {seconds:.2f} s ({seconds / max(events, 1) * 1e6:.0f} us/event)"
        for role, seconds in sorted(cpu.items())
    )
