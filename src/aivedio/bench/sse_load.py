"""The SSE load generator shared by ``bench connections`` and ``bench fanout``.

- ``GatewayProcess`` (in ``sse_load_gateway``): the gateway under test
  (``aivedio.bench.gateway_server``) in a process of its own, with its RSS
  (``/proc/<pid>/status`` VmRSS) and CPU time (``/proc/<pid>/stat``).
- ``ClientFleet``: client processes (spawned; the client is ``sse_load_client``), each holding
  its share of the connections as raw asyncio protocols: one request write, then a byte parser
  that splits frames on a blank line and records, per read, one ``time.time()`` stamp (every
  process on the machine shares that clock): ``: ping`` arrivals per connection, and the receive
  times of each event by seq. A process reports back through its pipe: first how many
  connections it established, then, on ``stop``, everything it recorded.
- ``gateway_under_test`` (in ``sse_load_gateway``): scratch database, a project with an API key,
  a unique Redis channel and key prefix, the gateway process; all removed afterwards, also on
  failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from array import array
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from aivedio.bench.sse_load_client import ClientSpec, Report, client_process
from aivedio.bench.sse_load_gateway import (
    FDS_PER_PROCESS,
    GatewayProcess,
    Target,
    gateway_under_test,
    raise_open_files,
)

# -- the fleet (bench driver side) -----------------------------------------------------------


def split(total: int, parts: int) -> list[int]:
    """``total`` connections over ``parts`` processes, as evenly as possible."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts) if base or i < extra]


@dataclass(slots=True)
class Ready:
    established: int = 0
    failed: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0


class ClientFleet:
    """Client processes holding ``total`` connections to one project's stream."""

    def __init__(self, target: Target, total: int, procs: int, record_events: bool) -> None:
        self.specs = [
            ClientSpec(
                "127.0.0.1",
                target.gateway.port,
                str(target.project_id),
                target.api_key,
                n,
                record_events=record_events,
            )
            for n in split(total, procs)
        ]
        ctx = multiprocessing.get_context("spawn")
        self.pipes: list[Connection] = []
        self.procs: list[Any] = []
        for spec in self.specs:
            mine, theirs = ctx.Pipe()
            self.procs.append(ctx.Process(target=client_process, args=(spec, theirs), daemon=True))
            self.pipes.append(mine)

    async def connect(self, timeout_s: float = 300.0) -> Ready:
        """Start the processes; returns once every one has opened its connections."""
        started = time.perf_counter()
        for proc in self.procs:
            proc.start()
        ready = Ready()
        for pipe, proc in zip(self.pipes, self.procs, strict=True):
            kind, established, failed, failures = await _receive(pipe, proc, timeout_s)
            assert kind == "ready"
            ready.established += established
            ready.failed += failed
            ready.failures.update(failures)
        ready.seconds = time.perf_counter() - started
        return ready

    async def stop(self, timeout_s: float = 120.0) -> Report:
        """Close every connection; the merged reports of all processes."""
        for pipe in self.pipes:
            pipe.send("stop")
        merged = Report()
        for pipe, proc in zip(self.pipes, self.procs, strict=True):
            kind, report = await _receive(pipe, proc, timeout_s)
            assert kind == "report"
            merged.established += report.established
            merged.failed += report.failed
            merged.failures.update(report.failures)
            merged.lost += report.lost
            merged.closes.update(report.closes)
            merged.resets += report.resets
            merged.pings.extend(report.pings)
            merged.cpu_s += report.cpu_s
            merged.connect_s = max(merged.connect_s, report.connect_s)
            for seq, times in report.events.items():
                merged.events.setdefault(seq, array("d")).extend(times)
        return merged

    async def close(self) -> None:
        """Reap the processes (kill what does not exit); safe to call after a failure."""
        for proc in self.procs:
            if proc.pid is None:
                continue
            await asyncio.to_thread(proc.join, 10)
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, 5)
        for pipe in self.pipes:
            pipe.close()


async def _receive(pipe: Connection, proc: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(pipe.poll, 0.2):
        if not proc.is_alive():
            raise RuntimeError(f"client process {proc.pid} exited ({proc.exitcode})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"client process {proc.pid} did not answer in {timeout_s:g} s")
    return pipe.recv()


@contextlib.asynccontextmanager
async def fleet(
    target: Target, total: int, procs: int, record_events: bool
) -> AsyncIterator[ClientFleet]:
    clients = ClientFleet(target, total, procs, record_events)
    try:
        yield clients
    finally:
        for pipe in clients.pipes:
            with contextlib.suppress(OSError):
                pipe.send("stop")
        await clients.close()


__all__ = [
    "FDS_PER_PROCESS",
    "ClientFleet",
    "GatewayProcess",
    "Ready",
    "Report",
    "Target",
    "fleet",
    "gateway_under_test",
    "raise_open_files",
    "split",
]
