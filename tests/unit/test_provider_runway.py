"""The Runway-style adapter: poll-only; task statuses, progress scaling, failure codes, calls."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from aivedio.domain.observation import ProviderStatus
from aivedio.providers.port import (
    InboxFields,
    ProviderAdapter,
    Rejected,
    SubmitRequest,
    VerificationError,
)
from aivedio.providers.registry import (
    ProvidersConfig,
    RunwayConfig,
    build_providers,
    callback_providers,
)
from aivedio.providers.runway import RunwayAdapter
from tests.contract.provider_contract import PollOnlyContract
from tests.contract.provider_outbound import answered

TASK = "2272f1f2-dbb8-4083-a126-d9a8f0524bb2"


def make(client: httpx.AsyncClient | None = None) -> RunwayAdapter:
    return RunwayAdapter(api_key="rw_key", base_url="http://runway.test", client=client)


def task(status: str, **extra: Any) -> dict[str, Any]:
    return {"id": TASK, "status": status, "createdAt": "2024-11-30T07:06:07.912Z", **extra}


class TestRunwayContract(PollOnlyContract):
    status_table = (
        ("RUNNING", ProviderStatus.RUNNING),
        ("PENDING", ProviderStatus.QUEUED),
        ("THROTTLED", ProviderStatus.QUEUED),
        ("SUCCEEDED", ProviderStatus.SUCCEEDED),
        ("FAILED", ProviderStatus.FAILED),
        ("CANCELLED", ProviderStatus.CANCELED),
    )
    progress_cases = (
        (0.0, 0),
        (0.426, 43),
        (1.0, 100),
        (1.7, 100),
        (-0.2, 0),
        ("0.5", 50),
        (None, None),
        ("x", None),
        (True, None),
    )  # fmt: skip  (a fraction 0..1, scaled to percent)
    task_id = TASK

    def make(
        self, client: httpx.AsyncClient | None = None, *, keys: Sequence[str] = ("k0",)
    ) -> ProviderAdapter:
        return make(client)

    def callback(self, status: str) -> dict[str, Any]:
        return task(status)


async def test_poll_only() -> None:
    adapter: ProviderAdapter = make()
    assert isinstance(adapter, ProviderAdapter)
    assert not adapter.supports_webhooks and adapter.webhook_url_for("a") is None
    with pytest.raises(VerificationError):
        await adapter.verifier.verify({}, b"{}", 0.0)
    built = build_providers(
        ProvidersConfig(public_url="http://x", runway=RunwayConfig(api_key="k"))
    )
    assert "runway" in built and "runway" not in callback_providers(built)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("PENDING", ProviderStatus.QUEUED),
        ("THROTTLED", ProviderStatus.QUEUED),
        ("RUNNING", ProviderStatus.RUNNING),
        ("SUCCEEDED", ProviderStatus.SUCCEEDED),
        ("FAILED", ProviderStatus.FAILED),
        ("CANCELLED", ProviderStatus.CANCELED),
    ],
)
async def test_status_table(raw: str, expected: ProviderStatus) -> None:
    state, requests = await answered(
        make, lambda r: httpx.Response(200, json=task(raw)), lambda a: a.query(TASK)
    )
    assert requests[0].url.path == f"/v1/tasks/{TASK}"
    assert requests[0].headers["x-runway-version"] == "2024-11-06"
    assert state.status is expected and state.provider_task_id == TASK
    assert state.output_ref == (f"runway:{TASK}" if raw == "SUCCEEDED" else None)


@pytest.mark.parametrize(
    ("code", "public"),
    [
        ("SAFETY.INPUT.TEXT", "content_rejected"),
        ("SAFETY.OUTPUT.VIDEO", "content_rejected"),
        ("INPUT_PREPROCESSING.SAFETY.TEXT", "content_rejected"),
        ("INPUT_PREPROCESSING.INTERNAL", "invalid_request"),
        ("ASSET.INVALID", "invalid_request"),
        ("INTERNAL.BAD_OUTPUT.CODE01", "generation_failed"),
        ("INTERNAL", "generation_failed"),
        (None, "generation_failed"),
    ],
)
def test_failure_codes(code: str | None, public: str) -> None:
    body = task("FAILED", failure="raw reason", failureCode=code)
    state = make().normalize(body, InboxFields(provider="runway", dedup_key="k"))
    assert state.error_code == public


async def test_submit_routes_and_rejection() -> None:
    text = SubmitRequest(
        client_request_id="cr", model="gen4_turbo", prompt="p", params={"ratio": "1280:720"}
    )
    _, requests = await answered(
        make, lambda r: httpx.Response(200, json={"id": TASK}), lambda a: a.submit(text)
    )
    assert requests[0].url.path == "/v1/text_to_video"
    assert json.loads(requests[0].content) == {
        "model": "gen4_turbo",
        "promptText": "p",
        "ratio": "1280:720",
    }
    image = SubmitRequest(
        client_request_id="cr", model="gen4_turbo", prompt="p", params={"promptImage": "https://i"}
    )
    result, requests = await answered(
        make, lambda r: httpx.Response(200, json={"id": TASK}), lambda a: a.submit(image)
    )
    assert requests[0].url.path == "/v1/image_to_video" and result.provider_task_id == TASK
    with pytest.raises(Rejected) as caught:
        await answered(
            make, lambda r: httpx.Response(400, json={"error": "bad"}), lambda a: a.submit(text)
        )
    assert caught.value.public_code == "invalid_request"


async def test_cancel() -> None:
    ok, requests = await answered(make, lambda r: httpx.Response(204), lambda a: a.cancel(TASK))
    assert ok and requests[0].method == "DELETE"
