"""Callback verification: Standard Webhooks (spec vector + the independent signer), fal-style
ED25519 with a JWKS cache, callback tokens, and fuzzing of everything a caller controls."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
import standardwebhooks
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aivedio.providers.jwks import (
    FalEd25519Verifier,
    JwksCache,
    JwksError,
    httpx_fetcher,
    parse_jwks,
)
from aivedio.providers.port import Reason, VerificationError, Verified, Verifier
from aivedio.providers.verify import (
    CallbackTokenVerifier,
    StandardWebhooksVerifier,
    mint_callback_token,
)

T0 = 1_700_000_000


def new_whsec() -> str:
    return "whsec_" + base64.b64encode(os.urandom(24)).decode()


def b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


async def rejected(verifier: Verifier, headers: Mapping[str, str], body: bytes, now: float,
                   *, callback_token: str | None = None) -> Reason:  # fmt: skip
    with pytest.raises(VerificationError) as caught:
        await verifier.verify(headers, body, now, callback_token=callback_token)
    error = caught.value
    assert str(error) == error.reason.value  # nothing but the code ever reaches a message
    verify_now = getattr(verifier, "verify_now", None)
    if verify_now is not None:  # the plain call refuses alike (the lean path uses it)
        with pytest.raises(VerificationError) as caught_now:
            verify_now(headers, body, now, callback_token=callback_token)
        assert caught_now.value.reason is error.reason
    return error.reason


# --- Standard Webhooks -------------------------------------------------------------------------

SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SPEC_TS = 1614265330
SPEC_BODY = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def sw_headers(msg_id: str, timestamp: int | str, signature: str) -> dict[str, str]:
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature,
    }


def sw_sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """Signed by the independent reference implementation, not by our code."""
    when = datetime.fromtimestamp(timestamp, UTC)
    return str(standardwebhooks.Webhook(secret).sign(msg_id, when, body.decode()))


async def test_standard_webhooks_spec_vector() -> None:
    verifier = StandardWebhooksVerifier([("spec", SPEC_SECRET)])
    headers = sw_headers(SPEC_ID, SPEC_TS, SPEC_SIGNATURE)
    result = await verifier.verify(headers, SPEC_BODY, SPEC_TS)
    assert verifier.verify_now(headers, SPEC_BODY, SPEC_TS) == result
    assert result == Verified(key_version="spec", event_id=SPEC_ID, timestamp=SPEC_TS)
    assert result.payload_authenticated


async def test_signed_by_the_reference_library_verifies() -> None:
    secret, body = new_whsec(), b'{"type": "generation.updated", "data": {"id": "g1"}}'
    headers = sw_headers("msg_1", T0, sw_sign(secret, "msg_1", T0, body))
    result = await StandardWebhooksVerifier([("k1", secret)]).verify(headers, body, T0 + 12.5)
    assert (result.key_version, result.event_id, result.timestamp) == ("k1", "msg_1", T0)


async def test_non_utf8_body_is_signed_as_raw_bytes() -> None:
    secret, body = new_whsec(), b"\xff\xfe not utf-8"
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, b"msg_2.%d.%s" % (T0, body), hashlib.sha256).digest()
    headers = sw_headers("msg_2", T0, "v1," + base64.b64encode(mac).decode())
    assert (await StandardWebhooksVerifier([("k", secret)]).verify(headers, body, T0)).key_version


class TestRotation:
    OLD, NEW = new_whsec(), new_whsec()
    BODY = b'{"n": 1}'

    def verifier(self) -> StandardWebhooksVerifier:
        return StandardWebhooksVerifier([("2025-06", self.NEW), ("2024-01", self.OLD)])

    def signature(self, secret: str) -> str:
        return sw_sign(secret, "msg_r", T0, self.BODY)

    async def test_header_with_both_signatures_reports_the_first_listed_secret(self) -> None:
        both = f"{self.signature(self.OLD)} {self.signature(self.NEW)}"
        result = await self.verifier().verify(sw_headers("msg_r", T0, both), self.BODY, T0)
        assert result.key_version == "2025-06"

    @pytest.mark.parametrize(("which", "version"), [("OLD", "2024-01"), ("NEW", "2025-06")])
    async def test_a_single_signature_reports_its_version(self, which: str, version: str) -> None:
        headers = sw_headers("msg_r", T0, self.signature(getattr(self, which)))
        assert (await self.verifier().verify(headers, self.BODY, T0)).key_version == version

    async def test_retired_secret_no_longer_verifies(self) -> None:
        verifier = StandardWebhooksVerifier([("2025-06", self.NEW)])
        headers = sw_headers("msg_r", T0, self.signature(self.OLD))
        assert await rejected(verifier, headers, self.BODY, T0) == Reason.BAD_SIGNATURE


class TestStandardWebhooksRejections:
    SECRET = new_whsec()
    BODY = b'{"status": "succeeded"}'

    def verifier(self) -> StandardWebhooksVerifier:
        return StandardWebhooksVerifier([("k", self.SECRET)])

    def good(self, timestamp: int = T0) -> dict[str, str]:
        return sw_headers("msg_x", timestamp, sw_sign(self.SECRET, "msg_x", timestamp, self.BODY))

    async def test_tampered_body(self) -> None:
        reason = await rejected(self.verifier(), self.good(), b'{"status": "failed"}', T0)
        assert reason == Reason.BAD_SIGNATURE

    async def test_tampered_id(self) -> None:
        headers = {**self.good(), "webhook-id": "msg_y"}
        assert await rejected(self.verifier(), headers, self.BODY, T0) == Reason.BAD_SIGNATURE

    async def test_tampered_timestamp(self) -> None:
        headers = {**self.good(), "webhook-timestamp": str(T0 + 1)}
        assert await rejected(self.verifier(), headers, self.BODY, T0) == Reason.BAD_SIGNATURE

    async def test_timestamp_window_is_inclusive_at_five_minutes(self) -> None:
        for now in (T0 - 300, T0 + 300):
            assert (await self.verifier().verify(self.good(), self.BODY, now)).timestamp == T0

    async def test_stale(self) -> None:
        assert await rejected(self.verifier(), self.good(), self.BODY, T0 + 301) == (
            Reason.STALE_TIMESTAMP
        )

    async def test_future(self) -> None:
        assert await rejected(self.verifier(), self.good(), self.BODY, T0 - 301) == (
            Reason.FUTURE_TIMESTAMP
        )

    async def test_custom_tolerance(self) -> None:
        verifier = StandardWebhooksVerifier([("k", self.SECRET)], tolerance_s=10)
        assert await rejected(verifier, self.good(), self.BODY, T0 + 11) == Reason.STALE_TIMESTAMP

    async def test_forged_and_stale_is_a_bad_signature(self) -> None:
        headers = {**self.good(), "webhook-signature": "v1," + base64.b64encode(b"x" * 32).decode()}
        assert await rejected(self.verifier(), headers, self.BODY, T0 + 9999) == (
            Reason.BAD_SIGNATURE
        )

    @pytest.mark.parametrize("name", ["webhook-id", "webhook-timestamp", "webhook-signature"])
    @pytest.mark.parametrize("drop", [True, False])
    async def test_missing_headers(self, name: str, drop: bool) -> None:
        headers = self.good()
        if drop:
            del headers[name]
        else:
            headers[name] = ""
        assert await rejected(self.verifier(), headers, self.BODY, T0) == Reason.MISSING_HEADERS

    @pytest.mark.parametrize(
        ("name", "value"),
        [
            ("webhook-timestamp", "abc"),
            ("webhook-timestamp", "-1700000000"),
            ("webhook-timestamp", "1700000000.5"),
            ("webhook-timestamp", " 1700000000"),
            (
                "webhook-timestamp",
                "１７００００００００",
            ),  # fullwidth digits: int() would take them
            ("webhook-timestamp", "9" * 13),
            ("webhook-signature", "garbage"),
            ("webhook-signature", "v1,!!!not-base64!!!"),
            ("webhook-signature", "v1," + base64.b64encode(b"short").decode()),
            ("webhook-signature", ","),
            ("webhook-signature", " ".join(["v1,AAAA"] * 17)),
            ("webhook-id", "msg\nsplit"),
            ("webhook-id", "msg_é"),
            ("webhook-id", "m" * 256),
        ],
    )
    async def test_malformed_header(self, name: str, value: str) -> None:
        headers = {**self.good(), name: value}
        assert await rejected(self.verifier(), headers, self.BODY, T0) == Reason.MALFORMED_HEADER

    async def test_only_other_schemes_is_unsupported(self) -> None:
        good = self.good()["webhook-signature"].removeprefix("v1,")
        headers = {**self.good(), "webhook-signature": f"v1a,{good} v2,{good}"}
        assert await rejected(self.verifier(), headers, self.BODY, T0) == (
            Reason.UNSUPPORTED_SCHEME
        )

    async def test_other_schemes_beside_v1_are_ignored(self) -> None:
        good = self.good()["webhook-signature"]
        headers = {**self.good(), "webhook-signature": f"v1a,AAAA  v1,AAAA {good} junk"}
        assert (await self.verifier().verify(headers, self.BODY, T0)).key_version == "k"

    async def test_comparison_is_constant_time(self, monkeypatch: pytest.MonkeyPatch) -> None:
        calls: list[tuple[bytes, bytes]] = []
        real = hmac.compare_digest

        def spy(a: bytes, b: bytes) -> bool:
            calls.append((a, b))
            return real(a, b)

        monkeypatch.setattr(hmac, "compare_digest", spy)
        await self.verifier().verify(self.good(), self.BODY, T0)
        await rejected(self.verifier(), self.good(), b"tampered", T0)  # verify and verify_now
        assert len(calls) == 3

    def test_bad_configuration_is_refused_without_echoing_the_secret(self) -> None:
        with pytest.raises(ValueError, match="at least one"):
            StandardWebhooksVerifier([])
        with pytest.raises(ValueError, match="unique"):
            StandardWebhooksVerifier([("a", self.SECRET), ("a", new_whsec())])
        with pytest.raises(ValueError, match="base64") as caught:
            StandardWebhooksVerifier([("a", "whsec_not*base64*secret")])
        assert "not*base64" not in str(caught.value)
        with pytest.raises(ValueError, match="positive"):
            StandardWebhooksVerifier([("a", self.SECRET)], tolerance_s=0)


# --- fal-style ED25519 + JWKS ------------------------------------------------------------------


def jwk(kid: str | None, key: Ed25519PrivateKey) -> dict[str, str]:
    entry = {"kty": "OKP", "crv": "Ed25519", "x": b64url(key.public_key().public_bytes_raw())}
    if kid is not None:
        entry["kid"] = kid
    return entry


def jwks_document(*entries: Mapping[str, Any]) -> bytes:
    return json.dumps({"keys": list(entries)}).encode()


class Fetcher:
    """An injected JWKS fetcher that counts its calls and can be switched to fail or stall."""

    def __init__(self, document: bytes) -> None:
        self.document = document
        self.calls = 0
        self.fail = False
        self.delay = 0.0

    async def __call__(self) -> bytes:
        self.calls += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail:
            raise httpx.ConnectError("jwks endpoint down")
        return self.document


def fal_headers(key: Ed25519PrivateKey, body: bytes, timestamp: int = T0, *,
                request_id: str = "req-1", user_id: str = "user-1") -> dict[str, str]:  # fmt: skip
    message = f"{request_id}\n{user_id}\n{timestamp}\n{hashlib.sha256(body).hexdigest()}"
    return {
        "x-fal-webhook-request-id": request_id,
        "x-fal-webhook-user-id": user_id,
        "x-fal-webhook-timestamp": str(timestamp),
        "x-fal-webhook-signature": key.sign(message.encode()).hex(),
    }


K1, K2, K3 = (Ed25519PrivateKey.generate() for _ in range(3))
FAL_BODY = b'{"request_id": "req-1", "status": "OK", "payload": {}}'


def fal_setup(*entries: Mapping[str, Any], min_interval: float = 30.0, **kwargs: Any) -> tuple[
    FalEd25519Verifier, Fetcher, JwksCache
]:  # fmt: skip
    fetcher = Fetcher(jwks_document(*(entries or (jwk("k1", K1),))))
    cache = JwksCache(fetcher, ttl_s=3600, min_refresh_interval_s=min_interval)
    return FalEd25519Verifier(cache, **kwargs), fetcher, cache


async def test_fal_valid_signature_and_cached_keys() -> None:
    verifier, fetcher, _ = fal_setup(jwk("k0", K3), jwk("k1", K1))
    for now in (T0, T0 + 1, T0 + 100):
        result = await verifier.verify(fal_headers(K1, FAL_BODY), FAL_BODY, now)
        assert result == Verified(key_version="k1", event_id=None, timestamp=T0)
    assert fetcher.calls == 1


async def test_fal_tampered_body_is_a_bad_signature_and_refetches_nothing_yet() -> None:
    verifier, fetcher, _ = fal_setup()
    headers = fal_headers(K1, FAL_BODY)
    assert await rejected(verifier, headers, b'{"status": "ERROR"}', T0) == Reason.BAD_SIGNATURE
    assert fetcher.calls == 1  # the miss asked for a refresh; the rate limit refused it


@pytest.mark.parametrize(
    "header", ["x-fal-webhook-request-id", "x-fal-webhook-user-id", "x-fal-webhook-timestamp"]
)
async def test_fal_tampered_signed_header(header: str) -> None:
    verifier, _, _ = fal_setup()
    headers = fal_headers(K1, FAL_BODY)
    headers[header] = headers[header][:-1] + ("9" if headers[header][-1] != "9" else "8")
    assert await rejected(verifier, headers, FAL_BODY, T0) == Reason.BAD_SIGNATURE


async def test_fal_unknown_key_refreshes_once_then_verifies_after_rotation() -> None:
    verifier, fetcher, cache = fal_setup(jwk("k1", K1), min_interval=30)
    assert (await verifier.verify(fal_headers(K1, FAL_BODY), FAL_BODY, T0)).key_version == "k1"
    fetcher.document = jwks_document(jwk("k2", K2))  # the provider rotates its key
    later = T0 + 60
    result = await verifier.verify(fal_headers(K2, FAL_BODY, later), FAL_BODY, later)
    assert result.key_version == "k2"
    assert (fetcher.calls, cache.generation) == (2, 2)


async def test_fal_refresh_rate_limit_bounds_fetches_under_a_forgery_flood() -> None:
    verifier, fetcher, _ = fal_setup(min_interval=30)
    await verifier.verify(fal_headers(K1, FAL_BODY), FAL_BODY, T0)
    forged = fal_headers(K3, FAL_BODY)  # signed by a key nobody published
    for i in range(200):  # 100 seconds of forgeries, two per second
        assert await rejected(verifier, forged, FAL_BODY, T0 + i * 0.5) == Reason.BAD_SIGNATURE
    assert fetcher.calls == 1 + 3  # the first fetch, then one at +30, +60, +90


async def test_fal_concurrent_misses_share_one_fetch() -> None:
    verifier, fetcher, _ = fal_setup(min_interval=30)
    await verifier.verify(fal_headers(K1, FAL_BODY), FAL_BODY, T0)
    fetcher.delay = 0.01
    forged = fal_headers(K3, FAL_BODY, T0 + 40)
    reasons = await asyncio.gather(
        *(rejected(verifier, forged, FAL_BODY, T0 + 40) for _ in range(50))
    )
    assert set(reasons) == {Reason.BAD_SIGNATURE}
    assert fetcher.calls == 2


async def test_fal_key_id_header_unknown_key() -> None:
    verifier, fetcher, _ = fal_setup(key_id_header="X-Key-Id", min_interval=30)
    headers = {**fal_headers(K2, FAL_BODY), "x-key-id": "k2"}
    assert await rejected(verifier, headers, FAL_BODY, T0) == Reason.UNKNOWN_KEY
    assert fetcher.calls == 1  # refresh refused: the first fetch was this very second
    fetcher.document = jwks_document(jwk("k1", K1), jwk("k2", K2))
    later = T0 + 31
    headers = {**fal_headers(K2, FAL_BODY, later), "x-key-id": "k2"}
    assert (await verifier.verify(headers, FAL_BODY, later)).key_version == "k2"
    assert fetcher.calls == 2
    wrong_key = {**fal_headers(K1, FAL_BODY, later), "x-key-id": "k2"}
    assert await rejected(verifier, wrong_key, FAL_BODY, later) == Reason.BAD_SIGNATURE


@pytest.mark.parametrize(
    "signature",
    ["zz" * 64, "ab" * 63, "ab" * 65, "ab" * 63 + " a", "0x" + "ab" * 63, "ａｂ" * 64],
)
async def test_fal_bad_hex_is_malformed(signature: str) -> None:
    verifier, _, _ = fal_setup()
    headers = {**fal_headers(K1, FAL_BODY), "x-fal-webhook-signature": signature}
    assert await rejected(verifier, headers, FAL_BODY, T0) == Reason.MALFORMED_HEADER


async def test_fal_uppercase_hex_is_accepted() -> None:
    verifier, _, _ = fal_setup()
    headers = fal_headers(K1, FAL_BODY)
    headers["x-fal-webhook-signature"] = headers["x-fal-webhook-signature"].upper()
    assert (await verifier.verify(headers, FAL_BODY, T0)).key_version == "k1"


@pytest.mark.parametrize(
    "name",
    [
        "x-fal-webhook-request-id",
        "x-fal-webhook-user-id",
        "x-fal-webhook-timestamp",
        "x-fal-webhook-signature",
    ],
)
async def test_fal_missing_headers(name: str) -> None:
    verifier, fetcher, _ = fal_setup()
    headers = fal_headers(K1, FAL_BODY)
    del headers[name]
    assert await rejected(verifier, headers, FAL_BODY, T0) == Reason.MISSING_HEADERS
    assert fetcher.calls == 0  # nothing fetched for a request that cannot be checked


async def test_fal_timestamp_window() -> None:
    verifier, _, _ = fal_setup()
    headers = fal_headers(K1, FAL_BODY)
    assert await rejected(verifier, headers, FAL_BODY, T0 + 301) == Reason.STALE_TIMESTAMP
    assert await rejected(verifier, headers, FAL_BODY, T0 - 301) == Reason.FUTURE_TIMESTAMP


async def test_fal_expected_user_ids() -> None:
    verifier, _, _ = fal_setup(expected_user_ids=["user-1"])
    assert (await verifier.verify(fal_headers(K1, FAL_BODY), FAL_BODY, T0)).key_version == "k1"
    other = fal_headers(K1, FAL_BODY, user_id="someone-else")
    assert await rejected(verifier, other, FAL_BODY, T0) == Reason.UNEXPECTED_ACCOUNT


async def test_fal_keys_unavailable_is_retryable() -> None:
    verifier, fetcher, cache = fal_setup()
    fetcher.fail = True
    with pytest.raises(VerificationError) as caught:
        await verifier.verify(fal_headers(K1, FAL_BODY), FAL_BODY, T0)
    assert caught.value.reason == Reason.KEYS_UNAVAILABLE
    assert caught.value.retryable
    assert cache.last_error == "ConnectError"
    fetcher.fail = False  # the endpoint recovers; the next attempt after the interval succeeds
    assert (await verifier.verify(fal_headers(K1, FAL_BODY), FAL_BODY, T0 + 30)).key_version


class TestJwksCache:
    async def test_ttl_expiry_refetches_and_a_failed_refetch_keeps_stale_keys(self) -> None:
        fetcher = Fetcher(jwks_document(jwk("k1", K1)))
        cache = JwksCache(fetcher, ttl_s=100, min_refresh_interval_s=10)
        assert set(await cache.keys(T0)) == {"k1"}
        assert set(await cache.keys(T0 + 99)) == {"k1"}
        assert fetcher.calls == 1
        fetcher.fail = True
        assert set(await cache.keys(T0 + 100)) == {"k1"}  # stale beats nothing
        assert set(await cache.keys(T0 + 105)) == {"k1"}  # rate-limited, no second attempt
        assert fetcher.calls == 2
        fetcher.fail = False
        fetcher.document = jwks_document(jwk("k2", K2))
        assert set(await cache.keys(T0 + 110)) == {"k2"}
        assert fetcher.calls == 3

    async def test_a_bad_document_never_replaces_good_keys(self) -> None:
        fetcher = Fetcher(jwks_document(jwk("k1", K1)))
        cache = JwksCache(fetcher, min_refresh_interval_s=0)
        await cache.keys(T0)
        fetcher.document = b'{"keys": []}'
        assert not await cache.refresh(T0 + 1, cache.generation)
        assert cache.last_error == "JwksError"
        assert set(cache.cached_keys) == {"k1"}

    def test_parse_skips_foreign_keys_and_names_kidless_keys_by_thumbprint(self) -> None:
        kidless = jwk(None, K2)
        keys = parse_jwks(
            jwks_document(
                {"kty": "RSA", "kid": "rsa", "n": "AQAB", "e": "AQAB"},
                {"kty": "OKP", "crv": "X25519", "kid": "x", "x": kidless["x"]},
                {"kty": "OKP", "crv": "Ed25519", "kid": "short", "x": "AAAA"},
                {"kty": "OKP", "crv": "Ed25519", "kid": "bad", "x": "+/+/"},
                {**jwk("enc", K3), "use": "enc"},
                {"not": "a key"},
                jwk("k1", K1),
                kidless,
            )
        )
        canonical = json.dumps({"crv": "Ed25519", "kty": "OKP", "x": kidless["x"]}).replace(" ", "")
        thumbprint = b64url(hashlib.sha256(canonical.encode()).digest())
        assert set(keys) == {"k1", thumbprint}

    @pytest.mark.parametrize(
        "document", [b"", b"not json", b"\xff", b"[]", b'{"keys": {}}', b'{"keys": [1, 2]}']
    )
    def test_parse_rejects_documents_without_a_usable_key(self, document: bytes) -> None:
        with pytest.raises(JwksError):
            parse_jwks(document)

    async def test_httpx_fetcher(self) -> None:
        document = jwks_document(jwk("k1", K1))
        routes = {
            "/jwks.json": httpx.Response(200, content=document),
            "/down": httpx.Response(503),
            "/huge": httpx.Response(200, content=b"x" * 2048),
        }
        seen: list[str] = []

        def handler(request: httpx.Request) -> httpx.Response:
            seen.append(request.method + " " + request.url.path)
            return routes[request.url.path]

        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            ok = httpx_fetcher("https://keys.test/jwks.json", client=client)
            assert await ok() == document
            with pytest.raises(JwksError, match="503"):
                await httpx_fetcher("https://keys.test/down", client=client)()
            with pytest.raises(JwksError, match="size"):
                await httpx_fetcher("https://keys.test/huge", max_bytes=1024, client=client)()
            cache = JwksCache(ok)
            assert set(await cache.keys(T0)) == {"k1"}
        assert seen[0] == "GET /jwks.json"


# --- Callback tokens ---------------------------------------------------------------------------

TOKEN_SECRET = b"s" * 32
OLD_TOKEN_SECRET = b"o" * 32
ATTEMPT = "0b9c6f8e-5a7d-4c1e-9f3b-2d8e7a6c5b4a"


def token_verifier() -> CallbackTokenVerifier:
    return CallbackTokenVerifier([("t2", TOKEN_SECRET), ("t1", OLD_TOKEN_SECRET)])


async def test_callback_token_valid() -> None:
    token = mint_callback_token(TOKEN_SECRET, ATTEMPT)
    assert re.fullmatch(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+", token)  # URL-safe as a query or path
    tag = base64.urlsafe_b64decode(token.split(".")[1] + "==")
    assert len(tag) * 8 >= 128
    result = await token_verifier().verify({}, b"anything", T0, callback_token=token)
    assert token_verifier().verify_now({}, b"anything", T0, callback_token=token) == result
    assert result == Verified(
        key_version="t2",
        event_id=None,
        timestamp=None,
        attempt_id=ATTEMPT,
        payload_authenticated=False,
    )


async def test_callback_token_minted_under_the_previous_secret() -> None:
    token = mint_callback_token(OLD_TOKEN_SECRET, "attempt-7")
    result = await token_verifier().verify({}, b"", T0, callback_token=token)
    assert (result.attempt_id, result.key_version) == ("attempt-7", "t1")


async def test_callback_token_moved_to_another_attempt() -> None:
    mine, theirs = (mint_callback_token(TOKEN_SECRET, a) for a in ("attempt-a", "attempt-b"))
    assert mine != theirs
    moved = theirs.split(".")[0] + "." + mine.split(".")[1]
    reason = await rejected(token_verifier(), {}, b"", T0, callback_token=moved)
    assert reason == Reason.BAD_TOKEN


@pytest.mark.parametrize("position", [0, 5, -1])
async def test_callback_token_tampered(position: int) -> None:
    token = mint_callback_token(TOKEN_SECRET, ATTEMPT)
    flipped = "A" if token[position] != "A" else "B"
    tampered = token[:position] + flipped + (token[position + 1 :] if position != -1 else "")
    reason = await rejected(token_verifier(), {}, b"", T0, callback_token=tampered)
    assert reason == Reason.BAD_TOKEN


@pytest.mark.parametrize(
    "token",
    ["no-dot", ".", "a.", ".b", "!!.!!", "YQ.x", "YQ." + "A" * 600, "_w.AAAA", "YQ.AAAA.AAAA"],
)
async def test_callback_token_malformed(token: str) -> None:
    assert await rejected(token_verifier(), {}, b"", T0, callback_token=token) == Reason.BAD_TOKEN


async def test_callback_token_under_an_unknown_secret() -> None:
    token = mint_callback_token(b"x" * 32, ATTEMPT)
    assert await rejected(token_verifier(), {}, b"", T0, callback_token=token) == Reason.BAD_TOKEN


@pytest.mark.parametrize("token", [None, ""])
async def test_callback_token_empty(token: str | None) -> None:
    reason = await rejected(token_verifier(), {}, b"", T0, callback_token=token)
    assert reason == Reason.MISSING_TOKEN


def test_callback_token_configuration() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        mint_callback_token(b"short", ATTEMPT)
    with pytest.raises(ValueError, match="attempt_id"):
        mint_callback_token(TOKEN_SECRET, "")
    with pytest.raises(ValueError, match=">= 16 bytes"):
        CallbackTokenVerifier([("t", b"short")])
    with pytest.raises(ValueError, match="unique"):
        CallbackTokenVerifier([("t", TOKEN_SECRET), ("t", OLD_TOKEN_SECRET)])


# --- Fuzzing: anything a caller controls ---------------------------------------------------------

HEADER_NAMES = [
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
    "x-fal-webhook-request-id",
    "x-fal-webhook-user-id",
    "x-fal-webhook-timestamp",
    "x-fal-webhook-signature",
    "x-key-id",
    "content-type",
]
FUZZ_SECRET = new_whsec()
header_values = st.one_of(
    st.text(max_size=200),
    st.integers(min_value=-(10**13), max_value=10**13).map(str),
    st.lists(
        st.tuples(st.sampled_from(["v1", "v1a", "v2", ""]), st.binary(max_size=36)).map(
            lambda pair: f"{pair[0]},{base64.b64encode(pair[1]).decode()}"
        ),
        min_size=1,
        max_size=4,
    ).map(" ".join),
    st.binary(min_size=62, max_size=66).map(bytes.hex),
    st.sampled_from(["k1", "k2", "", " ", "v1,", "msg_1", str(T0)]),
)
headers_strategy = st.dictionaries(st.sampled_from(HEADER_NAMES), header_values, max_size=9)
tokens = st.one_of(
    st.none(),
    st.text(max_size=120),
    st.tuples(st.binary(max_size=40), st.binary(max_size=40)).map(
        lambda pair: f"{b64url(pair[0])}.{b64url(pair[1])}"
    ),
)


async def _verify_all(headers: dict[str, str], body: bytes, now: float, token: str | None) -> None:
    verifiers: list[Verifier] = [
        StandardWebhooksVerifier([("k", FUZZ_SECRET)]),
        fal_setup(jwk("k1", K1), key_id_header=None)[0],
        fal_setup(jwk("k1", K1), key_id_header="x-key-id")[0],
        token_verifier(),
    ]
    for verifier in verifiers:
        with pytest.raises(VerificationError) as caught:
            await verifier.verify(headers, body, now, callback_token=token)
        assert str(caught.value) == caught.value.reason.value
        assert isinstance(caught.value.reason, Reason)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    headers=headers_strategy,
    body=st.binary(max_size=300),
    now=st.one_of(st.just(float(T0)), st.floats(min_value=0, max_value=4e9)),
    token=tokens,
)
def test_fuzz_arbitrary_requests_only_ever_fail_with_a_reason(
    headers: dict[str, str], body: bytes, now: float, token: str | None
) -> None:
    asyncio.run(_verify_all(headers, body, now, token))


@settings(max_examples=200, deadline=None)
@given(signature=header_values, msg_id=header_values, timestamp=header_values)
def test_fuzz_standard_webhooks_header_values_near_a_valid_request(
    signature: str, msg_id: str, timestamp: str
) -> None:
    """Each header replaced by an arbitrary value: never verifies, never raises anything else."""
    good = sw_headers("msg_f", T0, sw_sign(FUZZ_SECRET, "msg_f", T0, b"{}"))
    verifier = StandardWebhooksVerifier([("k", FUZZ_SECRET)])
    for name, value in (
        ("webhook-signature", signature),
        ("webhook-id", msg_id),
        ("webhook-timestamp", timestamp),
    ):
        if value == good[name]:
            continue
        with pytest.raises(VerificationError):
            asyncio.run(verifier.verify({**good, name: value}, b"{}", T0))
