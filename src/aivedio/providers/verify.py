"""Callback authenticity checks on the raw request bytes, one verifier per signing scheme.

The callback gateway calls ``await verifier.verify(headers, body, now, callback_token=...)`` before
it parses anything. A failure raises :class:`VerificationError` carrying a stable :class:`Reason`;
the gateway answers 401 with a generic body (503 when :attr:`VerificationError.retryable`) and
sends the reason to a metric and a log line, never to the caller. Exception messages never hold a
secret, a signature or a token.

The types (``Verifier``, ``Verified``, ``VerificationError``, ``Reason``) are part of the provider
port, :mod:`aivedio.providers.port`. Here: Standard Webhooks v1 (HMAC) and callback tokens for
unsigned providers; fal-style ED25519 with its JWKS cache is in :mod:`aivedio.providers.jwks`.
Every check is pure apart from the JWKS fetch: no environment reads, no module state, the clock
passed in as ``now`` (Unix seconds). Headers are a mapping with lower-cased names.
Order of checks: headers present, headers well formed, signature, then timestamp window; so
``stale_timestamp`` / ``future_timestamp`` mean "genuinely signed, outside the window" (a replay
or a skewed clock), while forgeries land in ``bad_signature``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Mapping, Sequence

from aivedio.providers.port import ImmediateVerifier, Reason, VerificationError, Verified

__all__ = ["CallbackTokenVerifier", "StandardWebhooksVerifier", "mint_callback_token"]

DEFAULT_TOLERANCE_S = 300

_TIMESTAMP = re.compile(r"[0-9]{1,12}")
_B64URL = re.compile(r"[A-Za-z0-9_-]*")
_MAX_ID_CHARS = 255
_MAX_SIGNATURES = 16
_SHA256_BYTES = 32
_SHA256_BLOCK = 64


# --- Checks shared by the verifiers (also used by aivedio.providers.jwks) ------------------------


def require_headers(headers: Mapping[str, str], *names: str) -> list[str]:
    values = [headers.get(name) or "" for name in names]
    if not all(values):
        raise VerificationError(Reason.MISSING_HEADERS)
    return values


def check_id(value: str) -> None:
    """An id that is signed as text: printable ASCII, bounded, so its bytes are unambiguous."""
    if len(value) > _MAX_ID_CHARS or not (value.isascii() and value.isprintable()):
        raise VerificationError(Reason.MALFORMED_HEADER)


def parse_timestamp(value: str) -> int:
    # 1 to 12 ASCII digits (isascii: str.isdigit alone also takes other scripts' digits)
    if not (0 < len(value) <= 12 and value.isascii() and value.isdigit()):
        raise VerificationError(Reason.MALFORMED_HEADER)
    return int(value)


def check_window(timestamp: int, now: float, tolerance_s: float) -> None:
    if timestamp < now - tolerance_s:
        raise VerificationError(Reason.STALE_TIMESTAMP)
    if timestamp > now + tolerance_s:
        raise VerificationError(Reason.FUTURE_TIMESTAMP)


def check_tolerance(tolerance_s: float) -> float:
    if tolerance_s <= 0:
        raise ValueError("tolerance_s must be positive")
    return tolerance_s


def b64url_decode(value: str) -> bytes:
    """Strict base64url (RFC 7515 §2): padding optional, any byte outside the alphabet refused."""
    stripped = value.rstrip("=")
    if not _B64URL.fullmatch(stripped):
        raise ValueError("not base64url")
    try:
        return base64.urlsafe_b64decode(stripped + "=" * (-len(stripped) % 4))
    except binascii.Error as exc:
        raise ValueError("not base64url") from exc


# --- Standard Webhooks v1 (HMAC-SHA256) ----------------------------------------------------------


def decode_whsec(secret: str) -> bytes:
    """The HMAC key of a Standard Webhooks secret: base64 after an optional ``whsec_`` prefix."""
    encoded = secret.removeprefix("whsec_")
    try:
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("webhook secret is not base64 after the whsec_ prefix") from None
    if not key:
        raise ValueError("webhook secret is empty")
    return key


def _v1_signatures(header: str) -> list[bytes]:
    """The decoded ``v1`` signatures of a ``webhook-signature`` header.

    Entries of other schemes (``v1a``, future versions) are ignored, as the spec asks. A ``v1``
    entry that is not base64 of 32 bytes is skipped; if nothing usable is left the header is
    malformed, or of an unsupported scheme when it held no ``v1`` entry at all.
    """
    entries = header.split()
    if not entries or len(entries) > _MAX_SIGNATURES:
        raise VerificationError(Reason.MALFORMED_HEADER)
    saw_v1 = saw_well_formed = False
    signatures: list[bytes] = []
    for entry in entries:
        scheme, comma, value = entry.partition(",")
        if not comma or not scheme or not value:
            continue
        saw_well_formed = True
        if scheme != "v1":
            continue
        saw_v1 = True
        try:
            # strict: only the base64 alphabet, padding only at the end (C, no regex)
            raw = binascii.a2b_base64(value, strict_mode=True)
        except (binascii.Error, ValueError):
            continue
        if len(raw) == _SHA256_BYTES:
            signatures.append(raw)
    if signatures:
        return signatures
    if saw_well_formed and not saw_v1:
        raise VerificationError(Reason.UNSUPPORTED_SCHEME)
    raise VerificationError(Reason.MALFORMED_HEADER)


class _HmacSha256:
    """HMAC-SHA256 under one key (RFC 2104) with the padded key's hash states computed once:
    each message then costs two hash copies, not a key setup (OpenSSL 3's one-shot HMAC looks
    the algorithm up on every call, ~3x slower for a webhook-sized body)."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes) -> None:
        if len(key) > _SHA256_BLOCK:
            key = hashlib.sha256(key).digest()
        key = key.ljust(_SHA256_BLOCK, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))

    def digest(self, message: bytes) -> bytes:
        inner = self._inner.copy()
        inner.update(message)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()


