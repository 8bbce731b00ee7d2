"""Probe and render with PyAV. Blocking functions: the worker runs them in a thread.

``probe`` opens the container, requires a decodable video stream within the limits and reports
its metadata. ``render`` writes the published rendition, an MP4 with the ``moov`` atom first
(``movflags=faststart``) so playback starts before the download ends: H.264 video (+ AAC audio)
is remuxed without re-encoding; anything else is transcoded to H.264 (yuv420p, even
dimensions) and AAC.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av

from aivedio.media.errors import MediaRejected

__all__ = ["MediaLimits", "Probe", "probe", "render"]

_FASTSTART = {"movflags": "faststart"}
_REMUX_VIDEO = frozenset({"h264"})
_REMUX_AUDIO = frozenset({"aac"})


@dataclass(frozen=True, slots=True)
class MediaLimits:
    max_duration_s: float = 600.0
    max_width: int = 4096
    max_height: int = 4096


@dataclass(frozen=True, slots=True)
class Probe:
    format_name: str
    duration_s: float | None
    width: int
    height: int
    video_codec: str
    audio_codec: str | None
    size_bytes: int

    @property
    def remuxable(self) -> bool:
        return self.video_codec in _REMUX_VIDEO and self.audio_codec in (None, *_REMUX_AUDIO)


def probe(path: Path, limits: MediaLimits) -> Probe:
    """Metadata of a local media file; ``MediaRejected`` when it is not a video we accept."""
    try:
        with av.open(str(path), mode="r") as container:
            if not container.streams.video:
                raise MediaRejected("no video stream")
            video = container.streams.video[0]
            audio = container.streams.audio[0] if container.streams.audio else None
            width, height = video.codec_context.width, video.codec_context.height
            duration = _duration(container, video)
            _first_frame(container, video)
            result = Probe(
                format_name=container.format.name,
                duration_s=duration,
                width=width,
                height=height,
                video_codec=video.codec_context.name,
                audio_codec=audio.codec_context.name if audio is not None else None,
                size_bytes=path.stat().st_size,
            )
    except MediaRejected:
        raise
    except (av.FFmpegError, ValueError, IndexError, EOFError) as exc:
        raise MediaRejected(f"unreadable media: {type(exc).__name__}") from exc
    if not (0 < result.width <= limits.max_width and 0 < result.height <= limits.max_height):
        raise MediaRejected(f"unsupported dimensions {result.width}x{result.height}")
    if result.duration_s is not None and result.duration_s > limits.max_duration_s:
        raise MediaRejected(f"too long: {result.duration_s:.1f}s")
    return result


def _duration(container: Any, video: Any) -> float | None:
    if container.duration is not None:
        return float(container.duration / av.time_base)
    if video.duration is not None and video.time_base is not None:
        return float(video.duration * video.time_base)
    return None


def _first_frame(container: Any, video: Any) -> None:
    for _frame in container.decode(video):
        return
    raise MediaRejected("no decodable video frame")


def render(source: Path, target: Path, meta: Probe) -> str:
    """Write the rendition of ``source`` to ``target``; return ``"remux"`` or ``"transcode"``."""
    try:
        if meta.remuxable:
            _remux(source, target)
            return "remux"
        _transcode(source, target)
        return "transcode"
    except (av.FFmpegError, ValueError, EOFError) as exc:
        raise MediaRejected(f"cannot render: {type(exc).__name__}") from exc


def _remux(source: Path, target: Path) -> None:
    with (
        av.open(str(source), mode="r") as src,
        av.open(str(target), mode="w", format="mp4", options=_FASTSTART) as dst,
    ):
        inputs = [src.streams.video[0], *src.streams.audio[:1]]
        outputs = {s.index: dst.add_stream_from_template(s) for s in inputs}
        for packet in src.demux(inputs):
            if packet.dts is None:  # the demuxer's flush packet
                continue
            packet.stream = outputs[packet.stream.index]
            dst.mux(packet)


def _transcode(source: Path, target: Path) -> None:
    with (
        av.open(str(source), mode="r") as src,
        av.open(str(target), mode="w", format="mp4", options=_FASTSTART) as dst,
    ):
        v_in = src.streams.video[0]
        a_in = src.streams.audio[0] if src.streams.audio else None
        rate = v_in.average_rate or v_in.guessed_rate or 25
        v_out = dst.add_stream("libx264", rate=rate, options={"preset": "veryfast", "crf": "23"})
        width = v_in.codec_context.width - v_in.codec_context.width % 2
        height = v_in.codec_context.height - v_in.codec_context.height % 2
        v_out.width, v_out.height, v_out.pix_fmt = max(width, 2), max(height, 2), "yuv420p"
        a_out = None
        if a_in is not None:
            a_out = dst.add_stream("aac", rate=a_in.codec_context.sample_rate or 48000)
        streams = [v_in] if a_in is None else [v_in, a_in]
        for frame in src.decode(*streams):
            if isinstance(frame, av.VideoFrame):
                # reformat keeps pts and time_base; encode rescales them to the encoder's
                out = frame.reformat(width=v_out.width, height=v_out.height, format="yuv420p")
                dst.mux(v_out.encode(out))
            elif a_out is not None and isinstance(frame, av.AudioFrame):
                frame.pts = None
                dst.mux(a_out.encode(frame))
        dst.mux(v_out.encode(None))
        if a_out is not None:
            dst.mux(a_out.encode(None))
