"""Build the configured adapters from one typed config (the CLI maps ``AIVEDIO_*`` onto it).

``build_providers(config)`` -> ``{name: ProviderAdapter}`` for every provider whose section is
set; ``callback_providers(adapters)`` is the subset the callback gateway serves (poll-only
adapters are left out, so their path answers 404). No module here reads the environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx

from aivedio.config import Settings
from aivedio.errors import ConfigError
from aivedio.providers.fal import FalAdapter
from aivedio.providers.http import HttpConfig
from aivedio.providers.jwks import FalEd25519Verifier, JwksCache, httpx_fetcher
from aivedio.providers.kling import KlingAdapter
from aivedio.providers.port import DEFAULT_MAX_BODY_BYTES, CallbackProvider, ProviderAdapter
from aivedio.providers.replicate import ReplicateAdapter
from aivedio.providers.runway import RunwayAdapter
from aivedio.providers.sandbox import SandboxAdapter

__all__ = [
    "FalConfig",
    "KlingConfig",
    "ProvidersConfig",
    "ReplicateConfig",
    "RunwayConfig",
    "SandboxAdapterConfig",
    "build_providers",
    "callback_providers",
    "providers_config",
    "versioned",
]

FAL_JWKS_URL = "https://rest.alpha.fal.ai/.well-known/jwks.json"  # also Settings.fal_jwks_url


def versioned(secrets: tuple[str, ...] | list[str]) -> tuple[tuple[str, str], ...]:
    """Secrets listed newest first as ``(version, secret)`` pairs: ``k0`` is the newest."""
    return tuple((f"k{i}", secret) for i, secret in enumerate(secrets))


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxAdapterConfig:
    base_url: str
    api_key: str
    webhook_secrets: tuple[str, ...]
    """``whsec_`` keys, newest first (``AIVEDIO_SANDBOX_WEBHOOK_SECRETS``)."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    tolerance_s: float = 300.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicateConfig:
    api_token: str
    webhook_secrets: tuple[str, ...]
    base_url: str = "https://api.replicate.com"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    tolerance_s: float = 300.0


@dataclass(frozen=True, slots=True, kw_only=True)
class FalConfig:
    api_key: str
    app_id: str
    """``owner/name`` of the fal app; models are its endpoints (``owner/name/sub/path``)."""
    base_url: str = "https://queue.fal.run"
    jwks_url: str = FAL_JWKS_URL
    expected_user_ids: tuple[str, ...] | None = None
    """When set, a genuinely fal-signed callback for another fal account is refused."""
    max_body_bytes: int = 1024 * 1024
    tolerance_s: float = 300.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RunwayConfig:
    api_key: str
    base_url: str = "https://api.dev.runwayml.com"
    api_version: str = "2024-11-06"


@dataclass(frozen=True, slots=True, kw_only=True)
class KlingConfig:
    access_key: str
    secret_key: str
    callback_token_secrets: tuple[bytes, ...]
    """At least 16 random bytes each, newest first (tokens are minted with the newest)."""
    base_url: str = "https://api-singapore.klingai.com"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


@dataclass(frozen=True, slots=True, kw_only=True)
class ProvidersConfig:
    public_url: str | None
    """Base the providers call back (``AIVEDIO_PUBLIC_URL``); None: no webhooks (poll only)."""
    http: HttpConfig = field(default_factory=HttpConfig)
    sandbox: SandboxAdapterConfig | None = None
    replicate: ReplicateConfig | None = None
    fal: FalConfig | None = None
    runway: RunwayConfig | None = None
    kling: KlingConfig | None = None


def build_providers(
    config: ProvidersConfig, *, client: httpx.AsyncClient | None = None
) -> dict[str, ProviderAdapter]:
    """One adapter per configured provider. ``client`` (optional) is shared by all of them and
    then closed by the caller; otherwise each adapter owns one (close with ``aclose``)."""
    public, http = config.public_url, config.http
    made: list[ProviderAdapter] = []
    if (sb := config.sandbox) is not None:
        made.append(
            SandboxAdapter(
                base_url=sb.base_url,
                api_key=sb.api_key,
                webhook_secrets=versioned(sb.webhook_secrets),
                public_url=public,
                tolerance_s=sb.tolerance_s,
                max_body_bytes=sb.max_body_bytes,
                http=http,
                client=client,
            )
        )
    if (rp := config.replicate) is not None:
        made.append(
            ReplicateAdapter(
                api_token=rp.api_token,
                webhook_secrets=versioned(rp.webhook_secrets),
                public_url=public,
                base_url=rp.base_url,
                tolerance_s=rp.tolerance_s,
                max_body_bytes=rp.max_body_bytes,
                http=http,
                client=client,
            )
        )
    if config.fal is not None:
        made.append(_fal(config.fal, config, client))
    if (rw := config.runway) is not None:
        made.append(
            RunwayAdapter(
                api_key=rw.api_key,
                base_url=rw.base_url,
                api_version=rw.api_version,
                http=http,
                client=client,
            )
        )
    if config.kling is not None:
        made.append(_kling(config.kling, config, client))
    return {adapter.name: adapter for adapter in made}


