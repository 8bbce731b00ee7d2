"""Named close reasons in documented ranges (centrifuge's ``disconnect.go`` habit).

- 3000-3499 **reconnect**: the client reconnects (with backoff) and resumes from its cursor.
- 3500-3999 **terminal**: reconnecting with the same credential and request cannot succeed.

An SSE stream carries the reason in a last ``event: close`` frame. A WebSocket carries it in its
close frame, as an application code (RFC 6455 reserves 4000-4999 for applications): ``code + 1000``,
so 4000-4499 reconnect and 4500-4999 are terminal, the same ranges shifted. Violations of the
WebSocket protocol itself use the RFC's own codes (``ws_code``): 1002 ``protocol_error``, 1003
``unsupported_data``, 1007 ``invalid_data``, 1009 ``message_too_big``. ``client_gone`` is never
sent: it names, in the close log line, a client that went away by itself (or closed its WebSocket);
``killed`` is not sent either: the sandbox's stream outage aborts the socket.
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
    PING_TIMEOUT = (3006, "ping_timeout")  # WebSocket: no pong (nor anything) within a period
    KILLED = (3007, "killed")  # the sandbox's stream outage: cut without a goodbye frame
    UNAUTHORIZED = (3500, "unauthorized")
    FORBIDDEN = (3501, "forbidden")
    BAD_REQUEST = (3502, "bad_request")
    CREDENTIAL_REVOKED = (3503, "credential_revoked")
    PROTOCOL_ERROR = (3504, "protocol_error")  # WebSocket: unmasked, reserved bits, bad opcode
    UNSUPPORTED_DATA = (3505, "unsupported_data")  # WebSocket: a binary message
    INVALID_DATA = (3506, "invalid_data")  # WebSocket: a text message that is not UTF-8
    MESSAGE_TOO_BIG = (3507, "message_too_big")  # WebSocket: a frame or message over the cap

    @property
    def code(self) -> int:
        return self.value[0]

    @property
    def label(self) -> str:
        return self.value[1]

    @property
    def reconnect(self) -> bool:
        return self.code < 3500

    @property
    def abrupt(self) -> bool:
        """Closed without a goodbye frame: the socket is aborted (never sent, like
        ``client_gone``, so a client sees only a broken connection)."""
        return self in (CloseReason.CLIENT_GONE, CloseReason.KILLED)

    @property
    def ws_code(self) -> int:
        """The code of a WebSocket close frame: the RFC's own for protocol violations, else
        the application code ``code + 1000`` (4000-4499 reconnect, 4500-4999 terminal)."""
        return _WS_PROTOCOL_CODES.get(self.code, self.code + 1000)


RECONNECT_RANGE = range(3000, 3500)
TERMINAL_RANGE = range(3500, 4000)
WS_RECONNECT_RANGE = range(4000, 4500)
WS_TERMINAL_RANGE = range(4500, 5000)

_WS_PROTOCOL_CODES = {3504: 1002, 3505: 1003, 3506: 1007, 3507: 1009}
