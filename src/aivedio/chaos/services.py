"""A chaos run's services, proxies and cluster: embedded PostgreSQL, Valkey and NATS behind TCP
proxies the run cuts, ``aivedio cluster`` with the sandbox provider, every chaos knob on."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import asyncpg
import httpx

from aivedio.admin import create_project_in
from aivedio.chaos.config import Run
from aivedio.chaos.proxy import TcpProxy
from aivedio.cluster import Cluster, ClusterConfig
from aivedio.services import embedded

KNOBS: dict[str, Any] = {
    "duplicate_rate": 0.3,
    "reorder": 0.3,
    "delay_ms": [0, 300],
    "drop_rate": 0.1,
    "forge_signature_rate": 0.1,
    "stale_signature_rate": 0.1,
    "callback_before_submit_response": 0.3,
    "contradictory_terminal": 0.2,
    "query_429_rate": 0.1,
    "retry_after_s": 1,
    "query_5xx_rate": 0.1,
    "query_slow_ms": [0, 300],
}

# The cluster's processes run with these, so that a chaos run of a minute or two exercises what a
# production deployment sees over hours: leases shorter than a SIGSTOP, a quick stall eviction.
CLUSTER_ENV = {
    "AIVEDIO_GATEWAY_TAILCHECK_S": "2",
    "AIVEDIO_LOG_LEVEL": "INFO",
    # every lease and the bus's ack wait shorter than a SIGSTOP (stop_s, 8 s): the frozen
    # process's work is taken over, and its late writes must be fenced off when it wakes
    "AIVEDIO_INBOX_LEASE_S": "4",
    "AIVEDIO_POLL_LEASE_S": "4",
    "AIVEDIO_SUBMIT_LEASE_S": "4",
    "AIVEDIO_CANCEL_LEASE_S": "4",
    "AIVEDIO_MEDIA_LEASE_S": "4",
    "AIVEDIO_BUS_ACK_WAIT_S": "4",
    # the sandbox's contradictory_terminal knob is on: a success webhook lost (drop_rate) and
    # then a "failed" with the next sequence is the provider's word against its own record;
    # the inbox asks for the record before applying a terminal
    "AIVEDIO_INBOX_CONFIRM_TERMINALS": "1",
}


# -- services, proxies, cluster -------------------------------------------------------------------


async def _start(run: Run) -> None:
    urls = await asyncio.to_thread(embedded.up, run.services)
    run.real_database_url = urls.database_url
    targets = {"postgres": urls.database_url, "redis": urls.redis_url}
    if not run.config.nats_cluster:
        targets["nats"] = urls.nats_url
    proxied: dict[str, str] = {}
    for name, url in targets.items():
        parts = httpx.URL(url)
        proxy = TcpProxy(parts.host, parts.port or 0)
        await proxy.start()
        run.proxies[name] = proxy
        proxied[name] = url.replace(f":{parts.port}", f":{proxy.port}", 1)
    update: dict[str, Any] = {
        "database_url": proxied["postgres"],
        "redis_url": proxied["redis"],
        "data_dir": run.folder,
    }
    if "nats" in proxied:
        update["nats_url"] = proxied["nats"]
    run.settings = run.settings.model_copy(update=update)
    port = _free_port()
    cluster = Cluster(
        run.settings,
        ClusterConfig(
            data_dir=run.folder,
            replicas=run.config.replicas,
            split=run.config.split,
            nats_cluster=run.config.nats_cluster,
            sandbox=True,
            port=port,
            extra_env=CLUSTER_ENV,
        ),
    )
    run.cluster = cluster
    await cluster.start()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def _wait_ready(http: httpx.AsyncClient, url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if (await http.get(url, timeout=2)).status_code == 200:
                return
        await asyncio.sleep(0.25)
    raise RuntimeError(f"{url} did not become ready within {timeout_s:.0f} s")


async def _sandbox(run: Run) -> httpx.AsyncClient:
    assert run.cluster is not None
    assert run.cluster.sandbox_url is not None
    sandbox = httpx.AsyncClient(
        base_url=run.cluster.sandbox_url,
        headers={"Authorization": f"Bearer {run.settings.sandbox_api_key}"},
        timeout=10,
    )
    await _wait_ready(sandbox, "/healthz")
    knobs = KNOBS | {"seed": run.config.seed}
    (await sandbox.put("/_sandbox/chaos", json=knobs)).raise_for_status()
    return sandbox


async def _make_projects(run: Run) -> None:
    conn = await asyncpg.connect(run.real_database_url)
    try:
        for n in range(run.config.projects):
            run.projects.append(await create_project_in(conn, f"chaos-{n}", f"p{n}"))
    finally:
        await conn.close()
