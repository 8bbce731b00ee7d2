"""Parsing the task.status bus message; retry arithmetic."""

from __future__ import annotations

import json
import random
import uuid

import pytest

from aivedio.consumers import InvalidEvent, parse_status_event
from aivedio.media.retry import RetryPolicy


def body(**overrides: object) -> bytes:
    payload = {
        "event_type": "task.status.changed",
        "aggregate_id": str(uuid.uuid4()),
        "aggregate_version": 4,
        "tenant_id": str(uuid.uuid4()),
        "project_id": str(uuid.uuid4()),
        "attempt_id": str(uuid.uuid4()),
        "status": "provider_succeeded",
        "error_code": None,
        "trace_id": "trc_1",
        "event_id": 9,
    } | overrides
    return json.dumps(payload).encode()


def test_parses_the_domain_payload() -> None:
    event = parse_status_event(body())
    assert event is not None
    assert (event.status, event.version, event.trace_id) == ("provider_succeeded", 4, "trc_1")
    assert parse_status_event(body(attempt_id=None)).attempt_id is None  # type: ignore[union-attr]


def test_other_event_types_are_skipped() -> None:
    assert parse_status_event(body(event_type="task.deleted")) is None


@pytest.mark.parametrize(
    "data",
    [b"{", b"[]", body(aggregate_id="nope"), body(aggregate_version="4"), body(status=None)],
)
def test_poison(data: bytes) -> None:
    with pytest.raises(InvalidEvent):
        parse_status_event(data)


def test_retry_policy() -> None:
    policy = RetryPolicy(max_tries=4, base_s=1.0, cap_s=5.0, jitter=0.0)
    assert [policy.delay(n) for n in (1, 2, 3, 4, 5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert not policy.exhausted(3) and policy.exhausted(4)
    jittered = RetryPolicy(base_s=10.0, jitter=0.2)
    rng = random.Random(7)
    assert all(8.0 <= jittered.delay(1, rng) <= 12.0 for _ in range(100))
    with pytest.raises(ValueError, match="max_tries"):
        RetryPolicy(max_tries=0)
