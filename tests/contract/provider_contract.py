"""The provider contract: one set of tests every provider adapter (and any fake) must pass.

Subclass the base that matches how the provider authenticates its callbacks, once per adapter,
as ``Test<Adapter>Contract`` (in that adapter's ``tests/unit/test_provider_<name>.py``):

:class:`SignedCallbackContract`
    the body is signed with a timestamp (Standard Webhooks HMAC, fal's Ed25519): a good
    signature passes, a tampered body or a stale / future timestamp fails, and during a rotation
    old and new keys both verify while a retired key does not;
:class:`TokenCallbackContract`
    nothing is signed, the callback URL carries a token we minted (Kling style): the token is
    checked, the body is not (``payload_authenticated=False``, the processor refetches), tokens
    under old and new secrets verify during a rotation;
:class:`PollOnlyContract`
    the provider never calls back: every callback is refused.

All three share :class:`ProviderContract`: dedup keys (the same delivery has the same key, a
different event a different one, and ``dedup`` is total), the normalization tables of callbacks
and of queries (every provider status to the expected :class:`ProviderStatus`, progress clamped,
the stored minimized copy normalizes the same), and, from
:class:`~tests.contract.provider_outbound.OutboundContract`, the error mapping of ``submit``,
``query``, ``cancel`` and ``lookup`` (429 -> ``RateLimited`` with its ``Retry-After``, 5xx ->
``ProviderUnavailable``, 404 -> ``NotFoundYet``, 401/403 -> ``AuthFailed``, a body that is not
a JSON object -> ``MalformedResponse``, a create sent exactly once).

The provider's HTTP side (in :mod:`tests.contract.provider_outbound`) is an
``httpx.MockTransport`` that answers what the case needs and records every request, as the
adapter-specific tests do, and for the transport failures also a real socket (a local HTTP
server that refuses, hangs up or answers), so the mapping holds for what httpx really raises.

A subclass supplies the adapter-specific fixtures as methods and class attributes: ``make``
(the adapter with the named keys active), ``callback`` / ``query_body`` (sample payloads for a
raw provider status), ``status_table`` / ``query_table``, ``progress_cases``, ``fields``,
``submit_request`` and, for callbacks, ``sign`` (how the provider signs a body) and
``retired_reason``.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpx
import pytest

from aivedio.domain.observation import ProviderStatus
from aivedio.providers.port import (
    InboxFields,
    MalformedResponse,
    PayloadError,
    ProviderAdapter,
    Reason,
    VerificationError,
    Verified,
)
from aivedio.providers.verify import decode_whsec
from tests.contract.provider_outbound import (
    OutboundContract,
    answered,
)

NOW = 1_767_225_600
"""The fixed clock of every verification (2026-01-01T00:00:00Z)."""
TOLERANCE_S = 300
"""The timestamp window the signed adapters are built with (the default)."""


@dataclass(frozen=True, slots=True)
class Delivery:
    """How a callback arrives: its headers and, for token providers, the URL's token."""

    headers: Mapping[str, str] = field(default_factory=dict)
    callback_token: str | None = None


