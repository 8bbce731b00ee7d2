"""The Kling-style adapter: unsigned callbacks authenticated by a per-attempt URL token,
refetch required; task statuses, envelope error codes, JWT auth, dedup, minimize, calls."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from aivedio.domain.observation import ProviderStatus
from aivedio.providers.kling import KlingAdapter
from aivedio.providers.port import (
    AuthFailed,
    InboxFields,
    MalformedResponse,
    ProviderAdapter,
    ProviderUnavailable,
    RateLimited,
    Rejected,
    SubmitRequest,
    Unsupported,
    VerificationError,
    Verified,
)
from aivedio.providers.verify import mint_callback_token
from tests.contract.provider_contract import Delivery, TokenCallbackContract
from tests.contract.provider_outbound import answered

TOKEN_SECRET = os.urandom(32)
TOKEN_SECRETS = {"k0": TOKEN_SECRET, "k1": os.urandom(32)}
FIELDS = InboxFields(provider="kling", dedup_key="fb:x", payload_authenticated=False)


def make(client: httpx.AsyncClient | None = None, keys: tuple[str, ...] = ("k0",)) -> KlingAdapter:
    return KlingAdapter(
        access_key="ak_1",
        secret_key="sk_1",
        callback_token_secrets=tuple((key, TOKEN_SECRETS[key]) for key in keys),
        public_url="http://aivedio.test",
        base_url="http://kling.test",
        client=client,
        clock=lambda: 1_700_000_000.0,
    )


def callback(status: str = "processing", **extra: Any) -> dict[str, Any]:
    """A callback in Kling's documented protocol (the body is the task itself)."""
    return {
        "task_id": "867283741759111202",
        "task_status": status,
        "task_status_msg": "",
        "created_at": 1722769557708,
        "updated_at": 1722769557708,
        "final_unit_deduction": "1.5",
        "task_info": {"external_task_id": "cr_1"},
        "task_result": {
            "videos": [
                {"id": "v1", "url": "https://cdn.kling/v1.mp4?x-sig=SECRET", "duration": "5"}
            ]
        },
        **extra,
    }


def envelope(data: dict[str, Any] | None, code: int = 0) -> dict[str, Any]:
    return {
        "code": code,
        "message": "SUCCEED" if code == 0 else "x",
        "request_id": "rq",
        "data": data,
    }


class TestKlingContract(TokenCallbackContract):
    status_table = (
        ("processing", ProviderStatus.RUNNING),
        ("submitted", ProviderStatus.QUEUED),
        ("succeed", ProviderStatus.SUCCEEDED),
        ("failed", ProviderStatus.FAILED),
    )
    progress_cases = ((0.5, None), (250, None))  # Kling reports no progress figure
    task_id = "867283741759111202"
    cancels = False

    def make(
        self, client: httpx.AsyncClient | None = None, *, keys: Sequence[str] = ("k0",)
    ) -> ProviderAdapter:
        return make(client, tuple(keys))

    def callback(self, status: str) -> dict[str, Any]:
        return callback(status)

    def query_body(self, status: str) -> Any:
        return envelope(callback(status))

    def fields(self) -> InboxFields:
        return FIELDS

    def sign(self, body: bytes, *, delivery_id: str, at: int, key: str) -> Delivery:
        return Delivery(callback_token=mint_callback_token(TOKEN_SECRETS[key], self.attempt_id))


async def test_capabilities_and_token_url() -> None:
    adapter: ProviderAdapter = make()
    assert isinstance(adapter, ProviderAdapter)
    assert adapter.needs_refetch_on_callback and not adapter.signed_callbacks
    assert adapter.supports_lookup and not adapter.honours_idempotency_key
    url = adapter.webhook_url_for("4b8e7a8e-0000-4000-8000-000000000001")
    assert url is not None and url.startswith("http://aivedio.test/v1/callbacks/kling?token=")
    token = parse_qs(urlsplit(url).query)["token"][0]
    verified = await adapter.verifier.verify({}, b"{}", 0.0, callback_token=token)
    assert verified.attempt_id == "4b8e7a8e-0000-4000-8000-000000000001"
    assert verified.payload_authenticated is False
    with pytest.raises(VerificationError):
        await adapter.verifier.verify({}, b"{}", 0.0, callback_token=token[:-2] + "AA")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("submitted", ProviderStatus.QUEUED),
        ("processing", ProviderStatus.RUNNING),
        ("succeed", ProviderStatus.SUCCEEDED),
        ("failed", ProviderStatus.FAILED),
    ],
)
def test_normalization_table(raw: str, expected: ProviderStatus) -> None:
    state = make().normalize(callback(raw), FIELDS)
    assert state.status is expected
    assert state.provider_task_id == "867283741759111202"
    assert state.client_request_id == "cr_1"
    assert state.occurred_at is not None and state.occurred_at.year == 2024
    assert state.sequence is None and state.progress is None


