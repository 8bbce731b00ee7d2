from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from aivedio.config import Settings


def test_settings_read_the_environment_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIVEDIO_DATABASE_URL", "postgresql://x@h/db")
    monkeypatch.setenv("AIVEDIO_COALESCE_MIN_POINTS", "7")
    settings = Settings.from_env()
    monkeypatch.setenv("AIVEDIO_COALESCE_MIN_POINTS", "9")
    assert settings.database().url == "postgresql://x@h/db"
    assert settings.state.coalesce_min_points == 7


def test_master_secret_is_created_once_and_kept(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    first = settings.master_secret()
    assert len(first) == 64
    assert Settings(data_dir=tmp_path).master_secret() == first
    assert (tmp_path / "secret.key").stat().st_mode & 0o777 == 0o600
    assert settings.derived_secret("a") != settings.derived_secret("b")


def test_configured_secret_wins(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, secret_key="s3cret")
    assert settings.master_secret() == b"s3cret"
    assert not (tmp_path / "secret.key").exists()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("7d", timedelta(days=7)),
        ("72h", timedelta(hours=72)),
        ("30m", timedelta(minutes=30)),
        ("90s", timedelta(seconds=90)),
        ("3600", timedelta(hours=1)),
        ("P8D", timedelta(days=8)),
    ],
)
def test_retention_durations_read_as_written(raw: str, expected: timedelta) -> None:
    assert Settings(outbox_retention=raw).outbox_retention == expected


def test_retention_settings_reach_the_maintenance_config() -> None:
    from aivedio.retention.config import RetentionConfig

    settings = Settings(
        event_retention="3d",
        callback_dedup_window="96h",
        outbox_retention="2h",
        event_partitions_ahead=4,
    )
    config = RetentionConfig.from_settings(settings)
    assert (config.event_retention, config.callback_dedup_window) == (
        timedelta(days=3),
        timedelta(hours=96),
    )
    assert (config.outbox_retention, config.partitions_ahead_days) == (timedelta(hours=2), 4)
