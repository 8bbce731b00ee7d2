"""A Python client for the task API and the event stream (tests, benchmarks, scripts).

The stream is SSE by default, or the WebSocket endpoint with ``transport="ws"`` (the
``websockets`` package, imported only then); both yield the same ``Frame`` objects (a WebSocket
``task.status`` frame is flattened to the SSE data fields; ``raw`` keeps the JSON as received).

Snapshot first, then the stream from the snapshot's cursor; resume by cursor after any
disconnect; reconnect with full-jitter backoff; on ``event: reset`` re-read the snapshot. A task's
state is replaced only by a higher ``task_version`` and a seq already seen is ignored, so
duplicates and replays are harmless.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import httpx

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection


class StreamRefused(Exception):
    """The server refused the stream for good (400, 401, 403, 404): reconnecting cannot help."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"stream refused with HTTP {status}: {body}")
        self.status = status
        self.body = body


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame as received: ``event`` is ``task.status``, ``reset`` or ``close`` (WebSocket
    also ``start``, ``ack``, ``error``); ``id`` is the cursor of a ``task.status``/``reset``."""

    event: str
    id: str | None
    data: dict[str, Any]
    raw: dict[str, Any] | None = None  # a WebSocket frame's JSON, as received

    @property
    def seq(self) -> int | None:
        return int(self.id.rpartition("-")[2]) if self.id else None


@dataclass
class ProjectView:
    """What a client shows: the latest state of each task, the cursor to resume from."""

    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)
    cursor: str | None = None
    last_seq: int = 0

    def apply(self, payload: dict[str, Any]) -> bool:
        """Apply a snapshot or event payload if its version is higher; ``True`` if applied."""
        task_id = str(payload.get("task_id") or payload.get("id"))
        known = self.tasks.get(task_id)
        if known is not None and known["task_version"] >= payload["task_version"]:
            return False
        self.tasks[task_id] = {**(known or {}), **payload}
        return True


async def parse_sse(lines: AsyncIterator[str]) -> AsyncIterator[Frame]:
    """Frames from SSE lines (comments and ``retry:`` skipped)."""
    event: str = "message"
    event_id: str | None = None
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield Frame(event, event_id, json.loads("\n".join(data)))
            event, event_id, data = "message", None, []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            event = value
        elif name == "id":
            event_id = value
        elif name == "data":
            data.append(value)


def ws_to_frame(message: dict[str, Any]) -> Frame:
    """A WebSocket JSON frame as a ``Frame`` (``task.status`` flattened like SSE data)."""
    kind = str(message.get("type"))
    if kind == "task.status":
        data = {
            "event_id": message["event_id"],
            "task_id": message["task_id"],
            "task_version": message["task_version"],
            **message["payload"],
        }
        return Frame(kind, message["cursor"], data, message)
    return Frame(kind, message.get("cursor") if kind == "reset" else None, message, message)


def ws_close_frame(code: int, reason: str) -> Frame:
    """The server's close frame as an SSE-like ``close`` frame (4000-4499: reconnect)."""
    reconnect = 4000 <= code < 4500 or code in (1001, 1006, 1011, 1012, 1013)
    return Frame("close", None, {"code": code, "reason": reason, "reconnect": reconnect})


