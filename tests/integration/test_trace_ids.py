"""The trace id that entered with an API request or a callback rides the chain: the task or inbox
row, the observation, the task event, the outbox row, the bus message, the Redis message, and the
log lines on the way, down to the gateway's line for the frame it wrote. Every role of ``aivedio
run --role all`` runs in this process on the real servers (``chain.py``)."""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from aivedio.bus import BusConfig
from aivedio.client import Client
from aivedio.logs import JsonFormatter
from tests.integration.chain import LONG, Chain, running_chain
from tests.integration.propagation import stream_messages
from tests.integration.test_metrics import _async, listening
from tests.waiting import eventually


class Lines(logging.Handler):
    """The JSON log lines of every ``aivedio`` logger, as ``setup_logging`` would write them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))

    def where(self, msg: str, **fields: Any) -> list[dict[str, Any]]:
        return [
            line
            for line in self.lines
            if line["msg"] == msg and all(line.get(k) == v for k, v in fields.items())
        ]


@contextlib.contextmanager
def captured_lines() -> Iterator[Lines]:
    handler = Lines()
    root = logging.getLogger("aivedio")
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


@pytest.fixture
async def chain(
    database_url: str, redis_url: str, nats_url: str, tmp_path: Path
) -> AsyncIterator[Chain]:
    async with running_chain(database_url, redis_url, nats_url, tmp_path) as running:
        yield running


def traceparent() -> tuple[str, str]:
    """A W3C ``traceparent`` header and the trace id aivedio derives from it."""
    trace = secrets.token_hex(16)
    return f"00-{trace}-{secrets.token_hex(8)}-01", f"trc_{trace}"


def payload(value: Any) -> dict[str, Any]:
    loaded = json.loads(value) if isinstance(value, str) else value
    assert isinstance(loaded, dict)
    return loaded


async def bus_messages(chain: Chain, task_id: str) -> list[dict[str, Any]]:
    """The task's messages on the bus stream, as the relay published them."""
    messages = await stream_messages(
        chain.rt.urls.nats_url, BusConfig.from_settings(chain.settings, chain.rt.urls.nats_url)
    )
    out = []
    for _key, data in messages:
        with contextlib.suppress(ValueError):
            body = json.loads(data)
            if isinstance(body, dict) and body.get("aggregate_id") == task_id:
                out.append(body)
    return out


async def assert_rides_the_chain(chain: Chain, task_id: str, trace: str, lines: Lines) -> None:
    """The event(s) written under ``trace`` carry it in PostgreSQL, on the bus and in the
    gateway's frame line."""
    events: list[Any] = []

    async def written() -> bool:
        nonlocal events
        events = await chain.fetch(
            "SELECT seq FROM task_events WHERE task_id = $1"
            " AND 'trc_' || encode(trace_id, 'hex') = $2",
            uuid.UUID(task_id),
            trace,
        )
        return bool(events)

    await eventually(written, "a task event that carries the trace id")
    outbox = await chain.fetch(
        "SELECT payload->>'trace_id' AS trace FROM outbox_events WHERE aggregate_id = $1",
        uuid.UUID(task_id),
    )
    assert trace in {r["trace"] for r in outbox}

    async def on_the_bus() -> bool:
        return any(m.get("trace_id") == trace for m in await bus_messages(chain, task_id))

    await eventually(on_the_bus, "the bus message with the trace id")
    seqs = {r["seq"] for r in events}

    async def frame_logged() -> bool:
        return any(line.get("seq") in seqs for line in lines.where("frame written", trace_id=trace))

    await eventually(frame_logged, "the gateway's frame line with the trace id")
    for line in lines.where("frame written", trace_id=trace):
        assert line["task_id"] == task_id
        assert line["project_id"] == chain.project_id
    published = [
        e
        for line in lines.where("events published to redis")
        for e in line["events"]
        if e["trace_id"] == trace
    ]
    assert published and all(e["task_id"] == task_id for e in published)


