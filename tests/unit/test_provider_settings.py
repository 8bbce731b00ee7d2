"""``AIVEDIO_*`` provider settings -> adapters: which providers exist, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from aivedio.config import Settings
from aivedio.errors import ConfigError
from aivedio.providers.registry import build_providers, callback_providers, providers_config


def test_only_the_sandbox_by_default(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    assert settings.api.providers == frozenset({"sandbox"})
    config = providers_config(settings)
    assert config.sandbox is not None
    assert (config.replicate, config.fal, config.runway, config.kling) == (None,) * 4


async def test_every_dialect_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {
        "AIVEDIO_DATA_DIR": str(tmp_path),
        "AIVEDIO_SANDBOX_ENABLED": "false",
        "AIVEDIO_REPLICATE_API_TOKEN": "r8_token",
        "AIVEDIO_REPLICATE_WEBHOOK_SECRETS": "whsec_bmV3LXNlY3JldC0wMDAwMDAwMA==, "
        "whsec_b2xkLXNlY3JldC0wMDAwMDAwMA==",
        "AIVEDIO_FAL_API_KEY": "fal-key",
        "AIVEDIO_FAL_APP_ID": "acme/video",
        "AIVEDIO_FAL_USER_IDS": "user-1,user-2",
        "AIVEDIO_RUNWAY_API_KEY": "rw-key",
        "AIVEDIO_KLING_ACCESS_KEY": "ak",
        "AIVEDIO_KLING_SECRET_KEY": "sk",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings.from_env()
    assert settings.api.providers == frozenset({"replicate", "fal", "runway", "kling"})
    config = providers_config(settings)
    assert config.replicate is not None and len(config.replicate.webhook_secrets) == 2
    assert config.fal is not None and config.fal.expected_user_ids == ("user-1", "user-2")
    assert config.kling is not None
    # Without AIVEDIO_KLING_CALLBACK_SECRETS the token key is derived from the master secret.
    assert config.kling.callback_token_secrets == (
        settings.derived_secret("kling-callback-tokens"),
    )
    adapters = build_providers(config)
    try:
        assert set(adapters) == {"replicate", "fal", "runway", "kling"}
        assert set(callback_providers(adapters)) == {"replicate", "fal", "kling"}  # runway polls
    finally:
        for adapter in adapters.values():
            await adapter.aclose()


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"AIVEDIO_REPLICATE_API_TOKEN": "t"}, "AIVEDIO_REPLICATE_WEBHOOK_SECRETS"),
        ({"AIVEDIO_FAL_API_KEY": "k"}, "AIVEDIO_FAL_APP_ID"),
        ({"AIVEDIO_KLING_ACCESS_KEY": "ak"}, "AIVEDIO_KLING_SECRET_KEY"),
        ({"AIVEDIO_RUNWAY_API_KEY": " "}, "AIVEDIO_RUNWAY_API_KEY"),
        (
            {
                "AIVEDIO_KLING_ACCESS_KEY": "ak",
                "AIVEDIO_KLING_SECRET_KEY": "sk",
                "AIVEDIO_KLING_CALLBACK_SECRETS": "short",
            },
            "AIVEDIO_KLING_CALLBACK_SECRETS",
        ),
    ],
)
def test_a_half_configured_provider_names_the_missing_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], variable: str
) -> None:
    monkeypatch.setenv("AIVEDIO_DATA_DIR", str(tmp_path))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=variable):
        providers_config(Settings.from_env())


def test_the_cli_refuses_to_start_with_a_clear_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from aivedio.cli import main

    monkeypatch.setenv("AIVEDIO_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("AIVEDIO_FAL_API_KEY", "k")
    assert main(["run", "--role", "poller"]) == 2
    assert "AIVEDIO_FAL_APP_ID" in capsys.readouterr().err
