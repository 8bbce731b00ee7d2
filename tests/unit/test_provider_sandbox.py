"""The sandbox adapter: normalization table, errors, dedup keys, minimization, outbound calls."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from aivedio.domain.observation import ProviderStatus, Source
from aivedio.providers.port import (
    InboxFields,
    PayloadError,
    ProviderAdapter,
    Rejected,
    SubmitRequest,
    Verified,
)
from aivedio.providers.sandbox import SandboxAdapter
from tests.contract.provider_contract import (
    Delivery,
    SignedCallbackContract,
    standard_webhooks,
)
from tests.contract.provider_outbound import answered

SECRET = "whsec_" + base64.b64encode(b"k" * 24).decode()
SECRETS = {"k0": SECRET, "k1": "whsec_" + base64.b64encode(b"n" * 24).decode()}
FIELDS = InboxFields(provider="sandbox", dedup_key="msg_gen_1_1")


def make(
    client: httpx.AsyncClient | None = None, keys: tuple[str, ...] = ("k0",)
) -> SandboxAdapter:
    return SandboxAdapter(
        base_url="http://sandbox.test/",
        api_key="sk_test",
        webhook_secrets=tuple((key, SECRETS[key]) for key in keys),
        public_url="http://aivedio.test",
        client=client,
    )


def generation(status: str = "running", **extra: Any) -> dict[str, Any]:
    return {
        "id": "gen_1",
        "status": status,
        "progress": 40,
        "sequence": 3,
        "updated_at": "2026-01-01T00:00:00.000000Z",
        "error": None,
        "output": None,
        "metadata": {"client_request_id": "cr_1"},
        **extra,
    }


def webhook(status: str = "running", **extra: Any) -> dict[str, Any]:
    return {"type": "generation.updated", "data": generation(status, **extra)}


class TestSandboxContract(SignedCallbackContract):
    status_table = (
        ("running", ProviderStatus.RUNNING),
        ("queued", ProviderStatus.QUEUED),
        ("succeeded", ProviderStatus.SUCCEEDED),
        ("failed", ProviderStatus.FAILED),
        ("canceled", ProviderStatus.CANCELED),
    )
    progress_cases = (
        (-5, 0), (250, 100), (33.4, 33), ("12", 12), ("42%", 42), (None, None), ("x", None),
        (True, None), (float("nan"), None),
    )  # fmt: skip
    task_id = "gen_1"

    def make(
        self, client: httpx.AsyncClient | None = None, *, keys: Sequence[str] = ("k0",)
    ) -> ProviderAdapter:
        return make(client, tuple(keys))

    def callback(self, status: str) -> dict[str, Any]:
        return webhook(status)

    def query_body(self, status: str) -> Any:
        return generation(status)

    def with_progress(self, value: object) -> dict[str, Any]:
        return webhook(progress=value)

    def sign(self, body: bytes, *, delivery_id: str, at: int, key: str) -> Delivery:
        return standard_webhooks(SECRETS[key], body, delivery_id=delivery_id, at=at)


def test_satisfies_the_port() -> None:
    adapter: ProviderAdapter = make()
    assert isinstance(adapter, ProviderAdapter)
    assert adapter.honours_idempotency_key and adapter.supports_lookup
    assert adapter.supports_webhooks and adapter.signed_callbacks
    assert not adapter.needs_refetch_on_callback
    assert adapter.webhook_url_for("a1") == "http://aivedio.test/v1/callbacks/sandbox"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("queued", ProviderStatus.QUEUED),
        ("running", ProviderStatus.RUNNING),
        ("succeeded", ProviderStatus.SUCCEEDED),
        ("failed", ProviderStatus.FAILED),
        ("canceled", ProviderStatus.CANCELED),
    ],
)
def test_normalization_table(raw: str, expected: ProviderStatus) -> None:
    state = make().normalize(webhook(raw), FIELDS)
    assert state.status is expected
    assert state.provider_task_id == "gen_1"
    assert state.client_request_id == "cr_1"
    assert state.sequence == 3
    assert state.progress == 40
    assert state.occurred_at == datetime(2026, 1, 1, tzinfo=UTC)
    assert state.output_ref == ("sandbox:gen_1" if raw == "succeeded" else None)
    assert (state.error_code is not None) == (raw == "failed")


@pytest.mark.parametrize(
    ("code", "public"),
    [
        ("generation_failed", "generation_failed"),
        ("content_policy", "content_rejected"),
        ("invalid_params", "invalid_request"),
        ("timeout", "timeout"),
        ("contradictory_terminal", "generation_failed"),
        ("gpu_on_fire", "generation_failed"),
        (None, "generation_failed"),
    ],
)
def test_error_codes_map_to_public_codes(code: str | None, public: str) -> None:
    error = {"code": code, "message": "raw provider text"} if code else None
    state = make().normalize(webhook("failed", error=error), FIELDS)
    assert state.error_code == public
    obs = state.observation("sandbox", None, Source.WEBHOOK)
    assert obs.error_message is not None and "raw provider text" not in obs.error_message


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        ({"type": "generation.updated"}, "missing_data"),
        ({"data": {"status": "running"}}, "missing_id"),
        ({"data": {"id": "gen_1", "status": "exploded"}}, "unknown_status"),
        ({"data": {"id": "gen_1", "status": 3}}, "unknown_status"),
    ],
)
def test_unparseable_payload_is_a_payload_error(payload: dict[str, Any], code: str) -> None:
    with pytest.raises(PayloadError) as caught:
        make().normalize(payload, FIELDS)
    assert caught.value.code == code


def test_dedup_key_is_the_signed_webhook_id() -> None:
    verified = Verified(key_version="k0", event_id="msg_gen_1_3", timestamp=1)
    info = make().dedup({}, webhook(), verified, b"\x00" * 32)
    assert info.dedup_key == "msg_gen_1_3"
    assert info.provider_task_id == "gen_1"
    assert info.client_request_id == "cr_1"


def test_minimize_redacts_signed_output_urls() -> None:
    output = {"url": "http://sb/files/gen_1.mp4?exp=1&sig=SECRET", "content_type": "video/mp4"}
    payload = webhook("succeeded", output=output)
    stored = make().minimize(payload)
    assert "SECRET" not in json.dumps(stored)
    assert stored["data"]["output"]["url"] == "[redacted]"
    assert payload["data"]["output"]["url"].endswith("SECRET")  # argument untouched
    # what is stored still normalizes
    assert make().normalize(stored, FIELDS).status is ProviderStatus.SUCCEEDED


async def test_submit_sends_key_and_metadata_once() -> None:
    request = SubmitRequest(
        client_request_id="cr_9",
        model="m1",
        prompt="a cat",
        params={"sandbox": {"outcome": "succeeded"}},
        webhook_url="http://aivedio.test/v1/callbacks/sandbox",
        metadata={"task": "t1"},
    )
    result, requests = await answered(
        make,
        lambda r: httpx.Response(200, json={"id": "gen_9", "status": "queued"}),
        lambda a: a.submit(request),
    )
    assert result.provider_task_id == "gen_9" and result.status is ProviderStatus.QUEUED
    assert not result.replayed
    (sent,) = requests
    assert sent.url == "http://sandbox.test/v1/generations"
    assert sent.headers["idempotency-key"] == "cr_9"
    assert sent.headers["authorization"] == "Bearer sk_test"
    body = json.loads(sent.content)
    assert body["metadata"] == {"task": "t1", "client_request_id": "cr_9"}
    assert body["webhook_url"].endswith("/v1/callbacks/sandbox")


async def test_submit_replay_and_rejection() -> None:
    request = SubmitRequest(client_request_id="cr_9", model="m1", prompt="a cat")
    result, _ = await answered(
        make,
        lambda r: httpx.Response(
            200, json={"id": "gen_9", "status": "running"}, headers={"Idempotent-Replayed": "true"}
        ),
        lambda a: a.submit(request),
    )
    assert result.replayed
    with pytest.raises(Rejected) as caught:
        await answered(
            make,
            lambda r: httpx.Response(422, json={"error": {"code": "invalid_sandbox_params"}}),
            lambda a: a.submit(request),
        )
    assert caught.value.public_code == "invalid_request"


async def test_query_normalizes_the_view() -> None:
    state, requests = await answered(
        make,
        lambda r: httpx.Response(200, json=generation("succeeded", progress=100, sequence=7)),
        lambda a: a.query("gen_1"),
    )
    assert requests[0].url == "http://sandbox.test/v1/generations/gen_1"
    assert state.status is ProviderStatus.SUCCEEDED and state.sequence == 7
    assert state.output_ref == "sandbox:gen_1"


async def test_cancel_and_lookup() -> None:
    accepted, _ = await answered(
        make, lambda r: httpx.Response(202, json={"id": "g", "status": "canceled"}),
        lambda a: a.cancel("g"),
    )  # fmt: skip
    finished, _ = await answered(
        make, lambda r: httpx.Response(409, json={"error": {"code": "already_terminal"}}),
        lambda a: a.cancel("g"),
    )  # fmt: skip
    assert accepted is True and finished is False
    found, requests = await answered(
        make, lambda r: httpx.Response(200, json={"data": [generation()]}),
        lambda a: a.lookup("cr_1"),
    )  # fmt: skip
    assert found == "gen_1"
    assert requests[0].url.params["idempotency_key"] == "cr_1"
    missing, _ = await answered(
        make, lambda r: httpx.Response(200, json={"data": []}), lambda a: a.lookup("cr_2")
    )
    assert missing is None
