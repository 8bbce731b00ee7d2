"""One root exception; driver errors are translated at the adapter edge into these."""

from __future__ import annotations


class AivedioError(Exception):
    """Root of every error aivedio raises on purpose."""


class DatabaseUnavailable(AivedioError):
    """PostgreSQL cannot be reached or did not answer in time; nothing was committed."""


class NotFound(AivedioError):
    """The thing does not exist, or belongs to another tenant (answered the same way)."""


class Conflict(AivedioError):
    """The request contradicts the current state (for example, retry of a running task)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class IdempotencyMismatch(AivedioError):
    """The Idempotency-Key was used before with a different request body."""


class Unauthorized(AivedioError):
    """Missing, unknown or revoked credential."""


class ConfigError(AivedioError):
    """The settings are incomplete or contradictory; the message names the variable to fix."""
