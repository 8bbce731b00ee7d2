"""The HTTP contract as pydantic models: every request body, response body and error shape.

Handlers validate what comes in with the request models (``parse_body``) and serialise what goes
out through the response models (``api.http.respond``), so the wire format is what these models
say; ``api.openapi`` builds the OpenAPI document from the same models. Times are ISO 8601 as
Python writes them (``datetime.isoformat()``: ``+00:00``, not ``Z``), as the API always wrote
them.
"""

from __future__ import annotations

import re
import uuid
from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    WithJsonSchema,
)
from pydantic.json_schema import SkipJsonSchema

from aivedio.domain.statuses import Stage

__all__ = [
    "AuditEvent",
    "AuditObservation",
    "AuditResponse",
    "ChaosKnobs",
    "ChaosPatch",
    "CloseFrame",
    "CreateSessionBody",
    "CreateTaskBody",
    "ErrorDetail",
    "ErrorResponse",
    "EventPayload",
    "FieldError",
    "Health",
    "ListQuery",
    "LoopDown",
    "NotReady",
    "PlaybackLink",
    "PublicError",
    "PublicStatus",
    "Readiness",
    "ResetFrame",
    "Session",
    "SessionResponse",
    "Snapshot",
    "StreamOutage",
    "StreamOutageBody",
    "StreamToken",
    "StreamTokenBody",
    "TaskEvents",
    "TaskList",
    "TaskResponse",
    "TimelineEvent",
]

# The public statuses (``domain.statuses.PUBLIC_STATUSES``; a unit test keeps the two equal).
PublicStatus = Literal[
    "queued", "running", "cancel_requested", "processing_media", "ready", "failed", "canceled"
]

Time = Annotated[
    datetime,
    PlainSerializer(lambda d: d.isoformat(), return_type=str),
    WithJsonSchema({"type": "string", "format": "date-time"}),
]
CURSOR_PATTERN = r"^\d+-\d+$"
Cursor = Annotated[
    str, Field(pattern=CURSOR_PATTERN, description="`<epoch>-<seq>` of the project's stream")
]
Progress = Annotated[int, Field(ge=0, le=100)]
Version = Annotated[int, Field(ge=1)]
Seq = Annotated[int, Field(ge=1)]


class _Out(BaseModel):
    """A response body: every field is always written (null where the value is null)."""

    model_config = ConfigDict(extra="forbid")


class _In(BaseModel):
    """A request body: unknown fields are refused. ``field_messages`` keeps the API's stable
    message for a field where it had one before these models; ``body_error`` is the one field
    error for a body that is no object (or has unknown fields), where the API had one
    (``api.http.body_errors``)."""

    model_config = ConfigDict(extra="forbid")
    field_messages: ClassVar[dict[str, str]] = {}
    body_error: ClassVar[tuple[str, str] | None] = None


# -- errors --------------------------------------------------------------------------------------


def _never_null(schema: dict[str, Any]) -> None:
    """A field left out rather than written as null: no ``default: null`` in its schema."""
    schema.pop("default", None)


class FieldError(_Out):
    field: str = Field(description="the body field, `body`, a query parameter or a header")
    message: str


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str = Field(description="a stable code (see the status's description)")
    message: str = Field(description="for people; may change")
    fields: list[FieldError] | SkipJsonSchema[None] = Field(
        None,
        description="422 `validation_failed` (and `idempotency_key_reused`) only",
        json_schema_extra=_never_null,
    )
    trace_id: str | SkipJsonSchema[None] = Field(
        None,
        description="the request's trace id (the `X-Trace-Id` header)",
        json_schema_extra=_never_null,
    )