class StandardWebhooksVerifier(ImmediateVerifier):
    """Standard Webhooks v1: ``webhook-id``, ``webhook-timestamp``, ``webhook-signature``.

    The signed content is ``{id}.{timestamp}.{body}`` (body as raw bytes), the signature
    ``base64(HMAC-SHA256(key, content))`` where ``key`` is the base64-decoded ``whsec_`` secret.
    ``secrets`` are ``(version, secret)`` pairs, all accepted at once during a rotation; the
    version that matched is returned as ``key_version``. Every comparison is constant time.
    """

    ID_HEADER = "webhook-id"
    TIMESTAMP_HEADER = "webhook-timestamp"
    SIGNATURE_HEADER = "webhook-signature"

    def __init__(
        self, secrets: Sequence[tuple[str, str]], tolerance_s: float = DEFAULT_TOLERANCE_S
    ) -> None:
        if not secrets:
            raise ValueError("at least one webhook secret is required")
        versions = [version for version, _ in secrets]
        if len(set(versions)) != len(versions) or not all(versions):
            raise ValueError("secret versions must be non-empty and unique")
        self._keys: tuple[tuple[str, _HmacSha256], ...] = tuple(
            (version, _HmacSha256(decode_whsec(secret))) for version, secret in secrets
        )
        self._tolerance_s = check_tolerance(tolerance_s)

    def verify_now(
        self,
        headers: Mapping[str, str],
        body: bytes,
        now: float,
        *,
        callback_token: str | None = None,
    ) -> Verified:
        msg_id, raw_timestamp, header = require_headers(
            headers, self.ID_HEADER, self.TIMESTAMP_HEADER, self.SIGNATURE_HEADER
        )
        check_id(msg_id)
        timestamp = parse_timestamp(raw_timestamp)
        signatures = _v1_signatures(header)
        content = b"%s.%s.%s" % (msg_id.encode("ascii"), raw_timestamp.encode("ascii"), body)
        matched: str | None = None
        for version, key in self._keys:
            expected = key.digest(content)
            for signature in signatures:
                if hmac.compare_digest(expected, signature) and matched is None:
                    matched = version
        if matched is None:
            raise VerificationError(Reason.BAD_SIGNATURE)
        check_window(timestamp, now, self._tolerance_s)
        return Verified(key_version=matched, event_id=msg_id, timestamp=timestamp)


