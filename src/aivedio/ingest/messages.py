"""The callback endpoint's values, shared with its transports: the request whose body is read
next, the answer as plain data, and the refusals (status, error code, message).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from aivedio.providers.port import CallbackProvider

__all__ = ["NO_CONTENT", "REFUSALS", "Answer", "CallbackRequest", "Reject", "error_answer"]


@dataclass(frozen=True, slots=True)
class Answer:
    """A response as plain data, for any transport to write.

    ``headers`` are lower-cased names besides ``content-length`` (the transport adds it, and the
    trace id header). ``close``: the transport must close the connection after this answer, as
    the rest of the request was not read (413).
    """

    status: int
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    close: bool = False


NO_CONTENT = Answer(204)
"""The answer to a callback that is stored (now, or before: a duplicate)."""


@dataclass(slots=True)
class CallbackRequest:
    """A callback whose head passed rows 1 to 5: the transport now reads at most
    :attr:`max_body_bytes` of body within ``read_timeout_s`` and hands it to
    :meth:`CallbackEndpoint.finish`."""

    provider: CallbackProvider
    headers: dict[str, str]
    """Lower-cased names, the first value of a repeated header."""
    query: bytes
    trace_id: str

    @property
    def max_body_bytes(self) -> int:
        return self.provider.max_body_bytes


class Reject(Exception):
    """Control flow inside the endpoint: answer ``status`` and stop. Never escapes it."""

    def __init__(self, status: int, code: str, reason: str, **headers: str) -> None:
        super().__init__(reason)
        self.status = status
        self.code = code
        self.reason = reason
        self.headers = headers


_MESSAGES = {
    400: "the body is not valid UTF-8",
    401: "the callback could not be authenticated",
    404: "no such callback endpoint",
    405: "use POST",
    408: "the body did not arrive in time",
    413: "the body is too large",
    414: "the query string is too long",
    415: "send application/json",
    422: "the body is not an acceptable JSON object",
    431: "the request headers are too large",
    500: "the callback could not be stored",
    503: "the service is temporarily unavailable; retry later",
}

_BAD_REQUEST = "the request is not valid HTTP/1.1"

# What a transport reports on its own (status -> error code, metric reason).
REFUSALS = {
    400: ("bad_request", "bad_request"),  # not HTTP/1.1 the parser accepts (lean path only)
    408: ("request_timeout", "request_timeout"),
    413: ("body_too_large", "body_too_large"),
    431: ("headers_too_large", "headers_too_large"),  # a head past the transport's own cap
    499: ("client_disconnected", "client_disconnected"),  # nothing is sent: nobody listens
}


def error_answer(rejection: Reject, trace_id: str) -> Answer:
    body = json.dumps(
        {
            "error": {
                "code": rejection.code,
                "message": _BAD_REQUEST
                if rejection.code == "bad_request"
                else _MESSAGES.get(rejection.status, "rejected"),
                "trace_id": trace_id,
            }
        }
    ).encode()
    return Answer(
        rejection.status,
        (("content-type", "application/json"), *rejection.headers.items()),
        body,
        # the rest of the request was not read: the connection cannot carry another one
        close=rejection.status in _CLOSING,
    )


_CLOSING = frozenset({400, 408, 413, 431})
