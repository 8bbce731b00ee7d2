"""Media failure classes. Each names what to do with the operation, not where it happened.

- ``MediaRejected``: the bytes are not a video we accept (corrupt, unsupported, too big):
  fail now with ``media_failed``.
- ``OutputExpired``: the signed URL was refused (401/403/404/410): ask the provider for a fresh
  URL; retried; ``output_expired`` when the tries run out.
- ``OutputUnavailable``: the provider has no output for the job right now: retried;
  ``output_expired`` when the tries run out.
- ``OutputWithdrawn``: the provider now says the job failed or was canceled (a provider that
  contradicted its own success): it has no output and never will: fail now with
  ``generation_failed`` (the contradiction itself is a reconciliation item already).
- ``TransientMediaError``: network error, timeout, 408/429/5xx, object store I/O: retried with
  backoff; its ``public_code`` when the tries run out.
- ``Superseded``: the task moved on (terminal, or another attempt): stop, no observation.
"""

from __future__ import annotations

from aivedio.errors import AivedioError


class MediaError(AivedioError):
    """Root of the media worker's errors. ``detail`` is internal (never a URL, never public)."""

    public_code = "media_failed"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class MediaRejected(MediaError):
    """Corrupt or unsupported media: retrying cannot help."""


class RetryableMediaError(MediaError):
    """Retrying later may help; ``public_code`` is the error once the tries are used up."""


class TransientMediaError(RetryableMediaError):
    public_code = "media_failed"


class TransientFetchError(TransientMediaError):
    """The provider's file or query endpoint failed transiently (network, timeout, 429, 5xx)."""

    public_code = "output_expired"


class OutputExpired(RetryableMediaError):
    """The output URL was refused: it expired or its signature is no longer accepted."""

    public_code = "output_expired"


class OutputUnavailable(RetryableMediaError):
    """The provider reports no output for the job (not succeeded, or not found)."""

    public_code = "output_expired"


class OutputWithdrawn(MediaRejected):
    """The provider reports the job failed or canceled: retrying cannot bring an output."""

    public_code = "generation_failed"


class Superseded(MediaError):
    """The task is terminal or runs another attempt: this operation has nothing left to do."""
