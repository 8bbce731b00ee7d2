"""The REST contract: every snapshot field and every error, on real PostgreSQL."""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Any

import httpx

from aivedio.domain.observation import (
    PlatformKind,
    PlatformObservation,
    ProviderObservation,
    ProviderStatus,
    Source,
)
from tests.integration.conftest import Api
from tests.integration.helpers import make_project

BODY = {"provider": "sandbox", "model": "m1", "prompt": "a cat on a skateboard", "params": {"s": 5}}
SNAPSHOT_FIELDS = {
    "id",
    "project_id",
    "status",
    "stage",
    "progress",
    "task_version",
    "last_event_id",
    "cursor",
    "error",
    "asset",
    "created_at",
    "updated_at",
}


async def create(api: Api, body: Any = BODY, key: str | None = None, **kw: Any) -> httpx.Response:
    headers = api.auth() | {"Idempotency-Key": key or uuid.uuid4().hex} | kw.pop("headers", {})
    return await api.client.post(api.tasks_url(kw.pop("project", None)), json=body, headers=headers)


async def current_attempt(api: Api, task_id: str) -> uuid.UUID:
    async with api.db.connection() as conn:
        return await conn.fetchval(
            "SELECT current_attempt_id FROM generation_tasks WHERE id = $1", uuid.UUID(task_id)
        )


async def observe(api: Api, task_id: str, status: ProviderStatus, **kw: Any) -> None:
    await api.state.apply(
        ProviderObservation(
            provider="sandbox",
            attempt_id=await current_attempt(api, task_id),
            status=status,
            source=Source.WEBHOOK,
            **kw,
        )
    )


async def test_create_returns_the_full_snapshot(api: Api) -> None:
    r = await create(api)
    assert r.status_code == 202
    task = r.json()["task"]
    assert set(task) == SNAPSHOT_FIELDS
    assert task["project_id"] == str(api.project.project_id)
    assert (task["status"], task["stage"], task["progress"]) == ("queued", "submitting", None)
    assert (task["task_version"], task["last_event_id"]) == (1, 1)
    assert re.fullmatch(r"\d+-1", task["cursor"])
    assert task["error"] is None and task["asset"] is None
    assert r.headers["x-trace-id"].startswith("trc_")


async def test_same_key_same_body_is_the_same_task(api: Api) -> None:
    first = await create(api, key="k-1")
    again = await create(api, key="k-1", body=dict(reversed(list(BODY.items()))))
    assert again.status_code == 202
    assert again.json()["task"]["id"] == first.json()["task"]["id"]
    assert again.headers["idempotent-replayed"] == "true"
    async with api.db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM generation_tasks") == 1


async def test_same_key_other_body_is_422(api: Api) -> None:
    await create(api, key="k-2")
    r = await create(api, key="k-2", body=BODY | {"prompt": "a dog"})
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "idempotency_key_reused"


async def test_concurrent_identical_creates_make_one_task(api: Api) -> None:
    results = await asyncio.gather(*(create(api, key="k-race") for _ in range(10)))
    assert {r.status_code for r in results} == {202}
    assert len({r.json()["task"]["id"] for r in results}) == 1
    async with api.db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM generation_tasks") == 1


async def test_same_key_in_another_project_is_another_task(api: Api) -> None:
    other = await make_project(api.db, tenant="acme", project="mobile")
    a = await create(api, key="shared")
    b = await api.client.post(
        f"/v1/projects/{other.project_id}/tasks",
        json=BODY,
        headers={"Authorization": f"Bearer {other.api_key}", "Idempotency-Key": "shared"},
    )
    assert b.status_code == 202 and a.json()["task"]["id"] != b.json()["task"]["id"]


async def test_malformed_create_lists_field_errors(api: Api) -> None:
    r = await create(api, body={"provider": "nope", "model": "", "params": [], "extra": 1})
    assert r.status_code == 422
    error = r.json()["error"]
    assert error["code"] == "validation_failed"
    fields = {f["field"] for f in error["fields"]}
    assert {"model", "prompt", "params", "extra"} <= fields


async def test_unknown_provider_is_a_field_error(api: Api) -> None:
    r = await create(api, body=BODY | {"provider": "nope"})
    assert r.status_code == 422
    assert [f["field"] for f in r.json()["error"]["fields"]] == ["provider"]


async def test_missing_idempotency_key_is_a_field_error(api: Api) -> None:
    r = await api.client.post(api.tasks_url(), json=BODY, headers=api.auth())
    assert r.status_code == 422
    assert r.json()["error"]["fields"][0]["field"] == "Idempotency-Key"


