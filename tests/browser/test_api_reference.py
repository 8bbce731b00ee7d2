"""The API reference page (``/docs``) in real Chromium: it renders every operation and schema
of ``/openapi.json`` from local files only, with no console error."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from aivedio.api.openapi import openapi_document
from tests.browser.conftest import Proc, free_port, wait_ok

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = pytest.mark.browser


@pytest.fixture
def api(env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    port = free_port()
    proc = Proc(
        [sys.executable, "-m", "aivedio", "run", "--role", "api", "--port", str(port)],
        env,
        tmp_path / "api.log",
    ).start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ok(f"{base}/readyz", proc)
        yield base
    finally:
        proc.stop()


def test_the_reference_page_renders_every_operation(page: Page, api: str) -> None:
    from playwright.sync_api import expect

    problems: list[str] = []
    requested: list[str] = []
    page.on(
        "console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None
    )
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.on("request", lambda request: requested.append(request.url))
    page.goto(f"{api}/docs")
    expect(page.locator("body")).to_have_attribute("data-rendered", "true")
    doc = openapi_document()
    ids = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    for operation_id in ids:
        expect(page.locator(f"section#{operation_id}")).to_have_count(1)
    for name in doc["components"]["schemas"]:
        expect(page.locator(f"section#schema-{name}")).to_have_count(1)
    create = page.locator("section#CreateTask")
    expect(create).to_contain_text("Idempotency-Key")
    expect(create).to_contain_text("idempotency_key_reused")
    create.locator("a", has_text="CreateTaskBody").click()
    expect(page.locator("section#schema-CreateTaskBody")).to_be_in_viewport()
    assert problems == []
    assert requested and all(url.startswith(api) for url in requested), requested