@pytest.mark.parametrize(
    ("message", "public"),
    [
        ("Failure to pass the risk control system", "content_rejected"),
        ("triggering the content security policy of the platform", "content_rejected"),
        ("internal error", "generation_failed"),
        ("", "generation_failed"),
    ],
)
def test_failure_messages(message: str, public: str) -> None:
    state = make().normalize(callback("failed", task_status_msg=message), FIELDS)
    assert state.error_code == public


def test_dedup_fallback_and_minimize() -> None:
    adapter = make()
    unverified = Verified(
        key_version="k0", event_id=None, timestamp=None, payload_authenticated=False
    )
    one = adapter.dedup({}, callback(), unverified, b"a")
    same = adapter.dedup({}, callback(), unverified, b"a")
    later = adapter.dedup({}, callback(updated_at=1722769560000), unverified, b"b")
    assert one.dedup_key == same.dedup_key != later.dedup_key
    assert one.dedup_key.startswith("fb:") and one.client_request_id == "cr_1"
    stored = adapter.minimize(callback("succeed"))
    text = json.dumps(stored)
    assert "SECRET" not in text and "final_unit_deduction" not in text
    assert adapter.normalize(stored, FIELDS).status is ProviderStatus.SUCCEEDED


def _jwt_ok(authorization: str) -> bool:
    token = authorization.removeprefix("Bearer ")
    header, claims, signature = token.split(".")
    expected = hmac.new(b"sk_1", f"{header}.{claims}".encode(), hashlib.sha256).digest()
    decoded = json.loads(base64.urlsafe_b64decode(claims + "=" * (-len(claims) % 4)))
    return (
        base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4)) == expected
        and decoded["iss"] == "ak_1"
        and decoded["exp"] == 1_700_000_000 + 1800
    )


async def test_submit_sends_external_task_id_callback_and_jwt() -> None:
    request = SubmitRequest(
        client_request_id="cr_1", model="kling-v2-master", prompt="p", params={"duration": "5"},
        webhook_url="http://aivedio.test/v1/callbacks/kling?token=t",
    )  # fmt: skip
    data = {"task_id": "867", "task_status": "submitted", "task_info": {"external_task_id": "cr_1"}}
    result, requests = await answered(
        make, lambda r: httpx.Response(200, json=envelope(data)), lambda a: a.submit(request)
    )
    assert result.provider_task_id == "867" and result.status is ProviderStatus.QUEUED
    body = json.loads(requests[0].content)
    assert body["external_task_id"] == "cr_1" and body["callback_url"].endswith("?token=t")
    assert body["model_name"] == "kling-v2-master"
    assert _jwt_ok(requests[0].headers["authorization"])


@pytest.mark.parametrize(
    ("http_status", "code", "expected"),
    [
        (401, 1001, AuthFailed),
        (400, 1201, Rejected),
        (400, 1301, Rejected),
        (429, 1302, RateLimited),
        (429, 1303, RateLimited),
        (500, 5000, ProviderUnavailable),
        (200, 1201, Rejected),
        (200, 4242, MalformedResponse),
    ],
)
async def test_envelope_codes(http_status: int, code: int, expected: type[Exception]) -> None:
    request = SubmitRequest(client_request_id="c", model="m", prompt="p")
    with pytest.raises(expected) as caught:
        await answered(
            make, lambda r: httpx.Response(http_status, json=envelope(None, code)),
            lambda a: a.submit(request),
        )  # fmt: skip
    if code == 1301:
        assert isinstance(caught.value, Rejected) and caught.value.public_code == "content_rejected"


async def test_query_lookup_cancel() -> None:
    state, requests = await answered(
        make, lambda r: httpx.Response(200, json=envelope(callback("succeed"))),
        lambda a: a.query("867283741759111202"),
    )  # fmt: skip
    assert requests[0].url.path == "/v1/videos/text2video/867283741759111202"
    assert state.status is ProviderStatus.SUCCEEDED and state.client_request_id == "cr_1"
    found, requests = await answered(
        make, lambda r: httpx.Response(200, json=envelope(callback())), lambda a: a.lookup("cr_1")
    )
    assert found == "867283741759111202"
    assert requests[0].url.params["external_task_id"] == "cr_1"
    missing, _ = await answered(make, lambda r: httpx.Response(404), lambda a: a.lookup("cr_2"))
    assert missing is None
    with pytest.raises(Unsupported):
        await make().cancel("867")
