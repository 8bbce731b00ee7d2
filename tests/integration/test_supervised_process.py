"""``serve``: a failing loop is restarted while the process keeps serving and ``/readyz`` names its
role; a configuration error stops the process; the contract of ``/readyz``."""

from __future__ import annotations

import asyncio
import socket
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import httpx
import pytest

from aivedio import roles
from aivedio.api.app import create_app
from aivedio.config import ApiConfig, DatabaseConfig, Settings
from aivedio.db.pool import Database
from aivedio.errors import ConfigError
from aivedio.process.health import Health
from aivedio.process.parts import RoleLoop, RoleParts
from aivedio.process.restart import RestartPolicy
from aivedio.runtime import Runtime
from aivedio.services.embedded import ServiceUrls
from aivedio.state.service import StateService
from tests.conftest import with_database
from tests.integration.helpers import store
from tests.integration.test_api_database_down import via
from tests.proxy import TcpProxy
from tests.waiting import eventually

DEADLINE_S = 30.0  # only to fail instead of hanging


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def runtime(db: Database, tmp_path: Path, redis_url: str, nats_url: str) -> Runtime:
    settings = Settings(data_dir=tmp_path, secret_key="k" * 32)
    urls = ServiceUrls(db.config.url, redis_url, nats_url)
    state = StateService(db)
    return Runtime(settings, urls, db, state, store(db, state))


class FlakyRole:
    """A role whose loop fails ``failures`` times, then runs until the process stops."""

    def __init__(self, failures: int, error: Exception | None = None) -> None:
        self.failures = failures
        self.error = error or ConnectionResetError("a bug nobody foresaw")
        self.runs = 0
        self.failed = asyncio.Event()
        self.steady = asyncio.Event()
        self.stopped = False

    async def loop(self, stopping: asyncio.Event) -> None:
        self.runs += 1
        if self.runs <= self.failures:
            self.failed.set()
            raise self.error
        self.steady.set()
        await stopping.wait()

    async def factory(self, rt: Runtime) -> RoleParts:
        async def on_stop() -> None:
            self.stopped = True

        return RoleParts(loops=[RoleLoop("worker", self.loop)], on_stop=[on_stop])


async def readyz(base: str) -> httpx.Response:
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
        return await client.get(f"{base}/readyz")