async def test_the_trace_id_of_an_api_request_reaches_the_frame(chain: Chain) -> None:
    header, trace = traceparent()
    client = Client(chain.base, chain.api_key, chain.project_id)
    replayer = Client(chain.base, chain.api_key, chain.project_id)
    try:
        await client.snapshot()
        replayer.view.cursor = client.view.cursor  # from before the task: a replay
        with captured_lines() as lines:
            async with listening(client):
                response = await chain.client.post(
                    f"/v1/projects/{chain.project_id}/tasks",
                    json={"provider": "sandbox", "model": "m1", "prompt": "a cat", "params": LONG},
                    headers={
                        **chain.auth,
                        "Idempotency-Key": uuid.uuid4().hex,
                        "traceparent": header,
                    },
                )
                assert response.status_code == 202, response.text
                assert response.headers["x-trace-id"] == trace
                task_id = response.json()["task"]["id"]
                rows = await chain.fetch(
                    "SELECT trace_id FROM generation_tasks WHERE id = $1", uuid.UUID(task_id)
                )
                assert rows[0]["trace_id"] == trace
                await assert_rides_the_chain(chain, task_id, trace, lines)
                await eventually(
                    lambda: _async(bool(lines.where("submitted"))), "the submitter's line"
                )
            async with listening(replayer):

                def replayed() -> bool:
                    return any(
                        frame["trace_id"] == trace and frame["task_id"] == task_id
                        for line in lines.where("frames replayed", project_id=chain.project_id)
                        for frame in line["frames"]
                    )

                await eventually(lambda: _async(replayed()), "the replayed frame's line")
        # The submitter's line for the attempt it submitted carries the request's trace id.
        submitted = lines.where("submitted")
        assert submitted and all(line.get("trace_id") == trace for line in submitted)
    finally:
        await client.aclose()
        await replayer.aclose()


async def test_the_trace_id_of_a_callback_reaches_the_frame(chain: Chain) -> None:
    await chain.chaos(webhooks_enabled=False)  # the only callback is the test's own
    task_id = await chain.create_task(LONG)
    generation: dict[str, Any] = {}

    async def submitted() -> bool:
        nonlocal generation
        rows = await chain.fetch(
            "SELECT provider_task_id FROM task_attempts WHERE task_id = $1", uuid.UUID(task_id)
        )
        if not rows or rows[0]["provider_task_id"] is None:
            return False
        answer = await chain.sandbox.get(f"/v1/generations/{rows[0]['provider_task_id']}")
        generation = answer.json()
        return answer.status_code == 200 and generation["status"] == "running"

    await eventually(submitted, "the generation to run")
    # Newer than anything the provider said so far (the poller may have read it meanwhile).
    data = generation | {"progress": 42, "sequence": int(generation["sequence"]) + 1000}
    header, trace = traceparent()
    client = Client(chain.base, chain.api_key, chain.project_id)
    try:
        await client.snapshot()
        with captured_lines() as lines:
            async with listening(client):
                answer = await chain.callback(data, headers={"traceparent": header})
                assert answer.status_code == 204, answer.text
                assert answer.headers["x-trace-id"] == trace
                rows = await chain.fetch(
                    "SELECT dedup_key FROM provider_callback_inbox WHERE trace_id = $1", trace
                )
                assert len(rows) == 1  # the inbox row the callback became
                await assert_rides_the_chain(chain, task_id, trace, lines)
                audit = await chain.fetch(
                    "SELECT trace_id FROM observation_audit WHERE task_id = $1 AND trace_id = $2",
                    uuid.UUID(task_id),
                    trace,
                )
                events = await chain.fetch(
                    "SELECT public_payload FROM task_events WHERE task_id = $1"
                    " AND 'trc_' || encode(trace_id, 'hex') = $2",
                    uuid.UUID(task_id),
                    trace,
                )
                assert audit or events
                assert any(payload(e["public_payload"])["progress"] == 42 for e in events)
        processed = lines.where("inbox row processed", trace_id=trace)
        assert processed and processed[0]["task_id"] == task_id
    finally:
        await client.aclose()
