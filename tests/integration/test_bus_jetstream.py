"""The bus contract against a real NATS JetStream server, plus JetStream-only behaviour:
unreachable server, server restart, concurrent stream creation."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import nats
import nats.js.errors
import pytest

from aivedio.bus import (
    Bus,
    BusConfig,
    BusError,
    BusUnavailable,
    Delivery,
    OutgoingMessage,
    PublishAck,
)
from aivedio.bus.jetstream import JetStreamBus
from aivedio.bus.jetstream_pipeline import PullFetcher, status_of
from aivedio.bus.nats_internals import _header_lines, internals_enabled, public_api_only
from tests.contract.bus_contract import BusContract, BusFactory, contract_config
from tests.waiting import eventually, eventually_sync


async def _delete_streams(url: str, cfg: BusConfig) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        for name in (cfg.stream, f"{cfg.stream}_DLQ"):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await js.delete_stream(name)
    finally:
        await nc.close()


@pytest.fixture
async def jetstream_factory(nats_url: str) -> AsyncIterator[tuple[BusConfig, BusFactory]]:
    """A unique stream/prefix per test; every bus closed and both streams deleted afterwards."""
    cfg = contract_config(nats_url)
    buses: list[Bus] = []

    async def factory() -> Bus:
        bus = await JetStreamBus.connect(cfg)
        buses.append(bus)
        return bus

    yield cfg, factory
    for bus in buses:
        await bus.close()
    await _delete_streams(nats_url, cfg)


class TestJetStreamBus(BusContract):
    @pytest.fixture
    def bus_factory(self, jetstream_factory: tuple[BusConfig, BusFactory]) -> BusFactory:
        return jetstream_factory[1]


class TestJetStreamBusPublicApiOnly(BusContract):
    """The same contract with every nats-py internal switched off (raw writer, header parser
    and the raw router): the path a nats-py without them takes."""

    @pytest.fixture
    def bus_factory(self, jetstream_factory: tuple[BusConfig, BusFactory]) -> Iterator[BusFactory]:
        with public_api_only():
            yield jetstream_factory[1]

    async def test_internals_are_off(self, bus: Bus) -> None:
        assert not internals_enabled()
        assert isinstance(bus, JetStreamBus)
        nc = bus._nc
        assert not bus._raw.supported
        assert not hasattr(nc, "_aivedio_router")
        assert "_parse_header_lines" not in vars(nc)
        consumer = await bus.subscribe("task.status", "g1")
        await bus.publish("task.status", "task-1", "off-1", b"x", {"trace-id": "t"})
        [d] = await consumer.fetch(batch=1, timeout=5.0)
        assert dict(d.headers) == {"trace-id": "t"}
        await d.ack()
        assert not hasattr(nc, "_aivedio_router")


class TestJetStreamBusThroughClientPublish(BusContract):
    """The same contract with the raw-frame path off, as on a nats-py without the internals it
    relies on: every publish and ack then goes through ``Client.publish``."""

    @pytest.fixture
    def bus_factory(self, jetstream_factory: tuple[BusConfig, BusFactory]) -> BusFactory:
        make = jetstream_factory[1]

        async def factory() -> Bus:
            bus = await make()
            assert isinstance(bus, JetStreamBus)
            bus._raw.supported = False
            bus._pipeline._raw.supported = False
            return bus

        return factory


async def test_unreachable_server_raises_bus_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    cfg = replace(contract_config(f"nats://127.0.0.1:{port}"), connect_timeout_s=0.5)
    with pytest.raises(BusUnavailable):
        await JetStreamBus.connect(cfg)


async def test_concurrent_connect_creates_streams_once(
    jetstream_factory: tuple[BusConfig, BusFactory], nats_url: str
) -> None:
    cfg, factory = jetstream_factory
    buses = await asyncio.gather(*(factory() for _ in range(5)))
    ack = await buses[0].publish("task.status", "k", "d-1", b"x")
    assert ack.stream == cfg.stream
    nc = await nats.connect(nats_url)
    try:
        info = await nc.jetstream().stream_info(cfg.stream)
        assert info.config.duplicate_window == cfg.duplicate_window_s
        assert info.config.subjects == [f"{cfg.subject_prefix}.>"]
    finally:
        await nc.close()


async def test_foreign_stream_on_the_same_subjects_is_refused(
    jetstream_factory: tuple[BusConfig, BusFactory], nats_url: str
) -> None:
    """A stream of another name that owns our subjects is a configuration error, not a race
    with a concurrent start: connect names the overlap instead of updating anything."""
    cfg, _ = jetstream_factory
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await js.add_stream(name=f"{cfg.stream}_FOREIGN", subjects=[f"{cfg.subject_prefix}.>"])
        try:
            with pytest.raises(BusError, match="overlap"):
                await JetStreamBus.connect(cfg)
            with pytest.raises(nats.js.errors.NotFoundError):
                await js.stream_info(cfg.stream)
        finally:
            await js.delete_stream(f"{cfg.stream}_FOREIGN")
    finally:
        await nc.close()


async def test_changed_config_updates_existing_stream(
    jetstream_factory: tuple[BusConfig, BusFactory], nats_url: str
) -> None:
    cfg, factory = jetstream_factory
    await factory()
    longer = replace(cfg, duplicate_window_s=60.0)
    bus = await JetStreamBus.connect(longer)
    try:
        nc = await nats.connect(nats_url)
        try:
            info = await nc.jetstream().stream_info(cfg.stream)
            assert info.config.duplicate_window == 60.0
        finally:
            await nc.close()
    finally:
        await bus.close()


async def test_publish_many_throughput_smoke(
    jetstream_factory: tuple[BusConfig, BusFactory],
) -> None:
    """Many in flight at once, every one acked (figures belong to ``aivedio bench``)."""
    _, factory = jetstream_factory
    bus = await factory()
    messages = [
        OutgoingMessage("task.status", f"t-{i % 50}", f"b-{i}", b"x" * 200) for i in range(5000)
    ]
    results = await bus.publish_many(messages)
    assert all(isinstance(r, PublishAck) and not r.duplicate for r in results)


# -- a NATS server of our own, to stop and restart ------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Server:
    def __init__(self, binary: str, port: int, store: Path) -> None:
        self.binary, self.port, self.store = binary, port, store
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.store)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        eventually_sync(self.listening, "nats-server to start", 10, interval=0.05)

    def listening(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[_Server]:
    binary = shutil.which("nats-server")
    if binary is None:
        pytest.skip("no nats-server binary on PATH")
    server = _Server(binary, _free_port(), tmp_path / "js")
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_server_restart_reports_unavailable_then_recovers(own_nats: _Server) -> None:
    cfg = replace(
        contract_config(own_nats.url), storage="file", publish_timeout_s=1.0, reconnect_wait_s=0.2
    )
    bus = await JetStreamBus.connect(cfg)
    try:
        consumer = await bus.subscribe("task.status", "g1")
        await bus.publish("task.status", "task-1", "before", b"before")

        own_nats.stop()
        with pytest.raises(BusUnavailable):
            await bus.publish("task.status", "task-1", "during", b"during")
        with pytest.raises(BusUnavailable):
            await consumer.fetch(batch=1, timeout=0.2)
        [failed] = await bus.publish_many(
            [OutgoingMessage("task.status", "task-1", "during-many", b"x")]
        )
        assert isinstance(failed, BusUnavailable)

        own_nats.start()
        ack = await eventually(
            lambda: bus.publish("task.status", "task-1", "after", b"after"),
            "a publish after the restart",
            20,
            interval=0.2,
            ignoring=(BusUnavailable,),
        )
        assert ack is not None
        got: list[Delivery] = []

        async def two_fetched() -> bool:
            got.extend(await consumer.fetch(batch=10, timeout=0.5))
            return len(got) >= 2

        await eventually(
            two_fetched,
            "two deliveries after the restart",
            20,
            interval=0.2,
            ignoring=(BusUnavailable,),
        )
        # The file-backed stream and the durable consumer survived the restart. "during" may or
        # may not have been stored (the server was gone; the caller got BusUnavailable and would
        # retry with the same dedup id), so it is not asserted either way.
        ids = [d.dedup_id for d in got]
        assert "before" in ids
        assert "after" in ids or len(got) >= 2
        for d in got:
            await d.ack()
    finally:
        await bus.close()


async def test_fetch_returns_what_is_there_at_once_and_keeps_late_deliveries(
    jetstream_factory: tuple[BusConfig, BusFactory],
) -> None:
    """One pull request per fetch: the server sends what it has and ends the request, so a
    fetch for many does not wait for the batch to fill; messages delivered to a fetch the caller
    gave up on are handed out by the next fetch, not lost until the ack wait."""
    _, factory = jetstream_factory
    bus = await factory()
    consumer = await bus.subscribe("fetch.now", "g1")
    for i in range(3):
        await bus.publish("fetch.now", "k", f"d{i}", b"%d" % i)
    # An expiry far beyond the helper's hang guard: the fetch returns because the server ended
    # the request with what it had, not because the batch filled or the request expired.
    fetching = asyncio.create_task(consumer.fetch(100, timeout=600.0))
    await eventually(fetching.done, "the fetch to return what the server had")
    got = fetching.result()
    assert [d.data for d in got] == [b"0", b"1", b"2"]
    for d in got:
        await d.ack()

    # A long-poll that is cancelled while waiting; the message published meanwhile reaches this
    # consumer and is returned by the next fetch (delivered once: deliveries == 1).
    waiting = asyncio.create_task(consumer.fetch(10, timeout=2.0))
    await asyncio.sleep(0.2)
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    await bus.publish("fetch.now", "k", "d3", b"3")
    late: list[bytes] = []

    async def late_fetched() -> bool:
        for d in await consumer.fetch(10, timeout=0.5):
            assert d.deliveries == 1
            late.append(d.data)
            await d.ack()
        return bool(late)

    await eventually(late_fetched, "the late delivery", 5)
    assert late == [b"3"]


async def test_fetch_long_polls_when_the_server_answers_no_wait_at_once(
    jetstream_factory: tuple[BusConfig, BusFactory], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that ignores ``expires`` on a no-wait request answers 404 at once when empty
    (simulated by dropping ``expires``): the fetch then long-polls instead of returning, so an
    idle consumer does not spin."""
    real = PullFetcher._request

    requests: list[dict[str, object]] = []

    async def old_server(self: PullFetcher, request: dict[str, object]) -> str:
        requests.append(request)
        if request.get("no_wait"):
            request = {k: v for k, v in request.items() if k != "expires"}
        return await real(self, request)

    monkeypatch.setattr(PullFetcher, "_request", old_server)
    _, factory = jetstream_factory
    bus = await factory()
    consumer = await bus.subscribe("fetch.old", "g1")

    fetching = asyncio.create_task(consumer.fetch(10, timeout=600.0))
    # The empty no-wait answer came at once; the fetch then sent a long-poll and is waiting.
    await eventually(lambda: any(not r.get("no_wait") for r in requests), "a long-poll request")
    assert not fetching.done()
    await bus.publish("fetch.old", "k", "d1", b"late")
    await eventually(fetching.done, "the long-poll to return the late message")
    got = fetching.result()
    assert [d.data for d in got] == [b"late"]
    await got[0].ack()


