"""``aivedio chaos``: a cluster on its own embedded services, every sandbox chaos knob on, a fault
schedule, browsers that resume by cursor, and the invariant table at the end.

The run owns its services: embedded PostgreSQL, Valkey and NATS (or a three-node NATS cluster) in
a fresh data folder, because it kills and restarts them; the cluster's processes reach
PostgreSQL, Valkey and the single NATS through TCP proxies that the run cuts. Phases:

1. start services, proxies and ``aivedio cluster`` (with the sandbox provider); turn every chaos
   knob on; create the projects; connect the clients (before any task, seed 004);
2. create the tasks over the first part of the fault window (each create retried with its
   ``Idempotency-Key`` until it is accepted: the API is down during some faults) while the
   fault schedule runs;
3. after the last fault, wait for convergence (every task final, as the provider's truth says);
4. wait for the clients to read up to each stream's head; check the invariants; print the table
   and one JSON line; exit 1 on any violation.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from aivedio.chaos.check import _converge
from aivedio.chaos.clients import SlowReader, StreamWatcher
from aivedio.chaos.config import ChaosConfig, Run
from aivedio.chaos.faults import _faults
from aivedio.chaos.report import _report
from aivedio.chaos.schedule import plan
from aivedio.chaos.services import _make_projects, _sandbox, _start, _wait_ready
from aivedio.chaos.tasks import _create_tasks
from aivedio.config import ServicesConfig, Settings
from aivedio.logs import setup_logging
from aivedio.services import embedded

__all__ = ["ChaosConfig", "run_chaos"]

# -- the run --------------------------------------------------------------------------------------


async def _main(settings: Settings, cfg: ChaosConfig, folder: Path) -> int:
    services = ServicesConfig(data_dir=folder, database_url=None, redis_url=None, nats_url=None)
    if cfg.nats_cluster:
        services = ServicesConfig(
            data_dir=folder, database_url=None, redis_url=None, nats_url="nats://unused"
        )
    run = Run(cfg, random.Random(cfg.seed), folder, services, settings)
    schedule = plan(cfg.seed, cfg.window_s, cfg.interval_s, cfg.kinds)
    print(
        f"aivedio chaos: seed {cfg.seed}, {cfg.tasks} tasks, {cfg.projects} projects, "
        f"{cfg.replicas} replicas{' (split)' if cfg.split else ''}, "
        f"{'3 NATS nodes' if cfg.nats_cluster else 'one NATS'}; data in {folder}",
        flush=True,
    )
    for fault in schedule:
        print(f"  planned {fault.describe()}", flush=True)
    stopping = asyncio.Event()
    cluster_stopping = asyncio.Event()
    watchers: list[Any] = []
    supervise: asyncio.Task[None] | None = None
    report: dict[str, Any] = {"ok": False, "error": "the run did not finish"}
    try:
        await _start(run)
        assert run.cluster is not None
        supervise = asyncio.create_task(run.cluster.run(cluster_stopping))
        http = httpx.AsyncClient(base_url=run.cluster.api_url, timeout=10)
        await _wait_ready(http, "/readyz")
        sandbox = await _sandbox(run)
        await _make_projects(run)
        watchers = await _start_clients(run)
        readers = [asyncio.create_task(w.run(stopping)) for w in watchers]
        started = time.monotonic()
        creating = asyncio.create_task(_create_tasks(run, http, stopping))
        await _faults(run, schedule, started)
        await creating
        outcomes, converged_s = await _converge(run, sandbox)
        report = await _report(run, sandbox, watchers, outcomes, converged_s)
        stopping.set()
        for reader in readers:  # a reader may be waiting for a frame that never comes
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await http.aclose()
        await sandbox.aclose()
    finally:
        stopping.set()
        cluster_stopping.set()
        if supervise is not None:
            await asyncio.gather(supervise, return_exceptions=True)
        for w in watchers:
            await w.aclose()
        for proxy in run.proxies.values():
            await proxy.close()
        await asyncio.to_thread(embedded.down, services)
    ok = bool(report["ok"])
    if ok and cfg.data_dir is None and not cfg.keep:
        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(report), flush=True)
    return 0 if ok else 1


async def _start_clients(run: Run) -> list[Any]:
    assert run.cluster is not None
    base = run.cluster.api_url
    watchers: list[Any] = []
    for n, project in enumerate(run.projects):
        pid, key = project["project_id"], project["api_key"]
        watchers.append(StreamWatcher(f"sse-{n}", base, key, pid, transport="sse"))
        watchers.append(StreamWatcher(f"ws-{n}", base, key, pid, transport="ws"))
        watchers.append(
            StreamWatcher(
                f"hop-{n}",
                base,
                key,
                pid,
                transport="sse" if n % 2 else "ws",
                hop_s=(1.0, 4.0),
                rng=random.Random(run.config.seed + n),
            )
        )
    for w in watchers:
        await w.start()
    first = watchers[0]
    watchers.append(
        SlowReader(
            "slow-0",
            base,
            run.projects[0]["api_key"],
            run.projects[0]["project_id"],
            cursor=str(first.client.view.cursor),
            start_seq=first.log.start_seq,
            stall_s=8.0,
        )
    )
    return watchers


async def _interruptible(settings: Settings, config: ChaosConfig, folder: Path) -> int:
    """``_main``, cancelled (so that it stops the cluster and the services) on SIGINT/SIGTERM."""
    main = asyncio.current_task()
    assert main is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main.cancel)
    try:
        return await _main(settings, config, folder)
    except asyncio.CancelledError:
        print(f"aivedio chaos: interrupted; data in {folder}", flush=True)
        return 130


def run_chaos(settings: Settings, config: ChaosConfig) -> int:
    setup_logging(settings.log_level)
    folder = Path(config.data_dir or tempfile.mkdtemp(prefix="aivedio-chaos-")).absolute()
    code: int = asyncio.run(_interruptible(settings, config, folder))
    return code
