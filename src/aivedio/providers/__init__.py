"""Provider adapters behind one port, ``port.py`` (re-exported here).

One module per provider dialect: ``sandbox`` (aivedio's fake provider), ``replicate``, ``fal``,
``runway`` (poll-only) and ``kling`` (unsigned callbacks), standing on the adapter support
``common``, ``http``, ``redact`` and the verifiers ``verify`` and ``jwks``; ``registry`` builds
them from config.
"""

from aivedio.providers.port import (
    DEFAULT_MAX_BODY_BYTES,
    AuthFailed,
    CallbackProvider,
    DedupInfo,
    ImmediateVerifier,
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
    Reason,
    Rejected,
    SubmitOutcomeUnknown,
    SubmitRequest,
    SubmitResult,
    Unsupported,
    VerificationError,
    Verified,
    Verifier,
)

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "AuthFailed",
    "CallbackProvider",
    "DedupInfo",
    "ImmediateVerifier",
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
    "Reason",
    "Rejected",
    "SubmitOutcomeUnknown",
    "SubmitRequest",
    "SubmitResult",
    "Unsupported",
    "VerificationError",
    "Verified",
    "Verifier",
]
