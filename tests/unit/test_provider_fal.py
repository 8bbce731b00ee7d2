"""The fal-style adapter: webhook payloads and queue statuses in fal's documented formats,
ED25519 verification through the adapter's verifier, errors, dedup, minimize, calls."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from aivedio.domain.observation import ProviderStatus
from aivedio.providers.fal import FalAdapter
from aivedio.providers.jwks import FalEd25519Verifier, JwksCache
from aivedio.providers.port import (
    InboxFields,
    PayloadError,
    ProviderAdapter,
    SubmitRequest,
    VerificationError,
    Verified,
)
from tests.contract.provider_contract import Delivery, SignedCallbackContract
from tests.contract.provider_outbound import answered

KEYS = {"k0": Ed25519PrivateKey.generate(), "k1": Ed25519PrivateKey.generate()}
KEY = KEYS["k1"]
APP = "fal-ai/kling-video"
FIELDS = InboxFields(provider="fal", dedup_key="fb:x")
REQUEST_ID = "024ca5b1-45d3-4afd-883e-ad3abe2a1c4d"


def jwks_of(kids: tuple[str, ...]) -> Callable[[], Awaitable[bytes]]:
    """fal's published JWKS holding the keys named by ``kids``."""

    async def fetch() -> bytes:
        keys = []
        for kid in kids:
            raw = KEYS[kid].public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
            x = base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
            keys.append({"kty": "OKP", "crv": "Ed25519", "kid": kid, "x": x})
        return json.dumps({"keys": keys}).encode()

    return fetch


def make(client: httpx.AsyncClient | None = None, kids: tuple[str, ...] = ("k1",)) -> FalAdapter:
    return FalAdapter(
        api_key="fal_key",
        app_id=APP,
        verifier=FalEd25519Verifier(JwksCache(jwks_of(kids))),
        public_url="http://aivedio.test",
        base_url="http://queue.fal.test",
        client=client,
    )


def ok_webhook() -> dict[str, Any]:
    return {
        "request_id": REQUEST_ID,
        "gateway_request_id": REQUEST_ID,
        "status": "OK",
        "payload": {
            "video": {"url": "https://v3.fal.media/files/x/out.mp4", "content_type": "video/mp4"}
        },
        "error": None,
    }


def error_webhook(detail: list[dict[str, Any]], error: str = "Invalid status code: 422") -> dict:
    return {
        "request_id": REQUEST_ID,
        "gateway_request_id": REQUEST_ID,
        "status": "ERROR",
        "payload": {"detail": detail},
        "error": error,
    }


class TestFalContract(SignedCallbackContract):
    status_table = (("OK", ProviderStatus.SUCCEEDED), ("ERROR", ProviderStatus.FAILED))
    query_table = (
        ("IN_QUEUE", ProviderStatus.QUEUED),
        ("IN_PROGRESS", ProviderStatus.RUNNING),
        ("COMPLETED", ProviderStatus.SUCCEEDED),
    )
    progress_cases = ((0.5, None), (250, None))  # fal reports no progress figure
    unknown_status = "MAYBE"
    task_id = REQUEST_ID

    def make(
        self, client: httpx.AsyncClient | None = None, *, keys: Sequence[str] = ("k0",)
    ) -> ProviderAdapter:
        return make(client, tuple(keys))

    def callback(self, status: str) -> dict[str, Any]:
        detail = [{"loc": ["body", "prompt"], "msg": "raw", "type": "missing"}]
        return (error_webhook(detail) if status == "ERROR" else ok_webhook()) | {"status": status}

    def query_body(self, status: str) -> Any:
        return {"status": status}

    def submit_request(self) -> SubmitRequest:
        return SubmitRequest(client_request_id="cr_1", model=f"{APP}/v1", prompt="p")

    def sign(self, body: bytes, *, delivery_id: str, at: int, key: str) -> Delivery:
        message = f"{REQUEST_ID}\nuser_1\n{at}\n{hashlib.sha256(body).hexdigest()}".encode()
        return Delivery(
            {
                "x-fal-webhook-request-id": REQUEST_ID,
                "x-fal-webhook-user-id": "user_1",
                "x-fal-webhook-timestamp": str(at),
                "x-fal-webhook-signature": KEYS[key].sign(message).hex(),
            }
        )


def test_capabilities() -> None:
    adapter: ProviderAdapter = make()
    assert isinstance(adapter, ProviderAdapter)
    assert adapter.signed_callbacks and not adapter.needs_refetch_on_callback
    assert not adapter.honours_idempotency_key and not adapter.supports_lookup
    with pytest.raises(ValueError, match="owner/name"):
        FalAdapter(api_key="k", app_id="fal-ai/x/y", verifier=make().verifier, public_url=None)


async def test_adapter_verifier_checks_fal_signatures() -> None:
    body = json.dumps(ok_webhook()).encode()
    now = int(time.time())
    message = f"{REQUEST_ID}\nuser_1\n{now}\n{hashlib.sha256(body).hexdigest()}".encode()
    headers = {
        "x-fal-webhook-request-id": REQUEST_ID,
        "x-fal-webhook-user-id": "user_1",
        "x-fal-webhook-timestamp": str(now),
        "x-fal-webhook-signature": KEY.sign(message).hex(),
    }
    verified = await make().verifier.verify(headers, body, now)
    assert verified.key_version == "k1"
    with pytest.raises(VerificationError):
        await make().verifier.verify(headers, body + b" ", now)


