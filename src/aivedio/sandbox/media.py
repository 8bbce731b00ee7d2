"""Outputs: one tiny real MP4 rendered once with PyAV, served at signed, expiring URLs.

A URL is ``{base}/files/{id}.mp4?exp=<unix>&sig=<base64url HMAC-SHA256 of "id.exp">``; after
``exp`` or with a wrong ``sig`` the file answers 403, so a media worker holding a stale URL has to
query the generation again for a fresh one.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import io
import math
from urllib.parse import urlencode

CONTENT_TYPE = "video/mp4"
WIDTH = HEIGHT = 64
FPS = 10
SECONDS = 1
CODECS = ("libx264", "mpeg4")


@functools.cache
def sample_mp4() -> bytes:
    """A 64x64, one-second MP4 (H.264, else MPEG-4 part 2) whose brightness ramps up."""
    import av  # only the sandbox needs PyAV; imported here so the package imports without it

    last_error: Exception | None = None
    for codec in CODECS:
        try:
            return _render(codec)
        except (av.FFmpegError, ValueError) as exc:  # codec missing from this FFmpeg build
            last_error = exc
    raise RuntimeError("no MP4 video encoder available in PyAV") from last_error


def _render(codec: str) -> bytes:
    import av as pyav

    buffer = io.BytesIO()
    with pyav.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream(codec, rate=FPS)
        if not isinstance(stream, pyav.VideoStream):
            raise ValueError(f"{codec} is not a video encoder")
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        for index in range(FPS * SECONDS):
            frame = pyav.VideoFrame(WIDTH, HEIGHT, "yuv420p")
            for plane, value in zip(frame.planes, (16 + index * 20, 128, 128), strict=True):
                plane.update(bytes([value]) * plane.buffer_size)
            frame.pts = index
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


class FileSigner:
    """Signs and checks the temporary file URLs of generation outputs."""

    def __init__(self, key: bytes, base_url: str) -> None:
        self._key = key
        self._base = base_url.rstrip("/")

    def _sig(self, generation_id: str, expires: int) -> str:
        mac = hmac.new(self._key, f"{generation_id}.{expires}".encode(), hashlib.sha256)
        return base64.urlsafe_b64encode(mac.digest()).decode().rstrip("=")

    def url(self, generation_id: str, expires_at: float) -> tuple[str, int]:
        expires = math.ceil(expires_at)
        query = urlencode({"exp": expires, "sig": self._sig(generation_id, expires)})
        return f"{self._base}/files/{generation_id}.mp4?{query}", expires

    def valid(self, generation_id: str, exp: str | None, sig: str | None, now: float) -> bool:
        if exp is None or sig is None or not exp.isdigit():
            return False
        expires = int(exp)
        if expires <= now:
            return False
        return hmac.compare_digest(self._sig(generation_id, expires), sig)
