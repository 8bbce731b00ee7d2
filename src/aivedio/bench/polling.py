"""``aivedio bench polling``: thousands of in-flight attempts polled against a capped provider.

In a scratch database: ``attempts`` tasks over ``tenants`` tenants, each submitted to a sandbox
provider that runs in its own process with ``rate_cap_qps = cap`` and webhooks off, with long
timelines (queued for 20-60 s, then running for an hour) so every task stays in flight. The
submissions themselves go through a token bucket under the cap. Then the sandbox's counters are
reset and ``replicas`` pollers (each with its own pool, Redis client and limiter, in this process)
poll for ``seconds``.

Figures:

- per-second request counts at the provider (its ``per_second.requests``: every arrival,
  admitted or not), ``max_rps`` and ``seconds_over_cap`` (target 0);
- ``gap_p99_ratio``: for every pair of consecutive polls of one attempt, the gap between the two
  sends divided by the interval the scheduler TARGETED at the first one, i.e. the time from that
  send to the ``next_poll_at`` it wrote (query time + the stretched, jittered delay). 7,200
  attempts at 200 QPS cannot be polled more often than every 36 s on average, while the interval
  table asks for 5-30 s: the scheduler stretches every interval by demand / (limit x
  utilization) and this ratio says whether it then keeps the promise it made (target <= 1.5).
  ``nominal_gap_p50_ratio`` is the gap against the un-stretched table interval, so the stretch is
  visible rather than hidden;
- database statements per poll, counted by the poller (claims, releases, the demand read,
  applies with BEGIN/COMMIT, reschedules) and, as a cross-check, committed transactions per poll
  from ``pg_stat_database``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import socket
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpx
import redis.asyncio as aioredis

from aivedio.admin import create_project_in
from aivedio.bench.common import (
    BenchUsageError,
    build_options,
    database_url,
    percentile,
    print_json_line,
    rounded,
    scratch_database,
)
from aivedio.config import DatabaseConfig, Settings
from aivedio.db.pool import Database
from aivedio.domain.observation import PlatformKind, PlatformObservation, Source
from aivedio.polling.buckets import Limit
from aivedio.polling.claimed import PollRecord
from aivedio.polling.config import PollerConfig, RateLimitConfig
from aivedio.polling.poller import Poller
from aivedio.polling.ratelimit import RateLimiter, Scope
from aivedio.providers.http import HttpConfig
from aivedio.providers.port import ProviderError, SubmitRequest
from aivedio.providers.sandbox import SandboxAdapter
from aivedio.runtime import resolve_urls
from aivedio.state.service import StateService
from aivedio.state.tasks import NewTask, Principal, TaskStore

API_KEY = "sk_bench_polling"
SECRET = "whsec_YmVuY2gtcG9sbGluZy1zZWNyZXQtYmVuY2gtcG9sbGluZw=="  # noqa: S105 (a test key)


@dataclass(frozen=True, slots=True)
class Options:
    attempts: int = 7200
    cap: int = 200
    replicas: int = 3
    seconds: float = 120.0
    tenants: int = 8
    limit_qps: float = 170.0  # the provider bucket: rate + burst + delay spread < cap
    burst: float = 8.0
    concurrency: int = 64
    create_workers: int = 48
    seed: int = 1

    def check(self) -> None:
        for name in ("attempts", "cap", "replicas", "tenants", "concurrency", "create_workers"):
            if getattr(self, name) < 1:
                raise BenchUsageError(f"{name} must be at least 1")
        if self.seconds <= 0 or self.limit_qps <= 0 or self.burst < 1:
            raise BenchUsageError("seconds and limit_qps must be positive, burst at least 1")
        if self.limit_qps + self.burst > self.cap:
            raise BenchUsageError("limit_qps + burst must stay below cap")


def run(settings: Settings, options: Mapping[str, str]) -> int:
    opts = build_options(Options, options)
    opts.check()
    return asyncio.run(_run(settings, opts))


# -- the sandbox in its own process ---------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


_SANDBOX = """
import asyncio, sys
from aivedio.sandbox import SandboxConfig, serve
port, cap, key, secret = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
config = SandboxConfig(api_key=key, webhook_secrets=(secret,),
                       public_url=f"http://127.0.0.1:{port}", rate_cap_qps=cap,
                       queue_s=30, duration_s=3600, steps=60, seed=1)
