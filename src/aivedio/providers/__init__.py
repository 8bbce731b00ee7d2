"""Provider adapters behind one port, :mod:`aivedio.providers.port` (re-exported here).

One module per provider dialect: ``sandbox`` (aivedio's fake provider), ``replicate``, ``fal``,
``runway`` (poll-only) and ``kling`` (unsigned callbacks); ``registry`` builds them from config.
"""

from aivedio.providers.port import (
    AuthFailed,
    InboxFields,
    JobState,
    MalformedResponse,
    NormalizedCallback,
    NotFoundYet,
    PayloadError,
    ProviderAdapter,
    ProviderError,
    ProviderUnavailable,
    QueryResult,
    RateLimited,
    Rejected,
    SubmitOutcomeUnknown,
    SubmitRequest,
    SubmitResult,
    Unsupported,
)

__all__ = [
    "AuthFailed",
    "InboxFields",
    "JobState",
    "MalformedResponse",
    "NormalizedCallback",
    "NotFoundYet",
    "PayloadError",
    "ProviderAdapter",
    "ProviderError",
    "ProviderUnavailable",
    "QueryResult",
    "RateLimited",
    "Rejected",
    "SubmitOutcomeUnknown",
    "SubmitRequest",
    "SubmitResult",
    "Unsupported",
]
