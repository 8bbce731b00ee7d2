"""A chaos run's faults: the schedule played, each fault injected (processes killed or stopped,
connections cut, services restarted) and what was done recorded."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from typing import Any

from aivedio.chaos.config import Run
from aivedio.chaos.schedule import Fault, FaultKind
from aivedio.logs import log
from aivedio.services import embedded

logger = logging.getLogger("aivedio.chaos")

# -- faults ---------------------------------------------------------------------------------------


async def _faults(run: Run, schedule: list[Fault], started: float) -> None:
    for fault in schedule:
        await asyncio.sleep(max(0.0, started + fault.at_s - time.monotonic()))
        try:
            what = await _inject(run, fault)
        except Exception as exc:  # a fault that could not be injected is reported
            what = f"could not inject: {exc!r}"
        run.faults_done.append((fault, what))
        run.last_fault_end = time.monotonic()
        log(logger, logging.INFO, "fault", fault=fault.describe(), what=what)


def _role_members(run: Run) -> list[Any]:
    assert run.cluster is not None
    return [m for m in run.cluster.members if m.kind == "role" and m.pid is not None]


async def _inject(run: Run, fault: Fault) -> str:
    kind = fault.kind
    if kind is FaultKind.KILL_PROCESS:
        members = _role_members(run)
        victim = members[fault.target % len(members)]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        return f"SIGKILL {victim.name}"
    if kind is FaultKind.STOP_PROCESS:
        members = _role_members(run)
        victim = members[fault.target % len(members)]
        pid = victim.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(fault.hold_s)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        return f"SIGSTOP {victim.name} for {fault.hold_s:.1f} s"
    if kind is FaultKind.CUT_CONNECTIONS:
        cut = {name: proxy.cut() for name, proxy in run.proxies.items()}
        return "cut " + ", ".join(f"{n} {c}" for n, c in cut.items())
    if kind is FaultKind.RESTART_NATS and run.config.nats_cluster:
        assert run.cluster is not None
        nodes = [m for m in run.cluster.members if m.kind == "nats" and m.pid is not None]
        victim = nodes[fault.target % len(nodes)]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        return f"SIGKILL {victim.name} (the cluster restarts it)"
    name = {
        FaultKind.RESTART_POSTGRES: "postgres",
        FaultKind.RESTART_REDIS: "valkey",
        FaultKind.RESTART_NATS: "nats",
    }[kind]
    pid = embedded.pids(run.services).get(name)
    if pid is None:
        return f"{name} not running"
    os.kill(pid, signal.SIGKILL)
    await asyncio.sleep(fault.hold_s)
    await asyncio.to_thread(embedded.up, run.services)
    return f"SIGKILL {name}, started again after {fault.hold_s:.1f} s"