async def test_bad_bodies_get_their_own_status(api: Api) -> None:
    headers = api.auth() | {"Idempotency-Key": "x"}
    not_json = await api.client.post(
        api.tasks_url(), content=b"{nope", headers=headers | {"content-type": "application/json"}
    )
    assert (not_json.status_code, not_json.json()["error"]["code"]) == (422, "invalid_json")
    wrong_type = await api.client.post(
        api.tasks_url(), content=b"{}", headers=headers | {"content-type": "text/plain"}
    )
    assert wrong_type.status_code == 415
    huge = await api.client.post(
        api.tasks_url(), json=BODY | {"prompt": "x" * 70_000}, headers=headers
    )
    assert huge.status_code == 413
    async with api.db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM generation_tasks") == 0


async def test_auth_errors(api: Api) -> None:
    none = await api.client.get(api.tasks_url())
    wrong = await api.client.get(api.tasks_url(), headers=api.auth("av_wrong"))
    assert (none.status_code, wrong.status_code) == (401, 401)
    assert none.json()["error"]["code"] == "unauthorized"
    async with api.db.connection() as conn:
        await conn.execute("UPDATE api_keys SET revoked_at = now()")
    revoked = await api.client.get(api.tasks_url(), headers=api.auth())
    assert revoked.status_code == 401


async def test_unknown_and_foreign_projects_and_tasks_are_404(api: Api) -> None:
    mine = (await create(api)).json()["task"]["id"]
    other = await make_project(api.db, tenant="evil", project="web")
    foreign_headers = {"Authorization": f"Bearer {other.api_key}"}
    for url, headers in [
        (api.tasks_url(uuid.uuid4()), api.auth()),
        (api.tasks_url("not-a-uuid"), api.auth()),
        (api.tasks_url(), foreign_headers),
        (f"{api.tasks_url()}/{mine}", foreign_headers),
        (f"/v1/projects/{other.project_id}/tasks/{mine}", foreign_headers),
        (f"{api.tasks_url()}/{uuid.uuid4()}", api.auth()),
    ]:
        r = await api.client.get(url, headers=headers)
        assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found"), url
    r = await create(api, project=uuid.uuid4())
    assert r.status_code == 404


async def test_snapshot_cursor_is_the_stream_head(api: Api) -> None:
    a = (await create(api)).json()["task"]
    b = (await create(api)).json()["task"]
    await observe(api, a["id"], ProviderStatus.RUNNING, progress=20)
    r = await api.client.get(f"{api.tasks_url()}/{a['id']}", headers=api.auth())
    snap = r.json()["task"]
    epoch = b["cursor"].split("-")[0]
    assert snap["cursor"] == f"{epoch}-3"
    assert (snap["status"], snap["stage"], snap["progress"], snap["task_version"]) == (
        "running",
        "generating",
        20,
        2,
    )
    assert snap["last_event_id"] == 3


async def test_list_pages_newest_first(api: Api) -> None:
    ids = [(await create(api)).json()["task"]["id"] for _ in range(5)]
    seen, page = [], None
    while True:
        params = {"limit": "2"} | ({"page": page} if page else {})
        r = await api.client.get(api.tasks_url(), params=params, headers=api.auth())
        assert r.status_code == 200
        body = r.json()
        seen += [t["id"] for t in body["tasks"]]
        page = body["next_page"]
        if page is None:
            break
    assert seen == list(reversed(ids))
    bad = await api.client.get(api.tasks_url(), params={"page": "garbage!"}, headers=api.auth())
    assert bad.status_code == 422
    too_big = await api.client.get(api.tasks_url(), params={"limit": "100000"}, headers=api.auth())
    assert too_big.status_code == 422


async def test_cancel_is_a_request_until_confirmed(api: Api) -> None:
    task = (await create(api)).json()["task"]
    await observe(api, task["id"], ProviderStatus.RUNNING, progress=10)
    url = f"{api.tasks_url()}/{task['id']}/cancel"
    r = await api.client.post(url, headers=api.auth())
    assert r.status_code == 202
    assert (r.json()["task"]["status"], r.json()["task"]["stage"]) == (
        "cancel_requested",
        "canceling",
    )
    again = await api.client.post(url, headers=api.auth())
    assert (
        again.status_code == 202
        and again.json()["task"]["task_version"] == r.json()["task"]["task_version"]
    )
    await observe(api, task["id"], ProviderStatus.CANCELED)
    snap = (await api.client.get(f"{api.tasks_url()}/{task['id']}", headers=api.auth())).json()[
        "task"
    ]
    assert snap["status"] == "canceled"
    late = await api.client.post(url, headers=api.auth())
    assert (late.status_code, late.json()["error"]["code"]) == (409, "not_cancelable")