asyncio.run(serve(config, "127.0.0.1", port))
"""


@contextlib.asynccontextmanager
async def _sandbox(cap: int) -> Any:
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _SANDBOX,
        str(port),
        str(cap),
        API_KEY,
        SECRET,
        stdout=asyncio.subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{url}/healthz")).status_code == 200:
                        break
                if time.monotonic() > deadline or proc.returncode is not None:
                    raise RuntimeError("the sandbox provider did not start")
                await asyncio.sleep(0.1)
            yield url, http
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def _admin(http: httpx.AsyncClient, url: str, method: str, path: str, **kw: Any) -> Any:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    response = await http.request(method, f"{url}{path}", headers=auth, **kw)
    response.raise_for_status()
    return response.json()


# -- setup: create and submit ----------------------------------------------------------------


async def _create_and_submit(
    db: Database, state: StateService, sandbox_url: str, opts: Options
) -> int:
    principals = await _principals(db, opts)
    store = TaskStore(db, state, timedelta(hours=1))
    creates = RateLimiter(None, RateLimitConfig(global_limit=Limit(opts.limit_qps, opts.burst)))
    adapter = _adapter(sandbox_url)
    rand = random.Random(opts.seed)
    queue = list(range(opts.attempts))
    done = 0

    async def creator() -> None:
        nonlocal done
        while queue:
            i = queue.pop()
            project_id, principal = principals[i % len(principals)]
            script = {"queue_s": rand.uniform(20, 60), "duration_s": 3600.0, "steps": 60}
            body = NewTask(provider="sandbox", model="bench", prompt="a cat", params={})
            created = await store.create(principal, project_id, f"bench-{i}", body, None)
            task_id = uuid.UUID(created.snapshot["id"])
            async with db.connection() as conn:
                row = await conn.fetchrow(
                    "SELECT a.id, a.client_request_id FROM task_attempts a "
                    "JOIN generation_tasks t ON t.current_attempt_id = a.id WHERE t.id = $1",
                    task_id,
                )
            assert row is not None
            await _token(creates)
            try:
                result = await adapter.submit(
                    SubmitRequest(
                        client_request_id=row["client_request_id"],
                        model="bench",
                        prompt="a cat",
                        params={"sandbox": script},
                    )
                )
            except ProviderError as exc:
                print(f"  submit failed: {exc}", flush=True)
                continue
            await _accepted(db, state, row["id"], result.provider_task_id, rand.uniform(0, 5))
            done += 1

    try:
        await asyncio.gather(*(creator() for _ in range(opts.create_workers)))
    finally:
        await adapter.aclose()
    return done


async def _principals(db: Database, opts: Options) -> list[tuple[uuid.UUID, Principal]]:
    """One project (and its principal) per bench tenant."""
    principals: list[tuple[uuid.UUID, Principal]] = []
    async with db.connection() as conn:
        for i in range(opts.tenants):
            made = await create_project_in(conn, f"bench-tenant-{i}", "bench")
            principal = Principal(uuid.UUID(made["tenant_id"]), uuid.UUID(made["user_id"]))
            principals.append((uuid.UUID(made["project_id"]), principal))
    return principals


async def _accepted(
    db: Database,
    state: StateService,
    attempt_id: uuid.UUID,
    provider_task_id: str,
    first_poll_s: float,
) -> None:
    """Record a bench submit as the submitter would: provider task id, first poll, accepted."""
    async with db.transaction() as conn:
        await conn.execute(
            "UPDATE task_attempts SET provider_task_id = $2, "
            "next_poll_at = now() + make_interval(secs => $3) WHERE id = $1",
            attempt_id,
            provider_task_id,
            first_poll_s,
        )
        await state.apply_in(
            conn,
            PlatformObservation(
                kind=PlatformKind.SUBMIT_ACCEPTED,
                attempt_id=attempt_id,
                source=Source.SUBMIT,
            ),
        )


async def _token(limiter: RateLimiter) -> None:
    """Wait for one create token (the creates stay under the provider's cap too)."""
    for _ in range(100_000):
        grant = await limiter.take(Scope("sandbox", "bench", "all"))
        if grant.granted:
            return
        await asyncio.sleep(grant.wait_s)


def _adapter(url: str) -> SandboxAdapter:
    return SandboxAdapter(
        base_url=url,
        api_key=API_KEY,
        webhook_secrets=(("k0", SECRET),),
        public_url=None,
        http=HttpConfig(max_connections=64),
    )


# -- the run ---------------------------------------------------------------------------------


async def _run(settings: Settings, opts: Options) -> int:
    print(
        f"polling: {opts.attempts} attempts, {opts.tenants} tenants, cap {opts.cap} QPS, "
        f"provider bucket {opts.limit_qps:g}/s burst {opts.burst:g}, {opts.replicas} replicas, "
        f"{opts.seconds:g} s",
        flush=True,
    )
    urls = resolve_urls(settings)
    prefix = f"aivedio:bench:{uuid.uuid4().hex[:10]}"
    async with (
        scratch_database(database_url(settings), "aivedio_bench_poll") as url,
        _sandbox(opts.cap) as (sandbox_url, http),
    ):
        await _admin(http, sandbox_url, "PUT", "/_sandbox/chaos", json={"webhooks_enabled": False})
        setup_db = await Database.connect(DatabaseConfig(url=url, min_size=4, max_size=24))
        try:
            started = time.perf_counter()
            submitted = await _create_and_submit(
                setup_db, StateService(setup_db), sandbox_url, opts
            )
            print(
                f"  setup: {submitted} attempts submitted in {time.perf_counter() - started:.1f} s"
            )
            async with setup_db.connection() as conn:
                commits_before = await _commits(conn)
        finally:
            await setup_db.close()
        await _admin(http, sandbox_url, "POST", "/_sandbox/reset")
        await _admin(http, sandbox_url, "PUT", "/_sandbox/chaos", json={"webhooks_enabled": False})
        run_started = time.time()
        pollers, records = await _poll(url, urls.redis_url, sandbox_url, prefix, opts)
        run_ended = time.time()
        stats = await _admin(http, sandbox_url, "GET", "/_sandbox/stats")
        check_db = await Database.connect(DatabaseConfig(url=url, min_size=1, max_size=2))
        try:
            async with check_db.connection() as conn:
                commits = await _commits(conn) - commits_before
                in_flight = await conn.fetchval(
                    "SELECT count(*) FROM task_attempts WHERE next_poll_at IS NOT NULL"
                )
        finally:
            await check_db.close()
    return _report(opts, pollers, records, stats, commits, run_started, run_ended, in_flight)


async def _commits(conn: Any) -> int:
    value = await conn.fetchval(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
    )
    return int(value or 0)


async def _poll(
    url: str, redis_url: str, sandbox_url: str, prefix: str, opts: Options
) -> tuple[list[Poller], list[PollRecord]]:
    limits = RateLimitConfig(
        prefix=prefix,
        global_limit=Limit(opts.limit_qps * 2, opts.burst * 2),
        providers={"sandbox": Limit(opts.limit_qps, opts.burst)},
        tenant=Limit(opts.limit_qps, opts.burst),
        replicas=opts.replicas,
    )
    config = PollerConfig(concurrency=opts.concurrency, batch=64, limits=limits)
    records: list[PollRecord] = []
    stopping = asyncio.Event()
    dbs: list[Database] = []
    clients: list[aioredis.Redis] = []
    adapters: list[SandboxAdapter] = []
    pollers: list[Poller] = []
    try:
        for i in range(opts.replicas):
            db = await Database.connect(DatabaseConfig(url=url, min_size=2, max_size=16))
            dbs.append(db)
            r = aioredis.from_url(redis_url, socket_timeout=0.25, socket_connect_timeout=0.25)
            clients.append(r)
            adapter = _adapter(sandbox_url)
            adapters.append(adapter)
            pollers.append(
                Poller(
                    db,
                    StateService(db),
                    {"sandbox": adapter},
                    RateLimiter(r, limits),
                    config,
                    redis=r,
                    rand=random.Random(opts.seed + i),
                    name=f"replica-{i}",
                    on_poll=records.append,
                )
            )
        jobs = [asyncio.create_task(p.run(stopping)) for p in pollers]
        reporter = asyncio.create_task(_progress(records, stopping))
        await asyncio.sleep(opts.seconds)
        stopping.set()
        await asyncio.gather(*jobs, reporter)
    finally:
        stopping.set()
        for adapter in adapters:
            await adapter.aclose()
        for r in clients:
            await r.aclose()
        for db in dbs:
            await db.close()
    return pollers, records


async def _progress(records: list[PollRecord], stopping: asyncio.Event) -> None:
    last, at = 0, time.monotonic()
    while not stopping.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), 10)
        now = time.monotonic()
        count = len(records)
        print(f"  {count} polls, {(count - last) / (now - at):.0f}/s", flush=True)
        last, at = count, now


