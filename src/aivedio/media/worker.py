"""The media worker: claims due media operations and runs them to ``ready`` (or ``failed``).

One run of an operation: locate the provider output (a fresh signed URL every run, never a
stored one), download it, keep the original in the object store, probe it, render the H.264 MP4
rendition, store it, then publish: the asset row, the operation's success and the task's
``MEDIA_READY`` observation commit in ONE transaction. Each stage is reported through the state
service before it starts (``ingesting -> probing -> transcoding -> publishing``).

Any number of workers (in any number of processes) share the table: a claim takes due rows with
``FOR UPDATE SKIP LOCKED`` and a lease with a fresh ``lease_token``. Every later write of that
run (stage, retry, failure, publish) is conditional on the token, and the lease is renewed while
the run lasts; a worker whose lease was taken over is cancelled and writes nothing more. So one
operation never has two live runs, and a dead worker's operation is picked up after its lease
(one the database interrupted as soon as the database is back: :mod:`aivedio.db.leases`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from prometheus_client import Counter, Histogram

from aivedio.db.leases import LeftLeases
from aivedio.db.pool import Database
from aivedio.db.queries import q
from aivedio.domain.observation import PlatformKind, PlatformObservation, Source
from aivedio.domain.public import PUBLIC_ERRORS
from aivedio.domain.statuses import Stage, Status, is_terminal
from aivedio.domain.transitions import Outcome, Reason
from aivedio.errors import DatabaseUnavailable
from aivedio.logs import log, trace_id_var
from aivedio.media.config import MediaConfig
from aivedio.media.errors import (
    MediaError,
    MediaRejected,
    OutputExpired,
    OutputUnavailable,
    RetryableMediaError,
    Superseded,
    TransientMediaError,
)
from aivedio.media.fetch import download
from aivedio.media.locator import OutputLocator, redact_url
from aivedio.media.pipeline import Probe, probe, render
from aivedio.process import health
from aivedio.state.service import StateService
from aivedio.storage.port import ObjectStore, StorageError

logger = logging.getLogger("aivedio.media")

RENDITION_TYPE = "video/mp4"

MEDIA_RUNS = Counter(
    "aivedio_media_runs_total",
    "Media operation runs, by outcome (succeeded, retried, failed, superseded, lease_lost)",
    ["outcome"],
)
MEDIA_FAILURES = Counter(
    "aivedio_media_failures_total", "Media failures, by class and public code", ["cls", "code"]
)
MEDIA_RELOCATIONS = Counter(
    "aivedio_media_relocations_total", "Refused output URLs replaced by a fresh one"
)
MEDIA_STAGE_SECONDS = Histogram(
    "aivedio_media_stage_seconds",
    "Time spent in each media stage",
    ["stage"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)

# State-service answers meaning the task no longer wants this operation's work.
_GONE = frozenset(
    {Reason.AFTER_TERMINAL, Reason.STALE_ATTEMPT, Reason.UNKNOWN_ATTEMPT, Reason.ILLEGAL_TRANSITION}
)


class LeaseLost(MediaError):
    """Another worker holds the operation now; this run stops and writes nothing more."""


@dataclass(frozen=True, slots=True)
class Claim:
    id: uuid.UUID
    task_id: uuid.UUID
    attempt_id: uuid.UUID
    project_id: uuid.UUID
    tenant_id: uuid.UUID
    tries: int
    asset_id: uuid.UUID
    lease_token: uuid.UUID
    trace_id: str | None

    @classmethod
    def of(cls, row: asyncpg.Record) -> Claim:
        return cls(
            id=row["id"],
            task_id=row["task_id"],
            attempt_id=row["attempt_id"],
            project_id=row["project_id"],
            tenant_id=row["tenant_id"],
            tries=row["tries"],
            asset_id=row["asset_id"],
            lease_token=row["lease_token"],
            trace_id=row["trace_id"],
        )

    def key(self, prefix: str, name: str) -> str:
        return (
            f"{prefix}/{self.tenant_id}/{self.project_id}/{self.task_id}/{self.attempt_id}/{name}"
        )


class MediaWorker:
    def __init__(
        self,
        db: Database,
        state: StateService,
        store: ObjectStore,
        locator: OutputLocator,
        http: httpx.AsyncClient,
        config: MediaConfig | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.db = db
        self.state = state
        self.store = store
        self.locator = locator
        self.http = http  # owned by the caller; used for downloads only
        self.config = config or MediaConfig()
        self.rng = rng or random.Random()  # jitter, not security
        self.left = LeftLeases("media_end_leases")
        """Runs the database interrupted; their leases end at the next claim (module doc)."""

    # -- the loop ----------------------------------------------------------------------------

    async def run(self, stopping: asyncio.Event, grace_s: float = 10.0) -> None:
        """Claim and run operations until ``stopping`` is set; then let running ones finish
        for up to ``grace_s`` and cancel the rest (their operations go back to pending)."""
        running: set[asyncio.Task[None]] = set()
        try:
            while not stopping.is_set():
                free = self.config.concurrency - len(running)
                claims = await self._claim_safely(free) if free > 0 else []
                for claim in claims:
                    job = asyncio.create_task(self.process(claim))
                    running.add(job)
                    job.add_done_callback(running.discard)
                if not claims or free <= len(claims):
                    await _wait_any(stopping, running, self.config.poll_interval_s)
        finally:
            if running:
                _, pending = await asyncio.wait(running, timeout=grace_s)
                for job in pending:
                    job.cancel()
                await asyncio.gather(*pending, return_exceptions=True)

    async def run_once(self, limit: int | None = None) -> int:
        """Claim up to ``limit`` (default: concurrency) due operations, run them; return how
        many were claimed (after ending the leases the database left us). For tests and tools."""
        await self.left.give_back(self.db)
        claims = await self.claim(limit or self.config.concurrency)
        await asyncio.gather(*(self.process(c) for c in claims))
        return len(claims)

    async def _claim_safely(self, limit: int) -> list[Claim]:
        try:
            await self.left.give_back(self.db)
            claims = await self.claim(limit)
        except DatabaseUnavailable as exc:
            log(logger, logging.WARNING, "cannot claim media operations", error=str(exc))
            health.outage("database", exc)
            return []
        health.recovered()
        return claims

    async def claim(self, limit: int) -> list[Claim]:
        async with self.db.connection() as conn:
            rows = await conn.fetch(q("claim_media_operations"), limit, self.config.lease_s)
        return [Claim.of(r) for r in rows]

    # -- one run -----------------------------------------------------------------------------

    async def process(self, claim: Claim) -> None:
        """Run one claimed operation and record its outcome. Never raises (except cancel)."""
        token = trace_id_var.set(claim.trace_id)
        lease = _LeaseKeeper(self, claim)
        try:
            async with lease:
                await self._process(claim)
        except LeaseLost:
            MEDIA_RUNS.labels("lease_lost").inc()
            log(logger, logging.WARNING, "media lease lost", operation_id=str(claim.id))
        except DatabaseUnavailable as exc:  # no verdict written: the run is tried again
            log(logger, logging.WARNING, "media outcome not recorded", error=str(exc))
            self.left.add(claim.id, claim.lease_token)
        except asyncio.CancelledError:
            if lease.lost:
                current = asyncio.current_task()
                if current is not None:
                    current.uncancel()
                MEDIA_RUNS.labels("lease_lost").inc()
                log(logger, logging.WARNING, "media lease lost", operation_id=str(claim.id))
                return
            await asyncio.shield(self._release(claim))
            raise
        finally:
            trace_id_var.reset(token)

    async def _process(self, claim: Claim) -> None:
        try:
            if claim.tries > self.config.retry.max_tries:  # runs that died without a verdict
                raise MediaRejected("the operation outlived its tries (worker crashes?)")
            await self._run(claim)
        except (LeaseLost, asyncio.CancelledError):
            raise
        except Superseded as exc:
            await self._finish(claim, "failed", "superseded", exc.detail, observe=False)
            MEDIA_RUNS.labels("superseded").inc()
        except MediaRejected as exc:
            await self._fail(claim, exc)
        except RetryableMediaError as exc:
            await self._retry_or_fail(claim, exc)
        except StorageError as exc:
            await self._retry_or_fail(claim, TransientMediaError(f"object store: {exc}"))
        except DatabaseUnavailable:
            raise  # not the operation's fault: process() hands it back once the database is back
        except Exception as exc:
            logger.exception("media run crashed", extra={"fields": {"operation_id": str(claim.id)}})
            await self._retry_or_fail(claim, TransientMediaError(f"bug: {type(exc).__name__}"))

    async def _run(self, claim: Claim) -> None:
        ctx = await self._context(claim)
        if ctx["task_status"] == Status.READY and ctx["task_asset_id"] == claim.asset_id:
            await self._finish(claim, "succeeded", None, None, observe=False)
            return
        if is_terminal(ctx["task_status"]) or ctx["current_attempt_id"] != claim.attempt_id:
            raise Superseded(f"task is {ctx['task_status']} / attempt no longer current")
        prefix = self.config.key_prefix
        original_key = claim.key(prefix, "original")
        asset_key = claim.key(prefix, f"{claim.asset_id}.mp4")
        with tempfile.TemporaryDirectory(prefix="aivedio-media-") as tmp:
            source, rendition = Path(tmp) / "original", Path(tmp) / "rendition.mp4"
            async with self._stage(claim, Stage.INGESTING):
                await self._ingest(ctx, original_key, source)
            async with self._stage(claim, Stage.PROBING):
                meta = await asyncio.to_thread(probe, source, self.config.limits)
            async with self._stage(claim, Stage.TRANSCODING):
                mode = await asyncio.to_thread(render, source, rendition, meta)
                final = await asyncio.to_thread(probe, rendition, self.config.limits)
                await self.store.put(asset_key, _file_chunks(rendition), RENDITION_TYPE)
            async with self._stage(claim, Stage.PUBLISHING):
                await self._publish(claim, asset_key, original_key, final)
        MEDIA_RUNS.labels("succeeded").inc()
        log(
            logger,
            logging.INFO,
            "asset published",
            task_id=str(claim.task_id),
            asset_id=str(claim.asset_id),
            mode=mode,
            size=final.size_bytes,
        )

    async def _context(self, claim: Claim) -> dict[str, Any]:
        async with self.db.connection() as conn:
            row = await conn.fetchrow(q("media_operation_context"), claim.id)
        if row is None:
            raise Superseded("the operation row is gone")
        return dict(row.items())

    async def _ingest(self, ctx: dict[str, Any], original_key: str, target: Path) -> None:
        """The original into ``target``: from the store if a previous run kept it, else from
        the provider (and then into the store, so a retry does not download again)."""
        if await self.store.exists(original_key):
            with target.open("wb") as handle:
                async for chunk in self.store.read(original_key):
                    await asyncio.to_thread(handle.write, chunk)
            return
        provider, job = ctx["provider"], ctx["provider_task_id"]
        if not job:
            raise OutputUnavailable("the attempt has no provider task id")
        relocations = 0
        while True:
            ref = await self.locator.fresh_output(provider, job)
            try:
                fetched = await download(self.http, ref.url, target, self.config.fetch)
                break
            except OutputExpired:
                if relocations >= self.config.max_relocations:
                    raise
                relocations += 1
                MEDIA_RELOCATIONS.inc()
                log(logger, logging.INFO, "output URL refused; locating it again",
                    url=redact_url(ref.url), relocations=relocations)  # fmt: skip
        await self.store.put(original_key, _file_chunks(target), fetched.content_type)

    @contextlib.asynccontextmanager
    async def _stage(self, claim: Claim, stage: Stage) -> AsyncIterator[None]:
        """Report ``stage`` (fenced by the lease, in one transaction), then run its body."""
        obs = PlatformObservation(
            kind=PlatformKind.MEDIA_STAGE,
            stage=stage,
            attempt_id=claim.attempt_id,
            source=Source.MEDIA,
            trace_id=claim.trace_id,
        )
        async with self.db.transaction() as conn:
            await self._fenced(conn, q("set_media_stage"), claim, str(stage))
            result = await self.state.apply_in(conn, obs)
        if result.outcome is not Outcome.APPLIED and result.reason in _GONE:
            raise Superseded(f"stage {stage} refused: {result.reason}")
        started = time.perf_counter()
        yield
        MEDIA_STAGE_SECONDS.labels(str(stage)).observe(time.perf_counter() - started)

    async def _publish(self, claim: Claim, asset_key: str, original_key: str, meta: Probe) -> None:
        obs = PlatformObservation(
            kind=PlatformKind.MEDIA_READY,
            attempt_id=claim.attempt_id,
            asset_id=claim.asset_id,
            source=Source.MEDIA,
            trace_id=claim.trace_id,
        )
        async with self.db.transaction() as conn:
            await self._fenced(conn, q("finish_media_operation"), claim, "succeeded", None, None)
            await conn.execute(
                q("insert_asset"),
                claim.asset_id,
                claim.task_id,
                claim.attempt_id,
                claim.project_id,
                claim.tenant_id,
                asset_key,
                original_key,
                RENDITION_TYPE,
                meta.size_bytes,
                meta.duration_s,
                meta.width,
                meta.height,
                meta.video_codec,
            )
            result = await self.state.apply_in(conn, obs)
            if result.outcome is not Outcome.APPLIED:
                raise Superseded(f"ready refused: {result.reason}")  # rolls the asset back

    # -- outcomes ----------------------------------------------------------------------------

    async def _fenced(self, conn: asyncpg.Connection, sql: str, claim: Claim, *args: Any) -> None:
        if await conn.fetchval(sql, claim.id, claim.lease_token, *args) is None:
            raise LeaseLost(f"operation {claim.id} is no longer ours")

    async def _finish(
        self,
        claim: Claim,
        state: str,
        code: str | None,
        detail: str | None,
        *,
        observe: bool,
    ) -> None:
        async with self.db.transaction() as conn:
            await self._fenced(conn, q("finish_media_operation"), claim, state, code, detail)
            if observe and code is not None:
                await self.state.apply_in(
                    conn,
                    PlatformObservation(
                        kind=PlatformKind.MEDIA_FAILED,
                        attempt_id=claim.attempt_id,
                        error_code=code,
                        error_message=PUBLIC_ERRORS.get(code),
                        source=Source.MEDIA,
                        trace_id=claim.trace_id,
                    ),
                )

    async def _fail(self, claim: Claim, exc: MediaError) -> None:
        MEDIA_FAILURES.labels(type(exc).__name__, exc.public_code).inc()
        MEDIA_RUNS.labels("failed").inc()
        log(logger, logging.WARNING, "media failed", operation_id=str(claim.id),
            task_id=str(claim.task_id), code=exc.public_code, detail=exc.detail)  # fmt: skip
        await self._finish(claim, "failed", exc.public_code, exc.detail, observe=True)

    async def _retry_or_fail(self, claim: Claim, exc: RetryableMediaError) -> None:
        if self.config.retry.exhausted(claim.tries):
            await self._fail(claim, exc)
            return
        delay = self.config.retry.delay(claim.tries, self.rng)
        MEDIA_FAILURES.labels(type(exc).__name__, "retry").inc()
        MEDIA_RUNS.labels("retried").inc()
        log(logger, logging.INFO, "media run will be retried", operation_id=str(claim.id),
            tries=claim.tries, delay_s=round(delay, 2), error=type(exc).__name__,
            detail=exc.detail)  # fmt: skip
        async with self.db.connection() as conn:
            await self._fenced(
                conn, q("retry_media_operation"), claim, delay, exc.public_code, exc.detail
            )

    async def _release(self, claim: Claim) -> None:
        """A run cancelled by shutdown: back to pending at once (its try still counts)."""
        with contextlib.suppress(MediaError, DatabaseUnavailable):
            async with self.db.connection() as conn:
                await self._fenced(
                    conn, q("retry_media_operation"), claim, 0.0, None, "worker stopped"
                )


class _LeaseKeeper:
    """Renews the claim's lease every third of it; if the lease is gone (taken over, or not
    renewable before it ran out) it cancels the run and sets ``lost``."""

    def __init__(self, worker: MediaWorker, claim: Claim) -> None:
        self.worker = worker
        self.claim = claim
        self.lost = False
        self._job: asyncio.Task[None] | None = None
        self._owner: asyncio.Task[Any] | None = None

    async def __aenter__(self) -> _LeaseKeeper:
        self._owner = asyncio.current_task()
        self._job = asyncio.create_task(self._keep())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._job is not None
        self._job.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._job

    async def _keep(self) -> None:
        lease_s = self.worker.config.lease_s
        deadline = time.monotonic() + lease_s
        while True:
            await asyncio.sleep(lease_s / 3)
            try:
                async with self.worker.db.connection() as conn:
                    renewed = await conn.fetchval(
                        q("extend_media_lease"), self.claim.id, self.claim.lease_token, lease_s
                    )
            except DatabaseUnavailable:
                renewed = None if time.monotonic() >= deadline else True
            else:
                if renewed is not None:
                    deadline = time.monotonic() + lease_s
            if renewed is None:
                self.lost = True
                assert self._owner is not None
                self._owner.cancel()
                return


async def _file_chunks(path: Path, size: int = 1024 * 1024) -> AsyncIterator[bytes]:
    handle = await asyncio.to_thread(path.open, "rb")
    try:
        while chunk := await asyncio.to_thread(handle.read, size):
            yield chunk
    finally:
        await asyncio.to_thread(handle.close)


async def _wait_any(
    stopping: asyncio.Event, running: set[asyncio.Task[None]], seconds: float
) -> None:
    """Until ``stopping``, a running job ends, or ``seconds`` passed."""
    stop = asyncio.create_task(stopping.wait())
    try:
        await asyncio.wait({stop, *running}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