async def test_retry_only_after_failure_or_cancel(api: Api) -> None:
    task = (await create(api)).json()["task"]
    url = f"{api.tasks_url()}/{task['id']}/retry"
    early = await api.client.post(url, headers=api.auth())
    assert (early.status_code, early.json()["error"]["code"]) == (409, "not_retryable")
    first_attempt = await current_attempt(api, task["id"])
    await observe(api, task["id"], ProviderStatus.FAILED, error_code="content_rejected")
    failed = (await api.client.get(f"{api.tasks_url()}/{task['id']}", headers=api.auth())).json()[
        "task"
    ]
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == "content_rejected" and "trace_id" in failed["error"]
    r = await api.client.post(url, headers=api.auth())
    assert r.status_code == 202
    snap = r.json()["task"]
    assert (snap["status"], snap["error"], snap["task_version"]) == (
        "queued",
        None,
        failed["task_version"] + 1,
    )
    assert await current_attempt(api, task["id"]) != first_attempt
    # the old attempt's late result changes nothing
    await api.state.apply(
        ProviderObservation(
            provider="sandbox",
            attempt_id=first_attempt,
            status=ProviderStatus.SUCCEEDED,
            source=Source.POLL,
        )
    )
    after = (await api.client.get(f"{api.tasks_url()}/{task['id']}", headers=api.auth())).json()[
        "task"
    ]
    assert after["task_version"] == snap["task_version"]


async def test_audit_lists_events_and_ignored_observations(api: Api) -> None:
    task = (await create(api)).json()["task"]
    await observe(api, task["id"], ProviderStatus.RUNNING, progress=50, provider_sequence=5)
    await observe(api, task["id"], ProviderStatus.QUEUED, provider_sequence=2)
    r = await api.client.get(f"{api.tasks_url()}/{task['id']}/audit", headers=api.auth())
    body = r.json()
    assert [e["task_version"] for e in body["events"]] == [1, 2]
    assert [e["payload"]["status"] for e in body["events"]] == ["queued", "running"]
    assert [(o["outcome"], o["reason"]) for o in body["ignored_observations"]] == [
        ("ignored", "stale_sequence")
    ]
    assert body["unpublished_versions"] == []


async def test_audit_lists_versions_that_are_no_public_event(api: Api) -> None:
    task = (await create(api)).json()["task"]
    attempt_id = await current_attempt(api, task["id"])
    await api.state.apply(
        PlatformObservation(
            kind=PlatformKind.SUBMIT_ACCEPTED, attempt_id=attempt_id, source=Source.SUBMIT
        )
    )
    await observe(api, task["id"], ProviderStatus.QUEUED, provider_sequence=1)  # still queued
    url = f"{api.tasks_url()}/{task['id']}"
    body = (await api.client.get(f"{url}/audit", headers=api.auth())).json()
    assert [e["task_version"] for e in body["events"]] == [1, 2]
    assert [
        (v["outcome"], v["reason"], v["observed"], v["task_version"])
        for v in body["unpublished_versions"]
    ] == [("applied", "no_public_change", "queued", 3)]
    assert body["ignored_observations"] == []
    snap = (await api.client.get(url, headers=api.auth())).json()["task"]
    assert (snap["task_version"], snap["last_event_id"], snap["status"]) == (3, 2, "queued")


async def test_health_ready_metrics(api: Api) -> None:
    assert (await api.client.get("/healthz")).status_code == 200
    assert (await api.client.get("/readyz")).status_code == 200
    await create(api)
    metrics = (await api.client.get("/metrics")).text
    assert "aivedio_observations_total" in metrics


async def test_text_postgresql_cannot_store_is_a_field_error_not_a_500(api: Api) -> None:
    headers = api.auth() | {"Idempotency-Key": "k", "content-type": "application/json"}
    for raw, field in [
        (b'{"provider": "sandbox", "model": "m\\u0000", "prompt": "p"}', "model"),
        (b'{"provider": "sandbox", "model": "m", "prompt": "\\ud800"}', "prompt"),
        (
            b'{"provider": "sandbox", "model": "m", "prompt": "p", "params": {"\\u0000": 1}}',
            "params",
        ),
        (
            b'{"provider": "sandbox", "model": "m", "prompt": "p", "params": {"a": ["\\udc00"]}}',
            "params",
        ),
    ]:
        r = await api.client.post(api.tasks_url(), content=raw, headers=headers)
        assert r.status_code == 422, raw
        assert r.json()["error"]["code"] == "validation_failed"
        assert [f["field"] for f in r.json()["error"]["fields"]] == [field], raw
    for raw in (b'{"params": {"a": NaN}}', b'{"params": {"a": 1e400}}', b'{"params": -Infinity}'):
        r = await api.client.post(api.tasks_url(), content=raw, headers=headers)
        assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_json"), raw
    async with api.db.connection() as conn:
        assert await conn.fetchval("SELECT count(*) FROM generation_tasks") == 0


async def test_list_limit_is_digits_within_the_page_size(api: Api) -> None:
    for limit in ("0", "201", " 5", "+5", "5.0", "5_0", "five", ""):
        r = await api.client.get(api.tasks_url(), params={"limit": limit}, headers=api.auth())
        assert r.status_code == 422, limit
        assert r.json()["error"]["fields"] == [{"field": "limit", "message": "1..200"}], limit
    ok = await api.client.get(api.tasks_url(), params={"limit": "200"}, headers=api.auth())
    assert ok.status_code == 200