# --- Callback tokens for unsigned providers ------------------------------------------------------

_TOKEN_CONTEXT = b"aivedio.callback-token.v1\x00"
_MIN_TOKEN_SECRET_BYTES = 16
_MAX_ATTEMPT_ID_CHARS = 200
_MAX_TOKEN_CHARS = 512


def _token_tag(secret: bytes, attempt_id: bytes) -> bytes:
    return hmac.new(secret, _TOKEN_CONTEXT + attempt_id, hashlib.sha256).digest()


def _b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def mint_callback_token(secret: bytes, attempt_id: str) -> str:
    """An unguessable, URL-safe token naming ``attempt_id``: ``b64url(attempt_id).b64url(tag)``.

    ``tag`` is the full 256-bit HMAC-SHA256 of the attempt id under ``secret`` (domain-separated),
    so a token cannot be forged or moved to another attempt without the secret. The token carries
    the attempt id in the clear: it authenticates, it does not hide.
    """
    if len(secret) < _MIN_TOKEN_SECRET_BYTES:
        raise ValueError(f"callback token secret must be at least {_MIN_TOKEN_SECRET_BYTES} bytes")
    if not attempt_id or len(attempt_id) > _MAX_ATTEMPT_ID_CHARS:
        raise ValueError("attempt_id must be 1..200 characters")
    raw_id = attempt_id.encode("utf-8")
    return f"{_b64url(raw_id)}.{_b64url(_token_tag(secret, raw_id))}"


class CallbackTokenVerifier(ImmediateVerifier):
    """For providers that sign nothing (Luma / Kling style): the callback URL carries a token.

    The submitter puts ``mint_callback_token(secret, attempt_id)`` in the ``webhook_url`` it hands
    the provider (``?token=`` or a path segment); the gateway passes it as ``callback_token``.
    ``secrets`` are ``(version, secret)`` pairs; during a rotation tokens minted under any of them
    verify, and the matched version is returned. Verification is constant time per secret.

    The token proves only that the caller knows a URL we gave to the provider, not what the body
    says: the result has ``payload_authenticated=False`` and the processor must re-fetch the job
    from the provider before it changes any state. Headers and body are not inspected.
    """

    def __init__(self, secrets: Sequence[tuple[str, bytes]]) -> None:
        if not secrets:
            raise ValueError("at least one callback token secret is required")
        versions = [version for version, _ in secrets]
        if len(set(versions)) != len(versions) or not all(versions):
            raise ValueError("secret versions must be non-empty and unique")
        if any(len(secret) < _MIN_TOKEN_SECRET_BYTES for _, secret in secrets):
            raise ValueError(f"callback token secrets must be >= {_MIN_TOKEN_SECRET_BYTES} bytes")
        self._secrets = tuple(secrets)

    def authenticate(self, token: str | None) -> tuple[str, str]:
        """``(attempt_id, key_version)`` of a token we minted, else :class:`VerificationError`."""
        if not token:
            raise VerificationError(Reason.MISSING_TOKEN)
        encoded_id, dot, encoded_tag = token.partition(".")
        if len(token) > _MAX_TOKEN_CHARS or not dot or not encoded_id or not encoded_tag:
            raise VerificationError(Reason.BAD_TOKEN)
        try:
            raw_id = b64url_decode(encoded_id)
            tag = b64url_decode(encoded_tag)
            attempt_id = raw_id.decode("utf-8")
        except ValueError:  # UnicodeDecodeError is a ValueError
            raise VerificationError(Reason.BAD_TOKEN) from None
        matched: str | None = None
        for version, secret in self._secrets:
            if hmac.compare_digest(_token_tag(secret, raw_id), tag) and matched is None:
                matched = version
        if matched is None or not attempt_id:
            raise VerificationError(Reason.BAD_TOKEN)
        return attempt_id, matched

    def verify_now(
        self,
        headers: Mapping[str, str],
        body: bytes,
        now: float,
        *,
        callback_token: str | None = None,
    ) -> Verified:
        attempt_id, version = self.authenticate(callback_token)
        return Verified(
            key_version=version,
            event_id=None,
            timestamp=None,
            attempt_id=attempt_id,
            payload_authenticated=False,
        )
