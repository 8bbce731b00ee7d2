"""Sessions, stream tokens, playback links and the signed media files."""

from __future__ import annotations

from aivedio.api import models as m
from aivedio.api.contract.base import (
    ASSET,
    CSRF,
    INVALID,
    KEY,
    MEDIA_TYPE,
    NOT_FOUND,
    PROJECT,
    READ,
    TOO_LARGE,
    UNAUTHORIZED,
    UNAVAILABLE,
    WRITE,
    Body,
    Operation,
    Param,
    Reply,
    error,
)

# -- sessions, stream tokens, playback ----------------------------------------------------------

NO_STORE = (("Cache-Control", "`no-store`"),)

ACCESS_OPERATIONS = [
    Operation(
        "post",
        "/v1/sessions",
        "CreateSession",
        "sessions",
        "Exchange an API key for a browser session cookie",
        description="Sets `aivedio_session=<secret>; HttpOnly; SameSite=Strict; Path=/` (plus "
        "`Secure` behind an `https://` public URL); the secret is only in the cookie. A session "
        "lives 8 hours. Only an API key creates one.",
        security=(KEY,),
        body=Body(
            m.CreateSessionBody,
            required=False,
            description="optional; without it, or `{}`, the session may use every project of "
            "the key's tenant",
        ),
        replies={
            201: Reply(
                "the session",
                m.SessionResponse,
                headers=(("Set-Cookie", "the session cookie"), *NO_STORE),
            ),
            401: UNAUTHORIZED,
            404: NOT_FOUND,
            413: TOO_LARGE,
            415: MEDIA_TYPE,
            422: INVALID,
            503: UNAVAILABLE,
        },
    ),
    Operation(
        "get",
        "/v1/sessions/current",
        "GetCurrentSession",
        "sessions",
        "Describe the session the cookie holds",
        security=(("session",),),
        replies={
            200: Reply("the session", m.SessionResponse, headers=NO_STORE),
            401: UNAUTHORIZED,
            503: UNAVAILABLE,
        },
    ),
    Operation(
        "delete",
        "/v1/sessions/current",
        "DeleteCurrentSession",
        "sessions",
        "Revoke the session and clear the cookie",
        description="Idempotent: 204 without a live session too. Its streams close with "
        "`credential_revoked` within 5 s.",
        security=(("session", "csrf"), ()),
        replies={
            204: Reply(
                "revoked (or there was none); the cookie is cleared",
                content_type=None,
                headers=(("Set-Cookie", "the cleared cookie (`Max-Age=0`)"), *NO_STORE),
            ),
            403: CSRF,
            503: UNAVAILABLE,
        },
    ),
    Operation(
        "post",
        "/v1/stream-tokens",
        "CreateStreamToken",
        "streams",
        "Mint a short-lived token for one project's stream URL",
        description="The token may travel in a URL (`?token=`): it lives <= 60 s and names one "
        "project. One minted with a session is revoked with it.",
        security=WRITE,
        body=Body(m.StreamTokenBody),
        replies={
            200: Reply("the token", m.StreamToken, headers=NO_STORE),
            401: UNAUTHORIZED,
            403: CSRF,
            404: NOT_FOUND,
            413: TOO_LARGE,
            415: MEDIA_TYPE,
            422: INVALID,
            503: UNAVAILABLE,
        },
    ),
    Operation(
        "get",
        "/v1/projects/{project_id}/assets/{asset_id}/playback",
        "GetPlayback",
        "media",
        "Get a short-lived signed link to a finished video",
        description="`Snapshot.asset.playback_url`. The caller is checked again each time.",
        security=READ,
        params=(
            PROJECT,
            ASSET,
            Param(
                "redirect",
                "query",
                {"type": "string", "enum": ["1", "true"]},
                "answer 302 to the link instead (what a `<video src>` can follow)",
            ),
        ),
        replies={
            200: Reply("the link", m.PlaybackLink, headers=NO_STORE),
            302: Reply(
                "with `?redirect=1`: to the link",
                content_type=None,
                headers=(("Location", "the signed media URL"), *NO_STORE),
            ),
            401: UNAUTHORIZED,
            404: NOT_FOUND,
            503: UNAVAILABLE,
        },
    ),
    Operation(
        "get",
        "/v1/media/{asset_id}",
        "GetMedia",
        "media",
        "Read a video file through a signed link",
        description="No API key: the signature is the credential, until `exp`. `Range` is "
        "supported (206).",
        params=(
            ASSET,
            Param("exp", "query", {"type": "string"}, "unix seconds", required=True),
            Param("sig", "query", {"type": "string"}, "the link's signature", required=True),
            Param("Range", "header", {"type": "string"}, "`bytes=<first>-<last>`"),
        ),
        replies={
            200: Reply("the file", content_type="video/*", schema={}),
            206: Reply("the range", content_type="video/*", schema={}),
            403: error("`forbidden`: the link is invalid or has expired"),
            404: error("`not_found`: no such asset, or its file is gone"),
            416: error("`range_not_satisfiable`", (("Content-Range", "`bytes */<size>`"),)),
            503: UNAVAILABLE,
        },
    ),
]
