"""The media consumer and worker on real PostgreSQL against a real sandbox provider (uvicorn on
a free port): provider_succeeded -> ingesting -> probing -> transcoding -> publishing -> ready,
an asset row and a playable file; refused URLs re-located; corrupt media and vanished outputs
fail with stable codes; two worker replicas never run one operation twice; playback links."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from aivedio.api.app import create_app
from aivedio.billing import BillingConfig, PriceTable, tenant_balance
from aivedio.billing.role import billing_role
from aivedio.bus.jetstream import JetStreamBus
from aivedio.config import ApiConfig, Settings
from aivedio.consumers import ConsumerSettings, StatusEvent
from aivedio.db.pool import Database
from aivedio.domain.observation import PlatformKind, ProviderStatus
from aivedio.media.config import MediaConfig
from aivedio.media.consumer import MediaConsumer
from aivedio.media.errors import TransientFetchError
from aivedio.media.locator import OutputRef
from aivedio.media.pipeline import MediaLimits, probe
from aivedio.media.playback import PlaybackConfig, playback_routes
from aivedio.media.retry import RetryPolicy
from aivedio.media.role import media_role, playback_routes_for
from aivedio.media.sandbox_locator import SandboxLocatorConfig, SandboxOutputLocator
from aivedio.media.worker import MediaWorker
from aivedio.runtime import Runtime
from aivedio.sandbox import SandboxConfig
from aivedio.sandbox import create_app as create_sandbox
from aivedio.sandbox.provider import SandboxProvider
from aivedio.services.embedded import ServiceUrls
from aivedio.state.service import StateService
from aivedio.storage import ObjectInfo, ObjectStore
from aivedio.storage.filesystem import FileSystemObjectStore, FileSystemStoreConfig
from tests.contract.bus_contract import contract_config
from tests.integration.consumer_helpers import (
    AckLoser,
    apply_all,
    platform,
    prov,
    publish_outbox,
    running,
)
from tests.integration.helpers import (
    CutAfter,
    Project,
    database_behind_a_proxy,
    make_project,
    make_task,
    store,
)
from tests.integration.test_bus_jetstream import _delete_streams
from tests.waiting import eventually

API_KEY = "sk_media_test"
FAST = {"sandbox": {"queue_s": 0, "duration_s": 0.05, "steps": 1}}
STAGES = ["ingesting", "probing", "transcoding", "publishing"]


@dataclass
class Sandbox:
    url: str
    provider: SandboxProvider
    client: httpx.AsyncClient

    def locator(self) -> SandboxOutputLocator:
        return SandboxOutputLocator(SandboxLocatorConfig(self.url, API_KEY), self.client)


@pytest.fixture
async def sandbox() -> AsyncIterator[Sandbox]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    app = create_sandbox(SandboxConfig(api_key=API_KEY, public_url=url))
    server = uvicorn.Server(
        uvicorn.Config(app, lifespan="on", ws="none", log_level="warning", access_log=False)
    )
    job = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await eventually(lambda: server.started, "the sandbox server to start", 10)
        async with httpx.AsyncClient() as client:
            yield Sandbox(url, app.state.sandbox, client)
    finally:
        server.should_exit = True
        await asyncio.wait_for(job, 15)
        sock.close()


@pytest.fixture
def object_store(tmp_path: Path) -> FileSystemObjectStore:
    return FileSystemObjectStore(FileSystemStoreConfig(root=tmp_path / "store"))


def media_config(**kw: Any) -> MediaConfig:
    base = MediaConfig(
        consumer=ConsumerSettings(batch=50, fetch_timeout_s=0.2, retry_delay_s=0.2),
        poll_interval_s=0.05,
        lease_s=30.0,
        retry=RetryPolicy(max_tries=3, base_s=0.0, cap_s=0.0, jitter=0.0),
    )
    return replace(base, **kw)


@dataclass
class Env:
    db: Database
    state: StateService
    sandbox: Sandbox
    store: ObjectStore
    project: Project

    def worker(
        self, locator: Any = None, store: ObjectStore | None = None, **kw: Any
    ) -> MediaWorker:
        return MediaWorker(
            self.db,
            self.state,
            store or self.store,
            locator or self.sandbox.locator(),
            self.sandbox.client,
            media_config(**kw),
        )

    async def generated(self, outcome: str = "succeeded") -> tuple[uuid.UUID, uuid.UUID]:
        """A task at ``provider_succeeded`` whose sandbox generation really ended ``outcome``
        (``failed``: a provider that contradicted its own success)."""
        params = {"sandbox": {**FAST["sandbox"], "outcome": outcome}}
        task_id, attempt = await make_task(store(self.db, self.state), self.project, params=params)
        async with self.db.connection() as conn:
            request_id = await conn.fetchval(
                "SELECT client_request_id FROM task_attempts WHERE id = $1", attempt
            )
        auth = {"Authorization": f"Bearer {API_KEY}"}
        client = self.sandbox.client
        created = await client.post(
            f"{self.sandbox.url}/v1/generations",
            json={"model": "m1", "prompt": "a cat", "params": params},
            headers={**auth, "Idempotency-Key": request_id},
        )
        gen = created.json()["id"]
        async with self.db.connection() as conn:  # what the submitter records
            await conn.execute(
                "UPDATE task_attempts SET provider_task_id = $2 WHERE id = $1", attempt, gen
            )

        async def done() -> bool:
            r = await client.get(f"{self.sandbox.url}/v1/generations/{gen}", headers=auth)
            return bool(r.json()["status"] == outcome)

        await eventually(done, what="the sandbox generation")
        await apply_all(
            self.state,
            [
                platform(PlatformKind.SUBMIT_ACCEPTED, attempt),
                prov(attempt, ProviderStatus.SUCCEEDED, provider_task_id=gen),
            ],
        )
        return task_id, attempt

    async def queued(self, outcome: str = "succeeded") -> tuple[uuid.UUID, uuid.UUID]:
        """A generated task with its media operation created (as the consumer would)."""
        task_id, attempt = await self.generated(outcome)
        await MediaConsumer(self.db).handle(self.event(task_id, attempt))
        return task_id, attempt

    def event(self, task_id: uuid.UUID, attempt: uuid.UUID) -> StatusEvent:
        p = self.project
        return StatusEvent(task_id, attempt, p.tenant_id, p.project_id, 4, "provider_succeeded",
                           None, None)  # fmt: skip

    async def task(self, task_id: uuid.UUID) -> dict[str, Any]:
        async with self.db.connection() as conn:
            row = await conn.fetchrow("SELECT * FROM generation_tasks WHERE id = $1", task_id)
        return dict(row.items())

    async def operations(self, task_id: uuid.UUID | None = None) -> list[dict[str, Any]]:
        async with self.db.connection() as conn:
            rows = await conn.fetch(
                "SELECT * FROM media_operations WHERE $1::uuid IS NULL OR task_id = $1",
                task_id,
            )
        return [dict(r.items()) for r in rows]

    async def events(self, task_id: uuid.UUID) -> list[tuple[str, str]]:
        async with self.db.connection() as conn:
            rows = await conn.fetch(
                "SELECT payload FROM outbox_events WHERE aggregate_id = $1 ORDER BY id", task_id
            )
        return [(r["payload"]["status"], r["payload"]["stage"]) for r in rows]


@pytest.fixture
async def env(db: Database, sandbox: Sandbox, object_store: FileSystemObjectStore) -> Env:
    return Env(db, StateService(db), sandbox, object_store, await make_project(db))


def pipeline_events(events: list[tuple[str, str]]) -> list[tuple[str, str]]:
    start = events.index(("provider_succeeded", "ingesting"))
    return events[start:]


EXPECTED = [
    ("provider_succeeded", "ingesting"),
    ("processing_media", "ingesting"),
    ("processing_media", "probing"),
    ("processing_media", "transcoding"),
    ("processing_media", "publishing"),
    ("ready", "done"),
]


async def assert_published(env: Env, task_id: uuid.UUID, tmp_path: Path) -> dict[str, Any]:
    task = await env.task(task_id)
    assert (task["status"], task["progress"], task["error_code"]) == ("ready", 100, None)
    assert pipeline_events(await env.events(task_id)) == EXPECTED
    async with env.db.connection() as conn:
        asset = await conn.fetchrow("SELECT * FROM assets WHERE task_id = $1", task_id)
    assert asset is not None and asset["id"] == task["asset_id"]
    assert (asset["codec"], asset["width"], asset["height"]) == ("h264", 64, 64)
    assert asset["content_type"] == "video/mp4" and asset["duration_s"] == pytest.approx(1, 0.2)
    info = await env.store.stat(asset["storage_key"])
    assert info == ObjectInfo(asset["storage_key"], asset["size_bytes"], "video/mp4")
    local = tmp_path / f"{asset['id']}.mp4"
    local.write_bytes(b"".join([c async for c in env.store.read(asset["storage_key"])]))
    opened = probe(local, MediaLimits())  # PyAV opens and decodes it
    assert (opened.video_codec, opened.width) == ("h264", 64)
    assert await env.store.exists(asset["original_key"])
    return dict(asset.items())


async def test_end_to_end_on_jetstream_with_three_redeliveries(
    env: Env, nats_url: str, tmp_path: Path
) -> None:
    task_id, _ = await env.generated()
    cfg = replace(contract_config(nats_url), ack_wait_s=1.0, max_deliver=10)
    bus = await JetStreamBus.connect(cfg)
    try:
        published = await publish_outbox(env.db, bus, task_id=task_id)
        handled: dict[str, int] = {}
        losing = AckLoser(bus, lose=3, handled=handled)
        consumer = MediaConsumer(env.db, media_config())
        async with running(lambda stop: consumer.run(losing, stop)):  # type: ignore[arg-type]

            async def redelivered() -> bool:
                return len(handled) == published and all(n >= 4 for n in handled.values())

            await eventually(redelivered, timeout=30, what="4 deliveries of every message")
        operations = await env.operations(task_id)
        assert len(operations) == 1  # one media operation despite 4 deliveries
        assert operations[0]["source_ref"].startswith("sandbox:gen_")
        assert "http" not in operations[0]["source_ref"]
        async with running(env.worker().run):

            async def ready() -> bool:
                return (await env.task(task_id))["status"] == "ready"

            await eventually(ready, what="the task to be ready")
        await assert_published(env, task_id, tmp_path)
        (operation,) = await env.operations(task_id)
        assert (operation["state"], operation["tries"], operation["stage"]) == (
            "succeeded",
            1,
            "publishing",
        )
        assert operation["lease_token"] is None and operation["error_code"] is None
    finally:
        await bus.close()
        await _delete_streams(nats_url, cfg)


@dataclass
class Locator:
    """The real sandbox locator, but the first ``refused`` URLs it hands out are tampered with
    (the sandbox answers 403, as for an expired link); ``fail`` query failures come first."""

    inner: SandboxOutputLocator
    refused: int = 0
    fail: int = 0
    calls: int = 0
    urls: list[str] = field(default_factory=list)

    async def fresh_output(self, provider: str, provider_task_id: str) -> OutputRef:
        self.calls += 1
        if self.fail > 0:
            self.fail -= 1
            raise TransientFetchError("provider query answered 503")
        ref = await self.inner.fresh_output(provider, provider_task_id)
        self.urls.append(ref.url)
        if self.refused > 0:
            self.refused -= 1
            return replace(ref, url=ref.url.replace("sig=", "sig=x"))
        return ref


async def test_refused_url_is_located_again(
    env: Env, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    task_id, _ = await env.queued()
    locator = Locator(env.sandbox.locator(), refused=2)
    assert await env.worker(locator).run_once() == 1
    await assert_published(env, task_id, tmp_path)
    assert locator.calls == 3
    (operation,) = await env.operations(task_id)
    assert operation["tries"] == 1
    logged = caplog.text + repr([r.__dict__ for r in caplog.records])
    assert all(url.split("?")[1] not in logged for url in locator.urls)  # no signed URL in logs
    assert "sig=" not in repr(operation)


async def test_output_refused_on_every_try_fails_with_output_expired(env: Env) -> None:
    task_id, _ = await env.queued()
    locator = Locator(env.sandbox.locator(), refused=1000)
    worker = env.worker(locator)
    for expected_tries in (1, 2, 3):
        assert await worker.run_once() == 1
        (operation,) = await env.operations(task_id)
        assert operation["tries"] == expected_tries
        assert operation["error_code"] == "output_expired"
    assert operation["state"] == "failed"
    assert locator.calls == 3 * 3  # each try: a fresh URL and two re-locations
    task = await env.task(task_id)
    assert (task["status"], task["error_code"]) == ("failed", "output_expired")
    assert task["error_message"] == "The generated video expired before it could be stored."
    assert await worker.run_once() == 0


async def test_transient_provider_failure_is_retried(env: Env, tmp_path: Path) -> None:
    task_id, _ = await env.queued()
    locator = Locator(env.sandbox.locator(), fail=1)
    worker = env.worker(locator)
    assert await worker.run_once() == 1
    (operation,) = await env.operations(task_id)
    assert (operation["state"], operation["tries"]) == ("pending", 1)
    assert (await env.task(task_id))["status"] == "processing_media"
    assert await worker.run_once() == 1
    await assert_published(env, task_id, tmp_path)


async def test_a_provider_that_withdrew_its_success_fails_the_task_without_retry(
    env: Env,
) -> None:
    """Found by aivedio chaos: a provider sent ``succeeded`` with a higher sequence than its real
    ``failed`` (the contradictory_terminal knob); the task went to media, whose queries then
    answered "failed" and which retried "no output" for minutes. Now the first run fails it."""
    task_id, _ = await env.queued(outcome="failed")
    worker = env.worker()
    assert await worker.run_once() == 1
    (operation,) = await env.operations(task_id)
    assert (operation["state"], operation["tries"]) == ("failed", 1)
    task = await env.task(task_id)
    assert (task["status"], task["error_code"]) == ("failed", "generation_failed")
    assert await worker.run_once() == 0


async def test_corrupt_output_fails_with_media_failed_without_retry(env: Env) -> None:
    task_id, _ = await env.queued()
    env.sandbox.provider.video = b"\x00\x00\x00\x18ftypmp42" + b"not a video" * 100
    assert await env.worker().run_once() == 1
    (operation,) = await env.operations(task_id)
    assert (operation["state"], operation["tries"], operation["error_code"]) == (
        "failed",
        1,
        "media_failed",
    )
    task = await env.task(task_id)
    assert (task["status"], task["stage"], task["error_code"]) == ("failed", "done", "media_failed")
    assert pipeline_events(await env.events(task_id))[-2:] == [
        ("processing_media", "probing"),
        ("failed", "done"),
    ]
    async with env.db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM assets") == 0


@dataclass
class CountingStore:
    inner: ObjectStore
    puts: dict[str, int] = field(default_factory=dict)

    async def put(self, key: str, data: Any, content_type: str) -> ObjectInfo:
        self.puts[key] = self.puts.get(key, 0) + 1
        return await self.inner.put(key, data, content_type)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_two_replicas_never_run_one_operation_twice(env: Env, tmp_path: Path) -> None:
    tasks = [(await env.queued())[0] for _ in range(6)]
    counting = CountingStore(env.store)
    replicas = [env.worker(store=counting, concurrency=2) for _ in range(2)]  # type: ignore[arg-type]
    async with running(replicas[0].run), running(replicas[1].run):

        async def all_ready() -> bool:
            statuses = [(await env.task(t))["status"] for t in tasks]
            return statuses == ["ready"] * len(tasks)

        await eventually(all_ready, timeout=60, what="every task ready")
    assert len(counting.puts) == 12 and set(counting.puts.values()) == {1}
    for task_id in tasks:
        await assert_published(env, task_id, tmp_path)
        (operation,) = await env.operations(task_id)
        assert (operation["state"], operation["tries"]) == ("succeeded", 1)


async def test_a_run_whose_lease_was_taken_over_writes_nothing(env: Env, tmp_path: Path) -> None:
    task_id, _ = await env.queued()
    slow = env.worker(lease_s=0.2)
    (stale,) = await slow.claim(1)
    await asyncio.sleep(0.4)  # the lease lapses, as if the worker had stalled
    fast = env.worker()
    (fresh,) = await fast.claim(1)
    assert fresh.id == stale.id and fresh.lease_token != stale.lease_token
    await slow.process(stale)  # its first fenced write fails: it stops
    assert (await env.task(task_id))["status"] == "provider_succeeded"
    await fast.process(fresh)
    await assert_published(env, task_id, tmp_path)
    (operation,) = await env.operations(task_id)
    assert (operation["state"], operation["tries"]) == ("succeeded", 2)


async def test_a_run_the_database_interrupted_is_claimed_again_once_it_is_back(
    env: Env, database_url: str, tmp_path: Path
) -> None:
    task_id, _ = await env.queued()
    async with database_behind_a_proxy(database_url) as (proxy, cut_db):
        cutting = CutAfter(env.store, "put", proxy, lambda key, *_: key.endswith(".mp4"))
        worker = MediaWorker(cut_db, StateService(cut_db), cutting, env.sandbox.locator(),  # type: ignore[arg-type]
                             env.sandbox.client, media_config(lease_s=600.0))  # fmt: skip
        (claim,) = await worker.claim(1)
        await worker.process(claim)  # no verdict written: the database went away
        (operation,) = await env.operations(task_id)
        assert (operation["state"], operation["stage"]) == ("running", "transcoding")
        assert len(worker.left) == 1
        await proxy.start()  # back: the next claim ends that lease first, not in ten minutes
        assert await worker.run_once() == 1
        assert len(worker.left) == 0
    await assert_published(env, task_id, tmp_path)
    (operation,) = await env.operations(task_id)
    assert (operation["state"], operation["tries"]) == ("succeeded", 2)


async def test_superseded_operation_stops_without_an_observation(env: Env) -> None:
    task_id, attempt = await env.queued()
    await apply_all(env.state, [platform(PlatformKind.MEDIA_FAILED, attempt)])
    assert await env.worker().run_once() == 1
    (operation,) = await env.operations(task_id)
    assert (operation["state"], operation["error_code"]) == ("failed", "superseded")
    assert (await env.events(task_id))[-1] == ("failed", "done")


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


async def test_playback_link_works_then_expires(env: Env, tmp_path: Path) -> None:
    task_id, _ = await env.queued()
    await env.worker().run_once()
    asset = await assert_published(env, task_id, tmp_path)
    clock = Clock()
    routes = playback_routes(env.db, env.store, PlaybackConfig(b"s" * 32, ttl_s=60), clock)
    app = create_app(env.db, store(env.db, env.state), ApiConfig(), extra_routes=routes)
    other = await make_project(env.db, tenant="other", project="p2")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
        path = f"/v1/projects/{env.project.project_id}/assets/{asset['id']}/playback"
        auth = {"Authorization": f"Bearer {env.project.api_key}"}
        assert (await client.get(path)).status_code == 401
        foreign = {"Authorization": f"Bearer {other.api_key}"}
        assert (await client.get(path, headers=foreign)).status_code == 404
        issued = await client.get(path, headers=auth)
        assert issued.status_code == 200
        url = issued.json()["url"]
        assert url.startswith(f"http://api/v1/media/{asset['id']}?exp=")
        assert issued.json()["expires_at"] == "2027-01-15T08:01:00Z"
        redirect = await client.get(path + "?redirect=1", headers=auth)
        assert redirect.status_code == 302 and redirect.headers["location"].startswith(
            "http://api/v1/media/"
        )
        media = await client.get(url)  # no API key: the signature is the credential
        assert media.status_code == 200 and media.headers["content-type"] == "video/mp4"
        stored = b"".join([c async for c in env.store.read(asset["storage_key"])])
        assert media.content == stored and len(stored) == asset["size_bytes"]
        part = await client.get(url, headers={"Range": "bytes=4-11"})
        assert part.status_code == 206 and part.content == stored[4:12]
        assert part.headers["content-range"] == f"bytes 4-11/{len(stored)}"
        tampered = url.replace("sig=", "sig=A")
        assert (await client.get(tampered)).status_code == 403
        clock.now += 61
        expired = await client.get(url)
        assert expired.status_code == 403
        assert expired.json()["error"]["code"] == "forbidden"


async def test_media_and_billing_roles_run_the_whole_chain(
    env: Env, nats_url: str, database_url: str, tmp_path: Path
) -> None:
    """The role factories as the runner starts them: bus -> media consumer -> worker -> ready,
    and the billing consumer reserves then settles."""
    settings = Settings(
        database_url=database_url,
        nats_url=nats_url,
        data_dir=tmp_path / "data",
        sandbox_url=env.sandbox.url,
        sandbox_api_key=API_KEY,
        secret_key="x" * 32,
    )
    urls = ServiceUrls(database_url, "redis://unused", nats_url)
    rt = Runtime(settings, urls, env.db, env.state, store(env.db, env.state))
    cfg = contract_config(nats_url)
    media = await media_role(rt, media_config(), cfg)
    billing = await billing_role(rt, BillingConfig(prices=PriceTable(default=7)), cfg)
    task_id, _ = await env.generated()
    bus = await JetStreamBus.connect(cfg)
    try:
        await publish_outbox(env.db, bus, task_id=task_id)
        loops = [*media.loops, *billing.loops]
        async with contextlib.AsyncExitStack() as stack:
            for loop in loops:
                await stack.enter_async_context(running(loop.run))

            async def ready() -> bool:
                return (await env.task(task_id))["status"] == "ready"

            await eventually(ready, timeout=30, what="ready through the roles")
            await publish_outbox(env.db, bus, task_id=task_id)  # the new events, deduplicated

            async def settled() -> bool:
                return (await tenant_balance(env.db, env.project.tenant_id)).spent == 7

            await eventually(settled, timeout=30, what="the settle entry")
        asset_id = (await env.task(task_id))["asset_id"]
        routes = playback_routes_for(rt, ttl_s=30)
        app = create_app(env.db, store(env.db, env.state), ApiConfig(), extra_routes=routes)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            issued = await client.get(
                f"/v1/projects/{env.project.project_id}/assets/{asset_id}/playback",
                headers={"Authorization": f"Bearer {env.project.api_key}"},
            )
            media_file = await client.get(issued.json()["url"])
        assert media_file.status_code == 200 and media_file.content[4:8] == b"ftyp"
        assert (tmp_path / "data" / "media" / "data" / "media").is_dir()
    finally:
        await bus.close()
        await _delete_streams(nats_url, cfg)
