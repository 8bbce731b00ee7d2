"""Redaction: what is stored or logged of a provider payload never holds a credential.

:func:`redact` is what every adapter's ``minimize`` applies before a callback payload is stored;
:func:`sample_of` is the short, redacted rendering an error record carries. Adapters never log
payloads or signed URLs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

__all__ = ["REDACTED", "SAMPLE_CHARS", "SECRET_KEYS", "redact", "sample_of"]

REDACTED = "[redacted]"
SAMPLE_CHARS = 300

# Keys whose values are credentials wherever they appear in a payload (compared lower-cased).
SECRET_KEYS = frozenset(
    {
        "token",
        "access_token",
        "refresh_token",
        "api_key",
        "apikey",
        "secret",
        "password",
        "authorization",
        "signature",
        "sig",
        "x-amz-signature",
        "credential",
        "credentials",
    }
)
_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def _strip_url(value: str) -> str:
    """A URL without its query, fragment and user info: where signed, temporary tokens live."""
    try:
        parts = urlsplit(value)
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
    except ValueError:
        return REDACTED
    if not (parts.query or parts.fragment or parts.username or parts.password):
        return value
    stripped = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    return stripped + ("?" + REDACTED if parts.query else "")


def redact(value: Any, url_keys: frozenset[str] = frozenset()) -> Any:
    """A JSON value with credentials redacted; ``value`` itself when there is nothing to redact
    (containers are copied only along the paths that change, never modified in place).

    Values under a :data:`SECRET_KEYS` key become ``"[redacted]"``; values under one of
    ``url_keys`` (temporary download links) become ``"[redacted]"`` too; any other string that is
    a URL loses its query, fragment and user info."""
    if isinstance(value, str):
        return _strip_url(value) if "://" in value and _URL.match(value) else value
    if isinstance(value, dict):
        return _redact_dict(value, url_keys)
    if isinstance(value, list):
        return _redact_list(value, url_keys)
    if isinstance(value, Mapping):  # any other mapping: redacted as the dict it would store
        return _redact_dict(dict(value), url_keys)
    return value


def _redact_dict(value: dict[str, Any], url_keys: frozenset[str]) -> dict[str, Any]:
    out: dict[str, Any] | None = None
    for key, item in value.items():
        kind = type(item)  # exact types first: what a JSON parser builds
        lowered = key.lower()
        if lowered in SECRET_KEYS or (item is not None and lowered in url_keys):
            new: Any = REDACTED
        elif kind is str:  # most values are strings without a URL
            if "://" not in item or not _URL.match(item):
                continue
            new = _strip_url(item)
        elif kind is dict:
            new = _redact_dict(item, url_keys)
        elif kind is int or kind is float or kind is bool or item is None:
            continue
        else:  # lists, and subclasses of str / dict / list
            new = redact(item, url_keys)
        if new is not item:
            if out is None:
                out = dict(value)
            out[key] = new
    return value if out is None else out


def _redact_list(value: list[Any], url_keys: frozenset[str]) -> list[Any]:
    out: list[Any] | None = None
    for index, item in enumerate(value):
        new = redact(item, url_keys)
        if new is not item:
            if out is None:
                out = list(value)
            out[index] = new
    return value if out is None else out


def sample_of(value: object, limit: int = SAMPLE_CHARS) -> str:
    """A short, redacted rendering of a payload or response body for an error record."""
    if isinstance(value, bytes):
        raw = value
        try:
            value = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            value = raw[:limit].decode("utf-8", "replace")
    try:
        text = json.dumps(redact(value), separators=(",", ":"), default=str)
    except (TypeError, ValueError):
        text = repr(type(value))
    return text if len(text) <= limit else text[: limit - 1] + "…"
