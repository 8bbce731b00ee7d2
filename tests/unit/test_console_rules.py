"""What the web console derives from the API's rules: which commands a public status allows
(``console-view.js``), the fields each timeline event changed, and the gateway's stream outages."""

from __future__ import annotations

import re
import socket
import uuid
from importlib import resources

import pytest

from aivedio.api.http import ApiError
from aivedio.api.sandbox import SandboxChaos
from aivedio.domain.statuses import CANCELABLE, PUBLIC_STATUSES, RETRYABLE, STATUS_TABLE
from aivedio.gateway.outage import Outages
from aivedio.state.tasks import changed_fields

VIEW = resources.files("aivedio.web").joinpath("console-view.js").read_text()


def test_the_console_greys_cancel_exactly_where_the_api_would_not_cancel() -> None:
    block = re.search(r"const CANCEL_REASONS = \{(.*?)\};", VIEW, re.S)
    assert block is not None
    greyed = set(re.findall(r"^\s*(\w+):", block.group(1), re.M))
    cancelable = {STATUS_TABLE[s].public for s in CANCELABLE}
    # cancel_requested: the API answers the same snapshot again; the console says it is pending
    assert greyed == PUBLIC_STATUSES - cancelable
    assert "cancel_requested" in greyed


def test_the_console_offers_retry_exactly_where_the_api_retries() -> None:
    retryable = {STATUS_TABLE[s].public for s in RETRYABLE}
    found = re.search(r'const retryable = status === "(\w+)" \|\| status === "(\w+)";', VIEW)
    assert found is not None
    assert set(found.groups()) == retryable


def test_changed_fields_name_what_differs() -> None:
    first = {"status": "queued", "stage": "submitting", "progress": None, "asset_id": None}
    assert changed_fields({}, first) == ["status", "stage"]
    running = first | {"status": "running", "stage": "generating", "progress": 0}
    assert changed_fields(first, running) == ["status", "stage", "progress"]
    error = {"code": "generation_failed", "message": "m"}
    assert changed_fields(running, running | {"error": error}) == ["error"]
    assert changed_fields(running, dict(running)) == []


def test_an_outage_lasts_its_seconds_for_its_project_only() -> None:
    now = [100.0]
    outages = Outages(clock=lambda: now[0])
    project, other = uuid.uuid4(), uuid.uuid4()
    assert outages.active(project) == 0
    outages.start(project, 5)
    assert outages.active(project) == 5
    assert outages.active(other) == 0
    now[0] = 104.5
    assert outages.active(project) == 0.5
    now[0] = 105.0
    assert outages.active(project) == 0
    outages.start(project, 0)
    assert outages.active(project) == 0


async def test_a_sandbox_that_does_not_answer_is_503_sandbox_unavailable() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    chaos = SandboxChaos(f"http://127.0.0.1:{port}", "key", timeout_s=2)
    with pytest.raises(ApiError) as refused:
        await chaos.call("GET")
    assert (refused.value.status, refused.value.code) == (503, "sandbox_unavailable")
    assert refused.value.headers["Retry-After"] == "2"
