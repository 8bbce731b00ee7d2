"""The sandbox provider's chaos, for the web console: mounted only where the sandbox provider is
enabled (``AIVEDIO_SANDBOX_ENABLED``); elsewhere these paths answer 404."""

from __future__ import annotations

from aivedio.api import models as m
from aivedio.api.contract.base import (
    CSRF,
    INVALID,
    MEDIA_TYPE,
    NOT_FOUND,
    PROJECT,
    READ,
    RETRY_AFTER,
    TOO_LARGE,
    UNAUTHORIZED,
    WRITE,
    Body,
    Operation,
    Reply,
    error,
)

CHAOS = "/v1/sandbox/chaos"
SANDBOX_UNAVAILABLE = error(
    "`sandbox_unavailable`: the sandbox provider did not answer; nothing changed", RETRY_AFTER
)
ONLY_SANDBOX = (
    " Mounted only where the sandbox provider is enabled; the knobs are the sandbox "
    "provider's own, shared by every project that uses it (docs/reference/sandbox-provider.md)."
)

SANDBOX_OPERATIONS = [
    Operation(
        "get",
        CHAOS,
        "GetSandboxChaos",
        "sandbox",
        "Read the sandbox provider's chaos knobs",
        description="What the sandbox provider does wrong on purpose right now." + ONLY_SANDBOX,
        security=READ,
        replies={
            200: Reply("the knobs", m.ChaosKnobs),
            401: UNAUTHORIZED,
            503: SANDBOX_UNAVAILABLE,
        },
    ),
    Operation(
        "put",
        CHAOS,
        "SetSandboxChaos",
        "sandbox",
        "Change the sandbox provider's chaos knobs",
        description="Changes the knobs the body names, keeps the others, and answers the new set."
        + ONLY_SANDBOX,
        security=WRITE,
        body=Body(m.ChaosPatch),
        replies={
            200: Reply("the knobs after the change", m.ChaosKnobs),
            401: UNAUTHORIZED,
            403: CSRF,
            413: TOO_LARGE,
            415: MEDIA_TYPE,
            422: INVALID,
            503: SANDBOX_UNAVAILABLE,
        },
    ),
    Operation(
        "post",
        "/v1/projects/{project_id}/sandbox/stream-outage",
        "StartStreamOutage",
        "sandbox",
        "Kill the project's realtime connections on this gateway",
        description="The gateway that answers closes the project's open SSE and WebSocket "
        "streams without a goodbye frame (as a lost network would) and refuses the project's new "
        "streams with 503 `stream_outage` for `seconds`: clients retry with backoff, fall back to "
        'polling ("live updates paused"), then resume from their cursor. Served by the '
        "`gateway` role; other gateway processes are not affected." + ONLY_SANDBOX,
        security=WRITE,
        params=(PROJECT,),
        body=Body(m.StreamOutageBody),
        replies={
            202: Reply("the outage started", m.StreamOutage),
            401: UNAUTHORIZED,
            403: CSRF,
            404: NOT_FOUND,
            413: TOO_LARGE,
            415: MEDIA_TYPE,
            422: INVALID,
        },
    ),
]
