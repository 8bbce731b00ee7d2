"""ED25519 webhook signatures with keys from a JWKS document (fal style).

:class:`JwksCache` holds the keys: parsed strictly, cached with a TTL, refetched at a bounded rate.
:class:`FalEd25519Verifier` checks fal's signature with them. Neither reads the clock: every call
carries ``now`` (Unix seconds). The document arrives through an injected ``Fetcher``;
:func:`httpx_fetcher` is the production one.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import MappingProxyType

import httpx
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from aivedio.errors import AivedioError
from aivedio.providers.port import Reason, VerificationError, Verified
from aivedio.providers.verify import (
    DEFAULT_TOLERANCE_S,
    b64url_decode,
    check_id,
    check_tolerance,
    check_window,
    parse_timestamp,
    require_headers,
)

__all__ = ["FalEd25519Verifier", "Fetcher", "JwksCache", "JwksError", "httpx_fetcher", "parse_jwks"]

Fetcher = Callable[[], Awaitable[bytes]]
"""Returns the raw JWKS document; raises on any transport or HTTP failure."""

_HEX_SIGNATURE = re.compile(r"[0-9a-fA-F]{128}")
_ED25519_KEY_BYTES = 32
_EMPTY: Mapping[str, Ed25519PublicKey] = MappingProxyType({})


class JwksError(AivedioError):
    """The JWKS document could not be fetched, or holds no usable Ed25519 key."""


def _thumbprint(x: str) -> str:
    """RFC 7638 thumbprint of an OKP key: the id of a key published without ``kid``."""
    canonical = json.dumps({"crv": "Ed25519", "kty": "OKP", "x": x}, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _parse_key(entry: object) -> tuple[str, Ed25519PublicKey] | None:
    """One JWK, or None when it is not an Ed25519 signing key (skipped, not an error)."""
    if not isinstance(entry, dict):
        return None
    x = entry.get("x")
    if entry.get("kty") != "OKP" or entry.get("crv") != "Ed25519" or not isinstance(x, str):
        return None
    if entry.get("use", "sig") != "sig" or entry.get("alg", "EdDSA") not in ("EdDSA", "Ed25519"):
        return None
    try:
        raw = b64url_decode(x)
        if len(raw) != _ED25519_KEY_BYTES:
            return None
        key = Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        return None
    kid = entry.get("kid")
    return (kid if isinstance(kid, str) and kid else _thumbprint(x)), key


def parse_jwks(document: bytes) -> dict[str, Ed25519PublicKey]:
    """Keys by id (``kid``, else the RFC 7638 thumbprint) from a JWKS document.

    Keys of other types are skipped; a document without a single usable Ed25519 key is an error,
    so a broken or hostile response never replaces a working key set with an empty one.
    """
    try:
        parsed = json.loads(document)
    except (ValueError, UnicodeDecodeError) as exc:
        raise JwksError("JWKS document is not JSON") from exc
    entries = parsed.get("keys") if isinstance(parsed, dict) else None
    if not isinstance(entries, list):
        raise JwksError("JWKS document has no 'keys' list")
    keys: dict[str, Ed25519PublicKey] = {}
    for entry in entries:
        parsed_key = _parse_key(entry)
        if parsed_key is not None:
            keys.setdefault(*parsed_key)
    if not keys:
        raise JwksError("JWKS document holds no usable Ed25519 key")
    return keys


class JwksCache:
    """Ed25519 keys by id, fetched lazily, kept for ``ttl_s``, refetched at most once per
    ``min_refresh_interval_s`` whatever the cause (expiry, unknown key id, no key matched).

    The rate limit is what keeps a flood of forged callbacks from turning into a flood of JWKS
    requests: a forged signature looks exactly like a signature by a key published a moment ago.
    Concurrent callers share one fetch (single flight). A failed fetch keeps the keys already held
    (serving stale keys beats rejecting genuine callbacks) and counts as an attempt.
    """

    def __init__(
        self,
        fetcher: Fetcher,
        *,
        ttl_s: float = 3600.0,
        min_refresh_interval_s: float = 30.0,
    ) -> None:
        if ttl_s <= 0 or min_refresh_interval_s < 0:
            raise ValueError("ttl_s must be > 0 and min_refresh_interval_s >= 0")
        self._fetcher = fetcher
        self._ttl_s = ttl_s
        self._min_interval_s = min_refresh_interval_s
        self._keys = _EMPTY
        self._fetched_at: float | None = None
        self._attempted_at: float | None = None
        self._generation = 0
        self._lock = asyncio.Lock()
        self.fetches = 0
        """Fetch attempts made (successful or not); for metrics and tests."""
        self.last_error: str | None = None
        """Class name of the last fetch failure, None after a success; for logs."""

    @property
    def generation(self) -> int:
        """Increases by one each time a fetch replaces the key set."""
        return self._generation

    @property
    def cached_keys(self) -> Mapping[str, Ed25519PublicKey]:
        """The keys held now, without fetching."""
        return self._keys

    async def keys(self, now: float) -> Mapping[str, Ed25519PublicKey]:
        """The current keys, fetched first when none are held or they are older than the TTL.

        Raises :class:`JwksError` only when no key is held at all and none could be fetched.
        """
        if self._fetched_at is None or not 0 <= now - self._fetched_at < self._ttl_s:
            await self._fetch(now, self._generation)
        if not self._keys:
            raise JwksError(self.last_error or "no JWKS key available")
        return self._keys

    async def refresh(self, now: float, seen_generation: int) -> bool:
        """Refetch because a signature matched no key of generation ``seen_generation``.

        True when the keys held are newer than that generation (fetched by this call or by a
        concurrent one); False when the rate limit refused the fetch or the fetch failed.
        """
        return await self._fetch(now, seen_generation)

    async def _fetch(self, now: float, seen_generation: int) -> bool:
        async with self._lock:
            if self._generation != seen_generation:
                return True
            if self._attempted_at is not None and 0 <= now - self._attempted_at < (
                self._min_interval_s
            ):
                return False
            self._attempted_at = now
            self.fetches += 1
            try:
                keys = parse_jwks(await self._fetcher())
            except Exception as exc:  # any fetcher failure is "no new keys", never a crash
                self.last_error = type(exc).__name__
                return False
            self.last_error = None
            self._keys = MappingProxyType(keys)
            self._fetched_at = now
            self._generation += 1
            return True


def httpx_fetcher(
    url: str,
    timeout: float = 5.0,
    *,
    max_bytes: int = 1 << 20,
    client: httpx.AsyncClient | None = None,
) -> Fetcher:
    """A :data:`Fetcher` that GETs ``url`` with httpx: 200 only, body capped at ``max_bytes``.

    Pass ``client`` to share a connection pool (or a mock transport in tests); otherwise each
    fetch opens and closes its own client, which is fine at the rate :class:`JwksCache` allows.
    """

    async def fetch_with(http: httpx.AsyncClient) -> bytes:
        async with http.stream("GET", url, timeout=timeout) as response:
            if response.status_code != httpx.codes.OK:
                raise JwksError(f"JWKS endpoint answered HTTP {response.status_code}")
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    raise JwksError("JWKS document exceeds the size limit")
                chunks.append(chunk)
            return b"".join(chunks)

    async def fetch() -> bytes:
        if client is not None:
            return await fetch_with(client)
        async with httpx.AsyncClient(follow_redirects=False) as http:
            return await fetch_with(http)

    return fetch


def _ed25519_ok(key: Ed25519PublicKey, signature: bytes, message: bytes) -> bool:
    try:
        key.verify(signature, message)
    except InvalidSignature:
        return False
    return True


def _first_match(
    keys: Mapping[str, Ed25519PublicKey], signature: bytes, message: bytes
) -> str | None:
    return next((kid for kid, key in keys.items() if _ed25519_ok(key, signature, message)), None)


class FalEd25519Verifier:
    """fal's webhook signature: ED25519 over ``request_id\\nuser_id\\ntimestamp\\nsha256hex(body)``.

    Headers (as fal integrations use them; see docs/reference/webhook-verification.md):
    ``x-fal-webhook-request-id``, ``x-fal-webhook-user-id``, ``x-fal-webhook-timestamp``,
    ``x-fal-webhook-signature`` (hex of the 64-byte signature). fal names no key in the request,
    so every published key is tried; a ``key_id_header`` can be configured for a dialect that does
    name one. When no held key matches, the JWKS is refetched once (rate-limited by the cache) and
    the new keys are tried.

    fal signs every account's webhooks with the same keys, so a valid signature only proves the
    callback came from fal: pass ``expected_user_ids`` to also require that it is about our account.
    """

    REQUEST_ID_HEADER = "x-fal-webhook-request-id"
    USER_ID_HEADER = "x-fal-webhook-user-id"
    TIMESTAMP_HEADER = "x-fal-webhook-timestamp"
    SIGNATURE_HEADER = "x-fal-webhook-signature"

    def __init__(
        self,
        jwks: JwksCache,
        tolerance_s: float = DEFAULT_TOLERANCE_S,
        *,
        key_id_header: str | None = None,
        expected_user_ids: Sequence[str] | None = None,
    ) -> None:
        self._jwks = jwks
        self._tolerance_s = check_tolerance(tolerance_s)
        self._key_id_header = key_id_header.lower() if key_id_header else None
        self._user_ids = frozenset(expected_user_ids) if expected_user_ids is not None else None

    async def verify(
        self,
        headers: Mapping[str, str],
        body: bytes,
        now: float,
        *,
        callback_token: str | None = None,
    ) -> Verified:
        request_id, user_id, raw_timestamp, signature_hex = require_headers(
            headers,
            self.REQUEST_ID_HEADER,
            self.USER_ID_HEADER,
            self.TIMESTAMP_HEADER,
            self.SIGNATURE_HEADER,
        )
        check_id(request_id)
        check_id(user_id)
        timestamp = parse_timestamp(raw_timestamp)
        if not _HEX_SIGNATURE.fullmatch(signature_hex):
            raise VerificationError(Reason.MALFORMED_HEADER)
        signature = bytes.fromhex(signature_hex)
        kid = (headers.get(self._key_id_header) if self._key_id_header else None) or None
        if kid is not None:
            check_id(kid)
        message = "\n".join(
            (request_id, user_id, raw_timestamp, hashlib.sha256(body).hexdigest())
        ).encode("ascii")
        matched = await self._match(kid, signature, message, now)
        check_window(timestamp, now, self._tolerance_s)
        if self._user_ids is not None and user_id not in self._user_ids:
            raise VerificationError(Reason.UNEXPECTED_ACCOUNT)
        return Verified(key_version=matched, event_id=None, timestamp=timestamp)

    async def _match(self, kid: str | None, signature: bytes, message: bytes, now: float) -> str:
        try:
            keys = await self._jwks.keys(now)
        except JwksError:
            raise VerificationError(Reason.KEYS_UNAVAILABLE) from None
        generation = self._jwks.generation
        if kid is not None:
            key = keys.get(kid)
            if key is None and await self._jwks.refresh(now, generation):
                key = self._jwks.cached_keys.get(kid)
            if key is None:
                raise VerificationError(Reason.UNKNOWN_KEY)
            if not _ed25519_ok(key, signature, message):
                raise VerificationError(Reason.BAD_SIGNATURE)
            return kid
        matched = _first_match(keys, signature, message)
        if matched is None and await self._jwks.refresh(now, generation):
            tried = {key.public_bytes_raw() for key in keys.values()}
            fresh = self._jwks.cached_keys
            untried = {k: v for k, v in fresh.items() if v.public_bytes_raw() not in tried}
            matched = _first_match(untried, signature, message)
        if matched is None:
            raise VerificationError(Reason.BAD_SIGNATURE)
        return matched
