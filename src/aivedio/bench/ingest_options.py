"""The options of ``aivedio bench ingest``; the provider and secret its callbacks are signed."""

from __future__ import annotations

import base64
from dataclasses import dataclass

SECRET = "whsec_" + base64.b64encode(b"aivedio-bench-ingest-secret-0001").decode()
PROVIDER = "sandbox"


@dataclass(frozen=True)
class IngestOptions:
    seconds: float = 10.0
    """Length of each measured phase (and of each pgbench run)."""
    warmup: float = 2.0
    """Closed-loop warm-up before the maximum-rate phase (not counted)."""
    connections: int = 128
    """Concurrent client connections (senders with one callback in flight each). Group commit
    needs callbacks in flight to batch: 64 gave ~16.6k/s here, 96 ~17.0k, 128 ~17.9-18.1k."""
    pgbench_clients: str = "8,32,64"
    """pgbench ``-c`` values; the best TPS is the ceiling (here its best is at 32-64 clients: 96
    measured lower, 14.9k against 15.5k at 32; 128 exceeds a default max_connections of 100)."""
    linger_ms: float = 0.0
    """Group commit: how long a batch that is not full waits for more rows (as in production:
    ``GroupCommitConfig.linger_s``)."""
    max_batch: int = 512
    max_inflight: int = 1
    """Group commit: batches being inserted at once, per server process
    (``AIVEDIO_CALLBACK_MAX_INFLIGHT``): 1 with one process per core, as measured best here
    (two processes: 15.7-16.7k/s with 1, 14.4-15.2k/s with 2; one process: 2 is best)."""
    pool_size: int = 4
    path: str = "lean"
    """How callbacks are served: lean (the production path: sniffer + ``aivedio.ingest.http``)
    or asgi (uvicorn, Starlette and the trace middleware: the path before the lean one)."""
    http: str = "auto"
    """uvicorn's HTTP parser for ``path=asgi``: auto (httptools when installed, else h11), h11,
    httptools."""
    loop: str = "uvloop"
    """The server's event loop: uvloop (as ``aivedio run``) or asyncio."""
    client_processes: int = 1
    """Load-generator processes (connections and rate split between them)."""
    repeats: int = 2
    """pgbench and the max-rate phase run this many times, alternately; each side's best run
    counts (the machine's spells of noise moved either by +-10 % between runs)."""
    server_processes: int = 0
    """Server processes on the port; 0: one per CPU. 1 serves in this process; more start that
    many processes binding it with ``SO_REUSEPORT``, as ``aivedio run --reuse-port`` once per
    core would (each with its own pool of ``pool_size`` and its own group commit)."""