def body_of(payload: Mapping[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


def standard_webhooks(secret: str, body: bytes, *, delivery_id: str, at: int) -> Delivery:
    """A Standard Webhooks v1 delivery: ``base64(HMAC-SHA256(key, "{id}.{ts}.{body}"))``."""
    content = f"{delivery_id}.{at}.".encode() + body
    signature = base64.b64encode(hmac.digest(decode_whsec(secret), content, "sha256")).decode()
    return Delivery(
        {
            "webhook-id": delivery_id,
            "webhook-timestamp": str(at),
            "webhook-signature": "v1," + signature,
        }
    )


# --- the contract ----------------------------------------------------------------------------


class ProviderContract(OutboundContract):
    """What every adapter does, whatever its callbacks (see the module docstring)."""

    status_table: ClassVar[Sequence[tuple[str, ProviderStatus]]]
    """Raw provider status of a callback payload -> the normalized status."""
    query_table: ClassVar[Sequence[tuple[str, ProviderStatus]]] = ()
    """Raw status of a query answer -> the normalized status (``status_table`` when empty)."""
    progress_cases: ClassVar[Sequence[tuple[object, int | None]]]
    """Raw progress figure -> the clamped one (always None for a provider that reports none)."""
    unknown_status: ClassVar[str] = "exploded"

    # -- fixtures a subclass supplies ---------------------------------------------------------

    def callback(self, status: str) -> dict[str, Any]:
        """A callback payload (what ``normalize`` reads) with this raw status."""
        raise NotImplementedError

    def query_body(self, status: str) -> Any:
        """A query answer with this raw status."""
        return self.callback(status)

    def with_progress(self, value: object) -> dict[str, Any]:
        """A running callback payload whose progress figure is ``value``."""
        return {**self.callback(self.status_table[0][0]), "progress": value}

    def fields(self) -> InboxFields:
        return InboxFields(provider=self.make().name, dedup_key="k")

    async def arrive(
        self, adapter: ProviderAdapter, body: bytes, delivery_id: str, at: int
    ) -> tuple[Mapping[str, str], Verified]:
        """The headers of a delivery of ``body`` sent at ``at`` and what the gateway's
        verification of it establishes."""
        raise NotImplementedError

    # -- the port ----------------------------------------------------------------------------

    def test_satisfies_the_port(self) -> None:
        adapter = self.make()
        assert isinstance(adapter, ProviderAdapter)
        assert adapter.max_body_bytes > 0
        assert not (adapter.signed_callbacks and adapter.needs_refetch_on_callback)

    # -- dedup -------------------------------------------------------------------------------

    async def _key(
        self, adapter: ProviderAdapter, status: str, delivery_id: str, at: int = NOW
    ) -> str:
        body = body_of(self.callback(status))
        headers, verified = await self.arrive(adapter, body, delivery_id, at)
        info = adapter.dedup(headers, json.loads(body), verified, hashlib.sha256(body).digest())
        assert info.dedup_key
        return info.dedup_key

    async def test_the_same_delivery_has_the_same_dedup_key(self) -> None:
        adapter = self.make()
        status = self.status_table[0][0]
        first = await self._key(adapter, status, "evt_1")
        assert await self._key(adapter, status, "evt_1") == first
        assert await self._key(self.make(), status, "evt_1") == first  # another process
        # the provider's retry of the same event, signed again a minute later
        assert await self._key(adapter, status, "evt_1", at=NOW + 60) == first

    async def test_a_different_event_has_a_different_dedup_key(self) -> None:
        adapter = self.make()
        keys = {
            await self._key(adapter, raw, f"evt_{n}")
            for n, (raw, _) in enumerate(self.status_table)
        }
        assert len(keys) == len(self.status_table)

    def test_dedup_is_total(self) -> None:
        adapter = self.make()
        verified = Verified(key_version=None, event_id=None, timestamp=None)
        odd: list[dict[str, Any]] = [
            {},
            {"data": 3, "type": ["x"]},
            {"status": [], "id": {}, "request_id": 1.5, "task_id": None},
            {"data": {"id": [], "metadata": "x", "updated_at": {}}},
            {"task_info": 7, "updated_at": "not a time"},
        ]
        for payload in odd:
            info = adapter.dedup({}, payload, verified, hashlib.sha256(body_of(payload)).digest())
            assert info.dedup_key, payload

    # -- normalization -----------------------------------------------------------------------

    def test_callback_normalization_table(self) -> None:
        adapter = self.make()
        for raw, expected in self.status_table:
            payload = self.callback(raw)
            before = copy.deepcopy(payload)
            stored = adapter.minimize(payload)
            assert payload == before, raw  # minimize never modifies its argument
            state = adapter.normalize(stored, self.fields())
            assert state.status is expected, raw
            assert adapter.normalize(payload, self.fields()) == state, raw
            assert (state.error_code is not None) == (expected is ProviderStatus.FAILED), raw
            if expected is ProviderStatus.SUCCEEDED:
                assert state.output_ref == f"{adapter.name}:{state.provider_task_id}"

    def test_unknown_status_is_a_payload_error(self) -> None:
        with pytest.raises(PayloadError) as caught:
            self.make().normalize(self.callback(self.unknown_status), self.fields())
        assert caught.value.code == "unknown_status"

    def test_progress_is_clamped(self) -> None:
        adapter = self.make()
        for raw, expected in self.progress_cases:
            state = adapter.normalize(adapter.minimize(self.with_progress(raw)), self.fields())
            assert state.progress == expected, raw

    async def test_query_normalization_table(self) -> None:
        for raw, expected in self.query_table or self.status_table:
            state, requests = await answered(
                self.make,
                lambda r, raw=raw: httpx.Response(200, json=self.query_body(raw)),
                lambda a: a.query(self.task_id),
            )
            assert state.status is expected, raw
            assert len(requests) == 1 and requests[0].method == "GET", raw

    async def test_query_of_an_unknown_status_is_malformed(self) -> None:
        with pytest.raises(MalformedResponse):
            await answered(
                self.make,
                lambda r: httpx.Response(200, json=self.query_body(self.unknown_status)),
                lambda a: a.query(self.task_id),
            )


class CallbackContract(ProviderContract):
    """A provider that calls back: deliveries verify, and keys rotate."""

    retired_reason: ClassVar[Reason]
    """Why a delivery under a key that is no longer configured is refused."""

    def sign(self, body: bytes, *, delivery_id: str, at: int, key: str) -> Delivery:
        """The delivery of ``body`` as the provider makes it, signed at ``at`` with ``key``."""
        raise NotImplementedError

    async def arrive(
        self, adapter: ProviderAdapter, body: bytes, delivery_id: str, at: int
    ) -> tuple[Mapping[str, str], Verified]:
        delivery = self.sign(body, delivery_id=delivery_id, at=at, key="k0")
        return delivery.headers, await self.verify(adapter, delivery, body, now=at)

    async def verify(
        self, adapter: ProviderAdapter, delivery: Delivery, body: bytes, now: float = NOW
    ) -> Verified:
        """The gateway's check, through both paths it takes: awaited, and ``verify_now`` (the
        lean path) when the verifier offers it; both must agree."""
        headers = {k.lower(): v for k, v in delivery.headers.items()}
        verifier = adapter.verifier
        verified = await verifier.verify(headers, body, now, callback_token=delivery.callback_token)
        verify_now = getattr(verifier, "verify_now", None)
        if verify_now is not None:
            assert (
                verify_now(headers, body, now, callback_token=delivery.callback_token) == verified
            )
        return verified

    async def refused(
        self, adapter: ProviderAdapter, delivery: Delivery, body: bytes, now: float = NOW
    ) -> Reason:
        with pytest.raises(VerificationError) as caught:
            await self.verify(adapter, delivery, body, now)
        assert not caught.value.retryable
        return caught.value.reason

    def test_takes_callbacks(self) -> None:
        adapter = self.make()
        assert adapter.supports_webhooks
        url = adapter.webhook_url_for("4b8e7a8e-0000-4000-8000-000000000001")
        assert url is not None and f"/v1/callbacks/{adapter.name}" in url

    async def test_a_good_delivery_verifies(self) -> None:
        adapter = self.make()
        body = body_of(self.callback(self.status_table[0][0]))
        verified = await self.verify(
            adapter, self.sign(body, delivery_id="evt_1", at=NOW, key="k0"), body
        )
        assert verified.key_version == "k0"
        assert verified.payload_authenticated is adapter.signed_callbacks

    async def test_old_and_new_keys_verify_during_a_rotation(self) -> None:
        rotating = self.make(keys=("k1", "k0"))
        body = body_of(self.callback(self.status_table[0][0]))
        for key in ("k0", "k1"):
            delivery = self.sign(body, delivery_id=f"evt_{key}", at=NOW, key=key)
            assert (await self.verify(rotating, delivery, body)).key_version == key
        retired = self.make(keys=("k1",))
        old = self.sign(body, delivery_id="evt_old", at=NOW, key="k0")
        assert await self.refused(retired, old, body) is self.retired_reason
        new = self.sign(body, delivery_id="evt_new", at=NOW, key="k1")
        assert (await self.verify(retired, new, body)).key_version == "k1"


class SignedCallbackContract(CallbackContract):
    """The body is signed together with a timestamp."""

    retired_reason = Reason.BAD_SIGNATURE

    def test_callbacks_are_signed(self) -> None:
        adapter = self.make()
        assert adapter.signed_callbacks and not adapter.needs_refetch_on_callback

    async def test_a_tampered_body_fails(self) -> None:
        adapter = self.make()
        payload = self.callback(self.status_table[0][0])
        body = body_of(payload)
        delivery = self.sign(body, delivery_id="evt_1", at=NOW, key="k0")
        for tampered in (body + b" ", body.replace(b":", b": ", 1), body_of({**payload, "x": 1})):
            assert await self.refused(adapter, delivery, tampered) is Reason.BAD_SIGNATURE

    async def test_a_signature_outside_the_window_fails(self) -> None:
        adapter = self.make()
        body = body_of(self.callback(self.status_table[0][0]))
        stale = self.sign(body, delivery_id="evt_1", at=NOW - TOLERANCE_S - 1, key="k0")
        assert await self.refused(adapter, stale, body) is Reason.STALE_TIMESTAMP
        future = self.sign(body, delivery_id="evt_1", at=NOW + TOLERANCE_S + 1, key="k0")
        assert await self.refused(adapter, future, body) is Reason.FUTURE_TIMESTAMP
        edge = self.sign(body, delivery_id="evt_1", at=NOW - TOLERANCE_S, key="k0")
        assert (await self.verify(adapter, edge, body)).timestamp == NOW - TOLERANCE_S

    async def test_missing_headers_fail(self) -> None:
        adapter = self.make()
        body = body_of(self.callback(self.status_table[0][0]))
        delivery = self.sign(body, delivery_id="evt_1", at=NOW, key="k0")
        for name in delivery.headers:
            partial = Delivery({k: v for k, v in delivery.headers.items() if k != name})
            assert await self.refused(adapter, partial, body) is Reason.MISSING_HEADERS


class TokenCallbackContract(CallbackContract):
    """Nothing is signed: the callback URL carries a token naming the attempt."""

    retired_reason = Reason.BAD_TOKEN
    attempt_id: ClassVar[str] = "4b8e7a8e-0000-4000-8000-000000000001"

    def test_callbacks_need_a_refetch(self) -> None:
        adapter = self.make()
        assert not adapter.signed_callbacks and adapter.needs_refetch_on_callback

    async def test_the_callback_url_carries_a_token_for_the_attempt(self) -> None:
        adapter = self.make()
        url = adapter.webhook_url_for(self.attempt_id)
        assert url is not None
        token = url.rpartition("token=")[2]
        verified = await self.verify(adapter, Delivery(callback_token=token), b"{}")
        assert verified.attempt_id == self.attempt_id and verified.key_version == "k0"
        assert verified.payload_authenticated is False and verified.event_id is None

    async def test_a_tampered_body_verifies_but_is_not_authenticated(self) -> None:
        adapter = self.make()
        body = body_of(self.callback(self.status_table[0][0]))
        delivery = self.sign(body, delivery_id="evt_1", at=NOW, key="k0")
        verified = await self.verify(adapter, delivery, body + b" ")
        assert verified.payload_authenticated is False  # the processor refetches the job

    async def test_a_tampered_or_missing_token_fails(self) -> None:
        adapter = self.make()
        body = b"{}"
        token = self.sign(body, delivery_id="evt_1", at=NOW, key="k0").callback_token
        assert token is not None
        tampered = token[:-2] + ("AA" if not token.endswith("AA") else "BB")
        assert await self.refused(adapter, Delivery(callback_token=tampered), body) is (
            Reason.BAD_TOKEN
        )
        assert await self.refused(adapter, Delivery(), body) is Reason.MISSING_TOKEN

    async def test_a_token_has_no_time_window(self) -> None:
        """No timestamp is signed: an old token still verifies (a replay only makes the
        processor refetch the job, and the dedup key collapses the same bytes)."""
        adapter = self.make()
        delivery = self.sign(b"{}", delivery_id="evt_1", at=NOW, key="k0")
        verified = await self.verify(adapter, delivery, b"{}", now=NOW + 30 * 86400)
        assert verified.timestamp is None


class PollOnlyContract(ProviderContract):
    """The provider never calls back: every callback is refused."""

    async def arrive(
        self, adapter: ProviderAdapter, body: bytes, delivery_id: str, at: int
    ) -> tuple[Mapping[str, str], Verified]:
        return {}, Verified(key_version=None, event_id=None, timestamp=None)

    async def test_every_callback_is_refused(self) -> None:
        adapter = self.make()
        assert not adapter.supports_webhooks and adapter.webhook_url_for("a1") is None
        body = body_of(self.callback(self.status_table[0][0]))
        for headers, token in (({}, None), ({"webhook-id": "x"}, None), ({}, "tok")):
            with pytest.raises(VerificationError):
                await adapter.verifier.verify(headers, body, NOW, callback_token=token)