def test_webhook_normalization_table() -> None:
    adapter = make()
    ok = adapter.normalize(adapter.minimize(ok_webhook()), FIELDS)
    assert ok.status is ProviderStatus.SUCCEEDED and ok.provider_task_id == REQUEST_ID
    assert ok.output_ref == f"fal:{REQUEST_ID}" and ok.error_code is None
    failed = adapter.normalize(
        error_webhook([{"loc": ["body", "prompt"], "type": "missing"}]), FIELDS
    )
    assert failed.status is ProviderStatus.FAILED and failed.output_ref is None


@pytest.mark.parametrize(
    ("types", "public"),
    [
        (["content_policy_violation"], "content_rejected"),
        (["value_error.missing"], "invalid_request"),
        (["image_too_large"], "invalid_request"),
        (["generation_timeout"], "timeout"),
        (["downstream_service_error"], "provider_unavailable"),
        (["something_new"], "generation_failed"),
        ([], "generation_failed"),
    ],
)
def test_error_mapping_survives_minimization(types: list[str], public: str) -> None:
    adapter = make()
    payload = error_webhook([{"loc": ["body"], "msg": "raw text", "type": t} for t in types])
    stored = adapter.minimize(payload)
    assert "raw text" not in json.dumps(stored)
    assert adapter.normalize(stored, FIELDS).error_code == public
    assert adapter.normalize(payload, FIELDS).error_code == public


def test_payload_errors() -> None:
    with pytest.raises(PayloadError):
        make().normalize({"request_id": "r", "status": "MAYBE"}, FIELDS)
    with pytest.raises(PayloadError):
        make().normalize({"status": "OK"}, FIELDS)


def test_dedup_and_minimize() -> None:
    adapter = make()
    body = ok_webhook() | {"payload": {"video": {"url": "https://x/out.mp4?token=SECRET"}}}
    info = adapter.dedup({}, body, Verified(key_version="k1", event_id=None, timestamp=1), b"h1")
    again = adapter.dedup({}, body, Verified(key_version="k1", event_id=None, timestamp=2), b"h1")
    other = adapter.dedup({}, body, Verified(key_version="k1", event_id=None, timestamp=2), b"h2")
    assert info.dedup_key == again.dedup_key != other.dedup_key
    assert info.provider_task_id == REQUEST_ID and info.event_type == "OK"
    assert "SECRET" not in json.dumps(adapter.minimize(body))
    assert "out.mp4" not in json.dumps(adapter.minimize(body))


@pytest.mark.parametrize(
    ("body", "expected", "code"),
    [
        ({"status": "IN_QUEUE", "queue_position": 3}, ProviderStatus.QUEUED, None),
        ({"status": "IN_PROGRESS", "logs": []}, ProviderStatus.RUNNING, None),
        ({"status": "COMPLETED"}, ProviderStatus.SUCCEEDED, None),
        (
            {"status": "COMPLETED", "error": "boom", "error_type": "content_policy_violation"},
            ProviderStatus.FAILED,
            "content_rejected",
        ),
        ({"status": "COMPLETED", "error": "boom"}, ProviderStatus.FAILED, "generation_failed"),
    ],
)
async def test_queue_status_table(
    body: dict[str, Any], expected: ProviderStatus, code: str | None
) -> None:
    state, requests = await answered(
        make, lambda r: httpx.Response(200, json=body), lambda a: a.query(REQUEST_ID)
    )
    assert requests[0].url.path == f"/{APP}/requests/{REQUEST_ID}/status"
    assert requests[0].headers["authorization"] == "Key fal_key"
    assert state.status is expected and state.error_code == code


async def test_submit_and_cancel() -> None:
    request = SubmitRequest(
        client_request_id="cr_1", model=f"{APP}/v2/master/text-to-video", prompt="p",
        params={"duration": "5"}, webhook_url="http://aivedio.test/v1/callbacks/fal",
    )  # fmt: skip
    result, requests = await answered(
        make,
        lambda r: httpx.Response(200, json={"request_id": REQUEST_ID, "status_url": "x"}),
        lambda a: a.submit(request),
    )
    assert result.provider_task_id == REQUEST_ID
    sent = requests[0]
    assert sent.url.path == f"/{APP}/v2/master/text-to-video"
    assert sent.url.params["fal_webhook"] == "http://aivedio.test/v1/callbacks/fal"
    assert json.loads(sent.content) == {"prompt": "p", "duration": "5"}
    with pytest.raises(ValueError, match="not an endpoint"):
        await make().submit(SubmitRequest(client_request_id="c", model="other/app", prompt="p"))
    ok, requests = await answered(
        make, lambda r: httpx.Response(202, json={"status": "CANCELLATION_REQUESTED"}),
        lambda a: a.cancel(REQUEST_ID),
    )  # fmt: skip
    assert ok and requests[0].method == "PUT"
    done, _ = await answered(
        make, lambda r: httpx.Response(400, json={"status": "ALREADY_COMPLETED"}),
        lambda a: a.cancel(REQUEST_ID),
    )  # fmt: skip
    assert done is False