def _fal(fl: FalConfig, config: ProvidersConfig, client: httpx.AsyncClient | None) -> FalAdapter:
    jwks = JwksCache(httpx_fetcher(fl.jwks_url, client=client))
    return FalAdapter(
        api_key=fl.api_key,
        app_id=fl.app_id,
        verifier=FalEd25519Verifier(jwks, fl.tolerance_s, expected_user_ids=fl.expected_user_ids),
        public_url=config.public_url,
        base_url=fl.base_url,
        max_body_bytes=fl.max_body_bytes,
        http=config.http,
        client=client,
    )


def _kling(
    kl: KlingConfig, config: ProvidersConfig, client: httpx.AsyncClient | None
) -> KlingAdapter:
    return KlingAdapter(
        access_key=kl.access_key,
        secret_key=kl.secret_key,
        callback_token_secrets=tuple(
            (f"k{i}", secret) for i, secret in enumerate(kl.callback_token_secrets)
        ),
        public_url=config.public_url,
        base_url=kl.base_url,
        max_body_bytes=kl.max_body_bytes,
        http=config.http,
        client=client,
    )


def callback_providers(adapters: Mapping[str, ProviderAdapter]) -> dict[str, CallbackProvider]:
    """The adapters the callback gateway serves: those that receive webhooks at all."""
    return {name: a for name, a in adapters.items() if a.supports_webhooks}


def _split(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


def _require(value: str, variable: str, provider: str) -> str:
    if not value.strip():
        raise ConfigError(f"{provider} is configured but {variable} is empty")
    return value.strip()


def providers_config(settings: Settings) -> ProvidersConfig:
    """The providers the settings configure, calling back at ``AIVEDIO_PUBLIC_URL``.

    The sandbox is on unless ``AIVEDIO_SANDBOX_ENABLED=false``; every other dialect is on when its
    credential is set (``AIVEDIO_REPLICATE_API_TOKEN``, ``AIVEDIO_FAL_API_KEY``,
    ``AIVEDIO_RUNWAY_API_KEY``, ``AIVEDIO_KLING_ACCESS_KEY``) and then needs the rest of its
    section: a missing part raises :class:`ConfigError` naming the variable, at startup.
    """
    sandbox = None
    if settings.sandbox_enabled:
        sandbox = SandboxAdapterConfig(
            base_url=settings.sandbox_url,
            api_key=settings.sandbox_api_key,
            webhook_secrets=_split(settings.sandbox_webhook_secrets),
        )
    replicate = None
    if settings.replicate_api_token is not None:
        replicate = _replicate_config(settings, settings.replicate_api_token)
    fal = None
    if settings.fal_api_key is not None:
        users = _split(settings.fal_user_ids)
        fal = FalConfig(
            api_key=_require(settings.fal_api_key, "AIVEDIO_FAL_API_KEY", "fal"),
            app_id=_require(settings.fal_app_id, "AIVEDIO_FAL_APP_ID", "fal"),
            base_url=settings.fal_url,
            jwks_url=settings.fal_jwks_url,
            expected_user_ids=users or None,
        )
    runway = None
    if settings.runway_api_key is not None:
        runway = RunwayConfig(
            api_key=_require(settings.runway_api_key, "AIVEDIO_RUNWAY_API_KEY", "runway"),
            base_url=settings.runway_url,
            api_version=settings.runway_api_version,
        )
    kling = None
    if settings.kling_access_key is not None:
        kling = _kling_config(settings, settings.kling_access_key)
    return ProvidersConfig(
        public_url=settings.public_url,
        sandbox=sandbox,
        replicate=replicate,
        fal=fal,
        runway=runway,
        kling=kling,
    )


def _replicate_config(settings: Settings, api_token: str) -> ReplicateConfig:
    secrets = _split(settings.replicate_webhook_secrets)
    if not secrets:
        raise ConfigError("replicate is configured but AIVEDIO_REPLICATE_WEBHOOK_SECRETS is empty")
    return ReplicateConfig(
        api_token=_require(api_token, "AIVEDIO_REPLICATE_API_TOKEN", "replicate"),
        webhook_secrets=secrets,
        base_url=settings.replicate_url,
    )


def _kling_config(settings: Settings, access_key: str) -> KlingConfig:
    token_secrets = tuple(s.encode() for s in _split(settings.kling_callback_secrets))
    if any(len(secret) < 16 for secret in token_secrets):
        raise ConfigError("every AIVEDIO_KLING_CALLBACK_SECRETS entry needs 16 bytes or more")
    return KlingConfig(
        access_key=_require(access_key, "AIVEDIO_KLING_ACCESS_KEY", "kling"),
        secret_key=_require(settings.kling_secret_key, "AIVEDIO_KLING_SECRET_KEY", "kling"),
        # Newest first; without rotation, one key derived from the master secret.
        callback_token_secrets=token_secrets or (settings.derived_secret("kling-callback-tokens"),),
        base_url=settings.kling_url,
    )
