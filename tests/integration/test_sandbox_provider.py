"""The sandbox provider over real HTTP: protocol, scripting, webhooks, chaos knobs, files, stats.

The sandbox and a tiny webhook receiver each run in uvicorn on a free port inside the test's event
loop. Webhook signatures are checked with the independent ``standardwebhooks`` package, not with
the sandbox's own signer. No test asserts a duration; waits are bounded polls for a condition.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import av
import httpx
import pytest
import uvicorn
from standardwebhooks import Webhook, WebhookVerificationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from aivedio.sandbox import SandboxConfig, create_app, running
from aivedio.sandbox.provider import SandboxProvider
from aivedio.sandbox.simulation import CreateRequest, Script
from aivedio.sandbox.webhooks import sign
from tests.waiting import eventually as wait_for_async
from tests.waiting import eventually as wait_until

API_KEY = "sk_sandbox_test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SECRET_NEW = "whsec_" + base64.b64encode(b"new-secret-new-secret-new-secret").decode()
SECRET_OLD = "whsec_" + base64.b64encode(b"old-secret-old-secret-old-secret").decode()
QUICK = {"queue_s": 0.05, "duration_s": 0.3, "steps": 3}
TERMINAL = {"succeeded", "failed", "canceled"}


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@dataclass
class Running:
    server: uvicorn.Server
    task: asyncio.Task[None]
    url: str

    async def stop(self) -> None:
        self.server.should_exit = True
        await asyncio.wait_for(self.task, 15)


async def run_app(app: Any, sock: socket.socket) -> Running:
    config = uvicorn.Config(app, lifespan="on", ws="none", log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await wait_until(lambda: server.started, what="uvicorn start")
    host, port = sock.getsockname()
    return Running(server, task, f"http://{host}:{port}")


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes

    @property
    def data(self) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(self.body)["data"]
        return parsed


@dataclass
class Receiver:
    """A webhook endpoint that records every request; ``fail_first`` answers 500 that many times."""

    url: str = ""
    received: list[Received] = field(default_factory=list)
    fail_first: int = 0
    attempts: dict[str, int] = field(default_factory=dict)

    async def handle(self, request: Request) -> Response:
        body = await request.body()
        item = Received(dict(request.headers), body)
        self.received.append(item)
        msg_id = item.headers.get("webhook-id", "")
        self.attempts[msg_id] = self.attempts.get(msg_id, 0) + 1
        if self.attempts[msg_id] <= self.fail_first:
            return Response(status_code=500)
        return Response(status_code=204)

    def for_generation(self, generation_id: str) -> list[Received]:
        return [r for r in self.received if r.data["id"] == generation_id]

    def statuses(self, generation_id: str) -> list[str]:
        return [r.data["status"] for r in self.for_generation(generation_id)]


@dataclass
class Sandbox:
    url: str
    client: httpx.AsyncClient
    receiver: Receiver

    async def create(
        self, key: str, script: dict[str, Any] | None = None, *, webhook: bool = True, **extra: Any
    ) -> httpx.Response:
        body: dict[str, Any] = {
            "model": "sandbox-video-1",
            "prompt": "a cat surfing",
            "params": {"sandbox": script} if script is not None else {},
            "webhook_url": self.receiver.url if webhook else None,
            "metadata": {"client_request_id": key},
        }
        body.update(extra)
        return await self.client.post(
            "/v1/generations", json=body, headers={**AUTH, "Idempotency-Key": key}
        )

    async def get(self, generation_id: str) -> httpx.Response:
        return await self.client.get(f"/v1/generations/{generation_id}", headers=AUTH)

    async def chaos(self, **knobs: Any) -> dict[str, Any]:
        response = await self.client.put("/_sandbox/chaos", json=knobs, headers=AUTH)
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    async def stats(self) -> dict[str, Any]:
        response = await self.client.get("/_sandbox/stats", headers=AUTH)
        assert response.status_code == 200
        result: dict[str, Any] = response.json()
        return result

    async def wait_terminal(self, generation_id: str) -> dict[str, Any]:
        seen: dict[str, Any] = {}

        async def done() -> bool:
            response = await self.get(generation_id)
            if response.status_code == 200:
                seen.update(response.json())
            return seen.get("status") in TERMINAL

        await wait_for_async(done, what=f"{generation_id} terminal")
        return seen


SandboxFactory = Callable[..., Awaitable[Sandbox]]


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    recorder = Receiver()
    app = Starlette(routes=[Route("/hook", recorder.handle, methods=["POST"])])
    running = await run_app(app, free_socket())
    recorder.url = running.url + "/hook"
    yield recorder
    await running.stop()


@pytest.fixture
async def make_sandbox(receiver: Receiver) -> AsyncIterator[SandboxFactory]:
    started: list[tuple[Running, httpx.AsyncClient]] = []

    async def make(**overrides: Any) -> Sandbox:
        sock = free_socket()
        host, port = sock.getsockname()
        config = SandboxConfig(
            api_key=API_KEY,
            webhook_secrets=(SECRET_NEW,),
            public_url=f"http://{host}:{port}",
            webhook_backoff_s=0.05,
            seed=7,
        )
        running = await run_app(create_app(replace(config, **overrides)), sock)
        client = httpx.AsyncClient(base_url=running.url, timeout=10, trust_env=False)
        started.append((running, client))
        return Sandbox(running.url, client, receiver)

    yield make
    for server, client in started:
        await client.aclose()
        await server.stop()


@pytest.fixture
async def sandbox(make_sandbox: SandboxFactory) -> Sandbox:
    return await make_sandbox()


# -- the protocol --------------------------------------------------------------------------------


async def test_api_key_is_required(sandbox: Sandbox) -> None:
    body = {"model": "m", "prompt": "p"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = await sandbox.client.post(
            "/v1/generations", json=body, headers={**headers, "Idempotency-Key": "k"}
        )
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "unauthorized"
    assert (await sandbox.client.get("/v1/generations/gen_x")).status_code == 401
    assert (await sandbox.client.post("/v1/generations/gen_x/cancel")).status_code == 401
    assert (await sandbox.client.get("/_sandbox/stats")).status_code == 401
    assert (await sandbox.client.put("/_sandbox/chaos", json={"fast": True})).status_code == 401
    assert (await sandbox.client.post("/_sandbox/reset")).status_code == 401
    assert (await sandbox.stats())["generations"]["created"] == 0


async def test_idempotency_key_is_required(sandbox: Sandbox) -> None:
    response = await sandbox.client.post(
        "/v1/generations", json={"model": "m", "prompt": "p"}, headers=AUTH
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "idempotency_key_required"


async def test_invalid_bodies_are_rejected(sandbox: Sandbox) -> None:
    headers = {**AUTH, "Idempotency-Key": "bad"}
    response = await sandbox.client.post("/v1/generations", content=b"{", headers=headers)
    assert response.status_code == 400
    response = await sandbox.client.post("/v1/generations", json={"prompt": "p"}, headers=headers)
    assert response.status_code == 422
    for script in ({"outcome": "exploded"}, {"steps": 0}, {"duration_s": -1}, {"typo": 1}):
        response = await sandbox.create("bad", script)
        assert response.status_code == 422
        assert response.json()["error"]["code"] == "invalid_sandbox_params"
    assert (await sandbox.stats())["generations"]["created"] == 0


async def test_same_idempotency_key_returns_the_same_generation(sandbox: Sandbox) -> None:
    first = await sandbox.create("key-1", QUICK)
    assert first.status_code == 200
    assert first.json()["status"] == "queued"
    assert first.json()["id"].startswith("gen_")
    replies = await asyncio.gather(*(sandbox.create("key-1", QUICK) for _ in range(10)))
    assert {r.json()["id"] for r in replies} == {first.json()["id"]}
    assert all(r.headers["idempotent-replayed"] == "true" for r in replies)
    other = await sandbox.create("key-2", QUICK)
    assert other.json()["id"] != first.json()["id"]

    response = await sandbox.client.get("/_sandbox/stats?keys=1", headers=AUTH)
    generations = response.json()["generations"]
    assert generations["created"] == 2
    assert generations["create_requests"] == 12
    assert generations["idempotent_replays"] == 10
    assert generations["unique_idempotency_keys"] == 2
    assert generations["create_requests_by_key"] == {"key-1": 11, "key-2": 1}

    found = await sandbox.client.get("/v1/generations?idempotency_key=key-1", headers=AUTH)
    assert [g["id"] for g in found.json()["data"]] == [first.json()["id"]]
    missing = await sandbox.client.get("/v1/generations?idempotency_key=nope", headers=AUTH)
    assert missing.json()["data"] == []


@pytest.mark.parametrize("outcome", ["succeeded", "failed", "canceled"])
async def test_lifecycle_reaches_the_scripted_outcome(sandbox: Sandbox, outcome: str) -> None:
    script = {**QUICK, "outcome": outcome, "error_code": "content_policy"}
    generation_id = (await sandbox.create(f"life-{outcome}", script, webhook=False)).json()["id"]
    sequences: list[int] = []

    async def terminal() -> bool:
        body = (await sandbox.get(generation_id)).json()
        sequences.append(body["sequence"])
        return body["status"] in TERMINAL

    await wait_for_async(terminal, what="terminal")
    body = (await sandbox.get(generation_id)).json()
    assert set(body) == {
        "id",
        "status",
        "progress",
        "sequence",
        "updated_at",
        "error",
        "output",
        "metadata",
    }
    assert body["status"] == outcome
    assert body["metadata"] == {"client_request_id": f"life-{outcome}"}
    assert body["updated_at"].endswith("Z")
    assert sequences == sorted(sequences)
    # queued(1), running 0, 33, 67, terminal: every change took one sequence number
    assert body["sequence"] == 5
    if outcome == "succeeded":
        assert body["progress"] == 100
        assert body["error"] is None
        assert body["output"]["content_type"] == "video/mp4"
        assert body["output"]["url"].startswith(sandbox.url + "/files/" + generation_id)
        assert body["output"]["expires_at"].endswith("Z")
    else:
        assert body["output"] is None
        expected = "content_policy" if outcome == "failed" else "canceled"
        assert body["error"]["code"] == expected
        assert body["error"]["message"]


async def test_cancel_while_running_and_after_terminal(sandbox: Sandbox) -> None:
    slow = {"queue_s": 0.0, "duration_s": 60, "steps": 2}
    generation_id = (await sandbox.create("cancel-1", slow, webhook=False)).json()["id"]
    await wait_for_async(lambda: _status_is(sandbox, generation_id, "running"), what="running")
    response = await sandbox.client.post(f"/v1/generations/{generation_id}/cancel", headers=AUTH)
    assert response.status_code == 202
    assert response.json() == {"id": generation_id, "status": "canceled"}
    body = (await sandbox.get(generation_id)).json()
    assert body["status"] == "canceled"
    assert body["sequence"] == 3
    again = await sandbox.client.post(f"/v1/generations/{generation_id}/cancel", headers=AUTH)
    assert again.status_code == 202

    done_id = (await sandbox.create("cancel-2", QUICK, webhook=False)).json()["id"]
    await sandbox.wait_terminal(done_id)
    late = await sandbox.client.post(f"/v1/generations/{done_id}/cancel", headers=AUTH)
    assert late.status_code == 409
    missing = await sandbox.client.post("/v1/generations/gen_nope/cancel", headers=AUTH)
    assert missing.status_code == 404


async def _status_is(sandbox: Sandbox, generation_id: str, status: str) -> bool:
    return bool((await sandbox.get(generation_id)).json()["status"] == status)


async def test_fast_knob_finishes_default_tasks(make_sandbox: SandboxFactory) -> None:
    sandbox = await make_sandbox(queue_s=30.0, duration_s=600.0)
    await sandbox.chaos(fast=True)
    generation_id = (await sandbox.create("fast-1", webhook=False)).json()["id"]
    assert (await sandbox.wait_terminal(generation_id))["status"] == "succeeded"


async def test_hold_keeps_a_generation_queued_and_silent(
    make_sandbox: SandboxFactory, receiver: Receiver
) -> None:
    """``params.sandbox.hold``: no timeline and no webhook of its own, even with ``fast`` and an
    early callback rolled; a cancel still moves it and is announced."""
    sandbox = await make_sandbox(queue_s=0.0, duration_s=0.1)
    await sandbox.chaos(fast=True, callback_before_submit_response=1.0)
    generation_id = (await sandbox.create("hold-1", {"hold": True})).json()["id"]
    await asyncio.sleep(0.4)  # past the whole default (and fast) timeline
    body = (await sandbox.get(generation_id)).json()
    assert (body["status"], body["sequence"], body["progress"]) == ("queued", 1, 0)
    assert receiver.received == []
    assert (await sandbox.stats())["webhooks"].get("events", 0) == 0
    response = await sandbox.client.post(f"/v1/generations/{generation_id}/cancel", headers=AUTH)
    assert response.status_code == 202
    await wait_for_async(
        lambda: _received_any(receiver), what="the cancel's webhook of a held generation"
    )
    assert receiver.statuses(generation_id) == ["canceled"]
    bad = await sandbox.create("hold-2", {"hold": "yes"})
    assert bad.status_code == 422
    assert bad.json()["error"]["code"] == "invalid_sandbox_params"


async def _received_any(receiver: Receiver) -> bool:
    return bool(receiver.received)


# -- webhooks ------------------------------------------------------------------------------------


async def test_webhooks_are_signed_with_every_secret_during_rotation(
    make_sandbox: SandboxFactory, receiver: Receiver
) -> None:
    sandbox = await make_sandbox(webhook_secrets=(SECRET_NEW, SECRET_OLD))
    generation_id = (await sandbox.create("wh-1", QUICK)).json()["id"]
    await wait_until(
        lambda: "succeeded" in receiver.statuses(generation_id), what="succeeded webhook"
    )
    events = receiver.for_generation(generation_id)
    assert [e.data["sequence"] for e in events] == [1, 2, 3, 4, 5]
    assert [e.data["status"] for e in events] == [
        "queued",
        "running",
        "running",
        "running",
        "succeeded",
    ]
    for event in events:
        assert len(event.headers["webhook-signature"].split(" ")) == 2
        for secret in (SECRET_NEW, SECRET_OLD):
            payload = Webhook(secret).verify(event.body, event.headers)
            assert payload["type"] == "generation.updated"
        assert event.headers["webhook-id"] == f"msg_{generation_id}_{event.data['sequence']}"
    unrelated = "whsec_" + base64.b64encode(b"someone-else-entirely-0123456789").decode()
    with pytest.raises(WebhookVerificationError):
        Webhook(unrelated).verify(events[0].body, events[0].headers)
    # the webhook body is the GET body at the time of the change
    final = (await sandbox.get(generation_id)).json()
    assert {k: v for k, v in events[-1].data.items() if k != "output"} == {
        k: v for k, v in final.items() if k != "output"
    }
    await wait_for_async(lambda: _webhook_count(sandbox, "delivered", 5), what="5 delivered")
    assert (await sandbox.stats())["webhooks"]["events"] == 5


def test_signer_matches_the_standard_webhooks_test_vector() -> None:
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signature = sign([key], "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b'{"test": 2432232314}')
    assert signature == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


async def test_forged_signatures_fail_verification(sandbox: Sandbox, receiver: Receiver) -> None:
    await sandbox.chaos(forge_signature_rate=1.0)
    generation_id = (await sandbox.create("forge-1", QUICK)).json()["id"]
    await wait_until(lambda: len(receiver.for_generation(generation_id)) == 10, what="10 webhooks")
    verifier = Webhook(SECRET_NEW)
    good = bad = 0
    for event in receiver.for_generation(generation_id):
        try:
            verifier.verify(event.body, event.headers)
            good += 1
        except WebhookVerificationError:
            bad += 1
    assert (good, bad) == (5, 5)
    # our receiver accepts anything: the sandbox counts forgeries a receiver wrongly accepted
    await wait_for_async(
        lambda: _webhook_count(sandbox, "forged_accepted", 5), what="forgeries counted"
    )
    assert (await sandbox.stats())["webhooks"]["forged"] == 5


async def test_stale_copies_are_signed_well_but_an_hour_old(
    sandbox: Sandbox, receiver: Receiver
) -> None:
    await sandbox.chaos(stale_signature_rate=1.0)
    generation_id = (await sandbox.create("stale-1", QUICK)).json()["id"]
    await wait_until(lambda: len(receiver.for_generation(generation_id)) == 10, what="10 webhooks")
    verifier = Webhook(SECRET_NEW)
    good = stale = 0
    for event in receiver.for_generation(generation_id):
        try:
            verifier.verify(event.body, event.headers)  # checks the 5-minute tolerance too
            good += 1
        except WebhookVerificationError:
            age = time.time() - int(event.headers["webhook-timestamp"])
            assert age > 3000
            stale += 1
    assert (good, stale) == (5, 5)
    await wait_for_async(lambda: _webhook_count(sandbox, "stale_accepted", 5), what="counted")
    stats = (
        await sandbox.client.get("/_sandbox/stats", params={"delivered": "1"}, headers=AUTH)
    ).json()
    assert stats["webhooks"]["stale"] == 5
    # only the genuine copies count as delivered, each id once
    assert stats["webhooks_delivered_ids"] == sorted(
        f"msg_{generation_id}_{n}" for n in range(1, 6)
    )


async def test_duplicates_are_sent_and_counted(sandbox: Sandbox, receiver: Receiver) -> None:
    await sandbox.chaos(duplicate_rate=1.0)
    generation_id = (await sandbox.create("dup-1", QUICK)).json()["id"]
    await wait_until(lambda: len(receiver.for_generation(generation_id)) == 10, what="10 webhooks")
    ids = [e.headers["webhook-id"] for e in receiver.for_generation(generation_id)]
    assert len(set(ids)) == 5
    assert all(ids.count(i) == 2 for i in ids)
    await wait_for_async(lambda: _webhook_count(sandbox, "delivered", 10), what="10 delivered")
    assert (await sandbox.stats())["webhooks"]["duplicated"] == 5


async def test_drops_are_counted_and_webhooks_can_be_switched_off(
    sandbox: Sandbox, receiver: Receiver
) -> None:
    await sandbox.chaos(drop_rate=1.0)
    dropped_id = (await sandbox.create("drop-1", QUICK)).json()["id"]
    await sandbox.wait_terminal(dropped_id)
    await sandbox.chaos(drop_rate=0.0, webhooks_enabled=False)
    silent_id = (await sandbox.create("off-1", QUICK)).json()["id"]
    await sandbox.wait_terminal(silent_id)
    await wait_for_async(
        lambda: _webhook_count(sandbox, "disabled", 5), what="disabled webhooks counted"
    )
    stats = (await sandbox.stats())["webhooks"]
    assert stats["dropped"] == 5
    assert stats.get("sent", 0) == 0
    assert receiver.received == []


async def _webhook_count(sandbox: Sandbox, name: str, expected: int) -> bool:
    return bool((await sandbox.stats())["webhooks"].get(name, 0) == expected)


async def test_failed_deliveries_are_retried_with_the_same_id(
    sandbox: Sandbox, receiver: Receiver
) -> None:
    receiver.fail_first = 2
    generation_id = (await sandbox.create("retry-1", QUICK)).json()["id"]
    await wait_for_async(
        lambda: _webhook_count(sandbox, "delivered", 5), what="5 delivered after retries"
    )
    assert len(receiver.for_generation(generation_id)) == 15
    assert set(receiver.attempts.values()) == {3}
    assert (await sandbox.stats())["webhooks"]["retried"] == 10


async def test_reorder_holds_one_and_sends_it_later(sandbox: Sandbox, receiver: Receiver) -> None:
    await sandbox.chaos(reorder=1.0)
    generation_id = (await sandbox.create("reorder-1", QUICK)).json()["id"]
    await wait_until(lambda: len(receiver.for_generation(generation_id)) == 5, what="5 webhooks")
    sequences = [e.data["sequence"] for e in receiver.for_generation(generation_id)]
    assert sorted(sequences) == [1, 2, 3, 4, 5]
    assert sequences != sorted(sequences)
    assert (await sandbox.stats())["webhooks"]["reordered"] >= 1


async def test_delay_knob_still_delivers(sandbox: Sandbox, receiver: Receiver) -> None:
    await sandbox.chaos(delay_ms=[10, 50])
    generation_id = (await sandbox.create("delay-1", QUICK)).json()["id"]
    await wait_until(lambda: len(receiver.for_generation(generation_id)) == 5, what="5 webhooks")


async def test_callback_arrives_before_the_submit_response(
    sandbox: Sandbox, receiver: Receiver
) -> None:
    await sandbox.chaos(callback_before_submit_response=True)
    response = await sandbox.create("early-1", QUICK)
    generation_id = response.json()["id"]
    # the create was answered only after the receiver had answered the first webhook
    first = receiver.for_generation(generation_id)[0]
    assert first.data["status"] == "queued"
    assert first.data["metadata"] == {"client_request_id": "early-1"}
    Webhook(SECRET_NEW).verify(first.body, first.headers)
    assert (await sandbox.stats())["chaos"]["callback_before_submit_response"] == 1


async def test_contradictory_terminal_sends_the_other_terminal(
    sandbox: Sandbox, receiver: Receiver
) -> None:
    await sandbox.chaos(contradictory_terminal=1.0)
    generation_id = (await sandbox.create("contra-1", QUICK)).json()["id"]
    await wait_until(lambda: len(receiver.for_generation(generation_id)) == 6, what="6 webhooks")
    last_two = sorted(receiver.for_generation(generation_id), key=lambda e: e.data["sequence"])[-2:]
    assert [e.data["status"] for e in last_two] == ["succeeded", "failed"]
    assert [e.data["sequence"] for e in last_two] == [5, 6]
    assert last_two[1].data["error"]["code"] == "contradictory_terminal"
    Webhook(SECRET_NEW).verify(last_two[1].body, last_two[1].headers)
    # the provider's record keeps its first terminal
    assert (await sandbox.get(generation_id)).json()["status"] == "succeeded"
    assert (await sandbox.stats())["chaos"]["contradictory_terminal"] == 1


# -- query chaos, submit timeout, rate cap -------------------------------------------------------


async def test_query_429_5xx_and_slow_knobs(sandbox: Sandbox) -> None:
    generation_id = (await sandbox.create("q-1", QUICK, webhook=False)).json()["id"]
    await sandbox.chaos(query_429_rate=1.0, retry_after_s=3)
    limited = await sandbox.get(generation_id)
    assert limited.status_code == 429
    assert limited.headers["retry-after"] == "3"
    await sandbox.chaos(query_429_rate=0.0, query_5xx_rate=1.0)
    broken = await sandbox.get(generation_id)
    assert broken.status_code in {500, 502, 503}
    await sandbox.chaos(query_5xx_rate=0.0, query_slow_ms=[20, 40])
    assert (await sandbox.get(generation_id)).status_code == 200
    chaos = (await sandbox.stats())["chaos"]
    assert (chaos["query_429"], chaos["query_5xx"], chaos["query_slow"]) == (1, 1, 1)


async def test_query_answers_404_just_after_creation(sandbox: Sandbox) -> None:
    await sandbox.chaos(query_not_found_for_s=0.5)
    generation_id = (await sandbox.create("young-1", QUICK, webhook=False)).json()["id"]
    assert (await sandbox.get(generation_id)).status_code == 404
    await wait_for_async(lambda: _answers(sandbox, generation_id, 200), what="generation visible")
    assert (await sandbox.stats())["chaos"]["query_404_young"] >= 1


async def _answers(sandbox: Sandbox, generation_id: str, status: int) -> bool:
    return (await sandbox.get(generation_id)).status_code == status


async def test_submit_timeout_after_accept_creates_exactly_one(
    make_sandbox: SandboxFactory,
) -> None:
    sandbox = await make_sandbox(submit_hold_s=1.0)
    await sandbox.chaos(submit_timeout_after_accept=True)
    with pytest.raises(httpx.ReadTimeout):
        await sandbox.client.post(
            "/v1/generations",
            json={"model": "m", "prompt": "p", "params": {"sandbox": QUICK}},
            headers={**AUTH, "Idempotency-Key": "held-1"},
            timeout=0.2,
        )
    found = await sandbox.client.get("/v1/generations?idempotency_key=held-1", headers=AUTH)
    [generation] = found.json()["data"]
    await sandbox.chaos(submit_timeout_after_accept=False)
    retry = await sandbox.create("held-1", QUICK, webhook=False)
    assert retry.json()["id"] == generation["id"]
    stats = await sandbox.stats()
    assert stats["generations"]["created"] == 1
    assert stats["chaos"]["submit_timeout_after_accept"] == 1


async def test_rate_cap_limits_served_requests_per_second(make_sandbox: SandboxFactory) -> None:
    sandbox = await make_sandbox(rate_cap_qps=20)
    generation_id = "gen_unknown"
    responses = await asyncio.gather(*(sandbox.get(generation_id) for _ in range(60)))
    codes = [r.status_code for r in responses]
    rejected = [r for r in responses if r.status_code == 429]
    assert rejected
    assert all(r.headers["retry-after"] == "1" for r in rejected)
    assert set(codes) <= {404, 429}
    stats = await sandbox.stats()
    per_second = stats["per_second"]
    assert all(count <= 20 for count in per_second["served"].values())
    assert all(count <= 20 for count in per_second["queries_served"].values())
    assert stats["max_per_second"]["served"] <= 20
    assert sum(per_second["requests"].values()) == 60
    assert sum(per_second["queries"].values()) == 60
    assert sum(per_second["rejected"].values()) == len(rejected)
    assert stats["requests"]["rejected_by_rate_cap"] == len(rejected)
    assert sum(per_second["served"].values()) + len(rejected) == 60


async def test_stats_count_requests_per_endpoint_and_second(sandbox: Sandbox) -> None:
    generation_id = (await sandbox.create("stats-1", QUICK, webhook=False)).json()["id"]
    for _ in range(7):
        await sandbox.get(generation_id)
    await sandbox.client.post(f"/v1/generations/{generation_id}/cancel", headers=AUTH)
    stats = await sandbox.stats()
    assert stats["requests"]["create"] == 1
    assert stats["requests"]["query"] == 7
    assert stats["requests"]["cancel"] == 1
    assert sum(stats["per_second"]["queries"].values()) == 7
    assert sum(stats["per_second"]["requests"].values()) == 9
    assert all(key.isdigit() for key in stats["per_second"]["requests"])
    assert stats["generations"]["by_status"] == {"canceled": 1}
    assert stats["generations"]["in_flight"] == 0


async def test_chaos_knobs_validate_and_reset(sandbox: Sandbox) -> None:
    defaults = (await sandbox.client.get("/_sandbox/chaos", headers=AUTH)).json()
    assert defaults["webhooks_enabled"] is True
    assert defaults["delay_ms"] == [0, 0]
    changed = await sandbox.chaos(duplicate_rate=0.5, delay_ms=[5, 10], seed=42)
    assert (changed["duplicate_rate"], changed["delay_ms"], changed["seed"]) == (0.5, [5, 10], 42)
    for bad in ({"nope": 1}, {"drop_rate": 2}, {"delay_ms": [10, 5]}, {"fast": "yes"}):
        response = await sandbox.client.put("/_sandbox/chaos", json=bad, headers=AUTH)
        assert response.status_code == 422
        assert response.json()["error"]["code"] == "invalid_chaos"
    await sandbox.create("reset-1", QUICK, webhook=False)
    assert (await sandbox.stats())["generations"]["created"] == 1
    reset = await sandbox.client.post("/_sandbox/reset", headers=AUTH)
    assert reset.status_code == 200
    assert (await sandbox.client.get("/_sandbox/chaos", headers=AUTH)).json() == defaults
    stats = await sandbox.stats()
    assert stats["generations"]["created"] == 0
    assert stats["requests"] == {"admin": 2}


# -- output files --------------------------------------------------------------------------------


async def test_signed_file_url_serves_a_real_mp4_and_expires(
    make_sandbox: SandboxFactory,
) -> None:
    sandbox = await make_sandbox(output_url_ttl_s=1.0)
    generation_id = (await sandbox.create("file-1", QUICK, webhook=False)).json()["id"]
    output = (await sandbox.wait_terminal(generation_id))["output"]
    url = (await sandbox.get(generation_id)).json()["output"]["url"]
    assert output["content_type"] == "video/mp4"

    response = await sandbox.client.get(url)
    assert response.status_code == 200
    assert response.headers["content-type"] == "video/mp4"
    with av.open(io.BytesIO(response.content), mode="r") as container:
        [video] = container.streams.video
        assert (video.width, video.height) == (64, 64)
        frames = list(container.decode(video))
        assert frames

    tampered = url.replace("sig=", "sig=x")
    assert (await sandbox.client.get(tampered)).status_code == 403
    other = url.replace(generation_id, "gen_000000000000000000000000")
    assert (await sandbox.client.get(other)).status_code == 403
    unsigned = url.split("?")[0]
    assert (await sandbox.client.get(unsigned)).status_code == 403

    await wait_for_async(
        lambda: _url_answers(sandbox, url, 403), what="the URL to expire", timeout=10
    )
    fresh = (await sandbox.get(generation_id)).json()["output"]["url"]
    assert fresh != url
    assert (await sandbox.client.get(fresh)).status_code == 200


async def _url_answers(sandbox: Sandbox, url: str, status: int) -> bool:
    return (await sandbox.client.get(url)).status_code == status


# -- scale ---------------------------------------------------------------------------------------


async def test_thousands_of_generations_run_on_one_scheduler() -> None:
    """7,200 in-flight generations: one heap entry each, no task per generation."""
    provider = SandboxProvider(SandboxConfig(api_key=API_KEY, seed=1))
    await provider.start()
    try:
        script = Script(queue_s=0.2, duration_s=1.0, steps=4)
        request = CreateRequest("m", "p", {}, None, {}, script)
        for index in range(7200):
            await provider.create(f"bulk-{index}", request)
        assert len(provider.scheduler) == 7200
        tasks_before = len(asyncio.all_tasks())
        assert tasks_before < 100
        await wait_until(
            lambda: provider.simulator.in_flight() == 0, timeout=60, what="all terminal"
        )
        statuses = {g.status for g in provider.simulator.generations.values()}
        assert statuses == {"succeeded"}
        assert {g.sequence for g in provider.simulator.generations.values()} == {6}
    finally:
        await provider.stop()


async def test_runs_in_process_with_asgi_transport() -> None:
    app = create_app(SandboxConfig(api_key=API_KEY, public_url="http://sandbox"))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sandbox") as client:
        body = {"model": "m", "prompt": "p", "params": {"sandbox": QUICK}}
        headers = {**AUTH, "Idempotency-Key": "asgi-1"}
        not_started = await client.post("/v1/generations", json=body, headers=headers)
        assert not_started.status_code == 503
        assert not_started.json()["error"]["code"] == "sandbox_not_started"
        async with running(app) as provider:
            generation_id = (
                await client.post("/v1/generations", json=body, headers=headers)
            ).json()["id"]
            await wait_until(
                lambda: provider.simulator.generations[generation_id].status == "succeeded",
                what="succeeded",
            )
            url = (await client.get(f"/v1/generations/{generation_id}", headers=AUTH)).json()[
                "output"
            ]["url"]
            video = await client.get(url)
            assert video.status_code == 200
            assert video.content[4:8] == b"ftyp"