# -- figures ---------------------------------------------------------------------------------


def _gap_ratios(records: list[PollRecord]) -> tuple[list[float], list[float]]:
    by_attempt: dict[uuid.UUID, list[PollRecord]] = defaultdict(list)
    for r in records:
        by_attempt[r.attempt_id].append(r)
    targeted: list[float] = []
    nominal: list[float] = []
    for polls in by_attempt.values():
        polls.sort(key=lambda r: r.sent_at)
        for a, b in itertools.pairwise(polls):
            if a.delay_s is None:
                continue
            gap = b.sent_at - a.sent_at
            target = a.delay_s + (a.answered_at - a.sent_at)
            if target > 0:
                targeted.append(gap / target)
            if a.nominal_s > 0:
                nominal.append(gap / a.nominal_s)
    return targeted, nominal


def _report(
    opts: Options,
    pollers: list[Poller],
    records: list[PollRecord],
    stats: Mapping[str, Any],
    commits: int,
    started: float,
    ended: float,
    in_flight: int,
) -> int:
    per_second = {int(k): v for k, v in stats["per_second"]["requests"].items()}
    seconds = range(int(started), int(ended) + 1)
    counts = [per_second.get(s, 0) for s in seconds]
    busy = counts[5:-1] or counts  # steady state: skip the start and the last second
    print("  requests per second at the provider:")
    for i in range(0, len(counts), 20):
        print("   ", " ".join(f"{c:3d}" for c in counts[i : i + 20]))
    max_rps = max(counts, default=0)
    over = sum(c > opts.cap for c in counts)
    targeted, nominal = _gap_ratios(records)
    polls = sum(p.stats.polls for p in pollers)
    statements = sum(p.stats.statements for p in pollers)
    outcomes: dict[str, int] = defaultdict(int)
    for p in pollers:
        for k, v in p.stats.outcomes.items():
            outcomes[k] += v
    stretches = [r.stretch for r in records]
    lags = [r.lag_s for r in records]
    covered = len({r.attempt_id for r in records})
    figures = {
        "bench": "polling",
        "attempts": opts.attempts,
        "replicas": opts.replicas,
        "seconds": opts.seconds,
        "cap_rps": opts.cap,
        "max_rps": max_rps,
        "mean_rps": rounded(sum(busy) / len(busy) if busy else 0.0, 1),
        "seconds_over_cap": over,
        "rejected_by_cap": stats["requests"].get("rejected_by_rate_cap", 0),
        "polls": polls,
        "attempts_polled": covered,
        "attempts_in_flight": in_flight,
        "gap_pairs": len(targeted),
        "gap_p50_ratio": rounded(percentile(targeted, 50)),
        "gap_p99_ratio": rounded(percentile(targeted, 99)),
        "nominal_gap_p50_ratio": rounded(percentile(nominal, 50)),
        "stretch_p50": rounded(percentile(stretches, 50)),
        "lag_p99_s": rounded(percentile(lags, 99)),
        "statements_per_poll": rounded(statements / polls if polls else float("nan")),
        "commits_per_poll": rounded(commits / polls if polls else float("nan")),
        "outcomes": dict(outcomes),
        "skipped_unchanged": sum(p.stats.skipped for p in pollers),
        "applied": sum(p.stats.applied for p in pollers),
        "released": sum(p.stats.released for p in pollers),
    }
    _print_summary(opts, figures)
    print_json_line(figures)
    return 0


def _print_summary(opts: Options, figures: dict[str, Any]) -> None:
    print(
        f"  max {figures['max_rps']}/s (cap {opts.cap}), {figures['seconds_over_cap']} s over "
        f"the cap, {figures['mean_rps']}/s steady; {figures['polls']} polls of "
        f"{figures['attempts_polled']} attempts"
    )
    print(
        f"  gap / targeted interval: p50 {figures['gap_p50_ratio']}, "
        f"p99 {figures['gap_p99_ratio']} over {figures['gap_pairs']} gaps; stretch p50 "
        f"{figures['stretch_p50']}, gap / table interval p50 {figures['nominal_gap_p50_ratio']}"
    )
    print(
        f"  {figures['statements_per_poll']} statements per poll (counted), "
        f"{figures['commits_per_poll']} commits per poll (pg_stat_database); "
        f"outcomes {json.dumps(figures['outcomes'])}"
    )


__all__ = ["Options", "run"]
