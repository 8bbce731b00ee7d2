"""The embedded PostgreSQL, Valkey and NATS: started for real, reused, restarted, stopped."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import nats
import pytest
import redis.asyncio

from aivedio.config import ServicesConfig
from aivedio.services import embedded
from aivedio.services.daemon import ServicesError, spawn_detached
from aivedio.services.nats_server import NATS
from aivedio.services.postgres_server import POSTGRES, pgbench_path
from aivedio.services.valkey_server import VALKEY


def _config(data_dir: Path, **urls: str | None) -> ServicesConfig:
    return ServicesConfig(
        data_dir=data_dir,
        database_url=urls.get("database_url"),
        redis_url=urls.get("redis_url"),
        nats_url=urls.get("nats_url"),
    )


def _port(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


def _accepts(url: str) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", _port(url)), timeout=1.0):
            return True
    except OSError:
        return False


def _state(data_dir: Path) -> dict[str, dict[str, int | None]]:
    state: dict[str, dict[str, int | None]] = json.loads((data_dir / "services.json").read_text())
    return state


async def _check_all(urls: embedded.ServiceUrls) -> None:
    conn = await asyncpg.connect(urls.database_url)
    try:
        assert await conn.fetchval("SELECT 1") == 1
        assert str(await conn.fetchval("SHOW server_version")).startswith("18")
        assert await conn.fetchval("SELECT current_database()") == "aivedio"
    finally:
        await conn.close()
    client = redis.asyncio.from_url(urls.redis_url)
    try:
        assert await client.ping() is True
    finally:
        await client.aclose()
    nc = await nats.connect(urls.nats_url)
    try:
        info = await nc.jetstream().account_info()
        assert info.limits is not None
    finally:
        await nc.close()


@pytest.fixture
def services(tmp_path: Path) -> Iterator[ServicesConfig]:
    cfg = _config(tmp_path / "services")
    try:
        yield cfg
    finally:
        embedded.down(cfg)


async def test_up_starts_reuses_restarts_and_down_stops(services: ServicesConfig) -> None:
    urls = await asyncio.to_thread(embedded.up, services)
    assert urls.database_url.startswith("postgresql://postgres@127.0.0.1:")
    assert urls.database_url.endswith("/aivedio")
    assert urls.redis_url.startswith("redis://127.0.0.1:")
    assert urls.nats_url.startswith("nats://127.0.0.1:")
    assert {_port(u) for u in urls.as_dict().values()}.isdisjoint({5432, 6379, 4222})
    await _check_all(urls)
    conn = await asyncpg.connect(urls.database_url)
    try:
        await conn.execute("CREATE TABLE survives_restart (x int)")
    finally:
        await conn.close()

    # Up again: the same servers, nothing new started.
    pids = _state(services.data_dir)
    assert await asyncio.to_thread(embedded.up, services) == urls
    assert _state(services.data_dir) == pids

    # Servers that died (stale state, a stale postmaster.pid) are started again, on the recorded
    # port where it is free, reusing PostgreSQL's data directory.
    for name in ("postgres", "valkey"):
        pid = pids[name]["pid"]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
    restarted = await asyncio.to_thread(embedded.up, services)
    assert restarted.redis_url == urls.redis_url
    assert restarted.nats_url == urls.nats_url
    after = _state(services.data_dir)
    assert after["postgres"]["pid"] != pids["postgres"]["pid"]
    assert after["valkey"]["pid"] != pids["valkey"]["pid"]
    assert after["nats"] == pids["nats"]
    await _check_all(restarted)
    urls = restarted

    await asyncio.to_thread(embedded.down, services)
    for url in urls.as_dict().values():
        assert not _accepts(url), url
    await asyncio.to_thread(embedded.down, services)  # a no-op now

    # Up after down reuses the PostgreSQL data directory: initdb ran only once.
    again = await asyncio.to_thread(embedded.up, services)
    await _check_all(again)
    conn = await asyncpg.connect(again.database_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM survives_restart") == 0
    finally:
        await conn.close()


def test_configured_urls_pass_through_and_start_nothing(tmp_path: Path) -> None:
    given = {
        "database_url": "postgresql://someone@db.example:6543/app",
        "redis_url": "redis://cache.example:7000/3",
        "nats_url": "nats://bus.example:4333",
    }
    data_dir = tmp_path / "unused"
    urls = embedded.up(_config(data_dir, **given))
    assert urls.as_dict() == given
    assert not data_dir.exists()
    embedded.down(_config(data_dir, **given))


def test_a_server_that_dies_at_startup_is_named_with_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def launch(folder: Path, port: int) -> int:
        folder.mkdir(parents=True, exist_ok=True)
        argv = ["/bin/sh", "-c", "echo 'cannot start: boom' >&2; exit 3"]
        return spawn_detached(argv, folder / "nats.log", folder, None)

    broken = replace(NATS, launch=launch)
    monkeypatch.setattr(embedded, "KINDS", (POSTGRES, VALKEY, broken))
    cfg = _config(tmp_path / "broken", database_url="postgresql://x@h/d", redis_url="redis://h")
    with pytest.raises(ServicesError, match=r"NATS exited during startup") as caught:
        embedded.up(cfg)
    assert str(tmp_path / "broken" / "nats" / "nats.log") in str(caught.value)
    assert "cannot start: boom" in str(caught.value)
    embedded.down(cfg)


def test_down_without_up_is_a_no_op(tmp_path: Path) -> None:
    embedded.down(_config(tmp_path / "never-started"))
    assert not (tmp_path / "never-started").exists()


def test_pgbench_is_available() -> None:
    path = pgbench_path()
    assert path is not None
    assert os.access(path, os.X_OK)


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aivedio", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_cli_up_outlives_the_process_and_down_stops(tmp_path: Path) -> None:
    data_dir = tmp_path / "cli"
    fake_redis = "redis://127.0.0.1:1/0"  # configured: passed through, no Valkey started
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIVEDIO_")}
    env["AIVEDIO_REDIS_URL"] = fake_redis
    try:
        up = _cli("services", "up", "--data-dir", str(data_dir), env=env)
        assert up.returncode == 0, up.stderr
        urls = json.loads(up.stdout.strip().splitlines()[-1])
        assert set(urls) == {"database_url", "redis_url", "nats_url"}
        assert urls["redis_url"] == fake_redis
        assert not (data_dir / "valkey").exists()
        assert set(_state(data_dir)) == {"postgres", "nats"}

        # The `up` process has exited; its servers still answer.
        async def check() -> None:
            conn = await asyncpg.connect(urls["database_url"])
            try:
                assert await conn.fetchval("SELECT 1") == 1
            finally:
                await conn.close()
            nc = await nats.connect(urls["nats_url"])
            try:
                await nc.jetstream().account_info()
            finally:
                await nc.close()

        asyncio.run(check())

        again = _cli("services", "up", "--data-dir", str(data_dir), env=env)
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout.strip().splitlines()[-1]) == urls

        down = _cli("services", "down", "--data-dir", str(data_dir), env=env)
        assert down.returncode == 0, down.stderr
        assert not _accepts(urls["database_url"])
        assert not _accepts(urls["nats_url"])
    finally:
        embedded.down(_config(data_dir))
