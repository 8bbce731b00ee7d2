from __future__ import annotations

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
