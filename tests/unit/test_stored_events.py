"""A task event as ``task_events`` stores it (``stored_payload``) reads back as the event the
live path sends: same payload, same SSE frame."""

from __future__ import annotations

import json
import uuid

import pytest

from aivedio.domain.public import public_event, stored_event
from aivedio.domain.statuses import Status
from aivedio.gateway.frames import PUBLIC_FIELDS, event_of, make_event
from aivedio.state.events import stored_payload

TASK = uuid.UUID("6f0a3a49-3a4c-4a39-9a3c-1c2b3d4e5f60")
ASSET = uuid.UUID("0b7c1d2e-3f40-4152-8637-48596a7b8c9d")

EVENTS = [
    public_event(
        task_id=TASK, task_version=1, status=Status.CREATED, stage="submitting",
        progress=None, asset_id=None, error_code=None,
    ),
    public_event(
        task_id=TASK, task_version=7, status=Status.RUNNING, stage="generating",
        progress=45, asset_id=None, error_code=None,
    ),
    public_event(
        task_id=TASK, task_version=9, status=Status.READY, stage="ready",
        progress=100, asset_id=ASSET, error_code=None,
    ),
    public_event(
        task_id=TASK, task_version=4, status=Status.FAILED, stage="failed",
        progress=60, asset_id=None, error_code="timeout",
    ),
]  # fmt: skip


@pytest.mark.parametrize("public", EVENTS)
def test_a_stored_event_reads_back_as_the_live_one(public: dict[str, object]) -> None:
    stored = stored_payload(public)
    kept = json.loads(stored)
    assert " " not in stored.replace("The video took too long to generate.", "")  # compact
    assert not {"task_id", "task_version", "event_id"} & kept.keys()
    assert None not in kept.values()

    version = public["task_version"]
    assert isinstance(version, int)
    read = stored_event(kept, str(TASK), version, 12)
    assert tuple(read) == PUBLIC_FIELDS  # what event_of asks of its payload
    assert read == {**dict.fromkeys(PUBLIC_FIELDS), **public, "event_id": 12}

    replayed = event_of(5, 12, read, stored_at=1.5, trace_id="trc_" + "ab" * 12)
    live = make_event(5, 12, public, stored_at=1.5, trace_id="trc_" + "ab" * 12)
    assert replayed == live
    assert replayed.frame.startswith(b"id: 5-12\nevent: task.status\ndata: {")