class ErrorResponse(BaseModel):
    """Every error answer: ``{"error": {"code", "message", ...}}``. Absent fields are left out
    (``fields`` except for field errors; ``trace_id`` on the stream endpoints' refusals)."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorDetail


# -- tasks ---------------------------------------------------------------------------------------

_UNSTORABLE = re.compile(r"[\x00\ud800-\udfff]")


def _storable(value: Any) -> Any:
    """Text PostgreSQL can store: no NUL, no unpaired surrogate (JSON may escape both), in
    strings and in every key and string of a nested object."""
    if isinstance(value, str):
        if _UNSTORABLE.search(value):
            raise ValueError("text with NUL or an unpaired surrogate cannot be stored")
    elif isinstance(value, dict):
        for key, item in value.items():
            _storable(key)
            _storable(item)
    elif isinstance(value, list):
        for item in value:
            _storable(item)
    return value


Text = AfterValidator(_storable)


class CreateTaskBody(_In):
    model_config = ConfigDict(extra="forbid", strict=True)

    provider: Annotated[
        str, Field(min_length=1, max_length=64, description="a configured provider"), Text
    ]
    model: Annotated[str, Field(min_length=1, max_length=200), Text]
    prompt: Annotated[str, Field(min_length=1, max_length=8000), Text]
    params: Annotated[dict[str, Any], Text] = Field(
        default_factory=dict, description="provider parameters, at most 16 KiB as JSON"
    )


def _digits(value: object) -> object:
    """A query integer is written in ASCII digits only (no sign, space, ``_`` or ``.0``)."""
    if isinstance(value, str) and not (value.isascii() and value.isdigit()):
        raise ValueError("digits only")
    return value


class ListQuery(_In):
    """The query of ``GET .../tasks``; other parameters are ignored. The largest ``limit`` is
    the API's setting (``page_size_max``, 200 by default), checked by the handler."""

    model_config = ConfigDict(extra="ignore")

    limit: Annotated[int, BeforeValidator(_digits), Field(ge=1)] = 50
    page: str | None = None


class PublicError(_Out):
    code: str = Field(description="a stable product error code")
    message: str


class TaskError(PublicError):
    trace_id: str | None


class Asset(_Out):
    id: uuid.UUID
    playback_url: str = Field(
        description="an API path that answers with a short-lived signed link (`GetPlayback`)"
    )


class Snapshot(_Out):
    """A task as a browser may see it, with the project's stream position it was read at."""

    id: uuid.UUID
    project_id: uuid.UUID
    status: PublicStatus
    stage: Stage
    progress: Progress | None
    task_version: Version = Field(description="apply an event only if its version is higher")
    last_event_id: Seq | None = Field(description="the seq of this task's last event")
    cursor: Cursor = Field(description="resume the stream from here")
    error: TaskError | None
    asset: Asset | None
    created_at: Time
    updated_at: Time


class TaskResponse(_Out):
    task: Snapshot


class TaskList(_Out):
    tasks: list[Snapshot] = Field(description="newest first, all read at `cursor`")
    next_page: str | None = Field(description="the `page` of the next call; null: the last page")
    cursor: Cursor


class EventPayload(_Out):
    """The public payload of one task event (the SSE `data:` of a `task.status` frame)."""

    event_id: Seq = Field(description="the seq")
    task_id: uuid.UUID
    task_version: Version
    status: PublicStatus
    stage: Stage
    progress: Progress | None
    asset_id: uuid.UUID | None
    error: PublicError | None


class AuditEvent(_Out):
    event_id: Seq
    cursor: Cursor
    task_version: Version
    type: str = Field(description="`task.status`")
    source: str
    trace_id: str | None
    created_at: Time
    payload: EventPayload


class AuditObservation(_Out):
    outcome: Literal["ignored", "conflict", "applied"]
    reason: str
    source: str
    observed: str
    provider_sequence: int | None
    progress: int | None
    task_version: int | None
    trace_id: str | None
    received_at: Time


class AuditResponse(_Out):
    events: list[AuditEvent]
    ignored_observations: list[AuditObservation] = Field(
        description="observations that changed nothing, and why"
    )
    unpublished_versions: list[AuditObservation] = Field(
        description="task versions that changed no public field: written, but no event"
    )


PublicField = Literal["status", "stage", "progress", "asset_id", "error"]


class TimelineEvent(_Out):
    """One public event of a task, as the stream delivered it, with what it changed."""

    event_id: Seq = Field(description="the seq")
    cursor: Cursor
    task_version: Version
    created_at: Time
    changed: list[PublicField] = Field(
        description="the public fields that differ from the task's previous event (the first "
        "event: every field it sets)"
    )
    payload: EventPayload


class TaskEvents(_Out):
    events: list[TimelineEvent] = Field(description="every public event of the task, seq order")


# -- sessions and stream tokens -----------------------------------------------------------------


class CreateSessionBody(_In):
    project_id: uuid.UUID | None = Field(
        None, description="bind the session to this project; absent or null: every project"
    )
    field_messages: ClassVar[dict[str, str]] = {"project_id": "a UUID"}
    body_error: ClassVar[tuple[str, str] | None] = ("body", 'an object {"project_id"?: UUID}')


class Session(_Out):
    id: uuid.UUID
    project_id: uuid.UUID | None = Field(description="null: every project of the tenant")
    created_at: Time
    expires_at: Time


