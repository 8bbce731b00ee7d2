"""What a browser may see: the whitelist of public event fields and the stable error codes.

Provider raw errors, URLs with credentials, costs and internal routing never pass through here.
"""

from __future__ import annotations

import uuid
from typing import Any

from aivedio.domain.statuses import STATUS_TABLE, Status

# Stable product error codes and their public messages. An adapter maps a provider's error to one
# of these; anything else is shown as ``generation_failed``.
PUBLIC_ERRORS: dict[str, str] = {
    "generation_failed": "The video could not be generated.",
    "content_rejected": "The request was rejected by the content policy.",
    "invalid_request": "The provider rejected the request parameters.",
    "provider_unavailable": "The video provider is unavailable.",
    "submit_rejected": "The video provider did not accept the request.",
    "media_failed": "The generated video could not be processed.",
    "output_expired": "The generated video expired before it could be stored.",
    "timeout": "The video took too long to generate.",
}


def public_error(code: str | None) -> dict[str, str] | None:
    if code is None:
        return None
    if code not in PUBLIC_ERRORS:
        code = "generation_failed"
    return {"code": code, "message": PUBLIC_ERRORS[code]}


def public_fields(
    status: Status,
    stage: str,
    progress: int | None,
    asset_id: uuid.UUID | None,
    error_code: str | None,
) -> dict[str, Any]:
    """What a browser sees of a task state: the fields of an event that are not its identity
    (``event_id``, ``task_id``, ``task_version``). Two states with equal public fields look the
    same to every client, so a change between them publishes no event (``transitions``)."""
    return {
        "status": STATUS_TABLE[status].public,
        "stage": str(stage),
        "progress": progress,
        "asset_id": str(asset_id) if asset_id is not None else None,
        "error": public_error(error_code),
    }


def public_event(
    *,
    task_id: uuid.UUID,
    task_version: int,
    status: Status,
    stage: str,
    progress: int | None,
    asset_id: uuid.UUID | None,
    error_code: str | None,
) -> dict[str, Any]:
    """The public payload of one task event (the stream seq is added where it is allotted)."""
    return {
        "task_id": str(task_id),
        "task_version": task_version,
        **public_fields(status, stage, progress, asset_id, error_code),
    }


def stored_fields(event: dict[str, Any]) -> dict[str, Any]:
    """What a ``task_events`` row stores of a public event (``state.events.stored_payload``
    writes it as compact JSON): not what the row's columns say (``task_id``, ``task_version``,
    the seq) and no null field. :func:`stored_event` adds them back."""
    return {
        k: v
        for k, v in event.items()
        if v is not None and k not in ("task_id", "task_version", "event_id")
    }


def stored_event(
    stored: dict[str, Any], task_id: uuid.UUID | str, task_version: int, seq: int
) -> dict[str, Any]:
    """A task event as clients see it, from its ``task_events`` row: the stored payload leaves
    out what the row's columns say (``task_id``, ``task_version``, the seq) and null fields
    (rows written before that keep them: the columns win)."""
    return {
        "event_id": seq,
        "task_id": str(task_id),
        "task_version": task_version,
        "status": stored.get("status"),
        "stage": stored.get("stage"),
        "progress": stored.get("progress"),
        "asset_id": stored.get("asset_id"),
        "error": stored.get("error"),
    }
