"""PyAV probe and render: H.264 input is remuxed, anything else transcoded to H.264 + AAC; the
rendition has its moov atom first; corrupt and unsupported inputs are rejected."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest

from aivedio.media.errors import MediaRejected
from aivedio.media.pipeline import MediaLimits, probe, render
from aivedio.sandbox.media import sample_mp4


def write_video(path: Path, codec: str, *, audio: bool, width: int = 66, height: int = 50) -> None:
    with av.open(str(path), "w", format="mp4") as container:
        video = container.add_stream(codec, rate=10)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        sound = container.add_stream("aac", rate=44100) if audio else None
        if sound is not None:
            sound.layout = "mono"
        for i in range(10):
            frame = av.VideoFrame(width, height, "yuv420p")
            for plane in frame.planes:
                plane.update(bytes([i * 20]) * plane.buffer_size)
            frame.pts = i
            container.mux(video.encode(frame))
        container.mux(video.encode(None))
        if sound is not None:
            for i in range(40):
                samples = (np.sin(np.arange(1024) / 8) * 0.2).astype("float32").reshape(1, -1)
                chunk = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
                chunk.sample_rate, chunk.pts = 44100, i * 1024
                container.mux(sound.encode(chunk))
            container.mux(sound.encode(None))


def moov_first(path: Path) -> bool:
    head = path.read_bytes()
    return 0 <= head.find(b"moov") < head.find(b"mdat")


def test_h264_is_remuxed_with_faststart(tmp_path: Path) -> None:
    source, target = tmp_path / "in.mp4", tmp_path / "out.mp4"
    source.write_bytes(sample_mp4())
    meta = probe(source, MediaLimits())
    assert (meta.video_codec, meta.width, meta.height, meta.audio_codec) == ("h264", 64, 64, None)
    assert meta.remuxable and meta.duration_s == pytest.approx(1.0, abs=0.15)
    assert render(source, target, meta) == "remux"
    out = probe(target, MediaLimits())
    assert (out.video_codec, out.width, out.height) == ("h264", 64, 64)
    assert moov_first(target)


def test_other_codecs_are_transcoded_to_h264_and_aac(tmp_path: Path) -> None:
    source, target = tmp_path / "in.mp4", tmp_path / "out.mp4"
    write_video(source, "mpeg4", audio=True, width=66, height=50)
    meta = probe(source, MediaLimits())
    assert (meta.video_codec, meta.audio_codec, meta.remuxable) == ("mpeg4", "aac", False)
    assert render(source, target, meta) == "transcode"
    out = probe(target, MediaLimits())
    assert (out.video_codec, out.audio_codec, out.width, out.height) == ("h264", "aac", 66, 50)
    assert out.duration_s == pytest.approx(1.0, abs=0.2)
    assert moov_first(target)


@pytest.mark.parametrize(
    "body",
    [b"", b"not a video at all", b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 500],
)
def test_corrupt_input_is_rejected(tmp_path: Path, body: bytes) -> None:
    path = tmp_path / "bad.mp4"
    path.write_bytes(body)
    with pytest.raises(MediaRejected):
        probe(path, MediaLimits())


def test_limits(tmp_path: Path) -> None:
    path = tmp_path / "in.mp4"
    path.write_bytes(sample_mp4())
    with pytest.raises(MediaRejected, match="too long"):
        probe(path, MediaLimits(max_duration_s=0.5))
    with pytest.raises(MediaRejected, match="dimensions"):
        probe(path, MediaLimits(max_width=32))


def test_audio_only_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "a.m4a"
    with av.open(str(path), "w", format="mp4") as container:
        sound = container.add_stream("aac", rate=44100)
        sound.layout = "mono"
        samples = np.zeros((1, 1024), dtype="float32")
        chunk = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
        chunk.sample_rate, chunk.pts = 44100, 0
        container.mux(sound.encode(chunk))
        container.mux(sound.encode(None))
    with pytest.raises(MediaRejected, match="no video stream"):
        probe(path, MediaLimits())
