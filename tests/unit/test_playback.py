"""Signed playback links: valid until they expire, bound to one asset, tamper-evident."""

from __future__ import annotations

import uuid
from urllib.parse import parse_qs, urlsplit

import pytest

from aivedio.media.playback import PlaybackConfig, sign_playback, verify_playback

SECRET = b"k" * 32


def parts(link: str) -> tuple[str, str, str]:
    split = urlsplit(link)
    query = parse_qs(split.query)
    return split.path, query["exp"][0], query["sig"][0]


def test_link_verifies_until_it_expires() -> None:
    asset = uuid.uuid4()
    path, exp, sig = parts(sign_playback(asset, 60, SECRET, now=1000.0))
    assert path == f"/v1/media/{asset}" and exp == "1060"
    assert verify_playback(asset, exp, sig, SECRET, now=1059.9)
    assert not verify_playback(asset, exp, sig, SECRET, now=1060.0)


def test_link_is_bound_to_asset_expiry_and_secret() -> None:
    asset = uuid.uuid4()
    _, exp, sig = parts(sign_playback(asset, 60, SECRET, now=1000.0))
    assert not verify_playback(uuid.uuid4(), exp, sig, SECRET, now=1000.0)
    assert not verify_playback(asset, "1999", sig, SECRET, now=1000.0)
    assert not verify_playback(asset, exp, sig, b"x" * 32, now=1000.0)
    for bad_exp, bad_sig in ((None, sig), (exp, None), ("-1", sig), ("1e9", sig)):
        assert not verify_playback(asset, bad_exp, bad_sig, SECRET, now=0.0)


def test_config_rejects_weak_secrets() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        PlaybackConfig(b"short")