class Client:
    def __init__(
        self,
        base_url: str,
        api_key: str,
        project_id: uuid.UUID | str,
        *,
        use_stream_token: bool = False,
        transport: str = "sse",
        origin: str | None = None,
        backoff_base_s: float = 0.2,
        backoff_max_s: float = 10.0,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.project_id = str(project_id)
        self.api_key = api_key
        self.use_stream_token = use_stream_token
        if transport not in ("sse", "ws"):
            raise ValueError("transport is 'sse' or 'ws'")
        self.transport = transport
        self.origin = origin  # WebSocket: the Origin header to send (a browser's page origin)
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.http = http or httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(10.0))
        self.view = ProjectView()
        self.frames: list[Frame] = []  # every frame received, duplicates included
        self.connects = 0

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    async def aclose(self) -> None:
        await self.http.aclose()

    # -- REST --------------------------------------------------------------------------------

    async def create_task(self, prompt: str = "a cat", **body: Any) -> dict[str, Any]:
        payload = {"provider": "sandbox", "model": "m1", "prompt": prompt, "params": {}} | body
        response = await self.http.post(
            f"/v1/projects/{self.project_id}/tasks",
            json=payload,
            headers={**self.headers, "Idempotency-Key": uuid.uuid4().hex},
        )
        response.raise_for_status()
        task: dict[str, Any] = response.json()["task"]
        return task

    async def snapshot(self) -> None:
        """Read every task (all pages) and the project cursor, at one position per page."""
        page: str | None = None
        cursor: str | None = None
        while True:
            params = {"page": page} if page else {}
            response = await self.http.get(
                f"/v1/projects/{self.project_id}/tasks", params=params, headers=self.headers
            )
            response.raise_for_status()
            body = response.json()
            cursor = cursor or body["cursor"]  # the first page's position: replay covers the rest
            for task in body["tasks"]:
                self.view.apply(task)
            page = body.get("next_page")
            if not page:
                break
        self.view.cursor = cursor
        self.view.last_seq = max(self.view.last_seq, int(str(cursor).rpartition("-")[2]))

    async def stream_token(self) -> str:
        response = await self.http.post(
            "/v1/stream-tokens", json={"project_id": self.project_id}, headers=self.headers
        )
        response.raise_for_status()
        token: str = response.json()["token"]
        return token

    # -- stream ------------------------------------------------------------------------------

    async def connect_once(self, task_id: str | None = None) -> AsyncIterator[Frame]:
        """One connection from the current cursor; yields its frames until it ends."""
        if self.transport == "ws":
            async for frame in self._connect_ws(task_id):
                yield frame
            return
        params: dict[str, str] = {}
        headers: dict[str, str] = {"Accept": "text/event-stream"}
        if self.view.cursor:
            params["after"] = self.view.cursor
        if task_id:
            params["task_id"] = task_id
        if self.use_stream_token:
            params["token"] = await self.stream_token()
        else:
            headers |= self.headers
        url = f"/v1/projects/{self.project_id}/events"
        timeout = httpx.Timeout(10.0, read=None)
        async with self.http.stream(
            "GET", url, params=params, headers=headers, timeout=timeout
        ) as response:
            if response.status_code in (400, 401, 403, 404):
                raise StreamRefused(response.status_code, (await response.aread()).decode())
            response.raise_for_status()
            self.connects += 1
            async for frame in parse_sse(response.aiter_lines()):
                self.frames.append(frame)
                yield frame

    async def ws_target(self, task_id: str | None = None) -> tuple[str, dict[str, str]]:
        """The WebSocket URL (cursor, filter, token in the query) and headers to connect with."""
        params: dict[str, str] = {}
        headers: dict[str, str] = {}
        if self.view.cursor:
            params["after"] = self.view.cursor
        if task_id:
            params["task_id"] = task_id
        if self.use_stream_token:
            params["token"] = await self.stream_token()
        else:
            headers |= self.headers
        base = str(self.http.base_url).rstrip("/")
        base = "ws" + base.removeprefix("http")  # http -> ws, https -> wss
        query = f"?{urlencode(params)}" if params else ""
        return f"{base}/v1/projects/{self.project_id}/ws{query}", headers

    async def open_ws(self, task_id: str | None = None) -> ClientConnection:
        """An open WebSocket (no compression, 4 KiB frames out are plenty for commands)."""
        from websockets.asyncio.client import connect
        from websockets.exceptions import InvalidStatus
        from websockets.typing import Origin

        url, headers = await self.ws_target(task_id)
        try:
            return await connect(
                url,
                additional_headers=headers,
                origin=Origin(self.origin) if self.origin else None,
                compression=None,
                proxy=None,
                max_size=None,
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            if status in (400, 401, 403, 404):
                raise StreamRefused(status, exc.response.body.decode(errors="replace")) from exc
            raise

    async def _connect_ws(self, task_id: str | None) -> AsyncIterator[Frame]:
        from websockets.exceptions import ConnectionClosed

        ws = await self.open_ws(task_id)
        self.connects += 1
        try:
            async for message in ws:
                frame = ws_to_frame(json.loads(message))
                self.frames.append(frame)
                yield frame
        except ConnectionClosed:
            pass
        finally:
            await ws.close()
        received = ws.protocol.close_rcvd  # None: the socket ended without a close frame
        if received is not None:
            frame = ws_close_frame(received.code, received.reason)
            self.frames.append(frame)
            yield frame

    async def events(self, task_id: str | None = None) -> AsyncIterator[Frame]:
        """Frames applied to ``view``, across reconnects, for as long as the caller iterates."""
        if self.view.cursor is None:
            await self.snapshot()
        failures = 0
        while True:
            try:
                async for frame in self.connect_once(task_id):
                    failures = 0
                    if await self._handle(frame):
                        yield frame
                    if frame.event == "close" and not frame.data.get("reconnect", True):
                        raise StreamRefused(0, json.dumps(frame.data))
            except httpx.HTTPStatusError as exc:
                retry_after = exc.response.headers.get("retry-after")
                if retry_after and retry_after.isdigit():
                    await asyncio.sleep(float(retry_after))
            except (httpx.TransportError, httpx.StreamError, OSError):
                pass
            except Exception as exc:  # the websockets package's errors (imported lazily)
                if type(exc).__module__.split(".")[0] != "websockets":
                    raise
                response = getattr(exc, "response", None)
                retry_after = response.headers.get("Retry-After") if response else None
                if retry_after and retry_after.isdigit():
                    await asyncio.sleep(float(retry_after))
            failures += 1
            cap = min(self.backoff_max_s, self.backoff_base_s * 2 ** min(failures, 16))
            await asyncio.sleep(random.uniform(0, cap))  # full jitter

    async def _handle(self, frame: Frame) -> bool:
        if frame.event == "reset":
            self.view.cursor = frame.data["cursor"]
            self.view.last_seq = int(str(frame.data["cursor"]).rpartition("-")[2])
            await self.snapshot()  # the stream goes on from the reset cursor
            return True
        if frame.event != "task.status" or frame.seq is None:
            return frame.event == "close"
        if frame.seq <= self.view.last_seq:
            return False  # a duplicate
        self.view.last_seq = frame.seq
        self.view.cursor = frame.id
        self.view.apply(frame.data)
        return True
