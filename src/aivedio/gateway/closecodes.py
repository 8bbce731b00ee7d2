"""Named close reasons in documented ranges (centrifuge's ``disconnect.go`` habit).

- 3000-3499 **reconnect**: the client reconnects (with backoff) and resumes from its cursor.
- 3500-3999 **terminal**: reconnecting with the same credential and request cannot succeed.

An SSE stream carries the reason in a last ``event: close`` frame; a WebSocket will carry the
code in its close frame. ``client_gone`` is never sent: it names, in the close log line, a client
that went away by itself.
"""

from __future__ import annotations

from enum import Enum


class CloseReason(Enum):
    """``(code, name)``; ``reconnect`` says whether the client should come back."""

    SHUTDOWN = (3000, "shutdown")
    SLOW = (3001, "slow")
    SESSION_EXPIRED = (3002, "session_expired")
    CREDENTIAL_EXPIRED = (3003, "credential_expired")
    SERVER_ERROR = (3004, "server_error")
    CLIENT_GONE = (3005, "client_gone")
    UNAUTHORIZED = (3500, "unauthorized")
    FORBIDDEN = (3501, "forbidden")
    BAD_REQUEST = (3502, "bad_request")
    CREDENTIAL_REVOKED = (3503, "credential_revoked")

    @property
    def code(self) -> int:
        return self.value[0]

    @property
    def label(self) -> str:
        return self.value[1]

    @property
    def reconnect(self) -> bool:
        return self.code < 3500


RECONNECT_RANGE = range(3000, 3500)
TERMINAL_RANGE = range(3500, 4000)