def test_header_fast_path_matches_nats_py() -> None:
    """The ASCII fast path parses header blocks exactly like nats-py's own parser."""
    from nats.aio.client import Client

    slow = Client._parse_header_lines
    samples = [
        b"Aivedio-Key: 7f1c\r\nNats-Msg-Id: task.status.changed:7f1c:5\r\n\r\n",
        b"A:b\r\nC:\tvalue \r\nbad name: x\r\nno colon\r\n: empty name\r\n\r\n",
        b"K: caf\xc3\xa9\r\nL: \xff\r\n\r\n",  # non-ASCII: nats-py's parser decides
        b"K: a:b:c\r\n\x1cX: y\r\n",
        b"",
    ]
    for raw in samples:
        assert _header_lines(raw, slow) == slow(raw), raw
    assert status_of(b"NATS/1.0 408 Request Timeout\r\n\r\n") == "408"
    assert status_of(b"NATS/1.0 503\r\n\r\n") == "503"
    assert status_of(b"NATS/1.0\r\nStatus: 408\r\n\r\n") == ""
    assert status_of(None) == ""


async def test_headers_nats_py_would_rewrite_and_double_ack(
    jetstream_factory: tuple[BusConfig, BusFactory],
) -> None:
    """Raw frames carry user headers as they are; a value nats-py would strip goes through
    ``Client.publish`` (same result as before the raw path); a second ack is a BusError."""
    _, factory = jetstream_factory
    bus = await factory()
    consumer = await bus.subscribe("raw.headers", "g1")
    await bus.publish("raw.headers", "k1", "d1", b"one", headers={"X-Plain": "v 1"})
    await bus.publish("raw.headers", "k2", "d2", b"two", headers={"X-Padded": " v2 "})
    got = await consumer.fetch(10, timeout=2.0)
    assert [(d.key, d.dedup_id, d.data, dict(d.headers)) for d in got] == [
        ("k1", "d1", b"one", {"X-Plain": "v 1"}),
        ("k2", "d2", b"two", {"X-Padded": "v2"}),
    ]
    await got[0].ack()
    with pytest.raises(BusError):
        await got[0].ack()
    await got[1].nak()
    again = await consumer.fetch(10, timeout=2.0)
    assert [(d.data, d.deliveries) for d in again] == [(b"two", 2)]
    await again[0].ack()
