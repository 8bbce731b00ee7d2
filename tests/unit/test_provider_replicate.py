"""The Replicate-style adapter: recorded-format predictions, errors, dedup, minimize, calls."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from aivedio.domain.observation import ProviderStatus
from aivedio.providers.port import (
    InboxFields,
    PayloadError,
    ProviderAdapter,
    SubmitRequest,
    Verified,
)
from aivedio.providers.replicate import ReplicateAdapter
from tests.contract.provider_contract import (
    Delivery,
    SignedCallbackContract,
    standard_webhooks,
)
from tests.contract.provider_outbound import answered

SECRET = "whsec_" + base64.b64encode(b"r" * 24).decode()
SECRETS = {"k0": SECRET, "k1": "whsec_" + base64.b64encode(b"s" * 24).decode()}
FIELDS = InboxFields(provider="replicate", dedup_key="msg_1")


def make(
    client: httpx.AsyncClient | None = None, keys: tuple[str, ...] = ("k0",)
) -> ReplicateAdapter:
    return ReplicateAdapter(
        api_token="r8_test",
        webhook_secrets=tuple((key, SECRETS[key]) for key in keys),
        public_url="http://aivedio.test",
        base_url="http://replicate.test",
        client=client,
    )


def prediction(status: str = "processing", **extra: Any) -> dict[str, Any]:
    """A prediction object in Replicate's documented shape (webhook body == GET body)."""
    return {
        "id": "ufawqhfynnddngldkgtslldrkq",
        "version": "5c7d5dc6dd8bf75c1acaa8565735e7986bc5b66206b55cca93cb72c9bf15ccaa",
        "created_at": "2022-04-26T22:13:06.224088Z",
        "started_at": "2022-04-26T22:13:07.000000Z",
        "completed_at": None,
        "status": status,
        "input": {"prompt": "a private prompt", "image": "https://user.example/me.png"},
        "output": None,
        "error": None,
        "logs": "step 1/50\nstep 2/50",
        "metrics": {"predict_time": 4.2},
        "urls": {"get": "https://api.replicate.com/v1/predictions/ufaw"},
        **extra,
    }


class TestReplicateContract(SignedCallbackContract):
    status_table = (
        ("processing", ProviderStatus.RUNNING),
        ("starting", ProviderStatus.QUEUED),
        ("succeeded", ProviderStatus.SUCCEEDED),
        ("failed", ProviderStatus.FAILED),
        ("canceled", ProviderStatus.CANCELED),
        ("aborted", ProviderStatus.CANCELED),
    )
    progress_cases = ((0.5, None), (250, None), ("42%", None))  # no progress figure
    unknown_status = "booting"
    task_id = "ufawqhfynnddngldkgtslldrkq"

    def make(
        self, client: httpx.AsyncClient | None = None, *, keys: Sequence[str] = ("k0",)
    ) -> ProviderAdapter:
        return make(client, tuple(keys))

    def callback(self, status: str) -> dict[str, Any]:
        return prediction(status)

    def sign(self, body: bytes, *, delivery_id: str, at: int, key: str) -> Delivery:
        return standard_webhooks(SECRETS[key], body, delivery_id=delivery_id, at=at)


def test_capabilities() -> None:
    adapter: ProviderAdapter = make()
    assert isinstance(adapter, ProviderAdapter)
    assert not adapter.honours_idempotency_key and not adapter.supports_lookup
    assert adapter.signed_callbacks and not adapter.needs_refetch_on_callback


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("starting", ProviderStatus.QUEUED),
        ("processing", ProviderStatus.RUNNING),
        ("succeeded", ProviderStatus.SUCCEEDED),
        ("failed", ProviderStatus.FAILED),
        ("canceled", ProviderStatus.CANCELED),
        ("aborted", ProviderStatus.CANCELED),
    ],
)
def test_normalization_table(raw: str, expected: ProviderStatus) -> None:
    state = make().normalize(prediction(raw), FIELDS)
    assert state.status is expected
    assert state.provider_task_id == "ufawqhfynnddngldkgtslldrkq"
    assert state.sequence is None and state.progress is None  # logs / metrics ignored
    assert state.client_request_id is None
    assert state.output_ref == (
        "replicate:ufawqhfynnddngldkgtslldrkq" if raw == "succeeded" else None
    )


@pytest.mark.parametrize(
    ("error", "public"),
    [
        (
            "NSFW content detected. Try running it again, or try a different prompt.",
            "content_rejected",
        ),
        ("Prediction failed: flagged by safety checker", "content_rejected"),
        ("CUDA out of memory", "generation_failed"),
        (None, "generation_failed"),
    ],
)
def test_error_mapping(error: str | None, public: str) -> None:
    assert make().normalize(prediction("failed", error=error), FIELDS).error_code == public


def test_payload_errors() -> None:
    for payload in ({"status": "succeeded"}, {"id": "p", "status": "booting"}):
        with pytest.raises(PayloadError):
            make().normalize(payload, FIELDS)


def test_dedup_by_webhook_id_and_minimize() -> None:
    body = prediction(
        "succeeded", output=["https://replicate.delivery/pbxt/abc/out.mp4?token=SECRET"]
    )
    info = make().dedup({}, body, Verified(key_version="k0", event_id="msg_2", timestamp=1), b"h")
    assert info.dedup_key == "msg_2" and info.event_type == "succeeded"
    assert info.provider_task_id == "ufawqhfynnddngldkgtslldrkq"
    stored = make().minimize(body)
    text = json.dumps(stored)
    assert "SECRET" not in text and "private prompt" not in text and "step 1" not in text
    assert stored["output"] == "[redacted]"
    assert make().normalize(stored, FIELDS).status is ProviderStatus.SUCCEEDED


async def test_submit_version_and_model_routes() -> None:
    request = SubmitRequest(
        client_request_id="cr_1", model="owner/name:abc123", prompt="p", params={"fps": 8},
        webhook_url="http://aivedio.test/v1/callbacks/replicate",
    )  # fmt: skip
    result, requests = await answered(
        make,
        lambda r: httpx.Response(201, json=prediction("starting")),
        lambda a: a.submit(request),
    )
    assert result.status is ProviderStatus.QUEUED
    body = json.loads(requests[0].content)
    assert requests[0].url.path == "/v1/predictions"
    assert body["version"] == "abc123" and body["input"] == {"prompt": "p", "fps": 8}
    assert body["webhook"].endswith("/replicate") and "completed" in body["webhook_events_filter"]
    official = SubmitRequest(client_request_id="cr_2", model="owner/name", prompt="p")
    _, requests = await answered(
        make,
        lambda r: httpx.Response(201, json=prediction("starting")),
        lambda a: a.submit(official),
    )
    assert requests[0].url.path == "/v1/models/owner/name/predictions"
    assert "webhook" not in json.loads(requests[0].content)


async def test_cancel() -> None:
    ok, requests = await answered(
        make, lambda r: httpx.Response(200, json=prediction("canceled")), lambda a: a.cancel("p1")
    )
    assert ok and requests[0].url.path == "/v1/predictions/p1/cancel"
    late, _ = await answered(
        make, lambda r: httpx.Response(200, json=prediction("succeeded")), lambda a: a.cancel("p1")
    )
    assert late is False