async def test_a_failing_loop_is_restarted_while_the_process_serves_and_readyz_names_it(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    flaky = FlakyRole(failures=2)
    monkeypatch.setitem(roles.AVAILABLE, "flaky", flaky.factory)
    port = free_port()
    stopping = asyncio.Event()
    # A backoff long enough to look at the process while the loop waits to be restarted.
    policy = RestartPolicy(first_s=0.5, cap_s=0.5, jitter=0.0)
    job = asyncio.create_task(roles.serve(runtime, ["api", "flaky"], port, stopping, policy))
    base = f"http://127.0.0.1:{port}"
    try:
        await asyncio.wait_for(flaky.failed.wait(), DEADLINE_S)

        async def names_it() -> bool:
            try:
                r = await readyz(base)
            except httpx.HTTPError:
                return False
            return r.status_code == 503

        await eventually(names_it, "/readyz 503", DEADLINE_S)
        r = await readyz(base)
        body = r.json()
        assert body["status"] == "unavailable" and body["database"] == "ok"
        assert body["roles_down"] == ["flaky"]
        (loop,) = body["loops"]
        assert loop["role"] == "flaky" and loop["loop"] == "worker"
        assert loop["state"] == "restarting" and loop["error"] == "ConnectionResetError"
        assert r.headers["retry-after"].isdigit()
        assert (await _get(base, "/healthz")).status_code == 200  # the process serves meanwhile

        await asyncio.wait_for(flaky.steady.wait(), DEADLINE_S)

        async def ready() -> bool:
            return (await readyz(base)).status_code == 200

        await eventually(ready, "/readyz 200 once the loop runs again", DEADLINE_S)
        assert (await readyz(base)).json() == {"status": "ready"}
        metrics = (await _get(base, "/metrics")).text
        assert 'aivedio_role_restarts_total{loop="worker",role="flaky"} 2.0' in metrics
        assert 'aivedio_role_up{loop="worker",role="flaky"} 1.0' in metrics
        assert not job.done()
    finally:
        stopping.set()
        assert await asyncio.wait_for(job, DEADLINE_S) == 0
    assert flaky.stopped


async def test_a_configuration_error_in_a_loop_stops_the_process(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = FlakyRole(failures=1, error=ConfigError("AIVEDIO_X is half set"))
    other = FlakyRole(failures=0)
    monkeypatch.setitem(roles.AVAILABLE, "bad", bad.factory)
    monkeypatch.setitem(roles.AVAILABLE, "other", other.factory)
    with pytest.raises(ConfigError, match="AIVEDIO_X"):
        await asyncio.wait_for(
            roles.serve(runtime, ["other", "bad"], free_port(), asyncio.Event()), DEADLINE_S
        )
    assert bad.runs == 1  # not restarted
    assert other.stopped and bad.stopped  # every role stopped and cleaned up first


async def test_a_port_that_cannot_be_bound_is_a_configuration_error(runtime: Runtime) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot serve HTTP on 127.0.0.1:{port}"):
            await asyncio.wait_for(roles.serve(runtime, ["api"], port, asyncio.Event()), DEADLINE_S)


async def test_a_process_started_while_postgres_is_away_waits_for_it(
    database_url: str, tmp_path: Path, redis_url: str, nats_url: str
) -> None:
    target = urlsplit(database_url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 5432)
    await proxy.start()
    url = via(database_url, proxy.port)
    await proxy.cut()  # away at start
    settings = Settings(data_dir=tmp_path, db_acquire_timeout_s=1.0)
    stopping = asyncio.Event()
    opening = asyncio.create_task(
        roles.open_runtime(
            settings,
            ServiceUrls(url, redis_url, nats_url),
            stopping,
            RestartPolicy(first_s=0.05, cap_s=0.1),
        )
    )
    try:
        await asyncio.sleep(0.3)  # a few tries fail meanwhile
        assert not opening.done()
        await proxy.start()
        rt = await asyncio.wait_for(opening, DEADLINE_S)
        assert rt is not None
        await rt.close()
        # A signal while it waits ends the wait.
        await proxy.cut()
        waiting = asyncio.create_task(
            roles.open_runtime(settings, ServiceUrls(url, redis_url, nats_url), stopping)
        )
        stopping.set()
        assert await asyncio.wait_for(waiting, DEADLINE_S) is None
    finally:
        await proxy.cut()


async def test_readyz_contract(db: Database, database_url: str) -> None:
    health = Health()
    inbox = health.unit("inbox", "processor")
    health.unit("relay", "relay")
    app = create_app(db, store(db), ApiConfig(), health=health)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/readyz")).json() == {"status": "ready"}
        inbox.outage("database", ConnectionRefusedError())
        r = await c.get("/readyz")
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        body = r.json()
        assert body["roles_down"] == ["inbox"] and body["database"] == "ok"
        assert body["loops"][0] | {"for_s": 0} == {
            "role": "inbox",
            "loop": "processor",
            "state": "outage",
            "dependency": "database",
            "error": "ConnectionRefusedError",
            "restarts": 0,
            "for_s": 0,
        }
        inbox.recovered()
        assert (await c.get("/readyz")).status_code == 200

    # PostgreSQL away: 503 naming the database, no role down in this process.
    target = urlsplit(database_url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 5432)
    await proxy.start()
    cut = await Database.connect(
        DatabaseConfig(url=via(database_url, proxy.port), min_size=1, acquire_timeout_s=1.0)
    )
    try:
        await proxy.cut()
        app = create_app(cut, store(cut), ApiConfig(), health=Health())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.get("/readyz")
        assert r.status_code == 503
        assert r.json() == {
            "status": "unavailable",
            "database": "unavailable",
            "roles_down": [],
            "loops": [],
        }
    finally:
        await cut.close()


async def _get(base: str, path: str) -> httpx.Response:
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
        return await client.get(f"{base}{path}")


async def test_a_database_older_than_the_code_is_a_configuration_error(
    admin_database_url: str, tmp_path: Path, redis_url: str, nats_url: str
) -> None:
    name = f"aivedio_empty_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(admin_database_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        url = with_database(admin_database_url, name)
        with pytest.raises(ConfigError, match="run `aivedio migrate`"):
            await roles.open_runtime(
                Settings(data_dir=tmp_path), ServiceUrls(url, redis_url, nats_url), asyncio.Event()
            )
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