class SessionResponse(_Out):
    session: Session


class StreamTokenBody(_In):
    """``{"project_id"}``; other fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    project_id: uuid.UUID
    field_messages: ClassVar[dict[str, str]] = {"project_id": "a UUID"}
    body_error: ClassVar[tuple[str, str] | None] = ("project_id", "a UUID")


class StreamToken(_Out):
    token: str = Field(description="put it in the stream URL as `?token=`")
    expires_at: Time = Field(description="at most 60 s from now")


# -- playback, health ----------------------------------------------------------------------------


class PlaybackLink(_Out):
    url: str = Field(description="a signed `/v1/media/{asset_id}?exp=..&sig=..` URL")
    expires_at: str = Field(
        description="when `url` stops working (ISO 8601, UTC, written with `Z`)",
        json_schema_extra={"format": "date-time"},
    )


class Health(_Out):
    status: Literal["ok"]


class Readiness(BaseModel):
    """``/readyz`` when the process can serve: ``{"status": "ready"}``."""

    model_config = ConfigDict(extra="allow")

    status: str


class LoopDown(_Out):
    """One role loop that is down (``aivedio.process.health``)."""

    role: str
    loop: str = Field(description="the loop's name within its role, e.g. `worker`, `cancel`")
    state: Literal["outage", "restarting"] = Field(
        description="`outage`: paused while `dependency` is away, it retries by itself; "
        "`restarting`: it failed and waits out its backoff before its supervisor restarts it"
    )
    dependency: Literal["database", "redis", "bus"] | None
    error: str | None = Field(description="exception type names only, never a message")
    restarts: int = Field(ge=0, description="restarts of this loop since the process started")
    for_s: float = Field(ge=0, description="seconds in this state")


class NotReady(_Out):
    """``/readyz`` answered 503: what is down."""

    status: Literal["unavailable"]
    database: Literal["ok", "unavailable"] = Field(description="`SELECT 1` through the pool")
    roles_down: list[str] = Field(
        description="the roles of this process with at least one loop down, in start order"
    )
    loops: list[LoopDown]


# -- the sandbox provider's chaos (only where the sandbox provider is enabled) -----------------

Rate = Annotated[float, Field(ge=0, le=1, description="a probability, 0..1")]
Span = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=2, max_length=2)]


class ChaosKnobs(_Out):
    """The sandbox provider's chaos knobs (docs/reference/sandbox-provider.md)."""

    model_config = ConfigDict(extra="allow")

    webhooks_enabled: bool
    duplicate_rate: float
    reorder: float
    delay_ms: list[int] = Field(description="`[min_ms, max_ms]`")
    drop_rate: float
    query_429_rate: float
    retry_after_s: float
    query_5xx_rate: float
    query_slow_ms: list[int] = Field(description="`[min_ms, max_ms]`")


class ChaosPatch(_In):
    """The knobs to change; the others keep their values."""

    webhooks_enabled: bool | None = None
    duplicate_rate: Rate | None = None
    reorder: Rate | None = None
    delay_ms: Span | None = None
    drop_rate: Rate | None = None
    forge_signature_rate: Rate | None = None
    contradictory_terminal: Rate | None = None
    query_429_rate: Rate | None = None
    retry_after_s: Annotated[float, Field(ge=0, le=60)] | None = None
    query_5xx_rate: Rate | None = None
    query_slow_ms: Span | None = None
    body_error: ClassVar[tuple[str, str] | None] = ("body", "an object of known chaos knobs")


class StreamOutageBody(_In):
    seconds: Annotated[float, Field(ge=0, le=120)] = Field(
        description="how long this gateway refuses the project's streams after closing them"
    )
    body_error: ClassVar[tuple[str, str] | None] = ("body", 'an object {"seconds": 0..120}')


class StreamOutage(_Out):
    closed: int = Field(ge=0, description="the project's streams this gateway closed")
    until: Time = Field(description="new streams of the project are refused until then")


# -- stream frames (documented; written by the gateway, not through these models) ---------------


class ResetFrame(_Out):
    """The `data:` of an SSE `event: reset` (re-read the snapshot, go on from `cursor`)."""

    reason: Literal["other_epoch", "ahead_of_head", "below_floor", "replay_too_large"]
    cursor: Cursor
    epoch: int
    head: int


class CloseFrame(_Out):
    """The `data:` of an SSE `event: close`, the last frame before the server closes."""

    code: int = Field(description="3000-3499 reconnect, 3500-3999 terminal")
    reason: str
    reconnect: bool
